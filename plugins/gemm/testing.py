"""Helpers shared by the GEMM tests and scripts/bench_gemm.py (torch is imported inside functions).

* :class:`Case` -- one op instance: op, M (as leading dims of A), N, K, dtype (A's), activation, bias /
  residual modes, residual position, alpha, y's dtype (``output_dtype``), the FP8 weight scales' mode;
* :func:`case_inputs` -- random inputs in spec order (None where absent); FP8 ones quantized with
  saturation (``quantize_fp8``), scales per tensor (A) and per output channel (weights);
* :func:`case_sources` -- KernelSource + LaunchParams of a case, from launch.py;
* :func:`run_triton` -- the Triton kernel of a KernelSource run directly (JIT on a GPU, or the
  interpreter on CPU), binding arguments by parameter name, so absent inputs (``None`` constexprs
  between the runtime parameters) work;
* :func:`reference_of` / :func:`check_close` / :func:`tolerance_key` -- the float64 reference
  (reference.py; FP8: the dequantized math on the same FP8 values) and the accuracy check against it;
* :func:`ptxas_usage` -- registers and spill bytes of an artifact's PTX (Triton's bundled ptxas);
* :func:`get_artifact` -- an artifact prebuilt elsewhere (``$OPTFUSE_GEMM_PREBUILT``, a KernelCache
  root), else compiled here.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

from optfuse.kernels.artifact import KernelArtifact, KernelSource, LaunchParams
from optfuse.kernels.registry import plugin_module
from optfuse.kernels.triton_aot import interpret_env


def launch_mod():
    return plugin_module("gemm", "launch")


def reference_mod():
    return plugin_module("gemm", "reference")


@dataclass(frozen=True)
class Case:
    op: str
    lead: tuple[int, ...]  # A's leading dims (M = their product)
    n: int
    k: int
    dtype: str
    activation: str = "none"
    bias: str = "none"  # none | scalar | vector
    residual: str = "none"  # none | scalar | full
    residual_position: str = "after_activation"
    alpha: float = 1.0
    output_dtype: str = "like_input"  # y's dtype (an FP8 case names one)
    w_scale: str = "vector"  # FP8: the weight scales per output channel ("vector") or one ("scalar")
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def m(self) -> int:
        return math.prod(self.lead)

    @property
    def fp8(self) -> bool:
        return self.dtype == "float8e4m3fn"

    @property
    def y_dtype(self) -> str:
        return self.dtype if self.output_dtype == "like_input" else self.output_dtype

    @property
    def attrs(self) -> dict:
        out = {"activation": self.activation}
        if self.op == "GemmEpilogue":
            out.update({"alpha": self.alpha, "residual_position": self.residual_position})
        if self.output_dtype != "like_input":
            out["output_dtype"] = self.output_dtype
        return out

    def shapes(self) -> list[list[int] | None]:
        """Per spec input (None for an absent one)."""
        a, w = [*self.lead, self.k], [self.n, self.k]
        ws = [self.n] if self.w_scale == "vector" else [1]
        if self.op == "GatedGemm":
            return [a, w, list(w), *(([], ws, list(ws)) if self.fp8 else (None,) * 3)]
        bias = {"none": None, "scalar": [], "vector": [self.n]}[self.bias]
        res = {"none": None, "scalar": [1], "full": [*self.lead, self.n]}[self.residual]
        return [a, w, bias, res, *(([], ws) if self.fp8 else (None, None))]

    def dtypes(self) -> list[str | None]:
        """Per spec input: A's dtype for A and the weights, y's for bias and residual, float32 for scales."""
        names = [t.name for t in reference_mod().SPECS[self.op].inputs]
        scales = reference_mod().SCALES[self.op]
        operands = reference_mod().OPERANDS[self.op]
        return [None if s is None else (self.dtype if n in operands else "float32" if n in scales else self.y_dtype)
                for n, s in zip(names, self.shapes())]

    def id(self) -> str:
        dt = self.dtype if self.output_dtype == "like_input" else f"{self.dtype}-to-{self.output_dtype}"
        parts = [self.op, "x".join(map(str, self.lead)), f"n{self.n}", f"k{self.k}", dt, self.activation]
        if self.op == "GemmEpilogue":
            parts += [f"bias-{self.bias}", f"res-{self.residual}"]
            if self.residual != "none" and self.residual_position == "before_activation":
                parts.append("before")
            if self.alpha != 1.0:
                parts.append(f"alpha{self.alpha:g}")
        if self.fp8:
            parts.append(f"wscale-{self.w_scale}")
        return "-".join(parts)


#: E4M3's largest finite value.
FP8_MAX = 448.0


def quantize_fp8(x, scale):
    """``x / scale`` saturated to +-448 and rounded to float8e4m3fn (torch), ``scale`` broadcasting
    over x (per tensor, or [N, 1] per output channel): what a caller's quantizer hands the op."""
    import torch

    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fp8_scale(x, dim=None, headroom: float = 1.0):
    """The scale mapping ``headroom`` times x's amax (per tensor, or per row along ``dim``) to 448:
    headroom < 1 saturates the largest values (scaled past +-448 before the clamp)."""
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    return (amax.float() * headroom / FP8_MAX).clamp_min(1e-12)


