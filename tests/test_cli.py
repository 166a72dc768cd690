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
    bad.write_text(yaml.safe_dump({**RECIPE, "precision": {"mode": "int4"}, "target": {"arch": "x"}}))
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


# -------------------------------------------------------------------------------------------------
# trtexec / polygraphy conventions (issue 20 item 2)
# -------------------------------------------------------------------------------------------------
def _json(res):
    assert res.exit_code == 0, res.stderr
    return json.loads(res.stdout)  # stdout is JSON alone: progress and warnings go to stderr


def test_shapes_size_the_estimate_and_are_recorded(tmp_path, models):
    out = tmp_path / "out" / "f.onnx"
    report = _json(invoke("fuse", models / "res.onnx", "-o", out, "--shapes", "x:1x32x64", "--json"))
    assert report["dims"] == {"b": 1, "s": 32} and report["dims_source"] == "command line opt shapes"
    assert report["options"]["shapes"] == {"x": {"min": [1, 32, 64], "opt": [1, 32, 64], "max": [1, 32, 64]}}
    saved = json.loads((tmp_path / "out" / "res.fusion_report.json").read_text())
    assert saved["options"] == report["options"]
    assert "## Options" in (tmp_path / "out" / "res.fusion_report.md").read_text()
    # the same report shape as inspect --json
    inspected = _json(invoke("inspect", models / "res.onnx", "--shapes", "x:1x32x64", "--json"))
    assert set(inspected) <= set(report) and inspected["dims"] == report["dims"]


def test_opt_shapes_are_what_verify_feeds(tmp_path, models):
    res = _json(invoke("verify", models / "res.onnx", models / "res.onnx", "--opt-shapes", "x:1x4x64", "--json"))
    assert [i["shape"] for i in res["inputs"]] == [[1, 4, 64]] and res["passed"]


def test_command_line_shapes_override_the_recipe(tmp_path, models):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    rep = _json(invoke("fuse", "-r", recipe, "-o", tmp_path / "out" / "f.onnx", "--opt-shapes", "x:3x5x64",
                       "--min-shapes", "x:1x1x64", "--max-shapes", "x:4x32x64", "--json"))
    assert rep["dims"] == {"b": 3, "s": 5}
    assert rep["options"]["recipe"] == str(recipe)
    # the recipe's spelling names the dims; a dim the command line does not give keeps the recipe's value
    rep = _json(invoke("inspect", models / "res.onnx", "-r", recipe, "--json"))
    assert rep["dims"] == {"b": 2, "s": 8}


def test_guessed_profile_says_so(tmp_path, models):
    from optfuse.pipeline import build_profile

    profile, dims = build_profile(None, models / "res.onnx")
    assert profile.dims == {"b": (1, 2, 2), "s": (1, 16, 16)} and dims.guessed == ["b", "s"]
    line = dims.guess_warning()
    assert "\n" not in line and "b 1..2 (opt 2)" in line and "--shapes x:2x16x64" in line
    from optfuse.pipeline import Overrides

    profile, dims = build_profile(None, models / "res.onnx", Overrides(shapes={"x": ((1, 1, 64), (2, 8, 64), (4, 32, 64))}))
    assert profile.dims == {"b": (1, 2, 4), "s": (1, 8, 32)} and dims.guess_warning() is None


