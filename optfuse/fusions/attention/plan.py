"""Planning one match of the decomposed (4-D) and batched (3-D bmm) rules: checks, scale, heads, k layout.

A planner returns the `AttentionPlan` (the rule's bindings) or raises `Reject` with the reason.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from ...ir.query import const_value, rank
from ...ir.static import UNKNOWN_DIM, StaticEval
from ...pattern import After, Context, FusedOutput, Match, NewTensor
from .common import AttentionPlan, check_dtypes, check_head_dim, need
from .mask_bias import plan_mask


def plan_decomposed(m: Match, ctx: Context) -> AttentionPlan:
    """The 4-D rules (additive, masked_fill): q, k, v [B, H, S, D] around Softmax over the key axis."""
    g, st = ctx.graph, ctx.facts.static
    sm = m["softmax"]
    logits = sm.inputs[0]
    r = rank(logits)
    default_axis = -1 if (g.opset or 17) >= 13 else 1
    axis = int(sm.attrs.get("axis", default_axis))
    need(r is not None, "rank of the attention scores is unknown")
    need(axis % r == r - 1, f"Softmax over axis {axis} of rank-{r} scores, not the key axis")
    probs = [sm.outputs[0], m.get("p")] + [m[n].outputs[0] for n in ("nan_guard", "dropout") if n in m]
    for p in filter(None, probs):
        need(not any(o is p for o in g.outputs),
             f"attention probabilities {p.name!r} are a graph output (output_attentions)")
    if "dropout" in m:
        _check_dropout(m)
    q = m["q"]
    need(rank(q) == 4, f"q {q.name!r} is not a 4-D [B, H, S, D] tensor (rank {rank(q)})")
    k, k_kv, k_new = _resolve_k(m, st)
    v, v_kv = m["v"], m.get("v_kv")
    need(rank(v) == 4, f"v {v.name!r} is not a 4-D [B, H, S, D] tensor")
    scale = _scale(m, st)
    heads = _heads(m, st, q, k, k_kv, v, v_kv)
    attrs = {"scale": scale, "causal": 0, "num_heads": heads["H"], "num_kv_heads": heads["Hkv"]}
    k_in = k_kv if heads["gqa"] else (k_new if k_new is not None else k)
    v_in = v_kv if heads["gqa"] else v
    check_dtypes(q, [k, v], m.root)
    mp = plan_mask(m, ctx, q, heads["H"])
    softcap = _softcap(m, st)
    attrs.update(mp.attrs)
    info = mp.info
    if softcap:
        attrs["softcap"] = info["softcap"] = softcap
    info.update(scale=scale, num_heads=heads["H"], num_kv_heads=heads["Hkv"], head_dim=heads["D"])
    if k_new is not None:
        info["k_layout"] = "transposed back from k^T"
    return AttentionPlan([q, k_in, v_in, mp.bias, *mp.layout_inputs], attrs, info, mp.op)


def plan_batched(m: Match, ctx: Context) -> AttentionPlan:
    """3-D variant: q, k, v are [B, H, S, D] tensors flattened to [B*H, S, D] around the bmm's.

    The Reshapes must only merge/split the leading (B, H) dims: each 3-D tensor keeps the last two
    dims of its 4-D source (checked where shapes tell), the scores and the output are split back
    into H heads, and k, v have the heads of q (one flattened batch index addresses all three).
    """
    g, st = ctx.graph, ctx.facts.static
    sm = m["softmax"]
    r = rank(sm.inputs[0])
    axis = int(sm.attrs.get("axis", -1 if (g.opset or 17) >= 13 else 1))
    need(r == 4 and axis % 4 == 3, "Softmax is not over the key axis of 4-D scores")
    for p in filter(None, [sm.outputs[0], m.get("p"), m.get("p3")]):
        need(not any(o is p for o in g.outputs), f"attention probabilities {p.name!r} are a graph output")
    q, k, v = m["q"], m["k"], m["v"]
    out = m.root
    need(all(rank(x) == 4 for x in (q, k, v, out)), "q/k/v/output are not 4-D around the 3-D bmm's")
    H, D = st.dim(q, 1), st.dim(q, 3)
    need(H is not None and D is not None, f"number of heads or head dim of {q.name!r} is unknown")
    check_head_dim(D)
    need(st.dim(k, 1) == H and st.dim(v, 1) == H, "3-D attention with k/v heads differing from q's")
    need(st.dim(k, 3) == D and st.dim(v, 3) == D, "k/v head dims differ from q's")
    need(st.dim(m["s4"], 1) == H and st.dim(out, 1) == H and st.dim(out, 3) == D,
         "the 3-D scores / output are not split back into the query heads")
    for x4, x3 in ((q, m["q3"]), (v, m["v3"])) + (((k, m["k3"]),) if "k_t" in m else ()):
        need(rank(x3) == 3 and st.dim(x3, 2) == D, f"{x3.name!r} is not [B*H, S, D]")
        need(st.same_dim(x3, 1, x4, 2) is not False, f"{x3.name!r} does not keep the sequence of {x4.name!r}")
    if "k_t" not in m:
        need(rank(m["k3"]) == 3 and st.dim(m["k3"], 1) == D, f"{m['k3'].name!r} is not [B*H, D, S]")
    scale = _scale(m, st)
    check_dtypes(q, [k, v], out)
    mp = plan_mask(m, ctx, q, H, split={"bias3": H})
    info = mp.info
    info.update(scale=scale, num_heads=H, num_kv_heads=H, head_dim=D, layout="3-D batched heads")
    attrs = {"scale": scale, **mp.attrs, "num_heads": H, "num_kv_heads": H}
    plan = AttentionPlan([q, k, v, mp.bias, *mp.layout_inputs], attrs, info, mp.op)
    o3 = m["pv"].outputs[0]
    if any(c is not m["o_unflat"] for c in o3.outputs) or any(t is o3 for t in g.outputs):
        # read outside the match (TorchScript's _merge_heads reads its shape): the fused output o
        # reshaped by q's own flattening target, which gives o [B, H, Sq, D] (q's shape) as
        # [B*H, Sq, D], the value the 3-D product wrote
        flatten_q = m["q3"].inputs[0]
        plan.after.append(After("Reshape", [FusedOutput(0), m["q_flat_shape"]], [o3], dict(flatten_q.attrs)))
        info["kept_3d_output"] = f"{o3.name!r}: Reshape of the output by q's [B*H, Sq, D] target"
    return plan


def _check_dropout(m: Match) -> None:
    node = m["dropout"]
    training = m.get("drop_training")
    if training is not None:
        t = const_value(training)
        need(t is not None, "dropout training_mode is not a constant")
        if bool(np.asarray(t).reshape(-1)[0]):
            ratio = m.get("drop_ratio")
            rv = const_value(ratio) if ratio is not None else np.array(0.5)
            need(rv is not None and float(np.asarray(rv).reshape(-1)[0]) == 0.0,
                 "dropout on the attention probabilities is live (training_mode=1)")
    need(len(node.outputs) < 2 or not node.outputs[1].outputs, "dropout mask output is used")


def _resolve_k(m: Match, st: StaticEval) -> tuple[gs.Tensor, gs.Tensor | None, NewTensor | None]:
    """(k as [B, Hk, Sk, D] tensor or its source, the un-repeated k or None, a NewTensor giving k or None)."""
    if "k_bshd" in m:
        src = m["k_bshd"]
        need(rank(src) == 4, f"head split {src.name!r} is not 4-D")
        existing = next((c.outputs[0] for c in src.outputs if c.op == "Transpose" and c is not m["k_t"]
                         and list(c.attrs.get("perm", [])) == [0, 2, 1, 3]), None)
        if existing is not None:
            return existing, None, None
        shape = None if src.shape is None else [src.shape[0], src.shape[2], src.shape[1], src.shape[3]]
        return src, None, NewTensor("Transpose", [src], {"perm": [0, 2, 1, 3]}, src.dtype, shape, "k")
    if "k_t_raw" in m:
        kt = m["k_t_raw"]
        need(rank(kt) == 4, f"k^T {kt.name!r} is not 4-D")
        shape = None if kt.shape is None else [kt.shape[0], kt.shape[1], kt.shape[3], kt.shape[2]]
        return kt, None, NewTensor("Transpose", [kt], {"perm": [0, 1, 3, 2]}, kt.dtype, shape, "k")
    k = m["k"]
    need(rank(k) == 4, f"k {k.name!r} is not 4-D")
    if "k_flat" in m:
        kt = m["k_t"].outputs[0]
        flat = m["k_flat"]
        proofs = [rank(flat) == 3, rank(kt) == 4, st.same_dim(flat, 1, k, 2), st.same_dim(flat, 2, k, 3),
                  st.same_dim(kt, 0, k, 0), st.same_dim(kt, 1, k, 1), st.same_dim(kt, 2, k, 3), st.same_dim(kt, 3, k, 2)]
        need(all(p is True for p in proofs),
             "cannot prove that Reshape/Transpose/Reshape of k is k^T (shapes unknown)")
    return k, m.get("k_kv"), None


def _scale(m: Match, st: StaticEval) -> float:
    scale = 1.0
    for name, inv in (("q_mul", False), ("q_div", True), ("k_mul", False), ("k_div", True)):
        if name in m:
            c = float(np.asarray(st.value(m[name]), dtype=np.float64).reshape(()))
            scale *= 1.0 / c if inv else c
    for name, inv in (("s_mul", False), ("s_div", True)):
        if name in m:
            t = m[name]
            val = st.value(t)
            need(val is not None, f"attention scores are scaled by a non-constant tensor {t.name!r}")
            need(val.size == 1, f"attention scale {t.name!r} is not a scalar (shape {list(val.shape)})")
            c = float(np.asarray(val, dtype=np.float64).reshape(()))
            scale *= 1.0 / c if inv else c
    need(np.isfinite(scale) and scale != 0.0, f"attention scale {scale} is not a finite non-zero number")
    return float(scale)


#: Relative tolerance between the soft-cap's divisor and its multiplier (c * tanh(s / c)).
SOFTCAP_RTOL = 1e-6


def _softcap(m: Match, st: StaticEval) -> float:
    """Gemma 2's logit soft-cap c: scores -> Div(c) or Mul(1 / c) -> Tanh -> Mul(c); 0 when absent."""
    if "cap_out" not in m:
        return 0.0
    vals = {n: st.value(m[n]) for n in ("cap_div", "cap_mul", "cap_out") if n in m}
    for n, val in vals.items():
        need(val is not None and val.size == 1, f"soft-cap factor {m[n].name!r} is not a constant scalar")
    out = float(np.asarray(vals["cap_out"], np.float64).reshape(()))
    inner = vals.get("cap_div")
    c = float(np.asarray(inner, np.float64).reshape(())) if inner is not None else \
        1.0 / float(np.asarray(vals["cap_mul"], np.float64).reshape(()))
    need(np.isfinite(c) and c > 0 and abs(c - out) <= SOFTCAP_RTOL * abs(out),
         f"tanh of the scores is not a soft-cap c * tanh(s / c) (divides by {c:g}, multiplies by {out:g})")
    return out


