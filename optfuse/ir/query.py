"""Read-only questions about tensors and nodes: dtype names, constant values, attributes, static dims,
sizes, outside uses."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import onnx
import onnx_graphsurgeon as gs

_ONNX_NAMES = {
    onnx.TensorProto.FLOAT: "float32",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.BFLOAT16: "bfloat16",
    onnx.TensorProto.DOUBLE: "float64",
    onnx.TensorProto.INT64: "int64",
    onnx.TensorProto.INT32: "int32",
    onnx.TensorProto.INT8: "int8",
    onnx.TensorProto.UINT8: "uint8",
    onnx.TensorProto.BOOL: "bool",
}
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "int8": 1,
             "uint8": 1, "bool": 1}


def dtype_name(t: gs.Tensor) -> str | None:
    """'float32', 'float16', 'bfloat16', ... or None when unknown."""
    dt = t.dtype
    if dt is None:
        return None
    if isinstance(dt, int):
        return _ONNX_NAMES.get(dt)
    try:
        if dt == onnx.TensorProto.BFLOAT16:
            return "bfloat16"
    except Exception:
        pass
    name = np.dtype(dt).name if not isinstance(dt, str) else dt
    return "bfloat16" if "bfloat16" in str(name) else str(name)


def rank(t: gs.Tensor) -> int | None:
    return None if t.shape is None else len(t.shape)


def static_dim(t: gs.Tensor, axis: int) -> int | None:
    if t.shape is None or not (-len(t.shape) <= axis < len(t.shape)):
        return None
    d = t.shape[axis]
    return int(d) if isinstance(d, (int, np.integer)) and d >= 0 else None


def numel(t: gs.Tensor, dims: dict[str, int] | None = None, shape=None) -> int | None:
    """Element count, symbolic dims resolved from `dims`; None if something stays unknown.
    `shape` overrides the tensor's own (e.g. a concrete shape inferred for the analysis dims)."""
    if isinstance(t, gs.Constant):
        return int(np.prod(t.shape)) if t.shape is not None else None
    shape = t.shape if shape is None else shape
    if shape is None:
        return None
    n = 1
    for d in shape:
        if isinstance(d, (int, np.integer)) and d >= 0:
            n *= int(d)
        elif isinstance(d, str) and dims and d in dims:
            n *= int(dims[d])
        else:
            return None
    return n


def tensor_bytes(t: gs.Tensor, dims: dict[str, int] | None = None, shape=None) -> int | None:
    n = numel(t, dims, shape)
    dt = dtype_name(t)
    if n is None or dt not in _ITEMSIZE:
        return None
    return n * _ITEMSIZE[dt]


def outside_uses(t: gs.Tensor, inside: Iterable[gs.Node], graph: gs.Graph) -> list[str]:
    """Why `t` escapes the node set `inside`: names of outside consumers, or 'graph output'."""
    ids = {id(n) for n in inside}
    uses = [f"node {c.name or c.op}" for c in t.outputs if id(c) not in ids]
    if any(o is t for o in graph.outputs):
        uses.append("graph output")
    return uses


# Attributes that later opsets moved to inputs: op -> {attr: input index}.
ATTR_INPUTS = {
    "ReduceMean": {"axes": 1},
    "ReduceSum": {"axes": 1},
    "ReduceMax": {"axes": 1},
    "ReduceL2": {"axes": 1},
    "Unsqueeze": {"axes": 1},
    "Squeeze": {"axes": 1},
    "Split": {"split": 1},
}


def const_value(tensor: gs.Tensor) -> np.ndarray | None:
    """The value of a constant tensor (initializer or Constant node output), else None."""
    if isinstance(tensor, gs.Constant):
        return np.asarray(tensor.values)
    if len(tensor.inputs) == 1 and tensor.inputs[0].op == "Constant":
        node = tensor.inputs[0]
        val = node.attrs.get("value")
        if isinstance(val, gs.Constant):
            return np.asarray(val.values)
        for key in ("value_float", "value_int", "value_floats", "value_ints"):
            if key in node.attrs:
                return np.asarray(node.attrs[key])
    return None


def node_attr(node: gs.Node, name: str) -> Any:
    """An attribute's value, wherever the opset put it (attribute or constant input)."""
    if name in node.attrs:
        val = node.attrs[name]
        return val.values if isinstance(val, gs.Constant) else val
    idx = ATTR_INPUTS.get(node.op, {}).get(name)
    if idx is not None and idx < len(node.inputs) and node.inputs[idx].name:
        val = const_value(node.inputs[idx])
        if val is not None:
            return val.tolist()
    return None
