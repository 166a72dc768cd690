"""Helpers shared by the FlashAttention tests and scripts/bench_attention.py (no pydantic).

* :func:`case_sources` -- KernelSource + LaunchParams of one case, from launch.py;
* :func:`run_triton` -- run the Triton kernel of a KernelSource directly (JIT on a GPU, or the
  interpreter on CPU) with the launcher's argument order, binding by parameter name so an absent
  bias (a ``None`` constexpr in the middle of the signature) works;
* :func:`case_plan` / :func:`build_plan` / :func:`run_plan_triton` -- the plan of a case (launch.py's
  ``launch_plan``: split-KV decode, or the CUDA kernel's HOST_MAPS build), its artifacts, a decode
  plan's steps run as Triton functions with a poisoned workspace (:func:`new_workspace`) and a
  zeroed state (:func:`new_state`);
* :func:`launch_fn` -- what the classic plugin launches for a case (its plan, else the one kernel)
  through the launcher, as the benchmarks time it;
* :func:`prebuilt_artifact` / :func:`get_artifact` -- an artifact compiled elsewhere (this repo's
  CPU machine: Triton 3.9 cubins for sm_90), looked up by its spec, else compiled here;
* :func:`fp8_inputs` / :func:`fp8_reference_of` / :func:`check_close_fp8` -- the FP8 form: q, k, v
  quantized per tensor (v transposed and padded as the spec says), its float64 reference of the
  dequantized math, and the error bounds of E4M3 probabilities.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Sequence

from optfuse.kernels.artifact import KernelArtifact, KernelSource, LaunchParams
from optfuse.kernels.registry import plugin_module
from optfuse.kernels.triton_aot import interpret_env

OP = "FlashAttention"


def launch_mod():
    return plugin_module("flash_attention", "launch")


def reference_mod():
    return plugin_module("flash_attention", "reference")


def attrs_for(H: int, Hkv: int, D: int, causal: bool, scale: float | None = None) -> dict:
    return {"scale": D ** -0.5 if scale is None else scale, "causal": int(causal),
            "num_heads": H, "num_kv_heads": Hkv}


def case_sources(dtype: str, shapes: Sequence[Sequence[int] | None], attrs: dict,
                 config=None, bias_dtype: str | None = None,
                 arch: int | None = None, layout=None, host_maps: bool = False) -> tuple[KernelSource, LaunchParams]:
    """(KernelSource, LaunchParams) for concrete shapes [q, k, v, bias-or-None]. ``arch`` is the
    target the choice may depend on (90: the CUDA kernel where it applies; None: Triton).
    ``layout`` = (block_offsets, block_indices) arrays: the case is BlockSparseAttention.
    ``host_maps``: the CUDA kernel's HOST_MAPS build of the same config (launch_plan's), B appended
    to the extra args as the plan appends it."""
    L = launch_mod()
    op = OP if layout is None else L.BLOCK_SPARSE
    q = list(shapes[0])
    bias = shapes[3] if len(shapes) > 3 else None
    static = {"head_dim": q[3], "bias_shape": None if bias is None else tuple(bias),
              "bias_dtype": bias_dtype, "arch": arch, "q_shape": q}  # what a plugin's enqueue knows
    if layout is not None:
        static["layout_heads"] = int(layout[0].shape[0]) != 1
    src = L.kernel_config(op, dtype, attrs, static, config=config, host_maps=host_maps)
    shp = [list(s) for s in shapes[:3]] + ([list(bias)] if bias is not None else [])
    if dtype == L.FP8:  # spec order: the scales after the (possibly absent) bias
        shp = shp[:3] + [None if bias is None else list(bias)] + [[1], [1], [1]]
    if layout is not None:
        shp += [list(layout[0].shape), list(layout[1].shape)]
    params = L.launch_params(op, shp, [dtype], attrs, config=config, static_shape=static)
    if host_maps:
        params.extra_args.append(q[0])
    return src, params


def run_triton(src: KernelSource, params: LaunchParams, inputs: Sequence[Any],
               outputs: Sequence[Any], interpret: bool = False) -> None:
    """Launch ``src``'s @triton.jit function on torch tensors (GPU JIT, or CPU interpreter)."""
    from optfuse.kernels.triton_aot import load_module

    fn = getattr(load_module(src.path, interpret=interpret), src.entry)
    runtime = list(src.signature)
    values = [*inputs, *[int(a) for a in params.extra_args], *outputs]
    if len(values) != len(runtime):
        raise ValueError(f"{src.name}: {len(values)} arguments for signature {runtime}")
    kwargs = dict(zip(runtime, values))
    with interpret_env(interpret):
        fn[tuple(int(g) for g in params.grid)](**kwargs, **src.constexprs,
                                                num_warps=src.num_warps,
                                                num_stages=src.num_stages)


