"""One GEMM and its epilogue -> GemmEpilogue: the check plans the fused node (`GemmPlan`), the
rewrite emits it.

Residual or SkipNorm. A residual Add whose sum feeds a fused LayerNorm / RMSNorm can be taken by
the GEMM (its epilogue adds it) or by the norm (SkipLayerNorm / SkipRMSNorm). Per [M, N] tensor
of the sum's size, with g the GEMM output, r the residual, s the sum and y the norm output:

    GEMM takes it:     GEMM reads r, writes s; the norm reads s, writes y               4 [M, N]
    SkipNorm takes it: GEMM writes g; SkipNorm reads g and r, writes s and y            5 [M, N]
                       (post-norm, s read by nobody else: SkipNorm need not write s)    4 [M, N]

So the GEMM takes the residual when the sum has another reader (pre-norm GPT-2 / LLaMA: the next
residual Add), and leaves it to the SkipNorm when the norm is its only reader (post-norm BERT,
equal bytes; the norm family keeps its fusion). The report's info says which way each went.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from ... import DOMAIN
from ...ir.query import dtype_name, static_dim
from ...pattern import After, Context, FusedOutput, Match, NewTensor, Rewrite
from .common import EPILOGUE, Reject, absent, check_a, check_limits, need, np_dtype, vector, weight

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


def norm_reader(t: gs.Tensor, ctx: Context) -> gs.Node | None:
    """The fused norm that is the only reader of `t` (and `t` no graph output), else None."""
    if len(t.outputs) != 1 or any(o is t for o in ctx.graph.outputs):
        return None
    node = t.outputs[0]
    return node if node.domain == DOMAIN and node.op in _NORMS else None


def residual_left_note(root: gs.Tensor, ctx: Context) -> str | None:
    """The note for a GEMM whose output feeds a residual Add that a SkipNorm will take."""
    if len(root.outputs) != 1 or root.outputs[0].op != "Add":
        return None
    add = root.outputs[0]
    norm = norm_reader(add.outputs[0], ctx)
    if norm is None:
        return None
    return (f"residual left to Skip{norm.op}: the sum is read only by the norm, so either way moves "
            "4 [M, N] tensors")


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
    need(dtype_name(r) == dt, f"residual {r.name!r} has dtype {dtype_name(r)}, A has {dt}")
    need(ctx.same_shape(r, other), f"residual Add broadcasts ({r.shape} + {other.shape}); "
                                   f"{EPILOGUE} adds a residual of the output's shape")
    norm = norm_reader(s, ctx)
    if norm is not None:
        raise Reject(f"the residual sum {s.name!r} is read only by {norm.op} {norm.name!r}: Skip{norm.op} "
                     "takes the residual (equal HBM bytes: 4 [M, N] tensors either way)")
    readers = [c.op for c in s.outputs]
    note = "residual taken by the GEMM"
    if any(c.domain == DOMAIN and c.op in _NORMS for c in s.outputs):
        note = (f"residual taken by the GEMM, not the SkipNorm: the sum is also read by "
                f"{', '.join(sorted(set(readers)))}, so this saves one [M, N] write and read")
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
