// kernel_sm90.cu, the consumers' math between the MMAs: exp2, 16-bit packing, the key bias,
// the online softmax (plain and as one instruction stream) and the O rescale.

__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float bias_to_float(const void* p, long long i) {
#if BIAS_DTYPE == 0
    return ((const float*)p)[i];
#elif BIAS_DTYPE == 1
    float f;
    u16 h = ((const u16*)p)[i];
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    return __uint_as_float((u32)((const u16*)p)[i] << 16);
#endif
}

// S accumulator layout (m64n128, per thread): s[4n + 0..1] = row r0, cols 8n + 2q + {0,1};
// s[4n + 2..3] = row r0 + 8, same cols (q = lane % 4, r0 = 16 * warp + lane / 4).

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Part one of the online softmax of a block: the key bias (BIAS: the tile adds it), in place; the rows' block
// maxima and the new running maxima. sl2 turns a raw score into log2 units (SCORE_LOG2; FP8: times
// q_scale * k_scale, a run-time value). Sets m (the running maxima), ms (what the exponents subtract:
// m, or 0 while a row has seen no finite score, so that exp2 gives 0, not NaN) and alpha =
// exp2(m_old - m_new) per row (0 for the first block); returns whether O needs rescaling (false
// when the warp kept its maxima: alpha = 1, warp-uniform).
template <bool FIRST, bool BIAS>
__device__ __forceinline__ bool softmax_max(float (&s)[64], float& m0, float& m1, float& ms0, float& ms1,
                                            float& alpha0, float& alpha1, const float* bias_s, int q4, float sl2) {
    if (BIAS) {
        // key bias (already in log2 units): t = s * sl2 + b[col]
#pragma unroll
        for (int n = 0; n < 16; ++n) {
            const float2 b = *reinterpret_cast<const float2*>(bias_s + 8 * n + 2 * q4);
            s[4 * n + 0] = fmaf(s[4 * n + 0], sl2, b.x);
            s[4 * n + 1] = fmaf(s[4 * n + 1], sl2, b.y);
            s[4 * n + 2] = fmaf(s[4 * n + 2], sl2, b.x);
            s[4 * n + 3] = fmaf(s[4 * n + 3], sl2, b.y);
        }
    }
    const float sc = BIAS ? 1.0f : sl2;  // without a bias: folded into the exponent's FFMA
#if SOFTMAX_STREAM
    // four partial maxima per row: a chain of 8 dependent FMNMX instead of 32
    float x0[4], x1[4];
#pragma unroll
    for (int n = 0; n < 4; ++n) {
        x0[n] = fmaxf(s[4 * n + 0], s[4 * n + 1]);
        x1[n] = fmaxf(s[4 * n + 2], s[4 * n + 3]);
    }
#pragma unroll
    for (int n = 4; n < 16; ++n) {
        x0[n & 3] = fmaxf(x0[n & 3], fmaxf(s[4 * n + 0], s[4 * n + 1]));
        x1[n & 3] = fmaxf(x1[n & 3], fmaxf(s[4 * n + 2], s[4 * n + 3]));
    }
    float mx0 = fmaxf(fmaxf(x0[0], x0[1]), fmaxf(x0[2], x0[3]));
    float mx1 = fmaxf(fmaxf(x1[0], x1[1]), fmaxf(x1[2], x1[3]));
#else
    float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
    for (int n = 0; n < 16; ++n) {
        mx0 = fmaxf(mx0, fmaxf(s[4 * n + 0], s[4 * n + 1]));
        mx1 = fmaxf(mx1, fmaxf(s[4 * n + 2], s[4 * n + 3]));
    }
#endif
    mx0 = quad_max(mx0) * sc;
    mx1 = quad_max(mx1) * sc;
    bool keep = false;
    if (!FIRST)
        keep = __all_sync(0xffffffffu, mx0 <= m0 + LAZY_MARGIN && mx1 <= m1 + LAZY_MARGIN);
    const float mn0 = FIRST ? mx0 : keep ? m0 : fmaxf(m0, mx0);
    const float mn1 = FIRST ? mx1 : keep ? m1 : fmaxf(m1, mx1);
    ms0 = mn0 == NEG_INF ? 0.f : mn0;
    ms1 = mn1 == NEG_INF ? 0.f : mn1;
    alpha0 = FIRST ? 0.f : keep ? 1.f : ex2(m0 - ms0);
    alpha1 = FIRST ? 0.f : keep ? 1.f : ex2(m1 - ms1);
    m0 = mn0;
    m1 = mn1;
    return !keep;
}

