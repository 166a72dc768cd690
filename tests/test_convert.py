"""`convert` end to end on a small fused-able model: every artifact, the report says what ran."""

from __future__ import annotations

import json
import time

import onnx
import pytest

import graphs
from optfuse.errors import InputError
from optfuse.recipe import load_recipe
from optfuse.trt import compat
from optfuse.pipeline import convert

RECIPE = """
name: block
model: {path: block.onnx}
inputs:
  x: {dtype: float32, shape: [b, s, 64]}
dims:
  b: {min: 1, opt: 2, max: 4}
  s: {min: 1, opt: 8, max: 16}
precision: {mode: fp16}
target: {arch: sm_90, backend: auto}
"""


@pytest.fixture
def recipe(tmp_path):
    onnx.save(graphs.residual_block(hidden=64, norm="layer_norm", n_layers=2), tmp_path / "block.onnx")
    (tmp_path / "r.yaml").write_text(RECIPE)
    return load_recipe(tmp_path / "r.yaml")


def test_convert_writes_every_artifact(tmp_path, recipe):
    out = tmp_path / "out"
    res = convert(None, recipe, out)
    assert res.passed
    for f in ("block.fused.onnx", "block.fp16.onnx", "block.fusion_report.md", "precision_report.json",
              "accuracy_report.md", "accuracy_report.json", "report.md"):
        assert (out / f).is_file(), f
    acc = json.loads((out / "accuracy_report.json").read_text())
    assert acc["onnxruntime"]["passed"]
    report = (out / "report.md").read_text()
    assert "| fuse | ok" in report and "| verify (onnxruntime) | ok" in report and "max abs" in report
    build = res.step("build")
    if compat.resolve_backend("auto") is None:
        assert build.state == "skipped" and "no TensorRT backend" in build.detail
    else:
        assert build.state == "ok" and (out / "block.plan").is_file() and (out / "build_report.md").is_file()
        # 2 GemmEpilogue (each takes its residual Add) + 2 LayerNorm
        assert res.build_report.layers_by_kind["plugin"] == res.build_report.optfuse_nodes == 4
        if res.build_report.backend == "tensorrt_rtx":
            assert "cannot build for" in build.detail  # recipe sm_90 -> RTX default targets, said so
    engine = res.step("verify (engine)")
    if not (res.build_report and res.build_report.runnable_here):
        assert engine.state == "skipped" and "not executed" in report + engine.detail


def test_convert_explicit_rtx_sm90_is_an_error(tmp_path, recipe):
    if "tensorrt_rtx" not in compat.installed_backends():
        pytest.skip("TensorRT-RTX not installed")
    t0 = time.perf_counter()
    with pytest.raises(InputError, match=r"TensorRT-RTX cannot build for sm_90 .*needs TensorRT \(--backend tensorrt\)"):
        convert(None, recipe, tmp_path / "out", target="sm_90", backend="tensorrt_rtx")
    # checked before any work (issue 20): nothing fused, verified or written
    assert time.perf_counter() - t0 < 1.0
    assert not (tmp_path / "out").exists()


# -------------------------------------------------------------------------------------------------
# the output folder is a transaction: a completed run replaces the previous one, a failed one leaves it
# -------------------------------------------------------------------------------------------------
def _snapshot(d):
    return {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}


def test_convert_manifest_and_no_mixed_runs(tmp_path, recipe):
    import hashlib

    out = tmp_path / "out"
    out.mkdir()
    (out / "build_report.md").write_text("an older run's report\n")  # a run from before manifests
    (out / "block.plan").write_bytes(b"an older engine")
    (out / "notes.txt").write_text("the user's own file\n")
    convert(None, recipe, out, skip_build=True)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["command"] == "convert" and manifest["versions"]["optfuse"]
    assert manifest["parameters"]["skip_build"] is True and manifest["model"].endswith("block.onnx")
    listed = {o["path"]: o["sha256"] for o in manifest["outputs"]}
    assert "report.md" in listed and "block.fusion_report.json" in listed and "block.fp16.onnx" in listed
    for name, digest in listed.items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest
    assert not (out / "build_report.md").exists() and not (out / "block.plan").exists()  # not this run's: gone
    assert (out / "notes.txt").is_file()  # not a run file: kept
    assert not [p for p in out.iterdir() if p.name.startswith("partial-")]
    assert str(tmp_path / "out" / "partial-") not in (out / "report.md").read_text()
    # a later run that lists fewer files removes the ones the manifest listed
    (out / "extra.onnx").write_text("x")
    manifest["outputs"].append({"path": "extra.onnx", "sha256": "0"})
    (out / "manifest.json").write_text(json.dumps(manifest))
    convert(None, recipe, out, skip_build=True)
    assert not (out / "extra.onnx").exists() and (out / "notes.txt").is_file()


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError("boom")], ids=["interrupted", "crashed"])
def test_convert_failure_leaves_the_previous_run(tmp_path, recipe, monkeypatch, exc):
    import importlib

    convert_mod = importlib.import_module("optfuse.pipeline.convert")

    out = tmp_path / "out"
    convert(None, recipe, out, skip_build=True)
    before = _snapshot(out)

    def fail(*a, **k):
        raise exc

    monkeypatch.setattr(convert_mod, "_verify_step", fail)
    with pytest.raises(type(exc) if isinstance(exc, Exception) else exc):
        convert(None, recipe, out, skip_build=True)
    assert _snapshot(out) == before
    (partial,) = [p for p in out.iterdir() if p.is_dir()]
    assert partial.name.startswith("partial-")
    assert (partial / "error.log").is_file() and (partial / "block.fused.onnx").is_file()
    assert ("interrupted" if exc is KeyboardInterrupt else "boom") in (partial / "error.log").read_text()


def test_convert_bad_model_leaves_nothing(tmp_path, recipe):
    (tmp_path / "block.onnx").write_text("not a model")
    with pytest.raises(InputError, match="is not a valid ONNX model"):
        convert(None, recipe, tmp_path / "out", skip_build=True)
    assert not (tmp_path / "out").exists()


def test_convert_files_get_the_umask(tmp_path, recipe):
    import os

    old = os.umask(0o022)
    try:
        convert(None, recipe, tmp_path / "out", skip_build=True)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "out").iterdir()}
    assert set(modes.values()) == {0o644}, modes
