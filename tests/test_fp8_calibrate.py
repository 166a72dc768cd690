"""FP8 calibration: each calibrator on a known distribution, the grid-alignment search of weight and
activation scales, the onnxruntime collection, the scales of :func:`quantize_fp8` reproducible with a
seed, and bad calibration settings."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphs
from optfuse.errors import InputError
from optfuse.fusions import fuse_model
from optfuse.precision import PrecisionOptions, apply_precision
from optfuse.precision.calibrate import (E4M3_MAX, MAX_SCALE_STEPS, SCALE_STEPS, Histogram, calibrate,
                                         fake_quant_e4m3, quantize_e4m3, scale_of, weight_scales)


def _values(seed: int = 0, outliers: int = 20, n: int = 200_000) -> np.ndarray:
    """N(0, 1) with a few outliers at +-50."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n)
    x[rng.integers(0, n, outliers)] = 50.0 * rng.choice([-1.0, 1.0], outliers)
    return x


def _hist(x: np.ndarray, batches: int = 4) -> Histogram:
    h = Histogram()
    for part in np.array_split(x, batches):
        h.add(part)
    return h


def test_histogram_grows_with_same_bin_width():
    h = Histogram(num_bins=10)
    h.add(np.array([0.5, 1.0]))
    width = h.edges[1] - h.edges[0]
    h.add(np.array([-3.05, 0.2]))  # |x| beyond the first range: bins of the same width are added
    assert h.edges[-1] >= 3.05 and np.allclose(np.diff(h.edges), width)
    assert h.counts.sum() == 4


def test_percentile_is_below_max_and_near_the_true_quantile():
    x = _values()
    h = _hist(x)
    amax = h.percentile_amax(99.9)
    assert amax < np.abs(x).max() / 10
    # |N(0,1)|'s 99.9th percentile is 3.29; one bin of 50/2048 is the resolution
    assert abs(amax - np.quantile(np.abs(x), 0.999)) < 2 * (h.edges[1] - h.edges[0])
    # ModelOpt's rule returns the lower edge of the bin where the CDF reaches the percentile
    assert np.abs(x).max() - (h.edges[1] - h.edges[0]) <= h.percentile_amax(100.0) <= np.abs(x).max()


def test_mse_is_the_least_e4m3_error_and_keeps_isolated_outliers():
    """E4M3's grid is relative: shrinking the scale does not refine the bulk (until it would fall
    into the subnormals), so clipping a few outliers only adds their squared clipping error. The
    MSE calibrator keeps them (amax near max |x|, unlike percentile) and its choice is the least
    error over its candidates."""
    x = _values()
    h = _hist(x)
    amax = h.mse_amax()
    top = float(np.abs(x).max())
    assert top * 0.9 < amax <= top + (h.edges[1] - h.edges[0])
    assert h.percentile_amax(99.9) < top / 10

    def mse(a):
        return float(((fake_quant_e4m3(x, a) - x) ** 2).mean())

    for other in (h.percentile_amax(99.9), top / 4, top / 2):
        assert mse(amax) < mse(other)


def test_mse_clips_a_sparse_top_bin():
    """Where clipping does pay: most mass at 1, a few values just past the range an E4M3 step away
    (clipping 448 + 16 units to 448 costs less than rounding the bulk on a coarser grid)."""
    rng = np.random.default_rng(2)
    bulk = rng.uniform(0.9, 1.0, 100_000)
    x = np.concatenate([bulk, np.full(3, 1.2)])
    amax = _hist(x).mse_amax()
    assert amax < 1.2

    def mse(a):
        return float(((fake_quant_e4m3(x, a) - x) ** 2).mean())

    assert mse(amax) <= mse(1.2)


def test_quantize_saturates_and_rounds_like_e4m3():
    import ml_dtypes

    q = quantize_e4m3(np.array([1000.0, -1000.0, 1.0, 0.0]), 1.0)
    assert q.dtype == ml_dtypes.float8_e4m3fn
    assert q.astype(np.float32).tolist() == [E4M3_MAX, -E4M3_MAX, 1.0, 0.0]
    w = np.array([[1.0, -2.0], [0.0, 0.0], [4.0, 0.5]])
    s = weight_scales(w, axis=0, steps=1)
    assert s.tolist() == pytest.approx([2.0 / E4M3_MAX, 1.0, 4.0 / E4M3_MAX])  # all-zero row: scale 1
    assert np.abs(quantize_e4m3(w, s, axis=0).astype(np.float32)).max(axis=1).tolist() == [E4M3_MAX, 0.0, E4M3_MAX]
    assert scale_of(0.0) == 1.0 and scale_of(448.0) == 1.0


