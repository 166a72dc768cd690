"""Stage `precision`: a strongly typed FP16 / BF16 / FP8 version of a (fused) model.

- :mod:`.fp16`: the FP16 / BF16 conversion (onnxconverter-common; BF16 is its FP16 result re-typed),
  with the keep-FP32 policy;
- :mod:`.calibrate`: FP8 calibration: the FP32 model run in onnxruntime over calibration feeds with
  the tensors to quantize as extra outputs, and the max / percentile / MSE calibrators;
- :mod:`.fp8`: the ``fp8`` mode (E4M3): which GEMMs run FP8 and why the others do not, the Q/DQ
  placement (optfuse GEMM nodes take FP8 tensors and their scales directly; unfused MatMul/Gemm
  get TensorRT's explicit-quantization Q/DQ pattern), everything else through the FP16/BF16 path;
  :mod:`.fp8_attention` (optfuse FlashAttention nodes take their FP8 form), :mod:`.fp8_mha`
  (TensorRT's FP8 MHA pattern on unfused attention), :mod:`.fp8_norm` (norms write E4M3 y, their
  Q folded in) and :mod:`.fp8_nodes` (the Q/DQ builder and helpers these share).

:func:`apply_precision` is the stage's entry point: it takes the model, :class:`PrecisionOptions`
and, for ``fp8`` only, the calibration feeds (the pipeline makes them); it returns the converted
model and a :class:`PrecisionResult` (plain data; :mod:`optfuse.report` renders it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx

from ..errors import InputError
from .fp16 import (DEFAULT_KEEP_FP32, LOW, PrecisionOptions, PrecisionResult, check_optfuse_io, convert_precision,
                   converter_name, fp16_to_bf16, resolve_keep_fp32)

__all__ = [
    "DEFAULT_KEEP_FP32", "LOW", "PrecisionOptions", "PrecisionResult", "apply_precision", "check_optfuse_io",
    "convert_precision", "converter_name", "fp16_to_bf16", "resolve_keep_fp32",
]


def apply_precision(model: onnx.ModelProto, options: PrecisionOptions,
                    calibration: Sequence[Mapping[str, np.ndarray]] | None = None
                    ) -> tuple[onnx.ModelProto, PrecisionResult]:
    """The model at ``options.mode``: fp32 unchanged, fp16/bf16 through :func:`convert_precision`,
    fp8 through :func:`optfuse.precision.fp8.quantize_fp8` on the `calibration` feeds (required then)."""
    if options.mode == "fp8":
        from .fp8 import quantize_fp8

        if not calibration:
            raise InputError("precision fp8 needs calibration feeds (the pipeline makes them from the recipe)")
        return quantize_fp8(model, options, calibration)
    return convert_precision(model, options.mode, keep_fp32=options.keep_fp32, io_dtype=options.io_dtype)
