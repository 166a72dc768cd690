#!/usr/bin/env python3
"""GEMM benchmark: the optfuse GEMM plugin (GemmEpilogue, GatedGemm) vs cuBLAS, cuBLASLt's fused
epilogue, the eager chain and torch.compile, on the same shapes in the same run.

Shapes (``--shapes``, names below): the QKV, FFN-up and FFN-down projections of BERT-base /
BERT-large (bias; GELU erf on FFN up; the residual on FFN down) and LLaMA-7B / 13B (no bias;
SwiGLU as GatedGemm; the residual on FFN down), at M = ``--tokens`` rows; plus square 4k / 8k
(M = N = K, bias + GELU); and, named by ``--shapes`` only, BERT-large's FFN up with each other
epilogue (``bert-large.ffn_up.bare`` / ``.bias`` / ``.relu`` / ``.silu`` / ``.gelu_tanh``: what the
epilogue costs), and BERT-large's FFN down without bias or residual (``bert-large.ffn_down.bare``), with the
bias (``.bias``) or the residual (``.res``) alone, and LLaMA-7B's without its residual
(``llama-7b.ffn_down.bare``). Contenders, per shape:

* ``mm``: bare cuBLAS, ``torch.mm(x, W.t())`` (no epilogue at all);
* ``lt``: cuBLASLt's fused epilogue where one call expresses the op: ``torch._addmm_activation``
  (bias + GELU -- cuBLASLt's GELU is the tanh form -- or ReLU), ``torch.addmm`` (bias, or a
  residual as C); "-" elsewhere (SiLU, bias and residual together);
* ``chain``: the eager chain (mm, add bias, activation, add residual: one kernel each);
* ``compile``: torch.compile of the chain's function (mode max-autotune-no-cudagraphs, static
  shapes), within ``--compile-limit`` seconds per point and ``--compile-budget`` in all; "-"
  with a note when it fails, runs out of time, or the budget is spent;
* ``ours``: the AOT artifact of every kernel source launch.py's candidates hold for this arch (its
  first config each: what a plugin built for any M runs), launched through
  ``optfuse.kernels.launcher``; with ``--variants`` also each candidate config. Where
  ``launch.launch_plan`` answers for this M (on sm_90 always: the schedule for this M, its tensor maps
  encoded by the launcher), ``ours[plan]`` too, first: what the classic plugin runs at this M, the ratios'
  ``ours``.
* ``ours[plan|device maps]`` (``--device-maps``): the same plan with its tensor maps built by each CTA (the
  kernel QDP runs) instead of encoded by the launcher, right after ``ours[plan]`` in each round.
* ``ours[<schedule>|plan]`` (``--schedules``, 16-bit points on sm_90): every sm_90 schedule that takes the
  point, each as an unsplit run-time plan with host-encoded maps (``launch_plan(schedule=...)``), right after
  ``ours[plan]``: the measurements behind the plan rules (launch_sm90.small_m_schedule, wave_schedule,
  large_m_schedule) -- is the plan's pick the fastest?
* ``ours[impl|baseline]`` (``--baseline DIR``: a checkout of an earlier source tree, e.g. ``git worktree add
  DIR COMMIT``): the same CUDA config compiled from DIR's kernel source, launched and checked like ours, right
  after it in each round: a kernel change A/B in one run. The Triton kernel has no baseline row.

GatedGemm shapes replace mm / lt by ``mm2`` (two bare GEMMs, gate and up) and ``packed`` (one bare
GEMM over [W_gate; W_up], N doubled: what the gate must not cost on top of); the chain is
mm, mm, silu, mul.

FP8 (``--fp8``: off by default): the same shapes with E4M3 A and weights (per-tensor A scale,
per-output-channel weight scales; y in ``--fp8-output``, bf16 by default), in their own table:

* ``scaled``: ``torch._scaled_mm`` with per-tensor scales (cuBLASLt's FP8 GEMM, no epilogue);
* ``scaled_bias``: the same with its bias (cuBLASLt's FP8 bias epilogue), where the op is a bias only;
* ``rowwise``: ``torch._scaled_mm`` with per-row / per-column scales (our scales' math; CUTLASS in torch);
* ``fp8_chain``: ``scaled`` then the epilogue in eager (the same math as ours: one kernel per op);
  GatedGemm: ``scaled2`` (two FP8 GEMMs) and ``scaled_packed`` (one over [W_gate; W_up]);
* ``bf16``: ``torch.mm`` in bf16 on the same shape (what FP8 is measured against);
* ``ours``: the run-time plan where ``launch.launch_plan`` makes one (sm_90: the CUDA kernel's FP8 path with
  host-encoded maps, first), then each kernel source's first config (the CUDA kernel, the FP8 Triton kernel),
  checked against the float64 dequantized math.

Timing: ``triton.testing.do_bench_cudagraph`` medians: each contender's calls replayed from a
CUDA graph, so no contender pays Python launch costs (ours goes through a ctypes launcher; a
TensorRT engine launches from C++); all contenders of a point visited in turn for ``--rounds``
rounds (the clock drifts over a run), median of the rounds.
Ratios are time ours / time contender (< 1: ours is faster).

    python scripts/bench_gemm.py --build .optfuse_cache/gemm            # CPU: prebuild the cubins
    python scripts/bench_gemm.py --prebuilt .optfuse_cache/gemm --out bench_gemm.json   # GPU
    python scripts/bench_gemm.py --quick                                # three shapes, M = 4096
    python scripts/bench_gemm.py --build DIR --fp8 && python scripts/bench_gemm.py --prebuilt DIR --fp8
    python scripts/bench_gemm.py --markdown bench_gemm.json             # the README's table from a run's rows

Over 500 lines: one script, so that every contender of a point (16-bit and FP8) is timed in the
same run with the same inputs and timing code.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from optfuse.kernels.registry import plugin_module  # noqa: E402

T = plugin_module("gemm", "testing")
L = plugin_module("gemm", "launch")

#: name -> (op, K, N, activation, bias, residual)
SHAPES = {
    "bert-base.qkv": ("GemmEpilogue", 768, 2304, "none", "vector", "none"),
    "bert-base.ffn_up": ("GemmEpilogue", 768, 3072, "gelu_erf", "vector", "none"),
    "bert-base.ffn_down": ("GemmEpilogue", 3072, 768, "none", "vector", "full"),
    "bert-large.qkv": ("GemmEpilogue", 1024, 3072, "none", "vector", "none"),
    "bert-large.ffn_up": ("GemmEpilogue", 1024, 4096, "gelu_erf", "vector", "none"),
    "bert-large.ffn_down": ("GemmEpilogue", 4096, 1024, "none", "vector", "full"),
    "llama-7b.qkv": ("GemmEpilogue", 4096, 12288, "none", "none", "none"),
    "llama-7b.ffn_gate_up": ("GatedGemm", 4096, 11008, "silu", "none", "none"),
    "llama-7b.ffn_down": ("GemmEpilogue", 11008, 4096, "none", "none", "full"),
    "llama-13b.qkv": ("GemmEpilogue", 5120, 15360, "none", "none", "none"),
    "llama-13b.ffn_gate_up": ("GatedGemm", 5120, 13824, "silu", "none", "none"),
    "llama-13b.ffn_down": ("GemmEpilogue", 13824, 5120, "none", "none", "full"),
    "square-4k": ("GemmEpilogue", 4096, 4096, "gelu_erf", "vector", "none"),
    "square-8k": ("GemmEpilogue", 8192, 8192, "gelu_erf", "vector", "none"),
}
#: BERT-large FFN up with each other epilogue (what the epilogue costs over the bare GEMM): named by
#: ``--shapes`` only, not in the default run. ``bert-large.ffn_up`` itself is bias + GELU erf.
EPILOGUE_SHAPES = {
    f"bert-large.ffn_up.{name}": (*SHAPES["bert-large.ffn_up"][:3], act, bias, "none")
    for name, act, bias in (("bare", "none", "none"), ("bias", "none", "vector"), ("relu", "relu", "vector"),
                            ("silu", "silu", "vector"), ("gelu_tanh", "gelu_tanh", "vector"))
}
#: FFN down split by what its epilogue adds (``bert-large.ffn_down`` itself has a bias and the residual,
#: ``llama-7b.ffn_down`` the residual only): named by ``--shapes`` only.
FFN_DOWN_SHAPES = {
    **{f"bert-large.ffn_down.{name}": (*SHAPES["bert-large.ffn_down"][:3], "none", bias, residual)
       for name, bias, residual in (("bare", "none", "none"), ("bias", "vector", "none"), ("res", "none", "full"))},
    "llama-7b.ffn_down.bare": (*SHAPES["llama-7b.ffn_down"][:3], "none", "none", "none"),
}
DEFAULT_SHAPES = tuple(SHAPES)
SHAPES.update(EPILOGUE_SHAPES)
SHAPES.update(FFN_DOWN_SHAPES)
TOKENS = (512, 4096, 32768)
QUICK_SHAPES = ("bert-large.ffn_up", "llama-7b.ffn_gate_up", "llama-7b.ffn_down")
DTYPES = ("float16",)
FP8 = "float8e4m3fn"
#: y's dtype of the FP8 points (``--fp8-output``)
FP8_OUTPUT = {"dtype": "bfloat16"}


def case_of(name: str, m: int, dtype: str) -> "T.Case":
    op, k, n, act, bias, residual = SHAPES[name]
    if name.startswith("square-"):
        m = k  # M = N = K
    out = {"output_dtype": FP8_OUTPUT["dtype"]} if dtype == FP8 else {}
    return T.Case(op, (m,), n, k, dtype, act, bias, residual, **out)


def points(shapes, tokens, dtypes):
    """(shape name, M, dtype) of every measurement; squares once (their own M)."""
    out = []
    for name in shapes:
        for dt in dtypes:
            for m in ([0] if name.startswith("square-") else tokens):
                out.append((name, case_of(name, m, dt).m, dt))
    return out


def ours_configs(case, arch, variants: str | None) -> list:
    """(label, config): the first candidate of every kernel source (what kernel_config picks
    first), then, with ``variants`` ("all" or config names), those candidates too."""
    cands = L.candidate_configs(case.op, case.dtype, case.n, case.k, arch, T.case_static(case, arch), case.activation,
                                case.y_dtype)
    out, seen = [], set()
    for c in cands:
        if c.impl not in seen:
            seen.add(c.impl)
            out.append((f"ours[{c.impl}]", c))
    if variants:
        wanted = None if variants == "all" else set(variants.split(","))
        for c in cands:
            name = L.config_name(c)
            if (wanted is None or name in wanted) and all(c != o for _, o in out):
                out.append((f"ours[{name}]", c))
    return out


def needed_sources(pts, arch, variants, with_tests=True, baseline=None, device_maps=False, schedules=False) -> list:
    """Every KernelSource a device run needs: each point's configs (and their ``baseline`` versions,
    16-bit points), its plan (and with ``device_maps`` the plan with device-built maps, with
    ``schedules`` the plan of every schedule), and the GPU tests' sources."""
    srcs = {}
    for name, m, dt in pts:
        case = case_of(name, m, dt)
        for _, cfg in ours_configs(case, arch, variants):
            s = T.case_sources(case, config=cfg, arch=arch)[0]
            srcs[s.name] = s
            if baseline and s.lang == "cuda" and not case.fp8:
                b = baseline_source(s, baseline)
                srcs[b.name] = b
        plans = [T.case_plan(case, arch, host_maps=h) for h in ((True, False) if device_maps else (True,))]
        plans += list(T.schedule_plans(case, arch).values()) if schedules else []
        for plan in plans:
            for step in plan.steps if plan is not None else ():
                srcs[step.source.name] = step.source
    if with_tests:
        for s in plugin_module("gemm", "test_kernel_gpu").gpu_test_sources(arch):
            srcs[s.name] = s
    return list(srcs.values())


