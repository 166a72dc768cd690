"""Defaults shared by the recipe schema and the stages (bottom layer: imports only onnx).

- Symbolic dims: a recipe's opt value, else :data:`DEFAULT_BATCH` (2) for a leading or
  batch-named dim and :data:`DEFAULT_DIM` (16) for any other (:func:`concrete_dims`). Verify feeds
  these shapes, the HBM estimate assumes them and an engine profile without a recipe uses them.
- Tolerances per precision mode (:data:`DEFAULT_TOLERANCES`): fp32 agrees to rounding, the half
  types and FP8 to their mantissa; FP8 also by cosine similarity (:data:`DEFAULT_FP8_MIN_COSINE`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import onnx

DEFAULT_BATCH = 2
DEFAULT_DIM = 16

#: (atol, rtol) per precision mode of the candidate.
DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    "fp32": (1e-4, 1e-3),
    "fp16": (1e-2, 1e-2),
    "bf16": (5e-2, 5e-2),
    # E4M3 keeps 3 mantissa bits: each quantized operand is off by up to 2^-4 of itself, and a GEMM
    # output of random-signed terms by ~5% of its RMS (the tiny LLaMA's unit-scale hidden state:
    # mean |diff| 0.047, max 0.30 over 12k elements); 0.5 + 0.25 |ref| is ~8 sigma of that.
    # Elementwise maxima grow with the element count: cosine similarity (verify.fp8) is the main bar.
    "fp8": (5e-1, 2.5e-1),
}
#: FP8 candidates: the least cosine similarity of each output to the original's (~5% relative RMS
#: error gives 0.9987), and the least top-1 agreement of head outputs (None: reported, not required)
DEFAULT_FP8_MIN_COSINE = 0.99
DEFAULT_FP8_MIN_TOP1: float | None = None


def value_shape(vi: onnx.ValueInfoProto) -> list[int | str | None] | None:
    """A value's shape: ints for fixed dims, names for symbolic ones, None for unknown; None without a shape."""
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        return None
    out: list[int | str | None] = []
    for d in t.shape.dim:
        if d.HasField("dim_value"):
            out.append(int(d.dim_value))
        elif d.HasField("dim_param") and d.dim_param:
            out.append(d.dim_param)
        else:
            out.append(None)
    return out


def is_batch_name(name: str) -> bool:
    return bool(re.search(r"batch|^b$|^n$|^bs$", name, re.IGNORECASE))


def concrete_dims(model: onnx.ModelProto, opt_dims: Mapping[str, int] | None = None) -> dict[str, int]:
    """Symbolic dim name -> value: ``opt_dims`` (a recipe's opt values), else 2 for a leading (batch)
    dim and 16 otherwise, for every symbolic dim of the graph inputs."""
    dims: dict[str, int] = dict(opt_dims or {})
    init_names = {t.name for t in model.graph.initializer}
    for inp in model.graph.input:
        if inp.name in init_names:
            continue
        shape = value_shape(inp) or []
        for axis, d in enumerate(shape):
            if isinstance(d, str) and d not in dims:
                dims[d] = DEFAULT_BATCH if axis == 0 or is_batch_name(d) else DEFAULT_DIM
    return dims
