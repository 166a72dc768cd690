// kernel_sm90.cu, synchronization beyond plugins/common/sm90.cuh: the late-wait count of the K/V
// ring's waits, cp.async completion on a barrier, and the named barriers the consumer warpgroups
// take turns on. Needs profile.cuh (KV_WAIT counts late waits under PROFILE).

// A consumer's wait for K / V. PROFILE: also counts the waits whose data had not landed when
// first probed (test_wait, which does not block: try_wait may itself wait a while and then pass).
#if PROFILE
__device__ __forceinline__ bool mbar_wait_late(u32 bar, u32 parity) {
    u32 ready;
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(ready) : "r"(bar), "r"(parity) : "memory");
    mbar_wait(bar, parity);
    return !ready;
}
#define KV_WAIT(bar, parity) { if (mbar_wait_late(bar, parity)) PROF_COUNT(PR_KV_LATE); }
#else
#define KV_WAIT(bar, parity) mbar_wait(bar, parity)
#endif

// The barrier counts this thread's arrival once all its earlier cp.async copies have landed.
__device__ __forceinline__ void cp_async_arrive(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

// 16-byte global -> shared copy; src_bytes < 16 zero-fills the rest (rows past the sequence end).
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, u32 src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// Turn-taking between consumer warpgroups: warpgroup c waits on barrier 1 + c, then (after issuing
// its MMAs) arrives on the next one's; each barrier joins the waiting and the arriving warpgroup.
__device__ __forceinline__ void named_sync(int id) { asm volatile("bar.sync %0, 256;" ::"r"(id) : "memory"); }
__device__ __forceinline__ void named_arrive(int id) { asm volatile("bar.arrive %0, 256;" ::"r"(id) : "memory"); }
#define TURN_WAIT(cw) named_sync(1 + (cw))
#define TURN_PASS(cw) named_arrive(1 + ((cw) + 1) % nc)

// The producer warpgroup's own named barriers (key padding; ids apart from the turns' 1-3 and the
// consumers' 1 + CONSUMERS + cw): 14 joins its 128 threads at each tile start (with TMA); the
// key-padding scan (sparsity.cuh, live_key_range) joins the whole warpgroup on 15, or its warps
// 1-3 on 13 when they scan the next tile's row ahead.
#define PRODUCER_SYNC() asm volatile("bar.sync 14, 128;" ::: "memory")
#define LIVE_SYNC_PRODUCER() asm volatile("bar.sync 15, 128;" ::: "memory")
#define LIVE_SYNC_AHEAD() asm volatile("bar.sync 13, 96;" ::: "memory")
