"""Small helpers shared by the plugins' ``launch.py`` (no torch, no pydantic)."""

from __future__ import annotations

import struct
from typing import Any, Sequence

_DTYPES = {
    "float32": "float32", "fp32": "float32", "float": "float32", "f32": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16", "f16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float8e4m3fn": "float8e4m3fn", "float8_e4m3fn": "float8e4m3fn", "fp8": "float8e4m3fn", "fp8e4m3": "float8e4m3fn",
}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float8e4m3fn": 1}
#: Triton's pointer element names (E4M3 with NaN and no infinities: Triton's ``fp8e4nv``).
TRITON_TYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float8e4m3fn": "fp8e4nv"}
#: ``-DOPTFUSE_DTYPE`` of the CUDA kernels (plugins/common/io_dtype.cuh, the FlashAttention kernel)
CUDA_DTYPE_CODE = {"float32": 0, "float16": 1, "bfloat16": 2}


def as_float32(x: Any) -> float:
    """``x`` rounded to float32, the value an ONNX float attribute and a TensorRT plugin field hold.
    Float attributes that are compiled into a kernel (a scale, an epsilon, alpha) go through this
    before they enter its source, so a kernel built ahead of time from a Python float (1 / sqrt(128),
    1e-5) and the one an engine asks for with the stored float32 have the same cache key."""
    return struct.unpack("<f", struct.pack("<f", float(x)))[0]


def norm_cuda_defines(dtype: str, hidden: int, eps: float) -> dict[str, str]:
    """The ``-D`` defines every CUDA norm kernel takes: element type, row width, epsilon (a float
    literal with 9 significant digits: the fp32 value exactly)."""
    return {"OPTFUSE_DTYPE": str(CUDA_DTYPE_CODE[dtype]), "HIDDEN": str(hidden), "EPS": format(eps, ".9g") + "f"}


def norm_dtype(dtype: Any) -> str:
    """``"float16"`` from "fp16", numpy/ml_dtypes dtypes, torch dtypes, TensorRT DataType..."""
    s = str(dtype).lower().replace("torch.", "").replace("datatype.", "").replace("<class '", "").rstrip("'>")
    s = s.split(".")[-1]
    if s in _DTYPES:
        return _DTYPES[s]
    raise ValueError(f"unsupported dtype {dtype!r}")


def cdiv(a: Any, b: Any) -> Any:
    """Ceiling division of ints; TensorRT QDP callers pass ``trtp.cdiv`` instead."""
    return -(-a // b)


def static_int(v: Any, what: str = "dimension") -> int:
    """A concrete int from an int or a constant TensorRT symbolic expression."""
    if isinstance(v, int):
        return v
    for attr in ("constant_value",):
        c = getattr(v, attr, None)
        if c is not None and getattr(v, "is_constant", True):
            return int(c() if callable(c) else c)
    try:
        return int(v)
    except Exception:
        raise ValueError(f"{what} must be static (a concrete int); pass static_shape={{'hidden': N}}") from None


def rows_of(shape: Sequence[Any]) -> Any:
    """Product of all dims but the last, written with ``*`` only (works on symbolic dims)."""
    rows: Any = None
    for d in list(shape)[:-1]:
        rows = d if rows is None else rows * d
    return 1 if rows is None else rows


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


#: The first arch with E4M3 conversions (cvt.rn.satfinite.e4m3x2.f32): the norms' FP8-output floor.
FP8_OUTPUT_MIN_ARCH = 89


def fp8_output(op: str, static_shape: dict) -> bool:
    """Whether a norm node has y_scale (its FP8-output form); refuses (ValueError) a known target
    below sm_89, which has no E4M3 conversions."""
    if static_shape.get("y_scale") is None:
        return False
    arch = static_shape.get("arch")
    if arch is not None and int(arch) < FP8_OUTPUT_MIN_ARCH:
        raise ValueError(f"{op}: the FP8 output (y_scale) needs E4M3 conversions, sm_{FP8_OUTPUT_MIN_ARCH} or later "
                         f"(target sm_{arch})")
    return True
