"""Mask to kernel parameters: how a classified mask reaches the fused node.

The decomposed rules' mask is ``sum(bias terms) [+ where(cond, 0, fill)]`` (`MaskExpr`); its class
(`mask_class`) decides the fused node's bias input (none: a scalar 0, the mask's last query row --
key padding, one ``Slice`` shared by all layers -- or the whole mask), its ``causal`` flag and
``window_left``, and for a constant block mask the op itself (BlockSparseAttention with a BSR
layout computed here, see `block_layout`). See the package doc for the table per class.

Exactness. A mask passed whole is exact. A key-padding row next to ``causal = 1`` (and
``window_left = w - 1`` for a sliding window) changes only query rows whose every visible key is
padding: the unfused graph averages such a row over all keys (every score is absorbed by the same
finfo.min), the fused node over its causal / window keys. Such rows are padding positions
themselves (left padding or an all-zero mask row; with a window also right-padded queries more than
w - 1 positions past the last real key), so every real token is exact. Such a node's report facts
name the mask input (``padded_queries_inexact``), the fuse stage writes it into the node's metadata,
and verify leaves those positions out of its comparison (``optfuse.verify.padding``).
``FusionOptions.attention_full_mask`` passes such masks whole with causal = 0 and no window
(exact everywhere; the kernel then reads an Sq x Sk mask and visits every block).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from ...ir.query import const_value, dtype_name, rank
from ...ir.static import StaticEval
from ...pattern import Context, Match, NewTensor
from ...spec import get_spec
from .block_layout import BlockLayout, allowed_planes, block_layout
from .common import OP, AttentionFacts, need, np_dtype
from .mask_class import MaskClass, masked_below

INT64_MAX = np.iinfo(np.int64).max
#: A masked_fill value this low only matters for rows with no kept key.
WEAK_FILL = -1e4
BLOCK_SPARSE = "BlockSparseAttention"


@dataclass
class MaskParams:
    """How the fused node takes a mask: bias ``mode`` ("none"; "row": the mask's last query row;
    "key_max": its maximum over the query axis; "full"), the causal flag and the left window (-1: none)."""

    mode: str
    causal: int = 0
    window_left: int = -1


@dataclass
class MaskPlan:
    """What a mask gives the fused node: its bias input, attributes (causal, window_left), report
    facts, the op (FlashAttention, or BlockSparseAttention with ``layout_inputs`` after the bias)."""

    bias: Any
    attrs: dict[str, int]
    info: dict[str, Any]
    op: str = OP
    layout_inputs: list[Any] = field(default_factory=list)


def plan_mask(m: Match, ctx: Context, q: gs.Tensor, H: int,
              split: dict[str, int] | None = None) -> MaskPlan:
    """The mask's plan for the decomposed rules.

    split: bindings of 3-D [B*H, Sq, Sk] bias terms -> H (the batched variant).
    """
    st = ctx.facts.static
    dt = dtype_name(q)
    split = split or {}
    names = [n for n in ("bias3", "bias", "bias2") if n in m]
    terms = [m[n] for n in names]
    for n, t in zip(names, terms):
        if n in split:
            need(rank(t) is not None and rank(t) <= 3, f"bias {t.name!r} of the 3-D scores is not 3-D")
        else:
            check_bias_shape(t, H, st)
    where = None
    if "where" in m:
        inverted = "cond_inv" in m
        cond = m["cond_inv"] if inverted else m["cond"]
        fill_v = const_value(m["fill"])
        need(fill_v is not None and fill_v.size == 1, f"masked_fill value {m['fill'].name!r} is not a constant scalar")
        fill = float(np.asarray(fill_v, dtype=np.float64).reshape(()))
        need(dtype_name(cond) == "bool", f"Where condition {cond.name!r} is not bool")
        check_bias_shape(cond, H, st)
        where = (cond, fill, inverted)
    for t in terms:
        need(dtype_name(t) == dt, f"bias {t.name!r} has dtype {dtype_name(t)}, q has {dt}")
    if not terms and where is None:
        return MaskPlan(np.zeros((), dtype=np_dtype(dt)), {"causal": 0}, {"mask_class": "none"})

    expr = MaskExpr(terms, where, np_dtype(dt), {i: split[n] for i, n in enumerate(names) if n in split})
    cls = ctx.facts.of(AttentionFacts).masks.classify(expr.sources, expr.evaluate, expr.key)
    info = class_info(cls)
    if where is not None:
        _check_fill(where, cls, masked_below(np_dtype(dt)))
    layout = _constant_layout(expr, cls, H, q, st) if not ctx.options.attention_full_mask else None
    if layout is not None:
        return _layout_plan(ctx, expr, layout, st, info)
    params = mask_mode(cls, ctx.options.attention_full_mask)
    info.update(padded_queries_inexact(cls, params, bool(params.causal)))
    if params.mode == "none":
        bias = np.zeros((), dtype=np_dtype(dt))
    else:
        bias = shared_bias(ctx, (params.mode,) + expr.key, lambda: expr.build(st, params.mode, ctx.graph.opset))
    return MaskPlan(bias, mask_attrs(params), info)


def class_info(cls: MaskClass) -> dict[str, Any]:
    """The report facts of a mask class: its name, source, window and probe details."""
    info: dict[str, Any] = {"mask_class": cls.name}
    if cls.source:
        info["mask_source"] = cls.source
    if cls.window:
        info["window"] = cls.window
    if cls.detail:
        info["mask_detail"] = dict(cls.detail)
    return info


#: The report fact (and fused-node metadata ``optfuse.padded_queries_inexact``, which verify reads) naming
#: the graph input whose zeros mark the query positions a fused node may not compute exactly.
PADDED_QUERIES_INEXACT = "padded_queries_inexact"


def padded_queries_inexact(cls: MaskClass, params: MaskParams, causal: bool) -> dict[str, str]:
    """``{PADDED_QUERIES_INEXACT: mask input}`` where a key-padding row goes next to a causal or window
    limit (module doc, "Exactness": a padded query whose visible keys are all padding), else {}."""
    if cls.source and params.mode in ("row", "key_max") and (causal or params.window_left >= 0):
        return {PADDED_QUERIES_INEXACT: cls.source}
    return {}


def mask_attrs(params: MaskParams) -> dict[str, int]:
    """The fused node's mask attributes (window_left only when there is a window)."""
    attrs = {"causal": params.causal}
    if params.window_left >= 0:
        attrs["window_left"] = params.window_left
    return attrs


