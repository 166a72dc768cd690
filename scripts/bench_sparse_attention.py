#!/usr/bin/env python3
"""Sparse attention benchmark (H200): sliding windows, block layouts and padded batches.

Every row times, in interleaved rounds in one process, the AOT artifacts launched through
``optfuse.kernels.launcher`` as the classic TensorRT plugin launches them (``launch_fn``: launch.py's
plan, on sm_90 the CUDA kernel with host-encoded tensor maps; variants launched the same way)
against their peers on the same inputs:

* ``window``: causal sliding windows w (FlashAttention v2, window_left = w - 1) vs our dense causal
  kernel, FlexAttention (``torch.compile``d, a sliding-window BlockMask) and SDPA's default with
  the equivalent boolean mask (S <= 16k);
* ``layout``: random per-head block layouts (128-blocks) at a density vs FlexAttention with the same
  blocks (``BlockMask.from_kv_blocks``, every listed block full);
* ``padding``: right-padded batches (a key-padding bias, HF's finfo.min) vs the same batch with no
  mask and SDPA's default with the boolean mask;
* ``dense``: the dense kernel vs ``--baseline``'s (a checkout of the previous kernel source), same
  shapes (the FlashAttention README's grid), to show the dense speed is kept: both as the one
  kernel that builds its maps on the device (an older source may have no HOST_MAPS build).

Effective TF/s count the visible blocks' FLOPs (4 * D per score of a visited 128 x 128 block, the
work a block-sparse kernel must do). ``ideal`` = dense non-causal time x visited-block fraction;
``vs_ideal`` = time / ideal (issue: <= 1.2 down to 10 % density).

    python scripts/bench_sparse_attention.py --out sparse.json [--baseline DIR] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from optfuse.kernels.registry import plugin_module  # noqa: E402

T = plugin_module("flash_attention", "testing")
L = plugin_module("flash_attention", "launch")
R = plugin_module("flash_attention", "reference")
BLOCK = 128


def tokens_heads(S: int, D: int) -> tuple[int, int]:
    """B and H of the FlashAttention grid: B * S = max(16k, S) tokens, H * D = 2048."""
    return max(16384, S) // S, 2048 // D


def _bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")  # ms


def interleaved(fns: dict, rounds: int, bench=None) -> dict:
    """Median ms of each contender over ``rounds`` interleaved rounds, timed by ``bench`` (fn -> ms;
    default ``_bench``)."""
    bench = bench or _bench
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            times[k].append(bench(fn))
    return {k: statistics.median(v) for k, v in times.items()}


def _stream():
    """The current torch stream at call time."""
    import torch

    return torch.cuda.current_stream().cuda_stream


class Kernels:
    """KernelSources -> artifacts (compiled here once, in parallel) and launches."""

    def __init__(self, baseline: str | None):
        self.baseline = Path(baseline) if baseline else None
        self.arts = {}

    def source(self, op_attrs, dtype, shapes, layout=None, baseline=False, config=None):
        src, params = T.case_sources(dtype, shapes, op_attrs, arch=90, layout=layout, config=config)
        if baseline:
            src = dataclasses.replace(src, path=str(self.baseline / "plugins/flash_attention/kernel_sm90.cu"))
        return src, params

    def compile(self, srcs, jobs=16):
        from optfuse.kernels import default_cache

        t0 = time.time()
        todo = {s.name + s.path: s for s in srcs}
        default_cache().build_many(list(todo.values()), 90, jobs=jobs)
        print(f"compiled {len(todo)} kernels in {time.time() - t0:.0f}s", flush=True)

    def sources(self, op_attrs, dtype, shapes, layout=None, config=None):
        """The KernelSources :meth:`ours` launches for a case (T.launch_sources)."""
        return T.launch_sources(dtype, shapes, op_attrs, arch=90, layout=layout, config=config)

    def ours(self, op_attrs, dtype, shapes, ins, out, layout=None, config=None):
        """(launch function, kernel names): what the classic plugin launches (T.launch_fn: the
        plan, sm_90's HOST_MAPS build; ``config``: that config launched the same way), run once on
        a NaN-poisoned ``out`` first; ``ins`` in spec order (None for no bias)."""
        import torch

        from optfuse.kernels import build_kernel

        fn, kernel = T.launch_fn(dtype, shapes, op_attrs, ins, out, _stream, arch=90, layout=layout,
                                 config=config, artifact=lambda src, arch: build_kernel(src, arch))
        out.fill_(float("nan"))
        fn(sync=True)
        assert not torch.isnan(out).any(), f"{kernel}: NaN in the output"
        return fn, kernel

    def launcher(self, src, params, ins, out):
        import torch

        from optfuse.kernels import build_kernel, launch

        art = build_kernel(src, 90)
        stream = torch.cuda.current_stream().cuda_stream
        out.fill_(float("nan"))
        launch(art, params, ins, [out], stream, sync=True)
        assert not torch.isnan(out).any(), f"{src.name}: NaN in the output"
        return lambda: launch(art, params, ins, [out], stream)


# ---- the rows ----------------------------------------------------------------------------------
def _qkv(B, H, S, D, dtype, seed):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(B, H, S, D, device="cuda", dtype=getattr(torch, dtype), generator=g) for _ in range(3)]


def _flex():
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    # one compiled kernel per shape: the default limit (8) would drop later shapes to eager
    torch._dynamo.config.recompile_limit = 1000
    torch._dynamo.config.cache_size_limit = 1000
    return torch.compile(flex_attention, dynamic=False)


def _flex_fn(flex, q, k, v, block_mask, scale):
    def fn():
        return flex(q, k, v, block_mask=block_mask, scale=scale)
    try:
        fn()
        return fn, None
    except Exception as e:  # report, do not stop the run
        return None, f"{type(e).__name__}: {str(e)[:160]}"


def visited_blocks(S, causal, window=None, layout=None, keys=None) -> float:
    """Fraction of the S x S blocks (of 128) a tile visits (per head, averaged)."""
    nb = math.ceil(S / BLOCK)
    if layout is not None:
        off = layout[0]
        return float((off[:, -1]).mean()) / (nb * nb)
    total = 0
    for m in range(nb):
        r0, r1 = m * BLOCK, min(S, m * BLOCK + BLOCK) - 1
        hi = min(S, r1 + 1) if causal else (keys or S)
        lo = max(0, r0 - (window - 1)) if window else 0
        total += max(0, math.ceil(hi / BLOCK) - lo // BLOCK)
    return total / (nb * nb)


def run_window(K, dtype, S, D, w, flex, rounds, sdpa_max):
    import torch
    import torch.nn.functional as F

    B, H = tokens_heads(S, D)
    q, k, v = _qkv(B, H, S, D, dtype, S + D + w)
    out = torch.empty_like(q)
    scale = D ** -0.5
    attrs = T.attrs_for(H, H, D, True) | {"window_left": w - 1}
    shapes = [q.shape, k.shape, v.shape, None]
    fns = {}
    fns["ours"], kernel = K.ours(attrs, dtype, shapes, [q, k, v], out)
    fns["dense_causal"], _ = K.ours(T.attrs_for(H, H, D, True), dtype, shapes, [q, k, v], torch.empty_like(q))
    fns["dense_full"], _ = K.ours(T.attrs_for(H, H, D, False), dtype, shapes, [q, k, v], torch.empty_like(q))
    for name, cfg in variants("window", D, w):
        fns[name], _ = K.ours(attrs, dtype, shapes, [q, k, v], torch.empty_like(q), config=cfg)
    row = {"kind": "window", "dtype": dtype, "B": B, "H": H, "S": S, "D": D, "window": w, "kernel": kernel}
    i = torch.arange(S, device="cuda")
    allowed = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - w)
    ref = F.scaled_dot_product_attention(q[:1, :2], k[:1, :2], v[:1, :2], attn_mask=allowed)
    row["max_abs_vs_sdpa"] = float((out[:1, :2].float() - ref.float()).abs().max())
    if flex is not None:
        from torch.nn.attention.flex_attention import create_block_mask

        def window_mod(b, h, qi, ki):
            return (ki <= qi) & (ki > qi - w)
        bm = create_block_mask(window_mod, None, None, S, S, BLOCK_SIZE=BLOCK)
        fn, err = _flex_fn(flex, q, k, v, bm, scale)
        if fn:
            fns["flex"] = fn
        else:
            row["flex_error"] = err
    if S <= sdpa_max:
        fns["sdpa_mask"] = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    times = interleaved(fns, rounds)
    frac = visited_blocks(S, True, window=w)
    return _finish(row, times, B * H * S * S * 4 * D * frac, frac)


def _bsr_to_flex(offsets, indices, H, S):
    """Our BSR layout as a FlexAttention BlockMask of full blocks."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask

    nb = math.ceil(S / BLOCK)
    counts = torch.zeros(1, H, nb, dtype=torch.int32)
    idx = torch.zeros(1, H, nb, nb, dtype=torch.int32)
    for h in range(H):
        hl = h if offsets.shape[0] > 1 else 0
        for m in range(nb):
            sel = indices[hl, offsets[hl, m]:offsets[hl, m + 1]]
            counts[0, h, m] = len(sel)
            idx[0, h, m, :len(sel)] = torch.from_numpy(sel)
    zero_c, zero_i = torch.zeros_like(counts), torch.zeros_like(idx)
    return BlockMask.from_kv_blocks(zero_c.cuda(), zero_i.cuda(), counts.cuda(), idx.cuda(),
                                    BLOCK_SIZE=BLOCK, mask_mod=None, seq_lengths=(S, S))


def _layout_bool(layout, heads, S):
    """[heads, S, S] boolean visibility of the first layout heads, built on the GPU."""
    import torch

    nb = math.ceil(S / BLOCK)
    blocks = torch.zeros(heads, nb, nb, dtype=torch.bool)
    for h in range(heads):
        for m in range(nb):
            blocks[h, m, layout[1][h, layout[0][h, m]:layout[0][h, m + 1]]] = True
    full = blocks.cuda().repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2)
    return full[:, :S, :S]


