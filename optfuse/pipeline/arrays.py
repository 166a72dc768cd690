"""Input and output arrays on disk, for ``--load-inputs``, ``--save-inputs`` and ``--save-outputs``.

Two formats, chosen by the file's suffix:

- ``.json``: polygraphy's own. Inputs are a JSON list of feed dicts, one per iteration, what
  ``polygraphy run --save-inputs`` writes and ``--load-inputs`` reads; outputs are polygraphy's
  ``RunResults`` (``polygraphy run --save-outputs``; ``polygraphy inspect data`` reads both).
- ``.npz`` (anything else): NumPy. Inputs: one key per input name for one iteration; with several
  iterations the keys are ``<iteration>/<input>`` (``0/input_ids``, ``1/input_ids``, ...).
  Outputs: ``<runner>/<output>`` (runner ``original`` or ``candidate``), with the same
  ``<iteration>/`` prefix when there are several iterations.

Loaded inputs are checked against the model's inputs (names, rank, fixed axes, dtype): a mismatch
is an InputError (exit 2) naming the file, the input and what differs.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx

from ..defaults import value_shape
from ..errors import InputError
from ..report.common import user_mode
from ..verify import Feeds, InputPlan

_ITERATION_KEY = re.compile(r"^(\d+)/(.+)$")


def _is_json(path: Path) -> bool:
    return path.suffix.lower() == ".json"


def load_feeds(paths: Sequence[str | os.PathLike], plans: Sequence[InputPlan], model: onnx.ModelProto) -> Feeds:
    """The feed dicts in `paths` (each file one or more iterations, in order), checked against the
    inputs `model` takes (`plans`: their dtypes)."""
    fixed = {i.name: [(a, d) for a, d in enumerate(value_shape(i) or []) if isinstance(d, int)]
             for i in model.graph.input}
    feeds: Feeds = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise InputError(f"--load-inputs: {path} not found" if not path.exists() else
                             f"--load-inputs: {path} is not a file")
        for i, feed in enumerate(_read_json_feeds(path) if _is_json(path) else _read_npz_feeds(path)):
            feeds.append(_checked_feed(feed, plans, fixed, f"{path}" + (f" (iteration {i})" if i else "")))
    if not feeds:
        raise InputError(f"--load-inputs: {', '.join(map(str, paths))} holds no input data")
    return feeds


def _read_npz_feeds(path: Path) -> list[dict[str, np.ndarray]]:
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except Exception as exc:  # noqa: BLE001 - any unreadable file is bad input
        raise InputError(f"--load-inputs: cannot read {path} as npz: {_first_line(exc)}") from None
    keyed = {k: _ITERATION_KEY.match(k) for k in arrays}
    if arrays and all(keyed.values()):
        per: dict[int, dict[str, np.ndarray]] = {}
        for k, m in keyed.items():
            per.setdefault(int(m.group(1)), {})[m.group(2)] = arrays[k]
        return [per[i] for i in sorted(per)]
    return [arrays]


def _quiet_polygraphy() -> None:
    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.ERROR  # no "[I] Loading input data from ..." lines


def _read_json_feeds(path: Path) -> list[dict[str, np.ndarray]]:
    from polygraphy.json import load_json

    _quiet_polygraphy()
    try:
        data = load_json(str(path), description="input data")
    except Exception as exc:  # noqa: BLE001
        raise InputError(f"--load-inputs: cannot read {path} as polygraphy input data (JSON): "
                         f"{_first_line(exc)}") from None
    if isinstance(data, Mapping):
        data = [data]
    if not isinstance(data, list) or not all(isinstance(d, Mapping) for d in data):
        raise InputError(f"--load-inputs: {path} is not polygraphy input data (a list of name -> array dicts)")
    return [{k: np.asarray(v) for k, v in d.items()} for d in data]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _checked_feed(feed: Mapping[str, np.ndarray], plans: Sequence[InputPlan],
                  fixed: Mapping[str, list[tuple[int, int]]], label: str) -> dict[str, np.ndarray]:
    names = [p.name for p in plans]
    missing = [n for n in names if n not in feed]
    if missing:
        raise InputError(f"--load-inputs: {label} has no array for input {missing[0]!r} "
                         f"(it holds {', '.join(feed) or 'nothing'}; the model's inputs: {', '.join(names)})")
    extra = [k for k in feed if k not in names]
    if extra:
        raise InputError(f"--load-inputs: {label} holds {extra[0]!r}, which is not an input of the model "
                         f"(its inputs: {', '.join(names)})")
    out = {}
    for p in plans:
        arr = np.asarray(feed[p.name])
        if arr.dtype != p.dtype:
            raise InputError(f"--load-inputs: input {p.name!r} in {label} is {arr.dtype.name}, "
                             f"but the model takes {np.dtype(p.dtype).name}")
        if arr.ndim != len(p.shape):
            raise InputError(f"--load-inputs: input {p.name!r} in {label} has shape {list(arr.shape)} "
                             f"(rank {arr.ndim}), but the model's input has rank {len(p.shape)}")
        for axis, size in fixed.get(p.name, []):
            if arr.shape[axis] != size:
                raise InputError(f"--load-inputs: input {p.name!r} in {label}: axis {axis} is {arr.shape[axis]}, "
                                 f"but the model fixes it to {size}")
        out[p.name] = arr
    return out


def save_feeds(path: str | os.PathLike, feeds: Feeds) -> Path:
    """Write the input feeds (one dict per iteration) in the format of `path`'s suffix (module doc)."""
    path = Path(path)
    if _is_json(path):
        from polygraphy.json import save_json

        _quiet_polygraphy()
        return _atomic(path, lambda tmp: save_json(list(feeds), str(tmp), description="input data"))
    arrays = dict(feeds[0]) if len(feeds) == 1 else {f"{i}/{k}": v for i, f in enumerate(feeds) for k, v in f.items()}
    return _atomic(path, lambda tmp: _savez(tmp, arrays))


def save_outputs(path: str | os.PathLike, outputs: Mapping[str, Feeds]) -> Path:
    """Write every runner's outputs (runner -> one dict per iteration) as `path`'s suffix says."""
    path = Path(path)
    if _is_json(path):
        from polygraphy.comparator import IterationResult, RunResults

        _quiet_polygraphy()
        results = RunResults()
        for runner, iters in outputs.items():
            results.append((runner, [IterationResult(outputs=dict(it), runner_name=runner) for it in iters]))
        return _atomic(path, lambda tmp: results.save(str(tmp)))
    many = any(len(iters) > 1 for iters in outputs.values())
    arrays = {(f"{i}/" if many else "") + f"{runner}/{name}": np.asarray(v)
              for runner, iters in outputs.items() for i, it in enumerate(iters) for name, v in it.items()}
    return _atomic(path, lambda tmp: _savez(tmp, arrays))


def _savez(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    with open(path, "wb") as f:  # a file object: np.savez would add ".npz" to a path
        np.savez(f, **arrays)


def _atomic(path: Path, write) -> Path:
    """Write through a temp file beside `path`, then move it into place (a failure leaves no file)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        write(Path(tmp))
        os.chmod(tmp, user_mode(0o666))
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise InputError(f"cannot write {path}: {exc.strerror or exc}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path