def _plan_args(dtype: str, shapes, attrs: dict, arch, bias_dtype, layout) -> tuple[str, list, dict]:
    """(op, shapes in spec order, static shape) of a case, as launch_plan takes them."""
    L = launch_mod()
    op = OP if layout is None else L.BLOCK_SPARSE
    q = list(shapes[0])
    bias = shapes[3] if len(shapes) > 3 else None
    static = {"head_dim": q[3], "bias_shape": None if bias is None else tuple(bias),
              "bias_dtype": bias_dtype, "arch": arch}
    if layout is not None:
        static["layout_heads"] = int(layout[0].shape[0]) != 1
    shp = [list(s) for s in shapes[:3]] + [None if bias is None else list(bias)]
    if dtype == L.FP8:  # the scales, in spec order after the bias
        shp += [[1], [1], [1]]
    if layout is not None:
        shp += [list(layout[0].shape), list(layout[1].shape)]
    return op, shp, static


def case_plan(dtype: str, shapes: Sequence[Sequence[int] | None], attrs: dict, arch: int | None = None,
              bias_dtype: str | None = None, decode=None, host_maps: bool = True, layout=None):
    """launch.py's LaunchPlan (sources, no artifacts) for concrete shapes [q, k, v, bias-or-None];
    None where the one-kernel path runs. ``decode`` = a DecodeConfig to use instead of the default;
    ``host_maps=False``: no HOST_MAPS plan (the one kernel with device-built maps runs); ``layout`` =
    (block_offsets, block_indices) arrays: the case is BlockSparseAttention (as in case_sources)."""
    op, shp, static = _plan_args(dtype, shapes, attrs, arch, bias_dtype, layout)
    return launch_mod().launch_plan(op, shp, [dtype], attrs, static_shape=static, decode=decode,
                                    host_maps=host_maps)


def _launched(dtype, shapes, attrs, arch, bias_dtype, decode, host_maps, layout, config):
    """(plan, None) or (None, (src, params)): what launch_fn launches (its docstring). A given
    config takes launch.host_maps_plan's form where the default config would."""
    if config is None:
        plan = case_plan(dtype, shapes, attrs, arch, bias_dtype, decode, host_maps, layout)
        if plan is not None or decode is not None:
            return plan, None
    elif host_maps and arch == 90:
        op, shp, static = _plan_args(dtype, shapes, attrs, arch, bias_dtype, layout)
        plan = launch_mod().host_maps_plan(op, shp, [dtype], attrs, static, config=config)
        if plan is not None:
            return plan, None
    return None, case_sources(dtype, shapes, attrs, config=config, bias_dtype=bias_dtype, arch=arch, layout=layout)


def launch_sources(dtype: str, shapes: Sequence[Sequence[int] | None], attrs: dict, *, arch: int | None = 90,
                   bias_dtype: str | None = None, decode=None, host_maps: bool = True, layout=None,
                   config=None) -> list[KernelSource]:
    """The KernelSources :func:`launch_fn` launches for a case (what a benchmark prebuilds)."""
    plan, kernel = _launched(dtype, shapes, attrs, arch, bias_dtype, decode, host_maps, layout, config)
    if plan is not None:
        return [step.source for step in plan.steps]
    return [] if kernel is None else [kernel[0]]


