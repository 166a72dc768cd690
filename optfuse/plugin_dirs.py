"""Where plugin folders live and how they are imported (no third-party imports here).

Plugin folders import as the package ``optfuse_plugins.<folder>``, rooted at ``plugins/`` of a
checkout or, installed from the wheel, at the package ``optfuse_plugins`` (the same files), so
kernels, references and launch code sit next to their spec. This module stays free of pydantic
and onnx so kernel code and GPU tests can use it where only numpy/triton/cuda-python exist.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parent.parent


def _plugins_dir() -> Path:
    """``plugins/`` of a source checkout (editable install, PYTHONPATH) or, in an installed wheel,
    the folder of the package ``optfuse_plugins`` (the same files, shipped as package data)."""
    checkout = _CHECKOUT / "plugins"
    if (checkout / "__init__.py").is_file():
        return checkout
    spec = importlib.util.find_spec("optfuse_plugins")
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0]).resolve()
    return checkout  # neither: discovery finds no plugins and says so


PLUGINS_DIR = _plugins_dir()
SCRIPTS_DIR = _CHECKOUT / "scripts"


def _ensure_plugins_package() -> None:
    if "optfuse_plugins" in sys.modules:
        return
    pkg = types.ModuleType("optfuse_plugins")
    pkg.__path__ = [str(PLUGINS_DIR)]  # type: ignore[attr-defined]
    pkg.__file__ = str(PLUGINS_DIR / "__init__.py")
    sys.modules["optfuse_plugins"] = pkg


def plugin_module(folder: str, module: str) -> types.ModuleType:
    """Import ``plugins/<folder>/<module>.py`` (e.g. ``reference``, ``launch``)."""
    _ensure_plugins_package()
    return importlib.import_module(f"optfuse_plugins.{folder}.{module}")


def script_module(name: str) -> types.ModuleType:
    """Import ``scripts/<name>.py`` of a source checkout (benchmark and profiling scripts, used by
    each other and by tests; the folder is not a package), once per process."""
    key = f"_optfuse_script_{name}"
    mod = sys.modules.get(key)
    if mod is None:
        path = SCRIPTS_DIR / f"{name}.py"
        spec = importlib.util.spec_from_file_location(key, path)
        if spec is None or spec.loader is None or not path.is_file():
            raise ImportError(f"no script {path}")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod  # dataclasses look their module up there
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules[key]
            raise
    return mod
