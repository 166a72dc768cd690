"""Sanitize: shape inference (symbolic dims kept), constant folding, dead-node cleanup, toposort.

Matching relies on this: constants are gs.Constant (so eps/exponents/axes are readable),
tensors carry dtypes and shapes, and node order is topological.
"""

from __future__ import annotations

import logging

import onnx
import onnx_graphsurgeon as gs

from .load import _PROTO_LIMIT, model_bytes

log = logging.getLogger(__name__)

# Folding a constant bigger than this would duplicate weights (e.g. a transposed copy).
FOLD_SIZE_THRESHOLD = 64 << 20


def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """ONNX shape inference with data propagation; models past the protobuf limit are left as they are."""
    if model_bytes(model) > _PROTO_LIMIT:
        log.warning("model over 2 GiB: skipping in-memory shape inference")
        return model
    try:
        return onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception as exc:  # inference is best effort: a model onnxruntime runs is still valid input
        log.warning("shape inference failed: %s", str(exc).splitlines()[0])
        return model


def sanitize(model: onnx.ModelProto, fold_constants: bool = True) -> gs.Graph:
    """Return a clean graphsurgeon graph of `model` (the proto is not modified)."""
    graph = gs.import_onnx(infer_shapes(model))
    if fold_constants:
        _quiet_gs()
        graph.fold_constants(size_threshold=FOLD_SIZE_THRESHOLD, error_ok=True)
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    # folding can change shapes (e.g. constant Reshape targets): infer once more on the result
    graph = gs.import_onnx(infer_shapes(gs.export_onnx(graph)))
    return graph


def _quiet_gs() -> None:
    gs.logger.G_LOGGER.module_severity = gs.logger.G_LOGGER.ERROR
