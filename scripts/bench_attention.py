#!/usr/bin/env python3
"""FlashAttention benchmark: the optfuse kernel vs torch scaled_dot_product_attention.

Sweep (issue 5): B*S = 16k tokens, H*D = 2048, S in 512..16k, D in {64, 128}, causal and not,
bf16 and fp16. For each shape it times

* ``ours``: the AOT artifacts (cubins) launched through ``optfuse.kernels.launcher`` as the
  classic TensorRT plugin launches them (testing.launch_fn: launch.py's plan where it makes one --
  with ``--arch 90`` the CUDA kernel with host-encoded tensor maps -- else the one kernel; a swept
  or ``--variants`` config launched the same way); taken from ``--prebuilt`` (a KernelCache root
  built on the CPU machine with ``--build``) or compiled with the local Triton;
  ``--device-maps`` adds ``ours[device maps]``, the same kernel building its maps on the device
  (what QDP runs);
* ``jit``: the same KernelSource through Triton's JIT (local Triton) as a cross-check;
* SDPA with each backend that runs (flash, cudnn, efficient) and the default choice.

TF/s = 4 * B * H * S^2 * D / time (half of that for causal). Times are medians of
triton.testing.do_bench (L2 flushed between calls).

    python scripts/bench_attention.py --build .optfuse_cache/fa          # CPU: prebuild cubins
    python scripts/bench_attention.py --prebuilt .optfuse_cache/fa --out bench.json   # GPU
    python scripts/bench_attention.py --sweep --prebuilt ... --out sweep.json         # tuning
    python scripts/bench_attention.py --fp8 [--arch 90] --out fp8.json    # FP8 vs our bf16 kernel

``--fp8`` (scripts/bench_attention_fp8.py) times the FP8 form (E4M3 q, k, v, bf16 output) against
our bf16 kernel on the same grid in the same run; with ``--build`` it compiles the FP8 artifacts
too, with ``--sweep`` it times the FP8 candidate configs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from optfuse.kernels.registry import plugin_module  # noqa: E402

T = plugin_module("flash_attention", "testing")
L = plugin_module("flash_attention", "launch")

TOKENS = 16384
HIDDEN = 2048
SEQS = (512, 1024, 2048, 4096, 8192, 16384)
DIMS = (64, 128)
DTYPES = ("bfloat16", "float16")
MASK_DTYPE = "bfloat16"  # the mask rows (scalar bias, key padding), at S = 4096
SWEEP_SEQS = (1024, 4096)


def shape_of(S: int, D: int) -> tuple[int, int]:
    return TOKENS // S, HIDDEN // D


def flops(B, H, S, D, causal) -> float:
    f = 4.0 * B * H * S * S * D
    return f / 2 if causal else f


def source_for(dtype, S, D, causal, config=None, bias_shape=None, arch=None):
    B, H = shape_of(S, D)
    attrs = T.attrs_for(H, H, D, causal)
    shapes = [(B, H, S, D), (B, H, S, D), (B, H, S, D), bias_shape]
    return T.case_sources(dtype, shapes, attrs, config=config, arch=arch)


def launched_sources(dtype, S, D, causal, config=None, bias_shape=None, arch=None):
    """The KernelSources ``ours`` launches on a grid shape (T.launch_sources: the plan's, sm_90's
    HOST_MAPS builds whose config follows B and S; else the one kernel)."""
    B, H = shape_of(S, D)
    return T.launch_sources(dtype, [(B, H, S, D)] * 3 + [bias_shape], T.attrs_for(H, H, D, causal), arch=arch,
                            config=config)


def _gpu_test_sources(arch=None):
    """The GPU tests' KernelSources: each case's Triton kernel and, with ``arch=90``, the CUDA
    kernel of every case it takes, in every variant test_kernel_gpu.py runs."""
    mod = plugin_module("flash_attention", "test_kernel_gpu")
    out = []
    for case in mod.CASES:
        B, H, Hkv, Sq, Sk, D, causal, bias_shape, dtype, _ = case
        attrs = T.attrs_for(H, Hkv, D, causal)
        shapes = [(B, H, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, D), bias_shape]
        out.append(T.case_sources(dtype, shapes, attrs)[0])
        if arch == 90 and mod._sm90_applies(case):
            cfgs = [L.sm90_config(D, causal)] + [mod.variant_config(v, D, causal) for v in mod.SM90_VARIANTS]
            for cfg in filter(None, cfgs):
                out.append(T.case_sources(dtype, shapes, attrs, config=cfg, arch=90)[0])
    return out


def parse_variants(text: str | None) -> list[tuple[str, dict]]:
    """``--variants "softmax_stream=0;num_stages=3,tma=0"`` -> [(name, FAConfig overrides)]."""
    out = []
    fields = {f.name: f.type for f in dataclasses.fields(L.FAConfig)}
    for spec in filter(None, (text or "").split(";")):
        kv = {}
        for item in spec.split(","):
            k, _, v = item.partition("=")
            k, v = k.strip(), v.strip()
            typ = fields.get(k)
            if typ is None or not v or (typ in (int, "int") and not v.lstrip("-").isdigit()):
                raise SystemExit(f"bench_attention: bad --variants item {item!r} "
                                 f"(FAConfig fields: {', '.join(fields)})")
            kv[k] = (v.lower() in ("1", "true") if typ in (bool, "bool")
                     else int(v) if typ in (int, "int") else v)
        out.append((spec.strip(), kv))
    return out


def variant_configs(dtype, D, causal, variants, keypad=False):
    """The CUDA kernel's default config for the case with each variant's overrides applied
    ([] where the CUDA kernel does not apply)."""
    if not variants or not L.sm90_eligible(dtype, D, None, 1.0, 90):
        return []
    base = L.sm90_config(D, causal, keypad=keypad)
    out = []
    for name, kv in variants:
        cfg = dataclasses.replace(base, **kv)
        try:  # a variant the kernel does not take at this D (e.g. block_m 192 at D = 128)
            source_for(dtype, 4096, D, causal, cfg, arch=90)
        except ValueError as e:
            print(f"variant {name}: skipped at D={D}: {e}", file=sys.stderr)
            continue
        out.append((name, cfg))
    return out


def build_sources(sweep: bool = True, tests: bool = True, configs: dict | None = None,
                  sweep_dtypes=("bfloat16",), arch=None, variants=()):
    """Every KernelSource a device run may need, most needed first: the GPU test cases, the chosen
    config of each benchmark shape (plus bias variants), then the sweep candidates. ``arch=90``
    adds the CUDA kernel's (the shipped choice, the mask rows of both kernels, its sweep)."""
    srcs = {}
    if tests:
        for s in _gpu_test_sources(arch):
            srcs[s.name] = s
    combos = [(dt, D, c) for dt in DTYPES for D in DIMS for c in (0, 1)]

    def add(sources):
        srcs.update((s.name, s) for s in sources)

    for dtype, D, causal in combos:
        cfg = (configs or {}).get((D, causal))
        B, H = shape_of(4096, D)
        for a in {None, arch}:
            for S in SEQS:  # a plan's config follows B and S
                add(launched_sources(dtype, S, D, causal, cfg, None, a))
            for bshape in ((), (B, 1, 1, 4096)):  # with arch 90: the CUDA kernel where it applies
                add(launched_sources(dtype, 4096, D, causal, cfg, bshape, a))
        for bshape in (None, (), (B, 1, 1, 4096)):  # variants of the shapes and of the mask rows
            if bshape is not None and dtype != MASK_DTYPE:
                continue
            for _, vcfg in variant_configs(dtype, D, causal, variants, keypad=bool(bshape)):
                add(launched_sources(dtype, 4096, D, causal, vcfg, bshape, arch=90))
    if sweep:
        for dtype, D, causal in combos:
            if dtype not in sweep_dtypes:
                continue
            for a in {None, arch}:
                for cfg in L.candidate_configs(dtype, D, causal, arch=a):
                    add(launched_sources(dtype, 4096, D, causal, cfg, arch=a))
    return list(srcs.values())


