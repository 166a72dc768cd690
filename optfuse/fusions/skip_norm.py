"""Skip norms: the residual Add feeding a fused norm joins it (one pass instead of two).

    a ─┐
       Add ─► s ─► LayerNorm | RMSNorm ─► y          =>   SkipLayerNorm | SkipRMSNorm(a, b) ─► y, s
    b ─┘      └─► (next residual Add, ...)

The sum s stays available as the fused op's second output, because pre-norm and post-norm
blocks both read it again for the next residual connection. Runs after the norm families, on
their optfuse nodes.

Not fused: an Add that broadcasts (e.g. BERT's position embeddings [1, S, H] + [B, S, H]),
operands of different dtypes.
Targets: ``optfuse::SkipLayerNorm`` v1, ``optfuse::SkipRMSNorm`` v1.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_graphsurgeon as gs

from .. import DOMAIN
from ..ir.query import dtype_name
from ..pattern import Context, FusionRule, Match, Rewrite, Var, op


@dataclass(frozen=True)
class SkipBindings:
    """The residual operands, the fused norm's parameters and epsilon."""

    a: gs.Tensor
    b: gs.Tensor
    params: tuple[gs.Tensor, ...]
    epsilon: float


def _check(m: Match, ctx: Context) -> str | SkipBindings:
    norm, a, b = m["norm"], m["a"], m["b"]
    if norm.domain != DOMAIN:
        return f"{norm.op} is not an optfuse node"
    if dtype_name(a) != dtype_name(b):
        return f"residual operands have different dtypes ({dtype_name(a)}, {dtype_name(b)})"
    if not ctx.same_shape(a, b):
        return f"residual Add broadcasts ({a.shape} + {b.shape}); the skip kernel needs equal shapes"
    return SkipBindings(a, b, tuple(norm.inputs[1:]), float(norm.attrs["epsilon"]))


def _rewrite(target: str):
    def rewrite(m: Match, sb: SkipBindings) -> Rewrite:
        return Rewrite(target, [sb.a, sb.b, *sb.params], [m.root, m["s"]], {"epsilon": sb.epsilon})

    return rewrite


def _pattern(norm_op: str):
    n_params = 2 if norm_op == "LayerNorm" else 1
    residual = op.Add(Var("a"), Var("b"), out="s")
    return getattr(op, norm_op)(residual, *(Var(f"p{i}") for i in range(n_params)), capture="norm")


RULES = [
    FusionRule("skip_norm.layer_norm", "SkipLayerNorm", _pattern("LayerNorm"), _check, _rewrite("SkipLayerNorm"),
               doc="Add + LayerNorm"),
    FusionRule("skip_norm.rms_norm", "SkipRMSNorm", _pattern("RMSNorm"), _check, _rewrite("SkipRMSNorm"),
               doc="Add + RMSNorm"),
]
