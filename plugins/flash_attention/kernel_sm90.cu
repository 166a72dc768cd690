// FlashAttention forward for Hopper (sm_90a) in CUDA C++: an FA3-style schedule behind the same
// launch contract as the Triton kernel (kernel.py).
//
//     o[b, h] = softmax(scale * q[b, h] @ k[b, h // G]^T (+ key bias) (+ causal mask)) @ v[b, h // G]
//
// q, o: [B, H, Sq, D]; k, v: [B, Hkv, Sk, D]; contiguous fp16/bf16; D in {64, 128}.
// Arguments (TensorRT QDP order): q, k, v[, bias], H, Hkv, Sq, Sk, num_tiles (int32), o;
// num_tiles = cdiv(Sq, BLOCK_M) * B * H, grid = one CTA per SM (persistent).
//
// Why this kernel exists: the Triton kernel (FA2 schedule) keeps the tensor cores idle while the
// same warps compute exp2/max/sum; at D = 128 the exponentials alone take half the MMA time of a
// score. Here, as in FlashAttention-3:
//   * one producer warpgroup streams K/V tiles into shared memory (TMA, or 16-byte cp.async,
//     swizzled for wgmma) through a STAGES-deep ring guarded by mbarriers, so the math warps never
//     wait on address arithmetic or loads;
//   * two (or three: CONSUMERS) consumer warpgroups own 64 query rows each and run wgmma:
//     S = Q K^T from shared memory, O += P V with P straight from registers (the fp32 accumulator
//     layout of S, packed to 16 bit, is the A-operand register layout of the next wgmma: no
//     shared-memory round trip);
//   * inside a warpgroup, S_{j+1} = Q K_{j+1}^T and O += P_j V_j are issued before the softmax of
//     S_{j+1} runs, so the exponentials overlap the tensor cores (intra-warpgroup pipelining);
//   * between the consumer warpgroups, named barriers let one issue its MMAs while the others do
//     their softmax (turn-taking, "pingpong").
// TMA without host-encoded tensor maps (a QDP kernel gets pointers and int32 scalars only): each
// CTA builds its maps on the device and keeps them in output rows it alone writes, last (TMA
// below); the loads keep up as long as K/V come mostly from L2 (each 128 x 128 block is 128 FLOP
// per byte: from HBM alone the tensor cores would starve; see the tile order below).
//
// Compile-time specialization (-D): OPTFUSE_DTYPE (1 fp16, 2 bf16), HEAD_DIM (64|128), CAUSAL,
// BIAS_MODE (0 none, 1 scalar: a bias broadcast from one value, 2 key padding: [B|1, 1, 1, Sk]),
// BIAS_BATCH (key padding bias has a batch dim), BIAS_DTYPE (0 fp32, 1 fp16, 2 bf16),
// SCALE_LOG2 (scale * log2(e)), STAGES (K/V ring depth), CONSUMERS (2|3), TMA, KV_ONE_FULL,
// SOFTMAX_STREAM, ONES_SUM (D = 64: the rows' sums of p from the tensor cores), PROFILE (per-phase
// cycle counters as a second output; for scripts/profile_attention.py only). launch.py
// (sm90_config) sets them per head dim, causality and bias. Fixed: 128-key blocks, two Q buffers
// with the staged epilogue, turn-taking consumers, lazy rescaling. Needs sm_90a (wgmma,
// setmaxnreg).

typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short u16;

#ifndef OPTFUSE_DTYPE
#define OPTFUSE_DTYPE 2
#endif
#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef CAUSAL
#define CAUSAL 0
#endif
#ifndef BIAS_MODE
#define BIAS_MODE 0
#endif
#ifndef BIAS_BATCH
#define BIAS_BATCH 1
#endif
#ifndef BIAS_DTYPE
#define BIAS_DTYPE OPTFUSE_DTYPE
#endif
#ifndef SCALE_LOG2
#define SCALE_LOG2 0.12751743074602467f
#endif
#ifndef STAGES
#define STAGES 2
#endif
// Lazy rescaling (FlashAttention-4): a warp keeps its rows' running maxima while no row's block
// maximum exceeds its stored one by more than 2^LAZY_MARGIN (log2 units), so the O rescale (D / 2
// FMULs a thread) is skipped for most blocks. Exponents stay <= LAZY_MARGIN: p <= 2^8 fits
// fp16/bf16 and the fp32 sums; the final 1 / l cancels the stale offset.
#define LAZY_MARGIN 8
// TMA loads (1): the producer's K / V / Q copies are tensor-memory-accelerator transfers, one
// instruction per 64-column box issued by one thread, instead of 16-byte cp.async by 128 threads
// (16 per thread and tile at D = 64). The tensor maps they need are built on the device (a QDP
// kernel gets no host-encoded ones) and kept in global memory that this CTA alone owns until its
// very end: the first rows of the output tile it writes last ("TMA loads" below). A CTA whose last
// tile is too short for them, loads nothing (no visible key) or is not 64-byte aligned in the
// output falls back to cp.async.
#ifndef TMA
#define TMA 0
#endif
// One "full" barrier per K/V ring stage (1): K_j and V_j complete the same barrier, so a consumer
// waits once per key block (for K_j, with V_j) instead of twice (K_j, then V_{j-1}); the "empty"
// barriers stay separate (K's slot is refilled before V's). It needs a third ring stage: with two,
// V_j can only load once P_{j-2} V_{j-2} is done, one block before S_j = Q K_j^T now waits for it
// (launch.py: on from 3 stages, README "Tuning" 38).
#ifndef KV_ONE_FULL
#define KV_ONE_FULL 0
#endif

// Softmax as one instruction stream (1; launch.py: D = 64, and D = 128 non-causal without a key
// bias). In the steady-state key loop, the wait for O += P_{j-1} V_{j-1} moves before the
// exponentials of block j (ptxas hoisted it there anyway), so the P registers are free during them
// and each group of exponentials is followed by its P packs. A MUFU op takes the unit 8 cycles per
// warp; interleaved, the FFMA / F2FP work issues in those gaps instead of before and after the 64
// exponentials, where Nsight Compute found the warps stalled on them (README "Tuning" 41). The row
// maxima come from four partial chains instead of one.
#ifndef SOFTMAX_STREAM
#define SOFTMAX_STREAM 0
#endif

#if OPTFUSE_DTYPE == 1
#define WG_TY "f16"
#elif OPTFUSE_DTYPE == 2
#define WG_TY "bf16"
#else
#error "OPTFUSE_DTYPE must be 1 (fp16) or 2 (bf16)"
#endif

#if HEAD_DIM != 64 && HEAD_DIM != 128
#error "HEAD_DIM must be 64 or 128"
#endif
#define BLOCK_N 128  // keys per block: the score wgmma is m64n128k16

