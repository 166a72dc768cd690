// FlashAttention forward for Hopper (sm_90a) in CUDA C++: an FA3-style schedule behind the same
// launch contract as the Triton kernel (kernel.py).
//
//     o[b, h] = softmax(cap(scale * q[b, h] @ k[b, h // G]^T) (+ key bias) (+ causal / window mask)) @ v[b, h // G]
//
// q, o: [B, H, Sq, D]; k, v: [B, Hkv, Sk, D]; contiguous fp16/bf16; D in {64, 128}. FP8 (FlashAttention
// v3's FP8 form, D = 128): q, k E4M3 as above, v E4M3 transposed, [B, Hkv, D, Skv] (Skv = Sk rounded
// up to 16), float32 per-tensor scales, o fp16/bf16 (OPTFUSE_DTYPE).
// Arguments (TensorRT QDP order): q, k, v[, bias][, q_scale, k_scale, v_scale][, block_offsets,
// block_indices], H, Hkv, Sq, Sk, num_tiles[, nnz][, B] (int32), o[, map_q, map_k, map_v];
// num_tiles = cdiv(Sq, BLOCK_M) * B * H, grid = one CTA per SM (persistent). The layout arguments
// are BlockSparseAttention's (LAYOUT); B and the maps are HOST_MAPS builds' (TMA below).
//
// Sparsity (sm90/sparsity.cuh): a tile visits only the key blocks its rows can see -- the causal
// and window limits, the live range of a key-padding bias, the blocks a layout lists -- and masks
// only the blocks some row's limit cuts; the producer and the consumers derive the same block list
// from the same arguments.
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
// TMA with tensor maps the host encoded (HOST_MAPS: launch.py's run-time plan, which the classic
// plugin launches) or, in a QDP kernel (pointers and int32 scalars only), that each CTA builds on
// the device and keeps in output rows it alone writes, last (TMA below); the loads keep up as long
// as K/V come mostly from L2 (each 128 x 128 block is 128 FLOP per byte: from HBM alone the tensor
// cores would starve; see the tile order below).
//
// This file holds the configuration, the shared-memory layout and the kernel body (tile order,
// producer, consumers, epilogue) in one piece because both roles share the tile order, the
// barriers and the ring positions; the building blocks are in sm90/*.cuh by role.
//
// Compile-time specialization (-D): OPTFUSE_DTYPE (1 fp16, 2 bf16: q, k, v and o; FP8: o), FP8,
// HEAD_DIM (64|128), CAUSAL,
// BIAS_MODE (0 none, 1 scalar: a bias broadcast from one value, 2 key padding: [B|1, 1, 1, Sk]),
// BIAS_BATCH (key padding bias has a batch dim), BIAS_DTYPE (0 fp32, 1 fp16, 2 bf16),
// SCALE_LOG2 (scale * log2(e)), STAGES (K/V ring depth), CONSUMERS (2|3), TMA, HOST_MAPS, KV_ONE_FULL,
// SOFTMAX_STREAM, ONES_SUM (D = 64: the rows' sums of p from the tensor cores), WINDOW_LEFT /
// WINDOW_RIGHT / SOFTCAP_IN / SOFTCAP_LOG2 / LAYOUT / LAYOUT_HEADS (sm90/sparsity.cuh), PROFILE (per-phase
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
// FP8 (1): q, k, v in E4M3 with per-tensor scales (a value is the E4M3 number times its scale).
// Both products run E4M3 wgmma (k = 32 per instruction, twice the 16-bit rate); 8-bit operands
// have no transposed mode, so P V reads V^T, whose keys are contiguous (the contract's layout).
// q_scale * k_scale joins the score scale at run time; p is computed scaled by 448 (E4M3's
// largest value: small probabilities stay normal longer) and rounded on chip; v_scale comes in
// with 1 / l. Lazy rescaling runs at margin 0 (only blocks whose row maxima do not grow skip the O
// rescale): a margin would let p exceed 448.
#ifndef FP8
#define FP8 0
#endif
#if FP8
typedef unsigned char elem_t;  // E4M3 bits
#define ELEM_BYTES 1
#define P_LOG2_SCALE 8.807354922057604f  // log2(448)
#else
typedef u16 elem_t;
#define ELEM_BYTES 2
#endif
// One 128-byte swizzle chunk holds CHUNK_ELEMS elements of a row; a D-element row is D_CHUNKS of them.
#define CHUNK_ELEMS (128 / ELEM_BYTES)
#define D_CHUNKS (HEAD_DIM * ELEM_BYTES / 128)
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
// What turns a raw score into log2 units: scale * log2(e), or 1 after the soft-cap (sparsity.cuh
// apply_softcap, SOFTCAP_IN / SOFTCAP_LOG2 set by launch.py), which leaves log2 units itself.
#ifdef SOFTCAP_IN
#define SCORE_LOG2 1.0f
#else
#define SCORE_LOG2 SCALE_LOG2
#endif
#ifndef STAGES
#define STAGES 2
#endif
// Lazy rescaling (FlashAttention-4): a warp keeps its rows' running maxima while no row's block
// maximum exceeds its stored one by more than 2^LAZY_MARGIN (log2 units), so the O rescale (D / 2
// FMULs a thread) is skipped for most blocks. Exponents stay <= LAZY_MARGIN: p <= 2^8 fits
// fp16/bf16 and the fp32 sums; the final 1 / l cancels the stale offset. FP8: margin 0 (p is
// already scaled to E4M3's largest value, 448).
#define LAZY_MARGIN (FP8 ? 0 : 8)
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
// Host-encoded tensor maps (HOST_MAPS 1, with TMA): Q's, K's and V's maps come as __grid_constant__
// parameters after o (launch.py's plan encodes them, [B * H | B * Hkv, rows, D], FP8's V^T
// [B * Hkv, D, Sk] with rows Skv apart; the batch size B is the last int32 argument, for the
// launcher's extents). No CTA builds or publishes maps, none falls back to cp.async: building them
// took the producer about 1 us before its first load (the GEMM kernel's H100 probe, same code).
#ifndef HOST_MAPS
#define HOST_MAPS 0
#endif
#if HOST_MAPS && !TMA
#error "HOST_MAPS needs TMA"
#endif
// One "full" barrier per K/V ring stage (1): K_j and V_j complete the same barrier, so a consumer
// waits once per key block (for K_j, with V_j) instead of twice (K_j, then V_{j-1}); the "empty"
// barriers stay separate (K's slot is refilled before V's). It needs a third ring stage: with two,
// V_j can only load once P_{j-2} V_{j-2} is done, one block before S_j = Q K_j^T now waits for it
// (launch.py: on from 3 stages, README "Tried").
#ifndef KV_ONE_FULL
#define KV_ONE_FULL 0
#endif

