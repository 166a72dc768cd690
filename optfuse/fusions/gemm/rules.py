"""The GEMM rules, in priority order: each longer epilogue before the shorter ones it contains, so
each GEMM fuses as far as is safe (the planner runs the rules one after the other over the whole
graph and skips nodes a rule before took; within one rule, the root is the last node of the chain)."""

from __future__ import annotations

from ...pattern import FusionRule
from . import patterns as p
from .common import EPILOGUE, GATED, choices
from .epilogue import check_for, emit
from .gated import check_gated
from .siblings import check_siblings

_ACTS = choices(EPILOGUE, "activation")
AFTER, BEFORE = choices(EPILOGUE, "residual_position")

RULES = [
    FusionRule("gemm.gated", GATED, p.gated(choices(GATED, "activation")), check_gated, emit,
               doc="act(X @ W_gate) * (X @ W_up): SwiGLU, GeGLU"),
    FusionRule("gemm.act_residual", EPILOGUE, p.residual_add(p.activated(p.core(), "act", _ACTS)),
               check_for(AFTER), emit, doc="act(X @ W + b) + residual"),
    FusionRule("gemm.residual_act", EPILOGUE, p.activated(p.residual_add(p.core()), "act", _ACTS),
               check_for(BEFORE), emit, doc="act(X @ W + b + residual)"),
    FusionRule("gemm.act", EPILOGUE, p.activated(p.core(), "act", _ACTS), check_for(None), emit,
               doc="act(X @ W + b)"),
    FusionRule("gemm.residual", EPILOGUE, p.residual_add(p.core()), check_for(AFTER), emit,
               doc="X @ W + b + residual"),
    FusionRule("gemm.siblings", EPILOGUE, p.Siblings(), check_siblings, emit,
               doc="MatMuls [+ bias] reading one input -> one GEMM over the concatenated weight + Split"),
    FusionRule("gemm.bias", EPILOGUE, p.biased_core(), check_for(None), emit, doc="X @ W + b"),
    FusionRule("gemm.linear", EPILOGUE, p.bare_core(), check_for(None), emit, doc="X @ W (a Gemm's C included)"),
]
