// kernel_sm90.cu, the epilogue warps (EPILOGUE_WG): the consumers hand each finished tile over
// through shared memory and go straight on to the next tile's MMAs; warps 1-3 of the producer's
// warpgroup (its warp 0 issues the loads) apply bias, activation, gate and residual and write y
// while they run. (A fourth warpgroup would leave 128 registers a thread: too few to compile the
// m64n256 wgmma.) The tensor cores no longer wait
// for the epilogue's math, only for the hand-over (16 stmatrix per consumer thread).
//
// The hand-over tile: 128 rows x 256 columns of 16-bit values (64 KB), alpha * accumulator rounded
// once to the I/O type, as the unfused chain rounds the GEMM's output (fp16 with saturation to
// +-65504 where the activation is not the identity or ReLU, so that an overflow stays finite for
// GELU / SiLU, whose limit at -inf is 0). GatedGemm: columns 0-127 hold the gate, 128-255 the up
// values of the same outputs. Layout: boxes of 64 columns, 128 rows x 128 bytes each; in a box,
// row r's 16-byte chunk c at r * 128 + (c ^ r % 8) * 16, so that the 8 rows of one stmatrix and
// the 8 chunks of one row a reader takes hit different banks.

__device__ __forceinline__ u32 handover_offset(int row, int chunk) {
    return (chunk >> 3) * (BLOCK_M * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
}

// alpha * (a, b) as a packed pair of the I/O type, rounded once (see above).
__device__ __forceinline__ u32 handover_pair(float a, float b) {
    a *= ALPHA;
    b *= ALPHA;
#if OPTFUSE_DTYPE == 1 && ACTIVATION >= 2
    u32 r;
    asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
    return r;
#else
    return pack2(a, b);
#endif
}

// Consumer warpgroup c: its 64 x 256 accumulators into rows 64 c .. 64 c + 63 of the hand-over
// tile. Column group j, row half h of the m64n256 fragment is one 8 x 8 matrix in stmatrix's
// fragment layout (lane l: row l / 4, columns 2 (l % 4) + {0, 1}); one stmatrix.x4 stores
// groups j and j + 1, both halves, with lane t giving the row address of matrix t / 8.
__device__ __forceinline__ void handover_store(const float (&d)[128], u32 stage, int c) {
    const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
    const int q = lane >> 3;
    const int row = 64 * c + 16 * warp + 8 * (q & 1) + (lane & 7);
#pragma unroll
    for (int j = 0; j < 32; j += 2) {
        const u32 r0 = handover_pair(d[4 * j], d[4 * j + 1]);
        const u32 r1 = handover_pair(d[4 * j + 2], d[4 * j + 3]);
        const u32 r2 = handover_pair(d[4 * j + 4], d[4 * j + 5]);
        const u32 r3 = handover_pair(d[4 * j + 6], d[4 * j + 7]);
        asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
                     ::"r"(stage + handover_offset(row, j + (q >> 1))), "r"(r0), "r"(r1), "r"(r2), "r"(r3)
                     : "memory");
    }
}

__device__ __forceinline__ void unpack8(const uint4& v, float (&x)[8]) {
    x[0] = lo_f32(v.x); x[1] = hi_f32(v.x); x[2] = lo_f32(v.y); x[3] = hi_f32(v.y);
    x[4] = lo_f32(v.z); x[5] = hi_f32(v.z); x[6] = lo_f32(v.w); x[7] = hi_f32(v.w);
}

// A 16-byte store to global memory under a predicate. A C++ `if` around the store let the compiler
// sink each row's math into its branch, one row after another: 8 independent values to hide the
// SFU's and the shared loads' latency with one warp per scheduler. Predicated, the rows of a group
// interleave.
__device__ __forceinline__ void st_global_v4_if(bool p, void* ptr, const uint4& v) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %5, 0;\n@p st.global.v4.u32 [%0], {%1, %2, %3, %4};\n}\n"
                 ::"l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(static_cast<int>(p)) : "memory");
}

__device__ __forceinline__ uint4 ld_shared_v4(u32 addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
    return v;
}

// One tile's epilogue, by the three epilogue warps. GemmEpilogue: lane l takes the 8 columns of
// chunk l of a row (a warp writes one 512-byte row segment per step); GatedGemm: lanes 0-15 and
// 16-31 the 16 output chunks of two rows. Rows go in groups of ROWS_AT_ONCE steps, dealt to the
// warps in turn; a group's shared and residual loads are issued before its math, to cover the
// latency with one warp per scheduler.
#define ROWS_AT_ONCE 4
#define EPI_WARPS 3
__device__ __forceinline__ void epilogue_tile(u32 stage, u16* Y, const u16* bias, const u16* res, int M, int m0, int n0) {
    const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) - 1;  // epilogue warp 0..2
