"""Tiny HuggingFace transformer models with random weights, exported to ONNX by torch.

Test models for optfuse: each *family* is a transformers model class built **from a config**
(``Model._from_config``, never ``from_pretrained``: no hub access; ``HF_HUB_OFFLINE=1`` is set
when this module is imported) with seeded random weights, wrapped so that it takes positional
tensors and returns ``last_hidden_state``, and exported with either torch exporter:

- ``torchscript``: ``torch.onnx.export(..., dynamo=False)``, ``dynamic_axes``, opset 17 unless given;
- ``dynamo``: ``torch.onnx.export(..., dynamo=True)``, ``dynamic_shapes``, the exporter's default
  opset unless given (18+; a lower one goes through the ONNX version converter).

``attn`` selects transformers' attention implementation (``sdpa`` or ``eager``), which changes
the exported attention subgraph.

Every export returns an :class:`ExportedModel`: the ONNX path, the inputs (name, dtype, shape
with symbolic dims, value range ``[low, high)`` and kind: the fields of a recipe's ``inputs``),
the symbolic dims' ranges, and the **expected fusion counts** derived from the config (see
:func:`expected_counts`). A JSON sidecar (``<stem>.json``), the sample inputs
(``<stem>.inputs.npz``, one array per input name) and torch's outputs for them
(``<stem>.outputs.npz``) are written next to the model.

Nothing here imports torch or transformers at module level: listing families and reading a
sidecar work without them.

Layout (the public names below are all importable from ``optfuse.models``):

- :mod:`.families`: the family table (:data:`FAMILIES`, :class:`Family`), exporter / attention
  choices, reading a config;
- :mod:`.inputs`: :class:`InputInfo` / :class:`OutputInfo`, :func:`input_infos`, :func:`make_inputs`;
- :mod:`.facts`: config-derived :func:`dim_ranges`, :func:`expected_counts`, :func:`model_meta`;
- :mod:`.build`: :func:`build_model` (the wrapped torch module), :func:`torch_outputs`;
- :mod:`.exporters`: the TorchScript and dynamo ``torch.onnx.export`` calls, quieted, failures in one line;
- :mod:`.exporting`: :func:`export_model` / :func:`export` (build, sample, export, sidecars);
- :mod:`.record`: :class:`ExportedModel`, :class:`ExportError`, :func:`load_exported`;
- :mod:`.cache`: the on-disk export cache (:func:`cached_export`);
- :mod:`.decode`: decode graphs over a KV cache (``export_model(..., past=True)``: ``past_key_values``
  inputs, the updated cache as outputs; :data:`DECODE_FAMILIES`, :func:`decode_dims`).

Usage::

    from optfuse.models import export_model
    m = export_model("bert", "dynamo", "sdpa", "models/")
    m.path, m.inputs, m.counts
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from .build import build_model, torch_outputs, wrapper_class  # noqa: E402
from .cache import cache_disabled, cache_key, cached_export, default_cache_dir  # noqa: E402
from .decode import (  # noqa: E402
    DECODE_FAMILIES,
    build_decode_model,
    decode_dim_ranges,
    decode_dims,
    decode_input_infos,
    decode_output_infos,
    decode_torch_outputs,
    left_padded_mask,
)
from .exporters import export_dynamo, export_torchscript, quiet, summarize  # noqa: E402
from .exporting import default_stem, export, export_model, versions  # noqa: E402
from .facts import COUNT_KEYS, DEFAULT_MAX_SEQ, MAX_BATCH, dim_ranges, expected_counts, model_meta  # noqa: E402
from .families import (  # noqa: E402
    ATTNS,
    DEFAULT_TORCHSCRIPT_OPSET,
    EXPORTERS,
    FAMILIES,
    KNOWN_FAILURES,
    Attn,
    Exporter,
    Family,
)
from .inputs import DEFAULT_DIMS, InputInfo, OutputInfo, input_infos, make_inputs  # noqa: E402
from .record import ExportedModel, ExportError, load_exported  # noqa: E402

# The same functions under the names tests/test_heldout_families.py uses for its BART export.
_wrapper_class, _quiet = wrapper_class, quiet
_export_torchscript, _export_dynamo = export_torchscript, export_dynamo

__all__ = [
    "ATTNS", "COUNT_KEYS", "DECODE_FAMILIES", "DEFAULT_DIMS", "DEFAULT_MAX_SEQ", "DEFAULT_TORCHSCRIPT_OPSET",
    "EXPORTERS", "FAMILIES", "KNOWN_FAILURES", "MAX_BATCH", "Attn", "ExportError", "ExportedModel", "Exporter",
    "Family", "InputInfo", "OutputInfo", "build_decode_model", "build_model", "cache_disabled", "cache_key",
    "cached_export",
    "decode_dim_ranges", "decode_dims", "decode_input_infos", "decode_output_infos", "decode_torch_outputs",
    "default_cache_dir", "default_stem", "dim_ranges", "expected_counts", "export", "export_dynamo",
    "export_model", "export_torchscript", "input_infos", "left_padded_mask", "load_exported", "make_inputs",
    "model_meta", "quiet", "summarize", "torch_outputs", "versions", "wrapper_class",
]
