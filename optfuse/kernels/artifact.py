"""What to compile (:class:`KernelSource`), what comes out (:class:`KernelArtifact`) and how
to launch it (:class:`LaunchParams`).

The argument order of every kernel is TensorRT QDP's (``aot_impl``): input pointers, then the
int32 extra arguments, then output pointers, then -- Triton >= 3.3 only -- the trailing scratch
pointers Triton appends (:attr:`KernelArtifact.n_scratch`). A CUDA kernel that only the launcher
runs (not QDP) may take tensor maps after the outputs (:class:`TensorMapArg`), which the launcher
encodes from the pointers and extra arguments of each launch.

An op whose work takes more than one kernel is a :class:`LaunchPlan`: its steps in launch order,
each naming the buffers its kernel reads and writes (:class:`Buffer`: an op input, an op output,
or a byte offset into the op's workspace), and the workspace size in bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

#: Bumped whenever the artifact layout or the argument convention changes (part of the cache key).
ABI_VERSION = 1


_LOCAL_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*(?://.*)?$', re.M)


def _inline_local_includes(path: Path, stack: tuple[Path, ...], seen: set[Path] | None = None) -> str:
    """``path``'s text with every ``#include "file"`` (relative to the including file) replaced by
    that file's text, recursively; each file is inlined once per translation unit (``seen``,
    shared by the whole recursion: an include guard for free)."""
    path = path.resolve()
    if path in stack:
        raise ValueError(f"{path}: #include cycle through {' -> '.join(p.name for p in stack)}")
    seen = set() if seen is None else seen

    def expand(m: re.Match) -> str:
        inc = (path.parent / m.group(1)).resolve()
        if not inc.is_file():
            raise FileNotFoundError(f"{path}: #include \"{m.group(1)}\" not found ({inc})")
        if inc in seen:
            return f"// {m.group(1)}: already included"
        seen.add(inc)
        body = _inline_local_includes(inc, stack + (path,), seen)
        return f"// ---- {m.group(1)} ----\n{body}// ---- end {m.group(1)} ----"

    return _LOCAL_INCLUDE.sub(expand, path.read_text())


#: Element types a :class:`TensorMapArg` can name, with their sizes in bytes.
TENSOR_MAP_DTYPES = {"float16": 2, "bfloat16": 2, "uint8": 1}


#: A tensor-map extent: a product of factors, each a number or ``extra:<i>`` (the launch's int32 extra
#: argument i), e.g. ``"extra:2"`` (Sq) or ``"extra:5*extra:0"`` (B * H).
_EXTENT = re.compile(r"(?:extra:\d+|\d+)(?:\*(?:extra:\d+|\d+))*")


def tensor_map_extent(value: int | str, extra: Any) -> int:
    """The value of a :class:`TensorMapArg` extent (an int, or a product over ``extra``, the
    launch's int32 extra arguments)."""
    if isinstance(value, int):
        return value
    out = 1
    for factor in value.split("*"):
        out *= int(extra[int(factor[6:])]) if factor.startswith("extra:") else int(factor)
    return out


@dataclass(frozen=True)
class TensorMapArg:
    """A ``__grid_constant__`` CUtensorMap parameter that the launcher encodes
    (cuTensorMapEncodeTiled) at each launch: pointer argument ``pointer`` (an index into the
    inputs, then the outputs) is a row-major ``rows x cols`` matrix of ``dtype`` (rows
    ``row_align`` bytes apart: cols' bytes rounded up to it), read in boxes of ``box_rows x
    box_cols`` (128-byte swizzle, zeros past the edges). ``rows``, ``cols`` and ``heads`` are ints or
    products over the launch's extra args (:func:`tensor_map_extent`: ``"extra:5*extra:0"``).
    ``heads``: ``heads`` such matrices one after the other, the map's third dimension (box 1).
    ``pair``: a second pointer argument of the same shape; the map covers both as one
    ``[2, rows, cols]`` tensor from the lower address, whose third stride is the distance between
    them (the kernel picks the matrix by the same order)."""

    pointer: int
    dtype: str
    rows: int | str
    cols: int | str
    box_rows: int
    box_cols: int
    pair: int | None = None
    heads: int | str | None = None
    row_align: int = 1

    def __post_init__(self) -> None:
        if self.dtype not in TENSOR_MAP_DTYPES:
            raise ValueError(f"tensor map of {self.dtype}: one of {sorted(TENSOR_MAP_DTYPES)}")
        for what in ("rows", "cols", "heads"):
            v = getattr(self, what)
            if isinstance(v, str) and not _EXTENT.fullmatch(v):
                raise ValueError(f"tensor map {what} {v!r}: an int or a product of ints and 'extra:<index>'")
        if self.box_cols * TENSOR_MAP_DTYPES[self.dtype] != 128:
            raise ValueError(f"tensor map box of {self.box_cols} columns: one 128-byte swizzle row")
        if self.pair is not None and self.heads is not None:
            raise ValueError("tensor map: a pair or heads, not both (each is the third dimension)")
        if self.row_align < 1:
            raise ValueError(f"tensor map row_align {self.row_align}: >= 1")

    def spec(self) -> dict[str, Any]:
        """The fields as an artifact keeps them (and the cache key hashes them): heads and
        row_align only where set, so maps without them keep their keys."""
        d = asdict(self)
        if self.heads is None:
            del d["heads"]
        if self.row_align == 1:
            del d["row_align"]
        return d


@dataclass
class KernelSource:
    """One specialization of one kernel: everything a compiler needs, nothing device-specific.

    ``lang="triton"``: ``entry`` is a ``@triton.jit`` function defined in ``path``;
    ``signature`` lists its runtime parameters in order (name -> Triton type such as ``*fp16`` or
    ``i32``) and ``constexprs`` its compile-time ones. ``lang="cuda"``: ``entry`` is an
    ``extern "C"`` ``__global__`` function in ``path``, specialized by the ``-D`` ``defines``.
    """

    name: str  # logical id, e.g. "layer_norm/LayerNorm/float16/h768"
    lang: str  # "triton" | "cuda"
    path: str
    entry: str
    n_inputs: int
    n_extra: int
    n_outputs: int
    signature: dict[str, str] = field(default_factory=dict)  # triton
    constexprs: dict[str, Any] = field(default_factory=dict)  # triton
    defines: dict[str, str] = field(default_factory=dict)  # cuda
    num_warps: int = 4  # triton
    num_stages: int = 1  # triton
    threads: int = 0  # cuda: threads per block
    #: Byte alignment every pointer argument must have (the kernel is compiled assuming it).
    pointer_align: int = 16
    #: Free-form description (op, dtype, hidden, config); stored in the artifact.
    meta: dict[str, Any] = field(default_factory=dict)
    #: cuda: ``"a"`` compiles for the arch-specific target (``sm_90a``: wgmma, setmaxnreg), whose
    #: code runs on that exact compute capability only.
    arch_suffix: str = ""
    #: cuda: tensor-map parameters after the outputs, which the launcher encodes (not QDP).
    tensor_maps: tuple[TensorMapArg, ...] = ()

    def __post_init__(self) -> None:
        if self.lang not in ("triton", "cuda"):
            raise ValueError(f"unknown kernel language {self.lang!r}")
        if self.tensor_maps and self.lang != "cuda":
            raise ValueError(f"{self.name}: tensor-map parameters are for CUDA kernels")
        if self.arch_suffix not in ("", "a") or (self.arch_suffix and self.lang != "cuda"):
            raise ValueError(f"{self.name}: arch_suffix {self.arch_suffix!r} (only 'a', CUDA kernels)")

    def source_text(self) -> str:
        """The text the compiler gets, and the cache key hashes. CUDA sources may ``#include
        "relative/path"`` files of the project (shared helpers, e.g. plugins/common/): those are
        inlined here, so NVRTC needs no include paths and a change to a helper changes the key."""
        path = Path(self.path)
        return _inline_local_includes(path, ()) if self.lang == "cuda" else path.read_text()

    def spec_dict(self) -> dict[str, Any]:
        """Everything that decides the compiled code, except the compiler and the arch."""
        return {
            "lang": self.lang,
            "entry": self.entry,
            "source_sha256": hashlib.sha256(self.source_text().encode()).hexdigest(),
            "signature": list(self.signature.items()),
            "constexprs": sorted((k, repr(v)) for k, v in self.constexprs.items()),
            "defines": sorted(self.defines.items()),
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
            "threads": self.threads,
            "io": [self.n_inputs, self.n_extra, self.n_outputs],
            "pointer_align": self.pointer_align,
            "arch_suffix": self.arch_suffix,
            "abi": ABI_VERSION,
            # only where present: every other kernel keeps its cache key
            **({"tensor_maps": [t.spec() for t in self.tensor_maps]} if self.tensor_maps else {}),
        }


@dataclass
class LaunchParams:
    """Grid/block/shared memory and the int32 extra arguments of one launch.

    Fields may hold ints (launcher, tests) or TensorRT symbolic expressions (QDP ``aot_impl``).
    """

    grid: tuple[Any, Any, Any]
    block: tuple[Any, Any, Any]
    shared_mem: Any = 0
    extra_args: list[Any] = field(default_factory=list)


@dataclass
class KernelArtifact:
    """A compiled kernel: cubin for one arch plus the PTX of the same compile."""

    name: str  # entry symbol in the cubin/PTX (unmangled)
    arch: int
    cubin: bytes | None
    ptx: str | None
    threads: int  # threads per block the kernel was compiled for
    shared_mem: int  # dynamic shared memory bytes (Triton: metadata.shared)
    n_inputs: int
    n_extra: int
    n_outputs: int
    n_scratch: int = 0  # trailing scratch pointer params (Triton >= 3.3: 2)
    pointer_align: int = 16
    key: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    arch_suffix: str = ""  # "a": sm_90a code, runs on compute capability 9.0 only
    #: tensor-map parameters after the outputs (KernelSource.tensor_maps), as dicts of TensorMapArg's fields
    tensor_maps: list[dict[str, Any]] = field(default_factory=list)

    @property
    def n_params(self) -> int:
        return self.n_inputs + self.n_extra + self.n_outputs + len(self.tensor_maps) + self.n_scratch

    @cached_property
    def tensor_map_args(self) -> tuple[TensorMapArg, ...]:
        """``tensor_maps`` as TensorMapArg, checked once per artifact rather than at every launch."""
        return tuple(TensorMapArg(**t) for t in self.tensor_maps)

    # -- on-disk form: <dir>/meta.json, <dir>/kernel.cubin, <dir>/kernel.ptx -----------------
    def save(self, directory: str | os.PathLike) -> Path:
        """Write atomically (a temp dir renamed into place); returns the directory."""
        directory = Path(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=directory.parent))
        try:
            meta = asdict(self)
            meta.pop("cubin")
            meta.pop("ptx")
            meta["has_cubin"] = self.cubin is not None
            meta["has_ptx"] = self.ptx is not None
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True, default=str))
            if self.cubin is not None:
                (tmp / "kernel.cubin").write_bytes(self.cubin)
            if self.ptx is not None:
                (tmp / "kernel.ptx").write_text(self.ptx)
            try:
                os.replace(tmp, directory)
            except OSError:
                # Another process saved the same key first (non-empty target): keep theirs.
                if not (directory / "meta.json").exists():
                    shutil.rmtree(directory, ignore_errors=True)
                    os.replace(tmp, directory)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return directory

    @classmethod
    def load(cls, directory: str | os.PathLike) -> KernelArtifact:
        directory = Path(directory)
        meta = json.loads((directory / "meta.json").read_text())
        has_cubin = meta.pop("has_cubin", False)
        has_ptx = meta.pop("has_ptx", False)
        cubin = (directory / "kernel.cubin").read_bytes() if has_cubin else None
        ptx = (directory / "kernel.ptx").read_text() if has_ptx else None
        return cls(cubin=cubin, ptx=ptx, **meta)


