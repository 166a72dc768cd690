"""Formatting and writing helpers every report uses: sizes, Markdown cells, JSON of odd values,
atomic writes."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np


def format_bytes(n: int | None) -> str:
    if n is None:
        return "unknown"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{sign}{n} B" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    return f"{sign}{n:.1f} GiB"


def user_mode(mode: int = 0o666) -> int:
    """`mode` under the process umask (what open() would give a new file)."""
    mask = os.umask(0)
    os.umask(mask)
    return mode & ~mask


def atomic_write(path: Path, text: str) -> None:
    """Write `text` to a temp file beside `path`, then rename it into place; the file gets the
    user's umask (mkstemp alone would leave it 0600)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, user_mode())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def names_cell(nodes: list[str], limit: int = 6) -> str:
    shown = ", ".join(f"`{n}`" for n in nodes[:limit])
    more = len(nodes) - limit
    return shown + (f" (+{more} more)" if more > 0 else "")


def short(v: Any) -> str:
    text = json.dumps(v, default=json_default) if not isinstance(v, str) else v
    return text if len(text) <= 60 else text[:57] + "..."


def md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def jsonable(v: Any) -> Any:
    return json.loads(json.dumps(v, default=json_default))


def json_default(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return v.tolist() if v.size <= 64 else f"<array {list(v.shape)} {v.dtype}>"
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, (set, tuple)):
        return list(v)
    if isinstance(v, Path):
        return str(v)
    if hasattr(v, "name") and hasattr(v, "op"):  # a gs.Node
        return v.name or v.op
    if hasattr(v, "name"):  # a gs.Tensor
        return v.name
    return str(v)


def write_json(path: Path, data: Any, indent: int = 1) -> None:
    path.write_text(json.dumps(data, indent=indent, default=str))
