"""Every kernel of every plugin, for ``optfuse kernels build`` / ``list``.

A plugin folder takes part when its ``launch.py`` defines ``prebuild_sources() ->
list[KernelSource]`` (the specializations worth compiling ahead of time: default attributes,
common hidden sizes, every dtype). Plugin modules are imported through
:mod:`optfuse.plugin_dirs` (no pydantic), so kernel code and GPU tests run where only
numpy/triton/cuda-python exist.
"""

from __future__ import annotations

import inspect

from ..plugin_dirs import PLUGINS_DIR, plugin_module
from .artifact import KernelSource

__all__ = ["PLUGINS_DIR", "all_sources", "plugin_folders", "plugin_module"]


def plugin_folders() -> list[str]:
    return sorted(p.parent.name for p in PLUGINS_DIR.glob("*/launch.py"))


def all_sources(folders: list[str] | None = None, errors: list[str] | None = None,
                arch: int | None = None) -> list[KernelSource]:
    """The prebuild specializations of every plugin folder (or of ``folders``) for target ``arch``
    (passed to a ``prebuild_sources(arch=...)`` that takes it: a plugin may add arch-specific
    kernels).

    With an ``errors`` list, a folder whose ``launch.py`` fails to import is reported there and
    skipped; without one, the exception propagates."""
    out: list[KernelSource] = []
    for folder in folders or plugin_folders():
        try:
            launch = plugin_module(folder, "launch")
            fn = getattr(launch, "prebuild_sources", None)
            if fn is not None:
                out.extend(fn(arch=arch) if "arch" in inspect.signature(fn).parameters else fn())
        except Exception as exc:
            if errors is None:
                raise
            errors.append(f"{folder}: {type(exc).__name__}: {exc}")
    return out
