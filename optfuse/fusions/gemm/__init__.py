"""GEMM epilogues: y = act(alpha * X @ W + b) [+ residual]  ->  optfuse::GemmEpilogue, the gated FFN
->  optfuse::GatedGemm, and sibling GEMMs packed into one.

The GEMM core, as both torch exporters write a Linear (W a constant; the fused node takes it as
[N, K], transposed from a MatMul's [K, N]; a Gemm's beta is folded into the bias, alpha kept)::

    X [..., K] ─► MatMul(X, W) ─────────────────────────────► [Add(b)] ─► pre        (batched, any rank >= 2)
    X [M, K]   ─► Gemm(X, W, [C], transB 0|1, alpha, beta) ─► [Add(b)] ─► pre
    X2 [M, K]  ─► Gemm | MatMul ─► [Add(b)] ─► Reshape(out_shape) ─► [Add(b)] ─► pre  (GPT-2 Conv1D)

Then, in rule order (rule ids):

- ``gemm.gated``: ``act(X @ W_gate) * (X @ W_up)``, act in GatedGemm's choices (SwiGLU, GeGLU);
  both weights constant, one X, no bias (a bias is a reason);
- ``gemm.act_residual``: ``act(pre) + r``; ``gemm.residual_act``: ``act(pre + r)``;
- ``gemm.act``: ``act(pre)``; ``gemm.residual``: ``pre + r``;
- ``gemm.siblings``: MatMuls [+ bias] reading the same input (Q/K/V) -> one GEMM + ``Split``;
- ``gemm.bias``: ``pre`` with its bias, nothing after; ``gemm.linear``: a MatMul / Gemm alone.

Activations (``patterns.ACTIVATIONS``, every association of the products)::

    relu      Relu(x)
    relu2     Pow(Relu(x), 2) | Mul(r, r), r = Relu(x)      squared ReLU (Primer, Persimmon, Nemotron)
    gelu_erf  x * 0.5 * (1 + Erf(x / √2 | x * (1/√2))), Gelu(x) (opset 20)
    gelu_tanh x * 0.5 * (1 + Tanh(√(2/π) (x + 0.044715 Pow(x, 3) | x*x*x)))     GPT-2 NewGELU
              x * 0.5 * (1 + Tanh(√(2/π) x (1 + 0.044715 x x)))                   FastGelu
              Gelu(x, approximate="tanh")
    quick_gelu x * Sigmoid(1.702 x);  silu x * Sigmoid(x);  sigmoid;  tanh

An activation or residual after the Reshape of a 2-D GEMM fuses too (elementwise ops commute with
a Reshape): the fused node runs on the rows and the Reshape follows it (an ``After`` node; a
residual is flattened to [-1, N] by a new Reshape). A GEMM's residual and a SkipNorm compete for
the same Add: see ``epilogue`` (the GEMM takes it when the sum has another reader).

Boundaries: a match fuses only up to a value nobody else reads (the planner's leak check, so the
largest safe part fuses: MatMul + bias when the pre-activation is read elsewhere). A Relu whose only
reader is its square is left to ``relu2`` (the planner meets the Relu first); a Relu read elsewhere
too fuses as ``relu`` and its square stays. Rejected with a
reason: a weight that is not a constant (attention's Q.K^T and P.V when attention did not fuse),
dtypes outside the spec, K or N not a multiple of the spec's k_multiple / n_multiple, K over max_k,
a residual that broadcasts or that the match itself computes, Gemm transA=1, a non-constant Gemm C.

The family's summary (``summary``) gives the GEMM count before and after the pass.

Targets: ``optfuse::GemmEpilogue`` v3, ``optfuse::GatedGemm`` v2 (plugins/gemm; the rules write FP16 / BF16 / FP32
nodes with the defaults, which compute what v1 did; ``relu2`` needs GemmEpilogue v3).

Modules, by role: ``patterns`` (what the rules match), ``common`` (spec facts, weight and bias),
``epilogue`` (one GEMM and its epilogue; the residual decision), ``gated``, ``siblings``,
``rules`` (the RULES list).
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from .common import EPILOGUE, GATED
from .rules import RULES

_GEMM_OPS = ("MatMul", "Gemm", EPILOGUE, GATED)


def summary(graph: gs.Graph) -> dict[str, int]:
    """The GEMMs a graph launches: MatMul, Gemm and the fused GEMM nodes (a GatedGemm is one)."""
    return {"gemms": sum(1 for n in graph.nodes if n.op in _GEMM_OPS)}


__all__ = ["RULES", "summary"]
