// kernel_sm90.cu, profiling: per-phase cycle counters (PROFILE 1, scripts/profile_attention.py).
// With PROFILE 0 (every shipped build) the macros are empty and the kernel has no second output.

// PROFILE 1: every warp adds the SM clock cycles it spends in each phase of its loop to counters
// written to a second output, u32 [grid, warps per CTA, PR_N] (scripts/profile_attention.py).
// Development only: the clock reads cost a few cycles each and constrain instruction scheduling.
#ifndef PROFILE
#define PROFILE 0
#endif
enum {
    PR_WAIT_Q,   // consumer: Q tile landed / producer: Q slot free
    PR_WAIT_KV,  // consumer: K / V tile landed / producer: ring slot free
    PR_FENCE,    // consumer: fence.proxy.async after the K / V waits
    PR_TURN,     // consumer: waiting for its turn to issue MMAs (pingpong)
    PR_ISSUE,    // consumer: issuing wgmmas / producer: issuing cp.async
    PR_PASS,     // consumer: handing the turn on (pingpong)
    PR_WAIT_S,   // consumer: S = Q K^T not yet done
    PR_SOFTMAX,  // consumer: mask + online softmax of a block
    PR_WAIT_PV,  // consumer: O += P V not yet done
    PR_POST,     // consumer: rescale O, pack P, tile bookkeeping
    PR_EPI,      // consumer: epilogue (normalize, store O)
    PR_TOTAL,    // cycles from the role split to the end
    PR_TILES,    // tiles (count)
    PR_BLOCKS,   // key blocks (count)
    PR_KV_LATE,  // consumer: K / V waits whose data had not landed when first probed (count)
    PR_N
};
#if PROFILE
__device__ __forceinline__ u32 clock32() {
    u32 r;
    asm volatile("mov.u32 %0, %%clock;" : "=r"(r)::"memory");
    return r;
}
#define PROF_DECL u32 prof_acc[PR_N] = {}; u32 prof_t = clock32(); const u32 prof_start = prof_t;
#define PROF(ph) { const u32 t_ = clock32(); prof_acc[ph] += t_ - prof_t; prof_t = t_; }
#define PROF_COUNT(ph) (++prof_acc[ph])
#define PROF_STORE                                                                         \
    if ((threadIdx.x & 31) == 0) {                                                         \
        prof_acc[PR_TOTAL] = clock32() - prof_start;                                       \
        u32* dst = Prof + ((long long)blockIdx.x * (NTHREADS / 32) + threadIdx.x / 32) * PR_N; \
        for (int i_ = 0; i_ < PR_N; ++i_) dst[i_] = prof_acc[i_];                          \
    }
#else
#define PROF_DECL
#define PROF(ph)
#define PROF_COUNT(ph)
#define PROF_STORE
#endif
