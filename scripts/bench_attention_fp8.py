"""``bench_attention.py --fp8``: the FP8 FlashAttention kernel vs our BF16 kernel, same run.

The dense grid of bench_attention.py (B*S = 16k tokens, H*D = 2048, S 512..16k, D 64/128, causal
and not). Per shape, in interleaved rounds (medians of triton.testing.do_bench, L2 flushed):

* ``fp8``: the FP8 form (E4M3 q, k, v quantized per tensor from the bf16 inputs, v transposed to
  [B, H, D, S], bf16 output) -- the kernel launch.py picks for FP8 on the target (``--arch 90``,
  D = 128: the CUDA kernel's FP8 path, with the Triton kernel's FP8 branch timed beside it as
  ``fp8_triton``; elsewhere the Triton kernel), through the launcher;
* ``bf16``: the kernel launch.py picks for bf16 on the target (``--arch 90``: the CUDA sm90 kernel,
  with the bf16 Triton kernel timed beside it as ``bf16_triton``; default: the Triton kernel).

Both forms run as the classic plugin launches them (testing.launch_fn: on sm_90 the CUDA kernel's
HOST_MAPS build, its tensor maps encoded by the launcher).

With ``--fp8-padding F`` both forms take a [B, 1, 1, S] key-padding bias (bf16; the last F of each
batch's keys at finfo.min, F = 0 a mask that masks nothing): the kernels each form runs with HF's
padding mask (rows ``"bias": "key_padding"``, ``"padding": F``).

Effective TF/s = 4 * B * H * S^2 * D / time (half for causal; dense, whatever the padding), the
same formula for both, so the speedup is the time ratio. The FP8 output is checked against the bf16 kernel's (max abs error
relative to max |o|, at most FP8_CHECK) before timing. The summary lists every D = 128, S >= 4096
shape under the targets (FP8 >= 1.5x our best bf16 kernel and >= 900 TF/s).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from optfuse.kernels.registry import plugin_module
from optfuse.plugin_dirs import script_module

T = plugin_module("flash_attention", "testing")
L = plugin_module("flash_attention", "launch")

OUT_DTYPE = "bfloat16"
#: FP8 vs bf16 outputs of N(0, 1) inputs: max |difference| / max |o| (E4M3 q, k, v and p: a few %)
FP8_CHECK = 0.15
TARGET_SPEEDUP = 1.5
TARGET_TFS = 900.0


def padding_shape(S: int, D: int) -> tuple[int, int, int, int]:
    """The key-padding bias of a dense-grid shape: [B, 1, 1, S]."""
    B, _ = script_module("bench_attention").shape_of(S, D)
    return (B, 1, 1, S)


def fp8_case(S: int, D: int, causal, padded: bool = False) -> tuple[list, dict]:
    """(shapes [q, k, v^T, bias-or-None], attrs) of the FP8 form on a dense-grid shape (bf16 output;
    ``padded``: with the bf16 key-padding bias)."""
    bench = script_module("bench_attention")
    B, H = bench.shape_of(S, D)
    attrs = {**T.attrs_for(H, H, D, causal), "output_dtype": OUT_DTYPE}
    skv = plugin_module("flash_attention", "reference").fp8_v_keys(S)
    return [(B, H, S, D), (B, H, S, D), (B, H, D, skv), padding_shape(S, D) if padded else None], attrs


def fp8_source_for(S: int, D: int, causal, config=None, arch=None, padded: bool = False):
    """KernelSource + LaunchParams of the FP8 form's one kernel on a dense-grid shape, the choice
    for ``arch`` unless ``config`` is given."""
    shapes, attrs = fp8_case(S, D, causal, padded)
    return T.case_sources(L.FP8, shapes, attrs, config=config, arch=arch,
                          bias_dtype=OUT_DTYPE if padded else None)


def fp8_launched_sources(S: int, D: int, causal, config=None, arch=None, padded: bool = False) -> list:
    """The KernelSources the FP8 form launches on a dense-grid shape (T.launch_sources: sm_90's
    HOST_MAPS build, whose config follows the shapes; else the one kernel)."""
    shapes, attrs = fp8_case(S, D, causal, padded)
    return T.launch_sources(L.FP8, shapes, attrs, arch=arch, config=config, bias_dtype=OUT_DTYPE if padded else None)


def _test_case_source(case, arch=None, config=None):
    """The KernelSource test_kernel_fp8_gpu.check_fp8_case builds for ``case`` (its bias in o's
    16-bit type, fp16 for an fp32 o)."""
    B, H, Hkv, Sq, Sk, D, causal, bias_shape, out_dtype, extra = case
    attrs, _ = T.sparse_attrs(H, Hkv, D, causal, Sq, Sk, extra)
    attrs["output_dtype"] = out_dtype
    skv = plugin_module("flash_attention", "reference").fp8_v_keys(Sk)
    bias_dtype = None if bias_shape is None else ("bfloat16" if out_dtype == "bfloat16" else "float16")
    src, _ = T.case_sources(L.FP8, [(B, H, Sq, D), (B, Hkv, Sk, D), (B, Hkv, D, skv), bias_shape], attrs,
                            config=config, bias_dtype=bias_dtype, arch=arch)
    return src


def fp8_build_sources(dims, seqs=(4096,), sweep: bool = False, arch=None, padded: bool = False) -> list:
    """The FP8 sources a device run needs: each (D, causal) config launch.py picks (one per
    (D, causal): kernel_config cannot see S), the GPU tests' cases, and with ``sweep`` every
    candidate config (``arch`` 90: the CUDA kernel's and the Triton kernel's); with ``padded`` also
    both forms with the key-padding bias (--fp8-padding)."""
    srcs = {}
    gpu = plugin_module("flash_attention", "test_kernel_fp8_gpu")
    for case in gpu.CASES:
        for a in {None, arch}:
            s = _test_case_source(case, a)
            srcs[s.name] = s
    if arch == 90:  # test_fp8_sm90_variants
        for kw in gpu.SM90_VARIANTS.values():
            for case in gpu.SM90_VARIANT_CASES:
                s = _test_case_source(case, 90, L.sm90_config(case[5], case[6], fp8=True, **kw))
                srcs[s.name] = s
    for D in dims:
        for causal in (0, 1):
            for S in seqs:
                cfgs = [None] + (candidates(D, causal, arch) if sweep else [])
                for a in {None, arch}:
                    for cfg in cfgs:
                        srcs.update((s.name, s) for s in fp8_launched_sources(S, D, causal, cfg, arch=a))
                    if padded:
                        srcs.update((s.name, s) for s in fp8_launched_sources(S, D, causal, arch=a, padded=True))
                        srcs.update((s.name, s) for s in script_module("bench_attention").launched_sources(
                            OUT_DTYPE, S, D, causal, bias_shape=padding_shape(S, D), arch=a))
    return list(srcs.values())


def padding_bias(B: int, S: int, padding: float, device="cuda"):
    """[B, 1, 1, S] bf16: 0 on each batch's first S - round(padding * S) keys, finfo.min after."""
    import torch

    bias = torch.zeros(B, 1, 1, S, device=device, dtype=torch.bfloat16)
    cut = S - int(round(padding * S))
    bias[..., cut:] = torch.finfo(torch.bfloat16).min
    return bias


