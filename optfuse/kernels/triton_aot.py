"""Ahead-of-time compilation of Triton kernels (``triton.compile`` on an explicit GPUTarget).

Works without a GPU. The result is a :class:`KernelArtifact` with the cubin and the PTX of the
same compile. The PTX ISA version is capped (``$OPTFUSE_TRITON_PTX_VERSION``, default 8.7)
so that the PTX loads on drivers >= CUDA 12.8 even when this Triton's ptxas is newer.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import re
import sys
import types
from pathlib import Path

from .artifact import KernelArtifact, KernelSource

DEFAULT_PTX_VERSION = 87

_modules: dict[tuple[str, float, bool], types.ModuleType] = {}


def triton_version() -> str:
    import triton

    return triton.__version__


def compiler_id() -> str:
    return f"triton-{triton_version()}"


@contextlib.contextmanager
def interpret_env(interpret: bool):
    """TRITON_INTERPRET set (or unset) for the block, restored after."""
    old = os.environ.get("TRITON_INTERPRET")
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


def load_module(path: str | os.PathLike, interpret: bool = False) -> types.ModuleType:
    """Import a kernel source file under a private name (JIT functions or, with
    ``interpret=True``, Triton-interpreter functions)."""
    path = Path(path).resolve()
    key = (str(path), path.stat().st_mtime, interpret)
    mod = _modules.get(key)
    if mod is None:
        tag = hashlib.sha1(f"{path}:{interpret}".encode()).hexdigest()[:10]
        name = f"_optfuse_kernel_{path.stem}_{tag}"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        with interpret_env(interpret):
            spec.loader.exec_module(mod)
        _modules[key] = mod
    return mod


def _ptx_params(ptx: str, name: str) -> int:
    m = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\((.*?)\)", ptx, re.S)
    if not m:
        raise RuntimeError(f"entry {name!r} not found in the PTX")
    return len(re.findall(r"\.param\b", m.group(1)))


def compile_triton(src: KernelSource, arch: int, ptx_version: int | None = None) -> KernelArtifact:
    """Compile ``src`` (lang ``triton``) for ``sm_<arch>``; no GPU needed."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if src.lang != "triton":
        raise ValueError(f"{src.name}: not a Triton kernel")
    fn = getattr(load_module(src.path), src.entry)
    signature: dict[str, str] = {}
    attrs: dict[tuple[int], list] = {}
    for i, arg in enumerate(fn.arg_names):
        if arg in src.signature:
            ty = src.signature[arg]
            signature[arg] = ty
            if ty.startswith("*") and src.pointer_align >= 16:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif arg in src.constexprs:
            signature[arg] = "constexpr"
        else:
            raise ValueError(f"{src.name}: parameter {arg!r} of {src.entry} is neither in the signature nor a constexpr")
    n_runtime = len(src.signature)
    if n_runtime != src.n_inputs + src.n_extra + src.n_outputs:
        raise ValueError(f"{src.name}: signature has {n_runtime} runtime params, expected inputs+extra+outputs")
    if ptx_version is None:
        ptx_version = int(os.environ.get("OPTFUSE_TRITON_PTX_VERSION", DEFAULT_PTX_VERSION))
    options = {
        "num_warps": src.num_warps,
        "num_stages": src.num_stages,
        "enable_fp_fusion": True,
    }
    if ptx_version:
        options["ptx_version"] = ptx_version
    ast = ASTSource(fn=fn, signature=signature, constexprs=dict(src.constexprs), attrs=attrs)
    with interpret_env(False):
        compiled = triton.compile(ast, target=GPUTarget("cuda", arch, 32), options=options)
    md = compiled.metadata
    ptx = compiled.asm.get("ptx")
    cubin = compiled.asm.get("cubin")
    n_params = _ptx_params(ptx, md.name)
    n_scratch = n_params - n_runtime
    global_scratch = int(getattr(md, "global_scratch_size", 0) or 0)
    profile_scratch = int(getattr(md, "profile_scratch_size", 0) or 0)
    if global_scratch or profile_scratch:
        raise RuntimeError(
            f"{src.name}: kernel needs scratch memory ({global_scratch}/{profile_scratch} B); "
            "optfuse launches pass null scratch pointers"
        )
    return KernelArtifact(
        name=md.name,
        arch=arch,
        cubin=bytes(cubin) if cubin is not None else None,
        ptx=ptx,
        threads=md.num_warps * 32,
        shared_mem=int(md.shared),
        n_inputs=src.n_inputs,
        n_extra=src.n_extra,
        n_outputs=src.n_outputs,
        n_scratch=n_scratch,
        pointer_align=src.pointer_align,
        metadata={
            "lang": "triton",
            "compiler": compiler_id(),
            "source": src.name,
            "num_warps": md.num_warps,
            "num_stages": src.num_stages,
            "ptx_version": getattr(md, "ptx_version", ptx_version),
            **src.meta,
        },
    )
