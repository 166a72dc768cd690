"""Fusion families, applied in a fixed order; each family is one module with a RULES list.

Order matters: plain norms are fused first so that the Skip rules can absorb the residual Add
into an already fused norm node; attention runs on the graph left by the norm families.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

import onnx_graphsurgeon as gs

from ..pattern import Context
from ..rewrite import FusionResult, apply_plan, plan_family

# family name -> module (in application order)
FAMILIES: dict[str, str] = {
    "layer_norm": "optfuse.fusions.layer_norm",
    "rms_norm": "optfuse.fusions.rms_norm",
    "skip_norm": "optfuse.fusions.skip_norm",
    "attention": "optfuse.fusions.attention",
}


def available_families() -> list[str]:
    out = []
    for name, mod in FAMILIES.items():
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            if exc.name == mod:
                continue
            raise
        out.append(name)
    return out


def family_rules(name: str):
    return importlib.import_module(FAMILIES[name]).RULES


def fuse_graph(graph: gs.Graph, ctx: Context, families: Iterable[str] | None = None) -> FusionResult:
    """Plan and apply each enabled family in order; returns everything accepted and rejected."""
    enabled = set(available_families() if families is None else families)
    total = FusionResult()
    for name in available_families():
        if name not in enabled:
            continue
        ctx.graph = graph
        result = plan_family(graph, family_rules(name), ctx)
        apply_plan(graph, result, ctx.dims, start_index=len(total.accepted))
        total.accepted += result.accepted
        total.rejected += result.rejected
    return total
