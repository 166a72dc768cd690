"""optfuse.kernels: AOT kernel builds (Triton, CUDA C++), the kernel cache, and one launcher.

No torch and no pydantic here: kernels are compiled with Triton / NVRTC (no GPU needed) and
launched through the CUDA driver API (cuda-python) in TensorRT QDP's argument order.
"""

from .artifact import ABI_VERSION, KernelArtifact, KernelSource, LaunchParams
from .cache import KernelCache, build_kernel, cache_dir, default_cache
from .target import DEFAULT_ARCH, SUPPORTED_ARCHS, arch_name, default_arch, parse_arch


def cdiv(a, b):
    """Ceiling division for ints (TensorRT QDP passes ``trtp.cdiv`` for symbolic shapes)."""
    return -(-a // b)


def launch(artifact, params, inputs, outputs, stream=0, **kw):
    """See :func:`optfuse.kernels.launcher.launch` (imported lazily: needs cuda-python)."""
    from .launcher import launch as _launch

    return _launch(artifact, params, inputs, outputs, stream, **kw)


__all__ = [
    "ABI_VERSION",
    "DEFAULT_ARCH",
    "SUPPORTED_ARCHS",
    "KernelArtifact",
    "KernelCache",
    "KernelSource",
    "LaunchParams",
    "arch_name",
    "build_kernel",
    "cache_dir",
    "cdiv",
    "default_arch",
    "default_cache",
    "launch",
    "parse_arch",
]