// The exponentials of scores n-block n (in place): p = exp2(s * sc - ms); their per-thread row
// sums (unless ONES_SUM) added to sum0 / sum1.
template <bool BIAS>
__device__ __forceinline__ void exp_nblock(float (&s)[64], int n, float ms0, float ms1, float& sum0, float& sum1,
                                           float sl2) {
    const float sc = BIAS ? 1.0f : sl2;
    s[4 * n + 0] = ex2(fmaf(s[4 * n + 0], sc, -ms0));
    s[4 * n + 1] = ex2(fmaf(s[4 * n + 1], sc, -ms0));
    s[4 * n + 2] = ex2(fmaf(s[4 * n + 2], sc, -ms1));
    s[4 * n + 3] = ex2(fmaf(s[4 * n + 3], sc, -ms1));
    if (!ONES_SUM) {
        sum0 += s[4 * n + 0] + s[4 * n + 1];
        sum1 += s[4 * n + 2] + s[4 * n + 3];
    }
}

// The running row sums take a block's per-thread partial sums: l = l * alpha + sum (the quad
// reduction happens once, in the epilogue; ONES_SUM: the tensor cores sum, in O's extra columns).
template <bool FIRST>
__device__ __forceinline__ void add_row_sums(float& l0, float& l1, float sum0, float sum1, float a0, float a1) {
    if (!ONES_SUM) {
        l0 = FIRST ? sum0 : fmaf(l0, a0, sum0);
        l1 = FIRST ? sum1 : fmaf(l1, a1, sum1);
    }
}

// Online softmax of one block, in place: s becomes p = exp2(s * sl2 (+ bias) - m_new) (FP8: times
// 2^P_LOG2_SCALE = 448, taken off the exponent's subtrahend).
// Sets alpha = exp2(m_old - m_new) per row (0 while a row has seen no finite score); returns
// whether O needs rescaling (false when the warp kept its maxima: alpha = 1, warp-uniform).
template <bool FIRST, bool BIAS>
__device__ __forceinline__ bool softmax_block(float (&s)[64], float& m0, float& m1, float& l0, float& l1,
                                              float& alpha0, float& alpha1, const float* bias_s, int q4, float sl2) {
    float ms0, ms1;
    const bool resc = softmax_max<FIRST, BIAS>(s, m0, m1, ms0, ms1, alpha0, alpha1, bias_s, q4, sl2);
#if FP8
    ms0 -= P_LOG2_SCALE;
    ms1 -= P_LOG2_SCALE;
#endif
    float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
    for (int n = 0; n < 16; ++n) exp_nblock<BIAS>(s, n, ms0, ms1, sum0, sum1, sl2);
    add_row_sums<FIRST>(l0, l1, sum0, sum1, alpha0, alpha1);
    return resc;
}

// p (fp32, S layout) -> 16-bit A fragments of O += P V: k-step kk covers keys 16kk..16kk+15,
// i.e. n-blocks 2kk and 2kk+1 of S, which is exactly the wgmma A register layout.
__device__ __forceinline__ void pack_p(const float (&s)[64], u32 (&p)[8][4]) {
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
        p[kk][0] = pack2(s[8 * kk + 0], s[8 * kk + 1]);
        p[kk][1] = pack2(s[8 * kk + 2], s[8 * kk + 3]);
        p[kk][2] = pack2(s[8 * kk + 4], s[8 * kk + 5]);
        p[kk][3] = pack2(s[8 * kk + 6], s[8 * kk + 7]);
    }
}

