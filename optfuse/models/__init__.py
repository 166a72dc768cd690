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

Usage::

    from optfuse.models import export_model
    m = export_model("bert", "dynamo", "sdpa", "models/")
    m.path, m.inputs, m.counts
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import numpy as np

from .model_families import EXPORT_FAMILIES

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

Exporter = Literal["torchscript", "dynamo"]
Attn = Literal["sdpa", "eager"]
EXPORTERS: tuple[str, ...] = ("torchscript", "dynamo")
ATTNS: tuple[str, ...] = ("sdpa", "eager")
DEFAULT_TORCHSCRIPT_OPSET = 17

#: Concrete values of the symbolic dims for the example inputs (export, samples, verify).
DEFAULT_DIMS: dict[str, int] = {"batch": 2, "sequence": 16}
#: Max batch declared in :attr:`ExportedModel.dims` (the graph itself has no limit).
MAX_BATCH = 8
#: Max sequence declared for models without a position table (T5: relative position buckets).
DEFAULT_MAX_SEQ = 128

#: Counts every family reports (keys of :attr:`ExportedModel.counts`).
COUNT_KEYS = ("layers", "attention", "mlp", "layer_norm", "skip_layer_norm", "embed_layer_norm",
              "rms_norm", "skip_rms_norm")


class ExportError(RuntimeError):
    """A torch exporter failed on a family; ``reason`` is one line naming the stage and the error."""

    def __init__(self, family: str, exporter: str, attn: str, reason: str):
        self.family, self.exporter, self.attn, self.reason = family, exporter, attn, reason
        super().__init__(f"{exporter} export of {family} (attn={attn}) failed: {reason}")


# ------------------------------------------------------------------------------------------------
# Descriptions
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class InputInfo:
    """One graph input. ``shape`` mixes ints and symbolic dim names; values lie in ``[low, high)``.

    ``kind`` is a recipe input kind: ``tokens`` (integers, uniform in the range), ``mask``
    (0/1, right-padded: ones then zeros per row) or ``float`` (uniform in the range).
    """

    name: str
    dtype: str
    shape: list[int | str]
    low: float
    high: float
    kind: Literal["tokens", "mask", "float"]
    doc: str = ""

    def concrete_shape(self, dims: Mapping[str, int] | None = None) -> list[int]:
        d = {**DEFAULT_DIMS, **(dims or {})}
        return [s if isinstance(s, int) else int(d[s]) for s in self.shape]

    def to_recipe(self) -> dict[str, Any]:
        """This input as a recipe ``inputs.<name>`` entry (dtype, shape, range, kind)."""
        return {"dtype": self.dtype, "shape": list(self.shape), "range": [self.low, self.high], "kind": self.kind}


@dataclass(frozen=True)
class OutputInfo:
    name: str
    dtype: str
    shape: list[int | str]


