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

FP8 (Q, K, V float8e4m3fn, FP8 constexpr from Q's type; QScale, KScale, VScale float32 scalars):
- q @ k^T is an E4M3 dot with fp32 accumulation; q_scale * k_scale is folded into the exp2 argument
  (one runtime factor on SCALE * log2(e)); the hot path's max-then-FMA assumes positive scales.
- p is computed scaled by 448 (LOG2_P_FP8_SCALE = log2(448) taken off the running max inside the exp2
  argument: no extra multiply) and rounded to E4M3 on chip, so the row max lands on E4M3's largest
  finite value and small probabilities stay normal longer; p @ v is an E4M3 dot (fp32
  accumulation). The row sum l comes from the same fp32 p, as in FlashAttention-3, so the 448
  cancels in acc / l.
- V comes transposed, [Hkv, D, Skv] per batch with Skv = Sk rounded up to 16 (keys contiguous:
  the K-major B operand of the FP8 tensor-core dot; rows 16-byte aligned for vector loads).
- the epilogue applies v_scale once, with the 1 / l normalisation.

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
def _scores_log2(qk, SCALE_LOG2: tl.constexpr, SOFTCAP: tl.constexpr):
    """Scores in log2 units: scale * qk, or with soft-capping softcap * tanh(scale * qk / softcap)
    (tanh from one exp2: every arch and the interpreter have it)."""
    if SOFTCAP > 0:
        x = qk * (SCALE_LOG2 / (SOFTCAP * 1.4426950408889634))
        t = 1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)
        return t * (SOFTCAP * 1.4426950408889634)
    return qk * SCALE_LOG2


#: FP8: log2 of the scale of p before its rounding to E4M3 (448, E4M3's largest finite value)
LOG2_P_FP8_SCALE = tl.constexpr(8.807354922057604)


