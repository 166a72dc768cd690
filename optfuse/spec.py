"""The fused-op contract: one `plugins/<folder>/spec.yaml` per optfuse op.

A spec says everything the rest of optfuse needs to know about an op, once:
its name and version, ordered inputs/outputs with their dtypes, typed attributes,
shape rules and limits. The rewrite stage writes nodes from it, the TensorRT stage
generates plugins from it, the plugin's launch and reference code read their op names,
dtypes, limits and attribute defaults from it, and ``tests/test_contracts.py`` checks the
code against it.

The reader needs only pyyaml (plugin launch/reference code and the GPU tests import it where
pydantic is not installed); validation is strict all the same: unknown keys, wrong types,
unknown dtype or attribute type names, duplicate names or ops, an output ``like`` naming no
input, a default of the wrong type and a bad ``dtype_from`` rule are a :class:`SpecError` naming
the file and the field.

An output's dtype is that of the input it is ``like``, or, with ``dtype_from: <attribute>``, the
value of that string attribute: each of its choices is one of the output's dtypes or
``like_input`` (:data:`LIKE_INPUT`: the ``like`` input's dtype). :meth:`OpSpec.output_dtype`
applies the rule; both TensorRT plugin forms and the contract test call it. An optional input
with ``with_dtypes: [...]`` is present exactly when the first input has one of those dtypes (the
GEMM's FP8 scales: ``[float8e4m3fn]``); :meth:`OpSpec.presence_error` checks a node against it.
An output with ``quantized_by: <input>`` (an optional float32 input, its scale) is float8e4m3fn
exactly when that input is present (the norms' FP8 output: ``y_scale``), else it follows its other
rules.

``fp8_speedup`` (ops with an FP8 first input) lists where the op's FP8 form was timed against its
16-bit kernel: per (arch, head dim, bias forms), the kernel the FP8 form runs there, the lowest and highest
speedup over the shapes timed, the GPU and the results file (:class:`Fp8Speedup`; the precision
stage puts a node in FP8 only where that is known to pay, :meth:`OpSpec.fp8_speedup_at`).

Plugin folders are imported as the package ``optfuse_plugins.<folder>`` (see
:mod:`optfuse.plugin_dirs`), so kernels, references and launch code live next to the spec.

Over 500 lines: one reader for every field of the contract, each field's type next to its checks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

from . import DOMAIN
from .plugin_dirs import PLUGINS_DIR, plugin_module  # noqa: F401  (re-exported)
from .target import arch_name, parse_arch

DTYPES = ("float32", "float16", "bfloat16", "float8e4m3fn", "int32", "int64", "bool")
#: Dtypes computed in (and stored as) floating point wide enough for every op's math.
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
#: 8-bit floats (E4M3, no infinities, max 448: ONNX's FLOAT8E4M3FN): GEMM operands that come with
#: float32 scales; an op's output only through a ``quantized_by`` rule (with its scale input).
FP8_DTYPES = ("float8e4m3fn",)
#: The ``dtype_from`` attribute value meaning "the dtype of the input the output is ``like``".
LIKE_INPUT = "like_input"
ATTR_TYPES = ("float", "int", "string", "floats", "ints")
#: The kernels an op's FP8 form runs (an ``fp8_speedup`` entry names one), as reports call them.
FP8_KERNELS = {"cuda": "the CUDA kernel's FP8 path", "triton": "the Triton FP8 branch"}
#: The forms of an attention bias an ``fp8_speedup`` entry can cover (the kernels take each form
#: differently): none (absent, or one broadcast value), key_padding ([B|1, 1, 1, Sk]), other.
BIAS_FORMS = ("none", "key_padding", "other")


class SpecError(ValueError):
    """A spec.yaml that does not follow the schema (the message names the file and the field)."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtypes: tuple[str, ...]
    optional: bool = False
    # Output shape/dtype rule: the output has the shape and dtype of this input ...
    like: str | None = None
    # ... except its last dim, which is dim `axis` of input `input` (a GEMM's [..., K] x [N, K]
    # gives [..., N]): (input name, axis), or None.
    last_dim: tuple[str, int] | None = None
    # ... and its dtype is the value of this string attribute (LIKE_INPUT: the ``like`` input's)
    dtype_from: str | None = None
    # An optional input present exactly when the first input has one of these dtypes (empty: any)
    with_dtypes: tuple[str, ...] = ()
    # An output that is float8e4m3fn exactly when this optional float32 input (its scale) is present
    quantized_by: str | None = None
    doc: str = ""