// Softmax as one instruction stream (1; launch.py: D = 64, and D = 128 non-causal without a key
// bias). In the steady-state key loop, the wait for O += P_{j-1} V_{j-1} moves before the
// exponentials of block j (ptxas hoisted it there anyway), so the P registers are free during them
// and each group of exponentials is followed by its P packs. A MUFU op takes the unit 8 cycles per
// warp; interleaved, the FFMA / F2FP work issues in those gaps instead of before and after the 64
// exponentials, where Nsight Compute found the warps stalled on them (README "Tried"). The row
// maxima come from four partial chains instead of one.
#ifndef SOFTMAX_STREAM
#define SOFTMAX_STREAM 0
#endif

#if HEAD_DIM != 64 && HEAD_DIM != 128
#error "HEAD_DIM must be 64 or 128"
#endif
#define BLOCK_N 128  // keys per block: the score wgmma is m64n128k16 (FP8: k32)
// P V's k-steps per key block (16 keys per 16-bit wgmma, 32 per E4M3 one): P's A fragments
#define P_KSTEPS (BLOCK_N * ELEM_BYTES / 32)

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
#if FP8 && (HEAD_DIM != 128 || defined(SOFTCAP_IN) || SOFTMAX_STREAM || (defined(LAYOUT) && LAYOUT))
#error "FP8: D = 128 (one 128-byte chunk per row), no soft-cap, no softmax stream, no layout"
#endif
#define BLOCK_M (64 * CONSUMERS)         // query rows per CTA
#define D HEAD_DIM
#define NTHREADS (128 * (CONSUMERS + 1)) // producer warpgroup + consumer warpgroups
#if CONSUMERS == 2 && HEAD_DIM == 128 && ((BIAS_MODE == 2 && CAUSAL) || LAYOUT)
#define PRODUCER_REGS 64                 // 56 spilled the key-padding scan with the causal pairs, and the layout walk
#define CONSUMER_REGS 216                // 128 * 64 + 256 * 216 <= 64K registers
#elif CONSUMERS == 2
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
// "128B swizzle" descriptor: the tile's head dim is cut into 128-byte chunks (64 16-bit or 128
// E4M3 elements); chunk c holds all rows, row r at r * 128 bytes, its 16-byte unit u at position
// u ^ (r % 8), so the 8 rows a wgmma core matrix reads hit 8 different bank groups. Chunks are
// 1024-byte aligned. FP8's V^T tile is [D rows, BLOCK_N keys], one chunk. A Q slot holds 16-bit
// rows whatever the input type: the epilogue stages o (fp16/bf16) through it.
#define Q_BYTES (BLOCK_M * D * 2)
#define KV_BYTES (BLOCK_N * D * ELEM_BYTES)
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

