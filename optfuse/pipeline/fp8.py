"""What an fp8 run needs besides the stages' own work: the calibration batches and the base-precision
baseline the FP8 candidate is reported next to.

- :func:`calibration_feeds`: the recipe's ``precision.calibration.npz`` (read as ``--load-inputs``
  reads a file; its first ``batches`` feed dicts), else ``batches`` feed dicts of verify's input
  generator (inputs that respect each input's meaning: token ids below the vocabulary, padded
  masks), seeded with ``precision.calibration.seed``;
- :func:`baseline_model`: the same fused model through the base precision alone (``fp8_base``),
  verified on the same inputs as the FP8 candidate.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx

from ..errors import InputError
from ..precision import PrecisionOptions, PrecisionResult, apply_precision
from ..recipe import Recipe
from ..verify import Feeds, make_feed, plan_inputs
from .options import NO_OVERRIDES, CalibrationSettings, Overrides, calibration_settings, verify_options

NPZ_FIELD = "precision.calibration.npz"


def calibration_feeds(model: onnx.ModelProto, recipe: Recipe | None, overrides: Overrides = NO_OVERRIDES,
                      settings: CalibrationSettings | None = None) -> Feeds:
    """The calibration batches of an fp8 run on `model` (its graph inputs; weights not needed)."""
    from .arrays import load_feeds

    settings = settings or calibration_settings(recipe)
    plans = plan_inputs(model, verify_options(recipe, overrides, model))
    if settings.npz is not None:
        label = settings.npz_label or str(settings.npz)
        if not settings.npz.is_file():
            raise InputError(f"{NPZ_FIELD}: {label} not found" if not settings.npz.exists() else
                             f"{NPZ_FIELD}: {label} is not a file")
        try:
            feeds = load_feeds([settings.npz], plans, model)
        except InputError as exc:
            raise InputError(str(exc).replace("--load-inputs:", f"{NPZ_FIELD}:", 1)) from None
        return feeds[:settings.batches]
    rng = np.random.default_rng(settings.seed)
    return [make_feed(plans, rng) for _ in range(settings.batches)]


def check_calibration(model: onnx.ModelProto, recipe: Recipe | None, overrides: Overrides = NO_OVERRIDES) -> None:
    """The calibration file against the model's inputs, before any work (InputError: exit 2)."""
    settings = calibration_settings(recipe)
    if settings.npz is not None:
        calibration_feeds(model, recipe, overrides, settings)


def calibration_source(recipe: Recipe | None, n_feeds: int) -> str:
    """One phrase for the reports: how many calibration batches, from where."""
    s = calibration_settings(recipe)
    if s.npz is not None:
        return f"{n_feeds} batch(es) from {s.npz_label or s.npz}"
    return f"{n_feeds} generated batch(es), seed {s.seed}"


def baseline_model(model: onnx.ModelProto, options: PrecisionOptions) -> tuple[onnx.ModelProto, PrecisionResult]:
    """The fused model in the fp8 run's base precision alone (the FP8 candidate's side-by-side)."""
    return apply_precision(model, replace(options, mode=options.fp8_base))


def baseline_path(outdir: Path, name: str, options: PrecisionOptions) -> Path:
    return outdir / f"{name}.{options.fp8_base}.onnx"
