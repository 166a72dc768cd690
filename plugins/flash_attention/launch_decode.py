"""FlashAttention's split-KV decode (kernel_decode.py): when it runs, its configs, its two kernels'
sources and launch parameters, the launch plan and its workspace. launch.py dispatches to it.

* :func:`decode_applies`: FlashAttention (not the block-sparse op) with Sq <= DECODE_MAX_QUERIES
  and Sk >= DECODE_MIN_KEYS, concrete, and no bias / one broadcast value / a key-padding row;
* :func:`decode_plan`: a :class:`LaunchPlan` of two steps -- the split kernel (inputs q, k, v[,
  bias] -> the partials in the workspace) and the combine kernel (partials -> o) -- or, where one
  split holds the cache, of one: the direct kernel (q, k, v[, bias] -> o, no workspace);
* :func:`workspace_layout`: the partials' byte offsets and the workspace size, + - * cdiv of the
  shapes (monotone in B, Sq and Sk, so a profile's largest plan is at its max shapes).

Split kernel arguments: ``q, k, v[, bias], H, Hkv, Sq, Sk (int32), Part, RowMax, RowSum``; grid
``cdiv(G * Sq, BLOCK_M) * cdiv(Sk, SPLIT_KEYS) * (B * Hkv)``. Combine kernel: ``Part, RowMax,
RowSum, Sk (int32), o``; grid ``B * H * Sq``. Direct kernel: ``q, k, v[, bias], H, Hkv, Sq, Sk, o``;
grid ``cdiv(G * Sq, BLOCK_M) * (B * Hkv)``.
"""

from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from optfuse.kernels.artifact import Buffer, KernelSource, LaunchParams, LaunchPlan, PlanStep
from optfuse.kernels.util import TRITON_TYPE, as_float32, cdiv as _cdiv, next_pow2, norm_dtype

from .sparsity import OP, Sparsity

KERNEL_PATH = str(Path(__file__).resolve().parent / "kernel_decode.py")
SPLIT_ENTRY = "_decode_split_kernel"
COMBINE_ENTRY = "_decode_combine_kernel"
#: Query rows per head up to which the split-KV kernels run (decode, speculative and chunked steps).
DECODE_MAX_QUERIES = 16
#: Keys from which they run: two splits or more. Below, one split would leave the combine launch
#: as pure overhead; those caches stay on the one-kernel path (kernel.py / kernel_sm90.cu).
DECODE_MIN_KEYS = 512
#: Keys per split of DecodeConfig's default (a sweep's base).
SPLIT_KEYS = 256
#: Keys per split the plan picks from (split_keys_for; each size is a kernel specialization). A
#: split writes G * Sq rows of D + 2 floats of partials, G * Sq / size of the K/V it reads (GQA
#: 32/8, Sq = 1, 128 keys: 3 %), read once more by the combine; a profile's workspace bound takes
#: the smallest size, whose partials are the most.
SPLIT_SIZES = (128, 256, 512, 1024, 2048)
#: The split kernel's programs the size leaves at least: about two per SM of an H200, all resident
#: at once (70 KB of shared memory each at D = 128: three fit an SM). H200 sweep, CUDA-graph
#: timings: the largest size keeping 256 programs was the fastest or within 2 % on every decode
#: row; B = 1 at 1k / 2k keys (64 / 128 programs even at 128 keys) took the smallest size.
MIN_PROGRAMS = 256
#: 2048-key splits only while their programs stay within this (B = 16..64 at 4k-16k keys, 1024
#: programs and more: 0.95x the speed of 1024-key splits).
LONGEST_SPLIT_MAX_PROGRAMS = 512
#: SMs of an H100 SXM / H200, the waves' unit.
SM_COUNT = 132
#: Most packed rows (G * Sq) per program: M beyond it takes cdiv(M, 64) row blocks per split,
#: which read the split's K/V from L2 after the first.
MAX_BLOCK_M = 64
#: TensorRT's workspace is 256-byte aligned; so is every partial array in it.
WORKSPACE_ALIGN = 256
#: Query heads per kv head (G = H / Hkv) whose Sq = 1 row blocks the prebuilt split kernels cover:
#: MHA and GQA 4:1 / 8:1 (32/8, 64/8 heads). All pack into BLOCK_M 16, as does any G <= 16.
PREBUILD_GROUPS = (1, 4, 8)


