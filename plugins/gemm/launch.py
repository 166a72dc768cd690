"""Kernel configs and launch parameters of the GEMM plugin (GemmEpilogue, GatedGemm).

* ``static_shape(op, shapes, dtypes)`` -> the compile-time facts: ``N`` (W's rows), ``K`` (A's last
  dim), ``bias_mode`` (``none`` / ``scalar`` / ``vector``), ``residual_mode`` (``none`` / ``scalar`` /
  ``full``), the dtypes of bias and residual, and with FP8 A and weights the weight scales' modes
  (``w_scale_mode``, GatedGemm's ``w_up_scale_mode``: ``scalar`` / ``vector``; left out without
  FP8); ``optfuse.trt.glue`` adds ``arch``.
* ``kernel_config(op, dtype, attrs, static_shape, config=None)`` -> :class:`KernelSource`: N, K,
  the activation, alpha, the residual position, the bias / residual / scale modes and y's dtype
  (``output_dtype``) are compiled in. FP8 (float8e4m3fn) runs on sm_89 and later (FP8 tensor
  cores): the sm_90 CUDA kernel's cooperative schedule where it takes the instance and y is fp16 /
  bf16, else the Triton kernel; a known target below sm_89 is refused.
* ``launch_params(op, shapes, dtypes, attrs, cdiv=..., static_shape=..., config=...)`` ->
  :class:`LaunchParams`: a 1-D grid of ``cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N)`` tiles, written with
  ``*`` and ``cdiv`` over M only (M = the product of A's leading dims, the one dynamic size), so
  TensorRT QDP ``aot_impl`` can call it with symbolic shapes.
* ``choose_config`` / ``candidate_configs``: tiles, warps and pipeline depth per arch and shape class.

Argument order (QDP): the present inputs in spec order (GemmEpilogue: A, W[, bias][, residual]
[, a_scale, w_scale]; GatedGemm: A, W_gate, W_up[, a_scale, w_gate_scale, w_up_scale]), the int32 M,
the output y.

Kernel sources: ``impl`` of a :class:`GemmConfig` names the kernel; ``choose_config`` is where an
arch picks one and ``_SOURCES`` is where each impl's source is made: on sm_90 the CUDA C++ wgmma
kernel (``cuda_sm90``: kernel_sm90.cu, launch_sm90.py) wherever it takes the instance (fp16/bf16,
N a multiple of 32 with room for its tensor maps), else the Triton kernel (kernel.py), which is
also the kernel of every other arch.

Over 500 lines: the config tables of every dtype class (fp16 / bf16, fp32, FP8) and arch, the
static-shape facts they depend on, and both kernel sources' choice are kept in one module, so the
choice between them reads in one place.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from optfuse.kernels.artifact import Buffer, KernelSource, LaunchParams, LaunchPlan, PlanStep
from optfuse.kernels.util import ITEMSIZE, TRITON_TYPE, as_float32, cdiv as _cdiv, next_pow2, norm_dtype, rows_of, static_int
from optfuse.spec import FP8_DTYPES, plugin_specs, shared

from . import launch_sm90

KERNEL_PATH = str(Path(__file__).resolve().parent / "kernel.py")
ENTRY = "_gemm_epilogue_kernel"
SPECS = plugin_specs(__file__)
OPS = tuple(SPECS)
DTYPES = shared(SPECS, lambda s: s.inputs[0].dtypes, "the dtypes of A")
K_MULTIPLE = shared(SPECS, lambda s: s.limits["k_multiple"], "k_multiple")
N_MULTIPLE = shared(SPECS, lambda s: s.limits["n_multiple"], "n_multiple")
MAX_K = shared(SPECS, lambda s: s.limits["max_k"], "max_k")
ACTIVATIONS = {op: tuple(s.attr("activation").choices) for op, s in SPECS.items()}
DEFAULTS = {op: s.defaults() for op, s in SPECS.items()}
RESIDUAL_POSITIONS = tuple(SPECS["GemmEpilogue"].attr("residual_position").choices)
#: ``bias_mode`` / ``residual_mode`` of the static shape, and the kernel's BIAS_MODE / RES_MODE code.
BIAS_MODES = {"none": 0, "scalar": 1, "vector": 2}
RESIDUAL_MODES = {"none": 0, "scalar": 1, "full": 2}
#: ``w_scale_mode`` / ``w_up_scale_mode`` and the kernel's W_SCALE / W_UP_SCALE code (none: no FP8).
SCALE_MODES = {"none": 0, "scalar": 1, "vector": 2}
#: FP8 needs the FP8 tensor cores: sm_89 (Ada) and later.
FP8_MIN_ARCH = 89
#: FP8 dots on sm_90 (wgmma) accumulate in fewer than FP32's bits; tl.dot's max_num_imprecise_acc
#: adds the imprecise partial sums into the FP32 accumulator every this many K (at most BLOCK_K;
#: Triton's sm_90 default, 2**30, never does, so the error grows with K): 128, DeepSeek-V3's
#: promotion interval. Other archs ignore it.
FP8_IMPRECISE_ACC = 128
#: Per op: the operands that are FP8 together, and the scales that come with them (spec order).
FP8_OPERANDS = {"GemmEpilogue": ("A", "W"), "GatedGemm": ("A", "W_gate", "W_up")}
FP8_SCALES = {"GemmEpilogue": ("a_scale", "w_scale"), "GatedGemm": ("a_scale", "w_gate_scale", "w_up_scale")}
#: Kernel parameter of each spec input (the Triton kernel's names).
_KERNEL_PARAM = {"A": "A", "W": "W", "W_gate": "W", "W_up": "W_up", "bias": "Bias", "residual": "Residual",
                 "a_scale": "AScale", "w_scale": "WScale", "w_gate_scale": "WScale", "w_up_scale": "WUpScale"}
_INPUTS = {op: tuple(t.name for t in s.inputs) for op, s in SPECS.items()}
_N_OUTPUTS = {op: len(s.outputs) for op, s in SPECS.items()}
#: Dynamic shared memory per block (bytes): sm_80 / sm_87 163 KiB, sm_86 / sm_89 99 KiB, sm_90 227 KiB.
SMEM_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}
PORTABLE_SMEM = min(SMEM_LIMIT.values())  # arch unknown: a config that fits every target


@dataclass(frozen=True)
class GemmConfig:
    block_m: int  # rows of y per program
    block_n: int  # columns of y per program
    block_k: int  # K slice per main-loop step
    group_m: int  # row tiles walked per column tile (grouped order, L2 reuse)
    num_warps: int
    num_stages: int  # software-pipelining depth of the A / W loads
    impl: str = "triton"  # which kernel source (_SOURCES)
    #: the epilogue in two column halves (fewer live registers: the residual tile and the
    #: activation's temporaries of half the tile at a time)
    epilogue_split: bool = False


def config_name(cfg: GemmConfig) -> str:
    """The config in words, e.g. ``triton_128x256x64_g8_8warps_3stages_split``."""
    return (f"{cfg.impl}_{cfg.block_m}x{cfg.block_n}x{cfg.block_k}_g{cfg.group_m}_"
            f"{cfg.num_warps}warps_{cfg.num_stages}stages" + ("_split" if cfg.epilogue_split else ""))


def shared_mem_estimate(op: str, dtype: str, cfg: GemmConfig) -> int:
    """Shared memory of the operand ring: ``num_stages`` slices of A and of each weight."""
    n_weights = 2 if op == "GatedGemm" else 1
    return cfg.num_stages * (cfg.block_m + n_weights * cfg.block_n) * cfg.block_k * ITEMSIZE[dtype]


def _smem_limit(arch: int | None) -> int:
    return PORTABLE_SMEM if arch is None else SMEM_LIMIT.get(int(arch), PORTABLE_SMEM)


def _fit(cfg: GemmConfig, n: int, k: int, dtype: str = "float16") -> GemmConfig:
    """Tiles no wider than the problem needs (N, K rounded up to a power of two, >= 16: tl.dot's
    minimum; K >= 32 for FP8, the FP8 MMA's K)."""
    min_k = 32 if dtype in FP8_DTYPES else 16
    return _split_epilogue(replace(cfg, block_n=min(cfg.block_n, max(16, next_pow2(n))),
                                   block_k=min(cfg.block_k, max(min_k, next_pow2(k)))))


# Defaults from the Triton tutorials until measured on the GPUs (README "Configs"):
# 03-matrix-multiplication (sm_80 list) and 09-persistent-matmul (Hopper fp16: 128 x 256 x 64,
# 8 warps, 3 stages), adjusted so that ptxas spills no register with the largest epilogue (GELU erf,
# a bias and a full residual; test_aot checks it): the epilogue of a tile with >= 128 accumulator
# registers per thread runs in column halves, GatedGemm (two accumulators) takes narrower tiles.
_C = GemmConfig
_HALF_DEFAULT = {  # (arch class, gated) -> config for fp16 / bf16
    ("sm90", False): _C(128, 256, 64, 8, 8, 3),
    ("sm90", True): _C(128, 128, 64, 8, 8, 4),
    ("sm80", False): _C(128, 256, 64, 8, 8, 3),
    ("sm80", True): _C(128, 64, 32, 8, 4, 4),
    ("small_smem", False): _C(128, 128, 32, 8, 8, 4),
    ("small_smem", True): _C(128, 64, 32, 8, 4, 4),
}
#: FP8 (E4M3 operands, FP8 tensor cores: mma on sm_89, wgmma on sm_90): BLOCK_K 128 (128 bytes of a
#: row, as 64 is at 16 bits), 3-4 stages within sm_89's 99 KiB. 128 x 256 tiles spill registers on
#: sm_90 once the partial sums are promoted every K block (FP8_IMPRECISE_ACC: a second accumulator).
_FP8_DEFAULT = {
    ("sm90", False): _C(128, 128, 128, 8, 8, 4),
    ("sm90", True): _C(128, 128, 128, 8, 8, 3),
    ("sm80", False): _C(128, 128, 128, 8, 8, 3),
    ("sm80", True): _C(128, 64, 128, 8, 4, 3),
    ("small_smem", False): _C(128, 128, 128, 8, 8, 3),
    ("small_smem", True): _C(128, 64, 128, 8, 4, 3),
}
#: FP32 (IEEE FMA dots, no tensor cores): small tiles, few registers.
_FP32_DEFAULT = {False: _C(64, 64, 32, 8, 4, 3), True: _C(64, 64, 32, 8, 8, 2)}
#: What a sweep tries besides the default, per (dtype class, gated): the 03 tutorial's sm_80 list and
#: Hopper tiles, less those ptxas spills registers for with the largest epilogue on sm_80, sm_89 or
#: sm_90 (64 x 256; GatedGemm tiles over 128 x 64, but for the sm_90 one, whose operand ring only
#: sm_90's shared memory holds).
_CANDIDATES = {
    ("half", False): [
        _C(128, 256, 64, 8, 8, 3), _C(128, 128, 32, 8, 4, 4), _C(128, 64, 32, 8, 4, 4), _C(64, 128, 32, 8, 4, 4),
        _C(128, 32, 32, 8, 4, 4), _C(64, 32, 32, 8, 2, 5), _C(32, 64, 32, 8, 2, 5), _C(128, 128, 64, 8, 8, 4),
        _C(128, 128, 64, 8, 4, 3), _C(128, 256, 64, 8, 8, 4), _C(128, 128, 32, 8, 8, 4),
    ],
    ("half", True): [
        _C(128, 128, 64, 8, 8, 4), _C(128, 64, 32, 8, 4, 4), _C(64, 128, 32, 8, 4, 4), _C(64, 32, 32, 8, 2, 5),
        _C(32, 64, 32, 8, 2, 5),
    ],
    ("fp32", False): [_C(64, 64, 32, 8, 4, 3), _C(128, 64, 32, 8, 4, 3), _C(64, 128, 32, 8, 4, 3),
                      _C(32, 64, 32, 8, 2, 4), _C(64, 64, 16, 8, 4, 4), _C(64, 64, 32, 8, 8, 2)],
    ("fp32", True): [_C(64, 64, 32, 8, 8, 2), _C(64, 32, 32, 8, 4, 3), _C(32, 64, 32, 8, 4, 3),
                     _C(64, 64, 16, 8, 4, 3)],
    ("fp8", False): [_C(128, 128, 128, 8, 8, 4), _C(128, 128, 128, 8, 8, 3), _C(128, 128, 128, 8, 4, 4),
                     _C(64, 128, 128, 8, 4, 4), _C(64, 128, 128, 8, 4, 3), _C(128, 64, 128, 8, 4, 4),
                     _C(64, 64, 128, 8, 4, 3)],
    ("fp8", True): [_C(128, 128, 128, 8, 8, 3), _C(64, 128, 128, 8, 4, 3), _C(64, 64, 128, 8, 4, 4),
                    _C(128, 64, 128, 8, 8, 3)],
}


def _dtype_class(dtype: str) -> str:
    return "fp32" if dtype == "float32" else ("fp8" if dtype in FP8_DTYPES else "half")


def _split_epilogue(cfg: GemmConfig) -> GemmConfig:
    """Column halves for the epilogue of tiles holding >= 128 accumulator registers per thread
    (at 64+ columns): the residual tile and the activation's temporaries of the whole tile
    would not fit beside the accumulator."""
    acc_regs = cfg.block_m * cfg.block_n // (32 * cfg.num_warps)
    return replace(cfg, epilogue_split=acc_regs >= 128 and cfg.block_n >= 64)


def _arch_class(arch: int | None) -> str:
    if arch is not None and int(arch) >= 90:
        return "sm90"
    return "sm80" if _smem_limit(arch) >= 160 * 1024 else "small_smem"


def sm90_schedules(op: str, k: int, static: dict, activation: str | None) -> tuple[str, ...]:
    """The CUDA kernel's schedules in order of preference for an instance (H200 table, README):
    ping-pong for plain projections (no activation, no residual) with K <= 2048 -- BERT's QKV,
    where its 128 x 128 tiles and overlapped epilogue win from M = 512 to 4096; cooperative where a
    full residual comes by TMA during the mainloop (FFN down) and for GatedGemm; the epilogue-warp
    schedule (cooperative tiles, the epilogue of each tile but the last hidden behind the next
    tile's mainloop) for the other GemmEpilogue instances: those with an activation. Narrow tiles and
    128 x 192 tiles come last everywhere: launch_plan runs them where M is known (small, or filling the
    grid's waves badly)."""
    residual = static.get("residual_mode", "none")
    plain = activation in (None, "none") and residual == "none" and op == "GemmEpilogue" and k <= 2048
    if plain:
        order = ("cuda_sm90_pingpong", launch_sm90.EPILOGUE_WG, "cuda_sm90")
    elif op == "GatedGemm" or residual == "full" or activation in (None, "none"):
        order = ("cuda_sm90", launch_sm90.EPILOGUE_WG, "cuda_sm90_pingpong")
    else:
        order = (launch_sm90.EPILOGUE_WG, "cuda_sm90", "cuda_sm90_pingpong")
    return (*order, launch_sm90.NARROW, launch_sm90.TILE_192)


def _sm90_configs(op: str, dtype: str, n: int, k: int, static: dict | None, arch: int | None,
                  activation: str | None = None, out_dtype: str | None = None) -> list[GemmConfig]:
    """The CUDA sm_90 kernel's configs for this instance (none where it does not take it, or y's
    dtype ``out_dtype`` is not A's at 16 bits; FP8 A with an fp16 / bf16 y runs its cooperative
    schedule): per schedule (sm90_schedules' order) its ring depths, deepest first, with 8- and
    16-row-block raster groups."""
    static = static or {}
    fp8 = dtype in FP8_DTYPES
    if not fp8 and out_dtype not in (None, dtype):
        return []
    block_k = launch_sm90.BLOCK_K * (2 if fp8 else 1)  # one 128-byte swizzle row
    out = []
    for impl in sm90_schedules(op, k, static, activation):
        if launch_sm90.takes(op, dtype, n, static, arch, impl, k, out_dtype=out_dtype) is not None:
            continue
        out += [GemmConfig(launch_sm90.BLOCK_M, launch_sm90.OUT_N[(impl, op)], block_k, group, 12, stages, impl)
                for stages in launch_sm90.stage_options(impl, fp8) for group in (8, 16)]
    return out


def _triton_choice(op: str, dtype: str, n: int, k: int, arch: int | None) -> GemmConfig:
    """The Triton kernel's config on ``arch``."""
    gated = op == "GatedGemm"
    if dtype == "float32":
        cfg = _FP32_DEFAULT[gated]
    else:
        cfg = (_FP8_DEFAULT if dtype in FP8_DTYPES else _HALF_DEFAULT)[(_arch_class(arch), gated)]
    return _fit(cfg, n, k, dtype)


def choose_config(op: str, dtype: Any, n: int, k: int, arch: int | None = None,
                  static: dict | None = None, activation: str | None = None,
                  out_dtype: str | None = None) -> GemmConfig:
    """The config for a specialization. ``arch`` is the build target (None: unknown, so one that
    fits every target's shared memory); ``static`` the instance's static shape (bias / residual
    modes and dtypes), ``activation`` its activation, ``out_dtype`` y's dtype (None: A's). On sm_90
    the CUDA kernel where it takes the instance (README, the H200 table), else the Triton kernel."""
    _check_op(op)
    dtype = norm_dtype(dtype)
    sm90 = _sm90_configs(op, dtype, static_int(n, "N"), static_int(k, "K"), static, arch, activation, out_dtype)
    return sm90[0] if sm90 else _triton_choice(op, dtype, n, k, arch)


def candidate_configs(op: str, dtype: Any, n: int, k: int, arch: int | None = None,
                      static: dict | None = None, activation: str | None = None,
                      out_dtype: str | None = None) -> list[GemmConfig]:
    """Configs a tuning sweep tries (the current choice first; on sm_90 the CUDA kernel's, then the
    Triton kernel's), fitted to N and K; those whose operand ring exceeds ``arch``'s shared memory
    are left out. The GPU tests run every one."""
    _check_op(op)
    dtype = norm_dtype(dtype)
    out = _sm90_configs(op, dtype, static_int(n, "N"), static_int(k, "K"), static, arch, activation, out_dtype)
    out.append(_triton_choice(op, dtype, n, k, arch))
    limit = _smem_limit(arch)
    for c in _CANDIDATES[(_dtype_class(dtype), op == "GatedGemm")]:
        c = _fit(c, n, k, dtype)
        if c not in out and shared_mem_estimate(op, dtype, c) <= limit:
            out.append(c)
    return out


# -- static shape facts ---------------------------------------------------------------------------
def _check_op(op: Any) -> str:
    name = getattr(op, "op", op)
    if name not in OPS:
        raise ValueError(f"gemm plugin has no op {name!r} (ops: {OPS})")
    return name


def _is_one(d: Any) -> bool:
    try:
        return static_int(d) == 1
    except ValueError:
        return False


def bias_mode(shape: Sequence[Any] | None, n: Any) -> str:
    """``none`` (absent), ``scalar`` (one value: shape [] or all dims 1) or ``vector`` ([N], or [1, .., N])."""
    if shape is None:
        return "none"
    dims = list(shape)
    if all(_is_one(d) for d in dims):
        return "scalar"
    if all(_is_one(d) for d in dims[:-1]) and _same_dim(dims[-1], n):
        return "vector"
    raise ValueError(f"GEMM: bias of shape {dims} is neither one value nor [N = {n}]")


def residual_mode(shape: Sequence[Any] | None, a_shape: Sequence[Any]) -> str:
    """``none``, ``scalar`` (one value) or ``full`` (y's shape: A's leading dims, then N). A residual
    that broadcasts over some rows (a leading dim 1 where A's is not) is not supported."""
    if shape is None:
        return "none"
    dims, lead = list(shape), list(a_shape)[:-1]
    if all(_is_one(d) for d in dims):
        return "scalar"
    if len(dims) != len(lead) + 1 or any(_is_one(r) and not _is_one(a) for r, a in zip(dims, lead)):
        raise ValueError(f"GEMM: residual of shape {dims} does not have y's shape {lead + ['N']} "
                         "(only one value or the full output)")
    return "full"


def _same_dim(d: Any, n: Any) -> bool:
    try:
        return static_int(d) == static_int(n)
    except ValueError:
        return False


def scale_mode(shape: Sequence[Any] | None, n: Any, what: str) -> str:
    """A weight scale's mode: ``none`` (absent), ``scalar`` (one value) or ``vector`` ([N])."""
    if shape is None:
        return "none"
    dims = list(shape)
    if all(_is_one(d) for d in dims):
        return "scalar"
    if len(dims) == 1 and _same_dim(dims[0], n):
        return "vector"
    raise ValueError(f"GEMM: {what} of shape {dims} is neither one value nor [N = {n}]")


def _fp8_facts(op: str, by_shape: dict, by_dtype: dict, n: Any) -> dict:
    """FP8 operands together or not at all, their scales present exactly with them; the weight
    scales' modes (no entry without FP8: ``none``). FP8-ness is read from the dtypes where given, else from
    a_scale's presence."""
    operands, scales = FP8_OPERANDS[op], FP8_SCALES[op]
    known = [by_dtype[x] for x in operands if by_dtype.get(x) is not None]
    fp8 = [norm_dtype(d) in FP8_DTYPES for d in known]
    if any(fp8) and not all(fp8):
        raise ValueError(f"{op}: {', '.join(operands)} must all be FP8 or none (got {', '.join(map(str, known))})")
    is_fp8 = fp8[0] if fp8 else by_shape.get("a_scale") is not None
    for name in scales:
        if (by_shape.get(name) is not None) != is_fp8:
            raise ValueError(f"{op}: {name} must be {'present with FP8' if is_fp8 else 'absent without FP8'} operands")
    if not is_fp8:
        return {}  # no scale modes: "none"
    if scale_mode(by_shape["a_scale"], 1, "a_scale") != "scalar":
        raise ValueError(f"{op}: a_scale of shape {list(by_shape['a_scale'])} is not one value (per-tensor)")
    out = {"w_scale_mode": scale_mode(by_shape[scales[1]], n, scales[1])}
    if op == "GatedGemm":
        out["w_up_scale_mode"] = scale_mode(by_shape[scales[2]], n, scales[2])
    return out


def static_shape(op: Any, shapes: Sequence[Sequence[Any] | None], dtypes: Sequence[Any] | None = None) -> dict:
    """The compile-time facts of one op instance (``shapes`` / ``dtypes`` per spec input, None for
    an absent one): N, K, the bias / residual modes and their dtypes, the FP8 weight scales' modes.
    N and K are left as given (``kernel_config`` checks that they are static and within the limits)."""
    op = _check_op(op)
    names = _INPUTS[op]
    shapes = list(shapes) + [None] * (len(names) - len(shapes))
    dtypes = list(dtypes or []) + [None] * (len(names) - len(dtypes or []))
    by_name = dict(zip(names, shapes))
    a, w = by_name["A"], shapes[1]
    out: dict[str, Any] = {"K": a[-1], "N": w[0]}
    if op == "GatedGemm" and shapes[2] is not None and (
            len(shapes[2]) != len(w) or not all(_same_dim(u, g) for u, g in zip(shapes[2], w))):
        raise ValueError(f"GatedGemm: W_up {list(shapes[2])} and W_gate {list(w)} differ")
    if op == "GemmEpilogue":
        out["bias_mode"] = bias_mode(by_name["bias"], w[0])
        out["residual_mode"] = residual_mode(by_name["residual"], a)
    out.update(_fp8_facts(op, by_name, dict(zip(names, dtypes)), w[0]))
    for name, dt in zip(names, dtypes):
        if name in ("bias", "residual") and dt is not None and by_name[name] is not None:
            out[f"{name}_dtype"] = norm_dtype(dt)
    return out


_static_shape_of = static_shape  # launch_params' keyword of the same name hides it there


def _dims(static: dict) -> tuple[int, int]:
    """N and K from the static shape, checked against the spec's limits."""
    if "N" not in static or "K" not in static:
        raise ValueError("GEMM: the static shape needs N and K (launch.static_shape)")
    n, k = static_int(static["N"], "N"), static_int(static["K"], "K")
    if n <= 0 or n % N_MULTIPLE:
        raise ValueError(f"GEMM: N = {n} is not a positive multiple of {N_MULTIPLE}")
    if k <= 0 or k % K_MULTIPLE or k > MAX_K:
        raise ValueError(f"GEMM: K = {k} is not a positive multiple of {K_MULTIPLE} up to {MAX_K}")
    return n, k


@dataclass(frozen=True)
class Epilogue:
    """What the kernel compiles in besides N and K."""
    activation: str
    alpha: float
    residual_before: bool
    bias_mode: str
    residual_mode: str
    out_dtype: str = ""  # y's dtype ("": A's)
    w_scale_mode: str = "none"  # FP8: the (gate) weight scale's mode; none without FP8
    w_up_scale_mode: str = "none"  # FP8 GatedGemm: the up weight scale's mode


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def epilogue_of(op: str, attrs: dict | None, static: dict, dtype: str | None = None) -> Epilogue:
    """The epilogue of an instance; ``dtype`` (A's) gives y's dtype with ``output_dtype``
    (ValueError for an FP8 A with ``like_input``)."""
    attrs = {**DEFAULTS[op], **{k: v for k, v in (attrs or {}).items() if v is not None}}
    act = _text(attrs["activation"])
    if act not in ACTIVATIONS[op]:
        raise ValueError(f"{op}: activation {act!r} not in {ACTIVATIONS[op]}")
    out = "" if dtype is None else SPECS[op].output_dtype(0, [dtype] * len(_INPUTS[op]), attrs)
    scales = {"w_scale_mode": static.get("w_scale_mode", "none"), "w_up_scale_mode": static.get("w_up_scale_mode", "none")}
    if any(m not in SCALE_MODES for m in scales.values()):
        raise ValueError(f"{op}: scale modes {scales} unknown")
    fp8 = dtype is not None and dtype in FP8_DTYPES
    if dtype is not None and fp8 != (scales["w_scale_mode"] != "none"):
        raise ValueError(f"{op}: A is {dtype} but the static shape's w_scale_mode is {scales['w_scale_mode']!r} "
                         "(scales come exactly with FP8 operands)")
    if op == "GatedGemm":
        return Epilogue(act, 1.0, False, "none", "none", out, **scales)
    pos = _text(attrs["residual_position"])
    if pos not in RESIDUAL_POSITIONS:
        raise ValueError(f"{op}: residual_position {pos!r} not in {RESIDUAL_POSITIONS}")
    bmode, rmode = static.get("bias_mode", "none"), static.get("residual_mode", "none")
    if bmode not in BIAS_MODES or rmode not in RESIDUAL_MODES:
        raise ValueError(f"{op}: bias_mode {bmode!r} / residual_mode {rmode!r} unknown")
    # the position only matters with a residual: one kernel for both without one
    before = rmode != "none" and pos == "before_activation"
    return Epilogue(act, as_float32(attrs["alpha"]), before, bmode, rmode, out, scales["w_scale_mode"])


# -- kernel sources -------------------------------------------------------------------------------
def _source_name(op: str, dtype: str, n: int, k: int, epi: Epilogue, cfg: GemmConfig) -> str:
    """``gemm/<op>/<dtype>[-to-<y dtype>]/n<N>_k<K>/<activation>[_alpha<a>]_bias-<mode>_res-<mode>[-before]
    [_wscale-<mode>[-<up mode>]]/<config>`` (y's dtype where it is not A's; the FP8 weight scales' modes)."""
    tail = f"{epi.activation}" + ("" if epi.alpha == 1.0 else f"_alpha{epi.alpha:.9g}")
    if op == "GemmEpilogue":
        tail += f"_bias-{epi.bias_mode}_res-{epi.residual_mode}" + ("-before" if epi.residual_before else "")
    if epi.w_scale_mode != "none":
        tail += f"_wscale-{epi.w_scale_mode}" + (f"-{epi.w_up_scale_mode}" if op == "GatedGemm" else "")
    io = dtype if epi.out_dtype in ("", dtype) else f"{dtype}-to-{epi.out_dtype}"
    return f"gemm/{op}/{io}/n{n}_k{k}/{tail}/{config_name(cfg)}"


def _triton_source(op: str, dtype: str, n: int, k: int, epi: Epilogue, cfg: GemmConfig,
                   static: dict) -> KernelSource:
    ty = "*" + TRITON_TYPE[dtype]
    out_dtype = epi.out_dtype or dtype
    present = {"A": ty}
    constexprs: dict[str, Any] = {}
    if op == "GatedGemm":
        present.update({"W": ty, "W_up": ty})
        constexprs.update({"Bias": None, "Residual": None})
    else:
        present["W"] = ty
        constexprs["W_up"] = None
        for name, mode in (("bias", epi.bias_mode), ("residual", epi.residual_mode)):
            if mode == "none":
                constexprs[_KERNEL_PARAM[name]] = None
            else:
                present[_KERNEL_PARAM[name]] = "*" + TRITON_TYPE[norm_dtype(static.get(f"{name}_dtype") or out_dtype)]
    if epi.w_scale_mode == "none":
        constexprs.update({"AScale": None, "WScale": None, "WUpScale": None})
    else:
        present.update({"AScale": "*fp32", "WScale": "*fp32"})
        if op == "GatedGemm":
            present["WUpScale"] = "*fp32"
        else:
            constexprs["WUpScale"] = None
    # the kernel's parameter order = spec order
    order = ("A", "W", "W_up", "Bias", "Residual", "AScale", "WScale", "WUpScale")
    signature = {p: present[p] for p in order if p in present}
    signature.update({"M": "i32", "Y": "*" + TRITON_TYPE[out_dtype]})
    constexprs.update({
        "N": n, "K": k, "ALPHA": epi.alpha, "ACTIVATION": epi.activation,
        "BIAS_MODE": BIAS_MODES[epi.bias_mode], "RES_MODE": RESIDUAL_MODES[epi.residual_mode],
        "RESIDUAL_BEFORE": epi.residual_before, "GATED": op == "GatedGemm",
        "W_SCALE": SCALE_MODES[epi.w_scale_mode], "W_UP_SCALE": SCALE_MODES[epi.w_up_scale_mode],
        "FP8_ACC": min(FP8_IMPRECISE_ACC, cfg.block_k) if dtype in FP8_DTYPES else None,
        "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m,
        "EPILOGUE_SPLIT": cfg.epilogue_split,
    })
    return KernelSource(
        name=_source_name(op, dtype, n, k, epi, cfg),
        lang="triton",
        path=KERNEL_PATH,
        entry=ENTRY,
        n_inputs=len(signature) - 2,
        n_extra=1,
        n_outputs=_N_OUTPUTS[op],
        signature=signature,
        constexprs=constexprs,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        pointer_align=16,  # K, N multiples of 8: every row starts 16-byte aligned at 16-bit dtypes
        meta={"op": op, "dtype": dtype, "N": n, "K": k, **asdict(epi), "config": asdict(cfg)},
    )


def _sm90_source(op: str, dtype: str, n: int, k: int, epi: Epilogue, cfg: GemmConfig,
                 static: dict) -> KernelSource:
    why = launch_sm90.takes(op, dtype, n, static, static.get("arch"), cfg.impl, k, out_dtype=epi.out_dtype or None)
    if why:
        raise ValueError(f"{op}: the sm_90 kernel ({cfg.impl}) does not take this instance: {why}")
    return launch_sm90.source(cfg.impl, op, dtype, n, k, epi, cfg.num_stages, cfg.group_m,
                              _source_name(op, dtype, n, k, epi, cfg))


#: The CUDA sm_90 kernel's schedules, the one chosen first where both take an instance.
SM90_SCHEDULES = ("cuda_sm90_pingpong", "cuda_sm90", launch_sm90.EPILOGUE_WG, launch_sm90.NARROW, launch_sm90.TILE_192)
#: impl -> the function making its KernelSource (one entry per kernel source).
_SOURCES = {"triton": _triton_source, **{impl: _sm90_source for impl in SM90_SCHEDULES}}


def _config_for(op: str, dtype: str, n: int, k: int, static: dict, config: GemmConfig | None,
                epi: Epilogue) -> GemmConfig:
    if config is not None:
        if config.impl not in _SOURCES:
            raise ValueError(f"GEMM: no kernel source {config.impl!r} (have {sorted(_SOURCES)})")
        return config
    arch = static.get("arch")
    return choose_config(op, dtype, n, k, None if arch is None else int(arch), static, epi.activation,
                         epi.out_dtype or None)


def kernel_config(op: Any, dtype: Any, attrs: dict | None, static_shape: dict,
                  config: GemmConfig | None = None) -> KernelSource:
    """What to compile: ``dtype`` is A's (W, W_up share it; y's is ``output_dtype``'s, A's by
    default; bias and residual default to y's, or have their own, ``static_shape['bias_dtype']`` /
    ``['residual_dtype']``). FP8 needs sm_89 or later where the target is known."""
    op = _check_op(op)
    dtype = norm_dtype(dtype)
    if dtype not in DTYPES:
        raise ValueError(f"{op}: dtype {dtype} not in {DTYPES}")
    arch = static_shape.get("arch")
    if dtype in FP8_DTYPES and arch is not None and int(arch) < FP8_MIN_ARCH:
        raise ValueError(f"{op}: FP8 ({dtype}) needs FP8 tensor cores, sm_{FP8_MIN_ARCH} or later "
                         f"(target sm_{arch})")
    n, k = _dims(static_shape)
    epi = epilogue_of(op, attrs, static_shape, dtype)
    cfg = _config_for(op, dtype, n, k, static_shape, config, epi)
    return _SOURCES[cfg.impl](op, dtype, n, k, epi, cfg, static_shape)


def launch_params(op: Any, shapes: Sequence[Sequence[Any]], dtypes: Sequence[Any], attrs: dict | None,
                  cdiv=_cdiv, *, static_shape: dict | None = None,
                  config: GemmConfig | None = None) -> LaunchParams:
    """One program per BLOCK_M x BLOCK_N tile of y: grid x = cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),
    M = the product of A's leading dims (``shapes[0]``)."""
    op = _check_op(op)
    dtype = norm_dtype(dtypes[0])
    static = static_shape if static_shape is not None else _static_shape_of(op, shapes, dtypes)
    n, k = _dims(static)
    cfg = _config_for(op, dtype, n, k, static, config, epilogue_of(op, attrs, static, dtype))
    m = rows_of(shapes[0])
    if cfg.impl in SM90_SCHEDULES:  # persistent: one CTA per SM
        return launch_sm90.launch(cfg.impl, m, cfg.num_stages, static)
    return LaunchParams(
        grid=(cdiv(m, cfg.block_m) * _cdiv(n, cfg.block_n), 1, 1),
        block=(cfg.num_warps * 32, 1, 1),
        shared_mem=0,  # Triton's shared memory comes with the artifact (metadata.shared)
        extra_args=[m],
    )


# -- run-time plans (the classic plugin: M known at enqueue) ---------------------------------------
def plan_choice(op: str, dtype: str, m: int, n: int, k: int, cfg: GemmConfig, static: dict,
                activation: str) -> tuple[str, int, int]:
    """(schedule, ring stages, splits) of the run-time plan at M = ``m`` rows, where the static choice
    is the sm_90 config ``cfg``. launch_sm90.small_m_schedule first; where it leaves one kernel (the
    static choice or an unsplit plan), 128 x 192 tiles instead if they fill the grid's waves much better
    (launch_sm90.wave_schedule); where both keep the static choice, the epilogue-warp schedule for a
    plain projection or a GatedGemm at large M (launch_sm90.large_m_schedule); else the static choice's
    own schedule (``cfg``'s, one split)."""
    impl = cfg.impl
    choice = launch_sm90.small_m_schedule(op, dtype, m, n, k, impl, static, activation)
    if choice is None or choice[2] == 1:
        choice = launch_sm90.wave_schedule(op, dtype, m, n, k, choice[0] if choice else impl, static) or choice
    return choice or launch_sm90.large_m_schedule(op, dtype, m, n, k, impl, static) or (impl, cfg.num_stages, 1)


def _plan_of(op: str, dtype: str, n: int, k: int, m: Any, epi: Epilogue, cfg: GemmConfig, static: dict,
             choice: tuple[str, int, int], present: Sequence[int], host_maps: bool = True) -> LaunchPlan:
    """The LaunchPlan of ``choice`` (plan_choice) for ``m`` rows;
    ``present``: the op inputs given. Its GEMM takes host-encoded tensor maps (HOST_MAPS) unless
    ``host_maps`` is False."""
    impl, stages, splits = choice
    pp = replace(cfg, block_n=launch_sm90.OUT_N[(impl, op)], num_stages=stages, impl=impl)
    name = _source_name(op, dtype, n, k, epi, pp) + ("_hostmaps" if host_maps else "")
    params = launch_sm90.launch(pp.impl, m, stages, static)
    if splits == 1:
        src = launch_sm90.source(pp.impl, op, dtype, n, k, epi, stages, pp.group_m, name, host_maps=host_maps)
        return LaunchPlan([PlanStep(src, params, [Buffer("input", i) for i in present], [Buffer("output", 0)])])
    gemm = launch_sm90.source(pp.impl, op, dtype, n, k, epi, stages, pp.group_m, f"{name}_splitk{splits}", splits,
                              host_maps=host_maps)
    reduce = launch_sm90.reduce_source(op, dtype, n, k, epi, stages, pp.group_m, splits, f"{name}_splitk{splits}_reduce",
                                       host_maps=host_maps)
    epilogue_inputs = [Buffer("input", i) for i in present if _INPUTS[op][i] in ("bias", "residual")]
    return LaunchPlan([
        PlanStep(gemm, params, [Buffer("input", i) for i in present], [Buffer("workspace", 0)]),
        PlanStep(reduce, launch_sm90.reduce_launch(m, n), [Buffer("workspace", 0), *epilogue_inputs],
                 [Buffer("output", 0)]),
    ], splits * m * n * 4)


def launch_plan(op: Any, shapes: Sequence[Sequence[Any] | None], dtypes: Sequence[Any], attrs: dict | None,
                cdiv=_cdiv, *, static_shape: dict | None = None, host_maps: bool = True,
                schedule: str | None = None) -> LaunchPlan | None:
    """At concrete shapes, wherever the sm_90 kernel was chosen: plan_choice's schedule for this M
    (narrow tiles or the pingpong kernel alone, or split-K -- the pingpong kernel writing fp32 partial
    planes to the workspace, then gemm_sm90_splitk_reduce (op inputs A, W[, bias][, residual] ->
    workspace -> y); 128 x 192 tiles; the epilogue-warp schedule for large-M plain projections and
    GatedGemm), else the static choice's schedule; either with its tensor maps encoded by the launcher
    (about 1 us a launch that each CTA spends building them in the kernel of kernel_config, H100). None:
    the one kernel of kernel_config / launch_params runs (another arch or the Triton kernel; QDP's AOT
    path always runs that kernel). ``host_maps=False``: the same plan with the maps built on the device
    (an A/B of the two; the schedule rules still assume the host's). ``schedule``: that sm_90 schedule
    (SM90_SCHEDULES) instead of plan_choice's, unsplit, with its first ring-stage option (a benchmark's A/B
    of the schedules; 16-bit instances); ValueError where it does not take the instance."""
    op = _check_op(op)
    dtype = norm_dtype(dtypes[0])
    static = static_shape if static_shape is not None else _static_shape_of(op, shapes, dtypes)
    n, k = _dims(static)
    epi = epilogue_of(op, attrs, static, dtype)
    cfg = _config_for(op, dtype, n, k, static, None, epi)
    if cfg.impl not in SM90_SCHEDULES:
        return None
    m = int(rows_of([int(d) for d in shapes[0]]))
    if schedule is None:
        choice = plan_choice(op, dtype, m, n, k, cfg, static, epi.activation)
    else:
        why = ("an FP8 instance runs its static schedule" if dtype in FP8_DTYPES else
               f"not one of {', '.join(SM90_SCHEDULES)}" if schedule not in SM90_SCHEDULES else
               launch_sm90.takes(op, dtype, n, static, 90, schedule, k, host_maps=host_maps))
        if why is not None:
            raise ValueError(f"{op}: the {schedule} schedule does not take this instance: {why}")
        choice = schedule, launch_sm90.stage_options(schedule)[0], 1
    return _plan_of(op, dtype, n, k, m, epi, cfg, static, choice, [i for i, s in enumerate(shapes) if s is not None],
                    host_maps)


#: Row blocks (128 rows) up to which prebuild_sources looks for run-time plans: M <= 128k rows.
PLAN_ROW_BLOCKS = 1024


def plan_sources(op: Any, dtype: Any, attrs: dict | None, static_shape: dict) -> list[KernelSource]:
    """Every kernel a run-time plan of this instance can launch at any M up to PLAN_ROW_BLOCKS x 128
    rows (plans depend on M only through its 128-row blocks), each source once; none where the
    static choice is not the sm_90 kernel."""
    op = _check_op(op)
    dtype = norm_dtype(dtype)
    n, k = _dims(static_shape)
    epi = epilogue_of(op, attrs, static_shape, dtype)
    cfg = _config_for(op, dtype, n, k, static_shape, None, epi)
    if cfg.impl not in SM90_SCHEDULES:
        return []
    choices = {plan_choice(op, dtype, 128 * blocks, n, k, cfg, static_shape, epi.activation)
               for blocks in range(1, PLAN_ROW_BLOCKS + 1)}
    given = {"A", "W", "W_gate", "W_up"} | ({"bias"} if epi.bias_mode != "none" else set()) \
        | ({"residual"} if epi.residual_mode != "none" else set())
    present = [i for i, name in enumerate(_INPUTS[op]) if name in given]
    out = {}
    for choice in sorted(choices):
        for step in _plan_of(op, dtype, n, k, 128, epi, cfg, static_shape, choice, present).steps:
            out[step.source.name] = step.source
    return list(out.values())


def workspace_bytes(op: Any, min_shapes: Sequence[Sequence[Any] | None], max_shapes: Sequence[Sequence[Any] | None],
                    dtypes: Sequence[Any], attrs: dict | None) -> int:
    """The workspace ``launch_plan`` needs at any shape of a profile (TensorRT asks once, at build
    time, without the target): the split-K partial planes' bound (one 64 KB tile per CTA) for a
    16-bit GemmEpilogue the pingpong kernel takes, 0 otherwise."""
    op = _check_op(op)
    dtype = norm_dtype(dtypes[0])
    static = _static_shape_of(op, max_shapes, dtypes)
    n, k = _dims(static)
    if op != "GemmEpilogue" or launch_sm90.takes(op, dtype, n, static, 90, launch_sm90.PINGPONG, k,
                                                 host_maps=True) is not None:
        return 0
    return launch_sm90.split_k_workspace(static)


# -- prebuilt specializations ---------------------------------------------------------------------
#: (op, N, K, bias_mode, residual_mode, activations) of the FFN / QKV / output projections of
#: BERT-base and GPT-2 (hidden 768), BERT-large (1024) and LLaMA-7B (4096, gated FFN of 11008).
PREBUILD_SHAPES = (
    ("GemmEpilogue", 2304, 768, "vector", "none", ("none",)),                   # packed QKV
    ("GemmEpilogue", 768, 768, "vector", "full", ("none",)),                    # attention output + residual
    ("GemmEpilogue", 3072, 768, "vector", "none", ("gelu_erf", "gelu_tanh")),   # FFN up (BERT, GPT-2)
    ("GemmEpilogue", 768, 3072, "vector", "full", ("none",)),                   # FFN down + residual
    ("GemmEpilogue", 3072, 1024, "vector", "none", ("none",)),
    ("GemmEpilogue", 1024, 1024, "vector", "full", ("none",)),
    ("GemmEpilogue", 4096, 1024, "vector", "none", ("gelu_erf",)),
    ("GemmEpilogue", 1024, 4096, "vector", "full", ("none",)),
    ("GemmEpilogue", 12288, 4096, "none", "none", ("none",)),                   # LLaMA packed QKV
    ("GemmEpilogue", 4096, 4096, "none", "full", ("none",)),
    ("GatedGemm", 11008, 4096, "none", "none", ("silu",)),                      # SwiGLU gate/up
    ("GemmEpilogue", 4096, 11008, "none", "full", ("none",)),                   # FFN down + residual
)


#: y's dtypes of the prebuilt FP8 kernels (per-channel weight scales).
PREBUILD_FP8_OUTPUTS = ("float16", "bfloat16")


def prebuild_sources(arch: int | None = None) -> list[KernelSource]:
    """Every PREBUILD_SHAPES entry at every dtype, with the config ``arch`` picks, and on sm_90 the
    kernels of its run-time plans (plan_sources: `optfuse kernels build` leaves nothing for the classic
    plugin to compile at its first enqueue); FP8 (per-channel weight scales, y in each
    PREBUILD_FP8_OUTPUTS dtype) where ``arch`` has FP8 tensor cores or is unknown."""
    out = []
    fp8_ok = arch is None or int(arch) >= FP8_MIN_ARCH
    for op, n, k, bmode, rmode, acts in PREBUILD_SHAPES:
        for dt in DTYPES:
            if dt in FP8_DTYPES and not fp8_ok:
                continue
            outputs = PREBUILD_FP8_OUTPUTS if dt in FP8_DTYPES else ("like_input",)
            scales = {"w_scale_mode": "vector", "w_up_scale_mode": "vector"} if dt in FP8_DTYPES else {}
            for act in acts:
                for y in outputs:
                    static = {"N": n, "K": k, "bias_mode": bmode, "residual_mode": rmode, "arch": arch, **scales}
                    attrs = {"activation": act, "output_dtype": y}
                    out.append(kernel_config(op, dt, attrs, static))
                    if arch is not None and int(arch) == 90:
                        out += plan_sources(op, dt, attrs, static)
    return out