// The kernel's building blocks, by role (each needs the configuration above; inlined by the
// kernel build, optfuse.kernels.artifact.KernelSource.source_text).
#include "../common/sm90.cuh"  // WG_TY, mbarriers, proxy fence, tensor-map publishing, wgmma fences, descriptors
#include "sm90/profile.cuh"   // PROFILE cycle counters (compiled out of shipped builds)
#include "sm90/barriers.cuh"  // mbarriers, proxy fence, turn-taking named barriers
#include "sm90/loads.cuh"     // producer: TMA (device-built or host maps), cp.async fallback
#include "sm90/wgmma.cuh"     // mainloop MMAs: descriptors, wgmma, S = Q K^T and O += P V
#if FP8
#include "../common/e4m3.cuh"  // e4m3x2: two floats -> two E4M3 bytes
#endif
#include "sm90/softmax.cuh"   // consumers: online softmax, rescale, packing
#include "sm90/sparsity.cuh"  // the key blocks a tile visits (windows, key padding, layouts), masks, soft-cap

// Key padding (KEYPAD_SLOTS): the producer scans the key-padding row of a tile's batch
// (sparsity.cuh live_key_range; again only when the batch changes between the CTA's tiles),
// narrows the tile's blocks to its live range and hands them to the consumers in the tile's Q
// slot record (written before an extra arrival on the Q "full" barrier, so the consumers' wait
// orders it), so they neither scan nor wait for a scan. Without a key-padding bias (or with a
// layout) the range is (Sk, -1): none, and every role computes the blocks itself.
#define KEYPAD_SLOTS (BIAS_MODE == 2 && !LAYOUT)
#if KEYPAD_SLOTS
// With TMA and a row per batch, warps 1-3 scan the next tile's row during a tile with no key bias
// to load, which they sit out (kp_ahead: that row's batch, into the other result slot); the
// tile-start barrier publishes it before the range is read.
#define KEYPAD_AHEAD (TMA && BIAS_BATCH)
#if KEYPAD_AHEAD
#define KEYPAD_RANGE                                                                                 \
    if (use_tma) PRODUCER_SYNC();                                                                  \
    if (b != kp_batch) {                                                                           \
        kp_batch = b;                                                                              \
        if (b == kp_ahead) kp_slot ^= 1;                                                           \
        else live_key_range<128>(Bias, (long long)b * Sk, Sk, ptid, live_red, kp_slot);            \
    }                                                                                              \
    kp_ahead = -1;                                                                                 \
    const KeyLive live = live_of(live_red, kp_slot);
#define KEYPAD_STATE int kp_batch = -1, kp_ahead = -1, kp_slot = 0;
#else
#define KEYPAD_RANGE                                                                                 \
    if ((BIAS_BATCH ? b : 0) != kp_batch) {                                                        \
        kp_batch = BIAS_BATCH ? b : 0;                                                             \
        live_key_range<128>(Bias, (long long)kp_batch * Sk, Sk, ptid, live_red, 0);                \
    }                                                                                              \
    const KeyLive live = live_of(live_red, 0);
#define KEYPAD_STATE int kp_batch = -1;
#endif
#else
#define KEYPAD_RANGE
#define KEYPAD_STATE const KeyLive live = {Sk, -1, false};
#endif
#if FP8
#define PACK_P(s, p) pack_p_fp8(s, p, q4)
#else
#define PACK_P(s, p) pack_p(s, p)
#endif
#if LAYOUT
#define LAYOUT_ARGS(h) , Offsets, Indices, nnz, (h)
#else
#define LAYOUT_ARGS(h)
#endif

