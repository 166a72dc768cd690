"""Sanitize: shape inference (symbolic dims kept), constant folding, dead-node cleanup, toposort.

Matching relies on this: constants are gs.Constant (so eps/exponents/axes are readable),
tensors carry dtypes and shapes, and node order is topological.
"""

from __future__ import annotations

import onnx
import onnx_graphsurgeon as gs

from .query import dtype_name
from .shapes import infer_shapes
from .weights import export_graph, import_graph

# Folding a constant bigger than this would duplicate weights (e.g. a transposed copy).
FOLD_SIZE_THRESHOLD = 64 << 20


def sanitize(model: onnx.ModelProto, fold_constants: bool = True, weights_dir=None) -> gs.Graph:
    """Return a clean graphsurgeon graph of `model` (the proto is not modified).

    weights_dir: where the tensors `model` left on disk live (``load_model(..., weights="disk")``).
    """
    graph = import_graph(infer_shapes(model), weights_dir)
    if fold_constants:
        _quiet_gs()
        graph.fold_constants(size_threshold=FOLD_SIZE_THRESHOLD, error_ok=True)
    remove_noop_casts(graph)
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    # folding can change shapes (e.g. constant Reshape targets): infer once more on the result
    graph = import_graph(infer_shapes(export_graph(graph)), weights_dir)
    return graph


def remove_noop_casts(graph: gs.Graph) -> int:
    """Bypass Casts to the dtype their input already has (TorchScript writes them for `.float()`
    on fp32 tensors); they would otherwise sit between a residual Add and its norm."""
    removed = 0
    outputs = {id(t) for t in graph.outputs}
    for node in graph.nodes:
        if node.op != "Cast" or len(node.inputs) != 1 or len(node.outputs) != 1:
            continue  # (folding leaves folded nodes without outputs until cleanup)
        src, dst = node.inputs[0], node.outputs[0]
        to = node.attrs.get("to")
        if to is None or dtype_name(src) is None or id(dst) in outputs:
            continue
        if dtype_name(src) != dtype_name(gs.Variable("_", dtype=_np_dtype_of(to))):
            continue
        for consumer in list(dst.outputs):
            for i, t in enumerate(consumer.inputs):
                if t is dst:
                    consumer.inputs[i] = src
        node.outputs.clear()
        removed += 1
    return removed


def _np_dtype_of(onnx_type: int):
    import onnx.helper

    try:
        return onnx.helper.tensor_dtype_to_np_dtype(onnx_type)
    except Exception:
        return onnx_type


def _quiet_gs() -> None:
    gs.logger.G_LOGGER.module_severity = gs.logger.G_LOGGER.ERROR