#if FP8
// p (fp32, S layout, at most 448) -> E4M3 A fragments of O += P V. k-step kk covers keys
// 32kk..32kk+31 = S n-blocks 4kk..4kk+3; its fragment wants, in registers 0 / 2, row r0's keys
// 4q..4q+3 / 16+4q..16+4q+3 (1 / 3: row r0 + 8), while thread q of a quad holds keys 8n + 2q + {0, 1}
// of each n-block. Per row and k-step: quad lane q needs the 16-bit pairs of blocks n0 = q / 2 and
// n0 + 2 from lanes a = 2 (q % 2) and a + 1; two shuffles over permutations of the quad deliver
// them (the first reads lane {0, 2, 1, 3}[q], the second {1, 3, 0, 2}[q]: each source sends the
// pair of blocks its reader needs), then byte permutes put a's pair below b's.
__device__ __forceinline__ void pack_p_fp8(const float (&s)[64], u32 (&p)[P_KSTEPS][4], int q4) {
    const int quad = (threadIdx.x & 31) & ~3;
    const int src1 = quad | ((q4 & 1) << 1 | q4 >> 1), src2 = quad | ((q4 & 1) << 1 | q4 >> 1) ^ 1;
    const bool odd = q4 & 1, low = q4 < 2;  // low: the first read is from lane a
    // prmt selectors: {a.lo, b.lo} and {a.hi, b.hi} from (x = first read, y = second read)
    const u32 sel_lo = low ? 0x5410u : 0x1054u, sel_hi = low ? 0x7632u : 0x3276u;
#pragma unroll
    for (int kk = 0; kk < P_KSTEPS; ++kk) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {  // rows r0 (s[.. + 0, 1]) and r0 + 8 (s[.. + 2, 3])
            u32 h[4];
#pragma unroll
            for (int n = 0; n < 4; ++n) {
                const int i = 4 * (4 * kk + n) + 2 * half;
                h[n] = e4m3x2(s[i], s[i + 1]);
            }
            const u32 even_pair = h[0] | (h[2] << 16), odd_pair = h[1] | (h[3] << 16);  // blocks (0, 2), (1, 3)
            const u32 x = __shfl_sync(0xffffffffu, odd ? odd_pair : even_pair, src1);
            const u32 y = __shfl_sync(0xffffffffu, odd ? even_pair : odd_pair, src2);
            p[kk][half] = __byte_perm(x, y, sel_lo);
            p[kk][2 + half] = __byte_perm(x, y, sel_hi);
        }
    }
}
#endif

template <int N>
__device__ __forceinline__ void rescale(float (&o)[N], float a0, float a1) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
        o[4 * i + 0] *= a0;
        o[4 * i + 1] *= a0;
        o[4 * i + 2] *= a1;
        o[4 * i + 3] *= a1;
    }
}

#if SOFTMAX_STREAM
// Part two of the online softmax with the P registers free (SOFTMAX_STREAM): the exponentials in
// groups of 8 scores (the 16 keys of one P V k-step), each followed by its P packs.
template <bool FIRST, bool BIAS>
__device__ __forceinline__ void softmax_exp_pack(float (&s)[64], u32 (&p)[8][4], float ms0, float ms1,
                                                 float a0, float a1, float& l0, float& l1, float sl2) {
    float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
        // A data dependency on the previous group's first exponentials (ms + 0 * p = ms): without
        // it ptxas hoists all 64 FFMAs above the first MUFU op (README "Tried").
        if (kk > 0) {
            ms0 = fmaf(s[8 * kk - 8], 0.f, ms0);
            ms1 = fmaf(s[8 * kk - 6], 0.f, ms1);
        }
        exp_nblock<BIAS>(s, 2 * kk, ms0, ms1, sum0, sum1, sl2);
        exp_nblock<BIAS>(s, 2 * kk + 1, ms0, ms1, sum0, sum1, sl2);
        p[kk][0] = pack2(s[8 * kk + 0], s[8 * kk + 1]);
        p[kk][1] = pack2(s[8 * kk + 2], s[8 * kk + 3]);
        p[kk][2] = pack2(s[8 * kk + 4], s[8 * kk + 5]);
        p[kk][3] = pack2(s[8 * kk + 6], s[8 * kk + 7]);
    }
    add_row_sums<FIRST>(l0, l1, sum0, sum1, a0, a1);
}
#endif
