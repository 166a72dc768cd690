// The I/O element type of the norm kernels and its conversions to and from FP32, chosen by
// OPTFUSE_DTYPE (0 fp32, 1 fp16, 2 bf16). Inline PTX instead of cuda_fp16.h / cuda_bf16.h, so
// NVRTC compiles the kernels without any CUDA headers. Included by plugins/*/kernel*.cu (the
// kernel build inlines it: optfuse.kernels.artifact.KernelSource.source_text).

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
