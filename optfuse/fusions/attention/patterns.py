"""Attention patterns: the scores, probabilities and output chains the rules match (see the package doc)."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from ...ir.static import static_value
from ...pattern import AnyOf, Const, Var, maybe_cast, op


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


def _scores():
    qk = op.MatMul(_scaled(Var("q"), "q"), _scaled(_k_transposed(), "k"), capture="qk")
    # the scores' own scale: any tensor here (a non-constant one is rejected with its reason)
    s = AnyOf(op.Mul(qk, Var("s_mul")), op.Div(qk, Var("s_div")), qk)
    # Gemma 2's soft-cap c * tanh(s / c) (the factors are checked by the planner)
    inner = AnyOf(op.Div(s, Var("cap_div")), op.Mul(s, Var("cap_mul", where=_is_static_scalar)))
    return AnyOf(op.Mul(op.Tanh(inner, capture="cap_tanh"), Var("cap_out")), s)


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
    # a position bias may come before the masked_fill (MPT: scores + ALiBi, then masked_fill)
    pre = AnyOf(op.Add(s, Var("bias2")), s)
    filled = AnyOf(op.Where(Var("cond"), pre, Var("fill"), capture="where"),
                   op.Where(Var("cond_inv"), Var("fill"), pre, capture="where"))
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


ONNX_ATTENTION = AnyOf(
    op.Attention(Var("q"), Var("k"), Var("v"), Var("attn_mask"), capture="attn"),
    op.Attention(Var("q"), Var("k"), Var("v"), capture="attn"),
)


#: How far (nodes) the diagnostic looks from a Softmax for the score product (upstream) and the
#: value product (downstream): Longformer's chunked scores lie 14 nodes up, its value product 9 down.
NEAR_SCORES, NEAR_VALUES = 20, 12
_PRODUCTS = ("MatMul", "Einsum")


def _near_product(t: gs.Tensor, downstream: bool, depth: int) -> bool:
    """Whether a MatMul / Einsum of two computed operands (activations, not a weight) lies within
    ``depth`` nodes of ``t`` (consumers or producers)."""
    frontier, seen = [t], set()
    for _ in range(depth):
        nxt = []
        for x in frontier:
            for n in (list(x.outputs) if downstream else list(x.inputs)):
                if id(n) in seen:
                    continue
                seen.add(id(n))
                if n.op in _PRODUCTS and not any(static_value(i) is not None for i in n.inputs):
                    return True
                nxt += [o for o in (n.outputs if downstream else n.inputs) if not isinstance(o, gs.Constant)]
        frontier = nxt
    return False


def _attention_like_scores(t: gs.Tensor) -> bool:
    """Scores from a product of activations near by whose Softmax's probabilities reach another
    (chunked or gathered attention such as Longformer's and BigBird's; not a router's softmax
    over a weight product)."""
    sms = [n for n in t.outputs if n.op == "Softmax"]
    return bool(sms) and _near_product(t, False, NEAR_SCORES) and _near_product(sms[0].outputs[0], True, NEAR_VALUES)


def _unrecognized():
    sm = op.Softmax(Var("logits"), capture="softmax", out="p")
    probs = AnyOf(op.Where(op.IsNaN(Var("p")), Const(0.0), sm), op.Reshape(sm, Var("_p_shape")), op.Cast(sm), sm)
    # a Softmax whose probabilities reach the value product some other way: reported on its own
    # (a Softmax inside a larger reported or fused match is not reported again)
    bare = op.Softmax(Var("logits", where=_attention_like_scores), capture="softmax", out="p")
    return AnyOf(op.MatMul(probs, Var("v")), bare)


ADDITIVE = _additive()
MASKED_FILL = _masked_fill()
BATCHED = _batched()
UNRECOGNIZED = _unrecognized()