@dataclass
class ExportedModel:
    """What :func:`export_model` wrote, with everything a test or recipe needs to use it."""

    path: Path
    family: str
    exporter: str
    attn: str
    opset: int  # the default-domain opset in the file
    inputs: list[InputInfo]
    outputs: list[OutputInfo]
    counts: dict[str, int]
    dims: dict[str, dict[str, int]]  # symbolic dim -> {min, opt, max}
    meta: dict[str, Any]  # attention / norm / MLP facts: heads, kv heads, causal, activation, eps ...
    config: dict[str, Any]  # the transformers config, as config.to_dict()
    seed: int = 0
    overrides: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    export_seconds: float = 0.0  # wall time of torch.onnx.export
    export_cpu_seconds: float = 0.0  # process CPU time of torch.onnx.export (all threads)

    @property
    def sample_inputs_path(self) -> Path:
        return _sidecar(self.path, ".inputs.npz")

    @property
    def sample_outputs_path(self) -> Path:
        return _sidecar(self.path, ".outputs.npz")

    @property
    def json_path(self) -> Path:
        return _sidecar(self.path, ".json")

    def input(self, name: str) -> InputInfo:
        for i in self.inputs:
            if i.name == name:
                return i
        raise KeyError(name)

    def make_inputs(self, dims: Mapping[str, int] | None = None, seed: int = 0) -> dict[str, np.ndarray]:
        """Random inputs in the declared ranges (see :func:`make_inputs`)."""
        return make_inputs(self.inputs, dims, seed)

    def sample(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """The inputs used at export time and torch's outputs for them."""
        with np.load(self.sample_inputs_path) as i, np.load(self.sample_outputs_path) as o:
            return {k: i[k] for k in i.files}, {k: o[k] for k in o.files}

    def torch_outputs(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Rebuild the torch model (same seed and overrides) and run it on ``feeds`` (needs torch)."""
        return torch_outputs(self.family, self.attn, feeds, seed=self.seed, **self.overrides)

    def recipe_inputs(self) -> dict[str, dict[str, Any]]:
        """The ``inputs`` section of a recipe for this model."""
        return {i.name: i.to_recipe() for i in self.inputs}

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["path"] = str(self.path)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=_json_default)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ExportedModel:
        d = dict(d)
        d["path"] = Path(d["path"])
        d["inputs"] = [InputInfo(**i) for i in d["inputs"]]
        d["outputs"] = [OutputInfo(**o) for o in d["outputs"]]
        return cls(**d)


def load_exported(json_path: os.PathLike | str) -> ExportedModel:
    """Read a ``<stem>.json`` sidecar; the model path is taken relative to the sidecar's folder."""
    json_path = Path(json_path)
    d = json.loads(json_path.read_text())
    m = ExportedModel.from_dict(d)
    m.path = json_path.parent / m.path.name
    return m


# ------------------------------------------------------------------------------------------------
# Families
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Family:
    name: str
    description: str
    config_class: str  # in transformers
    model_class: str  # in transformers; built with ``_from_config(config, attn_implementation=...)``
    defaults: dict[str, Any]  # config kwargs for the tiny model
    inputs: tuple[str, ...]  # forward() argument names, in graph-input order
    norm: Literal["layer_norm", "rms_norm"]
    causal: bool
    position: Literal["absolute", "rotary", "relative_bias"] = "absolute"
    scaled: bool = True  # attention scores scaled by 1/sqrt(head_dim) (T5: no)
    call_kwargs: dict[str, Any] = field(default_factory=dict)  # extra forward() kwargs
    notes: str = ""

    def config(self, **overrides: Any):
        """The transformers config (defaults + overrides); unknown keys are an error."""
        import transformers

        cls = getattr(transformers, self.config_class)
        base = cls()
        known = set(base.to_dict()) | set(getattr(cls, "attribute_map", {}) or {})
        unknown = sorted(k for k in overrides if k not in known and not hasattr(base, k))
        if unknown:
            raise ValueError(f"unknown {self.config_class} field(s) for family {self.name!r}: {', '.join(unknown)}")
        return cls(**{**self.defaults, **overrides})


_TEXT = dict(vocab_size=1000, max_position_embeddings=128)

# Every family's head dim is 32: the smallest FlashAttention supports (spec limits.head_dims), so
# attention fuses on the default models.

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "bert", "BERT encoder (post-LN, GELU-erf MLP, padding mask, token types)",
            "BertConfig", "BertModel",
            dict(_TEXT, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                 type_vocab_size=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
            ("input_ids", "attention_mask", "token_type_ids"), "layer_norm", causal=False,
        ),
        Family(
            "gpt2", "GPT-2 decoder without KV cache (pre-LN, Conv1D/Gemm projections, GELU-tanh MLP, causal + padding mask)",
            "GPT2Config", "GPT2Model",
            dict(vocab_size=1000, n_positions=128, n_embd=64, n_layer=2, n_head=2, n_inner=128, use_cache=False,
                 bos_token_id=0, eos_token_id=0,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
            ("input_ids", "attention_mask"), "layer_norm", causal=True, call_kwargs={"use_cache": False},
        ),
        Family(
            "vit", "ViT image encoder (patch Conv, CLS token, pre-LN, GELU-erf MLP, no mask)",
            "ViTConfig", "ViTModel",
            dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                 image_size=32, patch_size=8, num_channels=3, hidden_dropout_prob=0.0,
                 attention_probs_dropout_prob=0.0),
            ("pixel_values",), "layer_norm", causal=False,
        ),
        Family(
            "llama", "LLaMA decoder without KV cache (RMSNorm, RoPE, GQA: 4 query / 2 KV heads, SwiGLU MLP, causal + padding mask)",
            "LlamaConfig", "LlamaModel",
            dict(_TEXT, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, use_cache=False),
            ("input_ids", "attention_mask"), "rms_norm", causal=True, position="rotary",
            call_kwargs={"use_cache": False},
        ),
        Family(
            "t5", "T5 encoder (T5EncoderModel: RMS-style T5LayerNorm, relative position bias, ReLU MLP, padding mask)",
            "T5Config", "T5EncoderModel",
            dict(vocab_size=1000, d_model=64, d_kv=32, d_ff=128, num_layers=2, num_heads=2, use_cache=False,
                 dropout_rate=0.0, relative_attention_num_buckets=32, relative_attention_max_distance=128),
            ("input_ids", "attention_mask"), "rms_norm", causal=False, position="relative_bias", scaled=False,
            notes="attention scores get a float position bias (+ mask) before Softmax and are not scaled by 1/sqrt(d)",
        ),
    )
}