@dataclass(frozen=True)
class DecodeConfig:
    """Tiles of the two decode kernels. ``block_m`` None: from the packed rows (packed_block_m)."""

    split_keys: int = SPLIT_KEYS
    block_n: int = 64  # keys per step of a split (divides split_keys)
    num_warps: int = 4
    num_stages: int = 3  # depth of the K/V load pipeline
    block_m: int | None = None
    combine_splits: int = 32  # splits per step of the combine kernel
    combine_warps: int = 4

    def __post_init__(self) -> None:
        if self.split_keys % self.block_n:
            raise ValueError(f"DecodeConfig: block_n {self.block_n} does not divide split_keys {self.split_keys}")


def split_keys_for(units: int, Sk: int) -> int:
    """Keys per split for a split kernel of ``units`` = row blocks * B * Hkv programs per split:
    the largest of SPLIT_SIZES whose grid units * cdiv(Sk, size) keeps MIN_PROGRAMS (the largest
    size only within LONGEST_SPLIT_MAX_PROGRAMS), the smallest where none does. Longer splits
    stream more keys per program and leave fewer partials for the combine."""
    best = SPLIT_SIZES[0]
    for size in SPLIT_SIZES:
        programs = units * _cdiv(Sk, size)
        if programs < MIN_PROGRAMS or (size == SPLIT_SIZES[-1] and programs > LONGEST_SPLIT_MAX_PROGRAMS):
            break
        best = size
    return best


def decode_config(dtype: Any, head_dim: int, units: int | None = None, Sk: int | None = None) -> DecodeConfig:
    """fp16/bf16: 64-key blocks, 3 stages (D = 128: 16 KB each of K and V per block); D = 256:
    32-key blocks (the same bytes per block); fp32 (IEEE dots): 32-key blocks, 2 stages. With the
    concrete ``units`` (row blocks * B * Hkv) and ``Sk``, split_keys_for's split size, else SPLIT_KEYS."""
    if norm_dtype(dtype) == "float32":
        cfg = DecodeConfig(block_n=32, num_stages=2)
    elif next_pow2(head_dim) > 128:
        cfg = DecodeConfig(block_n=32)
    else:
        cfg = DecodeConfig()
    if units is not None and Sk is not None:
        cfg = replace(cfg, split_keys=split_keys_for(units, Sk))
    return cfg


def candidate_decode_configs(dtype: Any, head_dim: int) -> list[DecodeConfig]:
    """What a benchmark sweep tries (the default first): split sizes 128 / 512 / 1024 / 2048, 32-
    and 128-key blocks, pipeline depths 2 / 4, 8 warps."""
    base = decode_config(dtype, head_dim)
    out = [base]
    for change in (dict(split_keys=128), dict(split_keys=512), dict(split_keys=1024), dict(split_keys=2048),
                   dict(num_stages=2), dict(num_stages=4),
                   dict(block_n=32), dict(block_n=128, num_stages=2), dict(num_warps=8)):
        cfg = DecodeConfig(**{**asdict(base), **change})
        if cfg not in out:
            out.append(cfg)
    return out


def packed_block_m(rows: int, cfg: DecodeConfig) -> int:
    """BLOCK_M of the split kernel: the packed rows G * Sq rounded up to a power of two, at least 16
    (the MMA's M), at most MAX_BLOCK_M."""
    if cfg.block_m is not None:
        return cfg.block_m
    return min(MAX_BLOCK_M, max(16, next_pow2(rows)))


def decode_takes_bias(pattern) -> bool:
    """No bias, or one whose head and query dims broadcast (a key-padding row, one value)."""
    return pattern is None or tuple(pattern[1:3]) == (0, 0)


def decode_applies(op: str, q_shape: Sequence[Any], k_shape: Sequence[Any], pattern) -> bool:
    """The split-KV kernels take FlashAttention with Sq <= DECODE_MAX_QUERIES, Sk >=
    DECODE_MIN_KEYS (both concrete ints: the plan is made at run time) and no bias, one value
    broadcast everywhere or a key-padding row ([B|1, 1, 1, Sk|1]); a per-head or per-query bias
    stays on the one-kernel path."""
    sq, sk = q_shape[2], k_shape[2]
    if op != OP or not isinstance(sq, numbers.Integral) or not isinstance(sk, numbers.Integral):
        return False
    return sq <= DECODE_MAX_QUERIES and sk >= DECODE_MIN_KEYS and decode_takes_bias(pattern)


