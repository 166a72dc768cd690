"""``manifest.json`` of a run directory: every output with its size and sha256, and the run's
parameters (command, model, recipe, options, versions of optfuse and the libraries it used)."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from .. import __version__
from .common import atomic_write

MANIFEST = "manifest.json"
_PACKAGES = ("onnx", "onnxruntime", "onnx-graphsurgeon", "polygraphy", "numpy", "tensorrt", "tensorrt-rtx")


def sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def versions() -> dict[str, str]:
    out = {"optfuse": __version__}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The manifest of `directory`, or None when there is none (or it cannot be read)."""
    try:
        data = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def manifest_outputs(data: Mapping[str, Any] | None) -> list[str]:
    """The output file names a manifest lists."""
    if not data:
        return []
    return [o["path"] for o in data.get("outputs", []) if isinstance(o, dict) and isinstance(o.get("path"), str)]


def write_manifest(directory: Path, files: Iterable[Path], *, command: str, parameters: Mapping[str, Any]) -> Path:
    """``manifest.json`` in `directory`: `files` (relative to it) with bytes and sha256, and the parameters."""
    outputs = []
    for f in sorted(files, key=lambda p: p.name):
        outputs.append({"path": f.relative_to(directory).as_posix(), "bytes": f.stat().st_size, "sha256": sha256(f)})
    data = {
        "command": command,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **dict(parameters),
        "versions": versions(),
        "outputs": outputs,
    }
    path = directory / MANIFEST
    atomic_write(path, json.dumps(data, indent=2, default=str) + "\n")
    return path
