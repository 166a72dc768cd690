"""The sm_90 CUDA C++ GEMM (kernel_sm90.cu): which instances it takes, what to compile, how to launch.

launch.py picks it (``GemmConfig.impl`` ``cuda_sm90``: the cooperative schedule,
``cuda_sm90_pingpong``, ``cuda_sm90_epilogue_wg``; ``cuda_sm90_narrow`` and ``cuda_sm90_n192`` in run-time
plans only) where :func:`takes` says it can run; this module holds the kernel's own facts: its fixed tiles
(cooperative: 128 rows of A by 256 rows of W, 256 output columns, GatedGemm 128; pingpong: 128 x 128 per
consumer warpgroup; narrow: 128 x 128 shared by both; n192: 128 x 192 shared by both), its shared memory,
its persistent grid (``sm_count`` CTAs, default 132: H100 SXM / H200; the only extra argument is M), the tensor-map
room it needs in y.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from optfuse.kernels.artifact import KernelSource, LaunchParams, TensorMapArg
from optfuse.spec import plugin_specs

KERNEL_PATH = str(Path(__file__).resolve().parent / "kernel_sm90.cu")
SPECS = plugin_specs(__file__)
#: Persistent grid: one CTA per SM of an H100 SXM / H200.
SM90_GRID = 132
THREADS = 384  # a producer and two consumer warpgroups
BLOCK_M, BLOCK_K = 128, 64
PINGPONG = "cuda_sm90_pingpong"
#: the cooperative schedule with its epilogue in the producer's warpgroup (sm90/epilogue_wg.cuh)
EPILOGUE_WG = "cuda_sm90_epilogue_wg"
#: the cooperative schedule on 128 x 128 tiles (kernel_sm90.cu, NARROW): small M, GemmEpilogue
NARROW = "cuda_sm90_narrow"
#: the cooperative schedule on 128 x 192 tiles (kernel_sm90.cu, TILE_N 192): GemmEpilogue, where M and N
#: fill the grid's last wave of 128 x 256 tiles badly
TILE_192 = "cuda_sm90_n192"
#: output columns per tile (kernel_sm90.cu, "Tiles"), by impl and op
OUT_N = {("cuda_sm90", "GemmEpilogue"): 256, ("cuda_sm90", "GatedGemm"): 128, (PINGPONG, "GemmEpilogue"): 128,
         (EPILOGUE_WG, "GemmEpilogue"): 256, (EPILOGUE_WG, "GatedGemm"): 128, (NARROW, "GemmEpilogue"): 128,
         (TILE_192, "GemmEpilogue"): 192}
#: rows of W per tile (the MMA's N), by impl
TILE_N = {PINGPONG: 128, NARROW: 128, TILE_192: 192}
MAX_SMEM = 227 * 1024


def grid_size(static: dict) -> int:
    """CTAs of a persistent launch: one per SM (the static shape's ``sm_count``, else the H100 / H200's 132)."""
    return int(static.get("sm_count") or SM90_GRID)


def tile_count(m: int, n: int, width: int) -> int:
    """Tiles of BLOCK_M rows x ``width`` columns covering y's M x N."""
    return -(-m // BLOCK_M) * -(-n // width)


def _stage_bytes(impl: str) -> int:
    return (BLOCK_M + TILE_N.get(impl, 256)) * BLOCK_K * 2
_DTYPE_CODE = {"float16": 1, "bfloat16": 2}
FP8 = "float8e4m3fn"
_SCALE_CODE = {"scalar": 1, "vector": 2}
_BIAS_CODE = {"none": 0, "scalar": 1, "vector": 2}
_RESIDUAL_CODE = {"none": 0, "scalar": 1, "full": 2}
#: The kernel's ACTIVATION codes: GemmEpilogue's choices in spec order (GatedGemm's are a subset).
ACTIVATION_CODES = SPECS["GemmEpilogue"].attr("activation").choices


def residual_by_tma(impl: str, op: str, residual_mode: str) -> bool:
    """Cooperative: a full residual comes by TMA, its first 128 columns into the epilogue stage and
    its last 128 into a ring slot after the tile's k-blocks (128 x 192 tiles: all 192 into the
    stage)."""
    return impl in ("cuda_sm90", TILE_192) and op == "GemmEpilogue" and residual_mode == "full"



def shared_mem(impl: str, stages: int) -> int:
    """The ring, the two epilogue stages, the barriers, and slack to align to 1024 bytes (a full
    residual takes no room of its own: kernel_sm90.cu, RESIDUAL_IN_RING)."""
    if impl == PINGPONG:
        epi = 128 * 128 * 2
    elif impl == NARROW:
        epi = 64 * 128 * 2  # a warpgroup's 64 x 128 tile
    elif impl == EPILOGUE_WG:
        epi = BLOCK_M * 256  # half the 64 KB hand-over tile (2 * epi below)
    elif impl == TILE_192:
        epi = 64 * 192 * 2  # a warpgroup's whole 64 x 192 tile, one pass
    else:
        epi = 64 * 128 * 2  # a warpgroup's 64 x 128 stage (kernel_sm90.cu, RESIDUAL_IN_RING)
    barriers = 8 * (2 * stages + (6 if impl == EPILOGUE_WG else 4))
    return stages * _stage_bytes(impl) + 2 * epi + barriers + 1024


def stage_options(impl: str, fp8: bool = False) -> list[int]:
    """The two deepest rings that fit in shared memory, deepest first (the default); FP8 the
    shallower first (H200, M = 4096: 3 stages take 0.89-0.99x the time of 4)."""
    fits = [s for s in (5, 4, 3) if shared_mem(impl, s) <= MAX_SMEM][:2]
    return fits[::-1] if fp8 else fits


def takes(op: str, dtype: str, n: int, static: dict, arch: Any, impl: str = "cuda_sm90", k: int | None = None,
          out_dtype: str | None = None, host_maps: bool = False) -> str | None:
    """Why the sm_90 kernel (schedule ``impl``) cannot run this instance (None: it can). ``dtype`` is
    A's; ``out_dtype`` y's (None: A's), which an FP8 instance needs to be fp16 / bf16. ``host_maps``:
    a build whose tensor maps the launcher encodes (run-time plans), which needs no room for them in y."""
    if dtype == FP8:
        if impl != "cuda_sm90":
            return "FP8 runs the cooperative schedule"
        if out_dtype not in _DTYPE_CODE:
            return f"FP8 with y in {out_dtype}: fp16 / bf16 only"
        dtype = out_dtype  # what bias, residual and y must be
    if impl in (PINGPONG, NARROW, TILE_192) and op != "GemmEpilogue":
        return f"{impl}: GemmEpilogue only"
    if impl in (PINGPONG, NARROW) and n % 128:
        return f"{impl}: N = {n} is not a multiple of 128 (the tensor maps fill a tile row)"
    if impl == PINGPONG:
        if k is not None and -(-k // BLOCK_K) < stage_options(impl)[0]:
            return f"pingpong: K = {k} is shorter than the ring"
    if arch is None or int(arch) != 90:
        return f"sm_90 only (target {'unknown' if arch is None else f'sm_{arch}'})"
    if dtype not in _DTYPE_CODE:
        return f"fp16/bf16 only (got {dtype})"
    for name in ("bias", "residual"):
        other = static.get(f"{name}_dtype")
        if other is not None and other != dtype:
            return f"{name} must have A's dtype ({other} vs {dtype})"
    if n % 32:
        return f"N = {n} is not a multiple of 32"
    # Maps built on the device (2, with a TMA residual 3, x 128 bytes) live in the first row of one of
    # this CTA's tiles: every tile's row must hold them.
    maps = 3 if residual_by_tma(impl, op, static.get("residual_mode", "none")) else 2
    rest = n % OUT_N[(impl, op)]
    if rest and rest * 2 < 128 * maps and not host_maps:
        return f"the last column tile of N = {n} is {rest} columns, too narrow for the tensor maps"
    return None


def tensor_maps(impl: str, op: str, dtype: str, out: str, n: int, k: int, epi: Any) -> tuple[TensorMapArg, ...]:
    """The tensor maps a HOST_MAPS build takes after y (kernel_sm90.cu, "Tensor maps"): A [M, K] in
    128-row boxes, W [N, K] in boxes of the tile's W rows (GatedGemm: W_gate and W_up as one pair
    map, half the rows each), and a residual (y's dtype ``out``) that comes by TMA, [M, N] in 64 x 64
    boxes."""
    elem = "uint8" if dtype == FP8 else dtype
    cols = 128 if dtype == FP8 else 64  # one 128-byte swizzle row
    w_rows = TILE_N.get(impl, 256)
    gated = op == "GatedGemm"
    maps = [TensorMapArg(0, elem, "extra:0", k, BLOCK_M, cols),
            TensorMapArg(1, elem, n, k, w_rows // 2 if gated else w_rows, cols, pair=2 if gated else None)]
    if residual_by_tma(impl, op, epi.residual_mode):
        maps.append(TensorMapArg(2 + (epi.bias_mode != "none"), out, "extra:0", n, 64, 64))
    return tuple(maps)


def source(impl: str, op: str, dtype: str, n: int, k: int, epi: Any, stages: int, group_m: int, name: str,
           split_k: int = 1, host_maps: bool = False) -> KernelSource:
    """The KernelSource of one instance; ``epi`` is launch.Epilogue (activation, alpha, residual
    position, the bias / residual modes; FP8: y's dtype and the weight scales' mode). ``split_k`` > 1: the
    pingpong kernel writing the fp32 partial planes of that many K ranges (the epilogue is then the
    reduce's, :func:`reduce_source`). ``host_maps``: the tensor maps come from the launcher
    (:func:`tensor_maps`; run-time plans), not built by each CTA (QDP's AOT path)."""
    gated = op == "GatedGemm"
    fp8 = dtype == FP8
    out = (getattr(epi, "out_dtype", "") or dtype) if fp8 else dtype
    need = shared_mem(impl, stages)
    if need > MAX_SMEM:
        raise ValueError(f"{op}: {stages} stages need {need} bytes of shared memory")
    defines = {
        "OPTFUSE_DTYPE": str(_DTYPE_CODE[out]),
        "IN_FP8": str(int(fp8)),
        "W_SCALE_MODE": str(_SCALE_CODE[epi.w_scale_mode] if fp8 else 0),
        "N_DIM": str(n),
        "K_DIM": str(k),
        "GATED": str(int(gated)),
        "ACTIVATION": str(ACTIVATION_CODES.index(epi.activation)),
        "BIAS_MODE": str(_BIAS_CODE[epi.bias_mode]),
        "RESIDUAL_MODE": str(_RESIDUAL_CODE[epi.residual_mode]),
        "RESIDUAL_BEFORE": str(int(epi.residual_before)),
        "ALPHA": f"{float(epi.alpha)!r}f",
        "STAGES": str(stages),
        "GROUP_M": str(group_m),
        "PINGPONG": str(int(impl == PINGPONG)),
        "EPILOGUE_WG": str(int(impl == EPILOGUE_WG)),
        "SPLIT_K": str(split_k),
        "NARROW": str(int(impl == NARROW)),
        "HOST_MAPS": str(int(host_maps)),
    }
    if impl == TILE_192:
        defines["TILE_N"] = "192"
    n_inputs = 3 if gated else 2 + (epi.bias_mode != "none") + (epi.residual_mode != "none")
    if fp8:
        n_inputs += 3 if gated else 2  # a_scale and the weight scale(s)
        if gated and epi.w_up_scale_mode != epi.w_scale_mode:
            raise ValueError(f"{op}: FP8 gate and up weight scales of different modes")
    return KernelSource(
        name=name,
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
        meta={"op": op, "dtype": dtype, "N": n, "K": k, "kernel": impl, "stages": stages, "group_m": group_m,
              "split_k": split_k, "host_maps": host_maps},
        tensor_maps=tensor_maps(impl, op, dtype, out, n, k, epi) if host_maps else (),
    )


def launch(impl: str, m: Any, stages: int, static: dict) -> LaunchParams:
    return LaunchParams(grid=(grid_size(static), 1, 1), block=(THREADS, 1, 1),
                        shared_mem=shared_mem(impl, stages), extra_args=[m])


# -- small M (launch.launch_plan: chosen at run time, when M is known): narrow tiles, split-K ----
# A split-K launch has at most one work unit per CTA of the grid: two units of one CTA would take
# turns on its tensor cores, with no epilogue worth overlapping between them.
#: A unit's k-blocks: at least this many, so that its mainloop outweighs filling the ring and
#: writing the 64 KB partial tile.
SPLIT_K_MIN_BLOCKS = 8
#: Narrow tiles with an activation and K <= NARROW_ACTIVATION_MAX_K: up to this many 128 x 128 tiles
#: per CTA (H100, fp16: BERT-base FFN up at M = 2048, 2.9 a CTA, 23.3 vs 26.9 us with the epilogue
#: warps; BERT-large's at 3.9 a CTA, 37.4 vs 35.2). Longer K was not measured. Past one tile a CTA a
#: 16-bit GELU (HALF2_ACTIVATIONS) runs ping-pong instead (README "Schedules at small M").
NARROW_ACTIVATION_WAVES = 3
#: The activations whose 16-bit epilogue computes on f16x2 pairs (sm90/epilogue.cuh, GemmEpilogue, GELU
#: erf or tanh: fp16 wholly, HALF2_EPILOGUE; bf16 the gate, GATE_F16X2_EPILOGUE). Ping-pong's epilogue runs
#: on one warpgroup while the other's MMAs go on; with the short f16x2 GELU that overlap beats narrow tiles
#: past one tile a CTA (H100, host maps: BERT-base FFN up at M = 2048 0.88x / 0.91x the narrow time in fp16,
#: 0.90x / 0.88x in bf16; BERT-large's at M = 1024 0.93x fp16, 0.92x bf16).
HALF2_ACTIVATIONS = ("gelu_erf", "gelu_tanh")
NARROW_ACTIVATION_MAX_K = 1024
#: The workspace a split-K plan can need: one 128 x 128 fp32 partial tile per unit.
PARTIAL_TILE_BYTES = BLOCK_M * 128 * 4
REDUCE_THREADS = 256


def split_k_workspace(static: dict) -> int:
    """Bytes of the partial planes of any split-K plan on this grid (units <= CTAs)."""
    return grid_size(static) * PARTIAL_TILE_BYTES


def small_m_schedule(op: str, dtype: str, m: int, n: int, k: int, impl: str, static: dict,
                     activation: str = "none") -> tuple[str, int, int] | None:
    """(schedule, ring stages, splits) for a GemmEpilogue whose M gives the statically chosen schedule
    ``impl`` (picked for large M) too few tiles, or None (keep it). From the H100 table (README,
    "Small M"), in 128 x 128 tiles:

    * at most half a tile per CTA: pingpong with K in ``splits`` ranges, the largest divisor of the
      k-blocks that keeps units <= CTAs and every unit >= max(ring, SPLIT_K_MIN_BLOCKS) k-blocks;
    * otherwise, with an activation: narrow tiles up to one tile per CTA, and up to
      NARROW_ACTIVATION_WAVES per CTA where K <= NARROW_ACTIVATION_MAX_K (both consumer warpgroups on
      each tile, the activation in its short form: a pingpong CTA with one tile runs it, epilogue
      included, on one warpgroup) -- except a 16-bit GELU past one tile a CTA, which runs pingpong
      unsplit (HALF2_ACTIVATIONS);
    * without one, up to a tile per CTA: pingpong unsplit (0.93-1.05x the time of narrow tiles in
      three runs: one warpgroup's epilogue overlaps the other's MMAs), or narrow tiles where K is
      shorter than pingpong's ring; and pingpong where its tiles take 2-3 waves of the grid, so that
      the 128 x 256 tiles would take two, the second at most half full (LLaMA-7B's QKV at M = 512:
      87.7 vs 101.0 us cooperative).
    None also where neither 128 x 128 schedule takes the instance."""
    grid = grid_size(static)
    arch = static.get("arch")
    if op != "GemmEpilogue" or takes(op, dtype, n, static, arch, NARROW, k, host_maps=True) is not None:
        return None
    tiles = tile_count(m, n, 128)
    narrow = NARROW, stage_options(NARROW)[0], 1
    pingpong_takes = takes(op, dtype, n, static, arch, PINGPONG, k, host_maps=True) is None
    stages = stage_options(PINGPONG)[0]
    if 2 * tiles <= grid and pingpong_takes:
        k_blocks = -(-k // BLOCK_K)
        least = max(stages, SPLIT_K_MIN_BLOCKS)
        splits = max(d for d in range(1, k_blocks + 1)
                     if k_blocks % d == 0 and d * tiles <= grid and (d == 1 or k_blocks // d >= least))
        if splits > 1:
            return PINGPONG, stages, splits
    if activation != "none":
        if tiles <= grid:
            return narrow
        if k <= NARROW_ACTIVATION_MAX_K and tiles <= NARROW_ACTIVATION_WAVES * grid:
            if activation in HALF2_ACTIVATIONS and pingpong_takes:  # 16-bit: takes(NARROW) refused the others
                return PINGPONG, stages, 1  # its one-warpgroup epilogue is short on f16x2 pairs
            return narrow
        return None
    if impl == PINGPONG:
        return None
    if tiles <= grid:
        return (PINGPONG, stages, 1) if pingpong_takes else narrow
    if pingpong_takes and 2 * grid < tiles <= 3 * grid:
        return PINGPONG, stages, 1
    return None


# -- any M (launch.launch_plan, where small_m_schedule keeps the static choice): 128 x 192 tiles ----
#: 128 x 192 tiles replace the static schedule where their waves' work is at most this fraction of its
#: waves' (wave_cost): BERT-base's FFN down (N = 768) at M = 4096 (0.75), not at equal costs (N = 3072
#: at M = 4096; N = 768 at M = 8192 against ping-pong).
TILE_192_MAX_COST = 0.85


def wave_cost(impl: str, m: int, n: int, grid: int) -> float:
    """A persistent launch's time in units of one 128 x 256 tile's mainloop: the tiles of the busiest
    CTA (tiles are taken round-robin) by their width. Ping-pong's two warpgroups share the tensor
    cores, so its 128 x 128 tiles weigh half as well."""
    width = TILE_N.get(impl, 256)
    tiles = tile_count(m, n, width)
    return -(-tiles // grid) * width / 256


def wave_schedule(op: str, dtype: str, m: int, n: int, k: int, impl: str,
                  static: dict) -> tuple[str, int, int] | None:
    """(TILE_192, ring stages, 1) where 128 x 192 tiles fill the grid's waves so much better than
    ``impl`` (the static choice, or small_m_schedule's unsplit one) that they take at most
    TILE_192_MAX_COST of its time (wave_cost), or None. H100, fp16, same run (README, "128 x 192
    tiles"): BERT-base's FFN down (N = 768) at M = 4096, 96 tiles of 128 x 256 on 132 SMs against
    128 of 128 x 192: 41.9 -> 37.0 us; its FFN up at M = 1024, 192 narrow tiles against 128: 15.9
    -> 12.7 us."""
    if op != "GemmEpilogue" or impl == TILE_192:
        return None
    if takes(op, dtype, n, static, static.get("arch"), TILE_192, k, host_maps=True) is not None:
        return None
    grid = grid_size(static)
    if wave_cost(TILE_192, m, n, grid) > TILE_192_MAX_COST * wave_cost(impl, m, n, grid):
        return None
    return TILE_192, stage_options(TILE_192)[0], 1


# -- large M (launch.launch_plan, where neither rule above answers): wide tiles for plain projections --
#: Plain projections (BERT's QKV: a bias at most, K <= 2048) take ping-pong statically, whose 128 x 128 tiles
#: fill the grid's waves at small M; from this many waves of 128 x 256 tiles on, the epilogue-warp schedule's
#: wide tiles run them faster (H100, same run, against ping-pong, results/h100_qkv_by_m.json: BERT-large QKV
#: at 5.8 waves (M = 8192) 0.96x, BERT-base / BERT-large at 8.7 / 11.6 waves (M = 16384) 0.95x / 0.95x; below
#: it BERT-base at 4.4 waves (M = 8192) 1.07x, and both at M = 4096 (2.2 / 2.9 waves) 1.04x / 1.02x).
PLAIN_WIDE_MIN_WAVES = 5


#: GatedGemm takes the cooperative schedule statically; from this many rows on, the epilogue-warp schedule
#: (the gate product in the producer's warpgroup, behind the next tile's MMAs) is faster on both LLaMA shapes
#: (H100, fp16, README "GatedGemm at large M": 0.944-0.992x at M = 24576 / 32768). Below it they split:
#: LLaMA-7B 1.016-1.021x at M = 8192 / 16384, LLaMA-13B 0.956x at 16384.
GATED_EPILOGUE_WG_MIN_ROWS = 24576


def large_m_schedule(op: str, dtype: str, m: int, n: int, k: int, impl: str,
                     static: dict) -> tuple[str, int, int] | None:
    """(EPILOGUE_WG, ring stages, 1) where the static choice is ping-pong (a plain projection) and M
    gives at least PLAIN_WIDE_MIN_WAVES waves of 128 x 256 tiles, or where a GatedGemm has at least
    GATED_EPILOGUE_WG_MIN_ROWS rows (16-bit: an FP8 instance runs its static schedule); else None."""
    if takes(op, dtype, n, static, static.get("arch"), EPILOGUE_WG, k, host_maps=True) is not None:
        return None
    if op == "GatedGemm":
        wide = m >= GATED_EPILOGUE_WG_MIN_ROWS
    else:
        wide = impl == PINGPONG and tile_count(m, n, 256) >= PLAIN_WIDE_MIN_WAVES * grid_size(static)
    return (EPILOGUE_WG, stage_options(EPILOGUE_WG)[0], 1) if wide else None


def reduce_source(op: str, dtype: str, n: int, k: int, epi: Any, stages: int, group_m: int, split_k: int,
                  name: str, host_maps: bool = False) -> KernelSource:
    """gemm_sm90_splitk_reduce of a split-K plan: the same defines as its GEMM (one translation
    unit; the epilogue's), inputs the partial planes then the present bias / residual."""
    gemm = source(PINGPONG, op, dtype, n, k, epi, stages, group_m, name, split_k, host_maps)
    n_inputs = 1 + (epi.bias_mode != "none") + (epi.residual_mode != "none")
    return KernelSource(name=name, lang="cuda", path=KERNEL_PATH, entry="gemm_sm90_splitk_reduce",
                        n_inputs=n_inputs, n_extra=1, n_outputs=1, defines=gemm.defines, threads=REDUCE_THREADS,
                        pointer_align=16, arch_suffix="a", meta={**gemm.meta, "kernel": "splitk_reduce"})


def reduce_launch(m: int, n: int) -> LaunchParams:
    """One thread per 8 output columns; a plain launch (as a programmatic dependent launch its
    CTAs were placed on the few SMs the GEMM left idle: README, "Tried")."""
    return LaunchParams(grid=(-(-m * (n // 8) // REDUCE_THREADS), 1, 1), block=(REDUCE_THREADS, 1, 1),
                        shared_mem=0, extra_args=[m])
