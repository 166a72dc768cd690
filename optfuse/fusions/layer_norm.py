"""LayerNorm: y = (x - mean(x)) / sqrt(var(x) + eps) * gamma + beta, over the last axis.

Exporter variants matched (rule ids):

- ``layer_norm.native``: ``LayerNormalization`` (opset >= 17; torch.onnx writes it for
  ``nn.LayerNorm`` with both exporters).
- ``layer_norm.decomposed``: what opset < 17 exports and hand-written LayerNorms look like::

        x ──┬──────────────► Sub ──┬──► Pow(2) | Mul(d, d) ─► ReduceMean ─► Add(eps) ─► Sqrt ─┐
            └─► ReduceMean ─┘      └─────────────────────► Div | Mul(Reciprocal) | Mul(Div(1, .)) ◄┘
                                                                          │
                                                   [Cast] ─► Mul(gamma) ─► Add(beta) ─► y

  with optional Casts (fp32 statistics in fp16 models) and optional affine parameters. A
  hand-written ``(x - mean) * torch.rsqrt(var + eps)`` (Cohere's LayerNorm) is exported as
  Mul(Reciprocal(Sqrt)) by dynamo and as Mul(Div(1, Sqrt)) by TorchScript.

Target: ``optfuse::LayerNorm`` v1 (plugins/layer_norm).
"""

from __future__ import annotations

import numpy as np

from ..pattern import AnyOf, Capture, Const, Context, FusionRule, Match, Var, maybe_cast, op
from ._norm_common import NormBindings, bind, check_eps, check_input, check_last_axis, check_same_dtype, norm_rewrite

OP = "LayerNorm"
_AFFINE = (("gamma", 1.0), ("beta", 0.0))

# --- native LayerNormalization ------------------------------------------------------------------
_native = AnyOf(
    op.LayerNormalization(Var("x"), Var("gamma"), Var("beta"), capture="ln"),
    op.LayerNormalization(Var("x"), Var("gamma"), capture="ln"),
)


def _check_native(m: Match, ctx: Context) -> str | NormBindings:
    ln = m["ln"]
    x = m["x"]
    axis = ln.attrs.get("axis", -1)
    return (
        check_last_axis([axis], x)
        or check_input(OP, x)
        or check_same_dtype(x, m.root)
        or bind(m, x, _AFFINE, ln.attrs.get("epsilon", 1e-5))
    )


# --- decomposed ------------------------------------------------------------------------------------
def _decomposed(affine: str) -> object:
    x = Var("x")
    mean = op.ReduceMean(maybe_cast(x), axes=Capture("axes1"))
    d = op.Sub(maybe_cast(x), mean)
    var = op.ReduceMean(AnyOf(op.Pow(d, Const(2.0)), op.Mul(d, d)), axes=Capture("axes2"))
    std = op.Sqrt(op.Add(var, Const(name="eps")))
    normed = maybe_cast(AnyOf(op.Div(d, std), op.Mul(d, op.Reciprocal(std)), op.Mul(d, op.Div(Const(1.0), std))))
    if affine == "gamma_beta":
        return op.Add(op.Mul(normed, Var("gamma")), Var("beta"))
    if affine == "gamma":
        return op.Mul(normed, Var("gamma"))
    return normed


def _check_decomposed(m: Match, ctx: Context) -> str | NormBindings:
    x = m["x"]
    return (
        check_last_axis(m["axes1"], x)
        or (None if list(np.atleast_1d(m["axes1"])) == list(np.atleast_1d(m["axes2"]))
            else "mean and variance reduce over different axes")
        or check_eps(m["eps"])
        or check_input(OP, x)
        or check_same_dtype(x, m.root)
        or bind(m, x, _AFFINE, np.asarray(m["eps"]).reshape(()))
    )


_rewrite = norm_rewrite(OP)

RULES = [
    FusionRule("layer_norm.native", OP, _native, _check_native, _rewrite,
               doc="LayerNormalization (opset 17+)"),
    FusionRule("layer_norm.decomposed", OP, _decomposed("gamma_beta"), _check_decomposed, _rewrite,
               doc="ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div + Mul/Add affine"),
    FusionRule("layer_norm.decomposed_scale", OP, _decomposed("gamma"), _check_decomposed, _rewrite,
               doc="decomposed, scale only"),
    FusionRule("layer_norm.decomposed_plain", OP, _decomposed("none"), _check_decomposed, _rewrite,
               doc="decomposed, no affine parameters"),
]
