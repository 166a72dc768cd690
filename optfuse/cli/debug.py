"""The ``debug`` command and the per-node table of ``verify --per-node``: parse, call
:mod:`optfuse.pipeline`, print."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from . import args
from .ui import RECIPE_OPTION, console, guarded, json_mode, print_json, progress

if TYPE_CHECKING:
    from ..pipeline.debug import DebugOutcome


def offenders_table(out: Console, facts: dict[str, Any], top: int) -> None:
    """The top offenders (error added), and every tensor that overflowed FP16."""
    from ..report.per_node import _text

    t = Table(title=f"Top offenders ({facts['compared_tensors']} tensors compared, {facts['mode']} candidate)",
              title_justify="left")
    for col, justify in (("#", "right"), ("kind", "left"), ("name", "left"), ("growth", "right"), ("detail", "left")):
        t.add_column(col, justify=justify, overflow="fold")
    for i, o in enumerate(facts["attribution"][:top], 1):
        t.add_row(str(i), o["kind"], o["name"], _text(o["growth"]), o["detail"])
    if not facts["attribution"]:
        t.add_row("-", "-", "(no fused node or precision decision compared)", "-", "-")
    out.print(t)
    if facts.get("left_out"):
        out.print(f"Not compared: {facts['left_out']}.", markup=False, highlight=False)
    for line in facts["overflow"][:top]:
        out.print(f"[bold red]FP16 overflow[/]: {line}")


def debug_summary(out: Console, outcome: DebugOutcome) -> None:
    import yaml

    t = Table(title="Bisection steps", title_justify="left")
    for col in ("#", "stage", "change", "result", "worst output"):
        t.add_column(col, overflow="fold")
    for i, s in enumerate(outcome.steps, 1):
        t.add_row(str(i), s.stage, s.change, "pass" if s.passed else "[red]FAIL[/]", s.worst)
    out.print(t)
    out.print(f"[bold]found[/]: {outcome.fault}")
    if outcome.patch:
        out.print("recipe patch:\n" + yaml.safe_dump(outcome.patch, sort_keys=False).rstrip())
    for f in outcome.files:
        out.print(f"wrote {f}")


@guarded
def debug(
    model: Optional[Path] = typer.Argument(None, help="Exported ONNX model (default: the recipe's).",
                                           show_default=False),
    recipe: Optional[Path] = RECIPE_OPTION,
    outdir: Path = typer.Option(Path("optfuse-debug"), "--output", "-o",
                                help="Where the recipe patch and debug_report.{json,md} go."),
    iterations: int = typer.Option(3, "--iterations", "-n", min=1, help="Seeded input sets to run."),
    seed: int = typer.Option(0, "--seed", help="Seed of the input generator."),
    shapes: Optional[list[str]] = args.SHAPES,
    opt_shapes: Optional[list[str]] = args.OPT_SHAPES,
    fp16: bool = args.FP16,
    bf16: bool = args.BF16,
    keep_fp32: Optional[list[str]] = args.KEEP_FP32,
    atol: Optional[list[str]] = args.ATOL,
    rtol: Optional[list[str]] = args.RTOL,
    json_out: bool = args.JSON,
) -> None:
    """When the candidate (fuse + precision per the recipe, checked in onnxruntime) fails its
    tolerances, find the smallest recipe change that passes: fusion families, then rule ids, then
    fused nodes, then nodes kept in FP32. Writes recipe_patch.yaml, the patched recipe and the
    report of every step (exit 1 when no change passes)."""
    from .. import pipeline
    from ..pipeline.debug import debug as run_debug
    from ..pipeline.debug import debug_dict

    json_mode(json_out)
    over = args.overrides(shapes=shapes, opt_shapes=opt_shapes, atol=atol, rtol=rtol, fp16=fp16, bf16=bf16,
                          keep_fp32=keep_fp32)
    rec = pipeline.read_recipe(recipe)
    with progress("debugging") as status:
        outcome = run_debug(model, rec, outdir, iterations=iterations, seed=seed, status=status, overrides=over)
    if json_out:
        print_json(debug_dict(outcome))
    else:
        debug_summary(console(), outcome)
