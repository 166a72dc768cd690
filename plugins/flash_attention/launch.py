"""Kernel configs and launch parameters of FlashAttention (Triton kernel in kernel.py).

* ``kernel_config(op, dtype, attrs, static_shape)`` -> :class:`KernelSource`: scale and causal are
  compiled in, and so are the static facts ``static_shape`` gives: ``head_dim`` (D) and
  ``bias_shape`` (absent / None: no bias input; else the bias dims, where a dim that is statically 1
  broadcasts and any other value -- an int, -1, a symbolic dim -- is taken as full).
* ``launch_params(op, shapes, dtypes, attrs, cdiv=...)`` -> :class:`LaunchParams`, written with
  ``+ - *`` and ``cdiv`` over the dynamic dims (B, H, Hkv, Sq, Sk), so TensorRT QDP ``aot_impl``
  can call it with symbolic shapes.

Argument order (QDP): inputs q, k, v[, bias], extra int32 (H, Hkv, Sq, Sk), output o. Tensors are
contiguous; strides are derived from the shapes inside the kernel. H and Hkv are runtime
arguments (one integer division per program), so one artifact serves every head count.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from optfuse.kernels.artifact import KernelSource, LaunchParams
from optfuse.kernels.util import CUDA_DTYPE_CODE, TRITON_TYPE, cdiv as _cdiv, next_pow2, norm_dtype, static_int
from optfuse.spec import plugin_spec

KERNEL_PATH = str(Path(__file__).resolve().parent / "kernel.py")
ENTRY = "_flash_attention_fwd_kernel"
SM90_PATH = str(Path(__file__).resolve().parent / "kernel_sm90.cu")
SM90_ENTRY = "flash_attention_sm90"
#: The CUDA kernel's own head dims (wgmma tiles), a subset of the spec's head_dims.
SM90_HEAD_DIMS = (64, 128)
#: Persistent grid of the sm90 kernel: one CTA per SM of an H100 SXM / H200 (132 SMs); the
#: static shape's ``sm_count`` overrides it. A fixed number, because QDP launch parameters may
#: only combine the dynamic dims with + - * and cdiv (no min): a GPU with fewer SMs runs the
#: surplus CTAs as a short second wave.
SM90_GRID = 132
SM90_SMEM_LIMIT = 227 * 1024  # dynamic shared memory per block on sm_90
SPEC = plugin_spec(__file__)
OP = SPEC.op
DTYPES = SPEC.inputs[0].dtypes
HEAD_DIMS = tuple(SPEC.limits["head_dims"])
DEFAULT_CAUSAL = SPEC.attr("causal").default


@dataclass(frozen=True)
class FAConfig:
    block_m: int  # query rows per program
    block_n: int  # keys per inner step
    num_warps: int
    num_stages: int  # software-pipelining depth of the K/V loads
    pipeline_qk: bool = False  # issue q @ k^T of the next block before this block's softmax
    #: rescale acc only when a row max grows by > 2^8 (Triton: unmasked blocks; sm90: per warp,
    #: on by default there)
    lazy_rescale: bool = False
    #: "triton" (kernel.py, any arch) or "sm90" (kernel_sm90.cu: CUDA C++, wgmma, warp-specialized;
    #: sm_90 only). For sm90, block_m is 128 (num_warps 12: producer + 2 consumer warpgroups) or, at
    #: D = 64, 192 (num_warps 16: 3 consumers), block_n 128, num_stages the depth of the K/V ring.
    impl: str = "triton"
    pingpong: bool = True  # sm90: the two consumer warpgroups take turns issuing their MMAs
    q_buffers: int = 2  # sm90: Q tiles in shared memory (2: the next tile's Q loads early)
    #: sm90, D = 64: row sums of p on the tensor cores (P V with 8 extra columns of ones; the
    #: default there, sm90_config)
    ones_sum: bool = False
    #: sm90: K / V / Q through TMA (tensor maps built on the device, kept in the CTA's last output
    #: tile; cp.async where that tile is too short; on by default there, sm90_config; not with
    #: block_m 192 and a key-padding bias, _sm90_tma)
    tma: bool = False
    #: sm90: one "full" barrier per K/V ring stage (kernel_sm90.cu KV_ONE_FULL: one wait per key
    #: block instead of two; on by default from 3 stages, sm90_config)
    kv_one_full: bool = False
    #: sm90: the softmax's exponentials interleaved with their FFMAs and P packs (kernel_sm90.cu
    #: SOFTMAX_STREAM; on by default at D = 64 and for D = 128 non-causal without a key bias,
    #: sm90_config)
    softmax_stream: bool = False


#: Where the CUDA kernel is chosen on sm_90 -- per (head_dim, causal, key-padding bias) -- and its
#: defaults there (query rows per CTA: 128 = two consumer warpgroups, 192 = three; K/V ring depth;
#: turn-taking; Q buffers); None would keep the Triton kernel. H200, same run, interleaved rounds
#: (README "CUDA kernel", run 29): 1.03-1.79x the Triton kernel on every benchmark shape (least:
#: causal D = 64 at S = 512). Three consumer warpgroups at D = 64: +3-18 % non-causal
#: (run 17); causal, they pay from S = 4096 (+7-13 %) but cost 27 % at S = 512 (192-row tiles waste
#: a third of the diagonal block), so that kernel uses the third warpgroup only from Sq >= 4096
#: (kernel_sm90.cu SQ_THREE, decided at run time; with per-warpgroup key ranges, three at every S
#: measured 0.86x at S = 512, README "Tuning" 20). With key padding three warpgroups are not
#: measured. Two Q buffers also enable the staged (16-byte store) epilogue. TMA loads (last
#: field): 1.00-1.06x the cp.async ones on all 48 benchmark shapes and 1.01-1.07x on the mask rows
#: (runs 38-39), except non-causal D = 64 with key padding: 0.93x in two runs (39, 39b), so that
#: case keeps cp.async (README "Tuning" 34).
SM90_DEFAULTS: dict[tuple[int, bool, bool], tuple[int, int, bool, int, bool] | None] = {
    (64, False, False): (192, 3, True, 2, True),
    (64, True, False): (192, 3, True, 2, True),
    (64, False, True): (128, 3, True, 2, False),
    (64, True, True): (128, 3, True, 2, True),
    (128, False, False): (128, 2, True, 2, True),
    (128, True, False): (128, 2, True, 2, True),
    (128, False, True): (128, 2, True, 2, True),
    (128, True, True): (128, 2, True, 2, True),
}


def is_keypad(pattern) -> bool:
    """A bias that is a real input, not one broadcast value (some dim of its pattern is not 1)."""
    return _bias_mode(pattern) == 2


def sm90_config(head_dim: int, causal: bool, stages: int | None = None,
                pingpong: bool | None = None, q_buffers: int | None = None,
                lazy_rescale: bool = True, *, keypad: bool = False, block_m: int | None = None,
                tma: bool | None = None, kv_one_full: bool | None = None,
                softmax_stream: bool | None = None) -> FAConfig:
    """The CUDA kernel's config: 128 x 128 tiles with 3 warpgroups (producer + 2 consumers) or, at
    D = 64, 192 x 128 with 4; a K/V ring of ``stages`` (D = 128: 2-3 fit in shared memory; D = 64:
    2-4); unset fields from SM90_DEFAULTS. Lazy rescaling is on by default (README "CUDA kernel",
    runs 14-15: +1-3 % at D = 64 and for causal D = 128, neutral elsewhere), and at D = 64 the row
    sums come from the tensor cores (``ones_sum``; run 28: 1.00-1.06x, never slower). K / V / Q load
    through TMA (``tma``; SM90_DEFAULTS, README "Tuning" 34). With a ring of 3+ stages K and V share
    one "full" barrier per stage (``kv_one_full``; run 42: 1.01x at D = 64, geometric mean of 24
    shapes; with the 2-stage ring of D = 128 it cost 4-20 %: the next K waits for a V load that
    could only start one block earlier). The softmax runs as one instruction stream
    (``softmax_stream``; runs 48-49, geometric means per (causal, S range): 1.01-1.05x at D = 64,
    1.00-1.03x at D = 128 non-causal, neutral at D = 128 causal, 0.97-0.99x on the D = 128 mask rows
    in run 48: on for D = 64 and for D = 128 non-causal without a key bias)."""
    d_bm, d_stages, d_pp, d_qb, d_tma = (SM90_DEFAULTS.get((head_dim, bool(causal), keypad))
                                         or SM90_DEFAULTS.get((head_dim, bool(causal), True))
                                         or (128, 2 if head_dim > 64 else 3, True, 2, True))
    bm = d_bm if block_m is None else block_m
    st = d_stages if stages is None else stages
    return FAConfig(bm, 128, 4 * (bm // 64 + 1), st, impl="sm90",
                    pingpong=d_pp if pingpong is None else pingpong,
                    q_buffers=d_qb if q_buffers is None else q_buffers, lazy_rescale=lazy_rescale,
                    ones_sum=head_dim == 64, tma=d_tma if tma is None else tma,
                    kv_one_full=st >= 3 if kv_one_full is None else kv_one_full,
                    softmax_stream=(head_dim == 64 or not (causal or keypad)) if softmax_stream is None
                    else softmax_stream)


# Tuned on the H200 (README "Tuning"; bf16 sweep at S = 1024 and 4096, best geometric mean; fp16
# ranks the configs the same): ("half" = fp16/bf16, head_dim, causal) -> config. Other head dims
# fall back to _default_config.
TUNED: dict[tuple[str, int, bool], FAConfig] = {
    ("half", 64, False): FAConfig(128, 64, 8, 3),
    ("half", 64, True): FAConfig(64, 64, 4, 3),
    ("half", 128, False): FAConfig(128, 64, 8, 3),
    ("half", 128, True): FAConfig(128, 64, 8, 4),
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
    """The CUDA kernel takes fp16/bf16, D 64/128, a positive scale, and no bias, a scalar bias or
    a key-padding bias ([B|1, 1, 1, Sk]); it needs sm_90 (wgmma)."""
    return (arch == 90 and dtype in ("float16", "bfloat16") and head_dim in SM90_HEAD_DIMS
            and scale > 0 and (pattern is None or pattern[1:3] == (0, 0)))


def choose_config(dtype: Any, head_dim: int, causal: bool, *,
                  arch: int | None = None, pattern: tuple[int, int, int, int] | None = None,
                  scale: float = 1.0) -> FAConfig:
    """The config for a specialization. ``arch`` is the target (None: unknown, so the portable
    Triton kernel); on sm_90 the CUDA kernel is chosen wherever it applies (sm90_eligible)."""
    dtype = norm_dtype(dtype)
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"FlashAttention: head_dim {head_dim} not in {HEAD_DIMS}")
    keypad = is_keypad(pattern)
    if sm90_eligible(dtype, head_dim, pattern, scale, arch) and SM90_DEFAULTS.get((head_dim, bool(causal), keypad)):
        return sm90_config(head_dim, causal, keypad=keypad)
    cls = "float32" if dtype == "float32" else "half"
    return TUNED.get((cls, head_dim, bool(causal))) or _default_config(dtype, head_dim, causal)


def candidate_configs(dtype: Any, head_dim: int, causal: bool, arch: int | None = None) -> list[FAConfig]:
    """Configs a tuning sweep tries (the current choice first).
    FAConfig(block_m, block_n, num_warps, num_stages, pipeline_qk, lazy_rescale, impl, pingpong,
    q_buffers);
    with ``arch=90`` and a case the CUDA kernel takes, its consumer warpgroups (D = 64), ring
    depths, turn-taking, Q buffers and lazy rescaling."""
    if sm90_eligible(norm_dtype(dtype), head_dim, None, 1.0, arch):
        stages = (2, 3) if head_dim > 64 else (2, 3, 4)
        out = [sm90_config(head_dim, causal)]
        for bm in (128, 192) if head_dim == 64 else (128,):
            for qb in (2, 1):
                for st in stages:
                    for pp in (True, False):
                        for lazy in (True, False):
                            c = sm90_config(head_dim, causal, st, pp, qb, lazy, block_m=bm)
                            if c not in out and sm90_shared_mem(head_dim, c, 2) <= SM90_SMEM_LIMIT:
                                out.append(c)
        return out
    C = FAConfig
    if next_pow2(head_dim) <= 64:
        extra = [C(128, 64, 8, 3), C(128, 64, 4, 3), C(64, 64, 4, 3), C(128, 128, 4, 3),
                 C(128, 64, 8, 3, False, True)]
    else:
        extra = [C(128, 64, 8, 3), C(128, 64, 8, 4), C(128, 64, 8, 3, True), C(64, 64, 4, 3),
                 C(128, 128, 8, 2, True), C(128, 64, 8, 3, False, True)]
    out = [choose_config(dtype, head_dim, causal)]
    for c in extra:
        if c not in out:
            out.append(c)
    return out


def _check_op(op: Any) -> None:
    name = getattr(op, "op", op)
    if name != OP:
        raise ValueError(f"flash_attention plugin has no op {name!r}")


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


def _head_dim(static_shape: dict) -> int:
    if "head_dim" in static_shape:
        return static_int(static_shape["head_dim"], "head_dim")
    return static_int(static_shape["q"][-1], "head_dim")


def _config_for(dtype: str, head_dim: int, causal: bool, pattern, scale: float,
                static_shape: dict | None) -> FAConfig:
    arch = (static_shape or {}).get("arch")
    return choose_config(dtype, head_dim, causal,
                         arch=None if arch is None else int(arch), pattern=pattern, scale=scale)


def sm90_shared_mem(head_dim: int, cfg: FAConfig, bias_mode: int) -> int:
    """Dynamic shared memory of kernel_sm90.cu (its SMEM_BYTES): the Q tiles, the K/V ring, the
    ones tile (ones_sum), the key bias ring, the mbarriers, and 1024 bytes to align the base."""
    q = cfg.block_m * head_dim * 2
    kv = cfg.block_n * head_dim * 2
    bias = cfg.num_stages * cfg.block_n * 4 if bias_mode == 2 else 0
    ones = cfg.block_n * 128 if cfg.ones_sum else 0
    kv_full_bars = 1 if cfg.kv_one_full else 2  # K and V "full" barriers per stage, or one for both
    return (cfg.q_buffers * q + 2 * cfg.num_stages * kv + bias + ones
            + 8 * (2 * cfg.q_buffers + (kv_full_bars + 2) * cfg.num_stages) + 1024)


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


def _source_name(dtype: str, head_dim: int, causal: bool, pattern, scale: float, config_tag: str) -> str:
    bias_tag = "nobias" if pattern is None else "bias" + "".join(map(str, pattern))
    return (f"flash_attention/{OP}/{dtype}/d{head_dim}/{'causal' if causal else 'full'}/{bias_tag}/"
            f"scale{scale:.6g}/{config_tag}")


def _sm90_source(dtype: str, head_dim: int, causal: bool, pattern, scale: float, cfg: FAConfig,
                 bias_dtype: str) -> KernelSource:
    if not sm90_eligible(dtype, head_dim, pattern, scale, 90):
        raise ValueError(f"FlashAttention sm90 kernel: {dtype} D={head_dim} bias {pattern} "
                         f"scale {scale} not supported (use the Triton kernel)")
    if (cfg.block_m, cfg.block_n, cfg.num_warps) not in ((128, 128, 12), (192, 128, 16)):
        raise ValueError(f"FlashAttention sm90 kernel: config {cfg} (tiles are 128 x 128 with 12 "
                         f"warps or 192 x 128 with 16)")
    if cfg.block_m == 192 and head_dim != 64:
        raise ValueError(f"FlashAttention sm90 kernel: three consumer warpgroups (block_m 192) only at "
                         f"head_dim 64, not {head_dim}")
    if cfg.ones_sum and head_dim != 64:
        raise ValueError(f"FlashAttention sm90 kernel: ones_sum only at head_dim 64, not {head_dim}")
    mode = _bias_mode(pattern)
    scale_log2 = scale * 1.4426950408889634
    defines = {
        "OPTFUSE_DTYPE": str(CUDA_DTYPE_CODE[dtype]), "HEAD_DIM": str(head_dim),
        "CAUSAL": str(int(causal)), "BIAS_MODE": str(mode),
        "BIAS_BATCH": str(pattern[0] if mode == 2 else 0), "BIAS_DTYPE": str(CUDA_DTYPE_CODE[bias_dtype]),
        "SCALE_LOG2": f"{scale_log2!r}f", "BLOCK_N": str(cfg.block_n),
        "STAGES": str(cfg.num_stages), "PINGPONG": str(int(cfg.pingpong)),
        "Q_BUFFERS": str(cfg.q_buffers), "LAZY_RESCALE": "8" if cfg.lazy_rescale else "0",
        "CONSUMERS": str(cfg.block_m // 64),
        **({"ONES_SUM": "1"} if cfg.ones_sum else {}),
        **({"TMA": "1"} if _sm90_tma(cfg, mode) else {}),
        **({"KV_ONE_FULL": "1"} if cfg.kv_one_full else {}),
        **({"SOFTMAX_STREAM": "1"} if cfg.softmax_stream else {}),
    }
    return KernelSource(
        name=_source_name(dtype, head_dim, causal, pattern, scale,
                          f"sm90{'m192' if cfg.block_m == 192 else ''}s{cfg.num_stages}q{cfg.q_buffers}"
                          f"{'p' if cfg.pingpong else ''}"
                          f"{'l' if cfg.lazy_rescale else ''}"
                          f"{'o' if cfg.ones_sum else ''}"
                          f"{'t' if _sm90_tma(cfg, mode) else ''}"
                          f"{'k' if cfg.kv_one_full else ''}"
                          f"{'x' if cfg.softmax_stream else ''}"),
        lang="cuda",
        path=SM90_PATH,
        entry=SM90_ENTRY,
        n_inputs=3 + (pattern is not None),
        n_extra=5,
        n_outputs=1,
        defines=defines,
        threads=32 * cfg.num_warps,
        pointer_align=16,
        arch_suffix="a",
        meta={"op": OP, "dtype": dtype, "head_dim": head_dim, "causal": causal, "scale": scale,
              "bias_pattern": pattern, "bias_dtype": bias_dtype if pattern is not None else None,
              "config": asdict(cfg), "shared_mem": sm90_shared_mem(head_dim, cfg, mode)},
    )


def kernel_config(op: Any, dtype: Any, attrs: dict, static_shape: dict,
                  config: FAConfig | None = None) -> KernelSource:
    """What to compile: dtype is q's (k, v, o share it); bias may have its own
    (``static_shape['bias_dtype']``, default q's). ``static_shape['arch']`` (the target compute
    capability, when known) lets sm_90 pick the CUDA kernel (choose_config)."""
    _check_op(op)
    dtype = norm_dtype(dtype)
    head_dim = _head_dim(static_shape)
    scale = float(attrs["scale"])
    causal = bool(int(attrs.get("causal", DEFAULT_CAUSAL) or 0))
    pattern = bias_pattern(static_shape.get("bias_shape"))
    mode = _bias_mode(pattern)
    has_bias, scalar_bias = mode == 2, mode == 1
    cfg = config or _config_for(dtype, head_dim, causal, pattern, scale, static_shape)
    if cfg.impl == "sm90":
        return _sm90_source(dtype, head_dim, causal, pattern, scale, cfg,
                            norm_dtype(static_shape.get("bias_dtype") or dtype))
    ty = "*" + TRITON_TYPE[dtype]
    signature = {"Q": ty, "K": ty, "V": ty}
    constexprs: dict[str, Any] = {}
    if pattern is not None:
        bdt = norm_dtype(static_shape.get("bias_dtype") or dtype)
        signature["Bias"] = "*" + TRITON_TYPE[bdt]
    else:
        constexprs["Bias"] = None
    signature.update({"H": "i32", "Hkv": "i32", "Sq": "i32", "Sk": "i32", "Out": ty})
    flags = pattern or (0, 0, 0, 0)
    constexprs.update({
        "SCALE": scale, "HEAD_DIM": head_dim, "HEAD_DIM_PAD": next_pow2(head_dim),
        "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "CAUSAL": causal,
        "HAS_BIAS": has_bias, "BIAS_B": flags[0], "BIAS_H": flags[1], "BIAS_M": flags[2],
        "BIAS_N": flags[3], "SCALAR_BIAS": scalar_bias, "PIPELINE_QK": cfg.pipeline_qk,
        "LAZY_RESCALE": cfg.lazy_rescale,
    })
    return KernelSource(
        name=_source_name(dtype, head_dim, causal, pattern, scale,
                          f"m{cfg.block_m}n{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}"
                          f"{'p' if cfg.pipeline_qk else ''}{'l' if cfg.lazy_rescale else ''}"),
        lang="triton",
        path=KERNEL_PATH,
        entry=ENTRY,
        n_inputs=3 + (pattern is not None),
        n_extra=4,
        n_outputs=1,
        signature=signature,
        constexprs=constexprs,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        pointer_align=16,
        meta={"op": OP, "dtype": dtype, "head_dim": head_dim, "causal": causal, "scale": scale,
              "bias_pattern": flags if pattern is not None else None, "config": asdict(cfg)},
    )


def launch_params(op: Any, shapes: Sequence[Sequence[Any]], dtypes: Sequence[Any], attrs: dict,
                  cdiv=_cdiv, *, static_shape: dict | None = None,
                  config: FAConfig | None = None) -> LaunchParams:
    """One program per (BLOCK_M query rows, b, h): grid x = cdiv(Sq, BLOCK_M) * B * H.

    ``shapes`` = [q, k, v(, bias)] shapes: q [B, H, Sq, D], k/v [B, Hkv, Sk, D].
    """
    _check_op(op)
    dtype = norm_dtype(dtypes[0])
    q, k = shapes[0], shapes[1]
    B, H, Sq = q[0], q[1], q[2]
    Hkv, Sk = k[1], k[2]
    head_dim = _head_dim(static_shape) if static_shape else static_int(q[3], "head_dim")
    causal = bool(int(attrs.get("causal", DEFAULT_CAUSAL) or 0))
    bias_shape = (static_shape or {}).get("bias_shape", shapes[3] if len(shapes) > 3 else None)
    pattern = bias_pattern(bias_shape)
    cfg = config or _config_for(dtype, head_dim, causal, pattern, float(attrs["scale"]), static_shape)
    if cfg.impl == "sm90":
        # persistent: a fixed grid walks num_tiles = cdiv(Sq, block_m) * B * H tiles
        return LaunchParams(
            grid=(int((static_shape or {}).get("sm_count") or SM90_GRID), 1, 1),
            block=(32 * cfg.num_warps, 1, 1),
            shared_mem=sm90_shared_mem(head_dim, cfg, _bias_mode(pattern)),
            extra_args=[H, Hkv, Sq, Sk, cdiv(Sq, cfg.block_m) * (B * H)],
        )
    return LaunchParams(
        grid=(cdiv(Sq, cfg.block_m) * (B * H), 1, 1),
        block=(cfg.num_warps * 32, 1, 1),
        shared_mem=0,  # Triton's shared memory comes with the artifact (metadata.shared)
        extra_args=[H, Hkv, Sq, Sk],
    )


def check_shapes(shapes: Sequence[Sequence[int]], attrs: dict) -> None:
    """Concrete-shape checks (tests, launcher users): GQA, head dim, bias broadcast."""
    q, k, v = (list(s) for s in shapes[:3])
    B, H, Sq, D = q
    if len(k) != 4 or k[0] != B or k[3] != D or list(v) != list(k):
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
def prebuild_sources(arch: int | None = None) -> list[KernelSource]:
    """With ``arch`` (the build target), the kernel launch.py picks for it (sm_90: the CUDA
    kernel where it applies)."""
    out = []
    for dt in ("float16", "bfloat16"):
        for d in (64, 128):
            for causal in (0, 1):
                for bias in (None, (), (-1, 1, 1, -1)):
                    static = {"head_dim": d, "bias_shape": bias, "arch": arch}
                    out.append(kernel_config(OP, dt, {"scale": d ** -0.5, "causal": causal},
                                             static))
    return out
