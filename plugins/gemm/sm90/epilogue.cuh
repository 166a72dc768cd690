// kernel_sm90.cu, the epilogue: bias, alpha, activation, residual and the output cast applied to
// the fp32 accumulators in registers, staged through shared memory into 16-byte row stores.
//
// Accumulator layout of an m64nN wgmma (per warpgroup): warp w, lane l holds rows
// 16 w + l / 4 (+ 8) and, for each group j of 8 columns, columns 8 j + 2 (l % 4) (+ 1):
// registers d[4 j + 2 h + e] for row half h and column e.

// ACTIVATION: 0 none, 1 relu, 2 gelu_erf, 3 gelu_tanh, 4 quick_gelu, 5 silu, 6 sigmoid, 7 tanh,
// 8 relu2 (max(x, 0)^2) (the order of the spec's choices; launch_sm90.py passes the index).
// Sigmoids as x / (1 + e^-x) with the fast exponential and reciprocal: an exponential that
// overflows gives x * (1 / inf) = 0, the right limit.
//
// e^x and 1 / x are the SFU's approximations (ex2 / rcp .approx). With FTZ, denormals are flushed
// (.ftz): without, each costs a range test and two scaling multiplies more, a quarter of GELU's
// instructions; a flushed value (below 2^-126: e^-x past x = 87, 1 / (1 + e^-x) before x = -87)
// moves an activation by less than 2^-126 |x|. The epilogue warps (epilogue_wg.cuh), whose
// instruction rate bounds their schedule, take FTZ; so do the consumers of narrow and 128 x 192
// tiles (NARROW, TILE_N 192: 64 / 96 accumulator registers, no spills with any activation); the other
// consumers do not: with the shorter code ptxas schedules their epilogue wider and spills (16 bytes
// with gelu_tanh, 40 in FP8 with a scalar bias and silu).
#ifndef CONSUMER_FTZ
#define CONSUMER_FTZ (NARROW || BLOCK_N == 192)
#endif
template <bool FTZ>
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    if constexpr (FTZ) asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    else asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

template <bool FTZ>
__device__ __forceinline__ float rcp_approx(float x) {
    float y;
    if constexpr (FTZ) asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    else asm("rcp.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

template <bool FTZ = false>
__device__ __forceinline__ float activate(float x) {
#if ACTIVATION == 0
    return x;
#elif ACTIVATION == 1
    return fmaxf(x, 0.f);
#elif ACTIVATION == 2
    // x Phi(x), Phi(x) = (1 + erf(x / sqrt 2)) / 2, as x sigmoid(q(x)) with q an odd polynomial fitted to
    // Phi's logit, q(x) = x (c0 + c1 x^2 + c2 x^4), minimax over the GELU's absolute error: |error| <=
    // 2.6e-5 for every x in fp32 (below fp16's rounding of the pre-activation from |x| = 0.1 on, a
    // twentieth of it at |x| = 1). Nine instructions, two of them SFU, where Abramowitz & Stegun's erf
    // (1.5e-7) took 14-18 and erff more; branch-free, like the sigmoids. c2 < 0 turns q around past
    // |x| = 10, so x^2 is clamped at 36 (q(6) = 20: sigmoid 1 - 2e-9). The coefficients carry -log2(e).
    const float x2 = fminf(x * x, 36.f);
    const float q_log2e = x * fmaf(fmaf(0.00101426306f, x2, -0.106775724f), x2, -2.30112134f);
    return x * rcp_approx<FTZ>(1.f + exp2_approx<FTZ>(q_log2e));
#elif ACTIVATION == 3
    // 0.5 x (1 + tanh(u)) = x sigmoid(2 u), u = sqrt(2 / pi) (x + 0.044715 x^3); e^(-2u) = 2^(-2u log2 e),
    // -2u log2 e = x (c0 + c1 x^2) with the constants multiplied out (one multiply fewer)
    const float q_log2e = x * fmaf(-0.1029432395800235f, x * x, -2.302208198144325f);
    return x * rcp_approx<FTZ>(1.f + exp2_approx<FTZ>(q_log2e));
#elif ACTIVATION == 4
    return x * rcp_approx<FTZ>(1.f + exp2_approx<FTZ>(-2.4554669595930156f * x));  // e^(-1.702 x)
#elif ACTIVATION == 5
    return x * rcp_approx<FTZ>(1.f + exp2_approx<FTZ>(-1.4426950408889634f * x));
#elif ACTIVATION == 6
    return rcp_approx<FTZ>(1.f + exp2_approx<FTZ>(-1.4426950408889634f * x));
#elif ACTIVATION == 7
    return tanhf(x);
#elif ACTIVATION == 8
    const float r = fmaxf(x, 0.f);
    return r * r;
#else
#error "unknown ACTIVATION"
#endif
}

__device__ __forceinline__ float lo_f32(u32 v) {
#if OPTFUSE_DTYPE == 1
    float f;
    asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %1;\ncvt.f32.f16 %0, l;\n}\n" : "=f"(f) : "r"(v));
    return f;
#else
    return __uint_as_float(v << 16);
#endif
}

__device__ __forceinline__ float hi_f32(u32 v) {
#if OPTFUSE_DTYPE == 1
    float f;
    asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %1;\ncvt.f32.f16 %0, h;\n}\n" : "=f"(f) : "r"(v));
    return f;
#else
    return __uint_as_float(v & 0xFFFF0000u);
#endif
}

