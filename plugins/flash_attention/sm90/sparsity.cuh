// kernel_sm90.cu, which key blocks a tile visits: the causal / window limits of its rows, the live
// range of a key-padding bias, a block layout (BSR); the masks of the partial blocks and the
// soft-cap. The producer and the consumers call the same functions on the same arguments, so they
// agree on every tile's block list without talking to each other.
//
// Visibility (spec.yaml; off = Sk - Sq): key j is visible to row i iff
//     j <= i + off (CAUSAL),  j >= i + off - WINDOW_LEFT,  j <= i + off + WINDOW_RIGHT,  j < Sk
// (the window limits only when defined), and for BlockSparseAttention its block is listed.

#ifndef WINDOW_LEFT
#define WINDOW_LEFT -1
#endif
#ifndef WINDOW_RIGHT
#define WINDOW_RIGHT -1
#endif
#ifndef LAYOUT
#define LAYOUT 0
#endif
#ifndef LAYOUT_HEADS
#define LAYOUT_HEADS 0
#endif
// A key-padding bias at or below this masks its key: it adds exactly 0 to any row that also sees
// an unmasked key (fp16 masks are finfo(float16).min = -65504).
#define KEYPAD_MASKED (BIAS_DTYPE == 1 ? -3.0e4f : -1.0e30f)
// Per-row lower key limits exist: a left window, or the first live key of a key-padding bias.
#define HAS_LOW (WINDOW_LEFT >= 0 || BIAS_MODE == 2)

// What a key-padding row holds: its live range [first, last] (first > last: no live key, or no
// key-padding bias) and whether every value in that range is exactly 0 (pure: HF's padding mask,
// 0 or finfo.min, with the padding outside the range).
struct KeyLive {
    int first, last;
    bool pure;
};

// The blocks one tile visits: blocks first .. first + n - 1, or (LAYOUT) list[0 .. n - 1]. A block
// kb needs the per-row mask unless clean_lo <= kb < clean_hi (no row's limit cuts it). bias: the
// tile adds the key bias; without it (no bias, or a pure key-padding row the tile was narrowed
// to) keys outside [key_lo, key_hi] are masked instead, and the tile runs the no-bias math.
struct KeyBlocks {
    int first, n, clean_lo, clean_hi, key_lo, key_hi;
    bool bias;
#if LAYOUT
    const int* list;
#endif
};

__device__ __forceinline__ int block_at(const KeyBlocks& r, int j) {
#if LAYOUT
    return __ldg(r.list + j);
#else
    return r.first + j;
#endif
}

// Every row's visible keys [row + off - WINDOW_LEFT, min(row + off (+ WINDOW_RIGHT), Sk - 1)], for
// the tile's rows m0 .. m0 + bm - 1 (those < Sq). live: the key-padding row of this batch. Keys
// outside its live range add exactly 0 to a row that sees a live key, so they are skipped when
// every row of the tile does (checking its first and last rows is enough: their windows bound
// the others'); a pure row then needs no bias at all, only the range's limits.
__device__ __forceinline__ KeyBlocks tile_blocks(int m0, int bm, int Sq, int Sk, int off, KeyLive live
#if LAYOUT
                                                 , const int* offsets, const int* indices, int nnz, int h
#endif
                                                 ) {
    const int first_row = m0, last_row = min(m0 + bm, Sq) - 1;
    int lo = 0, hi = Sk, clean_lo = 0, clean_hi = Sk;
    if (WINDOW_LEFT >= 0) {
        lo = max(first_row + off - WINDOW_LEFT, 0);
        clean_lo = max(last_row + off - WINDOW_LEFT, 0);
    }
    if (CAUSAL) {
        hi = min(hi, last_row + off + 1);
        clean_hi = min(clean_hi, first_row + off + 1);
    }
    if (WINDOW_RIGHT >= 0) {
        hi = min(hi, last_row + off + WINDOW_RIGHT + 1);
        clean_hi = min(clean_hi, first_row + off + WINDOW_RIGHT + 1);
    }
    KeyBlocks r;
    r.bias = BIAS_MODE == 2;
    r.key_lo = 0;
    r.key_hi = Sk - 1;
#if LAYOUT
    (void)live;
    const int lh = LAYOUT_HEADS ? h : 0, mb = m0 / BLOCK_N;
    const int* row = offsets + lh * ((Sq + BLOCK_N - 1) / BLOCK_N + 1) + mb;
    const int p0 = __ldg(row), p1 = __ldg(row + 1);
    r.first = 0;
    r.n = hi > lo ? p1 - p0 : 0;
    r.list = indices + (long long)lh * nnz + p0;
#else
    if (live.first <= live.last) {
        int top = Sk - 1, bottom = 0;  // the first row's last visible key, the last row's first
        if (CAUSAL) top = min(top, first_row + off);
        if (WINDOW_RIGHT >= 0) top = min(top, first_row + off + WINDOW_RIGHT);
        if (WINDOW_LEFT >= 0) bottom = last_row + off - WINDOW_LEFT;
        if (top >= live.first && bottom <= live.last) {
            lo = max(lo, live.first);
            hi = min(hi, live.last + 1);
            if (live.pure) {
                r.bias = false;
                r.key_lo = live.first;
                r.key_hi = live.last;
                clean_lo = max(clean_lo, live.first);
                clean_hi = min(clean_hi, live.last + 1);
            }
        }
    }
    r.first = lo / BLOCK_N;
    r.n = hi > lo ? (hi + BLOCK_N - 1) / BLOCK_N - r.first : 0;
#endif
    r.clean_lo = (clean_lo + BLOCK_N - 1) / BLOCK_N;
    r.clean_hi = max(clean_hi, 0) / BLOCK_N;
    return r;
}

