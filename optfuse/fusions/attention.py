"""Attention: o = softmax(scale * q @ k^T + bias) @ v, per head  ->  optfuse::FlashAttention.

The rules match the math, not one model's template: a Softmax over the last axis between two
MatMuls, with every step the torch exporters (TorchScript and dynamo; transformers' eager and SDPA
attention) write around it as an alternative::

    q ─► [Mul(√s) | Div(c)] ─────────────────────────────────────────────┐
                                                                          MatMul ─► [Mul(s) | Div(c)] ─┐
    k ─► [repeat_kv] ─► Transpose(0,1,3,2) ─┐                            │                            │
    k_bshd ─► Transpose(0,2,3,1) ───────────┼─► [Mul(√s) | Div(c)] ──────┘                            │
    k ─► [repeat_kv] ─► Reshape(-1,S,D) ─► Transpose(0,2,1) ─► Reshape(B,H,D,S)   (dynamo SDPA)     │
    any kᵀ [B,H,D,Sk] ─┘                                                                              │
                                                                                                      ▼
        ┌─ attention.additive:    [+ bias] [+ bias2]                       (padding / causal / position bias)
        └─ attention.masked_fill: Where(cond, ., fill) | Where(cond, fill, .) [+ bias]
                                                                                                      │
             [Cast] ─► Softmax(axis=-1) ─► [Cast] ─► [Where(IsNaN(p), 0, p)] [Dropout(eval)] ─► MatMul ─► o
                                                                                                 ▲
    v ─► [repeat_kv] ────────────────────────────────────────────────────────────────────────────┘

    repeat_kv (GQA):  Reshape(Expand(Unsqueeze(x, axes=[2]), [B,Hkv,G,S,D]), [B,Hkv*G,S,D])

- ``attention.batched``: 3-D attention over heads merged into the batch (BLOOM's baddbmm + ALiBi,
  DeBERTa-v2)::

      q, k, v [B,H,S,D] ─► Reshape [B*H,S,D] ─► MatMul(q3, Transpose(k3)) [scale] [+ bias3 (ALiBi)]
        ─► Reshape [B,H,S,S] ─► [+ mask | Where(cond, ., fill)] ─► Softmax ─► Reshape [B*H,S,S]
        ─► MatMul(., v3) ─► Reshape [B,H,S,D] = o

  the fused node reads the 4-D q, k, v and writes the final 4-D output; a 3-D bias term is split
  back into heads (new Unsqueeze + Reshape [-1, H, 0, 0]).
- ``attention.onnx``: ONNX's own ``Attention`` op (opset 23+) with 4-D q/k/v, an optional bool or
  additive ``attn_mask``, ``is_causal``, ``scale`` (no cache inputs, no softcap, only output Y used).
- ``attention.unrecognized``: never fuses; reports a Softmax -> MatMul that no rule above took,
  with the ops that produced its scores (e.g. BLOOM's 3-D baddbmm scores), so the report says why.

What the fused node gets:

- q as matched (after rotary embeddings, which stay outside; a scalar Mul/Div on q, on kᵀ and on
  the scores is folded into ``scale`` when it is a constant or computed from static dims, such as
  TorchScript's ``1 / sqrt(q.size(-1))``; any other scale on the scores is rejected);
- k in [B, Hkv, Sk, D]: the tensor before the transpose; when the head split wrote kᵀ directly
  (``Transpose(perm=[0,2,3,1])`` of [B, S, H, D]) a new ``Transpose(perm=[0,2,1,3])`` of the same
  input gives k (an existing one is reused); for any other kᵀ a new ``Transpose(perm=[0,1,3,2])``;
- k and v before ``repeat_kv`` when both are repeated that way (``num_kv_heads`` = their heads);
  otherwise the repeated tensors (``num_kv_heads = num_heads``, always exact);
- the mask, by what it computes (see ``_attention_mask``), recorded as ``info["mask_class"]``:

    none                 no bias (a scalar 0: the reference function needs 4 inputs)
    causal               causal=1, no bias
    padding              the key-padding row of the mask, [B, 1, 1, Sk] (one ``Slice`` of the
                         mask's last query row, shared by all layers)
    causal+padding       causal=1 and that row
    sliding_window       the mask as it is, and causal=1 (the kernel skips blocks above the diagonal)
    sliding_window+padding  the mask as it is (causal=0: right padding leaves padded queries whose
                         window holds no real key, and causal=1 would change those rows)
    anything else        the mask as it is (block, bias, dynamic, unknown, ...)

  ``Where(cond, scores, fill)`` becomes the bias ``Where(cond, 0, fill)`` (a new node) when that
  cannot change a result: fill <= -1e30 or -inf (it absorbs the score), or a constant cond whose
  every row keeps a key and fill <= -1e4; otherwise the match is rejected.

Head counts and head dims must be static: they come from shapes, or through Reshape/Transpose/
elementwise producers when shape inference left them symbolic (TorchScript's ``view(b, s, -1, d)``).

Not fused (with the reason): attention probabilities that are a graph output (``output_attentions``)
or read by anything else, live dropout, a non-constant scale, unknown head counts, a head dim outside
the kernel's ``head_dims``, a mask that does not broadcast to [B, H, Sq, Sk].

Exactness. Masks are passed with their own values, so the fused op computes what the graph did.
The one exception is ``causal+padding``: a query row whose every allowed key is padding (only left
padding or an all-zero mask row makes one; such a row is itself a padding position) gets the
average of its causal keys instead of the average of all keys. Every real token's output is exact,
and so is every output with right padding (each row keeps key 0). Set
``FusionOptions(attention_full_mask=True)`` (recipe ``fusions.attention_full_mask``) to pass such masks whole with causal=0 (exact for
every row, but the kernel then reads an Sq x Sk mask and computes the masked blocks).

Masks are classified in the mask's dtype: values <= -1e30 (fp16: <= -3e4) or -inf mask.

Target: ``optfuse::FlashAttention`` v1 (plugins/flash_attention).
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from ..ir.query import dtype_name, rank, static_dim
from ..pattern import AnyOf, Const, Context, FusionRule, Match, NewTensor, Rewrite, Var, const_value, maybe_cast, node_attr, op
from ..spec import get_spec
from ._attention_mask import MaskAnalyzer, MaskClass, masked_below

OP = "FlashAttention"
INT64_MAX = np.iinfo(np.int64).max
#: A masked_fill value this low only matters for rows with no kept key.
WEAK_FILL = -1e4


# ------------------------------------------------------------------------------------------------
# Patterns
# ------------------------------------------------------------------------------------------------
def _scalar(v: np.ndarray) -> bool:
    return v.size == 1 and np.issubdtype(v.dtype, np.floating)


def _axes_are(want: int, out_rank: int):
    def pred(axes) -> bool:
        if axes is None:
            return False
        a = [int(x) % out_rank for x in np.atleast_1d(np.asarray(axes))]
        return a == [want]

    return pred


def _kv(name: str):
    """x [B, H, S, D], or the GQA repeat of x_kv [B, Hkv, S, D] (binds both)."""
    repeat = op.Reshape(op.Expand(op.Unsqueeze(Var(f"{name}_kv"), axes=_axes_are(2, 5)), Var(f"{name}_rep_shape")),
                        Var(f"{name}_shape"), capture=f"{name}_rep", out=name)
    return AnyOf(repeat, Var(name))


def _k_transposed():
    k = _kv("k")
    return AnyOf(
        op.Transpose(k, perm=[0, 1, 3, 2], capture="k_t"),
        op.Transpose(Var("k_bshd"), perm=[0, 2, 3, 1], capture="k_t"),
        op.Reshape(op.Transpose(op.Reshape(k, Var("k_flat_shape"), out="k_flat"), perm=[0, 2, 1], out="k_flat_t"),
                   Var("k_t_shape"), capture="k_t"),
        Var("k_t_raw"),
    )


def _scaled(x, name: str):
    """x, or x times / divided by a static scalar (captured as name_mul / name_div)."""
    return AnyOf(op.Mul(x, Var(f"{name}_mul", where=_is_static_scalar)),
                 op.Div(x, Var(f"{name}_div", where=_is_static_scalar)), x)


def _is_static_scalar(t: gs.Tensor) -> bool:
    v = static_value(t)
    return v is not None and v.size == 1 and np.issubdtype(v.dtype, np.floating)


_FOLD = {
    "Cast": lambda x, a: x.astype(_cast_np(a.get("to"))),
    "Sqrt": lambda x, a: np.sqrt(x), "Reciprocal": lambda x, a: 1.0 / x, "Neg": lambda x, a: -x,
    "Mul": lambda x, y, a: x * y, "Div": lambda x, y, a: (x // y if np.issubdtype(np.asarray(x).dtype, np.integer)
                                                         else x / y),
    "Add": lambda x, y, a: x + y, "Sub": lambda x, y, a: x - y, "Pow": lambda x, y, a: np.power(x, y),
}


def _cast_np(to):
    import onnx

    return onnx.helper.tensor_dtype_to_np_dtype(int(to))


#: Placeholder for a dim Shape cannot tell (static_value(partial=True) keeps it, others reject it).
UNKNOWN_DIM = -(1 << 62)


# Memo of sdim / static_value (planning never mutates the graph); entries hold a weak reference to
# their tensor, so an id reused by another graph's tensor is a miss. Reset when the graph changes.
_MEMO: dict[str, Any] = {"graph": lambda: None, "sdim": {}, "value": {}}


def _memo(graph: gs.Graph | None) -> None:
    if graph is None or _MEMO["graph"]() is not graph:
        _MEMO.update(graph=weakref.ref(graph) if graph is not None else (lambda: None), sdim={}, value={})


def static_value(t: gs.Tensor, depth: int = 12, partial: bool = False) -> np.ndarray | None:
    """The value of a small tensor that only depends on constants and static dims (a scale written
    as ``1 / sqrt(q.size(-1))`` by TorchScript, a Reshape target built from Shape), else None.

    partial: shape vectors may hold UNKNOWN_DIM where a dim is not static.
    """
    out = _static_partial(t, depth)
    if out is not None and not partial and np.issubdtype(out.dtype, np.integer) and (out == UNKNOWN_DIM).any():
        return None
    return out


def _static_partial(t: gs.Tensor, depth: int) -> np.ndarray | None:
    key = (id(t), depth)
    hit = _MEMO["value"].get(key)
    if hit is None or hit[0]() is not t:
        hit = _MEMO["value"][key] = (weakref.ref(t), _static_value(t, depth))
    return hit[1]


def _static_value(t: gs.Tensor, depth: int) -> np.ndarray | None:
    v = const_value(t)
    if v is not None or depth <= 0 or len(t.inputs) != 1:
        return v
    node = t.inputs[0]
    ins = node.inputs
    try:
        if node.op == "Shape":
            r = rank(ins[0])
            if r is None:
                return None
            start, end = int(node.attrs.get("start", 0)), node.attrs.get("end")
            start = start % r if start < 0 else min(start, r)
            end = r if end is None else (int(end) % r if int(end) < 0 else min(int(end), r))
            dims = [sdim(ins[0], i) for i in range(start, end)]
            out = np.array([UNKNOWN_DIM if d is None else d for d in dims], np.int64)
        else:
            vals = [_static_partial(x, depth - 1) for x in ins if x.name]
            if any(x is None for x in vals):
                return None
            if node.op == "Gather":
                out = np.take(vals[0], vals[1], axis=int(node.attrs.get("axis", 0)))
            elif node.op == "Slice":
                starts, ends = vals[1], vals[2]
                axes = vals[3] if len(vals) > 3 else np.arange(len(starts))
                steps = vals[4] if len(vals) > 4 else np.ones(len(starts), np.int64)
                idx = [slice(None)] * vals[0].ndim
                for a, b, e, st in zip(axes, starts, ends, steps):
                    idx[int(a)] = slice(int(b), int(e), int(st))
                out = vals[0][tuple(idx)]
            elif node.op == "Concat":
                out = np.concatenate([np.atleast_1d(x) for x in vals], axis=int(node.attrs.get("axis", 0)))
            elif node.op in ("Squeeze", "Unsqueeze", "Reshape", "Identity", "Flatten"):
                x = vals[0]
                if node.op == "Squeeze":
                    out = x.reshape(()) if x.size == 1 and rank(t) == 0 else np.squeeze(x)
                elif node.op == "Unsqueeze":
                    out = x.reshape((1,) + x.shape) if x.ndim == 0 else (x.reshape(-1) if rank(t) == 1 else None)
                else:
                    out = x.reshape(-1) if rank(t) == 1 else (x.reshape(()) if rank(t) == 0 else None)
            elif node.op in _FOLD and len(vals) in (1, 2):
                if any((np.asarray(x) == UNKNOWN_DIM).any() for x in vals if np.issubdtype(np.asarray(x).dtype, np.integer)):
                    return None
                out = np.asarray(_FOLD[node.op](*vals, node.attrs))
            else:
                return None
    except Exception:  # noqa: BLE001 - anything odd is just "not static"
        return None
    return None if out is None else np.asarray(out)


def _scores():
    qk = op.MatMul(_scaled(Var("q"), "q"), _scaled(_k_transposed(), "k"), capture="qk")
    # the scores' own scale: any tensor here (a non-constant one is rejected with its reason)
    return AnyOf(op.Mul(qk, Var("s_mul")), op.Div(qk, Var("s_div")), qk)


def _probs(logits):
    softmax = op.Softmax(maybe_cast(logits), capture="softmax")
    # out="p" binds the probabilities; the NaN guard reads them twice, matched once (Var("p"))
    sm = AnyOf(op.Cast(softmax, out="p"), op.Softmax(maybe_cast(logits), capture="softmax", out="p"))
    guarded = AnyOf(
        op.Where(op.IsNaN(Var("p")), Const(0.0), sm, capture="nan_guard"),
        op.Dropout(sm, capture="dropout"),
        op.Dropout(sm, Var("drop_ratio"), capture="dropout"),
        op.Dropout(sm, Var("drop_ratio"), Var("drop_training"), capture="dropout"),
        sm,
    )
    return op.MatMul(guarded, _kv("v"), capture="pv")


def _additive():
    s = _scores()
    logits = AnyOf(op.Add(op.Add(s, Var("bias")), Var("bias2")), op.Add(s, Var("bias")), s)
    return _probs(logits)


def _masked_fill():
    s = _scores()
    filled = AnyOf(op.Where(Var("cond"), s, Var("fill"), capture="where"),
                   op.Where(Var("cond_inv"), Var("fill"), s, capture="where"))
    return _probs(AnyOf(op.Add(filled, Var("bias")), filled))


def _flat(name: str):
    """x3 = Reshape(x) with x [B, H, S, D] and x3 [B*H, S, D] (heads merged into the batch)."""
    return op.Reshape(Var(name), Var(f"{name}_flat_shape"), out=f"{name}3")


def _batched():
    """BLOOM-style 3-D attention: bmm over [B*H, S, D], the scores reshaped to 4-D around Softmax."""
    kt3 = AnyOf(op.Transpose(_flat("k"), perm=[0, 2, 1], capture="k_t"),
                op.Reshape(op.Transpose(Var("k"), perm=[0, 1, 3, 2]), Var("k_flat_shape"), out="k3"))
    qk = op.MatMul(_scaled(_flat("q"), "q"), _scaled(kt3, "k"), capture="qk")
    s3 = AnyOf(op.Mul(qk, Var("s_mul")), op.Div(qk, Var("s_div")), qk)
    s4 = op.Reshape(AnyOf(op.Add(s3, Var("bias3")), s3), Var("s_shape"), out="s4")
    filled = AnyOf(op.Where(Var("cond"), s4, Var("fill"), capture="where"),
                   op.Where(Var("cond_inv"), Var("fill"), s4, capture="where"))
    logits = AnyOf(op.Add(s4, Var("bias")), op.Add(filled, Var("bias")), filled, s4)
    softmax = op.Softmax(maybe_cast(logits), capture="softmax")
    sm = AnyOf(op.Cast(softmax, out="p"), op.Softmax(maybe_cast(logits), capture="softmax", out="p"))
    guarded = AnyOf(op.Where(op.IsNaN(Var("p")), Const(0.0), sm, capture="nan_guard"), sm)
    o3 = op.MatMul(op.Reshape(guarded, Var("p_flat_shape"), out="p3"), _flat("v"), capture="pv")
    return op.Reshape(o3, Var("o_shape"), capture="o_unflat")


_onnx_attention = AnyOf(
    op.Attention(Var("q"), Var("k"), Var("v"), Var("attn_mask"), capture="attn"),
    op.Attention(Var("q"), Var("k"), Var("v"), capture="attn"),
)


# ------------------------------------------------------------------------------------------------
# Static dims through layout ops (TorchScript leaves the head count symbolic)
# ------------------------------------------------------------------------------------------------
_ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Pow", "Where", "Neg", "Cast", "CastLike", "Relu", "Sigmoid", "Tanh", "Erf",
                "Exp", "Sqrt", "Reciprocal", "Abs", "Identity", "Max", "Min", "Gelu", "Softmax", "IsNaN", "Not",
                "And", "Or", "Equal", "Less", "Greater", "Dropout", "Clip", "Sin", "Cos", "Tril", "Trilu"}
_FIRST_INPUT = {"Cast", "Dropout", "RotaryEmbedding", "Clip", "Trilu", "Softmax", "LayerNormalization",
                "RMSNormalization", "Identity"}


def sdim(t: gs.Tensor, axis: int, depth: int = 16) -> int | None:
    """Static size of `t` along `axis`, looking through producers when shape inference left it symbolic."""
    key = (id(t), axis, depth)
    hit = _MEMO["sdim"].get(key)
    if hit is None or hit[0]() is not t:
        hit = _MEMO["sdim"][key] = (weakref.ref(t), _sdim(t, axis, depth))
    return hit[1]


def _sdim(t: gs.Tensor, axis: int, depth: int) -> int | None:
    r = rank(t)
    if r is None or not -r <= axis < r:
        return None
    axis %= r
    d = static_dim(t, axis)
    if d is not None:
        return d
    if isinstance(t, gs.Constant):
        return int(t.shape[axis])
    if depth <= 0 or len(t.inputs) != 1:
        return None
    node = t.inputs[0]
    ins = [x for x in node.inputs if x.name]
    nop = node.op
    if nop == "Transpose":
        perm = node.attrs.get("perm")
        perm = list(range(r))[::-1] if perm is None else list(perm)
        return sdim(node.inputs[0], perm[axis], depth - 1)
    if nop in _FIRST_INPUT or node.domain not in ("", "ai.onnx", None):
        # shape-preserving in their first input (norms, rotary embeddings, optfuse norm nodes)
        return sdim(ins[0], axis, depth - 1) if ins and rank(ins[0]) == r else None
    if nop in _ELEMENTWISE:
        return _broadcast_dim(ins, r, axis, depth)
    if nop == "Concat":
        cax = int(node.attrs.get("axis", 0)) % r
        if cax != axis:
            return _broadcast_dim(ins, r, axis, depth)
        parts = [sdim(x, axis, depth - 1) for x in ins]
        return sum(parts) if all(p is not None for p in parts) else None
    if nop == "Unsqueeze":
        axes = node_attr(node, "axes")
        if axes is None:
            return None
        axes = sorted(int(a) % r for a in np.atleast_1d(axes))
        if axis in axes:
            return 1
        return sdim(node.inputs[0], axis - sum(a < axis for a in axes), depth - 1)
    if nop == "Squeeze":
        ri = rank(node.inputs[0])
        axes = node_attr(node, "axes")
        if ri is None or axes is None:
            return None
        axes = {int(a) % ri for a in np.atleast_1d(axes)}
        kept = [i for i in range(ri) if i not in axes]
        return sdim(node.inputs[0], kept[axis], depth - 1) if axis < len(kept) else None
    if nop == "Expand":
        x = node.inputs[0]
        rx = rank(x)
        d = sdim(x, axis - (r - rx), depth - 1) if rx is not None and axis - (r - rx) >= 0 else 1
        if d is not None and d != 1:
            return d
        shape = const_value(node.inputs[1])
        if shape is not None and len(shape) == r and int(shape[axis]) > 1:
            return int(shape[axis])
        return d if shape is not None and len(shape) == r and int(shape[axis]) in (0, 1) else None
    if nop == "MatMul":
        if axis == r - 1:
            return sdim(node.inputs[1], -1, depth - 1)
        if axis == r - 2:
            return sdim(node.inputs[0], -2, depth - 1)
        return _broadcast_dim(ins, r, axis, depth)
    if nop == "Reshape":
        return _reshape_dim(node, t, axis, depth)
    if nop in ("Slice", "Split"):
        x = node.inputs[0]
        if rank(x) != r:
            return None
        if nop == "Split":
            sax = int(node.attrs.get("axis", 0)) % r
            return sdim(x, axis, depth - 1) if sax != axis else None
        axes = const_value(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3].name else np.arange(
            len(const_value(node.inputs[1]) if const_value(node.inputs[1]) is not None else []))
        if axes is None or len(axes) == 0:
            return None
        return sdim(x, axis, depth - 1) if axis not in {int(a) % r for a in axes} else None
    return None


def _broadcast_dim(ins, r, axis, depth) -> int | None:
    found = []
    for x in ins:
        rx = rank(x)
        if rx is None:
            return None
        ax = axis - (r - rx)
        if ax < 0:
            found.append(1)
            continue
        d = sdim(x, ax, depth - 1)
        if d is not None and d != 1:
            return d
        found.append(d)
    return 1 if found and all(f == 1 for f in found) else None


def _reshape_dim(node: gs.Node, t: gs.Tensor, axis: int, depth: int) -> int | None:
    x, shape_t = node.inputs[0], node.inputs[1]
    r = rank(t)
    entries = _shape_entries(shape_t, r)
    allowzero = int(node.attrs.get("allowzero", 0))
    if entries is not None and entries[axis] is not None:
        v = entries[axis]
        if v > 0:
            return v
        if v == 0 and not allowzero:
            return sdim(x, axis, depth - 1)
    # element count is preserved: cancel the symbolic dims both sides share, divide the static ones
    if x.shape is None or t.shape is None:
        return None
    in_syms: Counter = Counter()
    in_static = 1
    for i, d in enumerate(x.shape):
        if isinstance(d, (int, np.integer)) and d >= 0:
            in_static *= int(d)
            continue
        s = sdim(x, i, depth - 1)
        if s is not None:
            in_static *= s
        elif isinstance(d, str):
            in_syms[d] += 1
        else:
            return None
    out_syms: Counter = Counter()
    out_static = 1
    for i, d in enumerate(t.shape):
        if i == axis:
            continue
        if isinstance(d, (int, np.integer)) and d >= 0:
            out_static *= int(d)
        elif entries is not None and entries[i] is not None and entries[i] > 0:
            out_static *= entries[i]
        elif isinstance(d, str):
            out_syms[d] += 1
        else:
            return None
    if in_syms != out_syms or out_static == 0 or in_static % out_static:
        return None
    return in_static // out_static


def _shape_entries(shape_t: gs.Tensor, r: int | None) -> list[int | None] | None:
    """The Reshape target as known ints (None for a computed entry), or None if even its length is unknown."""
    v = const_value(shape_t)
    if v is not None:
        return [int(x) for x in v.reshape(-1)]
    sv = static_value(shape_t, partial=True)
    if sv is not None and sv.ndim == 1:
        out_sv = [None if int(x) == UNKNOWN_DIM else int(x) for x in sv]
        return out_sv if r is None or len(out_sv) == r else None
    if len(shape_t.inputs) == 1 and shape_t.inputs[0].op == "Concat":
        out: list[int | None] = []
        for p in shape_t.inputs[0].inputs:
            pv = static_value(p, partial=True)
            if pv is not None:
                out.extend(None if int(x) == UNKNOWN_DIM else int(x) for x in pv.reshape(-1))
            elif p.shape is not None and len(p.shape) == 1 and static_dim(p, 0) is not None:
                out.extend([None] * static_dim(p, 0))
            else:
                return None
        return out if r is None or len(out) == r else None
    return None


def _same_dim(a: gs.Tensor, ai: int, b: gs.Tensor, bi: int) -> bool | None:
    """True/False when the dims are provably equal/different, None when unknown."""
    da = a.shape[ai] if a.shape is not None and -len(a.shape) <= ai < len(a.shape) else None
    db = b.shape[bi] if b.shape is not None and -len(b.shape) <= bi < len(b.shape) else None
    sa, sb = sdim(a, ai), sdim(b, bi)
    if sa is not None and sb is not None:
        return sa == sb
    if isinstance(da, str) and isinstance(db, str) and da == db:
        return True
    return None


# ------------------------------------------------------------------------------------------------
# Planning one match
# ------------------------------------------------------------------------------------------------
@dataclass
class _Plan:
    inputs: list[Any]
    attrs: dict[str, Any]
    info: dict[str, Any] = field(default_factory=dict)


def _cache(ctx: Context) -> dict:
    c = ctx.__dict__.get("_attention")
    if c is None or c["graph"] is not ctx.graph:
        c = {"graph": ctx.graph, "plans": {}, "masks": MaskAnalyzer(ctx.graph), "shared": {}}
        ctx.__dict__["_attention"] = c
    return c


def _plan(m: Match, ctx: Context) -> _Plan | str:
    _memo(ctx.graph)
    plans = _cache(ctx)["plans"]
    key = id(m)
    if key not in plans:
        try:
            if "o_unflat" in m:
                plan = _plan_batched(m, ctx)
            elif "softmax" in m:
                plan = _plan_decomposed(m, ctx)
            else:
                plan = _plan_onnx(m, ctx)
            plans[key] = (m, plan)
        except _Reject as r:
            plans[key] = (m, str(r))
    return plans[key][1]


class _Reject(Exception):
    pass


def _need(cond: bool, reason: str) -> None:
    if not cond:
        raise _Reject(reason)


def _plan_decomposed(m: Match, ctx: Context) -> _Plan:
    g = ctx.graph
    sm = m["softmax"]
    logits = sm.inputs[0]
    r = rank(logits)
    default_axis = -1 if (g.opset or 17) >= 13 else 1
    axis = int(sm.attrs.get("axis", default_axis))
    _need(r is not None, "rank of the attention scores is unknown")
    _need(axis % r == r - 1, f"Softmax over axis {axis} of rank-{r} scores, not the key axis")
    probs = [sm.outputs[0], m.get("p")] + [m[n].outputs[0] for n in ("nan_guard", "dropout") if n in m]
    for p in filter(None, probs):
        _need(not any(o is p for o in g.outputs),
              f"attention probabilities {p.name!r} are a graph output (output_attentions)")
    if "dropout" in m:
        _check_dropout(m)
    q = m["q"]
    _need(rank(q) == 4, f"q {q.name!r} is not a 4-D [B, H, S, D] tensor (rank {rank(q)})")
    k, k_kv, k_new = _resolve_k(m)
    v, v_kv = m["v"], m.get("v_kv")
    _need(rank(v) == 4, f"v {v.name!r} is not a 4-D [B, H, S, D] tensor")
    scale = _scale(m)
    heads = _heads(m, q, k, k_kv, v, v_kv)
    attrs = {"scale": scale, "causal": 0, "num_heads": heads["H"], "num_kv_heads": heads["Hkv"]}
    k_in = k_kv if heads["gqa"] else (k_new if k_new is not None else k)
    v_in = v_kv if heads["gqa"] else v
    _check_dtypes(q, [k, v], m.root)
    bias, causal, info = _plan_mask(m, ctx, q, heads)
    attrs["causal"] = causal
    info.update(scale=scale, num_heads=heads["H"], num_kv_heads=heads["Hkv"], head_dim=heads["D"])
    if k_new is not None:
        info["k_layout"] = "transposed back from k^T"
    return _Plan([q, k_in, v_in, bias], attrs, info)


def _plan_batched(m: Match, ctx: Context) -> _Plan:
    """3-D variant: q, k, v are [B, H, S, D] tensors flattened to [B*H, S, D] around the bmm's.

    The Reshapes must only merge/split the leading (B, H) dims: each 3-D tensor keeps the last two
    dims of its 4-D source (checked where shapes tell), the scores and the output are split back
    into H heads, and k, v have the heads of q (one flattened batch index addresses all three).
    """
    g = ctx.graph
    sm = m["softmax"]
    r = rank(sm.inputs[0])
    axis = int(sm.attrs.get("axis", -1 if (g.opset or 17) >= 13 else 1))
    _need(r == 4 and axis % 4 == 3, "Softmax is not over the key axis of 4-D scores")
    for p in filter(None, [sm.outputs[0], m.get("p"), m.get("p3")]):
        _need(not any(o is p for o in g.outputs), f"attention probabilities {p.name!r} are a graph output")
    q, k, v = m["q"], m["k"], m["v"]
    out = m.root
    _need(all(rank(x) == 4 for x in (q, k, v, out)), "q/k/v/output are not 4-D around the 3-D bmm's")
    H, D = sdim(q, 1), sdim(q, 3)
    _need(H is not None and D is not None, f"number of heads or head dim of {q.name!r} is unknown")
    limits = get_spec(OP).limits.get("head_dims")
    _need(limits is None or D in limits, f"head dim {D} is not supported by {OP} (head_dims {limits})")
    _need(sdim(k, 1) == H and sdim(v, 1) == H, "3-D attention with k/v heads differing from q's")
    _need(sdim(k, 3) == D and sdim(v, 3) == D, "k/v head dims differ from q's")
    _need(sdim(m["s4"], 1) == H and sdim(out, 1) == H and sdim(out, 3) == D,
          "the 3-D scores / output are not split back into the query heads")
    for x4, x3 in ((q, m["q3"]), (v, m["v3"])) + (((k, m["k3"]),) if "k_t" in m else ()):
        _need(rank(x3) == 3 and sdim(x3, 2) == D, f"{x3.name!r} is not [B*H, S, D]")
        _need(_same_dim(x3, 1, x4, 2) is not False, f"{x3.name!r} does not keep the sequence of {x4.name!r}")
    if "k_t" not in m:
        _need(rank(m["k3"]) == 3 and sdim(m["k3"], 1) == D, f"{m['k3'].name!r} is not [B*H, D, S]")
    scale = _scale(m)
    _check_dtypes(q, [k, v], out)
    bias, causal, info = _plan_mask(m, ctx, q, {"H": H}, split={"bias3": H})
    info.update(scale=scale, num_heads=H, num_kv_heads=H, head_dim=D, layout="3-D batched heads")
    return _Plan([q, k, v, bias], {"scale": scale, "causal": causal, "num_heads": H, "num_kv_heads": H}, info)


def _check_dropout(m: Match) -> None:
    node = m["dropout"]
    training = m.get("drop_training")
    if training is not None:
        t = const_value(training)
        _need(t is not None, "dropout training_mode is not a constant")
        if bool(np.asarray(t).reshape(-1)[0]):
            ratio = m.get("drop_ratio")
            rv = const_value(ratio) if ratio is not None else np.array(0.5)
            _need(rv is not None and float(np.asarray(rv).reshape(-1)[0]) == 0.0,
                  "dropout on the attention probabilities is live (training_mode=1)")
    _need(len(node.outputs) < 2 or not node.outputs[1].outputs, "dropout mask output is used")


def _resolve_k(m: Match) -> tuple[gs.Tensor, gs.Tensor | None, NewTensor | None]:
    """(k as [B, Hk, Sk, D] tensor or its source, the un-repeated k or None, a NewTensor giving k or None)."""
    if "k_bshd" in m:
        src = m["k_bshd"]
        _need(rank(src) == 4, f"head split {src.name!r} is not 4-D")
        existing = next((c.outputs[0] for c in src.outputs if c.op == "Transpose" and c is not m["k_t"]
                         and list(c.attrs.get("perm", [])) == [0, 2, 1, 3]), None)
        if existing is not None:
            return existing, None, None
        shape = None if src.shape is None else [src.shape[0], src.shape[2], src.shape[1], src.shape[3]]
        return src, None, NewTensor("Transpose", [src], {"perm": [0, 2, 1, 3]}, src.dtype, shape, "k")
    if "k_t_raw" in m:
        kt = m["k_t_raw"]
        _need(rank(kt) == 4, f"k^T {kt.name!r} is not 4-D")
        shape = None if kt.shape is None else [kt.shape[0], kt.shape[1], kt.shape[3], kt.shape[2]]
        return kt, None, NewTensor("Transpose", [kt], {"perm": [0, 1, 3, 2]}, kt.dtype, shape, "k")
    k = m["k"]
    _need(rank(k) == 4, f"k {k.name!r} is not 4-D")
    if "k_flat" in m:
        kt = m["k_t"].outputs[0]
        flat = m["k_flat"]
        proofs = [rank(flat) == 3, rank(kt) == 4, _same_dim(flat, 1, k, 2), _same_dim(flat, 2, k, 3),
                  _same_dim(kt, 0, k, 0), _same_dim(kt, 1, k, 1), _same_dim(kt, 2, k, 3), _same_dim(kt, 3, k, 2)]
        _need(all(p is True for p in proofs),
              "cannot prove that Reshape/Transpose/Reshape of k is k^T (shapes unknown)")
    return k, m.get("k_kv"), None


def _scale(m: Match) -> float:
    scale = 1.0
    for name, inv in (("q_mul", False), ("q_div", True), ("k_mul", False), ("k_div", True)):
        if name in m:
            c = float(np.asarray(static_value(m[name]), dtype=np.float64).reshape(()))
            scale *= 1.0 / c if inv else c
    for name, inv in (("s_mul", False), ("s_div", True)):
        if name in m:
            t = m[name]
            val = static_value(t)
            _need(val is not None, f"attention scores are scaled by a non-constant tensor {t.name!r}")
            _need(val.size == 1, f"attention scale {t.name!r} is not a scalar (shape {list(val.shape)})")
            c = float(np.asarray(val, dtype=np.float64).reshape(()))
            scale *= 1.0 / c if inv else c
    _need(np.isfinite(scale) and scale != 0.0, f"attention scale {scale} is not a finite non-zero number")
    return float(scale)


def _heads(m: Match, q, k, k_kv, v, v_kv) -> dict[str, Any]:
    H, D = sdim(q, 1), sdim(q, 3)
    _need(H is not None, f"number of query heads of {q.name!r} is unknown")
    _need(D is not None, f"head dim of {q.name!r} is unknown")
    limits = get_spec(OP).limits.get("head_dims")
    _need(limits is None or D in limits, f"head dim {D} is not supported by {OP} (head_dims {limits})")
    if "k_bshd" in m:
        Hk, Dk = sdim(m["k_bshd"], 2), sdim(m["k_bshd"], 3)
    elif "k_t_raw" in m:
        Hk, Dk = sdim(k, 1), sdim(k, 2)
    else:
        Hk, Dk = sdim(k, 1), sdim(k, 3)
    Hv, Dv = sdim(v, 1), sdim(v, 3)
    _need(Dk == D, f"k head dim {Dk} differs from q head dim {D}")
    _need(Dv == D, f"v head dim {Dv} differs from q head dim {D} (the op needs one head dim)")
    gqa = False
    if k_kv is not None and v_kv is not None:
        hk, hv = sdim(k_kv, 1), sdim(v_kv, 1)
        same = all(_same_dim(a, i, b, i) is not False for a, b in ((k, k_kv), (v, v_kv)) for i in (0, 2, 3))
        if hk is not None and hk == hv and H % hk == 0 and same and Hk in (None, H) and Hv in (None, H) \
                and rank(k_kv) == 4 and rank(v_kv) == 4:
            gqa = True
            Hk = Hv = hk
    _need(Hk is not None and Hv is not None, "number of key/value heads is unknown")
    _need(Hk == Hv, f"k has {Hk} heads but v has {Hv}")
    _need(Hk in (H, 1) or (gqa and H % Hk == 0), f"{H} query heads cannot share {Hk} key/value heads")
    for x, what in ((k, "k"), (v, "v")):
        _need(_same_dim(q, 0, x, 0) is not False, f"batch of {what} differs from q's (broadcast batch)")
    return {"H": H, "Hkv": Hk, "D": D, "gqa": gqa}


def _check_dtypes(q, others, out) -> None:
    spec = get_spec(OP)
    dt = dtype_name(q)
    _need(dt is not None, f"dtype of q {q.name!r} is unknown")
    _need(dt in spec.inputs[0].dtypes, f"dtype {dt} is not supported by {OP}")
    for x in [*others, out]:
        _need(dtype_name(x) == dt, f"{x.name!r} has dtype {dtype_name(x)}, q has {dt}")


# ------------------------------------------------------------------------------------------------
# Masks
# ------------------------------------------------------------------------------------------------
def _np(dt: str):
    if dt == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(dt)


def _plan_mask(m: Match, ctx: Context, q: gs.Tensor, heads: dict,
               split: dict[str, int] | None = None) -> tuple[Any, int, dict]:
    """(bias input, causal flag, report info) for the decomposed rules.

    split: bindings of 3-D [B*H, Sq, Sk] bias terms -> H (the batched variant).
    """
    dt = dtype_name(q)
    split = split or {}
    names = [n for n in ("bias3", "bias", "bias2") if n in m]
    terms = [m[n] for n in names]
    for n, t in zip(names, terms):
        if n in split:
            _need(rank(t) is not None and rank(t) <= 3, f"bias {t.name!r} of the 3-D scores is not 3-D")
        else:
            _check_bias_shape(t, heads["H"])
    where = None
    if "where" in m:
        inverted = "cond_inv" in m
        cond = m["cond_inv"] if inverted else m["cond"]
        fill_v = const_value(m["fill"])
        _need(fill_v is not None and fill_v.size == 1, f"masked_fill value {m['fill'].name!r} is not a constant scalar")
        fill = float(np.asarray(fill_v, dtype=np.float64).reshape(()))
        _need(dtype_name(cond) == "bool", f"Where condition {cond.name!r} is not bool")
        _check_bias_shape(cond, heads["H"])
        where = (cond, fill, inverted)
    for t in terms:
        _need(dtype_name(t) == dt, f"bias {t.name!r} has dtype {dtype_name(t)}, q has {dt}")
    if not terms and where is None:
        return np.zeros((), dtype=_np(dt)), 0, {"mask_class": "none"}

    expr = _MaskExpr(terms, where, _np(dt), {i: split[n] for i, n in enumerate(names) if n in split})
    cls = _cache(ctx)["masks"].classify(expr.sources, expr.evaluate, expr.key)
    info: dict[str, Any] = {"mask_class": cls.name}
    if cls.source:
        info["mask_source"] = cls.source
    if cls.window:
        info["window"] = cls.window
    if cls.detail:
        info["mask_detail"] = dict(cls.detail)
    if where is not None:
        _check_fill(where, cls, masked_below(_np(dt)))
    mode, causal = _mask_mode(cls, ctx.options.attention_full_mask)
    if mode == "none":
        return np.zeros((), dtype=_np(dt)), causal, info
    return _shared(ctx, (mode,) + expr.key, lambda: expr.build(row=mode == "row")), causal, info


def _mask_mode(cls: MaskClass, keep_full: bool) -> tuple[str, int]:
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
    _need(fill <= WEAK_FILL, f"masked_fill value {fill:g} is too large to be an additive mask")
    _need(const_value(cond) is not None and not cls.fully_masked_rows and not cls.padding,
          f"masked_fill value {fill:g} only masks exactly where every row keeps a key; "
          f"condition {cond.name!r} is data-dependent")


def _check_bias_shape(t: gs.Tensor, H: int) -> None:
    r = rank(t)
    _need(r is not None and r <= 4, f"mask/bias {t.name!r} does not broadcast to [B, H, Sq, Sk] (rank {r})")
    if r == 4:
        h = sdim(t, 1)
        _need(h in (None, 1, H), f"mask/bias {t.name!r} has {h} heads, the scores {H}")


def _shared(ctx: Context, key, make: Callable[[], Any]):
    """One NewTensor per mask for all layers (so one Slice node serves every fused node)."""
    shared = _cache(ctx)["shared"]
    if key not in shared:
        shared[key] = make()
    return shared[key]


class _MaskExpr:
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

    def build(self, row: bool):
        """The mask as the fused node's bias: whole, or its last query row ([..., 1, Sk])."""
        parts = [_last_row(t) if row else t for t in self.terms]
        parts = [_split_heads(p, self.split[i], self.dtype) if i in self.split else p for i, p in enumerate(parts)]
        if self.where is not None:
            cond, fill, inverted = self.where
            c = _last_row(cond) if row else cond
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
    _need(r is not None and r <= 3, "3-D attention bias of unknown rank")
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