def case_inputs(case: Case, *, device: str = "cpu", generator=None, headroom: float = 1.0) -> list:
    """Random torch inputs per spec input (None where absent): A ~ N(0, 1), weights ~ N(0, 1/K)
    (pre-activations of order 1, where every activation bends), bias and residual ~ N(0, 1) in y's
    dtype. FP8: A and the weights quantized (``quantize_fp8``) with a per-tensor scale for A and a
    per-output-channel (or, ``w_scale`` scalar, one) scale per weight from ``fp8_scale(headroom)``,
    so ``headroom`` < 1 puts values at the E4M3 range edge (+-448 after saturation)."""
    import torch

    def rnd(shape, scale=1.0):
        return torch.randn(tuple(shape), generator=generator, dtype=torch.float32) * scale

    R = reference_mod()
    names = [t.name for t in R.SPECS[case.op].inputs]
    operands, scales = R.OPERANDS[case.op], R.SCALES[case.op]
    values = {}
    for name, shape, dt in zip(names, case.shapes(), case.dtypes()):  # spec order: A, weights, then the rest
        if shape is None or name in scales:
            continue
        x = rnd(shape, case.k ** -0.5 if name in operands[1:] else 1.0)
        if not case.fp8 or name not in operands:
            values[name] = x.to(device=device, dtype=getattr(torch, dt))
            continue
        if name == "A":
            scale = fp8_scale(x, headroom=headroom).reshape(())
        elif case.w_scale == "vector":
            scale = fp8_scale(x, dim=1, headroom=headroom).reshape(-1)
        else:
            scale = fp8_scale(x, headroom=headroom).reshape(1)
        values[name] = quantize_fp8(x, scale if name == "A" else scale.reshape(-1, 1)).to(device)
        values[scales[operands.index(name)]] = scale.to(device)
    return [values.get(name) for name in names]


def case_static(case: Case, arch: int | None = None, bias_dtype: str | None = None) -> dict:
    """The static shape of a case (``bias_dtype``: bias and residual of another dtype than y's)."""
    L = launch_mod()
    dtypes = case.dtypes()
    if bias_dtype:
        dtypes = [bias_dtype if (i in (2, 3) and case.op == "GemmEpilogue" and d is not None) else d
                  for i, d in enumerate(dtypes)]
    static = L.static_shape(case.op, case.shapes(), dtypes)
    static["arch"] = arch
    return static


def case_sources(case: Case, config=None, arch: int | None = None) -> tuple[KernelSource, LaunchParams]:
    """(KernelSource, LaunchParams) of a case; ``arch`` is the target the choice may depend on."""
    L = launch_mod()
    static = case_static(case, arch)
    src = L.kernel_config(case.op, case.dtype, case.attrs, static, config=config)
    shapes = case.shapes()
    params = L.launch_params(case.op, shapes, case.dtypes(), case.attrs, static_shape=static, config=config)
    return src, params


