"""The bad-input corpus (issue 20): each case gives its exit code, exactly one line on stderr, no
traceback, and leaves nothing behind in the output folder."""

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml

import graphs
from cli_checks import invoke, one_line


@pytest.fixture
def inp(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    model = graphs.residual_block(n_layers=2)
    onnx.save(model, d / "res.onnx")
    (d / "text.onnx").write_text("this is not an onnx model\n")
    data = (d / "res.onnx").read_bytes()
    (d / "truncated.onnx").write_bytes(data[: len(data) // 2])
    (d / "empty.onnx").write_bytes(b"")
    ext = onnx.ModelProto.FromString(model.SerializeToString())
    onnx.save_model(ext, str(d / "ext.onnx"), save_as_external_data=True, location="ext.onnx.data", size_threshold=0)
    (d / "ext.onnx.data").unlink()
    (d / "adir.onnx").mkdir()
    empty = onnx.helper.make_model(onnx.helper.make_graph([], "empty", [], []),
                                   opset_imports=[onnx.helper.make_opsetid("", 17)])
    onnx.save(empty, d / "emptygraph.onnx")
    return d


def leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


@pytest.mark.parametrize("name, fragment", [
    ("text.onnx", "is not a valid ONNX model"),
    ("truncated.onnx", "is not a valid ONNX model"),
    ("empty.onnx", "is not a valid ONNX model"),
    ("ext.onnx", "missing external data file"),
    ("adir.onnx", "is a directory"),
    ("emptygraph.onnx", "no graph outputs"),
])
def test_build_bad_model(tmp_path, inp, name, fragment):
    before = leftovers(inp)
    out = tmp_path / "out"
    one_line(invoke("build", inp / name, "-o", out / "m.plan"), 2, fragment, name)
    assert leftovers(out) == []
    assert leftovers(inp) == before


def test_convert_into_read_only_directory(tmp_path, inp):
    if os.geteuid() == 0:
        pytest.skip("root ignores directory permissions")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "res", "model": {"path": "in/res.onnx"},
        "dims": {"batch": {"min": 1, "opt": 2, "max": 4}, "sequence": {"min": 1, "opt": 8, "max": 32}}}))
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        one_line(invoke("convert", "-r", recipe, "-o", ro / "out", "--skip-build"), 2, "cannot write", str(ro))
        one_line(invoke("convert", "-r", recipe, "-o", ro, "--skip-build"), 2, "cannot write", str(ro))
        assert leftovers(ro) == []
    finally:
        ro.chmod(0o755)


def _res_recipe(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "res", "model": {"path": "in/res.onnx"},
        "dims": {"batch": {"min": 1, "opt": 2, "max": 4}, "sequence": {"min": 1, "opt": 8, "max": 32}}}))
    return recipe


@pytest.mark.parametrize("command", ["convert", "build"])
def test_unwritable_output_directory(tmp_path, inp, monkeypatch, command):
    """What a read-only folder gives (simulated: root ignores the mode bits)."""
    import tempfile

    def denied(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkdtemp", denied)
    out = tmp_path / "out"
    args = (["convert", "-r", _res_recipe(tmp_path), "-o", out, "--skip-build"] if command == "convert"
            else ["build", inp / "res.onnx", "-o", out / "m.plan"])
    one_line(invoke(*args), 2, "cannot write into", "Permission denied")
    assert not out.exists()


def _npz_recipe(tmp_path, arrays):
    np.savez(tmp_path / "x.npz", **arrays)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "res", "model": {"path": "in/res.onnx"},
        "inputs": {"x": {"dtype": "float32", "shape": ["b", "s", 64], "npz": "x.npz"}},
        "dims": {"b": {"min": 1, "opt": 2, "max": 4}, "s": {"min": 1, "opt": 8, "max": 32}}}))
    return recipe


@pytest.mark.parametrize("arrays, fragment", [
    ({"y": np.zeros((2, 8, 64), np.float32)}, "none named 'x'"),
    ({"x": np.zeros((2, 8), np.float32)}, "rank"),
    ({"x": np.zeros((2, 8, 32), np.float32)}, "axis 2"),
], ids=["one-other-key", "wrong-rank", "wrong-axis"])
def test_verify_bad_npz(tmp_path, inp, arrays, fragment):
    recipe = _npz_recipe(tmp_path, arrays)
    one_line(invoke("verify", inp / "res.onnx", inp / "res.onnx", "-r", recipe), 2, fragment)