def _last_row(t: gs.Tensor):
    """t[..., -1:, :] (the key-padding row of a mask whose rows only differ by a causal mask)."""
    r = rank(t)
    if r is None or r < 2 or sdim(t, -2) == 1 or const_value(t) is not None and const_value(t).shape[-2] == 1:
        return t
    if const_value(t) is not None:
        return np.ascontiguousarray(const_value(t)[..., -1:, :])
    shape = None if t.shape is None else list(t.shape[:-2]) + [1, t.shape[-1]]
    return NewTensor("Slice", [t, np.array([-1], np.int64), np.array([INT64_MAX], np.int64), np.array([-2], np.int64)],
                     {}, t.dtype, shape, "mask_row")


# ------------------------------------------------------------------------------------------------
# ONNX Attention (opset 23)
# ------------------------------------------------------------------------------------------------
def _plan_onnx(m: Match, ctx: Context) -> _Plan:
    node = m["attn"]
    q, k, v = m["q"], m["k"], m["v"]
    _need(all(rank(x) == 4 for x in (q, k, v)), "Attention with 3-D (packed heads) inputs is not supported")
    for j, o in enumerate(node.outputs[1:], start=1):
        _need(not o.outputs and not any(o is g for g in ctx.graph.outputs),
              f"Attention output {j} ({o.name!r}: cache or scores) is used")
    softcap = float(node.attrs.get("softcap", 0.0) or 0.0)
    _need(softcap == 0.0, f"Attention softcap {softcap} is not supported")
    for a in ("left_window_size", "right_window_size"):
        _need(int(node.attrs.get(a, -1)) == -1, f"Attention {a} is not supported")
    H, D = sdim(q, 1), sdim(q, 3)
    Hk, Hv = sdim(k, 1), sdim(v, 1)
    _need(None not in (H, D, Hk, Hv), "number of heads or head dim of the Attention inputs is unknown")
    limits = get_spec(OP).limits.get("head_dims")
    _need(limits is None or D in limits, f"head dim {D} is not supported by {OP} (head_dims {limits})")
    _need(sdim(k, 3) == D and sdim(v, 3) == D, "k/v head dims differ from q's")
    _need(Hk == Hv and H % Hk == 0, f"{H} query heads cannot share {Hk} key/value heads")
    _check_dtypes(q, [k, v], node.outputs[0])
    scale = node.attrs.get("scale")
    scale = float(scale) if scale is not None else 1.0 / float(np.sqrt(D))
    causal = int(node.attrs.get("is_causal", 0))
    if causal:
        _need(_same_dim(q, 2, k, 2) is True,
              "is_causal with query and key lengths that may differ (ONNX and the op align the diagonal differently)")
    dt = dtype_name(q)
    info: dict[str, Any] = {"mask_class": "causal" if causal else "none", "scale": scale, "num_heads": H,
                            "num_kv_heads": Hk, "head_dim": D}
    bias: Any = np.zeros((), dtype=_np(dt))
    mask = m.get("attn_mask")
    if mask is not None:
        _check_bias_shape(mask, H)
        _need(_same_dim(mask, -1, k, 2) is True, "attn_mask may be shorter than the keys (ONNX pads it)")
        if dtype_name(mask) == "bool":
            expr = _MaskExpr([], (mask, float("-inf"), False), _np(dt))
        else:
            _need(dtype_name(mask) == dt, f"attn_mask has dtype {dtype_name(mask)}, q has {dt}")
            expr = _MaskExpr([mask], None, _np(dt))
        cls = _cache(ctx)["masks"].classify(expr.sources, expr.evaluate, expr.key)
        mode, mask_causal = _mask_mode(cls, ctx.options.attention_full_mask)
        info["mask_class"] = ("causal+" if causal and cls.base != "causal" else "") + cls.name
        if cls.source:
            info["mask_source"] = cls.source
        causal = int(causal or mask_causal)
        if mode != "none":
            bias = _shared(ctx, (mode,) + expr.key, lambda: expr.build(row=mode == "row"))
    attrs = {"scale": scale, "causal": causal, "num_heads": H, "num_kv_heads": Hk}
    return _Plan([q, k, v, bias], attrs, info)


