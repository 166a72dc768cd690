"""Fusion families, applied in a fixed order; each family is one module with a RULES list.

Order matters: plain norms are fused first so that the Skip rules can absorb the residual Add
into an already fused norm node; attention runs on the graph left by the norm families.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

import onnx_graphsurgeon as gs

from ..ir.query import concrete_shapes, probe_dims
from ..pattern import Context, FusionOptions
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
    ctx.probe_shapes = concrete_shapes(graph, probe_dims(graph))
    shapes = None  # concrete shapes at ctx.dims, inferred when the first plan is applied
    for name in available_families():
        if name not in enabled:
            continue
        ctx.graph = graph
        result = plan_family(graph, family_rules(name), ctx)
        shapes = apply_plan(graph, result, ctx.dims, start_index=len(total.accepted), shapes=shapes)
        total.accepted = _absorb(total.accepted, result.accepted) + result.accepted
        total.rejected += result.rejected
    return total


def _absorb(earlier, later):
    """Drop earlier fusions that a later family took in (e.g. LayerNorm -> SkipLayerNorm).

    The later record then lists the original nodes and the HBM savings of both steps, so the
    report describes the final graph.
    """
    by_name = {a.node_name: a for a in earlier}
    gone = set()
    for acc in later:
        nodes, saved = [], acc.hbm_saved_bytes
        for n in acc.nodes:
            prev = by_name.get(n)
            if prev is None:
                nodes.append(n)
                continue
            gone.add(n)
            nodes.extend(prev.nodes)
            saved = None if saved is None or prev.hbm_saved_bytes is None else saved + prev.hbm_saved_bytes
        acc.nodes, acc.hbm_saved_bytes = nodes, saved
    return [a for a in earlier if a.node_name not in gone]


def fuse_model(model, dims: dict[str, int] | None = None, families: Iterable[str] | None = None,
               options: FusionOptions | None = None):
    """sanitize -> match -> rewrite on a ModelProto; returns (fused ModelProto, FusionResult).

    The fused model embeds the reference function of each optfuse op it uses (onnxruntime runs it).
    """
    from ..ir import sanitize
    from ..rewrite import add_functions

    graph = sanitize(model)
    ctx = Context(graph, dims=dict(dims or {}), options=options or FusionOptions())
    result = fuse_graph(graph, ctx, families)
    fused = gs.export_onnx(graph)
    return add_functions(fused), result
