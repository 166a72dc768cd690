// RMSNorm / SkipRMSNorm forward, CUDA C++ (compiled by NVRTC or nvcc through optfuse.kernels).
//
// y = x / sqrt(mean(x^2) + EPS) * gamma over the last axis; SkipRMSNorm first forms
// s = x + skip (rounded to the I/O dtype, written out as the second output) and normalizes s.
// Statistics in FP32 whatever the I/O dtype, so FP16 inputs up to 65504 cannot overflow.
//
// Specialized at compile time (-D): OPTFUSE_DTYPE (0 fp32, 1 fp16, 2 bf16), HIDDEN, EPS (a float
// literal), VEC (elements per access: 16 bytes / sizeof(T), or 1 when HIDDEN is not a multiple),
// TPR (threads per row: 1..32 = sub-warp/warp per row, shuffles only; 64..1024 = block per row),
// RPB (rows per block; TPR * RPB threads per block), RELOAD (0: each thread keeps its accesses of
// x in registers across the reduction; 1: Inductor's two passes: x read for the sum of squares,
// then read again after the reduction with L1+L2 evict_first priority, meant to hit L1/L2, so x is
// not live across the barrier). x (and skip) are loaded with L1/L2 evict_last priority (Triton's
// eviction_policy="evict_last" form), gamma through the read-only path (ld.global.nc).
//
// Each thread keeps its VPT accesses of the row in registers (packed, as loaded; with RELOAD only
// until its sum of squares is formed): one read of x (and skip), one write of y (and sum); gamma
// is loaded together with the row, so no global load waits behind the reduction.
//
// OPTFUSE_FP8_OUT 1: y is float8e4m3fn, saturate(round(y / y_scale)) from the FP32 value (never a
// 16-bit y rounded first), y_scale a float32 [1] input after gamma (sm_89+: plugins/common/e4m3.cuh);
// the sum output stays in the I/O dtype.
// Parameter order is TensorRT QDP's: inputs, int32 extra args (rows), outputs.
// No CUDA headers needed (fp16/bf16 conversions in inline PTX), so the nvrtc wheel alone builds it.

#ifndef RELOAD
#define RELOAD 0
#endif
#ifndef OPTFUSE_FP8_OUT
#define OPTFUSE_FP8_OUT 0
#endif

#include "../common/io_dtype.cuh"  // T, to_f32, from_f32
#include "../common/e4m3.cuh"      // E4M3Vec, quantize_e4m3 (used with OPTFUSE_FP8_OUT only)

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
constexpr bool kBlockRow = kTPR > 32;  // a block per row: warp shuffles + one shared-memory step
constexpr int kWarps = kThreads / 32;
constexpr float kInvHidden = 1.0f / (float)kHidden;

static_assert(kVec == 1 || kHidden % kVec == 0, "vector path needs HIDDEN % VEC == 0");
static_assert(!kBlockRow || kRPB == 1, "block-per-row mode handles one row per block at a time");
static_assert(!kBlockRow || kTPR % 32 == 0, "block-per-row mode needs whole warps");
static_assert(kBlockRow || (kTPR & (kTPR - 1)) == 0, "sub-warp rows need a power-of-two width");
static_assert(kThreads <= 1024, "at most 1024 threads per block");
static_assert(RELOAD == 0 || RELOAD == 1, "RELOAD is 0 or 1");

typedef typename RawOf<kVec * sizeof(T)>::type Raw;
union Pack {
    Raw raw;
    T v[kVec];
};

// An L2 cache policy for the .L2::cache_hint accesses (sm_80+): 1 evict_first, 2 evict_last.
template <int KIND>
__device__ __forceinline__ unsigned long long l2_policy() {
    unsigned long long pol;
    if constexpr (KIND == 1) {
        asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    } else {
        asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
    }
    return pol;
}

// Sum over the threads of a row (block mode: warp shuffles, then one shared-memory step).
__device__ __forceinline__ float row_sum(float v) {
    if constexpr (!kBlockRow) {
#pragma unroll
        for (int o = kTPR / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o, kTPR);
        return v;
    } else {
        __shared__ float part[kWarps];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        if (lane == 0) part[warp] = v;
        __syncthreads();
        if constexpr ((kWarps & (kWarps - 1)) == 0) {
            // every lane group of kWarps lanes holds all partials: a kWarps-wide butterfly
            float w = part[lane & (kWarps - 1)];
#pragma unroll
            for (int o = kWarps / 2; o > 0; o >>= 1) w += __shfl_xor_sync(0xffffffffu, w, o);
            return w;
        } else {
            float w = lane < kWarps ? part[lane] : 0.f;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) w += __shfl_xor_sync(0xffffffffu, w, o);
            return w;
        }
    }
}

