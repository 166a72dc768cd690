#!/usr/bin/env python3
"""Where split-KV decode's time goes (H200): the plan against the bandwidth its reads could reach.

    PYTHONPATH=$PWD python scripts/profile_decode.py [--shapes 1:8192,256:1024] [--rounds 3] [--out f.json]

Per decode shape (Sq = 1, H / Hkv = 32 / 8, D = 128, bf16, causal), timed from CUDA graph replays in
interleaved rounds on the same inputs:

* ``ours``: launch.py's plan (the split kernel whose last split per row block combines, or the
  direct kernel where one split holds the cache);
* ``ours[split=N]``: the plan with N keys per split (``direct`` where N >= Sk);
* ``ours[TAG]``: the plan's split size with other tiles (``--tiles``: key block, stages, warps);
* ``read_same_grid``: a Triton kernel that only reads K and V (a sum), on the split kernel's grid,
  blocks and pipeline depth: what the access pattern allows without the attention math;
* ``sdpa``: torch SDPA's default on the same inputs (``enable_gqa``).

A development tool: it answers "is the loss in the math or the grid?" before a kernel
change is designed. ``--launch-only B:Sk`` launches ours and SDPA a few times with nothing else, the
program to run under Nsight Compute:

    ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \\
        -k regex:'decode|flash' python scripts/profile_decode.py --launch-only 256:1024
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from optfuse.kernels.registry import plugin_module  # noqa: E402
from optfuse.plugin_dirs import script_module  # noqa: E402

T = plugin_module("flash_attention", "testing")
LD = plugin_module("flash_attention", "launch_decode")
_SHAPES = script_module("bench_attention_shapes")

H, HKV, D = 32, 8, 128
DEFAULT_SHAPES = "1:8192,1:32768,1:131072,16:16384,64:4096,256:1024,256:4096,64:256,256:128"


def _read_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def read_kv(K, V, Out, Sk, SPLIT_KEYS: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
        n_split = tl.cdiv(Sk, SPLIT_KEYS)
        pid = tl.program_id(0)
        split = pid % n_split
        bk = pid // n_split
        base = bk.to(tl.int64) * Sk * HEAD_DIM
        offs = tl.arange(0, BLOCK_N)[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
        acc = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        start = split * SPLIT_KEYS
        end = tl.minimum(start + SPLIT_KEYS, Sk)
        for n in range(start, end, BLOCK_N):
            k = tl.load(K + base + n * HEAD_DIM + offs)
            v = tl.load(V + base + n * HEAD_DIM + offs)
            acc += k.to(tl.float32) * v.to(tl.float32)
        tl.store(Out + pid, tl.sum(acc))

    return read_kv


def _plan_fn(plan, ins, out):
    from optfuse.kernels.launcher import launch_plan

    T.build_plan(plan, 90)
    ws = T.new_workspace(plan, "cuda")
    state = T.new_state(plan, "cuda")
    return lambda sync=False: launch_plan(plan, ins, [out], ws, _SHAPES._stream(), state=state, sync=sync)


def _inputs(B, Sk):
    import torch

    g = torch.Generator(device="cuda").manual_seed(Sk + B)
    q = torch.randn(B, H, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(B, HKV, Sk, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    return q, k, v


def run_shape(B, Sk, rounds, sizes, tiles=()):
    import torch
    import torch.nn.functional as F
    import triton

    q, k, v = _inputs(B, Sk)
    attrs = T.attrs_for(H, HKV, D, 1)
    shapes = [q.shape, k.shape, v.shape, None]
    out = torch.full_like(q, float("nan"))
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    plan = T.case_plan("bfloat16", shapes, attrs, arch=90)
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
    if plan is None:  # a short cache: the one-kernel path, against the direct decode kernel
        ours, name = _SHAPES._ours("bfloat16", shapes, attrs, [q, k, v], out)
        direct = T.forced_decode_plan("bfloat16", shapes, attrs, decode=LD.DecodeConfig(split_keys=64 * Sk))
        fns = {"ours": ours, "ours[split=direct]": _plan_fn(direct, [q, k, v], out), "sdpa": sdpa}
        row = {"B": B, "Sk": Sk, "kernel": name.rsplit("/", 1)[-1], "programs": None}
        sizes, cfg = [], dict(direct.steps[0].source.meta["config"], split_keys=64 * Sk)
    else:
        cfg = plan.steps[0].source.meta["config"]
        row = {"B": B, "Sk": Sk, "kernel": " + ".join(s.source.name.rsplit("/", 1)[-1] for s in plan.steps),
               "split_keys": cfg["split_keys"], "programs": plan.steps[0].params.grid[0]}
        fns = {"ours": _plan_fn(plan, [q, k, v], out), "sdpa": sdpa}
    for size in sizes:
        if size == cfg["split_keys"] or (size >= Sk and cfg["split_keys"] >= Sk):
            continue
        c = LD.DecodeConfig(split_keys=size)
        p = T.case_plan("bfloat16", shapes, attrs, arch=90, decode=c)
        fns[f"ours[split={size if size < Sk else 'direct'}]"] = _plan_fn(p, [q, k, v], out)
    for tag, change in tiles:  # other tiles at the plan's own split size (or direct)
        c = LD.DecodeConfig(**{**cfg, **change})
        if c.split_keys % c.block_n:
            continue
        p = (T.case_plan("bfloat16", shapes, attrs, arch=90, decode=c)
             or T.forced_decode_plan("bfloat16", shapes, attrs, decode=c))
        fns[f"ours[{tag}]"] = _plan_fn(p, [q, k, v], out)
    read = _read_kernel()
    split_keys = min(cfg["split_keys"], triton.cdiv(Sk, 64) * 64)
    sink = torch.empty(B * HKV * triton.cdiv(Sk, split_keys), device="cuda")
    grid = (sink.numel(),)
    fns["read_same_grid"] = lambda: read[grid](k, v, sink, Sk, SPLIT_KEYS=split_keys, BLOCK_N=cfg["block_n"],
                                                HEAD_DIM=D, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    for name, fn in fns.items():
        if name.startswith("ours"):
            out.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            row[f"{name}_max_abs"] = float((out.float() - ref.float()).abs().max())
        else:
            fn()
    times = _SHAPES.interleaved(fns, rounds, True)
    kv_bytes = 2 * B * HKV * Sk * D * 2
    for name, t in times.items():
        row[f"{name}_us"] = t * 1e3
        row[f"{name}_gbs"] = kv_bytes / (t * 1e-3) / 1e9
    return row


def launch_only(B, Sk):
    import torch
    import torch.nn.functional as F

    q, k, v = _inputs(B, Sk)
    plan = T.case_plan("bfloat16", [q.shape, k.shape, v.shape, None], T.attrs_for(H, HKV, D, 1), arch=90)
    out = torch.empty_like(q)
    ours = _plan_fn(plan, [q, k, v], out)
    for _ in range(3):
        ours()
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.cuda.synchronize()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="B:Sk,... (Sq = 1, 32 / 8 heads, D = 128)")
    ap.add_argument("--sizes", default="256,512,1024,2048,4096,1000000",
                    help="split sizes to time besides the plan's (>= Sk: the direct kernel)")
    ap.add_argument("--tiles", default="n128_s2:block_n=128+num_stages=2,w8:num_warps=8,s4:num_stages=4,s2:num_stages=2",
                    help="TAG:key=value+key=value,...: DecodeConfig changes timed at the plan's split size")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--launch-only", metavar="B:Sk")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.launch_only:
        launch_only(*map(int, args.launch_only.split(":")))
        return
    import torch

    bw = _SHAPES.copy_bandwidth()
    print(f"copy bandwidth {bw:.0f} GB/s (read + write)", flush=True)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    tiles = []
    for spec in filter(None, args.tiles.split(",")):
        tag, changes = spec.split(":")
        tiles.append((tag, {k: int(v) for k, v in (c.split("=") for c in changes.split("+"))}))
    rows = []
    for spec in args.shapes.split(","):
        B, Sk = map(int, spec.split(":"))
        row = run_shape(B, Sk, args.rounds, sizes, tiles)
        rows.append(row)
        print(f"B={B} Sk={Sk} plan: {row['kernel']} ({row['programs']} programs)", flush=True)
        for k_ in row:
            if k_.endswith("_us"):
                name = k_[:-3]
                err = row.get(f"{name}_max_abs")
                print(f"    {name:28s} {row[k_]:9.2f} us  {row[name + '_gbs']:6.0f} GB/s = {row[name + '_gbs'] / bw:.2f} "
                      f"of copy  x sdpa {row['sdpa_us'] / row[k_]:.2f}" + ("" if err is None else f"  err {err:.1e}"),
                      flush=True)
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_gbs": bw, "rows": rows},
                                             indent=1))


if __name__ == "__main__":
    main()
