"""The FP16 / BF16 precision modes: strongly typed FP16 / BF16 version of a (fused) model.

TensorRT 11 and TensorRT-RTX have no FP16 builder flag: the ONNX tensor types decide the
precision. This stage writes those types: weights and activations in the low-precision type,
except the nodes a keep-FP32 policy names, which stay FP32 behind Casts; graph inputs/outputs
keep their type unless the recipe says ``io_dtype: fp16``.

FP16 uses onnxconverter-common's ``convert_float_to_float16`` (well kept, offline, pure Python;
checked here to leave optfuse nodes and their embedded reference functions intact: the nodes are
custom-domain ops it converts like any other, and the function bodies compute in FP32 internally
through Cast/CastLike, so they accept FP16 I/O unchanged). onnxconverter-common has no BF16, so
BF16 is the FP16 result re-typed: every FP16 tensor, Cast target and constant becomes BF16, with
initializers re-rounded from their FP32 originals (BF16 keeps FP32's range, so nothing is
clamped twice). onnxruntime's CPU provider runs FP16 models (it inserts FP32 fallbacks where it
lacks FP16 kernels) but almost no BF16 kernels: ``optfuse.verify`` checks a BF16 model through
its FP32 emulation (:mod:`optfuse.verify.emulate`: BF16-rounded weights and activations at the
same points, FP32 arithmetic).

The result (:class:`PrecisionResult`) is plain data; :mod:`optfuse.report` renders it.

ModelOpt AutoCast was not used: ``nvidia-modelopt`` pulls a large dependency set (and an
onnxruntime-gpu requirement) for a conversion onnxconverter-common already does here.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import warnings
from dataclasses import asdict, dataclass, field
from typing import Iterable

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from .. import DOMAIN
from ..errors import InputError
from .calibrate import SCALE_STEPS

#: Ops kept in FP32 by default: they overflow FP16 (x^2, exp, sums of squares) or lose too much
#: precision in it (sin/cos of large angles: rotary embeddings; log). Unfused norms compute their
#: variance with Pow + ReduceMean, which is exactly where FP16 overflows.
DEFAULT_KEEP_FP32: tuple[str, ...] = (
    "Pow",
    "ReduceMean",
    "ReduceSumSquare",
    "ReduceL2",
    "ReduceLogSumExp",
    "Exp",
    "Log",
    "Sin",
    "Cos",
)

LOW = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}


@dataclass(frozen=True)
class PrecisionOptions:
    """What the precision stage needs from a recipe's ``precision`` section."""

    mode: str = "fp32"  # fp32 | fp16 | bf16 | fp8
    keep_fp32: tuple[str, ...] = ()  # op types, node names or globs over node names
    io_dtype: str = "keep"  # keep | fp16
    #: fp8 only: the precision of everything not quantized (fp16 | bf16)
    fp8_base: str = "fp16"
    #: fp8 only: the activation calibrator (max | percentile | mse) and its percentile
    calibrator: str = "max"
    percentile: float = 99.99
    #: fp8 only: scale candidates per binade of the E4M3 grid-alignment search (calibrate.SCALE_STEPS; 1: amax / 448)
    scale_steps: int = SCALE_STEPS
    #: fp8 only: GEMM node names or globs (over the fused node's name and the nodes it replaced) kept in fp8_base
    fp8_exclude: tuple[str, ...] = ()
    #: fp8 only: which FlashAttention nodes take their FP8 form: auto (where it pays on target_arch,
    #: per the spec's fp8_speedup) | on (every node) | off (none)
    fp8_attention: str = "auto"
    #: the target's compute capability (recipe target.arch, convert --target; None: unknown)
    target_arch: int | None = None


@dataclass
class PrecisionResult:
    mode: str
    converter: str = ""
    io_dtype: str = "keep"
    keep_fp32_ops: list[str] = field(default_factory=list)  # op types kept FP32 (present in the model)
    keep_fp32_nodes: list[str] = field(default_factory=list)  # node names kept FP32
    casts_added: int = 0
    optfuse_nodes: int = 0
    initializers_converted: int = 0
    notes: list[str] = field(default_factory=list)
    #: fp8 only (else None): :meth:`optfuse.precision.fp8.Fp8Plan.to_dict`: base precision, calibration
    #: (method, batches), each GEMM's placement and scales, and why the others stay in the base precision
    fp8: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def converter_name() -> str:
    try:
        return f"onnxconverter-common {importlib.metadata.version('onnxconverter-common')}"
    except importlib.metadata.PackageNotFoundError:
        return "onnxconverter-common (not installed)"