def run_layout(K, dtype, S, D, density, flex, rounds):
    import numpy as np
    import torch

    B, H = tokens_heads(S, D)
    q, k, v = _qkv(B, H, S, D, dtype, S + D + int(density * 100))
    out = torch.empty_like(q)
    layout = R.random_layout(np.random.default_rng(S + int(density * 1000)), H, S, S, BLOCK, density)
    lay_t = [torch.from_numpy(a).cuda() for a in layout]
    attrs = T.attrs_for(H, H, D, False) | {"block_size": BLOCK}
    shapes = [q.shape, k.shape, v.shape, None]
    fns = {}
    fns["ours"], kernel = K.ours(attrs, dtype, shapes, [q, k, v, None] + lay_t, out, layout=layout)
    fns["dense_full"], _ = K.ours(T.attrs_for(H, H, D, False), dtype, shapes, [q, k, v], torch.empty_like(q))
    row = {"kind": "layout", "dtype": dtype, "B": B, "H": H, "S": S, "D": D, "density": density, "kernel": kernel}
    # correctness on batch 0, heads 0-1, against SDPA with the layout as a boolean mask
    import torch.nn.functional as F

    mask = _layout_bool(layout, 2, S)
    ref = F.scaled_dot_product_attention(q[:1, :2], k[:1, :2], v[:1, :2], attn_mask=mask[None])
    live = mask.any(-1, keepdim=True)[None]
    row["max_abs_vs_sdpa"] = float(((out[:1, :2].float() - ref.float()) * live).abs().nan_to_num().max())
    del mask, ref
    if flex is not None:
        bm = _bsr_to_flex(layout[0], layout[1], H, S)
        fn, err = _flex_fn(flex, q, k, v, bm, D ** -0.5)
        if fn:
            fns["flex"] = fn
        else:
            row["flex_error"] = err
    times = interleaved(fns, rounds)
    frac = visited_blocks(S, False, layout=layout)
    return _finish(row, times, B * H * S * S * 4 * D * frac, frac)


