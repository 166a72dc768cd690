"""Where the CUDA (sm90) FlashAttention kernel's warps spend their cycles, per phase (H200 only).

    python scripts/profile_attention.py [--shapes S:D:causal,...] [--dtype bfloat16] [--block-m 128] [--tma 0]

Builds the shipped config of each shape with ``PROFILE=1`` (kernel_sm90.cu: every warp adds the
SM clock cycles of each phase of its loop to counters, written to a second output), launches it
through optfuse's launcher on the benchmark's shapes (B * S = 16k tokens, H * D = 2048), and prints
per shape the share of each phase in the consumer and producer warps' cycles, plus the speed of the
profiled build against the plain one (the clock reads cost a little and constrain scheduling).
A development tool: it answers "waiting for what?" before a kernel change is designed. With TMA
loads (the shipped default) the profiled build spills 12-48 bytes (the counters take registers the
producer no longer has; nvcc -Xptxas -v), so its shares are approximate; ``--tma
0`` profiles the cp.async loads, whose profiled build does not spill. Note that a per-warp phase
profile cannot show what the producer's instructions cost the consumers on the same SM
sub-partitions (README "Tried").

``--launch-only`` launches the shipped kernel and SDPA's default backend (cuDNN on these shapes) a
few times per shape and nothing else: the program to run under Nsight Compute, which sees what the
phase counters cannot (issue-slot and pipe use, stall reasons per SASS instruction):

    ncu --clock-control none --set full -k regex:'flash_attention_sm90|sdpa|fmha' --launch-skip 2 \
        --launch-count 2 -o rep python scripts/profile_attention.py --shapes 1024:64:1 --launch-only
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from optfuse.kernels.registry import plugin_module  # noqa: E402
from optfuse.plugin_dirs import script_module  # noqa: E402

L = plugin_module("flash_attention", "launch")
T = plugin_module("flash_attention", "testing")
COUNTERS = ROOT / "plugins" / "flash_attention" / "sm90" / "profile.cuh"  # the kernel's PR_* enum


#: the benchmark's shapes (shape_of, source_for: B * S = 16k tokens, H * D = 2048) and FLOP count
BENCH = script_module("bench_attention")
CONSUMER_PHASES = ("WAIT_Q", "WAIT_KV", "FENCE", "TURN", "ISSUE", "PASS", "WAIT_S", "SOFTMAX", "WAIT_PV", "POST", "EPI")
PRODUCER_PHASES = ("WAIT_Q", "WAIT_KV", "ISSUE", "POST")


def phase_names(path: Path = COUNTERS) -> list[str]:
    """The PR_* counters in kernel order (from the enum in sm90/profile.cuh, which kernel_sm90.cu
    includes; PR_N, their number, left out)."""
    body = re.search(r"enum\s*\{(.*?)\};", path.read_text(), re.S).group(1)
    names = re.findall(r"\bPR_(\w+)", body)
    if names[-1:] != ["N"]:
        raise RuntimeError(f"{path.name}: the PR_* enum must end with PR_N")
    return names[:-1]


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    out = []
    for item in filter(None, text.split(",")):
        parts = item.split(":")
        if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"bad --shapes item {item!r} (want S:D:causal, e.g. 512:64:1)")
        S, D, causal = map(int, parts)
        if D not in L.SM90_HEAD_DIMS or causal not in (0, 1) or S < 1 or BENCH.TOKENS % S:
            raise ValueError(f"--shapes {item!r}: D must be one of {L.SM90_HEAD_DIMS}, causal 0 or 1, "
                             f"S a divisor of {BENCH.TOKENS}")
        out.append((S, D, causal))
    return out


def profiled(src):
    """The same kernel source with the phase counters on (a second output)."""
    return dataclasses.replace(src, name=src.name + "/profile", n_outputs=2,
                               defines={**src.defines, "PROFILE": "1"})


def summarize(counters, names, n_warps):
    """counters: int array [grid, warps, PR_N] -> {role: {phase: share of that role's cycles}}."""
    import numpy as np

    c = np.asarray(counters, dtype=np.float64).reshape(-1, n_warps, len(names))
    idx = {n: i for i, n in enumerate(names)}
    out = {}
    for role, warps, phases in (("producer", slice(0, 4), PRODUCER_PHASES),
                                ("consumer", slice(4, n_warps), CONSUMER_PHASES)):
        part = c[:, warps, :].reshape(-1, len(names))
        part = part[part[:, idx["TOTAL"]] > 0]  # warps that sat out wrote nothing
        total = part[:, idx["TOTAL"]].sum()
        row = {p: part[:, idx[p]].sum() / total for p in phases}
        row["other"] = 1.0 - sum(row.values())
        row["blocks_per_tile"] = part[:, idx["BLOCKS"]].sum() / max(1.0, part[:, idx["TILES"]].sum())
        # consumer K / V waits whose data had not landed yet, per key block (producer: 0)
        row["kv_late_per_block"] = part[:, idx["KV_LATE"]].sum() / max(1.0, part[:, idx["BLOCKS"]].sum())
        row["cycles_per_warp"] = total / len(part)
        out[role] = row
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="512:64:1,2048:64:1,16384:64:1,512:64:0,16384:64:0,512:128:1,4096:128:0")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--block-m", type=int, default=None, help="128 (two consumer warpgroups) or 192 (three, D = 64)")
    ap.add_argument("--tma", type=int, choices=(0, 1), default=None,
                    help="TMA (1) or cp.async (0) loads; default: the shipped config's")
    ap.add_argument("--out", default=None, help="write the shares as JSON here")
    ap.add_argument("--launch-only", action="store_true",
                    help="launch the shipped kernel and SDPA 4 times each per shape, alternating, and "
                         "profile nothing (a program for Nsight Compute)")
    args = ap.parse_args()
    try:
        shapes = parse_shapes(args.shapes)
    except ValueError as e:
        print(f"profile_attention: {e}", file=sys.stderr)
        return 2

    import torch
    from optfuse.kernels import build_kernel, launch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("profile_attention: needs an sm_90 GPU (H100 / H200)", file=sys.stderr)
        return 2
    names = phase_names()
    results = []
    for S, D, causal in shapes:
        B, H = BENCH.shape_of(S, D)
        cfg = L.sm90_config(D, causal)
        if args.block_m:
            cfg = dataclasses.replace(cfg, block_m=args.block_m, num_warps=4 * (args.block_m // 64 + 1))
        if args.tma is not None:
            cfg = dataclasses.replace(cfg, tma=bool(args.tma))
        q, k, v, _ = T.random_inputs(B, H, H, S, S, D, args.dtype, device="cuda")
        src, params = BENCH.source_for(args.dtype, S, D, causal, cfg, arch=90)
        plain = T.get_artifact(src, 90)
        n_warps = plain.threads // 32
        out = torch.empty_like(q)
        stream = torch.cuda.current_stream().cuda_stream
        if args.launch_only:
            # alternate, so --launch-skip 2 --launch-count 2 takes one launch of each, warmed up
            for _ in range(4):
                launch(plain, params, [q, k, v], [out], stream)
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))
            torch.cuda.synchronize()
            print(f"{args.dtype} S={S} D={D} causal={causal}: launched {src.name} and SDPA 4 times each", flush=True)
            continue
        counters = torch.zeros(params.grid[0] * n_warps * len(names), dtype=torch.int32, device="cuda")

        def timed(art, outs):
            for _ in range(3):
                launch(art, params, [q, k, v], outs, stream)
            times = []
            for _ in range(5):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(10):
                    launch(art, params, [q, k, v], outs, stream)
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b) / 10)
            return sorted(times)[len(times) // 2]

        prof = build_kernel(profiled(src), 90)
        t_plain = timed(plain, [out])
        t_prof = timed(prof, [out, counters])
        counters.zero_()
        launch(prof, params, [q, k, v], [out, counters], stream, sync=True)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))
        err = (out.float() - ref.float()).abs().max().item()
        flops = BENCH.flops(B, H, S, D, causal)
        share = summarize(counters.cpu().numpy().view("uint32"), names, n_warps)
        row = {"S": S, "D": D, "causal": causal, "dtype": args.dtype, "kernel": src.name,
               "tfs": flops / t_plain * 1e-9, "tfs_profiled": flops / t_prof * 1e-9, "max_abs_vs_sdpa": err, **share}
        results.append(row)
        c, p = share["consumer"], share["producer"]
        print(f"{args.dtype} S={S} D={D} causal={causal}  {row['tfs']:.0f} TF/s (profiled {row['tfs_profiled']:.0f}), "
              f"{c['blocks_per_tile']:.1f} blocks/tile, K/V not yet there at {100 * c['kv_late_per_block']:.1f}% "
              f"of the blocks' waits, max|err| {err:.3g}")
        print("  consumer: " + "  ".join(f"{k} {100 * c[k]:.1f}%" for k in (*CONSUMER_PHASES, "other")))
        print("  producer: " + "  ".join(f"{k} {100 * p[k]:.1f}%" for k in (*PRODUCER_PHASES, "other")), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