# -- contenders -------------------------------------------------------------------------------------
def torch_activation(name: str):
    import torch
    import torch.nn.functional as F

    return {
        "none": lambda x: x, "relu": torch.relu, "gelu_erf": F.gelu,
        "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "sigmoid": torch.sigmoid,
        "tanh": torch.tanh, "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    }[name]


def chain_fn(case):
    """The unfused expression in eager torch (one kernel per op)."""
    import torch

    act = torch_activation(case.activation)
    if case.op == "GatedGemm":
        return lambda x, wg, wu: act(torch.mm(x, wg.t())) * torch.mm(x, wu.t())
    before = case.residual_position == "before_activation"

    def fn(x, w, bias, residual):
        y = torch.mm(x, w.t())
        if bias is not None:
            y = y + bias
        if residual is not None and before:
            y = y + residual
        y = act(y)
        if residual is not None and not before:
            y = y + residual
        return y
    return fn


def torch_inputs(case, ins):
    """The inputs the 16-bit torch contenders take (chain_fn, cublaslt_fn): the op's own, without the
    FP8 scales that follow them in the spec (absent at 16 bits)."""
    return list(ins[:3] if case.op == "GatedGemm" else ins[:4])


def cublaslt_fn(case):
    """One cuBLASLt call computing the op, or None where cuBLASLt has no such epilogue."""
    import torch

    if case.op == "GatedGemm":
        return None
    if case.residual == "none" and case.bias == "vector":
        if case.activation in ("gelu_erf", "gelu_tanh", "relu"):
            gelu = case.activation != "relu"
            return lambda x, w, b, r: torch._addmm_activation(b, x, w.t(), use_gelu=gelu)
        if case.activation == "none":
            return lambda x, w, b, r: torch.addmm(b, x, w.t())
    if case.residual == "full" and case.bias == "none" and case.activation == "none":
        return lambda x, w, b, r: torch.addmm(r, x, w.t())
    return None


class CompileBudget:
    """torch.compile within a time limit per point (SIGALRM) and a total budget."""

    def __init__(self, limit: float, budget: float):
        self.limit, self.left = limit, budget

    def compile(self, fn, args) -> tuple[object | None, str]:
        import torch

        if self.left <= 0:
            return None, "compile budget spent"
        limit = max(1, int(min(self.limit, self.left)))

        def alarm(*_):
            raise TimeoutError(f"compile over {limit}s")

        # the chain functions of all points share one code object: without a reset, dynamo's
        # recompile limit would silently run later points in eager
        torch._dynamo.reset()
        t0 = time.time()
        old = signal.signal(signal.SIGALRM, alarm)
        signal.alarm(limit)
        try:
            cfn = torch.compile(fn, mode="max-autotune-no-cudagraphs", dynamic=False)
            cfn(*args)
            torch.cuda.synchronize()
            return cfn, f"compiled in {time.time() - t0:.0f}s"
        except Exception as e:  # a failed or timed-out compile is a note, not an abort
            torch._dynamo.reset()
            return None, f"{type(e).__name__}: {str(e)[:120]}"
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
            self.left -= time.time() - t0


class Artifacts:
    """Artifacts from a prebuilt KernelCache root (else compiled with the local Triton)."""

    def __init__(self, prebuilt: str | None):
        self.prebuilt = prebuilt

    def get(self, src, arch):
        if self.prebuilt:
            art = plugin_module("flash_attention", "testing").prebuilt_artifact(src, self.prebuilt, arch or 90)
            if art is not None:
                return art, "prebuilt"
        from optfuse.kernels import build_kernel

        return build_kernel(src, arch), "local"


def _bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")  # ms


def interleaved(fns: dict, rounds: int, notes: dict) -> dict:
    """Median time of each contender over ``rounds`` rounds that visit them in turn; one that
    cannot be timed (e.g. it does not capture into a CUDA graph) is dropped with a note."""
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in list(fns.items()):
            try:
                times[k].append(_bench(fn))
            except Exception as exc:  # noqa: BLE001 - a contender's failure is reported, not fatal
                notes[k] = f"not timed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                fns.pop(k)
                times.pop(k)
    return {k: statistics.median(v) for k, v in times.items()}


def baseline_source(src, root: str):
    """``src`` compiled from the same file under the checkout ``root`` (its own name: both fit in one cache)."""
    import dataclasses

    path = Path(root).resolve() / Path(src.path).resolve().relative_to(ROOT)
    if not path.is_file():
        raise SystemExit(f"bench_gemm: --baseline {root}: no {path.relative_to(Path(root).resolve())} there")
    return dataclasses.replace(src, path=str(path), name=src.name + "_baseline")


def contenders(case, ins, compiler, artifacts, arch, variants, check, baseline=None, device_maps=False,
               schedules=False):
    """{name: callable} for one point, and notes (compile, artifact origin, accuracy)."""
    import torch

    from optfuse.kernels import launch

    notes = {}
    by_spec = list(ins)
    present = [t for t in ins if t is not None]
    ins = torch_inputs(case, ins)
    x, w = ins[0], ins[1]
    fns = {}
    if case.op == "GatedGemm":
        wgu = torch.cat([ins[1], ins[2]], 0)
        fns["mm2"] = lambda: (torch.mm(x, ins[1].t()), torch.mm(x, ins[2].t()))
        fns["packed"] = lambda: torch.mm(x, wgu.t())
    else:
        fns["mm"] = lambda: torch.mm(x, w.t())
        lt = cublaslt_fn(case)
        if lt is not None:
            fns["lt"] = lambda: lt(*ins)
    chain = chain_fn(case)
    fns["chain"] = lambda: chain(*ins)
    if compiler is not None:
        cfn, notes["compile"] = compiler.compile(chain, ins)
        if cfn is not None:
            fns["compile"] = lambda: cfn(*ins)
    stream = torch.cuda.current_stream().cuda_stream
    ref = chain(*[t.double() if t is not None else None for t in ins]) if check else None
    plan = T.case_plan(case, arch)
    if plan is not None:  # what the plugin runs at this M: the headline (the first "ours")
        fns["ours[plan]"], notes["ours[plan]"] = plan_contender(case, plan, by_spec, artifacts, arch, ref, x.dtype)
        if device_maps:
            fns["ours[plan|device maps]"], notes["ours[plan|device maps]"] = plan_contender(
                case, T.case_plan(case, arch, host_maps=False), by_spec, artifacts, arch, ref, x.dtype)
        for impl, splan in (T.schedule_plans(case, arch) if schedules else {}).items():
            label = f"ours[{impl}|plan]"
            fns[label], notes[label] = plan_contender(case, splan, by_spec, artifacts, arch, ref, x.dtype)
    for label, cfg in ours_configs(case, arch, variants):
        src, params = T.case_sources(case, config=cfg, arch=arch)
        labelled = [(label, src)]
        if baseline and src.lang == "cuda":
            labelled.append((label[:-1] + "|baseline]", baseline_source(src, baseline)))
        for lab, s in labelled:
            art, origin = artifacts.get(s, arch)
            out = torch.full((case.m, case.n), float("nan"), dtype=x.dtype, device="cuda")
            launch(art, params, present, [out], stream, sync=True)
            if check:  # the result against the chain in float64 (a wrong kernel is not timed)
                check_on_device(out, ref, case.dtype, s.name)
            notes[lab] = f"{L.config_name(cfg)} ({origin})"
            # the current stream when called: the graph capture's
            fns[lab] = (lambda a=art, p=params, o=out: launch(a, p, present, [o], torch.cuda.current_stream().cuda_stream))
    return fns, notes


def plan_contender(case, plan, by_spec, artifacts, arch, ref, dtype):
    """launch.launch_plan's plan (what the classic plugin runs at this M) as a contender, checked like the
    configs (``ref`` None: unchecked): (callable, note)."""
    import torch

    from optfuse.kernels.launcher import launch_plan

    origins = []
    for step in plan.steps:
        step.artifact, origin = artifacts.get(step.source, arch)
        origins.append(origin)
    workspace = T.new_workspace(plan, "cuda")
    out = torch.full((case.m, case.n), float("nan"), dtype=dtype, device="cuda")
    launch_plan(plan, by_spec, [out], workspace, torch.cuda.current_stream().cuda_stream, sync=True)
    if ref is not None:
        check_on_device(out, ref, T.tolerance_key(case), plan.steps[0].source.name)
    note = " + ".join(s.source.name.rsplit("/", 1)[-1] for s in plan.steps) + f" ({'/'.join(sorted(set(origins)))})"
    return (lambda: launch_plan(plan, by_spec, [out], workspace, torch.cuda.current_stream().cuda_stream)), note


def fp8_contenders(case, ins, artifacts, arch, variants, check):
    """{name: callable} for one FP8 point (the module doc's FP8 contenders), and notes."""
    import torch

    from optfuse.kernels import launch

    notes, fns = {}, {}
    names = [t.name for t in T.reference_mod().SPECS[case.op].inputs]
    by = dict(zip(names, ins))
    y_dt = getattr(torch, case.y_dtype)
    x, sa = by["A"], by["a_scale"]
    one = torch.ones((), device="cuda", dtype=torch.float32)
    act = torch_activation(case.activation)

    def scaled(w, sw=one, bias=None, rowwise=False):
        if rowwise:
            return torch._scaled_mm(x, w.t(), scale_a=sa.reshape(1, 1).expand(x.shape[0], 1).contiguous(),
                                    scale_b=sw.reshape(1, -1), bias=bias, out_dtype=y_dt)
        return torch._scaled_mm(x, w.t(), scale_a=sa.reshape(()), scale_b=sw.reshape(()), bias=bias, out_dtype=y_dt)

    bf16 = {k: (v.to(torch.bfloat16) if v is not None and v.dtype == torch.float8_e4m3fn else v) for k, v in by.items()}
    if case.op == "GatedGemm":
        wg, wu = by["W_gate"], by["W_up"]
        wgu = torch.cat([wg, wu], 0)
        fns["scaled2"] = lambda: (scaled(wg), scaled(wu))
        fns["scaled_packed"] = lambda: scaled(wgu)
        fns["rowwise"] = lambda: scaled(wgu, torch.cat([by["w_gate_scale"], by["w_up_scale"]]), rowwise=True)
        fns["fp8_chain"] = lambda: act(scaled(wg)) * scaled(wu)
        bg = torch.cat([bf16["W_gate"], bf16["W_up"]], 0)
        fns["bf16"] = lambda: torch.mm(bf16["A"], bg.t())
    else:
        w, bias, res = by["W"], by["bias"], by["residual"]
        fns["scaled"] = lambda: scaled(w)
        if bias is not None and res is None and case.activation == "none":
            fns["scaled_bias"] = lambda: scaled(w, bias=bias)
        fns["rowwise"] = lambda: scaled(w, by["w_scale"], rowwise=True)
        fns["fp8_chain"] = lambda: chain_after(case, scaled(w), bias, res, act)
        fns["bf16"] = lambda: torch.mm(bf16["A"], bf16["W"].t())
    ref = fp8_reference(case, by) if check else None
    present = [t for t in ins if t is not None]
    plan = T.case_plan(case, arch)
    if plan is not None:  # what the classic plugin runs (the sm_90 kernel with host-encoded maps): the headline
        fns["ours[plan]"], notes["ours[plan]"] = plan_contender(case, plan, list(ins), artifacts, arch, ref, y_dt)
    for label, cfg in ours_configs(case, arch, variants):
        src, params = T.case_sources(case, config=cfg, arch=arch)
        art, origin = artifacts.get(src, arch)
        out = torch.full((case.m, case.n), float("nan"), dtype=y_dt, device="cuda")
        launch(art, params, present, [out], torch.cuda.current_stream().cuda_stream, sync=True)
        if check:
            check_on_device(out, ref, T.tolerance_key(case), src.name)
        notes[label] = f"{L.config_name(cfg)} ({origin})"
        fns[label] = (lambda a=art, p=params, o=out: launch(a, p, present, [o], torch.cuda.current_stream().cuda_stream))
    return fns, notes


def chain_after(case, y, bias, residual, act):
    """The epilogue of ``case`` in eager torch on the GEMM result ``y`` (one kernel per op)."""
    before = case.residual_position == "before_activation"
    if bias is not None:
        y = y + bias
    if residual is not None and before:
        y = y + residual
    y = act(y)
    if residual is not None and not before:
        y = y + residual
    return y


def fp8_reference(case, by: dict):
    """The float64 dequantized math on the device: (A * a_scale) @ (W * w_scale[n])^T, then the epilogue."""
    a = by["A"].double() * by["a_scale"].double()
    act = torch_activation(case.activation)
    if case.op == "GatedGemm":
        g = a @ (by["W_gate"].double() * by["w_gate_scale"].double().reshape(-1, 1)).t()
        u = a @ (by["W_up"].double() * by["w_up_scale"].double().reshape(-1, 1)).t()
        return act(g) * u
    y = a @ (by["W"].double() * by["w_scale"].double().reshape(-1, 1)).t()
    bias = None if by["bias"] is None else by["bias"].double()
    res = None if by["residual"] is None else by["residual"].double()
    return chain_after(case, y, bias, res, act)


def _cuda_fp8_inputs(case, gen) -> list:
    """FP8 inputs on the GPU per spec input: A ~ N(0, 1) and weights ~ N(0, 1/K) quantized with
    saturation (per-tensor A scale, per-channel weight scales), bias and residual ~ N(0, 1) in y's dtype."""
    import torch

    R = T.reference_mod()
    names = [t.name for t in R.SPECS[case.op].inputs]
    operands, scales = R.OPERANDS[case.op], R.SCALES[case.op]
    values = {}
    for name, shape, dt in zip(names, case.shapes(), case.dtypes()):
        if shape is None or name in scales:
            continue
        t = torch.randn(tuple(shape), device="cuda", dtype=torch.float32, generator=gen)
        if name in operands[1:]:
            t = t * case.k ** -0.5
        if name not in operands:
            values[name] = t.to(getattr(torch, dt))
            continue
        scale = T.fp8_scale(t).reshape(()) if name == "A" else T.fp8_scale(t, dim=1).reshape(-1)
        values[name] = T.quantize_fp8(t, scale if name == "A" else scale.reshape(-1, 1))
        values[scales[operands.index(name)]] = scale
    return [values.get(n) for n in names]


def run_point(name, m, dtype, args, compiler, artifacts, arch) -> dict:
    import torch

    case = case_of(name, m, dtype)
    gen = torch.Generator(device="cuda").manual_seed(m * 7 + case.n)
    if case.fp8:
        ins = _cuda_fp8_inputs(case, gen)
        fns, notes = fp8_contenders(case, ins, artifacts, arch, args.variants, not args.no_check)
    else:
        ins = _cuda_inputs(case, gen)
        fns, notes = contenders(case, ins, compiler, artifacts, arch, args.variants, not args.no_check, args.baseline,
                                args.device_maps, args.schedules)
    times = interleaved(fns, args.rounds, notes)
    flops = 2.0 * case.m * case.n * case.k * (2 if case.op == "GatedGemm" else 1)
    row = {"shape": name, "op": case.op, "M": case.m, "N": case.n, "K": case.k, "dtype": dtype,
           "activation": case.activation, "bias": case.bias, "residual": case.residual,
           "ms": times, "notes": notes,
           "tflops": {k: flops / t / 1e9 for k, t in times.items()}}
    first = next(k for k in times if k.startswith("ours["))
    for base in ("mm", "lt", "chain", "compile", "packed", "mm2", *FP8_COLUMNS):
        if base in times:
            row[f"ours/{base}"] = times[first] / times[base]
    if case.fp8:
        row["output_dtype"] = case.y_dtype
    del ins, fns
    torch.cuda.empty_cache()
    return row


def _cuda_inputs(case, gen) -> list:
    """Random inputs on the GPU per spec input (None where absent): A ~ N(0, 1), weights
    ~ N(0, 1/K), bias and residual ~ N(0, 1)."""
    import torch

    out = []
    for i, shape in enumerate(case.shapes()):
        if shape is None:
            out.append(None)
            continue
        t = torch.randn(tuple(shape), device="cuda", dtype=torch.float32, generator=gen)
        if i == 1 or (case.op == "GatedGemm" and i == 2):
            t = t * case.k ** -0.5
        out.append(t.to(getattr(torch, case.dtype)))
    return out


def check_on_device(out, ref, dtype: str, what: str) -> None:
    """testing.check_close's bound, computed on the GPU (the outputs are up to 10^9 elements)."""
    import torch

    rtol, atol = T.TOLERANCE[dtype]
    o = out.double()
    if not torch.isfinite(o).all():
        raise AssertionError(f"{what}: non-finite outputs")
    bound = rtol * (ref.abs() + ref.pow(2).mean().sqrt()) + atol
    bad = int(((o - ref).abs() > bound).sum())
    if bad:
        raise AssertionError(f"{what}: {bad} of {o.numel()} elements outside the bound")


# -- output ---------------------------------------------------------------------------------------
def fmt(x, spec="6.3f") -> str:
    return "-" if x is None else format(x, spec)


COLUMNS = ("mm", "packed", "mm2", "lt", "chain", "compile")
FP8_COLUMNS = ("scaled", "scaled_packed", "scaled2", "scaled_bias", "rowwise", "fp8_chain", "bf16")


def print_table(rows) -> None:
    fp8 = [r for r in rows if r.get("dtype") == FP8]
    if fp8:
        print_fp8_table(fp8)
    rows = [r for r in rows if r.get("dtype") != FP8]
    if not rows:
        return
    print(f"{'shape':22} {'M':>6} {'dtype':8} {'ours ms':>8} " + " ".join(f"{c + ' ms':>10}" for c in COLUMNS)
          + "   ours/mm|packed  ours/lt  ours/chain  ours/compile  ours TF/s")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:22} {r['M']:6d} {r['dtype']:8} error: {r['error']}")
            continue
        ms = r["ms"]
        first = next(k for k in ms if k.startswith("ours["))
        base = r.get("ours/mm", r.get("ours/packed"))
        print(f"{r['shape']:22} {r['M']:6d} {r['dtype']:8} {ms[first]:8.3f} "
              + " ".join(f"{fmt(ms.get(c), '10.3f')}" for c in COLUMNS)
              + f"   {fmt(base, '14.3f')}  {fmt(r.get('ours/lt'), '7.3f')}  {fmt(r.get('ours/chain'), '10.3f')}"
              + f"  {fmt(r.get('ours/compile'), '12.3f')}  {r['tflops'][first]:9.0f}")
        for k in ms:
            if k.startswith("ours[") and k != first:
                print(f"{'':22} {'':6} {'':8} {ms[k]:8.3f}  {k} ({ms[k] / ms[first]:.3f}x the first)")