if tuple(FAMILIES) != EXPORT_FAMILIES:  # the recipe schema validates family names against that list
    raise ImportError(f"optfuse.models defines the families {tuple(FAMILIES)}, but optfuse.model_families "
                      f"lists {EXPORT_FAMILIES}: keep the two in step")

#: (family, exporter, attn) -> why that export is known to fail with the pinned torch/transformers.
#: Tests and the fixtures skip these with the reason instead of exporting.
KNOWN_FAILURES: dict[tuple[str, str, str], str] = {}


def _family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}") from None


def _check_choice(what: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}; expected one of: {', '.join(choices)}")


# ------------------------------------------------------------------------------------------------
# Inputs, dims and counts (from the config)
# ------------------------------------------------------------------------------------------------
def _cfg(config: Any, key: str) -> Any:
    return config[key] if isinstance(config, Mapping) else getattr(config, key)


def input_infos(family: str, config: Any) -> list[InputInfo]:
    """The graph inputs of a family's model with this config."""
    fam = _family(family)
    infos = []
    for name in fam.inputs:
        if name == "input_ids":
            vocab = int(_cfg(config, "vocab_size"))
            infos.append(InputInfo(name, "int64", ["batch", "sequence"], 0, vocab, "tokens", "token ids"))
        elif name == "token_type_ids":
            n = int(_cfg(config, "type_vocab_size"))
            infos.append(InputInfo(name, "int64", ["batch", "sequence"], 0, n, "tokens", "segment ids"))
        elif name == "attention_mask":
            infos.append(InputInfo(name, "int64", ["batch", "sequence"], 0, 2, "mask",
                                   "1 = attend, 0 = padding (right-padded)"))
        elif name == "pixel_values":
            c, s = int(_cfg(config, "num_channels")), int(_cfg(config, "image_size"))
            infos.append(InputInfo(name, "float32", ["batch", c, s, s], -1.0, 1.0, "float", "normalized image"))
        else:  # pragma: no cover - a family naming an input this table lacks
            raise AssertionError(f"no input description for {name!r}")
    return infos


def dim_ranges(family: str, config: Any) -> dict[str, dict[str, int]]:
    """Recipe ``dims``: min/opt/max of each symbolic dim (opt = the example inputs' value)."""
    fam = _family(family)
    dims = {"batch": {"min": 1, "opt": DEFAULT_DIMS["batch"], "max": MAX_BATCH}}
    if "input_ids" in fam.inputs:
        # The position table's size; relative-position models (T5) have none: declare DEFAULT_MAX_SEQ.
        max_seq = next((int(_cfg(config, k)) for k in ("max_position_embeddings", "n_positions") if _has(config, k)),
                       DEFAULT_MAX_SEQ)
        dims["sequence"] = {"min": 1, "opt": DEFAULT_DIMS["sequence"], "max": max_seq}
    return dims


