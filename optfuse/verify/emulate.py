"""BF16 models made runnable by onnxruntime's CPU provider, which has almost no BF16 kernels.

:func:`emulate_bf16` returns an FP32 model that computes what the BF16 model computes up to the
rounding inside each op: FP32 arithmetic on BF16-rounded values at the same points.

- BF16 initializers and constants become FP32 holding the same (BF16) values, exactly.
- A ``Cast(to=BFLOAT16)`` becomes ``Cast(to=BFLOAT16) -> Cast(to=FLOAT)``: the value is rounded to
  BF16 (round to nearest even, as onnxruntime's Cast does) and carried on in FP32.
- Every other node output that the BF16 model types BF16 is rounded the same way after the node
  (the op runs in FP32 on BF16-rounded inputs, its result is stored as BF16 would be), except
  the outputs of ops that only move or select values (Reshape, Transpose, Gather, ...): those are
  BF16-exact already.
- BF16 graph inputs become FP32 inputs rounded to BF16 on entry; BF16 outputs become FP32.

The optfuse reference functions compute in FP32 internally (Cast/CastLike to their inputs' type),
so they run unchanged. What this does not model: accumulation inside an op in BF16 (TensorRT
accumulates matrix products and reductions in FP32, as here).
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper, numpy_helper

#: Ops whose outputs hold only values of their inputs (exact in BF16 when the inputs are).
_VALUE_PRESERVING = {"Reshape", "Transpose", "Gather", "GatherElements", "GatherND", "Slice", "Squeeze", "Unsqueeze",
                     "Flatten", "Identity", "Expand", "Concat", "Split", "Tile", "Pad", "Where", "Max", "Min",
                     "ReduceMax", "ReduceMin", "Relu", "Neg", "Abs", "Dropout", "Shape", "Size", "DepthToSpace",
                     "SpaceToDepth"}

BF16_METHOD = ("BF16 emulated in FP32 (onnxruntime has no BF16 kernels on CPU): BF16 weights as FP32, values "
               "rounded to BF16 at each Cast to BF16 and after each op with a BF16 output")


def uses_bf16(model: onnx.ModelProto) -> bool:
    """Whether the graph holds BF16 weights, values or casts (onnxruntime's CPU provider cannot run it)."""
    g = model.graph
    if any(t.data_type == TensorProto.BFLOAT16 for t in g.initializer):
        return True
    if any(v.type.tensor_type.elem_type == TensorProto.BFLOAT16 for v in [*g.input, *g.output, *g.value_info]):
        return True
    return any(n.op_type == "Cast" and _attr(n, "to") == TensorProto.BFLOAT16 for n in g.node)


def emulate_bf16(model: onnx.ModelProto) -> onnx.ModelProto:
    """The FP32 emulation of a BF16 `model` (a new model; `model` is left as it is)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    types = _value_types(model)
    for t in g.initializer:
        _to_fp32(t)
    nodes: list[onnx.NodeProto] = []
    bf16_inputs = [v.name for v in g.input if v.type.tensor_type.elem_type == TensorProto.BFLOAT16]
    entry = {name: f"{name}/bf16_rounded" for name in bf16_inputs}
    for name in bf16_inputs:
        nodes += _round(name, entry[name])
    for n in g.node:
        for i, name in enumerate(n.input):
            if name in entry:
                n.input[i] = entry[name]
        for a in n.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                _to_fp32(a.t)
        if n.op_type == "Cast" and _attr(n, "to") == TensorProto.BFLOAT16:
            nodes += _round(n.input[0], n.output[0])
            continue
        nodes.append(n)
        if n.op_type in _VALUE_PRESERVING:
            continue
        for j, name in enumerate(n.output):
            if name and types.get(name) == TensorProto.BFLOAT16:
                n.output[j] = f"{name}/fp32"
                nodes += _round(n.output[j], name)
    del g.node[:]
    g.node.extend(nodes)
    for v in [*g.input, *g.output, *g.value_info]:
        if v.type.tensor_type.elem_type == TensorProto.BFLOAT16:
            v.type.tensor_type.elem_type = TensorProto.FLOAT
    return out


def _round(src: str, dst: str) -> list[onnx.NodeProto]:
    """dst = src rounded to BF16, as FP32 (nodes named after `dst`, a tensor name, so unique)."""
    mid = f"{dst}/as_bf16"
    return [helper.make_node("Cast", [src], [mid], name=f"{dst}/bf16_round/to_bf16", to=TensorProto.BFLOAT16),
            helper.make_node("Cast", [mid], [dst], name=f"{dst}/bf16_round/to_fp32", to=TensorProto.FLOAT)]


def _to_fp32(t: onnx.TensorProto) -> None:
    if t.data_type == TensorProto.BFLOAT16:
        t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype("float32"), t.name))


def _value_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor the graph names (ONNX shape inference fills the gaps)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # best effort: the declared types are enough where inference stops
        inferred = model
    g = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*g.input, *g.output, *g.value_info]
             if v.type.HasField("tensor_type")}
    types.update({t.name: t.data_type for t in g.initializer})
    return types


def _attr(node: onnx.NodeProto, name: str):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return None
