"""Load and save ONNX models, external data included.

Models over 2 GiB cannot be one protobuf, so their weights live in external files. We load
the proto with its external data once; onnx-graphsurgeon wraps initializers as lazy values
that keep pointing at those bytes, so the weights are not copied again on import.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from ..errors import InputError

# protobuf's hard limit is 2 GiB; leave headroom for the graph itself.
_PROTO_LIMIT = 1_900_000_000


def load_model(path: str | os.PathLike) -> onnx.ModelProto:
    """Read an ONNX model and its external data; every failure is an InputError (exit 2)."""
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
        onnx.load_external_data_for_model(model, str(path.parent))
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


def save_model(model: onnx.ModelProto, path: str | os.PathLike, external_data: bool | None = None) -> Path:
    """Write atomically: files are written in a temp folder beside the target and moved into place
    when complete, so a failed save never leaves a half-written model under the final name.

    `external_data=None` decides by size (weights above the protobuf limit go to `<name>.data`).
    The caller's `model` is left as it was (onnx moves weights out of the proto while saving;
    they are read back).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if external_data is None:
        external_data = model_bytes(model) > _PROTO_LIMIT
    data_name = f"{path.name}.data"
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        tmp_model = tmp_dir / path.name
        if external_data:
            onnx.save_model(model, str(tmp_model), save_as_external_data=True, all_tensors_to_one_file=True,
                            location=data_name, size_threshold=1024)
            onnx.load_external_data_for_model(model, str(tmp_dir))  # give the caller its weights back
            os.replace(tmp_dir / data_name, path.parent / data_name)
        else:
            onnx.save_model(model, str(tmp_model))
        os.replace(tmp_model, path)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return path


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
