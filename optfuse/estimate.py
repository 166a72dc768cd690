"""Stage `estimate`: the HBM traffic each fusion saves, computed once per fuse run.

A fusion saves the bytes its original nodes read and wrote minus what the fused node and the
standard nodes its rewrite added read and write (each input read once, each output written once).
Tensors are sized at the analysis dims (the recipe's opt shapes, or verify's defaults): one
onnxruntime shape inference over the graph before the rewrite together with the nodes the
rewrite added, so the tensors that fusing removed are sized too. A size that depends on a dim
nobody resolved makes that fusion's estimate ``None`` (``unknown`` in the report).

What the fused nodes still move is kept too (``moved_bytes``). For attention over a KV cache
(decode, chunked prefill) the fused node reads k and v after the cache concatenation, so each
attention node counts its K/V reads at the key length Sk = past + Sq (not Sq), at the number of
KV heads (the node takes them before any repeat_kv), next to q, the output and the mask row.
The analysis dims must then be consistent (``total_sequence = past_sequence + sequence`` for
:mod:`optfuse.models.decode` graphs); otherwise the sizes follow shape inference, which takes the
key length from the concatenation.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import onnx
import onnx_graphsurgeon as gs

from .ir.query import tensor_bytes
from .ir.shapes import concrete_shapes
from .rewrite import FusionResult, add_functions, inferable_model

# Ops whose output has the element count and dtype of their first input.
_SAME_SIZE = {"Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Identity"}


@dataclass
class TrafficEstimate:
    """Bytes each fused node saves per run and bytes it (with the nodes its rewrite added) still
    reads and writes, by fused node name; None when a size stays unknown."""

    dims: dict[str, int] = field(default_factory=dict)
    saved_bytes: dict[str, int | None] = field(default_factory=dict)
    moved_bytes: dict[str, int | None] = field(default_factory=dict)


def estimate_traffic(fused: onnx.ModelProto, result: FusionResult,
                     dims: dict[str, int] | None = None) -> TrafficEstimate:
    """The traffic estimate of a fuse run: `fused` and `result` as `fuse_model` returned them.

    dims: symbolic dim -> value (default: the dims the run recorded, ``result.dims``).
    """
    dims = dict(result.dims if dims is None else dims)
    estimate = TrafficEstimate(dims)
    if not result.accepted:
        return estimate
    original = result.original
    if original is None:
        raise ValueError("the fusion result holds no original graph (made by fuse_graph / fuse_model)")
    after = gs.import_onnx(fused)
    nodes = {n.name: n for n in after.nodes}
    added = [nodes[n] for a in result.accepted for n in [a.node_name, *a.added_nodes] if n in nodes]
    shapes = _shapes(original, fused, [n.name for n in added], dims)
    before_t, after_t = original.tensors(), after.tensors()
    for acc in result.accepted:
        before = _io_bytes(acc.replaced_io, (before_t, after_t), dims, shapes)
        new = [nodes[n] for n in [acc.node_name, *acc.added_nodes] if n in nodes]
        now = _io_bytes([tuple(t.name for t in [*n.inputs, *n.outputs] if t.name) for n in new],
                        (after_t, before_t), dims, shapes)
        estimate.saved_bytes[acc.node_name] = None if before is None or now is None else before - now
        estimate.moved_bytes[acc.node_name] = now
    return estimate


def _shapes(original: gs.Graph, fused: onnx.ModelProto, new_nodes: Sequence[str],
            dims: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """Concrete shapes of the original graph's tensors and of those the rewrite added, from one
    inference: the original graph plus the fused model's new nodes (an output of theirs that an
    original tensor already names is renamed; it has that tensor's shape)."""
    if not dims:
        return {}
    model = inferable_model(original)
    g = model.graph
    names = {i.name for i in g.initializer} | {v.name for v in g.input}
    names |= {o for n in g.node for o in n.output}
    wanted = set(new_nodes)
    renamed: dict[str, str] = {}
    for node in fused.graph.node:
        if node.name not in wanted:
            continue
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        for j, o in enumerate(copy.output):
            if o in names:
                renamed[o + "/estimate"] = o
                copy.output[j] = o + "/estimate"
        g.node.append(copy)
    g.initializer.extend(t for t in fused.graph.initializer if t.name not in names)
    shapes = concrete_shapes(add_functions(model), dims)
    for new, old in renamed.items():
        if old not in shapes and new in shapes:
            shapes[old] = shapes[new]
    return shapes


def _io_bytes(io: Iterable[tuple[str, ...]], graphs: tuple[dict[str, gs.Tensor], ...], dims: dict[str, int],
              shapes: dict[str, tuple[int, ...]]) -> int | None:
    """Bytes the named tensors take (looked up in `graphs` in order), or None if one is unknown."""
    total = 0
    for names in io:
        for name in names:
            t = next((g[name] for g in graphs if name in g), None)
            b = None if t is None else _bytes(t, dims, shapes)
            if b is None:
                return None
            total += b
    return total


def _bytes(t: gs.Tensor, dims: dict[str, int], shapes: dict[str, tuple[int, ...]], depth: int = 8) -> int | None:
    """Size of `t`: from the concrete shapes inferred for the analysis dims when known, else from its
    own (symbolic) shape, else that of the tensor a Reshape/Transpose/... made it from (shape
    inference often names a merged dim, e.g. batch * heads, with a fresh symbol)."""
    if t.name in shapes:
        b = tensor_bytes(t, dims, shape=shapes[t.name])
    else:
        b = tensor_bytes(t, dims)
    if b is None and depth and len(t.inputs) == 1 and t.inputs[0].op in _SAME_SIZE and t.inputs[0].inputs:
        return _bytes(t.inputs[0].inputs[0], dims, shapes, depth - 1)
    return b
