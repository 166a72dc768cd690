"""Contract tests: every op's spec.yaml against the code of its plugin folder (CPU only).

Parametrized over ``load_specs()``, so a new op is covered as soon as its spec exists. Per op:

* spec vs ONNX function (``reference.onnx_function(op, opset)``): domain and name, input and
  output names in order, the spec's attributes (those with a default carry it, the others are
  set by the node) plus ``plugin_namespace`` / ``plugin_version`` with the spec's domain and
  version;
* spec vs launch (``launch.py``): it serves the spec's op and every spec dtype and rejects other
  ops; with every input present its kernel takes the spec's input and output counts; attributes
  left out take the spec's defaults (``launch.DTYPES``, one tuple or a dict per op, equals the
  spec's dtypes); every limit holds exactly (``max_hidden``:
  ``max_hidden`` builds, one more does not; ``head_dims`` / ``block_sizes``: exactly those build; ``k_multiple`` /
  ``n_multiple``: an odd multiple of the value builds, one more does not; ``max_k``: the value
  builds, the next multiple does not); a launch constant
  named after a limit (``MAX_HIDDEN``, ``HEAD_DIMS``) equals it, and a kernel's own narrower one
  (``<KERNEL>_HEAD_DIMS``, ``<KERNEL>_MAX_HIDDEN``) lies within it;
* spec vs NumPy reference: the ONNX function on a one-node model in onnxruntime matches
  ``reference.reference`` in fp32 on ``reference.sample_inputs`` (optional inputs present and
  absent; an absent one is what the fused node carries, ``reference.ABSENT_INPUTS`` in y's dtype,
  or no input), with the spec's attribute defaults, and y has the spec's dtype
  (``OpSpec.output_dtype``).

Ops whose first input lists an FP8 dtype are also checked on ``sample_inputs(op, rng, dtype=<fp8>)``
(FP8 operands, their scales, the attributes the case needs): launch builds it, and from opset 19
(ONNX's float8 types) the function matches the reference. A reference with ``function_overload`` /
``function_overloads`` (one function per variant, ONNX ``overload``) has every variant checked
against the spec; an FP8 variant below opset 19 is refused with a ValueError.

An op's ``fp8_speedup`` entries (where its FP8 form was timed against the 16-bit kernel) are checked
against their results file (that arch and GPU; the lowest and highest speedup over the rows of that
head dim, to 2 decimals, from the FP8 column of the kernel the entry names against its 16-bit
dtype) and against ``launch.py`` (at that arch and head dim, with each bias form the entry covers,
causal or not, the FP8 form builds the kernel the entry names and the 16-bit form the CUDA kernel the
rows were timed against): a new kernel choice or new numbers mean the entry is re-measured.

Each check raises :class:`ContractError`; ``test_contract_checks_catch_a_broken_spec`` shows each
one failing on a deliberately broken copy of the spec (renamed input, output or attribute, dropped
output, wrong default, wrong version, changed limit, dropped dtype, dropped output dtype rule, dropped
``quantized_by`` rule, changed FP8 speedup or kernel). An output with a ``quantized_by`` rule (the norms' FP8 y) is checked with
its scale present (from opset 19: the ``fp8`` function variant, FP8 bits compared) and absent. A spec limit with no check
here fails the launch check: add its check to ``LIMIT_CHECKS``.

Over 500 lines: every check and the broken-spec cases that prove each one fails stay in one file.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import helper

import json

from optfuse.functions import PLUGIN_ATTRIBUTES
from optfuse.spec import FP8_DTYPES, PLUGINS_DIR, OpSpec, load_specs, plugin_module
from optfuse.trt import glue

SPECS = load_specs()
OPS = sorted(SPECS)
OPSETS = (17, 18, 19)  # ReduceMean's axes move from attribute to input at 18; float8 types from 19
FP8_OPSET = 19
RTOL, ATOL = 1e-5, 1e-5  # fp32 onnxruntime vs the float64 NumPy reference rounded to fp32


class ContractError(AssertionError):
    """A spec field and the code disagree."""


def _expect(ok: bool, spec: OpSpec, what: str) -> None:
    if not ok:
        raise ContractError(f"{spec.op} (plugins/{spec.folder}): {what}")


# -- spec vs ONNX function ----------------------------------------------------------------------
_ONNX_ATTR_TYPE = {"float": onnx.AttributeProto.FLOAT, "int": onnx.AttributeProto.INT,
                   "string": onnx.AttributeProto.STRING, "floats": onnx.AttributeProto.FLOATS,
                   "ints": onnx.AttributeProto.INTS}


def _same_value(kind: str, got, want) -> bool:
    if kind == "float":
        return np.float32(got) == np.float32(want)
    if kind == "floats":
        return list(np.float32(got)) == list(np.float32(want))
    if kind == "string":
        return got == (want.encode() if isinstance(want, str) else want)
    return list(got) == list(want) if kind == "ints" else got == want


def check_function(spec: OpSpec, fn: onnx.FunctionProto) -> None:
    _expect((fn.domain, fn.name) == (spec.domain, spec.op), spec, f"function is {fn.domain}::{fn.name}")
    want_in, want_out = [t.name for t in spec.inputs], [t.name for t in spec.outputs]
    _expect(list(fn.input) == want_in, spec, f"function inputs {list(fn.input)} != spec inputs {want_in}")
    _expect(list(fn.output) == want_out, spec, f"function outputs {list(fn.output)} != spec outputs {want_out}")
    protos = {a.name: a for a in fn.attribute_proto}
    names = set(fn.attribute) | set(protos)
    want = {a.name for a in spec.attributes} | set(PLUGIN_ATTRIBUTES)
    _expect(names == want, spec, f"function attributes {sorted(names)} != spec attributes + plugin ones {sorted(want)}")
    for a in spec.attributes:
        if a.default is None:
            _expect(a.name in fn.attribute, spec, f"attribute {a.name!r} has no spec default, but the function gives one")
            continue
        p = protos.get(a.name)
        _expect(p is not None, spec, f"attribute {a.name!r}: the function has no default (spec: {a.default!r})")
        _expect(p.type == _ONNX_ATTR_TYPE[a.type], spec, f"attribute {a.name!r}: function type {p.type}, spec {a.type}")
        got = helper.get_attribute_value(p)
        _expect(_same_value(a.type, got, a.default), spec,
                f"attribute {a.name!r}: function default {got!r} != spec default {a.default!r}")
    for name, value in (("plugin_namespace", spec.domain), ("plugin_version", spec.plugin_version)):
        p = protos.get(name)
        got = None if p is None else p.s.decode()
        _expect(got == value, spec, f"function {name} default {got!r} != the spec's {value!r}")


# -- spec vs launch -----------------------------------------------------------------------------
def _fp8_dtypes(spec: OpSpec) -> list[str]:
    return [d for d in spec.inputs[0].dtypes if d in FP8_DTYPES]


def _sample(spec: OpSpec, seed: int = 0, dtype: str = "float32") -> tuple[list, dict]:
    """``sample_inputs`` (float32, or an FP8 case: ``dtype=``), checked: one entry per spec input
    (None: absent); float32 sets exactly the attributes without a default, an FP8 case may add
    others it needs (``output_dtype``)."""
    reference = plugin_module(spec.folder, "reference")
    rng = np.random.default_rng(seed)
    inputs, attrs = reference.sample_inputs(spec.op, rng) if dtype == "float32" else \
        reference.sample_inputs(spec.op, rng, dtype=dtype)
    _expect(len(inputs) == len(spec.inputs), spec,
            f"sample_inputs gives {len(inputs)} inputs, the spec has {len(spec.inputs)}")
    required = {a.name for a in spec.attributes if a.default is None}
    if dtype == "float32":
        _expect(set(attrs) == required, spec,
                f"sample_inputs sets attributes {sorted(attrs)}, the spec's without a default are {sorted(required)}")
    else:
        _expect(required <= set(attrs) <= {a.name for a in spec.attributes}, spec,
                f"sample_inputs({dtype}) sets attributes {sorted(attrs)}: not the spec's, or missing {sorted(required)}")
    return inputs, attrs


def _dtype_name(x) -> str | None:
    if x is None:
        return None
    name = np.asarray(x).dtype.name
    return {"float8_e4m3fn": "float8e4m3fn"}.get(name, name)


def _cases(spec: OpSpec) -> list[tuple[str, list, dict, list]]:
    """(A's dtype, inputs, attributes the case sets, input dtypes) per launch case: the float32
    sample at every non-FP8 dtype of the first input (every present input of that dtype), and each
    FP8 sample with its own dtypes."""
    inputs, attrs = _sample(spec)
    out = [(dt, inputs, attrs, [None if x is None else dt for x in inputs])
           for dt in spec.inputs[0].dtypes if dt not in FP8_DTYPES]
    for dt in _fp8_dtypes(spec):
        ins, at = _sample(spec, dtype=dt)
        out.append((dt, ins, at, [_dtype_name(x) for x in ins]))
    return out


def _static(spec: OpSpec, inputs, dtypes, **override) -> dict:
    if isinstance(dtypes, str):
        dtypes = [None if x is None else dtypes for x in inputs]
    static = glue.static_shape(spec, [None if x is None else list(x.shape) for x in inputs], list(dtypes))
    static.update(override)
    return static


def _kernel(launch, spec: OpSpec, dtype: str, attrs: dict, static: dict):
    src = launch.kernel_config(spec.op, dtype, attrs, static)
    return (src.name, src.lang, src.entry, dict(src.defines or {}), dict(src.constexprs or {}))


def _builds(launch, spec, dtype, attrs, static) -> bool:
    try:
        launch.kernel_config(spec.op, dtype, attrs, static)
        return True
    except ValueError:
        return False


def _limit_values(launch, key: str) -> dict[str, object]:
    """Launch constants for limit ``key``: ``KEY`` itself and kernel-own ``<KERNEL>_KEY`` ones."""
    return {n: getattr(launch, n) for n in dir(launch) if n == key.upper() or n.endswith("_" + key.upper())}


def _check_hidden_limit(key: str):
    def check(spec, launch, dtype, attrs, inputs, value, in_dtypes):
        inside, outside = (value, value + 1) if key == "max_hidden" else (value, value - 1)
        for h, ok in ((inside, True), (outside, False)):
            built = _builds(launch, spec, dtype, attrs, _static(spec, inputs, in_dtypes, hidden=h))
            _expect(built == ok, spec, f"{key} {value}: hidden {h} {'does not build' if ok else 'builds'}")
        for name, v in _limit_values(launch, key).items():
            exact = name == key.upper()
            fits = v == value if exact else (v <= value if key == "max_hidden" else v >= value)
            _expect(fits, spec, f"launch.{name} = {v} {'!=' if exact else 'is outside'} the spec's {key} {value}")
    return check


def _check_head_dims(spec, launch, dtype, attrs, inputs, value, in_dtypes):
    value = tuple(value)
    probe = sorted(set(value) | set(range(8, 2 * max(value) + 1, 8)))
    built = tuple(d for d in probe if _builds(launch, spec, dtype, attrs, _static(spec, inputs, in_dtypes, head_dim=d)))
    _expect(built == value, spec, f"head dims that build {built} != the spec's head_dims {value}")
    for name, v in _limit_values(launch, "head_dims").items():
        exact = name == "HEAD_DIMS"
        fits = tuple(v) == value if exact else set(v) <= set(value)
        _expect(fits, spec, f"launch.{name} = {tuple(v)} {'!=' if exact else 'is not within'} the spec's head_dims {value}")


def _check_block_sizes(spec, launch, dtype, attrs, inputs, value, in_dtypes):
    """``block_sizes``: exactly the spec's layout block sizes build (the ``block_size`` attribute)."""
    value = tuple(value)
    probe = sorted(set(value) | {16, 32, 64, 128, 256})
    static = _static(spec, inputs, in_dtypes)
    built = tuple(b for b in probe if _builds(launch, spec, dtype, {**attrs, "block_size": b}, static))
    _expect(built == value, spec, f"block sizes that build {built} != the spec's block_sizes {value}")
    for name, v in _limit_values(launch, "block_sizes").items():
        exact = name == "BLOCK_SIZES"
        fits = tuple(v) == value if exact else set(v) <= set(value)
        _expect(fits, spec, f"launch.{name} = {tuple(v)} {'!=' if exact else 'is not within'} the spec's block_sizes {value}")


def _check_multiple(key: str):
    """``k_multiple`` / ``n_multiple``: the static dim (``K`` / ``N``) builds at an odd multiple of
    the value (so a launch demanding twice the multiple fails) and not one more; kernel-own
    ``<KERNEL>_K_MULTIPLE`` constants are multiples of it."""
    dim = key.split("_")[0].upper()

    def check(spec, launch, dtype, attrs, inputs, value, in_dtypes):
        for d, ok in ((3 * value, True), (3 * value + 1, False)):
            built = _builds(launch, spec, dtype, attrs, _static(spec, inputs, in_dtypes, **{dim: d}))
            _expect(built == ok, spec, f"{key} {value}: {dim} = {d} {'does not build' if ok else 'builds'}")
        for name, v in _limit_values(launch, key).items():
            fits = v == value if name == key.upper() else v % value == 0
            _expect(fits, spec, f"launch.{name} = {v} {'!=' if name == key.upper() else 'is not a multiple of'} "
                                f"the spec's {key} {value}")
    return check


def _check_max_dim(key: str):
    """``max_k``: K = the value builds, the next allowed K (one ``k_multiple`` more) does not."""
    dim = key.split("_")[1].upper()

    def check(spec, launch, dtype, attrs, inputs, value, in_dtypes):
        step = spec.limits.get(f"{dim.lower()}_multiple", 1)
        for d, ok in ((value, True), (value + step, False)):
            built = _builds(launch, spec, dtype, attrs, _static(spec, inputs, in_dtypes, **{dim: d}))
            _expect(built == ok, spec, f"{key} {value}: {dim} = {d} {'does not build' if ok else 'builds'}")
        for name, v in _limit_values(launch, key).items():
            exact = name == key.upper()
            _expect(v == value if exact else v <= value, spec,
                    f"launch.{name} = {v} {'!=' if exact else 'is over'} the spec's {key} {value}")
    return check


LIMIT_CHECKS = {"min_hidden": _check_hidden_limit("min_hidden"), "max_hidden": _check_hidden_limit("max_hidden"),
                "head_dims": _check_head_dims, "block_sizes": _check_block_sizes, "k_multiple": _check_multiple("k_multiple"),
                "n_multiple": _check_multiple("n_multiple"), "max_k": _check_max_dim("max_k")}


def check_launch(spec: OpSpec, launch) -> None:
    folder_ops = {op for op, s in SPECS.items() if s.folder == spec.folder}
    served = set(getattr(launch, "OPS", None) or (launch.OP,))
    _expect(spec.op in served and served <= folder_ops, spec,
            f"launch serves {sorted(served)}, the folder's specs {sorted(folder_ops)}")
    with pytest.raises(ValueError):
        launch.kernel_config(spec.op + "Unknown", "float32", {}, {})
    dtypes = spec.inputs[0].dtypes
    if hasattr(launch, "DTYPES"):  # one tuple for the folder's ops, or a tuple per op
        served = launch.DTYPES.get(spec.op, ()) if isinstance(launch.DTYPES, dict) else launch.DTYPES
        _expect(tuple(served) == tuple(dtypes), spec, f"launch.DTYPES {tuple(served)} != spec dtypes {dtypes}")
    cases = _cases(spec)
    for dt, inputs, required, in_dtypes in cases:  # every spec dtype builds, a left-out attribute takes the spec default
        attrs = {**spec.defaults(), **required}
        static = _static(spec, inputs, in_dtypes)
        _expect(_builds(launch, spec, dt, attrs, static), spec, f"dtype {dt} does not build")
        _expect(_kernel(launch, spec, dt, required, static) == _kernel(launch, spec, dt, attrs, static), spec,
                f"{dt}: kernel without the defaulted attributes differs from the one with the spec defaults {spec.defaults()}")
        src = launch.kernel_config(spec.op, dt, attrs, static)
        present = sum(x is not None for x in inputs)
        _expect((src.n_inputs, src.n_outputs) == (present, len(spec.outputs)), spec,
                f"{dt}: kernel {src.name} takes {src.n_inputs} inputs / {src.n_outputs} outputs, the case has "
                f"{present} / the spec {len(spec.outputs)}")
    _expect(any(all(x is not None for x in ins) for _, ins, _, _ in cases), spec,
            "no sample has every input present (so no kernel is checked to take them all)")
    limit_cases = [c for c in cases if c[0] not in FP8_DTYPES][-1:] + [c for c in cases if c[0] in FP8_DTYPES]
    for key, value in spec.limits.items():
        _expect(key in LIMIT_CHECKS, spec, f"limit {key!r} has no contract check (add one to LIMIT_CHECKS)")
        for dt, inputs, required, in_dtypes in limit_cases:
            LIMIT_CHECKS[key](spec, launch, dt, {**spec.defaults(), **required}, inputs, value, in_dtypes)


# -- spec vs NumPy reference --------------------------------------------------------------------
def _onnx_type(x: np.ndarray) -> int:
    if _dtype_name(x) == "float8e4m3fn":
        return onnx.TensorProto.FLOAT8E4M3FN
    return helper.np_dtype_to_tensor_dtype(x.dtype)


def _feed(x: np.ndarray):
    """An onnxruntime feed: FP8 (ml_dtypes) arrays as OrtValues of their ONNX type."""
    import onnxruntime as ort

    if _dtype_name(x) in FP8_DTYPES:
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(np.ascontiguousarray(x).view(np.uint8), _onnx_type(x))
    return x


def _np_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a spec dtype name (float8e4m3fn: ml_dtypes')."""
    if name == "float8e4m3fn":
        import ml_dtypes

        return np.dtype(ml_dtypes.float8_e4m3fn)
    return np.dtype(name)


def _output_dtypes(spec: OpSpec, inputs: list, attrs: dict) -> list[np.dtype]:
    """y's dtypes by the spec's rule (``OpSpec.output_dtype``): a rule that gives none is a ContractError."""
    dts = [_dtype_name(x) for x in inputs]
    try:
        return [_np_dtype(spec.output_dtype(j, dts, attrs)) for j in range(len(spec.outputs))]
    except ValueError as exc:
        raise ContractError(f"{spec.op}: the spec's output dtype rule fails on the sample ({exc})") from None


def _node_inputs(spec: OpSpec, inputs: list, absent: dict, y_dtype) -> tuple[list[str], dict, list]:
    """The node's input names ("" for absent), feeds and value infos; an absent input the function
    needs is fed ``absent[name]`` as a scalar of y's dtype."""
    feeds, names, vis = {}, [], []
    for t, x in zip(spec.inputs, inputs):
        if x is None and t.name not in absent:
            names.append("")
            continue
        x = np.full((), absent[t.name], y_dtype) if x is None else x
        feeds[t.name] = _feed(x)
        names.append(t.name)
        vis.append(helper.make_tensor_value_info(t.name, _onnx_type(x), list(x.shape)))
    while names and names[-1] == "":
        names.pop()
    return names, feeds, vis


def _run_function(spec: OpSpec, reference, inputs: list, attrs: dict, opset: int, absent: dict) -> list[np.ndarray]:
    """One fused node (the case's attributes set) in onnxruntime (CPU), with the reference's
    function variant for it (``function_overload``) where it has variants."""
    import onnxruntime as ort

    y_dtypes = _output_dtypes(spec, inputs, attrs)
    names, feeds, vis = _node_inputs(spec, inputs, absent, y_dtypes[0])
    node = helper.make_node(spec.op, names, [t.name for t in spec.outputs], domain=spec.domain,
                            plugin_namespace=spec.domain, plugin_version=spec.plugin_version, **attrs)
    pick = getattr(reference, "function_overload", None)
    overload = pick(spec.op, names, attrs) if pick else ""
    fn = reference.onnx_function(spec.op, opset=opset, **({"overload": overload} if overload else {}))
    node.overload = overload
    shapes = [None if x is None else list(x.shape) for x in inputs]
    outs = [helper.make_tensor_value_info(t.name, helper.np_dtype_to_tensor_dtype(y_dtypes[j]), spec.output_shape(j, shapes))
            for j, t in enumerate(spec.outputs)]  # the spec's dtype rule (fp32 for the samples), shaped by its rule
    model = helper.make_model(helper.make_graph([node], "contract", vis, outs), functions=[fn],
                              opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(spec.domain, 1)])
    model.ir_version = min(model.ir_version, 10)
    try:
        onnx.checker.check_model(model, full_check=True)
    except onnx.shape_inference.InferenceError as exc:  # the function's output type is not the spec rule's
        raise ContractError(f"{spec.op}: the function disagrees with the spec's output rules: {exc}") from None
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    # onnxruntime hands FP8 outputs back as their uint8 bits
    return [g.view(dt) if dt.itemsize == 1 and g.dtype == np.uint8 else g for g, dt in zip(sess.run(None, feeds), y_dtypes)]


def _absent_variants(spec: OpSpec, inputs: list) -> list[tuple[str, list]]:
    out = [("all inputs", list(inputs))]
    for i, t in enumerate(spec.inputs):
        if t.optional and inputs[i] is not None:
            out.append((f"{t.name} absent", [None if j == i else x for j, x in enumerate(inputs)]))
    return out


def _numeric_cases(spec: OpSpec, opset: int) -> list[tuple[str, list, dict]]:
    """float32, and each FP8 sample from ``FP8_OPSET``."""
    inputs, required = _sample(spec)
    out = [("float32", inputs, required)]
    if opset >= FP8_OPSET:
        out += [(dt, *_sample(spec, dtype=dt)) for dt in _fp8_dtypes(spec)]
    return out


def _refused(reference, spec: OpSpec, ins: list, attrs: dict) -> bool:
    """The reference refuses the variant (a ValueError: GEMM's FP8 scales dropped from an FP8 case)."""
    try:
        reference.reference(spec.op, ins, attrs)
        return False
    except ValueError:
        return True


def _variant(spec: OpSpec, reference, inputs: list, attrs: dict) -> str:
    """The function variant a node with these inputs (None: absent) gets ("" without variants)."""
    pick = getattr(reference, "function_overload", None)
    return pick(spec.op, [t.name if x is not None else "" for t, x in zip(spec.inputs, inputs)], attrs) if pick else ""


def check_numerics(spec: OpSpec, reference, opset: int) -> None:
    absent = getattr(reference, "ABSENT_INPUTS", {})
    for case, inputs, required in _numeric_cases(spec, opset):
        for what, ins in _absent_variants(spec, inputs):
            if what != "all inputs" and _refused(reference, spec, ins, required):
                continue
            if opset < FP8_OPSET and _variant(spec, reference, ins, required).startswith("fp8"):
                continue  # an FP8 variant (a norm's y_scale) needs FP8_OPSET: check_functions sees it refused
            what = f"{case}, {what}"
            got = _run_function(spec, reference, ins, required, opset, absent)
            dts = _output_dtypes(spec, ins, required)
            for attrs, whose in (({**spec.defaults(), **required}, "spec defaults"), (required, "reference's own defaults")):
                want = reference.reference(spec.op, ins, attrs)
                _expect(len(got) == len(want) == len(spec.outputs), spec, f"{what}: {len(got)} / {len(want)} outputs")
                for t, g, w, dt in zip(spec.outputs, got, want, dts):
                    _expect(g.dtype == w.dtype == dt, spec, f"{what}: output {t.name!r} is {g.dtype} (function) / "
                                                            f"{w.dtype} (NumPy), the spec's rule gives {dt}")
                    ok = g.shape == w.shape and np.allclose(g, w, rtol=RTOL, atol=ATOL)
                    err = float(np.abs(g.astype(np.float64) - w).max()) if g.shape == w.shape else float("inf")
                    _expect(ok, spec, f"{what}, opset {opset}, NumPy with the {whose}: output {t.name!r} "
                                      f"max abs error {err:.3g} (rtol {RTOL}, atol {ATOL})")


# -- the tests ----------------------------------------------------------------------------------
def _overloads(reference, op: str) -> tuple[str, ...]:
    return getattr(reference, "function_overloads", lambda op: ("",))(op)


def check_functions(spec: OpSpec, reference, opset: int) -> None:
    """Every function variant against the spec; an FP8 one below ``FP8_OPSET`` is a ValueError."""
    for overload in _overloads(reference, spec.op):
        kw = {"overload": overload} if overload else {}
        if overload.startswith("fp8") and opset < FP8_OPSET:
            with pytest.raises(ValueError, match="opset"):
                reference.onnx_function(spec.op, opset=opset, **kw)
            continue
        fn = reference.onnx_function(spec.op, opset=opset, **kw)
        _expect(fn.overload == overload, spec, f"function variant {overload!r} has overload {fn.overload!r}")
        check_function(spec, fn)


# -- spec fp8_speedup vs its results and launch ---------------------------------------------------
#: the name part of a timed kernel, per fp8_speedup kernel
_TIMED_KERNEL = {"cuda": "fa_sm90_d{D}_", "triton": "fa_triton_d{D}_"}


def _fp8_time(row: dict, timed: str) -> float | None:
    """A results row's FP8 time for the kernel `timed` names: its main FP8 column, or the Triton
    FP8 column timed beside it (D = 128 rows), else None."""
    for kernel, ms in (("kernel", "fp8_ms"), ("fp8_triton_kernel", "fp8_triton_ms")):
        if timed in row.get(kernel, "").rsplit("/", 1)[-1]:
            return row[ms]
    return None


#: a bias of each form, as launch.kernel_config's static facts take it
_BIAS_SHAPE = {"none": None, "key_padding": [-1, 1, 1, -1]}


def check_fp8_speedup(spec: OpSpec, launch) -> None:
    for m in spec.fp8_speedup:
        where = f"fp8_speedup sm_{m.arch}, head dim {m.head_dim}, bias {'/'.join(m.bias)}"
        path = PLUGINS_DIR / spec.folder / m.results
        _expect(path.is_file(), spec, f"{where}: results file {m.results} not found")
        data = json.loads(path.read_text())
        info = data["info"]
        _expect((info.get("arch"), info.get("device", "").split()[-1]) == (m.arch, m.device), spec,
                f"{where}: {m.results} was timed on sm_{info.get('arch')}, {info.get('device')}, not {m.device}")
        of_dim = [r for r in data["rows"] if r["D"] == m.head_dim]
        # rows timed with the entry's bias forms (--fp8-padding: "bias": "key_padding"), else the no-mask ones
        rows = [r for r in of_dim if r.get("bias", "none") in m.bias] or [r for r in of_dim if "bias" not in r]
        _expect(bool(rows), spec, f"{where}: {m.results} has no row of head dim {m.head_dim}")
        _expect(all(r.get("bias", "none") in m.bias for r in rows) or "without a mask" in m.doc, spec,
                f"{where}: timed without a mask, and the entry's doc does not say so")
        timed = _TIMED_KERNEL[m.kernel].format(D=m.head_dim)
        fp8 = [_fp8_time(r, timed) for r in rows]
        _expect(all(t is not None for t in fp8), spec, f"{where}: not every row times a {m.kernel} FP8 kernel ({timed}...)")
        ratios = [r["bf16_ms"] / t for r, t in zip(rows, fp8)]
        got = (round(min(ratios), 2), round(max(ratios), 2))
        _expect(got == m.speedup, spec, f"{where}: speedup {list(m.speedup)}, {m.results} gives {list(got)}")
        _expect(all(f"/{m.against}/" in r["bf16_kernel"] for r in rows), spec,
                f"{where}: the kernel timed against is not {m.against}")
        against = {k for r in rows for k, name in _TIMED_KERNEL.items()
                   if name.format(D=m.head_dim) in r["bf16_kernel"].rsplit("/", 1)[-1]}
        _expect(len(against) == 1, spec, f"{where}: the rows time {m.against} on {sorted(against) or 'no'} kernel(s)")
        for bias in m.bias:
            _expect(bias in _BIAS_SHAPE, spec, f"{where}: no launch check for the {bias} form")
            for causal in (0, 1):
                attrs = {"scale": m.head_dim ** -0.5, "causal": causal, "num_heads": 16, "num_kv_heads": 16,
                         "output_dtype": m.against}
                static = {"head_dim": m.head_dim, "bias_shape": _BIAS_SHAPE[bias], "arch": m.arch}
                for dtype, kernel in ((_fp8_dtypes(spec)[0], m.kernel), (m.against, *against)):
                    src = launch.kernel_config(spec.op, dtype, attrs if dtype != m.against else
                                               {k: v for k, v in attrs.items() if k != "output_dtype"}, static)
                    _expect(src.lang == kernel, spec, f"{where}: launch picks the {src.lang} kernel for the {dtype} "
                                                      f"form (causal {causal}), the entry says {kernel}")


SPEEDUP_OPS = [op for op in OPS if SPECS[op].fp8_speedup]


@pytest.mark.parametrize("op", SPEEDUP_OPS)
def test_fp8_speedup_matches_results_and_launch(op):
    spec = SPECS[op]
    check_fp8_speedup(spec, plugin_module(spec.folder, "launch"))


@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize("op", OPS)
def test_spec_matches_onnx_function(op, opset):
    spec = SPECS[op]
    check_functions(spec, plugin_module(spec.folder, "reference"), opset)


@pytest.mark.parametrize("op", OPS)
def test_spec_matches_launch(op):
    spec = SPECS[op]
    check_launch(spec, plugin_module(spec.folder, "launch"))


@pytest.mark.parametrize("opset", OPSETS)
@pytest.mark.parametrize("op", OPS)
def test_onnx_function_matches_numpy_reference(op, opset):
    spec = SPECS[op]
    check_numerics(spec, plugin_module(spec.folder, "reference"), opset)


def _renamed_input(spec: OpSpec) -> OpSpec:
    t = spec.inputs[-1]
    return dataclasses.replace(spec, inputs=spec.inputs[:-1] + (dataclasses.replace(t, name=t.name + "_renamed"),))


def _renamed_output(spec: OpSpec) -> OpSpec:
    t = spec.outputs[-1]
    return dataclasses.replace(spec, outputs=spec.outputs[:-1] + (dataclasses.replace(t, name=t.name + "_renamed"),))


def _renamed_attribute(spec: OpSpec) -> OpSpec:
    a = spec.attributes[-1]
    return dataclasses.replace(spec, attributes=spec.attributes[:-1] + (dataclasses.replace(a, name=a.name + "_renamed"),))


def _wrong_default(spec: OpSpec) -> OpSpec:
    i, a = next((i, a) for i, a in enumerate(spec.attributes) if a.default is not None)
    if a.type == "string" and a.choices:
        wrong = next(c for c in a.choices if c != a.default)
    else:
        wrong = a.default * 10 if a.type == "float" else (1 - a.default if a.type == "int" else None)
    assert wrong is not None, f"no wrong default for a {a.type} attribute"
    attrs = list(spec.attributes)
    attrs[i] = dataclasses.replace(a, default=wrong)
    return dataclasses.replace(spec, attributes=tuple(attrs))


def _changed_limit(key: str):
    def breaks(spec: OpSpec) -> OpSpec:
        v = spec.limits[key]
        changed = v[:-1] if isinstance(v, list) else (v // 2 if key.startswith("max") else v + 1)
        return dataclasses.replace(spec, limits={**spec.limits, key: changed})
    return breaks


def _dropped_dtype(spec: OpSpec) -> OpSpec:
    def drop(t):
        return dataclasses.replace(t, dtypes=t.dtypes[:-1])
    return dataclasses.replace(spec, inputs=tuple(map(drop, spec.inputs)), outputs=tuple(map(drop, spec.outputs)))


def _dropped_dtype_rule(spec: OpSpec) -> OpSpec:
    return dataclasses.replace(spec, outputs=tuple(dataclasses.replace(t, dtype_from=None) for t in spec.outputs))


def _dropped_quantized_by(spec: OpSpec) -> OpSpec:
    return dataclasses.replace(spec, outputs=tuple(dataclasses.replace(t, quantized_by=None) for t in spec.outputs))


def _changed_fp8_speedup(spec: OpSpec) -> OpSpec:
    first, *rest = spec.fp8_speedup
    lo, hi = first.speedup
    return dataclasses.replace(spec, fp8_speedup=(dataclasses.replace(first, speedup=(lo, hi + 0.05)), *rest))


def _swapped_fp8_kernel(spec: OpSpec) -> OpSpec:
    swap = {"cuda": "triton", "triton": "cuda"}
    return dataclasses.replace(spec, fp8_speedup=tuple(dataclasses.replace(m, kernel=swap[m.kernel])
                                                       for m in spec.fp8_speedup))


_CHECKS = {
    "function": lambda spec: check_function(spec, plugin_module(spec.folder, "reference").onnx_function(spec.op)),
    "launch": lambda spec: check_launch(spec, plugin_module(spec.folder, "launch")),
    "numerics": lambda spec: check_numerics(spec, plugin_module(spec.folder, "reference"), OPSETS[0]),
    "numerics_fp8": lambda spec: check_numerics(spec, plugin_module(spec.folder, "reference"), FP8_OPSET),
    "fp8_speedup": lambda spec: check_fp8_speedup(spec, plugin_module(spec.folder, "launch")),
}


def _breakages(spec: OpSpec):
    yield "renamed input", _renamed_input, ("function",)
    yield "renamed output", _renamed_output, ("function",)
    yield "dropped output", lambda s: dataclasses.replace(s, outputs=s.outputs[:-1]), ("function", "launch")
    if spec.attributes:
        yield "renamed attribute", _renamed_attribute, ("function",)
    yield "wrong version", lambda s: dataclasses.replace(s, version=s.version + 1), ("function",)
    if any(a.default is not None for a in spec.attributes):
        yield "wrong default", _wrong_default, ("function", "launch", "numerics")
    for key in spec.limits:
        yield f"changed {key}", _changed_limit(key), ("launch",)
    yield "dropped dtype", _dropped_dtype, ("launch",)
    if any(t.dtype_from for t in spec.outputs) and _fp8_dtypes(spec):
        yield "dropped output dtype rule", _dropped_dtype_rule, ("numerics_fp8",)
    if any(t.quantized_by for t in spec.outputs):  # the norms' FP8 y (y_scale present)
        yield "dropped quantized_by rule", _dropped_quantized_by, ("numerics_fp8",)
    if spec.fp8_speedup:
        yield "changed fp8 speedup", _changed_fp8_speedup, ("fp8_speedup",)
        yield "swapped fp8 kernel", _swapped_fp8_kernel, ("fp8_speedup",)


BROKEN = [(op, what, breaks, checks) for op in OPS for what, breaks, checks in _breakages(SPECS[op])]


@pytest.mark.parametrize(("op", "what", "breaks", "checks"), BROKEN, ids=[f"{op}-{what}" for op, what, _, _ in BROKEN])
def test_contract_checks_catch_a_broken_spec(op, what, breaks, checks):
    """The same checks as above, on a copy of the spec with one field wrong: each must fail."""
    broken = breaks(SPECS[op])
    assert broken != SPECS[op]
    for name in checks:
        with pytest.raises(ContractError):
            _CHECKS[name](broken)
