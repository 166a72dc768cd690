"""Kernel configs and launch parameters of the RMSNorm family (CUDA C++ kernels in kernel.cu).

Per op (``RMSNorm``, ``SkipRMSNorm``):

* ``kernel_config(op, dtype, attrs, static_shape)`` -> :class:`KernelSource` (epsilon, hidden and
  the thread layout are ``-D`` defines);
* ``launch_params(op, shapes, dtypes, attrs, cdiv=...)`` -> :class:`LaunchParams`, written with
  ``+ - *`` and ``cdiv`` over the dynamic row count only (TensorRT QDP ``aot_impl`` passes
  symbolic shapes; hidden must be static).

Layout: 16-byte vector accesses (scalar when hidden is not a multiple of 16 bytes); a warp (or
a power-of-two slice of one) per row for small rows, a block per row for large ones; each block
handles ``rpb * iters`` rows (grid = ``cdiv(rows, rpb * iters)``).
Argument order: inputs (x, [skip], gamma), extra (rows), outputs (y, [sum]).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from optfuse.kernels.artifact import KernelSource, LaunchParams
from optfuse.kernels.util import ITEMSIZE, cdiv as _cdiv, next_pow2, norm_cuda_defines, norm_dtype, rows_of, static_int
from optfuse.spec import plugin_specs, shared

KERNEL_PATH = str(Path(__file__).resolve().parent / "kernel.cu")
SPECS = plugin_specs(__file__)
OPS = tuple(SPECS)
DEFAULT_EPSILON = shared(SPECS, lambda s: s.attr("epsilon").default, "the epsilon default")
MIN_HIDDEN = shared(SPECS, lambda s: s.limits["min_hidden"], "min_hidden")
MAX_HIDDEN = shared(SPECS, lambda s: s.limits["max_hidden"], "max_hidden")
DTYPES = shared(SPECS, lambda s: s.inputs[0].dtypes, "the dtypes of x")

_ENTRY = {"RMSNorm": "rms_norm_fwd", "SkipRMSNorm": "skip_rms_norm_fwd"}
_N_IO = {op: (len(s.inputs), len(s.outputs)) for op, s in SPECS.items()}


@dataclass(frozen=True)
class RMSConfig:
    vec: int  # elements per access (16 bytes, or 1)
    tpr: int  # threads per row (<= 32: shuffles only; else a block per row)
    rpb: int  # rows per block at a time
    iters: int = 1  # row groups per block (grid-stride; gamma kept, next group prefetched)
    stcs: bool = False  # streaming stores (st.global.cs)
    glate: bool = False  # gamma loads not tied to before the reduction (ptxas may sink them behind it)
    minb: int = 0  # __launch_bounds__ minimum blocks per SM (0: none): caps the registers
    nc: bool = True  # loads through the read-only path (ld.global.nc); False: plain ld.global
    xpol: int = 0  # x/skip loads with an L2 eviction priority: 0 none, 1 evict_first, 2 evict_last
    ypol: int = 0  # 1: y/sum stores L2 evict_first (and not allocated in L1)
    reload: int = 0  # x read again after the reduction (1: L1+L2 evict_first, Inductor's; 2: plain read-only)

    @property
    def threads(self) -> int:
        return self.tpr * self.rpb

    @property
    def rows_per_block(self) -> int:
        return self.rpb * self.iters


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"rms_norm plugin has no op {op!r} (ops: {OPS})")


def _vec_nv(dtype: str, hidden: int) -> tuple[int, int]:
    vec = 16 // ITEMSIZE[dtype]
    if hidden % vec:
        vec = 1
    return vec, -(-hidden // vec)


def make_config(
    dtype: Any, hidden: int, vpt: int, block_threads: int = 256, iters: int = 1, stcs: bool = False,
    glate: bool = False, full: bool = False, nc: bool = True, xpol: int = 0, ypol: int = 0, reload: int = 0,
) -> RMSConfig:
    """About ``vpt`` accesses (16 bytes, or one element when hidden is not a multiple of 16 bytes)
    per thread: rows of <= 32 threads get a (sub-)warp each, ``block_threads`` threads per block;
    longer rows a block each (at most 1024 threads, more accesses per thread beyond; then one
    row group per block: ``iters`` > 1 would spill). ``full``: registers capped so that 2048
    threads (the SM's limit) stay resident (``minb`` = 2048 / threads)."""
    dtype = norm_dtype(dtype)
    if not MIN_HIDDEN <= hidden <= MAX_HIDDEN:
        raise ValueError(f"hidden {hidden} outside [{MIN_HIDDEN}, {MAX_HIDDEN}]")
    vec, nv = _vec_nv(dtype, hidden)
    need = -(-nv // vpt)
    if need <= 32:
        tpr = next_pow2(need)
        rpb = max(1, block_threads // tpr)
        minb = 2048 // (tpr * rpb) if full else 0
        return RMSConfig(vec, tpr, rpb, iters, stcs, glate, minb, nc, xpol, ypol, reload)
    tpr = min(1024, -(-need // 32) * 32)
    # 1024 threads leave 64 registers a thread: a prefetched second row would spill
    return RMSConfig(vec, tpr, 1, 1 if tpr == 1024 else iters, stcs, glate, 2048 // tpr if full else 0, nc, xpol, ypol,
                     reload)


def choose_config(dtype: Any, hidden: int, op: str = "RMSNorm") -> RMSConfig:
    """The default layout, from the H200 sweeps (README "Tuning"): rows of <= 32 accesses: one
    access per thread, a (sub-)warp per row, 256 threads; <= 128 accesses: a warp per row (up
    to 4 accesses per thread), 2 rows per block; longer rows: a block per row, 2 accesses per
    thread (at most 1024 threads), one row per block. x (and skip) loaded with L1/L2
    evict_last priority (XPOL 2, Inductor's first read of x): 0-4 % faster than plain
    read-only loads at every swept shape, up to 4 % at 4096/8192. RMSNorm at hidden 8192
    (fp16/bf16): x read again after the reduction (RELOAD 1, Inductor's second read), 2-3 %
    faster than holding it in registers (README "Tuning" 6)."""
    dtype = norm_dtype(dtype)
    if not MIN_HIDDEN <= hidden <= MAX_HIDDEN:
        raise ValueError(f"hidden {hidden} outside [{MIN_HIDDEN}, {MAX_HIDDEN}]")
    _, nv = _vec_nv(dtype, hidden)
    if nv <= 32:
        return make_config(dtype, hidden, 1, 256, xpol=2)
    if nv <= 128:
        return make_config(dtype, hidden, -(-nv // 32), 64, xpol=2)
    if op == "RMSNorm" and hidden == 8192 and dtype in ("float16", "bfloat16"):
        # kernel v4: x read twice (Inductor's form): 32 registers, 4 rows of 512 threads in flight per SM
        return make_config(dtype, hidden, 2, xpol=2, reload=1)
    return make_config(dtype, hidden, 2, xpol=2)


def candidate_configs(dtype: Any, hidden: int, op: str = "RMSNorm") -> list[RMSConfig]:
    """Configs a benchmark sweep may try (the default first); the GPU tests run every one."""
    dtype = norm_dtype(dtype)
    _, nv = _vec_nv(dtype, hidden)
    out = [choose_config(dtype, hidden, op)]

    def add(*a, **k):
        c = make_config(dtype, hidden, *a, **k)
        if c not in out:
            out.append(c)

    if nv <= 32:  # xpol 0 below: the v2 default's plain read-only loads, with the other options
        add(1, 256)
        add(1, 128)
        add(1, 256, iters=2)
    if 32 < nv <= 256:  # a warp per row (3-8 accesses a thread), or half a warp (twice the accesses)
        w = -(-nv // 32)
        for bt in (32, 64, 128):
            add(w, bt)
        add(w, 32, nc=False)
        if nv <= 128:
            add(2 * w, 32)
            add(2 * w, 64)
        add(w, 32, iters=2)
        add(w, 64, stcs=True)
        add(w, 64, glate=True)
        add(w, 64, xpol=1)
        add(w, 64, xpol=2)
        add(w, 64, ypol=1)
    if 64 < nv <= 128:  # the v1 layout: a block per row, one access per thread
        add(1)
    if nv > 128:  # a block per row
        add(2)
        add(4)
        add(2, full=True)
        add(2, nc=False)
        add(2, iters=2)
        add(2, glate=True)
        add(2, stcs=True)
        add(2, xpol=1)
        add(2, xpol=2)
        add(2, ypol=1)
        add(2, xpol=2, ypol=1)
        # kernel v4 (README "Tuning" 6): x read twice (Inductor's form), other thread counts with evict_last loads
        add(2, xpol=2, reload=1)
        add(2, xpol=2, reload=1, glate=True)
        add(2, xpol=2, reload=2)
        add(4, xpol=2)
        add(4, xpol=2, reload=1)
        if op == "RMSNorm":  # register caps: 4 rows of 512 / 8 of 256 threads per SM (SkipRMSNorm spills)
            add(2, xpol=2, full=True)
            add(4, xpol=2, reload=1, full=True)
        add(1, xpol=2)
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
        name=(
            f"rms_norm/{op}/{dtype}/h{hidden}/eps{eps:g}/v{cfg.vec}t{cfg.tpr}r{cfg.rpb}i{cfg.iters}"
            f"{'s' if cfg.stcs else ''}{'g' if cfg.glate else ''}{f'b{cfg.minb}' if cfg.minb else ''}{'' if cfg.nc else 'p'}"
            f"{f'x{cfg.xpol}' if cfg.xpol else ''}{f'y{cfg.ypol}' if cfg.ypol else ''}"
            f"{f'd{cfg.reload}' if cfg.reload else ''}"
        ),
        lang="cuda",
        path=KERNEL_PATH,
        entry=_ENTRY[op],
        n_inputs=n_in,
        n_extra=1,
        n_outputs=n_out,
        defines={
            **norm_cuda_defines(dtype, hidden, eps),
            "VEC": str(cfg.vec),
            "TPR": str(cfg.tpr),
            "RPB": str(cfg.rpb),
            "ITERS": str(cfg.iters),
            "STCS": str(int(cfg.stcs)),
            "GLATE": str(int(cfg.glate)),
            "MINB": str(cfg.minb),
            "NC": str(int(cfg.nc)),
            "XPOL": str(cfg.xpol),
            "YPOL": str(cfg.ypol),
            "RELOAD": str(cfg.reload),
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