def print_fp8_table(rows) -> None:
    """The FP8 points: ms per contender, ours / each, ours' TF/s."""
    print(f"{'shape (FP8)':22} {'M':>6} {'y':8} {'ours ms':>8} " + " ".join(f"{c + ' ms':>13}" for c in FP8_COLUMNS)
          + "   ours/scaled|packed  ours/scaled_bias  ours/fp8_chain  ours/bf16  ours TF/s")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:22} {r['M']:6d} {'':8} error: {r['error']}")
            continue
        ms = r["ms"]
        first = next(k for k in ms if k.startswith("ours["))
        base = r.get("ours/scaled", r.get("ours/scaled_packed"))
        print(f"{r['shape']:22} {r['M']:6d} {r.get('output_dtype', ''):8} {ms[first]:8.3f} "
              + " ".join(f"{fmt(ms.get(c), '13.3f')}" for c in FP8_COLUMNS)
              + f"   {fmt(base, '18.3f')}  {fmt(r.get('ours/scaled_bias'), '16.3f')}  {fmt(r.get('ours/fp8_chain'), '14.3f')}"
              + f"  {fmt(r.get('ours/bf16'), '9.3f')}  {r['tflops'][first]:9.0f}")


#: README names of the kernel sources (GemmConfig.impl)
SCHEDULE_NAMES = {"cuda_sm90": "cooperative", "cuda_sm90_pingpong": "ping-pong",
                  "cuda_sm90_epilogue_wg": "epilogue warps", "cuda_sm90_narrow": "narrow",
                  "cuda_sm90_n192": "128 x 192", "triton": "Triton"}