def _heads(m: Match, st: StaticEval, q, k, k_kv, v, v_kv) -> dict[str, Any]:
    H, D = st.dim(q, 1), st.dim(q, 3)
    need(H is not None, f"number of query heads of {q.name!r} is unknown")
    need(D is not None, f"head dim of {q.name!r} is unknown")
    check_head_dim(D)
    if "k_bshd" in m:
        Hk, Dk = st.dim(m["k_bshd"], 2), st.dim(m["k_bshd"], 3)
    elif "k_t_raw" in m:
        Hk, Dk = st.dim(k, 1), st.dim(k, 2)
    else:
        Hk, Dk = st.dim(k, 1), st.dim(k, 3)
    Hv, Dv = st.dim(v, 1), st.dim(v, 3)
    need(Dk == D, f"k head dim {Dk} differs from q head dim {D}")
    need(Dv == D, f"v head dim {Dv} differs from q head dim {D} (the op needs one head dim)")
    gqa = False
    if k_kv is not None and v_kv is not None:
        hk, hv = (st.dim(x, 1) or _heads_from_repeat(m, st, name, H) for x, name in ((k_kv, "k"), (v_kv, "v")))
        same = all(st.same_dim(a, i, b, i) is not False for a, b in ((k, k_kv), (v, v_kv)) for i in (0, 2, 3))
        if hk is not None and hk == hv and H % hk == 0 and same and Hk in (None, H) and Hv in (None, H) \
                and rank(k_kv) == 4 and rank(v_kv) == 4:
            gqa = True
            Hk = Hv = hk
    need(Hk is not None and Hv is not None, "number of key/value heads is unknown")
    need(Hk == Hv, f"k has {Hk} heads but v has {Hv}")
    need(Hk in (H, 1) or (gqa and H % Hk == 0), f"{H} query heads cannot share {Hk} key/value heads")
    for x, what in ((k, "k"), (v, "v")):
        need(st.same_dim(q, 0, x, 0) is not False, f"batch of {what} differs from q's (broadcast batch)")
    return {"H": H, "Hkv": Hk, "D": D, "gqa": gqa}


