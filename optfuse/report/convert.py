"""``report.md``: the summary of a convert run (every step, what did not run here and why, the
fusions, precision, accuracy and engine build sections, the files written)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from ..precision import PrecisionResult
from ..trt.build import BuildReport
from .accuracy import Check, accuracy_markdown
from .build import build_markdown
from .fusion import options_markdown
from .precision import precision_markdown

SUMMARY_MD = "report.md"


class StepLike(Protocol):
    """What the summary reads of a pipeline step."""

    name: str
    state: str  # ok | failed | skipped
    detail: str
    artifacts: list[str]


def first_line(text: str) -> str:
    return text.splitlines()[0] if text else ""


def summary_markdown(name: str, model: Path, outdir: Path, steps: Sequence[StepLike], fusion: Mapping[str, Any],
                     precision: PrecisionResult, accuracy: Mapping[str, Check], build: BuildReport | None,
                     options: Mapping[str, Any] | None = None) -> str:
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
    lines += ["", f"See {model.stem}.fusion_report.md.", "", precision_markdown(precision),
              accuracy_markdown(accuracy, title="## Accuracy")]
    if build is not None:
        lines += ["", build_markdown(build)]
    lines += options_markdown(dict(options) if options else None)
    lines += ["", "## Files", ""]
    for s in steps:
        lines += [f"- {a}" for a in s.artifacts]
    return "\n".join(lines) + "\n"


def write_summary(name: str, model: Path, outdir: Path, steps: Sequence[StepLike], fusion: Mapping[str, Any],
                  precision: PrecisionResult, accuracy: Mapping[str, Check], build: BuildReport | None,
                  options: Mapping[str, Any] | None = None) -> Path:
    """``report.md`` in `outdir` (see :func:`summary_markdown`; `options`: what the run used)."""
    path = outdir / SUMMARY_MD
    path.write_text(summary_markdown(name, model, outdir, steps, fusion, precision, accuracy, build, options))
    return path
