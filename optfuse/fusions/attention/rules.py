"""The attention rules: each check plans the match (the plan is its bindings) and each rewrite emits it."""

from __future__ import annotations

from ...ir.query import const_value, dtype_name, rank
from ...pattern import Context, FusionRule, Match, Rewrite
from . import patterns
from .common import OP, AttentionPlan, Reject, input_side_kept
from .onnx_op import plan_onnx
from .plan import plan_batched, plan_decomposed


def _check(m: Match, ctx: Context) -> str | AttentionPlan:
    try:
        if "o_unflat" in m:
            plan = plan_batched(m, ctx)
        elif "softmax" in m:
            plan = plan_decomposed(m, ctx)
        else:
            return plan_onnx(m, ctx)
    except Reject as r:
        return str(r)
    plan.keep = input_side_kept(m, ctx.graph)
    if plan.keep:
        plan.info["kept_for_other_readers"] = sorted(n.name for n in plan.keep)
    return plan


def _rewrite(m: Match, p: AttentionPlan) -> Rewrite:
    out = m["attn"].outputs[0] if "attn" in m else m.root
    return Rewrite(p.op, list(p.inputs), [out], dict(p.attrs), dict(p.info), after=list(p.after), keep=list(p.keep))


# ------------------------------------------------------------------------------------------------
# Diagnostics: an attention-like Softmax -> MatMul no rule above recognised
# ------------------------------------------------------------------------------------------------
def _explain(m: Match, ctx: Context) -> str:
    """Why a Softmax -> MatMul stayed unfused: the ops that produce its scores."""
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
    if "v" not in m:  # a bare Softmax: its probabilities do not feed MatMul(p, v)
        return (f"Softmax not recognised as attention: its probabilities reach the value product through "
                f"{' -> '.join(_consumers(m['p']))} (chunked or gathered attention, such as Longformer's sliding "
                f"chunks or BigBird's block gathers, is not a pattern); scores <- {' <- '.join(chain) or 'graph input'}")
    why = "the scores are not MatMul(q, k^T) [* scale] [+ bias | masked_fill]"
    if "Reshape" in chain:
        why = "the scores are reshaped between MatMul(q, k^T) and Softmax (3-D [B*H, S, D] batched heads)"
    elif chain and chain[-1] == "Einsum":
        why = "the scores come from an Einsum"
    return f"Softmax -> MatMul not recognised as attention: {why}; scores <- {' <- '.join(chain) or 'graph input'}"


def _consumers(t, depth: int = 6) -> list[str]:
    """The ops along the first consumer path from ``t`` (up to ``depth``, to a product)."""
    chain = []
    for _ in range(depth):
        data = [n for n in t.outputs if n.op not in ("Shape", "Size")]  # the values' path, not a shape read
        if not data:
            break
        node = data[0]
        chain.append(node.op)
        if node.op in ("MatMul", "Einsum", "Gemm") or not node.outputs:
            break
        t = node.outputs[0]
    return chain


def _no_rewrite(m: Match, bindings: object) -> Rewrite:  # pragma: no cover - _explain always rejects
    raise AssertionError("attention.unrecognized never rewrites")


RULES = [
    FusionRule("attention.additive", OP, patterns.ADDITIVE, _check, _rewrite,
               doc="MatMul(q, k^T) [* scale] [+ bias] -> Softmax -> MatMul(., v) (eager and SDPA, both exporters)"),
    FusionRule("attention.masked_fill", OP, patterns.MASKED_FILL, _check, _rewrite,
               doc="MatMul(q, k^T) [* scale] -> Where(cond, ., fill) [+ bias] -> Softmax -> MatMul(., v)"),
    FusionRule("attention.batched", OP, patterns.BATCHED, _check, _rewrite,
               doc="3-D bmm attention over [B*H, S, D] with 4-D Softmax (BLOOM's baddbmm + ALiBi)"),
    FusionRule("attention.onnx", OP, patterns.ONNX_ATTENTION, _check, _rewrite,
               doc="ONNX Attention (opset 23+), 4-D inputs"),
    FusionRule("attention.unrecognized", OP, patterns.UNRECOGNIZED, _explain, _no_rewrite,
               doc="reports Softmax -> MatMul candidates no rule above recognised, and Softmaxes between "
                   "products that reach the value product another way (never fuses)"),
]