// ---- the kernel --------------------------------------------------------------------------------
// Persistent: the grid is one CTA per SM (launch.py); each CTA walks a fixed list of tiles (a tile
// = BLOCK_M query rows of one (b, h); the order is set after the barriers). The producer runs
// ahead into the next tile (its Q and first K/V tiles load while the consumers finish the current
// one), which hides the per-tile prologue and epilogue that dominate short sequences.
extern "C" __global__ void __launch_bounds__(NTHREADS, 1) flash_attention_sm90(
    const elem_t* __restrict__ Q, const elem_t* __restrict__ K, const elem_t* __restrict__ V,
#if BIAS_MODE != 0
    const void* __restrict__ Bias,
#endif
#if FP8
    const float* __restrict__ QScale, const float* __restrict__ KScale, const float* __restrict__ VScale,
#endif
#if LAYOUT
    const int* __restrict__ Offsets, const int* __restrict__ Indices,
#endif
    int H, int Hkv, int Sq, int Sk, int num_tiles,
#if LAYOUT
    int nnz,
#endif
#if HOST_MAPS
    int batch,
#endif
    u16* __restrict__ O
#if PROFILE
    , u32* __restrict__ Prof
#endif
#if HOST_MAPS
    , const __grid_constant__ TensorMap map_q, const __grid_constant__ TensorMap map_k,
    const __grid_constant__ TensorMap map_v
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
#if KEYPAD_SLOTS
    __shared__ KeyBlocks tile_slot[Q_BUFFERS];  // the producer's narrowed blocks of each Q slot's tile
    __shared__ int live_red[24];                // live_key_range's reductions and two result slots
#endif

    // num_tiles counts BLOCK_M-row tiles (launch.py); with nc < CONSUMERS active consumer
    // warpgroups the tiles are bm = 64 * nc rows.
    const int nc = ACTIVE_CONSUMERS(Sq), bm = 64 * nc;
    const int BH = num_tiles / ((Sq + BLOCK_M - 1) / BLOCK_M);
    const int num_m = (Sq + bm - 1) / bm;
    const int n_tiles = num_m * BH;
    (void)n_tiles;
    const int causal_off = Sk - Sq;
    // V's keys per row: FP8's V^T rows are Skv = Sk rounded up to 16 long
    const int v_keys = FP8 ? (Sk + 15) / 16 * 16 : Sk;
    (void)v_keys;
    // warpgroup index, broadcast from lane 0 so that ptxas knows it is warp-uniform (without it,
    // values derived from it -- Q offsets, row limits -- were per-thread, and each branch on them
    // a divergent one: README "Tried")
    const int wg = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);

    // Tile order (below): CTA i takes units i, i + G, ... of BH * P, P units per head (causal:
    // pairs of query blocks, a pair ending with its light block; else query blocks).
    const int G = gridDim.x;
    const int P = CAUSAL ? (num_m + 1) / 2 : num_m;

#if HOST_MAPS
    (void)batch;
    constexpr bool use_tma = true;
#define TMAP_Q ((const void*)&map_q)
#define TMAP_K ((const void*)&map_k)
#define TMAP_V ((const void*)&map_v)
#else
    // TMA loads with device-built maps: this CTA's tensor maps (Q, K, V: 3 x 128 bytes) live in
    // the first rows of the output tile it writes last (the tile order below). No other CTA
    // writes there (tiles are disjoint), and that tile's epilogue runs only after every TMA
    // transfer of this CTA has landed (its consumers waited for all of them), so the maps are dead
    // by then. That tile must load something: the zeros of a tile with no visible key (causal,
    // Sk < Sq) are written without waiting for anything, possibly before the maps were even
    // published (a race the GPU tests caught). Null: cp.async.
    unsigned char* tmaps = nullptr;
#define TMAP_Q ((const void*)tmaps)
#define TMAP_K ((const void*)(tmaps + 128))
#define TMAP_V ((const void*)(tmaps + 256))
#if TMA
    {
        const u32 grid = G, bid = blockIdx.x;
        const u32 per = P;
        const u32 units = BH * per;
        if (bid < units && Sk > 0) {
            const u32 u = (units - 1 - bid) / grid * grid + bid;  // this CTA's last unit
            const int last_bh = u / per, last_mb = u % per;
            const int rows = min(bm, Sq - last_mb * bm);
            // that tile visits a key block (the live-range narrowing never empties a tile)
            const bool loads = tile_blocks(last_mb * bm, bm, Sq, Sk, causal_off, KeyLive{Sk, -1, false}
                                           LAYOUT_ARGS(last_bh % H)).n > 0;
            unsigned char* g = reinterpret_cast<unsigned char*>(O + ((long long)last_bh * Sq + (long long)last_mb * bm) * D);
            if (loads && rows * D * 2 >= 3 * 128 && ((u64)g & 63) == 0) tmaps = g;
        }
    }
#endif
    const bool use_tma = tmaps != nullptr;