def run_fp8_shape(runner, S: int, D: int, causal, arch=None, rounds: int = 3, config=None,
                  padding: float | None = None) -> dict:
    """One dense-grid shape: FP8 vs our bf16 kernel(s), checked, timed in interleaved rounds;
    ``padding`` (a fraction): both forms with the key-padding bias (module doc)."""
    import torch

    from optfuse.kernels import launch

    bench = script_module("bench_attention")
    B, H = bench.shape_of(S, D)
    gen = torch.Generator(device="cuda").manual_seed(S * 31 + D)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    q8, k8, vt8, scales = T.fp8_inputs(q, k, v)
    stream = torch.cuda.current_stream().cuda_stream
    fl = bench.flops(B, H, S, D, causal)
    padded = padding is not None
    bias = [padding_bias(B, S, padding)] if padded else []
    shapes8, attrs8 = fp8_case(S, D, causal, padded)
    found = []

    def artifact(src, _arch):
        art_, where_ = runner.artifact(src)
        found.append((art_, where_))
        return art_

    ins8 = [q8, k8, vt8, bias[0] if padded else None, *scales]  # spec order (None: no bias)
    out8 = torch.full_like(q, float("nan"))
    fns = {}
    fns["fp8"], kernel8 = T.launch_fn(L.FP8, shapes8, attrs8, ins8, out8, bench._stream, arch=arch,
                                      bias_dtype=OUT_DTYPE if padded else None, config=config, artifact=artifact)
    art8, where = found[-1]
    fns["fp8"](sync=True)
    row = {"mode": "fp8", "B": B, "H": H, "S": S, "D": D, "causal": int(causal), "kernel": kernel8,
           "artifact": where, "smem": art8.shared_mem, **({"bias": "key_padding", "padding": padding} if padded else {})}
    outs = {}
    src8, _ = fp8_source_for(S, D, causal, config, arch=arch, padded=padded)
    if config is None and src8.lang == "cuda":  # the Triton kernel's FP8 branch beside it
        srct, paramst = fp8_source_for(S, D, causal, padded=padded)
        artt, _ = runner.artifact(srct)
        outt = torch.full_like(q, float("nan"))
        present8 = [x for x in ins8 if x is not None]
        launch(artt, paramst, present8, [outt], stream, sync=True)
        row["fp8_triton_kernel"] = srct.name
        outs["fp8_triton"] = outt
        fns["fp8_triton"] = lambda: launch(artt, paramst, present8, [outt], stream)
    attrs16 = T.attrs_for(H, H, D, causal)
    shapes16 = [q.shape, k.shape, v.shape, padding_shape(S, D) if padded else None]
    for name, a in (("bf16", arch), ("bf16_triton", None)):
        if name == "bf16_triton" and arch is None:
            continue
        o = torch.full_like(q, float("nan"))
        fn, kernel = T.launch_fn(OUT_DTYPE, shapes16, attrs16, [q, k, v, *bias], o, bench._stream, arch=a,
                                 artifact=artifact)
        if name == "bf16_triton" and kernel == row.get("bf16_kernel"):
            continue  # the target's bf16 choice is the Triton kernel already
        fn(sync=True)
        outs[name] = o
        row[f"{name}_kernel"] = kernel
        fns[name] = fn
    ref = outs["bf16"].float()
    for name, o8 in (("fp8", out8), ("fp8_triton", outs.get("fp8_triton"))):
        if o8 is None:
            continue
        err = float((o8.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
        row[f"{name}_rel_max_err_vs_bf16"] = err
        if not err <= FP8_CHECK:
            row["error"] = f"{name} output differs from the bf16 kernel's by {err:.3g} of max |o| (> {FP8_CHECK})"
    times = bench.interleaved(fns, rounds)
    for name, t in times.items():
        row[f"{name}_ms"] = t
        row[f"{name}_tfs"] = fl / t * 1e-9
    best16 = max(row[f"{n}_tfs"] for n in times if not n.startswith("fp8"))
    row["speedup"] = row["fp8_tfs"] / best16
    row["rounds"] = rounds
    torch.cuda.empty_cache()
    return row


def misses(rows) -> list[dict]:
    """D = 128, S >= 4096 rows under the targets (>= 1.5x our best bf16 kernel, >= 900 TF/s)."""
    return [r for r in rows if r["D"] == 128 and r["S"] >= 4096 and not r.get("error")
            and (r["speedup"] < TARGET_SPEEDUP or r["fp8_tfs"] < TARGET_TFS)]


def print_rows(rows) -> None:
    fmt = script_module("bench_attention").fmt
    print(f"{'S':>6} {'D':>4} {'c':>2} {'fp8':>7} {'fp8tr':>7} {'bf16':>7} {'bf16tr':>7} {'x':>6} {'err':>7}  kernel")
    for r in rows:
        print(f"{r['S']:6d} {r['D']:4d} {r['causal']:2d} {fmt(r.get('fp8_tfs'))} {fmt(r.get('fp8_triton_tfs'))} "
              f"{fmt(r.get('bf16_tfs'))} {fmt(r.get('bf16_triton_tfs'))} {fmt(r.get('speedup'), '6.2f')} "
              f"{fmt(r.get('fp8_rel_max_err_vs_bf16'), '7.4f')}  {r.get('error') or r.get('kernel', '')}")


def candidates(D: int, causal, arch=None) -> list:
    """What a sweep times: the target's FP8 candidates (sm_90, D = 128: the CUDA kernel's) and the
    Triton kernel's."""
    out = L.candidate_configs(L.FP8, D, causal, arch=arch)
    return out + [c for c in L.candidate_configs(L.FP8, D, causal) if c not in out]


def sweep_fp8(runner, dims, seqs, arch=None) -> list[dict]:
    """Every FP8 candidate config (launch.candidate_configs) on each (D, causal, S), one round each."""
    rows = []
    for D in dims:
        for causal in (0, 1):
            for S in seqs:
                for cfg in candidates(D, causal, arch):
                    try:
                        r = run_fp8_shape(runner, S, D, causal, arch=arch, rounds=1, config=cfg)
                    except Exception as e:
                        r = {"S": S, "D": D, "causal": causal, "error": f"{type(e).__name__}: {str(e)[:200]}"}
                    r["config"] = list(cfg.__dict__.values())
                    rows.append(r)
                    print(f"S{S:6d} D{D:4d} c{causal} {str(r['config']):40} "
                          f"{r.get('fp8_tfs', 0):7.1f} TF/s {r.get('error', '')}", flush=True)
    return rows


def main_fp8(args, runners) -> int:
    """The ``--fp8`` table: every (D, causal, S) of the grid, then the target summary; with
    ``--sweep``, the FP8 candidate configs at bench_attention's sweep lengths instead."""
    import torch

    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "mode": "fp8", "arch": args.arch}
    print(json.dumps(info))
    bench = script_module("bench_attention")
    dims = [int(d) for d in args.dims.split(",")]
    seqs = [int(s) for s in args.seqs.split(",")]
    padding = getattr(args, "fp8_padding", None)
    bench.prebuild_missing(runners, fp8_build_sources(dims, seqs, sweep=args.sweep, arch=args.arch,
                                                      padded=padding is not None))
    if args.sweep:
        rows = sweep_fp8(runners[0], dims, bench.SWEEP_SEQS if args.seqs == ",".join(map(str, bench.SEQS)) else seqs,
                         arch=args.arch)
        if args.out:
            Path(args.out).write_text(json.dumps({"info": info, "rows": rows}, indent=1))
        return 0
    rows = []
    for D in dims:
        for causal in (int(c) for c in args.causal.split(",")):
            for S in seqs:
                try:
                    rows.append(run_fp8_shape(runners[0], S, D, causal, arch=args.arch, rounds=args.rounds,
                                              padding=padding))
                except Exception as e:  # a failing shape is a row, the grid goes on
                    rows.append({"S": S, "D": D, "causal": causal, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                print_rows(rows[-1:])
                sys.stdout.flush()
    print("\n== FP8 vs bf16 (effective TF/s; x = FP8 / our best bf16 kernel) ==")
    print_rows(rows)
    miss = misses([r for r in rows if "speedup" in r])
    print(f"\nD = 128, S >= 4096 shapes under target (>= {TARGET_SPEEDUP}x and >= {TARGET_TFS:.0f} TF/s): {len(miss)}")
    for r in miss:
        print(f"  S{r['S']} D{r['D']} causal={r['causal']}: {r['fp8_tfs']:.0f} TF/s, {r['speedup']:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    return 1 if any(r.get("error") for r in rows) else 0