@dataclass(frozen=True)
class AttrSpec:
    name: str
    type: str
    default: Any = None
    # string attributes: the values a node may carry (empty: any)
    choices: tuple[str, ...] = ()
    doc: str = ""


@dataclass(frozen=True)
class Fp8Speedup:
    """The op's FP8 form timed against its 16-bit kernel on one target and head dim: the kernel
    the FP8 form runs there and the speedup (16-bit time / FP8 time), lowest and highest over the
    shapes timed. FP8 pays there when even the lowest is above 1."""

    arch: int  # compute capability (sm_90: 90)
    head_dim: int
    bias: tuple[str, ...]  # the BIAS_FORMS the entry covers
    kernel: str  # a key of FP8_KERNELS: what launch.py picks for the FP8 form there
    speedup: tuple[float, float]  # (lowest, highest)
    against: str  # the 16-bit dtype of the kernel timed against (bfloat16)
    device: str  # the GPU it was timed on (H200)
    results: str  # the raw rows, relative to the plugin folder
    doc: str = ""

    @property
    def pays(self) -> bool:
        return self.speedup[0] > 1.0

    def describe(self, what: str, bias: str = "none") -> str:
        """For a node of bias form `bias`, e.g. ``FP8 attention at head dim 64 on sm_90 runs the
        Triton FP8 branch, 0.71-0.94x the bf16 kernel (H200)``; the entry's doc joins the brackets."""
        short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(self.against, self.against)
        form = "" if bias == "none" else f" with a {bias.replace('_', '-')} bias"
        note = f"; {self.doc}" if self.doc else ""
        return (f"FP8 {what} at head dim {self.head_dim}{form} on {arch_name(self.arch)} runs {FP8_KERNELS[self.kernel]}, "
                f"{self.speedup[0]:.2f}-{self.speedup[1]:.2f}x the {short} kernel ({self.device}{note})")


