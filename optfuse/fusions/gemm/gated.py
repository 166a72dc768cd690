"""The gated FFN -> GatedGemm: act(X @ W_gate) * (X @ W_up), both weights constant, one X, no bias."""

from __future__ import annotations

from ...pattern import Context, Match
from .common import GATED, Reject, check_a, check_limits, need, weight
from .epilogue import GemmPlan, matched_activation


def plan_gated(m: Match, ctx: Context) -> GemmPlan:
    a, gate, up, root = m["a"], m["mm_gate"], m["mm_up"], m.root
    need(gate is not up, "gate and up are one GEMM (x * act(x) is an activation, not a gated FFN)")
    for tag in ("gate", "up"):
        need(f"bias_{tag}" not in m, f"the {tag} projection has a bias Add; {GATED} has no bias input")
    dt = check_a(GATED, a, root)
    wg = weight(gate, m["w_gate"], a, dt)
    wu = weight(up, m["w_up"], a, dt)
    for node, w in ((gate, wg), (up, wu)):
        need(w.alpha == 1.0, f"Gemm {node.name!r} has alpha {w.alpha}; {GATED} has no alpha")
    need(tuple(wg.w.shape) == tuple(wu.w.shape), f"gate weight {list(wg.w.shape)} and up weight {list(wu.w.shape)} differ")
    check_limits(GATED, wg.k, wg.n, f"{gate.op} {gate.name!r}")
    act = matched_activation(m)
    return GemmPlan(GATED, [a, wg.w, wu.w], [root], {"activation": act},
                    {"activation": act, "K": wg.k, "N": wg.n})


def check_gated(m: Match, ctx: Context):
    try:
        return plan_gated(m, ctx)
    except Reject as r:
        return str(r)
