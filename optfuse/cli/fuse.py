"""The ``fuse``, ``inspect``, ``verify`` and ``demo`` commands: parse, call :mod:`optfuse.pipeline`, print."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from . import args, show
from .ui import RECIPE_OPTION, console, guarded, json_mode, print_json, progress


@guarded
def fuse(
    model: Optional[Path] = typer.Argument(None, help="Exported ONNX model (none: run the demo).", show_default=False),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Fused model (default: MODEL.fused.onnx).",
                                          show_default=False),
    recipe: Optional[Path] = RECIPE_OPTION,
    verify: bool = typer.Option(False, "--verify", help="Also verify the fused model against the original."),
    shapes: Optional[list[str]] = args.SHAPES,
    min_shapes: Optional[list[str]] = args.MIN_SHAPES,
    opt_shapes: Optional[list[str]] = args.OPT_SHAPES,
    max_shapes: Optional[list[str]] = args.MAX_SHAPES,
    atol: Optional[list[str]] = args.ATOL,
    rtol: Optional[list[str]] = args.RTOL,
    json_out: bool = args.JSON,
) -> None:
    """Fuse MODEL into OUTPUT and write MODEL.fusion_report.json/.md next to it (opt shapes size the
    HBM estimate; tolerances are for --verify)."""
    from .. import pipeline

    json_mode(json_out)
    over = args.overrides(shapes=shapes, min_shapes=min_shapes, opt_shapes=opt_shapes, max_shapes=max_shapes,
                          atol=atol, rtol=rtol)
    rec = pipeline.read_recipe(recipe)
    if model is None and rec is None:
        run_demo(output.parent if output is not None else pipeline.DEMO_DIR, json_out)
        return
    with progress("fusing") as status:
        outcome = pipeline.fuse(model, output, rec, verify_after=verify, workdir=output.parent if output else None,
                                status=status, overrides=over)
    if json_out:
        print_json(outcome.report)
    else:
        out = console()
        show.fuse_summary(out, outcome)
        if outcome.verification is not None:
            show.verification(out, outcome.verification)
    if outcome.verification is not None:
        pipeline.raise_if_failed(outcome.verification)


@guarded
def inspect(
    model: Optional[Path] = typer.Argument(None, help="Exported ONNX model.", show_default=False),
    recipe: Optional[Path] = RECIPE_OPTION,
    shapes: Optional[list[str]] = args.SHAPES,
    min_shapes: Optional[list[str]] = args.MIN_SHAPES,
    opt_shapes: Optional[list[str]] = args.OPT_SHAPES,
    max_shapes: Optional[list[str]] = args.MAX_SHAPES,
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON instead of tables."),
) -> None:
    """Show what would fuse and what would not, and why. Writes nothing."""
    from .. import pipeline

    json_mode(json_out)
    over = args.overrides(shapes=shapes, min_shapes=min_shapes, opt_shapes=opt_shapes, max_shapes=max_shapes)
    rec = pipeline.read_recipe(recipe)
    with progress("inspecting") as status:
        outcome = pipeline.inspect(model, rec, status=status, overrides=over)
    if json_out:
        print_json(outcome.report)
        return
    out = console()
    report = outcome.report
    out.print(f"[bold]{outcome.model}[/]: families {', '.join(report['families']) or 'none'}; "
              f"dims {show.dims_text(report)}")
    show.fusions(out, report, title="Would fuse")
    show.rejected(out, report)


@guarded
def verify(
    original: Path = typer.Argument(..., help="Reference model (usually the unfused export)."),
    candidate: Path = typer.Argument(..., help="Model to check (usually the fused one)."),
    recipe: Optional[Path] = RECIPE_OPTION,
    iterations: int = typer.Option(3, "--iterations", "-n", min=1, help="Seeded input sets to run."),
    seed: int = typer.Option(0, "--seed", help="Seed of the input generator."),
    atol: Optional[list[str]] = args.ATOL,
    rtol: Optional[list[str]] = args.RTOL,
    shapes: Optional[list[str]] = args.SHAPES,
    min_shapes: Optional[list[str]] = args.MIN_SHAPES,
    opt_shapes: Optional[list[str]] = args.OPT_SHAPES,
    max_shapes: Optional[list[str]] = args.MAX_SHAPES,
    load_inputs: Optional[list[Path]] = args.LOAD_INPUTS,
    save_inputs: Optional[Path] = args.SAVE_INPUTS,
    save_outputs: Optional[Path] = args.SAVE_OUTPUTS,
    html: Optional[Path] = typer.Option(None, "--html", help="Also write the run's report.html (plots; needs "
                                        "pip install 'optfuse[report]').", show_default=False),
    per_node: bool = typer.Option(False, "--per-node", help="Also compare every tensor both models compute and "
                                  "rank the fused nodes and precision decisions by the error they add."),
    top: int = typer.Option(10, "--top", min=1, help="Offenders shown with --per-node."),
    chunk_size: int = typer.Option(64, "--chunk-size", min=1, help="Intermediate tensors exposed per run "
                                   "(--per-node; bounds memory)."),
    json_out: bool = args.JSON,
) -> None:
    """Run ORIGINAL and CANDIDATE in onnxruntime on the same inputs (at the opt shapes) and compare
    every output (exit 1 on a mismatch); --per-node says where the error comes from."""
    from .. import pipeline

    json_mode(json_out)
    over = args.overrides(shapes=shapes, min_shapes=min_shapes, opt_shapes=opt_shapes, max_shapes=max_shapes,
                          atol=atol, rtol=rtol)
    rec = pipeline.read_recipe(recipe)
    files = dict(save_inputs=save_inputs, save_outputs=save_outputs, html=html)
    with progress("verifying") as status:
        if per_node:
            outcome = pipeline.verify_per_node(original, candidate, rec, iterations=iterations, seed=seed,
                                               status=status, overrides=over, load_inputs=tuple(load_inputs or ()),
                                               chunk_size=chunk_size, **files)
            result, facts = outcome.verification, outcome.facts
        else:
            result = pipeline.verify(original, candidate, rec, iterations=iterations, seed=seed, status=status,
                                     overrides=over, load_inputs=tuple(load_inputs or ()), **files)
            facts = None
    if json_out:
        print_json({**result.to_dict(), **(facts or {})})
    else:
        out = console()
        show.verification(out, result, show_inputs=True)
        if facts is not None:
            from .debug import offenders_table

            offenders_table(out, facts, top)
        for label, path in (("inputs", save_inputs), ("outputs", save_outputs), ("the report", html)):
            if path is not None:
                out.print(f"wrote {label} to {path}")
    pipeline.raise_if_failed(result)


@guarded
def demo(
    directory: Path = typer.Option(Path("optfuse-demo"), "--dir", "-d", help="Where the demo writes its files."),
    json_out: bool = args.JSON,
) -> None:
    """Export the tiny BERT, fuse it, verify it (needs torch + transformers)."""
    json_mode(json_out)
    run_demo(directory, json_out)


def run_demo(directory: Path, json_out: bool = False) -> None:
    from .. import pipeline

    with progress("demo") as status:
        outcome = pipeline.demo(directory, status=status)
    if json_out:
        print_json(outcome.fuse.report)
    else:
        out = console()
        out.print(f"exported [bold]{outcome.exported}[/]")
        show.fuse_summary(out, outcome.fuse)
        if outcome.fuse.verification is not None:
            show.verification(out, outcome.fuse.verification)
    if outcome.fuse.verification is not None:
        pipeline.raise_if_failed(outcome.fuse.verification)