@dataclass(frozen=True)
class OpSpec:
    op: str
    folder: str
    doc: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    attributes: tuple[AttrSpec, ...] = ()
    domain: str = DOMAIN
    version: int = 1
    # Limits of the kernel contract (e.g. max_hidden, head_dims); fusions consult them before
    # matching, launch code enforces them.
    limits: dict[str, Any] = field(default_factory=dict)
    # Where the FP8 form was timed against the 16-bit kernel, per (arch, head dim, bias forms)
    fp8_speedup: tuple[Fp8Speedup, ...] = ()

    @property
    def plugin_version(self) -> str:
        return str(self.version)

    def attr(self, name: str) -> AttrSpec:
        for a in self.attributes:
            if a.name == name:
                return a
        raise KeyError(f"{self.op} has no attribute {name!r}")

    def input_index(self, name: str) -> int:
        return [t.name for t in self.inputs].index(name)

    def output_shape(self, j: int, shapes: list[Any]) -> list[Any]:
        """Output ``j``'s shape from the inputs' shapes (spec order, dims of any type): that of the
        input it is ``like``, the last dim replaced where it has a ``last_dim`` rule."""
        out = self.outputs[j]
        if out.like is None:
            raise ValueError(f"{self.op}: output {out.name!r} has no shape rule")
        dims = list(shapes[self.input_index(out.like)])
        if out.last_dim is not None:
            name, axis = out.last_dim
            dims[-1] = list(shapes[self.input_index(name)])[axis]
        return dims

    def output_dtype(self, j: int, dtypes: Sequence[str | None], attrs: dict | None = None) -> str:
        """Output ``j``'s dtype from the inputs' dtypes (spec order, None for an absent one) and the
        node's attributes (a left-out one takes the spec default): the ``dtype_from`` attribute's
        value, or the ``like`` input's dtype (``like_input``, or no ``dtype_from`` rule). Raises
        ValueError where that is not one of the output's dtypes (GEMM: an FP8 A with ``like_input``)."""
        out = self.outputs[j]
        if out.quantized_by is not None:
            i = self.input_index(out.quantized_by)
            if i < len(dtypes) and dtypes[i] is not None:
                return next(d for d in out.dtypes if d in FP8_DTYPES)
        value = LIKE_INPUT
        if out.dtype_from is not None:
            got = (attrs or {}).get(out.dtype_from)
            value = self.attr(out.dtype_from).default if got is None else got
            value = value.decode() if isinstance(value, bytes) else str(value)
            if value not in self.attr(out.dtype_from).choices:
                raise ValueError(f"{self.op}: {out.dtype_from} {value!r} is not one of "
                                 f"{', '.join(self.attr(out.dtype_from).choices)}")
        if value == LIKE_INPUT:
            if out.like is None:
                raise ValueError(f"{self.op}: output {out.name!r} has no dtype rule")
            value = dtypes[self.input_index(out.like)]
            if value is None:
                raise ValueError(f"{self.op}: input {out.like!r} (whose dtype output {out.name!r} takes) is absent")
        if value not in out.dtypes:
            why = f" ({out.dtype_from} {LIKE_INPUT}: the dtype of {out.like})" if out.dtype_from else ""
            raise ValueError(f"{self.op}: output {out.name!r} would be {value}{why}, not one of {', '.join(out.dtypes)}")
        return value

    def presence_error(self, dtypes: Sequence[str | None]) -> str | None:
        """Why inputs of these dtypes (spec order, None: absent) break a ``with_dtypes`` rule, or None."""
        first = dtypes[0] if dtypes else None
        for i, t in enumerate(self.inputs):
            if not t.with_dtypes or first is None:
                continue
            present = i < len(dtypes) and dtypes[i] is not None
            if present != (first in t.with_dtypes):
                return (f"{self.op}: input {t.name!r} is {'present' if present else 'absent'} with "
                        f"{self.inputs[0].name} {first}; it comes exactly with {', '.join(t.with_dtypes)}")
        return None

    def defaults(self) -> dict[str, Any]:
        """The attributes that have a default, with it (spec order)."""
        return {a.name: a.default for a in self.attributes if a.default is not None}

    def fp8_speedup_at(self, arch: int | None, head_dim: int | None, bias: str = "none") -> Fp8Speedup | None:
        """The ``fp8_speedup`` entry of this target, head dim and bias form (BIAS_FORMS), or None
        (not timed there, or the target or head dim unknown)."""
        return next((m for m in self.fp8_speedup if (m.arch, m.head_dim) == (arch, head_dim) and bias in m.bias), None)


# -- validation --------------------------------------------------------------------------------
_OP_KEYS = {"op": True, "doc": True, "inputs": True, "outputs": True, "attributes": False, "domain": False,
            "version": False, "limits": False, "fp8_speedup": False}
_TENSOR_KEYS = {"name": True, "dtypes": True, "optional": False, "like": False, "last_dim": False,
                "dtype_from": False, "with_dtypes": False, "quantized_by": False, "doc": False}
_LAST_DIM_KEYS = {"input": True, "axis": True}
_ATTR_KEYS = {"name": True, "type": True, "default": False, "choices": False, "doc": False}
_FP8_SPEEDUP_KEYS = {"arch": True, "head_dim": True, "bias": True, "kernel": True, "speedup": True, "against": True,
                     "device": True, "results": True, "doc": False}


def _fail(where: str, what: str) -> None:
    raise SpecError(f"{where}: {what}")


def _mapping(raw: Any, keys: dict[str, bool], where: str) -> dict:
    if not isinstance(raw, dict):
        _fail(where, f"expected a mapping, got {type(raw).__name__}")
    unknown = [k for k in raw if k not in keys]
    if unknown:
        _fail(where, f"unknown key {unknown[0]!r} (allowed: {', '.join(keys)})")
    missing = [k for k, required in keys.items() if required and k not in raw]
    if missing:
        _fail(where, f"missing required key {missing[0]!r}")
    return raw


