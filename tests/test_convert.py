"""`convert` end to end on a small fused-able model: every artifact, the report says what ran."""

from __future__ import annotations

import json

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
        assert res.build_report.layers_by_kind["plugin"] == res.build_report.optfuse_nodes == 2
        if res.build_report.backend == "tensorrt_rtx":
            assert "cannot build for" in build.detail  # recipe sm_90 -> RTX default targets, said so
    engine = res.step("verify (engine)")
    if not (res.build_report and res.build_report.runnable_here):
        assert engine.state == "skipped" and "not executed" in report + engine.detail


def test_convert_explicit_rtx_sm90_is_an_error(tmp_path, recipe):
    if "tensorrt_rtx" not in compat.installed_backends():
        pytest.skip("TensorRT-RTX not installed")
    with pytest.raises(InputError, match="sm_90"):
        convert(None, recipe, tmp_path / "out", target="sm_90", backend="tensorrt_rtx")
    assert (tmp_path / "out" / "report.md").is_file()  # the steps that ran are still reported