def launch_fn(dtype: str, shapes: Sequence[Sequence[int] | None], attrs: dict, inputs: Sequence[Any],
              out: Any, stream, *, arch: int | None = 90, bias_dtype: str | None = None, decode=None,
              host_maps: bool = True, layout=None, config=None, artifact=None):
    """What the classic plugin launches for one case, as ``(fn(sync=False), kernel names)`` on
    torch CUDA tensors (``inputs`` in spec order, None for an absent optional input): the case's
    plan where launch.py makes one (decode: the split-KV kernel with its workspace and state;
    sm_90: the CUDA kernel's HOST_MAPS build), else the one kernel. ``config``: that config's one
    kernel, as its HOST_MAPS build where the plan would take that form (a variant timed like the
    plan); ``host_maps=False``: device-built maps throughout; ``decode`` given where no decode plan
    applies: ``(None, "")``. ``stream()`` gives the CUDA stream at call time (a graph capture
    records on its own); ``artifact(src, arch)`` (default get_artifact) compiles or finds each
    kernel."""
    from optfuse.kernels import launch
    from optfuse.kernels.launcher import launch_plan

    artifact = artifact or get_artifact
    plan, kernel = _launched(dtype, shapes, attrs, arch, bias_dtype, decode, host_maps, layout, config)
    if plan is not None:
        for step in plan.steps:
            step.artifact = artifact(step.source, arch)
        workspace = new_workspace(plan, "cuda")  # 0xFF: a partial read unwritten is a NaN
        state = new_state(plan, "cuda")  # the split programs' arrival counters, zero
        return (lambda sync=False: launch_plan(plan, inputs, [out], workspace, stream(), state=state, sync=sync),
                " + ".join(step.source.name for step in plan.steps))
    if kernel is None:
        return None, ""
    src, params = kernel
    art = artifact(src, arch)
    present = [x for x in inputs if x is not None]
    return (lambda sync=False: launch(art, params, present, [out], stream(), sync=sync)), src.name


def forced_decode_plan(dtype: str, shapes: Sequence[Sequence[int] | None], attrs: dict, decode=None,
                       bias_dtype: str | None = None):
    """The split-KV decode plan of a case whatever its Sq and Sk (the kernels' tests run them on
    shapes the dispatch leaves to the one-kernel path too)."""
    L = launch_mod()
    q = list(shapes[0])
    bias = shapes[3] if len(shapes) > 3 else None
    causal = bool(int(attrs.get("causal", 0)))
    return L.decode_plan(dtype, [list(s) for s in shapes[:3]], attrs, q[3], causal, L.bias_pattern(bias),
                         L.sparsity_of(OP, attrs), bias_dtype, decode)


def build_plan(plan, arch: int | None = None):
    """Every step's artifact (get_artifact); returns ``plan``."""
    for step in plan.steps:
        step.artifact = get_artifact(step.source, arch)
    return plan


_TORCH_TYPE = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "i32": "int32"}


def new_workspace(plan, device="cpu"):
    """A workspace for ``plan``: uint8, every byte 0xFF (each fp32 partial a NaN until written)."""
    import torch

    return torch.full((max(int(plan.workspace_bytes), 1),), 255, dtype=torch.uint8, device=device)


def new_state(plan, device="cpu"):
    """The op instance's state for ``plan``: uint8, zeroed (as launcher.DeviceState allocates it)."""
    import torch

    return torch.zeros((max(int(plan.state_bytes), 1),), dtype=torch.uint8, device=device)