def _typed(value: Any, types: type | tuple[type, ...], where: str) -> Any:
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        _fail(where, f"expected {_type_names(types)}, got bool")
    if not isinstance(value, types):
        _fail(where, f"expected {_type_names(types)}, got {type(value).__name__} {value!r}")
    return value


def _type_names(types) -> str:
    return " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))


def _names_unique(items, where: str) -> None:
    seen: set[str] = set()
    for i, it in enumerate(items):
        if it.name in seen:
            _fail(f"{where}[{i}].name", f"duplicate name {it.name!r}")
        seen.add(it.name)


def _tensor(raw: Any, where: str) -> TensorSpec:
    raw = _mapping(raw, _TENSOR_KEYS, where)
    dtypes = _typed(raw["dtypes"], list, f"{where}.dtypes")
    if not dtypes:
        _fail(f"{where}.dtypes", "needs at least one dtype")
    for j, d in enumerate(dtypes):
        if d not in DTYPES:
            _fail(f"{where}.dtypes[{j}]", f"unknown dtype {d!r} (known: {', '.join(DTYPES)})")
    like = raw.get("like")
    last_dim = None
    if raw.get("last_dim") is not None:
        ld = _mapping(raw["last_dim"], _LAST_DIM_KEYS, f"{where}.last_dim")
        last_dim = (_typed(ld["input"], str, f"{where}.last_dim.input"), _typed(ld["axis"], int, f"{where}.last_dim.axis"))
        if like is None:
            _fail(f"{where}.last_dim", "needs a 'like' rule (the other dims and the dtype)")
    return TensorSpec(
        name=_typed(raw["name"], str, f"{where}.name"),
        dtypes=tuple(dtypes),
        optional=_typed(raw.get("optional", False), bool, f"{where}.optional"),
        like=None if like is None else _typed(like, str, f"{where}.like"),
        last_dim=last_dim,
        dtype_from=None if raw.get("dtype_from") is None else _typed(raw["dtype_from"], str, f"{where}.dtype_from"),
        quantized_by=None if raw.get("quantized_by") is None else _typed(raw["quantized_by"], str,
                                                                         f"{where}.quantized_by"),
        with_dtypes=tuple(_typed(d, str, f"{where}.with_dtypes[{j}]")
                          for j, d in enumerate(_typed(raw.get("with_dtypes", []), list, f"{where}.with_dtypes"))),
        doc=_typed(raw.get("doc", ""), str, f"{where}.doc"),
    )


def _default(kind: str, value: Any, where: str) -> Any:
    if value is None:
        return None
    if kind == "float":
        return float(_typed(value, (float, int), where))
    if kind == "int":
        return _typed(value, int, where)
    if kind == "string":
        return _typed(value, str, where)
    items = _typed(value, list, where)
    scalar = (float, int) if kind == "floats" else int
    return tuple((float if kind == "floats" else int)(_typed(v, scalar, f"{where}[{j}]")) for j, v in enumerate(items))


def _attr(raw: Any, where: str) -> AttrSpec:
    raw = _mapping(raw, _ATTR_KEYS, where)
    kind = _typed(raw["type"], str, f"{where}.type")
    if kind not in ATTR_TYPES:
        _fail(f"{where}.type", f"unknown attribute type {kind!r} (known: {', '.join(ATTR_TYPES)})")
    choices = tuple(_typed(c, str, f"{where}.choices[{j}]")
                    for j, c in enumerate(_typed(raw.get("choices", []), list, f"{where}.choices")))
    if choices and kind != "string":
        _fail(f"{where}.choices", f"only string attributes take choices (type is {kind})")
    default = _default(kind, raw.get("default"), f"{where}.default")
    if choices and default is not None and default not in choices:
        _fail(f"{where}.default", f"{default!r} is not one of the choices ({', '.join(choices)})")
    return AttrSpec(
        name=_typed(raw["name"], str, f"{where}.name"),
        type=kind,
        default=default,
        choices=choices,
        doc=_typed(raw.get("doc", ""), str, f"{where}.doc"),
    )


