"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * gamma, over the last axis (LLaMA, T5, Mistral, ...).

Exporter variants matched (rule ids):

- ``rms_norm.native``: ``RMSNormalization`` (opset 23).
- ``rms_norm.decomposed``: HF's hand-written RMSNorm as both torch exporters write it::

        x ─► [Cast f32] ─┬─► Pow(2) | Mul(h, h) ─► ReduceMean ─► Add(eps) ─► Sqrt ─┐
                         └──► Mul(h, Reciprocal(.)) | Div(h, .) | Mul(h, Div(1, .)) ◄┘
                                         │
                                      [Cast] ─► Mul(gamma) ─► y

  ``torch.rsqrt`` is exported as Reciprocal(Sqrt) by dynamo and as Div(1, Sqrt) by TorchScript.

Target: ``optfuse::RMSNorm`` v1 (plugins/rms_norm).
"""

from __future__ import annotations

import numpy as np

from ..pattern import AnyOf, Capture, Const, Context, FusionRule, Match, Var, maybe_cast, op
from ._norm_common import NormBindings, bind, check_eps, check_input, check_last_axis, check_same_dtype, norm_rewrite

OP = "RMSNorm"
_GAMMA = (("gamma", 1.0),)

_native = AnyOf(
    op.RMSNormalization(Var("x"), Var("gamma"), capture="rms"),
)


def _check_native(m: Match, ctx: Context) -> str | NormBindings:
    x = m["x"]
    rms = m["rms"]
    return (
        check_last_axis([rms.attrs.get("axis", -1)], x)
        or check_input(OP, x)
        or check_same_dtype(x, m.root)
        or bind(m, x, _GAMMA, rms.attrs.get("epsilon", 1e-5))
    )


def _decomposed(with_gamma: bool):
    # each branch may cast x on its own (T5 casts only the variance branch)
    x = Var("x")
    h = maybe_cast(x)
    ms = op.ReduceMean(AnyOf(op.Pow(maybe_cast(x), Const(2.0)), op.Mul(h, h)), axes=Capture("axes"))
    denom = op.Sqrt(op.Add(ms, Const(name="eps")))
    normed = AnyOf(
        op.Mul(h, op.Reciprocal(denom)),
        op.Div(h, denom),
        op.Mul(h, op.Div(Const(1.0), denom)),
    )
    y = maybe_cast(normed)
    return op.Mul(y, Var("gamma")) if with_gamma else y


def _check_decomposed(m: Match, ctx: Context) -> str | NormBindings:
    x = m["x"]
    return (
        check_last_axis(m["axes"], x)
        or check_eps(m["eps"])
        or check_input(OP, x)
        or check_same_dtype(x, m.root)
        or bind(m, x, _GAMMA, np.asarray(m["eps"]).reshape(()))
    )


_rewrite = norm_rewrite(OP)

RULES = [
    FusionRule("rms_norm.native", OP, _native, _check_native, _rewrite, doc="RMSNormalization (opset 23)"),
    FusionRule("rms_norm.decomposed", OP, _decomposed(True), _check_decomposed, _rewrite,
               doc="Pow/ReduceMean/Add/Sqrt/Reciprocal/Mul + gamma"),
    FusionRule("rms_norm.decomposed_plain", OP, _decomposed(False), _check_decomposed, _rewrite,
               doc="decomposed, no gamma"),
]