@triton.jit
def _attn_block(acc, l_i, m_i, q, k_base, v_base, b_base, stride_bm,
                rows, offs_n, offs_d, start_n, Sq, Sk, causal_off, qk_dq, v_stride,
                SCALE_LOG2: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr,
                WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
                HAS_BIAS: tl.constexpr, BIAS_M: tl.constexpr, BIAS_N: tl.constexpr,
                IEEE: tl.constexpr, FP8: tl.constexpr):
    """One key block [start_n, start_n + BLOCK_N) into (acc, l_i, m_i).

    MASKED blocks check key < Sk and the causal / window limits of each row; the other blocks are
    known to be fully visible and skip the mask arithmetic (the bulk of the work). FP8: ``qk_dq``
    = q_scale * k_scale dequantizes q @ k^T, V^T rows are ``v_stride`` keys apart.
    """
    d_ok = offs_d < HEAD_DIM  # all-true unless D is padded to a power of two (80, 96)
    cols = start_n + offs_n
    kv_off = cols[:, None] * HEAD_DIM + offs_d[None, :]
    # -- scores: q @ k^T in fp32 on the tensor cores ------------------------------------------
    if MASKED:
        kv_mask = (cols[:, None] < Sk) & d_ok[None, :]
    else:
        kv_mask = d_ok[None, :]
    k = tl.load(k_base + kv_off, mask=kv_mask, other=0.0)
    if IEEE:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    if FP8:
        sl2 = qk_dq * SCALE_LOG2  # the dequantization folded into the exp2 argument
    else:
        sl2 = SCALE_LOG2
    # -- new row max, in log2 units -------------------------------------------------------------
    if HAS_BIAS or MASKED or SCALE_LOG2 < 0 or SOFTCAP > 0:
        if FP8:
            s = _scores_log2(qk * qk_dq, SCALE_LOG2, SOFTCAP)
        else:
            s = _scores_log2(qk, SCALE_LOG2, SOFTCAP)
        if HAS_BIAS:
            s += _load_bias(b_base, rows, cols, Sq, Sk, stride_bm, BIAS_M, BIAS_N)
        if MASKED:
            ok = cols[None, :] < Sk
            diag = rows[:, None] + causal_off
            if CAUSAL:
                ok = ok & (cols[None, :] <= diag)
            if WINDOW_RIGHT >= 0:
                ok = ok & (cols[None, :] <= diag + WINDOW_RIGHT)
            if WINDOW_LEFT >= 0:
                ok = ok & (cols[None, :] >= diag - WINDOW_LEFT)
            s = tl.where(ok, s, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(s, 1))
        # A row with no finite score so far: subtract 0 so exp2(-inf - 0) = 0, not NaN.
        m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
        if FP8:
            p = tl.math.exp2(s - (m_sub - LOG2_P_FP8_SCALE)[:, None])  # 448 p
        else:
            p = tl.math.exp2(s - m_sub[:, None])
    else:
        # Hot path (no bias, no mask, no cap, scale > 0): max of the raw scores, one FMA per score.
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * sl2)
        m_sub = m_ij
        if FP8:
            p = tl.math.exp2(qk * sl2 - (m_sub - LOG2_P_FP8_SCALE)[:, None])  # 448 p
        else:
            p = tl.math.exp2(qk * sl2 - m_sub[:, None])
    # -- rescale what was accumulated under the old max ----------------------------------------
    alpha = tl.math.exp2(m_i - m_sub)
    l_ij = tl.sum(p, 1)
    acc = acc * alpha[:, None]
    # -- acc += p @ v (p rounded to the input dtype, as every FlashAttention does) ---------------
    if FP8:
        # V^T tile [D, BLOCK_N], keys contiguous; p scaled into E4M3's range, rounded on chip
        # (masked blocks: loaded up to the padded row end, a multiple of 16 keys, so the loads stay
        # 16-byte vectors; the padding keys past Sk hold any bits and are zeroed in registers)
        if MASKED:
            vt_mask = d_ok[:, None] & (cols[None, :] < v_stride)
        else:
            vt_mask = d_ok[:, None]
        vt = tl.load(v_base + offs_d[:, None] * v_stride + cols[None, :], mask=vt_mask, other=0.0)
        if MASKED:
            vt = tl.where(cols[None, :] < Sk, vt, tl.zeros_like(vt))
        acc = tl.dot(p.to(vt.dtype), tl.trans(vt), acc)
    else:
        v = tl.load(v_base + kv_off, mask=kv_mask, other=0.0)
        if IEEE:
            acc = tl.dot(p, v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
    l_i = l_i * alpha + l_ij
    return acc, l_i, m_ij


@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q,
                    k_base, v_base, b_base, stride_bm,
                    rows, offs_n, offs_d, lo, hi, Sq, Sk, causal_off, qk_dq, v_stride,
                    SCALE_LOG2: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                    WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
                    HAS_BIAS: tl.constexpr, BIAS_M: tl.constexpr, BIAS_N: tl.constexpr,
                    IEEE: tl.constexpr, FP8: tl.constexpr):
    """Stream key blocks [lo, hi) (lo a multiple of BLOCK_N, or lo == hi) into (acc, l_i, m_i).

    FP8 loops over block indices, so every start_n is a product of BLOCK_N the compiler can see:
    the bounds are clamped to Sk, which has no known alignment, a loop variable's alignment is that
    of its bounds, and ``tl.multiple_of`` on it is dropped; FP8's V^T tiles are keys-contiguous, so
    their loads vectorize (and pipeline as cp.async) only with it (H200: 328-352 -> 650-693 TF/s).
    The 16-bit loads are contiguous along D and need no key alignment: that loop (and its SASS)
    stays as it was.
    """
    if FP8:
        for blk in range(tl.cdiv(lo, BLOCK_N), tl.cdiv(hi, BLOCK_N)):
            acc, l_i, m_i = _attn_block(
                acc, l_i, m_i, q, k_base, v_base, b_base, stride_bm, rows, offs_n, offs_d, blk * BLOCK_N,
                Sq, Sk, causal_off, qk_dq, v_stride, SCALE_LOG2, HEAD_DIM, BLOCK_N, MASKED, CAUSAL,
                WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, HAS_BIAS, BIAS_M, BIAS_N, IEEE, FP8)
    else:
        for start_n in range(lo, hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            acc, l_i, m_i = _attn_block(
                acc, l_i, m_i, q, k_base, v_base, b_base, stride_bm, rows, offs_n, offs_d, start_n,
                Sq, Sk, causal_off, qk_dq, v_stride, SCALE_LOG2, HEAD_DIM, BLOCK_N, MASKED, CAUSAL,
                WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, HAS_BIAS, BIAS_M, BIAS_N, IEEE, FP8)
    return acc, l_i, m_i


@triton.jit
def _live_key_range(b_base, Sk, offs_n, BLOCK_N: tl.constexpr, THRESHOLD: tl.constexpr):
    """First and last key whose key-padding bias is above THRESHOLD (masked: at or below it),
    (Sk, -1) when there is none: one pass over the bias row."""
    first = Sk
    last = -1
    for c0 in range(0, Sk, BLOCK_N):
        cols = c0 + offs_n
        b = tl.load(b_base + cols, mask=cols < Sk, other=float("-inf")).to(tl.float32)
        live = b > THRESHOLD
        first = tl.minimum(first, tl.min(tl.where(live, cols, Sk), 0))
        last = tl.maximum(last, tl.max(tl.where(live, cols, -1), 0))
    return first, last


@triton.jit
def _flash_attention_fwd_kernel(
        Q, K, V, Bias, QScale, KScale, VScale, Offsets, Indices, H, Hkv, Sq, Sk, Nnz, Out,
        SCALE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
        HAS_BIAS: tl.constexpr, BIAS_B: tl.constexpr, BIAS_H: tl.constexpr,
        BIAS_M: tl.constexpr, BIAS_N: tl.constexpr, SCALAR_BIAS: tl.constexpr,
        WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
        LAYOUT: tl.constexpr, LAYOUT_HEADS: tl.constexpr, LAYOUT_BLOCK: tl.constexpr):
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
    FP8: tl.constexpr = Q.dtype.element_ty == tl.float8e4nv
    qk_dq = 1.0
    v_stride = Sk  # keys per V head (FP8: the padded row length of V^T)
    if FP8:
        qk_dq = tl.load(QScale) * tl.load(KScale)
        v_stride = tl.multiple_of(tl.cdiv(Sk, 16) * 16, 16)
    # Per-head bases in int64 (B*H*S*D may pass 2**31); offsets inside one head stay int32.
    q_base = Q + off_hz.to(tl.int64) * Sq * HEAD_DIM
    o_base = Out + off_hz.to(tl.int64) * Sq * HEAD_DIM
    k_base = K + off_kv.to(tl.int64) * Sk * HEAD_DIM
    v_base = V + off_kv.to(tl.int64) * v_stride * HEAD_DIM

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
    causal_off = Sk - Sq
    first_row = start_m * BLOCK_M
    last_row = tl.minimum(first_row + BLOCK_M, Sq) - 1

    if LAYOUT:
        # -- block-sparse: the key blocks the layout lists for this query block ------------------
        # (BLOCK_M divides LAYOUT_BLOCK; every listed block goes through the masked path, which
        # also handles the Sk tail and causal diagonal)
        lay_row = first_row // LAYOUT_BLOCK
        h_l = off_h if LAYOUT_HEADS else 0
        off_base = Offsets + h_l * (tl.cdiv(Sq, LAYOUT_BLOCK) + 1)
        p0 = tl.load(off_base + lay_row)
        p1 = tl.load(off_base + lay_row + 1)
        for j in range(p0, p1):
            kb = tl.load(Indices + h_l * Nnz + j)
            for sub in tl.static_range(LAYOUT_BLOCK // BLOCK_N):
                acc, l_i, m_i = _attn_block(
                    acc, l_i, m_i, q, k_base, v_base, b_base, stride_bm, rows, offs_n, offs_d,
                    kb * LAYOUT_BLOCK + sub * BLOCK_N, Sq, Sk, causal_off, qk_dq, v_stride, SCALE_LOG2,
                    HEAD_DIM, BLOCK_N, True, CAUSAL, -1, -1, SOFTCAP, HAS_BIAS, BIAS_M, BIAS_N, IEEE, FP8)
    else:
        # -- key range of the tile: the causal / window limits of its first and last rows --------
        # keys a row may see: [row + off - WINDOW_LEFT, row + off (+ WINDOW_RIGHT)] within [0, Sk)
        lo = Sk * 0
        hi = Sk
        full_lo = Sk * 0      # from here, no row's left window limit cuts a block
        full_end = Sk         # below this, no row's right limit (causal, window, Sk) cuts a block
        if WINDOW_LEFT >= 0:
            lo = tl.maximum(first_row + causal_off - WINDOW_LEFT, 0)
            full_lo = tl.maximum(last_row + causal_off - WINDOW_LEFT, 0)
        if CAUSAL:
            hi = tl.minimum(hi, last_row + causal_off + 1)
            full_end = tl.minimum(full_end, first_row + causal_off + 1)
        if WINDOW_RIGHT >= 0:
            hi = tl.minimum(hi, last_row + causal_off + WINDOW_RIGHT + 1)
            full_end = tl.minimum(full_end, first_row + causal_off + WINDOW_RIGHT + 1)
        if HAS_BIAS and BIAS_N and not BIAS_M:
            # Key padding: keys before the row's first unmasked key and after its last one add
            # exactly 0 to every row that sees an unmasked key, so they are skipped -- unless some
            # row of the tile would see none (then its average over masked keys is the result).
            first, last = _live_key_range(b_base, Sk, offs_n, BLOCK_N,
                                          -3.0e4 if Bias.dtype.element_ty == tl.float16 else -1.0e30)
            first_top = Sk - 1
            if CAUSAL:
                first_top = tl.minimum(first_top, first_row + causal_off)
            if WINDOW_RIGHT >= 0:
                first_top = tl.minimum(first_top, first_row + causal_off + WINDOW_RIGHT)
            last_bottom = Sk * 0
            if WINDOW_LEFT >= 0:
                last_bottom = last_row + causal_off - WINDOW_LEFT
            if (first <= last) & (first_top >= first) & (last_bottom <= last):
                lo = tl.maximum(lo, first)
                hi = tl.minimum(hi, last + 1)
        lo = (lo // BLOCK_N) * BLOCK_N
        hi = tl.maximum(hi, lo)
        full_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, lo), hi)
        full_hi = tl.minimum(tl.maximum((tl.maximum(full_end, 0) // BLOCK_N) * BLOCK_N, full_lo), hi)
        # masked left edge, full blocks without mask arithmetic, masked right edge
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, q, k_base, v_base, b_base, stride_bm,
            rows, offs_n, offs_d, lo, full_lo, Sq, Sk, causal_off, qk_dq, v_stride,
            SCALE_LOG2, HEAD_DIM, BLOCK_N, True, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP,
            HAS_BIAS, BIAS_M, BIAS_N, IEEE, FP8)
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, q, k_base, v_base, b_base, stride_bm,
            rows, offs_n, offs_d, full_lo, full_hi, Sq, Sk, causal_off, qk_dq, v_stride,
            SCALE_LOG2, HEAD_DIM, BLOCK_N, False, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP,
            HAS_BIAS, BIAS_M, BIAS_N, IEEE, FP8)
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, q, k_base, v_base, b_base, stride_bm,
            rows, offs_n, offs_d, full_hi, hi, Sq, Sk, causal_off, qk_dq, v_stride,
            SCALE_LOG2, HEAD_DIM, BLOCK_N, True, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP,
            HAS_BIAS, BIAS_M, BIAS_N, IEEE, FP8)

    # -- epilogue: normalise; rows with no visible key (l = 0) give 0 -----------------------------
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    if FP8:
        o = o * tl.load(VScale)  # v's dequantization, once (p's 448 cancels in acc / l)
    if SCALAR_BIAS:
        # A bias that broadcasts from one value c shifts every score equally, which softmax
        # ignores; only c = -inf (every score masked: 0) and NaN/+inf (NaN) change the result.
        c = tl.load(Bias).to(tl.float32)
        o = tl.where(c == float("-inf"), 0.0, o + c * 0.0)
    tl.store(o_base + rows[:, None] * HEAD_DIM + offs_d[None, :], o.to(Out.dtype.element_ty),
             mask=q_mask)
