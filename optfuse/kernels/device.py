"""Minimal device memory through the CUDA driver API (tests and tools without torch)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .launcher import _check, ensure_context


@dataclass
class DeviceArray:
    ptr: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: np.dtype

    def data_ptr(self) -> int:
        return self.ptr

    def free(self) -> None:
        from cuda.bindings import driver

        if self.ptr:
            _check(driver.cuMemFree(self.ptr), "cuMemFree")
            self.ptr = 0


def empty(shape, dtype) -> DeviceArray:
    from cuda.bindings import driver

    ensure_context()
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    ptr = _check(driver.cuMemAlloc(max(nbytes, 1)), "cuMemAlloc")
    return DeviceArray(int(ptr), nbytes, tuple(shape), dtype)


def to_device(a: np.ndarray) -> DeviceArray:
    from cuda.bindings import driver

    a = np.ascontiguousarray(a)
    d = empty(a.shape, a.dtype)
    if a.nbytes:
        _check(driver.cuMemcpyHtoD(d.ptr, a.ctypes.data, a.nbytes), "cuMemcpyHtoD")
    return d


def to_host(d: DeviceArray) -> np.ndarray:
    from cuda.bindings import driver

    out = np.empty(d.shape, d.dtype)
    if d.nbytes:
        _check(driver.cuMemcpyDtoH(out.ctypes.data, d.ptr, d.nbytes), "cuMemcpyDtoH")
    return out


def synchronize() -> None:
    from cuda.bindings import driver

    _check(driver.cuCtxSynchronize(), "cuCtxSynchronize")