def run_padding(K, dtype, S, D, pad, rounds):
    import torch
    import torch.nn.functional as F

    B, H = tokens_heads(S, D)
    q, k, v = _qkv(B, H, S, D, dtype, S + D + int(pad * 100))
    tdt = getattr(torch, dtype)
    real = S - int(S * pad)
    bias = torch.zeros(B, 1, 1, S, device="cuda", dtype=tdt)
    bias[..., real:] = torch.finfo(tdt).min
    shapes = [q.shape, k.shape, v.shape, bias.shape]
    attrs = T.attrs_for(H, H, D, False)
    out = torch.empty_like(q)
    fns = {}
    fns["ours"], kernel = K.ours(attrs, dtype, shapes, [q, k, v, bias], out)
    fns["no_mask"], _ = K.ours(attrs, dtype, shapes[:3] + [None], [q, k, v], torch.empty_like(q))
    for name, cfg in variants("padding", D):
        fns[name], _ = K.ours(attrs, dtype, shapes, [q, k, v, bias], torch.empty_like(q), config=cfg)
    keep = bias > -1
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    row = {"kind": "padding", "dtype": dtype, "B": B, "H": H, "S": S, "D": D, "padding": pad, "kernel": kernel,
           "max_abs_vs_sdpa": float((out.float() - ref.float()).abs().max())}
    del ref
    fns["sdpa_mask"] = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    times = interleaved(fns, rounds)
    frac = math.ceil(real / BLOCK) / math.ceil(S / BLOCK)
    row = _finish(row, times, B * H * S * S * 4 * D * frac, frac, ideal_base="no_mask")
    row["vs_no_mask"] = times["ours"] / times["no_mask"]
    return row