def case_plan(case: Case, arch: int | None = 90, host_maps: bool = True, schedule: str | None = None):
    """launch.py's run-time LaunchPlan of a case (sources, no artifacts), or None where the one
    kernel of case_sources runs (no sm_90 kernel); ``host_maps=False``: its maps built on the device;
    ``schedule``: that sm_90 schedule, unsplit (ValueError where it does not take the case)."""
    return launch_mod().launch_plan(case.op, case.shapes(), case.dtypes(), case.attrs,
                                    static_shape=case_static(case, arch), host_maps=host_maps, schedule=schedule)


def schedule_plans(case: Case, arch: int | None = 90) -> dict:
    """{schedule: plan} of every sm_90 schedule that takes a 16-bit case, each as an unsplit plan
    with host-encoded maps ({} where no sm_90 plan runs, and for FP8)."""
    L = launch_mod()
    if case.fp8 or case_plan(case, arch) is None:
        return {}
    out = {}
    for impl in L.SM90_SCHEDULES:
        try:
            out[impl] = case_plan(case, arch, schedule=impl)
        except ValueError:
            continue
    return out


def build_plan(plan, arch: int | None = None):
    """Every step's artifact (get_artifact); returns ``plan``."""
    for step in plan.steps:
        step.artifact = get_artifact(step.source, arch)
    return plan


def plan_kind(plan) -> str | None:
    """A run-time plan in words: ``pingpong``, ``pingpong split-K x<n>``, ``narrow``, ``cooperative``
    ... (None: no plan, the one kernel runs)."""
    if plan is None:
        return None
    meta = plan.steps[0].source.meta
    kind = "cooperative" if meta["kernel"] == "cuda_sm90" else meta["kernel"].removeprefix("cuda_sm90_")
    return f"{kind} split-K x{meta['split_k']}" if meta["split_k"] > 1 else kind


def new_workspace(plan, device="cpu"):
    """A workspace for ``plan``: uint8, every byte 0xFF (each fp32 partial a NaN until written)."""
    import torch

    return torch.full((max(int(plan.workspace_bytes), 1),), 255, dtype=torch.uint8, device=device)


def run_triton(src: KernelSource, params: LaunchParams, inputs: Sequence[Any], outputs: Sequence[Any],
               interpret: bool = False) -> None:
    """Launch ``src``'s @triton.jit function on torch tensors (GPU JIT, or the CPU interpreter);
    ``inputs`` are the present ones in spec order (the launcher's order)."""
    from optfuse.kernels.triton_aot import load_module

    fn = getattr(load_module(src.path, interpret=interpret), src.entry)
    runtime = list(src.signature)
    values = [*[x for x in inputs if x is not None], *[int(a) for a in params.extra_args], *outputs]
    if len(values) != len(runtime):
        raise ValueError(f"{src.name}: {len(values)} arguments for signature {runtime}")
    with interpret_env(interpret):
        fn[tuple(int(g) for g in params.grid)](**dict(zip(runtime, values)), **src.constexprs,
                                                num_warps=src.num_warps, num_stages=src.num_stages)


def to_numpy64(t):
    return None if t is None else t.detach().float().cpu().double().numpy()


def reference_of(case: Case, inputs: Sequence[Any]):
    """The float64 reference output (reference.py's functions, not rounded to y's dtype); FP8: the
    product of the FP8 values (exact in float64) times the scales."""
    import numpy as np

    R = reference_mod()
    x = dict(zip([t.name for t in R.SPECS[case.op].inputs], [to_numpy64(t) for t in inputs]))
    if case.op == "GatedGemm":
        return R.gated_gemm64(x["A"], x["W_gate"], x["W_up"], case.activation, x["a_scale"], x["w_gate_scale"],
                              x["w_up_scale"])
    y = R.gemm_epilogue64(x["A"], x["W"], x["bias"], x["residual"], case.activation, case.alpha,
                          case.residual_position, x["a_scale"], x["w_scale"])
    return np.asarray(y, np.float64)