def _all_nodes(graph: onnx.GraphProto) -> Iterable[onnx.NodeProto]:
    for n in graph.node:
        yield n
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _all_nodes(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for g in a.graphs:
                    yield from _all_nodes(g)


def resolve_keep_fp32(model: onnx.ModelProto, keep_fp32: Iterable[str], use_defaults: bool = True) -> tuple[list[str], list[str]]:
    """Split keep-FP32 entries into (op types, node names).

    An entry names an op type (``Softmax``, or an optfuse op such as ``LayerNorm``), a node name,
    or a glob over node names (``/encoder/layer.0/*``). Op types are matched against the model.
    """
    nodes = list(_all_nodes(model.graph))
    op_types = {n.op_type for n in nodes}
    ops: list[str] = []
    names: list[str] = []
    entries = list(DEFAULT_KEEP_FP32 if use_defaults else ()) + list(keep_fp32 or ())
    for e in entries:
        if e in op_types:
            if e not in ops:
                ops.append(e)
            continue
        hits = [n.name for n in nodes if n.name and (n.name == e or fnmatch.fnmatchcase(n.name, e))]
        for h in hits:
            if h not in names:
                names.append(h)
    return ops, names


def convert_precision(
    model: onnx.ModelProto,
    mode: str = "fp16",
    keep_fp32: Iterable[str] = (),
    io_dtype: str = "keep",
    use_defaults: bool = True,
) -> tuple[onnx.ModelProto, PrecisionResult]:
    """Return (converted copy, result). ``mode`` fp32 returns the model unchanged.
    :func:`optfuse.precision.apply_precision` is the same with the stage's :class:`PrecisionOptions`."""
    if mode not in ("fp32", "fp16", "bf16"):
        raise InputError(f"precision mode {mode!r}: expected fp32, fp16 or bf16")
    if io_dtype not in ("keep", "fp16", "bf16", "half"):
        raise InputError(f"io_dtype {io_dtype!r}: expected keep or fp16")
    n_optfuse = sum(1 for n in model.graph.node if n.domain == DOMAIN)
    if mode == "fp32":
        return model, PrecisionResult(mode="fp32", optfuse_nodes=n_optfuse)
    try:
        from onnxconverter_common import float16
    except ImportError as exc:
        raise InputError("precision fp16/bf16 needs onnxconverter-common: pip install onnxconverter-common") from exc

    ops, names = resolve_keep_fp32(model, keep_fp32, use_defaults)
    src = onnx.ModelProto()
    src.CopyFrom(model)
    n_casts_before = sum(1 for n in src.graph.node if n.op_type == "Cast")
    keep_io = io_dtype == "keep"
    block = sorted(set(float16.DEFAULT_OP_BLOCK_LIST) | set(ops))
    try:
        # The converter warns once per constant it clamps to the FP16 range (e.g. finfo(fp32).min
        # masks become -1e4); those go into the report as one note instead of flooding the console.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", UserWarning)
            out = float16.convert_float_to_float16(
                src, keep_io_types=keep_io, op_block_list=block, node_block_list=names, disable_shape_infer=False,
            )
    except Exception as exc:  # the converter's own failures are bad-input failures for the user
        raise InputError(f"FP16 conversion failed: {type(exc).__name__}: {exc}") from exc
    result = PrecisionResult(
        mode=mode, converter=converter_name(), io_dtype="keep" if keep_io else mode,
        keep_fp32_ops=ops, keep_fp32_nodes=names, optfuse_nodes=n_optfuse,
    )
    clamped = [str(w.message) for w in caught if "truncated" in str(w.message)]
    if clamped:
        result.notes.append(f"{len(clamped)} constant value(s) outside the FP16 range were clamped "
                            f"(first: {clamped[0]})")
    result.casts_added = sum(1 for n in out.graph.node if n.op_type == "Cast") - n_casts_before
    result.initializers_converted = sum(
        1 for a, b in zip(model.graph.initializer, out.graph.initializer)
        if a.data_type == TensorProto.FLOAT and b.data_type == TensorProto.FLOAT16
    ) if len(model.graph.initializer) == len(out.graph.initializer) else sum(
        1 for b in out.graph.initializer if b.data_type == TensorProto.FLOAT16
    )
    fixed = _fix_float_casts(out, {n.name for n in model.graph.node if n.op_type == "Cast"}, set(block), set(names))
    if fixed:
        result.notes.append(f"{fixed} exported Cast-to-FP32 node(s) retargeted to {mode} (their consumers run in {mode})")
    rewired = _read_outputs_before_their_cast(out, set(block), set(names))
    if rewired:
        result.notes.append(f"{rewired} input(s) of graph outputs also read inside the graph (e.g. a KV cache's "
                            f"present keys) rewired to the {mode} value the output Cast reads")
    if mode == "bf16":
        out = fp16_to_bf16(out, model)
        result.notes.append("BF16 = the FP16 conversion re-typed to BF16; onnxruntime CPU has almost no BF16 kernels, "
                            "so verify runs it emulated in FP32 (BF16 values rounded at the same points)")
    check_optfuse_io(out)
    return out, result


def _fix_float_casts(model: onnx.ModelProto, original_casts: set[str], blocked_ops: set[str], blocked_names: set[str]) -> int:
    """onnxconverter-common leaves the exporter's own ``Cast(to=FLOAT)`` nodes alone while it
    converts their consumers (e.g. LLaMA's ``.float()`` before rotary/mask arithmetic), which gives
    an invalid model (FP32 meets FP16 in one Mul). Such a Cast now casts to FP16, unless every
    consumer is kept in FP32; value_info follows the Cast's type."""
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    vi = {v.name: v for v in model.graph.value_info}
    outs = {o.name for o in model.graph.output}
    fixed = 0
    for n in model.graph.node:
        if n.op_type != "Cast" or n.name not in original_casts:
            continue
        to = next((a for a in n.attribute if a.name == "to"), None)
        if to is None or to.i != TensorProto.FLOAT or n.output[0] in outs:
            continue
        users = consumers.get(n.output[0], [])
        if not users or all(u.op_type in blocked_ops or u.name in blocked_names or u.op_type == "Cast" for u in users):
            continue
        to.i = TensorProto.FLOAT16
        if n.output[0] in vi:
            vi[n.output[0]].type.tensor_type.elem_type = TensorProto.FLOAT16
        fixed += 1
    return fixed


def _read_outputs_before_their_cast(model: onnx.ModelProto, blocked_ops: set[str], blocked_names: set[str]) -> int:
    """With ``keep_io_types`` onnxconverter-common makes a graph output FP32 again with a Cast from the
    FP16 value, under the output's name, but leaves the graph's own readers of that name on the FP32
    copy: a decoder's ``present.N.key`` (the KV cache, which the attention reads too) then feeds FP32
    into FP16 nodes, which onnxruntime and the plugins refuse (the unfused export breaks the same way).
    Those readers now take the Cast's FP16 input, except the nodes kept in FP32. Returns the inputs rewired."""
    types = _tensor_types(model)
    outs = {o.name for o in model.graph.output}
    low = (TensorProto.FLOAT16, TensorProto.BFLOAT16)
    before = {}  # graph output -> the low-precision value its Cast reads
    for n in model.graph.node:
        to = next((a.i for a in n.attribute if a.name == "to"), None) if n.op_type == "Cast" else None
        if to == TensorProto.FLOAT and n.output[0] in outs and types.get(n.input[0]) in low:
            before[n.output[0]] = n.input[0]
    rewired = 0
    for n in model.graph.node:
        if n.op_type in blocked_ops or n.name in blocked_names or (n.op_type == "Cast" and n.output[0] in before):
            continue
        for k, name in enumerate(n.input):
            if name in before:
                n.input[k] = before[name]
                rewired += 1
    return rewired


def check_optfuse_io(model: onnx.ModelProto) -> None:
    """Every optfuse node must see one float dtype on its float inputs (the plugins' contract)."""
    types = _tensor_types(model)
    bad = []
    for n in model.graph.node:
        if n.domain != DOMAIN:
            continue
        seen = {types.get(i) for i in n.input if i and types.get(i) in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)}
        if len(seen) > 1:
            bad.append(f"{n.name} ({n.op_type}): inputs of types {sorted(TensorProto.DataType.Name(t) for t in seen)}")
    if bad:
        raise InputError("precision conversion left optfuse nodes with mixed input dtypes:\n  " + "\n  ".join(bad))


