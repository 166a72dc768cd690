// RMSNorm / SkipRMSNorm forward, CUDA C++ (compiled by NVRTC or nvcc through optfuse.kernels).
//
// y = x / sqrt(mean(x^2) + EPS) * gamma over the last axis; SkipRMSNorm first forms
// s = x + skip (rounded to the I/O dtype, written out as the second output) and normalizes s.
// Statistics in FP32 whatever the I/O dtype, so FP16 inputs up to 65504 cannot overflow.
//
// Specialized at compile time (-D): OPTFUSE_DTYPE (0 fp32, 1 fp16, 2 bf16), HIDDEN, EPS (a float
// literal), VEC (elements per access: 16 bytes / sizeof(T), or 1 when HIDDEN is not a multiple),
// TPR (threads per row: 1..32 = sub-warp/warp per row, shuffles only; 64..1024 = block per row)
// and RPB (rows per block; TPR * RPB threads per block). Each thread keeps its VPT vectors of the
// row in registers: one read of x (and skip), one write of y (and sum).
//
// Parameter order is TensorRT QDP's: inputs, int32 extra args (rows), outputs.
// No CUDA headers needed (fp16/bf16 conversions in inline PTX), so the nvrtc wheel alone builds it.

#ifndef OPTFUSE_DTYPE
#error "define OPTFUSE_DTYPE"
#endif

typedef unsigned short u16;

#if OPTFUSE_DTYPE == 0
typedef float T;
__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float from_f32(float v) { return v; }
#elif OPTFUSE_DTYPE == 1
typedef u16 T;
__device__ __forceinline__ float to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 from_f32(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#elif OPTFUSE_DTYPE == 2
typedef u16 T;
__device__ __forceinline__ float to_f32(u16 h) { return __uint_as_float(((unsigned int)h) << 16); }
__device__ __forceinline__ u16 from_f32(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#else
#error "OPTFUSE_DTYPE must be 0 (fp32), 1 (fp16) or 2 (bf16)"
#endif

template <int BYTES> struct RawOf;
template <> struct RawOf<16> { typedef uint4 type; };
template <> struct RawOf<4> { typedef unsigned int type; };
template <> struct RawOf<2> { typedef unsigned short type; };

constexpr int kVec = VEC;
constexpr int kHidden = HIDDEN;
constexpr int kNV = (kHidden + kVec - 1) / kVec;  // accesses per row (kHidden % kVec == 0)
constexpr int kTPR = TPR;
constexpr int kRPB = RPB;
constexpr int kThreads = kTPR * kRPB;
constexpr int kVPT = (kNV + kTPR - 1) / kTPR;  // accesses per thread
constexpr bool kFull = (kVPT * kTPR == kNV);
constexpr float kInvHidden = 1.0f / (float)kHidden;

static_assert(kVec == 1 || kHidden % kVec == 0, "vector path needs HIDDEN % VEC == 0");
static_assert(kTPR <= 32 || kRPB == 1, "block-per-row mode handles one row per block");
static_assert(kTPR <= 32 || kTPR % 32 == 0, "block-per-row mode needs whole warps");
static_assert((kTPR & (kTPR - 1)) == 0 || kTPR > 32, "sub-warp rows need a power-of-two width");
static_assert(kThreads <= 1024, "at most 1024 threads per block");

typedef typename RawOf<kVec * sizeof(T)>::type Raw;
union Pack {
    Raw raw;
    T v[kVec];
};

__device__ __forceinline__ float row_sum(float v) {
    if (kTPR <= 32) {
#pragma unroll
        for (int o = (kTPR < 32 ? kTPR : 32) / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o, kTPR < 32 ? kTPR : 32);
        return v;
    } else {
        __shared__ float part[32];
        __shared__ float total;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        if (lane == 0) part[warp] = v;
        __syncthreads();
        if (warp == 0) {
            float w = lane < kTPR / 32 ? part[lane] : 0.f;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) w += __shfl_xor_sync(0xffffffffu, w, o);
            if (lane == 0) total = w;
        }
        __syncthreads();
        return total;
    }
}

template <bool SKIP>
__device__ __forceinline__ void rms_norm_rows(const T* __restrict__ x, const T* __restrict__ skip,
                                              const T* __restrict__ gamma, int rows, T* __restrict__ y,
                                              T* __restrict__ sum) {
    const int t = threadIdx.x % kTPR;
    const long long row = (long long)blockIdx.x * kRPB + threadIdx.x / kTPR;
    const bool active = row < rows;  // inactive threads still take part in the block reduction
    const long long base = row * (long long)(kNV);

    float v[kVPT][kVec];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < kVPT; ++i) {
        const int idx = t + i * kTPR;
        if (active && (kFull || idx < kNV)) {
            Pack p;
            p.raw = __ldg(reinterpret_cast<const Raw*>(x) + base + idx);
            if (SKIP) {
                Pack q;
                q.raw = __ldg(reinterpret_cast<const Raw*>(skip) + base + idx);
#pragma unroll
                for (int j = 0; j < kVec; ++j) p.v[j] = from_f32(to_f32(p.v[j]) + to_f32(q.v[j]));
                reinterpret_cast<Raw*>(sum)[base + idx] = p.raw;
            }
#pragma unroll
            for (int j = 0; j < kVec; ++j) {
                v[i][j] = to_f32(p.v[j]);
                ss += v[i][j] * v[i][j];
            }
        } else {
#pragma unroll
            for (int j = 0; j < kVec; ++j) v[i][j] = 0.f;
        }
    }
    ss = row_sum(ss);
    const float inv = rsqrtf(ss * kInvHidden + (float)(EPS));
    if (!active) return;
#pragma unroll
    for (int i = 0; i < kVPT; ++i) {
        const int idx = t + i * kTPR;
        if (kFull || idx < kNV) {
            Pack g, o;
            g.raw = __ldg(reinterpret_cast<const Raw*>(gamma) + idx);
#pragma unroll
            for (int j = 0; j < kVec; ++j) o.v[j] = from_f32(v[i][j] * inv * to_f32(g.v[j]));
            reinterpret_cast<Raw*>(y)[base + idx] = o.raw;
        }
    }
}

// RMSNorm: inputs (x, gamma), extra (rows), outputs (y).
extern "C" __global__ void __launch_bounds__(kThreads)
rms_norm_fwd(const T* __restrict__ x, const T* __restrict__ gamma, int rows, T* __restrict__ y) {
    rms_norm_rows<false>(x, nullptr, gamma, rows, y, nullptr);
}

// SkipRMSNorm: inputs (x, skip, gamma), extra (rows), outputs (y, sum).
extern "C" __global__ void __launch_bounds__(kThreads)
skip_rms_norm_fwd(const T* __restrict__ x, const T* __restrict__ skip, const T* __restrict__ gamma, int rows,
                  T* __restrict__ y, T* __restrict__ sum) {
    rms_norm_rows<true>(x, skip, gamma, rows, y, sum);
}