// Loads are unconditional, from clamped (valid) addresses: a row past the end reads the last
// row, an access past the row's end its last access; such values are never used (the sum of
// squares masks the accesses, the stores skip both). Selecting zero for them instead would make
// the compiler wait for each load right after issuing it (to merge the halves), so no further
// load could be issued before the row arrived.
__device__ __forceinline__ int clamp_access(int idx) { return (kFull || idx < kNV) ? idx : kNV - 1; }

// A 16-byte load with the PTX form OP and an L2 cache-policy operand.
#define OPTFUSE_LD4_POL(OP, POL)                                                                   \
    asm(OP ".v4.u32 {%0, %1, %2, %3}, [%4], %5;"                                                   \
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)                                               \
        : "l"(p), "l"(l2_policy<POL>()))

// x / skip: Triton's form of an eviction_policy="evict_last" load (L1 and L2 priority); narrower
// accesses through the read-only path.
template <typename R>
__device__ __forceinline__ R ldx(const R* p) {
    if constexpr (sizeof(R) != 16) {
        return __ldg(p);
    } else {
        R v;
        OPTFUSE_LD4_POL("ld.global.L1::evict_last.L2::cache_hint", 2);
        return v;
    }
}

// RELOAD: the second read of x / skip, after the reduction: Inductor's (L1+L2 evict_first).
template <typename R>
__device__ __forceinline__ R ldx2(const R* p) {
    if constexpr (sizeof(R) == 16) {
        R v;
        OPTFUSE_LD4_POL("ld.global.L1::evict_first.L2::cache_hint", 1);
        return v;
    } else {
        return __ldg(p);
    }
}
#undef OPTFUSE_LD4_POL

template <bool SKIP>
__device__ __forceinline__ void load_row(Raw (&a)[kVPT], Raw (&b)[kVPT], const Raw* __restrict__ x,
                                         const Raw* __restrict__ skip, long long row, int rows, int t) {
    const long long base = (row < rows ? row : (long long)rows - 1) * kNV;
#pragma unroll
    for (int i = 0; i < kVPT; ++i) {
        const int idx = clamp_access(t + i * kTPR);
        a[i] = ldx(x + base + idx);
        if (SKIP) b[i] = ldx(skip + base + idx);
    }
}

#if OPTFUSE_FP8_OUT
typedef unsigned char YT;  // y's element: E4M3 bytes
#else
typedef T YT;
#endif

