"""The positions a fused node does not compute exactly, which verify leaves out of its comparisons.

A fused causal or sliding-window attention next to a key-padding row averages the keys a padded query
sees when every one of them is padding, where the original averages all keys
(``optfuse.fusions.attention.mask_bias``, "Exactness"). The fuse stage writes the mask input into such
a node's metadata (PADDED_QUERIES_KEY); :func:`padded_query_inputs` reads it back with the node's key
view (``causal``, ``window_left``), and :func:`padded_positions` finds, per feed, the positions (b, i)
of a tensor indexed by that mask whose query sees no real key. ``compare`` leaves them out of the
outputs, ``per_node`` out of the intermediates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx

from ..defaults import dim_expression, value_shape


#: Fused-node metadata (the fuse stage's, optfuse.fusions): the graph input whose zeros mark padded
#: query positions; the node (causal, window_left attributes) is not exact at a padded query that sees
#: no real key (a causal or window limit next to a key-padding row: optfuse.fusions.attention).
PADDED_QUERIES_KEY = "optfuse.padded_queries_inexact"
#: A node's view of the keys: (causal, window_left), the FlashAttention attributes (window_left -1: none),
#: and the name of its query-length dim where shape inference names it ("" otherwise): with a KV cache the
#: queries are the last Sq of the mask's keys (the op's offset Sk - Sq).
KeyView = tuple[int, int, str]


def padded_query_inputs(model: onnx.ModelProto) -> dict[str, list[KeyView]]:
    """Mask input -> the key views of the fused nodes of `model` (PADDED_QUERIES_KEY metadata) that
    may not be exact at a query whose visible keys are all padding in that mask."""
    nodes = [(n, p.value) for n in model.graph.node for p in n.metadata_props if p.key == PADDED_QUERIES_KEY]
    if not nodes:
        return {}
    from ..ir.shapes import infer_shapes

    shapes = named_shapes(infer_shapes(model))
    out: dict[str, list[KeyView]] = {}
    for n, mask in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        o = shapes.get(n.output[0]) or []  # o [B, H, Sq, D]
        query = o[2] if len(o) == 4 and isinstance(o[2], str) and not o[2].startswith("unk__") else ""
        view = (int(attrs.get("causal", 0)), int(attrs.get("window_left", -1)), query)
        if view not in out.setdefault(mask, []):
            out[mask].append(view)
    return out


def named_shapes(model: onnx.ModelProto) -> dict[str, list]:
    """The dims of each graph input, output and value_info of `model` (names for symbolic dims)."""
    return {v.name: value_shape(v) or [] for v in (*model.graph.input, *model.graph.value_info, *model.graph.output)}


def padded_positions(shapes: Mapping[str, Sequence[Any]], tensor: str, masks: Mapping[str, Sequence[KeyView]],
                     feeds: Sequence[Mapping[str, np.ndarray]] | None, ref: Sequence[Any], got: Sequence[Any],
                     by_size: bool = False) -> tuple[list[np.ndarray] | None, list[str], int]:
    """Per iteration, the positions (b, i) of `tensor` to compare, the masks that decide them and the
    tensor's axis of i; (None, [], 0) to compare every element. A mask [B, S] indexes a tensor's positions
    when its dims are named and, in `shapes` (named_shapes), the tensor's first dim has the mask's first
    name and a later one its second (``[batch, sequence, hidden]``, ``[batch, heads, sequence, head_dim]``),
    with the same sizes; or, with a KV cache, where a later dim is the query-length dim a key view names
    (``[batch, sequence, hidden]`` of a ``[batch, total_sequence]`` mask: its last positions); or, by size,
    where the first dim is B long and exactly one later dim is S long and named by an expression over
    other dims (``past_sequence + sequence``), or (`by_size`, per node: intermediates whose dims shape
    inference left unnamed) has no name. Position (b, i) is left out where some key view of the mask sees
    no nonzero mask entry from query i (keys j <= i when causal, j >= i - window_left with a window).
    at_positions takes the kept elements."""
    if not masks or feeds is None or not ref:
        return None, [], 0
    dims = list(shapes.get(tensor) or [])
    named = [m for m in masks if len(shapes.get(m) or []) == 2 and all(isinstance(d, str) for d in shapes[m])]
    indexing = [m for m in named if dims[:1] == list(shapes[m][:1]) and shapes[m][1] in dims[1:]]
    # with a KV cache: a tensor over the queries' dim ([batch, sequence]) of a mask over all keys
    # ([batch, total_sequence]), whose positions are the mask's last ones
    queries = {v[2] for m in named for v in masks[m] if v[2] and v[2] in dims[1:] and dims[:1] == list(shapes[m][:1])}
    tail = not indexing and len(queries) == 1
    named = indexing or ([m for m in named if queries & {v[2] for v in masks[m]}] if tail else named)
    if len({tuple(shapes[m]) for m in named}) != 1:  # none, or masks over different dims: no one set of positions
        return None, [], 0
    batch, seq = shapes[named[0]]
    shape = np.shape(ref[0])
    if indexing:
        axis = dims.index(seq, 1)
    elif tail:
        axis = dims.index(next(iter(queries)), 1)
    elif len(dims) == len(shape) >= 2 and feeds[0].get(named[0]) is not None:
        # by size: a dim named by an expression (a cache's past_sequence + sequence against the mask's
        # total_sequence); per node (`by_size`) also dims shape inference left unnamed
        b, s = np.shape(feeds[0][named[0]])
        derived = [isinstance(d, str) and dim_expression(d) is not None for d in dims]
        free = [x or (by_size and (d is None or (isinstance(d, str) and (d.startswith("unk__") or d in (batch, seq)))))
                for d, x in zip(dims, derived)]
        hits = [a for a in range(1, len(shape)) if free[a] and shape[a] == s]
        if not ((dims[0] == batch or free[0]) and shape[0] == b and len(hits) == 1 and (by_size or derived[hits[0]])):
            return None, [], 0
        axis = hits[0]
    else:
        return None, [], 0
    keep = []
    for feed, r, g in zip(feeds, ref, got):
        r, g = np.asarray(r), np.asarray(g)
        size = r.shape[axis] if r.ndim > axis else 0
        if r.shape != g.shape or any(m not in feed or feed[m].shape[0] != r.shape[0]
                                     or not (feed[m].shape[1] >= size if tail else feed[m].shape[1] == size)
                                     for m in named):
            return None, [], 0
        sees = np.logical_and.reduce([_sees_a_key(np.asarray(feed[m]) != 0, v) for m in named for v in masks[m]])
        keep.append(sees[:, sees.shape[1] - size:])  # the queries: the mask's last `size` positions
    return keep, named, axis


def at_positions(x: Any, keep: np.ndarray, axis: int) -> np.ndarray:
    """The elements of `x` at the kept positions (b, i) of padded_positions: [kept, other dims...]."""
    return np.moveaxis(np.asarray(x), axis, 1)[keep]


def _sees_a_key(real: np.ndarray, view: KeyView) -> np.ndarray:
    """[B, S] bool: query i of batch b sees at least one real key (``real`` [B, S]) under ``view`` (queries
    and keys at the same positions: a KV cache's queries are the last ones)."""
    causal, window_left = view[0], view[1]
    s = real.shape[1]
    seen = np.concatenate([np.zeros((real.shape[0], 1), np.int64), np.cumsum(real, axis=1)], axis=1)  # keys < j
    i = np.arange(s)
    hi = i + 1 if causal else np.full(s, s)
    lo = np.maximum(i - window_left, 0) if window_left >= 0 else np.zeros(s, np.int64)
    return seen[:, hi] - seen[:, lo] > 0