def test_build_without_shapes_warns_on_stdout(tmp_path, models):
    pytest.importorskip("tensorrt_rtx")
    res = invoke("build", models / "res.onnx", "-o", tmp_path / "e" / "m.plan", "--backend", "rtx")
    assert res.exit_code == 0, res.stderr
    warnings = [ln for ln in res.stdout.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and "guessed b 1..2 (opt 2), s 1..16 (opt 16)" in warnings[0]
    res = invoke("build", models / "res.onnx", "-o", tmp_path / "e2" / "m.plan", "--backend", "rtx",
                 "--min-shapes", "x:1x1x64", "--opt-shapes", "x:2x8x64", "--max-shapes", "x:4x32x64")
    assert res.exit_code == 0, res.stderr
    assert "warning: no shapes" not in res.stdout
    report = json.loads((tmp_path / "e2" / "build_report.json").read_text())
    assert report["profiles"]["x"] == {"min": [1, 1, 64], "opt": [2, 8, 64], "max": [4, 32, 64]}
    assert report["options"]["dims"]["s"] == {"min": 1, "opt": 8, "max": 32, "source": "command line"}


def test_per_output_tolerances(tmp_path, models):
    args = ["verify", models / "res.onnx", models / "perturbed.onnx"]
    assert invoke(*args, "--atol", "y:1").exit_code == 0
    assert invoke(*args, "--atol", "1", "--atol", "y:1e-9").exit_code == 1  # the output's own wins
    assert_one_line_error(invoke(*args, "--atol", "z:1"), 2, "'z' is not an output of the model")
    res = _json(invoke(*args, "--atol", "y:0.5", "--rtol", "0.25", "--json"))
    assert (res["outputs"][0]["atol"], res["outputs"][0]["rtol"]) == (0.5, 0.25)


def test_command_line_tolerance_overrides_the_recipe(tmp_path, models):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({**RECIPE, "tolerances": {"atol": 1.0, "outputs": {"y": {"rtol": 0.5}}}}))
    args = ["verify", models / "res.onnx", models / "perturbed.onnx", "-r", recipe]
    assert invoke(*args).exit_code == 0
    res = invoke(*args, "--atol", "1e-9", "--rtol", "0", "--json")
    assert res.exit_code == 1 and json.loads(res.stdout)["outputs"][0]["atol"] == 1e-9


@pytest.mark.parametrize("suffix", [".npz", ".json"])
def test_save_and_load_inputs_and_outputs(tmp_path, models, suffix):
    from polygraphy.comparator import RunResults
    from polygraphy.json import load_json

    inputs, outputs = tmp_path / f"in{suffix}", tmp_path / f"out{suffix}"
    args = ["verify", models / "res.onnx", models / "perturbed.onnx", "--atol", "1"]
    first = _json(invoke(*args, "-n", 2, "--seed", 7, "--save-inputs", inputs, "--save-outputs", outputs, "--json"))
    if suffix == ".npz":
        assert sorted(np.load(inputs).files) == ["0/x", "1/x"]
        assert sorted(np.load(outputs).files) == ["0/candidate/y", "0/original/y", "1/candidate/y", "1/original/y"]
        saved = np.load(inputs)["1/x"]
    else:  # polygraphy's own formats
        feeds = load_json(str(inputs))
        assert len(feeds) == 2 and feeds[0]["x"].shape == (2, 16, 64)
        assert list(RunResults.load(str(outputs)).keys()) == ["original", "candidate"]
        saved = feeds[1]["x"]
    again = _json(invoke(*args, "--load-inputs", inputs, "--json"))  # a different seed would differ
    assert again["iterations"] == 2 and again["outputs"][0]["max_abs"] == first["outputs"][0]["max_abs"]
    assert again["inputs"][0]["source"] == f"--load-inputs {inputs}"
    assert saved.dtype == np.float32


def test_one_npz_of_one_iteration_is_plain_names(tmp_path, models):
    np.savez(tmp_path / "x.npz", x=np.ones((1, 3, 64), np.float32))
    res = _json(invoke("verify", models / "res.onnx", models / "res.onnx", "--load-inputs", tmp_path / "x.npz",
                       "--json"))
    assert res["iterations"] == 1 and res["inputs"][0]["shape"] == [1, 3, 64]


def test_convert_without_recipe_takes_command_line_options(tmp_path, models):
    out = tmp_path / "conv"
    res = invoke("convert", models / "res.onnx", "-o", out, "--skip-build", "--fp16", "--keep-fp32", "Add",
                 "--atol", "y:0.05", "--shapes", "x:2x8x64")
    assert res.exit_code == 0, res.stderr + res.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    options = manifest["parameters"]["options"]
    assert options["recipe"] is None and options["precision"]["mode"] == "fp16"
    assert options["precision"]["source"] == "command line" and options["precision"]["keep_fp32"] == ["Add"]
    assert (out / "res.fp16.onnx").is_file()
    summary = (out / "report.md").read_text()
    assert "precision: fp16 (command line)" in summary and "y atol 0.05 (command line)" in summary
    accuracy = json.loads((out / "accuracy_report.json").read_text())
    assert "0.05" in json.dumps(accuracy)


