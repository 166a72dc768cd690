"""The ``optfuse`` command line (typer). It parses, calls :mod:`optfuse.pipeline`, and prints.

Exit codes: 0 ok, 1 verification failed (or an internal error), 2 bad input. Every
:class:`~optfuse.errors.OptfuseError` becomes ``error: <message>`` on stderr (one line per problem)
and its exit code, without a traceback; any other exception becomes ``internal error: ...`` (exit 1),
with the traceback only under ``--debug`` or ``OPTFUSE_DEBUG=1``.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from . import __version__
from .errors import OptfuseError

app = typer.Typer(
    name="optfuse",
    help="Fuse subgraphs of exported ONNX models into optfuse ops (TensorRT plugins), verify and report.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
recipe_app = typer.Typer(help="Work with recipes (recipes/*.yaml).", no_args_is_help=True)
app.add_typer(recipe_app, name="recipe")


def _console(stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    tty = stream.isatty()
    return Console(stderr=stderr, width=None if tty else 160, highlight=False)


def _env_debug() -> bool:
    return os.environ.get("OPTFUSE_DEBUG", "") not in ("", "0")


class _State:
    debug = _env_debug()


def _fail(msg: str, code: int) -> None:
    for line in str(msg).strip().splitlines() or [type(msg).__name__]:
        sys.stderr.write(f"error: {line}\n")
    sys.stderr.flush()
    raise typer.Exit(code)


def _internal(exc: BaseException) -> None:
    if _State.debug:
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    text = str(exc).strip().splitlines()
    detail = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    hint = "" if _State.debug else " (run with --debug or OPTFUSE_DEBUG=1 for the traceback)"
    sys.stderr.write(f"internal error: {detail}{hint}\n")
    sys.stderr.flush()
    raise typer.Exit(1)


def guarded(fn):
    """Turn optfuse errors into one-line messages and exit codes; nothing else escapes as a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except OptfuseError as exc:
            _fail(str(exc), exc.exit_code)
        except KeyboardInterrupt:
            sys.stderr.write("interrupted\n")
            raise typer.Exit(130)
        except Exception as exc:  # noqa: BLE001 - the CLI's last line of defence
            _internal(exc)

    return wrapper


def _quiet_onnxruntime() -> None:
    """onnxruntime logs optimizer warnings (e.g. during constant folding) to stderr: keep errors only."""
    try:
        import onnxruntime

        onnxruntime.set_default_logger_severity(3)
    except Exception:  # noqa: BLE001 - logging is cosmetic
        pass


@contextmanager
def _progress(message: str):
    """A spinner with a changing message on a terminal; silent otherwise."""
    _quiet_onnxruntime()
    console = _console(stderr=True)
    if not console.is_terminal:
        yield lambda _msg: None
        return
    with console.status(message) as st:
        yield lambda msg: st.update(msg)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"optfuse {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks of internal errors."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    _State.debug = debug or _env_debug()


# ------------------------------------------------------------------------------------------------
# fuse / inspect / verify / demo
# ------------------------------------------------------------------------------------------------
RecipeOpt = typer.Option(None, "--recipe", "-r", help="Recipe YAML (inputs, dims, fusions, tolerances).",
                         show_default=False)


@app.command()
@guarded
def fuse(
    model: Optional[Path] = typer.Argument(None, help="Exported ONNX model (none: run the demo).", show_default=False),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Fused model (default: MODEL.fused.onnx).",
                                          show_default=False),
    recipe: Optional[Path] = RecipeOpt,
    verify: bool = typer.Option(False, "--verify", help="Also verify the fused model against the original."),
) -> None:
    """Fuse MODEL into OUTPUT and write fusion_report.json/.md next to it."""
    from . import pipeline

    rec = pipeline.read_recipe(recipe)
    if model is None and rec is None:
        _run_demo(output.parent if output is not None else pipeline.DEMO_DIR)
        return
    with _progress("fusing") as status:
        outcome = pipeline.fuse(model, output, rec, verify_after=verify, workdir=output.parent if output else None,
                                status=status)
    out = _console()
    _print_fuse_summary(out, outcome)
    if outcome.verification is not None:
        _print_verify(out, outcome.verification)
        pipeline.raise_if_failed(outcome.verification)


@app.command()
@guarded
def inspect(
    model: Optional[Path] = typer.Argument(None, help="Exported ONNX model.", show_default=False),
    recipe: Optional[Path] = RecipeOpt,
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON instead of tables."),
) -> None:
    """Show what would fuse and what would not, and why. Writes nothing."""
    from . import pipeline

    rec = pipeline.read_recipe(recipe)
    with _progress("inspecting") as status:
        outcome = pipeline.inspect(model, rec, status=status)
    if json_out:
        import json

        typer.echo(json.dumps(outcome.report, indent=2))
        return
    out = _console()
    report = outcome.report
    out.print(f"[bold]{outcome.model}[/]: families {', '.join(report['families']) or 'none'}; "
              f"dims {_dims_text(report)}")
    _print_fusions(out, report, title="Would fuse")
    _print_rejected(out, report)


