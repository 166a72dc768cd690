"""FlashAttention's split-KV decode (kernel_decode.py): when it runs, its configs, its kernel's
sources and launch parameters, the launch plan, its workspace and its state. launch.py dispatches
to it.

* :func:`decode_applies`: FlashAttention (not the block-sparse op) with Sq <= DECODE_MAX_QUERIES
  and Sk >= DECODE_MIN_KEYS, concrete, and no bias / one broadcast value / a key-padding row;
* :func:`decode_plan`: a :class:`LaunchPlan` of one step -- the split kernel (inputs q, k, v[,
  bias] -> the partials in the workspace, and o from the last split of each row block, counted
  in the plan state) or, where one split holds the cache, the direct kernel (q, k, v[, bias] ->
  o, no workspace, no state);
* :func:`workspace_layout` / :func:`state_bytes`: the partials' byte offsets and the workspace
  size, the counters' bytes -- + - * cdiv of the shapes (monotone in B, Sq and Sk, so a
  profile's largest plan is at its max shapes).

Split kernel arguments: ``q, k, v[, bias], H, Hkv, Sq, Sk (int32), Part, RowMax, RowSum, Count,
o``; grid ``cdiv(G * Sq, BLOCK_M) * cdiv(Sk, SPLIT_KEYS) * (B * Hkv)``. Direct kernel: ``q, k,
v[, bias], H, Hkv, Sq, Sk, o``; grid ``cdiv(G * Sq, BLOCK_M) * (B * Hkv)``.
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
#: Query rows per head up to which the split-KV kernels run (decode, speculative and chunked steps).
DECODE_MAX_QUERIES = 16
#: Keys from which they run; shorter caches stay on the one-kernel path (kernel.py /
#: kernel_sm90.cu).
DECODE_MIN_KEYS = 512
#: Keys per split of DecodeConfig's default (a sweep's base).
SPLIT_KEYS = 256
#: Keys per split the plan picks from (split_keys_for; each size is a kernel specialization), and
#: beyond them every key in one split (the direct kernel). A split writes G * Sq rows of D + 2
#: floats of partials, G * Sq / size of the K/V it reads (GQA 32/8, Sq = 1, 128 keys: 3 %), read
#: once more by the combine; a profile's workspace bound takes the smallest size, whose partials
#: are the most.
SPLIT_SIZES = (128, 256, 512, 1024, 2048, 4096)
#: The split kernel's programs the size leaves at least: about one per SM (132 on an H100 / H200).
#: One program per SM keeps enough K/V loads in flight (3 stages of 32 KB at D = 128) to reach the
#: memory's bandwidth, and longer splits mean fewer partials to combine.
MIN_PROGRAMS = 128
#: Split programs one wave holds: 3 an SM at D = 128 (about 70 KB of shared memory and 168
#: registers a thread each), 132 SMs. A grid a little over one wave (RESIDENT_PROGRAMS <
#: programs < 2 * RESIDENT_PROGRAMS) leaves its last programs to run alone on a few SMs: the
#: plan skips the split sizes that make one (B = 16, 16k keys, 512 programs of 4096 keys: 389 us
#: against 348 us for 128 programs of 16k, H100).
RESIDENT_PROGRAMS = 3 * 132
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
    """Tiles of the decode kernel. ``block_m`` None: from the packed rows (packed_block_m)."""

    split_keys: int = SPLIT_KEYS
    block_n: int = 64  # keys per step of a split (divides split_keys)
    num_warps: int = 4
    num_stages: int = 3  # depth of the K/V load pipeline
    block_m: int | None = None
    # the last split's combine loads a [combine_rows, combine_splits, D] fp32 tile a step: 4 x 16 x
    # 128 covers GQA 4:1 at Sq = 1 with 16 splits in one step (168 registers a thread, D = 128)
    combine_rows: int = 4
    combine_splits: int = 16

    def __post_init__(self) -> None:
        if self.split_keys % self.block_n:
            raise ValueError(f"DecodeConfig: block_n {self.block_n} does not divide split_keys {self.split_keys}")


def split_keys_for(units: int, Sk: int) -> int:
    """Keys per split for a split kernel of ``units`` = row blocks * B * Hkv programs per split:
    the largest of SPLIT_SIZES, or next_pow2(Sk) (one split: the direct kernel), whose grid units
    * cdiv(Sk, size) keeps MIN_PROGRAMS and is not a little over one wave (RESIDENT_PROGRAMS to
    twice that); the smallest size where none is. H100 sweep, CUDA-graph timings, 32/8 heads,
    D = 128: the rule's pick was the fastest size or within 1 % on every row (B = 1 at 1k..128k
    keys, B = 16 at 16k, B = 64 at 4k and 8k, B = 256 at 4k)."""
    best = SPLIT_SIZES[0]
    for size in SPLIT_SIZES + (next_pow2(Sk),):
        programs = units * _cdiv(Sk, size)
        if programs < MIN_PROGRAMS:
            break
        if not RESIDENT_PROGRAMS < programs < 2 * RESIDENT_PROGRAMS:
            best = size
        if programs == units:  # one split already: a longer one is the same direct kernel
            break
    return best


def decode_config(dtype: Any, head_dim: int, units: int | None = None, Sk: int | None = None) -> DecodeConfig:
    """fp16/bf16: 64-key blocks, 3 stages (D = 128: 16 KB each of K and V per block); D = 256:
    32-key blocks (the same bytes per block) and a combine step of 2 rows (2 x 16 x 256 fp32, as
    many as 4 x 16 x 128); fp32 (IEEE dots, whose operands and products stay in registers):
    16-key blocks, 2 stages, row blocks of 16 and a combine step of 1 row -- no spills at D = 64 to
    256 and Sq = 1 to 16 (64-96 registers; 32-key blocks or 64-row blocks spilled 0.2 to 10 KB a
    thread to the stack, cuobjdump). With the concrete ``units`` (row blocks * B * Hkv) and ``Sk``,
    split_keys_for's split size, else SPLIT_KEYS."""
    if norm_dtype(dtype) == "float32":
        cfg = DecodeConfig(block_n=16, num_stages=2, block_m=16, combine_rows=1)
    elif next_pow2(head_dim) > 128:
        cfg = DecodeConfig(block_n=32, combine_rows=2)
    else:
        cfg = DecodeConfig()
    if units is not None and Sk is not None:
        cfg = replace(cfg, split_keys=split_keys_for(units, Sk))
    return cfg


