"""The ``optfuse`` typer app: the root options (``--debug``, ``-v``/``--verbose``, ``-q``/``--quiet``,
``--version``; all but ``--version`` also accepted after the subcommand), every command registered
from its module, and :func:`main` (console script and ``python -m optfuse``).

Exit codes: 0 ok, 1 verification failed (or an internal error), 2 bad input; errors are one line
each (:mod:`optfuse.cli.ui`).
"""

from __future__ import annotations

import re
import sys

import typer
import typer.core

from .. import __version__
from ..errors import OptfuseError
from . import build, debug, fuse, recipe
from .ui import State, env_debug, fail, internal_error

#: the root's options that may also follow the subcommand
GLOBAL_FLAGS = ("--debug", "--verbose", "--quiet", "-q")
_VERBOSE = re.compile(r"^-v+$")


class _RootGroup(typer.core.TyperGroup):
    """The root group: ``--debug``, ``-v`` and ``-q`` are global options, accepted after the
    subcommand too (moved to the front before parsing; not after ``--``)."""

    def parse_args(self, ctx, args):
        end = args.index("--") if "--" in args else len(args)
        is_global = [i < end and (a in GLOBAL_FLAGS or bool(_VERBOSE.match(a))) for i, a in enumerate(args)]
        moved = [a for a, g in zip(args, is_global) if g]
        args = moved + [a for a, g in zip(args, is_global) if not g]
        return super().parse_args(ctx, args)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """A usage error (unknown option, missing argument or value) is one line, exit 2."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except typer.Abort:
            sys.stderr.write("aborted\n")
            sys.exit(1)
        except typer.TyperException as exc:  # typer's click errors: usage errors and the help of a bare group
            if type(exc).__name__ == "NoArgsIsHelpError":  # `optfuse` alone: the help
                exc.show()
                sys.exit(exc.exit_code)
            ctx = getattr(exc, "ctx", None)
            hint = f" (see `{ctx.command_path} -h`)" if ctx is not None else ""
            sys.stderr.write(f"error: {exc.format_message()}{hint}\n")
            sys.exit(exc.exit_code)
        sys.exit(rv if isinstance(rv, int) else 0)


app = typer.Typer(
    name="optfuse",
    cls=_RootGroup,
    help="Fuse subgraphs of exported ONNX models into optfuse ops (TensorRT plugins), verify and report.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
recipe_app = typer.Typer(help="Work with recipes (recipes/*.yaml).", no_args_is_help=True)
app.add_typer(recipe_app, name="recipe")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"optfuse {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks of internal errors."),
    verbose: int = typer.Option(0, "--verbose", "-v", count=True, help="More detail (progress messages within a step)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress output."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    State.debug = debug or env_debug()
    State.verbosity = -1 if quiet else verbose
    State.json = False


for _command in (fuse.fuse, fuse.inspect, fuse.verify, fuse.demo, build.build, build.convert, debug.debug):
    app.command()(_command)
recipe_app.command("check")(recipe.check)
recipe_app.command("init")(recipe.init)


def _mount_kernels() -> None:
    """``optfuse kernels`` when the kernel foundation imports; a stub that says why otherwise."""
    try:
        import optfuse.kernels  # noqa: F401 - the commands need it; a broken install shows here

        from .kernels import kernels_app
    except ModuleNotFoundError as exc:
        if exc.name == "optfuse.kernels":
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
        fail(f"kernel commands are unavailable: {why}", 2)


_mount_kernels()


def main() -> None:
    """Console-script entry point (``optfuse``) and ``python -m optfuse``."""
    try:
        app(prog_name="optfuse")
    except SystemExit:
        raise
    except OptfuseError as exc:  # raised by a sub-app that does not guard its commands
        try:
            fail(str(exc), exc.exit_code)
        except typer.Exit as e:
            sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001
        try:
            internal_error(exc)
        except typer.Exit as e:
            sys.exit(e.exit_code)
