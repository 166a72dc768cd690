"""The CLI's user interface helpers, shared by every command module:

- :func:`console`: a rich Console on stdout (or stderr), 160 columns when not a terminal;
- :func:`progress`: a spinner with a changing message on a terminal, silent otherwise;
- :func:`guarded`: the error guard of a command: an :class:`~optfuse.errors.OptfuseError`
  becomes ``error: <message>`` on stderr (one line per problem) and its exit code, without a
  traceback; any other exception becomes ``internal error: ...`` (exit 1), with the traceback
  only under ``--debug`` or ``OPTFUSE_DEBUG=1``;
- :func:`fail` / :func:`internal_error`: the two messages themselves; :data:`RECIPE_OPTION`.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NoReturn, TypeVar

import typer
from rich.console import Console

from ..errors import OptfuseError

F = TypeVar("F", bound=Callable)

RECIPE_OPTION = typer.Option(None, "--recipe", "-r", help="Recipe YAML (inputs, dims, fusions, tolerances).",
                             show_default=False)


def console(stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    tty = stream.isatty()
    return Console(stderr=stderr, width=None if tty else 160, highlight=False)


def env_debug() -> bool:
    return os.environ.get("OPTFUSE_DEBUG", "") not in ("", "0")


class State:
    """Process-wide CLI state: ``--debug`` (set by the root callback)."""

    debug = env_debug()


def fail(msg: str, code: int) -> NoReturn:
    for line in str(msg).strip().splitlines() or [type(msg).__name__]:
        sys.stderr.write(f"error: {line}\n")
    sys.stderr.flush()
    raise typer.Exit(code)


def internal_error(exc: BaseException) -> NoReturn:
    if State.debug:
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    text = str(exc).strip().splitlines()
    detail = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    hint = "" if State.debug else " (run with --debug or OPTFUSE_DEBUG=1 for the traceback)"
    sys.stderr.write(f"internal error: {detail}{hint}\n")
    sys.stderr.flush()
    raise typer.Exit(1)


def guarded(fn: F) -> F:
    """Turn optfuse errors into one-line messages and exit codes; nothing else escapes as a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except OptfuseError as exc:
            fail(str(exc), exc.exit_code)
        except KeyboardInterrupt:
            sys.stderr.write("interrupted\n")
            raise typer.Exit(130)
        except Exception as exc:  # noqa: BLE001 - the CLI's last line of defence
            internal_error(exc)

    return wrapper  # type: ignore[return-value]


def _quiet_onnxruntime() -> None:
    """onnxruntime logs optimizer warnings (e.g. during constant folding) to stderr: keep errors only."""
    try:
        import onnxruntime

        onnxruntime.set_default_logger_severity(3)
    except Exception:  # noqa: BLE001 - logging is cosmetic
        pass


@contextmanager
def progress(message: str) -> Iterator[Callable[[str], None]]:
    """A spinner with a changing message on a terminal; silent otherwise. Yields the status callback."""
    _quiet_onnxruntime()
    out = console(stderr=True)
    if not out.is_terminal:
        yield lambda _msg: None
        return
    with out.status(message) as st:
        yield lambda msg: st.update(msg)