#: Error bound vs the float64 reference: max |y - ref| <= RTOL * (|ref| + scale) + ATOL per element,
#: scale = the RMS of ref. fp16 / bf16: FP32 accumulation, then one rounding of y (2^-11 / 2^-8
#: relative) and the inputs' own rounding (already in the reference, which reads the same values);
#: fp32: IEEE dots, K-long sums (~sqrt(K) ulps). FP8 operands (keys ``float8e4m3fn->y``): the
#: reference reads the same FP8 values, so y's rounding bounds fp16 / bf16 outputs; an fp32 y is
#: bounded by the FP8 tensor cores' accumulation within a K block, which keeps fewer than FP32's 24
#: bits on sm_90: fp16's bound. (Measured on the H200, Triton kernel, GatedGemm gelu_tanh K = 776:
#: 1.35e-3 off at |ref| 0.14, RMS 0.65, which (5e-4, 5e-4) did not hold.)
TOLERANCE = {"float16": (2e-3, 1e-3), "bfloat16": (1.6e-2, 8e-3), "float32": (2e-5, 2e-5),
             "float8e4m3fn->float16": (2e-3, 1e-3), "float8e4m3fn->bfloat16": (1.6e-2, 8e-3),
             "float8e4m3fn->float32": (2e-3, 1e-3)}


def tolerance_key(case: Case) -> str:
    """The TOLERANCE entry of a case: y's dtype, or ``float8e4m3fn-><y>`` with FP8 operands."""
    return f"{case.dtype}->{case.y_dtype}" if case.fp8 else case.y_dtype


def check_close(out, ref, dtype: str, what: str = "") -> float:
    """Assert ``out`` (torch or NumPy) is finite and within TOLERANCE of ``ref``; return the max
    relative error (scaled as above)."""
    import numpy as np

    o = out.detach().float().cpu().double().numpy() if hasattr(out, "detach") else np.asarray(out, np.float64)
    if o.shape != ref.shape:
        raise AssertionError(f"{what}: shape {o.shape} != reference {ref.shape}")
    if not np.isfinite(o).all():
        raise AssertionError(f"{what}: {int((~np.isfinite(o)).sum())} non-finite outputs (unwritten or bad math)")
    rtol, atol = TOLERANCE[dtype]
    scale = float(np.sqrt(np.mean(ref ** 2))) if ref.size else 0.0
    bound = rtol * (np.abs(ref) + scale) + atol
    err = np.abs(o - ref)
    if (err > bound).any():
        i = tuple(np.argwhere(err > bound)[0])
        raise AssertionError(f"{what}: {int((err > bound).sum())} of {err.size} elements off, e.g. at {i}: "
                             f"{o[i]:.6g} vs {ref[i]:.6g} (bound {bound[i]:.3g})")
    return float((err / (np.abs(ref) + scale + 1e-30)).max()) if ref.size else 0.0


def get_artifact(src: KernelSource, arch: int | None = None) -> KernelArtifact:
    """``$OPTFUSE_GEMM_PREBUILT`` (a KernelCache root built on another machine) first, else build
    (and cache) with the Triton installed here."""
    from optfuse.kernels import build_kernel

    root = os.environ.get("OPTFUSE_GEMM_PREBUILT")
    if root:
        art = plugin_module("flash_attention", "testing").prebuilt_artifact(src, root, arch or 90)
        if art is not None:
            return art
    return build_kernel(src, arch)


def ptxas_usage(art: KernelArtifact) -> dict:
    """``{"registers", "spill_stores", "spill_loads"}`` of ``art``'s PTX, from ``ptxas -v`` (the one
    Triton ships; no GPU needed)."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    gpu = f"sm_{art.arch}a" if art.arch >= 90 else f"sm_{art.arch}"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(art.ptx)
        res = subprocess.run([get_ptxas(art.arch).path, "-v", f"--gpu-name={gpu}", ptx, "-o", os.devnull],
                             capture_output=True, text=True, check=True)
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", res.stderr)
    if not (regs and spill):
        raise RuntimeError(f"ptxas -v printed no usage for {art.name}:\n{res.stderr[-2000:]}")
    return {"registers": int(regs.group(1)), "spill_stores": int(spill.group(1)), "spill_loads": int(spill.group(2))}
