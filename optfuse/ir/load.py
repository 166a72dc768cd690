"""Load and save ONNX models, external data included.

Models over 2 GiB cannot be one protobuf, so their weights live in external files.
``weights="memory"`` reads them in; ``weights="disk"`` leaves every tensor above
``weights.SMALL_TENSOR_BYTES`` in its file (a reference relative to the model's folder, the
``weights_dir`` that :func:`~optfuse.ir.weights.import_graph` and :func:`save_model` take), so a
fuse holds the graph and the small constants only. :func:`save_model` streams the weights into
the new data file (:func:`~optfuse.ir.weights.write_tensors`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from ..errors import InputError
from .weights import read_into, read_small_tensors, weights_size, write_tensors

# protobuf's hard limit is 2 GiB; leave headroom for the graph itself.
_PROTO_LIMIT = 1_900_000_000


def load_model(path: str | os.PathLike, weights: str = "memory") -> onnx.ModelProto:
    """Read an ONNX model and its external data; every failure is an InputError (exit 2).

    weights: ``"memory"`` reads all external data in; ``"disk"`` reads only the small tensors and
    leaves the rest in their files (checked to exist and to be long enough either way).
    """
    if weights not in ("memory", "disk"):
        raise ValueError(f"weights must be 'memory' or 'disk', not {weights!r}")
    path = Path(path)
    if not path.exists():
        raise InputError(f"model not found: {path}")
    if path.is_dir():
        raise InputError(f"model {path} is a directory, not an ONNX file")
    if not path.is_file():
        raise InputError(f"model path is not a file: {path}")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise InputError(f"{path} is not a valid ONNX model (protobuf could not be parsed: {_first_line(exc)})") from None
    except Exception as exc:  # onnx raises assorted errors on truncated files
        raise InputError(f"{path} is not a valid ONNX model ({type(exc).__name__}: {_first_line(exc)})") from None
    if not model.HasField("graph") or not model.opset_import:
        raise InputError(f"{path} is not a valid ONNX model (no graph or no opset_import)")
    _check_external_data(model, path.parent)
    try:
        if weights == "memory":
            onnx.load_external_data_for_model(model, str(path.parent))
        else:
            read_small_tensors(model, path.parent)
    except Exception as exc:
        raise InputError(f"could not read external data of {path}: {_first_line(exc)}") from None
    return model


def _check_external_data(model: onnx.ModelProto, base: Path) -> None:
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    for tensor in _get_all_tensors(model):
        if not uses_external_data(tensor):
            continue
        info = {e.key: e.value for e in tensor.external_data}
        location = base / info.get("location", "")
        if not location.is_file():
            raise InputError(f"missing external data file {location} (needed by tensor {tensor.name!r})")
        offset = int(info.get("offset", 0))
        length = int(info.get("length", 0))
        if offset + length > location.stat().st_size:
            raise InputError(f"external data file {location} is too short for tensor {tensor.name!r}")


def model_bytes(model: onnx.ModelProto) -> int:
    """Size of the initializers in bytes (what decides external-data saving)."""
    from onnx.external_data_helper import _get_all_tensors

    return sum(len(t.raw_data) for t in _get_all_tensors(model))


def save_model(model: onnx.ModelProto, path: str | os.PathLike, external_data: bool | None = None,
               weights_dir: str | os.PathLike | None = None) -> Path:
    """Write atomically: files are written in a temp folder beside the target and moved into place
    when complete, so a failed save never leaves a half-written model under the final name.

    `external_data=None` decides by size (weights above the protobuf limit go to `<name>.data`,
    streamed there one tensor at a time). `weights_dir`: where the tensors that `model` still has
    on disk live (the folder of the model it was loaded from with ``weights="disk"``). The caller's
    `model` is left as it was.
    """
    from onnx.external_data_helper import _get_all_tensors, _get_initializer_tensors, uses_external_data

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = list(_get_all_tensors(model))
    if external_data is None:
        external_data = weights_size(tensors) > _PROTO_LIMIT
    data_name = f"{path.name}.data"
    # how to give the caller its model back: on-disk tensors get their references again,
    # in-memory ones their bytes (read back from the written file)
    before = [(t, [(e.key, e.value) for e in t.external_data] if uses_external_data(t) else None) for t in tensors]
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        tmp_model = tmp_dir / path.name
        if external_data:  # initializers move to the data file (attribute tensors stay, as onnx saves them)
            write_tensors(_get_initializer_tensors(model), tmp_dir / data_name, data_name, weights_dir)
            for t in tensors:
                if uses_external_data(t) and not _in_file(t, data_name):
                    read_into(t, weights_dir)
        else:
            for t in tensors:
                if uses_external_data(t):
                    read_into(t, weights_dir)
        with open(tmp_model, "wb") as f:
            f.write(model.SerializeToString())
        if external_data:
            os.replace(tmp_dir / data_name, path.parent / data_name)
        os.replace(tmp_model, path)
    finally:
        _restore(before, tmp_dir if (tmp_dir / data_name).exists() else path.parent)
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return path


def _in_file(t: onnx.TensorProto, location: str) -> bool:
    return any(e.key == "location" and e.value == location for e in t.external_data)


def _restore(before: list[tuple[onnx.TensorProto, list[tuple[str, str]] | None]], written_dir: Path) -> None:
    from onnx.external_data_helper import uses_external_data

    for t, ext in before:
        if ext is not None:
            t.ClearField("raw_data")
            del t.external_data[:]
            for key, value in ext:
                entry = t.external_data.add()
                entry.key, entry.value = key, value
            t.data_location = onnx.TensorProto.EXTERNAL
        elif uses_external_data(t):
            read_into(t, written_dir)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