def _heads_from_repeat(m: Match, st: StaticEval, name: str, H: int) -> int | None:
    """The KV heads of ``name``'s repeat_kv when its input's head dim is not static (a cache input
    that names it, a value_info that left it symbolic): H / G, with the group size G read from the
    Expand's target [B, Hkv, G, S, D] (the Reshape to [B, H, S, D] merges Hkv and G)."""
    target = m.get(f"{name}_rep_shape")
    if target is None or target.shape is None or list(target.shape) != [5]:
        return None  # a shorter target broadcasts from the right: entry 2 is not the group
    g = _vector_entry(st, target, 2)
    return H // g if g is not None and g >= 1 and H % g == 0 else None


def _vector_entry(st: StaticEval, t: gs.Tensor | None, i: int, depth: int = 8) -> int | None:
    """Entry ``i`` of a 1-D int64 shape vector when it is static, though other entries are not
    (a target concatenated from Shape slices and constants, TorchScript's Where(Equal(t, -1), 1, t))."""
    if t is None or depth <= 0:
        return None
    v = st.value(t, partial=True)
    if v is not None:
        v = np.asarray(v).reshape(-1)
        ok = v.ndim == 1 and -len(v) <= i < len(v) and np.issubdtype(v.dtype, np.integer) and int(v[i]) != UNKNOWN_DIM
        return int(v[i]) if ok else None
    node = t.inputs[0] if len(t.inputs) == 1 else None
    if node is None:
        return None
    if node.op == "Concat" and int(node.attrs.get("axis", 0)) in (0, -1):
        for part in node.inputs:
            pv = st.value(part, partial=True)
            n = np.asarray(pv).size if pv is not None else (part.shape[0] if rank(part) == 1 else None)
            if not isinstance(n, (int, np.integer)):
                return None
            if i < n:
                return _vector_entry(st, part, i, depth - 1)
            i -= int(n)
        return None
    if node.op == "Where" and len(node.inputs) == 3:  # TorchScript's x.expand(t): Where(Equal(t, -1), 1, t)
        cond, t_ = node.inputs[0], node.inputs[2]
        eq = cond.inputs[0] if len(cond.inputs) == 1 else None
        minus = st.value(eq.inputs[1]) if eq is not None and eq.op == "Equal" and eq.inputs[0] is t_ else None
        if minus is None or not (np.asarray(minus) == -1).all():
            return None
        e = _vector_entry(st, t_, i, depth - 1)
        return e if e is not None and e != -1 else None
    return None