def _channel_errors(w: np.ndarray, s: np.ndarray) -> np.ndarray:
    return ((quantize_e4m3(w, s, axis=0).astype(np.float64) * s[:, None] - w) ** 2).sum(axis=1)


def test_weight_scales_align_the_grid_per_channel():
    """Each channel's scale is the candidate amax / 448 * 2^(j / 8) with the least squared rounding
    error of that channel: never more error than amax / 448 (j = 0 is a candidate), less over the
    weight, and nothing saturates (every candidate maps amax to 448 / 2^(j/8) <= 448)."""
    w = np.random.default_rng(4).standard_normal((256, 96)).astype(np.float32)
    w[7] = 0.0
    exact, aligned = weight_scales(w, 0, steps=1), weight_scales(w, 0)
    ratio = aligned / exact
    assert np.all(ratio >= 1) and np.all(ratio < 2) and ratio[7] == 1.0
    steps = np.log2(ratio.astype(np.float64)) * SCALE_STEPS
    assert np.allclose(steps, np.round(steps), atol=1e-4)  # a candidate, up to the float32 rounding of the scale
    e_exact, e_aligned = _channel_errors(w, exact), _channel_errors(w, aligned)
    assert np.all(e_aligned <= e_exact)
    assert e_aligned.sum() < 0.9 * e_exact.sum()
    assert np.abs(quantize_e4m3(w, aligned, axis=0).astype(np.float32)).max() <= E4M3_MAX
    # any axis: the transposed weight gets the same scales along axis 1
    assert np.array_equal(weight_scales(w.T.copy(), 1), aligned)


def test_weight_scales_search_with_the_scales_the_graph_holds():
    """A DequantizeLinear's scale has the base type: the search compares candidates as FP16 rounds them."""
    w = np.random.default_rng(5).standard_normal((64, 48)).astype(np.float32)
    fp16 = weight_scales(w, 0, rounding=lambda v: v.astype(np.float16).astype(np.float32))
    assert np.array_equal(fp16.astype(np.float16).astype(np.float32), fp16)
    e = _channel_errors(w, fp16)
    for j in range(SCALE_STEPS):  # no FP16 candidate beats the one chosen
        cand = (weight_scales(w, 0, steps=1) * 2.0 ** (j / SCALE_STEPS)).astype(np.float16).astype(np.float32)
        assert np.all(e <= _channel_errors(w, cand) + 1e-12)


@pytest.mark.parametrize("case", ["normal", "off-grid bulk"])
def test_aligned_amax_is_the_least_error_candidate_and_clips_nothing(case):
    rng = np.random.default_rng(6)
    if case == "normal":
        x = rng.standard_normal(100_000)
    else:  # most values 232 scale units at amax / 448: midway between E4M3's 224 and 240
        x = np.concatenate([rng.uniform(231.9, 232.1, 100_000) / E4M3_MAX, [1.0]])
    h = _hist(x)
    peak = float(np.abs(x).max())
    assert h.aligned_amax(peak, 1) == peak
    amax = h.aligned_amax(peak)
    assert peak <= amax < 2 * peak

    def mse(a):
        return float(((fake_quant_e4m3(x, a) - x) ** 2).mean())

    candidates = [mse(peak * 2 ** (j / SCALE_STEPS)) for j in range(SCALE_STEPS)]
    assert mse(amax) <= min(candidates) * 1.05  # the histogram's bin centres stand for the values
    if case == "off-grid bulk":
        assert mse(amax) < 0.5 * mse(peak)


def test_recipe_scale_steps_match_the_calibrator():
    """The recipe (a lower layer, which cannot import the calibrator) states the default and the bound
    again: they must agree with optfuse.precision.calibrate."""
    from pydantic import ValidationError

    from optfuse.recipe import Calibration

    assert Calibration().scale_steps == SCALE_STEPS
    assert Calibration(scale_steps=MAX_SCALE_STEPS).scale_steps == MAX_SCALE_STEPS
    for bad in (0, MAX_SCALE_STEPS + 1):
        with pytest.raises(ValidationError):
            Calibration(scale_steps=bad)


