"""Console tables of the fuse, inspect and verify commands (rich); the files are the report stage's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:  # the pipeline and the stages are imported when a command runs, not for --help
    from ..pipeline import FuseOutcome
    from ..verify import VerifyResult


def format_bytes(n: int | None) -> str:
    from ..report import format_bytes as fmt

    return fmt(n)


def dims_text(report: dict) -> str:
    dims = report.get("dims") or {}
    text = ", ".join(f"{k}={v}" for k, v in dims.items()) or "none"
    return f"{text} ({report['dims_source']})" if report.get("dims_source") and dims else text


def fuse_summary(out: Console, outcome: FuseOutcome) -> None:
    report = outcome.report
    t = Table(title=f"Fused {outcome.model.name}", title_justify="left")
    t.add_column("op")
    t.add_column("fused nodes", justify="right")
    t.add_column("HBM saved (est.)", justify="right")
    per_op: dict[str, list] = {}
    for f in report["fusions"]:
        per_op.setdefault(f["op"], []).append(f["hbm_saved_bytes"])
    for op, saved in sorted(per_op.items()):
        known = [s for s in saved if s is not None]
        if not known:
            text = "unknown"
        else:
            text = format_bytes(sum(known)) + (f" + {len(saved) - len(known)} unknown" if len(known) < len(saved) else "")
        t.add_row(op, str(len(saved)), text)
    if not per_op:
        t.add_row("(nothing fused)", "0", "-")
    out.print(t)
    total = format_bytes(report["hbm_saved_bytes_total"])
    unknown = f" (+{report['hbm_unknown']} unknown)" if report["hbm_unknown"] else ""
    if report["hbm_unknown"] and report["hbm_unknown"] == report["fused_nodes"]:
        total, unknown = "unknown", ""
    out.print(f"{report['original_nodes_replaced']} nodes -> {report['fused_nodes']} fused nodes; "
              f"HBM traffic saved per run ~{total}{unknown}; {len(report['rejected'])} candidate(s) rejected; "
              f"dims {dims_text(report)}")
    out.print(f"wrote {outcome.output}")
    for p in outcome.report_paths:
        out.print(f"wrote {p}")


def fusions(out: Console, report: dict, title: str) -> None:
    if not report["fusions"]:
        out.print(f"{title}: nothing")
        return
    t = Table(title=f"{title} ({len(report['fusions'])})", title_justify="left")
    for col in ("op", "rule", "original nodes", "HBM saved", "info"):
        t.add_column(col, justify="right" if col == "HBM saved" else "left")
    for f in report["fusions"]:
        nodes = ", ".join(f["nodes"][:4]) + (f" (+{len(f['nodes']) - 4})" if len(f["nodes"]) > 4 else "")
        info = ", ".join(f"{k}={v}" for k, v in (f.get("info") or {}).items())
        t.add_row(f["op"], f["rule"], nodes, format_bytes(f["hbm_saved_bytes"]), info)
    out.print(t)


def rejected(out: Console, report: dict) -> None:
    if not report["rejected"]:
        out.print("Not fused: no candidate was rejected")
        return
    t = Table(title=f"Not fused ({len(report['rejected'])})", title_justify="left")
    for col in ("op", "rule", "nodes", "reason"):
        t.add_column(col)
    for r in report["rejected"]:
        nodes = ", ".join(r["nodes"][:4]) + (f" (+{len(r['nodes']) - 4})" if len(r["nodes"]) > 4 else "")
        t.add_row(r["op"], r["rule"], nodes, r["reason"])
    out.print(t)


def verification(out: Console, result: VerifyResult, show_inputs: bool = False) -> None:
    if show_inputs:
        t = Table(title="Inputs", title_justify="left")
        for col in ("input", "dtype", "shape", "values"):
            t.add_column(col)
        for i in result.inputs:
            t.add_row(i.name, i.dtype, str(i.shape), i.source)
        out.print(t)
    t = Table(title=f"Verification: {result.iterations} iteration(s), seed {result.seed}", title_justify="left")
    # an FP8 candidate (held to cosine similarity) or a head output also shows cosine and top-1
    agreement = any(o.min_cosine is not None or o.top1 is not None for o in result.outputs)
    cols = ("output", "max abs", "max rel", "mean abs", *(("cosine", "top-1") if agreement else ()), "atol", "rtol",
            "result")
    for col in cols:
        t.add_column(col, justify="left" if col in ("output", "result") else "right")
    for o in result.outputs:
        res = "[green]pass[/]" if o.passed else "[red]FAIL[/]" + (f" ({o.note})" if o.note else "")
        extra = (("-" if o.cosine is None else f"{o.cosine:.5f}", "-" if o.top1 is None else f"{100 * o.top1:.1f}%")
                 if agreement else ())
        t.add_row(o.name, f"{o.max_abs:.3g}", f"{o.max_rel:.3g}", f"{o.mean_abs:.3g}", *extra, f"{o.atol:g}",
                  f"{o.rtol:g}", res)
    out.print(t)
    if result.left_out:
        out.print(f"{result.left_out[:1].upper()}{result.left_out[1:]}.", markup=False, highlight=False)
    out.print("[green]verification passed[/]" if result.passed else "[red]verification failed[/]")
