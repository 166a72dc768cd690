"""The sm_90 CUDA C++ GEMM (kernel_sm90.cu): which instances it takes, what to compile, how to launch.

``takes(op, dtype, static) -> reason | None``; ``kernel_config(op, dtype, attrs, static, config)``
-> :class:`KernelSource`; ``launch_params(op, shapes, static, config)`` -> :class:`LaunchParams`
(a persistent grid of ``sm_count`` CTAs, default 132: H100 SXM / H200; the only extra argument is
M, the rows of A: the product of its leading dims, written with ``*`` so TensorRT's symbolic shapes
work).

``static`` holds the compile-time facts: ``N``, ``K``, ``bias_mode`` / ``residual_mode`` (0 absent,
1 one value, 2 a full tensor), ``arch``, optionally ``sm_count``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from optfuse.kernels.artifact import KernelSource, LaunchParams
from optfuse.kernels.util import norm_dtype, rows_of
from optfuse.spec import plugin_specs

KERNEL_PATH = str(Path(__file__).resolve().parent / "kernel_sm90.cu")
SPECS = plugin_specs(__file__)
#: Persistent grid: one CTA per SM of an H100 SXM / H200.
SM90_GRID = 132
THREADS = 384
_DTYPE_CODE = {"float16": 1, "bfloat16": 2}
_OUT_N = {"GemmEpilogue": 256, "GatedGemm": 128}  # output columns per tile (kernel_sm90.cu, "Tiles")
_STAGE_BYTES = (128 * 64 + 256 * 64) * 2
_MAX_SMEM = 227 * 1024


@dataclass(frozen=True)
class SM90Config:
    stages: int = 4    # ring depth (48 KB a stage)
    group_m: int = 8   # row blocks per raster group


def shared_mem(cfg: SM90Config, residual_mode: int) -> int:
    """The ring, the two epilogue stages (64 x 256 with a full residual, which arrives there by TMA;
    else 64 x 128), the barriers, and slack to align to 1024 bytes."""
    epi = 64 * (256 if residual_mode == 2 else 128) * 2
    return cfg.stages * _STAGE_BYTES + 2 * epi + 16 * cfg.stages + 32 + 1024


def default_config(op: str, static: dict) -> SM90Config:
    """4 ring stages; 3 with a full residual, whose 64 KB epilogue stage leaves no room for a fourth."""
    return SM90Config(stages=3 if int(static.get("residual_mode", 0)) == 2 and op == "GemmEpilogue" else 4)


def takes(op: str, dtype: Any, static: dict) -> str | None:
    """Why the sm_90 kernel cannot run this instance (None: it can)."""
    dtype = norm_dtype(dtype)
    if int(static.get("arch") or 0) != 90:
        return f"sm_90 only (target sm_{static.get('arch')})"
    if dtype not in _DTYPE_CODE:
        return f"fp16/bf16 only (got {dtype})"
    n, k = int(static["N"]), int(static["K"])
    if n % 32 or k % 8:
        return f"N = {n} must be a multiple of 32 and K = {k} of 8"
    # The tensor maps (2 or 3 x 128 bytes) live in the first row of a tile: every tile's row must hold them.
    rest = n % _OUT_N[op]
    maps = 3 if int(static.get("residual_mode", 0)) == 2 and op == "GemmEpilogue" else 2
    if rest and rest * 2 < 128 * maps:
        return f"the last column tile of N = {n} is {rest} columns, too narrow for the tensor maps"
    return None


def _activation(op: str, attrs: dict) -> str:
    return attrs.get("activation", SPECS[op].attr("activation").default)


#: The kernel's ACTIVATION codes: GemmEpilogue's choices in spec order (GatedGemm's are a subset).
ACTIVATION_CODES = SPECS["GemmEpilogue"].attr("activation").choices


def config_name(cfg: SM90Config) -> str:
    return f"{cfg.stages}stages_group{cfg.group_m}"


def kernel_config(op: str, dtype: Any, attrs: dict | None, static: dict, config: SM90Config | None = None) -> KernelSource:
    dtype = norm_dtype(dtype)
    attrs = dict(attrs or {})
    why = takes(op, dtype, static)
    if why:
        raise ValueError(f"{op}: the sm_90 kernel does not take this instance: {why}")
    cfg = config or default_config(op, static)
    gated = op == "GatedGemm"
    n, k = int(static["N"]), int(static["K"])
    bias_mode = 0 if gated else int(static.get("bias_mode", 0))
    residual_mode = 0 if gated else int(static.get("residual_mode", 0))
    before = int(attrs.get("residual_position", "after_activation") == "before_activation") if not gated else 0
    alpha = float(attrs.get("alpha", 1.0)) if not gated else 1.0
    activation = _activation(op, attrs)
    if shared_mem(cfg, residual_mode) > _MAX_SMEM:
        raise ValueError(f"{op}: {config_name(cfg)} needs {shared_mem(cfg, residual_mode)} bytes of shared memory")
    defines = {
        "OPTFUSE_DTYPE": str(_DTYPE_CODE[dtype]),
        "N_DIM": str(n),
        "K_DIM": str(k),
        "GATED": str(int(gated)),
        "ACTIVATION": str(ACTIVATION_CODES.index(activation)),
        "BIAS_MODE": str(bias_mode),
        "RESIDUAL_MODE": str(residual_mode),
        "RESIDUAL_BEFORE": str(before),
        "ALPHA": f"{alpha!r}f",
        "STAGES": str(cfg.stages),
        "GROUP_M": str(cfg.group_m),
    }
    n_inputs = 3 if gated else 2 + (bias_mode > 0) + (residual_mode > 0)
    return KernelSource(
        name=(f"gemm_sm90/{op}/{dtype}/n{n}_k{k}/{activation}/bias{bias_mode}_residual{residual_mode}"
              f"{'_before' if before else ''}/alpha{alpha:g}/{config_name(cfg)}"),
        lang="cuda",
        path=KERNEL_PATH,
        entry="gemm_sm90",
        n_inputs=n_inputs,
        n_extra=1,
        n_outputs=1,
        defines=defines,
        threads=THREADS,
        pointer_align=64,  # y holds the tensor maps (64-byte aligned); TensorRT gives 256
        arch_suffix="a",
        meta={"op": op, "dtype": dtype, "N": n, "K": k, "kernel": "sm90", "config": asdict(cfg)},
    )


def launch_params(op: str, shapes: Sequence[Sequence[Any]], static: dict, config: SM90Config | None = None) -> LaunchParams:
    cfg = config or default_config(op, static)
    m = rows_of(shapes[0])
    residual_mode = int(static.get("residual_mode", 0)) if op == "GemmEpilogue" else 0
    return LaunchParams(grid=(int(static.get("sm_count") or SM90_GRID), 1, 1), block=(THREADS, 1, 1),
                        shared_mem=shared_mem(cfg, residual_mode), extra_args=[m])


def candidate_configs(op: str, static: dict) -> list[SM90Config]:
    """Configs a benchmark sweep may try (the default first; those that fit in shared memory)."""
    first = default_config(op, static)
    rm = int(static.get("residual_mode", 0)) if op == "GemmEpilogue" else 0
    out = [first] + [c for c in (SM90Config(stages=3), SM90Config(stages=4), SM90Config(stages=4, group_m=16))
                     if c != first and shared_mem(c, rm) <= _MAX_SMEM]
    return out
