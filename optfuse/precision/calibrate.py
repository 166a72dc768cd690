"""FP8 calibration: the amax of each tensor to quantize, from the FP32 model run over calibration feeds.

:func:`calibrate` runs the (fused) FP32 model in onnxruntime (CPU) with the tensors to quantize
added as graph outputs, one feed dict at a time, and reduces what it sees with one calibrator:

- ``max``: amax = max |x| over every batch (TensorRT's and ModelOpt's ``max`` calibrator; ModelOpt's
  default for FP8);
- ``percentile``: amax = the ``percentile``-th percentile of |x| over every batch, read off a
  histogram (default 99.99);
- ``mse``: amax = the clipping value whose E4M3 fake quantization of the histogram has the least
  squared error (the outliers above it saturate to +-448 scale units).

The two histogram calibrators follow ModelOpt's ``HistogramCalibrator``
(``modelopt/torch/quantization/calib/histogram.py``, itself TensorRT's pytorch-quantization
``calib/histogram.py``): 2048 bins over [0, max |x|] from the first batch, the range extended by
bins of the same width when a later batch exceeds it; ``_compute_amax_percentile`` (the first bin
edge where the CDF reaches the percentile) and ``_compute_amax_mse`` (candidates: the bin centres
from bin 128 on, stride 1; error: sum over bins of count * (fake_quant(centre) - centre)^2). MSE
rather than entropy: the KL-divergence (entropy) calibrator is defined for INT8's uniform grid of
128 levels, which E4M3's floating-point grid is not; the squared error of the E4M3 fake quantization
itself is the quantity FP8 rounding changes, and ModelOpt offers ``mse`` for FP8 for that reason.
E4M3's grid is relative (3 mantissa bits in every binade), so a smaller scale does not refine the
bulk of a distribution until that bulk would reach the subnormals: MSE keeps isolated outliers
(amax near max |x|) and clips only where the E4M3 grid's alignment pays (a sparse top bin);
``percentile`` is the calibrator that clips outliers.

A scale is amax / 448 (E4M3's largest finite value), per tensor for activations; :func:`weight_scales`
gives the per-output-channel weight scales (max |W| over each channel's row / 448).

**Grid alignment** (``scale_steps`` > 1, default :data:`SCALE_STEPS`). Every value rounds to a
neighbour on E4M3's grid, and where that grid sits relative to the data is the scale's choice: any
scale from amax / 448 up to twice that keeps every calibrated value in range with the same relative
resolution, and each rounds the data differently. So each scale is the candidate
``amax / 448 * 2^(j / scale_steps)`` (j = 0 .. scale_steps - 1) with the least squared rounding error:
per output channel over the channel's own weights (:func:`weight_scales`, exact), and per tensor
over the calibration histogram for the ``max`` calibrator (:meth:`Histogram.aligned_amax`; the
tensor's amax is then the chosen candidate, max |x| <= amax < 2 max |x|, so nothing calibrated
saturates). ``percentile`` and ``mse`` choose their clipping value themselves; the softmax output of
TensorRT's MHA pattern keeps max |p| (``optfuse.precision.fp8``). Measured on the test
models (``scripts/compare_modelopt_fp8.py``, README "Against ModelOpt"): the output's mean |error| 4-6 %
lower than at amax / 448.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from ..errors import InputError

#: E4M3's largest finite value: a scale maps amax to it.
E4M3_MAX = 448.0
CALIBRATORS = ("max", "percentile", "mse")
DEFAULT_PERCENTILE = 99.99
NUM_BINS = 2048
#: ``_compute_amax_mse``'s first candidate bin (ModelOpt's default): amax below 1/16 of the range is never tried
MSE_START_BIN = 128
#: Scale candidates per binade of the grid-alignment search (1: amax / 448 exactly)
SCALE_STEPS = 8
#: The most candidates per binade a recipe may ask for
MAX_SCALE_STEPS = 64
#: Weight elements per block of the alignment search (bounds its float32 temporaries to ~64 MB each)
_SEARCH_BLOCK = 1 << 24


@dataclass(frozen=True)
class TensorCalibration:
    """One tensor's calibration: its amax (what the scale maps to 448), the calibrator, how many
    batches and elements it saw, and the plain max |x| (for the report: how much a histogram clipped)."""

    name: str
    amax: float
    method: str
    batches: int
    elements: int
    max_abs: float

    @property
    def scale(self) -> float:
        return scale_of(self.amax)


def scale_of(amax: float) -> float:
    """amax / 448; an all-zero tensor gets scale 1 (any scale quantizes zeros exactly)."""
    return float(amax) / E4M3_MAX if amax > 0 and np.isfinite(amax) else 1.0


def fake_quant_e4m3(x: np.ndarray, amax: float | np.ndarray) -> np.ndarray:
    """x quantized to E4M3 with scale amax / 448 (saturating at +-448) and dequantized, in float64."""
    import ml_dtypes

    scale = np.asarray(amax, np.float64) / E4M3_MAX
    q = np.clip(np.asarray(x, np.float64) / scale, -E4M3_MAX, E4M3_MAX).astype(np.float32)
    return q.astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale


class Histogram:
    """|x| histogram with fixed-width bins, extended when a batch exceeds the range (ModelOpt's rule)."""

    def __init__(self, num_bins: int = NUM_BINS):
        self.num_bins = num_bins
        self.counts: np.ndarray | None = None
        self.edges: np.ndarray | None = None

    def add(self, values: np.ndarray) -> None:
        x = np.abs(np.asarray(values, np.float64).ravel())
        x = x[np.isfinite(x)]
        if x.size == 0:
            return
        top = float(x.max())
        if self.edges is None:
            self.edges = np.linspace(0.0, top if top > 0 else 1.0, self.num_bins + 1)
            self.counts = np.zeros(self.num_bins, np.int64)
        elif top > self.edges[-1]:
            width = self.edges[1] - self.edges[0]
            extra = np.arange(self.edges[-1] + width, top + width, width)
            self.edges = np.concatenate([self.edges, extra])
            self.counts = np.concatenate([self.counts, np.zeros(extra.size, np.int64)])
        counts, _ = np.histogram(x, bins=self.edges)
        self.counts += counts

    def percentile_amax(self, percentile: float) -> float:
        """ModelOpt's ``_compute_amax_percentile``: the bin edge where the CDF of |x| reaches `percentile`."""
        if self.counts is None or self.counts.sum() == 0:
            return 0.0
        cdf = np.cumsum(self.counts / self.counts.sum())
        idx = int(np.searchsorted(cdf, percentile / 100.0))
        return float(self.edges[min(idx, len(self.edges) - 1)])

    def aligned_amax(self, peak: float, steps: int = SCALE_STEPS) -> float:
        """The candidate ``peak * 2^(j / steps)`` (j = 0 .. steps - 1) whose E4M3 fake quantization of the
        histogram (count-weighted bin centres) has the least squared error: the grid's alignment
        to the data, nothing clipped. ``peak`` = max |x|; steps 1 or an empty histogram: ``peak``."""
        if steps <= 1 or peak <= 0 or self.counts is None or self.counts.sum() == 0:
            return float(peak)
        centres = (self.edges[1:] + self.edges[:-1]) / 2
        keep = self.counts > 0
        c, w = centres[keep], self.counts[keep].astype(np.float64)
        candidates = peak * 2.0 ** (np.arange(steps) / steps)
        errors = ((fake_quant_e4m3(c[None, :], candidates[:, None]) - c[None, :]) ** 2 * w).sum(axis=1)
        return float(candidates[int(np.argmin(errors))])

    def mse_amax(self, start_bin: int = MSE_START_BIN) -> float:
        """ModelOpt's ``_compute_amax_mse`` with E4M3 fake quantization: the candidate amax (a bin
        centre from `start_bin` on) with the least count-weighted squared error over the bin centres."""
        if self.counts is None or self.counts.sum() == 0:
            return 0.0
        centres = (self.edges[1:] + self.edges[:-1]) / 2
        counts = self.counts.astype(np.float64)
        keep = counts > 0  # empty bins add nothing to any candidate's error
        c, w = centres[keep], counts[keep]
        candidates = centres[min(start_bin, len(centres) - 1):]
        errors = np.empty(candidates.size)
        for start in range(0, candidates.size, 64):  # 64 candidates x the occupied bins at a time
            amax = candidates[start:start + 64, None]
            errors[start:start + 64] = ((fake_quant_e4m3(c[None, :], amax) - c[None, :]) ** 2 * w).sum(axis=1)
        return float(candidates[int(np.argmin(errors))])


def check_scale_steps(steps: int) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_SCALE_STEPS:
        raise InputError(f"precision.calibration.scale_steps {steps!r}: expected an integer from 1 to "
                         f"{MAX_SCALE_STEPS}")


def check_calibrator(method: str, percentile: float = DEFAULT_PERCENTILE) -> None:
    if method not in CALIBRATORS:
        raise InputError(f"precision.calibration.method {method!r}: expected one of {', '.join(CALIBRATORS)}")
    if not 0.0 < percentile <= 100.0:
        raise InputError(f"precision.calibration.percentile {percentile:g}: expected a value in (0, 100]")


def calibrate(model: onnx.ModelProto, tensors: Sequence[str], feeds: Sequence[Mapping[str, np.ndarray]],
              method: str = "max", percentile: float = DEFAULT_PERCENTILE,
              scale_steps: int = SCALE_STEPS) -> dict[str, TensorCalibration]:
    """Run `model` (FP32) in onnxruntime on every feed with `tensors` as extra outputs; each tensor's
    amax by `method` (:data:`CALIBRATORS`) over all feeds; ``max`` with ``scale_steps`` > 1: max |x|
    aligned (:meth:`Histogram.aligned_amax`)."""
    check_calibrator(method, percentile)
    check_scale_steps(scale_steps)
    if not feeds:
        raise InputError("calibration needs at least one batch of inputs")
    names = list(dict.fromkeys(tensors))
    inputs = {i.name for i in model.graph.input}
    peak = {n: 0.0 for n in names}
    elements = {n: 0 for n in names}
    hists = {n: Histogram() for n in names} if method != "max" or scale_steps > 1 else {}
    session, wanted = _session_with_outputs(model, [n for n in names if n not in inputs])
    for feed in feeds:
        needed = {k: v for k, v in feed.items() if k in {i.name for i in session.get_inputs()}}
        try:
            values = dict(zip(wanted, session.run(wanted, needed)))
        except Exception as exc:  # noqa: BLE001 - onnxruntime's own failure on a calibration batch
            raise InputError(f"calibration: onnxruntime could not run the FP32 model: {str(exc).splitlines()[0]}") \
                from None
        values.update({n: feed[n] for n in names if n in inputs})
        for n in names:
            v = np.asarray(values[n])
            finite = np.abs(v[np.isfinite(v)]) if v.size else v
            peak[n] = max(peak[n], float(finite.max()) if finite.size else 0.0)
            elements[n] += int(v.size)
            if hists:
                hists[n].add(v)
    out = {}
    for n in names:
        if method == "max":
            amax = hists[n].aligned_amax(peak[n], scale_steps) if hists else peak[n]
        elif method == "percentile":
            amax = hists[n].percentile_amax(percentile)
        else:
            amax = hists[n].mse_amax()
        out[n] = TensorCalibration(n, amax, method, len(feeds), elements[n], peak[n])
    return out


def _session_with_outputs(model: onnx.ModelProto, extra: Sequence[str]):
    """An onnxruntime CPU session of `model` with the tensors `extra` added as graph outputs
    (typed FLOAT: only float activations are calibrated); returns it and the output names to fetch."""
    import onnxruntime as ort

    m = onnx.ModelProto()
    m.CopyFrom(model)
    present = {o.name for o in m.graph.output}
    for name in extra:
        if name not in present:
            m.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    try:
        session = ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - a model onnxruntime rejects
        raise InputError(f"calibration: onnxruntime cannot load the FP32 model: {str(exc).splitlines()[0]}") from None
    return session, list(extra)


def weight_scales(w: np.ndarray, axis: int, steps: int = SCALE_STEPS,
                  rounding: Callable[[np.ndarray], np.ndarray] | None = None) -> np.ndarray:
    """Per-output-channel scales of a weight (float32; an all-zero channel gets scale 1): max |W| over
    every axis but `axis` / 448, times the 2^(j / steps) (j < steps) whose E4M3 rounding of the
    channel has the least squared error. ``rounding`` maps candidate scales to the values the graph
    will hold (a DequantizeLinear's FP16 scale), so the search rounds with those."""
    import ml_dtypes

    check_scale_steps(steps)
    rounding = rounding or (lambda s: s)
    rows = np.moveaxis(np.asarray(w, np.float32), axis, 0).reshape(np.shape(w)[axis], -1)
    amax = np.abs(rows).max(axis=1).astype(np.float64) if rows.size else np.zeros(len(rows))
    base = np.where(amax > 0, amax / E4M3_MAX, 1.0)
    if steps == 1:
        return np.asarray(rounding(base.astype(np.float32)), np.float32)
    candidates = [np.asarray(rounding((base * 2.0 ** (j / steps)).astype(np.float32)), np.float32)
                  for j in range(steps)]
    best = candidates[0].copy()
    decode = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)  # E4M3 -> float32
    block = max(1, _SEARCH_BLOCK // max(rows.shape[1], 1))
    for lo in range(0, len(rows), block):
        r = rows[lo:lo + block]
        least = np.full(len(r), np.inf)
        y = np.empty_like(r)
        for s in candidates:
            s_r = s[lo:lo + block, None]
            # float32 division: correctly rounded, so the same E4M3 values as quantize_e4m3's float64 path
            np.clip(np.divide(r, s_r, out=y), -E4M3_MAX, E4M3_MAX, out=y)
            err = decode[y.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)]  # a table: faster than a cast back
            err *= s_r
            err -= r
            e = np.einsum("ij,ij->i", err, err, dtype=np.float64)
            better = e < least
            least[better], best[lo:lo + block][better] = e[better], s[lo:lo + block][better]
    return best


def quantize_e4m3(x: np.ndarray, scale: np.ndarray | float, axis: int | None = None) -> np.ndarray:
    """x / scale, saturated to +-448 and rounded to E4M3 (ml_dtypes float8_e4m3fn; round to nearest even):
    what ``QuantizeLinear`` with a float8e4m3fn zero point computes. `scale` per tensor, or per
    channel along `axis`."""
    import ml_dtypes

    s = np.asarray(scale, np.float64)
    if axis is not None and s.ndim == 1:
        shape = [1] * np.ndim(x)
        shape[axis] = s.size
        s = s.reshape(shape)
    q = np.clip(np.asarray(x, np.float64) / s, -E4M3_MAX, E4M3_MAX)
    return q.astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