def mask_mode(cls: MaskClass, keep_full: bool) -> MaskParams:
    """How the fused node takes a mask of class ``cls`` (see the module doc for exactness).

    none / causal: no bias; padding: the key-padding row (the last query row: with no causal part
    and, for causal+padding, a last row that sees every key, it is the padding); causal+padding:
    causal = 1 and that row; sliding_window (keys i - w < j <= i): causal = 1, window_left = w - 1,
    no bias, and with padding the key-padding row as the mask's maximum over the query axis (the
    last row misses the keys before its window; a key the window ever shows is allowed in some row,
    so its column's maximum is 0 when it is real and the fill when it is padding); ``keep_full``
    passes padded causal / window masks whole with causal = 0. Any other class passes the mask whole.
    """
    base, pad = cls.base, cls.padding
    if base in ("none", "causal") and not pad:
        return MaskParams("none", int(base == "causal"))
    if base == "none":
        return MaskParams("row")
    if base == "causal" and not keep_full:
        return MaskParams("row", 1)
    if base == "sliding_window" and cls.window and not (pad and keep_full):
        return MaskParams("key_max" if pad else "none", 1, cls.window - 1)
    return MaskParams("full")


def _constant_layout(expr: "MaskExpr", cls: MaskClass, H: int, q: gs.Tensor, st: StaticEval) -> BlockLayout | None:
    """The BSR layout of a constant ``block`` mask whose every row keeps a key, when its [Sq, Sk]
    are the scores' (static) and its planes depend on the head at most; else None."""
    if cls.base != "block" or cls.padding or cls.fully_masked_rows:
        return None
    values = [const_value(s) for s in expr.sources]
    if any(v is None for v in values):
        return None
    planes = allowed_planes(expr.evaluate(values), H)
    if planes is None or not planes.any(axis=-1).all():
        return None
    sq = st.dim(q, 2)
    if sq is None or planes.shape[1] != sq:
        return None
    block = int(get_spec(BLOCK_SPARSE).attr("block_size").default)
    layout = block_layout(planes, block)
    return layout if layout.density < 1.0 else None  # every block listed: dense FlashAttention


