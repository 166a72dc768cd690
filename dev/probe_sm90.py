"""Device probe for the sm_90 GEMM (not committed): correctness vs fp64, then timing vs cuBLAS."""
import sys, time, json, os
import torch
from optfuse.kernels import build_kernel
from optfuse.kernels.launcher import launch
from optfuse.spec import plugin_module
L = plugin_module("gemm", "launch_sm90")
ref = plugin_module("gemm", "reference")
dev = "cuda"
TD = {"float16": torch.float16, "bfloat16": torch.bfloat16}

def make(op, dtype, M, N, K, bias_mode=0, res_mode=0, swap=False, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    t = TD[dtype]
    A = torch.randn(M, K, device=dev, generator=g).to(t)
    if op == "GatedGemm":
        W2 = (torch.randn(2, N, K, device=dev, generator=g) / K ** 0.5).to(t)
        Wg, Wu = (W2[1], W2[0]) if swap else (W2[0], W2[1])
        return [A, Wg, Wu], (W2,)
    W = (torch.randn(N, K, device=dev, generator=g) / K ** 0.5).to(t)
    ins = [A, W]
    if bias_mode: ins.append(torch.randn(N if bias_mode == 2 else 1, device=dev, generator=g).to(t))
    if res_mode: ins.append(torch.randn((M, N) if res_mode == 2 else (1,), device=dev, generator=g).to(t))
    return ins, ()

def run(op, dtype, ins, attrs, static, cfg=None, out=None):
    src = L.kernel_config(op, dtype, attrs, static, cfg)
    art = build_kernel(src, 90)
    p = L.launch_params(op, [list(ins[0].shape)], static, cfg)
    N = static["N"]
    if out is None:
        out = torch.full((ins[0].shape[0], N), float("nan"), device=dev, dtype=ins[0].dtype)
    return art, p, out

def reference64(op, ins, attrs, bias_mode, res_mode):
    x = [t.double().cpu().numpy() for t in ins]
    if op == "GatedGemm":
        return ref.gated_gemm64(x[0], x[1], x[2], attrs.get("activation", "silu"))
    i = 2
    b = r = None
    if bias_mode: b = x[i]; i += 1
    if res_mode: r = x[i]
    return ref.gemm_epilogue64(x[0], x[1], b, r, attrs.get("activation", "none"), attrs.get("alpha", 1.0),
                               attrs.get("residual_position", "after_activation"))

import numpy as np
fails = 0
cases = [
    ("GemmEpilogue", "float16", 1000, 768, 1000, 2, 2, {"activation": "gelu_erf"}),
    ("GemmEpilogue", "bfloat16", 333, 1024, 512, 2, 2, {"activation": "gelu_tanh", "residual_position": "before_activation"}),
    ("GemmEpilogue", "float16", 257, 896, 264, 1, 1, {"activation": "silu", "alpha": 0.5}),
    ("GemmEpilogue", "float16", 4096, 4096, 1024, 2, 0, {"activation": "relu"}),
    ("GemmEpilogue", "bfloat16", 130, 2304, 768, 2, 0, {"activation": "none"}),
    ("GemmEpilogue", "float16", 77, 512, 64, 0, 0, {"activation": "quick_gelu"}),
    ("GemmEpilogue", "float16", 200, 512, 128, 2, 2, {"activation": "sigmoid"}),
    ("GemmEpilogue", "bfloat16", 200, 512, 128, 2, 2, {"activation": "tanh"}),
    ("GatedGemm", "float16", 777, 1408, 512, 0, 0, {"activation": "silu"}),
    ("GatedGemm", "bfloat16", 300, 640, 4096, 0, 0, {"activation": "gelu_tanh"}),
    ("GatedGemm", "float16", 65, 256, 136, 0, 0, {"activation": "gelu_erf", "swap": True}),
]
for op, dt, M, N, K, bm, rm, attrs in cases:
    swap = attrs.pop("swap", False)
    ins, keep = make(op, dt, M, N, K, bm, rm, swap)
    static = {"N": N, "K": K, "bias_mode": bm, "residual_mode": rm, "arch": 90}
    why = L.takes(op, dt, static)
    if why: print("NOT TAKEN", op, N, why); continue
    art, p, out = run(op, dt, ins, attrs, static)
    launch(art, p, ins, [out], 0, sync=True)
    want = reference64(op, ins, attrs, bm, rm)
    got = out.double().cpu().numpy()
    err = np.abs(got - want); scale = np.abs(want).max()
    tol = (4e-3 if dt == "float16" else 2e-2) * max(1.0, scale)
    ok = np.isfinite(got).all() and err.max() <= tol
    fails += not ok
    print(f"{'ok  ' if ok else 'FAIL'} {op} {dt} M{M} N{N} K{K} bias{bm} res{rm} {attrs}: max err {err.max():.3g} (tol {tol:.3g}) nan {int(np.isnan(got).sum())}")
print("correctness fails:", fails, flush=True)
if fails and "--force" not in sys.argv:
    sys.exit(1)

def bench(fn, reps=20):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    ts.sort(); return ts[len(ts) // 2] * 1e3  # us

rows = []
shapes = [  # name, op, N, K, bias, res, act
    ("bert_large_ffn1", "GemmEpilogue", 4096, 1024, 2, 0, "gelu_erf"),
    ("bert_large_ffn2", "GemmEpilogue", 1024, 4096, 2, 2, "none"),
    ("llama7b_gate_up", "GatedGemm", 11008, 4096, 0, 0, "silu"),
    ("llama7b_down", "GemmEpilogue", 4096, 11008, 0, 2, "none"),
    ("bert_large_qkv", "GemmEpilogue", 3072, 1024, 2, 0, "none"),
    ("square4k", "GemmEpilogue", 4096, 4096, 0, 0, "none"),
]
Ms = [int(m) for m in os.environ.get("PROBE_M", "4096,16384").split(",")]
cfgs = [None] + ([L.SM90Config(stages=3), L.SM90Config(group_m=16)] if "--cfgs" in sys.argv else [])
for name, op, N, K, bm, rm, act in shapes:
    for M in Ms:
        dt = "float16"
        ins, keep = make(op, dt, M, N, K, bm, rm)
        static = {"N": N, "K": K, "bias_mode": bm, "residual_mode": rm, "arch": 90}
        attrs = {"activation": act}
        A = ins[0]
        if op == "GatedGemm":
            Wcat = keep[0].reshape(2 * N, K)
            bare = lambda: torch.mm(A, Wcat.t())
            flops = 2 * M * 2 * N * K
            def chain():
                g = torch.mm(A, ins[1].t()); u = torch.mm(A, ins[2].t()); return torch.nn.functional.silu(g) * u
        else:
            W = ins[1]
            bare = lambda: torch.mm(A, W.t())
            flops = 2 * M * N * K
            bias = ins[2] if bm else None
            def chain():
                y = torch.mm(A, W.t())
                if bias is not None: y = y + bias
                if act == "gelu_erf": y = torch.nn.functional.gelu(y)
                if rm: y = y + ins[-1]
                return y
        t_bare = bench(bare); t_chain = bench(chain)
        t_lt = None
        if op == "GemmEpilogue" and bm == 2 and act in ("gelu_erf", "none") and not rm:
            t_lt = bench(lambda: torch._addmm_activation(ins[2], A, ins[1].t(), use_gelu=(act == "gelu_erf")) if act != "none" else torch.addmm(ins[2], A, ins[1].t()))
        for cfg in cfgs:
            art, p, out = run(op, dt, ins, attrs, static, cfg)
            t_ours = bench(lambda: launch(art, p, ins, [out], 0))
            r = dict(shape=name, M=M, N=N, K=K, cfg=None if cfg is None else L.config_name(cfg), ours_us=round(t_ours, 1), bare_us=round(t_bare, 1),
                     chain_us=round(t_chain, 1), lt_us=None if t_lt is None else round(t_lt, 1),
                     ours_tflops=round(flops / t_ours / 1e6, 1), bare_tflops=round(flops / t_bare / 1e6, 1))
            rows.append(r)
            print(f"{name:18s} M{M:6d} {r['cfg'] or 'default':18s} ours {t_ours:8.1f} us ({r['ours_tflops']:5.0f} TF)  bare {t_bare:8.1f} ({r['bare_tflops']:5.0f} TF)  "
                  f"ours/bare {t_ours / t_bare:5.3f}  chain/ours {t_chain / t_ours:5.3f}" + (f"  lt/ours {t_lt / t_ours:5.3f}" if t_lt else ""), flush=True)
os.makedirs(os.environ.get("OUT", "/tmp/out"), exist_ok=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp/out"), "probe.json"), "w"), indent=1)
