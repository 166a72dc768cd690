#!/usr/bin/env python3
"""Experiment: does a TMA (device-side tensor descriptor) variant of the FlashAttention kernel beat
the plain-pointer kernel on Hopper? JIT only (Triton on the GPU machine).

Device-side descriptors need Triton's global scratch memory (128 B per descriptor and program),
which optfuse's launcher (and TensorRT QDP) do not provide, so this variant cannot ship as a plugin
today; the number here says whether asking for launcher scratch support is worth it.
No bias, D in {64, 128}, causal or not; prints TF/s next to the shipped kernel's JIT.

    python scripts/attention_tma_probe.py --out probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@triton.jit
def _inner(acc, l_i, m_i, q, k_desc, v_desc, off_kv, rows, offs_n, lo, hi, Sk, causal_off,
           SCALE_LOG2: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
           MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = k_desc.load([off_kv, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        qk = tl.dot(q, tl.trans(k))
        if MASKED:
            s = qk * SCALE_LOG2
            ok = cols[None, :] < Sk
            if CAUSAL:
                ok = ok & (cols[None, :] <= rows[:, None] + causal_off)
            s = tl.where(ok, s, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(s, 1))
            m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
            p = tl.math.exp2(s - m_sub[:, None])
        else:
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * SCALE_LOG2)
            m_sub = m_ij
            p = tl.math.exp2(qk * SCALE_LOG2 - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_ij = tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = v_desc.load([off_kv, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        acc = tl.dot(p.to(v.dtype), v, acc)
        l_i = l_i * alpha + l_ij
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def _fa_tma(Q, K, V, H, Hkv, Sq, Sk, Out, SCALE: tl.constexpr, HEAD_DIM: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    num_m = tl.cdiv(Sq, BLOCK_M)
    pid = tl.program_id(0)
    off_hz = pid // num_m
    start_m = pid % num_m
    if CAUSAL:
        start_m = num_m - 1 - start_m
    off_b = off_hz // H
    off_h = off_hz % H
    off_kv = off_b * Hkv + off_h // (H // Hkv)
    BH = tl.num_programs(0) // num_m
    # 3-D descriptors [heads, S, D]: out-of-range rows read as 0 and are not written
    q_desc = tl.make_tensor_descriptor(Q, shape=[BH, Sq, HEAD_DIM], strides=[Sq * HEAD_DIM, HEAD_DIM, 1],
                                       block_shape=[1, BLOCK_M, HEAD_DIM])
    o_desc = tl.make_tensor_descriptor(Out, shape=[BH, Sq, HEAD_DIM], strides=[Sq * HEAD_DIM, HEAD_DIM, 1],
                                       block_shape=[1, BLOCK_M, HEAD_DIM])
    nkv = BH // H * Hkv
    k_desc = tl.make_tensor_descriptor(K, shape=[nkv, Sk, HEAD_DIM], strides=[Sk * HEAD_DIM, HEAD_DIM, 1],
                                       block_shape=[1, BLOCK_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(V, shape=[nkv, Sk, HEAD_DIM], strides=[Sk * HEAD_DIM, HEAD_DIM, 1],
                                       block_shape=[1, BLOCK_N, HEAD_DIM])
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q = q_desc.load([off_hz, start_m * BLOCK_M, 0]).reshape(BLOCK_M, HEAD_DIM)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    SCALE_LOG2: tl.constexpr = SCALE * 1.4426950408889634
    causal_off = Sk - Sq
    n_full_blocks = Sk // BLOCK_N
    if CAUSAL:
        first_row_keys = tl.maximum(start_m * BLOCK_M + causal_off + 1, 0)
        n_full_blocks = tl.minimum(first_row_keys // BLOCK_N, n_full_blocks)
        hi = tl.minimum(Sk, start_m * BLOCK_M + BLOCK_M + causal_off)
    else:
        hi = Sk
    mid = n_full_blocks * BLOCK_N
    acc, l_i, m_i = _inner(acc, l_i, m_i, q, k_desc, v_desc, off_kv, rows, offs_n, 0, mid, Sk,
                           causal_off, SCALE_LOG2, HEAD_DIM, BLOCK_N, False, CAUSAL)
    acc, l_i, m_i = _inner(acc, l_i, m_i, q, k_desc, v_desc, off_kv, rows, offs_n, mid, hi, Sk,
                           causal_off, SCALE_LOG2, HEAD_DIM, BLOCK_N, True, CAUSAL)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    o_desc.store([off_hz, start_m * BLOCK_M, 0], o.to(Out.dtype.element_ty).reshape(1, BLOCK_M, HEAD_DIM))


def main():
    import torch
    import torch.nn.functional as F
    import triton.testing

    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--S", type=int, default=4096)
    args = ap.parse_args()
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    rows = []
    S = args.S
    for D in (64, 128):
        B, H = 16384 // S, 2048 // D
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for causal in (0, 1):
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))
            fl = 4.0 * B * H * S * S * D / (2 if causal else 1)
            for bm, bn, w, st in ((128, 64, 8 if D == 128 else 4, 3), (128, 128, 8, 2)):
                o = torch.empty_like(q)
                grid = (triton.cdiv(S, bm) * B * H,)

                def run():
                    _fa_tma[grid](q, k, v, H, H, S, S, o, SCALE=D ** -0.5, HEAD_DIM=D, BLOCK_M=bm,
                                  BLOCK_N=bn, CAUSAL=bool(causal), num_warps=w, num_stages=st)
                try:
                    run()
                    err = float((o.float() - ref.float()).abs().max())
                    ms = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
                    r = dict(D=D, causal=causal, cfg=[bm, bn, w, st], tfs=fl / ms * 1e-9, err=err)
                except Exception as e:
                    r = dict(D=D, causal=causal, cfg=[bm, bn, w, st], error=f"{type(e).__name__}: {str(e)[:200]}")
                rows.append(r)
                print("tma", json.dumps(r), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
