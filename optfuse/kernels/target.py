"""The arch kernels build for: ``$OPTFUSE_ARCH``, else the GPU present, else sm_90.

The GPU's compute capability comes from the CUDA driver (cuda-python), so kernels build on a
machine without a GPU. Parsing and spelling arch names is :mod:`optfuse.target` (re-exported here).
"""

from __future__ import annotations

import functools
import os

from ..target import DEFAULT_ARCH, SUPPORTED_ARCHS, arch_name, parse_arch

__all__ = ["DEFAULT_ARCH", "SUPPORTED_ARCHS", "arch_name", "default_arch", "detect_arch", "parse_arch",
           "resolve_arch"]


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