def _align(n: Any, cdiv=_cdiv) -> Any:
    return cdiv(n, WORKSPACE_ALIGN) * WORKSPACE_ALIGN


def workspace_layout(B: Any, H: Any, Sq: Any, Sk: Any, head_dim: int, cfg: DecodeConfig = DecodeConfig(),
                     cdiv=_cdiv) -> tuple[Any, Any, Any, Any]:
    """(Part offset, RowMax offset, RowSum offset, total bytes) of the partials, fp32: Part
    [B * H * Sq, n_split, D], RowMax and RowSum [B * H * Sq, n_split], n_split = cdiv(Sk,
    split_keys), each 256-byte aligned."""
    slots = (B * H) * Sq * cdiv(Sk, cfg.split_keys)
    part = _align(slots * (head_dim * 4), cdiv)
    row = _align(slots * 4, cdiv)
    return 0, part, part + row, part + row + row


def _bias_flags(pattern) -> tuple[bool, int, int]:
    """(has a bias, its batch dim full, its key dim full)."""
    if pattern is None:
        return False, 0, 0
    return True, int(pattern[0]), int(pattern[3])


def split_source(dtype: Any, head_dim: int, causal: bool, pattern, scale: float, sparsity: Sparsity,
                 block_m: int, cfg: DecodeConfig, bias_dtype: Any = None, pdl: bool = False,
                 direct: bool = False) -> KernelSource:
    """The split kernel of one specialization (dtype, D, causal, bias pattern and dtype, scale,
    windows, soft-cap, BLOCK_M and the tiles; the scale taken at float32, as_float32). ``pdl``: it
    lets the combine, a programmatic dependent launch (sm_90+), be scheduled as soon as it starts.
    ``direct``: the one-split form (every key in one program, ``cfg.split_keys`` unused), which
    writes o itself: arguments ``q, k, v[, bias], H, Hkv, Sq, Sk, o``, no combine."""
    dtype = norm_dtype(dtype)
    scale = as_float32(scale)
    has_bias, bias_b, bias_n = _bias_flags(pattern)
    ty = "*" + TRITON_TYPE[dtype]
    signature = {"Q": ty, "K": ty, "V": ty}
    constexprs: dict[str, Any] = {}
    if has_bias:
        signature["Bias"] = "*" + TRITON_TYPE[norm_dtype(bias_dtype or dtype)]
    else:
        constexprs["Bias"] = None
    signature.update({"H": "i32", "Hkv": "i32", "Sq": "i32", "Sk": "i32"})
    if direct:
        signature["Out"] = ty
        constexprs.update({"Part": None, "RowMax": None, "RowSum": None})
    else:
        signature.update({"Part": "*fp32", "RowMax": "*fp32", "RowSum": "*fp32"})
        constexprs["Out"] = None
    constexprs.update({
        "SCALE": scale, "HEAD_DIM": head_dim, "HEAD_DIM_PAD": next_pow2(head_dim),
        "BLOCK_M": block_m, "BLOCK_N": cfg.block_n, "SPLIT_KEYS": 0 if direct else cfg.split_keys,
        "CAUSAL": bool(causal), "HAS_BIAS": has_bias, "BIAS_B": bias_b, "BIAS_N": bias_n,
        "WINDOW_LEFT": sparsity.window_left, "WINDOW_RIGHT": sparsity.window_right,
        "SOFTCAP": sparsity.softcap, "PDL": bool(pdl) and not direct, "DIRECT": bool(direct),
    })
    bias_tag = "nobias" if not has_bias else f"bias_{'B' if bias_b else '1'}_1_1_{'Sk' if bias_n else '1'}"
    split_tag = "" if direct else f"_split{cfg.split_keys}"
    name = (f"flash_attention/{OP}/{dtype}/scale{scale:.6g}/fa_decode_{'direct' if direct else 'split'}_d{head_dim}_"
            f"{'causal' if causal else 'full'}_{bias_tag}{sparsity.tag()}_m{block_m}{split_tag}_"
            f"n{cfg.block_n}_{cfg.num_warps}warps_{cfg.num_stages}stages" + ("_pdl" if pdl and not direct else ""))
    return KernelSource(
        name=name, lang="triton", path=KERNEL_PATH, entry=SPLIT_ENTRY,
        n_inputs=3 + has_bias, n_extra=4, n_outputs=1 if direct else 3,
        signature=signature, constexprs=constexprs,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, pointer_align=16,
        meta={"op": OP, "kernel": "decode_direct" if direct else "decode_split", "dtype": dtype,
              "head_dim": head_dim, "causal": bool(causal), "scale": scale, "bias_pattern": pattern,
              "block_m": block_m, "config": asdict(cfg), "sparsity": asdict(sparsity)},
    )


