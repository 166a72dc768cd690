"""``report.md``, ``report.json`` and ``report.html``: the summary of a convert run (every step,
what did not run here and why, the fusions with the HBM traffic saved per family, precision,
accuracy, per-node error growth and engine build sections, the files written). The three state
the same facts (:mod:`.facts`); the page needs the ``report`` extra (:mod:`.html`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from ..precision import PrecisionResult
from ..trt.build import BuildReport
from .accuracy import Check, accuracy_markdown
from .build import build_markdown
from .common import format_bytes, md_cell, write_json
from .facts import (PER_NODE_NOT_RUN, REPORT_JSON, convert_facts, hbm_by_family, per_node_sections,
                    top_offenders)
from .fusion import options_markdown
from .precision import precision_markdown

SUMMARY_MD = "report.md"
#: ranked offenders listed in report.md
TOP_ATTRIBUTION = 10


class StepLike(Protocol):
    """What the summary reads of a pipeline step."""

    name: str
    state: str  # ok | failed | skipped
    detail: str
    artifacts: list[str]


def first_line(text: str) -> str:
    return text.splitlines()[0] if text else ""


def hbm_markdown(fusion: Mapping[str, Any]) -> list[str]:
    """The "HBM traffic saved" lines: bytes per family and in total."""
    hbm = hbm_by_family(fusion)
    unknown = sum(hbm["unknown_per_family"].values())
    lines = ["", "## HBM traffic saved (estimate per run)", ""]
    if not hbm["per_family"] and not unknown:
        return lines + ["- nothing fused"]
    lines += [f"- {fam}: {format_bytes(b)}" for fam, b in hbm["per_family"].items()]
    lines += [f"- {fam}: {n} fusion(s) of unknown size" for fam, n in hbm["unknown_per_family"].items()]
    return lines + [f"- total: {format_bytes(hbm['total'])}" + (f" (plus {unknown} of unknown size)" if unknown else "")]


def per_node_markdown(per_node: Sequence[Mapping[str, Any]] | None, attribution: Sequence[Mapping[str, Any]] = (),
                      run: Mapping[str, Any] | None = None, top: int = TOP_ATTRIBUTION) -> list[str]:
    """The "Per-node error growth" lines (:mod:`.facts`' per-node keys): how it ran, each FP16
    overflow, the ranked offenders (attribution), the fused nodes that add the most error; or why
    there are none."""
    lines = ["", "## Per-node error growth", ""]
    if per_node is None:
        return lines + [f"not run: {PER_NODE_NOT_RUN}"]
    if run:
        lines += [f"{run['compared_tensors']} tensors compared ({run['mode']} candidate, {run['iterations']} "
                  f"iteration(s), seed {run['seed']}; {run['chunks']} chunk(s) of up to {run['chunk_size']}).", ""]
        lines += [f"Not compared: {md_cell(run['left_out'])}.", ""] if run.get("left_out") else []
        lines += [f"- FP16 overflow: {md_cell(t)}" for t in run.get("overflow") or ()]
        lines += [""] if run.get("overflow") else []
    if attribution:
        lines += [f"Ranked offenders (error added; the top {min(top, len(attribution))} of {len(attribution)}):", "",
                  "| # | kind | name | growth | detail |", "|---|---|---|---|---|"]
        lines += [f"| {i} | {o['kind']} | `{o['name']}` | {_num(o['growth'])} | {md_cell(o['detail'])} |"
                  for i, o in enumerate(attribution[:top], 1)]
        lines.append("")
    if not per_node:
        return lines + ["No fused node was compared."]
    lines += [f"{len(per_node)} node(s) compared; the top offenders:", "",
              "| node | op | rule | depth | error in | error out | growth |", "|---|---|---|---|---|---|---|"]
    for e in top_offenders(per_node, attribution=attribution):
        lines.append(f"| {e['node']} | {e['op']} | {e['rule']} | {e['depth']} | {_num(e['err_in'])} | "
                     f"{_num(e['err_out'])} | {_num(e['growth'])} |")
    return lines


def _num(x: float | str) -> str:
    return f"{float(x):.3g}"


def summary_markdown(name: str, model: Path, outdir: Path, steps: Sequence[StepLike], fusion: Mapping[str, Any],
                     precision: PrecisionResult, accuracy: Mapping[str, Check], build: BuildReport | None,
                     options: Mapping[str, Any] | None = None,
                     per_node: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None) -> str:
    """report.md (`per_node`: the per-node facts, see :func:`.facts.per_node_sections`)."""
    lines = [f"# optfuse convert: {name}", "", f"- model: {model}", f"- output directory: {outdir}", "",
             "| step | result | detail |", "|---|---|---|"]
    for s in steps:
        detail = first_line(s.detail).replace("|", "\\|")
        lines.append(f"| {s.name} | {s.state} | {detail} |")
    skipped = [s for s in steps if s.state == "skipped"]
    if skipped:
        lines += ["", "## Not run here", ""] + [f"- {s.name}: {s.detail}" for s in skipped]
    lines += ["", "## Fusions", ""]
    per_op: dict[str, int] = {}
    for f in fusion.get("fusions", []):
        per_op[f["op"]] = per_op.get(f["op"], 0) + 1
    lines += [f"- {op}: {n}" for op, n in sorted(per_op.items())] or ["- nothing fused"]
    lines += [f"- rejected: {len(fusion.get('rejected', []))}"]
    lines += ["", f"See {model.stem}.fusion_report.md."]
    lines += hbm_markdown(fusion)
    lines += ["", precision_markdown(precision), accuracy_markdown(accuracy, title="## Accuracy")]
    pn = per_node_sections(per_node)
    lines += per_node_markdown(pn["per_node"], pn["attribution"], pn["per_node_run"])
    if build is not None:
        lines += ["", build_markdown(build)]
    lines += options_markdown(dict(options) if options else None)
    lines += ["", "## Files", ""]
    for s in steps:
        lines += [f"- {a}" for a in s.artifacts]
    return "\n".join(lines) + "\n"


def write_summary(name: str, model: Path, outdir: Path, steps: Sequence[StepLike], fusion: Mapping[str, Any],
                  precision: PrecisionResult, accuracy: Mapping[str, Check], build: BuildReport | None,
                  options: Mapping[str, Any] | None = None,
                  per_node: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
                  html: Path | None = None) -> Path:
    """``report.md`` and ``report.json`` in `outdir` (see :func:`summary_markdown`; `options`: what
    the run used; `per_node`: the per-node comparison, None when it did not run), and the page at
    `html` when given (the caller checks :func:`.html.missing_extra` first). Returns report.md."""
    path = outdir / SUMMARY_MD
    path.write_text(summary_markdown(name, model, outdir, steps, fusion, precision, accuracy, build, options, per_node))
    facts = convert_facts(name, model, outdir, steps, fusion, precision, accuracy, build, options, per_node)
    write_json(outdir / REPORT_JSON, facts)
    if html is not None:
        from .html import write_html

        write_html(facts, html)
    return path