// Consumer warpgroups (2 or 3), 64 query rows each. Three give each warpgroup's softmax the time of
// two others' MMAs instead of one (FlashAttention-3's choice at D = 64, where the exponentials of
// a block take as long as its MMAs) at 160 registers a consumer thread.
#ifndef CONSUMERS
#define CONSUMERS 2
#endif
#if CONSUMERS != 2 && CONSUMERS != 3
#error "CONSUMERS must be 2 or 3"
#endif
#if CONSUMERS == 3 && HEAD_DIM != 64
#error "three consumer warpgroups only at D = 64 (at D = 128, 160 registers spill)"
#endif
#define BLOCK_M (64 * CONSUMERS)         // query rows per CTA
#define D HEAD_DIM
#define NTHREADS (128 * (CONSUMERS + 1)) // producer warpgroup + consumer warpgroups
#if CONSUMERS == 2
#define PRODUCER_REGS 56                 // 40 spilled the causal pair indexing (D = 64, no key bias)
#define CONSUMER_REGS 224                // 128 * 56 + 256 * 224 <= 64K registers
#else
#define PRODUCER_REGS 32                 // 128 * 32 + 384 * 160 = 64K registers
#define CONSUMER_REGS 160
#endif
// Causal with three: 192-row tiles cost a third more score blocks on the diagonal (27 % slower at
// S = 512, 7-13 % faster from S = 4096), so below SQ_THREE query rows the third consumer warpgroup
// sits out and the tiles are 128 rows: a run-time choice (launch parameters cannot branch on Sq).
#define SQ_THREE 4096
#if CONSUMERS == 3 && CAUSAL
#define ACTIVE_CONSUMERS(sq) ((sq) >= SQ_THREE ? 3 : 2)
#else
#define ACTIVE_CONSUMERS(sq) CONSUMERS
#endif

// Shared memory: every tile is stored in 128-byte swizzle atoms, the layout wgmma reads with a
// "128B swizzle" descriptor: the tile's head dim is cut into 64-element (128-byte) chunks; chunk c
// holds all rows, row r at r * 128 bytes, its 16-byte unit u at position u ^ (r % 8), so the 8
// rows a wgmma core matrix reads hit 8 different bank groups. Chunks are 1024-byte aligned.
#define Q_BYTES (BLOCK_M * D * 2)
#define KV_BYTES (BLOCK_N * D * 2)
#define BIAS_STAGE_BYTES (BLOCK_N * 4)   // key bias of one tile, fp32, log2 units
// Two Q tiles: the next tile's Q loads while the consumers finish this one, and the epilogue
// stages this tile's output through its own slot (released only after the epilogue).
#define Q_BUFFERS 2
#define OFF_Q 0
#define OFF_K (OFF_Q + Q_BUFFERS * Q_BYTES)
#define OFF_V (OFF_K + STAGES * KV_BYTES)
// Row sums on the tensor cores (ONES_SUM, D = 64 only): O += P V runs with N = 72, the 8 extra
// columns of "V" a constant tile of ones after the V ring, so O's 4 extra accumulators per thread
// are its two rows' sums of p (of the 16-bit p that P V multiplies), and the softmax drops its
// add per score.
#ifndef ONES_SUM
#define ONES_SUM 0
#endif
#if ONES_SUM && HEAD_DIM != 64
#error "ONES_SUM only at D = 64 (the ones columns must fit m64n72)"
#endif
#define O_REGS (D / 2 + (ONES_SUM ? 4 : 0))
#define OFF_ONES (OFF_V + STAGES * KV_BYTES)
#define OFF_BIAS (OFF_ONES + (ONES_SUM ? BLOCK_N * 128 : 0))
#define OFF_BAR (OFF_BIAS + (BIAS_MODE == 2 ? STAGES * BIAS_STAGE_BYTES : 0))
#define KV_FULL_BARS (KV_ONE_FULL ? 1 : 2)  // "full" barriers per ring stage: K and V, or one for both
#define N_BARS (2 * Q_BUFFERS + (KV_FULL_BARS + 2) * STAGES)
// + 1024: the dynamic shared memory base is aligned up to 1024 bytes at run time.
#define SMEM_BYTES (OFF_BAR + 8 * N_BARS + 1024)

#define NEG_INF (-__int_as_float(0x7f800000))

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

// ---- small PTX wrappers -------------------------------------------------------------------------
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r;
    asm("{\n.reg .u64 a;\ncvta.to.shared.u64 a, %1;\ncvt.u32.u64 %0, a;\n}\n" : "=r"(r) : "l"(p));
    return r;
}

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}

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

__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}

// One arrival per warp (32 arrivals on one barrier word would serialize): after __syncwarp the
// warp's earlier shared-memory reads are ordered before lane 0's release.
__device__ __forceinline__ void mbar_arrive_warp(u32 bar) {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) mbar_arrive(bar);
}