def candidate_decode_configs(dtype: Any, head_dim: int) -> list[DecodeConfig]:
    """What a benchmark sweep tries (the default first): split sizes 128 / 512 / 1024 / 2048 /
    4096, 32- and 128-key blocks, pipeline depths 2 / 4, 8 warps."""
    base = decode_config(dtype, head_dim)
    out = [base]
    for change in (dict(split_keys=128), dict(split_keys=512), dict(split_keys=1024), dict(split_keys=2048),
                   dict(split_keys=4096),
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


def state_bytes(B: Any, Hkv: Any, group: int, Sq: Any, block_m: int, cdiv=_cdiv) -> Any:
    """The plan state of the last-split-combines form: one int32 arrival counter per (b, kv head,
    row block), 256-byte aligned."""
    return _align((B * Hkv) * cdiv(group * Sq, block_m) * 4, cdiv)


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
                 block_m: int, cfg: DecodeConfig, bias_dtype: Any = None, direct: bool = False) -> KernelSource:
    """The split kernel of one specialization (dtype, D, causal, bias pattern and dtype, scale,
    windows, soft-cap, BLOCK_M and the tiles; the scale taken at float32, as_float32): arguments
    ``q, k, v[, bias], H, Hkv, Sq, Sk, Part, RowMax, RowSum, Count, o``. ``direct``: the one-split
    form (every key in one program, ``cfg.split_keys`` unused), which writes o with no partials:
    arguments ``q, k, v[, bias], H, Hkv, Sq, Sk, o``."""
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
        constexprs.update({"Part": None, "RowMax": None, "RowSum": None, "Count": None})
    else:
        signature.update({"Part": "*fp32", "RowMax": "*fp32", "RowSum": "*fp32", "Count": "*i32"})
    signature["Out"] = ty
    constexprs.update({
        "SCALE": scale, "HEAD_DIM": head_dim, "HEAD_DIM_PAD": next_pow2(head_dim),
        "BLOCK_M": block_m, "BLOCK_N": cfg.block_n, "SPLIT_KEYS": 0 if direct else cfg.split_keys,
        "CAUSAL": bool(causal), "HAS_BIAS": has_bias, "BIAS_B": bias_b, "BIAS_N": bias_n,
        "WINDOW_LEFT": sparsity.window_left, "WINDOW_RIGHT": sparsity.window_right,
        "SOFTCAP": sparsity.softcap, "DIRECT": bool(direct),
        "COMBINE_ROWS": cfg.combine_rows, "COMBINE_SPLITS": cfg.combine_splits,
    })
    bias_tag = "nobias" if not has_bias else f"bias_{'B' if bias_b else '1'}_1_1_{'Sk' if bias_n else '1'}"
    split_tag = "" if direct else f"_split{cfg.split_keys}_combine_r{cfg.combine_rows}s{cfg.combine_splits}"
    name = (f"flash_attention/{OP}/{dtype}/scale{scale:.6g}/fa_decode_{'direct' if direct else 'split'}_d{head_dim}_"
            f"{'causal' if causal else 'full'}_{bias_tag}{sparsity.tag()}_m{block_m}{split_tag}_"
            f"n{cfg.block_n}_{cfg.num_warps}warps_{cfg.num_stages}stages")
    return KernelSource(
        name=name, lang="triton", path=KERNEL_PATH, entry=SPLIT_ENTRY,
        n_inputs=3 + has_bias, n_extra=4, n_outputs=1 if direct else 5,
        signature=signature, constexprs=constexprs,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, pointer_align=16,
        meta={"op": OP, "kernel": "decode_direct" if direct else "decode_split", "dtype": dtype,
              "head_dim": head_dim, "causal": bool(causal), "scale": scale, "bias_pattern": pattern,
              "block_m": block_m, "config": asdict(cfg), "sparsity": asdict(sparsity)},
    )


