// LayerNorm / SkipLayerNorm forward for short rows, CUDA C++: one warp per row, no padding.
//
// Why a second kernel next to the Triton one (kernel.py): a Triton tile is a power of two wide,
// so a row of 768 elements occupies a 1024-wide tile (a quarter of the lanes and their loads
// masked off) -- the same tile Inductor generates, so at hidden 768 the Triton kernel could only
// tie torch.compile. Here a warp covers exactly the row's 16-byte accesses (768 fp16: 96 accesses,
// 3 per lane) and the statistics are warp shuffles only: no shared memory, no barrier.
//
// y = (s - mean(s)) / sqrt(var(s) + EPS) * gamma + beta over the last axis, s = x (LayerNorm) or
// s = x + skip rounded to the I/O dtype and written out as the second output (SkipLayerNorm).
// Statistics in FP32 from registers, two passes (mean, then the centred sum of squares), so FP16
// inputs up to 65504 cannot overflow and no cancellation as in E[x^2] - E[x]^2.
//
// Compile-time specialization (-D): OPTFUSE_DTYPE (0 fp32, 1 fp16, 2 bf16), HIDDEN (a multiple of
// 16 bytes of elements), EPS (a float literal), VPT (16-byte accesses per lane), RPB (rows, i.e.
// warps, per block). x / skip load through the read-only path (an L1/L2 evict_last priority,
// which the CUDA RMSNorm kernel gains from, measured no faster here: README "Tried").
// OPTFUSE_FP8_OUT 1: y is float8e4m3fn, saturate(round(y / y_scale)) from the FP32 value (never a
// 16-bit y rounded first), y_scale a float32 [1] input after beta (sm_89+: plugins/common/e4m3.cuh);
// the sum output stays in the I/O dtype.
// Parameter order is TensorRT QDP's: inputs, int32 extra args (rows), outputs.
// No CUDA headers needed (conversions in inline PTX), so the nvrtc wheel alone builds it.

#ifndef OPTFUSE_FP8_OUT
#define OPTFUSE_FP8_OUT 0
#endif

#include "../common/io_dtype.cuh"  // T, to_f32, from_f32
#include "../common/e4m3.cuh"      // E4M3Vec, quantize_e4m3 (used with OPTFUSE_FP8_OUT only)

constexpr int kVec = 16 / sizeof(T);               // elements per 16-byte access
constexpr int kNV = HIDDEN / kVec;                 // accesses per row
constexpr int kVPT = VPT;
constexpr int kRPB = RPB;
constexpr bool kFull = kVPT * 32 == kNV;           // every lane's every access is in the row
constexpr float kInvHidden = 1.0f / (float)HIDDEN;
static_assert(HIDDEN % kVec == 0, "HIDDEN must be a multiple of 16 bytes of elements");
static_assert(kVPT * 32 >= kNV && (kVPT - 1) * 32 < kNV, "VPT must be cdiv(accesses, 32)");
static_assert(kRPB >= 1 && kRPB * 32 <= 1024, "RPB in 1..32");

union Pack {
    uint4 raw;
    T v[kVec];
};

__device__ __forceinline__ uint4 load_x(const uint4* p) { return __ldg(p); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// A lane's access i, clamped into the row: loads are unconditional (a lane past the row's end
// re-reads its last access, a row past the end the last row; those values are never used), so
// all loads issue back to back instead of each waiting behind a select.
__device__ __forceinline__ int access(int lane, int i) {
    const int idx = lane + 32 * i;
    return (kFull || idx < kNV) ? idx : kNV - 1;
}
__device__ __forceinline__ bool valid(int lane, int i) { return kFull || lane + 32 * i < kNV; }

#if OPTFUSE_FP8_OUT
typedef unsigned char YT;  // y's element: E4M3 bytes
#else
typedef T YT;
#endif

template <bool SKIP>
__device__ __forceinline__ void layer_norm_row(const T* x_, const T* skip_, const T* gamma_, const T* beta_,
                                               const float* y_scale, int rows, YT* y_, T* sum_) {
    const uint4* __restrict__ x = reinterpret_cast<const uint4*>(x_);
    const uint4* __restrict__ skip = reinterpret_cast<const uint4*>(skip_);
    const uint4* __restrict__ gamma = reinterpret_cast<const uint4*>(gamma_);
    const uint4* __restrict__ beta = reinterpret_cast<const uint4*>(beta_);
    uint4* __restrict__ sum = reinterpret_cast<uint4*>(sum_);

    const int lane = threadIdx.x % 32;
    const long long row = (long long)blockIdx.x * kRPB + threadIdx.x / 32;
    if (row >= rows) return;  // warp-uniform: a row is one warp
    const long long base = row * kNV;
    const float ys = OPTFUSE_FP8_OUT ? __ldg(y_scale) : 1.f;

    // -- loads: the row (and skip), gamma and beta, all issued before any is used --
    Pack a[kVPT], k[kVPT], g[kVPT], b[kVPT];
#pragma unroll
    for (int i = 0; i < kVPT; ++i) {
        a[i].raw = load_x(x + base + access(lane, i));
        if (SKIP) k[i].raw = load_x(skip + base + access(lane, i));
    }
#pragma unroll
    for (int i = 0; i < kVPT; ++i) {
        g[i].raw = __ldg(gamma + access(lane, i));
        b[i].raw = __ldg(beta + access(lane, i));
    }
    // ptxas sinks read-only loads towards their first use, behind the reductions: one more L2
    // round trip on the row's critical path. A use that is never taken (rows is never negative)
    // before the row's first use keeps gamma's and beta's loads up here.
    if (rows < 0) {
#pragma unroll
        for (int i = 0; i < kVPT; ++i) a[i].raw = make_uint4(g[i].raw.x, b[i].raw.y, 0u, 0u);
    }
    if (SKIP) {
        // the residual sum, rounded to the I/O dtype as the unfused Add would; stored after all
        // loads (a store first would order every later load behind it: the pointers may alias)
#pragma unroll
        for (int i = 0; i < kVPT; ++i) {
#pragma unroll
            for (int j = 0; j < kVec; ++j) a[i].v[j] = from_f32(to_f32(a[i].v[j]) + to_f32(k[i].v[j]));
            if (valid(lane, i)) sum[base + lane + 32 * i] = a[i].raw;
        }
    }

    // -- statistics: mean, then the centred sum of squares (both from registers) --
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < kVPT; ++i)
        if (valid(lane, i))
#pragma unroll
            for (int j = 0; j < kVec; ++j) s += to_f32(a[i].v[j]);
    const float mean = warp_sum(s) * kInvHidden;
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < kVPT; ++i)
        if (valid(lane, i))
