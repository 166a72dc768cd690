"""Issue 20 item 3: one arch parser, one rule for what each backend builds, checked before any work."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest

import graphs
from optfuse.errors import InputError
from optfuse.pipeline.build import plan_target
from optfuse.recipe import load_recipe
from optfuse.target import BACKEND_ARCHS, KNOWN_ARCHS, backends_for, check_backend_target, parse_arch, target_problem

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("text,cc", [
    ("sm_75", 75), ("sm_80", 80), ("sm_86", 86), ("sm_87", 87), ("sm_89", 89), ("sm_90", 90), ("sm_90a", 90),
    ("90", 90), ("9.0", 90), ("sm90", 90), ("compute_90", 90), ("SM_90", 90), (90, 90),
    ("sm_100", 100), ("sm_100a", 100), ("sm_100f", 100), ("100", 100), ("10.0", 100), ("sm_103", 103),
    ("sm_110", 110), ("sm_120", 120), ("120", 120), ("12.0", 120), ("sm_121", 121), ("12.1", 121), (" sm_89 ", 89),
])
def test_parse_arch_table(text, cc):
    assert parse_arch(text) == cc


@pytest.mark.parametrize("bad", ["", "sm_", "sm_x", "ampere", "sm_1", "sm_900", "sm_1200", "sm_70", "sm_91", "9.9",
                                 "sm_90b", 5, 900, True])
def test_parse_arch_rejects(bad):
    with pytest.raises(ValueError) as e:
        parse_arch(bad)
    assert "\n" not in str(e.value)


def test_backend_rule():
    assert set(BACKEND_ARCHS["tensorrt"]) == set(KNOWN_ARCHS)
    assert backends_for(90) == ["tensorrt"] and backends_for(100) == ["tensorrt"]
    assert backends_for(120) == ["tensorrt", "tensorrt_rtx"] and backends_for(75) == ["tensorrt", "tensorrt_rtx"]
    assert target_problem("tensorrt_rtx", 120) is None and target_problem("tensorrt", 90) is None
    msg = target_problem("tensorrt_rtx", 90)
    assert msg.startswith("TensorRT-RTX cannot build for sm_90") and "--backend tensorrt" in msg and "\n" not in msg
    assert check_backend_target("tensorrt_rtx", "12.0") == 120 and check_backend_target(None, "sm_90") == 90
    assert check_backend_target("tensorrt", None) is None
    with pytest.raises(ValueError, match="sm_100 needs TensorRT"):
        check_backend_target("tensorrt_rtx", "sm_100")


def test_installed_rtx_agrees_with_the_table():
    from optfuse.trt import compat

    if "tensorrt_rtx" not in compat.installed_backends():
        pytest.skip("TensorRT-RTX not installed")
    assert set(compat.load("tensorrt_rtx").compute_capabilities) == set(BACKEND_ARCHS["tensorrt_rtx"])


@pytest.fixture
def recipe(tmp_path):
    onnx.save(graphs.residual_block(hidden=64, norm="layer_norm", n_layers=2), tmp_path / "block.onnx")
    (tmp_path / "r.yaml").write_text(
        "name: block\nmodel: {path: block.onnx}\ninputs:\n  x: {dtype: float32, shape: [b, s, 64]}\n"
        "dims:\n  b: {min: 1, opt: 2, max: 4}\n  s: {min: 1, opt: 8, max: 16}\n"
        "target: {arch: sm_90, backend: tensorrt_rtx}\n")
    return load_recipe(tmp_path / "r.yaml")


def test_plan_target_recipe_and_cli_agree(recipe):
    # the recipe's sm_90 with RTX: fall back to RTX's defaults, with a note (convert and build alike)
    p = plan_target(None, recipe, "tensorrt_rtx")
    assert p.target is None and not p.explicit and "cannot build for" in p.note
    # the same arch given explicitly: exit 2, one line naming the backend that can
    with pytest.raises(InputError, match=r"^TensorRT-RTX cannot build for sm_90 .*TensorRT \(--backend tensorrt\)$"):
        plan_target("9.0", recipe, "tensorrt_rtx")
    assert plan_target("sm_120", recipe, "tensorrt_rtx").target == "sm_120"
    assert plan_target("sm_100", recipe, "tensorrt").explicit
    with pytest.raises(InputError, match="--target: unknown GPU arch 'sm_99'"):
        plan_target("sm_99", recipe, "tensorrt")
    with pytest.raises(InputError):
        plan_target(None, recipe, "nosuch")


def _cli(*args, cwd):
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "optfuse", *map(str, args)], capture_output=True, text=True, cwd=cwd)
    return r, time.perf_counter() - t0


@pytest.mark.parametrize("command", ["convert", "build"])
def test_bad_target_fails_fast_and_writes_nothing(tmp_path, recipe, command):
    """``--target`` the backend cannot build: exit 2, one line, before any fuse/precision/verify
    work. Timed in-process (the interpreter's start-up is not the check's cost)."""
    from optfuse.pipeline import build, convert

    before = sorted(p.name for p in tmp_path.iterdir())
    t0 = time.perf_counter()
    with pytest.raises(InputError, match="cannot build for sm_90"):
        if command == "convert":
            convert(None, recipe, tmp_path / "out", target="sm_90", backend="tensorrt_rtx")
        else:
            build(tmp_path / "block.onnx", tmp_path / "out" / "m.plan", recipe, target="sm_90", backend="tensorrt_rtx")
    assert time.perf_counter() - t0 < 0.5
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written
    # and on the command line: exit 2, one line on stderr, no traceback
    args = [command, "block.onnx", "-r", "r.yaml", "-o", "out", "--target", "sm_90", "--backend", "tensorrt_rtx"]
    if command == "build":
        args[args.index("out")] = "out/m.plan"
    r, _ = _cli(*args, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "cannot build for sm_90" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("bad", ["sm_1", "sm_70", "sm_999"])
def test_unparsable_target_is_exit_2(tmp_path, recipe, bad):
    r, _ = _cli("convert", "block.onnx", "-r", "r.yaml", "-o", "out", "--target", bad, cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--target" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()