def _schedule_of(label: str, note: str) -> str:
    """The README name of an ``ours[...]`` contender: its kernel source's, ``ours[plan]`` by its note's
    config (split-K plans: ``split-K xN + reduce``), ``|baseline`` and ``|device maps`` rows marked."""
    impl, _, tag = label[len("ours["):-1].partition("|")
    marked = f" ({tag})" if tag else ""
    if impl == "plan":
        cfg = note.split(" ")[0]
        split = re.search(r"_splitk(\d+)", cfg)
        if split:
            return f"split-K x{split.group(1)} + reduce{marked}"
        impl = next(i for i in sorted(SCHEDULE_NAMES, key=len, reverse=True) if cfg.startswith(i + "_"))
        return f"{SCHEDULE_NAMES[impl]}, run-time plan{marked}"
    return SCHEDULE_NAMES.get(impl, impl) + marked


def markdown_table(rows) -> list[str]:
    """The 16-bit rows of a ``--out`` file as the gemm README's table (microseconds): cuBLAS (the packed
    GEMM for GatedGemm), cuBLASLt's epilogue, the eager chain, ours (what the classic plugin runs: the
    first ``ours`` contender) and the ratios, then each other kernel source against cuBLAS."""
    out = ["| shape | M | cuBLAS | cuBLASLt epilogue | eager chain | ours (schedule) | ours / cuBLAS | ours / cuBLASLt "
           "| ours / chain | the other kernels / cuBLAS |", "|---|---|---|---|---|---|---|---|---|---|"]
    us = lambda v: "-" if v is None else f"{v * 1e3:.1f}"  # noqa: E731
    ratio = lambda a, b: "-" if b is None else f"{a / b:.2f}"  # noqa: E731
    for r in rows:
        if "error" in r or r.get("dtype") == FP8:
            continue
        ms, notes = r["ms"], r.get("notes", {})
        gated = "packed" in ms
        base = ms["packed" if gated else "mm"]
        labels = [k for k in ms if k.startswith("ours[")]
        first, ours = labels[0], ms[labels[0]]
        others = ", ".join(f"{_schedule_of(k, notes.get(k, ''))} {ms[k] / base:.2f}" for k in labels[1:])
        out.append(f"| {r['shape']} | {r['M']} | {us(base)}{' (packed)' if gated else ''} | {us(ms.get('lt'))} "
                   f"| {us(ms.get('chain'))} | {us(ours)} ({_schedule_of(first, notes.get(first, ''))}) "
                   f"| {ratio(ours, base)} | {ratio(ours, ms.get('lt'))} | {ratio(ours, ms.get('chain'))} | {others} |")
    return out