@app.command()
@guarded
def verify(
    original: Path = typer.Argument(..., help="Reference model (usually the unfused export)."),
    candidate: Path = typer.Argument(..., help="Model to check (usually the fused one)."),
    recipe: Optional[Path] = RecipeOpt,
    iterations: int = typer.Option(3, "--iterations", "-n", min=1, help="Seeded input sets to run."),
    seed: int = typer.Option(0, "--seed", help="Seed of the input generator."),
    atol: Optional[float] = typer.Option(None, "--atol", min=0.0, help="Absolute tolerance for every output.",
                                         show_default=False),
    rtol: Optional[float] = typer.Option(None, "--rtol", min=0.0, help="Relative tolerance for every output.",
                                         show_default=False),
) -> None:
    """Run ORIGINAL and CANDIDATE in onnxruntime on the same inputs and compare every output (exit 1 on a mismatch)."""
    from . import pipeline

    rec = pipeline.read_recipe(recipe)
    with _progress("verifying") as status:
        result = pipeline.verify(original, candidate, rec, iterations=iterations, seed=seed, atol=atol, rtol=rtol,
                                 status=status)
    _print_verify(_console(), result, show_inputs=True)
    pipeline.raise_if_failed(result)


@app.command()
@guarded
def demo(
    directory: Path = typer.Option(Path("optfuse-demo"), "--dir", "-d", help="Where the demo writes its files."),
) -> None:
    """Export the tiny BERT, fuse it, verify it (needs torch + transformers)."""
    _run_demo(directory)


def _run_demo(directory: Path) -> None:
    from . import pipeline

    with _progress("demo") as status:
        outcome = pipeline.demo(directory, status=status)
    out = _console()
    out.print(f"exported [bold]{outcome.exported}[/]")
    _print_fuse_summary(out, outcome.fuse)
    if outcome.fuse.verification is not None:
        _print_verify(out, outcome.fuse.verification)
        pipeline.raise_if_failed(outcome.fuse.verification)


# ------------------------------------------------------------------------------------------------
# recipe
# ------------------------------------------------------------------------------------------------
@recipe_app.command("check")
@guarded
def recipe_check(files: list[Path] = typer.Argument(..., help="Recipe YAML files.")) -> None:
    """Validate recipes; each problem is one line naming the field and what was expected (exit 2)."""
    from .errors import InputError
    from .recipe import load_recipe

    problems: list[str] = []
    for f in files:
        try:
            r = load_recipe(f)
        except InputError as exc:
            problems.extend(str(exc).splitlines())
            continue
        src = r.model.path if r.model.path is not None else f"export {r.model.export.family}/{r.model.export.exporter}"
        typer.echo(f"ok: {f} ({r.name}: {src}; {len(r.inputs)} inputs, {len(r.dims)} dims)")
    if problems:
        raise InputError("\n".join(problems))


# ------------------------------------------------------------------------------------------------
# printing
# ------------------------------------------------------------------------------------------------
def _dims_text(report: dict) -> str:
    dims = report.get("dims") or {}
    text = ", ".join(f"{k}={v}" for k, v in dims.items()) or "none"
    return f"{text} ({report['dims_source']})" if report.get("dims_source") and dims else text


def _print_fuse_summary(out: Console, outcome) -> None:
    from .report import format_bytes

    report = outcome.report
    t = Table(title=f"Fused {outcome.model.name}", title_justify="left")
    t.add_column("op")
    t.add_column("fused nodes", justify="right")
    t.add_column("HBM saved (est.)", justify="right")
    per_op: dict[str, list] = {}
    for f in report["fusions"]:
        per_op.setdefault(f["op"], []).append(f["hbm_saved_bytes"])
    for op, saved in sorted(per_op.items()):
        known = [s for s in saved if s is not None]
        if not known:
            text = "unknown"
        else:
            text = format_bytes(sum(known)) + (f" + {len(saved) - len(known)} unknown" if len(known) < len(saved) else "")
        t.add_row(op, str(len(saved)), text)
    if not per_op:
        t.add_row("(nothing fused)", "0", "-")
    out.print(t)
    total = format_bytes(report["hbm_saved_bytes_total"])
    unknown = f" (+{report['hbm_unknown']} unknown)" if report["hbm_unknown"] else ""
    if report["hbm_unknown"] and report["hbm_unknown"] == report["fused_nodes"]:
        total, unknown = "unknown", ""
    out.print(f"{report['original_nodes_replaced']} nodes -> {report['fused_nodes']} fused nodes; "
              f"HBM traffic saved per run ~{total}{unknown}; {len(report['rejected'])} candidate(s) rejected; "
              f"dims {_dims_text(report)}")
    out.print(f"wrote {outcome.output}")
    for p in outcome.report_paths:
        out.print(f"wrote {p}")


