// kernel_sm90.cu, synchronization: shared-memory addresses, mbarriers (the stage ring's full /
// empty barriers) and the generic -> async proxy fence.

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

// One arrival per warp: after __syncwarp the warp's earlier reads of the slot are ordered
// before lane 0's release.
__device__ __forceinline__ void mbar_arrive_warp(u32 bar) {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}

// This thread's arrival on `bar`, which also expects `bytes` more from TMA transfers.
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// Shared memory written by ordinary stores that the copy engine writes (or reads) next.
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
