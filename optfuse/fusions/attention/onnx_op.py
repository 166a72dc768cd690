"""ONNX's own ``Attention`` op (opset 23+) -> FlashAttention: 4-D inputs, an optional bool or additive
mask, ``is_causal`` and ``scale``; no cache inputs, no softcap, only output Y used."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...ir.query import dtype_name, rank
from ...pattern import Context, Match
from .common import AttentionFacts, AttentionPlan, check_dtypes, check_head_dim, need, np_dtype
from .mask_bias import MaskExpr, check_bias_shape, mask_mode, padded_queries_inexact, shared_bias


def plan_onnx(m: Match, ctx: Context) -> AttentionPlan:
    """ONNX Attention (opset 23+) with 4-D q, k, v: its attributes map onto the op's."""
    st = ctx.facts.static
    node = m["attn"]
    q, k, v = m["q"], m["k"], m["v"]
    need(all(rank(x) == 4 for x in (q, k, v)), "Attention with 3-D (packed heads) inputs is not supported")
    for j, o in enumerate(node.outputs[1:], start=1):
        need(not o.outputs and not any(o is g for g in ctx.graph.outputs),
             f"Attention output {j} ({o.name!r}: cache or scores) is used")
    softcap = float(node.attrs.get("softcap", 0.0) or 0.0)
    need(softcap == 0.0, f"Attention softcap {softcap} is not supported")
    for a in ("left_window_size", "right_window_size"):
        need(int(node.attrs.get(a, -1)) == -1, f"Attention {a} is not supported")
    H, D = st.dim(q, 1), st.dim(q, 3)
    Hk, Hv = st.dim(k, 1), st.dim(v, 1)
    need(None not in (H, D, Hk, Hv), "number of heads or head dim of the Attention inputs is unknown")
    check_head_dim(D)
    need(st.dim(k, 3) == D and st.dim(v, 3) == D, "k/v head dims differ from q's")
    need(Hk == Hv and H % Hk == 0, f"{H} query heads cannot share {Hk} key/value heads")
    check_dtypes(q, [k, v], node.outputs[0])
    scale = node.attrs.get("scale")
    scale = float(scale) if scale is not None else 1.0 / float(np.sqrt(D))
    causal = int(node.attrs.get("is_causal", 0))
    if causal:
        need(st.same_dim(q, 2, k, 2) is True,
             "is_causal with query and key lengths that may differ (ONNX and the op align the diagonal differently)")
    dt = dtype_name(q)
    info: dict[str, Any] = {"mask_class": "causal" if causal else "none", "scale": scale, "num_heads": H,
                            "num_kv_heads": Hk, "head_dim": D}
    bias: Any = np.zeros((), dtype=np_dtype(dt))
    window_left = -1
    mask = m.get("attn_mask")
    if mask is not None:
        check_bias_shape(mask, H, st)
        need(st.same_dim(mask, -1, k, 2) is True, "attn_mask may be shorter than the keys (ONNX pads it)")
        if dtype_name(mask) == "bool":
            expr = MaskExpr([], (mask, float("-inf"), False), np_dtype(dt))
        else:
            need(dtype_name(mask) == dt, f"attn_mask has dtype {dtype_name(mask)}, q has {dt}")
            expr = MaskExpr([mask], None, np_dtype(dt))
        cls = ctx.facts.of(AttentionFacts).masks.classify(expr.sources, expr.evaluate, expr.key)
        params = mask_mode(cls, ctx.options.attention_full_mask)
        info["mask_class"] = ("causal+" if causal and cls.base != "causal" else "") + cls.name
        if cls.source:
            info["mask_source"] = cls.source
        if cls.window:
            info["window"] = cls.window
        causal = int(causal or params.causal)
        info.update(padded_queries_inexact(cls, params, bool(causal)))
        if params.window_left >= 0:
            window_left = params.window_left
        if params.mode != "none":
            bias = shared_bias(ctx, (params.mode,) + expr.key, lambda: expr.build(st, params.mode, ctx.graph.opset))
    attrs = {"scale": scale, "causal": causal, "num_heads": H, "num_kv_heads": Hk}
    if window_left >= 0:
        attrs["window_left"] = window_left
    return AttentionPlan([q, k, v, bias], attrs, info)