// bias (BIAS_MODE 0 none, 1 one value, 2 [N]) of the column pair at `col`
__device__ __forceinline__ float2 bias_pair(const u16* bias, int col) {
#if BIAS_MODE == 2
    const u32 b = *reinterpret_cast<const u32*>(bias + col);
    return make_float2(lo_f32(b), hi_f32(b));
#elif BIAS_MODE == 1
    const float b = lo_f32(*bias);
    return make_float2(b, b);
#else
    return make_float2(0.f, 0.f);
#endif
}

// residual (RESIDUAL_MODE 0 none, 1 one value, 2 [M, N]) of the column pair at (row, col)
__device__ __forceinline__ float2 residual_pair(const u16* res, long long row, int col) {
#if RESIDUAL_MODE == 2
    const u32 r = *reinterpret_cast<const u32*>(res + row * N_DIM + col);
    return make_float2(lo_f32(r), hi_f32(r));
#elif RESIDUAL_MODE == 1
    const float r = lo_f32(*res);
    return make_float2(r, r);
#else
    return make_float2(0.f, 0.f);
#endif
}

// FP8 (IN_FP8): the dequantization of an accumulator column, a_scale * the weight's scale (one
// value, or [N]: W_SCALE_MODE 1 / 2); GatedGemm's up weights have their own. 16-bit inputs: 1.
struct Scales {
    float a = 1.f;
    const float* w = nullptr;
    const float* w_up = nullptr;
};

__device__ __forceinline__ float2 weight_scale_pair(const float* w, int col) {
#if IN_FP8 && W_SCALE_MODE == 2
    return *reinterpret_cast<const float2*>(w + col);
#elif IN_FP8
    const float v = *w;
    return make_float2(v, v);
#else
    (void)w; (void)col;
    return make_float2(1.f, 1.f);
#endif
}

__device__ __forceinline__ float2 scale_pair(const Scales& sc, const float* w, int col) {
    const float2 ws = weight_scale_pair(w, col);
    return make_float2(sc.a * ws.x, sc.a * ws.y);
}

