"""Fusion families, applied in a fixed order; each family is one module with a RULES list.

Order matters: plain norms are fused first, attention runs on the graph they leave, then the GEMM
family (after attention, so packing the Q/K/V projections cannot hide an attention block; before
skip_norm, so it can take a residual Add whose sum is read again, see ``gemm.epilogue``), and
last the Skip rules, which absorb each remaining residual Add into an already fused norm node.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

import onnx_graphsurgeon as gs

from ..ir.shapes import concrete_shapes, probe_dims
from ..pattern import Context, FusionOptions
from ..rewrite import FusionResult, apply_plan, inferable_model, plan_family

# family name -> module (in application order)
FAMILIES: dict[str, str] = {
    "layer_norm": "optfuse.fusions.layer_norm",
    "rms_norm": "optfuse.fusions.rms_norm",
    "attention": "optfuse.fusions.attention",
    "gemm": "optfuse.fusions.gemm",
    "skip_norm": "optfuse.fusions.skip_norm",
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


def fuse_graph(graph: gs.Graph, families: Iterable[str] | None = None,
               options: FusionOptions | None = None) -> FusionResult:
    """Plan and apply each enabled family in order; returns everything accepted and rejected.

    Each family pass gets a fresh Context (its graph facts cache holds for the graph as that pass
    sees it). The result keeps a copy of the graph as it was before any rewrite.
    """
    enabled = set(available_families() if families is None else families)
    options = options or FusionOptions()
    total = FusionResult(original=graph.copy())
    probe = probe_dims(graph)
    probe_shapes = concrete_shapes(inferable_model(graph), probe) if probe else {}
    for name in available_families():
        if name not in enabled:
            continue
        ctx = Context(graph, options=options, probe_shapes=probe_shapes)
        summarize = getattr(importlib.import_module(FAMILIES[name]), "summary", None)
        before = summarize(graph) if summarize else {}
        rules = [r for r in family_rules(name) if r.id not in options.disabled_rules]
        result = plan_family(graph, rules, ctx)
        apply_plan(graph, result, start_index=len(total.accepted))
        if summarize:
            after = summarize(graph)
            total.summary[name] = {k: {"before": v, "after": after.get(k, 0)} for k, v in before.items()}
        total.accepted = _absorb(total.accepted, result.accepted) + result.accepted
        total.rejected += result.rejected
    return total


def _absorb(earlier, later):
    """Drop earlier fusions that a later family took in (e.g. LayerNorm -> SkipLayerNorm).

    The later record then lists the original nodes of both steps (with the tensors each read and
    wrote) and the nodes both added, so the report and the estimate describe the final graph.
    """
    by_name = {a.node_name: a for a in earlier}
    gone = set()
    for acc in later:
        nodes, io, added = [], [], list(acc.added_nodes)
        for n, rw in zip(acc.nodes, acc.replaced_io):
            prev = by_name.get(n)
            if prev is None:
                nodes.append(n)
                io.append(rw)
                continue
            gone.add(n)
            nodes.extend(prev.nodes)
            io.extend(prev.replaced_io)
            added.extend(prev.added_nodes)
        acc.nodes, acc.replaced_io, acc.added_nodes = nodes, io, added
    return [a for a in earlier if a.node_name not in gone]


def fuse_model(model, dims: dict[str, int] | None = None, families: Iterable[str] | None = None,
               options: FusionOptions | None = None, weights_dir=None):
    """sanitize -> match -> rewrite on a ModelProto; returns (fused ModelProto, FusionResult).

    The fused model embeds the reference function of each optfuse op it uses (onnxruntime runs it).
    `dims` (the analysis dims) are recorded in the result for the traffic estimate
    (`optfuse.estimate.estimate_traffic`); fusing itself does not depend on them. `weights_dir`:
    where the tensors `model` left on disk live (its folder, for ``load_model(..., weights="disk")``);
    the fused model refers to the same files for the weights it keeps.
    """
    from ..ir import sanitize
    from ..ir.weights import export_graph
    from ..rewrite import add_functions

    graph = sanitize(model, weights_dir=weights_dir)
    result = fuse_graph(graph, families, options)
    result.dims = dict(dims or {})
    fused = export_graph(graph)
    _stamp_fused_nodes(fused, result)
    return add_functions(fused), result


def _stamp_fused_nodes(model, result: FusionResult) -> None:
    """Each fused node's rule id and the original nodes it replaced, as node metadata
    (``optfuse.rule``, ``optfuse.replaced``: a JSON list), for per-node verification; and where an
    attention node is not exact at padded queries, the mask input that marks them
    (``optfuse.padded_queries_inexact``), for verify to leave those positions out."""
    import json

    by_name = {a.node_name: a for a in result.accepted}
    for node in model.graph.node:
        acc = by_name.get(node.name)
        if acc is None:
            continue
        stamps = [("optfuse.rule", acc.rule), ("optfuse.replaced", json.dumps(acc.nodes))]
        if "padded_queries_inexact" in acc.rewrite.info:
            stamps.append(("optfuse.padded_queries_inexact", acc.rewrite.info["padded_queries_inexact"]))
        for key, value in stamps:
            entry = node.metadata_props.add()
            entry.key, entry.value = key, value
