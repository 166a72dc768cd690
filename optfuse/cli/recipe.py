"""``optfuse recipe check``: validate recipe files, one line per problem (exit 2)."""

from __future__ import annotations

from pathlib import Path

import typer

from .ui import guarded


@guarded
def check(files: list[Path] = typer.Argument(..., help="Recipe YAML files.")) -> None:
    """Validate recipes; each problem is one line naming the field and what was expected (exit 2)."""
    from ..errors import InputError
    from ..recipe import load_recipe

    problems: list[str] = []
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
        src = r.model.path if r.model.path is not None else f"export {r.model.export.family}/{r.model.export.exporter}"
        typer.echo(f"ok: {f} ({r.name}: {src}; {len(r.inputs)} inputs, {len(r.dims)} dims)")
    if problems:
        raise InputError("\n".join(problems))
