"""FP8 norm outputs: a norm whose y only feeds FP8 GEMMs writes E4M3 itself.

After the FP8 placement (:mod:`.fp8`), the A input of each FP8 GEMM is ``QuantizeLinear(y, scale)``
of the tensor in front of it; where that tensor is the ``y`` of an optfuse norm (``LayerNorm``,
``SkipLayerNorm``, ``RMSNorm``, ``SkipRMSNorm``) the norm would write a 16-bit y that the Q reads
again to write the FP8 copy: two HBM passes more than needed. :func:`fold_norm_quantize` folds the Q
into the norm, its FP8-output form (the spec's optional ``y_scale``): y = saturate(round(norm / scale))
in float8e4m3fn, computed from the norm's FP32 value, so ``SkipLayerNorm -> GEMM`` moves one byte an
element between them.

A norm is folded when y is no graph output and every reader of y either reads only its shape
(``Shape``, ``Size``: they read x instead, whose shape y has) or is a ``QuantizeLinear`` to E4M3
(a float8e4m3fn zero point of 0, saturating), all of one per-tensor scale, whose outputs only
optfuse FP8 GEMMs read as their A (TensorRT's Q -> DQ pattern in front of an unfused GEMM keeps its
pair). The Q's output keeps its name (now the norm's y); the scale goes in as a float32 [1]
initializer of the Q scale's value (the placement rounded it to the base type already, so both hold
the same number). Otherwise the Q stays, and the precision report says why (y also read in the base
precision: a post-LN model's residual stream; a graph output; a Q -> DQ pair; Qs of different scales).

Numerics: the folded norm quantizes the FP32 normalized value; the unfolded chain quantized y
rounded to the base type first. The two differ by at most one E4M3 unit in the last place, only
where the FP32 value lies within half a base-type ulp of an E4M3 rounding boundary (the base
type's 8 or 11 significant bits against E4M3's 4).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .. import DOMAIN
from ..errors import InputError

NORM_OPS = ("LayerNorm", "SkipLayerNorm", "RMSNorm", "SkipRMSNorm")
#: the optfuse ops whose A takes an FP8 tensor directly (a norm's FP8 y)
FP8_PLUGINS = ("GemmEpilogue", "GatedGemm")
#: why a norm keeps its Q when the Q feeds something else (TensorRT's Q -> DQ pattern of an unfused GEMM)
KEPT_QDQ = "its QuantizeLinear feeds other nodes than optfuse FP8 GEMMs"
#: readers of a tensor's shape only: they read the FP8 y as well as the 16-bit one
SHAPE_READERS = ("Shape", "Size")
#: why a norm keeps its Q when y has readers besides the Qs (a post-LN residual stream)
KEPT_READ = "y is also read in the base precision"


@dataclass
class Fp8Norm:
    """One optfuse norm whose y feeds FP8 GEMMs: folded (``fp8_output``: it writes E4M3 with
    ``scale``) or not (``quantize_kept``: the Q stays, ``reason`` says why)."""

    name: str
    op: str
    form: str  # fp8_output | quantize_kept
    y: str  # the FP8 tensor the GEMMs read
    scale: float | None
    readers: list[str]  # the FP8 GEMMs (the Q's readers)
    reason: str = ""


def fold_norm_quantize(model: onnx.ModelProto, result) -> onnx.ModelProto:
    """`model` (the FP8-placed base model) with every foldable norm -> Q pair in the norm's FP8
    form (see module doc); the norms go in ``result.fp8["norms"]`` and a note in ``result.notes``."""
    g = model.graph
    readers = _readers(model)
    inits = {t.name: t for t in g.initializer}
    outputs = {o.name for o in g.output}
    norms: list[Fp8Norm] = []
    folded: list[tuple[onnx.NodeProto, list[onnx.NodeProto], float]] = []
    for n in g.node:
        if n.domain != DOMAIN or n.op_type not in NORM_OPS or _has_y_scale(n):
            continue
        y = n.output[0]
        qs = [c for c in readers.get(y, []) if c.op_type == "QuantizeLinear" and c.input[0] == y]
        if not qs:
            continue
        q_readers = [r for q in qs for r in readers.get(q.output[0], [])]
        gemms = sorted({r.name for r in q_readers})
        scale, why = _one_scale(qs, inits)
        q_outs = {q.output[0] for q in qs}
        if not why and not all(r.domain == DOMAIN and r.op_type in FP8_PLUGINS and r.input[0] in q_outs for r in q_readers):
            why = f"{KEPT_QDQ} ({sorted({r.op_type for r in q_readers})[0]})"
        others = [r.name or r.op_type for r in readers.get(y, []) if r not in qs and r.op_type not in SHAPE_READERS]
        if others:
            why = f"{KEPT_READ} ({len(others)} other reader(s), e.g. {sorted(others)[0]})"
        elif y in outputs:
            why = "y is a graph output"
        if why:
            norms.append(Fp8Norm(n.name, n.op_type, "quantize_kept", qs[0].output[0], scale, gemms, why))
            continue
        folded.append((n, qs, scale))
        norms.append(Fp8Norm(n.name, n.op_type, "fp8_output", qs[0].output[0], scale, gemms))
    if folded:
        _fold(model, folded)
        from ..rewrite import add_functions

        add_functions(model)  # the folded norms' fp8 function variant
        check_fp8_norms(model, [n for n, _, _ in folded])
    _report(result, norms)
    return model


def _readers(model: onnx.ModelProto) -> dict[str, list[onnx.NodeProto]]:
    out: dict[str, list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        for i in n.input:
            if i and n not in out.setdefault(i, []):
                out[i].append(n)
        for a in n.attribute:  # a subgraph reading the tensor keeps it in the base precision
            if a.type == onnx.AttributeProto.GRAPH:
                for m in a.g.node:
                    for i in m.input:
                        out.setdefault(i, []).append(n)
    return out


def _has_y_scale(n: onnx.NodeProto) -> bool:
    from ..spec import get_spec

    i = get_spec(n.op_type).input_index("y_scale")
    return i < len(n.input) and bool(n.input[i])


def _one_scale(qs: list[onnx.NodeProto], inits: dict[str, TensorProto]) -> tuple[float | None, str]:
    """(the one per-tensor scale of these Qs, "") or (None / a scale, why they do not fold)."""
    values = set()
    for q in qs:
        attrs = {a.name: helper.get_attribute_value(a) for a in q.attribute}
        if attrs.get("saturate", 1) != 1:
            return None, f"{q.name}: a non-saturating QuantizeLinear"
        scale = inits.get(q.input[1]) if len(q.input) > 1 else None
        zp = inits.get(q.input[2]) if len(q.input) > 2 else None
        if scale is None or int(np.prod(scale.dims)) != 1:
            return None, f"{q.name}: its scale is not one constant value"
        if zp is None or zp.data_type != TensorProto.FLOAT8E4M3FN or np.any(_array(zp).astype(np.float32) != 0):
            return None, f"{q.name}: not a quantization to E4M3 with a zero point of 0"
        values.add(float(_array(scale).astype(np.float32).reshape(-1)[0]))
    if len(values) != 1:
        return None, f"QuantizeLinear nodes of {len(values)} different scales read y"
    return values.pop(), ""


def _array(t: TensorProto) -> np.ndarray:
    if t.data_type == TensorProto.FLOAT8E4M3FN:
        import ml_dtypes

        raw = np.frombuffer(t.raw_data, np.uint8) if t.raw_data else np.asarray(t.int32_data, np.uint8)
        return raw.view(ml_dtypes.float8_e4m3fn).reshape(tuple(t.dims))
    return numpy_helper.to_array(t)


def _fold(model: onnx.ModelProto, folded) -> None:
    """Each norm takes y_scale and writes its first Q's output; the Qs go, the other Qs' readers read
    that output, and the initializers and value_info nobody needs any more are dropped."""
    from ..spec import get_spec

    g = model.graph
    names = {t.name for t in g.initializer} | {o for n in g.node for o in n.output}
    drop, renamed, gone = set(), {}, set()
    for n, qs, scale in folded:
        y_scale = _unique(f"{n.name or n.op_type}/y_scale", names)
        g.initializer.append(numpy_helper.from_array(np.array([scale], np.float32), y_scale))
        i = get_spec(n.op_type).input_index("y_scale")
        while len(n.input) < i:
            n.input.append("")
        n.input.append(y_scale)
        gone.add(n.output[0])
        renamed[n.output[0]] = n.input[0]  # its shape readers (SHAPE_READERS) read x: y's shape
        n.output[0] = qs[0].output[0]
        for q in qs:
            drop.add(id(q))
            renamed[q.output[0]] = qs[0].output[0]
    kept = [n for n in g.node if id(n) not in drop]
    for n in kept:
        for k, i in enumerate(n.input):
            if i in renamed:
                n.input[k] = renamed[i]
    del g.node[:]
    g.node.extend(kept)
    for vi in [v for v in g.value_info if v.name in gone or (v.name in renamed and renamed[v.name] != v.name)]:
        g.value_info.remove(vi)
    read = {i for n in g.node for i in n.input}
    for t in [t for t in g.initializer if t.name not in read and t.name not in {i.name for i in g.input}]:
        g.initializer.remove(t)


def _unique(base: str, names: set[str]) -> str:
    name, i = base, 1
    while name in names:
        name, i = f"{base}_{i}", i + 1
    names.add(name)
    return name


def check_fp8_norms(model: onnx.ModelProto, nodes) -> None:
    """The FP8-output contract of the folded norms: y_scale float32 [1], every other input one
    float dtype, y float8e4m3fn."""
    from .fp16 import _tensor_types

    types = _tensor_types(model)
    inits = {t.name: t for t in model.graph.initializer}
    floats = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)
    bad = []
    for n in nodes:
        *operands, y_scale = list(n.input)
        seen = {types.get(i) for i in operands if i and types.get(i) in floats}
        if len(seen) > 1:
            bad.append(f"{n.name} ({n.op_type}): inputs of types {sorted(TensorProto.DataType.Name(t) for t in seen)}")
        s = inits.get(y_scale)
        if s is None or s.data_type != TensorProto.FLOAT or list(s.dims) != [1]:
            bad.append(f"{n.name} ({n.op_type}): y_scale is not a float32 [1] constant")
        if types.get(n.output[0], TensorProto.FLOAT8E4M3FN) != TensorProto.FLOAT8E4M3FN:
            bad.append(f"{n.name} ({n.op_type}): y is not float8e4m3fn")
    if bad:
        raise InputError("precision fp8 left FP8-output norms breaking their contract:\n  " + "\n  ".join(bad))


def _report(result, norms: list[Fp8Norm]) -> None:
    if result.fp8 is not None:
        result.fp8["norms"] = [asdict(x) for x in norms]
    if not norms:
        return
    n_fold = sum(x.form == "fp8_output" for x in norms)
    kept = [x for x in norms if x.form != "fp8_output"]
    note = (f"FP8 norm outputs: {n_fold} of {len(norms)} norm(s) feeding FP8 GEMMs write E4M3 themselves "
            f"(their QuantizeLinear folded in: one byte an element to the GEMMs)")
    if kept:
        why: dict[str, int] = {}
        for x in kept:
            key = x.reason.split(" (")[0]
            why[key] = why.get(key, 0) + 1
        note += f"; {len(kept)} keep the QuantizeLinear: " + "; ".join(f"{c} x {k}" for k, c in sorted(why.items()))
    result.notes.append(note)


__all__ = ["FP8_PLUGINS", "KEPT_QDQ", "KEPT_READ", "NORM_OPS", "Fp8Norm", "check_fp8_norms", "fold_norm_quantize"]