#endif  // HOST_MAPS

    if (threadIdx.x == 0) {
#if HOST_MAPS
        // the maps' first use (the producer's first loads) finds them in the descriptor cache
        tmap_prefetch(&map_q);
        tmap_prefetch(&map_k);
        tmap_prefetch(&map_v);
#endif
        for (int q = 0; q < Q_BUFFERS; ++q) {
            // one expect_tx arrival, or 128 cp.async ones; + the tile_slot arrival (KEYPAD_SLOTS)
            mbar_init(BAR_Q_FULL(q), (use_tma ? 1 : 128) + KEYPAD_SLOTS);
            mbar_init(BAR_Q_EMPTY(q), 4 * nc);  // consumer barriers: one arrival per consumer warp
        }
        for (int s = 0; s < STAGES; ++s) {
            // loads (as for Q) + (BIAS_MODE 2) one arrival per producer warp for the key bias
            // (KV_ONE_FULL: the K and the V loads' arrivals on one barrier)
            mbar_init(BAR_FULL_K(s), (KV_ONE_FULL ? 2 : 1) * (use_tma ? 1 : 128) + (BIAS_MODE == 2 ? 4 : 0));
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
    // A CTA's unit is a pair: round r works on pair ROUND_UNIT(r), a new one every even round.
#define ROUND_UNIT(r) (((r) >> 1) * G + (int)blockIdx.x)
#define NEXT_ROUND_NEW_UNIT(r) ((r) & 1)  // round r + 1 starts another pair
#define UNIT_COUNT (BH * P)
#define UNIT_BH(u) ((u) / P)
#define TILE_LOOP for (int r = 0; (r >> 1) * G < UNIT_COUNT; ++r)
#define TILE_INDEX                                                                                   \
    const int pair = ROUND_UNIT(r);                                                                \
    if (pair >= UNIT_COUNT) continue;                                                              \
    const int pk = pair % P;                                                                       \
    if ((r & 1) && pk == num_m - 1 - pk) continue; /* odd num_m: the middle block has no partner */ \
    const int bh = UNIT_BH(pair);                                                                  \
    const int mb = (r & 1) ? pk : num_m - 1 - pk;
#else
    // Non-causal: CTA i takes tiles i, i + G, ... with the query block fastest, so the CTAs running
    // together read the same heads' K/V from L2. A CTA's unit is a tile, one a round.
#define ROUND_UNIT(r) ((r) * G + (int)blockIdx.x)
#define NEXT_ROUND_NEW_UNIT(r) true
#define UNIT_COUNT n_tiles
#define UNIT_BH(u) ((u) / num_m)
#define TILE_LOOP for (int r = 0; r * G < UNIT_COUNT; ++r)
#define TILE_INDEX                                                                                   \
    const int tile = ROUND_UNIT(r);                                                                \
    if (tile >= UNIT_COUNT) continue;                                                              \
    const int bh = UNIT_BH(tile);                                                                  \
    const int mb = tile % num_m;
#endif
// The (b, h) of round r + 1's tile where that round starts another unit, else -1 (the key-padding
// scan ahead, KEYPAD_AHEAD).
#define NEXT_TILE_BH(r) (NEXT_ROUND_NEW_UNIT(r) && ROUND_UNIT((r) + 1) < UNIT_COUNT ? UNIT_BH(ROUND_UNIT((r) + 1)) : -1)
#define TILE_COORDS                                                                                  \
    TILE_INDEX                                                                                     \
    const int m0 = mb * bm;                                                                        \
    const int b = bh / H, h = bh % H;                                                              \
    const int kvh = b * Hkv + h / (H / Hkv); /* GQA: index the shared kv head, never copy it */  \
    LIVE_UPDATE                                                                                    \
    KeyBlocks kbs = tile_blocks(m0, bm, Sq, Sk, causal_off, live LAYOUT_ARGS(h));                 \
    int n_blocks = kbs.n;                                                                          \
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
#if !HOST_MAPS
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
                    // Q: one 64-row box per consumer warpgroup
                    tmap_encode(stage, Q, D, Sq, BH, 64, D * ELEM_BYTES);
                    tmap_encode(stage + 128, K, D, Sk, B * Hkv, BLOCK_N, D * ELEM_BYTES);
#if FP8
                    tmap_encode(stage + 256, V, Sk, D, B * Hkv, D, v_keys);  // V^T: the keys are the columns
#else
                    tmap_encode(stage + 256, V, D, Sk, B * Hkv, BLOCK_N, D * 2);
#endif
                }
                __syncwarp();
                for (int i = 0; i < 3; ++i) tmap_publish(tmaps + 128 * i, stage + 128 * i);
                fence_proxy_async();
                __syncwarp();
            }
#endif
        }
