"""The optfuse CLI: exit codes (0 ok, 1 verification failed, 2 bad input), one-line errors, no leftovers."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml

import graphs
from cli_checks import invoke
from cli_checks import one_line as assert_one_line_error

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def models(tmp_path):
    """A residual LayerNorm model, its perturbed twin, and the bad files of every kind."""
    d = tmp_path / "in"
    d.mkdir()
    model = graphs.residual_block(n_layers=2)
    onnx.save(model, d / "res.onnx")
    perturbed = graphs.residual_block(n_layers=2)
    w = next(t for t in perturbed.graph.initializer if len(t.dims) == 1)
    arr = onnx.numpy_helper.to_array(w) + np.float32(1e-2)
    w.CopyFrom(onnx.numpy_helper.from_array(arr, w.name))
    onnx.save(perturbed, d / "perturbed.onnx")
    (d / "text.onnx").write_text("this is not an onnx model\n")
    data = (d / "res.onnx").read_bytes()
    (d / "truncated.onnx").write_bytes(data[: len(data) // 2])
    ext = onnx.ModelProto.FromString(model.SerializeToString())
    onnx.save_model(ext, str(d / "ext.onnx"), save_as_external_data=True, location="ext.onnx.data", size_threshold=0)
    (d / "ext.onnx.data").unlink()
    return d


def _out_files(tmp_path):
    out = tmp_path / "out"
    return sorted(p.name for p in out.iterdir()) if out.exists() else []


# -------------------------------------------------------------------------------------------------
# bad input: exit 2, one line, no traceback, nothing written
# -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, fragment",
    [
        ("missing.onnx", "model not found"),
        ("text.onnx", "is not a valid ONNX model"),
        ("truncated.onnx", "is not a valid ONNX model"),
        ("ext.onnx", "missing external data file"),
    ],
)
@pytest.mark.parametrize("command", ["fuse", "inspect"])
def test_bad_model(tmp_path, models, name, fragment, command):
    args = [command, models / name] + (["-o", tmp_path / "out" / "fused.onnx"] if command == "fuse" else [])
    res = invoke(*args)
    assert_one_line_error(res, 2, fragment, name)
    assert _out_files(tmp_path) == []


@pytest.mark.parametrize("name", ["missing.onnx", "text.onnx", "truncated.onnx", "ext.onnx"])
def test_verify_bad_model(models, name):
    assert_one_line_error(invoke("verify", models / "res.onnx", models / name), 2, name)
    assert_one_line_error(invoke("verify", models / name, models / "res.onnx"), 2, name)


RECIPE = {
    "name": "res",
    "model": {"path": "in/res.onnx"},
    "inputs": {"x": {"dtype": "float32", "shape": ["b", "s", 64]}},
    "dims": {"b": {"min": 1, "opt": 2, "max": 4}, "s": {"min": 1, "opt": 8, "max": 32}},
}


@pytest.mark.parametrize(
    "patch, fragment",
    [
        ({"dims": {"b": {"min": 1, "opt": "two", "max": 4}, "s": {"min": 1, "opt": 8, "max": 32}}},
         "field 'dims.b.opt': expected a valid integer"),
        ({"fusions": {"layernorm": True}}, "field 'fusions.layernorm': unknown key"),
        ({"inputs": {"x": {"dtype": "float32"}}}, "field 'inputs.x.shape': missing (required)"),
        ({"inputs": {"x": {"dtype": "float32", "shape": ["batch", "s", 64]}}},
         "field 'inputs.x.shape': dim 'batch' is not declared in 'dims'"),
    ],
    ids=["wrong-type", "unknown-key", "missing-shape", "undeclared-dim"],
)
def test_bad_recipe(tmp_path, models, patch, fragment):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({**RECIPE, **patch}))
    res = invoke("fuse", models / "res.onnx", "-o", tmp_path / "out" / "f.onnx", "-r", recipe)
    assert_one_line_error(res, 2, fragment, "recipe ")
    assert _out_files(tmp_path) == []
    assert_one_line_error(invoke("recipe", "check", recipe), 2, fragment)


def test_recipe_check(tmp_path):
    (tmp_path / "in").mkdir()
    onnx.save(graphs.residual_block(n_layers=2), tmp_path / "in" / "res.onnx")  # recipe check wants the model
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(RECIPE))
    res = invoke("recipe", "check", good)
    assert res.exit_code == 0 and "ok:" in res.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**RECIPE, "precision": {"mode": "fp8"}, "target": {"arch": "x"}}))
    res = invoke("recipe", "check", good, bad)
    assert res.exit_code == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 2 and all(ln.startswith(f"error: recipe {bad}: field '") for ln in lines)
    assert "Traceback" not in res.stderr


def test_shipped_recipes_check():
    recipes = sorted((ROOT / "recipes").glob("*.yaml"))
    assert recipes
    res = invoke("recipe", "check", *recipes)
    assert res.exit_code == 0, res.stderr
    assert res.stdout.count("ok:") == len(recipes)


def test_output_must_not_be_the_input(models):
    assert_one_line_error(invoke("fuse", models / "res.onnx", "-o", models / "res.onnx"), 2, "is the input model")


def test_invalid_graph_is_bad_input(tmp_path):
    from onnx import TensorProto, helper

    g = helper.make_graph([helper.make_node("Add", ["x", "undefined"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    onnx.save(helper.make_model(g), tmp_path / "dangling.onnx")
    res = invoke("fuse", tmp_path / "dangling.onnx", "-o", tmp_path / "out" / "f.onnx")
    assert_one_line_error(res, 2, "is not a valid ONNX graph")
    assert _out_files(tmp_path) == []


# -------------------------------------------------------------------------------------------------
# the commands
# -------------------------------------------------------------------------------------------------
def test_fuse_writes_model_and_reports(tmp_path, models):
    out = tmp_path / "out" / "res.fused.onnx"
    res = invoke("fuse", models / "res.onnx", "-o", out)
    assert res.exit_code == 0, res.stderr
    assert _out_files(tmp_path) == ["res.fused.onnx", "res.fusion_report.json", "res.fusion_report.md"]
    fused = onnx.load(out)
    # the residual sums are read again (pre-norm re-use), so the GEMMs take the residual Adds, not SkipLayerNorm
    assert [n.op_type for n in fused.graph.node].count("GemmEpilogue") == 2
    report = json.loads((tmp_path / "out" / "res.fusion_report.json").read_text())
    assert report["counts"] == {"GemmEpilogue": 2, "LayerNorm": 2} and report["fused_model"] == str(out)
    assert "GemmEpilogue" in res.stdout and "wrote" in res.stdout


def test_fuse_with_recipe_dims_and_families(tmp_path, models):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({**RECIPE, "fusions": {"skip_norm": False, "gemm": False}}))
    res = invoke("fuse", "-r", recipe, "-o", tmp_path / "out" / "f.onnx")  # model from the recipe
    assert res.exit_code == 0, res.stderr
    report = json.loads((tmp_path / "out" / "res.fusion_report.json").read_text())
    assert report["counts"] == {"LayerNorm": 2}  # skip_norm off: plain LayerNorms only
    assert report["dims"] == {"b": 2, "s": 8} and report["dims_source"] == "recipe opt shapes"
    assert report["fusions"][0]["hbm_saved_bytes"] is not None
    assert "skip_norm" not in report["families"] and "gemm" not in report["families"]


def test_inspect_writes_nothing(tmp_path, models):
    before = sorted(p.name for p in models.iterdir())
    cwd_before = sorted(os.listdir(tmp_path))
    res = invoke("inspect", models / "res.onnx")
    assert res.exit_code == 0, res.stderr
    assert "GemmEpilogue" in res.stdout and "gemm.residual" in res.stdout
    assert sorted(p.name for p in models.iterdir()) == before
    assert sorted(os.listdir(tmp_path)) == cwd_before
    res = invoke("inspect", models / "res.onnx", "--json")
    assert json.loads(res.stdout)["counts"] == {"GemmEpilogue": 2, "LayerNorm": 2}


def test_inspect_explains_rejections(tmp_path):
    onnx.save(graphs.layer_norm(extra_output="variance"), tmp_path / "leak.onnx")
    res = invoke("inspect", tmp_path / "leak.onnx")
    assert res.exit_code == 0
    assert "Not fused" in res.stdout and "graph output" in res.stdout


def test_verify_pass_and_fail(tmp_path, models):
    out = tmp_path / "out" / "f.onnx"
    assert invoke("fuse", models / "res.onnx", "-o", out).exit_code == 0
    res = invoke("verify", models / "res.onnx", out, "-n", 2)
    assert res.exit_code == 0, res.stderr
    assert "pass" in res.stdout and "verification passed" in res.stdout
    res = invoke("verify", models / "res.onnx", models / "perturbed.onnx")
    assert_one_line_error(res, 1, "verification failed: 1 of 1 output(s) out of tolerance (y)")
    assert "FAIL" in res.stdout
    # the same difference passes a looser tolerance
    assert invoke("verify", models / "res.onnx", models / "perturbed.onnx", "--atol", "1").exit_code == 0


def test_fuse_verify_flag(tmp_path, models):
    res = invoke("fuse", models / "res.onnx", "-o", tmp_path / "out" / "f.onnx", "--verify")
    assert res.exit_code == 0, res.stderr
    report = json.loads((tmp_path / "out" / "res.fusion_report.json").read_text())
    assert report["verification"]["passed"] is True


def test_internal_error_is_one_line(tmp_path, models, monkeypatch):
    from optfuse import pipeline

    def boom(*a, **k):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(pipeline, "inspect", boom)
    res = invoke("inspect", models / "res.onnx")
    assert res.exit_code == 1
    assert res.stderr.strip().splitlines() == [
        "internal error: RuntimeError: boom (run with --debug or OPTFUSE_DEBUG=1 for the traceback)"]
    res = invoke("--debug", "inspect", models / "res.onnx")
    assert res.exit_code == 1 and "Traceback" in res.stderr
    res = invoke("inspect", models / "res.onnx", env={"OPTFUSE_DEBUG": "1"})
    assert res.exit_code == 1 and "Traceback" in res.stderr


def test_demo_without_torch_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    monkeypatch.chdir(tmp_path)
    res = invoke("demo")
    assert_one_line_error(res, 2, "pip install -e '.[export]' torch==2.13.0")
    assert not (tmp_path / "optfuse-demo").exists() or not any((tmp_path / "optfuse-demo").iterdir())


def test_module_entry_point_and_exit_codes(tmp_path, models):
    """python -m optfuse: real process, real exit codes and streams."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = lambda *a: subprocess.run([sys.executable, "-m", "optfuse", *map(str, a)], capture_output=True,
                                    text=True, env=env, cwd=tmp_path)
    p = run("--version")
    assert p.returncode == 0 and p.stdout.startswith("optfuse ")
    p = run("fuse", models / "truncated.onnx", "-o", tmp_path / "out" / "f.onnx")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr
    assert _out_files(tmp_path) == []
    p = run("verify", models / "res.onnx", models / "perturbed.onnx")
    assert p.returncode == 1 and "verification failed" in p.stderr


