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
        f"- mode: {result.mode} (strongly typed; converter: {result.converter}"
        + (f", base {result.fp8['base']})" if result.fp8 is not None else ")"),
        f"- graph inputs/outputs: {'kept as exported' if result.io_dtype == 'keep' else result.mode}",
        f"- initializers converted: {result.initializers_converted}; Cast nodes added: {result.casts_added}",
        f"- optfuse nodes: {result.optfuse_nodes} (all in "
        + (f"{result.fp8['base']} but the FP8 GEMMs below)" if result.fp8 is not None else f"{result.mode} unless listed below)"),
        f"- kept in FP32, by op type: {', '.join(result.keep_fp32_ops) or 'none'}",
        f"- kept in FP32, by node: {len(nodes)} node(s)"
        + (f" ({', '.join(nodes[:8])}{', ...' if len(nodes) > 8 else ''})" if nodes else ""),
    ]
    lines += [f"- note: {n}" for n in result.notes]
    if result.fp8 is not None:
        lines += ["", *fp8_markdown(result.fp8)]
    return "\n".join(lines) + "\n"


def _alignment(fp8: dict) -> list[str]:
    steps = fp8.get("scale_steps", 1)
    if steps <= 1:
        return []
    act = " and each max-calibrated activation's amax" if fp8["calibrator"] == "max" else ""
    return [f"- grid alignment (scale_steps {steps}): each weight channel's scale{act} times the 2^(j/{steps}), "
            f"j < {steps}, whose E4M3 rounding has the least squared error (nothing calibrated saturates)"]


def fp8_markdown(fp8: dict) -> list[str]:
    """The FP8 placement: each GEMM that runs E4M3 with its scales and their sources, the
    FlashAttention nodes in FP8 (and those kept, with why), the norms feeding FP8 GEMMs, the GEMMs
    kept in the base precision and why, and the op types kept by policy."""
    cal = fp8["calibrator"] + (f" {fp8['percentile']:g}th percentile" if fp8.get("percentile") else "")
    lines = ["### FP8 (E4M3)", "",
             f"- base precision (everything not quantized): {fp8['base']}; opset {fp8['opset'][0]} -> {fp8['opset'][1]}",
             f"- activation scales: per tensor, amax / 448, calibrator {cal}, "
             f"{fp8.get('calibration_source') or str(fp8['batches']) + ' batch(es)'}",
             "- weight scales: per output channel, max |W| / 448 of the FP32 weights", *_alignment(fp8), "",
             "| node | op | form | activation amax | a_scale | a_scale source | weight channels | w_scale range |",
             "|---|---|---|---|---|---|---|---|"]
    for g in fp8["gemms"]:
        lines.append(f"| {g['name']} | {g['op']} | {g['form']} | {g['a_amax']:.4g} | {g['a_scale']:.4g} | "
                     f"{g['a_source']} | {', '.join(map(str, g['w_channels']))} | "
                     f"{g['w_scale_range'][0]:.3g} .. {g['w_scale_range'][1]:.3g} |")
    if not fp8["gemms"]:
        lines.append("| (none) | | | | | | | |")
    if fp8.get("attention"):
        lines += ["", f"Unfused attention in TensorRT's FP8 MHA pattern (Q/DQ on Q, K, softmax output P, V): "
                  f"{len(fp8['attention'])} block(s)", "",
                  "| softmax | MatMuls | Q amax | K amax | P amax | V amax |", "|---|---|---|---|---|---|"]
        for a in fp8["attention"]:
            amax = {t["role"]: t["amax"] for t in a["tensors"]}
            lines.append(f"| {a['softmax']} | {', '.join(a['matmuls'])} | "
                         + " | ".join(f"{amax[r]:.4g}" for r in "QKPV") + " |")
    lines += _flash_attention_lines(fp8) + _norm_lines(fp8)
    lines += ["", f"GEMM-like nodes kept in {fp8['base']}: {len(fp8['skipped'])}", ""]
    if fp8["skipped"]:
        lines += ["| node | op | why |", "|---|---|---|"]
        lines += [f"| {s['name']} | {s['op']} | {s['reason']} |" for s in fp8["skipped"]]
        lines.append("")
    if fp8["kept"]:
        lines += [f"Kept in {fp8['base']} by policy: "
                  + "; ".join(f"{op} x{n} ({why})" for op, (n, why) in fp8["kept"].items()), ""]
    return lines


def _flash_attention_lines(fp8: dict) -> list[str]:
    """optfuse FlashAttention nodes taking E4M3 q, k, v (amax and scale of each), and those kept in
    the base precision with why."""
    placed, kept = fp8.get("flash_attention") or [], fp8.get("flash_attention_kept") or []
    if not placed and not kept:
        return []
    lines = ["", f"FlashAttention nodes taking E4M3 q, k, v: {len(placed)}", ""]
    if placed:
        lines += ["| node | q amax / scale | k amax / scale | v amax / scale |", "|---|---|---|---|"]
        for a in placed:
            t = {x["role"]: x for x in a["tensors"]}
            lines.append(f"| {a['name']} | " + " | ".join(f"{t[r]['amax']:.4g} / {t[r]['scale']:.4g}" for r in "qkv") + " |")
    if kept:
        lines += ["", f"| FlashAttention node kept in {fp8['base']} | why |", "|---|---|"]
        lines += [f"| {k['name']} | {k['reason']} |" for k in kept]
    return lines


def _norm_lines(fp8: dict) -> list[str]:
    """optfuse norms whose y feeds FP8 GEMMs: writing E4M3 themselves, or keeping the Q and why."""
    norms = fp8.get("norms") or []
    if not norms:
        return []
    lines = ["", f"Norms feeding FP8 GEMMs: {len(norms)}", "", "| norm | op | form | y scale | why |", "|---|---|---|---|---|"]
    lines += [f"| {n['name']} | {n['op']} | {n['form']} | {'-' if n['scale'] is None else format(n['scale'], '.4g')} | "
              f"{n['reason'] or '-'} |" for n in norms]
    return lines


def write_precision_report(result: PrecisionResult, directory: Path) -> Path:
    path = directory / PRECISION_JSON
    write_json(path, result.to_dict())
    return path
