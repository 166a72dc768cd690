// E4M3 (float8e4m3fn) outputs of the norm kernels: y = saturate(round_half_even(v / scale)), ONNX
// QuantizeLinear's semantics (saturate to +-448, NaN stays NaN), with the IEEE division (__fdiv_rn)
// QuantizeLinear's float32 arithmetic does. cvt.rn.satfinite.e4m3x2.f32 (PTX ISA 7.8, sm_89+)
// converts two floats at a time; the launch code refuses the FP8 variant below sm_89. No CUDA headers
// (inline PTX), like io_dtype.cuh.

#pragma once

// N E4M3 bytes stored with one N-byte access (N = the elements of one input access: 1, 4 or 8).
template <int N>
struct alignas(N) E4M3Vec {
    unsigned char b[N];
};

// {lo, hi} -> two E4M3 bytes, lo in the low byte (the PTX puts its first source in the upper half).
__device__ __forceinline__ unsigned short e4m3x2(float lo, float hi) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

// v[0..N) / scale as N E4M3 bytes.
template <int N>
__device__ __forceinline__ E4M3Vec<N> quantize_e4m3(const float (&v)[N], float scale) {
    E4M3Vec<N> o;
    if constexpr (N == 1) {
        o.b[0] = (unsigned char)(e4m3x2(__fdiv_rn(v[0], scale), 0.f) & 0xffu);
    } else {
        static_assert(N % 2 == 0, "pairs of elements");
#pragma unroll
        for (int j = 0; j < N; j += 2) {
            const unsigned short h = e4m3x2(__fdiv_rn(v[j], scale), __fdiv_rn(v[j + 1], scale));
            o.b[j] = (unsigned char)(h & 0xffu);
            o.b[j + 1] = (unsigned char)(h >> 8);
        }
    }
    return o;
}
