"""What the CLI tests share: running a command in-process, and the one-line error contract
(exit code, exactly one stderr line with its prefix, no traceback, the expected fragments).
Progress lines (``[3/6] verify: ...``, stderr on a pipe) are a separate channel: the contract is
about the lines that are not progress."""

import re

from typer.testing import CliRunner

from optfuse.cli import app

runner = CliRunner()


def invoke(*args, env=None):
    return runner.invoke(app, [str(a) for a in args], env=env)


PROGRESS_LINE = re.compile(r"^\[\d+/\d+\] [^:]+: ")


def progress_lines(text):
    return [ln for ln in text.splitlines() if PROGRESS_LINE.match(ln)]


def one_line(res, code, *fragments, prefix="error: "):
    """Assert the result failed (or warned) with one line; returns that line."""
    assert res.exit_code == code, (res.exit_code, res.stdout, res.stderr)
    lines = [ln for ln in res.stderr.strip().splitlines() if not PROGRESS_LINE.match(ln)]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith(prefix), lines[0]
    assert "Traceback" not in res.stderr + res.stdout
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]
