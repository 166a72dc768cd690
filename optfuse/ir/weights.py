"""Weights left on disk: big models are fused without their external data in memory.

A model loaded with ``load_model(path, weights="disk")`` keeps every external tensor above
``SMALL_TENSOR_BYTES`` as a reference into its data file (location relative to the model's
folder, ``weights_dir``); the small ones (epsilons, shapes, axes, norm weights) are read in.
In a graphsurgeon graph those references become :class:`DiskValues`: reading a constant's values
memory-maps just that tensor (read-only), and :func:`export_graph` hands graphsurgeon the
original reference again for every constant whose values were read but not replaced, so an
export copies no weight bytes. :func:`write_tensors` writes a model's initializers into one
external data file by streaming them (file-to-file copies, one tensor at a time).

A rewrite that derives a new constant from on-disk ones (a GEMM's weight transposed to [N, K], or
sibling weights concatenated) gives it as :class:`DerivedValues`: nothing is computed until the
graph is exported, and :func:`export_graph` then computes one such tensor at a time into a
scratch data file (removed when the process exits), so the derived weights are never all in memory.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx.external_data_helper import ExternalDataInfo, uses_external_data

#: External tensors up to this size are read into memory at load time (pattern constants, shapes).
SMALL_TENSOR_BYTES = 64 << 10
#: Tensors of at least this size start at a page boundary in a written data file (onnxruntime
#: memory-maps aligned external data instead of copying it).
_ALIGN_FROM = 64 << 10
_PAGE = 4096
_CHUNK = 64 << 20
#: Types whose bytes are not one NumPy element each (strings; 4-bit and 2-bit packed types).
_NOT_MAPPABLE = {getattr(onnx.TensorProto, n) for n in ("STRING", "INT4", "UINT4", "FLOAT4E2M1", "INT2", "UINT2")
                 if hasattr(onnx.TensorProto, n)}


class DiskValues(gs.ir.tensor.LazyValues):
    """A constant's values in an external data file, read only when asked for (memory-mapped)."""

    def __init__(self, tensor: onnx.TensorProto, weights_dir: str | os.PathLike):
        super().__init__(tensor)
        self.weights_dir = Path(weights_dir)

    def load(self) -> np.ndarray:
        info = ExternalDataInfo(self.tensor)
        dtype = onnx.helper.tensor_dtype_to_np_dtype(self.tensor.data_type)
        path = self.weights_dir / info.location
        if self.tensor.data_type in _NOT_MAPPABLE or dtype.itemsize * int(np.prod(self.shape)) == 0:
            return np.array(onnx.numpy_helper.to_array(self.tensor, str(self.weights_dir)))
        values = np.memmap(path, dtype=dtype, mode="r", offset=int(info.offset or 0), shape=tuple(self.shape))
        values._optfuse_disk = self  # export_graph gives graphsurgeon the file reference back
        return values


class DerivedValues(gs.ir.tensor.LazyValues):
    """A new constant computed from others only when needed: ``np.concatenate([f(v) for v in
    parts], axis=0)`` cast to ``dtype``, where each part is (values, transpose) and values are an
    array or a source still on disk (DiskValues: mapped only while this is computed). Shape and
    dtype are known without computing."""

    def __init__(self, parts: list[tuple[np.ndarray, bool]], dtype: np.dtype):
        shapes = [tuple(v.shape[::-1]) if t else tuple(v.shape) for v, t in parts]
        shape = (sum(sh[0] for sh in shapes), *shapes[0][1:]) if len(shapes) > 1 else shapes[0]
        header = onnx.TensorProto()
        header.dims.extend(int(d) for d in shape)
        header.data_type = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        super().__init__(header)
        self.parts = parts
        self.np_dtype = np.dtype(dtype)
        self.spilled: DiskValues | None = None  # where export wrote it (then `parts` is dropped)

    def load(self) -> np.ndarray:
        if self.spilled is not None:  # computed before: read back from the scratch file
            return self.spilled.load()
        sources = [(v.load() if isinstance(v, gs.ir.tensor.LazyValues) else v, t) for v, t in self.parts]
        arrays = [(v.T if t else v) for v, t in sources]
        out = np.concatenate(arrays, axis=0) if len(arrays) > 1 else arrays[0]
        return np.ascontiguousarray(out.astype(self.np_dtype, copy=False))

    @property
    def on_disk(self) -> bool:
        """Whether any source is a memory-mapped weight (then export writes it to a scratch file)."""
        return any(isinstance(v, DiskValues) or getattr(v, "_optfuse_disk", None) is not None for v, _ in self.parts)