def _tensor_types(model: onnx.ModelProto) -> dict[str, int]:
    g = model.graph
    out: dict[str, int] = {}
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        if vi.type.HasField("tensor_type"):
            out[vi.name] = vi.type.tensor_type.elem_type
    for init in g.initializer:
        out[init.name] = init.data_type
    for n in g.node:  # Cast outputs are known even without value_info
        if n.op_type == "Cast":
            for a in n.attribute:
                if a.name == "to":
                    out[n.output[0]] = a.i
    return out


def fp16_to_bf16(model: onnx.ModelProto, original: onnx.ModelProto) -> onnx.ModelProto:
    """Re-type an FP16-converted model to BF16 (initializers re-rounded from ``original``)."""
    import ml_dtypes

    orig = {i.name: i for i in original.graph.initializer}

    def retype_tensor(t: onnx.TensorProto, source: onnx.TensorProto | None = None) -> None:
        if t.data_type != TensorProto.FLOAT16:
            return
        if source is not None and source.data_type == TensorProto.FLOAT:
            arr = numpy_helper.to_array(source)
        else:
            arr = numpy_helper.to_array(t).astype(np.float32)
        new = numpy_helper.from_array(arr.astype(ml_dtypes.bfloat16), t.name)
        t.CopyFrom(new)

    def retype_graph(g: onnx.GraphProto, top: bool) -> None:
        for init in g.initializer:
            retype_tensor(init, orig.get(init.name) if top else None)
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            tt = vi.type.tensor_type
            if vi.type.HasField("tensor_type") and tt.elem_type == TensorProto.FLOAT16:
                tt.elem_type = TensorProto.BFLOAT16
        for n in g.node:
            for a in n.attribute:
                if n.op_type == "Cast" and a.name == "to" and a.i == TensorProto.FLOAT16:
                    a.i = TensorProto.BFLOAT16
                elif a.type == onnx.AttributeProto.TENSOR:
                    retype_tensor(a.t)
                elif a.type == onnx.AttributeProto.GRAPH:
                    retype_graph(a.g, False)
                elif a.type == onnx.AttributeProto.GRAPHS:
                    for sg in a.graphs:
                        retype_graph(sg, False)

    out = onnx.ModelProto()
    out.CopyFrom(model)
    retype_graph(out.graph, True)
    return out