// The barrier counts this thread's arrival once all its earlier cp.async copies have landed.
__device__ __forceinline__ void cp_async_arrive(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

// 16-byte global -> shared copy; src_bytes < 16 zero-fills the rest (rows past the sequence end).
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, u32 src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// Make data that generic-proxy writes (cp.async) put in shared memory visible to wgmma (async proxy).
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// ---- TMA loads ----------------------------------------------------------------------------------
// A 3-D tensor map of a [heads, rows, D] 16-bit tensor (D contiguous) with boxes of 64 columns x
// box_rows rows x 1 head, landing in the 128-byte swizzle layout wgmma reads (see "Shared memory"
// below: a 64-column box is one swizzle chunk). Rows past `rows` read as zeros, as the cp.async
// path's zero fill does. Written by one thread into zeroed shared memory with tensormap.replace
// (the PTX encodings: rank - 1, elemtype 6 f16 / 10 bf16, swizzle 3 = 128 bytes, fill 0 = zeros).
__device__ __forceinline__ void tmap_encode(u32 sm, const void* g, u32 rows, u32 heads, u32 box_rows) {
#define TMAP_SET(field, val) asm volatile("tensormap.replace.tile." field ".shared::cta.b1024.b32 [%0], %1;" ::"r"(sm), "n"(val) : "memory")
#define TMAP_SET_ORD(field, ord, val) \
    asm volatile("tensormap.replace.tile." field ".shared::cta.b1024.b32 [%0], %1, %2;" ::"r"(sm), "n"(ord), "r"(val) : "memory")
    asm volatile("tensormap.replace.tile.global_address.shared::cta.b1024.b64 [%0], %1;" ::"r"(sm), "l"(g) : "memory");
    TMAP_SET("rank", 2);  // rank, elemtype and the modes are immediates
    TMAP_SET_ORD("box_dim", 0, 64u);
    TMAP_SET_ORD("box_dim", 1, box_rows);
    TMAP_SET_ORD("box_dim", 2, 1u);
    TMAP_SET_ORD("global_dim", 0, (u32)D);
    TMAP_SET_ORD("global_dim", 1, rows);
    TMAP_SET_ORD("global_dim", 2, heads);
    asm volatile("tensormap.replace.tile.global_stride.shared::cta.b1024.b64 [%0], 0, %1;" ::"r"(sm), "l"((u64)D * 2) : "memory");
    asm volatile("tensormap.replace.tile.global_stride.shared::cta.b1024.b64 [%0], 1, %1;" ::"r"(sm), "l"((u64)rows * D * 2) : "memory");
    TMAP_SET_ORD("element_stride", 0, 1u);
    TMAP_SET_ORD("element_stride", 1, 1u);
    TMAP_SET_ORD("element_stride", 2, 1u);
    TMAP_SET("elemtype", OPTFUSE_DTYPE == 1 ? 6 : 10);
    TMAP_SET("interleave_layout", 0);
    TMAP_SET("swizzle_mode", 3);
    TMAP_SET("fill_mode", 0);
#undef TMAP_SET
#undef TMAP_SET_ORD
}

// The warp's copy of a finished map to global memory, where the TMA unit reads it, ordered before
// this thread's later TMA use of it (release by the copy, acquire by the fence).
__device__ __forceinline__ void tmap_publish(void* g, u32 sm) {
    asm volatile("tensormap.cp_fenceproxy.global.shared::cta.tensormap::generic.release.gpu.sync.aligned [%0], [%1], 128;"
                 ::"l"(g), "r"(sm) : "memory");
    asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" ::"l"(g) : "memory");
}

// Box (column c0, row c1, head c2) of a map into shared memory; completes on `bar` by bytes.
__device__ __forceinline__ void tma_load(u32 dst, const void* tmap, int c0, int c1, int c2, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
        ::"r"(dst), "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}

// This thread's arrival on `bar`, which also expects `bytes` more from TMA transfers.
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// Rows from row0 of one head, all D columns: D / 64 boxes into the swizzle chunks of a tile whose
// chunks are chunk_bytes apart (a Q slot: BLOCK_M * 128; a K / V ring slot: BLOCK_N * 128).
__device__ __forceinline__ void tma_load_rows(u32 dst, u32 chunk_bytes, const void* tmap, int row0, int head, u32 bar) {
#pragma unroll
    for (int c = 0; c < D / 64; ++c) tma_load(dst + c * chunk_bytes, tmap, 64 * c, row0, head, bar);
}

// Key rows [row0, row0 + BLOCK_N) of one kv head from a K or V map into ring slot `dst`, counted
// on `bar`.
__device__ __forceinline__ void tma_load_kv(u32 dst, const void* tmap, int row0, int head, u32 bar) {
    mbar_expect_tx(bar, KV_BYTES);
    tma_load_rows(dst, BLOCK_N * 128, tmap, row0, head, bar);
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
template <int N>
__device__ __forceinline__ void fence_regs(u32 (&r)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}

// Turn-taking between consumer warpgroups: warpgroup c waits on barrier 1 + c, then (after issuing
// its MMAs) arrives on the next one's; each barrier joins the waiting and the arriving warpgroup.
__device__ __forceinline__ void named_sync(int id) { asm volatile("bar.sync %0, 256;" ::"r"(id) : "memory"); }
__device__ __forceinline__ void named_arrive(int id) { asm volatile("bar.arrive %0, 256;" ::"r"(id) : "memory"); }
#define TURN_WAIT(cw) named_sync(1 + (cw))
#define TURN_PASS(cw) named_arrive(1 + ((cw) + 1) % nc)

__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Two fp32 -> packed 16-bit pair (lo in the low half), round to nearest even.
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
#if OPTFUSE_DTYPE == 1
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}

__device__ __forceinline__ float bias_to_float(const void* p, long long i) {
#if BIAS_DTYPE == 0
    return ((const float*)p)[i];
#elif BIAS_DTYPE == 1
    float f;
    u16 h = ((const u16*)p)[i];
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    return __uint_as_float((u32)((const u16*)p)[i] << 16);
#endif
}

// wgmma shared-memory descriptor, 128-byte swizzle. For K-major operands the leading byte offset
// is unused (1) and the stride byte offset is 1024 (8 rows x 128 bytes); for N-major (V) the
// leading offset steps to the next 64-element chunk of N and the stride offset to the next 8 rows
// of K.
__device__ __forceinline__ u64 make_desc(u32 saddr, u32 lbo_bytes, u32 sbo_bytes) {
    u64 d = (u64)((saddr & 0x3FFFF) >> 4);
    d |= (u64)((lbo_bytes >> 4) & 0x3FFF) << 16;
    d |= (u64)((sbo_bytes >> 4) & 0x3FFF) << 32;
    d |= (u64)1 << 62;
    return d;
}

// The accumulator operands: N/2 fp32 registers per thread for an m64nN wgmma, bound in order
// (%0 .. %N/2-1) as read-write, so the compiler keeps them in place across the asynchronous MMA.
#define ACC_REGS_32 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define ACC_REGS_64 ACC_REGS_32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, " \
    "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define ACC_OPS_8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), \
    "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define ACC_OPS_32 ACC_OPS_8(0), ACC_OPS_8(8), ACC_OPS_8(16), ACC_OPS_8(24)
#define ACC_OPS_64 ACC_OPS_32, ACC_OPS_8(32), ACC_OPS_8(40), ACC_OPS_8(48), ACC_OPS_8(56)

// d (+)= A[64 x 16] (smem, K-major) @ B[16 x 128] (smem, K-major); SCALE_D 0 overwrites d.
template <int SCALE_D>
__device__ __forceinline__ void wgmma_ss_n128(float (&d)[64], u64 desc_a, u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." WG_TY "." WG_TY " {" ACC_REGS_64
        "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : ACC_OPS_64
        : "l"(desc_a), "l"(desc_b), "n"(SCALE_D));
}

// d += A[64 x 16] (registers) @ B[16 x 64] (smem, N-major: imm-trans-b = 1).
__device__ __forceinline__ void wgmma_rs_n64(float (&d)[32], const u32 (&a)[4], u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." WG_TY "." WG_TY " {" ACC_REGS_32
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
        : ACC_OPS_32
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(1));
}

// d += A[64 x 16] (registers) @ B[16 x 72] (smem, N-major: imm-trans-b = 1; columns 64-71 from
// the chunk at the descriptor's leading byte offset: the ones tile).
#define ACC_REGS_36 ACC_REGS_32 ", %32, %33, %34, %35"
__device__ __forceinline__ void wgmma_rs_n72(float (&d)[36], const u32 (&a)[4], u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %41, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n72k16.f32." WG_TY "." WG_TY " {" ACC_REGS_36
        "}, {%36, %37, %38, %39}, %40, p, 1, 1, 1;\n}\n"
        : ACC_OPS_32, "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(1));
}

// d += A[64 x 16] (registers) @ B[16 x 128] (smem, N-major: imm-trans-b = 1).
__device__ __forceinline__ void wgmma_rs_n128(float (&d)[64], const u32 (&a)[4], u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." WG_TY "." WG_TY " {" ACC_REGS_64
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : ACC_OPS_64
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(1));
}

// ---- producer: one tile of rows [row0, row0 + ROWS) into swizzled shared memory ---------------
template <int ROWS>
__device__ __forceinline__ void load_tile(u32 dst, const u16* src, int rows_valid, int ptid) {
    constexpr int UNITS = D / 8;          // 16-byte units per row
    constexpr int RSTEP = 128 / UNITS;    // rows one pass of the 128 threads covers (a multiple of 8)
    // Consecutive threads copy consecutive 16 bytes of a row (coalesced). A thread's row advances
    // by RSTEP per pass, so its swizzled position (u ^ row % 8) never changes: one address
    // computation, then constant offsets (the producer runs on few registers).
    const int r = ptid / UNITS, u = ptid % UNITS;
    const u32 off = (u >> 3) * (ROWS * 128) + r * 128 + (((u & 7) ^ (r & 7)) << 4);
    const u16* g = src + r * D + u * 8;
    // Opaque to the compiler: otherwise it hoists one pointer per pass out of the key loop and the
    // producer spills; from here every pass is the same register plus an immediate offset.
    asm volatile("mov.b64 %0, %0;" : "+l"(g));
#pragma unroll
    for (int it = 0; it < ROWS / RSTEP; ++it) {
        const bool ok = r + it * RSTEP < rows_valid;
        cp_async16(dst + off + it * RSTEP * 128, ok ? g + it * RSTEP * D : src, ok ? 16u : 0u);
    }
}

// ---- consumer helpers ----------------------------------------------------------------------------
// S accumulator layout (m64n128, per thread): s[4n + 0..1] = row r0, cols 8n + 2q + {0,1};
// s[4n + 2..3] = row r0 + 8, same cols (q = lane % 4, r0 = 16 * warp + lane / 4).

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Scores of key block kv0 that no row may see: keys >= Sk, and (causal) keys > row + causal_off.
// The limits are taken relative to this thread's first column, so each test is one compare of a
// register with the constant 8n + j (no per-element column arithmetic).
__device__ __forceinline__ void apply_mask(float (&s)[64], int kv0, int lim0, int lim1, int q4) {
    const int rel0 = lim0 - kv0 - 2 * q4, rel1 = lim1 - kv0 - 2 * q4;
#pragma unroll
    for (int n = 0; n < 16; ++n)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            if (8 * n + j > rel0) s[4 * n + j] = NEG_INF;
            if (8 * n + j > rel1) s[4 * n + 2 + j] = NEG_INF;
        }
}

// Part one of the online softmax of a block: the key bias (BIAS_MODE 2, in place), the rows' block
// maxima and the new running maxima. Sets m (the running maxima), ms (what the exponents subtract:
// m, or 0 while a row has seen no finite score, so that exp2 gives 0, not NaN) and alpha =
// exp2(m_old - m_new) per row (0 for the first block); returns whether O needs rescaling (false
// when the warp kept its maxima: alpha = 1, warp-uniform).
template <bool FIRST>
__device__ __forceinline__ bool softmax_max(float (&s)[64], float& m0, float& m1, float& ms0, float& ms1,
                                            float& alpha0, float& alpha1, const float* bias_s, int q4) {
#if BIAS_MODE == 2
    // key bias (already in log2 units): t = s * SCALE_LOG2 + b[col]
#pragma unroll
    for (int n = 0; n < 16; ++n) {
        const float2 b = *reinterpret_cast<const float2*>(bias_s + 8 * n + 2 * q4);
        s[4 * n + 0] = fmaf(s[4 * n + 0], SCALE_LOG2, b.x);
        s[4 * n + 1] = fmaf(s[4 * n + 1], SCALE_LOG2, b.y);
        s[4 * n + 2] = fmaf(s[4 * n + 2], SCALE_LOG2, b.x);
        s[4 * n + 3] = fmaf(s[4 * n + 3], SCALE_LOG2, b.y);
    }
    const float sc = 1.0f;
#else
    const float sc = SCALE_LOG2;  // folded into the exponent's FFMA
#endif
#if SOFTMAX_STREAM
    // four partial maxima per row: a chain of 8 dependent FMNMX instead of 32
    float x0[4], x1[4];
#pragma unroll
    for (int n = 0; n < 4; ++n) {
        x0[n] = fmaxf(s[4 * n + 0], s[4 * n + 1]);
        x1[n] = fmaxf(s[4 * n + 2], s[4 * n + 3]);
    }
#pragma unroll
    for (int n = 4; n < 16; ++n) {
        x0[n & 3] = fmaxf(x0[n & 3], fmaxf(s[4 * n + 0], s[4 * n + 1]));
        x1[n & 3] = fmaxf(x1[n & 3], fmaxf(s[4 * n + 2], s[4 * n + 3]));
    }
    float mx0 = fmaxf(fmaxf(x0[0], x0[1]), fmaxf(x0[2], x0[3]));
    float mx1 = fmaxf(fmaxf(x1[0], x1[1]), fmaxf(x1[2], x1[3]));
#else
    float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
    for (int n = 0; n < 16; ++n) {
        mx0 = fmaxf(mx0, fmaxf(s[4 * n + 0], s[4 * n + 1]));
        mx1 = fmaxf(mx1, fmaxf(s[4 * n + 2], s[4 * n + 3]));
    }
#endif
    mx0 = quad_max(mx0) * sc;
    mx1 = quad_max(mx1) * sc;
    bool keep = false;
    if (!FIRST)
        keep = __all_sync(0xffffffffu, mx0 <= m0 + LAZY_MARGIN && mx1 <= m1 + LAZY_MARGIN);
    const float mn0 = FIRST ? mx0 : keep ? m0 : fmaxf(m0, mx0);
    const float mn1 = FIRST ? mx1 : keep ? m1 : fmaxf(m1, mx1);
    ms0 = mn0 == NEG_INF ? 0.f : mn0;
    ms1 = mn1 == NEG_INF ? 0.f : mn1;
    alpha0 = FIRST ? 0.f : keep ? 1.f : ex2(m0 - ms0);
    alpha1 = FIRST ? 0.f : keep ? 1.f : ex2(m1 - ms1);
    m0 = mn0;
    m1 = mn1;
    return !keep;
}

// The exponentials of scores n-block n (in place): p = exp2(s * sc - ms); their per-thread row
// sums (unless ONES_SUM) added to sum0 / sum1.
__device__ __forceinline__ void exp_nblock(float (&s)[64], int n, float ms0, float ms1, float& sum0, float& sum1) {
    const float sc = BIAS_MODE == 2 ? 1.0f : SCALE_LOG2;
    s[4 * n + 0] = ex2(fmaf(s[4 * n + 0], sc, -ms0));
    s[4 * n + 1] = ex2(fmaf(s[4 * n + 1], sc, -ms0));
    s[4 * n + 2] = ex2(fmaf(s[4 * n + 2], sc, -ms1));
    s[4 * n + 3] = ex2(fmaf(s[4 * n + 3], sc, -ms1));
    if (!ONES_SUM) {
        sum0 += s[4 * n + 0] + s[4 * n + 1];
        sum1 += s[4 * n + 2] + s[4 * n + 3];
    }
}

// The running row sums take a block's per-thread partial sums: l = l * alpha + sum (the quad
// reduction happens once, in the epilogue; ONES_SUM: the tensor cores sum, in O's extra columns).
template <bool FIRST>
__device__ __forceinline__ void add_row_sums(float& l0, float& l1, float sum0, float sum1, float a0, float a1) {
    if (!ONES_SUM) {
        l0 = FIRST ? sum0 : fmaf(l0, a0, sum0);
        l1 = FIRST ? sum1 : fmaf(l1, a1, sum1);
    }
}

// Online softmax of one block, in place: s becomes p = exp2(s * SCALE_LOG2 (+ bias) - m_new).
// Sets alpha = exp2(m_old - m_new) per row (0 while a row has seen no finite score); returns
// whether O needs rescaling (false when the warp kept its maxima: alpha = 1, warp-uniform).
template <bool FIRST>
__device__ __forceinline__ bool softmax_block(float (&s)[64], float& m0, float& m1, float& l0, float& l1,
                                              float& alpha0, float& alpha1, const float* bias_s, int q4) {
    float ms0, ms1;
    const bool resc = softmax_max<FIRST>(s, m0, m1, ms0, ms1, alpha0, alpha1, bias_s, q4);
    float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
    for (int n = 0; n < 16; ++n) exp_nblock(s, n, ms0, ms1, sum0, sum1);
    add_row_sums<FIRST>(l0, l1, sum0, sum1, alpha0, alpha1);
    return resc;
}

// p (fp32, S layout) -> 16-bit A fragments of O += P V: k-step kk covers keys 16kk..16kk+15,
// i.e. n-blocks 2kk and 2kk+1 of S, which is exactly the wgmma A register layout.
__device__ __forceinline__ void pack_p(const float (&s)[64], u32 (&p)[8][4]) {
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
        p[kk][0] = pack2(s[8 * kk + 0], s[8 * kk + 1]);
        p[kk][1] = pack2(s[8 * kk + 2], s[8 * kk + 3]);
        p[kk][2] = pack2(s[8 * kk + 4], s[8 * kk + 5]);
        p[kk][3] = pack2(s[8 * kk + 6], s[8 * kk + 7]);
    }
}

template <int N>
__device__ __forceinline__ void rescale(float (&o)[N], float a0, float a1) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
        o[4 * i + 0] *= a0;
        o[4 * i + 1] *= a0;
        o[4 * i + 2] *= a1;
        o[4 * i + 3] *= a1;
    }
}