# ------------------------------------------------------------------------------------------------
# Rules
# ------------------------------------------------------------------------------------------------
def _check(m: Match, ctx: Context) -> str | None:
    p = _plan(m, ctx)
    return p if isinstance(p, str) else None


def _rewrite(m: Match, ctx: Context) -> Rewrite:
    p = _plan(m, ctx)
    assert not isinstance(p, str), p
    out = m["attn"].outputs[0] if "attn" in m else m.root
    return Rewrite(OP, list(p.inputs), [out], dict(p.attrs), dict(p.info))


# ------------------------------------------------------------------------------------------------
# Diagnostics: an attention-like Softmax -> MatMul no rule above recognised
# ------------------------------------------------------------------------------------------------
def _unrecognized():
    sm = op.Softmax(Var("logits"), capture="softmax", out="p")
    probs = AnyOf(op.Where(op.IsNaN(Var("p")), Const(0.0), sm), op.Reshape(sm, Var("_p_shape")), op.Cast(sm), sm)
    return op.MatMul(probs, Var("v"))


def _explain(m: Match, ctx: Context) -> str:
    """Why a Softmax -> MatMul stayed unfused: the ops that produce its scores."""
    _memo(ctx.graph)
    chain, t = [], m["logits"]
    for _ in range(8):
        if len(t.inputs) != 1:
            break
        node = t.inputs[0]
        chain.append(node.op)
        if node.op in ("MatMul", "Gemm", "Einsum"):
            break
        live = [x for x in node.inputs if x.name and const_value(x) is None and dtype_name(x) != "bool"]
        if not live:
            break
        t = max(live, key=lambda x: rank(x) or 0)  # the scores, not a broadcast mask or scale
    why = "the scores are not MatMul(q, k^T) [* scale] [+ bias | masked_fill]"
    if "Reshape" in chain:
        why = "the scores are reshaped between MatMul(q, k^T) and Softmax (3-D [B*H, S, D] batched heads)"
    elif chain and chain[-1] == "Einsum":
        why = "the scores come from an Einsum"
    return f"Softmax -> MatMul not recognised as attention: {why}; scores <- {' <- '.join(chain) or 'graph input'}"


def _no_rewrite(m: Match, ctx: Context) -> Rewrite:  # pragma: no cover - _explain always rejects
    raise AssertionError("attention.unrecognized never rewrites")


RULES = [
    FusionRule("attention.additive", OP, _additive(), _check, _rewrite,
               doc="MatMul(q, k^T) [* scale] [+ bias] -> Softmax -> MatMul(., v) (eager and SDPA, both exporters)"),
    FusionRule("attention.masked_fill", OP, _masked_fill(), _check, _rewrite,
               doc="MatMul(q, k^T) [* scale] -> Where(cond, ., fill) [+ bias] -> Softmax -> MatMul(., v)"),
    FusionRule("attention.batched", OP, _batched(), _check, _rewrite,
               doc="3-D bmm attention over [B*H, S, D] with 4-D Softmax (BLOOM's baddbmm + ALiBi)"),
    FusionRule("attention.onnx", OP, _onnx_attention, _check, _rewrite,
               doc="ONNX Attention (opset 23+), 4-D inputs"),
    FusionRule("attention.unrecognized", OP, _unrecognized(), _explain, _no_rewrite,
               doc="reports Softmax -> MatMul candidates no rule above recognised (never fuses)"),
]
