"""``accuracy_report.json`` and ``accuracy_report.md``: each accuracy check of a convert run
(onnxruntime: FP32 original vs fused + precision model; engine: FP32 original vs TensorRT engine),
each a :class:`~optfuse.verify.VerifyResult`, or why it compared nothing."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Union

from ..verify import CheckError, NotExecuted, VerifyResult
from .common import write_json

ACCURACY_JSON = "accuracy_report.json"
ACCURACY_MD = "accuracy_report.md"

Check = Union[VerifyResult, CheckError, NotExecuted]
#: The checks, in report order, with their section titles.
CHECKS = (("onnxruntime", "FP32 original vs fused + precision model (onnxruntime CPU)"),
          ("baseline", "FP32 original vs the fp8 run's base-precision model, same inputs (onnxruntime CPU)"),
          ("engine", "FP32 original (onnxruntime) vs TensorRT engine (polygraphy TrtRunner)"))


def check_dict(check: Check) -> dict[str, Any]:
    if isinstance(check, VerifyResult):
        return check.to_dict()
    if isinstance(check, CheckError):
        return {"passed": False, "error": check.error}
    return {"executed": False, "reason": check.reason} if check.reason else {"executed": False, "error": check.error}


def accuracy_dict(checks: Mapping[str, Check]) -> dict[str, dict[str, Any]]:
    return {name: check_dict(c) for name, c in checks.items()}


def accuracy_markdown(checks: Mapping[str, Check], title: str = "# Accuracy") -> str:
    acc = accuracy_dict(checks)
    lines = [title, ""]
    for label, heading in CHECKS:
        d = acc.get(label)
        lines += [f"## {heading}", ""]
        if d is None:
            lines += ["not run", ""]
            continue
        if "outputs" not in d:
            lines += [f"not executed: {d.get('reason') or d.get('error')}", ""]
            continue
        lines += [f"{d['iterations']} iteration(s), seed {d['seed']}: **{'pass' if d['passed'] else 'FAIL'}**", ""]
        if d.get("method"):
            lines += [f"Candidate run as: {d['method']}.", ""]
        if d.get("left_out"):
            lines += [f"{d['left_out'][:1].upper()}{d['left_out'][1:]}.", ""]
        lines += ["| output | max abs | max rel | mean abs | p99 abs | cosine | top-1 | atol | rtol | result |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for o in d["outputs"]:
            lines.append(f"| {o['name']} | {o['max_abs']:.3g} | {o['max_rel']:.3g} | {o['mean_abs']:.3g} | "
                         f"{p99_text(o)} | {agreement_text(o, 'cosine')} | {agreement_text(o, 'top1')} | "
                         f"{o['atol']:g} | {o['rtol']:g} | {'pass' if o['passed'] else 'FAIL ' + o.get('note', '')} |")
        lines.append("")
    return "\n".join(lines)


def agreement_text(output: Mapping[str, Any], key: str) -> str:
    """An output's cosine similarity / top-1 agreement, with the bar it was held to (``-``: none computed)."""
    value = output.get(key)
    if value is None:
        return "-"
    bar = output.get("min_cosine" if key == "cosine" else "min_top1")
    text = f"{value:.5f}" if key == "cosine" else f"{100 * value:.1f}%"
    return text + (f" (>= {bar:g})" if bar is not None else "")


def p99_text(output: Mapping[str, Any]) -> str:
    """The 0.99 quantile of an output's |diff| (``-`` when none was computed)."""
    q = next((v for p, v in output.get("abs_quantiles") or () if p == 0.99), None)
    return "-" if q is None else f"{q:.3g}"


def write_accuracy_report(checks: Mapping[str, Check], directory: Path) -> tuple[Path, Path]:
    j, m = directory / ACCURACY_JSON, directory / ACCURACY_MD
    write_json(j, accuracy_dict(checks))
    m.write_text(accuracy_markdown(checks))
    return j, m


def verify_line(v: VerifyResult) -> str:
    """One line for a step table: how many outputs passed, and the worst one."""
    worst = max(v.outputs, key=lambda o: o.max_abs / max(o.atol + o.rtol, 1e-30), default=None)
    if worst is None:
        return "no outputs compared"
    line = (f"{sum(o.passed for o in v.outputs)}/{len(v.outputs)} outputs within tolerance; worst {worst.name}: "
            f"max abs {worst.max_abs:.3g} (atol {worst.atol:g}, rtol {worst.rtol:g})")
    return f"{line}; {v.method.split(' (')[0]}" if v.method else line