def combine_source(dtype: Any, head_dim: int, cfg: DecodeConfig, pdl: bool = False) -> KernelSource:
    """The combine kernel: fp32 partials -> o in ``dtype``. ``pdl``: launched programmatically, it
    waits for the split kernel's partials itself (griddepcontrol.wait)."""
    dtype = norm_dtype(dtype)
    return KernelSource(
        name=(f"flash_attention/{OP}/{dtype}/fa_decode_combine_d{head_dim}_split{cfg.split_keys}_"
              f"s{cfg.combine_splits}_{cfg.combine_warps}warps" + ("_pdl" if pdl else "")),
        lang="triton", path=KERNEL_PATH, entry=COMBINE_ENTRY,
        n_inputs=3, n_extra=1, n_outputs=1,
        signature={"Part": "*fp32", "RowMax": "*fp32", "RowSum": "*fp32", "Sk": "i32",
                   "Out": "*" + TRITON_TYPE[dtype]},
        constexprs={"HEAD_DIM": head_dim, "HEAD_DIM_PAD": next_pow2(head_dim),
                    "SPLIT_KEYS": cfg.split_keys, "BLOCK_S": cfg.combine_splits, "PDL": bool(pdl)},
        num_warps=cfg.combine_warps, num_stages=1, pointer_align=16,
        meta={"op": OP, "kernel": "decode_combine", "dtype": dtype, "head_dim": head_dim, "config": asdict(cfg)},
    )


def decode_pdl(arch: Any) -> bool:
    """Whether a plan for target ``arch`` launches the combine programmatically (the ``_pdl``
    builds of both kernels): sm_90 and newer; None (an unknown target) and older ones do not."""
    return arch is not None and int(arch) >= 90


def prebuild_decode_sources(dtype: Any, head_dim: int, causal: bool, pattern, scale: float,
                            pdl: bool = False) -> list[KernelSource]:
    """The decode kernels of one specialization (no windows or soft-cap, bias in q's dtype) that
    ``optfuse kernels build`` compiles: per split size of SPLIT_SIZES, the split kernel at each
    BLOCK_M of Sq = 1 with PREBUILD_GROUPS, and the combine -- the sources decode_plan makes for
    those shapes with the default config (``pdl``: decode_pdl of the target)."""
    base = decode_config(dtype, head_dim)
    block_ms = sorted({packed_block_m(g, base) for g in PREBUILD_GROUPS})
    out = [split_source(dtype, head_dim, causal, pattern, scale, Sparsity(), bm, base, None, direct=True)
           for bm in block_ms]
    for size in SPLIT_SIZES:
        cfg = replace(base, split_keys=size)
        out += [split_source(dtype, head_dim, causal, pattern, scale, Sparsity(), bm, cfg, None, pdl)
                for bm in block_ms]
        out.append(combine_source(dtype, head_dim, cfg, pdl))
    return out


def split_params(B: Any, H: Any, Hkv: Any, Sq: Any, Sk: Any, group: int, block_m: int, cfg: DecodeConfig,
                 cdiv=_cdiv) -> LaunchParams:
    """One program per (row block, split, b * Hkv + kv head); ``group`` = H / Hkv (static: the
    num_heads / num_kv_heads attributes)."""
    return LaunchParams(grid=(cdiv(group * Sq, block_m) * cdiv(Sk, cfg.split_keys) * (B * Hkv), 1, 1),
                        block=(32 * cfg.num_warps, 1, 1), shared_mem=0, extra_args=[H, Hkv, Sq, Sk])