def prebuild_missing(runners, srcs, jobs=16):
    """Compile (in parallel, local Triton) the sources no prebuilt root has."""
    from optfuse.kernels import default_cache

    missing = [s for s in srcs
               if not any(r.prebuilt and T.prebuilt_artifact(s, r.prebuilt) for r in runners)]
    if missing:
        t0 = time.time()
        default_cache().build_many(missing, None, jobs=jobs)
        print(f"compiled {len(missing)} missing artifacts locally in {time.time() - t0:.0f}s", flush=True)


# ---------------------------------------------------------------------------------------------
def _sdpa_backends():
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def _default_backend(q, k, v, causal):
    import torch

    from torch.nn.attention import SDPBackend

    try:
        idx = torch._fused_sdp_choice(q, k, v, None, 0.0, bool(causal))
        return SDPBackend(int(idx)).name.lower()
    except Exception as e:  # private API; report what happened
        return f"? ({type(e).__name__})"


class Runner:
    """Artifacts from one prebuilt KernelCache root (else compiled with the local Triton)."""

    def __init__(self, prebuilt: str | None):
        self.prebuilt = prebuilt

    def artifact(self, src):
        if self.prebuilt:
            art = T.prebuilt_artifact(src, self.prebuilt)
            if art is not None:
                return art, "prebuilt:" + Path(self.prebuilt).name
        from optfuse.kernels import build_kernel

        return build_kernel(src), "local"


