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
// key-padding row and whether it is pure, by the producer warpgroup (ptid = its thread, 0..127;
// red: 12 ints of shared memory; named barrier 15): (Sk, -1) when every key is masked. Called once
// per batch change of the CTA's tiles; the consumers get the tile's blocks from the producer
// (kernel_sm90.cu, KEYPAD_SLOTS). Eight independent loads per thread in flight: a row of 1024 keys
// costs one L2 round trip, not 32.
#define LIVE_BARRIER() asm volatile("bar.sync 15, 128;" ::: "memory")
__device__ __forceinline__ KeyLive live_key_range(const void* bias, long long row, int Sk, int ptid, volatile int* red) {
    int f = Sk, l = -1;
#pragma unroll 1
    for (int c0 = 0; c0 < Sk; c0 += 128 * 8) {
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int c = c0 + 128 * u + ptid;
            if (c < Sk && !(bias_to_float(bias, row + c) <= KEYPAD_MASKED)) {
                f = min(f, c);
                l = max(l, c);
            }
        }
    }
    f = __reduce_min_sync(0xffffffffu, f);
    l = __reduce_max_sync(0xffffffffu, l);
    const int w = ptid / 32;
    if (ptid % 32 == 0) red[w] = f, red[4 + w] = l;
    LIVE_BARRIER();
    KeyLive live;
    live.first = min(min(red[0], red[1]), min(red[2], red[3]));
    live.last = max(max(red[4], red[5]), max(red[6], red[7]));
    bool nonzero = false;
#pragma unroll 1
    for (int c0 = live.first; c0 <= live.last; c0 += 128 * 8) {
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int c = c0 + 128 * u + ptid;
            if (c <= live.last) nonzero |= bias_to_float(bias, row + c) != 0.f;
        }
    }
    nonzero = __any_sync(0xffffffffu, nonzero);
    LIVE_BARRIER();  // red[0..7] read by all before the next call rewrites them
    if (ptid % 32 == 0) red[8 + w] = nonzero;
    LIVE_BARRIER();
    live.pure = !(red[8] | red[9] | red[10] | red[11]);
    return live;
}

// Layouts: the persistent CTAs take contiguous ranges of tiles of equal cost (the blocks a tile
// lists + LAYOUT_TILE_COST for its Q load, first block and epilogue), in the order bh-major,
// query block fastest: a random layout's tiles differ in cost, and the round-robin order left the
// CTA with the most work 17 % (10 % density) above the mean. Warp 0 of each CTA finds its range
// with prefix sums of the per-head costs (shared memory, one entry per head: at most
// MAX_LAYOUT_HEADS) and one search within a head's offsets row.
#define LAYOUT_TILE_COST 1
#define MAX_LAYOUT_HEADS 1024

struct LayoutCosts {
    const int* offsets;
    const int* head_prefix;  // [hl + 1]: cost of the heads before h (per-head layouts)
    long long per_batch;     // cost of one batch's tiles
    int H, BH, num_m;
};

// Cost of the tiles before the first tile of (b, h) = bh.
__device__ __forceinline__ long long cost_before_head(const LayoutCosts& c, int bh) {
    const int h = bh % c.H;
    const long long heads = LAYOUT_HEADS ? c.head_prefix[h] : (long long)h * c.head_prefix[1];
    return (long long)(bh / c.H) * c.per_batch + heads;
}

// The first tile whose preceding tiles cost >= target (all 32 lanes, the same target).
__device__ __forceinline__ int first_tile_at(const LayoutCosts& c, long long target) {
    int lo = 0, hi = c.BH;
    while (lo < hi) {  // the first head starting at or after target (shared memory only)
        const int mid = (lo + hi) >> 1;
        if (cost_before_head(c, mid) >= target) hi = mid;
        else lo = mid + 1;
    }
    if (lo == 0) return 0;
    const int bh = lo - 1;  // target falls inside head bh
    const long long rem = target - cost_before_head(c, bh);
    const int* row = c.offsets + (long long)(LAYOUT_HEADS ? bh % c.H : 0) * (c.num_m + 1);
    const int lane = threadIdx.x % 32;
    for (int m0 = 1; m0 <= c.num_m; m0 += 32) {  // the first query block mb >= 1 whose prefix reaches rem
        const int m = m0 + lane;
        const bool ok = m <= c.num_m && __ldg(row + m) + (long long)LAYOUT_TILE_COST * m >= rem;
        const unsigned hit = __ballot_sync(0xffffffffu, ok);
        if (hit) return bh * c.num_m + m0 + __ffs(hit) - 1;
    }
    return bh * c.num_m + c.num_m;  // unreachable: mb = num_m reaches the head's whole cost
}

// [range[0], range[1]): this CTA's tiles, by warp 0 (head_prefix: MAX_LAYOUT_HEADS + 1 ints).
__device__ __forceinline__ void layout_tile_range(const int* offsets, int H, int BH, int num_m, int ctas, int cta,
                                                  int* head_prefix, int* range) {
    const int lane = threadIdx.x % 32, hl = LAYOUT_HEADS ? H : 1;
    if (LAYOUT_HEADS && H > MAX_LAYOUT_HEADS) __trap();  // launch.py refuses such layouts
    int total = 0;
    for (int h0 = 0; h0 < hl; h0 += 32) {  // head costs, inclusive warp scan per 32 heads
        const int h = h0 + lane;
        int c = h < hl ? __ldg(offsets + (long long)h * (num_m + 1) + num_m) + LAYOUT_TILE_COST * num_m : 0;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const int n = __shfl_up_sync(0xffffffffu, c, d);
            if (lane >= d) c += n;
        }
        if (h < hl) head_prefix[h + 1] = total + c;
        total += __shfl_sync(0xffffffffu, c, 31);
    }
    if (lane == 0) head_prefix[0] = 0;
    __syncwarp();
    LayoutCosts c{offsets, head_prefix, LAYOUT_HEADS ? (long long)total : (long long)total * H, H, BH, num_m};
    const long long all = c.per_batch * (BH / H);
    const int begin = first_tile_at(c, all * cta / ctas);
    const int end = first_tile_at(c, all * (cta + 1) / ctas);
    if (lane == 0) range[0] = begin, range[1] = end;
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
