"""``optfuse recipe check`` (validate recipe files, one line per problem, exit 2) and ``optfuse
recipe init`` (a starter recipe from a model's inputs)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from . import args
from .ui import guarded, json_mode, print_json


@guarded
def check(files: list[Path] = typer.Argument(..., help="Recipe YAML files."), json_out: bool = args.JSON) -> None:
    """Validate recipes; each problem is one line naming the field and what was expected (exit 2)."""
    from ..errors import InputError
    from ..recipe import load_recipe

    json_mode(json_out)
    problems: list[str] = []
    checked: list[dict] = []
    for f in files:
        try:
            r = load_recipe(f)
        except InputError as exc:
            problems.extend(str(exc).splitlines())
            continue
        if r.model.path is not None and not r.resolve_path(r.model.path).is_file():
            where = r.resolve_path(r.model.path)
            problems.append(f"recipe {f}: field 'model.path': {r.model.path} not found"
                            + (f" (looked for {where})" if str(where) != str(r.model.path) else ""))
            continue
        e = r.model.export
        src = r.model.path if e is None else f"export {e.family}/{e.exporter}" + (" (decode, past)" if e.past else "")
        checked.append({"file": str(f), "name": r.name, "model": str(src), "inputs": len(r.inputs),
                        "dims": len(r.dims)})
        if not json_out:
            typer.echo(f"ok: {f} ({r.name}: {src}; {len(r.inputs)} inputs, {len(r.dims)} dims)")
    if json_out:
        print_json({"ok": checked, "problems": problems})
    if problems:
        raise InputError("\n".join(problems))


@guarded
def init(
    model: Path = typer.Argument(..., help="ONNX model to describe."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Recipe file (default: MODEL.recipe.yaml "
                                          "beside the model).", show_default=False),
    force: bool = typer.Option(False, "--force", help="Replace an existing file."),
    shapes: Optional[list[str]] = args.SHAPES,
    min_shapes: Optional[list[str]] = args.MIN_SHAPES,
    opt_shapes: Optional[list[str]] = args.OPT_SHAPES,
    max_shapes: Optional[list[str]] = args.MAX_SHAPES,
    json_out: bool = args.JSON,
) -> None:
    """Write a starter recipe from MODEL's inputs (names, dtypes, symbolic dims, token and mask
    inputs, a suggested profile; the shape options set the profile); `recipe check` accepts it."""
    from ..pipeline.starter import starter_recipe

    json_mode(json_out)
    over = args.overrides(shapes=shapes, min_shapes=min_shapes, opt_shapes=opt_shapes, max_shapes=max_shapes)
    made = starter_recipe(model, output, force=force, overrides=over)
    if json_out:
        print_json({"recipe": str(made.path), **made.data, "not_described": made.skipped})
        return
    dims = ", ".join(f"{k} {v['min']}..{v['max']} (opt {v['opt']})" for k, v in made.data["dims"].items())
    typer.echo(f"wrote {made.path}: {len(made.data['inputs'])} input(s); dims {dims or 'none (static shapes)'}")