def run_dense(K, dtype, S, D, causal, rounds):
    import torch

    B, H = tokens_heads(S, D)
    q, k, v = _qkv(B, H, S, D, dtype, S + D + causal)
    shapes = [q.shape, k.shape, v.shape, None]
    attrs = T.attrs_for(H, H, D, causal)
    src, p = K.source(attrs, dtype, shapes)
    fns = {"ours": K.launcher(src, p, [q, k, v], torch.empty_like(q))}
    bsrc, bp = K.source(attrs, dtype, shapes, baseline=True)
    fns["baseline"] = K.launcher(bsrc, bp, [q, k, v], torch.empty_like(q))
    times = interleaved(fns, rounds)
    fl = 4.0 * B * H * S * S * D / (2 if causal else 1)
    return {"kind": "dense", "dtype": dtype, "B": B, "H": H, "S": S, "D": D, "causal": causal,
            "kernel": src.name, "ours_tfs": fl / times["ours"] * 1e-9,
            "baseline_tfs": fl / times["baseline"] * 1e-9, "ours_vs_baseline": times["baseline"] / times["ours"]}


def variants(kind, D, w=None):
    """Other CUDA configs timed beside the shipped one (name -> FAConfig): at D = 64 the other
    tile height (two or three consumer warpgroups) for windows and key padding; at D = 128 the
    softmax stream for key padding."""
    if D != 64:
        if kind == "padding":  # the softmax as one stream (off by default with a key bias)
            return [("v:stream", dataclasses.replace(L.sm90_config(D, False, keypad=True), softmax_stream=True))]
        return []
    if kind == "window":
        short = w - 1 < L.SM90_SHORT_WINDOW
        return [("v:3wg" if short else "v:2wg",
                 dataclasses.replace(L.sm90_config(64, True), block_m=192 if short else 128,
                                     num_warps=16 if short else 12))]
    if kind == "padding":
        return [("v:2wg", dataclasses.replace(L.sm90_config(64, False, keypad=True), block_m=128, num_warps=12))]
    return []


def _finish(row, times, eff_flops, frac, ideal_base="dense_full"):
    row["visited_fraction"] = frac
    for name, t in times.items():
        row[f"{name}_ms"] = t
    row["ours_eff_tfs"] = eff_flops / times["ours"] * 1e-9
    row["ideal_ms"] = times[ideal_base] * frac
    row["vs_ideal"] = times["ours"] / row["ideal_ms"]
    for peer in ("flex", "dense_causal", "sdpa_mask"):
        if peer in times:
            row[f"speedup_vs_{peer}"] = times[peer] / times["ours"]
    for name in times:
        if name.startswith("v:"):
            row[f"{name[2:]}_vs_ours"] = times["ours"] / times[name]
    return row


def plan_sources(K, todo, dense):
    """Every KernelSource the rows launch (compiled up front, in parallel)."""
    import numpy as np

    out = []
    for kind, dt, S, D, x in todo:
        B, H = tokens_heads(S, D)
        qs = (B, H, S, D)
        shapes = [qs, qs, qs, None]
        if kind == "window":
            for attrs in (T.attrs_for(H, H, D, True) | {"window_left": x - 1}, T.attrs_for(H, H, D, True),
                          T.attrs_for(H, H, D, False)):
                out += K.sources(attrs, dt, shapes)
            for _, cfg in variants(kind, D, x):
                out += K.sources(T.attrs_for(H, H, D, True) | {"window_left": x - 1}, dt, shapes, config=cfg)
        elif kind == "layout":
            lay = (np.zeros((H, math.ceil(S / BLOCK) + 1), np.int32), np.zeros((H, 1), np.int32))
            out += K.sources(T.attrs_for(H, H, D, False) | {"block_size": BLOCK}, dt, shapes, layout=lay)
            out += K.sources(T.attrs_for(H, H, D, False), dt, shapes)
        else:
            out += K.sources(T.attrs_for(H, H, D, False), dt, shapes[:3] + [(B, 1, 1, S)])
            out += K.sources(T.attrs_for(H, H, D, False), dt, shapes)
            for _, cfg in variants(kind, D):
                out += K.sources(T.attrs_for(H, H, D, False), dt, shapes[:3] + [(B, 1, 1, S)], config=cfg)
    for dt, S, D, c in dense:
        B, H = tokens_heads(S, D)
        shapes = [(B, H, S, D)] * 3 + [None]
        out.append(K.source(T.attrs_for(H, H, D, c), dt, shapes)[0])
        out.append(K.source(T.attrs_for(H, H, D, c), dt, shapes, baseline=True)[0])
    return out


