"""``optfuse kernels build|list``: prebuild the plugin kernels into the cache and list it (typer
sub-app ``kernels_app``, mounted by :mod:`optfuse.cli.app` when :mod:`optfuse.kernels` imports).
"""

from __future__ import annotations

import time
from typing import Optional

import typer

kernels_app = typer.Typer(help="Compile and inspect the plugin kernels (Triton / CUDA C++).", no_args_is_help=True)


@kernels_app.command("build")
def build(
    target: Optional[str] = typer.Option(None, "--target", "-t", help="sm_80, sm_86, sm_89, sm_90 (default: the GPU present, else sm_90); repeatable as a comma list"),
    plugin: Optional[list[str]] = typer.Option(None, "--plugin", "-p", help="only these plugin folders"),
    jobs: Optional[int] = typer.Option(None, "--jobs", "-j", help="parallel compile processes"),
    force: bool = typer.Option(False, "--force", help="recompile even when cached"),
) -> None:
    """Prebuild every plugin kernel into the cache."""
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
    cache = default_cache()
    for arch in archs:
        errors: list[str] = []
        sources = all_sources(plugin or None, errors, arch=arch)  # a plugin may add arch-specific kernels
        if errors:  # a plugin whose launch code does not import (e.g. a missing module): one line, exit 1
            typer.echo(f"error: plugin {'; '.join(e.splitlines()[0] for e in errors)}", err=True)
            raise typer.Exit(1)
        t0 = time.time()
        arts = cache.build_many(sources, arch, jobs=jobs, force=force)
        typer.echo(f"{arch_name(arch)}: {len(arts)} kernels ready in {cache.root} ({time.time() - t0:.1f} s)")


@kernels_app.command("list")
def list_kernels(
    target: Optional[str] = typer.Option(None, "--target", "-t", help="only this arch"),
) -> None:
    """Show the kernels in the cache."""
    from ..kernels.cache import default_cache
    from ..target import arch_name, parse_arch

    cache = default_cache()
    want = arch_name(parse_arch(target)) if target else None
    n = 0
    typer.echo(f"{'arch':6} {'kernel':58} {'entry':28} {'compiler':14} {'thr':>5} {'smem':>6} {'cubin':>7}  ptx")
    for path, meta in cache.entries():
        arch = path.parent.parent.name
        if want and arch != want:
            continue
        n += 1
        size = (path / "kernel.cubin").stat().st_size if meta.get("has_cubin") else 0
        md = meta.get("metadata", {})
        typer.echo(
            f"{arch:6} {md.get('source', path.parent.name)[:58]:58} {meta['name'][:28]:28} {md.get('compiler', '?'):14} "
            f"{meta['threads']:>5} {meta['shared_mem']:>6} {size:>7}  {'yes' if meta.get('has_ptx') else 'no'}"
        )
    typer.echo(f"{n} kernels in {cache.root}")