def _limits(raw: Any, where: str) -> dict[str, Any]:
    raw = _typed(raw, dict, where)
    for k, v in raw.items():
        _typed(k, str, f"{where} key")
        for j, item in enumerate(v if isinstance(v, list) else [v]):
            _typed(item, (int, float), f"{where}.{k}" + (f"[{j}]" if isinstance(v, list) else ""))
    return dict(raw)


def _fp8_speedup(raw: Any, limits: dict[str, Any], where: str) -> Fp8Speedup:
    raw = _mapping(raw, _FP8_SPEEDUP_KEYS, where)
    try:
        arch = parse_arch(_typed(raw["arch"], str, f"{where}.arch"))
    except ValueError as exc:
        _fail(f"{where}.arch", str(exc))
    head_dim = _typed(raw["head_dim"], int, f"{where}.head_dim")
    if "head_dims" in limits and head_dim not in limits["head_dims"]:
        _fail(f"{where}.head_dim", f"{head_dim} is not one of the op's head_dims ({limits['head_dims']})")
    bias = tuple(_typed(raw["bias"], list, f"{where}.bias"))
    for j, b in enumerate(bias):
        if b not in BIAS_FORMS:
            _fail(f"{where}.bias[{j}]", f"unknown bias form {b!r} (known: {', '.join(BIAS_FORMS)})")
    if not bias or len(set(bias)) != len(bias):
        _fail(f"{where}.bias", f"expected distinct bias forms, got {list(bias)!r}")
    kernel = _typed(raw["kernel"], str, f"{where}.kernel")
    if kernel not in FP8_KERNELS:
        _fail(f"{where}.kernel", f"unknown kernel {kernel!r} (known: {', '.join(FP8_KERNELS)})")
    speedup = _typed(raw["speedup"], list, f"{where}.speedup")
    if len(speedup) != 2:
        _fail(f"{where}.speedup", f"expected [lowest, highest], got {speedup!r}")
    lo, hi = (float(_typed(x, (int, float), f"{where}.speedup[{j}]")) for j, x in enumerate(speedup))
    if not 0 < lo <= hi:
        _fail(f"{where}.speedup", f"expected 0 < lowest <= highest, got {speedup!r}")
    against = _typed(raw["against"], str, f"{where}.against")
    if against not in FLOAT_DTYPES:
        _fail(f"{where}.against", f"{against!r} is not one of {', '.join(FLOAT_DTYPES)}")
    return Fp8Speedup(arch=arch, head_dim=head_dim, bias=bias, kernel=kernel, speedup=(lo, hi), against=against,
                      device=_typed(raw["device"], str, f"{where}.device"),
                      results=_typed(raw["results"], str, f"{where}.results"),
                      doc=_typed(raw.get("doc", ""), str, f"{where}.doc"))


def _check_dtype_from(out: TensorSpec, attributes: tuple[AttrSpec, ...], where: str) -> None:
    """``dtype_from`` names a string attribute with a default and choices, each one of the output's
    dtypes or ``like_input`` (which needs a ``like`` rule)."""
    attr = next((a for a in attributes if a.name == out.dtype_from), None)
    if attr is None:
        _fail(where, f"{out.dtype_from!r} names no attribute (attributes: {', '.join(a.name for a in attributes) or 'none'})")
    if attr.type != "string" or not attr.choices or attr.default is None:
        _fail(where, f"attribute {attr.name!r} must be a string with choices and a default")
    for c in attr.choices:
        if c != LIKE_INPUT and c not in out.dtypes:
            _fail(where, f"choice {c!r} of {attr.name!r} is neither {LIKE_INPUT!r} nor one of the output's dtypes "
                         f"({', '.join(out.dtypes)})")
    if LIKE_INPUT in attr.choices and out.like is None:
        _fail(where, f"choice {LIKE_INPUT!r} of {attr.name!r} needs a 'like' rule")


