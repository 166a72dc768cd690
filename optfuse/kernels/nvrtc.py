"""CUDA C++ kernels (``extern "C"`` entry points) compiled to cubin + PTX.

NVRTC through cuda-python (``cuda.bindings.nvrtc``) by default; ``nvcc`` as the fallback (or
with ``$OPTFUSE_CUDA_COMPILER=nvcc``). Works without a GPU. The nvrtc wheel ships no CUDA headers
(``cuda_fp16.h``...), so :func:`cuda_include_dirs` looks for them in ``$CUDA_HOME``/``$CUDA_PATH``,
``/usr/local/cuda`` and the ``nvidia`` wheels; optfuse's own kernels include none of them.
"""

from __future__ import annotations

import functools
import glob
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .artifact import KernelArtifact, KernelSource


class CudaCompileError(RuntimeError):
    pass


@functools.cache
def nvrtc_version() -> tuple[int, int] | None:
    try:
        from cuda.bindings import nvrtc

        err, major, minor = nvrtc.nvrtcVersion()
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            return None
        return int(major), int(minor)
    except Exception:
        return None


@functools.cache
def nvcc_path() -> str | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


@functools.cache
def nvcc_version() -> str | None:
    nvcc = nvcc_path()
    if not nvcc:
        return None
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    for tok in out.replace(",", " ").split():
        if tok.startswith("V") and tok[1:2].isdigit():
            return tok[1:]
    return "unknown"


def backend() -> str:
    """``nvrtc`` or ``nvcc`` (``$OPTFUSE_CUDA_COMPILER`` overrides)."""
    want = os.environ.get("OPTFUSE_CUDA_COMPILER", "").lower()
    if want in ("nvrtc", "nvcc"):
        return want
    if nvrtc_version() is not None:
        return "nvrtc"
    if nvcc_path():
        return "nvcc"
    raise CudaCompileError("no CUDA C++ compiler: install cuda-bindings + nvidia-cuda-nvrtc, or put nvcc on PATH")


def compiler_id() -> str:
    if backend() == "nvrtc":
        major, minor = nvrtc_version()  # type: ignore[misc]
        return f"nvrtc-{major}.{minor}"
    return f"nvcc-{nvcc_version()}"


@functools.cache
def cuda_include_dirs() -> tuple[str, ...]:
    """Directories holding the CUDA toolkit headers (cuda_fp16.h and the CCCL ``nv/target``)."""
    roots: list[str] = []
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            roots.append(os.path.join(os.environ[env], "include"))
    roots.append("/usr/local/cuda/include")
    for p in sys.path:
        roots += sorted(glob.glob(os.path.join(p, "nvidia", "*", "include")))
    found: list[str] = []
    for r in roots:
        if os.path.isfile(os.path.join(r, "cuda_fp16.h")):
            found.append(r)
            cccl = os.path.join(r, "cccl")
            if os.path.isdir(cccl):
                found.append(cccl)
            break
    return tuple(found)


def _define_flags(src: KernelSource) -> list[str]:
    return [f"-D{k}={v}" for k, v in sorted(src.defines.items())]


def _check(result, what: str, log: str = "") -> None:
    from cuda.bindings import nvrtc

    err = result[0] if isinstance(result, tuple) else result
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, msg = nvrtc.nvrtcGetErrorString(err)
        raise CudaCompileError(f"{what} failed: {msg.decode() if isinstance(msg, bytes) else msg}\n{log}")


def _compile_nvrtc(src: KernelSource, arch: int) -> tuple[bytes, str]:
    from cuda.bindings import nvrtc

    text = src.source_text().encode()
    err, prog = nvrtc.nvrtcCreateProgram(text, os.path.basename(src.path).encode(), 0, [], [])
    _check(err, "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture=sm_{arch}{src.arch_suffix}", "--std=c++17", "-DOPTFUSE_NVRTC=1", *_define_flags(src)]
        opts += [f"-I{d}" for d in cuda_include_dirs()]
        bopts = [o.encode() for o in opts]
        (res,) = nvrtc.nvrtcCompileProgram(prog, len(bopts), bopts)
        # NVRTC writes into the buffers it is given: they must be fresh, writable objects. (The
        # usual `b" " * size` is neither: for an empty log, size 1, it is CPython's shared b" "
        # itself, and NVRTC's terminating NUL then corrupts that object for the whole process --
        # seen as `import torch` failing afterwards on a schema with its spaces gone.)
        err, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = bytearray(size)
        nvrtc.nvrtcGetProgramLog(prog, log)
        _check(res, f"NVRTC compile of {src.name} for sm_{arch}{src.arch_suffix}", log.decode(errors="replace").rstrip("\x00 "))
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(err, "nvrtcGetCUBINSize")
        cubin = bytearray(size)
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        err, size = nvrtc.nvrtcGetPTXSize(prog)
        _check(err, "nvrtcGetPTXSize")
        ptx = bytearray(size)
        _check(nvrtc.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
        return bytes(cubin), bytes(ptx).rstrip(b"\x00").decode()
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _compile_nvcc(src: KernelSource, arch: int) -> tuple[bytes, str]:
    nvcc = nvcc_path()
    if not nvcc:
        raise CudaCompileError("nvcc not found")
    with tempfile.TemporaryDirectory(prefix="optfuse-nvcc-") as tmp:
        cu = Path(tmp) / Path(src.path).name
        cu.write_text(src.source_text())
        base = [nvcc, "-std=c++17", *_define_flags(src), str(cu)]
        outs = {}
        a = f"{arch}{src.arch_suffix}"
        # -gencode, not -arch=sm_90a: nvcc 13.0's shorthand also runs a plain sm_90 pass, which
        # rejects the arch-specific instructions.
        for kind, flags in (("cubin", ["-cubin", f"-gencode=arch=compute_{a},code=sm_{a}"]),
                            ("ptx", ["-ptx", f"-gencode=arch=compute_{a},code=compute_{a}"])):
            out = Path(tmp) / f"k.{kind}"
            r = subprocess.run([*base, *flags, "-o", str(out)], capture_output=True, text=True)
            if r.returncode != 0:
                raise CudaCompileError(f"nvcc ({kind}) of {src.name} for sm_{arch} failed:\n{r.stderr}")
            outs[kind] = out.read_bytes()
        return outs["cubin"], outs["ptx"].decode()


def compile_cuda(src: KernelSource, arch: int) -> KernelArtifact:
    """Compile ``src`` (lang ``cuda``) for ``sm_<arch>`` into cubin + PTX; no GPU needed."""
    if src.lang != "cuda":
        raise ValueError(f"{src.name}: not a CUDA C++ kernel")
    if src.threads <= 0:
        raise ValueError(f"{src.name}: KernelSource.threads must be set for CUDA kernels")
    which = backend()
    cubin, ptx = _compile_nvrtc(src, arch) if which == "nvrtc" else _compile_nvcc(src, arch)
    return KernelArtifact(
        name=src.entry,
        arch=arch,
        cubin=cubin,
        ptx=ptx,
        threads=src.threads,
        shared_mem=0,
        n_inputs=src.n_inputs,
        n_extra=src.n_extra,
        n_outputs=src.n_outputs,
        n_scratch=0,
        pointer_align=src.pointer_align,
        arch_suffix=src.arch_suffix,
        tensor_maps=[t.spec() for t in src.tensor_maps],
        metadata={"lang": "cuda", "compiler": compiler_id(), "source": src.name, **src.meta},
    )
