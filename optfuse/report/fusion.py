"""``fusion_report.json`` and ``fusion_report.md`` from a FusionResult.

The report lists what was fused (rule, op, fused node, the original nodes it replaced, extra facts
the rule recorded such as the attention mask class and window; for attention nodes also the tile
density at the report's dims and the fractions of score FLOPs and K/V reads the mask removes,
``sparsity``), the counts a family summarises before and
after its pass (the GEMM family: GEMM launches), what was not and why, and an estimate of the
HBM traffic each fusion saves: bytes the original nodes read and wrote minus what the fused node
reads and writes (that last figure too, ``hbm_moved_bytes``: attention over a KV cache counts its
K/V reads at the KV heads), with symbolic dims resolved from the recipe's opt shapes (or the defaults of
:mod:`optfuse.defaults`). An estimate that depends on a dim nobody resolved is ``null`` in JSON and ``unknown`` in Markdown.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .. import __version__
from ..estimate import TrafficEstimate
from ..rewrite import FusionResult
from .common import atomic_write, format_bytes, json_default, jsonable, md_cell, names_cell, short

REPORT_JSON = "fusion_report.json"
REPORT_MD = "fusion_report.md"


def report_stem(model_name: str | None = None) -> str:
    """``<model>.fusion_report`` (so two models can share a folder), or ``fusion_report``."""
    return f"{model_name}.fusion_report" if model_name else "fusion_report"


def build_report(result: FusionResult, *, estimate: TrafficEstimate | None = None, model: str | None = None,
                 fused_model: str | None = None, recipe: str | None = None, dims: dict[str, int] | None = None,
                 dims_source: str = "", families: list[str] | None = None,
                 verification: dict | None = None, options: dict | None = None) -> dict[str, Any]:
    """A JSON-ready dict describing `result` (see the module doc)."""
    fusions = []
    for acc in result.accepted:
        info = getattr(acc.rewrite, "info", None) or {}
        fusions.append({
            "rule": acc.rule,
            "op": acc.op,
            "node": acc.node_name,
            "nodes": list(acc.nodes),
            "hbm_saved_bytes": estimate.saved_bytes.get(acc.node_name) if estimate is not None else None,
            # what the fused node still reads and writes (attention over a cache: the K/V at Hkv heads)
            "hbm_moved_bytes": estimate.moved_bytes.get(acc.node_name) if estimate is not None else None,
            "info": jsonable(info),
        })
        work = estimate.sparsity.get(acc.node_name) if estimate is not None else None
        if work:
            fusions[-1]["sparsity"] = jsonable(work)
    known = [f["hbm_saved_bytes"] for f in fusions if f["hbm_saved_bytes"] is not None]
    report: dict[str, Any] = {
        "optfuse_version": __version__,
        "model": model,
        "fused_model": fused_model,
        "recipe": recipe,
        "families": families,
        "dims": dict(dims or {}),
        "dims_source": dims_source,
        "counts": dict(sorted(result.counts().items())),
        "fused_nodes": len(fusions),
        "original_nodes_replaced": sum(len(f["nodes"]) for f in fusions),
        "hbm_saved_bytes_total": sum(known) if fusions else 0,
        "hbm_unknown": len(fusions) - len(known),
        "summary": jsonable(getattr(result, "summary", {}) or {}),
        "fusions": fusions,
        "rejected": [
            {"rule": r.rule, "op": r.op, "nodes": list(r.nodes), "reason": r.reason} for r in result.rejected
        ],
    }
    if verification is not None:
        report["verification"] = verification
    if options is not None:
        report["options"] = options  # what the run used, and where each value came from
    return report


def sparsity_cell(work: dict[str, Any]) -> str:
    """An attention node's mask facts at the report's dims: tile density and what the skipped tiles
    remove (see `optfuse.estimate.attention_sparsity`)."""
    parts = [f"Sq={work['sq']}, Sk={work['sk']}: {work['tile']}-tile density {work['block_density']:.3g}"]
    if "visible_fraction" in work:
        parts.append(f"visible scores {work['visible_fraction']:.3g}")
    if "flops_removed" in work:
        parts.append(f"score FLOPs removed {work['flops_removed']:.1%}, K/V reads removed {work['kv_reads_removed']:.1%}")
    return ", ".join(parts)


def options_markdown(options: dict[str, Any] | None) -> list[str]:
    """The "Options" lines of a report: each setting the run used and where it came from."""
    if not options:
        return []
    lines = ["", "## Options", ""]
    if options.get("recipe"):
        lines.append(f"- recipe: `{options['recipe']}`")
    for name, d in (options.get("dims") or {}).items():
        lines.append(f"- dim `{name}`: min {d['min']}, opt {d['opt']}, max {d['max']} ({d['source']})")
    for name, s in (options.get("shapes") or {}).items():
        lines.append(f"- shape `{name}`: min {s['min']}, opt {s['opt']}, max {s['max']} (command line)")
    p = options.get("precision")
    if p:
        lines.append(f"- precision: {p['mode']} ({p['source']}); keep FP32: "
                     f"{', '.join(p['keep_fp32']) or 'none'} ({p['keep_fp32_source']})")
    t = options.get("tolerances")
    if t:
        given = [f"atol {t['atol']:g}" if t.get("atol") is not None else "",
                 f"rtol {t['rtol']:g}" if t.get("rtol") is not None else ""]
        given += [f"{o} atol {v:g}" for o, v in (t.get("outputs_atol") or {}).items()]
        given += [f"{o} rtol {v:g}" for o, v in (t.get("outputs_rtol") or {}).items()]
        lines.append(f"- tolerances: {', '.join(g for g in given if g) or 'per precision mode'} ({t['source']})")
    v = options.get("verify")
    if v:
        lines.append(f"- per-node comparison: {'on' if v['per_node'] else 'off'}, up to {v['chunk_size']} tensors "
                     f"per run ({v['source']})")
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    lines = ["# optfuse fusion report", ""]
    meta = [("model", report.get("model")), ("fused model", report.get("fused_model")),
            ("recipe", report.get("recipe")), ("optfuse", report.get("optfuse_version"))]
    for k, v in meta:
        if v:
            lines.append(f"- **{k}**: `{v}`")
    if report.get("families") is not None:
        lines.append(f"- **families**: {', '.join(report['families']) or 'none'}")
    dims = report.get("dims") or {}
    if dims:
        src = f" ({report['dims_source']})" if report.get("dims_source") else ""
        lines.append(f"- **dims**{src}: " + ", ".join(f"{k}={v}" for k, v in dims.items()))
    lines += ["", "## Summary", ""]
    counts = report.get("counts") or {}
    if counts:
        lines += ["| op | fused nodes |", "|---|---:|"]
        lines += [f"| {op} | {n} |" for op, n in counts.items()]
    else:
        lines.append("Nothing was fused.")
    total = report.get("hbm_saved_bytes_total", 0)
    unknown = report.get("hbm_unknown", 0)
    if unknown and unknown == report.get("fused_nodes"):
        saved = "**unknown** (symbolic dims the estimate could not resolve)"
    else:
        saved = f"**{format_bytes(total)}**" + (f" (plus {unknown} fusion(s) of unknown size)" if unknown else "")
    lines += ["", f"Original nodes replaced: {report.get('original_nodes_replaced', 0)}. "
              f"Estimated HBM traffic saved per run: {saved}."]

    summary = report.get("summary") or {}
    if summary:
        lines += ["", "Per family, before and after its pass:", "", "| family | count | before | after |",
                  "|---|---|---:|---:|"]
        lines += [f"| {fam} | {what} | {v['before']} | {v['after']} |"
                  for fam, counts in summary.items() for what, v in counts.items()]

    ver = report.get("verification")
    if ver:
        lines += ["", "## Verification", "",
                  f"{'PASSED' if ver.get('passed') else 'FAILED'} over {ver.get('iterations')} iteration(s) "
                  f"(seed {ver.get('seed')}).", "",
                  *([f"{ver['left_out'][:1].upper()}{ver['left_out'][1:]}.", ""] if ver.get("left_out") else []),
                  "| output | max abs | max rel | mean abs | atol | rtol | result |", "|---|---:|---:|---:|---:|---:|---|"]
        for o in ver.get("outputs", []):
            res = "pass" if o["passed"] else ("FAIL" + (f": {o['note']}" if o.get("note") else ""))
            lines.append(f"| `{o['name']}` | {o['max_abs']:.3g} | {o['max_rel']:.3g} | {o['mean_abs']:.3g} | "
                         f"{o['atol']:g} | {o['rtol']:g} | {res} |")

    lines += ["", "## Fusions", ""]
    if report["fusions"]:
        lines += ["| fused node | op | rule | original nodes | HBM saved | HBM moved | info |",
                  "|---|---|---|---|---:|---:|---|"]
        for f in report["fusions"]:
            info = ", ".join(f"{k}={short(v)}" for k, v in f.get("info", {}).items())
            if f.get("sparsity"):
                info += "; " + sparsity_cell(f["sparsity"])
            lines.append(f"| `{f['node']}` | {f['op']} | `{f['rule']}` | {names_cell(f['nodes'])} | "
                         f"{format_bytes(f['hbm_saved_bytes'])} | {format_bytes(f.get('hbm_moved_bytes'))} | "
                         f"{md_cell(info)} |")
    else:
        lines.append("None.")
    lines += ["", "## Not fused", ""]
    if report["rejected"]:
        lines += ["| rule | op | nodes | reason |", "|---|---|---|---|"]
        for r in report["rejected"]:
            lines.append(f"| `{r['rule']}` | {r['op']} | {names_cell(r['nodes'])} | {md_cell(r['reason'])} |")
    else:
        lines.append("No candidate was rejected.")
    lines += options_markdown(report.get("options"))
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], directory: str | os.PathLike, stem: str = "fusion_report") -> tuple[Path, Path]:
    """Write `<stem>.json` and `<stem>.md` into `directory` (each atomically)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    json_path, md_path = directory / f"{stem}.json", directory / f"{stem}.md"
    atomic_write(json_path, json.dumps(report, indent=2, default=json_default) + "\n")
    atomic_write(md_path, render_markdown(report))
    return json_path, md_path