#pragma unroll
            for (int j = 0; j < kVec; ++j) {
                const float d = to_f32(a[i].v[j]) - mean;
                ss += d * d;
            }
    const float rstd = rsqrtf(warp_sum(ss) * kInvHidden + (float)(EPS));

    // -- normalize, scale, shift, store --
#pragma unroll
    for (int i = 0; i < kVPT; ++i) {
        if (!valid(lane, i)) continue;
        float o[kVec];
#pragma unroll
        for (int j = 0; j < kVec; ++j) o[j] = (to_f32(a[i].v[j]) - mean) * rstd * to_f32(g[i].v[j]) + to_f32(b[i].v[j]);
#if OPTFUSE_FP8_OUT
        reinterpret_cast<E4M3Vec<kVec>*>(y_)[base + lane + 32 * i] = quantize_e4m3<kVec>(o, ys);
#else
        Pack p;
#pragma unroll
        for (int j = 0; j < kVec; ++j) p.v[j] = from_f32(o[j]);
        reinterpret_cast<uint4*>(y_)[base + lane + 32 * i] = p.raw;
#endif
    }
}

#if OPTFUSE_FP8_OUT
// LayerNorm, FP8 y: inputs (x, gamma, beta, y_scale), extra (rows), outputs (y).
extern "C" __global__ void __launch_bounds__(RPB * 32)
layer_norm_warp_fp8_fwd(const T* __restrict__ x, const T* __restrict__ gamma, const T* __restrict__ beta,
                        const float* __restrict__ y_scale, int rows, YT* __restrict__ y) {
    layer_norm_row<false>(x, nullptr, gamma, beta, y_scale, rows, y, nullptr);
}

// SkipLayerNorm, FP8 y: inputs (x, skip, gamma, beta, y_scale), extra (rows), outputs (y, sum).
extern "C" __global__ void __launch_bounds__(RPB * 32)
skip_layer_norm_warp_fp8_fwd(const T* __restrict__ x, const T* __restrict__ skip, const T* __restrict__ gamma,
                             const T* __restrict__ beta, const float* __restrict__ y_scale, int rows,
                             YT* __restrict__ y, T* __restrict__ sum) {
    layer_norm_row<true>(x, skip, gamma, beta, y_scale, rows, y, sum);
}
#else
// LayerNorm: inputs (x, gamma, beta), extra (rows), outputs (y).
extern "C" __global__ void __launch_bounds__(RPB * 32)
layer_norm_warp_fwd(const T* __restrict__ x, const T* __restrict__ gamma, const T* __restrict__ beta, int rows,
                    T* __restrict__ y) {
    layer_norm_row<false>(x, nullptr, gamma, beta, nullptr, rows, y, nullptr);
}

// SkipLayerNorm: inputs (x, skip, gamma, beta), extra (rows), outputs (y, sum).
extern "C" __global__ void __launch_bounds__(RPB * 32)
skip_layer_norm_warp_fwd(const T* __restrict__ x, const T* __restrict__ skip, const T* __restrict__ gamma,
                         const T* __restrict__ beta, int rows, T* __restrict__ y, T* __restrict__ sum) {
    layer_norm_row<true>(x, skip, gamma, beta, nullptr, rows, y, sum);
}
#endif