_scratch: list[Path] = []


def _scratch_file() -> Path:
    """A data file for derived weights, removed at exit (one per process)."""
    if not _scratch:
        import atexit
        import shutil
        import tempfile

        d = Path(tempfile.mkdtemp(prefix="optfuse-derived-"))
        atexit.register(shutil.rmtree, d, True)
        _scratch.append(d / "derived.data")
        _scratch[0].touch()
    return _scratch[0]


def _spill(name: str, values: DerivedValues) -> "DiskValues":
    """Compute `values` once and append them to the scratch file; the tensor then lives there."""
    if values.spilled is not None:
        return values.spilled
    path = _scratch_file()
    data = np.ascontiguousarray(values.load())
    shape, nbytes = data.shape, data.nbytes
    with open(path, "r+b", buffering=0) as out:  # not "ab": appends would ignore the alignment seek
        pos = out.seek(0, os.SEEK_END)
        if pos % _PAGE:
            pos = out.seek(pos + _PAGE - pos % _PAGE)
        _write_all(out, memoryview(data.reshape(-1).view(np.uint8)))
    del data
    values.parts = []  # drop the sources' memory maps: their pages count as this process's memory
    t = onnx.TensorProto()
    t.name = name
    t.dims.extend(shape)
    t.data_type = values.tensor.data_type
    _set_external(t, str(path), pos, nbytes)  # an absolute location: write_tensors / read_into resolve it
    values.spilled = DiskValues(t, path.parent)
    return values.spilled


def external_length(tensor: onnx.TensorProto) -> int:
    """Bytes an external tensor takes in its data file."""
    info = ExternalDataInfo(tensor)
    if info.length:
        return int(info.length)
    itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    return int(np.prod(tensor.dims)) * itemsize


def read_small_tensors(model: onnx.ModelProto, weights_dir: str | os.PathLike,
                       limit: int = SMALL_TENSOR_BYTES) -> None:
    """Read the external tensors of at most `limit` bytes into the proto (the rest stay on disk)."""
    from onnx.external_data_helper import _get_all_tensors, load_external_data_for_tensor

    for t in _get_all_tensors(model):
        if uses_external_data(t) and external_length(t) <= limit:
            load_external_data_for_tensor(t, str(weights_dir))


def import_graph(model: onnx.ModelProto, weights_dir: str | os.PathLike | None = None) -> gs.Graph:
    """gs.import_onnx, with the constants still on disk under `weights_dir` as DiskValues."""
    graph = gs.import_onnx(model)
    if weights_dir is not None:
        for g in [graph, *graph.subgraphs(recursive=True)]:
            for t in g.tensors().values():
                lazy = getattr(t, "_values", None)
                if type(lazy) is gs.ir.tensor.LazyValues and uses_external_data(lazy.tensor):
                    t._values = DiskValues(lazy.tensor, weights_dir)
    return graph


def export_graph(graph: gs.Graph, **kwargs) -> onnx.ModelProto:
    """gs.export_onnx without copying weights that are still on disk: a constant whose values were
    read (memory-mapped) but not replaced is exported as its external reference."""
    for g in [graph, *graph.subgraphs(recursive=True)]:
        for t in g.tensors().values():
            values = getattr(t, "_values", None)
            if isinstance(values, DerivedValues):
                if values.on_disk:
                    t._values = _spill(t.name, values)  # computed now, one at a time, into the scratch file
                else:
                    t.values = values.load()
                continue
            disk = getattr(values, "_optfuse_disk", None)
            if disk is not None:
                t._values = disk
    return gs.export_onnx(graph, **kwargs)


