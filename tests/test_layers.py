"""The layering of optfuse (pyproject's [tool.importlinter] contract) holds, and it bites.

The contract says data flows down: cli -> pipeline -> report -> the stages -> rewrite -> pattern ->
the foundations; a cycle or an upward import (a stage reaching into the pipeline, the IR layer into
a stage) breaks it. Lazy imports inside functions count: import-linter reads every import statement.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT = ("import sys; from importlinter.cli import lint_imports; "
        "raise SystemExit(lint_imports(config_filename=sys.argv[1], no_cache=True, no_logo=True))")


def _lint(package_parent: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    return subprocess.run([sys.executable, "-c", LINT, str(ROOT / "pyproject.toml")], cwd=package_parent,
                          env=env, capture_output=True, text=True, timeout=120)


def test_layers_contract_is_kept():
    run = _lint(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 kept, 0 broken" in run.stdout


def test_an_upward_import_breaks_the_contract(tmp_path):
    """A copy of the package in which the IR layer imports the pipeline (never executed: the
    contract is read from the source) fails the same check, naming the import."""
    shutil.copytree(ROOT / "optfuse", tmp_path / "optfuse", ignore=shutil.ignore_patterns("__pycache__"))
    query = tmp_path / "optfuse" / "ir" / "query.py"
    query.write_text(query.read_text() + "\n\ndef _planted():\n    from ..pipeline import fuse  # noqa: F401\n")
    run = _lint(tmp_path)
    assert run.returncode != 0
    assert "BROKEN" in run.stdout and "optfuse.ir.query -> optfuse.pipeline" in run.stdout, run.stdout