// The live range (first, last key whose bias is above KEYPAD_MASKED; NaN counts as live) of one
// key-padding row and whether it is pure, by the producer warpgroup or its warps 1-3 (THREADS, t below;
// red: 24 ints of shared memory, the result in a slot of red[16..23] -- shared memory, not registers, holds
// it between tiles: the three-consumer producer has 32 registers): (Sk, -1)
// when every key is masked. One pass:
// the row is pure when the live keys fill [first, last] (their count) and are all 0. Called once
// per batch change of the CTA's tiles; the consumers get the tile's blocks from the producer
// (kernel_sm90.cu, KEYPAD_SLOTS). LIVE_UNROLL independent loads per thread in flight: a row of
// 1024 keys costs one L2 round trip.
#define LIVE_UNROLL 8
// THREADS: 128 (the producer warpgroup) or 96 (its warps 1-3 scanning the next tile's row ahead,
// kernel_sm90.cu KEYPAD_AHEAD), each on its named barrier (barriers.cuh); t: the thread among them. The
// result goes to red[16 + 4 slot ..]: two slots, the current row's and the one scanned ahead.
template <int THREADS>
__device__ __forceinline__ void live_barrier() {
    if constexpr (THREADS == 128) LIVE_SYNC_PRODUCER();
    else LIVE_SYNC_AHEAD();
}
template <int THREADS>
__device__ __forceinline__ void live_key_range(const void* bias, long long row, int Sk, int t, volatile int* red, int slot) {
    constexpr int WARPS = THREADS / 32;
    int f = Sk, l = -1, count = 0;
    bool nonzero = false;
#pragma unroll 1
    for (int c0 = 0; c0 < Sk; c0 += THREADS * LIVE_UNROLL) {
#pragma unroll
        for (int u = 0; u < LIVE_UNROLL; ++u) {
            const int c = c0 + THREADS * u + t;
            const float x = c < Sk ? bias_to_float(bias, row + c) : NEG_INF;
            if (!(x <= KEYPAD_MASKED)) {
                f = min(f, c);
                l = max(l, c);
                ++count;
                nonzero |= x != 0.f;
            }
        }
    }
    f = __reduce_min_sync(0xffffffffu, f);
    l = __reduce_max_sync(0xffffffffu, l);
    count = __reduce_add_sync(0xffffffffu, count);
    nonzero = __any_sync(0xffffffffu, nonzero);
    const int w = t / 32;
    if (t % 32 == 0) red[w] = f, red[4 + w] = l, red[8 + w] = count, red[12 + w] = nonzero;
    live_barrier<THREADS>();
    if (t == 0) {
        int first = red[0], last = red[4], live_keys = red[8], any_nonzero = red[12];
#pragma unroll
        for (int i = 1; i < WARPS; ++i)
            first = min(first, red[i]), last = max(last, red[4 + i]), live_keys += red[8 + i], any_nonzero |= red[12 + i];
        red[16 + 4 * slot] = first;
        red[17 + 4 * slot] = last;
        red[18 + 4 * slot] = live_keys == last - first + 1 && !any_nonzero;
    }
    live_barrier<THREADS>();  // the result is visible, and red[0..15] free for the next call
}

__device__ __forceinline__ KeyLive live_of(const volatile int* red, int slot) {
    KeyLive live;
    live.first = red[16 + 4 * slot];
    live.last = red[17 + 4 * slot];
    live.pure = red[18 + 4 * slot] != 0;
    return live;
}

// Scores of key block kv0 no row may see: keys past each row's upper limit (lim: Sk, causal,
// right window, a pure key-padding row's last live key) and before its lower limit (low: left
// window, the first live key). Limits relative to this
// thread's first column, so each test compares a register with the constant 8n + j.
__device__ __forceinline__ void apply_mask(float (&s)[64], int kv0, int lim0, int lim1, int low0, int low1, int q4) {
    const int rel0 = lim0 - kv0 - 2 * q4, rel1 = lim1 - kv0 - 2 * q4;
    const int lr0 = low0 - kv0 - 2 * q4, lr1 = low1 - kv0 - 2 * q4;
    (void)lr0, (void)lr1;
#pragma unroll
    for (int n = 0; n < 16; ++n)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            if (8 * n + j > rel0 || (HAS_LOW && 8 * n + j < lr0)) s[4 * n + j] = NEG_INF;
            if (8 * n + j > rel1 || (HAS_LOW && 8 * n + j < lr1)) s[4 * n + 2 + j] = NEG_INF;
        }
}

// Soft-capping (SOFTCAP_IN = scale / c, SOFTCAP_LOG2 = c log2(e)): the raw score x becomes
// c tanh(scale x / c) in log2 units, before the bias and the masks. tanh from ex2 and a division
// (tanh.approx's 2^-11 relative error would show in fp16 outputs).
#ifdef SOFTCAP_IN
__device__ __forceinline__ void apply_softcap(float (&s)[64]) {
#pragma unroll
    for (int i = 0; i < 64; ++i) {
        const float e = ex2(s[i] * (SOFTCAP_IN * 2.8853900817779268f));  // exp(2 scale x / c)
        s[i] = (1.0f - __fdividef(2.0f, e + 1.0f)) * SOFTCAP_LOG2;
    }
}
#else
__device__ __forceinline__ void apply_softcap(float (&)[64]) {}
#endif