# ---- main --------------------------------------------------------------------------------------
def grid(quick: bool, dtypes, dims):
    seqs_w = (4096, 16384) if quick else (4096, 16384, 32768)
    windows = (256, 1024, 4096)
    rows = []
    for dt in dtypes:
        for D in dims:
            rows += [("window", dt, S, D, w) for S in seqs_w for w in windows if w < S]
            rows += [("layout", dt, S, D, d) for S in ((16384,) if quick else (4096, 16384)) for d in (0.5, 0.25, 0.1, 0.05)]
            rows += [("padding", dt, S, D, p) for S in (1024, 4096) for p in (0.0, 0.25, 0.5, 0.75)]
    return rows


def print_rows(rows):
    for r in rows:
        base = f"{r['kind']:8s} {r['dtype']:9s} S={r['S']:6d} D={r['D']:3d} B={r['B']:2d} H={r['H']:2d}"
        if r["kind"] == "dense":
            print(f"{base} causal={r['causal']} ours {r['ours_tfs']:.0f} TF/s baseline {r['baseline_tfs']:.0f} "
                  f"ours/baseline {r['ours_vs_baseline']:.3f}", flush=True)
            continue
        what = {"window": f"w={r.get('window')}", "layout": f"density={r.get('density')}",
                "padding": f"pad={r.get('padding')}"}[r["kind"]]
        peers = " ".join(f"x{k[11:]}={r[k]:.2f}" for k in r if k.startswith("speedup_vs_"))
        peers += "".join(f" {k}={r[k]:.2f}" for k in r if k.endswith("_vs_ours"))
        extra = f" vs_no_mask={r['vs_no_mask']:.3f}" if "vs_no_mask" in r else ""
        print(f"{base} {what:13s} visited={r['visited_fraction']:.3f} ours {r['ours_ms']:.3f} ms "
              f"({r['ours_eff_tfs']:.0f} eff TF/s) vs_ideal={r['vs_ideal']:.2f} {peers}{extra} "
              f"err={r.get('max_abs_vs_sdpa', float('nan')):.1e}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--baseline", metavar="DIR", help="checkout root of the previous kernel (dense A/B rows)")
    ap.add_argument("--quick", action="store_true", help="fewer shapes (S 4k/16k)")
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--kinds", default="window,layout,padding,dense")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--sdpa-max", type=int, default=16384, help="largest S for SDPA with a full mask")
    args = ap.parse_args(argv)
    import torch

    dtypes, dims = args.dtypes.split(","), [int(x) for x in args.dims.split(",")]
    kinds = set(args.kinds.split(","))
    K = Kernels(args.baseline)
    todo = [r for r in grid(args.quick, dtypes, dims) if r[0] in kinds]
    dense = [(dt, S, D, c) for dt in dtypes for D in dims for S in (1024, 4096, 16384) for c in (0, 1)] \
        if "dense" in kinds and args.baseline else []
    flex = None if args.no_flex else _flex()
    rows, t0 = [], time.time()
    K.compile(plan_sources(K, todo, dense))
    for kind, dt, S, D, x in todo:
        try:
            if kind == "window":
                row = run_window(K, dt, S, D, x, flex, args.rounds, args.sdpa_max)
            elif kind == "layout":
                row = run_layout(K, dt, S, D, x, flex, args.rounds)
            else:
                row = run_padding(K, dt, S, D, x, args.rounds)
        except Exception as e:
            row = {"kind": kind, "dtype": dt, "S": S, "D": D, "x": x, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(row, flush=True)
        else:
            print_rows([row])
        rows.append(row)
        torch.cuda.empty_cache()
    for dt, S, D, c in dense:
        row = run_dense(K, dt, S, D, c, args.rounds)
        print_rows([row])
        rows.append(row)
    print(f"{len(rows)} rows in {time.time() - t0:.0f}s")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                              "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