def prebuild_decode_sources(dtype: Any, head_dim: int, causal: bool, pattern, scale: float) -> list[KernelSource]:
    """The decode kernels of one specialization (no windows or soft-cap, bias in q's dtype) that
    ``optfuse kernels build`` compiles: the direct kernel and, per split size of SPLIT_SIZES, the
    split kernel, each at every BLOCK_M of Sq = 1 with PREBUILD_GROUPS -- the sources decode_plan
    makes for those shapes with the default config."""
    base = decode_config(dtype, head_dim)
    block_ms = sorted({packed_block_m(g, base) for g in PREBUILD_GROUPS})
    out = [split_source(dtype, head_dim, causal, pattern, scale, Sparsity(), bm, base, None, direct=True)
           for bm in block_ms]
    for size in SPLIT_SIZES:
        cfg = replace(base, split_keys=size)
        out += [split_source(dtype, head_dim, causal, pattern, scale, Sparsity(), bm, cfg, None) for bm in block_ms]
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


def plan_config(dtype: Any, head_dim: int, B: int, H: int, Hkv: int, Sq: int, Sk: int) -> DecodeConfig:
    """The DecodeConfig decode_plan takes at these shapes when given none: decode_config with the
    split size of split_keys_for over the grid's row blocks * B * Hkv programs per split."""
    block_m = packed_block_m((H // Hkv) * Sq, decode_config(dtype, head_dim))
    return decode_config(dtype, head_dim, _cdiv((H // Hkv) * Sq, block_m) * B * Hkv, Sk)


def decode_plan(dtype: Any, shapes: Sequence[Sequence[int]], attrs: dict, head_dim: int, causal: bool, pattern,
                sparsity: Sparsity, bias_dtype: Any = None, cfg: DecodeConfig | None = None) -> LaunchPlan:
    """The one-kernel plan at concrete shapes [q, k, v]: the split kernel (op inputs q, k, v[,
    bias] -> partials in the workspace, counters in the state, op output 0 from each row block's
    last split), or the direct kernel where one split holds the cache (no workspace, no state)."""
    q, k = shapes[0], shapes[1]
    B, H, Sq = q[0], q[1], q[2]
    Hkv, Sk = k[1], k[2]
    if H % Hkv:
        raise ValueError(f"{OP}: {H} query heads do not share {Hkv} kv heads evenly")
    group = H // Hkv
    cfg = cfg or plan_config(dtype, head_dim, B, H, Hkv, Sq, Sk)
    block_m = packed_block_m(group * Sq, cfg)
    inputs = [Buffer("input", i) for i in range(3 + (pattern is not None))]
    scale = float(attrs["scale"])
    if _cdiv(Sk, cfg.split_keys) == 1:  # one split: the direct kernel writes o
        direct = split_source(dtype, head_dim, causal, pattern, scale, sparsity, block_m, cfg, bias_dtype, direct=True)
        return LaunchPlan([PlanStep(direct, direct_params(B, H, Hkv, Sq, Sk, group, block_m, cfg), inputs,
                                    [Buffer("output", 0)])], 0)
    part, row_max, row_sum, total = workspace_layout(B, H, Sq, Sk, head_dim, cfg)
    outputs = [Buffer("workspace", part), Buffer("workspace", row_max), Buffer("workspace", row_sum),
               Buffer("state", 0), Buffer("output", 0)]
    split = PlanStep(split_source(dtype, head_dim, causal, pattern, scale, sparsity, block_m, cfg, bias_dtype),
                     split_params(B, H, Hkv, Sq, Sk, group, block_m, cfg), inputs, outputs)
    return LaunchPlan([split], total, state_bytes(B, Hkv, group, Sq, block_m))


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