// GemmEpilogue with fp16 I/O and GELU (erf or tanh form): the epilogue computes on packed f16x2 pairs,
// alpha * accumulator rounded once to fp16 (as the unfused chain rounds the GEMM's output; saturating at
// +-65504), bias and residual added in fp16 as the chain adds them, the GELU as x sigmoid(2 z) =
// 0.5 x (1 + tanh(z)) with tanh.approx.f16x2. The consumers (epilogue_pair), the epilogue warps
// (epilogue_wg.cuh: their loop over 4 rows x 8 columns compiles to 7.9 instructions an element for
// bias + GELU erf, where the fp32 form takes 13.4) and the split-K reduce compute the same.
// The error, emulated on the CPU (each operation rounded to fp16, tanh correctly rounded; test_launch.py), over
// x in [-16, 16]: at most 0.76 of fp16's ulp of max(|y|, 1); below x = -2 it is absolute (0.5 |x| times
// tanh's rounding near -1), not relative to y. The other activations keep fp32: SiLU and QuickGELU, whose
// tanh stays short of -1 to x = -9 / -5.3, reached 1.5e-3 off (SiLU, y = -0.011; H100), the fp16 test
// bound; GatedGemm's up value multiplies the absolute error (H100, GELU tanh: -2.4e-3 for y = -1.1e-4).
#define HALF2_EPILOGUE (OPTFUSE_DTYPE == 1 && !IN_FP8 && !GATED && (ACTIVATION == 2 || ACTIVATION == 3))
// bf16 GemmEpilogue with GELU: bias, alpha and residual stay fp32, and only the GELU's gate
// g = 0.5 (1 + tanh(z)) is computed on f16x2 pairs (x rounded to fp16 with saturation, z as below;
// tanh.approx.f16x2 compiles to one MUFU.TANH.F16 an element, half the fp32 forms' ex2 + rcp), y = x g
// in fp32. The error before y's rounding, emulated on the CPU (test_launch.py) over x in [-16, 16]:
// at most 0.12 of bf16's ulp of max(|y|, 1) (1.3e-3 at x = 3.4, where g's fp16 rounding near 1 is it).
#define GATE_F16X2_EPILOGUE (OPTFUSE_DTYPE == 2 && !IN_FP8 && !GATED && (ACTIVATION == 2 || ACTIVATION == 3))
#if HALF2_EPILOGUE || GATE_F16X2_EPILOGUE
#define H2(bits) ((bits) * 0x10001u)  // one fp16 value (its bits) in both halves
__device__ __forceinline__ u32 h2_add(u32 a, u32 b) { u32 d; asm("add.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b)); return d; }
__device__ __forceinline__ u32 h2_mul(u32 a, u32 b) { u32 d; asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b)); return d; }
__device__ __forceinline__ u32 h2_fma(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
__device__ __forceinline__ u32 h2_min(u32 a, u32 b) { u32 d; asm("min.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b)); return d; }
// max.NaN: a NaN stays NaN (plain max returns the other operand), as in the fp32 form
__device__ __forceinline__ u32 h2_max_nan(u32 a, u32 b) { u32 d; asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b)); return d; }
__device__ __forceinline__ u32 h2_tanh(u32 a) { u32 d; asm("tanh.approx.f16x2 %0, %1;" : "=r"(d) : "r"(a)); return d; }

// GELU = 0.5 x (1 + tanh(z)): z of a finite pair
__device__ __forceinline__ u32 gelu_z_h2(u32 x) {
#if ACTIVATION == 2
    // GELU erf: z = x (z0 + z2 x^2 + z4 x^4), activate's q(x) times -ln(2) / 2 in fp16 (0.797363,
    // 0.0370178, -3.51429e-4); x^2 clamped at 36 as there
    const u32 x2 = h2_min(h2_mul(x, x), H2(0x5080u));
    const u32 z = h2_mul(x, h2_fma(h2_fma(H2(0x8DC2u), x2, H2(0x28BDu)), x2, H2(0x3A61u)));
#elif ACTIVATION == 3
    // GELU tanh: z = x (sqrt(2 / pi) + 0.044715 sqrt(2 / pi) x^2) (0.797852, 0.0356750); x^2 = inf past
    // |x| = 256 gives z = +-inf, tanh +-1
    const u32 z = h2_mul(x, h2_fma(H2(0x2891u), h2_mul(x, x), H2(0x3A62u)));
#endif
    return z;
}
#endif

#if HALF2_EPILOGUE
__device__ __forceinline__ u32 activate_h2(u32 x) {
    x = h2_max_nan(x, H2(0xFBFFu));  // -inf -> -65504, whose 0.5 x (1 + tanh(z)) is -0, not inf - inf
    const u32 hx = h2_mul(x, H2(0x3800u));  // 0.5 x
    return h2_fma(hx, h2_tanh(gelu_z_h2(x)), hx);
}

// y = act(x + bias [+ residual]) [+ residual] for one packed pair (absent terms not added: x + 0 is
// not x at -0)
__device__ __forceinline__ u32 epilogue_h2(u32 x, u32 b, u32 r) {
#if BIAS_MODE != 0
    x = h2_add(x, b);
#endif
#if RESIDUAL_MODE != 0 && RESIDUAL_BEFORE
    x = h2_add(x, r);
#endif
    x = activate_h2(x);
#if RESIDUAL_MODE != 0 && !RESIDUAL_BEFORE
    x = h2_add(x, r);
#endif
    (void)b; (void)r;
    return x;
}

// bias / scalar residual as packed pairs (BIAS_MODE / RESIDUAL_MODE 1: one value in both halves)
__device__ __forceinline__ u32 bias_word(const u16* bias, int col) {
#if BIAS_MODE == 2
    return *reinterpret_cast<const u32*>(bias + col);
#elif BIAS_MODE == 1
    return H2(static_cast<u32>(*bias));
#else
    (void)bias; (void)col;
    return 0u;
#endif
}
#endif

// act(v0), act(v1) in fp32 (GATE_F16X2_EPILOGUE: the gate on an f16x2 pair, above)
template <bool FTZ>
__device__ __forceinline__ void activate_pair(float& v0, float& v1) {
#if GATE_F16X2_EPILOGUE
    u32 x;
    asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;" : "=r"(x) : "f"(v1), "f"(v0));
    const u32 g = h2_fma(H2(0x3800u), h2_tanh(gelu_z_h2(x)), H2(0x3800u));  // 0.5 + 0.5 tanh(z)
    float g0, g1;
    asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}\n"
        : "=f"(g0), "=f"(g1) : "r"(g));
    v0 *= g0;  // -inf * 0 = NaN, as the fp32 form gives
    v1 *= g1;