def losses(rows) -> list[str]:
    """Every point where ours is slower than bare cuBLAS (the packed GEMM for GatedGemm) or
    cuBLASLt's epilogue (FP8: than torch._scaled_mm, bare or packed, or with its bias), by how much."""
    out = []
    for r in rows:
        for base in ("mm", "packed", "lt", "scaled", "scaled_packed", "scaled_bias"):
            ratio = r.get(f"ours/{base}")
            if ratio is not None and ratio > 1.0:
                out.append(f"{r['shape']} M={r['M']} {r['dtype']}: {ratio:.3f}x {base}")
    return out


#: --schedules: a pick within this fraction of the fastest schedule's time is within a run's spread (the same
#: kernel timed twice in one run differs by up to 3 %, README "Schedules at small M")
SCHEDULE_SPREAD = 0.03


def schedule_misses(rows) -> list[str]:
    """--schedules rows where the plan's pick (``ours[plan]``) takes more than SCHEDULE_SPREAD over the
    fastest schedule's unsplit plan (``ours[<schedule>|plan]``): where a plan rule may pick wrong."""
    out = []
    for r in rows:
        ms = r.get("ms", {})
        scheds = {k[len("ours["):-len("|plan]")]: t for k, t in ms.items() if k.endswith("|plan]")}
        if "ours[plan]" not in ms or not scheds:
            continue
        best = min(scheds, key=scheds.get)
        ratio = ms["ours[plan]"] / scheds[best]
        if ratio > 1 + SCHEDULE_SPREAD:
            pick = r.get("notes", {}).get("ours[plan]", "").split(" ")[0]
            out.append(f"{r['shape']} M={r['M']} {r['dtype']}: the plan ({pick}) {ratio:.3f}x {best}")
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", metavar="DIR", help="compile every artifact a run needs into DIR and exit (CPU or GPU)")
    ap.add_argument("--prebuilt", metavar="DIR", default=os.environ.get("OPTFUSE_GEMM_PREBUILT"),
                    help="KernelCache root with prebuilt artifacts (else compiled with the local Triton)")
    ap.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                    help=f"comma list of: {', '.join(SHAPES)} (default: all but the {', '.join(EPILOGUE_SHAPES)})")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="M values (squares use M = N = K)")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--fp8", action="store_true", help="add the FP8 points (E4M3 A and weights; own table)")
    ap.add_argument("--fp8-output", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                    help="y's dtype of the FP8 points")
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK_SHAPES)} at M = 4096")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per point (medians)")
    ap.add_argument("--variants", metavar="all|NAME[,NAME]",
                    help="also time these candidate configs (launch.config_name) of ours, or all of them")
    ap.add_argument("--baseline", metavar="DIR",
                    help="also time each CUDA config compiled from this checkout's kernel source (ours[impl|baseline])")
    ap.add_argument("--device-maps", action="store_true",
                    help="also time the run-time plan with its tensor maps built on the device (ours[plan|device maps])")
    ap.add_argument("--schedules", action="store_true",
                    help="16-bit points on sm_90: also time every schedule that takes the point as an unsplit "
                         "run-time plan (host-encoded maps), beside the plan's pick")
    ap.add_argument("--arch", type=int, default=None, help="target arch of the kernel choice (default: the GPU's)")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--compile-limit", type=float, default=30.0, help="seconds per point for torch.compile")
    ap.add_argument("--compile-budget", type=float, default=90.0, help="seconds for all torch.compile runs")
    ap.add_argument("--no-check", action="store_true", help="skip ours' accuracy check against the float64 chain")
    ap.add_argument("--no-test-sources", action="store_true", help="--build: leave out the GPU tests' artifacts")
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--markdown", metavar="JSON", help="print an --out file's 16-bit rows as the gemm README's table and exit")
    args = ap.parse_args(argv)
    if args.quick:
        args.shapes, args.tokens = ",".join(QUICK_SHAPES), "4096"
    if args.fp8 and FP8 not in args.dtypes.split(","):
        args.dtypes += "," + FP8
    FP8_OUTPUT["dtype"] = args.fp8_output
    if args.markdown and not Path(args.markdown).is_file():
        ap.error(f"--markdown {args.markdown}: no such file")
    if args.baseline and not (Path(args.baseline) / "plugins/gemm/kernel_sm90.cu").is_file():
        ap.error(f"--baseline {args.baseline}: no plugins/gemm/kernel_sm90.cu there (give a checkout's root)")
    unknown = set(args.shapes.split(",")) - set(SHAPES)
    if unknown:
        ap.error(f"--shapes: unknown {', '.join(sorted(unknown))} (have {', '.join(SHAPES)})")
    try:
        args.token_list = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        ap.error(f"--tokens {args.tokens!r}: give comma-separated integers")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.markdown:
        try:
            lines = markdown_table(json.loads(Path(args.markdown).read_text())["rows"])
        except (ValueError, KeyError, TypeError, StopIteration) as e:
            print(f"bench_gemm: --markdown {args.markdown}: not a bench_gemm --out file ({type(e).__name__}: {e})",
                  file=sys.stderr)
            return 2
        print("\n".join(lines))
        return 0
    pts = points(args.shapes.split(","), args.token_list, args.dtypes.split(","))
    if args.build:
        from optfuse.kernels import KernelCache

        arch = args.arch or 90
        srcs = needed_sources(pts, arch, args.variants, with_tests=not args.no_test_sources, baseline=args.baseline,
                              device_maps=args.device_maps, schedules=args.schedules)
        t0 = time.time()
        KernelCache(args.build).build_many(srcs, arch, jobs=args.jobs)
        print(f"built {len(srcs)} artifacts for sm_{arch} in {time.time() - t0:.0f}s into {args.build}")
        return 0

    import torch

    from optfuse.kernels.target import detect_arch

    assert torch.cuda.is_available(), "needs a CUDA GPU"
    arch = args.arch or detect_arch()
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "arch": arch}
    print(json.dumps(info), flush=True)
    compiler = None if args.no_compile else CompileBudget(args.compile_limit, args.compile_budget)
    artifacts = Artifacts(args.prebuilt)
    rows = []
    for name, m, dt in pts:
        try:
            rows.append(run_point(name, m, dt, args, compiler, artifacts, arch))
        except Exception as e:  # one failing point is reported, the run goes on
            rows.append({"shape": name, "M": m, "dtype": dt, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        print_table(rows[-1:])
        sys.stdout.flush()
    print("\n== summary (ms; ratios = time ours / time contender, < 1: ours faster) ==")
    print_table(rows)
    for r in rows:
        notes = r.get("notes", {})
        print(f"  {r['shape']} M={r['M']}: " + "; ".join(f"{k}: {v}" for k, v in notes.items()))
    lost = losses(rows)
    print(f"\npoints where ours is slower than cuBLAS (packed for gated) or cuBLASLt: {len(lost)}")
    for line in lost:
        print("  " + line)
    missed = schedule_misses(rows) if args.schedules else []
    if args.schedules:
        print(f"\npoints where another schedule beats the plan's pick by more than {SCHEDULE_SPREAD:.0%}: {len(missed)}")
        for line in missed:
            print("  " + line)
    if args.out:
        Path(args.out).write_text(json.dumps({"info": info, "rows": rows, "losses": lost, "schedule_misses": missed},
                                             indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
