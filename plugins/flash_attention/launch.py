"""Kernel configs and launch parameters of FlashAttention (Triton kernel in kernel.py).

* ``kernel_config(op, dtype, attrs, static_shape)`` -> :class:`KernelSource`: scale and causal are
  compiled in, and so are the static facts ``static_shape`` gives: ``head_dim`` (D) and
  ``bias_shape`` (absent / None: no bias input; else the bias dims, where a dim that is statically 1
  broadcasts and any other value -- an int, -1, a symbolic dim -- is taken as full).
* ``launch_params(op, shapes, dtypes, attrs, cdiv=...)`` -> :class:`LaunchParams`, written with
  ``+ - *`` and ``cdiv`` over the dynamic dims (B, H, Hkv, Sq, Sk), so TensorRT QDP ``aot_impl``
  can call it with symbolic shapes.
* ``launch_plan(op, shapes, dtypes, attrs, static_shape=...)`` -> :class:`LaunchPlan` or None: the
  split-KV decode kernels (kernel_decode.py, launch_decode.py) for Sq <= 16 over Sk >= 512 keys,
  with a workspace (``workspace_bytes`` over a TensorRT profile); where the CUDA kernel loads with
  TMA (sm_90), that kernel with its tensor maps encoded by the launcher (``HOST_MAPS``); None
  elsewhere, where the one kernel above runs. QDP AOT launches one kernel, so it always takes that
  one (with the maps built on the device).

Argument order (QDP): inputs q, k, v[, bias][, q_scale, k_scale, v_scale], extra int32 (H, Hkv,
Sq, Sk), output o. Tensors are contiguous; strides are derived from the shapes inside the kernel.
The FP8 form (E4M3 q, k, v, their float32 scales, o in ``output_dtype``; v as [B, Hkv, D, Skv])
runs the CUDA kernel's FP8 path on sm_90 at D = 128 with an fp16/bf16 o (no soft-cap), the Triton
kernel's FP8 branch (kernel.py) everywhere else; a float q whose o has another dtype runs the
Triton kernel. H and Hkv are runtime arguments (one integer division per program), so one artifact
serves every head count.

Past 500 lines because every entry point (kernel choice, both kernels' sources and launches, the
decode dispatch) reads the same bias-pattern, head-dim and sparsity facts defined here; the decode
kernels' own sources, configs and workspace are in launch_decode.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from optfuse.kernels.artifact import (Buffer, KernelSource, LaunchParams, LaunchPlan, PlanStep,
                                      TensorMapArg)
from optfuse.kernels.util import CUDA_DTYPE_CODE, TRITON_TYPE, as_float32, cdiv as _cdiv, next_pow2, norm_dtype, static_int
from optfuse.spec import plugin_spec

from .launch_decode import (DecodeConfig, decode_applies, decode_takes_bias, decode_plan,
                            decode_workspace_bound, prebuild_decode_sources)
from .sparsity import BLOCK_SPARSE, BLOCK_SPARSE_SPEC, LAYOUT_BLOCKS, OPS, Sparsity, sm90_defines, sparsity_of  # noqa: F401

KERNEL_PATH = str(Path(__file__).resolve().parent / "kernel.py")
ENTRY = "_flash_attention_fwd_kernel"
SM90_PATH = str(Path(__file__).resolve().parent / "kernel_sm90.cu")
SM90_ENTRY = "flash_attention_sm90"
#: The CUDA kernel's own head dims (wgmma tiles), a subset of the spec's head_dims; its FP8 path's
#: (one 128-byte swizzle chunk per E4M3 row) and that path's o dtypes.
SM90_HEAD_DIMS = (64, 128)
SM90_FP8_HEAD_DIMS = (128,)
SM90_FP8_OUTPUTS = ("float16", "bfloat16")
#: Persistent grid of the sm90 kernel: one CTA per SM of an H100 SXM / H200 (132 SMs); the
#: static shape's ``sm_count`` overrides it. A fixed number, because QDP launch parameters may
#: only combine the dynamic dims with + - * and cdiv (no min): a GPU with fewer SMs runs the
#: surplus CTAs as a short second wave.
SM90_GRID = 132
SM90_SMEM_LIMIT = 227 * 1024  # dynamic shared memory per block on sm_90
SM90_Q_BUFFERS = 2  # kernel_sm90.cu Q_BUFFERS: Q tiles in shared memory
SPEC = plugin_spec(__file__, "FlashAttention")
OP = SPEC.op
#: q's dtypes per op (the FP8 form is FlashAttention's only)
DTYPES = {op: plugin_spec(__file__, op).inputs[0].dtypes for op in OPS}
FP8 = "float8e4m3fn"
#: Targets with E4M3 tensor cores (sm_89 mma, sm_90 wgmma): the FP8 form builds for these (or an
#: unknown target), never for older ones.
FP8_ARCHS = (89, 90)
HEAD_DIMS = tuple(SPEC.limits["head_dims"])
DEFAULT_CAUSAL = SPEC.attr("causal").default
@dataclass(frozen=True)
class FAConfig:
    block_m: int  # query rows per program
    block_n: int  # keys per inner step
    num_warps: int
    num_stages: int  # software-pipelining depth of the K/V loads
    #: "triton" (kernel.py, any arch) or "sm90" (kernel_sm90.cu: CUDA C++, wgmma, warp-specialized;
    #: sm_90 only). For sm90, block_m is 128 (num_warps 12: producer + 2 consumer warpgroups) or, at
    #: D = 64, 192 (num_warps 16: 3 consumers), block_n 128, num_stages the depth of the K/V ring.
    impl: str = "triton"
    #: sm90, D = 64: row sums of p on the tensor cores (P V with 8 extra columns of ones)
    ones_sum: bool = False
    #: sm90: K / V / Q through TMA (tensor maps built on the device, kept in the CTA's last output
    #: tile; cp.async where that tile is too short; not with block_m 192 and a key-padding bias,
    #: _sm90_tma)
    tma: bool = False
    #: sm90: one "full" barrier per K/V ring stage (kernel_sm90.cu KV_ONE_FULL: one wait per key
    #: block instead of two; needs 3+ stages)
    kv_one_full: bool = False
    #: sm90: the softmax's exponentials interleaved with their FFMAs and P packs (kernel_sm90.cu
    #: SOFTMAX_STREAM)
    softmax_stream: bool = False


#: Where the CUDA kernel is chosen on sm_90 -- per (head_dim, causal, key-padding bias) -- and its
#: defaults there: (query rows per CTA: 128 = two consumer warpgroups, 192 = three; K/V ring depth;
#: TMA loads); None would keep the Triton kernel. The CUDA kernel measured 1.03-1.79x the Triton
#: kernel on every benchmark shape (README "Tried"). Three consumer warpgroups at D = 64: +3-18 %
#: non-causal; causal, they pay from S = 4096 (+7-13 %) but cost 27 % at S = 512, so that kernel
#: uses the third warpgroup only from Sq >= 4096 (kernel_sm90.cu SQ_THREE, decided at run time).
#: With key padding (non-causal), three warpgroups with cp.async loads: 1.01-1.13x two (the
#: three-warpgroup producer has no registers for TMA and the key bias). TMA loads: 1.00-1.07x the
#: cp.async ones, except non-causal D = 64 with key padding (0.93x with two warpgroups).
SM90_DEFAULTS: dict[tuple[int, bool, bool], tuple[int, int, bool] | None] = {
    (64, False, False): (192, 3, True),
    (64, True, False): (192, 3, True),
    (64, False, True): (192, 3, False),
    (64, True, True): (128, 3, True),
    (128, False, False): (128, 2, True),
    (128, True, False): (128, 2, True),
    (128, False, True): (128, 2, True),
    (128, True, True): (128, 2, True),
}


def is_keypad(pattern) -> bool:
    """A bias that is a real input, not one broadcast value (some dim of its pattern is not 1)."""
    return _bias_mode(pattern) == 2


#: The CUDA kernel's FP8 path (D = 128, two consumer warpgroups): K/V ring depth; E4M3 K and V^T
#: tiles are 16 KB each, so 3 stages fit beside the two Q slots (160 KB).
SM90_FP8_STAGES = 3


def sm90_config(head_dim: int, causal: bool, stages: int | None = None, *, keypad: bool = False,
                block_m: int | None = None, tma: bool | None = None, kv_one_full: bool | None = None,
                softmax_stream: bool | None = None, fp8: bool = False) -> FAConfig:
    """The CUDA kernel's config: 128 x 128 tiles with 3 warpgroups (producer + 2 consumers) or, at
    D = 64, 192 x 128 with 4; a K/V ring of ``stages`` (D = 128: 2-3 fit in shared memory; D = 64:
    2-4); unset fields from SM90_DEFAULTS. At D = 64 the row sums come from the tensor cores
    (``ones_sum``: 1.00-1.06x, never slower). With a ring of 3+ stages K and V share one "full"
    barrier per stage (``kv_one_full``: 1.01x at D = 64; with the 2-stage ring of D = 128 it cost
    4-20 %). The softmax runs as one instruction stream (``softmax_stream``) at D = 64 and for
    D = 128 non-causal without a key bias (1.01-1.05x and 1.00-1.03x there; neutral at D = 128
    causal, 0.97-0.99x on the D = 128 mask rows). ``fp8``: the FP8 path's defaults (128 rows,
    SM90_FP8_STAGES, TMA; no softmax stream: 0.97-0.99x there, README "Tried")."""
    if fp8:
        st = SM90_FP8_STAGES if stages is None else stages
        return FAConfig(128 if block_m is None else block_m, 128, 12, st, impl="sm90",
                        tma=True if tma is None else tma,
                        kv_one_full=st >= 3 if kv_one_full is None else kv_one_full)
    d_bm, d_stages, d_tma = (SM90_DEFAULTS.get((head_dim, bool(causal), keypad))
                             or SM90_DEFAULTS.get((head_dim, bool(causal), True))
                             or (128, 2 if head_dim > 64 else 3, True))
    bm = d_bm if block_m is None else block_m
    st = d_stages if stages is None else stages
    return FAConfig(bm, 128, 4 * (bm // 64 + 1), st, impl="sm90",
                    ones_sum=head_dim == 64, tma=d_tma if tma is None else tma,
                    kv_one_full=st >= 3 if kv_one_full is None else kv_one_full,
                    softmax_stream=(head_dim == 64 or not (causal or keypad)) if softmax_stream is None
                    else softmax_stream)


# Tuned on the H200 (README "Tried"; bf16 sweep at S = 1024 and 4096, best geometric mean; fp16
# ranks the configs the same): ("half" = fp16/bf16, head_dim, causal) -> config. Other head dims
# fall back to _default_config.
TUNED: dict[tuple[str, int, bool], FAConfig] = {
    ("half", 64, False): FAConfig(128, 64, 8, 3),
    ("half", 64, True): FAConfig(64, 64, 4, 3),
    ("half", 128, False): FAConfig(128, 64, 8, 3),
    ("half", 128, True): FAConfig(128, 64, 8, 4),
    # FP8 (Triton, E4M3 dots), H200 sweep at S = 4k / 16k (results/h200_fp8_sweep.json): 64 x 128,
    # 4 warps, 3 stages on every (D, causal): D = 128 694 / 719 TF/s non-causal, 584 / 690 causal
    # (128 x 128, 8 warps: 651 / 692, 546 / 680); D = 64 500 / 511, 422 / 504
    ("fp8", 64, False): FAConfig(64, 128, 4, 3),
    ("fp8", 64, True): FAConfig(64, 128, 4, 3),
    ("fp8", 128, False): FAConfig(64, 128, 4, 3),
    ("fp8", 128, True): FAConfig(64, 128, 4, 3),
}


def _default_config(dtype: str, head_dim: int, causal: bool) -> FAConfig:
    d_pad = next_pow2(head_dim)
    if dtype == "float32":
        # Correctness path (IEEE fp32 dot on the FMA units): small tiles, few registers.
        return FAConfig(32 if d_pad >= 256 else 64, 32, 4, 2)
    if d_pad <= 64:
        return FAConfig(64, 64, 4, 3) if causal else FAConfig(128, 64, 8, 3)
    if d_pad <= 128:
        return FAConfig(128, 64, 8, 4) if causal else FAConfig(128, 64, 8, 3)
    return FAConfig(64, 64, 4, 2)


def sm90_eligible(dtype: str, head_dim: int, pattern: tuple[int, int, int, int] | None,
                  scale: float, arch: int | None) -> bool:
    """The CUDA kernel takes fp16/bf16 at D 64/128, a positive scale, and no bias, a scalar bias or
    a key-padding bias ([B|1, 1, 1, Sk]); E4M3 (FP8) at D = 128 with no bias or a scalar one (and an
    fp16/bf16 o, no soft-cap: _choice_static). It needs sm_90 (wgmma)."""
    if dtype == FP8:
        # no key padding: with its bias ring that build spills (24-27 local stores in either role
        # at every register split tried), so FP8 key padding runs the Triton kernel
        return arch == 90 and head_dim in SM90_FP8_HEAD_DIMS and scale > 0 and _bias_mode(pattern) < 2
    return (arch == 90 and dtype in ("float16", "bfloat16") and head_dim in SM90_HEAD_DIMS
            and scale > 0 and (pattern is None or pattern[1:3] == (0, 0)))


#: Sliding windows up to this many keys run 128-row tiles at D = 64 (two consumer warpgroups):
#: 1.04-1.08x the 192-row tiles at w = 256 and w = 1024 (S = 4k), 0.93-0.98x from w = 1024 at
#: S = 16k, where the third warpgroup's overlap wins back its extra partial blocks.
SM90_SHORT_WINDOW = 512
#: Throughput of a 192-row tile (three consumer warpgroups) over a 128-row one, per SM, at D = 64
#: non-causal: 1.03-1.18x (the tuning sweep, README "Tried"); the estimate below takes 1.1.
SM90_THREE_SPEEDUP = 1.1


#: Query lengths up to this pick their rows per tile by the wave estimate (the dense table's
#: longer sequences keep the tuned 192-row tiles).
SM90_WAVES_MAX_SQ = 1024


def rows_per_tile_by_waves(B: int, H: int, Sq: int, sm_count: int = SM90_GRID) -> int:
    """128 or 192 query rows per tile at D = 64 when the batch, heads and query length are known:
    128 where its persistent waves (tiles over the CTAs, each wave as long as one tile) finish at
    least 5 % before the 192-row tiles' (the estimate's margin), for Sq <= SM90_WAVES_MAX_SQ.
    192-row tiles waste rows past Sq (197 tokens: 384 rows) and quantize into fewer, longer waves
    (B = 8, H = 12, S = 512: 288 tiles = 2.2 waves of 132)."""
    def finish(bm: int) -> float:
        tiles = -(-Sq // bm) * B * H
        return -(-tiles // sm_count) * bm / (SM90_THREE_SPEEDUP if bm == 192 else 1.0)
    return 128 if Sq <= SM90_WAVES_MAX_SQ and finish(128) <= 0.95 * finish(192) else 192


def choose_config(dtype: Any, head_dim: int, causal: bool, *,
                  arch: int | None = None, pattern: tuple[int, int, int, int] | None = None,
                  scale: float = 1.0, layout: bool = False, window_left: int = -1,
                  q_dims: tuple[int, int, int] | None = None, sm_count: int | None = None) -> FAConfig:
    """The config for a specialization. ``arch`` is the target (None: unknown, so the portable
    Triton kernel); on sm_90 the CUDA kernel is chosen wherever it applies (sm90_eligible).
    ``layout`` (BlockSparseAttention): tiles of 128 query rows on sm_90 (the Triton tiles all
    divide the 128-block layout); so do left windows up to SM90_SHORT_WINDOW keys. ``q_dims``
    (B, H, Sq), where all are known at build time: D = 64 non-causal without a mask or with key
    padding picks its rows per tile by rows_per_tile_by_waves (key padding, H100: 128-row tiles
    took 0.86-0.93x the time of 192-row ones where the rule picks them, results/h100_keypad_waves.json)."""
    dtype = norm_dtype(dtype)
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"FlashAttention: head_dim {head_dim} not in {HEAD_DIMS}")
    keypad = is_keypad(pattern)
    if dtype == FP8 and sm90_eligible(dtype, head_dim, pattern, scale, arch) and not layout:
        return sm90_config(head_dim, causal, keypad=keypad, fp8=True)
    if sm90_eligible(dtype, head_dim, pattern, scale, arch) and SM90_DEFAULTS.get((head_dim, bool(causal), keypad)):
        # a layout's 128-row blocks are the tiles of two consumer warpgroups
        short = 0 <= window_left < SM90_SHORT_WINDOW
        # a key-padding row shared by the batch ([1, 1, 1, Sk]) spills the three-consumer producer
        shared_row = keypad and pattern[0] == 0
        by_waves = (q_dims is not None and head_dim == 64 and not causal and (pattern is None or keypad)
                    and rows_per_tile_by_waves(*q_dims, sm_count or SM90_GRID) == 128)
        return sm90_config(head_dim, causal, keypad=keypad,
                           block_m=128 if layout or short or shared_row or by_waves else None)
    cls = "float32" if dtype == "float32" else "fp8" if dtype == FP8 else "half"
    return TUNED.get((cls, head_dim, bool(causal))) or _default_config(dtype, head_dim, causal)


def candidate_configs(dtype: Any, head_dim: int, causal: bool, arch: int | None = None) -> list[FAConfig]:
    """Configs a tuning sweep tries (the current choice first): the Triton kernel's tiles, warps
    and pipeline depths, or, with ``arch=90`` and a case the CUDA kernel takes, its consumer
    warpgroups (D = 64) and K/V ring depths."""
    if norm_dtype(dtype) == FP8 and sm90_eligible(FP8, head_dim, None, 1.0, arch):
        return [sm90_config(head_dim, causal, st, fp8=True) for st in (SM90_FP8_STAGES, 2, 4)]
    if norm_dtype(dtype) == FP8:
        C = FAConfig
        extra = [C(128, 128, 8, 3), C(128, 128, 8, 4), C(128, 128, 8, 2), C(128, 64, 8, 3), C(128, 64, 8, 4),
                 C(64, 128, 4, 3), C(64, 64, 4, 3), C(128, 256, 8, 2)]
        out = [choose_config(dtype, head_dim, causal)]
        return out + [c for c in extra if c not in out]
    if sm90_eligible(norm_dtype(dtype), head_dim, None, 1.0, arch):
        stages = (2, 3) if head_dim > 64 else (2, 3, 4)
        out = [sm90_config(head_dim, causal)]
        for bm in (128, 192) if head_dim == 64 else (128,):
            for st in stages:
                c = sm90_config(head_dim, causal, st, block_m=bm)
                if c not in out and sm90_shared_mem(head_dim, c, 2) <= SM90_SMEM_LIMIT:
                    out.append(c)
        return out
    C = FAConfig
    if next_pow2(head_dim) <= 64:
        extra = [C(128, 64, 8, 3), C(128, 64, 4, 3), C(64, 64, 4, 3), C(128, 128, 4, 3)]
    else:
        extra = [C(128, 64, 8, 3), C(128, 64, 8, 4), C(64, 64, 4, 3)]
    out = [choose_config(dtype, head_dim, causal)]
    for c in extra:
        if c not in out:
            out.append(c)
    return out


def output_dtype(op: str, dtype: str, attrs: dict) -> str:
    """o's dtype: FlashAttention's ``output_dtype`` (like_input: q's; an FP8 q needs one, else
    ValueError); BlockSparseAttention's is q's."""
    if op != OP:
        return dtype
    return SPEC.output_dtype(0, [dtype], attrs)


def _choice_static(dtype: str, out_dtype: str, static_shape: dict | None,
                   sparsity: Sparsity = Sparsity()) -> dict | None:
    """The static facts the config choice reads: o in another dtype than q runs the Triton kernel
    whatever the target (the CUDA kernel writes q's dtype, or with FP8 fp16/bf16, and its FP8 path
    has no soft-cap), so the target is hidden from the choice. An FP8 target older than sm_89 is a
    ValueError."""
    arch = (static_shape or {}).get("arch")
    if dtype == FP8 and arch is not None and int(arch) < min(FP8_ARCHS):
        raise ValueError(f"FlashAttention: FP8 (E4M3) needs sm_89 or newer, not sm_{arch}")
    if dtype == FP8:
        if out_dtype not in SM90_FP8_OUTPUTS or sparsity.softcap:
            return {**(static_shape or {}), "arch": None}
        return static_shape
    if out_dtype != dtype:
        return {**(static_shape or {}), "arch": None}
    return static_shape


def _check_op(op: Any) -> str:
    name = getattr(op, "op", op)
    if name not in OPS:
        raise ValueError(f"flash_attention plugin has no op {name!r}")
    return name


def bias_pattern(bias_shape: Sequence[Any] | None) -> tuple[int, int, int, int] | None:
    """(full_B, full_H, full_Sq, full_Sk) flags of a bias shape, left-padded to rank 4; None when
    there is no bias. A dim counts as broadcast only when it is statically 1."""
    if bias_shape is None:
        return None
    dims = list(bias_shape)
    if len(dims) > 4:
        raise ValueError(f"FlashAttention: bias rank {len(dims)} > 4")
    dims = [1] * (4 - len(dims)) + dims
    flags = []
    for d in dims:
        try:
            flags.append(0 if static_int(d) == 1 else 1)
        except ValueError:
            flags.append(1)
    return tuple(flags)  # type: ignore[return-value]


def kernel_bias_pattern(bias_shape: Sequence[Any] | None, static_shape: dict | None) -> tuple[int, int, int, int] | None:
    """bias_pattern for the one-kernel path, with a bias batch dim of 1 counted as per-batch where
    q's batch is a known 1 (``static_shape``'s q: both address the bias at batch 0). A batch-1
    run's key-padding row ``[1, 1, 1, Sk]`` then takes the per-batch kernel: at D = 64 three
    consumer warpgroups, where a row shared by a batch gets two (H100, B = 1, S = 16384: 1.30x the
    no-mask time with two, README "Masks")."""
    pattern = bias_pattern(bias_shape)
    dims = _known_q_dims(static_shape or {})
    # a real tensor only: one value broadcast everywhere ((0, 0, 0, 0), mode 1) stays a scalar
    if _bias_mode(pattern) == 2 and pattern[0] == 0 and dims is not None and dims[0] == 1:
        return (1,) + pattern[1:]
    return pattern


def _head_dim(static_shape: dict) -> int:
    if "head_dim" in static_shape:
        return static_int(static_shape["head_dim"], "head_dim")
    return static_int(static_shape["q"][-1], "head_dim")


def _config_for(dtype: str, head_dim: int, causal: bool, pattern, scale: float,
                static_shape: dict | None, sparsity: Sparsity = Sparsity()) -> FAConfig:
    static_shape = static_shape or {}
    arch = static_shape.get("arch")
    return choose_config(dtype, head_dim, causal,
                         arch=None if arch is None else int(arch), pattern=pattern, scale=scale,
                         layout=sparsity.layout, window_left=sparsity.window_left,
                         q_dims=_known_q_dims(static_shape), sm_count=static_shape.get("sm_count"))


def _known_q_dims(static_shape: dict) -> tuple[int, int, int] | None:
    """(B, H, Sq) of q where every one is a known int (a concrete run, or static dims at build)."""
    q = static_shape.get("q_shape") or static_shape.get("q")
    if not q or len(q) != 4:
        return None
    try:
        dims = tuple(static_int(d) for d in q[:3])
    except (ValueError, TypeError):
        return None
    return dims if all(d > 0 for d in dims) else None


def sm90_shared_mem(head_dim: int, cfg: FAConfig, bias_mode: int, elem_bytes: int = 2) -> int:
    """Dynamic shared memory of kernel_sm90.cu (its SMEM_BYTES): the two Q tiles (16-bit rows:
    they stage o), the K/V ring (``elem_bytes`` per element: 1 with FP8), the ones tile
    (ones_sum), the key bias ring, the mbarriers, and 1024 bytes to align the base."""
    q = cfg.block_m * head_dim * 2
    kv = cfg.block_n * head_dim * elem_bytes
    bias = cfg.num_stages * cfg.block_n * 4 if bias_mode == 2 else 0
    ones = cfg.block_n * 128 if cfg.ones_sum else 0
    kv_full_bars = 1 if cfg.kv_one_full else 2  # K and V "full" barriers per stage, or one for both
    return (SM90_Q_BUFFERS * q + 2 * cfg.num_stages * kv + bias + ones
            + 8 * (2 * SM90_Q_BUFFERS + (kv_full_bars + 2) * cfg.num_stages) + 1024)


def _bias_mode(pattern) -> int:
    """0: no bias input; 1: one value broadcast everywhere (the rewrite's 0 or a -inf); 2: a real
    tensor (key padding and the rest) -- both kernels specialise on it."""
    if pattern is None:
        return 0
    return 1 if not any(pattern) else 2


def _sm90_tma(cfg: FAConfig, bias_mode: int) -> bool:
    """TMA loads as configured, except with three consumer warpgroups and a key-padding bias: that
    build's producer has 32 registers, and with both load paths (TMA and the cp.async fallback)
    plus the bias loads ptxas spills (no default config has that combination)."""
    return cfg.tma and not (cfg.block_m == 192 and bias_mode == 2)


def _bias_tag(pattern) -> str:
    """``nobias``, ``bias_scalar`` (one broadcast value) or the bias dims, ``1`` where broadcast:
    ``bias_B_1_1_Sk`` (key padding)."""
    if pattern is None:
        return "nobias"
    if not any(pattern):
        return "bias_scalar"
    return "bias_" + "_".join(n if full else "1" for n, full in zip(("B", "H", "Sq", "Sk"), pattern))


def _source_name(dtype: str, head_dim: int, causal: bool, pattern, scale: float, cfg: FAConfig,
                 tma: bool = False, sparsity: Sparsity = Sparsity(), op: str = OP, host_maps: bool = False) -> str:
    """``flash_attention/<op>/<dtype>/scale<s>/fa_<impl>_d<D>_<causal|full>_<bias>[<sparsity>]_<config>``,
    the config in words: Triton ``128x64_8warps_3stages``; sm90 ``<2|3>wg_<n>stages`` and the
    options that are on (``tma``, ``host_maps``, ``ones_sum``, ``kv_one_full``, ``softmax_stream``);
    the sparsity as Sparsity.tag spells it (``_window1023_-1``, ``_softcap50``, ``_bsr``)."""
    if cfg.impl == "sm90":
        flags = [("tma", tma), ("host_maps", host_maps), ("ones_sum", cfg.ones_sum),
                 ("kv_one_full", cfg.kv_one_full), ("softmax_stream", cfg.softmax_stream)]
        config = "_".join([f"{cfg.block_m // 64}wg", f"{cfg.num_stages}stages"] + [n for n, on in flags if on])
    else:
        config = f"{cfg.block_m}x{cfg.block_n}_{cfg.num_warps}warps_{cfg.num_stages}stages"
    return (f"flash_attention/{op}/{dtype}/scale{scale:.6g}/fa_{cfg.impl}_d{head_dim}_"
            f"{'causal' if causal else 'full'}_{_bias_tag(pattern)}{sparsity.tag()}_{config}")


def sm90_tensor_maps(dtype: str, head_dim: int, layout: bool = False) -> tuple[TensorMapArg, ...]:
    """Q's, K's and V's tensor maps of a HOST_MAPS build, those kernel_sm90.cu builds on the device:
    [B * H, Sq, D] and [B * Hkv, Sk, D] in boxes of one 128-byte chunk by 64 query rows / 128 keys;
    FP8's V^T [B * Hkv, D, Sk] (rows Skv apart: 16-byte aligned) in boxes of 128 keys by D rows. The
    extents come from the extra args H, Hkv, Sq, Sk, num_tiles[, nnz], B."""
    batch = f"extra:{5 + int(layout)}"
    fp8 = dtype == FP8
    elem, chunk = ("uint8", 128) if fp8 else (dtype, 64)
    q = TensorMapArg(0, elem, "extra:2", head_dim, 64, chunk, heads=f"{batch}*extra:0")
    k = TensorMapArg(1, elem, "extra:3", head_dim, 128, chunk, heads=f"{batch}*extra:1")
    if fp8:
        v = TensorMapArg(2, elem, head_dim, "extra:3", head_dim, chunk, heads=f"{batch}*extra:1", row_align=16)
    else:
        v = TensorMapArg(2, elem, "extra:3", head_dim, 128, chunk, heads=f"{batch}*extra:1")
    return q, k, v


def _sm90_source(dtype: str, head_dim: int, causal: bool, pattern, scale: float, cfg: FAConfig,
                 bias_dtype: str, sparsity: Sparsity = Sparsity(), op: str = OP,
                 out_dtype: str | None = None, host_maps: bool = False) -> KernelSource:
    """The CUDA kernel's source; ``host_maps``: the HOST_MAPS build (TMA configs only), which takes
    B as one more extra arg and the tensor maps (sm90_tensor_maps) after o."""
    fp8 = dtype == FP8
    if not sm90_eligible(dtype, head_dim, pattern, scale, 90):
        raise ValueError(f"FlashAttention sm90 kernel: {dtype} D={head_dim} bias {pattern} "
                         f"scale {scale} not supported (use the Triton kernel)")
    if fp8 and (sparsity.softcap or sparsity.layout or cfg.block_m != 128 or cfg.ones_sum
                or cfg.softmax_stream):
        raise ValueError(f"FlashAttention sm90 kernel, FP8: 128-row tiles without soft-cap, layout, "
                         f"ones_sum or softmax stream ({cfg}, {sparsity})")
    if (cfg.block_m, cfg.block_n, cfg.num_warps) not in ((128, 128, 12), (192, 128, 16)):
        raise ValueError(f"FlashAttention sm90 kernel: config {cfg} (tiles are 128 x 128 with 12 "
                         f"warps or 192 x 128 with 16)")
    if cfg.block_m == 192 and head_dim != 64:
        raise ValueError(f"FlashAttention sm90 kernel: three consumer warpgroups (block_m 192) only at "
                         f"head_dim 64, not {head_dim}")
    if cfg.ones_sum and head_dim != 64:
        raise ValueError(f"FlashAttention sm90 kernel: ones_sum only at head_dim 64, not {head_dim}")
    if sparsity.layout and (cfg.block_m != 128 or sparsity.layout_block != 128):
        raise ValueError(f"FlashAttention sm90 kernel: a block layout needs 128-row tiles and 128-blocks "
                         f"(block_m {cfg.block_m}, block_size {sparsity.layout_block})")
    mode = _bias_mode(pattern)
    tma = _sm90_tma(cfg, mode)
    if host_maps and not tma:
        raise ValueError(f"FlashAttention sm90 kernel: host-encoded tensor maps need TMA loads ({cfg})")
    scale_log2 = scale * 1.4426950408889634
    out_dtype = out_dtype or dtype
    defines = {
        "OPTFUSE_DTYPE": str(CUDA_DTYPE_CODE[out_dtype]), "HEAD_DIM": str(head_dim),
        **({"FP8": "1"} if fp8 else {}),
        "CAUSAL": str(int(causal)), "BIAS_MODE": str(mode),
        "BIAS_BATCH": str(pattern[0] if mode == 2 else 0), "BIAS_DTYPE": str(CUDA_DTYPE_CODE[bias_dtype]),
        "SCALE_LOG2": f"{scale_log2!r}f", "STAGES": str(cfg.num_stages),
        "CONSUMERS": str(cfg.block_m // 64),
        **({"ONES_SUM": "1"} if cfg.ones_sum else {}),
        **({"TMA": "1"} if tma else {}),
        **({"HOST_MAPS": "1"} if host_maps else {}),
        **({"KV_ONE_FULL": "1"} if cfg.kv_one_full else {}),
        **({"SOFTMAX_STREAM": "1"} if cfg.softmax_stream else {}),
        **sm90_defines(sparsity, scale),
    }
    return KernelSource(
        name=_source_name(dtype if out_dtype == dtype else f"{dtype}_to_{out_dtype}", head_dim, causal,
                          pattern, scale, cfg, tma=tma, sparsity=sparsity, op=op, host_maps=host_maps),
        lang="cuda",
        path=SM90_PATH,
        entry=SM90_ENTRY,
        n_inputs=3 + (pattern is not None) + 3 * fp8 + 2 * sparsity.layout,
        n_extra=5 + sparsity.layout + host_maps,
        n_outputs=1,
        defines=defines,
        threads=32 * cfg.num_warps,
        pointer_align=16,
        arch_suffix="a",
        meta={"op": op, "dtype": dtype, "out_dtype": out_dtype, "head_dim": head_dim, "causal": causal,
              "scale": scale, "bias_pattern": pattern, "bias_dtype": bias_dtype if pattern is not None else None,
              "config": asdict(cfg), "shared_mem": sm90_shared_mem(head_dim, cfg, mode, 1 if fp8 else 2),
              "sparsity": asdict(sparsity)},
        tensor_maps=sm90_tensor_maps(dtype, head_dim, sparsity.layout) if host_maps else (),
    )


def kernel_config(op: Any, dtype: Any, attrs: dict, static_shape: dict,
                  config: FAConfig | None = None, *, host_maps: bool = False) -> KernelSource:
    """What to compile: dtype is q's (k, v, o share it); bias may have its own
    (``static_shape['bias_dtype']``, default q's). ``static_shape['arch']`` (the target compute
    capability, when known) lets sm_90 pick the CUDA kernel (choose_config). ``host_maps``: where
    that is the CUDA kernel with TMA loads, its HOST_MAPS build (launch_plan's), else ValueError."""
    name = _check_op(op)
    dtype = norm_dtype(dtype)
    head_dim = _head_dim(static_shape)
    scale = as_float32(attrs["scale"])
    causal = bool(int(attrs.get("causal", DEFAULT_CAUSAL) or 0))
    sp = sparsity_of(name, attrs, static_shape)
    pattern = kernel_bias_pattern(static_shape.get("bias_shape"), static_shape)
    mode = _bias_mode(pattern)
    has_bias, scalar_bias = mode == 2, mode == 1
    out_dtype = output_dtype(name, dtype, attrs)
    fp8 = dtype == FP8
    if fp8 and name != OP:
        raise ValueError(f"{name}: no FP8 form (FlashAttention has one)")
    cfg = config or _config_for(dtype, head_dim, causal, pattern, scale,
                                _choice_static(dtype, out_dtype, static_shape, sp), sp)
    if cfg.impl == "sm90" and (out_dtype not in SM90_FP8_OUTPUTS if fp8 else out_dtype != dtype):
        raise ValueError(f"FlashAttention sm90 kernel: {dtype} in, {out_dtype} out not supported (use the Triton kernel)")
    if cfg.impl == "sm90":
        return _sm90_source(dtype, head_dim, causal, pattern, scale, cfg,
                            norm_dtype(static_shape.get("bias_dtype") or out_dtype), sp, name, out_dtype,
                            host_maps)
    if host_maps:
        raise ValueError(f"{name}: host-encoded tensor maps are the sm_90 CUDA kernel's ({cfg})")
    if sp.layout and (sp.layout_block % cfg.block_m or sp.layout_block % cfg.block_n):
        raise ValueError(f"{name}: Triton tiles {cfg.block_m} x {cfg.block_n} do not divide the "
                         f"{sp.layout_block}-blocks of the layout")
    if sp.layout and config is None:
        # the layout loop holds two key blocks per listed block: deeper pipelines than 2 exceed
        # shared memory (4 stages at D = 128: 288 KB)
        cfg = dataclasses.replace(cfg, num_stages=min(cfg.num_stages, 2))
    ty = "*" + TRITON_TYPE[dtype]
    signature = {"Q": ty, "K": ty, "V": ty}
    constexprs: dict[str, Any] = {}
    if pattern is not None:
        bdt = norm_dtype(static_shape.get("bias_dtype") or (out_dtype if fp8 else dtype))  # FP8: o's
        signature["Bias"] = "*" + TRITON_TYPE[bdt]
    else:
        constexprs["Bias"] = None
    scales = ("QScale", "KScale", "VScale")
    if fp8:
        signature.update({s: "*fp32" for s in scales})
    else:
        constexprs.update({s: None for s in scales})
    if sp.layout:
        signature.update({"Offsets": "*i32", "Indices": "*i32"})
    else:
        constexprs.update({"Offsets": None, "Indices": None})
    signature.update({"H": "i32", "Hkv": "i32", "Sq": "i32", "Sk": "i32"})
    if sp.layout:
        signature["Nnz"] = "i32"
    else:
        constexprs["Nnz"] = None
    signature["Out"] = "*" + TRITON_TYPE[out_dtype]
    flags = pattern or (0, 0, 0, 0)
    constexprs.update({
        "SCALE": scale, "HEAD_DIM": head_dim, "HEAD_DIM_PAD": next_pow2(head_dim),
        "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "CAUSAL": causal,
        "HAS_BIAS": has_bias, "BIAS_B": flags[0], "BIAS_H": flags[1], "BIAS_M": flags[2],
        "BIAS_N": flags[3], "SCALAR_BIAS": scalar_bias,
        "WINDOW_LEFT": sp.window_left, "WINDOW_RIGHT": sp.window_right, "SOFTCAP": sp.softcap,
        "LAYOUT": sp.layout, "LAYOUT_HEADS": sp.layout_heads, "LAYOUT_BLOCK": sp.layout_block,
    })
    dtype_tag = dtype if out_dtype == dtype else f"{dtype}_to_{out_dtype}"
    return KernelSource(
        name=_source_name(dtype_tag, head_dim, causal, pattern, scale, cfg, sparsity=sp, op=name),
        lang="triton",
        path=KERNEL_PATH,
        entry=ENTRY,
        n_inputs=3 + (pattern is not None) + 3 * fp8 + 2 * sp.layout,
        n_extra=4 + sp.layout,
        n_outputs=1,
        signature=signature,
        constexprs=constexprs,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        pointer_align=16,
        meta={"op": name, "dtype": dtype, "out_dtype": out_dtype, "head_dim": head_dim, "causal": causal,
              "scale": scale, "bias_pattern": flags if pattern is not None else None, "config": asdict(cfg),
              "sparsity": asdict(sp)},
    )


def launch_params(op: Any, shapes: Sequence[Sequence[Any]], dtypes: Sequence[Any], attrs: dict,
                  cdiv=_cdiv, *, static_shape: dict | None = None,
                  config: FAConfig | None = None) -> LaunchParams:
    """One program per (BLOCK_M query rows, b, h): grid x = cdiv(Sq, BLOCK_M) * B * H.

    ``shapes`` = [q, k, v(, bias)] shapes: q [B, H, Sq, D], k/v [B, Hkv, Sk, D];
    BlockSparseAttention: [q, k, v(, bias), block_offsets, block_indices] -- its extra argument
    after Sk (Triton) or num_tiles (CUDA) is nnz, the row length of block_indices.
    """
    name = _check_op(op)
    dtype = norm_dtype(dtypes[0])
    q, k = shapes[0], shapes[1]
    B, H, Sq = q[0], q[1], q[2]
    Hkv, Sk = k[1], k[2]
    head_dim = _head_dim(static_shape) if static_shape else static_int(q[3], "head_dim")
    causal = bool(int(attrs.get("causal", DEFAULT_CAUSAL) or 0))
    sp = sparsity_of(name, attrs, static_shape)
    layout = sp.layout
    n_tensors = len(shapes) - 2 * layout
    bias_shape = (static_shape or {}).get("bias_shape", shapes[3] if n_tensors > 3 else None)
    pattern = kernel_bias_pattern(bias_shape, static_shape)
    choice = _choice_static(dtype, output_dtype(name, dtype, attrs), static_shape, sp)
    cfg = config or _config_for(dtype, head_dim, causal, pattern, as_float32(attrs["scale"]), choice, sp)
    nnz = [shapes[-1][1]] if layout else []
    if cfg.impl == "sm90":
        # persistent: a fixed grid walks num_tiles = cdiv(Sq, block_m) * B * H tiles
        return LaunchParams(
            grid=(int((static_shape or {}).get("sm_count") or SM90_GRID), 1, 1),
            block=(32 * cfg.num_warps, 1, 1),
            shared_mem=sm90_shared_mem(head_dim, cfg, _bias_mode(pattern), 1 if dtype == FP8 else 2),
            extra_args=[H, Hkv, Sq, Sk, cdiv(Sq, cfg.block_m) * (B * H)] + nnz,
        )
    return LaunchParams(
        grid=(cdiv(Sq, cfg.block_m) * (B * H), 1, 1),
        block=(cfg.num_warps * 32, 1, 1),
        shared_mem=0,  # Triton's shared memory comes with the artifact (metadata.shared)
        extra_args=[H, Hkv, Sq, Sk] + nnz,
    )


def launch_plan(op: Any, shapes: Sequence[Sequence[Any] | None], dtypes: Sequence[Any], attrs: dict, cdiv=_cdiv,
                *, static_shape: dict | None = None, decode: DecodeConfig | None = None,
                host_maps: bool = True) -> LaunchPlan | None:
    """At concrete shapes: the split-KV decode plan (launch_decode.decode_plan: one kernel, its
    partials in the workspace, its arrival counters in the plan state) where
    launch_decode.decode_applies; else, where the one kernel of kernel_config is the CUDA kernel with
    TMA loads, that kernel's HOST_MAPS build as a plan of one step (host_maps_plan: about 1 us a
    launch that each CTA spends building its maps, H100); else None: the one kernel of kernel_config
    / launch_params runs. ``shapes`` are concrete: [q, k, v(, bias)] (None for an absent bias), then
    an FP8 form's scales and a layout's arrays in spec order. ``decode``: that config for the decode
    plan, None where it does not apply. ``host_maps=False``: no HOST_MAPS plan (an A/B of the two
    map sources)."""
    name = _check_op(op)
    st = static_shape or {}
    shapes = list(shapes)
    bias_shape = st.get("bias_shape", shapes[3] if len(shapes) > 3 else None)
    pattern = bias_pattern(bias_shape)
    dtype = norm_dtype(dtypes[0])
    # the decode kernels are not FP8 and write o in q's dtype
    if (dtype != FP8 and output_dtype(name, dtype, attrs) == dtype
            and decode_applies(name, shapes[0], shapes[1], pattern)):
        head_dim = _head_dim(st) if st else static_int(shapes[0][3], "head_dim")
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"FlashAttention: head_dim {head_dim} not in {HEAD_DIMS}")
        causal = bool(int(attrs.get("causal", DEFAULT_CAUSAL) or 0))
        present = [[int(d) for d in s] for s in shapes[:3]]
        return decode_plan(dtype, present, attrs, head_dim, causal, pattern,
                           sparsity_of(name, attrs, st), st.get("bias_dtype"), decode)
    if decode is not None or not host_maps:
        return None
    return host_maps_plan(name, shapes, dtypes, attrs, st, cdiv)


def _loads_with_tma(src: KernelSource) -> bool:
    """Whether ``src`` is the CUDA kernel loading with TMA: the configs that have a HOST_MAPS build."""
    return src.lang == "cuda" and "TMA" in src.defines


def host_maps_plan(op: str, shapes: Sequence[Sequence[Any] | None], dtypes: Sequence[Any], attrs: dict,
                   static_shape: dict, cdiv=_cdiv, config: FAConfig | None = None) -> LaunchPlan | None:
    """The one kernel of kernel_config (q's dims from ``shapes`` where ``static_shape`` has none:
    the choice is the one-kernel path's at these shapes; ``config``: that config instead) as its
    HOST_MAPS build, with B appended to its extra args; None where that kernel is not the CUDA
    kernel with TMA loads, or a dim is 0 (no tensor map has an empty extent) or not known (symbolic
    shapes: the plan is made at run time)."""
    try:
        q, k = [static_int(d) for d in shapes[0]], [static_int(d) for d in shapes[1]]
    except ValueError:
        return None
    if min(q[:3]) <= 0 or k[2] <= 0:
        return None
    st = dict(static_shape)
    st.setdefault("head_dim", q[3])
    if _known_q_dims(st) is None:
        st["q_shape"] = q
    if not _loads_with_tma(kernel_config(op, dtypes[0], attrs, st, config)):
        return None
    src = kernel_config(op, dtypes[0], attrs, st, config, host_maps=True)
    params = launch_params(op, shapes, dtypes, attrs, cdiv, config=config, static_shape=st)
    params.extra_args.append(q[0])
    present = [i for i, s in enumerate(shapes) if s is not None]
    return LaunchPlan([PlanStep(src, params, [Buffer("input", i) for i in present], [Buffer("output", 0)])])


def workspace_bytes(op: Any, min_shapes: Sequence[Sequence[int] | None], max_shapes: Sequence[Sequence[int] | None],
                    dtypes: Sequence[Any], attrs: dict) -> int:
    """The workspace ``launch_plan`` needs at any shape of a profile [min_shapes, max_shapes]
    (TensorRT asks once, at build time): the decode partials at the largest shape that decodes,
    0 where no shape does (or the op / bias pattern never does)."""
    name = _check_op(op)
    max_shapes = list(max_shapes)
    bias = max_shapes[3] if len(max_shapes) > 3 else None
    pattern = bias_pattern(bias)
    dtype = norm_dtype(dtypes[0])
    if name != OP or not decode_takes_bias(pattern) or dtype == FP8 or output_dtype(name, dtype, attrs) != dtype:
        return 0
    return decode_workspace_bound([int(d) for d in min_shapes[0]], [int(d) for d in max_shapes[0]],
                                  [int(d) for d in max_shapes[1]], static_int(max_shapes[0][3], "head_dim"),
                                  norm_dtype(dtypes[0]))


def check_shapes(shapes: Sequence[Sequence[int]], attrs: dict, fp8: bool = False) -> None:
    """Concrete-shape checks (tests, launcher users): GQA, head dim, bias broadcast; ``fp8``: v is
    [B, Hkv, D, Skv], Skv = Sk rounded up to a multiple of 16 (spec.yaml)."""
    q, k, v = (list(s) for s in shapes[:3])
    B, H, Sq, D = q
    want_v = [k[0], k[1], k[3], -(-k[2] // 16) * 16] if fp8 and len(k) == 4 else list(k)
    if len(k) != 4 or k[0] != B or k[3] != D or list(v) != want_v:
        raise ValueError(f"FlashAttention: q{q} k{k} v{v} do not fit [B,H,Sq,D] / [B,Hkv,Sk,D]")
    if H != int(attrs["num_heads"]) or k[1] != int(attrs["num_kv_heads"]) or H % k[1]:
        raise ValueError(f"FlashAttention: heads {H}/{k[1]} vs attrs {attrs}")
    if D not in HEAD_DIMS:
        raise ValueError(f"FlashAttention: head_dim {D} not in {HEAD_DIMS}")
    if len(shapes) > 3 and shapes[3] is not None:
        b = [1] * (4 - len(shapes[3])) + list(shapes[3])
        for have, full in zip(b, (B, H, Sq, k[2])):
            if have not in (1, full):
                raise ValueError(f"FlashAttention: bias {list(shapes[3])} does not broadcast to "
                                 f"{[B, H, Sq, k[2]]}")


#: Specializations ``optfuse kernels build`` compiles ahead of time: half dtypes, the head dims of
#: common models, causal or not, no bias / scalar bias (what the rewrite emits when the graph has
#: none) / key-padding bias [B, 1, 1, Sk], at the usual 1/sqrt(D) scale.
PREBUILD_BIASES = (None, (), (-1, 1, 1, -1))
#: The decode plan's biases: those, and the key-padding row a run with B = 1 has ([1, 1, 1, Sk]:
#: its own split kernels, BIAS_B 0), the plan being made at concrete shapes.
PREBUILD_DECODE_BIASES = PREBUILD_BIASES + ((1, 1, 1, -1),)
#: o's dtypes of the prebuilt FP8 form: the base precisions precision fp8 gives FlashAttention nodes
PREBUILD_FP8_OUTPUTS = ("float16", "bfloat16")


#: q dims whose rows-per-tile choice differs from the one with q unknown (rows_per_tile_by_waves
#: picks 128-row tiles at D = 64 for so few tiles): with None, every config a plan can choose.
PLAN_Q_PROBES = (None, (1, 1, 64, 64))


def plan_sources(op: str, dtype: str, attrs: dict, static_shape: dict) -> list[KernelSource]:
    """The HOST_MAPS builds launch_plan can run for this instance (over PLAN_Q_PROBES: with q's dims
    the choice of rows per tile may change), each once; none off sm_90 or without TMA loads."""
    out: dict[str, KernelSource] = {}
    for q in PLAN_Q_PROBES:
        st = {**static_shape, **({"q_shape": list(q)} if q else {})}
        if _loads_with_tma(kernel_config(op, dtype, attrs, st)):
            twin = kernel_config(op, dtype, attrs, st, host_maps=True)
            out.setdefault(twin.name, twin)
    return list(out.values())


def prebuild_sources(arch: int | None = None) -> list[KernelSource]:
    """With ``arch`` (the build target), the kernel launch.py picks for it (sm_90: the CUDA
    kernel where it applies, and the HOST_MAPS builds of its run-time plans, plan_sources); then
    the split-KV decode kernels of the same specializations (launch_decode.prebuild_decode_sources:
    every split size, Sq = 1 with MHA and GQA up to 16:1), each name once; and where ``arch`` has
    E4M3 tensor cores (or is unknown), the FP8 form of the one kernel with o in each
    PREBUILD_FP8_OUTPUTS dtype (and on sm_90 its plans' builds)."""
    out = []
    plans: dict[str, KernelSource] = {}
    decode: dict[str, KernelSource] = {}
    for dt in ("float16", "bfloat16"):
        for d in (64, 128):
            for causal in (0, 1):
                attrs = {"scale": d ** -0.5, "causal": causal}
                for bias in PREBUILD_BIASES:
                    static = {"head_dim": d, "bias_shape": bias, "arch": arch}
                    out.append(kernel_config(OP, dt, attrs, static))
                    for src in plan_sources(OP, dt, attrs, static):
                        plans.setdefault(src.name, src)
                for bias in PREBUILD_DECODE_BIASES:
                    for src in prebuild_decode_sources(dt, d, bool(causal), bias_pattern(bias), attrs["scale"]):
                        decode.setdefault(src.name, src)
    if arch is None or int(arch) >= min(FP8_ARCHS):
        for out_dt in PREBUILD_FP8_OUTPUTS:
            for d in (64, 128):
                for causal in (0, 1):
                    attrs = {"scale": d ** -0.5, "causal": causal, "output_dtype": out_dt}
                    for bias in PREBUILD_BIASES:
                        static = {"head_dim": d, "bias_shape": bias, "arch": arch}
                        out.append(kernel_config(OP, FP8, attrs, static))
                        for src in plan_sources(OP, FP8, attrs, static):
                            plans.setdefault(src.name, src)
    return out + list(plans.values()) + list(decode.values())