def _layout_plan(ctx: Context, expr: "MaskExpr", layout: BlockLayout, st: StaticEval, info: dict) -> MaskPlan:
    """BlockSparseAttention over ``layout``: no bias when the layout is exact, else the whole mask;
    the layout tensors are int32 initializers shared by every layer with the same layout."""
    shared = ctx.facts.of(AttentionFacts).shared
    key = ("layout",) + layout.key()
    if key not in shared:
        n = sum(1 for k in shared if k[0] == "layout")
        shared[key] = [gs.Constant(f"optfuse/attention/layout{n}/block_offsets", layout.offsets),
                       gs.Constant(f"optfuse/attention/layout{n}/block_indices", layout.indices)]
    bias = np.zeros((), dtype=expr.dtype) if layout.exact else \
        shared_bias(ctx, ("full",) + expr.key, lambda: expr.build(st, "full", ctx.graph.opset))
    info = dict(info, block_size=layout.block, layout_heads=int(layout.offsets.shape[0]),
                block_density=round(layout.density, 4), partial_blocks_masked_by_bias=not layout.exact)
    return MaskPlan(bias, {"causal": layout.causal, "block_size": layout.block}, info, BLOCK_SPARSE, list(shared[key]))


def _check_fill(where, cls: MaskClass, masked: float) -> None:
    cond, fill, _ = where
    if fill <= masked or np.isneginf(fill):
        return
    need(fill <= WEAK_FILL, f"masked_fill value {fill:g} is too large to be an additive mask")
    need(const_value(cond) is not None and not cls.fully_masked_rows and not cls.padding,
         f"masked_fill value {fill:g} only masks exactly where every row keeps a key; "
         f"condition {cond.name!r} is data-dependent")


def check_bias_shape(t: gs.Tensor, H: int, st: StaticEval) -> None:
    r = rank(t)
    need(r is not None and r <= 4, f"mask/bias {t.name!r} does not broadcast to [B, H, Sq, Sk] (rank {r})")
    if r == 4:
        h = st.dim(t, 1)
        need(h in (None, 1, H), f"mask/bias {t.name!r} has {h} heads, the scores {H}")


def shared_bias(ctx: Context, key, make: Callable[[], Any]):
    """One NewTensor per mask for all layers (so one Slice node serves every fused node)."""
    shared = ctx.facts.of(AttentionFacts).shared
    if key not in shared:
        shared[key] = make()
    return shared[key]


class MaskExpr:
    """The additive mask a match applies: sum(terms) [+ where(cond, 0, fill)]."""

    def __init__(self, terms: list[gs.Tensor], where, np_dtype, split_heads: dict[int, int] | None = None):
        """split_heads: term index -> H for terms laid out [B*H, Sq, Sk] (made [B, H, Sq, Sk])."""
        self.terms, self.where, self.dtype = terms, where, np_dtype
        self.split = dict(split_heads or {})
        self.sources: list[gs.Tensor] = list(terms) + ([where[0]] if where else [])
        self.key = tuple(id(s) for s in self.sources) + ((where[1], where[2]) if where else ()) + \
            tuple(sorted(self.split.items()))

    def evaluate(self, values: list[np.ndarray]) -> np.ndarray:
        with np.errstate(over="ignore"):  # two masking terms (finfo.min + finfo.min) sum to -inf: masked as well
            return self._evaluate(values)

    def _evaluate(self, values: list[np.ndarray]) -> np.ndarray:
        out = None
        for i, v in enumerate(values[:len(self.terms)]):
            v = np.asarray(v, dtype=self.dtype)
            if i in self.split:
                v = _split_heads_np(v, self.split[i])
            out = v if out is None else out + v
        if self.where is not None:
            cond, fill, inverted = self.where
            c = np.asarray(values[-1]).astype(bool)
            # classified by where it masks (a weak fill such as -1e4 still masks; _check_fill decides
            # whether its value may become an additive bias)
            f = fill if fill <= masked_below(self.dtype) else -np.inf
            w = np.where(~c if inverted else c, self.dtype.type(0), self.dtype.type(f))
            out = w if out is None else (w + out)
        return out

    def build(self, st: StaticEval, mode: str, opset: int):
        """The mask as the fused node's bias: whole ("full"), its last query row ("row", [..., 1, Sk])
        or its maximum over the query axis ("key_max", [..., 1, Sk])."""
        if mode == "key_max":
            return _key_max(self.build(st, "full", opset), opset)
        row = mode == "row"
        parts = [_last_row(t, st) if row else t for t in self.terms]
        parts = [_split_heads(p, self.split[i], self.dtype) if i in self.split else p for i, p in enumerate(parts)]
        if self.where is not None:
            cond, fill, inverted = self.where
            c = _last_row(cond, st) if row else cond
            zero, f = np.zeros((), self.dtype), np.array(fill, dtype=self.dtype)
            args = [c, f, zero] if inverted else [c, zero, f]
            parts.append(NewTensor("Where", args, {}, self.dtype, _shape_of(c), "mask"))
        out = parts[0]
        for p in parts[1:]:
            out = NewTensor("Add", [out, p], {}, self.dtype, _broadcast_shape(_shape_of(out), _shape_of(p)), "mask")
        return out


