"""GPU architecture names: parse ``sm_90`` / ``90`` / ``9.0`` / ``compute_90`` and spell ``sm_90``.

A bottom-layer module (no imports from optfuse): the recipe schema validates ``target.arch`` with
it, the kernel foundation names its builds with it and the TensorRT backend parses ``--target``
with it. Which arch the machine has (the CUDA driver) is :mod:`optfuse.kernels.target`'s business.
"""

from __future__ import annotations

import re

#: Architectures optfuse builds and tests kernels for.
SUPPORTED_ARCHS: tuple[int, ...] = (80, 86, 89, 90)
#: The arch kernels build for when neither the user nor a GPU says otherwise.
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