def run_plan_triton(plan, inputs: Sequence[Any], outputs: Sequence[Any], interpret: bool = False,
                    workspace=None, state=None) -> None:
    """Run ``plan``'s steps in order as @triton.jit functions on torch tensors (``inputs`` in spec
    order, None for an absent bias): each workspace (state) buffer is a view of ``workspace``
    (default :func:`new_workspace`) or ``state`` (default :func:`new_state`) at its offset, typed as
    the kernel's signature says."""
    import torch

    ws = new_workspace(plan, inputs[0].device) if workspace is None else workspace
    st = new_state(plan, inputs[0].device) if state is None else state

    def tensor(ref, ptr_type):
        if ref.kind == "input":
            return inputs[ref.index]
        if ref.kind == "output":
            return outputs[ref.index]
        mem = ws if ref.kind == "workspace" else st
        return mem[ref.index:].view(getattr(torch, _TORCH_TYPE[ptr_type.lstrip("*")]))

    for step in plan.steps:
        src = step.source
        types = list(src.signature.values())
        ptr_types = types[:src.n_inputs] + types[src.n_inputs + src.n_extra:]
        ins = [tensor(r, t) for r, t in zip(step.inputs, ptr_types[:src.n_inputs])]
        outs = [tensor(r, t) for r, t in zip(step.outputs, ptr_types[src.n_inputs:])]
        run_triton(src, step.params, ins, outs, interpret=interpret)


