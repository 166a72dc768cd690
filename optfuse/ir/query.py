"""Read-only questions about tensors: dtype names, static dims, sizes, outside uses."""

from __future__ import annotations

from collections.abc import Iterable

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


def onnx_dtype(name: str) -> int:
    return {v: k for k, v in _ONNX_NAMES.items()}[name]


def rank(t: gs.Tensor) -> int | None:
    return None if t.shape is None else len(t.shape)


def static_dim(t: gs.Tensor, axis: int) -> int | None:
    if t.shape is None or not (-len(t.shape) <= axis < len(t.shape)):
        return None
    d = t.shape[axis]
    return int(d) if isinstance(d, (int, np.integer)) and d >= 0 else None


def numel(t: gs.Tensor, dims: dict[str, int] | None = None) -> int | None:
    """Element count, symbolic dims resolved from `dims`; None if something stays unknown."""
    if isinstance(t, gs.Constant):
        return int(np.prod(t.shape)) if t.shape is not None else None
    if t.shape is None:
        return None
    n = 1
    for d in t.shape:
        if isinstance(d, (int, np.integer)) and d >= 0:
            n *= int(d)
        elif isinstance(d, str) and dims and d in dims:
            n *= int(dims[d])
        else:
            return None
    return n


def tensor_bytes(t: gs.Tensor, dims: dict[str, int] | None = None) -> int | None:
    n = numel(t, dims)
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