#else
    v0 = activate<FTZ>(v0);
    v1 = activate<FTZ>(v1);
#endif
}

// y = act(alpha acc + bias [+ residual]) [+ residual] for one column pair (acc already dequantized)
__device__ __forceinline__ u32 epilogue_pair(float a0, float a1, float2 b, float2 r) {
#if HALF2_EPILOGUE
    u32 x;
    asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;" : "=r"(x) : "f"(ALPHA * a1), "f"(ALPHA * a0));
    return epilogue_h2(x, pack2(b.x, b.y), pack2(r.x, r.y));  // b, r: fp16 values, repacked exactly
#else
    float v0 = fmaf(ALPHA, a0, b.x), v1 = fmaf(ALPHA, a1, b.y);
#if RESIDUAL_MODE != 0 && RESIDUAL_BEFORE
    v0 += r.x;
    v1 += r.y;
#endif
    activate_pair<CONSUMER_FTZ>(v0, v1);
#if RESIDUAL_MODE != 0 && !RESIDUAL_BEFORE
    v0 += r.x;
    v1 += r.y;
#endif
    return pack2(v0, v1);
#endif
}

// The output pair (slab sl, column group j, row half h) of the fragment, packed; `g` / `u` are the
// pair's dequantization scales (the gate's and the up weights' for GatedGemm; 1 at 16 bits).
__device__ __forceinline__ u32 tile_value(const float (&d)[128], int sl, int j, int h, float2 b, float2 r,
                                          float2 g, float2 u) {
    const int i = 64 * sl + 4 * j + 2 * h;
#if GATED
    // columns j of the gate half, j + OUT_N / 8 of the up half (kernel_sm90.cu, "Tiles")
    (void)b; (void)r;
    const int k = 4 * (j + OUT_N / 8) + 2 * h;
    return pack2(activate(d[i] * g.x) * (d[k] * u.x), activate(d[i + 1] * g.y) * (d[k + 1] * u.y));
#else
    (void)u;
    return epilogue_pair(d[i] * g.x, d[i + 1] * g.y, b, r);
#endif
}

