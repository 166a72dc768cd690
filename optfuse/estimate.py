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

import numpy as np
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
    #: per attention node, the work its mask leaves (`attention_sparsity`; absent where q's or k's shape is unknown)
    sparsity: dict[str, dict] = field(default_factory=dict)
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
        _record_sparsity(estimate, nodes.get(acc.node_name), dims, shapes)
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


# ------------------------------------------------------------------------------------------------
# Attention: the work a mask leaves
# ------------------------------------------------------------------------------------------------
ATTENTION_OPS = ("FlashAttention", "BlockSparseAttention")
#: The tile both attention kernels skip at: query and key blocks of this many rows.
ATTENTION_TILE = 128


def _record_sparsity(estimate: TrafficEstimate, node: gs.Node | None, dims: dict[str, int],
                     shapes: dict[str, tuple[int, ...]]) -> None:
    """``estimate.sparsity[node]`` for a fused attention node whose q and k shapes are known."""
    if node is not None and node.op in ATTENTION_OPS:
        work = _node_sparsity(node, dims, shapes)
        if work is not None:
            estimate.sparsity[node.name] = work


def _node_sparsity(node: gs.Node, dims: dict[str, int], shapes: dict[str, tuple[int, ...]]) -> dict | None:
    """`attention_sparsity` of one fused attention node at the analysis dims (q [B, H, Sq, D],
    k [B, Hkv, Sk, D]; BlockSparseAttention's layout from its constant inputs)."""
    q, k = node.inputs[0], node.inputs[1]
    qs, ks = (shapes.get(t.name) or _static(t) for t in (q, k))
    if qs is None or ks is None or len(qs) != 4 or len(ks) != 4:
        return None
    item = tensor_bytes(q, shape=(1,))
    layout = None
    if node.op == "BlockSparseAttention":
        if len(node.inputs) < 6 or not all(isinstance(t, gs.Constant) for t in node.inputs[4:6]):
            return None
        layout = (np.asarray(node.inputs[4].values), np.asarray(node.inputs[5].values))
    a = node.attrs
    return attention_sparsity(int(qs[0]), int(qs[1]), int(qs[2]), int(ks[2]), int(qs[3]), item or 4,
                              causal=int(a.get("causal", 0)), window_left=int(a.get("window_left", -1)),
                              window_right=int(a.get("window_right", -1)), layout=layout,
                              block=int(a.get("block_size", ATTENTION_TILE)))


def _static(t: gs.Tensor) -> tuple[int, ...] | None:
    if t.shape is None or not all(isinstance(d, (int, np.integer)) and d >= 0 for d in t.shape):
        return None
    return tuple(int(d) for d in t.shape)


def attention_sparsity(batch: int, heads: int, sq: int, sk: int, head_dim: int, itemsize: int, *,
                       causal: int = 0, window_left: int = -1, window_right: int = -1,
                       layout: tuple[np.ndarray, np.ndarray] | None = None, block: int = ATTENTION_TILE) -> dict:
    """The work of one attention node whose kernel skips empty tiles, against dense attention.

    Tiles are ``block x block`` (query block m, key block n). A tile is visited when the causal /
    window visibility (offset Sk - Sq, see the FlashAttention spec) or the BSR layout leaves a key
    in it. Score FLOPs (q @ k^T and p @ v, 4 * D per score) count every score of a visited tile;
    K/V HBM reads count, per query tile of each head, the K and V rows of its visited key blocks
    (dense: all Sk rows per query tile). Key padding is data-dependent and not counted.

    Returns block_density (visited tiles / all tiles, over the layout's heads), visible_fraction
    (visible scores / Sq * Sk), score_flops, dense_score_flops, flops_removed, kv_read_bytes,
    dense_kv_read_bytes and kv_reads_removed (fractions of the dense figures).
    """
    mb, nb = -(-sq // block), -(-sk // block)
    if mb == 0 or nb == 0:
        return {"tile": block, "sq": sq, "sk": sk, "block_density": 0.0, "visible_fraction": 0.0}
    lo, hi = _visible_range(sq, sk, causal, window_left, window_right)  # per query row, inclusive
    first = np.arange(mb) * block
    last = np.minimum(first + block, sq) - 1
    tiles = np.zeros((1, mb, nb), bool)
    n_idx = np.arange(nb)
    row_lo, row_hi = lo[first], hi[last]  # the union of a block's rows (both bounds rise with i)
    tiles[0] = (n_idx[None, :] * block <= row_hi[:, None]) & ((n_idx[None, :] + 1) * block - 1 >= row_lo[:, None])
    visible = np.clip(hi - lo + 1, 0, None).astype(np.float64).sum() / float(sq * sk)
    if layout is not None:
        offsets, indices = layout
        listed = np.zeros((offsets.shape[0], mb, nb), bool)
        for h in range(offsets.shape[0]):
            for m in range(min(mb, offsets.shape[1] - 1)):
                listed[h, m, indices[h, offsets[h, m]:offsets[h, m + 1]]] = True
        tiles = tiles & listed
        visible = None  # partial blocks depend on the bias
    width = np.minimum(block, sk - n_idx * block)  # keys per key block
    rows = (last - first + 1).astype(np.float64)
    scores = float((rows[None, :, None] * width[None, None, :] * tiles).sum(axis=(1, 2)).mean())
    dense_scores = float(sq) * float(sk)
    kv_rows = float((width[None, None, :] * tiles).sum(axis=(1, 2)).mean())
    per_head = batch * heads
    out = {
        "tile": block, "sq": sq, "sk": sk,
        "block_density": round(float(tiles.mean()), 6),
        "score_flops": int(4 * head_dim * scores * per_head),
        "dense_score_flops": int(4 * head_dim * dense_scores * per_head),
        "kv_read_bytes": int(2 * head_dim * itemsize * kv_rows * per_head),
        "dense_kv_read_bytes": int(2 * head_dim * itemsize * mb * sk * per_head),
    }
    if visible is not None:
        out["visible_fraction"] = round(float(visible), 6)
    out["flops_removed"] = round(1.0 - out["score_flops"] / max(1, out["dense_score_flops"]), 6)
    out["kv_reads_removed"] = round(1.0 - out["kv_read_bytes"] / max(1, out["dense_kv_read_bytes"]), 6)
    return out


def _visible_range(sq: int, sk: int, causal: int, window_left: int, window_right: int) -> tuple[np.ndarray, np.ndarray]:
    """Per query row i, the first and last visible key (j - i - (Sk - Sq) in [-wl, wr], <= 0 if causal)."""
    i = np.arange(sq, dtype=np.int64) + (sk - sq)
    hi = np.full(sq, sk - 1, np.int64)
    lo = np.zeros(sq, np.int64)
    if causal:
        hi = np.minimum(hi, i)
    if window_right >= 0:
        hi = np.minimum(hi, i + window_right)
    if window_left >= 0:
        lo = np.maximum(lo, i - window_left)
    return lo, hi