def _split_heads_np(v: np.ndarray, H: int) -> np.ndarray:
    """[Z, X, Y] (Z = B*H, or 1) -> [B, H, X, Y]; lower ranks broadcast over Z."""
    v = v.reshape((1,) * (3 - v.ndim) + v.shape) if v.ndim < 3 else v
    return v[None] if v.shape[0] == 1 else v.reshape((-1, H) + v.shape[1:])


def _split_heads(t, H: int, dtype):
    """The NewTensor form of _split_heads_np: Unsqueeze to rank 4, then Reshape [-1, H, 0, 0]."""
    if isinstance(t, np.ndarray):
        return _split_heads_np(t, H)
    shape = _shape_of(t)
    r = len(shape) if shape is not None else rank(t)
    need(r is not None and r <= 3, "3-D attention bias of unknown rank")
    lead = (shape[0] if shape else None) if r == 3 else 1
    axes = list(range(4 - r))
    new_shape = [1] * (4 - r) + list(shape) if shape is not None else None
    u = NewTensor("Unsqueeze", [t, np.array(axes, np.int64)], {}, dtype, new_shape, "bias_4d")
    if r < 3 or lead == 1:
        return u
    out_shape = None if shape is None else [None, H, shape[1], shape[2]]
    return NewTensor("Reshape", [u, np.array([-1, H, 0, 0], np.int64)], {}, dtype, out_shape, "bias_heads")


def _shape_of(t) -> list | None:
    if isinstance(t, NewTensor):
        return t.shape
    if isinstance(t, np.ndarray):
        return list(t.shape)
    return None if t.shape is None else list(t.shape)


def _broadcast_shape(a: list | None, b: list | None) -> list | None:
    if a is None or b is None:
        return None
    n = max(len(a), len(b))
    a = [1] * (n - len(a)) + list(a)
    b = [1] * (n - len(b)) + list(b)
    out = []
    for x, y in zip(a, b):
        if x == 1:
            out.append(y)
        elif y == 1 or x == y:
            out.append(x)
        else:
            out.append(x if isinstance(x, (int, np.integer)) else y)
    return out


def _key_max(t, opset: int):
    """ReduceMax(t, axes=[-2], keepdims=1): the key-padding row of a padded sliding-window mask."""
    if isinstance(t, np.ndarray):
        return np.ascontiguousarray(t.max(axis=-2, keepdims=True))
    shape = _shape_of(t)
    shape = None if shape is None else list(shape[:-2]) + [1, shape[-1]]
    dtype = t.dtype
    if opset >= 18:  # axes became an input
        return NewTensor("ReduceMax", [t, np.array([-2], np.int64)], {"keepdims": 1}, dtype, shape, "mask_keys")
    return NewTensor("ReduceMax", [t], {"axes": [-2], "keepdims": 1}, dtype, shape, "mask_keys")


def _last_row(t: gs.Tensor, st: StaticEval):
    """t[..., -1:, :] (the key-padding row of a mask whose rows only differ by a causal mask)."""
    r = rank(t)
    if r is None or r < 2 or st.dim(t, -2) == 1 or const_value(t) is not None and const_value(t).shape[-2] == 1:
        return t
    if const_value(t) is not None:
        return np.ascontiguousarray(const_value(t)[..., -1:, :])
    shape = None if t.shape is None else list(t.shape[:-2]) + [1, t.shape[-1]]
    return NewTensor("Slice", [t, np.array([-1], np.int64), np.array([INT64_MAX], np.int64), np.array([-2], np.int64)],
                     {}, t.dtype, shape, "mask_row")
