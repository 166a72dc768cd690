"""The ``build`` and ``convert`` commands: parse, call :mod:`optfuse.pipeline`, print."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from . import args
from .ui import RECIPE_OPTION, console, guarded, json_mode, print_json, progress, warn

TARGET_HELP = "GPU arch: sm_75 .. sm_121, also 90, 9.0, sm_90a (RTX builds sm_75/80/86/89/120/121)."


@guarded
def build(
    model: Path = typer.Argument(..., help="Fused (precision) ONNX model."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Engine file (default: MODEL.plan).",
                                          show_default=False),
    recipe: Optional[Path] = RECIPE_OPTION,
    target: Optional[str] = typer.Option(None, "--target", help=TARGET_HELP, show_default=False),
    backend: Optional[str] = typer.Option(None, "--backend", help="auto | tensorrt | tensorrt_rtx (rtx).",
                                          show_default=False),
    timing_cache: Optional[Path] = typer.Option(None, "--timing-cache", help="Timing cache file (read and updated).",
                                                show_default=False),
    shapes: Optional[list[str]] = args.SHAPES,
    min_shapes: Optional[list[str]] = args.MIN_SHAPES,
    opt_shapes: Optional[list[str]] = args.OPT_SHAPES,
    max_shapes: Optional[list[str]] = args.MAX_SHAPES,
    fp16: bool = typer.Option(False, "--fp16", help="Not a build option here: the engine keeps the model's own "
                              "precision (optfuse convert --fp16 makes and builds an FP16 model)."),
    bf16: bool = typer.Option(False, "--bf16", help="As --fp16 (optfuse convert --bf16)."),
    json_out: bool = args.JSON,
) -> None:
    """Build a TensorRT engine; fails (exit 2) if any optfuse node does not become a plugin layer."""
    from .. import pipeline
    from ..errors import InputError

    json_mode(json_out)
    if fp16 or bf16:
        flag = "--fp16" if fp16 else "--bf16"
        raise InputError(f"build {flag}: the engine keeps the precision the model already has; "
                         f"run `optfuse convert {model} {flag} -o DIR` to make and build a {flag[2:]} model")
    over = args.overrides(shapes=shapes, min_shapes=min_shapes, opt_shapes=opt_shapes, max_shapes=max_shapes)
    rec = pipeline.read_recipe(recipe)
    with progress("building") as status:
        outcome = pipeline.build(model, output, rec, target=target, backend=backend, timing_cache=timing_cache,
                                 status=status, overrides=over)
    if outcome.profile_warning:
        warn(outcome.profile_warning)
    r = outcome.report
    if json_out:
        print_json({**r.to_dict(), "options": outcome.options, "files": [str(p) for p in outcome.report_paths],
                    "target_note": outcome.target_note, "warnings": outcome.warnings})
    else:
        out = console()
        out.print(f"built [bold]{outcome.engine}[/] ({r.engine_bytes} bytes) with {r.backend} {r.backend_version}, "
                  f"target {r.target}")
        out.print(f"layers: {r.layers_by_kind.get('plugin', 0)} plugin ({r.plugin_mode}), "
                  f"{r.layers_by_kind.get('native', 0)} native; optfuse nodes: {r.optfuse_nodes}")
        for p in r.plugin_layers:
            out.print(f"  plugin {p.name}: {p.namespace}::{p.op} v{p.version}")
        if not r.runnable_here:
            out.print(f"not executable here: {r.not_runnable_reason}")
        if outcome.target_note:
            out.print(f"note: {outcome.target_note}")
        for p in outcome.report_paths:
            out.print(f"wrote {p}")
        if r.build_log:
            out.print(f"wrote {r.build_log}")
    for w in outcome.warnings:
        sys.stderr.write(f"warning: {w}\n")


@guarded
def convert(
    model: Optional[Path] = typer.Argument(None, help="Exported ONNX model (default: the recipe's).",
                                           show_default=False),
    recipe: Optional[Path] = typer.Option(None, "--recipe", "-r", help="Recipe YAML (optional: the command line's "
                                          "options and the defaults otherwise).", show_default=False),
    outdir: Path = typer.Option(..., "--output", "-o", help="Output directory."),
    target: Optional[str] = typer.Option(None, "--target", help="GPU arch, as for build (default: the recipe's; one RTX cannot build falls back with a note).",
                                         show_default=False),
    backend: Optional[str] = typer.Option(None, "--backend", help="auto | tensorrt | tensorrt_rtx.",
                                          show_default=False),
    skip_build: bool = typer.Option(False, "--skip-build", help="Stop after verification."),
    shapes: Optional[list[str]] = args.SHAPES,
    min_shapes: Optional[list[str]] = args.MIN_SHAPES,
    opt_shapes: Optional[list[str]] = args.OPT_SHAPES,
    max_shapes: Optional[list[str]] = args.MAX_SHAPES,
    fp16: bool = args.FP16,
    bf16: bool = args.BF16,
    fp8: bool = args.FP8,
    keep_fp32: Optional[list[str]] = args.KEEP_FP32,
    atol: Optional[list[str]] = args.ATOL,
    rtol: Optional[list[str]] = args.RTOL,
    load_inputs: Optional[list[Path]] = args.LOAD_INPUTS,
    save_inputs: Optional[Path] = args.SAVE_INPUTS,
    save_outputs: Optional[Path] = args.SAVE_OUTPUTS,
    per_node: Optional[bool] = typer.Option(None, "--per-node/--no-per-node", help="Also compare every tensor "
                                            "both models compute in the onnxruntime check and rank what adds the "
                                            "error, into the reports (about one more verify; default: the "
                                            "recipe's verify.per_node, else off).", show_default=False),
    json_out: bool = args.JSON,
) -> None:
    """fuse -> precision -> verify -> build -> engine check; writes every artifact and report.md."""
    from dataclasses import replace

    from .. import pipeline
    from ..errors import OptfuseError

    json_mode(json_out)
    over = args.overrides(shapes=shapes, min_shapes=min_shapes, opt_shapes=opt_shapes, max_shapes=max_shapes,
                          atol=atol, rtol=rtol, fp16=fp16, bf16=bf16, fp8=fp8, keep_fp32=keep_fp32)
    over = replace(over, per_node=per_node)
    arrays = pipeline.RunArrays(tuple(map(str, load_inputs or ())), str(save_inputs) if save_inputs else None,
                                str(save_outputs) if save_outputs else None)
    rec = pipeline.read_recipe(recipe)
    out = console(stderr=json_out)
    try:
        with progress("converting") as status:
            result = pipeline.convert(model, rec, outdir, target=target, backend=backend, skip_build=skip_build,
                                      status=status, overrides=over, arrays=arrays)
    except OptfuseError as exc:
        partial = getattr(exc, "partial", None)
        if partial is not None:
            out.print(f"{outdir} left as it was; this run's files and error.log: {partial}")
        raise
    if result.profile_warning:
        warn(result.profile_warning)
    if json_out:
        print_json({"outdir": str(result.outdir), "model": result.model, "passed": result.passed,
                    "steps": [{"name": s.name, "state": s.state, "detail": s.detail, "files": s.artifacts}
                              for s in result.steps],
                    "summary": str(result.summary), "manifest": str(Path(outdir) / "manifest.json"),
                    "options": result.options})
        return
    for s in result.steps:
        colour = {"ok": "green", "failed": "red", "skipped": "yellow"}[s.state]
        out.print(f"[{colour}]{s.state:>7}[/] {s.name}: {s.detail.splitlines()[0] if s.detail else ''}")
    out.print(f"wrote {result.summary}")
    out.print(f"wrote {Path(outdir) / 'manifest.json'}")
