"""FlashAttention forward in Triton (FlashAttention-2 schedule, tuned for Hopper).

    o[b, h] = softmax(scale * q[b, h] @ k[b, h // G]^T + bias[b, h] (+ causal mask)) @ v[b, h // G]

q, o: [B, H, Sq, D]; k, v: [B, Hkv, Sk, D], all contiguous; G = H / Hkv query heads share one kv
head (grouped-query attention: the kv head is picked by index, never repeated in memory).
bias broadcasts to [B, H, Sq, Sk]; which of its four dims are full (the others have size 1, stride 0)
is a compile-time pattern, and its strides are derived from (H, Sq, Sk) here because the launcher
passes only pointers and int32 scalars. causal masks key j > i + (Sk - Sq).

One program computes one BLOCK_M x D tile of o: it keeps q, the running row max m, the running row
sum l and the fp32 accumulator on-chip and streams K/V in BLOCK_N blocks (online softmax; the
Sq x Sk scores and probabilities never reach HBM). Scores are kept in the log2 domain
(x * log2(e)), so every exponential is one exp2.

Masked and fully masked rows (the defined output):
- masked scores are -inf; a row whose every score is -inf (e.g. causal with Sk < Sq, or an all -inf
  bias row) has l = 0 and its output is 0 (the reference does the same).
- a finite very negative bias (HF masks use finfo(dtype).min) is added as a number, exactly like the
  unfused graph: a row whose bias is finfo.min everywhere gives a uniform average of v, because the
  small scores are absorbed by the huge bias. Bias values below -2e38 are kept as they are instead of
  being multiplied by log2(e) (which would overflow fp32 to -inf and turn "finfo.min" into "-inf").

- a bias that broadcasts from one value (SCALAR_BIAS; the rewrite stage's dummy 0 when the graph
  has no mask) shifts every score equally, which softmax ignores: it is read once, and only -inf
  (output 0) or NaN/+inf (NaN) change the result.

Program order: the 1-D grid walks the query blocks of one (b, h) fastest, so the programs running
together share K/V of one head (and the G heads of a group) in L2; causal runs the heaviest
(last) query blocks first to shorten the tail.
"""

import triton
import triton.language as tl


@triton.jit
def _load_bias(b_base, rows, cols, Sq, Sk, stride_bm,
               BIAS_M: tl.constexpr, BIAS_N: tl.constexpr):
    """The bias tile for (rows, cols), in log2 units, broadcast to [BLOCK_M, BLOCK_N].

    A broadcast dim is loaded once as a vector (a key-padding mask [B, 1, 1, Sk] is one row),
    not as a [BLOCK_M, BLOCK_N] gather of equal addresses.
    """
    if BIAS_M and BIAS_N:
        b = tl.load(b_base + rows[:, None] * stride_bm + cols[None, :],
                    mask=(rows[:, None] < Sq) & (cols[None, :] < Sk), other=0.0).to(tl.float32)
    elif BIAS_N:
        b = tl.load(b_base + cols, mask=cols < Sk, other=0.0).to(tl.float32)[None, :]
    elif BIAS_M:
        b = tl.load(b_base + rows, mask=rows < Sq, other=0.0).to(tl.float32)[:, None]
    else:
        b = tl.load(b_base).to(tl.float32)
    # log2 domain; keep finfo.min-like values finite (see module docstring).
    return tl.where(b < -2.0e38, b, b * 1.4426950408889634)


