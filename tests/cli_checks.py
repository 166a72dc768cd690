"""What the CLI tests share: running a command in-process, and the one-line error contract
(exit code, exactly one stderr line with its prefix, no traceback, the expected fragments)."""

from typer.testing import CliRunner

from optfuse.cli import app

runner = CliRunner()


def invoke(*args, env=None):
    return runner.invoke(app, [str(a) for a in args], env=env)


def one_line(res, code, *fragments, prefix="error: "):
    """Assert the result failed (or warned) with one line; returns that line."""
    assert res.exit_code == code, (res.exit_code, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith(prefix), lines[0]
    assert "Traceback" not in res.stderr + res.stdout
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]