#endif
        PROF_DECL
        int it = 0, tc = 0;  // K/V tiles and Q tiles loaded so far (ring positions and phases)
        KEYPAD_STATE
#define LIVE_UPDATE KEYPAD_RANGE
        TILE_LOOP {
            TILE_COORDS
            if (n_blocks == 0) continue;  // every row of this tile is dead: nothing to load
#if BIAS_MODE == 2
            // With TMA, warps 1-3 only load the key bias, and sit out the blocks of a tile that reads
            // none (below). This barrier keeps them from waiting on a ring slot more than one phase
            // ahead of it (a parity wait would pass): thread 0 has passed every earlier wait here.
            if (use_tma) {
#if KEYPAD_SLOTS && KEYPAD_AHEAD
                // (the tile-start barrier is KEYPAD_RANGE's) the next tile's batch where it is
                // another one (every thread the same)
                if (!kbs.bias) {
                    const int nbh = NEXT_TILE_BH(r);
                    if (nbh >= 0 && nbh / H != kp_batch) kp_ahead = nbh / H;
                }
#else
                PRODUCER_SYNC();
#endif
                if (!kbs.bias && ptid >= 32) {  // no key bias to load: thread 0 arrives for them
#if KEYPAD_SLOTS && KEYPAD_AHEAD
                    if (kp_ahead >= 0) live_key_range<96>(Bias, (long long)kp_ahead * Sk, Sk, ptid - 32, live_red, kp_slot ^ 1);
#endif
                    ++tc;
                    it += n_blocks;
                    continue;
                }
            }
#endif
            // Two Q buffers: this tile's Q loads while the consumers still work on the previous tile.
            const int qs = tc % Q_BUFFERS;
            PROF(PR_POST)
            mbar_wait(BAR_Q_EMPTY(qs), ((tc / Q_BUFFERS) & 1) ^ 1);
            PROF(PR_WAIT_Q)
            if (use_tma) {
                if (ptid == 0) {
                    mbar_expect_tx(BAR_Q_FULL(qs), nc * 64 * D * ELEM_BYTES);
                    for (int w = 0; w < nc; ++w)  // one 64-row box per active consumer warpgroup
                        tma_load_rows(Q_SLOT(qs) + w * (64 * 128), BLOCK_M * 128, TMAP_Q, m0 + 64 * w, bh, BAR_Q_FULL(qs));
                }
            } else {
                load_tile<BLOCK_M>(Q_SLOT(qs), Q + ((long long)bh * Sq + m0) * D, min(Sq - m0, bm), ptid);
                cp_async_arrive(BAR_Q_FULL(qs));
            }
#if KEYPAD_SLOTS
            if (ptid == 0) {  // the record, then the arrival that releases it to the consumers
                tile_slot[qs] = kbs;
                mbar_arrive(BAR_Q_FULL(qs));
            }
#endif
            ++tc;
            PROF_COUNT(PR_TILES);
            PROF(PR_ISSUE)
            const elem_t* k_g = K + (long long)kvh * Sk * D;
            const elem_t* v_g = V + (long long)kvh * v_keys * D;
#if LAYOUT
            int kb_next = n_blocks > 0 ? block_at(kbs, 0) : 0;  // the layout's indices, loaded a block ahead
#endif
            for (int j = 0; j < n_blocks; ++j, ++it) {
                const int s = it % STAGES;
                const u32 ph = (it / STAGES) & 1;
#if LAYOUT
                const int kv0 = kb_next * BLOCK_N;
                if (j + 1 < n_blocks) kb_next = block_at(kbs, j + 1);
#else
                const int kv0 = (kbs.first + j) * BLOCK_N;
#endif
                PROF(PR_POST)
                mbar_wait(BAR_EMPTY_K(s), ph ^ 1);  // a fresh barrier passes parity 1 at once
                PROF(PR_WAIT_KV)
                if (use_tma) {
                    if (ptid == 0) tma_load_kv(base + OFF_K + s * KV_BYTES, TMAP_K, kv0, kvh, BAR_FULL_K(s));
                } else {
                    load_tile<BLOCK_N>(base + OFF_K + s * KV_BYTES, k_g + (long long)kv0 * D, Sk - kv0, ptid);
                    cp_async_arrive(BAR_FULL_K(s));
                }
#if BIAS_MODE == 2
                {
                    // key bias of this tile, fp32 in log2 units; finfo.min-like values stay as they
                    // are (times log2(e) they would overflow to -inf, turning "masked" into "-inf").
                    // A tile narrowed to a pure key-padding range reads none (kbs.bias false).
                    if (kbs.bias) {
                        const int col = kv0 + ptid;  // BLOCK_N == 128 == producer threads: one key each
                        float bv = 0.f;
                        if (col < Sk) bv = bias_to_float(Bias, (BIAS_BATCH ? (long long)b * Sk : 0) + col);
                        bias_ring[s * BLOCK_N + ptid] = bv < -2.0e38f ? bv : bv * 1.4426950408889634f;
                        mbar_arrive_warp(BAR_FULL_K(s));
                    } else if (ptid == 0) {
                        mbar_arrive_count(BAR_FULL_K(s), 4);  // nothing written: one arrival for the 4 warps
                    }
                }
#endif
                PROF(PR_ISSUE)
                mbar_wait(BAR_EMPTY_V(s), ph ^ 1);
                PROF(PR_WAIT_KV)
#if FP8
                if (use_tma) {
                    if (ptid == 0) tma_load_vt(base + OFF_V + s * KV_BYTES, TMAP_V, kv0, kvh, BAR_FULL_V(s));
                } else {
                    load_vt_tile(base + OFF_V + s * KV_BYTES, v_g + kv0, v_keys, Sk - kv0, ptid);
                    cp_async_arrive(BAR_FULL_V(s));
                }
#else
                if (use_tma) {
                    if (ptid == 0) tma_load_kv(base + OFF_V + s * KV_BYTES, TMAP_V, kv0, kvh, BAR_FULL_V(s));
                } else {
                    load_tile<BLOCK_N>(base + OFF_V + s * KV_BYTES, v_g + (long long)kv0 * D, Sk - kv0, ptid);
                    cp_async_arrive(BAR_FULL_V(s));
                }
#endif
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
        const KeyLive live = {Sk, -1, false};  // the blocks of a key-padding tile come from the producer
        // raw score -> log2 units (FP8: the inputs' dequantization joins the score scale)
#if FP8
        const float sl2 = SCALE_LOG2 * (QScale[0] * KScale[0]);
        const float v_scale = VScale[0];
#else
        const float sl2 = SCORE_LOG2;
#endif
#undef LIVE_UPDATE
#define LIVE_UPDATE
        if (cw == nc - 1) named_arrive(1);  // warpgroup 0 issues first
        TILE_LOOP {
            TILE_COORDS  // (narrowing never empties a tile: n_blocks > 0 is decided without the scan)
            const int r0 = m0 + row_in_tile, r1 = r0 + 8;

            float o[O_REGS];
#pragma unroll
            for (int i = 0; i < O_REGS; ++i) o[i] = 0.f;
            float s[64];
            u32 p[P_KSTEPS][4];
            float m_0 = NEG_INF, m_1 = NEG_INF, l0 = 0.f, l1 = 0.f, a0, a1;
            int qs = -1;  // the Q slot this tile uses (none when every row is dead)

            if (n_blocks > 0) {
                qs = tc % Q_BUFFERS;
                const u32 q_tile = Q_SLOT(qs) + q_wg;
                PROF(PR_POST)
                mbar_wait(BAR_Q_FULL(qs), (tc / Q_BUFFERS) & 1);
                PROF(PR_WAIT_Q)
                ++tc;
#if KEYPAD_SLOTS
                kbs = tile_slot[qs];
                n_blocks = kbs.n;
#endif
                // keys visible to each row: [low, lim] with lim < Sk, (causal) <= row + causal_off,
                // (right window) <= row + causal_off + WINDOW_RIGHT, a pure key-padding range's
                // last key, and low: (left window) row + causal_off - WINDOW_LEFT, the range's
                // first key; blocks kbs.clean_lo <= kb < kbs.clean_hi need no mask
                int lim0 = Sk - 1, lim1 = Sk - 1;
                if (CAUSAL) lim0 = min(lim0, r0 + causal_off), lim1 = min(lim1, r1 + causal_off);
                if (WINDOW_RIGHT >= 0)
                    lim0 = min(lim0, r0 + causal_off + WINDOW_RIGHT), lim1 = min(lim1, r1 + causal_off + WINDOW_RIGHT);
                lim0 = min(lim0, kbs.key_hi), lim1 = min(lim1, kbs.key_hi);
                int low0 = kbs.key_lo, low1 = kbs.key_lo;
                if (WINDOW_LEFT >= 0)
                    low0 = max(low0, r0 + causal_off - WINDOW_LEFT), low1 = max(low1, r1 + causal_off - WINDOW_LEFT);
#define MASK_BLOCK(kb)                                                                               \
    if ((kb) < kbs.clean_lo || (kb) >= kbs.clean_hi) apply_mask(s, (kb) * BLOCK_N, lim0, lim1, low0, low1, q4);
                // -- block 0: scores and softmax (nothing before it to overlap with) --
                {
                    const int s0 = it % STAGES;
                    KV_WAIT(BAR_FULL_K(s0), (it / STAGES) & 1);
                    PROF(PR_WAIT_KV)
                    // cp.async writes are generic-proxy ones, so wgmma needs the fence; after TMA
                    // (async proxy) it is not needed, but branching on the CTA's load mode here
                    // made ptxas spill in the D = 128 key-padding build, and the fence costs ~0
                    // (README "Tried")
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
                    apply_softcap(s);
                    MASK_BLOCK(block_at(kbs, 0))
#if SOFTMAX_STREAM
                    {
                        float ms0, ms1;
                        if (kbs.bias) {
                            softmax_max<true, true>(s, m_0, m_1, ms0, ms1, a0, a1, bias_ring + s0 * BLOCK_N, q4, sl2);
                            softmax_exp_pack<true, true>(s, p, ms0, ms1, a0, a1, l0, l1, sl2);
                        } else {
                            softmax_max<true, false>(s, m_0, m_1, ms0, ms1, a0, a1, bias_ring, q4, sl2);
                            softmax_exp_pack<true, false>(s, p, ms0, ms1, a0, a1, l0, l1, sl2);
                        }
                    }
                    mbar_arrive_warp(BAR_EMPTY_K(s0));
                    PROF(PR_SOFTMAX)
#else
                    if (kbs.bias)
                        softmax_block<true, true>(s, m_0, m_1, l0, l1, a0, a1, bias_ring + s0 * BLOCK_N, q4, sl2);
                    else
                        softmax_block<true, false>(s, m_0, m_1, l0, l1, a0, a1, bias_ring, q4, sl2);
                    mbar_arrive_warp(BAR_EMPTY_K(s0));
                    PROF(PR_SOFTMAX)
                    PACK_P(s, p);
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
#if LAYOUT
                int kb_next = n_blocks > 1 ? block_at(kbs, 1) : 0;  // loaded a block ahead
#endif
                for (int j = 1; j < n_blocks; ++j) {
                    const int sj = (it + j) % STAGES, sp = (it + j - 1) % STAGES;
#if LAYOUT
                    const int kb = kb_next;
                    if (j + 1 < n_blocks) kb_next = block_at(kbs, j + 1);
#else
                    const int kb = kbs.first + j;
#endif
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
                    apply_softcap(s);
                    MASK_BLOCK(kb)
#if SOFTMAX_STREAM
                    float ms0, ms1;
                    const bool resc =
                        kbs.bias ? softmax_max<false, true>(s, m_0, m_1, ms0, ms1, a0, a1, bias_ring + sj * BLOCK_N, q4, sl2)
                                 : softmax_max<false, false>(s, m_0, m_1, ms0, ms1, a0, a1, bias_ring, q4, sl2);
                    PROF(PR_SOFTMAX)
                    PV_DONE(sp);
                    // before the exponentials, not among them: unconditional there (alpha = 1 where
                    // the warp kept its maxima), it cost 5-8 % at D = 128 (README "Tried")
                    if (resc) rescale(o, a0, a1);
                    if (kbs.bias)
                        softmax_exp_pack<false, true>(s, p, ms0, ms1, a0, a1, l0, l1, sl2);
                    else
                        softmax_exp_pack<false, false>(s, p, ms0, ms1, a0, a1, l0, l1, sl2);
                    mbar_arrive_warp(BAR_EMPTY_K(sj));
                    PROF(PR_SOFTMAX)
#else
                    const bool resc =
                        kbs.bias ? softmax_block<false, true>(s, m_0, m_1, l0, l1, a0, a1, bias_ring + sj * BLOCK_N, q4, sl2)
                                 : softmax_block<false, false>(s, m_0, m_1, l0, l1, a0, a1, bias_ring, q4, sl2);
                    mbar_arrive_warp(BAR_EMPTY_K(sj));
                    PROF(PR_SOFTMAX)
                    PV_DONE(sp);
                    if (resc) rescale(o, a0, a1);
                    PACK_P(s, p);
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
#if FP8
            float inv0 = l0 == 0.f ? 0.f : v_scale / l0;  // p's 448 cancels in O / l
            float inv1 = l1 == 0.f ? 0.f : v_scale / l1;
#else
            float inv0 = l0 == 0.f ? 0.f : 1.f / l0;
            float inv1 = l1 == 0.f ? 0.f : 1.f / l1;
#endif
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
