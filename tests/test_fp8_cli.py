"""``--fp8`` end to end (the demo's tiny BERT through convert) and the FP8 bad inputs: each exits 2
with one line and leaves nothing behind."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import yaml

import graphs
from cli_checks import invoke, one_line


def _recipe(tmp_path, fusions=None, **precision):
    d = tmp_path / "in"
    d.mkdir(parents=True, exist_ok=True)
    onnx.save(graphs.residual_block(n_layers=2), d / "res.onnx")
    r = d / "r.yaml"
    r.write_text(yaml.safe_dump({"name": "res", "model": {"path": "res.onnx"},
                                 "inputs": {"x": {"dtype": "float32", "shape": ["b", "s", 64]}},
                                 "dims": {"b": {"min": 1, "opt": 2, "max": 4}, "s": {"min": 1, "opt": 8, "max": 16}},
                                 "fusions": fusions or {}, "precision": {"mode": "fp8", **precision}}))
    return d, r


def _files(d):
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def test_unknown_calibrator(tmp_path):
    d, r = _recipe(tmp_path, calibration={"method": "entropy"})
    out = tmp_path / "out"
    one_line(invoke("convert", "-r", r, "-o", out, "--skip-build"), 2, "precision.calibration.method",
             "'max', 'percentile' or 'mse'")
    assert not out.exists()


def test_missing_npz(tmp_path):
    d, r = _recipe(tmp_path, calibration={"npz": "cal.npz"})
    before, out = _files(d), tmp_path / "out"
    one_line(invoke("convert", "-r", r, "-o", out, "--skip-build"), 2, "precision.calibration.npz: cal.npz not found")
    assert not out.exists() and _files(d) == before


def test_npz_lacking_an_input(tmp_path):
    d, r = _recipe(tmp_path, calibration={"npz": "cal.npz"})
    np.savez(d / "cal.npz", y=np.zeros((2, 8, 64), np.float32))
    before, out = _files(d), tmp_path / "out"
    one_line(invoke("convert", "-r", r, "-o", out, "--skip-build"), 2, "precision.calibration.npz:",
             "has no array for input 'x'")
    assert not out.exists() and _files(d) == before


def test_npz_calibration_is_used(tmp_path):
    """Scales follow the calibration file: twice the activations, twice the first GEMM's scale."""
    scales = []
    for k in (1.0, 2.0):
        d, r = _recipe(tmp_path / str(k), {"gemm": False}, calibration={"npz": "cal.npz", "batches": 2})
        x = np.random.default_rng(0).standard_normal((3, 2, 8, 64)).astype(np.float32) * k
        np.savez(d / "cal.npz", **{f"{i}/x": x[i] for i in range(3)})
        out = tmp_path / str(k) / "out"
        res = invoke("convert", "-r", r, "-o", out, "--skip-build")
        assert res.exit_code == 0, res.stderr
        fp8 = json.loads((out / "precision_report.json").read_text())["fp8"]
        assert fp8["batches"] == 2 and "2 batch(es) from cal.npz" in fp8["calibration_source"]
        scales.append(fp8["gemms"][0]["a_scale"])
    assert scales[1] == pytest.approx(2 * scales[0], rel=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("gemm, form", [(False, "qdq"), (True, "plugin")])
def test_fp8_convert_on_the_demo(tmp_path, gemm, form):
    """The demo's BERT through ``convert --fp8`` (its recipe; the GEMM fusions off: TensorRT's Q/DQ form,
    on: the optfuse GEMM nodes take FP8): reports name the FP8 GEMMs and the FP16 side-by-side."""
    from optfuse.pipeline import DEMO_RECIPE

    r = tmp_path / "demo.yaml"
    r.write_text(yaml.safe_dump({**DEMO_RECIPE, "fusions": {"gemm": gemm}}))
    out = tmp_path / "out"
    res = invoke("convert", "-r", r, "-o", out, "--fp8", "--skip-build")
    assert res.exit_code == 0, res.stdout + res.stderr
    acc = json.loads((out / "accuracy_report.json").read_text())
    fp8, base = acc["onnxruntime"], acc["baseline"]
    assert fp8["passed"] and base["passed"]
    o8, o16 = fp8["outputs"][0], base["outputs"][0]
    assert o8["name"] == o16["name"] and o8["cosine"] >= 0.99 and o8["min_cosine"] == 0.99
    assert o16["min_cosine"] is None and o16["max_abs"] < o8["max_abs"]  # FP16 is closer: the baseline is real
    assert (out / "bert.fp16.onnx").is_file() and (out / "bert.fp8.onnx").is_file()
    prec = json.loads((out / "precision_report.json").read_text())
    gemms = prec["fp8"]["gemms"]
    assert prec["mode"] == "fp8" and gemms and {g["form"] for g in gemms} == {form}
    assert len(gemms) == (12 if form == "qdq" else 8)  # Q/K/V packed into one GEMM per layer when fused
    md = (out / "report.md").read_text()
    assert "### FP8 (E4M3)" in md and "base-precision model, same inputs" in md and "cosine" in md
    if (out / "report.html").exists():
        html = (out / "report.html").read_text()
        assert "FP8 placement" in html and "cosine" in html


def test_verify_shows_cosine_for_an_fp8_candidate(tmp_path):
    from optfuse.fusions import fuse_model
    from optfuse.precision import PrecisionOptions, apply_precision

    m = graphs.residual_block(n_layers=2)
    fused, _ = fuse_model(m, dims={"b": 2, "s": 8}, families=graphs.NORM_FAMILIES)
    rng = np.random.default_rng(0)
    out, _ = apply_precision(fused, PrecisionOptions(mode="fp8"),
                             [{"x": rng.standard_normal((2, 8, 64)).astype(np.float32)} for _ in range(2)])
    onnx.save(m, tmp_path / "m.onnx")
    onnx.save(out, tmp_path / "c.onnx")
    res = invoke("verify", tmp_path / "m.onnx", tmp_path / "c.onnx", "--shapes", "x:2x8x64")
    assert res.exit_code == 0, res.stderr
    assert "cosine" in res.stdout and "0.99" in res.stdout
    res = invoke("verify", tmp_path / "m.onnx", tmp_path / "c.onnx", "--shapes", "x:2x8x64", "--json")
    o = json.loads(res.stdout)["outputs"][0]
    assert o["cosine"] > 0.99 and o["min_cosine"] == 0.99 and o["atol"] == 0.5


@pytest.mark.parametrize("steps", [0, 65])
def test_scale_steps_out_of_range(tmp_path, steps):
    d, r = _recipe(tmp_path, calibration={"scale_steps": steps})
    out = tmp_path / "out"
    one_line(invoke("convert", "-r", r, "-o", out, "--skip-build"), 2, "precision.calibration.scale_steps")
    assert not out.exists()


def test_scale_steps_reach_the_scales_and_the_report(tmp_path):
    """scale_steps 1: amax / 448 exactly; the default aligns each scale to the data (a_scale a
    candidate amax / 448 * 2^(j/8)), and the report says so."""
    fp8 = {}
    for steps in (1, None):
        calibration = {} if steps is None else {"scale_steps": steps}
        d, r = _recipe(tmp_path / str(steps), {"gemm": False}, calibration=calibration)
        out = tmp_path / str(steps) / "out"
        res = invoke("convert", "-r", r, "-o", out, "--skip-build")
        assert res.exit_code == 0, res.stderr
        fp8[steps] = json.loads((out / "precision_report.json").read_text())["fp8"]
        fp8[steps]["md"] = (out / "report.md").read_text()
    exact, aligned = fp8[1], fp8[None]
    assert exact["scale_steps"] == 1 and aligned["scale_steps"] == 8
    assert "grid alignment" not in exact["md"] and "grid alignment (scale_steps 8)" in aligned["md"]
    for e, a in zip(exact["gemms"], aligned["gemms"]):
        assert e["a_amax"] == pytest.approx(e["a_scale"] * 448, rel=1e-3)  # FP16-rounded scale
        j = np.log2(a["a_amax"] / e["a_amax"]) * 8
        assert 0 <= j < 8 and j == pytest.approx(round(j), abs=1e-6)
        assert ("grid-aligned" in a["a_source"]) == (round(j) > 0) and "grid-aligned" not in e["a_source"]
