"""One import point for TensorRT: standard TensorRT (``tensorrt`` 10.x/11.x) or TensorRT-RTX.

``load(backend)`` returns a :class:`Backend` -- the module plus what it can do -- so the rest of
optfuse asks capabilities (``has_qdp_aot``, ``has_add_plugin_v3``...) instead of comparing version
strings. ``backend="auto"`` prefers ``tensorrt`` when it is installed, else ``tensorrt_rtx``
(``$OPTFUSE_TRT_BACKEND`` overrides the default).

TensorRT-RTX 1.7 packaging bug, handled here and not by the user: when the ONNX parser meets a
node that maps to a plugin creator it ``dlopen``s the unversioned ``libtensorrt_rtx.so``, which
the ``tensorrt_rtx_libs`` wheel does not ship (it ships ``libtensorrt_rtx.so.1``); the process
then aborts (``terminate called without an active exception``). :func:`ensure_rtx_parser_lib`
adds the missing symlink inside ``tensorrt_rtx_libs/`` -- the parser's RPATH is ``$ORIGIN``, so
that fixes it for this and every later process. When that directory is read-only it creates the
symlink in a cache directory instead; that only helps processes started with the directory on
``LD_LIBRARY_PATH`` (the loader reads it once, at process start), so :func:`child_env` returns
such an environment and engine builds run in a child process (see ``optfuse.trt.build``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from ..errors import BuildError, InputError

BACKENDS = ("tensorrt", "tensorrt_rtx")
#: CLI spellings accepted for each backend.
ALIASES = {
    "auto": "auto",
    "trt": "tensorrt",
    "tensorrt": "tensorrt",
    "rtx": "tensorrt_rtx",
    "tensorrt-rtx": "tensorrt_rtx",
    "tensorrt_rtx": "tensorrt_rtx",
    "trt-rtx": "tensorrt_rtx",
}
RTX_LIB = "libtensorrt_rtx.so"
#: First TensorRT release with ahead-of-time Python plugins (QDP ``aot_impl``).
QDP_AOT_MIN = (10, 9)


def normalize_backend(name: str | None) -> str:
    """``"rtx"`` -> ``"tensorrt_rtx"``...; ``None`` -> ``$OPTFUSE_TRT_BACKEND`` or ``"auto"``."""
    raw = (name or os.environ.get("OPTFUSE_TRT_BACKEND") or "auto").strip().lower()
    try:
        return ALIASES[raw]
    except KeyError:
        raise InputError(f"unknown TensorRT backend {name!r}; use one of: auto, tensorrt, tensorrt_rtx") from None


def installed_backends() -> list[str]:
    """Backends whose Python package is importable (found without importing it)."""
    return [b for b in BACKENDS if importlib.util.find_spec(b) is not None]


def resolve_backend(name: str | None = None) -> str | None:
    """The concrete backend ``name`` stands for, or None when auto finds nothing installed."""
    want = normalize_backend(name)
    have = installed_backends()
    if want == "auto":
        return have[0] if have else None
    return want


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


@dataclass(frozen=True)
class Backend:
    name: str  # "tensorrt" | "tensorrt_rtx"
    trt: ModuleType = field(repr=False)
    version: str
    is_rtx: bool
    #: ``tensorrt.plugin`` with ``aot_impl`` and the QDP AOT classes (TensorRT >= 10.9).
    has_qdp_aot: bool
    #: ``INetworkDefinition.add_plugin_v3`` (absent in TensorRT-RTX).
    has_add_plugin_v3: bool
    #: Python IPluginV3 + IPluginCreatorV3One classes.
    has_plugin_v3: bool
    #: ``BuilderFlag.FP16`` still exists (TensorRT 10; gone in 11 and RTX: strong typing only).
    has_fp16_flag: bool
    has_strongly_typed_flag: bool
    #: RTX: compute capabilities an engine can target (``ComputeCapability.SMxx``).
    compute_capabilities: tuple[int, ...] = ()

    @property
    def version_tuple(self) -> tuple[int, ...]:
        return _version_tuple(self.version)

    @property
    def plugin_mode(self) -> str:
        """How optfuse ops become plugins here: ``"qdp"`` (AOT, no Python at run time) or
        ``"python"`` (classic IPluginV3 whose enqueue calls the launcher)."""
        return "qdp" if self.has_qdp_aot else "python"

    @property
    def label(self) -> str:
        return f"{'TensorRT-RTX' if self.is_rtx else 'TensorRT'} {self.version}"

    def capabilities(self) -> dict:
        return {
            "backend": self.name,
            "version": self.version,
            "is_rtx": self.is_rtx,
            "plugin_mode": self.plugin_mode,
            "has_qdp_aot": self.has_qdp_aot,
            "has_add_plugin_v3": self.has_add_plugin_v3,
            "has_plugin_v3": self.has_plugin_v3,
            "has_fp16_flag": self.has_fp16_flag,
            "has_strongly_typed_flag": self.has_strongly_typed_flag,
            "compute_capabilities": list(self.compute_capabilities),
        }


def _qdp_aot_available(trt: ModuleType, version: tuple[int, ...], is_rtx: bool) -> bool:
    if is_rtx or version[:2] < QDP_AOT_MIN:
        return False
    # The bindings must carry the AOT classes; the tensorrt.plugin package must import.
    if not all(hasattr(trt, n) for n in ("IPluginV3QuickAOTBuild", "QuickPluginCreationRequest", "ISymExpr")):
        return False
    try:
        trtp = importlib.import_module(f"{trt.__name__}.plugin")
    except Exception:
        return False
    return all(hasattr(trtp, n) for n in ("register", "aot_impl", "autotune", "KernelLaunchParams", "SymIntExprs"))


@functools.cache
def load(backend: str | None = None) -> Backend:
    """Import a TensorRT backend (``auto``, ``tensorrt`` or ``tensorrt_rtx``).

    Raises :class:`InputError` (exit 2) when the requested backend is not installed.
    """
    name = resolve_backend(backend)
    if name is None:
        raise InputError(
            "no TensorRT backend is installed: install `tensorrt` (10.x/11.x, needs a GPU to build) "
            "or `tensorrt-rtx` (builds on CPU): pip install 'optfuse[trt-rtx]'"
        )
    if name == "tensorrt_rtx":
        ensure_rtx_parser_lib()
    try:
        trt = importlib.import_module(name)
    except ImportError as exc:
        raise InputError(f"TensorRT backend {name!r} is not importable: {exc}") from exc
    version = str(getattr(trt, "__version__", "0"))
    is_rtx = name == "tensorrt_rtx"
    vt = _version_tuple(version)
    caps: tuple[int, ...] = ()
    if is_rtx and hasattr(trt, "ComputeCapability"):
        caps = tuple(sorted(int(m[2:]) for m in trt.ComputeCapability.__members__ if re.fullmatch(r"SM\d+", m)))
    return Backend(
        name=name,
        trt=trt,
        version=version,
        is_rtx=is_rtx,
        has_qdp_aot=_qdp_aot_available(trt, vt, is_rtx),
        has_add_plugin_v3=hasattr(trt.INetworkDefinition, "add_plugin_v3"),
        has_plugin_v3=all(hasattr(trt, n) for n in ("IPluginV3", "IPluginV3OneCore", "IPluginCreatorV3One")),
        has_fp16_flag=hasattr(trt.BuilderFlag, "FP16"),
        has_strongly_typed_flag=hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"),
        compute_capabilities=caps,
    )


# --- TensorRT-RTX: the unversioned library name the ONNX parser dlopens ----------------------

def _rtx_libs_dir() -> Path | None:
    spec = importlib.util.find_spec("tensorrt_rtx_libs")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def rtx_cache_lib_dir() -> Path:
    root = os.environ.get("OPTFUSE_CACHE")
    base = Path(root).parent if root else Path.home() / ".cache" / "optfuse"
    return base / "trt_rtx_lib"


def _make_link(directory: Path, target: Path) -> Path | None:
    link = directory / RTX_LIB
    try:
        if link.is_symlink() or link.exists():
            if link.resolve() == target.resolve():
                return link
            link.unlink()
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{RTX_LIB}.{os.getpid()}"
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        tmp.symlink_to(target.name if target.parent == directory else target)
        os.replace(tmp, link)  # atomic: concurrent processes never see a half-made link
        return link
    except OSError:
        return None


@functools.cache
def ensure_rtx_parser_lib() -> dict:
    """Make ``libtensorrt_rtx.so`` resolvable by the TensorRT-RTX ONNX parser.

    Returns ``{"where": "package"|"cache"|"present"|"absent", "path": str, "needs_env": bool}``;
    ``needs_env`` is True when only a child process started with :func:`child_env` can find it.
    """
    libs = _rtx_libs_dir()
    if libs is None:
        return {"where": "absent", "path": "", "needs_env": False}
    link = libs / RTX_LIB
    if link.exists():
        return {"where": "present", "path": str(link), "needs_env": False}
    versioned = sorted(libs.glob(f"{RTX_LIB}.*"))
    if not versioned:
        return {"where": "absent", "path": "", "needs_env": False}
    target = versioned[0]
    made = _make_link(libs, target) if os.access(libs, os.W_OK) else None
    if made is not None:
        return {"where": "package", "path": str(made), "needs_env": False}
    made = _make_link(rtx_cache_lib_dir(), target)
    if made is None:
        raise BuildError(
            f"TensorRT-RTX ships no {RTX_LIB} (only {target.name}) and neither {libs} nor "
            f"{rtx_cache_lib_dir()} is writable; create the symlink {libs / RTX_LIB} -> {target.name}"
        )
    on_path = str(made.parent) in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep)
    return {"where": "cache", "path": str(made), "needs_env": not on_path}


def child_env(env: dict | None = None) -> dict:
    """Environment for a child process that builds engines (LD_LIBRARY_PATH fix when needed)."""
    env = dict(os.environ if env is None else env)
    if importlib.util.find_spec("tensorrt_rtx_libs") is not None:
        info = ensure_rtx_parser_lib()
        if info["where"] == "cache":
            d = str(Path(info["path"]).parent)
            parts = [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
            if d not in parts:
                env["LD_LIBRARY_PATH"] = os.pathsep.join([d, *parts])
    return env


# --- targets ------------------------------------------------------------------------------------

def check_target(be: Backend, arch: int | None) -> None:
    """Raise InputError (exit 2) when ``arch`` cannot be a target of this backend: the rule of
    :func:`optfuse.target.target_problem`, with the arch list an installed TensorRT-RTX reports."""
    from ..target import target_problem

    if arch is None:
        return
    archs = be.compute_capabilities if be.is_rtx and be.compute_capabilities else None
    problem = target_problem(be.name, arch, archs)
    if problem:
        raise InputError(problem)
