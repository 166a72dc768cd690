"""Kernel configs and launch parameters of the RMSNorm family (CUDA C++ kernels in kernel.cu).

Per op (``RMSNorm``, ``SkipRMSNorm``):

* ``kernel_config(op, dtype, attrs, static_shape)`` -> :class:`KernelSource` (epsilon, hidden and
  the thread layout are ``-D`` defines);
* ``launch_params(op, shapes, dtypes, attrs, cdiv=...)`` -> :class:`LaunchParams`, written with
  ``+ - *`` and ``cdiv`` over the dynamic row count only (TensorRT QDP ``aot_impl`` passes
  symbolic shapes; hidden must be static).

Layout: 16-byte vector accesses (scalar when hidden is not a multiple of 16 bytes); a warp (or
a power-of-two slice of one) per row for small rows, a block per row for large ones.
Argument order: inputs (x, [skip], gamma), extra (rows), outputs (y, [sum]).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from optfuse.kernels.artifact import KernelSource, LaunchParams
from optfuse.kernels.util import ITEMSIZE, cdiv as _cdiv, next_pow2, norm_dtype, rows_of, static_int

KERNEL_PATH = str(Path(__file__).resolve().parent / "kernel.cu")
OPS = ("RMSNorm", "SkipRMSNorm")
DEFAULT_EPSILON = 1e-6
MAX_HIDDEN = 16384
DTYPES = ("float32", "float16", "bfloat16")

_ENTRY = {"RMSNorm": "rms_norm_fwd", "SkipRMSNorm": "skip_rms_norm_fwd"}
_N_IO = {"RMSNorm": (2, 1), "SkipRMSNorm": (3, 2)}
_DTYPE_CODE = {"float32": 0, "float16": 1, "bfloat16": 2}


@dataclass(frozen=True)
class RMSConfig:
    vec: int  # elements per access (16 bytes, or 1)
    tpr: int  # threads per row (<= 32: shuffles only; else a block per row)
    rpb: int  # rows per block

    @property
    def threads(self) -> int:
        return self.tpr * self.rpb


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"rms_norm plugin has no op {op!r} (ops: {OPS})")


def choose_config(
    dtype: Any, hidden: int, op: str = "RMSNorm", *, vpt: int | None = None, block_threads: int = 256
) -> RMSConfig:
    """``vpt`` accesses (16 bytes, or one element when hidden is not a multiple of 16 bytes)
    per thread -- by default 1 for rows of <= 128 accesses, else 2 (from the H200 sweep, README
    "Tuning"); rows of <= 32 threads get a (sub-)warp each, ``block_threads`` threads per block;
    longer rows a block each (at most 1024 threads, more accesses per thread beyond)."""
    dtype = norm_dtype(dtype)
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"hidden {hidden} outside [1, {MAX_HIDDEN}]")
    vec = 16 // ITEMSIZE[dtype]
    if hidden % vec:
        vec = 1
    nv = -(-hidden // vec)
    if vpt is None:
        vpt = 1 if nv <= 128 else 2
    need = -(-nv // vpt)
    if need <= 32:
        tpr = next_pow2(need)
        return RMSConfig(vec, tpr, max(1, block_threads // tpr))
    tpr = min(1024, -(-need // 32) * 32)
    return RMSConfig(vec, tpr, 1)


def candidate_configs(dtype: Any, hidden: int, op: str = "RMSNorm") -> list[RMSConfig]:
    """Configs a benchmark sweep may try (the default first)."""
    out = [choose_config(dtype, hidden, op)]
    for vpt in (1, 2, 3, 4, 8):
        for bt in (128, 256, 512):
            c = choose_config(dtype, hidden, op, vpt=vpt, block_threads=bt)
            if c not in out:
                out.append(c)
    return out


def _epsilon(attrs: dict | None) -> float:
    eps = (attrs or {}).get("epsilon", DEFAULT_EPSILON)
    return float(DEFAULT_EPSILON if eps is None else eps)


def kernel_config(
    op: str, dtype: Any, attrs: dict | None, static_shape: dict, config: RMSConfig | None = None
) -> KernelSource:
    """What to compile for ``op`` at ``dtype`` (x's dtype) and ``static_shape['hidden']``."""
    _check_op(op)
    dtype = norm_dtype(dtype)
    hidden = static_int(static_shape["hidden"], "hidden")
    cfg = config or choose_config(dtype, hidden, op)
    eps = _epsilon(attrs)
    n_in, n_out = _N_IO[op]
    return KernelSource(
        name=f"rms_norm/{op}/{dtype}/h{hidden}/eps{eps:g}/v{cfg.vec}t{cfg.tpr}r{cfg.rpb}",
        lang="cuda",
        path=KERNEL_PATH,
        entry=_ENTRY[op],
        n_inputs=n_in,
        n_extra=1,
        n_outputs=n_out,
        defines={
            "OPTFUSE_DTYPE": str(_DTYPE_CODE[dtype]),
            "HIDDEN": str(hidden),
            "EPS": format(eps, ".9g") + "f",
            "VEC": str(cfg.vec),
            "TPR": str(cfg.tpr),
            "RPB": str(cfg.rpb),
        },
        threads=cfg.threads,
        pointer_align=cfg.vec * ITEMSIZE[dtype],
        meta={"op": op, "dtype": dtype, "hidden": hidden, "epsilon": eps, "config": asdict(cfg)},
    )


def launch_params(
    op: str,
    shapes: Sequence[Sequence[Any]],
    dtypes: Sequence[Any],
    attrs: dict | None,
    cdiv=_cdiv,
    *,
    static_shape: dict | None = None,
    config: RMSConfig | None = None,
) -> LaunchParams:
    """Grid over the (dynamic) rows; ``shapes[0]`` is x's shape ``[..., hidden]``."""
    _check_op(op)
    dtype = norm_dtype(dtypes[0])
    hidden = static_int(static_shape["hidden"] if static_shape else shapes[0][-1], "hidden")
    cfg = config or choose_config(dtype, hidden, op)
    rows = rows_of(shapes[0])
    return LaunchParams(grid=(cdiv(rows, cfg.rpb), 1, 1), block=(cfg.threads, 1, 1), shared_mem=0, extra_args=[rows])


#: Hidden sizes prebuilt by ``optfuse kernels build`` (common transformer widths).
PREBUILD_HIDDEN = (768, 1024, 2048, 4096, 5120, 8192)


def prebuild_sources() -> list[KernelSource]:
    return [
        kernel_config(op, dt, {"epsilon": DEFAULT_EPSILON}, {"hidden": h})
        for op in OPS
        for dt in DTYPES
        for h in PREBUILD_HIDDEN
    ]
