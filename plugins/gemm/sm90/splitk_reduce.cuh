// kernel_sm90.cu, split-K (SPLIT_K > 1): the partial tiles of the work units, and the kernel that
// adds them and applies the epilogue.
//
// Workspace: SPLIT_K planes of [M, N] fp32, plane s the sum over split s's k-blocks; every element
// of rows < M is written by exactly one unit, so nothing needs to be zeroed first. The planes stay
// in L2 between the two kernels (132 units x 64 KB at most: launch_sm90.SPLIT_K_WORKSPACE).

#if SPLIT_K > 1
// A warpgroup's 128 x 128 accumulators (two m64n128 slabs; epilogue.cuh has the fragment layout)
// to its partial tile: 8-byte stores, each warp instruction 8 rows x 32 contiguous bytes (whole
// sectors); rows past M are skipped.
__device__ __forceinline__ void store_partial(const float (&d)[128], float* plane, int M, int row0, int col0) {
    const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
#pragma unroll
    for (int sl = 0; sl < SLABS; ++sl) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + 64 * sl + 16 * warp + (lane >> 2) + 8 * h;
            if (row >= M) continue;
            float* p = plane + (long long)row * N_DIM + col0 + 2 * (lane & 3);
#pragma unroll
            for (int j = 0; j < SLAB_N / 8; ++j) {
                const int i = 64 * sl + 4 * j + 2 * h;
                *reinterpret_cast<float2*>(p + 8 * j) = make_float2(d[i], d[i + 1]);
            }
        }
    }
}

// 16 bytes of a plane, read once (evict-first: .cs)
__device__ __forceinline__ float4 load_stream(const float* p) {
    float4 v;
    asm volatile("ld.global.cs.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}

#define REDUCE_THREADS 256
#define REDUCE_CHUNKS (N_DIM / 8)  // 8-column chunks of a row (N is a multiple of 128)

// y = act(alpha sum_s P[s] + bias [+ residual]) [+ residual], one 8-column chunk (16 bytes of y)
// per thread; the planes are added in split order, so the result does not depend on timing.
extern "C" __global__ void __launch_bounds__(REDUCE_THREADS) gemm_sm90_splitk_reduce(
    const float* __restrict__ P,
#if BIAS_MODE
    const u16* __restrict__ bias,
#endif
#if RESIDUAL_MODE
    const u16* __restrict__ residual,
#endif
    int M, u16* __restrict__ Y) {
#if !BIAS_MODE
    const u16* bias = nullptr;
#endif
#if !RESIDUAL_MODE
    const u16* residual = nullptr;
#endif
    const long long q = (long long)blockIdx.x * REDUCE_THREADS + threadIdx.x;
    if (q >= (long long)M * REDUCE_CHUNKS) return;
    const int row = (int)(q / REDUCE_CHUNKS), col = (int)(q % REDUCE_CHUNKS) * 8;
    const long long at = (long long)row * N_DIM + col, plane = (long long)M * N_DIM;
    float v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = 0.f;
#pragma unroll
    for (int s = 0; s < SPLIT_K; ++s) {
        const float4 a = load_stream(P + s * plane + at), b = load_stream(P + s * plane + at + 4);
        v[0] += a.x; v[1] += a.y; v[2] += a.z; v[3] += a.w;
        v[4] += b.x; v[5] += b.y; v[6] += b.z; v[7] += b.w;
    }
    u32 out[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const int c = col + 2 * e;
        out[e] = epilogue_pair(v[2 * e], v[2 * e + 1], bias_pair(bias, c), residual_pair(residual, row, c));
    }
    *reinterpret_cast<uint4*>(Y + at) = make_uint4(out[0], out[1], out[2], out[3]);
}
#endif