def expected_counts(family: str, config: Any) -> dict[str, int]:
    """How many of each fusable structure the model holds, from its config (L = num_hidden_layers).

    - ``attention``: self-attention blocks, one per layer (L); the exported graph has one Softmax each.
    - ``mlp``: feed-forward blocks (L).
    - ``layer_norm``: every ``nn.LayerNorm`` (one LayerNormalization node each at opset >= 17):
      BERT 2L + 1 (two per layer, post-LN, plus the embedding LayerNorm), GPT-2 and ViT 2L + 1
      (two per layer, pre-LN, plus the final ln_f / layernorm).
    - ``skip_layer_norm``: the LayerNorms whose input is a residual add ``x + sublayer(x)`` of two
      full ``[batch, seq, hidden]`` tensors: 2L in all three (BERT: both per layer; GPT-2/ViT: the
      second of layer 0, both of later layers and the final one).
    - ``embed_layer_norm``: the one LayerNorm fed by the embedding sum instead (BERT: word + position
      + token type; GPT-2: wte + wpe; ViT: patches + position), where the added position table is
      broadcast over the batch. ``skip_layer_norm + embed_layer_norm == layer_norm``.
    - ``rms_norm`` / ``skip_rms_norm``: the same for RMS norms (LLaMA ``LlamaRMSNorm``, T5
      ``T5LayerNorm``; decomposed into Pow/ReduceMean/Add/Sqrt/.../Mul, one ReduceMean each): 2L + 1,
      of which 2L follow a residual add; the first norm of layer 0 reads the embedding Gather directly.
    """
    fam = _family(family)
    n = int(_cfg(config, "num_hidden_layers"))
    counts = dict.fromkeys(COUNT_KEYS, 0)
    counts.update(layers=n, attention=n, mlp=n)
    if fam.norm == "layer_norm":
        counts.update(layer_norm=2 * n + 1, skip_layer_norm=2 * n, embed_layer_norm=1)
    else:
        counts.update(rms_norm=2 * n + 1, skip_rms_norm=2 * n)
    return counts


def model_meta(family: str, config: Any) -> dict[str, Any]:
    """Facts a fusion test may check: heads, KV heads, head dim, causal, activation, norm eps."""
    fam = _family(family)
    g = lambda *keys: next((_cfg(config, k) for k in keys if _has(config, k)), None)  # noqa: E731
    hidden = int(g("hidden_size"))
    heads = int(g("num_attention_heads"))
    kv = g("num_key_value_heads")
    head_dim = g("head_dim", "d_kv") or hidden // heads
    return {
        "hidden_size": hidden,
        "num_heads": heads,
        "num_kv_heads": int(kv) if kv is not None else heads,
        "head_dim": int(head_dim),
        "causal": fam.causal,
        "position": fam.position,
        "attention_scale": (1.0 / float(head_dim) ** 0.5) if fam.scaled else 1.0,
        "attention_mask": "attention_mask" in fam.inputs,
        "norm": fam.norm,
        # None where the config has no such field (OPT, DistilBERT: eps fixed in the modeling code)
        "norm_eps": _float_or_none(g("layer_norm_eps", "layer_norm_epsilon", "rms_norm_eps")),
        "activation": str(g("hidden_act", "activation_function", "feed_forward_proj", "activation")),
        "intermediate_size": int(g("intermediate_size", "n_inner", "d_ff", "ffn_dim", "hidden_dim")),
        "description": fam.description,
        "notes": fam.notes,
    }


def _float_or_none(v: Any) -> float | None:
    return None if v is None else float(v)


def _has(config: Any, key: str) -> bool:
    if isinstance(config, Mapping):
        return config.get(key) is not None
    return getattr(config, key, None) is not None