#: What a plan step's pointer argument is: the op's input ``index`` (spec order; an absent
#: optional input is a null pointer), its output ``index``, the workspace at byte ``index``, or the
#: op instance's state at byte ``index``.
BUFFER_KINDS = ("input", "output", "workspace", "state")


@dataclass(frozen=True)
class Buffer:
    """One pointer argument of a plan step (see :data:`BUFFER_KINDS`)."""

    kind: str
    index: int

    def __post_init__(self) -> None:
        if self.kind not in BUFFER_KINDS:
            raise ValueError(f"buffer kind {self.kind!r} is not one of {BUFFER_KINDS}")


@dataclass
class PlanStep:
    """One launch of a plan: what to compile, how to launch it, which buffers its pointer
    arguments are (``inputs`` then ``outputs``, in the kernel's argument order). ``artifact`` is
    filled in once the source is built (``optfuse.trt.glue.resolve_plan``)."""

    source: KernelSource
    params: LaunchParams
    inputs: list[Buffer]
    outputs: list[Buffer]
    artifact: KernelArtifact | None = None


@dataclass
class LaunchPlan:
    """The launches of one op instance, in order, on one stream, and the memory they share:

    * ``workspace_bytes`` (an int, or an expression over the shapes) of scratch memory, 256-byte
      aligned, that the caller provides and that no step expects to find initialized;
    * ``state_bytes`` of memory the op instance keeps from launch to launch: zeroed once when it
      is allocated, and left zero by every plan when its last step ends (counters that the program
      which reads them last resets), so no launch needs to clear it first. One instance runs one
      plan at a time on it (one stream).
    """

    steps: list[PlanStep]
    workspace_bytes: Any = 0
    state_bytes: Any = 0


def single_step_plan(source: KernelSource, params: LaunchParams, n_outputs: int) -> LaunchPlan:
    """The plan of an op that is one kernel: inputs 0 .. ``source.n_inputs - 1``, every output,
    no workspace."""
    return LaunchPlan([PlanStep(source, params, [Buffer("input", i) for i in range(source.n_inputs)],
                                [Buffer("output", j) for j in range(n_outputs)])])