def test_convert_json_output(tmp_path, models):
    res = _json(invoke("convert", models / "res.onnx", "-o", tmp_path / "c", "--skip-build", "--json"))
    assert [s["name"] for s in res["steps"]][:3] == ["fuse", "precision", "verify (onnxruntime)"]
    assert res["passed"] and res["manifest"].endswith("manifest.json")


def test_recipe_check_json(tmp_path):
    (tmp_path / "in").mkdir()
    onnx.save(graphs.residual_block(n_layers=2), tmp_path / "in" / "res.onnx")
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(RECIPE))
    res = _json(invoke("recipe", "check", good, "--json"))
    assert res == {"ok": [{"file": str(good), "name": "res", "model": "in/res.onnx", "inputs": 1, "dims": 2}],
                   "problems": []}


# -------------------------------------------------------------------------------------------------
# progress (issue 20 item 7): plain lines on a pipe, -q silences them, --json stays clean
# -------------------------------------------------------------------------------------------------
def test_progress_plain_lines(tmp_path, models):
    from cli_checks import progress_lines

    res = invoke("fuse", models / "res.onnx", "-o", tmp_path / "out" / "f.onnx", "--verify")
    assert res.exit_code == 0, res.stderr
    lines = progress_lines(res.stderr)
    assert [ln.split(":")[0] for ln in lines] == ["[1/5] load", "[2/5] fuse", "[3/5] estimate", "[4/5] write",
                                                 "[5/5] verify"]
    assert "4 matched (6 nodes replaced), 0 rejected" in lines[1]
    assert "3 iteration(s), 1/1 output(s) within tolerance" in lines[4]
    assert all(ln.endswith(" s") for ln in lines)
    assert not progress_lines(res.stdout)


@pytest.mark.parametrize("where", ["before", "after"])
def test_quiet_silences_progress(tmp_path, models, where):
    args = ["fuse", models / "res.onnx", "-o", tmp_path / "out" / "f.onnx"]
    res = invoke(*(["-q", *args] if where == "before" else [*args, "-q"]))
    assert res.exit_code == 0, res.stderr
    assert res.stderr == "" and "wrote" in res.stdout


def test_verbose_shows_messages_within_steps(tmp_path, models):
    from cli_checks import progress_lines

    res = invoke("verify", models / "res.onnx", models / "res.onnx", "-n", 2, "-v")
    assert res.exit_code == 0, res.stderr
    assert progress_lines(res.stderr) == [ln for ln in res.stderr.splitlines() if ln]
    assert any("running iteration 2/2" in ln for ln in progress_lines(res.stderr))


def test_convert_progress_counts_its_steps(tmp_path, models):
    from cli_checks import progress_lines

    res = invoke("convert", models / "res.onnx", "-o", tmp_path / "c", "--skip-build", "--json")
    assert res.exit_code == 0, res.stderr
    names = [ln.split(":")[0] for ln in progress_lines(res.stderr)]
    assert names == ["[1/6] load", "[2/6] fuse", "[3/6] precision", "[4/6] verify", "[5/6] build",
                     "[6/6] verify engine"]
    json.loads(res.stdout)


def test_live_progress_on_a_terminal(tmp_path, models, monkeypatch):
    """On a terminal: a live line, and each finished step printed above it (here into a buffer)."""
    import io

    from rich.console import Console

    from optfuse.cli import ui

    buf = io.StringIO()
    terminal = Console(file=buf, force_terminal=True, width=120)
    monkeypatch.setattr(ui, "console", lambda stderr=False: terminal if stderr else Console(file=io.StringIO()))
    res = invoke("fuse", models / "res.onnx", "-o", tmp_path / "out" / "f.onnx")
    assert res.exit_code == 0, res.stderr
    shown = buf.getvalue()
    for line in ("[1/4] load: 8 nodes", "[2/4] fuse: 4 matched (6 nodes replaced), 0 rejected",
                 "[3/4] estimate:", "[4/4] write:"):
        assert line in shown, shown
    assert "\x1b[" in shown  # drawn with terminal control codes, not plain lines


def test_kernels_list_json(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTFUSE_CACHE", str(tmp_path))
    res = invoke("kernels", "list", "--json")
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout) == {"cache": str(tmp_path), "kernels": []}