// The epilogue stage: EPI_ROWS rows x EPI_COLS columns of one warpgroup in TMA's 128-byte swizzle
// box layout (boxes of 64 columns, EPI_ROWS * 128 bytes apart; in a box, row r's 16-byte chunk c
// at r * 128 + (c ^ r % 8) * 16). The 8 rows one fragment store touches hit 32 different banks,
// and a residual arrives in this layout (by TMA, or by cp.async in the same layout).
__device__ __forceinline__ u32 epi_offset(int rl, int chunk) {
    return (chunk >> 3) * (EPI_ROWS * 128) + rl * 128 + (((chunk & 7) ^ (rl & 7)) << 4);
}

// Rows of the stage out to y: consecutive threads take consecutive 16-byte chunks of a row, so a
// warp writes whole row segments.
__device__ __forceinline__ void copy_out(u16* Y, int M, int row0, int col0, u32 stage) {
    const int tid = threadIdx.x & 127;
    constexpr int CHUNKS = EPI_COLS / 8;  // per row
#pragma unroll
    for (int it = 0; it < EPI_ROWS * CHUNKS / 128; ++it) {
        const int q = it * 128 + tid, rl = q / CHUNKS, ch = q % CHUNKS;
        const int row = row0 + rl, col = col0 + ch * 8;
        uint4 v;
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(stage + epi_offset(rl, ch)) : "memory");
        if (row < M && col < N_DIM) *reinterpret_cast<uint4*>(Y + (long long)row * N_DIM + col) = v;
    }
}

