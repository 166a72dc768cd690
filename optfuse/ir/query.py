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


def concrete_shapes(graph: gs.Graph, dims: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape when the graph inputs' symbolic dims take the values in `dims`.

    Shape inference on the symbolic graph names many intermediate dims with fresh symbols
    (`unk__3` after a broadcasting Add, `batch*heads` after a Reshape); with static inputs
    onnxruntime's symbolic shape inference resolves them to numbers (ONNX's own inference stops
    at mask-building chains). Tensors that stay unresolved are left out.
    """
    if not dims:
        return {}
    from ..rewrite import add_functions  # optfuse nodes are inferred through their reference functions

    model = add_functions(gs.export_onnx(graph.copy(), do_type_check=False))
    for vi in model.graph.input:
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_param") and d.dim_param in dims:
                d.dim_value = int(dims[d.dim_param])
    del model.graph.value_info[:]
    model = _infer_static(model)
    shapes: dict[str, tuple[int, ...]] = {}
    for vi in list(model.graph.value_info) + list(model.graph.output) + list(model.graph.input):
        tt = vi.type.tensor_type
        if not tt.HasField("shape"):
            continue
        dims_ = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
        if all(d is not None for d in dims_):
            shapes[vi.name] = tuple(dims_)
    return shapes


def probe_dims(graph: gs.Graph) -> dict[str, int]:
    """Distinct primes for the graph inputs' symbolic dims: shapes equal under this assignment are
    equal symbolically (a broadcast dim of 1 never coincides with a probed dim)."""
    primes = [7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47]
    names: list[str] = []
    for t in graph.inputs:
        for d in t.shape or []:
            if isinstance(d, str) and d not in names:
                names.append(d)
    return {n: primes[i % len(primes)] + 48 * (i // len(primes)) for i, n in enumerate(names)}


def _infer_static(model: onnx.ModelProto) -> onnx.ModelProto:
    from .sanitize import infer_shapes

    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

        # The loop of SymbolicShapeInference.infer_shapes, minus its last step: when some shape
        # stays unknown, that dumps the model into the current directory and raises, whereas a
        # partial result is what we want (unknown tensors just stay out of the estimate).
        sym = SymbolicShapeInference(2**31 - 1, True, False, 0)
        sym._preprocess(model)
        while sym.run_:
            sym._infer_impl()
        sym._update_output_from_vi()
        return sym.out_mp_
    except Exception:  # unsupported op or a model it cannot follow: ONNX's inference is the fallback
        return infer_shapes(model)