def make_inputs(inputs: Sequence[InputInfo], dims: Mapping[str, int] | None = None,
                seed: int = 0) -> dict[str, np.ndarray]:
    """Random feeds in the declared ranges. Masks: row 0 all ones, row 1 right-padded to about half,
    later rows random lengths >= 1 (so padding paths run but no query row is fully masked)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for info in inputs:
        shape = info.concrete_shape(dims)
        if info.kind == "mask":
            arr = np.ones(shape, dtype=info.dtype)
            rows, length = arr.reshape(-1, shape[-1]), shape[-1]
            for r in range(1, rows.shape[0]):
                keep = max(1, length // 2) if r == 1 else int(rng.integers(1, length + 1))
                rows[r, keep:] = 0
        elif info.kind == "tokens":
            arr = rng.integers(int(info.low), int(info.high), size=shape).astype(info.dtype)
        else:
            arr = rng.uniform(info.low, info.high, size=shape).astype(info.dtype)
        feeds[info.name] = arr
    return feeds


# ------------------------------------------------------------------------------------------------
# Building and running the torch model
# ------------------------------------------------------------------------------------------------
def _wrapper_class():
    import torch

    class Wrapped(torch.nn.Module):
        """Positional tensors in, ``last_hidden_state`` out (one graph output)."""

        def __init__(self, model, input_names, call_kwargs):
            super().__init__()
            self.model = model
            self.input_names = tuple(input_names)
            self.call_kwargs = dict(call_kwargs)

        def forward(self, *args):
            out = self.model(**dict(zip(self.input_names, args)), **self.call_kwargs)
            return out.last_hidden_state

    return Wrapped


def build_model(family: str, attn: str = "sdpa", seed: int = 0, **overrides: Any):
    """The wrapped torch module (eval mode, float32, weights from ``torch.manual_seed(seed)``).

    The caller's torch RNG state is left as it was. The returned module has ``.config``.
    """
    import torch
    import transformers

    fam = _family(family)
    _check_choice("attn", attn, ATTNS)
    config = fam.config(**overrides)
    cls = getattr(transformers, fam.model_class)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls._from_config(config, attn_implementation=attn)
    got = model.config._attn_implementation
    if got != attn:
        raise RuntimeError(f"{fam.model_class} runs attn_implementation={got!r}, not the requested {attn!r}")
    wrapped = _wrapper_class()(model.eval(), fam.inputs, fam.call_kwargs).eval()
    wrapped.config = model.config
    return wrapped


def torch_outputs(family: str, attn: str, feeds: Mapping[str, np.ndarray], seed: int = 0,
                  model=None, **overrides: Any) -> dict[str, np.ndarray]:
    """Run the torch model (rebuilt from family/attn/seed/overrides unless given) on NumPy feeds."""
    import torch

    fam = _family(family)
    if model is None:
        model = build_model(family, attn, seed, **overrides)
    args = tuple(torch.from_numpy(np.ascontiguousarray(feeds[n])) for n in fam.inputs)
    with torch.no_grad():
        out = model(*args)
    return {"last_hidden_state": out.detach().cpu().numpy()}


# ------------------------------------------------------------------------------------------------
# Export
# ------------------------------------------------------------------------------------------------
def versions() -> dict[str, str]:
    """Versions that change what an export produces (also part of the cache key)."""
    out = {}
    for mod in ("torch", "transformers", "onnx", "onnxscript"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - missing or broken: not part of the key
            out[mod] = "none"
    return out


def default_stem(family: str, exporter: str, attn: str, opset: int | None = None,
                 overrides: Mapping[str, Any] | None = None) -> str:
    stem = f"{family}_{exporter}_{attn}"
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
    **overrides: Any,
) -> ExportedModel:
    """Build ``family`` from its tiny config (plus ``overrides``: config fields) and export it.

    Writes ``<out_dir>/<name>.onnx`` (default name ``<family>_<exporter>_<attn>[_opset<N>][_<hash>]``)
    as a single file (no external data), plus the ``.json`` / ``.inputs.npz`` / ``.outputs.npz``
    sidecars. ``opset`` None means 17 for TorchScript and the dynamo exporter's default.
    ``optimize`` is the dynamo exporter's ``optimize`` flag (its default, True).

    Raises :class:`ExportError` when the exporter fails (with the stage and the error's summary),
    ValueError for an unknown family/exporter/attn/config field.
    """
    import torch

    fam = _family(family)
    _check_choice("exporter", exporter, EXPORTERS)
    _check_choice("attn", attn, ATTNS)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name or default_stem(family, exporter, attn, opset, overrides)}.onnx"

    model = build_model(family, attn, seed, **overrides)
    config = model.config
    inputs = input_infos(family, config)
    feeds = make_inputs(inputs, seed=seed)
    args = tuple(torch.from_numpy(feeds[i.name]) for i in inputs)
    with torch.no_grad():
        ref = model(*args)
    out_dynamic = {0: "batch", 1: "sequence"} if "sequence" in inputs[0].shape else {0: "batch"}
    outputs = [OutputInfo("last_hidden_state", "float32",
                          [out_dynamic.get(a, int(s)) for a, s in enumerate(ref.shape)])]

    t0, c0 = time.perf_counter(), time.process_time()
    try:
        # no_grad matters for dynamo: with grad on, T5 + sdpa fails in the FX decomposition step
        # ("Cannot view a tensor with shape [B, S, 4, 16] and strides ... as [B, S, 64]", torch 2.13).
        with _quiet(), torch.no_grad():
            if exporter == "torchscript":
                _export_torchscript(model, args, path, inputs, outputs, opset or DEFAULT_TORCHSCRIPT_OPSET)
            else:
                dim_max = {k: v["max"] for k, v in dim_ranges(family, config).items() if k != "batch"}
                _export_dynamo(model, args, path, inputs, outputs, opset, optimize, dim_max)
    except ExportError:
        raise
    except Exception as exc:  # noqa: BLE001 - every exporter failure becomes one ExportError line
        raise ExportError(family, exporter, attn, _summarize(exc)) from exc
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0

    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    file_opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    np.savez(_sidecar(path, ".inputs.npz"), **feeds)
    np.savez(_sidecar(path, ".outputs.npz"), last_hidden_state=ref.numpy())
    result = ExportedModel(
        path=path, family=family, exporter=exporter, attn=attn, opset=int(file_opset),
        inputs=inputs, outputs=outputs, counts=expected_counts(family, config),
        dims=dim_ranges(family, config), meta=model_meta(family, config),
        config=json.loads(json.dumps(config.to_dict(), default=_json_default)),
        seed=seed, overrides=dict(overrides), versions=versions(),
        export_seconds=round(wall, 3), export_cpu_seconds=round(cpu, 3),
    )
    result.json_path.write_text(result.to_json())
    return result


def export(family: str, dest: os.PathLike | str, exporter: str = "dynamo", attn: str = "sdpa",
           opset: int | None = None, **kwargs: Any) -> Path:
    """Export to exactly ``dest`` (a ``.onnx`` path); for ``optfuse.pipeline``. Returns the path."""
    dest = Path(dest)
    name = dest.name[: -len(".onnx")] if dest.name.endswith(".onnx") else dest.name
    m = export_model(family, exporter, attn, dest.parent, opset, name=name, **kwargs)
    return m.path


def _export_torchscript(model, args, path: Path, inputs, outputs, opset: int) -> None:
    import torch

    dynamic_axes = {}
    for info in [*inputs, *outputs]:
        axes = {a: s for a, s in enumerate(info.shape) if isinstance(s, str)}
        if axes:
            dynamic_axes[info.name] = axes
    torch.onnx.export(
        model, args, str(path), dynamo=False, opset_version=opset,
        input_names=[i.name for i in inputs], output_names=[o.name for o in outputs],
        dynamic_axes=dynamic_axes, do_constant_folding=True,
    )


def _export_dynamo(model, args, path: Path, inputs, outputs, opset: int | None, optimize: bool,
                   dim_max: Mapping[str, int]) -> None:
    import torch
    from torch.export import Dim

    # One Dim per symbol, shared by every input that has it. The sequence Dim needs its max (the
    # position table's size): without it torch.export raises a constraint violation, and the ONNX
    # exporter silently exports a second time with the suggested fix (twice the time).
    dims: dict[str, Any] = {}
    specs = []
    for info in inputs:
        axes = {}
        for a, s in enumerate(info.shape):
            if isinstance(s, str):
                if s not in dims:
                    dims[s] = Dim(s, max=dim_max[s]) if s in dim_max else Dim(s)
                axes[a] = dims[s]
        specs.append(axes or None)
    torch.onnx.export(
        model, args, str(path), dynamo=True, opset_version=opset,
        input_names=[i.name for i in inputs], output_names=[o.name for o in outputs],
        dynamic_shapes=(tuple(specs),), external_data=False, optimize=optimize, verbose=False,
    )


@contextlib.contextmanager
def _quiet():
    """Silence the exporters' tracer/deprecation warnings and progress prints (stdout)."""
    import io
    import logging

    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._export")]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for lg, lv in zip(loggers, levels):
                lg.setLevel(lv)


def _summarize(exc: BaseException) -> str:
    """One line: the exporter's stage (if it says) and the innermost error's first line."""
    text = str(exc)
    stage = re.search(r"This is step (\d)/3", text)
    prefix = ""
    if stage:
        prefix = {"1": "torch.export (step 1/3): ", "2": "FX decomposition (step 2/3): ",
                  "3": "ONNX translation (step 3/3): "}.get(stage.group(1), "")
    summary = re.search(r"## Exception summary\s*\n\s*(.+)", text)
    if summary:
        line = summary.group(1)
    else:
        inner = exc
        while inner.__cause__ is not None:
            inner = inner.__cause__
        line = f"{type(inner).__name__}: {str(inner).strip().splitlines()[0] if str(inner).strip() else ''}"
    line = re.sub(r"\x1b\[[0-9;]*m", "", line).strip()
    return prefix + (line[:400] + " ..." if len(line) > 400 else line)


def _sidecar(path: Path, suffix: str) -> Path:
    path = Path(path)
    stem = path.name[: -len(".onnx")] if path.name.endswith(".onnx") else path.name
    return path.with_name(stem + suffix)


def _json_default(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, (np.integer, np.floating)):
        return o.item()
    if hasattr(o, "to_dict"):
        return o.to_dict()
    return str(o)


# ------------------------------------------------------------------------------------------------
# On-disk cache (tests, recipes)
# ------------------------------------------------------------------------------------------------
def default_cache_dir() -> Path:
    """``$OPTFUSE_MODEL_CACHE`` if set, else ``~/.cache/optfuse/models``."""
    env = os.environ.get("OPTFUSE_MODEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "optfuse" / "models"


def cache_key(family: str, exporter: str, attn: str, opset: int | None = None, seed: int = 0,
              **overrides: Any) -> str:
    """Stable key over the request, the torch/transformers/onnx/onnxscript versions and this file's source."""
    src = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    blob = json.dumps({"family": family, "exporter": exporter, "attn": attn, "opset": opset, "seed": seed,
                       "overrides": overrides, "versions": versions(), "src": src},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cached_export(family: str, exporter: Exporter = "dynamo", attn: Attn = "sdpa", opset: int | None = None,
                  cache_dir: os.PathLike | str | None = None, seed: int = 0, **overrides: Any) -> ExportedModel:
    """:func:`export_model` into ``<cache_dir>/<family>-<exporter>-<attn>-<key>/``, reused when present.

    Exporter failures are cached too (``failed.txt``) and raised again as :class:`ExportError`.
    Concurrent callers (pytest-xdist) each export into a temp folder and rename it into place.
    """
    _family(family)
    _check_choice("exporter", exporter, EXPORTERS)
    _check_choice("attn", attn, ATTNS)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = cache_key(family, exporter, attn, opset, seed, **overrides)
    final = root / f"{family}-{exporter}-{attn}{'' if opset is None else f'-opset{opset}'}-{key}"
    stem = default_stem(family, exporter, attn, opset)
    found = _from_cache(final, stem, family, exporter, attn)
    if found is not None:
        return found
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        try:
            export_model(family, exporter, attn, tmp, opset, seed=seed, name=stem, **overrides)
        except ExportError as exc:
            (tmp / "failed.txt").write_text(exc.reason)
            _publish(tmp, final)
            raise
        _publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    found = _from_cache(final, stem, family, exporter, attn)
    assert found is not None, f"cache folder {final} is incomplete"
    return found


def _from_cache(folder: Path, stem: str, family: str, exporter: str, attn: str) -> ExportedModel | None:
    failed = folder / "failed.txt"
    if failed.is_file():
        raise ExportError(family, exporter, attn, failed.read_text().strip() + f" (cached in {folder})")
    js = folder / f"{stem}.json"
    if js.is_file() and (folder / f"{stem}.onnx").is_file():
        return load_exported(js)
    return None


def _publish(tmp: Path, final: Path) -> None:
    try:
        os.rename(tmp, final)
    except OSError:  # another process got there first (or a stale partial folder: replace it)
        if not ((final / "failed.txt").exists() or any(final.glob("*.json"))):
            shutil.rmtree(final, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.rename(tmp, final)