#if SOFTMAX_STREAM
// Part two of the online softmax with the P registers free (SOFTMAX_STREAM): the exponentials in
// groups of 8 scores (the 16 keys of one P V k-step), each followed by its P packs.
template <bool FIRST>
__device__ __forceinline__ void softmax_exp_pack(float (&s)[64], u32 (&p)[8][4], float ms0, float ms1,
                                                 float a0, float a1, float& l0, float& l1) {
    float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
        // A data dependency on the previous group's first exponentials (ms + 0 * p = ms): without
        // it ptxas hoists all 64 FFMAs above the first MUFU op (README "Tuning" 41).
        if (kk > 0) {
            ms0 = fmaf(s[8 * kk - 8], 0.f, ms0);
            ms1 = fmaf(s[8 * kk - 6], 0.f, ms1);
        }
        exp_nblock(s, 2 * kk, ms0, ms1, sum0, sum1);
        exp_nblock(s, 2 * kk + 1, ms0, ms1, sum0, sum1);
        p[kk][0] = pack2(s[8 * kk + 0], s[8 * kk + 1]);
        p[kk][1] = pack2(s[8 * kk + 2], s[8 * kk + 3]);
        p[kk][2] = pack2(s[8 * kk + 4], s[8 * kk + 5]);
        p[kk][3] = pack2(s[8 * kk + 6], s[8 * kk + 7]);
    }
    add_row_sums<FIRST>(l0, l1, sum0, sum1, a0, a1);
}
#endif

