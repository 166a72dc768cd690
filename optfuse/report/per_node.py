"""The per-node facts of a candidate (``verify --per-node``, ``optfuse debug``): JSON and Markdown.

Two lists, with these keys:

- ``per_node``: every fused node, in graph order: ``{node, op, rule, replaced, depth, err_in, err_out,
  growth}`` (max abs errors against the original at the node's inputs and outputs; growth = out - in;
  depth = the node's topological index in the candidate graph);
- ``attribution``: the ranked offenders, ``{kind, name, growth, detail, depth}`` with kind ``fused_node``,
  ``cast`` (a Cast the precision stage added), ``keep_fp32`` (a node kept in FP32) or ``node`` (an
  unfused node computing in the candidate's reduced precision); an FP16 overflow names the tensor
  and its range in the detail.

A value that is not finite (an overflow: inf) is written as the string ``"inf"`` (``"nan"``), so the
JSON stays strict.
"""

from __future__ import annotations

import math
from typing import Any

from ..verify.per_node import NodeError, Offender, PerNodeResult

#: Offenders shown by the CLI and the Markdown report.
TOP_OFFENDERS = 10


def number(x: float) -> float | str:
    """A float, or "inf" / "-inf" / "nan" (strict JSON has no such numbers)."""
    return float(x) if math.isfinite(x) else str(float(x))


def node_entry(n: NodeError) -> dict[str, Any]:
    return {"node": n.node, "op": n.op, "rule": n.rule, "replaced": list(n.replaced), "depth": n.depth,
            "err_in": number(n.err_in), "err_out": number(n.err_out), "growth": number(n.growth)}


def offender_entry(o: Offender) -> dict[str, Any]:
    return {"kind": o.kind, "name": o.name, "growth": number(o.growth), "detail": o.detail, "depth": o.depth}


def per_node_facts(result: PerNodeResult, offenders: list[Offender]) -> dict[str, Any]:
    """The facts every report (JSON, Markdown, HTML) draws on."""
    overflow = [t.range_text() for t in result.tensors.values() if t.overflow]
    return {
        "mode": result.mode, "iterations": result.iterations, "seed": result.seed,
        "compared_tensors": len(result.tensors), "chunks": result.chunks, "chunk_size": result.chunk_size,
        "per_node": [node_entry(n) for n in result.fused],
        "attribution": [offender_entry(o) for o in offenders],
        "overflow": overflow,
        "left_out": result.left_out,
    }


def per_node_markdown(facts: dict[str, Any], top: int = TOP_OFFENDERS, title: str = "## Per-node error") -> str:
    lines = [title, "",
             f"{facts['compared_tensors']} tensors compared ({facts['mode']} candidate, {facts['iterations']} "
             f"iteration(s), seed {facts['seed']}; {facts['chunks']} chunk(s) of up to {facts['chunk_size']}).", ""]
    if facts.get("left_out"):
        lines += [f"Not compared: {facts['left_out']}.", ""]
    if facts["overflow"]:
        lines += ["FP16 overflow:", ""] + [f"- {t}" for t in facts["overflow"][:top]] + [""]
    lines += [f"### Top {min(top, len(facts['attribution']))} offenders (error added)", "",
              "| # | kind | name | growth | detail |", "|---|---|---|---|---|"]
    for i, o in enumerate(facts["attribution"][:top], 1):
        lines.append(f"| {i} | {o['kind']} | `{o['name']}` | {_text(o['growth'])} | {o['detail']} |")
    lines += ["", "### Fused nodes", "", "| depth | node | rule | replaced | err in | err out | growth |",
              "|---|---|---|---|---|---|---|"]
    for n in facts["per_node"]:
        replaced = ", ".join(n["replaced"][:3]) + (" ..." if len(n["replaced"]) > 3 else "")
        lines.append(f"| {n['depth']} | `{n['node']}` | {n['rule']} | {replaced} | {_text(n['err_in'])} | "
                     f"{_text(n['err_out'])} | {_text(n['growth'])} |")
    lines.append("")
    return "\n".join(lines)


def _text(x: float | str) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def debug_markdown(report: dict[str, Any]) -> str:
    """``debug_report.md``: the verdict, the recipe patch, every step tried, the per-node facts."""
    import yaml

    verdict = ("passes as it is" if report["passed_before"] else
               "fixed by the patch" if report["passed_after"] else "not fixed")
    lines = ["# optfuse debug", "", f"Model: `{report['model']}`; candidate {verdict}.", "",
             f"**Found:** {report['fault']}", ""]
    if report["patch"]:
        lines += ["## Recipe patch", "", "```yaml", yaml.safe_dump(report["patch"], sort_keys=False).rstrip(), "```", ""]
    lines += ["## Steps", "", "| # | stage | change | result | worst output |", "|---|---|---|---|---|"]
    for i, s in enumerate(report["steps"], 1):
        lines.append(f"| {i} | {s['stage']} | {s['change']} | {'pass' if s['passed'] else 'FAIL'} | {s['worst']} |")
    lines.append("")
    if "per_node" in report:
        lines.append(per_node_markdown(report["per_node"], title="## Per-node error of the failing candidate"))
    return "\n".join(lines)
