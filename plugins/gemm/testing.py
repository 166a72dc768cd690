"""Helpers shared by the GEMM tests and scripts/bench_gemm.py (torch is imported inside functions).

* :class:`Case` -- one op instance: op, M (as leading dims of A), N, K, dtype, activation, bias /
  residual modes, residual position;
* :func:`case_inputs` -- random inputs in spec order (present ones only);
* :func:`case_sources` -- KernelSource + LaunchParams of a case, from launch.py;
* :func:`run_triton` -- the Triton kernel of a KernelSource run directly (JIT on a GPU, or the
  interpreter on CPU), binding arguments by parameter name, so absent inputs (``None`` constexprs
  between the runtime parameters) work;
* :func:`reference_of` / :func:`check_close` -- the float64 reference (reference.py) and the
  accuracy check against it;
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
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def m(self) -> int:
        return math.prod(self.lead)

    @property
    def attrs(self) -> dict:
        if self.op == "GatedGemm":
            return {"activation": self.activation}
        return {"activation": self.activation, "alpha": self.alpha, "residual_position": self.residual_position}

    def shapes(self) -> list[list[int] | None]:
        """Per spec input (None for an absent one)."""
        a, w = [*self.lead, self.k], [self.n, self.k]
        if self.op == "GatedGemm":
            return [a, w, list(w)]
        bias = {"none": None, "scalar": [], "vector": [self.n]}[self.bias]
        res = {"none": None, "scalar": [1], "full": [*self.lead, self.n]}[self.residual]
        return [a, w, bias, res]

    def id(self) -> str:
        parts = [self.op, "x".join(map(str, self.lead)), f"n{self.n}", f"k{self.k}", self.dtype, self.activation]
        if self.op == "GemmEpilogue":
            parts += [f"bias-{self.bias}", f"res-{self.residual}"]
            if self.residual != "none" and self.residual_position == "before_activation":
                parts.append("before")
            if self.alpha != 1.0:
                parts.append(f"alpha{self.alpha:g}")
        return "-".join(parts)


def case_inputs(case: Case, *, device: str = "cpu", generator=None) -> list:
    """Random torch inputs per spec input (None where absent): A ~ N(0, 1), weights ~ N(0, 1/K)
    (pre-activations of order 1, where every activation bends), bias and residual ~ N(0, 1)."""
    import torch

    tdt = getattr(torch, case.dtype)

    def rnd(shape, scale=1.0):
        x = torch.randn(tuple(shape), generator=generator, dtype=torch.float32) * scale
        return x.to(device=device, dtype=tdt)

    out = []
    for i, shape in enumerate(case.shapes()):
        if shape is None:
            out.append(None)
        elif i in (1, 2) and (case.op == "GatedGemm" or i == 1):
            out.append(rnd(shape, case.k ** -0.5))
        else:
            out.append(rnd(shape))
    return out


def case_static(case: Case, arch: int | None = None, bias_dtype: str | None = None) -> dict:
    L = launch_mod()
    shapes = case.shapes()
    dtypes = [None if s is None else (bias_dtype if i >= 2 and bias_dtype else case.dtype)
              for i, s in enumerate(shapes)]
    static = L.static_shape(case.op, shapes, dtypes)
    static["arch"] = arch
    return static


def case_sources(case: Case, config=None, arch: int | None = None) -> tuple[KernelSource, LaunchParams]:
    """(KernelSource, LaunchParams) of a case; ``arch`` is the target the choice may depend on."""
    L = launch_mod()
    static = case_static(case, arch)
    src = L.kernel_config(case.op, case.dtype, case.attrs, static, config=config)
    shapes = case.shapes()
    params = L.launch_params(case.op, shapes, [case.dtype] * len(shapes), case.attrs, static_shape=static,
                             config=config)
    return src, params


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
    """The float64 reference output (reference.py's functions, not rounded to the I/O dtype)."""
    import numpy as np

    R = reference_mod()
    x = [to_numpy64(t) for t in inputs]
    if case.op == "GatedGemm":
        return R.gated_gemm64(x[0], x[1], x[2], case.activation)
    y = R.gemm_epilogue64(x[0], x[1], x[2], x[3], case.activation, case.alpha, case.residual_position)
    return np.asarray(y, np.float64)


#: Error bound vs the float64 reference: max |y - ref| <= RTOL * (|ref| + scale) + ATOL per element,
#: scale = the RMS of ref. fp16 / bf16: FP32 accumulation, then one rounding of y (2^-11 / 2^-8
#: relative) and the inputs' own rounding (already in the reference, which reads the same values);
#: fp32: IEEE dots, K-long sums (~sqrt(K) ulps).
TOLERANCE = {"float16": (2e-3, 1e-3), "bfloat16": (1.6e-2, 8e-3), "float32": (2e-5, 2e-5)}


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
