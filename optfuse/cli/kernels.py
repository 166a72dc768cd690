"""``optfuse kernels build|list``: prebuild the plugin kernels into the cache and list it (typer
sub-app ``kernels_app``, mounted by :mod:`optfuse.cli.app` when :mod:`optfuse.kernels` imports).
"""

from __future__ import annotations

import time
from typing import Optional

import typer

from . import args
from .ui import json_mode, print_json, progress

kernels_app = typer.Typer(help="Compile and inspect the plugin kernels (Triton / CUDA C++).", no_args_is_help=True)


@kernels_app.command("build")
def build(
    target: Optional[str] = typer.Option(None, "--target", "-t", help="sm_80, sm_86, sm_89, sm_90 (default: the GPU present, else sm_90); repeatable as a comma list"),
    plugin: Optional[list[str]] = typer.Option(None, "--plugin", "-p", help="only these plugin folders"),
    jobs: Optional[int] = typer.Option(None, "--jobs", "-j", help="parallel compile processes"),
    force: bool = typer.Option(False, "--force", help="recompile even when cached"),
    json_out: bool = args.JSON,
) -> None:
    """Prebuild every plugin kernel into the cache (one progress step per arch)."""
    from ..kernels.cache import default_cache
    from ..kernels.registry import all_sources, plugin_folders
    from ..kernels.target import resolve_arch
    from ..target import arch_name

    from ..errors import InputError

    known = plugin_folders()
    unknown = [p for p in plugin or [] if p not in known]
    if unknown:
        raise InputError(f"unknown plugin {', '.join(map(repr, unknown))}; known: {', '.join(known) or 'none (no plugins found)'}")
    try:
        archs = [resolve_arch(t) for t in target.split(",")] if target else [resolve_arch(None)]
    except ValueError as exc:
        raise InputError(str(exc)) from None
    json_mode(json_out)
    cache = default_cache()
    built = []
    with progress("compiling kernels") as status:
        status.plan(len(archs))
        for arch in archs:
            errors: list[str] = []
            sources = all_sources(plugin or None, errors, arch=arch)  # a plugin may add arch-specific kernels
            if errors:  # a plugin whose launch code does not import (e.g. a missing module): one line, exit 1
                typer.echo(f"error: plugin {'; '.join(e.splitlines()[0] for e in errors)}", err=True)
                raise typer.Exit(1)
            t0 = time.time()
            with status.step(arch_name(arch)) as step:
                status(f"compiling {len(sources)} kernel source(s)")
                arts = cache.build_many(sources, arch, jobs=jobs, force=force)
                step.detail = f"{len(arts)} kernels ready"
            built.append({"arch": arch_name(arch), "kernels": len(arts), "cache": str(cache.root),
                          "seconds": round(time.time() - t0, 3)})
            if not json_out:
                typer.echo(f"{arch_name(arch)}: {len(arts)} kernels ready in {cache.root} ({time.time() - t0:.1f} s)")
    if json_out:
        print_json(built)


@kernels_app.command("list")
def list_kernels(
    target: Optional[str] = typer.Option(None, "--target", "-t", help="only this arch"),
    json_out: bool = args.JSON,
) -> None:
    """Show the kernels in the cache."""
    from ..kernels.cache import default_cache
    from ..target import arch_name, parse_arch

    json_mode(json_out)
    cache = default_cache()
    want = arch_name(parse_arch(target)) if target else None
    n = 0
    rows = []
    if not json_out:
        typer.echo(f"{'arch':6} {'kernel':58} {'entry':28} {'compiler':14} {'thr':>5} {'smem':>6} {'cubin':>7}  ptx")
    for path, meta in cache.entries():
        arch = path.parent.parent.name
        if want and arch != want:
            continue
        n += 1
        size = (path / "kernel.cubin").stat().st_size if meta.get("has_cubin") else 0
        md = meta.get("metadata", {})
        rows.append({"arch": arch, "kernel": md.get("source", path.parent.name), "entry": meta["name"],
                     "compiler": md.get("compiler"), "threads": meta["threads"], "shared_mem": meta["shared_mem"],
                     "cubin_bytes": size, "ptx": bool(meta.get("has_ptx")), "path": str(path)})
        if json_out:
            continue
        typer.echo(
            f"{arch:6} {md.get('source', path.parent.name)[:58]:58} {meta['name'][:28]:28} {md.get('compiler', '?'):14} "
            f"{meta['threads']:>5} {meta['shared_mem']:>6} {size:>7}  {'yes' if meta.get('has_ptx') else 'no'}"
        )
    if json_out:
        print_json({"cache": str(cache.root), "kernels": rows})
        return
    typer.echo(f"{n} kernels in {cache.root}")
