"""Launch a :class:`KernelArtifact` through the CUDA driver API (cuda-python). No torch.

Argument order (TensorRT QDP ``aot_impl``): input pointers, int32 extra args, output pointers,
then the tensor maps a CUDA kernel takes (``artifact.tensor_maps``, encoded here from the launch's
pointers and extra args), then ``artifact.n_scratch`` null scratch pointers (Triton >= 3.3). The
cubin is loaded when it matches the device; the PTX (its ISA version lowered to what the driver
accepts) only when no cubin fits, or when asked with ``prefer="ptx"``. :func:`launch_plan` runs the
steps of a :class:`LaunchPlan` (kernels over the op's inputs, outputs, a workspace and a state) in
order.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import threading
from typing import Any, Sequence

from .artifact import (TENSOR_MAP_DTYPES, Buffer, KernelArtifact, LaunchPlan, LaunchParams, TensorMapArg,
                       tensor_map_extent)


class CudaError(RuntimeError):
    """A CUDA driver call failed; ``.code`` is the CUresult."""

    def __init__(self, what: str, code: Any) -> None:
        self.code = code
        super().__init__(f"{what} failed: {_error_text(code)}")


def _error_text(code: Any) -> str:
    from cuda.bindings import driver

    try:
        _, name = driver.cuGetErrorName(code)
        _, desc = driver.cuGetErrorString(code)
        name = name.decode() if isinstance(name, bytes) else str(name)
        desc = desc.decode() if isinstance(desc, bytes) else str(desc)
        return f"{name} ({desc})"
    except Exception:
        return str(code)


def _check(result: Any, what: str) -> Any:
    """Unpack a cuda-python ``(CUresult, *values)`` tuple, raising :class:`CudaError`."""
    from cuda.bindings import driver

    if isinstance(result, tuple):
        err, rest = result[0], result[1:]
    else:
        err, rest = result, ()
    if err != driver.CUresult.CUDA_SUCCESS:
        raise CudaError(what, err)
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


_lock = threading.Lock()
_functions: dict[tuple, tuple[Any, Any, int]] = {}  # (ctx, key, kind) -> (module, function, smem set)
_initialized = False


def ensure_context() -> Any:
    """The current CUDA context; without one (no torch etc.), make the primary context of
    device ``$OPTFUSE_DEVICE`` (default 0) current."""
    from cuda.bindings import driver

    global _initialized
    if not _initialized:
        _check(driver.cuInit(0), "cuInit")
        _initialized = True
    ctx = _check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if ctx is None or int(ctx) == 0:
        dev = _check(driver.cuDeviceGet(int(os.environ.get("OPTFUSE_DEVICE", "0"))), "cuDeviceGet")
        ctx = _check(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        _check(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return ctx


_arch_by_ctx: dict[int, int] = {}


def current_device_arch() -> int:
    """Compute capability of the current context's device (cached per context)."""
    from cuda.bindings import driver

    ctx = int(ensure_context())
    if ctx in _arch_by_ctx:
        return _arch_by_ctx[ctx]
    dev = _check(driver.cuCtxGetDevice(), "cuCtxGetDevice")
    attr = driver.CUdevice_attribute
    major = _check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "cuDeviceGetAttribute")
    minor = _check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "cuDeviceGetAttribute")
    _arch_by_ctx[ctx] = int(major) * 10 + int(minor)
    return _arch_by_ctx[ctx]


def driver_version() -> int:
    from cuda.bindings import driver

    return int(_check(driver.cuDriverGetVersion(), "cuDriverGetVersion"))


def max_ptx_isa(drv: int) -> int | None:
    """Highest PTX ISA (e.g. 90 for 9.0) a driver of version ``drv`` (e.g. 13000) can JIT."""
    major, minor = drv // 1000, (drv % 1000) // 10
    if major == 12:
        return {0: 80, 1: 81, 2: 82, 3: 83, 4: 84, 5: 85, 6: 85, 7: 86, 8: 87, 9: 88}.get(minor, 88)
    if major == 13:
        return 90 + minor
    if major < 12:
        return 78
    return None  # newer than this table: leave the PTX alone