def _check_quantized_by(out: TensorSpec, inputs: tuple[TensorSpec, ...], where: str) -> None:
    """``quantized_by`` names an optional float32 input, and the output lists exactly one FP8 dtype."""
    scale = next((t for t in inputs if t.name == out.quantized_by), None)
    if scale is None:
        _fail(where, f"{out.quantized_by!r} names no input (inputs: {', '.join(t.name for t in inputs)})")
    if not scale.optional or scale.dtypes != ("float32",):
        _fail(where, f"input {scale.name!r} must be optional and float32 (the scale)")
    if sum(d in FP8_DTYPES for d in out.dtypes) != 1:
        _fail(where, f"the output must list exactly one of {', '.join(FP8_DTYPES)}")


def parse_spec(raw: Any, folder: str, where: str) -> OpSpec:
    """One spec document (a YAML mapping) as an :class:`OpSpec`; ``where`` prefixes every error
    (e.g. ``plugins/layer_norm/spec.yaml, document 2``)."""
    if isinstance(raw, dict) and isinstance(raw.get("op"), str):
        where = f"{where} (op {raw['op']})"
    raw = _mapping(raw, _OP_KEYS, where)
    op = _typed(raw["op"], str, f"{where}: op")
    inputs = tuple(_tensor(t, f"{where}: inputs[{i}]") for i, t in enumerate(_typed(raw["inputs"], list, f"{where}: inputs")))
    outputs = tuple(_tensor(t, f"{where}: outputs[{i}]")
                    for i, t in enumerate(_typed(raw["outputs"], list, f"{where}: outputs")))
    attributes = tuple(_attr(a, f"{where}: attributes[{i}]")
                       for i, a in enumerate(_typed(raw.get("attributes", []), list, f"{where}: attributes")))
    if not inputs:
        _fail(f"{where}: inputs", "an op needs at least one input")
    if not outputs:
        _fail(f"{where}: outputs", "an op needs at least one output")
    _names_unique(inputs, f"{where}: inputs")
    _names_unique(outputs, f"{where}: outputs")
    _names_unique(attributes, f"{where}: attributes")
    in_names = [t.name for t in inputs]
    for i, t in enumerate(inputs):
        for key in ("like", "dtype_from", "quantized_by"):
            if getattr(t, key) is not None:
                _fail(f"{where}: inputs[{i}].{key}", f"only outputs take a {key!r} rule")
    for i, t in enumerate(outputs):
        if t.like is not None and t.like not in in_names:
            _fail(f"{where}: outputs[{i}].like", f"{t.like!r} names no input (inputs: {', '.join(in_names)})")
        if t.last_dim is not None and t.last_dim[0] not in in_names:
            _fail(f"{where}: outputs[{i}].last_dim.input", f"{t.last_dim[0]!r} names no input (inputs: {', '.join(in_names)})")
    for i, t in enumerate(outputs):
        if t.dtype_from is not None:
            _check_dtype_from(t, attributes, f"{where}: outputs[{i}].dtype_from")
        if t.with_dtypes:
            _fail(f"{where}: outputs[{i}].with_dtypes", "only optional inputs take a 'with_dtypes' rule")
        if t.quantized_by is not None:
            _check_quantized_by(t, inputs, f"{where}: outputs[{i}].quantized_by")
    for i, t in enumerate(inputs):
        for j, d in enumerate(t.with_dtypes):
            if not t.optional or i == 0:
                _fail(f"{where}: inputs[{i}].with_dtypes", "only optional inputs after the first take a 'with_dtypes' rule")
            if d not in inputs[0].dtypes:
                _fail(f"{where}: inputs[{i}].with_dtypes[{j}]", f"{d!r} is not a dtype of {inputs[0].name} "
                                                                f"({', '.join(inputs[0].dtypes)})")
    reserved = [a.name for a in attributes if a.name in ("plugin_namespace", "plugin_version")]
    if reserved:
        _fail(f"{where}: attributes", f"{reserved[0]!r} is set by optfuse on every node, not declared")
    version = _typed(raw.get("version", 1), int, f"{where}: version")
    if version < 1:
        _fail(f"{where}: version", f"must be >= 1, got {version}")
    limits = _limits(raw.get("limits", {}), f"{where}: limits")
    fp8_speedup = tuple(_fp8_speedup(m, limits, f"{where}: fp8_speedup[{i}]")
                        for i, m in enumerate(_typed(raw.get("fp8_speedup", []), list, f"{where}: fp8_speedup")))
    if fp8_speedup and not any(d in FP8_DTYPES for d in inputs[0].dtypes):
        _fail(f"{where}: fp8_speedup", f"{op} has no FP8 form ({inputs[0].name} lists no {', '.join(FP8_DTYPES)})")
    seen: set[tuple[int, int, str]] = set()
    for i, m in enumerate(fp8_speedup):
        for b in m.bias:
            if (m.arch, m.head_dim, b) in seen:
                _fail(f"{where}: fp8_speedup[{i}]", f"{arch_name(m.arch)}, head dim {m.head_dim}, bias {b} listed twice")
            seen.add((m.arch, m.head_dim, b))
    return OpSpec(
        op=op, folder=folder, doc=_typed(raw["doc"], str, f"{where}: doc"), inputs=inputs, outputs=outputs,
        attributes=attributes, domain=_typed(raw.get("domain", DOMAIN), str, f"{where}: domain"), version=version,
        limits=limits, fp8_speedup=fp8_speedup,
    )


