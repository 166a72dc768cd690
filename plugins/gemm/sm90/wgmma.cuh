// kernel_sm90.cu, the mainloop's MMAs: wgmma fences and waits, shared-memory descriptors and the
// m64n256k16 instruction (both operands K-major in shared memory).

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }

// Keep the compiler from moving reads of wgmma results above the wait (and from reusing registers
// an in-flight wgmma still writes): an empty asm that "modifies" each register.
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// wgmma shared-memory descriptor, 128-byte swizzle, K-major: the leading byte offset is unused
// (16) and the stride byte offset is 1024 (8 rows x 128 bytes).
__device__ __forceinline__ u64 make_desc(u32 saddr) {
    u64 d = (u64)((saddr & 0x3FFFF) >> 4);
    d |= (u64)(16 >> 4) << 16;
    d |= (u64)(1024 >> 4) << 32;
    d |= (u64)1 << 62;
    return d;
}

// The fp32 accumulators of an m64n256 (128) or m64n128 (64) wgmma (per thread), bound in order as read-write so
// that the compiler keeps them in place across the asynchronous MMA.
#define ACC_REGS_128 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define ACC_OPS_8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), \
    "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define ACC_OPS_32(i) ACC_OPS_8(i), ACC_OPS_8(i + 8), ACC_OPS_8(i + 16), ACC_OPS_8(i + 24)
#define ACC_OPS_128 ACC_OPS_32(0), ACC_OPS_32(32), ACC_OPS_32(64), ACC_OPS_32(96)

// d += A[64 x 16] @ B[16 x 256]^T, A and B K-major in shared memory (B's 256 rows are W's rows).
__device__ __forceinline__ void wgmma_n256(float (&d)[128], u64 desc_a, u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32." WG_TY "." WG_TY " {" ACC_REGS_128
        "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
        : ACC_OPS_128
        : "l"(desc_a), "l"(desc_b), "n"(1));
}

// d += A[64 x 16] @ B[16 x 128]^T (pingpong: two of these per 16 columns of K, one per slab).
#define ACC_REGS_64 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, " \
    "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, " \
    "%60, %61, %62, %63"
__device__ __forceinline__ void wgmma_n128(float (&d)[64], u64 desc_a, u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." WG_TY "." WG_TY " {" ACC_REGS_64
        "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : ACC_OPS_32(0), ACC_OPS_32(32)
        : "l"(desc_a), "l"(desc_b), "n"(1));
}
