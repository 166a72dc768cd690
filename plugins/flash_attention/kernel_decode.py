"""FlashAttention for short query blocks over a long KV cache (decode): split-KV in Triton.

    o[b, h, i] = softmax_j(cap(scale * q[b, h, i] . k[b, h // G, j]) + bias[b, 0, 0, j] (+ masks)) v[b, h // G, j]

the op of kernel.py (q [B, H, Sq, D], k / v [B, Hkv, Sk, D], G = H / Hkv, causal and windows with
the offset off = Sk - Sq, soft-cap) for Sq = 1..16, in one kernel (flash-decoding whose last
split combines):

* ``_decode_split_kernel``: one program per (b, kv head, key split of SPLIT_KEYS keys, block of
  BLOCK_M packed rows). The G query heads that share a kv head and their Sq rows are one
  contiguous block of M = G * Sq rows of q (heads h = kv * G + g are adjacent, rows r = g * Sq + i),
  so they are packed into the MMA's M dimension and the split's K / V are read once for all of
  them. The program streams its split in BLOCK_N-key blocks (online softmax, log2 domain) and
  writes, per row, the unnormalized accumulator acc = sum_j 2^(s_j - m) v_j (fp32), the row max m
  and the row sum l = sum_j 2^(s_j - m). A split with no visible key writes acc = 0, m = -inf,
  l = 0.
* the combine, in the same kernel: each program then counts itself in on its (b, kv head, row
  block)'s arrival counter (an atomic add, acquire-release at GPU scope, after a CTA barrier so
  every thread's partials are released with it). The program that arrives last resets the
  counter to 0 and combines the row block's splits: with M* = max_s m_s,
  o = sum_s 2^(m_s - M*) acc_s / sum_s 2^(m_s - M*) l_s (the log-sum-exp combine), 0 when no split
  saw a key. No second kernel runs, so no launch and no grid-wide wait sit between the last
  split and o.

Where one split holds the whole cache (large batches), the kernel's ``DIRECT`` form runs: one
program per (b, kv head, row block) streams every key and writes o = acc / l itself (0 when no
key is visible), with no partials, counters or combine.

Partials (the workspace, fp32, row R = (b * H + h) * Sq + i, n = cdiv(Sk, SPLIT_KEYS) splits):
``Part[R, s, 0:D]``, ``RowMax[R, s]``, ``RowSum[R, s]`` -- one row's splits are contiguous, so the
combine reads them in one sweep. Counters (the plan state, int32, zero between launches):
``Count[(b * Hkv + kv head) * row blocks + row block]``.

Bias: none, one value for everything, or a key-padding row ([B|1, 1, 1, Sk] and [B|1, 1, 1, 1]):
added to the scores as a number (finfo.min rows give the uniform average, as in the unfused
graph; values below -2e38 are not multiplied by log2(e)). Masked scores are -inf; a row with no
visible key gives 0. Every other bias pattern stays on kernel.py (launch.py decides).
"""

import triton
import triton.language as tl


@triton.jit
def _scores_log2(qk, SCALE_LOG2: tl.constexpr, SOFTCAP: tl.constexpr):
    """Scores in log2 units: scale * qk, or softcap * tanh(scale * qk / softcap) (tanh from one exp2)."""
    if SOFTCAP > 0:
        x = qk * (SCALE_LOG2 / (SOFTCAP * 1.4426950408889634))
        t = 1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)
        return t * (SOFTCAP * 1.4426950408889634)
    return qk * SCALE_LOG2


