"""The ``fuse``, ``inspect``, ``verify`` and ``demo`` commands: parse, call :mod:`optfuse.pipeline`, print."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from . import show
from .ui import RECIPE_OPTION, console, guarded, progress


@guarded
def fuse(
    model: Optional[Path] = typer.Argument(None, help="Exported ONNX model (none: run the demo).", show_default=False),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Fused model (default: MODEL.fused.onnx).",
                                          show_default=False),
    recipe: Optional[Path] = RECIPE_OPTION,
    verify: bool = typer.Option(False, "--verify", help="Also verify the fused model against the original."),
) -> None:
    """Fuse MODEL into OUTPUT and write MODEL.fusion_report.json/.md next to it."""
    from .. import pipeline

    rec = pipeline.read_recipe(recipe)
    if model is None and rec is None:
        run_demo(output.parent if output is not None else pipeline.DEMO_DIR)
        return
    with progress("fusing") as status:
        outcome = pipeline.fuse(model, output, rec, verify_after=verify, workdir=output.parent if output else None,
                                status=status)
    out = console()
    show.fuse_summary(out, outcome)
    if outcome.verification is not None:
        show.verification(out, outcome.verification)
        pipeline.raise_if_failed(outcome.verification)


@guarded
def inspect(
    model: Optional[Path] = typer.Argument(None, help="Exported ONNX model.", show_default=False),
    recipe: Optional[Path] = RECIPE_OPTION,
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON instead of tables."),
) -> None:
    """Show what would fuse and what would not, and why. Writes nothing."""
    from .. import pipeline

    rec = pipeline.read_recipe(recipe)
    with progress("inspecting") as status:
        outcome = pipeline.inspect(model, rec, status=status)
    if json_out:
        typer.echo(json.dumps(outcome.report, indent=2))
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
    atol: Optional[float] = typer.Option(None, "--atol", min=0.0, help="Absolute tolerance for every output.",
                                         show_default=False),
    rtol: Optional[float] = typer.Option(None, "--rtol", min=0.0, help="Relative tolerance for every output.",
                                         show_default=False),
) -> None:
    """Run ORIGINAL and CANDIDATE in onnxruntime on the same inputs and compare every output (exit 1 on a mismatch)."""
    from .. import pipeline

    rec = pipeline.read_recipe(recipe)
    with progress("verifying") as status:
        result = pipeline.verify(original, candidate, rec, iterations=iterations, seed=seed, atol=atol, rtol=rtol,
                                 status=status)
    show.verification(console(), result, show_inputs=True)
    pipeline.raise_if_failed(result)


@guarded
def demo(
    directory: Path = typer.Option(Path("optfuse-demo"), "--dir", "-d", help="Where the demo writes its files."),
) -> None:
    """Export the tiny BERT, fuse it, verify it (needs torch + transformers)."""
    run_demo(directory)


def run_demo(directory: Path) -> None:
    from .. import pipeline

    with progress("demo") as status:
        outcome = pipeline.demo(directory, status=status)
    out = console()
    out.print(f"exported [bold]{outcome.exported}[/]")
    show.fuse_summary(out, outcome.fuse)
    if outcome.fuse.verification is not None:
        show.verification(out, outcome.fuse.verification)
        pipeline.raise_if_failed(outcome.fuse.verification)
