"""Mask to bias: how a classified mask reaches the fused node (its bias input and causal flag).

The decomposed rules' mask is ``sum(bias terms) [+ where(cond, 0, fill)]`` (`MaskExpr`); its class
(`mask_class`) decides whether the node gets no bias, the mask's last query row (key padding, one
``Slice`` shared by all layers) or the whole mask, and whether ``causal=1`` (see the package doc).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from ...ir.query import const_value, dtype_name, rank
from ...ir.static import StaticEval
from ...pattern import Context, Match, NewTensor
from .common import AttentionFacts, need, np_dtype
from .mask_class import MaskClass, masked_below

INT64_MAX = np.iinfo(np.int64).max
#: A masked_fill value this low only matters for rows with no kept key.
WEAK_FILL = -1e4


def plan_mask(m: Match, ctx: Context, q: gs.Tensor, H: int,
              split: dict[str, int] | None = None) -> tuple[Any, int, dict]:
    """(bias input, causal flag, report info) for the decomposed rules.

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
        return np.zeros((), dtype=np_dtype(dt)), 0, {"mask_class": "none"}

    expr = MaskExpr(terms, where, np_dtype(dt), {i: split[n] for i, n in enumerate(names) if n in split})
    cls = ctx.facts.of(AttentionFacts).masks.classify(expr.sources, expr.evaluate, expr.key)
    info: dict[str, Any] = {"mask_class": cls.name}
    if cls.source:
        info["mask_source"] = cls.source
    if cls.window:
        info["window"] = cls.window
    if cls.detail:
        info["mask_detail"] = dict(cls.detail)
    if where is not None:
        _check_fill(where, cls, masked_below(np_dtype(dt)))
    mode, causal = mask_mode(cls, ctx.options.attention_full_mask)
    if mode == "none":
        return np.zeros((), dtype=np_dtype(dt)), causal, info
    return shared_bias(ctx, (mode,) + expr.key, lambda: expr.build(st, row=mode == "row")), causal, info


def mask_mode(cls: MaskClass, keep_full: bool) -> tuple[str, int]:
    """How the fused node takes a mask: ("none" | "row" | "full", causal flag).

    causal=1 next to a mask that already holds the causal structure skips the masked key blocks;
    it only changes rows with no allowed key at all (see the module doc). Those exist only with
    padding; for a sliding window right padding makes them too (a padded query whose window holds
    only padding), so a padded window keeps causal=0 and the whole mask.
    """
    base, pad = cls.base, cls.padding
    if base in ("none", "causal") and not pad:
        return "none", int(base == "causal")
    if base == "none":
        return "row", 0
    if base == "causal" and not keep_full:
        return "row", 1
    if base == "sliding_window":
        return "full", int(not pad)
    return "full", 0


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

    def build(self, st: StaticEval, row: bool):
        """The mask as the fused node's bias: whole, or its last query row ([..., 1, Sk])."""
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