// S = Q K^T for this warpgroup's 64 rows: D / 16 wgmmas over the head dim.
__device__ __forceinline__ void issue_qk(float (&s)[64], u32 q_s, u32 k_s) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const u32 koff = (kk & 3) * 32;  // within a 128-byte chunk
        const u64 da = make_desc(q_s + (kk >> 2) * (BLOCK_M * 128) + koff, 16, 1024);
        const u64 db = make_desc(k_s + (kk >> 2) * (BLOCK_N * 128) + koff, 16, 1024);
        if (kk == 0)
            wgmma_ss_n128<0>(s, da, db);
        else
            wgmma_ss_n128<1>(s, da, db);
    }
}

// O += P V: BLOCK_N / 16 wgmmas over the keys; V is N-major (head dim contiguous).
// lbo: from V's first 64-column chunk to its second (D = 128) or to the ones tile (ONES_SUM).
__device__ __forceinline__ void issue_pv(float (&o)[O_REGS], const u32 (&p)[8][4], u32 v_s, u32 lbo = BLOCK_N * 128) {
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
        const u64 db = make_desc(v_s + kk * 16 * 128, lbo, 1024);
#if HEAD_DIM == 128
        wgmma_rs_n128(o, p[kk], db);
#elif ONES_SUM
        wgmma_rs_n72(o, p[kk], db);
#else
        wgmma_rs_n64(o, p[kk], db);
#endif
    }
}

// ---- the kernel --------------------------------------------------------------------------------
// Persistent: the grid is one CTA per SM (launch.py); each CTA walks a fixed list of tiles (a tile
// = BLOCK_M query rows of one (b, h); the order is set after the barriers). The producer runs
// ahead into the next tile (its Q and first K/V tiles load while the consumers finish the current
// one), which hides the per-tile prologue and epilogue that dominate short sequences.
extern "C" __global__ void __launch_bounds__(NTHREADS, 1) flash_attention_sm90(
    const u16* __restrict__ Q, const u16* __restrict__ K, const u16* __restrict__ V,
#if BIAS_MODE != 0
    const void* __restrict__ Bias,
#endif
    int H, int Hkv, int Sq, int Sk, int num_tiles, u16* __restrict__ O
#if PROFILE
    , u32* __restrict__ Prof
#endif
    ) {
    extern __shared__ unsigned char smem_raw[];
    const u32 raw = smem_addr(smem_raw);
    const u32 base = (raw + 1023u) & ~1023u;
    // mbarriers: [q_full[Q], q_empty[Q], full_k[S], full_v[S] (not with KV_ONE_FULL), empty_k[S],
    // empty_v[S]], addressed from base with constant offsets (a register holding their base was
    // spilled in the D = 128 causal key-padding build once the warpgroup index below became uniform)
#define BARS (base + OFF_BAR)
#define BAR_Q_FULL(q) (BARS + 8 * (q))
#define BAR_Q_EMPTY(q) (BARS + 8 * (Q_BUFFERS + (q)))
#define BAR_FULL_K(s) (BARS + 8 * (2 * Q_BUFFERS + (s)))
#if KV_ONE_FULL
#define BAR_FULL_V(s) BAR_FULL_K(s)
#else
#define BAR_FULL_V(s) (BARS + 8 * (2 * Q_BUFFERS + STAGES + (s)))
#endif
#define BAR_EMPTY_K(s) (BARS + 8 * (2 * Q_BUFFERS + KV_FULL_BARS * STAGES + (s)))
#define BAR_EMPTY_V(s) (BARS + 8 * (2 * Q_BUFFERS + (KV_FULL_BARS + 1) * STAGES + (s)))
#define Q_SLOT(q) (base + OFF_Q + (q) * Q_BYTES)
#if ONES_SUM
#define PV_LBO(stage) ((u32)(OFF_ONES - OFF_V - (stage) * KV_BYTES))  // V stage -> the ones tile
#else
#define PV_LBO(stage) (BLOCK_N * 128)
#endif
    float* bias_ring = reinterpret_cast<float*>(smem_raw + (base + OFF_BIAS - raw));
    (void)bias_ring;

    // num_tiles counts BLOCK_M-row tiles (launch.py); with nc < CONSUMERS active consumer
    // warpgroups the tiles are bm = 64 * nc rows.
    const int nc = ACTIVE_CONSUMERS(Sq), bm = 64 * nc;
    const int BH = num_tiles / ((Sq + BLOCK_M - 1) / BLOCK_M);
    const int num_m = (Sq + bm - 1) / bm;
    const int n_tiles = num_m * BH;
    (void)n_tiles;
    const int causal_off = Sk - Sq;
    // warpgroup index, broadcast from lane 0 so that ptxas knows it is warp-uniform (without it,
    // values derived from it -- Q offsets, row limits -- were per-thread, and each branch on them
    // a divergent one: README "Tuning" 18)
    const int wg = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);

    // Tile order (below): CTA i takes units i, i + G, ... of BH * P, P units per head (causal:
    // pairs of query blocks, a pair ending with its light block; else query blocks).
    const int G = gridDim.x;
    const int P = CAUSAL ? (num_m + 1) / 2 : num_m;

    // TMA loads: this CTA's tensor maps (Q, K, V: 3 x 128 bytes) live in the first rows of the
    // output tile it writes last (the tile order below). No other CTA writes there (tiles are
    // disjoint), and that tile's epilogue runs only after every TMA transfer of this CTA has
    // landed (its consumers waited for all of them), so the maps are dead by then. That tile must
    // load something: the zeros of a tile with no visible key (causal, Sk < Sq) are written
    // without waiting for anything, possibly before the maps were even published (a race the
    // GPU tests caught). Null: cp.async.
    unsigned char* tmaps = nullptr;
