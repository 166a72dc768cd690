"""Kernel configs and launch parameters of the LayerNorm family: Triton kernels (kernel.py) and,
for short rows that a power-of-two Triton tile would pad, a CUDA C++ warp-per-row kernel
(kernel_warp.cu).

Per op (``LayerNorm``, ``SkipLayerNorm``):

* ``kernel_config(op, dtype, attrs, static_shape)`` -> :class:`KernelSource` (epsilon and hidden
  are compiled in);
* ``launch_params(op, shapes, dtypes, attrs, cdiv=...)`` -> :class:`LaunchParams`, written with
  ``+ - *`` and ``cdiv`` over the dynamic row count only, so TensorRT QDP ``aot_impl`` can call it
  with symbolic shapes (hidden must be static: from ``static_shape`` or a constant last dim).

FP8 output (``y_scale`` present: ``static_shape['y_scale']``, as :func:`optfuse.trt.glue.static_shape`
gives every present input): the same kernels built with the FP8 store (``*_fp8_fwd`` entries,
``-DOPTFUSE_FP8_OUT=1``), y_scale one more input after beta, y E4M3 bytes. It needs sm_89 or later
(E4M3 conversions): below, kernel_config refuses with a ValueError naming the target.

Argument order: inputs (x, [skip], gamma, beta, [y_scale]), extra (rows), outputs (y, [sum]).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from optfuse.kernels.artifact import KernelSource, LaunchParams
from optfuse.kernels.util import (
    FP8_OUTPUT_MIN_ARCH, ITEMSIZE, TRITON_TYPE, as_float32, cdiv as _cdiv, fp8_output, next_pow2, norm_cuda_defines, norm_dtype,
    rows_of, static_int,
)
from optfuse.spec import plugin_specs, shared

KERNEL_PATH = str(Path(__file__).resolve().parent / "kernel.py")
WARP_KERNEL_PATH = str(Path(__file__).resolve().parent / "kernel_warp.cu")
SPECS = plugin_specs(__file__)
OPS = tuple(SPECS)
DEFAULT_EPSILON = shared(SPECS, lambda s: s.attr("epsilon").default, "the epsilon default")
MIN_HIDDEN = shared(SPECS, lambda s: s.limits["min_hidden"], "min_hidden")
MAX_HIDDEN = shared(SPECS, lambda s: s.limits["max_hidden"], "max_hidden")
DTYPES = shared(SPECS, lambda s: s.inputs[0].dtypes, "the dtypes of x")

FP8_MIN_ARCH = FP8_OUTPUT_MIN_ARCH  # the FP8-output variant's floor (E4M3 conversions)

_ENTRY = {"LayerNorm": "layer_norm_fwd", "SkipLayerNorm": "skip_layer_norm_fwd"}
_WARP_ENTRY = {"LayerNorm": "layer_norm_warp_fwd", "SkipLayerNorm": "skip_layer_norm_warp_fwd"}
_FP8_ENTRY = {"LayerNorm": "layer_norm_fp8_fwd", "SkipLayerNorm": "skip_layer_norm_fp8_fwd"}
_WARP_FP8_ENTRY = {"LayerNorm": "layer_norm_warp_fp8_fwd", "SkipLayerNorm": "skip_layer_norm_warp_fp8_fwd"}
#: the kernels' inputs without the FP8 variant's y_scale (spec order)
_INPUTS = {op: tuple(t.name for t in s.inputs if t.name != "y_scale") for op, s in SPECS.items()}
_OUTPUTS = {op: tuple(t.name for t in s.outputs) for op, s in SPECS.items()}


@dataclass(frozen=True)
class LNConfig:
    block_m: int  # rows per program
    block_n: int  # next power of two >= hidden
    num_warps: int
    # L2 priority of the streamed x / skip loads: "" (none) or "evict_last"
    x_evict: str = ""


@dataclass(frozen=True)
class LNWarpConfig:
    """The CUDA kernel (kernel_warp.cu): one warp per row, ``vpt`` 16-byte accesses per lane
    (exactly the row: no padding), ``rpb`` rows (warps) per block."""
    vpt: int
    rpb: int

    @property
    def threads(self) -> int:
        return 32 * self.rpb


def warp_kernel_fits(dtype: str, hidden: int) -> bool:
    """The warp kernel takes rows of whole 16-byte accesses, at most 4 per lane (128 accesses:
    1024 fp16 / bf16 elements; more would hold too many registers for a warp per row)."""
    item = ITEMSIZE[norm_dtype(dtype)]
    return (hidden * item) % 16 == 0 and hidden * item // 16 <= 128


def warp_config(dtype: str, hidden: int, rpb: int = 2) -> LNWarpConfig:
    if not warp_kernel_fits(dtype, hidden):
        raise ValueError(f"LayerNorm warp kernel: hidden {hidden} ({dtype}) is not whole 16-byte accesses <= 128")
    nv = hidden * ITEMSIZE[norm_dtype(dtype)] // 16
    return LNWarpConfig(-(-nv // 32), rpb)


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"layer_norm plugin has no op {op!r} (ops: {OPS})")


def choose_config(dtype: str, hidden: int, op: str = "LayerNorm") -> LNConfig | LNWarpConfig:
    """The default kernel and config for ``op`` at ``dtype`` and ``hidden``: the CUDA warp-per-row
    kernel for rows of 3-4 16-byte accesses a lane (fp16/bf16 hidden 520-1024 in steps of 8;
    SkipLayerNorm: 3, up to 768), where the Triton tile is padded to 1024 columns; the Triton
    kernel elsewhere. H200 sweep (README "Tried"): LayerNorm 768 1.01-1.10x torch.compile
    (Triton's one-warp tile, Inductor's: 1.00x), 1024 1.03-1.13x (Triton 1.00-1.11x);
    SkipLayerNorm 768 1.01-1.14x (Triton 0.99-1.14x), at 1024 the Triton kernel stays (1.09-1.10x
    against 1.03-1.05x at 4096 rows)."""
    if warp_kernel_fits(dtype, hidden) and norm_dtype(dtype) != "float32":
        cfg = warp_config(dtype, hidden)
        if cfg.vpt == 3 or (cfg.vpt == 4 and op == "LayerNorm"):
            return cfg
    return triton_config(dtype, hidden, op)


def triton_config(dtype: str, hidden: int, op: str = "LayerNorm") -> LNConfig:
    """The Triton kernel's tile per program, from the H200 sweeps (README "Tried"): LayerNorm rows
    of 513-768 elements (a 1024 tile at least a quarter padding) one to a program of one warp (Inductor's
    choice): split over 2 warps, the second would hold at most 256 valid of its 512 columns and
    both reductions would cross warps through shared memory and a barrier; other rows of <= 1024
    padded elements two (or more, up to 2048 elements) to a program of 2 warps; longer rows one
    to a program of 4-8 warps (LayerNorm) or 8-16 warps (SkipLayerNorm, twice the streams). L2
    priority evict_last on the x / skip loads of SkipLayerNorm rows over 1024 elements (+3-5 %),
    no hint elsewhere."""
    norm_dtype(dtype)
    if not MIN_HIDDEN <= hidden <= MAX_HIDDEN:
        raise ValueError(f"hidden {hidden} outside [{MIN_HIDDEN}, {MAX_HIDDEN}]")
    block_n = next_pow2(hidden)
    if op == "LayerNorm" and block_n == 1024 and hidden <= 768:
        return LNConfig(1, block_n, 1)
    if block_n <= 1024:
        return LNConfig(max(1, 2048 // block_n), block_n, 2)
    if op == "SkipLayerNorm":
        return LNConfig(1, block_n, min(16, block_n // 256), x_evict="evict_last")
    return LNConfig(1, block_n, min(8, block_n // 512) if block_n <= 8192 else 16)


def candidate_configs(dtype: str, hidden: int, op: str = "LayerNorm") -> list[LNConfig | LNWarpConfig]:
    """Configs a benchmark sweep may try (the op's default first); the GPU tests run every one."""
    block_n = next_pow2(hidden)
    first = triton_config(dtype, hidden, op)  # the Triton candidates vary its tile
    out = [choose_config(dtype, hidden, op)]
    if first not in out:
        out.append(first)

    def add(block_m, warps, x_evict=""):
        c = LNConfig(block_m, block_n, warps, x_evict)
        per_thread = (block_m * block_n) // (warps * 32)  # elements a thread holds: 4..64, no spills
        if c not in out and block_m * block_n <= 16384 and 4 <= per_thread <= 64:
            out.append(c)

    if block_n <= 1024:  # 1024-4096 elements a program; 1 warp (Inductor's choice) to 4
        base = max(1, 1024 // block_n)
        for block_m, warps in ((2, 2), (1, 1), (2, 1), (4, 2), (1, 2), (1, 4), (2, 4)):
            add(base * block_m, warps)
    else:
        for warps in (2, 4, 8, 16):
            add(1, warps)
        add(2, max(1, first.num_warps))
    add(first.block_m, first.num_warps, x_evict="evict_last")
    # evict_last with more rows in flight per SM (what the CUDA RMSNorm kernel gained from, README there)
    if block_n <= 1024:
        for block_m, warps in ((2, 2), (2, 1)):
            add(max(1, 1024 // block_n) * block_m, warps, x_evict="evict_last")
    else:
        add(1, max(1, first.num_warps // 2), x_evict="evict_last")
    if warp_kernel_fits(dtype, hidden):  # the CUDA warp-per-row kernel: 1-4 rows a block
        for rpb in (2, 1, 4):
            c = warp_config(dtype, hidden, rpb)
            if c not in out:
                out.append(c)
    return out


def config_name(cfg: LNConfig | LNWarpConfig) -> str:
    """The config in words: ``triton_2rows_2warps[_evict_last]`` or ``warp_per_row_3accesses_2rows``."""
    if isinstance(cfg, LNWarpConfig):
        return f"warp_per_row_{cfg.vpt}accesses_{cfg.rpb}rows"
    return f"triton_{cfg.block_m}rows_{cfg.num_warps}warps{'_' + cfg.x_evict if cfg.x_evict else ''}"


def _epsilon(attrs: dict | None) -> float:
    eps = (attrs or {}).get("epsilon", DEFAULT_EPSILON)
    return as_float32(DEFAULT_EPSILON if eps is None else eps)


def _variant_name(op: str, dtype: str, fp8: bool) -> str:
    return f"layer_norm/{op}/{dtype}{'_to_float8e4m3fn' if fp8 else ''}"


def kernel_config(
    op: str, dtype: Any, attrs: dict | None, static_shape: dict, config: LNConfig | LNWarpConfig | None = None
) -> KernelSource:
    """What to compile for ``op`` at ``dtype`` (x's dtype) and ``static_shape['hidden']``; with
    ``static_shape['y_scale']`` (present) the FP8-output variant (:func:`fp8_output`)."""
    _check_op(op)
    dtype = norm_dtype(dtype)
    hidden = static_int(static_shape["hidden"], "hidden")
    cfg = config or choose_config(dtype, hidden, op)
    eps = _epsilon(attrs)
    fp8 = fp8_output(op, static_shape)
    if isinstance(cfg, LNWarpConfig):
        return _warp_kernel_source(op, dtype, hidden, eps, cfg, fp8)
    ty = "*" + TRITON_TYPE[dtype]
    ins, outs = _INPUTS[op], _OUTPUTS[op]
    signature = {"X": ty, **({"SKIP": ty} if op == "SkipLayerNorm" else {}), "W": ty, "B": ty,
                 **({"YS": "*fp32"} if fp8 else {}), "rows": "i32", "Y": "*u8" if fp8 else ty}
    if op == "SkipLayerNorm":
        signature["S"] = ty
    return KernelSource(
        name=f"{_variant_name(op, dtype, fp8)}/h{hidden}/eps{eps:g}/{config_name(cfg)}",
        lang="triton",
        path=KERNEL_PATH,
        entry=(_FP8_ENTRY if fp8 else _ENTRY)[op],
        n_inputs=len(ins) + fp8,
        n_extra=1,
        n_outputs=len(outs),
        signature=signature,
        constexprs={
            "HIDDEN": hidden, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "EPS": eps, "X_EVICT": cfg.x_evict,
        },
        num_warps=cfg.num_warps,
        num_stages=1,
        pointer_align=16 if (hidden * ITEMSIZE[dtype]) % 16 == 0 else ITEMSIZE[dtype],
        meta={"op": op, "dtype": dtype, "hidden": hidden, "epsilon": eps, "config": asdict(cfg),
              **({"y_dtype": "float8e4m3fn"} if fp8 else {})},
    )


def _warp_kernel_source(op: str, dtype: str, hidden: int, eps: float, cfg: LNWarpConfig, fp8: bool) -> KernelSource:
    if warp_config(dtype, hidden).vpt != cfg.vpt:
        raise ValueError(f"LayerNorm warp kernel: vpt {cfg.vpt} does not cover hidden {hidden} ({dtype})")
    return KernelSource(
        name=f"{_variant_name(op, dtype, fp8)}/h{hidden}/eps{eps:g}/{config_name(cfg)}",
        lang="cuda",
        path=WARP_KERNEL_PATH,
        entry=(_WARP_FP8_ENTRY if fp8 else _WARP_ENTRY)[op],
        n_inputs=len(_INPUTS[op]) + fp8,
        n_extra=1,
        n_outputs=len(_OUTPUTS[op]),
        defines={
            **norm_cuda_defines(dtype, hidden, eps),
            "VPT": str(cfg.vpt),
            "RPB": str(cfg.rpb),
            **({"OPTFUSE_FP8_OUT": "1"} if fp8 else {}),
        },
        threads=cfg.threads,
        pointer_align=16,
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
    config: LNConfig | LNWarpConfig | None = None,
) -> LaunchParams:
    """Grid over the (dynamic) rows; ``shapes[0]`` is x's shape ``[..., hidden]``."""
    _check_op(op)
    dtype = norm_dtype(dtypes[0])
    hidden = static_int(static_shape["hidden"] if static_shape else shapes[0][-1], "hidden")
    cfg = config or choose_config(dtype, hidden, op)
    rows = rows_of(shapes[0])
    if isinstance(cfg, LNWarpConfig):
        return LaunchParams(grid=(cdiv(rows, cfg.rpb), 1, 1), block=(cfg.threads, 1, 1), shared_mem=0,
                            extra_args=[rows])
    return LaunchParams(
        grid=(cdiv(rows, cfg.block_m), 1, 1),
        block=(cfg.num_warps * 32, 1, 1),
        shared_mem=0,  # Triton's own shared memory comes with the artifact (metadata.shared)
        extra_args=[rows],
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