#if GATED
    const int chunk = lane & 15, row_step = 2, row_lane = lane >> 4;
#else
    const int chunk = lane, row_step = 1, row_lane = 0;
#endif
    const int col = n0 + 8 * chunk;
    const bool col_in = col < N_DIM;
#if HALF2_EPILOGUE
    u32 b2[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) b2[e] = col_in ? bias_word(bias, col + 2 * e) : 0u;
#else
    float b[8];
#pragma unroll
    for (int e = 0; e < 8; e += 2) {
        const float2 p = col_in ? bias_pair(bias, col + e) : make_float2(0.f, 0.f);
        b[e] = p.x;
        b[e + 1] = p.y;
    }
#endif
    (void)res;
#pragma unroll 1
    for (int r0 = warp * ROWS_AT_ONCE * row_step; r0 < BLOCK_M; r0 += EPI_WARPS * ROWS_AT_ONCE * row_step) {
        uint4 v[ROWS_AT_ONCE];
#if GATED
        uint4 u[ROWS_AT_ONCE];
#endif
#if RESIDUAL_MODE == 2
        uint4 rv[ROWS_AT_ONCE];
#endif
#pragma unroll
        for (int i = 0; i < ROWS_AT_ONCE; ++i) {
            const int rl = r0 + i * row_step + row_lane;
            v[i] = ld_shared_v4(stage + handover_offset(rl, chunk));
#if GATED
            u[i] = ld_shared_v4(stage + handover_offset(rl, chunk + 16));
#endif
#if RESIDUAL_MODE == 2
            const int row = m0 + rl;
            rv[i] = make_uint4(0u, 0u, 0u, 0u);
            if (row < M && col_in)
                rv[i] = __ldg(reinterpret_cast<const uint4*>(res + (long long)row * N_DIM + col));
#endif
        }
#pragma unroll
        for (int i = 0; i < ROWS_AT_ONCE; ++i) {
            const int row = m0 + r0 + i * row_step + row_lane;
#if HALF2_EPILOGUE
            const u32 w[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
            u32 o2[4];
#if RESIDUAL_MODE == 2
            const u32 r2[4] = {rv[i].x, rv[i].y, rv[i].z, rv[i].w};
#else
            const u32 rs = RESIDUAL_MODE == 1 ? H2(static_cast<u32>(*res)) : 0u;
            const u32 r2[4] = {rs, rs, rs, rs};
#endif
#pragma unroll
            for (int e = 0; e < 4; ++e) o2[e] = epilogue_h2(w[e], b2[e], r2[e]);
            const uint4 o = make_uint4(o2[0], o2[1], o2[2], o2[3]);
#else
            float x[8];
            unpack8(v[i], x);
#if GATED
            float g[8];
            unpack8(u[i], g);  // the up values
#pragma unroll
            for (int e = 0; e < 8; ++e) x[e] = activate<true>(x[e]) * g[e];
#else
            float r[8];
#if RESIDUAL_MODE == 2
            unpack8(rv[i], r);
#else
#pragma unroll
            for (int e = 0; e < 8; e += 2) {
                const float2 p = residual_pair(res, 0, 0);
                r[e] = p.x;
                r[e + 1] = p.y;
            }
#endif
#pragma unroll
            for (int e = 0; e < 8; e += 2) {
                // (no `+ 0` for an absent bias or residual: x + 0 is not x at -0, so it would cost an add)
                float y0 = x[e], y1 = x[e + 1];
#if BIAS_MODE != 0
                y0 += b[e];
                y1 += b[e + 1];
#endif
#if RESIDUAL_MODE != 0 && RESIDUAL_BEFORE
                y0 += r[e];
                y1 += r[e + 1];
#endif
                activate_pair<true>(y0, y1);
#if RESIDUAL_MODE != 0 && !RESIDUAL_BEFORE
                y0 += r[e];
                y1 += r[e + 1];
#endif
                x[e] = y0;
                x[e + 1] = y1;
            }
#endif
            const uint4 o = make_uint4(pack2(x[0], x[1]), pack2(x[2], x[3]), pack2(x[4], x[5]), pack2(x[6], x[7]));
#endif
            st_global_v4_if(row < M && col_in, Y + (long long)row * N_DIM + col, o);
        }
    }
}