def direct_params(B: Any, H: Any, Hkv: Any, Sq: Any, Sk: Any, group: int, block_m: int, cfg: DecodeConfig,
                  cdiv=_cdiv) -> LaunchParams:
    """The direct kernel: one program per (row block, b * Hkv + kv head), every key."""
    return LaunchParams(grid=(cdiv(group * Sq, block_m) * (B * Hkv), 1, 1), block=(32 * cfg.num_warps, 1, 1),
                        shared_mem=0, extra_args=[H, Hkv, Sq, Sk])


def combine_params(B: Any, H: Any, Sq: Any, Sk: Any, cfg: DecodeConfig, pdl: bool = False) -> LaunchParams:
    """One program per output row (b, h, i); with ``pdl`` a programmatic dependent launch."""
    return LaunchParams(grid=((B * H) * Sq, 1, 1), block=(32 * cfg.combine_warps, 1, 1), shared_mem=0,
                        extra_args=[Sk], programmatic=bool(pdl))


def decode_plan(dtype: Any, shapes: Sequence[Sequence[int]], attrs: dict, head_dim: int, causal: bool, pattern,
                sparsity: Sparsity, bias_dtype: Any = None, cfg: DecodeConfig | None = None,
                pdl: bool = False) -> LaunchPlan:
    """The two-kernel plan at concrete shapes [q, k, v]: split (op inputs q, k, v[, bias] ->
    workspace), then combine (workspace -> op output 0); ``pdl`` (sm_90+): the combine a
    programmatic dependent launch, scheduled while the split kernel runs, its launch latency hidden."""
    q, k = shapes[0], shapes[1]
    B, H, Sq = q[0], q[1], q[2]
    Hkv, Sk = k[1], k[2]
    if H % Hkv:
        raise ValueError(f"{OP}: {H} query heads do not share {Hkv} kv heads evenly")
    group = H // Hkv
    if cfg is None:
        block_m = packed_block_m(group * Sq, decode_config(dtype, head_dim))
        cfg = decode_config(dtype, head_dim, _cdiv(group * Sq, block_m) * B * Hkv, Sk)
    block_m = packed_block_m(group * Sq, cfg)
    if _cdiv(Sk, cfg.split_keys) == 1:  # one split: the direct kernel writes o, nothing to combine
        direct = split_source(dtype, head_dim, causal, pattern, float(attrs["scale"]), sparsity, block_m, cfg,
                              bias_dtype, direct=True)
        return LaunchPlan([PlanStep(direct, direct_params(B, H, Hkv, Sq, Sk, group, block_m, cfg),
                                    [Buffer("input", i) for i in range(3 + (pattern is not None))],
                                    [Buffer("output", 0)])], 0)
    part, row_max, row_sum, total = workspace_layout(B, H, Sq, Sk, head_dim, cfg)
    partials = [Buffer("workspace", part), Buffer("workspace", row_max), Buffer("workspace", row_sum)]
    n_in = 3 + (pattern is not None)
    split = PlanStep(split_source(dtype, head_dim, causal, pattern, float(attrs["scale"]), sparsity, block_m, cfg,
                                  bias_dtype, pdl),
                     split_params(B, H, Hkv, Sq, Sk, group, block_m, cfg),
                     [Buffer("input", i) for i in range(n_in)], partials)
    combine = PlanStep(combine_source(dtype, head_dim, cfg, pdl), combine_params(B, H, Sq, Sk, cfg, pdl),
                       partials, [Buffer("output", 0)])
    return LaunchPlan([split, combine], total)


def decode_workspace_bound(min_q: Sequence[int], max_q: Sequence[int], max_k: Sequence[int], head_dim: int,
                           dtype: Any, cfg: DecodeConfig | None = None) -> int:
    """The largest decode workspace over a profile whose q runs from ``min_q`` to ``max_q`` and k
    up to ``max_k``: 0 when no shape of it decodes (Sq_min > DECODE_MAX_QUERIES or Sk_max <
    DECODE_MIN_KEYS), else the workspace at (B_max, min(Sq_max, DECODE_MAX_QUERIES), Sk_max) with
    the smallest split size (the most partials any split size makes there or below)."""
    if min_q[2] > DECODE_MAX_QUERIES or max_k[2] < DECODE_MIN_KEYS:
        return 0
    cfg = cfg or replace(decode_config(dtype, head_dim), split_keys=SPLIT_SIZES[0])
    return int(workspace_layout(max_q[0], max_q[1], min(max_q[2], DECODE_MAX_QUERIES), max_k[2], head_dim, cfg)[3])