@pytest.mark.slow
def test_demo(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("optfuse.models")
    monkeypatch.chdir(tmp_path)
    res = invoke("demo")
    assert res.exit_code == 0, res.stderr + res.stdout
    files = sorted(p.name for p in (tmp_path / "optfuse-demo").iterdir())
    assert "bert.fusion_report.json" in files and "bert.fusion_report.md" in files
    report = json.loads((tmp_path / "optfuse-demo" / "bert.fusion_report.json").read_text())
    assert report["verification"]["passed"]
    # every residual Add goes to a GEMM (SkipLayerNorm would write its sum: one [M, N] more)
    assert set(report["counts"]) == {"LayerNorm", "FlashAttention", "GemmEpilogue"}
    attention = [f for f in report["fusions"] if f["op"] == "FlashAttention"]
    assert all(f["info"]["mask_class"] == "padding" for f in attention)


def test_kernels_build_missing_module_is_one_line_nonzero(monkeypatch):
    """A plugin whose launch code cannot import (issue 20: ModuleNotFoundError printed, exit 0)."""
    from optfuse.kernels import registry

    def broken(folder, module):
        raise ModuleNotFoundError("No module named 'triton'")

    monkeypatch.setattr(registry, "plugin_module", broken)
    res = invoke("kernels", "build", "-p", "rms_norm")
    assert_one_line_error(res, 1, "rms_norm", "ModuleNotFoundError", "triton")
    assert "kernels ready" not in res.stdout


@pytest.mark.parametrize("args,fragment", [(["-p", "nosuch"], "unknown plugin 'nosuch'"),
                                           (["--target", "sm_1"], "cannot parse GPU arch 'sm_1'")])
def test_kernels_build_bad_input_is_exit_2(args, fragment):
    res = subprocess.run([sys.executable, "-m", "optfuse", "kernels", "build", *args], capture_output=True, text=True)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [res.stderr.strip()] and fragment in res.stderr


def test_fuse_is_all_or_nothing(tmp_path, models, monkeypatch):
    """A fuse that fails after writing (here: verify is interrupted) leaves the previous outputs as they were."""
    import importlib

    fuse_mod = importlib.import_module("optfuse.pipeline.fuse")
    out = tmp_path / "out" / "res.fused.onnx"
    assert invoke("fuse", models / "res.onnx", "-o", out).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.parent.iterdir()}

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(fuse_mod, "verify", interrupted)
    res = invoke("fuse", models / "perturbed.onnx", "-o", out, "--verify")
    assert res.exit_code == 130
    assert {p.name: p.read_bytes() for p in out.parent.iterdir()} == before
    monkeypatch.undo()
    res = invoke("fuse", models / "missing.onnx", "-o", tmp_path / "new" / "f.onnx")
    assert res.exit_code == 2 and not (tmp_path / "new").exists()