@triton.jit
def _key_block(acc, l_i, m_i, q, k_base, v_base, b_base, start_n, key_end, diag, offs_n, offs_d,
               SCALE_LOG2: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
               SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_N: tl.constexpr,
               IEEE: tl.constexpr):
    """Keys [start_n, start_n + BLOCK_N) into (acc, l_i, m_i). MASKED blocks mask keys >= key_end
    (the split's or the cache's end) and each row's causal / window limits (``diag`` = i + off
    per packed row); the other blocks are visible to every row."""
    cols = start_n + offs_n
    kv_off = cols[:, None] * HEAD_DIM + offs_d[None, :]
    if MASKED or HEAD_DIM != HEAD_DIM_PAD:  # D padded to a power of two (80, 96): mask the tail
        kv_mask = (cols[:, None] < key_end) & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_base + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_base + kv_off, mask=kv_mask, other=0.0)
    else:  # the hot loop: whole blocks, unmasked (widest vector loads)
        k = tl.load(k_base + kv_off)
        v = tl.load(v_base + kv_off)
    # -- scores: q @ k^T in fp32 on the tensor cores --------------------------------------------
    if IEEE:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    s = _scores_log2(qk, SCALE_LOG2, SOFTCAP)
    if HAS_BIAS:
        if BIAS_N:
            b = tl.load(b_base + cols, mask=cols < key_end, other=0.0).to(tl.float32)[None, :]
        else:
            b = tl.load(b_base).to(tl.float32)
        s += tl.where(b < -2.0e38, b, b * 1.4426950408889634)  # finfo.min stays finite
    if MASKED:
        ok = cols[None, :] < key_end
        if CAUSAL:
            ok = ok & (cols[None, :] <= diag[:, None])
        if WINDOW_RIGHT >= 0:
            ok = ok & (cols[None, :] <= diag[:, None] + WINDOW_RIGHT)
        if WINDOW_LEFT >= 0:
            ok = ok & (cols[None, :] >= diag[:, None] - WINDOW_LEFT)
        s = tl.where(ok, s, float("-inf"))
    m_ij = tl.maximum(m_i, tl.max(s, 1))
    # a row with no finite score so far: subtract 0, so exp2(-inf - 0) = 0, not NaN
    m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
    p = tl.math.exp2(s - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    # -- acc += p @ v (p rounded to the input dtype, as every FlashAttention does) ---------------
    if IEEE:
        acc = tl.dot(p, v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_ij


@triton.jit
def _key_blocks(acc, l_i, m_i, q, k_base, v_base, b_base, lo, hi, key_end, diag, offs_n, offs_d,
                SCALE_LOG2: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr,
                WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr,
                BIAS_N: tl.constexpr, IEEE: tl.constexpr):
    """Stream the key blocks [lo, hi) (lo a multiple of BLOCK_N) into (acc, l_i, m_i)."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        acc, l_i, m_i = _key_block(
            acc, l_i, m_i, q, k_base, v_base, b_base, start_n, key_end, diag, offs_n, offs_d,
            SCALE_LOG2, HEAD_DIM, HEAD_DIM_PAD, MASKED, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP,
            HAS_BIAS, BIAS_N, IEEE)
    return acc, l_i, m_i


@triton.jit
def _visible_keys(start, end, Sq, causal_off, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                  WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr):
    """The split [start, end)'s key blocks as (lo, full_lo, full_hi, hi): masked left edge
    [lo, full_lo), blocks every query row sees whole [full_lo, full_hi), masked right edge
    [full_hi, hi). Bounds over all Sq query rows (row i sees keys up to i + off): with Sq <= 16 the
    masked edges are a block or two."""
    lo = start
    hi = end
    full_lo = start  # from here on, no row's left window limit cuts a block
    full_end = end   # below this, no row's right limit (causal, window, the split's end) cuts one
    if WINDOW_LEFT >= 0:
        lo = tl.maximum(lo, causal_off - WINDOW_LEFT)
        full_lo = tl.maximum(full_lo, causal_off + Sq - 1 - WINDOW_LEFT)
    if CAUSAL:
        hi = tl.minimum(hi, causal_off + Sq)
        full_end = tl.minimum(full_end, causal_off + 1)
    if WINDOW_RIGHT >= 0:
        hi = tl.minimum(hi, causal_off + Sq + WINDOW_RIGHT)
        full_end = tl.minimum(full_end, causal_off + 1 + WINDOW_RIGHT)
    lo = start + (tl.maximum(lo - start, 0) // BLOCK_N) * BLOCK_N
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(start + tl.cdiv(tl.maximum(full_lo - start, 0), BLOCK_N) * BLOCK_N, lo), hi)
    full_hi = tl.minimum(tl.maximum(start + (tl.maximum(full_end - start, 0) // BLOCK_N) * BLOCK_N, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _combine_partials(Part, RowMax, RowSum, Out, row0, n_rows, n_split,
                      HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, ROWS: tl.constexpr,
                      COMBINE_SPLITS: tl.constexpr):
    """Rows [row0, row0 + n_rows) of o from their n_split partials: o = sum_s 2^(m_s - M*) acc_s /
    sum_s 2^(m_s - M*) l_s, M* = max_s m_s, 0 where no split saw a key. A step loads a [ROWS,
    COMBINE_SPLITS, D] tile (its loads all in flight at once) and merges it into a running max,
    as the online softmax does. The loads are ``.cg``: the other programs' partials come from L2,
    never from a line this SM's L1 kept."""
    offs_r = tl.arange(0, ROWS)
    offs_s = tl.arange(0, COMBINE_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    for r0 in range(0, n_rows, ROWS):
        r_ok = r0 + offs_r < n_rows
        rows = (row0 + r0 + offs_r).to(tl.int64)
        m_run = tl.zeros([ROWS], dtype=tl.float32) - float("inf")
        l_run = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM_PAD], dtype=tl.float32)
        for s0 in range(0, n_split, COMBINE_SPLITS):
            ok = r_ok[:, None] & (s0 + offs_s < n_split)[None, :]
            slot = rows[:, None] * n_split + (s0 + offs_s)[None, :]
            m = tl.load(RowMax + slot, mask=ok, other=float("-inf"), cache_modifier=".cg")
            l = tl.load(RowSum + slot, mask=ok, other=0.0, cache_modifier=".cg")
            part = tl.load(Part + slot[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                           mask=ok[:, :, None] & d_ok[None, None, :], other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m_run, tl.max(m, 1))
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: weights 0, not NaN
            w = tl.math.exp2(m - m_sub[:, None])
            alpha = tl.math.exp2(m_run - m_sub)
            l_run = l_run * alpha + tl.sum(w * l, 1)
            acc = acc * alpha[:, None] + tl.sum(part * w[:, :, None], 1)
            m_run = m_new
        o = acc / tl.where(l_run == 0.0, 1.0, l_run)[:, None]
        tl.store(Out + rows[:, None] * HEAD_DIM + offs_d[None, :], o.to(Out.dtype.element_ty),
                 mask=r_ok[:, None] & d_ok[None, :])


@triton.jit
def _decode_split_kernel(
        Q, K, V, Bias, H, Hkv, Sq, Sk, Part, RowMax, RowSum, Count, Out,
        SCALE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_KEYS: tl.constexpr,
        CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_B: tl.constexpr, BIAS_N: tl.constexpr,
        WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
        DIRECT: tl.constexpr = False, COMBINE_ROWS: tl.constexpr = 4, COMBINE_SPLITS: tl.constexpr = 16):
    # -- which program: the row block fastest (the programs of one split share its K/V in L2),
    #    then the split, then (b, kv head) --------------------------------------------------------
    if DIRECT:  # one split of every key (the "direct" kernel): o is written here, no combine
        n_split = 1
    else:
        n_split = tl.cdiv(Sk, SPLIT_KEYS)
    rows_per_kv = (H // Hkv) * Sq  # M: the packed rows (g, i) of one kv head
    num_mb = tl.cdiv(rows_per_kv, BLOCK_M)
    pid = tl.program_id(0)
    mb = pid % num_mb
    split = (pid // num_mb) % n_split
    bk = pid // (num_mb * n_split)  # b * Hkv + kv head
    off_b = bk // Hkv
    # int64 bases (B * H * S * D and the partials may pass 2**31); offsets inside stay int32
    q_base = Q + bk.to(tl.int64) * rows_per_kv * HEAD_DIM
    k_base = K + bk.to(tl.int64) * Sk * HEAD_DIM
    v_base = V + bk.to(tl.int64) * Sk * HEAD_DIM
    b_base = Bias
    if HAS_BIAS:
        b_base = Bias + off_b.to(tl.int64) * BIAS_B * (Sk if BIAS_N else 1)

    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < rows_per_kv
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_base + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=q_mask, other=0.0)
    causal_off = Sk - Sq
    diag = rows % Sq + causal_off  # the last key query row i may see (causal)

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    SCALE_LOG2: tl.constexpr = SCALE * 1.4426950408889634
    IEEE: tl.constexpr = Q.dtype.element_ty == tl.float32

    if DIRECT:
        start = 0
        end = Sk
    else:
        start = split * SPLIT_KEYS
        end = tl.minimum(start + SPLIT_KEYS, Sk)
    lo, full_lo, full_hi, hi = _visible_keys(start, end, Sq, causal_off, BLOCK_N, CAUSAL,
                                             WINDOW_LEFT, WINDOW_RIGHT)
    acc, l_i, m_i = _key_blocks(
        acc, l_i, m_i, q, k_base, v_base, b_base, lo, full_lo, end, diag, offs_n, offs_d,
        SCALE_LOG2, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, True, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP,
        HAS_BIAS, BIAS_N, IEEE)
    acc, l_i, m_i = _key_blocks(
        acc, l_i, m_i, q, k_base, v_base, b_base, full_lo, full_hi, end, diag, offs_n, offs_d,
        SCALE_LOG2, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, False, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP,
        HAS_BIAS, BIAS_N, IEEE)
    acc, l_i, m_i = _key_blocks(
        acc, l_i, m_i, q, k_base, v_base, b_base, full_hi, hi, end, diag, offs_n, offs_d,
        SCALE_LOG2, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, True, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP,
        HAS_BIAS, BIAS_N, IEEE)

    if DIRECT:
        # -- o itself: packed row r of kv head bk is row bk * M + r of o [B, H, Sq, D], as of q ---
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a row with no visible key: 0
        o_rows = bk.to(tl.int64) * rows_per_kv + rows
        tl.store(Out + o_rows[:, None] * HEAD_DIM + offs_d[None, :], o.to(Out.dtype.element_ty), mask=q_mask)
    else:
        # -- this split's partials: row R = bk * M + r, split s at R * n_split + s ----------------
        slot = (bk.to(tl.int64) * rows_per_kv + rows) * n_split + split
        tl.store(Part + slot[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=q_mask)
        tl.store(RowMax + slot, m_i, mask=row_ok)
        tl.store(RowSum + slot, l_i, mask=row_ok)
        # -- the splits of this (b, kv head, row block) count themselves in; the last one in
        #    combines them all ----------------------------------------------------------------
        tl.debug_barrier()  # every thread's partials are stored before thread 0 releases them
        group = bk * num_mb + mb
        arrived = tl.atomic_add(Count + group, 1, sem="acq_rel", scope="gpu")
        if arrived == n_split - 1:
            tl.atomic_xchg(Count + group, 0, sem="relaxed", scope="gpu")  # the state is left zero
            row0 = bk * rows_per_kv + mb * BLOCK_M
            n_rows = tl.minimum(rows_per_kv - mb * BLOCK_M, BLOCK_M)
            _combine_partials(Part, RowMax, RowSum, Out, row0, n_rows, n_split, HEAD_DIM, HEAD_DIM_PAD,
                              COMBINE_ROWS, COMBINE_SPLITS)