template <bool SKIP>
__device__ __forceinline__ void rms_norm_rows(const T* __restrict__ x_, const T* __restrict__ skip_,
                                              const T* __restrict__ gamma_, const float* __restrict__ y_scale,
                                              int rows, YT* __restrict__ y_, T* __restrict__ sum_) {
    const Raw* __restrict__ x = reinterpret_cast<const Raw*>(x_);
    const Raw* __restrict__ skip = reinterpret_cast<const Raw*>(skip_);
    const Raw* __restrict__ gamma = reinterpret_cast<const Raw*>(gamma_);
    Raw* __restrict__ sum = reinterpret_cast<Raw*>(sum_);

    const int t = threadIdx.x % kTPR;
    const int sub = threadIdx.x / kTPR;
    const int groups = rows / kRPB + (rows % kRPB != 0);  // grid = cdiv(rows, RPB)
    const int grp = blockIdx.x;
    if (grp >= groups) return;  // block-uniform

    const long long row = (long long)grp * kRPB + sub;
    const bool active = row < rows;  // inactive threads (warp mode) still take part in the shuffles
    Raw a[kVPT], b[kVPT], g[kVPT];
    load_row<SKIP>(a, b, x, skip, row, rows, t);
#pragma unroll
    for (int i = 0; i < kVPT; ++i) g[i] = __ldg(gamma + clamp_access(t + i * kTPR));
    // ptxas sinks read-only loads towards their first use, which is behind the reduction (and
    // the exit of inactive rows): an L2 round trip more on every row's critical path. A use
    // that cannot be folded away (rows is never negative) before the row's first use ties
    // gamma's loads to right behind the row's.
    if (rows < 0) {
#pragma unroll
        for (int i = 0; i < kVPT; ++i) a[i] = g[i];
    }

    const long long base = row * kNV;
    const float ys = OPTFUSE_FP8_OUT ? __ldg(y_scale) : 1.f;
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < kVPT; ++i) {
        const int idx = t + i * kTPR;
        Pack p;
        p.raw = a[i];
        if (SKIP) {
            Pack q;
            q.raw = b[i];
#pragma unroll
            for (int j = 0; j < kVec; ++j) p.v[j] = from_f32(to_f32(p.v[j]) + to_f32(q.v[j]));
            a[i] = p.raw;
            if (active && (kFull || idx < kNV)) sum[base + idx] = p.raw;
        }
        if (kFull || idx < kNV) {
#pragma unroll
            for (int j = 0; j < kVec; ++j) {
                const float v = to_f32(p.v[j]);
                ss += v * v;
            }
        }
    }
    ss = row_sum(ss);
    const float inv = rsqrtf(ss * kInvHidden + (float)(EPS));
    if (active) {
#pragma unroll
        for (int i = 0; i < kVPT; ++i) {
            const int idx = t + i * kTPR;
            if (kFull || idx < kNV) {
                Pack p, q;
                if constexpr (RELOAD != 0) {  // x (and skip) read again: not live across the reduction
                    p.raw = ldx2(x + base + idx);
                    if (SKIP) {
                        Pack k;
                        k.raw = ldx2(skip + base + idx);
#pragma unroll
                        for (int j = 0; j < kVec; ++j) p.v[j] = from_f32(to_f32(p.v[j]) + to_f32(k.v[j]));
                    }
                } else {
                    p.raw = a[i];
                }
                q.raw = g[i];
                float o[kVec];
#pragma unroll
                for (int j = 0; j < kVec; ++j) o[j] = to_f32(p.v[j]) * inv * to_f32(q.v[j]);
#if OPTFUSE_FP8_OUT
                reinterpret_cast<E4M3Vec<kVec>*>(y_)[base + idx] = quantize_e4m3<kVec>(o, ys);
#else
                Pack r;
#pragma unroll
                for (int j = 0; j < kVec; ++j) r.v[j] = from_f32(o[j]);
                reinterpret_cast<Raw*>(y_)[base + idx] = r.raw;
#endif
            }
        }
    }
}

#if OPTFUSE_FP8_OUT
// RMSNorm, FP8 y: inputs (x, gamma, y_scale), extra (rows), outputs (y).
extern "C" __global__ void __launch_bounds__(kThreads)
rms_norm_fp8_fwd(const T* __restrict__ x, const T* __restrict__ gamma, const float* __restrict__ y_scale, int rows,
                 YT* __restrict__ y) {
    rms_norm_rows<false>(x, nullptr, gamma, y_scale, rows, y, nullptr);
}

// SkipRMSNorm, FP8 y: inputs (x, skip, gamma, y_scale), extra (rows), outputs (y, sum).
extern "C" __global__ void __launch_bounds__(kThreads)
skip_rms_norm_fp8_fwd(const T* __restrict__ x, const T* __restrict__ skip, const T* __restrict__ gamma,
                      const float* __restrict__ y_scale, int rows, YT* __restrict__ y, T* __restrict__ sum) {
    rms_norm_rows<true>(x, skip, gamma, y_scale, rows, y, sum);
}
#else
// RMSNorm: inputs (x, gamma), extra (rows), outputs (y).
extern "C" __global__ void __launch_bounds__(kThreads)
rms_norm_fwd(const T* __restrict__ x, const T* __restrict__ gamma, int rows, T* __restrict__ y) {
    rms_norm_rows<false>(x, nullptr, gamma, nullptr, rows, y, nullptr);
}

// SkipRMSNorm: inputs (x, skip, gamma), extra (rows), outputs (y, sum).
extern "C" __global__ void __launch_bounds__(kThreads)
skip_rms_norm_fwd(const T* __restrict__ x, const T* __restrict__ skip, const T* __restrict__ gamma, int rows,
                  T* __restrict__ y, T* __restrict__ sum) {
    rms_norm_rows<true>(x, skip, gamma, nullptr, rows, y, sum);
}
#endif
