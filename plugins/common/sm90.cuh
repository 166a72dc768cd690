// Hopper (sm_90a) building blocks shared by the plugins' CUDA kernels (flash_attention,
// gemm): the wgmma operand type, the packed 16-bit output pair, shared-memory addresses,
// mbarriers, the generic -> async proxy fence, host-encoded tensor-map parameters, publishing a
// device-built tensor map, wgmma fences / waits, shared-memory descriptors and the E4M3 m64n128k32
// wgmma. Needs u32 / u64 and OPTFUSE_DTYPE (1 fp16, 2 bf16) defined first.

#if OPTFUSE_DTYPE == 1
#define WG_TY "f16"
#elif OPTFUSE_DTYPE == 2
#define WG_TY "bf16"
#else
#error "OPTFUSE_DTYPE must be 1 (fp16) or 2 (bf16)"
#endif

// Two fp32 -> packed 16-bit pair of the I/O type (lo in the low half), round to nearest even.
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
#if OPTFUSE_DTYPE == 1
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r;
    asm("{\n.reg .u64 a;\ncvta.to.shared.u64 a, %1;\ncvt.u32.u64 %0, a;\n}\n" : "=r"(r) : "l"(p));
    return r;
}

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

// Wait until the phase of `bar` with this parity has completed (a fresh barrier passes parity 1).
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}

__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}

// `count` arrivals on `bar` by this one thread (one instruction for what several threads would
// otherwise each arrive for).
__device__ __forceinline__ void mbar_arrive_count(u32 bar, u32 count) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(bar), "r"(count) : "memory");
}

// One arrival per warp (32 arrivals on one barrier word would serialize): after __syncwarp the
// warp's earlier shared-memory reads and writes are ordered before lane 0's release.
__device__ __forceinline__ void mbar_arrive_warp(u32 bar) {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) mbar_arrive(bar);
}

// This thread's arrival on `bar`, which also expects `bytes` more from TMA transfers.
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// Make data that generic-proxy writes put in shared memory visible to wgmma / TMA (async proxy).
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// A tensor map the host encoded (cuTensorMapEncodeTiled), passed by value as a __grid_constant__
// parameter (HOST_MAPS): the layout of CUtensorMap.
struct __align__(64) TensorMap {
    u64 opaque[16];
};

// Fetch a parameter's tensor map into the TMA unit's descriptor cache ahead of its first use.
__device__ __forceinline__ void tmap_prefetch(const TensorMap* map) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<u64>(map)) : "memory");
}

// The warp's copy of a finished tensor map to global memory, where the TMA unit reads it,
// ordered before this thread's later TMA use of it (release by the copy, acquire by the fence).
__device__ __forceinline__ void tmap_publish(void* g, u32 sm) {
    asm volatile("tensormap.cp_fenceproxy.global.shared::cta.tensormap::generic.release.gpu.sync.aligned [%0], [%1], 128;"
                 ::"l"(g), "r"(sm) : "memory");
    asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" ::"l"(g) : "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }

// Keep the compiler from moving reads of wgmma results above the wait (and from reusing the
// registers an in-flight wgmma still reads): an empty asm that "modifies" each register.
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// wgmma shared-memory descriptor, 128-byte swizzle. For K-major operands the leading byte offset
// is unused (16) and the stride byte offset is 1024 (8 rows x 128 bytes); for N-major ones (FA's V)
// the leading offset steps to the next 64-element chunk of N and the stride offset to the next 8
// rows of K.
__device__ __forceinline__ u64 make_desc(u32 saddr, u32 lbo_bytes, u32 sbo_bytes) {
    u64 d = (u64)((saddr & 0x3FFFF) >> 4);
    d |= (u64)((lbo_bytes >> 4) & 0x3FFF) << 16;
    d |= (u64)((sbo_bytes >> 4) & 0x3FFF) << 32;
    d |= (u64)1 << 62;
    return d;
}

// The accumulator operands of an m64nN wgmma: N/2 fp32 registers per thread, bound in order
// (%0 .. %N/2-1) as read-write, so the compiler keeps them in place across the asynchronous MMA.
#define ACC_REGS_32 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define ACC_REGS_64 ACC_REGS_32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, " \
    "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define ACC_OPS_8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), \
    "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])

// d (+)= A[64 x 32] (smem, K-major) @ B[32 x 128] (smem, K-major), E4M3 (8-bit operands have no
// transposed mode); SCALE_D 0 overwrites d. FlashAttention's FP8 S = Q K^T, the GEMM's FP8 halves.
template <int SCALE_D>
__device__ __forceinline__ void wgmma_ss_n128_e4m3(float (&d)[64], u64 desc_a, u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" ACC_REGS_64
        "}, %64, %65, p, 1, 1;\n}\n"
        : ACC_OPS_8(0), ACC_OPS_8(8), ACC_OPS_8(16), ACC_OPS_8(24),
          ACC_OPS_8(32), ACC_OPS_8(40), ACC_OPS_8(48), ACC_OPS_8(56)
        : "l"(desc_a), "l"(desc_b), "n"(SCALE_D));
}
