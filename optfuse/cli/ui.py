"""The CLI's user interface helpers, shared by every command module:

- :func:`console`: a rich Console on stdout (or stderr), 160 columns when not a terminal;
- :func:`progress`: the flow's :class:`~optfuse.pipeline.Progress` display on stderr: on a terminal a
  live line (spinner, step, message, elapsed time) with each finished step printed above it; on a
  pipe one plain line per finished step (``[3/6] verify: 3 iteration(s), 2/2 output(s) within
  tolerance, 4.1 s``; with ``-v`` the messages within a step too); nothing under ``-q``;
- :func:`warn`: a ``warning: ...`` line (stdout, or stderr when the command prints JSON);
- :func:`guarded`: the error guard of a command: an :class:`~optfuse.errors.OptfuseError`
  becomes ``error: <message>`` on stderr (one line per problem) and its exit code, without a
  traceback; any other exception becomes ``internal error: ...`` (exit 1), with the traceback
  only under ``--debug`` or ``OPTFUSE_DEBUG=1``;
- :func:`fail` / :func:`internal_error`: the two messages themselves; :data:`RECIPE_OPTION`.
"""

from __future__ import annotations

import functools
import json
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
    """Process-wide CLI state, set by the root callback: ``--debug``, and the verbosity (-1 under
    ``-q``, 0 by default, 1 and more under ``-v``); `json`: the command prints JSON on stdout."""

    debug = env_debug()
    verbosity = 0
    json = False


def json_mode(on: bool) -> None:
    """The command prints JSON on stdout: warnings go to stderr."""
    State.json = on


def print_json(data) -> None:
    typer.echo(json.dumps(data, indent=2, default=str))


def warn(text: str, stderr: bool = False) -> None:
    """One ``warning: ...`` line: on stdout (stderr when asked, or when stdout carries JSON)."""
    stream = sys.stderr if stderr or State.json else sys.stdout
    stream.write(f"warning: {text}\n")
    stream.flush()


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


def step_line(index: int, total: int, name: str, text: str) -> str:
    return f"[{index}/{total}] {name}: {text}"


def _finished_text(detail: str, seconds: float) -> str:
    return f"{detail}, {seconds:.1f} s" if detail else f"{seconds:.1f} s"


def _plain_progress():
    from ..pipeline import Progress

    class PlainProgress(Progress):
        """One line per finished step on stderr; the messages within a step too under ``-v``."""

        def message(self, text: str) -> None:
            if State.verbosity > 0 and self.index:
                sys.stderr.write(step_line(self.index, self.total, self.current, text) + "\n")

        def finished(self, index: int, total: int, name: str, detail: str, seconds: float) -> None:
            sys.stderr.write(step_line(index, total, name, _finished_text(detail, seconds)) + "\n")
            sys.stderr.flush()

    return PlainProgress()


@contextmanager
def _live_progress(title: str, out: Console):
    from rich.progress import Progress as RichProgress
    from rich.progress import SpinnerColumn, TextColumn, TimeElapsedColumn

    from ..pipeline import Progress

    bar = RichProgress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=out,
                       transient=True)
    task = bar.add_task(title, total=None)

    class LiveProgress(Progress):
        """A live line on the terminal; each finished step printed above it."""

        def message(self, text: str) -> None:
            where = step_line(self.index, self.total, self.current, text) if self.index else text
            bar.update(task, description=where)

        def started(self, index: int, total: int, name: str) -> None:
            bar.update(task, description=step_line(index, total, name, "..."))

        def finished(self, index: int, total: int, name: str, detail: str, seconds: float) -> None:
            bar.console.print(step_line(index, total, name, _finished_text(detail, seconds)), highlight=False,
                              markup=False)
            bar.update(task, description=title)

    with bar:
        yield LiveProgress()


@contextmanager
def progress(title: str) -> Iterator:
    """The progress display of one command (see the module doc); yields a pipeline Progress."""
    from ..pipeline import Progress

    _quiet_onnxruntime()
    if State.verbosity < 0:
        yield Progress()
        return
    out = console(stderr=True)
    if not out.is_terminal:
        yield _plain_progress()
        return
    with _live_progress(title, out) as live:
        yield live
