"""The on-disk export cache (tests, recipes): one folder per request, reused when present.

A folder ``<family>-<exporter>-<attn>[-opset<N>]-<key>`` under :func:`default_cache_dir` holds one
export (model and sidecars) or its failure (``failed.txt``, raised again as
:class:`~optfuse.models.record.ExportError`). The key covers the request, the torch /
transformers / onnx / onnxscript versions and the source of this package, so any change to how
models are built or exported makes a new entry.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from .exporting import default_stem, export_model, versions
from .families import ATTNS, EXPORTERS, Attn, Exporter, check_choice, get_family
from .record import ExportedModel, ExportError, load_exported


def default_cache_dir() -> Path:
    """``$OPTFUSE_MODEL_CACHE`` if set, else ``~/.cache/optfuse/models``."""
    env = os.environ.get("OPTFUSE_MODEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "optfuse" / "models"


def cache_disabled() -> bool:
    """``$OPTFUSE_MODEL_CACHE`` set to tmp / 0 / off / no: export afresh, keep nothing (the tests read
    tmp as a cache of their own session)."""
    return os.environ.get("OPTFUSE_MODEL_CACHE", "").lower() in ("tmp", "0", "off", "no")


def cache_key(family: str, exporter: str, attn: str, opset: int | None = None, seed: int = 0,
              past: bool = False, **overrides: Any) -> str:
    """Stable key over the request, the family's definition (what the export reads of it: a family a
    test module registers is not in this package's source), the torch/transformers/onnx/onnxscript
    versions and this package's source."""
    src = _source_digest()
    fam = get_family(family)
    definition = {"config_class": fam.config_class, "model_class": fam.model_class, "defaults": fam.defaults,
                  "inputs": fam.inputs, "call_kwargs": fam.call_kwargs}
    request = {"family": family, "exporter": exporter, "attn": attn, "opset": opset, "seed": seed,
               "overrides": overrides, "definition": definition}
    if past:  # absent when False: the keys of the other exports stay as they were
        request["past"] = True
    blob = json.dumps({**request, "versions": versions(), "src": src},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cached_export(family: str, exporter: Exporter = "dynamo", attn: Attn = "sdpa", opset: int | None = None,
                  cache_dir: os.PathLike | str | None = None, seed: int = 0, past: bool = False,
                  **overrides: Any) -> ExportedModel:
    """:func:`export_model` into ``<cache_dir>/<family>-<exporter>-<attn>[-past]-<key>/``, reused when present.

    Exporter failures are cached too (``failed.txt``) and raised again as :class:`ExportError`.
    Concurrent callers (pytest-xdist) each export into a temp folder and rename it into place.
    """
    get_family(family)
    check_choice("exporter", exporter, EXPORTERS)
    check_choice("attn", attn, ATTNS)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = cache_key(family, exporter, attn, opset, seed, past, **overrides)
    tags = ("-past" if past else "") + ("" if opset is None else f"-opset{opset}")
    final = root / f"{family}-{exporter}-{attn}{tags}-{key}"
    stem = default_stem(family, exporter, attn, opset, past=past)
    found = _from_cache(final, stem, family, exporter, attn)
    if found is not None:
        return found
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        try:
            export_model(family, exporter, attn, tmp, opset, seed=seed, name=stem, past=past, **overrides)
        except ExportError as exc:
            (tmp / "failed.txt").write_text(exc.reason)
            _publish(tmp, final)
            raise
        _publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    found = _from_cache(final, stem, family, exporter, attn)
    assert found is not None, f"cache folder {final} is incomplete"
    return found


def _source_digest() -> str:
    """SHA-256 over the names and bytes of this package's modules."""
    h = hashlib.sha256()
    for p in sorted(Path(__file__).parent.glob("*.py")):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def _from_cache(folder: Path, stem: str, family: str, exporter: str, attn: str) -> ExportedModel | None:
    failed = folder / "failed.txt"
    if failed.is_file():
        raise ExportError(family, exporter, attn, failed.read_text().strip() + f" (cached in {folder})")
    js = folder / f"{stem}.json"
    if js.is_file() and (folder / f"{stem}.onnx").is_file():
        return load_exported(js)
    return None


def _publish(tmp: Path, final: Path) -> None:
    try:
        os.rename(tmp, final)
    except OSError:  # another process got there first (or a stale partial folder: replace it)
        if not ((final / "failed.txt").exists() or any(final.glob("*.json"))):
            shutil.rmtree(final, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.rename(tmp, final)