def read_specs(paths) -> dict[str, OpSpec]:
    """The specs of the given spec.yaml files, keyed by op (an op defined twice is an error)."""
    specs: dict[str, OpSpec] = {}
    for path in paths:
        path = Path(path)
        label = _label(path)
        try:
            docs = list(yaml.safe_load_all(path.read_text()))
        except yaml.YAMLError as exc:
            raise SpecError(f"{label}: not valid YAML: {exc}") from None
        for n, raw in enumerate(docs, 1):
            spec = parse_spec(raw, path.parent.name, f"{label}, document {n}" if len(docs) > 1 else label)
            if spec.op in specs:
                raise SpecError(f"{label}: op {spec.op} defined twice (also in plugins/{specs[spec.op].folder})")
            specs[spec.op] = spec
    return specs


def _label(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(PLUGINS_DIR.parent))
    except ValueError:
        return str(path)


@functools.cache
def load_specs() -> dict[str, OpSpec]:
    """All op specs, keyed by op name (discovered from plugins/*/spec.yaml)."""
    return read_specs(sorted(PLUGINS_DIR.glob("*/spec.yaml")))


def get_spec(op: str) -> OpSpec:
    try:
        return load_specs()[op]
    except KeyError:
        raise KeyError(f"unknown optfuse op {op!r}; known: {sorted(load_specs())}") from None


def plugin_specs(file: str | Path) -> dict[str, OpSpec]:
    """The specs of the plugin folder holding ``file`` (call it with ``__file__`` from a plugin's
    launch.py or reference.py), keyed by op in spec order."""
    folder = Path(file).resolve().parent.name
    specs = {op: s for op, s in load_specs().items() if s.folder == folder}
    if not specs:
        raise KeyError(f"plugins/{folder} has no spec.yaml")
    return specs


def plugin_spec(file: str | Path, op: str | None = None) -> OpSpec:
    """The spec of op ``op`` of the plugin folder holding ``file`` (``__file__``), or, without
    ``op``, of the folder's one op."""
    specs = plugin_specs(file)
    if op is None:
        if len(specs) != 1:
            raise KeyError(f"plugins/{Path(file).resolve().parent.name} holds {', '.join(specs)}: name the op")
        return next(iter(specs.values()))
    if op not in specs:
        raise KeyError(f"plugins/{Path(file).resolve().parent.name} has no op {op!r} (ops: {', '.join(specs)})")
    return specs[op]


def shared(specs: dict[str, OpSpec], fact: Callable[[OpSpec], Any], what: str) -> Any:
    """The one value of ``fact`` that every spec of a folder shares (e.g. the dtypes or the
    max_hidden a launch.py serves for a whole op family); a folder whose ops differ is an error
    naming them, so module-level constants never hide a per-op difference."""
    values = {op: fact(s) for op, s in specs.items()}
    first = next(iter(values.values()))
    if any(v != first for v in values.values()):
        raise SpecError(f"ops {', '.join(values)} differ in {what} ({values}); read it per op")
    return first