_PTX_VERSION = re.compile(r"^(\s*\.version\s+)(\d+)\.(\d+)", re.M)


def fit_ptx_to_driver(ptx: str, drv: int | None = None) -> str:
    """Lower the PTX's ``.version`` to what the driver accepts (a newer toolkit stamps its own
    ISA version even when the kernel uses nothing new; the JIT still fails if it does)."""
    cap = max_ptx_isa(driver_version() if drv is None else drv)
    m = _PTX_VERSION.search(ptx)
    if cap is None or not m:
        return ptx
    if int(m.group(2)) * 10 + int(m.group(3)) <= cap:
        return ptx
    return _PTX_VERSION.sub(lambda mm: f"{mm.group(1)}{cap // 10}.{cap % 10}", ptx, count=1)


def _cubin_fits(artifact_arch: int, device_arch: int, suffix: str = "") -> bool:
    # sm_XY cubins run on devices of the same major with minor >= Y; sm_90a only on 9.0.
    if suffix:
        return device_arch == artifact_arch
    return artifact_arch // 10 == device_arch // 10 and device_arch >= artifact_arch


def _artifact_id(art: KernelArtifact) -> str:
    if art.key:
        return art.key
    h = hashlib.sha1()
    h.update(art.cubin or b"")
    h.update((art.ptx or "").encode())
    h.update(art.name.encode())
    return h.hexdigest()


def get_function(artifact: KernelArtifact, prefer: str | None = None) -> tuple[Any, str]:
    """Load (once per context) and return ``(CUfunction, "cubin"|"ptx")``."""
    from cuda.bindings import driver

    ctx = ensure_context()
    dev_arch = current_device_arch()
    prefer = prefer or os.environ.get("OPTFUSE_LAUNCH_PREFER", "cubin")
    if prefer not in ("cubin", "ptx"):
        raise ValueError(f"prefer must be 'cubin' or 'ptx', not {prefer!r}")
    cubin_ok = artifact.cubin is not None and _cubin_fits(artifact.arch, dev_arch, artifact.arch_suffix)
    ptx_ok = artifact.ptx is not None and (
        dev_arch == artifact.arch if artifact.arch_suffix else dev_arch >= artifact.arch)
    if prefer == "ptx" and ptx_ok:
        kind = "ptx"
    elif cubin_ok:
        kind = "cubin"
    elif ptx_ok:
        kind = "ptx"
    else:
        raise RuntimeError(
            f"kernel {artifact.name} was built for sm_{artifact.arch}{artifact.arch_suffix}; the device is sm_{dev_arch} "
            "(rebuild with `optfuse kernels build --target sm_%d`)" % dev_arch
        )
    key = (int(ctx), _artifact_id(artifact), kind)
    with _lock:
        hit = _functions.get(key)
        if hit is None:
            if kind == "cubin":
                image = artifact.cubin
            else:
                image = fit_ptx_to_driver(artifact.ptx).encode() + b"\0"
            module = _check(driver.cuModuleLoadData(image), f"cuModuleLoadData({artifact.name}, {kind})")
            func = _check(driver.cuModuleGetFunction(module, artifact.name.encode()), f"cuModuleGetFunction({artifact.name})")
            hit = (module, func, 0)
            _functions[key] = hit
    return hit[1], kind


