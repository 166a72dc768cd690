#!/usr/bin/env python3
"""Attention at the shapes real models run (H200): ours vs torch SDPA, same run, same inputs.

Model-like shapes -- encoders with and without padding, vision transformers (token counts just past
a tile boundary), speech, long-context GQA prefill, and decode over a KV cache (Sq = 1..16, Sk 1k..128k,
batch 1..256) -- each timed in interleaved rounds, every contender replayed from a CUDA graph (medians of
``triton.testing.do_bench_cudagraph``: no contender pays its host launch cost; ``--launch-timing``: ``do_bench``):

* ``ours``: what the classic plugin runs on sm_90, as AOT artifacts through ``optfuse.kernels.launcher``:
  ``launch_plan``'s plan -- for decode (Sq <= 16 over >= 512 keys) the split-KV kernel whose last
  split per row block combines, with its workspace and state; elsewhere the CUDA kernel with its
  tensor maps encoded by the launcher (HOST_MAPS) -- or the one kernel where there is no plan;
  ``--device-maps`` adds ``ours[device maps]``, the same kernel building its maps on the device
  (what QDP runs);
* SDPA's default choice and each backend that runs (flash, cudnn, efficient; ``enable_gqa`` for
  grouped heads, the boolean mask for padded batches).

Decode rows also give the bandwidth reading K and V once (bytes / time) against the device copy
bandwidth measured in the same run (a 2 GiB device-to-device copy). ``--only decode`` runs just
the decode rows; ``--sweep-decode`` adds each of launch_decode.candidate_decode_configs as a
contender ``ours[<config>]`` on them (split size, key block, stages, warps), and ``--decode-variant
FIELD=VALUE,...`` (repeatable) the config the plan picks on each row with those fields changed
(an A/B against the shipped plan, e.g. ``--decode-variant num_stages=4``).

    PYTHONPATH=$PWD python scripts/bench_attention_shapes.py --out shapes.json
    PYTHONPATH=$PWD python scripts/bench_attention_shapes.py --only decode --sweep-decode
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from optfuse.kernels.registry import plugin_module  # noqa: E402
from optfuse.plugin_dirs import script_module  # noqa: E402

T = plugin_module("flash_attention", "testing")
_SPARSE = script_module("bench_sparse_attention")


def interleaved(fns: dict, rounds: int, graphs: bool) -> dict:
    """Median ms of each contender over interleaved rounds: replayed from a CUDA graph
    (``graphs``: no contender pays its host launch cost, as in a TensorRT engine; decode's kernels
    run for microseconds) or, as the sparse benchmark times, with ``do_bench``'s launches."""
    if not graphs:
        return _SPARSE.interleaved(fns, rounds)
    import triton.testing

    return _SPARSE.interleaved(fns, rounds, lambda fn: triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median"))

# name, B, H, Hkv, Sq, Sk, D, causal, padding (fraction of keys masked per batch, right-aligned)
SHAPES = [
    ("bert-base S=128 padded", 32, 12, 12, 128, 128, 64, 0, 0.3),
    ("bert-base S=512 padded", 8, 12, 12, 512, 512, 64, 0, 0.3),
    ("bert-base S=512", 8, 12, 12, 512, 512, 64, 0, 0.0),
    ("clip-text S=77 causal", 64, 8, 8, 77, 77, 64, 1, 0.0),
    ("vit-b/16 S=197", 64, 12, 12, 197, 197, 64, 0, 0.0),
    ("vit-l/14 S=257", 32, 16, 16, 257, 257, 64, 0, 0.0),
    ("vit-l/14@336 S=577", 16, 16, 16, 577, 577, 64, 0, 0.0),
    ("whisper S=1500", 8, 20, 20, 1500, 1500, 64, 0, 0.0),
    ("llama-gqa prefill S=4096", 1, 32, 8, 4096, 4096, 128, 1, 0.0),
    ("llama-gqa prefill S=16384", 1, 32, 8, 16384, 16384, 128, 1, 0.0),
    ("decode B=1 Sk=1k", 1, 32, 8, 1, 1024, 128, 1, 0.0),
    ("decode B=1 Sk=8k", 1, 32, 8, 1, 8192, 128, 1, 0.0),
    ("decode B=1 Sk=32k", 1, 32, 8, 1, 32768, 128, 1, 0.0),
    ("decode B=1 Sk=128k", 1, 32, 8, 1, 131072, 128, 1, 0.0),
    ("decode B=64 Sk=4k", 64, 32, 8, 1, 4096, 128, 1, 0.0),
    ("decode B=64 Sk=8k", 64, 32, 8, 1, 8192, 128, 1, 0.0),
    ("decode B=1 Sk=2k", 1, 32, 8, 1, 2048, 128, 1, 0.0),
    ("decode B=16 Sk=16k", 16, 32, 8, 1, 16384, 128, 1, 0.0),
    ("decode B=64 Sk=4k padded", 64, 32, 8, 1, 4096, 128, 1, 0.3),
    ("decode B=256 Sk=1k", 256, 32, 8, 1, 1024, 128, 1, 0.0),
    ("decode B=256 Sk=4k", 256, 32, 8, 1, 4096, 128, 1, 0.0),
    # speculative / chunked steps: Sq query rows per head; causal off, as SDPA has no
    # bottom-right causal mask without a mask tensor (the kernel's cost is the same)
    ("decode Sq=4 B=1 Sk=8k", 1, 32, 8, 4, 8192, 128, 0, 0.0),
    ("decode Sq=16 B=8 Sk=8k", 8, 32, 8, 16, 8192, 128, 0, 0.0),
]


def copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB: bytes read + written per second (GB/s)."""
    import torch

    a = torch.empty(1 << 30, dtype=torch.float16, device="cuda")
    b = torch.empty_like(a)
    t = _SPARSE._bench(lambda: b.copy_(a))
    return 2 * a.numel() * 2 / (t * 1e-3) / 1e9


def _config_tag(cfg) -> str:
    """The config's fields that differ from DecodeConfig's defaults (split size always), so two
    contenders that differ in any field (the combine tile too) get different keys."""
    default = type(cfg)()
    return ",".join(f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
                    if f.name == "split_keys" or getattr(cfg, f.name) != getattr(default, f.name))


def parse_variant(text: str) -> dict:
    """``FIELD=VALUE,...`` of --decode-variant as DecodeConfig changes (its fields are ints)."""
    ld = plugin_module("flash_attention", "launch_decode")
    fields = {f.name for f in dataclasses.fields(ld.DecodeConfig)}
    out = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in fields or not value.lstrip("-").isdigit():
            raise ValueError(f"--decode-variant: {item!r} is not FIELD=INTEGER of DecodeConfig ({', '.join(sorted(fields))})")
        out[key] = int(value)
    return out


def _stream() -> int:
    """The current torch stream at call time: the one a CUDA graph capture records on."""
    import torch

    return torch.cuda.current_stream().cuda_stream


def _ours(dtype, shapes, attrs, ins, out, decode=None, host_maps=True):
    """(launch function, kernel names) of T.launch_fn: launch.py's plan where it makes one (decode:
    its kernels, workspace and state; sm_90 elsewhere: the CUDA kernel with host-encoded maps), else
    the one kernel; ``decode`` = a DecodeConfig instead of the default; ``host_maps=False``: the one
    kernel (device-built maps) where the plan would be the HOST_MAPS build."""
    return T.launch_fn(dtype, shapes, attrs, ins, out, _stream, arch=90, decode=decode, host_maps=host_maps)


def run_shape(name, B, H, Hkv, Sq, Sk, D, causal, pad, rounds, dtype="bfloat16", sweep=(), graphs=True,
              device_maps=False):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tdt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(Sq * 7 + Sk)
    q = torch.randn(B, H, Sq, D, device="cuda", dtype=tdt, generator=g)
    k, v = (torch.randn(B, Hkv, Sk, D, device="cuda", dtype=tdt, generator=g) for _ in range(2))
    bias = keep = None
    if pad:
        bias = torch.zeros(B, 1, 1, Sk, device="cuda", dtype=tdt)
        bias[..., Sk - int(Sk * pad):] = torch.finfo(tdt).min
        keep = bias > -1
    attrs = T.attrs_for(H, Hkv, D, causal)
    shapes = [q.shape, k.shape, v.shape, None if bias is None else bias.shape]
    out = torch.full_like(q, float("nan"))
    ins = [q, k, v] + ([bias] if bias is not None else [])
    ours, kernel = _ours(dtype, shapes, attrs, ins, out)
    ours(sync=True)
    gqa = Hkv != H
    # SDPA's causal is top-left aligned; with Sq < Sk ours is bottom-right (key j <= i + Sk - Sq),
    # which for Sq = 1 is every key: no mask there
    sdpa_causal = bool(causal) and Sq == Sk

    def sdpa(backends=None):
        def fn():
            if backends is None:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=sdpa_causal, enable_gqa=gqa)
            with sdpa_kernel(backends):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=sdpa_causal, enable_gqa=gqa)
        return fn

    ref = sdpa()()
    row = {"name": name, "B": B, "H": H, "Hkv": Hkv, "Sq": Sq, "Sk": Sk, "D": D, "causal": causal,
           "padding": pad, "dtype": dtype, "kernel": kernel,
           "max_abs_vs_sdpa": float((out.float() - ref.float()).abs().max())}
    fns = {"ours": ours, "sdpa_default": sdpa()}
    if device_maps and "host_maps" in kernel:  # the same kernel with its maps built on the device (QDP's)
        fn, row["device_maps_kernel"] = _ours(dtype, shapes, attrs, ins, out, host_maps=False)
        out.fill_(float("nan"))
        fn(sync=True)
        row["ours[device maps]_max_abs_vs_sdpa"] = float((out.float() - ref.float()).abs().max())
        fns["ours[device maps]"] = fn
    for cfg in sweep:
        fn, _ = _ours(dtype, shapes, attrs, ins, out, decode=cfg)
        if fn is not None:
            tag = f"ours[{_config_tag(cfg)}]"
            out.fill_(float("nan"))
            fn(sync=True)
            row[f"{tag}_max_abs_vs_sdpa"] = float((out.float() - ref.float()).abs().max())
            fns[tag] = fn
    for be_name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                        ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            sdpa([be])()
            fns[be_name] = sdpa([be])
        except Exception as e:  # a backend that does not take the shape
            row[f"{be_name}_error"] = f"{type(e).__name__}: {str(e)[:100]}"
    times = interleaved(fns, rounds, graphs)
    for k_, t in times.items():
        row[f"{k_}_ms"] = t
    best = min(t for k_, t in times.items() if not k_.startswith("ours"))
    row["vs_sdpa_default"] = times["sdpa_default"] / times["ours"]
    row["vs_sdpa_best"] = best / times["ours"]
    row["kv_gbs"] = 2 * B * Hkv * Sk * D * q.element_size() / (times["ours"] * 1e-3) / 1e9
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", help="substring of the shape names to run (e.g. decode)")
    ap.add_argument("--launch-timing", action="store_true",
                    help="time with do_bench's launches (host launch costs included) instead of CUDA graph replays")
    ap.add_argument("--sweep-decode", action="store_true",
                    help="time every candidate decode config too (decode rows only)")
    ap.add_argument("--device-maps", action="store_true",
                    help="time the one kernel with device-built tensor maps (QDP's) beside the plan's host-encoded ones")
    ap.add_argument("--decode-variant", action="append", default=[], metavar="FIELD=VALUE,...",
                    help="time the plan's own decode config with these DecodeConfig fields changed (decode rows)")
    args = ap.parse_args(argv)
    try:
        variants = [parse_variant(v) for v in args.decode_variant]
    except ValueError as exc:
        ap.error(str(exc))
    import torch

    t0 = time.time()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    ld = plugin_module("flash_attention", "launch_decode")
    rows = []
    for shape in SHAPES:
        if args.only and args.only not in shape[0]:
            continue
        try:
            sweep = []
            if args.sweep_decode:
                sweep = ld.candidate_decode_configs("bfloat16", shape[6])[1:]
            if variants and shape[0].startswith("decode"):
                _, B, H, Hkv, Sq, Sk, D = shape[:7]
                rule = ld.plan_config("bfloat16", D, B, H, Hkv, Sq, Sk)
                sweep += [dataclasses.replace(rule, **v) for v in variants]
            row = run_shape(*shape, rounds=args.rounds, sweep=sweep, graphs=not args.launch_timing,
                            device_maps=args.device_maps)
        except Exception as e:
            row = {"name": shape[0], "error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(row, flush=True)
            rows.append(row)
            continue
        if row["name"].startswith("decode"):
            row["kv_of_copy_bw"] = row["kv_gbs"] / bw
        rows.append(row)
        extra = f" K/V {row['kv_gbs']:.0f} GB/s = {row['kv_of_copy_bw']:.2f} of copy" if "kv_of_copy_bw" in row else ""
        for k_ in row:
            if k_.startswith("ours[") and k_.endswith("_ms"):
                extra += f"\n    {k_[:-3]:44s} {row[k_]:.4f} ms ({row['ours_ms'] / row[k_]:.2f}x the default)"
        print(f"{row['name']:28s} ours {row['ours_ms']:.4f} ms  x SDPA default {row['vs_sdpa_default']:.2f}  "
              f"x best {row['vs_sdpa_best']:.2f}{extra}  err {row['max_abs_vs_sdpa']:.1e}", flush=True)
        torch.cuda.empty_cache()
    print(f"{len(rows)} rows in {time.time() - t0:.0f}s")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                              "copy_gbs": bw, "timing": "launches" if args.launch_timing else "cuda graphs",
                                              "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
