// kernel_sm90.cu, the mainloop's MMAs: the m64n256k16 (cooperative), m64n192k16 (cooperative on
// 128 x 192 tiles), m64n128k16 (pingpong, narrow tiles) and
// m64n128k32 E4M3 (cooperative with IN_FP8: each half of the tile's W rows) instructions, both
// operands K-major in shared memory (fences, waits, descriptors, the operand lists and the E4M3
// instruction itself: plugins/common/sm90.cuh).

// 128-byte swizzle, K-major: the descriptor of a tile of 8-row groups 1024 bytes apart.
__device__ __forceinline__ u64 kmajor_desc(u32 saddr) { return make_desc(saddr, 16, 1024); }


// The 128 accumulators of an m64n256 wgmma, and the operand lists of 64 / 128 accumulators from d[0].
#define ACC_REGS_128 ACC_REGS_64 ", " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define ACC_OPS_64_FROM(i) ACC_OPS_8(i), ACC_OPS_8(i + 8), ACC_OPS_8(i + 16), ACC_OPS_8(i + 24), \
    ACC_OPS_8(i + 32), ACC_OPS_8(i + 40), ACC_OPS_8(i + 48), ACC_OPS_8(i + 56)
#define ACC_OPS_128 ACC_OPS_64_FROM(0), ACC_OPS_64_FROM(64)
#define ACC_REGS_96 ACC_REGS_64 ", " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define ACC_OPS_96 ACC_OPS_64_FROM(0), ACC_OPS_8(64), ACC_OPS_8(72), ACC_OPS_8(80), ACC_OPS_8(88)

// d += A[64 x 16] @ B[16 x 256]^T, A and B K-major in shared memory (B's 256 rows are W's rows).
__device__ __forceinline__ void wgmma_n256(float (&d)[128], u64 desc_a, u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32." WG_TY "." WG_TY " {" ACC_REGS_128
        "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
        : ACC_OPS_128
        : "l"(desc_a), "l"(desc_b), "n"(1));
}

// d += A[64 x 16] @ B[16 x 192]^T (TILE_N 192: tiles of three quarters the width, for N and M whose
// 128 x 256 tiles fill the last wave of the grid badly; launch_sm90.py, wave_schedule).
__device__ __forceinline__ void wgmma_n192(float (&d)[96], u64 desc_a, u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n192k16.f32." WG_TY "." WG_TY " {" ACC_REGS_96
        "}, %96, %97, p, 1, 1, 0, 0;\n}\n"
        : ACC_OPS_96
        : "l"(desc_a), "l"(desc_b), "n"(1));
}

// d += A[64 x 16] @ B[16 x 128]^T (pingpong: two of these per 16 columns of K, one per slab).
__device__ __forceinline__ void wgmma_n128(float (&d)[64], u64 desc_a, u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." WG_TY "." WG_TY " {" ACC_REGS_64
        "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : ACC_OPS_64_FROM(0)
        : "l"(desc_a), "l"(desc_b), "n"(1));
}

// d = A[64 x 32] @ B[32 x 128]^T (+ d when `accumulate`), E4M3 (plugins/common/sm90.cuh's
// wgmma_ss_n128_e4m3). IN_FP8: the four of a k-block start a fresh partial (kernel_sm90.cu).
__device__ __forceinline__ void wgmma_n128_fp8(float (&d)[64], u64 desc_a, u64 desc_b, bool accumulate) {
    if (accumulate)
        wgmma_ss_n128_e4m3<1>(d, desc_a, desc_b);
    else
        wgmma_ss_n128_e4m3<0>(d, desc_a, desc_b);
}