def _print_fusions(out: Console, report: dict, title: str) -> None:
    from .report import format_bytes

    if not report["fusions"]:
        out.print(f"{title}: nothing")
        return
    t = Table(title=f"{title} ({len(report['fusions'])})", title_justify="left")
    for col in ("op", "rule", "original nodes", "HBM saved", "info"):
        t.add_column(col, justify="right" if col == "HBM saved" else "left")
    for f in report["fusions"]:
        nodes = ", ".join(f["nodes"][:4]) + (f" (+{len(f['nodes']) - 4})" if len(f["nodes"]) > 4 else "")
        info = ", ".join(f"{k}={v}" for k, v in (f.get("info") or {}).items())
        t.add_row(f["op"], f["rule"], nodes, format_bytes(f["hbm_saved_bytes"]), info)
    out.print(t)


def _print_rejected(out: Console, report: dict) -> None:
    if not report["rejected"]:
        out.print("Not fused: no candidate was rejected")
        return
    t = Table(title=f"Not fused ({len(report['rejected'])})", title_justify="left")
    for col in ("op", "rule", "nodes", "reason"):
        t.add_column(col)
    for r in report["rejected"]:
        nodes = ", ".join(r["nodes"][:4]) + (f" (+{len(r['nodes']) - 4})" if len(r["nodes"]) > 4 else "")
        t.add_row(r["op"], r["rule"], nodes, r["reason"])
    out.print(t)


def _print_verify(out: Console, result, show_inputs: bool = False) -> None:
    if show_inputs:
        t = Table(title="Inputs", title_justify="left")
        for col in ("input", "dtype", "shape", "values"):
            t.add_column(col)
        for i in result.inputs:
            t.add_row(i.name, i.dtype, str(i.shape), i.source)
        out.print(t)
    t = Table(title=f"Verification: {result.iterations} iteration(s), seed {result.seed}", title_justify="left")
    for col in ("output", "max abs", "max rel", "mean abs", "atol", "rtol", "result"):
        t.add_column(col, justify="left" if col in ("output", "result") else "right")
    for o in result.outputs:
        res = "[green]pass[/]" if o.passed else "[red]FAIL[/]" + (f" ({o.note})" if o.note else "")
        t.add_row(o.name, f"{o.max_abs:.3g}", f"{o.max_rel:.3g}", f"{o.mean_abs:.3g}", f"{o.atol:g}", f"{o.rtol:g}", res)
    out.print(t)
    out.print("[green]verification passed[/]" if result.passed else "[red]verification failed[/]")


# ------------------------------------------------------------------------------------------------
# sub-apps written elsewhere
# ------------------------------------------------------------------------------------------------
def _mount_kernels() -> None:
    try:
        from .kernels.cli import kernels_app
    except ModuleNotFoundError as exc:
        if exc.name in ("optfuse.kernels", "optfuse.kernels.cli"):
            return
        _kernels_unavailable(f"{exc.name} is not installed (pip install -e '.[kernels]')")
        return
    except Exception as exc:  # a broken optional sub-app must not break the core CLI
        _kernels_unavailable(f"{type(exc).__name__}: {exc}")
        return
    app.add_typer(kernels_app, name="kernels")


def _kernels_unavailable(why: str) -> None:
    @app.command("kernels", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def kernels_stub() -> None:
        """Kernel commands (unavailable in this install)."""
        _fail(f"kernel commands are unavailable: {why}", 2)


def _mount_trt() -> None:
    """`build` and `convert` (optfuse.trt.commands registers them on this app)."""
    try:
        from .trt.commands import register
    except ModuleNotFoundError as exc:
        if exc.name in ("optfuse.trt", "optfuse.trt.commands"):
            return
        raise
    register(app)


_mount_trt()
_mount_kernels()


def main() -> None:
    """Console-script entry point (``optfuse``) and ``python -m optfuse``."""
    try:
        app(prog_name="optfuse")
    except SystemExit:
        raise
    except OptfuseError as exc:  # raised by a sub-app that does not guard its commands
        try:
            _fail(str(exc), exc.exit_code)
        except typer.Exit as e:
            sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001
        try:
            _internal(exc)
        except typer.Exit as e:
            sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
