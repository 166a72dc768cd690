"""What every attention planner shares: the plan type (the rules' bindings), the rejection helper,
dtype and head-dim checks against the FlashAttention spec, and the attention graph facts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from ...ir.query import dtype_name
from ...spec import get_spec
from .mask_class import MaskAnalyzer

OP = "FlashAttention"


@dataclass
class AttentionPlan:
    """The bindings an attention check returns and its rewrite emits: the fused node's op, inputs
    (q, k, v, bias [, block_offsets, block_indices]), its attributes, and facts for the report
    (mask class, window, scale, heads, ...)."""

    inputs: list[Any]
    attrs: dict[str, Any]
    info: dict[str, Any] = field(default_factory=dict)
    op: str = "FlashAttention"
    keep: list[gs.Node] = field(default_factory=list)  # input-side nodes that stay for outside readers
    after: list[Any] = field(default_factory=list)  # `After` nodes: outputs of the match others read


class AttentionFacts:
    """Attention's part of the graph facts cache (`GraphFacts.of(AttentionFacts)`): the mask
    classifier (its classes memoised per mask) and one bias NewTensor per mask and mode, which every
    layer reading that mask reuses (so one Slice node serves all fused nodes)."""

    def __init__(self, graph: gs.Graph) -> None:
        self.masks = MaskAnalyzer(graph)
        self.shared: dict[tuple, Any] = {}


class Reject(Exception):
    """A planner's reason not to fuse (the rule's check returns it as a string)."""


def need(cond: bool, reason: str) -> None:
    if not cond:
        raise Reject(reason)


def check_head_dim(D: int) -> None:
    """The op's kernels take only the spec's ``head_dims``."""
    allowed = get_spec(OP).limits.get("head_dims")
    need(allowed is None or D in allowed, f"head dim {D} is not supported by {OP} (head_dims {allowed})")


def check_dtypes(q: gs.Tensor, others: list[gs.Tensor], out: gs.Tensor) -> None:
    spec = get_spec(OP)
    dt = dtype_name(q)
    need(dt is not None, f"dtype of q {q.name!r} is unknown")
    need(dt in spec.inputs[0].dtypes, f"dtype {dt} is not supported by {OP}")
    for x in [*others, out]:
        need(dtype_name(x) == dt, f"{x.name!r} has dtype {dtype_name(x)}, q has {dt}")


def np_dtype(dt: str):
    if dt == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(dt)


def input_side_kept(m, graph: gs.Graph) -> list[gs.Node]:
    """The match's input-side nodes (producing the score product's operands or v) that something
    outside the match also reads, with their ancestors in the match: they stay in the graph (the
    fused node reads q, k, v from before them), so the match shrinks to its largest legal part
    instead of failing on them (DeBERTa's head-split q and k also feed the position products)."""
    inside = {id(n) for n in m.nodes}
    roots = [t for name in ("qk", "pv") if name in m for t in
             (m[name].inputs if name == "qk" else m[name].inputs[1:])]
    side: dict[int, gs.Node] = {}
    stack = list(roots)
    while stack:
        t = stack.pop()
        for n in t.inputs:
            if id(n) in inside and id(n) not in side:
                side[id(n)] = n
                stack.extend(n.inputs)
    graph_outputs = {id(t) for t in graph.outputs}
    used = [n for n in side.values()
            if any(id(c) not in inside for o in n.outputs for c in o.outputs) or
            any(id(o) in graph_outputs for o in n.outputs)]
    keep: dict[int, gs.Node] = {}
    stack = list(used)
    while stack:
        n = stack.pop()
        if id(n) in keep:
            continue
        keep[id(n)] = n
        stack.extend(p for t in n.inputs for p in t.inputs if id(p) in side)
    return list(keep.values())