@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q,
                    k_base, v_base, b_base, stride_bm,
                    rows, offs_n, offs_d, lo, hi, Sq, Sk, causal_off,
                    SCALE_LOG2: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                    HAS_BIAS: tl.constexpr, BIAS_M: tl.constexpr, BIAS_N: tl.constexpr,
                    IEEE: tl.constexpr):
    """Stream key blocks [lo, hi) into (acc, l_i, m_i).

    MASKED blocks check key < Sk and, if CAUSAL, key <= row + causal_off; the other blocks are
    known to be fully valid and skip the mask arithmetic (the bulk of the work).
    """
    d_ok = offs_d < HEAD_DIM  # all-true unless D is padded to a power of two (80, 96)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        kv_off = cols[:, None] * HEAD_DIM + offs_d[None, :]
        # -- scores: q @ k^T in fp32 on the tensor cores --------------------------------------
        if MASKED:
            kv_mask = (cols[:, None] < Sk) & d_ok[None, :]
        else:
            kv_mask = d_ok[None, :]
        k = tl.load(k_base + kv_off, mask=kv_mask, other=0.0)
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        # -- new row max, in log2 units ---------------------------------------------------------
        if HAS_BIAS or MASKED or SCALE_LOG2 < 0:
            s = qk * SCALE_LOG2
            if HAS_BIAS:
                s += _load_bias(b_base, rows, cols, Sq, Sk, stride_bm, BIAS_M, BIAS_N)
            if MASKED:
                ok = cols[None, :] < Sk
                if CAUSAL:
                    ok = ok & (cols[None, :] <= rows[:, None] + causal_off)
                s = tl.where(ok, s, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(s, 1))
            # A row with no finite score so far: subtract 0 so exp2(-inf - 0) = 0, not NaN.
            m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
            p = tl.math.exp2(s - m_sub[:, None])
        else:
            # Hot path (no bias, no mask, scale > 0): max of the raw scores, one FMA per score.
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * SCALE_LOG2)
            m_sub = m_ij
            p = tl.math.exp2(qk * SCALE_LOG2 - m_sub[:, None])
        # -- rescale what was accumulated under the old max ------------------------------------
        alpha = tl.math.exp2(m_i - m_sub)
        l_ij = tl.sum(p, 1)
        acc = acc * alpha[:, None]
        # -- acc += p @ v (p rounded to the input dtype, as every FlashAttention does) -----------
        v = tl.load(v_base + kv_off, mask=kv_mask, other=0.0)
        if IEEE:
            acc = tl.dot(p, v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        l_i = l_i * alpha + l_ij
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def _flash_attention_fwd_kernel(
        Q, K, V, Bias, H, Hkv, Sq, Sk, Out,
        SCALE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
        HAS_BIAS: tl.constexpr, BIAS_B: tl.constexpr, BIAS_H: tl.constexpr,
        BIAS_M: tl.constexpr, BIAS_N: tl.constexpr, SCALAR_BIAS: tl.constexpr):
    # -- which tile: query block fastest, then (b, h) -------------------------------------------
    num_m = tl.cdiv(Sq, BLOCK_M)
    pid = tl.program_id(0)
    off_hz = pid // num_m
    start_m = pid % num_m
    if CAUSAL:
        start_m = num_m - 1 - start_m  # heaviest blocks first
    off_b = off_hz // H
    off_h = off_hz % H
    off_kv = off_b * Hkv + off_h // (H // Hkv)  # GQA: index the shared kv head, never copy it
    # Per-head bases in int64 (B*H*S*D may pass 2**31); offsets inside one head stay int32.
    q_base = Q + off_hz.to(tl.int64) * Sq * HEAD_DIM
    o_base = Out + off_hz.to(tl.int64) * Sq * HEAD_DIM
    k_base = K + off_kv.to(tl.int64) * Sk * HEAD_DIM
    v_base = V + off_kv.to(tl.int64) * Sk * HEAD_DIM

    # -- bias: contiguous, size-1 dims broadcast (stride 0) --------------------------------------
    stride_bm = 0
    b_base = Bias
    if HAS_BIAS:
        n_len = Sk if BIAS_N else 1
        m_len = Sq if BIAS_M else 1
        stride_bm = n_len if BIAS_M else 0
        stride_bh = m_len * n_len
        stride_bb = (H if BIAS_H else 1) * stride_bh
        b_off = off_b.to(tl.int64) * stride_bb * BIAS_B + off_h.to(tl.int64) * stride_bh * BIAS_H
        b_base = Bias + b_off

    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_mask = (rows[:, None] < Sq) & (offs_d[None, :] < HEAD_DIM)
    # q stays in registers / shared memory for the whole key loop.
    q = tl.load(q_base + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=q_mask, other=0.0)

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    SCALE_LOG2: tl.constexpr = SCALE * 1.4426950408889634
    IEEE: tl.constexpr = Q.dtype.element_ty == tl.float32

    # -- key ranges: full blocks without mask arithmetic, then the masked edge -------------------
    causal_off = Sk - Sq
    n_full_blocks = Sk // BLOCK_N
    if CAUSAL:
        # keys <= start_m*BLOCK_M + causal_off are visible to every row of this block
        first_row_keys = tl.maximum(start_m * BLOCK_M + causal_off + 1, 0)
        n_full_blocks = tl.minimum(first_row_keys // BLOCK_N, n_full_blocks)
        hi = tl.minimum(Sk, start_m * BLOCK_M + BLOCK_M + causal_off)
    else:
        hi = Sk
    mid = n_full_blocks * BLOCK_N
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, b_base, stride_bm,
        rows, offs_n, offs_d, 0, mid, Sq, Sk, causal_off,
        SCALE_LOG2, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, False, CAUSAL,
        HAS_BIAS, BIAS_M, BIAS_N, IEEE)
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, b_base, stride_bm,
        rows, offs_n, offs_d, mid, hi, Sq, Sk, causal_off,
        SCALE_LOG2, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, True, CAUSAL,
        HAS_BIAS, BIAS_M, BIAS_N, IEEE)

    # -- epilogue: normalise; rows with no visible key (l = 0) give 0 -----------------------------
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    if SCALAR_BIAS:
        # A bias that broadcasts from one value c shifts every score equally, which softmax
        # ignores; only c = -inf (every score masked: 0) and NaN/+inf (NaN) change the result.
        c = tl.load(Bias).to(tl.float32)
        o = tl.where(c == float("-inf"), 0.0, o + c * 0.0)
    tl.store(o_base + rows[:, None] * HEAD_DIM + offs_d[None, :], o.to(Out.dtype.element_ty),
             mask=q_mask)