#if RESIDUAL_STAGED && !RESIDUAL_TMA
// Pingpong: the warpgroup copies its tile's residual into its stage with 16-byte cp.async when
// the tile starts (rows past M, columns past N zero-filled); store_tile waits for it.
__device__ __forceinline__ void stage_residual(const u16* res, int M, int row0, int col0, u32 stage) {
    const int tid = threadIdx.x & 127;
    const int named = threadIdx.x / 128;
    asm volatile("bar.sync %0, 128;" ::"r"(named) : "memory");  // the last tile's copy_out has read the stage
    constexpr int CHUNKS = EPI_COLS / 8;
#pragma unroll
    for (int it = 0; it < EPI_ROWS * CHUNKS / 128; ++it) {
        const int q = it * 128 + tid, rl = q / CHUNKS, ch = q % CHUNKS;
        const int row = row0 + rl, col = col0 + ch * 8;
        const bool ok = row < M && col < N_DIM;
        const u16* src = ok ? res + (long long)row * N_DIM + col : res;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(stage + epi_offset(rl, ch)), "l"(src), "r"(ok ? 16u : 0u)
                     : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}
#endif

// This warpgroup's tile (SLABS x 64 rows, OUT_N columns), EPI_COLS columns per pass, through its
// shared-memory stage. With a full residual the stage already holds the tile's residual (TMA:
// `res_full` completes when it has landed; pingpong: this warpgroup's cp.async): each output pair
// replaces its residual pair in place. RESIDUAL_IN_RING: the second pass runs the same way in the
// ring slot `ring_stage`, which holds the residual's last 128 columns once `ring_full` passes
// `ring_phase`. Otherwise bias (and a scalar residual) come from global memory, 8 column groups'
// worth loaded at once (one at a time, each load's latency would stall the warp before every pair).
__device__ __forceinline__ void store_tile(const float (&d)[128], u16* Y, const u16* bias, const u16* res,
                                           const Scales& sc, int M, int row0, int col0, u32 stage, u32 res_full,
                                           u32 res_phase, u32 ring_stage = 0, u32 ring_full = 0, u32 ring_phase = 0) {
    const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
    const int named = threadIdx.x / 128;  // one named barrier (1, 2) per consumer warpgroup
#if RESIDUAL_TMA
    mbar_wait(res_full, res_phase);
#else
    (void)res_full; (void)res_phase;
#if RESIDUAL_STAGED
    asm volatile("cp.async.wait_all;" ::: "memory");
    asm volatile("bar.sync %0, 128;" ::"r"(named) : "memory");  // every thread's residual chunks landed
#endif
#endif
#if !RESIDUAL_IN_RING
    (void)ring_stage; (void)ring_full; (void)ring_phase;
#endif
#pragma unroll
    for (int pass = 0; pass < OUT_N / EPI_COLS; ++pass) {
        if (!RESIDUAL_STAGED) asm volatile("bar.sync %0, 128;" ::"r"(named) : "memory");  // the last pass's reads are done
#if RESIDUAL_IN_RING
        if (pass == 1) {
            mbar_wait(ring_full, ring_phase);
            stage = ring_stage;
        }
#endif
#pragma unroll
        for (int sl = 0; sl < SLABS; ++sl) {
#pragma unroll
            for (int j8 = 0; j8 < EPI_COLS / 8; j8 += 8) {
                float2 b[8], r[8][2];
#if IN_FP8
                float2 g[8], u[8];
#else
                const float2 one = make_float2(1.f, 1.f);
#endif
#pragma unroll
                for (int jj = j8; jj < j8 + 8; ++jj) {
                    const int col = col0 + 8 * (pass * (EPI_COLS / 8) + jj) + 2 * (lane & 3);
                    const bool in = col < N_DIM;
                    b[jj - j8] = in ? bias_pair(bias, col) : make_float2(0.f, 0.f);
#if IN_FP8
                    g[jj - j8] = in ? scale_pair(sc, sc.w, col) : make_float2(0.f, 0.f);
                    u[jj - j8] = in && GATED ? scale_pair(sc, sc.w_up, col) : make_float2(0.f, 0.f);
#else
                    (void)sc;
#endif
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int rl = 64 * sl + warp * 16 + (lane >> 2) + 8 * h;
#if RESIDUAL_STAGED
                        u32 rv;
                        asm volatile("ld.shared.u32 %0, [%1];" : "=r"(rv) : "r"(stage + epi_offset(rl, jj) + (lane & 3) * 4) : "memory");
                        r[jj - j8][h] = make_float2(lo_f32(rv), hi_f32(rv));
#else
                        r[jj - j8][h] = in && row0 + rl < M ? residual_pair(res, row0 + rl, col) : make_float2(0.f, 0.f);
#endif
                    }
                }
#pragma unroll
                for (int jj = j8; jj < j8 + 8; ++jj) {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int rl = 64 * sl + warp * 16 + (lane >> 2) + 8 * h;
#if IN_FP8
                        const u32 v = tile_value(d, sl, pass * (EPI_COLS / 8) + jj, h, b[jj - j8], r[jj - j8][h], g[jj - j8], u[jj - j8]);
#else
                        const u32 v = tile_value(d, sl, pass * (EPI_COLS / 8) + jj, h, b[jj - j8], r[jj - j8][h], one, one);
#endif
                        asm volatile("st.shared.u32 [%0], %1;" ::"r"(stage + epi_offset(rl, jj) + (lane & 3) * 4), "r"(v) : "memory");
                    }
                }
            }
        }
        asm volatile("bar.sync %0, 128;" ::"r"(named) : "memory");
        copy_out(Y, M, row0, col0 + pass * EPI_COLS, stage);
    }
}
