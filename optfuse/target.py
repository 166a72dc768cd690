"""GPU architectures and which TensorRT backend can build for which: one parser, one rule.

A bottom-layer module (no imports from optfuse, no TensorRT import): the recipe schema validates
``target.arch`` with :func:`parse_arch`, the kernel foundation names its builds with it, and
``convert`` / ``build`` check the target against the backend with :func:`check_backend_target`
before any work. Which arch the machine has (the CUDA driver) is :mod:`optfuse.kernels.target`'s
business; what an installed TensorRT-RTX reports is :mod:`optfuse.trt.compat`'s.
"""

from __future__ import annotations

import re

#: Architectures optfuse builds and tests kernels for.
SUPPORTED_ARCHS: tuple[int, ...] = (80, 86, 89, 90)
#: The arch kernels build for when neither the user nor a GPU says otherwise.
DEFAULT_ARCH = 90
#: Every arch TensorRT 10/11 and TensorRT-RTX know: Turing .. Blackwell (datacenter, Thor, consumer, Spark).
KNOWN_ARCHS: tuple[int, ...] = (75, 80, 86, 87, 89, 90, 100, 103, 110, 120, 121)
#: What each backend can build an engine for. TensorRT builds on (and for) the GPU present, any
#: arch it knows; TensorRT-RTX builds on CPU for its ``ComputeCapability`` list, which has no
#: Hopper or datacenter Blackwell (sm_90, sm_100, sm_103, sm_110) and no Jetson (sm_87).
BACKEND_ARCHS: dict[str, tuple[int, ...]] = {
    "tensorrt": KNOWN_ARCHS,
    "tensorrt_rtx": (75, 80, 86, 89, 120, 121),
}
BACKEND_LABELS = {"tensorrt": "TensorRT", "tensorrt_rtx": "TensorRT-RTX"}

# sm_90 / sm90 / 90 / 9.0 / compute_90 / sm_90a / sm_100f / 12.0 / sm_120
_ARCH_RE = re.compile(r"^(?:sm_?|compute_?)?(\d{1,2})\.?(\d)([af]?)$", re.IGNORECASE)


def parse_arch(value: str | int) -> int:
    """``"sm_90"``, ``"sm90"``, ``"90"``, ``"9.0"``, ``"compute_90"``, ``"sm_90a"``, ``"sm_120"``,
    ``"12.0"`` or ``90`` -> ``90`` (``120``); ValueError for anything TensorRT does not know."""
    if isinstance(value, bool):
        raise ValueError(f"cannot parse GPU arch {value!r}; use e.g. 'sm_90' or '90'")
    if isinstance(value, int):
        cc = value
    else:
        m = _ARCH_RE.match(str(value).strip())
        if not m:
            raise ValueError(f"cannot parse GPU arch {value!r}; use e.g. 'sm_90', '90' or '9.0'")
        cc = int(m.group(1)) * 10 + int(m.group(2))
    if cc not in KNOWN_ARCHS:
        raise ValueError(f"unknown GPU arch {value!r} (compute capability {cc}); known: "
                         + ", ".join(arch_name(c) for c in KNOWN_ARCHS))
    return cc


def arch_name(cc: int) -> str:
    """``90`` -> ``"sm_90"``."""
    return f"sm_{int(cc)}"


def backends_for(cc: int) -> list[str]:
    """The backends that can build an engine for ``cc``."""
    return [b for b, archs in BACKEND_ARCHS.items() if cc in archs]


def target_problem(backend: str, cc: int, archs: tuple[int, ...] | None = None) -> str | None:
    """Why ``backend`` cannot build for ``cc`` (one line naming the backends that can), or None.
    ``archs`` overrides the table with what an installed backend reports."""
    can = archs if archs is not None else BACKEND_ARCHS.get(backend, KNOWN_ARCHS)
    if cc in can:
        return None
    label = BACKEND_LABELS.get(backend, backend)
    others = [BACKEND_LABELS[b] + f" (--backend {b})" for b in backends_for(cc) if b != backend]
    return (f"{label} cannot build for {arch_name(cc)} (it builds for {', '.join(map(arch_name, can))}); "
            + (f"{arch_name(cc)} needs {' or '.join(others)}" if others else f"no backend builds for {arch_name(cc)}"))


def check_backend_target(backend: str | None, target: str | int | None) -> int | None:
    """Parse ``target`` and check ``backend`` (a concrete name, or None for none installed /
    not known yet) can build for it: the arch, or ValueError with one line."""
    if target in (None, "", "auto"):
        return None
    cc = parse_arch(target)  # type: ignore[arg-type]
    if backend is not None:
        problem = target_problem(backend, cc)
        if problem:
            raise ValueError(problem)
    return cc
