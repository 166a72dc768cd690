"""Every kernel of every plugin, for ``optfuse kernels build`` / ``list``.

A plugin folder takes part when its ``launch.py`` defines ``prebuild_sources() ->
list[KernelSource]`` (the specializations worth compiling ahead of time: default attributes,
common hidden sizes, every dtype). Imports plugin modules the way :mod:`optfuse.spec` does
(package ``optfuse_plugins`` rooted at ``plugins/``) but without pydantic, so kernel code and
GPU tests run where only numpy/triton/cuda-python exist.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

from .artifact import KernelSource

PLUGINS_DIR = Path(__file__).resolve().parent.parent.parent / "plugins"


def _ensure_plugins_package() -> None:
    # Same package as optfuse.spec._ensure_plugins_package (kept in step; no pydantic here).
    if "optfuse_plugins" in sys.modules:
        return
    pkg = types.ModuleType("optfuse_plugins")
    pkg.__path__ = [str(PLUGINS_DIR)]  # type: ignore[attr-defined]
    pkg.__file__ = str(PLUGINS_DIR / "__init__.py")
    sys.modules["optfuse_plugins"] = pkg


def plugin_module(folder: str, module: str) -> types.ModuleType:
    """Import ``plugins/<folder>/<module>.py`` as ``optfuse_plugins.<folder>.<module>``."""
    _ensure_plugins_package()
    return importlib.import_module(f"optfuse_plugins.{folder}.{module}")


def plugin_folders() -> list[str]:
    return sorted(p.parent.name for p in PLUGINS_DIR.glob("*/launch.py"))


def all_sources(folders: list[str] | None = None, errors: list[str] | None = None) -> list[KernelSource]:
    """The prebuild specializations of every plugin folder (or of ``folders``).

    With an ``errors`` list, a folder whose ``launch.py`` fails to import is reported there and
    skipped; without one, the exception propagates."""
    out: list[KernelSource] = []
    for folder in folders or plugin_folders():
        try:
            launch = plugin_module(folder, "launch")
            fn = getattr(launch, "prebuild_sources", None)
            if fn is not None:
                out.extend(fn())
        except Exception as exc:
            if errors is None:
                raise
            errors.append(f"{folder}: {type(exc).__name__}: {exc}")
    return out