@pytest.mark.parametrize("steps", [0, 65, 2.5, True])
def test_bad_scale_steps(steps):
    with pytest.raises(InputError, match="scale_steps"):
        weight_scales(np.ones((2, 2)), 0, steps=steps)
    fused, _ = fuse_model(graphs.residual_block(n_layers=1), dims={"b": 2, "s": 8}, families=graphs.NORM_FAMILIES)
    with pytest.raises(InputError, match="scale_steps"):
        apply_precision(fused, PrecisionOptions(mode="fp8", scale_steps=steps), _block_feeds(0, 1))


def _relu_matmul() -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4])
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32), "w")
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"), helper.make_node("MatMul", ["r", "w"], ["y"], name="mm")]
    return helper.make_model(helper.make_graph(nodes, "g", [x], [y], [w]), opset_imports=[helper.make_opsetid("", 19)])


@pytest.mark.parametrize("method", ["max", "percentile", "mse"])
def test_calibrate_runs_the_model_with_tensors_as_outputs(method):
    rng = np.random.default_rng(3)
    feeds = [{"x": rng.standard_normal((16, 8)).astype(np.float32) * (i + 1)} for i in range(3)]
    cal = calibrate(_relu_matmul(), ["r", "x"], feeds, method)
    top_r = max(float(np.maximum(f["x"], 0).max()) for f in feeds)
    assert cal["r"].max_abs == pytest.approx(top_r) and cal["x"].max_abs == pytest.approx(
        max(float(np.abs(f["x"]).max()) for f in feeds))
    assert cal["r"].batches == 3 and cal["r"].elements == 3 * 16 * 8
    if method == "max":  # max |x| aligned: one of top * 2^(j / 8), j < 8
        assert top_r <= cal["r"].amax < 2 * top_r
        j = np.log2(cal["r"].amax / top_r) * SCALE_STEPS
        assert j == pytest.approx(round(j))
        exact = calibrate(_relu_matmul(), ["r"], feeds, method, scale_steps=1)["r"]
        assert exact.amax == pytest.approx(top_r) and exact.scale == pytest.approx(top_r / E4M3_MAX)
    else:
        assert 0 < cal["r"].amax <= top_r * (1 + 2 / 2048)  # within a histogram bin of max


def test_calibrate_bad_method_and_no_batches():
    with pytest.raises(InputError, match="expected one of max, percentile, mse"):
        calibrate(_relu_matmul(), ["r"], [{"x": np.ones((1, 8), np.float32)}], "entropy")
    with pytest.raises(InputError, match="at least one batch"):
        calibrate(_relu_matmul(), ["r"], [], "max")


def _block_feeds(seed: int, n: int = 4) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((2, 8, 64)).astype(np.float32)} for _ in range(n)]


def _scales(feeds, method="max") -> list[float]:
    fused, _ = fuse_model(graphs.residual_block(n_layers=2), dims={"b": 2, "s": 8}, families=graphs.NORM_FAMILIES)
    _, res = apply_precision(fused, PrecisionOptions(mode="fp8", calibrator=method), feeds)
    return [g["a_scale"] for g in res.fp8["gemms"]]


@pytest.mark.parametrize("method", ["max", "percentile", "mse"])
def test_scales_reproducible_with_a_seed(method):
    a, b, c = _scales(_block_feeds(7), method), _scales(_block_feeds(7), method), _scales(_block_feeds(8), method)
    assert len(a) == 2 and a == b
    assert a != c


def test_fp8_needs_calibration_feeds():
    fused, _ = fuse_model(graphs.residual_block(n_layers=1), dims={"b": 2, "s": 8}, families=graphs.NORM_FAMILIES)
    with pytest.raises(InputError, match="calibration feeds"):
        apply_precision(fused, PrecisionOptions(mode="fp8"), None)
    with pytest.raises(InputError, match="fp8_base 'fp32'"):
        apply_precision(fused, PrecisionOptions(mode="fp8", fp8_base="fp32"), _block_feeds(0, 1))