def test_recipe_check_missing_model(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "res", "model": {"path": "nowhere/res.onnx"}}))
    one_line(invoke("recipe", "check", recipe), 2, "nowhere/res.onnx", "not found")


def test_build_unfused_model_warns(tmp_path, inp):
    pytest.importorskip("tensorrt_rtx")
    out = tmp_path / "out"
    res = invoke("build", inp / "res.onnx", "-o", out / "m.plan", "--backend", "rtx")
    line = one_line(res, 0, "0 optfuse nodes: did you mean `optfuse convert`?", prefix="warning: ")
    assert (out / "m.plan").is_file(), line


def test_debug_after_subcommand(inp):
    res = invoke("inspect", inp / "res.onnx", "--debug")
    assert res.exit_code == 0, res.stderr
    res = invoke("inspect", inp / "missing.onnx", "--debug")
    one_line(res, 2, "model not found")


def test_convert_failure_names_its_partial_folder(tmp_path, inp, monkeypatch):
    """A convert that fails late: one error line; stdout names the partial folder; the output folder has only it."""
    import importlib

    from optfuse.errors import InputError

    def late(*a, **k):
        raise InputError("late bad input")

    monkeypatch.setattr(importlib.import_module("optfuse.pipeline.convert"), "_verify_step", late)
    out = tmp_path / "out"
    res = invoke("convert", "-r", _res_recipe(tmp_path), "-o", out, "--skip-build")
    one_line(res, 2, "late bad input")
    (partial,) = list(out.iterdir())
    assert partial.name.startswith("partial-") and (partial / "error.log").is_file()
    assert str(partial) in res.stdout


# -------------------------------------------------------------------------------------------------
# command-line shapes, precisions, tolerances and input files (issue 20 item 2)
# -------------------------------------------------------------------------------------------------
OPTION_CASES = [
    (["--shapes", "x:1x"], "--shapes: cannot parse 'x:1x'"),
    (["--shapes", "x1x32x64"], "expected name:DIMS"),
    (["--shapes", "x:0x8x64"], "every dim must be >= 1"),
    (["--shapes", "nope:1x8x64"], "'nope' is not an input of the model (its inputs: x)"),
    (["--shapes", "x:1x8"], "2 dims given, but the input has rank 3"),
    (["--shapes", "x:1x8x32"], "axis 2 is fixed to 64 by the model"),
    (["--min-shapes", "x:4x8x64", "--opt-shapes", "x:2x8x64", "--max-shapes", "x:8x8x64"],
     "axis 0 needs min <= opt <= max, got 4, 2, 8"),
    (["--opt-shapes", "x:4x8x64", "--max-shapes", "x:2x8x64"], "got 4, 4, 2"),
    (["--max-shapes", "x:4x8x64"], "needs --opt-shapes x:... too"),
    (["--shapes", "x:1x8x64", "--opt-shapes", "x:1x8x64"], "not both"),
    (["--atol", "y:abc"], "--atol: cannot parse 'y:abc'"),
    (["--rtol", ":1e-3"], "--rtol: cannot parse ':1e-3'"),
    (["--atol", "inf"], "expected a number >= 0"),
    (["--rtol", "nope:1e-3"], "'nope' is not an output of the model (its outputs: y)"),
]


@pytest.mark.parametrize("extra, fragment", OPTION_CASES, ids=[f"case{i}" for i in range(len(OPTION_CASES))])
@pytest.mark.parametrize("command", ["fuse", "verify", "convert", "build"])
def test_bad_command_line_option(tmp_path, inp, command, extra, fragment):
    tolerance = extra[0] in ("--atol", "--rtol")
    if command == "build" and tolerance:
        pytest.skip("build takes no tolerances")
    out = tmp_path / "out"
    args = {"fuse": ["fuse", inp / "res.onnx", "-o", out / "f.onnx", "--verify"],
            "verify": ["verify", inp / "res.onnx", inp / "res.onnx"],
            "convert": ["convert", inp / "res.onnx", "-o", out, "--skip-build"],
            "build": ["build", inp / "res.onnx", "-o", out / "m.plan"]}[command]
    before = leftovers(inp)
    one_line(invoke(*args, *extra), 2, fragment)
    assert leftovers(out) == [] and leftovers(inp) == before


