"""``precision_report.json`` and the "Precision" section of the convert summary, from a
:class:`~optfuse.precision.PrecisionResult`."""

from __future__ import annotations

from pathlib import Path

from ..precision import PrecisionResult
from .common import write_json

PRECISION_JSON = "precision_report.json"


def precision_markdown(result: PrecisionResult) -> str:
    if result.mode == "fp32":
        return "## Precision\n\n- mode: fp32 (model unchanged)\n"
    nodes = result.keep_fp32_nodes
    lines = [
        "## Precision",
        "",
        f"- mode: {result.mode} (strongly typed; converter: {result.converter})",
        f"- graph inputs/outputs: {'kept as exported' if result.io_dtype == 'keep' else result.mode}",
        f"- initializers converted: {result.initializers_converted}; Cast nodes added: {result.casts_added}",
        f"- optfuse nodes: {result.optfuse_nodes} (all in {result.mode} unless listed below)",
        f"- kept in FP32, by op type: {', '.join(result.keep_fp32_ops) or 'none'}",
        f"- kept in FP32, by node: {len(nodes)} node(s)"
        + (f" ({', '.join(nodes[:8])}{', ...' if len(nodes) > 8 else ''})" if nodes else ""),
    ]
    lines += [f"- note: {n}" for n in result.notes]
    return "\n".join(lines) + "\n"


def write_precision_report(result: PrecisionResult, directory: Path) -> Path:
    path = directory / PRECISION_JSON
    write_json(path, result.to_dict())
    return path
