"""``build_report.json`` and ``build_report.md`` from a :class:`~optfuse.trt.build.BuildReport`
(also the "Engine build" section of the convert summary)."""

from __future__ import annotations

from pathlib import Path

from ..trt.build import BuildReport
from .common import format_bytes, write_json

BUILD_JSON = "build_report.json"
BUILD_MD = "build_report.md"


def build_markdown(report: BuildReport) -> str:
    lines = [
        "## Engine build",
        "",
        f"- backend: {report.backend} {report.backend_version} (plugins: {report.plugin_mode})",
        f"- target: {report.target}",
        f"- engine: {report.engine or '(not written)'} ({format_bytes(report.engine_bytes)})",
        f"- layers: {sum(report.layers_by_kind.values())} total, "
        + ", ".join(f"{k} {v}" for k, v in sorted(report.layers_by_kind.items())),
        f"- optfuse nodes in the model: {report.optfuse_nodes}; plugin layers: {len(report.plugin_layers)}",
        f"- parse {report.parse_seconds:.2f} s, build {report.build_seconds:.2f} s",
    ]
    if report.timing_cache:
        lines.append(f"- timing cache: {report.timing_cache}")
    if report.build_log:
        lines.append(f"- build log: {report.build_log}")
    if not report.runnable_here:
        lines.append(f"- not executed here: {report.not_runnable_reason}")
    if report.profiles:
        lines += ["", "| input | min | opt | max |", "|---|---|---|---|"]
        for name, p in report.profiles.items():
            lines.append(f"| {name} | {p['min']} | {p['opt']} | {p['max']} |")
    if report.plugin_layers:
        lines += ["", "| plugin layer | op | version | form |", "|---|---|---|---|"]
        for p in report.plugin_layers:
            lines.append(f"| {p.name} | {p.namespace}::{p.op} | {p.version} | {p.form} |")
    fp8 = getattr(report, "fp8_layers", None) or []
    if fp8:
        lines += ["", f"Layers that run FP8 ({len(fp8)}): " + ", ".join(fp8)]
    if report.layer_types:
        lines += ["", "| layer type | count |", "|---|---|"]
        for t, c in sorted(report.layer_types.items(), key=lambda kv: (-kv[1], kv[0])):
            lines.append(f"| {t} | {c} |")
    for w in report.warnings:
        lines.append(f"- warning: {w}")
    return "\n".join(lines) + "\n"


def write_build_report(report: BuildReport, directory: Path, options: dict | None = None) -> tuple[Path, Path]:
    """``build_report.json`` (the report's fields, and `options`: what the build used and where each
    value came from) and ``build_report.md`` in `directory`."""
    from .fusion import options_markdown

    directory.mkdir(parents=True, exist_ok=True)
    j, m = directory / BUILD_JSON, directory / BUILD_MD
    data = report.to_dict()
    if options is not None:
        data["options"] = options
    write_json(j, data)
    m.write_text(build_markdown(report) + "".join(f"{line}\n" for line in options_markdown(options)))
    return j, m
