"""Precision mode ``fp8`` (E4M3): which GEMMs run FP8, their scales, and the Q/DQ placement.

:func:`quantize_fp8` takes the fused FP32 model and the calibration feeds, and:

1. raises the default-domain opset to 19 when it is lower (FP8 ``QuantizeLinear``/``DequantizeLinear``
   need it; onnx's version converter, the reference functions re-embedded at the new opset);
2. picks the GEMMs to quantize (:func:`plan_targets`): every ``GemmEpilogue``/``GatedGemm`` whose spec
   has the FP8 inputs, and every unfused ``MatMul``/``Gemm`` with a constant 2-D weight, except what
   ``fp8_exclude`` names (node names or globs, matched against the fused node's name, the names of
   the nodes it replaced and the op type). Everything else stays in the base precision: norms and
   softmax statistics, the excluded GEMMs; optfuse's FlashAttention nodes take their FP8 form where
   it pays on the target (``fp8_attention``, :mod:`.fp8_attention`);
3. calibrates each quantized GEMM's activation input on the FP32 model
   (:mod:`optfuse.precision.calibrate`): a per-tensor scale amax / 448; weights get per-output-
   channel scales max |W| / 448 from their FP32 values;
4. converts the model to the base precision (``fp8_base``: the FP16 / BF16 path of :mod:`.fp16`);
5. places the quantization, in the base model:

   - optfuse GEMM nodes become their FP8 form (spec version 2): ``QuantizeLinear(x, scale, zp
     float8e4m3fn)`` feeds A directly (no DequantizeLinear in front of the plugin), the weights are
     float8e4m3fn initializers, the scales float32 inputs (``a_scale`` [1], ``w_scale`` [N]) and
     ``output_dtype`` the base precision; the op's reference function dequantizes, so onnxruntime
     runs the model as fake-quant;
   - unfused MatMul/Gemm get TensorRT's explicit-quantization pattern: ``Q -> DQ`` on the
     activation, ``DQ`` (per channel, ``axis`` the output channel) of an FP8 weight initializer.

   - unfused attention (``MatMul -> Softmax -> MatMul`` of activations) gets TensorRT's FP8 MHA
     pattern: Q -> DQ on Q, K, the softmax output and V (:mod:`.fp8_mha`).

   One Q per quantized tensor, shared by every GEMM reading it (packed Q/K/V siblings, a gated
   FFN's two weights). Q/DQ scales have the activation's type (opset 19 ties Q's scale to its
   input); every scale is rounded to the base type first, so the plugin's float32 ``a_scale`` and
   the Q in front of it hold the same value and weights are quantized with the scale they are
   dequantized with.

The Q/DQ node builder and the helpers the FlashAttention placement shares are in :mod:`.fp8_nodes`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .. import DOMAIN
from ..errors import InputError
from .calibrate import (E4M3_MAX, TensorCalibration, calibrate, check_calibrator, check_scale_steps, quantize_e4m3,
                        weight_scales)
from .fp16 import PrecisionOptions, PrecisionResult, convert_precision
from .fp8_attention import check_mode as check_fp8_attention_mode, place_flash_attention
from .fp8_mha import AttentionTarget, find_attention
from .fp8_nodes import (BASE_TYPES, OUTPUT_DTYPE, QdqBuilder, calibration_source, excluded_by, insert_nodes,
                        replaced_names, round_to)
from .fp8_norm import fold_norm_quantize

FP8_OPSET = 19
PLUGIN_GEMMS = ("GemmEpilogue", "GatedGemm")
#: op types that stay in the base precision by policy, and why (listed by op type in the report)
KEPT_BY_POLICY = {
    "LayerNorm": "norm", "RMSNorm": "norm", "SkipLayerNorm": "norm", "SkipRMSNorm": "norm",
    "LayerNormalization": "norm", "SimplifiedLayerNormalization": "norm",
    "Softmax": "softmax statistics", "LogSoftmax": "softmax statistics",
    "FlashAttention": "attention: optfuse's FlashAttention has no FP8 contract placed here; it runs in the base precision",
}


@dataclass
class Fp8Gemm:
    """One GEMM that runs FP8: how (``plugin``: its optfuse node takes FP8 A and weights; ``qdq``:
    TensorRT's Q/DQ pattern around a native MatMul/Gemm) and where its scales come from."""

    name: str
    op: str
    form: str  # plugin | qdq
    activation: str  # the FP32 model's tensor that is quantized
    a_amax: float
    a_scale: float
    a_source: str  # e.g. "max over 8 calibration batches"
    weights: list[str]
    w_channels: list[int]
    w_scale_range: list[float]  # [min, max] over every weight's channels
    w_source: str = "per output channel: max |W| / 448 (FP32 weights)"


@dataclass
class Fp8Skip:
    """A GEMM-like node that stays in the base precision, and why."""

    name: str
    op: str
    reason: str


@dataclass
class Fp8Attention:
    """An unfused attention block in TensorRT's FP8 MHA pattern: Q/DQ on Q, K, the softmax output
    and V; each tensor's amax and scale with their source."""

    softmax: str
    matmuls: list[str]
    tensors: list[dict]  # {"role": Q|K|P|V, "tensor", "amax", "scale", "source"}


@dataclass
class Fp8Plan:
    base: str
    calibrator: str
    percentile: float | None
    batches: int
    opset: list[int]  # [the model's, the result's]
    #: scale candidates per binade of the grid-alignment search (calibrate.SCALE_STEPS; 1: amax / 448)
    scale_steps: int
    gemms: list[Fp8Gemm] = field(default_factory=list)
    attention: list[Fp8Attention] = field(default_factory=list)
    skipped: list[Fp8Skip] = field(default_factory=list)
    #: op type -> (node count, why it stays in the base precision)
    kept: dict[str, list] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class _Target:
    node: str
    op: str
    form: str
    activation: str
    weights: tuple[str, ...]
    axes: tuple[int, ...]  # each weight's output-channel axis


# ------------------------------------------------------------------------------------------------
# the entry point
# ------------------------------------------------------------------------------------------------
def quantize_fp8(model: onnx.ModelProto, options: PrecisionOptions,
                 calibration: Sequence[Mapping[str, np.ndarray]]) -> tuple[onnx.ModelProto, PrecisionResult]:
    """The fused FP32 `model` in precision fp8 (see module doc); `calibration`: feed dicts of the
    model's inputs. Returns (model, result); bad options are InputErrors."""
    if options.fp8_base not in BASE_TYPES:
        raise InputError(f"precision.fp8_base {options.fp8_base!r}: expected fp16 or bf16")
    check_fp8_attention_mode(options.fp8_attention)
    check_calibrator(options.calibrator, options.percentile)
    check_scale_steps(options.scale_steps)
    opset_before = default_opset(model)
    fp32 = raise_opset(model, FP8_OPSET)
    targets, skipped = plan_targets(fp32, options.fp8_exclude)
    attention, skipped = _attention_targets(fp32, options.fp8_exclude, skipped)
    tensors = [t.activation for t in targets] + [x for a in attention for x, _, _ in a.tensors]
    cal = calibrate(fp32, tensors, calibration, options.calibrator, options.percentile, options.scale_steps)
    base, result = convert_precision(fp32, options.fp8_base, keep_fp32=options.keep_fp32, io_dtype=options.io_dtype)
    plan = Fp8Plan(options.fp8_base, options.calibrator,
                   options.percentile if options.calibrator == "percentile" else None, len(calibration),
                   [opset_before, default_opset(base)], scale_steps=options.scale_steps, skipped=skipped,
                   kept=_kept_by_policy(fp32))
    out = _place(base, fp32, targets, cal, plan)
    _place_attention(out, attention, cal, plan, BASE_TYPES[options.fp8_base])
    check_fp8_io(out)
    result.mode = "fp8"
    result.fp8 = plan.to_dict()
    place_flash_attention(out, fp32, options, calibration, result)  # optfuse FlashAttention: its FP8 form
    result.notes.append(f"FP8 (E4M3): {len(plan.gemms)} GEMM node(s) quantized "
                        f"({sum(g.form == 'plugin' for g in plan.gemms)} optfuse, "
                        f"{sum(g.form == 'qdq' for g in plan.gemms)} Q/DQ)"
                        + (f" and {len(plan.attention)} unfused attention block(s) in TensorRT's FP8 MHA pattern"
                           if plan.attention else "") + f"; the rest in {options.fp8_base}")
    out = fold_norm_quantize(out, result)  # norms feeding only FP8 GEMMs write E4M3 themselves (.fp8_norm)
    if opset_before < FP8_OPSET:
        result.notes.append(f"default-domain opset raised from {opset_before} to {FP8_OPSET} for FP8 Q/DQ "
                            f"(onnx version converter)")
    return out, result


def default_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


def raise_opset(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """`model` at default-domain opset >= `opset`: onnx's version converter on the graph, then the
    optfuse reference functions re-embedded at the new opset (their bodies follow the model's opset)
    and the nodes' metadata restored."""
    if default_opset(model) >= opset:
        return model
    from onnx import version_converter

    from ..rewrite import add_functions

    src = onnx.ModelProto()
    src.CopyFrom(model)
    kept = [f for f in src.functions if f.domain != DOMAIN]
    del src.functions[:]
    try:
        out = version_converter.convert_version(src, opset)
    except Exception as exc:  # noqa: BLE001 - the converter's refusal is the reason FP8 cannot be placed
        raise InputError(f"precision fp8 needs opset >= {opset} and onnx's version converter cannot raise this "
                         f"model's opset {default_opset(model)}: {str(exc).splitlines()[0]}") from None
    out.functions.extend(kept)
    meta = {n.name: list(n.metadata_props) for n in model.graph.node if n.name and n.metadata_props}
    for n in out.graph.node:  # the converter drops node metadata (optfuse.rule, optfuse.replaced)
        if n.name in meta and not n.metadata_props:
            n.metadata_props.extend(meta[n.name])
    return add_functions(out)


# ------------------------------------------------------------------------------------------------
# what is quantized
# ------------------------------------------------------------------------------------------------
def fp8_ready(op: str) -> bool:
    """Whether the op's spec has the FP8 form (spec version >= 2: an ``a_scale`` input, FP8 A)."""
    from ..spec import get_spec

    spec = get_spec(op)
    names = [t.name for t in spec.inputs]
    return "a_scale" in names and "float8e4m3fn" in spec.inputs[0].dtypes


def plan_targets(model: onnx.ModelProto, exclude: Sequence[str] = ()) -> tuple[list[_Target], list[Fp8Skip]]:
    """The GEMMs to quantize, and the GEMM-like nodes that stay in the base precision with why."""
    inits = {t.name: t for t in model.graph.initializer}
    targets: list[_Target] = []
    skipped: list[Fp8Skip] = []
    ready: dict[str, bool] = {}
    for n in model.graph.node:
        plugin = n.domain == DOMAIN and n.op_type in PLUGIN_GEMMS
        if not plugin and not (n.domain in ("", "ai.onnx") and n.op_type in ("MatMul", "Gemm")):
            continue
        target, reason = _target(n, inits, plugin)
        if target is not None:
            pattern = excluded_by(n, exclude)
            if pattern is not None:
                reason, target = f"excluded by precision.fp8_exclude ({pattern!r})", None
            elif plugin and not ready.setdefault(n.op_type, fp8_ready(n.op_type)):
                from ..spec import get_spec

                reason, target = (f"the {n.op_type} spec (version {get_spec(n.op_type).version}) has no FP8 "
                                  f"inputs"), None
        if target is not None:
            targets.append(target)
        else:
            skipped.append(Fp8Skip(n.name, n.op_type, reason))
    return targets, skipped


def _target(n: onnx.NodeProto, inits: Mapping[str, TensorProto], plugin: bool) -> tuple[_Target | None, str]:
    """(the target, "") for a quantizable GEMM, else (None, why not)."""
    a = n.input[0] if n.input else ""
    if not a or a in inits:
        return None, "its activation input is a constant"
    if plugin:
        weights = tuple(n.input[1:3] if n.op_type == "GatedGemm" else n.input[1:2])
        if not all(w in inits and len(inits[w].dims) == 2 for w in weights):
            return None, "its weights are not constant [N, K] initializers"
        return _Target(n.name, n.op_type, "plugin", a, weights, (0,) * len(weights)), ""
    b = n.input[1] if len(n.input) > 1 else ""
    if b not in inits:
        return None, "both inputs are activations, outside an attention block TensorRT's FP8 MHA pattern covers"
    if len(inits[b].dims) != 2 or inits[b].data_type != TensorProto.FLOAT:
        return None, "its weight is not a 2-D FP32 constant"
    attrs = {x.name: helper.get_attribute_value(x) for x in n.attribute}
    if n.op_type == "Gemm" and attrs.get("transA", 0):
        return None, "Gemm with transA=1"
    axis = 0 if n.op_type == "Gemm" and attrs.get("transB", 0) else 1  # the output channel N of B
    return _Target(n.name, n.op_type, "qdq", a, (b,), (axis,)), ""


def _attention_targets(model: onnx.ModelProto, exclude: Sequence[str],
                       skipped: list[Fp8Skip]) -> tuple[list[AttentionTarget], list[Fp8Skip]]:
    """The unfused attention blocks to put in TensorRT's FP8 MHA pattern (neither MatMul excluded),
    and `skipped` without their MatMuls (or with the exclusion as the reason)."""
    inits = {t.name: t for t in model.graph.initializer}
    nodes = {n.name: n for n in model.graph.node if n.name}
    chosen, why = [], {}
    for a in find_attention(model, inits):
        if not all(a.matmuls) or any(m not in nodes for m in a.matmuls):
            continue
        pattern = next((p for m in a.matmuls if (p := excluded_by(nodes[m], exclude)) is not None), None)
        if pattern is None:
            chosen.append(a)
            why.update({m: None for m in a.matmuls})
        else:
            why.update({m: f"excluded by precision.fp8_exclude ({pattern!r}), with its attention block" for m in a.matmuls})
    kept = []
    for s in skipped:
        if s.name in why and why[s.name] is None:
            continue
        kept.append(Fp8Skip(s.name, s.op, why[s.name]) if s.name in why else s)
    return chosen, kept


def _kept_by_policy(model: onnx.ModelProto) -> dict[str, list]:
    counts: dict[str, int] = {}
    for n in model.graph.node:
        if n.op_type in KEPT_BY_POLICY:
            counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return {op: [c, KEPT_BY_POLICY[op]] for op, c in sorted(counts.items())}


# ------------------------------------------------------------------------------------------------
# placement
# ------------------------------------------------------------------------------------------------
def _place(base: onnx.ModelProto, fp32: onnx.ModelProto, targets: Sequence[_Target],
           cal: Mapping[str, TensorCalibration], plan: Fp8Plan) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(base)
    g = out.graph
    b = QdqBuilder(out)
    by_name = {n.name: n for n in g.node}
    base_inits = {t.name: t for t in g.initializer}
    fp32_inits = {t.name: t for t in fp32.graph.initializer}
    for t in targets:
        node = by_name[t.node]
        dtype = base_inits[node.input[1]].data_type
        c = cal[t.activation]
        a_scale = float(round_to(np.array([c.scale]), dtype)[0])
        act = node.input[0]
        scales, channels = [], []
        fp8_weights = []
        for w, axis in zip(t.weights, t.axes):
            wf = numpy_helper.to_array(fp32_inits[w]).astype(np.float32)
            # float32: the plugin's w_scale; a DQ's scale has the base type (the search rounds with it)
            ws = weight_scales(wf, axis, plan.scale_steps, (lambda v: round_to(v, dtype)) if t.form == "qdq" else None)
            fp8_weights.append((w, b.constant(f"{w}/fp8", quantize_e4m3(wf, ws, axis), TensorProto.FLOAT8E4M3FN), ws,
                                axis))
            scales.append(ws)
            channels.append(int(ws.size))
        if t.form == "plugin":
            _to_plugin(node, b, b.quantize(act, a_scale, dtype, t.node)[0], a_scale, fp8_weights, dtype)
        else:
            node.input[0] = b.qdq(act, a_scale, dtype, t.node)
            (w, w8, ws, axis), = fp8_weights
            scale = b.constant(f"{w}/fp8_scale", ws, dtype)
            wzp = b.constant(f"{w}/fp8_zero_point", np.zeros(ws.shape, np.float32), TensorProto.FLOAT8E4M3FN)
            wdq = b.unique(f"{w}/fp8_dq")
            b.add_node(t.node, helper.make_node("DequantizeLinear", [w8, scale, wzp], [wdq],
                                                name=b.unique(f"{w}/DequantizeLinear"), axis=axis), dtype)
            node.input[1] = wdq
        all_scales = np.concatenate(scales)
        plan.gemms.append(Fp8Gemm(t.node, t.op, t.form, t.activation, c.amax, a_scale, calibration_source(c), list(t.weights),
                                  channels, [float(all_scales.min()), float(all_scales.max())]))
    _rebuild(out, b)
    return out


def _place_attention(out: onnx.ModelProto, attention: Sequence[AttentionTarget],
                     cal: Mapping[str, TensorCalibration], plan: Fp8Plan, base_type: int) -> None:
    """Q -> DQ on the four inputs of each attention block's two MatMuls, in the base model."""
    if not attention:
        return
    from .fp16 import _tensor_types

    b = QdqBuilder(out)
    types = _tensor_types(out)
    by_name = {n.name: n for n in out.graph.node}
    for a in attention:
        entries = []
        for role, (tensor, consumer, idx) in zip("QKPV", a.tensors):
            node = by_name[consumer]
            act = node.input[idx]
            dtype = types.get(act, base_type)
            c = cal[tensor]
            if role == "P" and c.method == "max":
                # probabilities: max |p| (<= 1) / 448, never grid-aligned past 1 (ModelOpt's exporter
                # fixes this scale at 1 / 448 for TensorRT's MHA fusion; a causal row's first p is 1)
                c = replace(c, amax=c.max_abs)
            scale = float(round_to(np.array([c.scale]), dtype)[0])
            node.input[idx] = b.qdq(act, scale, dtype, consumer)
            entries.append({"role": role, "tensor": tensor, "amax": c.amax, "scale": scale, "source": calibration_source(c)})
        plan.attention.append(Fp8Attention(a.softmax, list(a.matmuls), entries))
    insert_nodes(out, b)


def _to_plugin(node: onnx.NodeProto, b: QdqBuilder, q: str, a_scale: float,
               fp8_weights: list[tuple[str, str, np.ndarray, int]], dtype: int) -> None:
    """Rewrite an optfuse GEMM node into its FP8 form: inputs in the (v2) spec's order."""
    from ..plugin_dirs import plugin_module
    from ..spec import get_spec

    spec = get_spec(node.op_type)
    names = [t.name for t in spec.inputs]
    given = {names[i]: x for i, x in enumerate(node.input) if i < len(names)}
    given[names[0]] = q
    given["a_scale"] = b.constant(f"{node.name}/a_scale", np.array([a_scale], np.float32), TensorProto.FLOAT)
    for w, w8, ws, _ in fp8_weights:
        slot = names[list(node.input).index(w)]
        given[slot] = w8
        given[f"{slot.lower()}_scale"] = b.constant(f"{w}/fp8_scale", ws, TensorProto.FLOAT)
    absent = getattr(plugin_module(spec.folder, "reference"), "ABSENT_INPUTS", {})
    last = max(i for i, n in enumerate(names) if given.get(n))
    inputs = []
    for n in names[:last + 1]:
        if not given.get(n) and n in absent:
            given[n] = b.constant(f"{node.name}/{n}", np.array(absent[n], np.float32), dtype)
        inputs.append(given.get(n, ""))
    del node.input[:]
    node.input.extend(inputs)
    for a in list(node.attribute):
        if a.name in ("plugin_version", "output_dtype"):
            node.attribute.remove(a)
    node.attribute.extend([helper.make_attribute("plugin_version", spec.plugin_version),
                           helper.make_attribute("output_dtype", OUTPUT_DTYPE[dtype])])


def _rebuild(model: onnx.ModelProto, b: QdqBuilder) -> None:
    """Insert the Q/DQ nodes before their GEMMs, add the new tensors, drop the weights no node reads
    any more, and re-embed the reference functions of the optfuse GEMMs (their FP8 form)."""
    from ..rewrite import add_functions

    g = model.graph
    insert_nodes(model, b)
    read = {i for n in g.node for i in n.input} | {o.name for o in g.output}
    read |= {i for n in g.node for a in n.attribute if a.type == onnx.AttributeProto.GRAPH for m in a.g.node
             for i in m.input}
    unused = [t for t in g.initializer if t.name not in read]
    for t in unused:
        g.initializer.remove(t)
    stale = [f for f in model.functions if f.domain == DOMAIN and f.name in PLUGIN_GEMMS]
    for f in stale:
        model.functions.remove(f)
    add_functions(model)


def check_fp8_io(model: onnx.ModelProto) -> None:
    """The FP8 contract of every optfuse GEMM node in FP8 form: A and its weights float8e4m3fn, the
    scales float32, bias/residual the output dtype; every other optfuse node one float dtype."""
    from .fp16 import _tensor_types

    types = _tensor_types(model)
    floats = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)
    bad = []
    for n in model.graph.node:
        if n.domain != DOMAIN:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        out_dtype = attrs.get("output_dtype", b"like_input")
        out_dtype = out_dtype.decode() if isinstance(out_dtype, bytes) else out_dtype
        if n.op_type in PLUGIN_GEMMS and out_dtype != "like_input":
            n_w = 2 if n.op_type == "GatedGemm" else 1
            fp8 = list(n.input[:1 + n_w])
            scales = list(n.input[-(1 + n_w):])
            if any(types.get(i) != TensorProto.FLOAT8E4M3FN for i in fp8 if i in types):
                bad.append(f"{n.name} ({n.op_type}): A/weights not all float8e4m3fn")
            if any(types.get(i) != TensorProto.FLOAT for i in scales):
                bad.append(f"{n.name} ({n.op_type}): scales not all float32")
            continue
        seen = {types.get(i) for i in n.input if i and types.get(i) in floats}
        if len(seen) > 1:
            bad.append(f"{n.name} ({n.op_type}): inputs of types {sorted(TensorProto.DataType.Name(t) for t in seen)}")
    if bad:
        raise InputError("precision fp8 left optfuse nodes breaking their dtype contract:\n  " + "\n  ".join(bad))


__all__ = ["E4M3_MAX", "FP8_OPSET", "Fp8Gemm", "Fp8Plan", "Fp8Skip", "check_fp8_io", "excluded_by", "fp8_ready",
           "plan_targets", "quantize_fp8", "raise_opset", "replaced_names"]
