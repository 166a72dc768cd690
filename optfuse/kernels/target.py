"""GPU targets: parse ``sm_90``/``90``/``9.0`` and pick the default arch.

The default is the compute capability of the GPU present (through the CUDA driver, via
cuda-python), else :data:`DEFAULT_ARCH` (sm_90), so kernels build on a machine without a GPU.
``$OPTFUSE_ARCH`` overrides the default.
"""

from __future__ import annotations

import functools
import os
import re

#: Architectures optfuse builds and tests kernels for.
SUPPORTED_ARCHS: tuple[int, ...] = (80, 86, 89, 90)
DEFAULT_ARCH = 90

_ARCH_RE = re.compile(r"^(?:sm_?|compute_?)?(\d)\.?(\d)a?$", re.IGNORECASE)


def parse_arch(value: str | int) -> int:
    """``"sm_90"``, ``"sm90"``, ``"90"``, ``"9.0"``, ``"compute_90"`` or ``90`` -> ``90``."""
    if isinstance(value, int):
        cc = value
    else:
        m = _ARCH_RE.match(str(value).strip())
        if not m:
            raise ValueError(f"cannot parse GPU arch {value!r}; use e.g. 'sm_90' or '90'")
        cc = int(m.group(1)) * 10 + int(m.group(2))
    if cc < 70 or cc > 129:
        raise ValueError(f"unsupported GPU arch {value!r} (compute capability {cc})")
    return cc


def arch_name(cc: int) -> str:
    """``90`` -> ``"sm_90"``."""
    return f"sm_{int(cc)}"


@functools.cache
def detect_arch() -> int | None:
    """Compute capability of CUDA device 0, or None without a driver/GPU."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    try:
        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return None
        err, count = driver.cuDeviceGetCount()
        if err != driver.CUresult.CUDA_SUCCESS or count < 1:
            return None
        err, dev = driver.cuDeviceGet(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return None
        attr = driver.CUdevice_attribute
        err1, major = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
        err2, minor = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
        if err1 != driver.CUresult.CUDA_SUCCESS or err2 != driver.CUresult.CUDA_SUCCESS:
            return None
        return major * 10 + minor
    except Exception:  # a broken driver install must not break CPU-only builds
        return None


def default_arch() -> int:
    """``$OPTFUSE_ARCH``, else the GPU present, else sm_90."""
    env = os.environ.get("OPTFUSE_ARCH")
    if env:
        return parse_arch(env)
    return detect_arch() or DEFAULT_ARCH


def resolve_arch(value: str | int | None) -> int:
    return default_arch() if value is None else parse_arch(value)