def _expected_key(src: KernelSource, arch: int, compiler: str) -> str:
    blob = json.dumps({"spec": src.spec_dict(), "arch": arch, "compiler": compiler}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def prebuilt_artifact(src: KernelSource, root: str | os.PathLike, arch: int = 90) -> KernelArtifact | None:
    """The artifact of exactly ``src`` (same source hash and specialization) under a KernelCache
    root, built by any Triton version (the key is recomputed with the compiler it records)."""
    from optfuse.kernels.cache import KernelCache

    cache = KernelCache(root)
    probe = cache.path_for(src, arch, "x" * 24).parent
    if not probe.is_dir():
        return None
    for meta_path in sorted(probe.glob("*/meta.json")):
        meta = json.loads(meta_path.read_text())
        compiler = meta.get("metadata", {}).get("compiler", "")
        if meta.get("key") == _expected_key(src, arch, compiler):
            return KernelArtifact.load(meta_path.parent)
    return None


def get_artifact(src: KernelSource, arch: int | None = None) -> KernelArtifact:
    """``$OPTFUSE_FA_PREBUILT`` (a KernelCache root carried from the CPU machine) first, else
    build (and cache) with the Triton installed here."""
    from optfuse.kernels import build_kernel

    root = os.environ.get("OPTFUSE_FA_PREBUILT")
    if root:
        art = prebuilt_artifact(src, root, arch or 90)
        if art is not None:
            return art
    return build_kernel(src, arch)


def random_inputs(B, H, Hkv, Sq, Sk, D, dtype, bias_shape=None, *, device="cpu", generator=None):
    """q, k, v, bias (torch) from N(0, 1); bias N(0, 1) too (None when bias_shape is None)."""
    import torch

    tdt = getattr(torch, dtype)

    def rnd(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float32).to(device=device, dtype=tdt)

    q, k, v = rnd(B, H, Sq, D), rnd(B, Hkv, Sk, D), rnd(B, Hkv, Sk, D)
    bias = None if bias_shape is None else rnd(*bias_shape) if len(bias_shape) else rnd(1).reshape(())
    return q, k, v, bias


def key_padding(bias, how: str) -> None:
    """HF key-padding masks written into a [B, 1, 1, Sk] torch bias: 0 for real keys, finfo.min of
    its dtype for padding; batch b keeps max(1, Sk (b + 1) / (B + 1) - 13) real keys (never a
    multiple of 128). how: right, left, dead (batch 0 has no real key: the uniform average over
    all keys), holes (padding inside the live range too: computed, not skipped)."""
    import torch

    B, Sk = bias.shape[0], bias.shape[-1]
    lo = torch.finfo(bias.dtype).min
    bias.zero_()
    for b in range(B):
        n = max(1, Sk * (b + 1) // (B + 1) - 13)
        if how in ("right", "dead"):
            bias[b, ..., n:] = lo
        elif how == "left":
            bias[b, ..., :Sk - n] = lo
        elif how == "holes":
            bias[b, ..., n:] = lo
            bias[b, ..., n // 3:n // 2] = lo
        else:
            raise ValueError(f"key_padding: no padding kind {how!r}")
        if how == "dead" and b == 0:
            bias[b] = lo


def sparse_attrs(H, Hkv, D, causal, Sq, Sk, extra: dict, scale: float | None = None):
    """(attrs, layout or None) of a sparse test case: ``extra`` may hold window (left, right),
    softcap and layout (density, layout heads: a random 128-block BSR layout, seeded by Sq + Sk)."""
    import numpy as np

    attrs = attrs_for(H, Hkv, D, causal, scale)
    if "window" in extra:
        attrs["window_left"], attrs["window_right"] = extra["window"]
    if "softcap" in extra:
        attrs["softcap"] = extra["softcap"]
    layout = None
    if "layout" in extra:
        density, heads = extra["layout"]
        layout = reference_mod().random_layout(np.random.default_rng(Sq + Sk), heads, Sq, Sk, 128, density)
        attrs["block_size"] = 128
    return attrs, layout


def to_numpy64(t):
    return None if t is None else t.detach().float().cpu().double().numpy()


def reference_of(q, k, v, bias, attrs, layout=None):
    """The float64 reference; ``layout`` = (block_offsets, block_indices): BlockSparseAttention."""
    import numpy as np

    R = reference_mod()
    ins = [to_numpy64(q), to_numpy64(k), to_numpy64(v), to_numpy64(bias)]
    op = None
    if layout is not None:
        op = R.BLOCK_SPARSE
        ins += [np.asarray(layout[0]), np.asarray(layout[1])]
    o = R.reference(op, ins, attrs)[0]
    return np.asarray(o, dtype=np.float64)


#: Error bounds vs the float64 reference, by dtype: (max relative L2 error, max abs error).
#: fp16/bf16: the kernel rounds p to the input dtype before p @ v (as every FlashAttention does)
#: and o to the output dtype: ~2^-11 (fp16) / 2^-8 (bf16) relative. fp32: IEEE dots.
TOLERANCE = {"float16": (2e-3, 1e-2), "bfloat16": (1.6e-2, 6e-2), "float32": (1e-5, 1e-4)}


def check_close(out, ref, dtype: str, what: str = "") -> tuple[float, float]:
    import numpy as np

    o = out.detach().float().cpu().double().numpy() if hasattr(out, "detach") else np.asarray(out, np.float64)
    if np.isnan(o).any():
        raise AssertionError(f"{what}: {int(np.isnan(o).sum())} NaN outputs (unwritten or bad math)")
    rel = float(np.linalg.norm(o - ref) / max(np.linalg.norm(ref), 1e-30))
    mx = float(np.abs(o - ref).max()) if o.size else 0.0
    tr, ta = TOLERANCE[dtype]
    if rel > tr or mx > ta:
        raise AssertionError(f"{what}: rel L2 {rel:.2e} (<= {tr}), max abs {mx:.2e} (<= {ta})")
    return rel, mx


def fp8_inputs(q, k, v, margin: float = 1.0):
    """(q8, k8, vt8, [q_scale, k_scale, v_scale]) of float torch q, k, v: per-tensor scales
    amax / (448 * margin) (margin < 1 saturates the largest values to +-448), values rounded to
    E4M3 with saturation, v transposed to [B, Hkv, D, Skv] with Skv = Sk rounded up to 16 (the
    padding keys hold NaN: the kernel must never read them)."""
    import torch

    R = reference_mod()
    out, scales = [], []
    for x in (q, k, v):
        amax = float(x.detach().float().abs().max())
        s = torch.tensor([max(amax, 1e-30) / (448.0 * margin)], dtype=torch.float32, device=x.device)
        scales.append(s)
        out.append((x.float() / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn))
    B, Hkv, Sk, D = v.shape
    vt = torch.full((B, Hkv, D, R.fp8_v_keys(Sk)), float("nan"), dtype=torch.float32, device=v.device)
    vt[..., :Sk] = out[2].float().transpose(2, 3)
    return out[0], out[1], vt.to(torch.float8_e4m3fn), scales


def _fp8_numpy(t):
    """A torch float8_e4m3fn tensor as an ml_dtypes array (the reference's FP8 input)."""
    import ml_dtypes
    import torch

    return t.detach().cpu().contiguous().view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)


def fp8_reference_of(q8, k8, vt8, bias, scales, attrs):
    """The float64 reference of an FP8 case (the spec's dequantized math)."""
    import numpy as np

    ins = [_fp8_numpy(q8), _fp8_numpy(k8), _fp8_numpy(vt8), to_numpy64(bias)]
    ins += [s.detach().cpu().numpy() for s in scales]
    o = reference_mod().reference(OP, ins, {**attrs, "output_dtype": "float32"})[0]
    return np.asarray(o, dtype=np.float64)


#: FP8 error bounds vs the float64 reference of the dequantized math. q, k, v are the same E4M3
#: values in both, so the kernel's error is p rounded to E4M3 for p @ v (3 mantissa bits: relative
#: error <= 2^-4 per probability, uniform-ish, rms about 2^-4 / sqrt(3) ~ 0.036 at a power of two
#: and less above it) plus o's rounding. Relative L2 of o ~ that rms (zero-mean v); bound 0.05.
#: Max abs: each probability's relative error <= 2^-4, so |do| <= 2^-4 max|v| for normal ones;
#: those below E4M3's normal range (448 p < 2^-6) err by <= 2^-10 / 448 absolute each, at most
#: Sk of them over a row sum l >= 1; plus o's own rounding (2^-8 |o| in bf16).
FP8_REL_L2 = 5e-2


def fp8_max_abs_bound(v_absmax: float, sk: int, out_dtype: str, o_absmax: float) -> float:
    """The max abs error bound of an FP8 case (see FP8_REL_L2)."""
    out_ulp = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}[out_dtype]
    return (2.0 ** -4 + sk * 2.0 ** -10 / 448.0) * v_absmax + out_ulp * o_absmax + 1e-6


def check_close_fp8(out, ref, v_absmax: float, sk: int, out_dtype: str, what: str = "") -> tuple[float, float]:
    import numpy as np

    o = out.detach().float().cpu().double().numpy()
    if np.isnan(o).any():
        raise AssertionError(f"{what}: {int(np.isnan(o).sum())} NaN outputs (unwritten, padding keys read, or bad math)")
    rel = float(np.linalg.norm(o - ref) / max(np.linalg.norm(ref), 1e-30))
    mx = float(np.abs(o - ref).max()) if o.size else 0.0
    bound = fp8_max_abs_bound(v_absmax, sk, out_dtype, float(np.abs(ref).max()) if ref.size else 0.0)
    if rel > FP8_REL_L2 or mx > bound:
        raise AssertionError(f"{what}: rel L2 {rel:.2e} (<= {FP8_REL_L2}), max abs {mx:.2e} (<= {bound:.2e})")
    return rel, mx


def exact_fp8_rounding_in_interpreter() -> None:
    """Make the Triton interpreter round fp32 / fp16 -> E4M3 as the GPU does (cvt.rn.satfinite:
    nearest even, saturated to +-448, NaN kept). Triton 3.9's interpreter loses the carry when
    rounding up crosses a power of two (124.8 -> 64 instead of 128) and truncates subnormals; the
    FP8 interpreter tests run the kernel, not that conversion. Call it in the interpreter child."""
    import ml_dtypes
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._convert_float

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if output_dtype == tl.float8e4nv and input_dtype in (tl.float32, tl.float16):
            x = np.frombuffer(data.tobytes(), dtype=np.float32 if input_dtype == tl.float32 else np.float16)
            y = np.clip(x.astype(np.float32), -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)
            return y.view(np.uint8).reshape(data.shape)
        return original(data, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = convert


def cache_root_default() -> Path:
    return Path(__file__).resolve().parents[2] / ".optfuse_cache" / "flash_attention"
