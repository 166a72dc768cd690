"""Exporting a family: build the torch model, run it on sample inputs, export, write the sidecars.

:func:`export_model` is the one entry point (:func:`export` writes to an exact path, for
``optfuse.pipeline``); its steps are named functions below: the reference run, the timed and
quieted exporter call (every failure one :class:`~optfuse.models.record.ExportError`), the
sample files and the :class:`~optfuse.models.record.ExportedModel` record.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from .build import build_model
from .decode import (
    SAMPLE_PAST,
    SAMPLE_SEQUENCE,
    build_decode_model,
    check_decode_family,
    decode_dim_ranges,
    decode_dims,
    decode_input_infos,
    decode_output_infos,
)
from .exporters import export_dynamo, export_torchscript, quiet, summarize
from .facts import dim_ranges, expected_counts, model_meta
from .families import ATTNS, DEFAULT_TORCHSCRIPT_OPSET, EXPORTERS, Attn, Exporter, check_choice, get_family
from .inputs import InputInfo, OutputInfo, input_infos, make_inputs
from .record import ExportedModel, ExportError, json_default, sidecar_path


def versions() -> dict[str, str]:
    """Versions that change what an export produces (also part of the cache key)."""
    import importlib.metadata

    out = {}
    for dist in ("torch", "transformers", "onnx", "onnxscript"):
        try:  # the installed distribution's version (its __version__), without importing it
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:  # missing: not part of the key
            out[dist] = "none"
    return out


def default_stem(family: str, exporter: str, attn: str, opset: int | None = None,
                 overrides: Mapping[str, Any] | None = None, past: bool = False) -> str:
    """``<family>_<exporter>_<attn>[_past][_opset<N>][_<hash of the overrides>]``."""
    stem = f"{family}_{exporter}_{attn}" + ("_past" if past else "")
    if opset is not None:
        stem += f"_opset{opset}"
    if overrides:
        stem += "_" + hashlib.sha256(json.dumps(dict(overrides), sort_keys=True, default=str).encode()).hexdigest()[:8]
    return stem


def export_model(
    family: str,
    exporter: Exporter = "dynamo",
    attn: Attn = "sdpa",
    out_dir: os.PathLike | str = "models",
    opset: int | None = None,
    *,
    seed: int = 0,
    name: str | None = None,
    optimize: bool = True,
    past: bool = False,
    **overrides: Any,
) -> ExportedModel:
    """Build ``family`` from its tiny config (plus ``overrides``: config fields) and export it.

    Writes ``<out_dir>/<name>.onnx`` (default name ``<family>_<exporter>_<attn>[_opset<N>][_<hash>]``)
    as a single file (no external data), plus the ``.json`` / ``.inputs.npz`` / ``.outputs.npz``
    sidecars. ``opset`` None means 17 for TorchScript and the dynamo exporter's default.
    ``optimize`` is the dynamo exporter's ``optimize`` flag (its default, True). ``past`` exports
    the decode graph over a KV cache (:mod:`.decode`: the families in ``DECODE_FAMILIES``).

    Raises :class:`ExportError` when the exporter fails (with the stage and the error's summary),
    ValueError for an unknown family/exporter/attn/config field.
    """
    import torch  # noqa: F401 - a missing torch fails here, before any argument check or folder

    get_family(family)
    check_choice("exporter", exporter, EXPORTERS)
    check_choice("attn", attn, ATTNS)
    if past:
        check_decode_family(family)
    job = _Job(family, exporter, attn, opset, seed, optimize, dict(overrides), past)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name or default_stem(family, exporter, attn, opset, overrides, past)}.onnx"

    if past:
        model = build_decode_model(family, attn, seed, **overrides)
        inputs = decode_input_infos(family, model.config)
        feeds = make_inputs(inputs, decode_dims(SAMPLE_SEQUENCE, SAMPLE_PAST), seed=seed)
    else:
        model = build_model(family, attn, seed, **overrides)
        inputs = input_infos(family, model.config)
        feeds = make_inputs(inputs, seed=seed)
    args, ref = _reference_run(model, inputs, feeds)
    outputs = decode_output_infos(family, model.config) if past else _output_infos(inputs, ref)
    wall, cpu = _run_exporter(job, model, args, path, inputs, outputs)
    opset_in_file = _file_opset(path)
    np.savez(sidecar_path(path, ".inputs.npz"), **feeds)
    refs = ref if isinstance(ref, tuple) else (ref,)
    np.savez(sidecar_path(path, ".outputs.npz"), **{o.name: r.numpy() for o, r in zip(outputs, refs)})
    result = _record(job, path, opset_in_file, model.config, inputs, outputs, wall, cpu)
    result.json_path.write_text(result.to_json())
    return result


def export(family: str, dest: os.PathLike | str, exporter: str = "dynamo", attn: str = "sdpa",
           opset: int | None = None, **kwargs: Any) -> Path:
    """Export to exactly ``dest`` (a ``.onnx`` path); for ``optfuse.pipeline``. Returns the path."""
    dest = Path(dest)
    name = dest.name[: -len(".onnx")] if dest.name.endswith(".onnx") else dest.name
    m = export_model(family, exporter, attn, dest.parent, opset, name=name, **kwargs)
    return m.path


@dataclass(frozen=True)
class _Job:
    """One export request, as :func:`export_model` was called."""

    family: str
    exporter: str
    attn: str
    opset: int | None
    seed: int
    optimize: bool
    overrides: dict[str, Any] = field(default_factory=dict)
    past: bool = False  # the decode graph over a KV cache


def _reference_run(model, inputs: list[InputInfo], feeds: Mapping[str, np.ndarray]):
    """The positional example tensors and torch's output for them."""
    import torch

    args = tuple(torch.from_numpy(feeds[i.name]) for i in inputs)
    with torch.no_grad():
        ref = model(*args)
    return args, ref


def _output_infos(inputs: list[InputInfo], ref) -> list[OutputInfo]:
    """``last_hidden_state``: batch (and sequence, for token models) symbolic, the rest as ``ref``."""
    out_dynamic = {0: "batch", 1: "sequence"} if "sequence" in inputs[0].shape else {0: "batch"}
    return [OutputInfo("last_hidden_state", "float32", [out_dynamic.get(a, int(s)) for a, s in enumerate(ref.shape)])]


def _run_exporter(job: _Job, model, args, path: Path, inputs: list[InputInfo],
                  outputs: list[OutputInfo]) -> tuple[float, float]:
    """Export ``model`` to ``path`` with ``job.exporter``; (wall, process CPU) seconds of the export.

    Every exporter failure becomes one :class:`ExportError` line.
    """
    import torch

    t0, c0 = time.perf_counter(), time.process_time()
    try:
        # no_grad matters for dynamo: with grad on, T5 + sdpa fails in the FX decomposition step
        # ("Cannot view a tensor with shape [B, S, 4, 16] and strides ... as [B, S, 64]", torch 2.13).
        with quiet(), torch.no_grad():
            if job.exporter == "torchscript":
                export_torchscript(model, args, path, inputs, outputs, job.opset or DEFAULT_TORCHSCRIPT_OPSET)
            else:
                dim_max = {k: v["max"] for k, v in _dim_ranges(job, model.config).items() if k != "batch"}
                export_dynamo(model, args, path, inputs, outputs, job.opset, job.optimize, dim_max)
    except ExportError:
        raise
    except Exception as exc:  # noqa: BLE001 - every exporter failure becomes one ExportError line
        raise ExportError(job.family, job.exporter, job.attn, summarize(exc)) from exc
    return time.perf_counter() - t0, time.process_time() - c0


def _file_opset(path: Path) -> int:
    """The default-domain opset the exported file imports (0 if none)."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    return int(next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0))


def _dim_ranges(job: _Job, config) -> dict[str, dict[str, int]]:
    return decode_dim_ranges(job.family, config) if job.past else dim_ranges(job.family, config)


def _record(job: _Job, path: Path, opset: int, config, inputs: list[InputInfo], outputs: list[OutputInfo],
            wall: float, cpu: float) -> ExportedModel:
    """The export's record: descriptions, config-derived facts, versions and timings."""
    return ExportedModel(
        path=path, family=job.family, exporter=job.exporter, attn=job.attn, opset=opset,
        inputs=inputs, outputs=outputs, counts=expected_counts(job.family, config),
        dims=_dim_ranges(job, config), meta={**model_meta(job.family, config), "kv_cache": job.past},
        config=json.loads(json.dumps(config.to_dict(), default=json_default)),
        seed=job.seed, overrides=dict(job.overrides), versions=versions(), past=job.past,
        export_seconds=round(wall, 3), export_cpu_seconds=round(cpu, 3),
    )
