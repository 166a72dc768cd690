"""One GEMM and its epilogue -> GemmEpilogue: the check plans the fused node (`GemmPlan`), the
rewrite emits it.

Residual or SkipNorm. A residual Add whose sum feeds a fused LayerNorm / RMSNorm can be taken by
the GEMM (its epilogue adds it) or by the norm (SkipLayerNorm / SkipRMSNorm). Counted in [M, N]
tensors (g the GEMM output, r the residual, s the sum, y the norm output; A, W and the sum's other
readers are the same either way)::

    GEMM takes it:     GEMM reads r, writes s; the norm reads s, writes y              4
    SkipNorm takes it: GEMM writes g; SkipNorm reads g and r, writes y and s           5
                       (4 when the norm is the sum's only reader and the Skip op's
                        sum output is optional, so it need not write s)

``residual_traffic`` counts both from the graph and the Skip op's spec; the GEMM takes the residual
when it moves less, a tie stays with the SkipNorm. The Skip ops of plugins/layer_norm and
plugins/rms_norm always write their sum, so today the GEMM takes the residual in pre-norm (GPT-2,
LLaMA: the sum is read again) and in post-norm (BERT) blocks alike; the report's info gives the count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from ... import DOMAIN
from ...ir.query import dtype_name, static_dim
from ...pattern import After, Context, FusedOutput, Match, NewTensor, Rewrite
from ...spec import get_spec
from .common import EPILOGUE, Reject, absent, check_a, check_limits, need, np_dtype, vector, weight
from .patterns import squared_by

_NORMS = ("LayerNorm", "RMSNorm")


@dataclass
class GemmPlan:
    """The bindings a GEMM check returns and its rewrite emits: the fused node's inputs, outputs
    (None: a new tensor an `After` node reads), attributes, the nodes after it, facts for the report."""

    op: str
    inputs: list[Any]
    outputs: list[gs.Tensor | None]
    attrs: dict[str, Any]
    info: dict[str, Any] = field(default_factory=dict)
    after: list[After] = field(default_factory=list)


def emit(m: Match, p: GemmPlan) -> Rewrite:
    return Rewrite(p.op, list(p.inputs), list(p.outputs), dict(p.attrs), dict(p.info), list(p.after))


def matched_activation(m: Match) -> str:
    return next((k[4:] for k in m.bindings if k.startswith("act:")), "none")


def norm_reader(t: gs.Tensor) -> gs.Node | None:
    """A fused norm among the readers of `t`, else None."""
    return next((c for c in t.outputs if c.domain == DOMAIN and c.op in _NORMS), None)


def residual_traffic(s: gs.Tensor, norm: gs.Node, ctx: Context) -> tuple[int, int]:
    """[M, N] tensors moved (GEMM takes the residual, Skip<norm> takes it); see the module doc."""
    only_reader = len(s.outputs) == 1 and not any(o is s for o in ctx.graph.outputs)
    skip_sum = get_spec(f"Skip{norm.op}").outputs[1]
    return 4, 4 if only_reader and skip_sum.optional else 5


def _skip_decision(s: gs.Tensor, ctx: Context) -> tuple[bool, str | None]:
    """(whether the GEMM takes the residual Add that writes `s`, the report's note)."""
    norm = norm_reader(s)
    if norm is None:
        return True, None
    gemm, skip = residual_traffic(s, norm, ctx)
    counts = f"GEMM + {norm.op} move {gemm} [M, N] tensors, Skip{norm.op} {skip}"
    if gemm < skip:
        return True, f"residual taken by the GEMM, not Skip{norm.op}: {counts}"
    return False, f"residual left to Skip{norm.op}: {counts}"


def residual_left_note(root: gs.Tensor, ctx: Context) -> str | None:
    """The note for a GEMM whose output feeds a residual Add that a SkipNorm will take."""
    if len(root.outputs) != 1 or root.outputs[0].op != "Add":
        return None
    takes, note = _skip_decision(root.outputs[0].outputs[0], ctx)
    return None if takes else note


def _bias(m: Match, w_bias, n: int) -> np.ndarray | None:
    parts = [w_bias] if w_bias is not None else []
    for key in ("bias", "bias_out"):
        if key in m:
            parts.append(vector(m[key], n, "bias"))
    return None if not parts else np.sum(parts, axis=0)


def _residual(m: Match, ctx: Context, dt: str, n: int, flat: bool) -> tuple[Any, str]:
    """The residual input and the report note; rejects a residual that SkipNorm should keep."""
    add, r = m["residual_add"], m["residual"]
    s = add.outputs[0]
    other = next(t for t in add.inputs if t is not r)
    need(not any(o is r for n in m.nodes for o in n.outputs),
         f"the residual {r.name!r} is computed inside the match (the GEMM would run twice)")
    need(dtype_name(r) == dt, f"residual {r.name!r} has dtype {dtype_name(r)}, A has {dt}")
    need(ctx.same_shape(r, other), f"residual Add broadcasts ({r.shape} + {other.shape}); "
                                   f"{EPILOGUE} adds a residual of the output's shape")
    takes, note = _skip_decision(s, ctx)
    if not takes:
        raise Reject(f"the residual sum {s.name!r} goes to the SkipNorm: {note}")
    note = note or "residual taken by the GEMM"
    if flat:  # the GEMM runs on the flattened rows; so does its residual
        return NewTensor("Reshape", [r, np.array([-1, n], np.int64)], dtype=r.dtype, name="residual_rows"), note
    return r, note


def _last_dim(t: gs.Tensor, ctx: Context) -> int | None:
    d = static_dim(t, -1)
    return d if d is not None else ctx.facts.static.dim(t, -1)


def plan_epilogue(m: Match, ctx: Context, residual_position: str | None) -> GemmPlan:
    """The GemmEpilogue node of a match of ``core`` [-> activation] [-> residual]."""
    mm, a, root = m["mm"], m["a"], m.root
    dt = check_a(EPILOGUE, a, root)
    wt = weight(mm, m["w"], a, dt, m.get("gemm_c"))
    check_limits(EPILOGUE, wt.k, wt.n, f"{mm.op} {mm.name!r}")
    act = matched_activation(m)
    if act == "relu" and root.inputs and root.inputs[0].op == "Relu":
        # The planner meets the Relu before its square: leave the pair to relu2 (which fails the
        # leak check, and so leaves the Relu to this match, when the Relu has another reader).
        sq = squared_by(root, ctx.graph)
        if sq is not None:
            raise Reject(f"the Relu's output is squared by {sq.op} {sq.name!r} alone: relu2 takes the pair")
    flat = "out_reshape" in m
    if flat and ("bias_out" in m or residual_position is not None):
        last = _last_dim(m["pre"], ctx)
        need(last == wt.n, f"the Reshape after {mm.op} {mm.name!r} changes the last dim ({wt.n} -> {last}), "
                           "so its bias / residual is not per output column")
    bias = _bias(m, wt.gemm_bias, wt.n)
    info: dict[str, Any] = {"activation": act, "K": wt.k, "N": wt.n, "bias": bias is not None}
    attrs: dict[str, Any] = {"activation": act}
    if wt.alpha != 1.0:
        attrs["alpha"] = wt.alpha
    residual = absent("residual", dt)
    if residual_position is not None:
        residual, info["residual"] = _residual(m, ctx, dt, wt.n, flat)
        attrs["residual_position"] = residual_position
    else:
        note = residual_left_note(root, ctx)
        if note:
            info["residual"] = note
    bias_in = absent("bias", dt) if bias is None else bias.astype(np_dtype(dt))
    inputs = [a, wt.w, bias_in, residual]
    if not flat:
        return GemmPlan(EPILOGUE, inputs, [root], attrs, info)
    reshape = m["out_reshape"]
    info["reshape"] = "the Reshape after the 2-D GEMM stays after the fused node"
    after = After("Reshape", [FusedOutput(0), m["out_shape"]], [root], dict(reshape.attrs))
    return GemmPlan(EPILOGUE, inputs, [None], attrs, info, [after])


def check_for(residual_position: str | None):
    """The check of a single-GEMM rule (residual_position None: no residual Add in the pattern)."""

    def check(m: Match, ctx: Context) -> str | GemmPlan:
        try:
            return plan_epilogue(m, ctx, residual_position)
        except Reject as r:
            return str(r)

    return check