@pytest.mark.parametrize("flags, fragment", [(["--fp8", "--fp16"], "--fp16 and --fp8 exclude each other"),
                                             (["--fp16", "--bf16"], "exclude each other")])
def test_precision_flags(tmp_path, inp, flags, fragment):
    out = tmp_path / "out"
    one_line(invoke("convert", inp / "res.onnx", "-o", out, *flags), 2, fragment)
    assert not out.exists()


def test_build_precision_flag_points_to_convert(tmp_path, inp):
    out = tmp_path / "out"
    one_line(invoke("build", inp / "res.onnx", "-o", out / "m.plan", "--fp16"), 2, "optfuse convert", "--fp16")
    assert not out.exists()


def _arrays(tmp_path, name, **arrays):
    path = tmp_path / name
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize("arrays, fragment", [
    ({"y": np.zeros((2, 8, 64), np.float32)}, "has no array for input 'x' (it holds y"),
    ({"x": np.zeros((2, 8, 64), np.float32), "z": np.zeros(2, np.float32)}, "holds 'z', which is not an input"),
    ({"x": np.zeros((2, 8), np.float32)}, "has shape [2, 8] (rank 2), but the model's input has rank 3"),
    ({"x": np.zeros((2, 8, 32), np.float32)}, "axis 2 is 32, but the model fixes it to 64"),
    ({"x": np.zeros((2, 8, 64), np.float64)}, "is float64, but the model takes float32"),
    ({"0/x": np.zeros((2, 8, 64), np.float32), "1/y": np.zeros((2, 8, 64), np.float32)}, "(iteration 1)"),
], ids=["wrong-key", "extra-key", "wrong-rank", "wrong-axis", "wrong-dtype", "second-iteration"])
@pytest.mark.parametrize("command", ["verify", "convert"])
def test_load_inputs_bad_npz(tmp_path, inp, arrays, fragment, command):
    path = _arrays(tmp_path, "feeds.npz", **arrays)
    out = tmp_path / "out"
    args = (["verify", inp / "res.onnx", inp / "res.onnx"] if command == "verify"
            else ["convert", inp / "res.onnx", "-o", out, "--skip-build"])
    one_line(invoke(*args, "--load-inputs", path), 2, "--load-inputs", fragment)
    assert not out.exists()


@pytest.mark.parametrize("name, content, fragment", [
    ("missing.npz", None, "missing.npz not found"),
    ("text.npz", "not an npz", "cannot read"),
    ("text.json", "{not json", "cannot read"),
    ("list.json", "[1, 2]", "is not polygraphy input data"),
])
def test_load_inputs_bad_file(tmp_path, inp, name, content, fragment):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    one_line(invoke("verify", inp / "res.onnx", inp / "res.onnx", "--load-inputs", path), 2, fragment, name)


def test_save_into_unwritable_place_is_one_line(tmp_path, inp):
    (tmp_path / "file").write_text("")
    one_line(invoke("verify", inp / "res.onnx", inp / "res.onnx", "--save-inputs", tmp_path / "file" / "x.npz"), 2,
             "cannot write")


def test_recipe_init_does_not_overwrite(tmp_path, inp):
    (tmp_path / "r.yaml").write_text("keep me\n")
    one_line(invoke("recipe", "init", inp / "res.onnx", "-o", tmp_path / "r.yaml"), 2, "exists", "--force")
    assert (tmp_path / "r.yaml").read_text() == "keep me\n"
    one_line(invoke("recipe", "init", inp / "text.onnx", "-o", tmp_path / "t.yaml"), 2, "is not a valid ONNX model")
    assert not (tmp_path / "t.yaml").exists()


@pytest.mark.parametrize("args, fragment", [
    (["fuse", "m.onnx", "--shape", "x:1"], "No such option: --shape"),
    (["verify", "m.onnx"], "Missing argument 'candidate'"),
    (["fuse", "m.onnx", "--shapes"], "'--shapes' requires an argument"),
    (["verify", "a.onnx", "b.onnx", "-n", "0"], "'--iterations'"),
    (["nosuch"], "No such command 'nosuch'"),
], ids=["unknown-option", "missing-argument", "missing-value", "out-of-range", "unknown-command"])
def test_usage_errors_are_one_line(args, fragment):
    one_line(invoke(*args), 2, fragment)


def test_bare_command_group_shows_its_help():
    res = invoke("recipe")
    assert "Usage: optfuse recipe" in res.output and "Traceback" not in res.output