#if TMA
    {
        const u32 grid = G, bid = blockIdx.x;
        const u32 per = P;
        const u32 units = BH * per;
        if (bid < units && Sk > 0) {
            const u32 u = (units - 1 - bid) / grid * grid + bid;  // this CTA's last unit
            const int last_bh = u / per, last_mb = u % per;
            const int rows = min(bm, Sq - last_mb * bm);
            const bool loads = !CAUSAL || last_mb * bm + bm + causal_off > 0;  // n_blocks > 0
            unsigned char* g = reinterpret_cast<unsigned char*>(O + ((long long)last_bh * Sq + (long long)last_mb * bm) * D);
            if (loads && rows * D * 2 >= 3 * 128 && ((u64)g & 63) == 0) tmaps = g;
        }
    }
#endif
    const bool use_tma = tmaps != nullptr;

    if (threadIdx.x == 0) {
        for (int q = 0; q < Q_BUFFERS; ++q) {
            mbar_init(BAR_Q_FULL(q), use_tma ? 1 : 128);  // one expect_tx arrival, or 128 cp.async ones
            mbar_init(BAR_Q_EMPTY(q), 4 * nc);  // consumer barriers: one arrival per consumer warp
        }
        for (int s = 0; s < STAGES; ++s) {
            // loads (as for Q) + (BIAS_MODE 2) 128 plain arrivals for the key bias
            // (KV_ONE_FULL: the K and the V loads' arrivals on one barrier)
            mbar_init(BAR_FULL_K(s), (KV_ONE_FULL ? 2 : 1) * (use_tma ? 1 : 128) + (BIAS_MODE == 2 ? 128 : 0));
            if (!KV_ONE_FULL) mbar_init(BAR_FULL_V(s), use_tma ? 1 : 128);
            mbar_init(BAR_EMPTY_K(s), 4 * nc);
            mbar_init(BAR_EMPTY_V(s), 4 * nc);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
#if ONES_SUM
    // the ones tile: row r's 16-byte unit 0 of its 128-byte swizzle row (what an n72 wgmma reads)
    for (int r = threadIdx.x; r < BLOCK_N; r += NTHREADS) {
        const u32 one2 = OPTFUSE_DTYPE == 1 ? 0x3C003C00u : 0x3F803F80u;
        *reinterpret_cast<uint4*>(smem_raw + (base + OFF_ONES - raw) + r * 128 + ((r & 7) << 4)) =
            make_uint4(one2, one2, one2, one2);
    }
    fence_proxy_async();
#endif
    __syncthreads();

    // Tile order: no dynamic scheduler (it would need a global counter, and QDP kernels get no
    // scratch memory); a fixed assignment that keeps K/V reuse in L2 and the CTAs' work even.
#if CAUSAL
    // Causal: head-major pairs. CTA i takes pairs i, i + G, ...; pair q = (head q / P, k = q % P)
    // is query blocks num_m - 1 - k and k of one head, so every pair costs num_m + 1 key blocks
    // (balanced without ordering tiles by cost), and the CTAs running together share a few heads'
    // K/V in L2. (Heaviest-first order over all heads had each of the 132 CTAs read another
    // head's K/V: at B * H = 512 that kernel was bound by HBM traffic, 15-20 % slower.)
#define TILE_LOOP for (int r = 0; (r >> 1) * G < BH * P; ++r)
#define TILE_INDEX                                                                                   \
    const int pair = (r >> 1) * G + (int)blockIdx.x;                                               \
    if (pair >= BH * P) continue;                                                                  \
    const int pk = pair % P;                                                                       \
    if ((r & 1) && pk == num_m - 1 - pk) continue; /* odd num_m: the middle block has no partner */ \
    const int bh = pair / P;                                                                       \
    const int mb = (r & 1) ? pk : num_m - 1 - pk;
#else
    // Non-causal: CTA i takes tiles i, i + G, ... with the query block fastest, so the CTAs running
    // together read the same heads' K/V from L2.
#define TILE_LOOP for (int r = 0; r * G < n_tiles; ++r)
#define TILE_INDEX                                                                                   \
    const int tile = r * G + (int)blockIdx.x;                                                      \
    if (tile >= n_tiles) continue;                                                                 \
    const int bh = tile / num_m;                                                                   \
    const int mb = tile % num_m;
#endif
#define TILE_COORDS                                                                                  \
    TILE_INDEX                                                                                     \
    const int m0 = mb * bm;                                                                        \
    const int b = bh / H, h = bh % H;                                                              \
    const int kvh = b * Hkv + h / (H / Hkv); /* GQA: index the shared kv head, never copy it */  \
    const int kv_end = CAUSAL ? min(Sk, m0 + bm + causal_off) : Sk;                                \
    const int n_blocks = kv_end > 0 ? (kv_end + BLOCK_N - 1) / BLOCK_N : 0;                        \
    (void)b; (void)kvh;

    if (wg == 0) {
        // ================= producer warpgroup: per tile Q, then the K/V ring =================
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(PRODUCER_REGS));
        const int ptid = threadIdx.x;
#if TMA
        if (use_tma) {
            // One thread issues every copy; the other warps have nothing to do unless they load
            // the key bias.
            if (BIAS_MODE != 2 && !PROFILE && ptid >= 32) return;
            if (ptid < 32) {
                // Build the three maps in Q slot 0 (free until the first Q load, below) and
                // publish them; then fence: TMA will write that slot (async proxy) after these
                // generic writes.
                const u32 stage = Q_SLOT(0);
                const int B = BH / H;
                for (int i = 0; i < 3; ++i)
                    asm volatile("st.shared.u32 [%0], %1;" ::"r"(stage + 128 * i + 4 * ptid), "r"(0u) : "memory");
                __syncwarp();
                if (ptid == 0) {
                    tmap_encode(stage, Q, Sq, BH, 64);  // Q: one 64-row box per consumer warpgroup
                    tmap_encode(stage + 128, K, Sk, B * Hkv, BLOCK_N);
                    tmap_encode(stage + 256, V, Sk, B * Hkv, BLOCK_N);
                }
                __syncwarp();
                for (int i = 0; i < 3; ++i) tmap_publish(tmaps + 128 * i, stage + 128 * i);
                fence_proxy_async();
                __syncwarp();
            }
        }
#endif
        PROF_DECL
        int it = 0, tc = 0;  // K/V tiles and Q tiles loaded so far (ring positions and phases)
        TILE_LOOP {
            TILE_COORDS
            if (n_blocks == 0) continue;  // every row of this tile is dead: nothing to load
            // Two Q buffers: this tile's Q loads while the consumers still work on the previous tile.
            const int qs = tc % Q_BUFFERS;
            PROF(PR_POST)
            mbar_wait(BAR_Q_EMPTY(qs), ((tc / Q_BUFFERS) & 1) ^ 1);
            PROF(PR_WAIT_Q)
            if (use_tma) {
                if (ptid == 0) {
                    mbar_expect_tx(BAR_Q_FULL(qs), nc * 64 * D * 2);
                    for (int w = 0; w < nc; ++w)  // one 64-row box per active consumer warpgroup
                        tma_load_rows(Q_SLOT(qs) + w * (64 * 128), BLOCK_M * 128, tmaps, m0 + 64 * w, bh, BAR_Q_FULL(qs));
                }
            } else {
                load_tile<BLOCK_M>(Q_SLOT(qs), Q + ((long long)bh * Sq + m0) * D, min(Sq - m0, bm), ptid);
                cp_async_arrive(BAR_Q_FULL(qs));
            }
            ++tc;
            PROF_COUNT(PR_TILES);
            PROF(PR_ISSUE)
            const u16* k_g = K + (long long)kvh * Sk * D;
            const u16* v_g = V + (long long)kvh * Sk * D;
            for (int j = 0; j < n_blocks; ++j, ++it) {
                const int s = it % STAGES;
                const u32 ph = (it / STAGES) & 1;
                const int kv0 = j * BLOCK_N;
                PROF(PR_POST)
                mbar_wait(BAR_EMPTY_K(s), ph ^ 1);  // a fresh barrier passes parity 1 at once
                PROF(PR_WAIT_KV)
                if (use_tma) {
                    if (ptid == 0) tma_load_kv(base + OFF_K + s * KV_BYTES, tmaps + 128, kv0, kvh, BAR_FULL_K(s));
                } else {
                    load_tile<BLOCK_N>(base + OFF_K + s * KV_BYTES, k_g + (long long)kv0 * D, Sk - kv0, ptid);
                    cp_async_arrive(BAR_FULL_K(s));
                }
#if BIAS_MODE == 2
                {
                    // key bias of this tile, fp32 in log2 units; finfo.min-like values stay as they
                    // are (times log2(e) they would overflow to -inf, turning "masked" into "-inf").
                    const int col = kv0 + ptid;
                    float bv = 0.f;
                    if (col < Sk) bv = bias_to_float(Bias, (BIAS_BATCH ? (long long)b * Sk : 0) + col);
                    bias_ring[s * BLOCK_N + ptid] = bv < -2.0e38f ? bv : bv * 1.4426950408889634f;
                    mbar_arrive(BAR_FULL_K(s));  // BLOCK_N == 128 == producer threads
                }
#endif
                PROF(PR_ISSUE)
                mbar_wait(BAR_EMPTY_V(s), ph ^ 1);
                PROF(PR_WAIT_KV)
                if (use_tma) {
                    if (ptid == 0) tma_load_kv(base + OFF_V + s * KV_BYTES, tmaps + 256, kv0, kvh, BAR_FULL_V(s));
                } else {
                    load_tile<BLOCK_N>(base + OFF_V + s * KV_BYTES, v_g + (long long)kv0 * D, Sk - kv0, ptid);
                    cp_async_arrive(BAR_FULL_V(s));
                }
                PROF_COUNT(PR_BLOCKS);
                PROF(PR_ISSUE)
            }
        }
        asm volatile("cp.async.wait_all;" ::: "memory");
        PROF_STORE
    } else {
        // ================= consumer warpgroups: 64 query rows each =================
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(CONSUMER_REGS));
        const int cw = wg - 1;
        if (cw >= nc) return;  // a consumer warpgroup that sits out (ACTIVE_CONSUMERS)
        PROF_DECL
        const int t = threadIdx.x % 128, warp = t / 32, lane = t % 32, q4 = lane % 4;
        const int row_in_tile = cw * 64 + warp * 16 + lane / 4;  // this thread's rows: +0 and +8
        const u32 q_wg = cw * 64 * 128;  // this warpgroup's rows inside each Q chunk
        int it = 0, tc = 0;
        if (cw == nc - 1) named_arrive(1);  // warpgroup 0 issues first
        TILE_LOOP {
            TILE_COORDS
            const int r0 = m0 + row_in_tile, r1 = r0 + 8;
            // keys visible to each row: < Sk and (causal) <= row + causal_off
            const int lim0 = CAUSAL ? min(Sk - 1, r0 + causal_off) : Sk - 1;
            const int lim1 = CAUSAL ? min(Sk - 1, r1 + causal_off) : Sk - 1;
            // blocks below n_clean need no mask for any row of the tile
            int n_clean = Sk / BLOCK_N;
            if (CAUSAL) n_clean = min(n_clean, max(m0 + causal_off + 1, 0) / BLOCK_N);

            float o[O_REGS];
#pragma unroll
            for (int i = 0; i < O_REGS; ++i) o[i] = 0.f;
            float s[64];
            u32 p[8][4];
            float m_0 = NEG_INF, m_1 = NEG_INF, l0 = 0.f, l1 = 0.f, a0, a1;
            int qs = -1;  // the Q slot this tile uses (none when every row is dead)

            if (n_blocks > 0) {
                qs = tc % Q_BUFFERS;
                const u32 q_tile = Q_SLOT(qs) + q_wg;
                PROF(PR_POST)
                mbar_wait(BAR_Q_FULL(qs), (tc / Q_BUFFERS) & 1);
                PROF(PR_WAIT_Q)
                ++tc;
                // -- block 0: scores and softmax (nothing before it to overlap with) --
                {
                    const int s0 = it % STAGES;
                    KV_WAIT(BAR_FULL_K(s0), (it / STAGES) & 1);
                    PROF(PR_WAIT_KV)
                    // cp.async writes are generic-proxy ones, so wgmma needs the fence; after TMA
                    // (async proxy) it is not needed, but branching on the CTA's load mode here
                    // made ptxas spill in the D = 128 key-padding build, and the fence costs ~0
                    // (README "Tuning" 34)
                    fence_proxy_async();
                    PROF(PR_FENCE)
                    TURN_WAIT(cw);
                    PROF(PR_TURN)
                    wgmma_fence();
                    issue_qk(s, q_tile, base + OFF_K + s0 * KV_BYTES);
                    wgmma_commit();
                    PROF(PR_ISSUE)
                    TURN_PASS(cw);
                    PROF(PR_PASS)
                    wgmma_wait<0>();
                    fence_regs(s);
                    PROF(PR_WAIT_S)
                    if (0 >= n_clean) apply_mask(s, 0, lim0, lim1, q4);
#if SOFTMAX_STREAM
                    {
                        float ms0, ms1;
                        softmax_max<true>(s, m_0, m_1, ms0, ms1, a0, a1, bias_ring + s0 * BLOCK_N, q4);
                        softmax_exp_pack<true>(s, p, ms0, ms1, a0, a1, l0, l1);
                    }
                    mbar_arrive_warp(BAR_EMPTY_K(s0));
                    PROF(PR_SOFTMAX)
#else
                    softmax_block<true>(s, m_0, m_1, l0, l1, a0, a1, bias_ring + s0 * BLOCK_N, q4);
                    mbar_arrive_warp(BAR_EMPTY_K(s0));
                    PROF(PR_SOFTMAX)
                    pack_p(s, p);
#endif
                    PROF_COUNT(PR_BLOCKS);
                    PROF(PR_POST)
                }
                // -- steady state: issue S_j and O += P_{j-1} V_{j-1}; softmax S_j while PV runs --
                // (P V done: O and the P registers are free, and V's ring slot)
#define PV_DONE(stage)                                                                               \
    {                                                                                                \
        wgmma_wait<0>();                                                                             \
        fence_regs(o);                                                                               \
        fence_regs(p);                                                                               \
        PROF(PR_WAIT_PV)                                                                             \
        mbar_arrive_warp(BAR_EMPTY_V(stage));                                                        \
    }
                for (int j = 1; j < n_blocks; ++j) {
                    const int sj = (it + j) % STAGES, sp = (it + j - 1) % STAGES;
                    KV_WAIT(BAR_FULL_K(sj), ((it + j) / STAGES) & 1);
                    if (!KV_ONE_FULL) KV_WAIT(BAR_FULL_V(sp), ((it + j - 1) / STAGES) & 1);
                    PROF(PR_WAIT_KV)
                    fence_proxy_async();
                    PROF(PR_FENCE)
                    TURN_WAIT(cw);
                    PROF(PR_TURN)
                    wgmma_fence();
                    issue_qk(s, q_tile, base + OFF_K + sj * KV_BYTES);
                    wgmma_commit();
                    issue_pv(o, p, base + OFF_V + sp * KV_BYTES, PV_LBO(sp));
                    wgmma_commit();
                    PROF(PR_ISSUE)
                    TURN_PASS(cw);
                    PROF(PR_PASS)
                    wgmma_wait<1>();  // S_j ready; PV still running
                    fence_regs(s);
                    PROF(PR_WAIT_S)
                    if (j >= n_clean) apply_mask(s, j * BLOCK_N, lim0, lim1, q4);
#if SOFTMAX_STREAM
                    float ms0, ms1;
                    const bool resc =
                        softmax_max<false>(s, m_0, m_1, ms0, ms1, a0, a1, bias_ring + sj * BLOCK_N, q4);
                    PROF(PR_SOFTMAX)
                    PV_DONE(sp);
                    // before the exponentials, not among them: unconditional there (alpha = 1 where
                    // the warp kept its maxima), it cost 5-8 % at D = 128 ("Tuning" 41)
                    if (resc) rescale(o, a0, a1);
                    softmax_exp_pack<false>(s, p, ms0, ms1, a0, a1, l0, l1);
                    mbar_arrive_warp(BAR_EMPTY_K(sj));
                    PROF(PR_SOFTMAX)
#else
                    const bool resc =
                        softmax_block<false>(s, m_0, m_1, l0, l1, a0, a1, bias_ring + sj * BLOCK_N, q4);
                    mbar_arrive_warp(BAR_EMPTY_K(sj));
                    PROF(PR_SOFTMAX)
                    PV_DONE(sp);
                    if (resc) rescale(o, a0, a1);
                    pack_p(s, p);
#endif
                    PROF_COUNT(PR_BLOCKS);
                    PROF(PR_POST)
                }
                // -- tail: the last block's O += P V --
                {
                    const int sp = (it + n_blocks - 1) % STAGES;
                    if (!KV_ONE_FULL) KV_WAIT(BAR_FULL_V(sp), ((it + n_blocks - 1) / STAGES) & 1);
                    PROF(PR_WAIT_KV)
                    fence_proxy_async();
                    PROF(PR_FENCE)
                    TURN_WAIT(cw);
                    PROF(PR_TURN)
                    wgmma_fence();
                    issue_pv(o, p, base + OFF_V + sp * KV_BYTES, PV_LBO(sp));
                    wgmma_commit();
                    PROF(PR_ISSUE)
                    TURN_PASS(cw);
                    PROF(PR_PASS)
                    wgmma_wait<0>();
                    fence_regs(o);
                    PROF(PR_WAIT_PV)
                    mbar_arrive_warp(BAR_EMPTY_V(sp));
                }
                it += n_blocks;
            }

            // -- epilogue: normalise; rows with no visible key (l = 0) give 0 --
#if ONES_SUM
            l0 = o[D / 2];
            l1 = o[D / 2 + 2];
#else
            l0 = quad_sum(l0);
            l1 = quad_sum(l1);
#endif
            float inv0 = l0 == 0.f ? 0.f : 1.f / l0;
            float inv1 = l1 == 0.f ? 0.f : 1.f / l1;
            float add = 0.f;
#if BIAS_MODE == 1
            {
                // A bias broadcast from one value c shifts every score equally, which softmax
                // ignores: only c = -inf (every score masked: 0) and NaN/+inf (NaN) change the result.
                const float c = bias_to_float(Bias, 0);
                if (c == NEG_INF) inv0 = inv1 = 0.f;
                else add = c * 0.f;
            }
#endif
            u16* o_g = O + (long long)bh * Sq * D;
            if (qs >= 0) {
                // (1) this thread's pairs into the warpgroup's 64 rows of its Q tile, in Q's
                // swizzled layout (a warp's 32 four-byte writes hit 32 different banks) ...
                unsigned char* q_rows = smem_raw + (Q_SLOT(qs) + q_wg - raw);
                const int rl0 = warp * 16 + lane / 4;  // row within the warpgroup's 64
#pragma unroll
                for (int n = 0; n < D / 8; ++n) {
                    const int chunk = n >> 3, u = n & 7;
                    unsigned char* c = q_rows + chunk * (BLOCK_M * 128);
                    *reinterpret_cast<u32*>(c + rl0 * 128 + ((u ^ (rl0 & 7)) << 4) + 4 * q4) =
                        pack2(fmaf(o[4 * n + 0], inv0, add), fmaf(o[4 * n + 1], inv0, add));
                    *reinterpret_cast<u32*>(c + (rl0 + 8) * 128 + ((u ^ (rl0 & 7)) << 4) + 4 * q4) =
                        pack2(fmaf(o[4 * n + 2], inv1, add), fmaf(o[4 * n + 3], inv1, add));
                }
                // this warpgroup only (ids after the turn-taking ones)
                asm volatile("bar.sync %0, 128;" ::"r"(1 + CONSUMERS + cw) : "memory");
                // (2) ... then out as whole 16-byte row pieces: consecutive threads, consecutive
                // addresses of a row.
                constexpr int UNITS = D / 8;
                const int row_base = m0 + cw * 64;
#pragma unroll
                for (int k = 0; k < 64 * UNITS / 128; ++k) {
                    const int i = t + 128 * k;
                    const int rl = i / UNITS, ug = i % UNITS;
                    const uint4 v = *reinterpret_cast<const uint4*>(
                        q_rows + (ug >> 3) * (BLOCK_M * 128) + rl * 128 + (((ug & 7) ^ (rl & 7)) << 4));
                    if (row_base + rl < Sq)
                        *reinterpret_cast<uint4*>(o_g + (long long)(row_base + rl) * D + ug * 8) = v;
                }
                // the slot may take the tile after next's Q; a TMA write (async proxy) after
                // these generic accesses needs the proxy fence first (harmless before cp.async)
                fence_proxy_async();
                mbar_arrive_warp(BAR_Q_EMPTY(qs));
            } else {
#pragma unroll
                for (int n = 0; n < D / 8; ++n) {
                    const int col = 8 * n + 2 * q4;
                    if (r0 < Sq)
                        *reinterpret_cast<u32*>(o_g + (long long)r0 * D + col) =
                            pack2(fmaf(o[4 * n + 0], inv0, add), fmaf(o[4 * n + 1], inv0, add));
                    if (r1 < Sq)
                        *reinterpret_cast<u32*>(o_g + (long long)r1 * D + col) =
                            pack2(fmaf(o[4 * n + 2], inv1, add), fmaf(o[4 * n + 3], inv1, add));
                }
            }
            PROF_COUNT(PR_TILES);
            PROF(PR_EPI)
        }
        if (cw == 0) named_sync(1);  // consume the last warpgroup's final hand-over
        PROF_STORE
    }
}