def _set_smem(artifact: KernelArtifact, func: Any, smem: int, kind: str) -> None:
    from cuda.bindings import driver

    if smem <= 48 * 1024:
        return
    ctx = ensure_context()
    key = (int(ctx), _artifact_id(artifact), kind)
    module, f, done = _functions[key]
    if done >= smem:
        return
    _check(
        driver.cuFuncSetAttribute(func, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
        f"cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES={smem}) for {artifact.name}",
    )
    _functions[key] = (module, f, smem)


def device_pointer(x: Any) -> int:
    """An int device address from an int, None (-> 0), a CUdeviceptr, an object with
    ``data_ptr()`` (torch) or ``__cuda_array_interface__`` (CuPy, Numba...)."""
    if x is None:
        return 0
    if isinstance(x, int):
        return x
    if hasattr(x, "data_ptr"):
        return int(x.data_ptr())
    iface = getattr(x, "__cuda_array_interface__", None)
    if iface is not None:
        return int(iface["data"][0])
    return int(x)  # CUdeviceptr and friends


def stream_handle(stream: Any) -> int:
    if stream is None:
        return 0
    if isinstance(stream, int):
        return stream
    if hasattr(stream, "cuda_stream"):  # torch.cuda.Stream
        return int(stream.cuda_stream)
    return int(stream)  # CUstream


def _dim3(v: Any, what: str) -> tuple[int, int, int]:
    v = tuple(int(x) for x in v)
    if len(v) > 3 or not v:
        raise ValueError(f"{what} must have 1 to 3 dimensions, got {v}")
    v = v + (1,) * (3 - len(v))
    if any(x < 1 for x in v):
        raise ValueError(f"{what} dimensions must be >= 1, got {v}")
    return v  # type: ignore[return-value]


def tensor_map_layout(arg: TensorMapArg | dict, pointers: Sequence[int],
                      extra: Sequence[int]) -> tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(base address, dims, byte strides of dims 1.., box), innermost first, of the tensor map ``arg``
    over one launch's ``pointers`` (inputs, then outputs) and int32 ``extra`` arguments; what
    cuTensorMapEncodeTiled gets. Raises ValueError where TMA cannot address the tensor (an empty
    dimension, a base or a stride not a multiple of 16 bytes)."""
    if isinstance(arg, dict):
        arg = TensorMapArg(**arg)
    size = TENSOR_MAP_DTYPES[arg.dtype]
    rows, cols = tensor_map_extent(arg.rows, extra), tensor_map_extent(arg.cols, extra)
    row_bytes = -(-cols * size // arg.row_align) * arg.row_align
    base = int(pointers[arg.pointer])
    dims, strides, box = [cols, rows], [row_bytes], [arg.box_cols, arg.box_rows]
    if arg.pair is not None:
        other = int(pointers[arg.pair])
        dims.append(2)
        strides.append(abs(other - base) or rows * row_bytes)  # one matrix twice: any stride past it
        box.append(1)
        base = min(base, other)
    if arg.heads is not None:
        dims.append(tensor_map_extent(arg.heads, extra))
        strides.append(rows * row_bytes)
        box.append(1)
    if min(dims) <= 0 or base % 16 or any(st % 16 for st in strides):
        raise ValueError(f"tensor map over pointer {arg.pointer}: base 0x{base:x}, dims {dims}, byte strides "
                         f"{strides}: TMA needs dims > 0 and 16-byte multiples")
    return base, tuple(dims), tuple(strides), tuple(box)


_TMAP_TYPES = {"float16": "CU_TENSOR_MAP_DATA_TYPE_FLOAT16", "bfloat16": "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16",
               "uint8": "CU_TENSOR_MAP_DATA_TYPE_UINT8"}
_TMAP_CACHE: dict[tuple, Any] = {}
_TMAP_CACHE_MAX = 1024


def encode_tensor_map(dtype: str, layout: tuple) -> Any:
    """The CUtensorMap of ``layout`` (tensor_map_layout) over ``dtype`` elements: 128-byte swizzle,
    zeros past the edges, no interleave or L2 promotion (the device-built maps' settings). Cached:
    a stream of launches over the same buffers encodes each map once."""
    key = (dtype, layout)
    tmap = _TMAP_CACHE.get(key)
    if tmap is not None:
        return tmap
    from cuda.bindings import driver

    base, dims, strides, box = layout
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    tmap = _check(
        driver.cuTensorMapEncodeTiled(
            getattr(driver.CUtensorMapDataType, _TMAP_TYPES[dtype]), len(dims), base,
            [u64(d) for d in dims], [u64(st) for st in strides], [u32(b) for b in box], [u32(1)] * len(dims),
            driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
            driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_NONE,
            driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
        f"cuTensorMapEncodeTiled(dims={dims}, strides={strides}, box={box})")
    if len(_TMAP_CACHE) >= _TMAP_CACHE_MAX:
        _TMAP_CACHE.clear()
    _TMAP_CACHE[key] = tmap
    return tmap


def launch(
    artifact: KernelArtifact,
    params: LaunchParams,
    inputs: Sequence[Any],
    outputs: Sequence[Any],
    stream: Any = 0,
    *,
    prefer: str | None = None,
    sync: bool = False,
) -> None:
    """Launch ``artifact`` with ``params`` on ``stream`` (int handle, CUstream or torch stream).

    ``inputs``/``outputs`` are device pointers (ints, or objects with ``data_ptr()`` /
    ``__cuda_array_interface__``), in spec order; ``None`` for an absent optional input.
    ``sync=True`` synchronizes the stream and raises any asynchronous error (tests).
    """
    from cuda.bindings import driver

    if len(inputs) != artifact.n_inputs or len(outputs) != artifact.n_outputs:
        raise ValueError(
            f"{artifact.name}: expects {artifact.n_inputs} inputs and {artifact.n_outputs} outputs, "
            f"got {len(inputs)} and {len(outputs)}"
        )
    if len(params.extra_args) != artifact.n_extra:
        raise ValueError(f"{artifact.name}: expects {artifact.n_extra} extra args, got {len(params.extra_args)}")
    grid = _dim3(params.grid, "grid")
    block = _dim3(params.block, "block")
    if block[0] * block[1] * block[2] != artifact.threads:
        raise ValueError(f"{artifact.name}: compiled for {artifact.threads} threads per block, launch asks {block}")
    smem = max(int(params.shared_mem), int(artifact.shared_mem))

    ptrs = [device_pointer(p) for p in inputs] + [device_pointer(p) for p in outputs]
    for i, p in enumerate(ptrs):
        if p % max(artifact.pointer_align, 1):
            raise ValueError(
                f"{artifact.name}: pointer argument {i} (0x{p:x}) is not {artifact.pointer_align}-byte aligned"
            )
    extra = []
    for v in params.extra_args:
        v = int(v)
        if not -(2**31) <= v < 2**31:
            raise OverflowError(f"{artifact.name}: extra argument {v} does not fit int32")
        extra.append(ctypes.c_int32(v))
    ins = [ctypes.c_uint64(device_pointer(p)) for p in inputs]
    outs = [ctypes.c_uint64(device_pointer(p)) for p in outputs]
    scratch = [ctypes.c_uint64(0) for _ in range(artifact.n_scratch)]
    values = ins + extra + outs
    addresses = [ctypes.addressof(v) for v in values]
    maps = [encode_tensor_map(t.dtype, tensor_map_layout(t, ptrs, params.extra_args))
            for t in artifact.tensor_map_args]
    addresses += [int(m.getPtr()) for m in maps] + [ctypes.addressof(v) for v in scratch]
    argv = (ctypes.c_void_p * len(addresses))(*addresses)

    func, kind = get_function(artifact, prefer)
    _set_smem(artifact, func, smem, kind)
    hstream = driver.CUstream(stream_handle(stream))
    _check(
        driver.cuLaunchKernel(func, *grid, *block, smem, hstream, ctypes.addressof(argv), 0),
        f"cuLaunchKernel({artifact.name}, grid={grid}, block={block}, smem={smem})",
    )
    if sync:
        _check(driver.cuStreamSynchronize(hstream), f"cuStreamSynchronize after {artifact.name}")


def plan_pointers(refs: Sequence[Buffer], inputs: Sequence[Any], outputs: Sequence[Any], workspace: Any,
                  state: Any = 0) -> list[int]:
    """Device addresses of a plan step's buffers: ``inputs[i]`` (0 for an absent or missing
    optional input), ``outputs[j]``, ``workspace + offset``, ``state + offset``."""
    out = []
    for ref in refs:
        if ref.kind == "input":
            out.append(device_pointer(inputs[ref.index]) if ref.index < len(inputs) else 0)
        elif ref.kind == "output":
            out.append(device_pointer(outputs[ref.index]))
        else:
            base = device_pointer(workspace if ref.kind == "workspace" else state)
            if not base:
                raise ValueError(f"plan step reads {ref.kind} offset {ref.index} but no {ref.kind} was given")
            out.append(base + ref.index)
    return out


def launch_plan(
    plan: LaunchPlan,
    inputs: Sequence[Any],
    outputs: Sequence[Any],
    workspace: Any = 0,
    stream: Any = 0,
    *,
    state: Any = 0,
    prefer: str | None = None,
    sync: bool = False,
) -> None:
    """Launch every step of ``plan`` on ``stream``, in order (one stream orders them: a step sees
    what the previous ones wrote). ``inputs`` / ``outputs`` are the op's pointers in spec order
    (None for an absent optional input); ``workspace`` points at ``plan.workspace_bytes`` bytes,
    256-byte aligned (TensorRT's workspace is); ``state`` at the op instance's
    ``plan.state_bytes`` bytes (a :class:`DeviceState`). Each step's artifact must be built."""
    for what, size, ptr in (("workspace", plan.workspace_bytes, workspace), ("state", plan.state_bytes, state)):
        if int(size or 0) > 0 and not device_pointer(ptr):
            raise ValueError(f"plan needs a {what} of {int(size)} bytes; none was given")
    for k, step in enumerate(plan.steps):
        if step.artifact is None:
            raise ValueError(f"plan step {k} ({step.source.name}) has no built artifact")
        launch(step.artifact, step.params, plan_pointers(step.inputs, inputs, outputs, workspace, state),
               plan_pointers(step.outputs, inputs, outputs, workspace, state), stream, prefer=prefer,
               sync=sync and k == len(plan.steps) - 1)


class DeviceState:
    """An op instance's plan state (LaunchPlan.state_bytes): device memory, zeroed when allocated,
    grown (reallocated, zeroed) when a plan needs more, freed with the object. Allocate it before
    a CUDA graph capture (TensorRT's ``on_shape_change``): cuMemAlloc may not run inside one."""

    def __init__(self) -> None:
        self.ptr = 0
        self.nbytes = 0

    def ensure(self, nbytes: int) -> int:
        """The state's address, at least ``nbytes`` long and zero where new (0 when nbytes is 0)."""
        from cuda.bindings import driver

        nbytes = int(nbytes or 0)
        if nbytes > self.nbytes:
            ensure_context()
            self.free()
            ptr = _check(driver.cuMemAlloc(nbytes), "cuMemAlloc (plan state)")
            _check(driver.cuMemsetD8(ptr, 0, nbytes), "cuMemsetD8 (plan state)")
            # the memset runs on the legacy stream: done before any stream (blocking or not) uses it
            _check(driver.cuCtxSynchronize(), "cuCtxSynchronize (plan state)")
            self.ptr, self.nbytes = int(ptr), nbytes
        return self.ptr

    def free(self) -> None:
        if self.ptr:
            from cuda.bindings import driver

            driver.cuMemFree(self.ptr)
            self.ptr, self.nbytes = 0, 0

    def __del__(self) -> None:
        try:
            self.free()
        except Exception:  # interpreter shutdown: the context may be gone already
            pass
