"""Kernel configs and launch parameters of the RMSNorm family (CUDA C++ kernels in kernel.cu).

Per op (``RMSNorm``, ``SkipRMSNorm``):

* ``kernel_config(op, dtype, attrs, static_shape)`` -> :class:`KernelSource` (epsilon, hidden and
  the thread layout are ``-D`` defines);
* ``launch_params(op, shapes, dtypes, attrs, cdiv=...)`` -> :class:`LaunchParams`, written with
  ``+ - *`` and ``cdiv`` over the dynamic row count only (TensorRT QDP ``aot_impl`` passes
  symbolic shapes; hidden must be static).

Layout: 16-byte vector accesses (scalar when hidden is not a multiple of 16 bytes); a warp (or
a power-of-two slice of one) per row for small rows, a block per row for large ones; each block
handles ``rpb`` rows (grid = ``cdiv(rows, rpb)``).
FP8 output (``y_scale`` present: ``static_shape['y_scale']``, as :func:`optfuse.trt.glue.static_shape`
gives every present input): the same kernel built with ``-DOPTFUSE_FP8_OUT=1`` (``*_fp8_fwd``
entries), y_scale one more input after gamma, y E4M3 bytes. It needs sm_89 or later (E4M3
conversions): below, kernel_config refuses with a ValueError naming the target.

Argument order: inputs (x, [skip], gamma, [y_scale]), extra (rows), outputs (y, [sum]).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from optfuse.kernels.artifact import KernelSource, LaunchParams
from optfuse.kernels.util import (
    FP8_OUTPUT_MIN_ARCH, ITEMSIZE, as_float32, cdiv as _cdiv, fp8_output, next_pow2, norm_cuda_defines, norm_dtype, rows_of,
    static_int,
)
from optfuse.spec import plugin_specs, shared

KERNEL_PATH = str(Path(__file__).resolve().parent / "kernel.cu")
SPECS = plugin_specs(__file__)
OPS = tuple(SPECS)
DEFAULT_EPSILON = shared(SPECS, lambda s: s.attr("epsilon").default, "the epsilon default")
MIN_HIDDEN = shared(SPECS, lambda s: s.limits["min_hidden"], "min_hidden")
MAX_HIDDEN = shared(SPECS, lambda s: s.limits["max_hidden"], "max_hidden")
DTYPES = shared(SPECS, lambda s: s.inputs[0].dtypes, "the dtypes of x")

FP8_MIN_ARCH = FP8_OUTPUT_MIN_ARCH  # the FP8-output variant's floor (E4M3 conversions)

_ENTRY = {"RMSNorm": "rms_norm_fwd", "SkipRMSNorm": "skip_rms_norm_fwd"}
_FP8_ENTRY = {"RMSNorm": "rms_norm_fp8_fwd", "SkipRMSNorm": "skip_rms_norm_fp8_fwd"}
#: (inputs without the FP8 variant's y_scale, outputs)
_N_IO = {op: (sum(t.name != "y_scale" for t in s.inputs), len(s.outputs)) for op, s in SPECS.items()}


@dataclass(frozen=True)
class RMSConfig:
    vec: int  # elements per access (16 bytes, or 1)
    tpr: int  # threads per row (<= 32: shuffles only; else a block per row)
    rpb: int  # rows per block
    reload: int = 0  # 1: x read again after the reduction (L1+L2 evict_first, Inductor's)

    @property
    def threads(self) -> int:
        return self.tpr * self.rpb

    @property
    def rows_per_block(self) -> int:
        return self.rpb


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"rms_norm plugin has no op {op!r} (ops: {OPS})")


def _vec_nv(dtype: str, hidden: int) -> tuple[int, int]:
    vec = 16 // ITEMSIZE[dtype]
    if hidden % vec:
        vec = 1
    return vec, -(-hidden // vec)


def make_config(dtype: Any, hidden: int, vpt: int, block_threads: int = 256, reload: int = 0) -> RMSConfig:
    """About ``vpt`` accesses (16 bytes, or one element when hidden is not a multiple of 16 bytes)
    per thread: rows of <= 32 threads get a (sub-)warp each, ``block_threads`` threads per block;
    longer rows a block each (at most 1024 threads, more accesses per thread beyond)."""
    dtype = norm_dtype(dtype)
    if not MIN_HIDDEN <= hidden <= MAX_HIDDEN:
        raise ValueError(f"hidden {hidden} outside [{MIN_HIDDEN}, {MAX_HIDDEN}]")
    vec, nv = _vec_nv(dtype, hidden)
    need = -(-nv // vpt)
    if need <= 32:
        tpr = next_pow2(need)
        return RMSConfig(vec, tpr, max(1, block_threads // tpr), reload)
    return RMSConfig(vec, min(1024, -(-need // 32) * 32), 1, reload)


def choose_config(dtype: Any, hidden: int, op: str = "RMSNorm") -> RMSConfig:
    """The default layout, from the H200 sweeps (README "Tried"): rows of <= 32 accesses: one
    access per thread, a (sub-)warp per row, 256 threads; <= 128 accesses: a warp per row (up
    to 4 accesses per thread), 2 rows per block; longer rows: a block per row, 2 accesses per
    thread (at most 1024 threads), one row per block. RMSNorm at hidden 8192 (fp16/bf16): x
    read again after the reduction (RELOAD 1, Inductor's second read), 2-3 % faster than
    holding it in registers."""
    dtype = norm_dtype(dtype)
    if not MIN_HIDDEN <= hidden <= MAX_HIDDEN:
        raise ValueError(f"hidden {hidden} outside [{MIN_HIDDEN}, {MAX_HIDDEN}]")
    _, nv = _vec_nv(dtype, hidden)
    if nv <= 32:
        return make_config(dtype, hidden, 1, 256)
    if nv <= 128:
        return make_config(dtype, hidden, -(-nv // 32), 64)
    if op == "RMSNorm" and hidden == 8192 and dtype in ("float16", "bfloat16"):
        # x read twice (Inductor's form): 32 registers, 4 rows of 512 threads in flight per SM
        return make_config(dtype, hidden, 2, reload=1)
    return make_config(dtype, hidden, 2)


def candidate_configs(dtype: Any, hidden: int, op: str = "RMSNorm") -> list[RMSConfig]:
    """Configs a benchmark sweep may try (the default first): thread layouts and, for long rows,
    the second read of x; the GPU tests run every one."""
    dtype = norm_dtype(dtype)
    _, nv = _vec_nv(dtype, hidden)
    out = [choose_config(dtype, hidden, op)]

    def add(*a, **k):
        c = make_config(dtype, hidden, *a, **k)
        if c not in out:
            out.append(c)

    if nv <= 32:
        add(1, 256)
        add(1, 128)
    if 32 < nv <= 256:  # a warp per row (3-8 accesses a thread), or half a warp (twice the accesses)
        w = -(-nv // 32)
        for bt in (32, 64, 128):
            add(w, bt)
        if nv <= 128:
            add(2 * w, 32)
            add(2 * w, 64)
    if 64 < nv <= 128:  # a block per row, one access per thread
        add(1)
    if nv > 128:  # a block per row
        add(2)
        add(4)
        add(2, reload=1)
        add(4, reload=1)
        add(1)
    return out


def _epsilon(attrs: dict | None) -> float:
    eps = (attrs or {}).get("epsilon", DEFAULT_EPSILON)
    return as_float32(DEFAULT_EPSILON if eps is None else eps)


def config_name(cfg: RMSConfig) -> str:
    """The config in words, e.g. ``vec8_256threads_per_row_1rows_reload``."""
    return f"vec{cfg.vec}_{cfg.tpr}threads_per_row_{cfg.rpb}rows{'_reload' if cfg.reload else ''}"


def kernel_config(
    op: str, dtype: Any, attrs: dict | None, static_shape: dict, config: RMSConfig | None = None
) -> KernelSource:
    """What to compile for ``op`` at ``dtype`` (x's dtype) and ``static_shape['hidden']``; with
    ``static_shape['y_scale']`` (present) the FP8-output variant (:func:`fp8_output`)."""
    _check_op(op)
    dtype = norm_dtype(dtype)
    hidden = static_int(static_shape["hidden"], "hidden")
    cfg = config or choose_config(dtype, hidden, op)
    eps = _epsilon(attrs)
    fp8 = fp8_output(op, static_shape)
    n_in, n_out = _N_IO[op]
    return KernelSource(
        name=f"rms_norm/{op}/{dtype}{'_to_float8e4m3fn' if fp8 else ''}/h{hidden}/eps{eps:g}/{config_name(cfg)}",
        lang="cuda",
        path=KERNEL_PATH,
        entry=(_FP8_ENTRY if fp8 else _ENTRY)[op],
        n_inputs=n_in + fp8,
        n_extra=1,
        n_outputs=n_out,
        defines={
            **norm_cuda_defines(dtype, hidden, eps),
            "VEC": str(cfg.vec),
            "TPR": str(cfg.tpr),
            "RPB": str(cfg.rpb),
            "RELOAD": str(cfg.reload),
            **({"OPTFUSE_FP8_OUT": "1"} if fp8 else {}),
        },
        threads=cfg.threads,
        pointer_align=cfg.vec * ITEMSIZE[dtype],
        meta={"op": op, "dtype": dtype, "hidden": hidden, "epsilon": eps, "config": asdict(cfg),
              **({"y_dtype": "float8e4m3fn"} if fp8 else {})},
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
    return LaunchParams(
        grid=(cdiv(rows, cfg.rows_per_block), 1, 1), block=(cfg.threads, 1, 1), shared_mem=0, extra_args=[rows]
    )


#: Hidden sizes prebuilt by ``optfuse kernels build`` (common transformer widths).
PREBUILD_HIDDEN = (768, 1024, 2048, 4096, 5120, 8192)


def prebuild_sources() -> list[KernelSource]:
    return [
        kernel_config(op, dt, {"epsilon": DEFAULT_EPSILON}, {"hidden": h})
        for op in OPS
        for dt in DTYPES
        for h in PREBUILD_HIDDEN
    ]