def choose_from_sweep(path):
    """(D, causal) -> (FAConfig, root): the config with the best geometric mean TF/s over the
    swept sequence lengths (one config per (D, causal): kernel_config cannot see S)."""
    import math

    rows = [r for r in json.loads(Path(path).read_text())["rows"] if r.get("ours_tfs") and not r.get("error")]
    best = {}
    for D, causal in {(r["D"], r["causal"]) for r in rows}:
        seqs = {r["S"] for r in rows if (r["D"], r["causal"]) == (D, causal)}
        score = {}
        for r in rows:
            if (r["D"], r["causal"]) != (D, causal):
                continue
            key = (tuple(r["config"]), r["root"])
            score.setdefault(key, {}).setdefault(r["S"], []).append(r["ours_tfs"])
        full = {k: math.exp(sum(math.log(sum(v) / len(v)) for v in d.values()) / len(d))
                for k, d in score.items() if set(d) == seqs}
        (cfg, root), tfs = max(full.items(), key=lambda kv: kv[1])
        best[(D, causal)] = (L.FAConfig(*cfg), root, tfs)
    return best


def _bench(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # ms


def time_jit(src, params, q, k, v, bias, out):
    ins = [q, k, v] + ([bias] if bias is not None else [])
    T.run_triton(src, params, ins, [out])
    return _bench(lambda: T.run_triton(src, params, ins, [out]))


def interleaved(fns: dict, rounds: int) -> dict:
    """Median time of each contender over ``rounds`` rounds that visit them in turn: the GPU's
    clock drifts by several per cent over a run (power, temperature), so contenders timed
    back to back in rounds are compared under the same conditions."""
    import statistics

    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            times[k].append(_bench(fn))
    return {k: statistics.median(v) for k, v in times.items()}


def _stream():
    """The current torch stream at call time."""
    import torch

    return torch.cuda.current_stream().cuda_stream


def run_shape(runner, dtype, S, D, causal, config=None, bias=None, sdpa=True, jit=True, arch=None,
              triton_too=False, rounds=1, variants=(), device_maps=False):
    import torch
    import torch.nn.functional as F

    B, H = shape_of(S, D)
    tdt = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(S * 31 + D)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=tdt, generator=gen) for _ in range(3))
    bias_t = None
    if bias == "scalar":
        bias_t = torch.zeros((), device="cuda", dtype=tdt)
    elif bias == "keypad":
        bias_t = torch.zeros(B, 1, 1, S, device="cuda", dtype=tdt)
        bias_t[..., S - S // 8:] = torch.finfo(tdt).min
    bias_shape = None if bias_t is None else tuple(bias_t.shape)
    src, params = source_for(dtype, S, D, causal, config, bias_shape, arch=arch)
    jit = jit and src.lang == "triton"
    out = torch.empty_like(q)
    fl = flops(B, H, S, D, causal)
    row = {"dtype": dtype, "B": B, "H": H, "S": S, "D": D, "causal": int(causal), "bias": bias or "none"}

    # -- ours: what the classic plugin launches (T.launch_fn: the plan, else the one kernel) --
    ins = [q, k, v] + ([bias_t] if bias_t is not None else [])
    shapes = [q.shape, k.shape, v.shape, bias_shape]
    attrs = T.attrs_for(H, H, D, causal)
    found = []

    def artifact(s, _arch):
        art_, where_ = runner.artifact(s)
        found.append((art_, where_))
        return art_

    ours, row["kernel"] = T.launch_fn(dtype, shapes, attrs, ins, out, _stream, arch=arch, config=config,
                                      artifact=artifact)
    art, where = found[-1]
    row.update(artifact=where, compiler=art.metadata.get("compiler"), smem=art.shared_mem)

    # -- correctness against SDPA first (one launch; NaN-poisoned output) --
    out.fill_(float("nan"))
    ours(sync=True)
    assert not torch.isnan(out).any(), f"{row['kernel']}: NaN in the output"
    mask = bias_t if bias_t is not None and bias_t.dim() else None
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=bool(causal))
    row["max_abs_vs_sdpa"] = err = float((out.float() - ref.float()).abs().max())
    if not err < 0.05:  # bf16/fp16 outputs of N(0,1) inputs: ~1e-2 at most
        row["error"] = f"output differs from SDPA by {err:.3g}"
    fns = {"ours": ours}
    if device_maps and "host_maps" in row["kernel"]:  # the same kernel building its maps on the device (QDP's)
        dout = torch.full_like(q, float("nan"))
        fn, row["device_maps_kernel"] = T.launch_fn(dtype, shapes, attrs, ins, dout, _stream, arch=arch,
                                                    host_maps=False, config=config, artifact=artifact)
        fn(sync=True)
        row["ours[device maps]_max_abs_vs_sdpa"] = float((dout.float() - ref.float()).abs().max())
        fns["ours[device maps]"] = fn

    # -- the contenders, timed in interleaved rounds --
    if variants:  # CUDA-kernel variants (--variants), checked like ours
        row["variants"] = {}
        for name, vcfg in variant_configs(dtype, D, causal, variants, keypad=bias == "keypad"):
            vout = torch.full_like(q, float("nan"))  # launched as ours is (the HOST_MAPS build where it is)
            fn, _ = T.launch_fn(dtype, shapes, attrs, ins, vout, _stream, arch=90, config=vcfg, artifact=artifact)
            fn(sync=True)
            verr = float((vout.float() - ref.float()).abs().max())
            if not verr < 0.05:
                row["variants"][name] = {"error": f"differs from SDPA by {verr:.3g}"}
                continue
            row["variants"][name] = {"max_abs_vs_sdpa": verr}
            fns["v:" + name] = fn
    del ref
    if sdpa:
        row["default_backend"] = _default_backend(q, k, v, causal)
        from torch.nn.attention import sdpa_kernel

        def sdpa_fn(be):
            def fn():
                with sdpa_kernel([be]):
                    F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))
            return fn

        for name, be in _sdpa_backends().items():
            try:
                sdpa_fn(be)()
                fns[name] = sdpa_fn(be)
            except Exception as e:
                row[f"{name}_tfs"] = None
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:120]}"
    if triton_too and src.lang != "triton":
        tout = torch.empty_like(q)
        fns["triton"], _ = T.launch_fn(dtype, shapes, attrs, ins, tout, _stream, arch=None, artifact=artifact)
        fns["triton"](sync=True)
    times = interleaved(fns, rounds)
    row.update(ours_ms=times["ours"], ours_tfs=fl / times["ours"] * 1e-9, rounds=rounds)
    for name, t in times.items():
        if name.startswith("v:"):
            row["variants"][name[2:]]["tfs"] = fl / t * 1e-9
        elif name != "ours":
            row[f"{name}_tfs"] = fl / t * 1e-9
    if sdpa:
        best = max((row.get(f"{n}_tfs") or 0) for n in _sdpa_backends())
        row["sdpa_best_tfs"] = best
        row["ratio"] = row["ours_tfs"] / best if best else None
    if jit:
        try:
            row["jit_tfs"] = fl / time_jit(src, params, q, k, v, bias_t, out) * 1e-9
        except Exception as e:
            row["jit_tfs"] = None
            row["jit_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    torch.cuda.empty_cache()
    return row


def fmt(x, spec="7.1f"):
    return format(x, spec) if isinstance(x, (int, float)) else f"{'-':>7}"


def print_table(rows):
    print(f"{'dtype':9} {'S':>6} {'D':>4} {'c':>2} {'bias':7} {'ours':>7} {'triton':>7} {'jit':>7} {'flash':>7} "
          f"{'cudnn':>7} {'effic':>7} {'ratio':>6}  default")
    for r in rows:
        print(f"{r['dtype']:9} {r['S']:6d} {r['D']:4d} {r['causal']:2d} {r['bias']:7} {fmt(r['ours_tfs'])} "
              f"{fmt(r.get('triton_tfs'))} {fmt(r.get('jit_tfs'))} {fmt(r.get('flash_tfs'))} {fmt(r.get('cudnn_tfs'))} "
              f"{fmt(r.get('efficient_tfs'))} {fmt(r.get('ratio'), '6.2f')}  {r.get('default_backend', '')}")
        for name, v in (r.get("variants") or {}).items():
            best = r.get("sdpa_best_tfs")
            print(f"{'':9} {'':>6} {'':>4} {'':>2} variant {name}: "
                  + (v["error"] if "error" in v else
                     f"{v['tfs']:.1f} TF/s" + (f", {v['tfs'] / best:.2f}x SDPA best" if best else "")
                     + f", {v['tfs'] / r['ours_tfs']:.3f}x ours"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", metavar="DIR", help="CPU: compile every needed artifact into DIR and exit")
    ap.add_argument("--prebuilt", metavar="DIR[,DIR]", default=os.environ.get("OPTFUSE_FA_PREBUILT"),
                    help="KernelCache root(s) with prebuilt artifacts (else compile locally); "
                         "--sweep times each root")
    ap.add_argument("--sweep", action="store_true", help="time every candidate config (tuning)")
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--seqs", default=",".join(map(str, SEQS)))
    ap.add_argument("--dims", default=",".join(map(str, DIMS)))
    ap.add_argument("--causal", default="0,1", help="main table: causal values to run (0, 1 or 0,1)")
    ap.add_argument("--no-jit", action="store_true")
    ap.add_argument("--tuned-from", metavar="SWEEP_JSON",
                    help="use the best config per (D, causal) of a --sweep run (else launch.py's)")
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--build-sweep-dtypes", default="bfloat16",
                    help="--build: dtypes whose sweep candidates are compiled too")
    ap.add_argument("--mask-dims", default="128",
                    help="head dims of the mask-input rows (bf16, S 4096, scalar and key-padding bias)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="main table: time the contenders in this many interleaved rounds (medians)")
    ap.add_argument("--arch", type=int, default=None,
                    help="target arch for the kernel choice (90: the CUDA sm90 kernel where it "
                         "applies, with the Triton kernel timed beside it); default: Triton only")
    ap.add_argument("--fp8", action="store_true",
                    help="time the FP8 form vs our bf16 kernel on the grid (--dims/--seqs/--causal/--rounds/"
                         "--arch apply; --dtypes, --variants and --tuned-from do not)")
    ap.add_argument("--fp8-padding", type=float, default=None, metavar="FRACTION",
                    help="--fp8: both forms with a [B, 1, 1, S] key-padding bias (bf16), the last FRACTION "
                         "of each batch's keys masked (finfo.min; 0: a mask that masks nothing)")
    ap.add_argument("--device-maps", action="store_true",
                    help="main table and mask rows: also time ours' kernel building its tensor maps on the "
                         "device (what QDP runs) where the plan takes them from the host (--arch 90)")
    ap.add_argument("--variants", metavar="SPEC[;SPEC]",
                    help="main table: also time the CUDA kernel's default config with these FAConfig "
                         "overrides, in the same rounds (e.g. \"softmax_stream=0;num_stages=3,tma=0\"); "
                         "implies --arch 90")
    args = ap.parse_args(argv)
    if not set(args.causal.split(",")) <= {"0", "1"}:
        ap.error(f"--causal {args.causal!r}: give 0, 1 or 0,1")
    variants = parse_variants(args.variants)
    if args.fp8 and (variants or args.tuned_from):
        ap.error("--fp8 takes neither --variants nor --tuned-from (they pick bf16 CUDA-kernel configs)")
    if args.fp8_padding is not None and (not args.fp8 or not 0 <= args.fp8_padding < 1):
        ap.error(f"--fp8-padding {args.fp8_padding}: a fraction in [0, 1), with --fp8")
    if variants:
        args.arch = 90

    if args.build:
        from optfuse.kernels import KernelCache

        srcs = build_sources(sweep_dtypes=tuple(args.build_sweep_dtypes.split(",")), arch=args.arch,
                             variants=variants)
        if args.fp8:
            from optfuse.plugin_dirs import script_module

            srcs += script_module("bench_attention_fp8").fp8_build_sources(
                [int(d) for d in args.dims.split(",")], sweep=True, arch=args.arch,
                padded=args.fp8_padding is not None)
        t0 = time.time()
        KernelCache(args.build).build_many(srcs, 90, jobs=args.jobs)
        print(f"built {len(srcs)} artifacts for sm_90 in {time.time() - t0:.0f}s into {args.build}")
        return 0

    import torch

    assert torch.cuda.is_available(), "needs a CUDA GPU"
    runners = [Runner(p) for p in (args.prebuilt or "").split(",")]
    if args.fp8:
        from optfuse.plugin_dirs import script_module

        return script_module("bench_attention_fp8").main_fp8(args, runners)
    dtypes = args.dtypes.split(",")
    dims = [int(d) for d in args.dims.split(",")]
    rows = []
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "cudnn": torch.backends.cudnn.version()}
    print(json.dumps(info))
    if args.sweep:
        seqs = [int(s) for s in args.seqs.split(",")] if args.seqs != ",".join(map(str, SEQS)) else SWEEP_SEQS
        prebuild_missing(runners, [src for dt in dtypes for D in dims for c in (0, 1) for S in seqs
                                   for cfg in L.candidate_configs(dt, D, c, arch=args.arch)
                                   for src in launched_sources(dt, S, D, c, cfg, arch=args.arch)])
        for runner in runners:
            for dtype in dtypes:
                for D in dims:
                    for causal in (0, 1):
                        for S in seqs:
                            for cfg in L.candidate_configs(dtype, D, causal, arch=args.arch):
                                try:
                                    r = run_shape(runner, dtype, S, D, causal, cfg, sdpa=False, jit=False,
                                                  arch=args.arch)
                                except Exception as e:
                                    r = {"dtype": dtype, "S": S, "D": D, "causal": causal,
                                         "error": f"{type(e).__name__}: {str(e)[:200]}"}
                                r["config"] = list(cfg.__dict__.values())
                                r["root"] = runner.prebuilt
                                rows.append(r)
                                print(f"{dtype:9} S{S:6d} D{D:4d} c{causal} {str(r['config']):40} "
                                      f"{Path(runner.prebuilt or 'local').name:6} {fmt(r.get('ours_tfs'))} TF/s "
                                      f"{r.get('error', '')}", flush=True)
        print("\n== sweep: best three (config, root) per (dtype, S, D, causal); TF/s ==")
        keys = sorted({(r["dtype"], r["S"], r["D"], r["causal"]) for r in rows})
        for key in keys:
            sel = [r for r in rows if (r["dtype"], r["S"], r["D"], r["causal"]) == key]
            rs = sorted((r for r in sel if r.get("ours_tfs")), key=lambda r: -r["ours_tfs"])
            print(f"{key[0]:9} S{key[1]:6d} D{key[2]:4d} c{key[3]}  first {fmt(sel[0].get('ours_tfs'))}  "
                  + "  ".join(f"{r['config']}@{Path(r['root'] or 'local').name} {r['ours_tfs']:.0f}"
                              for r in rs[:3]))
        if args.out:
            Path(args.out).write_text(json.dumps({"info": info, "rows": rows}, indent=1))
        best = choose_from_sweep(args.out) if args.out else {}
        print("\n== chosen (geometric mean over S) ==")
        for (D, causal), (cfg, root, tfs) in sorted(best.items()):
            print(f"D{D} causal={causal}: {cfg} from {root}: {tfs:.0f} TF/s")
        return 0

    chosen = choose_from_sweep(args.tuned_from) if args.tuned_from else {}
    by_root = {r.prebuilt: r for r in runners}

    def pick(D, causal):
        if (D, causal) in chosen:
            cfg, root, _ = chosen[(D, causal)]
            return cfg, by_root.get(root) or Runner(root)
        return None, runners[0]

    prebuild_missing(runners + [Runner(c[1]) for c in chosen.values()],
                     build_sources(sweep=False, tests=False, arch=args.arch,
                                   configs={k: v[0] for k, v in chosen.items()}, variants=variants))
    for dtype in dtypes:
        for D in dims:
            for causal in (int(c) for c in args.causal.split(",")):
                cfg, runner = pick(D, causal)
                for S in (int(s) for s in args.seqs.split(",")):
                    rows.append(run_shape(runner, dtype, S, D, causal, cfg, jit=not args.no_jit,
                                          arch=args.arch, triton_too=args.arch is not None,
                                          rounds=args.rounds, variants=variants,
                                          device_maps=args.device_maps))
                    print_table(rows[-1:])
                    sys.stdout.flush()
    for D in [int(d) for d in args.mask_dims.split(",") if d]:  # "": no mask rows
        for bias in ("scalar", "keypad"):  # what a plugin with a mask input costs
            for causal in (0, 1):
                cfg, runner = pick(D, causal)  # with --arch 90: the CUDA kernel, the Triton one beside it
                rows.append(run_shape(runner, MASK_DTYPE, 4096, D, causal, cfg, bias=bias, sdpa=False,
                                      jit=False, arch=args.arch, triton_too=args.arch is not None,
                                      rounds=args.rounds, variants=variants, device_maps=args.device_maps))
    print("\n== summary (TF/s; ratio = ours / best SDPA backend) ==")
    for (D, causal), (cfg, root, _) in sorted(chosen.items()):
        print(f"config D{D} causal={causal}: {cfg} ({Path(root or 'local').name})")
    print_table(rows)
    losses = [r for r in rows if r.get("ratio") is not None and
              r["ratio"] < (0.9 if r["S"] <= 512 else 1.0)]
    print(f"\nshapes under target: {len(losses)}")
    for r in losses:
        print(f"  {r['dtype']} S{r['S']} D{r['D']} causal={r['causal']}: {r['ratio']:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