def weights_size(tensors: Iterable[onnx.TensorProto]) -> int:
    """Bytes of the tensors' values, in memory or on disk."""
    total = 0
    for t in tensors:
        if uses_external_data(t):
            total += external_length(t)
        elif t.HasField("raw_data"):
            total += len(t.raw_data)
        else:
            total += onnx.numpy_helper.to_array(t).nbytes
    return total


def write_tensors(tensors: Iterable[onnx.TensorProto], data_path: Path, location: str,
                  weights_dir: str | os.PathLike | None, threshold: int = 1024) -> None:
    """Move each tensor of at least `threshold` bytes into the file `data_path` (the tensor then
    refers to it as `location`): in-memory bytes are written out and dropped, external ones are
    copied from their file under `weights_dir` without passing through memory."""
    with open(data_path, "wb", buffering=0) as out:
        for t in tensors:
            size = weights_size([t])
            if size < threshold:
                continue
            pos = out.seek(0, os.SEEK_END)
            if size >= _ALIGN_FROM and pos % _PAGE:
                pos = out.seek(pos + _PAGE - pos % _PAGE)  # a hole up to the boundary
            if uses_external_data(t):
                info = ExternalDataInfo(t)
                if weights_dir is None and not Path(info.location).is_absolute():
                    raise ValueError(f"tensor {t.name!r} is on disk but no weights_dir was given")
                _copy_range(Path(weights_dir or "/") / info.location, int(info.offset or 0), size, out)
            else:
                _write_all(out, t.raw_data if t.HasField("raw_data") else onnx.numpy_helper.to_array(t).tobytes())
                _clear_values(t)
            _set_external(t, location, pos, size)


def read_into(tensor: onnx.TensorProto, weights_dir: str | os.PathLike | None) -> None:
    """Give an external tensor its bytes (raw_data) back from `weights_dir` (or from its absolute
    location: a derived weight's scratch file)."""
    info = ExternalDataInfo(tensor)
    if Path(info.location).is_absolute():
        with open(info.location, "rb") as f:
            f.seek(int(info.offset or 0))
            data = f.read(external_length(tensor))
        del tensor.external_data[:]
        tensor.data_location = onnx.TensorProto.DEFAULT
        tensor.raw_data = data
        return
    if weights_dir is None:
        raise ValueError(f"tensor {tensor.name!r} is on disk but no weights_dir was given")
    from onnx.external_data_helper import load_external_data_for_tensor

    load_external_data_for_tensor(tensor, str(weights_dir))


def _copy_range(src: Path, offset: int, length: int, out) -> None:
    """Append `length` bytes of `src` from `offset` to the unbuffered file `out` (kernel-side copy
    where the filesystems allow it, else bounded chunks)."""
    with open(src, "rb", buffering=0) as f:
        left = length
        if hasattr(os, "copy_file_range"):
            try:
                while left:
                    n = os.copy_file_range(f.fileno(), out.fileno(), min(left, _CHUNK), offset + length - left)
                    if n == 0:
                        raise OSError(f"{src} ends before the data of a tensor does")
                    left -= n
            except OSError:
                if left != length:
                    raise
        f.seek(offset + length - left)
        while left:
            chunk = f.read(min(left, _CHUNK))
            if not chunk:
                raise OSError(f"{src} ends before the data of a tensor does")
            _write_all(out, chunk)
            left -= len(chunk)


def _write_all(out, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[out.write(view):]


def _clear_values(t: onnx.TensorProto) -> None:
    for name in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data"):
        t.ClearField(name)


def _set_external(t: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    del t.external_data[:]
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    t.data_location = onnx.TensorProto.EXTERNAL
