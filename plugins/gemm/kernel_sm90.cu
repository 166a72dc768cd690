// GEMM with a fused epilogue for Hopper (sm_90a) in CUDA C++, behind the same launch contract as
// the Triton kernel (kernel.py):
//
//     GemmEpilogue: y = act(alpha A W^T + bias [+ residual]) [+ residual]
//     GatedGemm:    y = act(A W_gate^T) * (A W_up^T)
//
// A: [M, K], W / W_gate / W_up: [N, K], y (and residual): [M, N]; contiguous fp16/bf16, fp32
// accumulation. Arguments (TensorRT QDP order): A, W (GatedGemm: A, W_gate, W_up)[, bias]
// [, residual], M (int32), y. Grid: one CTA per SM (persistent), 384 threads.
//
// Schedules (PINGPONG, EPILOGUE_WG; launch.py's sm90_schedules picks one per shape class, from the H200 table):
// Cooperative (CUTLASS's "warp-specialized cooperative" kernel):
//   * one producer warpgroup: a single thread streams the A and W boxes of every k-block of every
//     tile of this CTA into a STAGES-deep shared-memory ring with TMA, guarded by mbarriers;
//   * two consumer warpgroups share each 128 x 256 tile, 64 rows each, and issue m64n256k16 wgmma
//     from the ring (both operands K-major: W is stored [N, K] for this); a k-block's slot is given
//     back once the next k-block's MMAs are issued and the previous ones have completed;
//   * the epilogue (sm90/epilogue.cuh) works on the accumulators in registers and writes y
//     through shared memory, while the producer already fills the ring with the next tile's
//     first k-blocks; the tensor cores wait for it.
// Pingpong (GemmEpilogue; CUTLASS's "ping-pong" kernel): each consumer warpgroup owns whole
//   128 x 128 tiles, the CTA's tiles taken in turn; the ring delivers them in order, so one
//   warpgroup's epilogue runs while the other's MMAs use the tensor cores. A full residual is
//   copied into the epilogue stage by the warpgroup itself (cp.async) when its tile starts.
// Epilogue warps (EPILOGUE_WG; sm90/epilogue_wg.cuh): the cooperative tiles and mainloop, but the
//   consumers hand every tile except the CTA's last over to warps 1-3 of the producer's warpgroup
//   through a 64 KB shared-memory tile and go straight on to the next tile's MMAs; those warps apply
//   the epilogue and write y. The hand-over takes the room of one ring stage.
// Split-K (SPLIT_K > 1, pingpong tiles; launch.py's launch_plan picks it at run time when M leaves
//   most SMs without a tile): each tile's K range in SPLIT_K units spread over the CTAs; units write
//   fp32 partial tiles to the workspace and a second kernel, gemm_sm90_splitk_reduce
//   (sm90/splitk_reduce.cuh), adds them and applies the epilogue.
// Narrow tiles (NARROW; launch.py's launch_plan, for small M): the cooperative schedule on
//   128 x 128 tiles.
// 128 x 192 tiles (TILE_N 192; launch.py's launch_plan, where M and N give 128 x 256 tiles a
//   badly filled last wave of the grid): the cooperative schedule on 128 x 192 tiles.
//
// Tiles (cooperative; ping-pong: 128 x 128): 128 rows of A by 256 rows of W. GemmEpilogue: 256
// output columns. GatedGemm: W rows 0-127 of the tile are W_gate's rows n0..n0+127 and rows
// 128-255 are W_up's same rows, so one thread holds the gate and the up value of each output (128
// output columns): neither GEMM's result reaches memory.
//
// FP8 (IN_FP8 1, cooperative schedule): A and the weights are E4M3 (128 values a k-block: the same
// 128-byte swizzle rows; m64n128k32 wgmma on each half of the tile's W rows, every k-block's
// partial sum promoted into the fp32 accumulator), which is scaled by a_scale * w_scale[n]
// (W_SCALE_MODE 1 one value, 2 [N]; GatedGemm: the gate's and the up weights' own scales) before
// alpha and the rest of the epilogue; y, bias and residual are OPTFUSE_DTYPE. Arguments then: A, W
// (GatedGemm: A, W_gate, W_up)[, bias][, residual], a_scale, the weight scale(s), M, y.
//
// Compile-time specialization (-D, launch_sm90.py): OPTFUSE_DTYPE (1 fp16, 2 bf16: y's type, and
// A's unless IN_FP8), IN_FP8, W_SCALE_MODE, N_DIM, K_DIM (static), GATED, ACTIVATION
// (sm90/epilogue.cuh), BIAS_MODE (0 none, 1 scalar, 2 [N]), RESIDUAL_MODE (0 none, 1 scalar, 2
// [M, N]), RESIDUAL_BEFORE, ALPHA, STAGES, GROUP_M, PINGPONG, EPILOGUE_WG, SPLIT_K, NARROW, TILE_N,
// HOST_MAPS (the tensor maps as parameters after y: map_a, map_w[, map_residual]).
// Needs sm_90a (wgmma, setmaxnreg).

typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short u16;
#ifndef IN_FP8
#define IN_FP8 0
#endif
#ifndef W_SCALE_MODE
#define W_SCALE_MODE 0
#endif
#if IN_FP8
typedef unsigned char in_t;  // E4M3 bits
#define IN_BYTES 1
#else
typedef u16 in_t;
#define IN_BYTES 2
#endif

#ifndef OPTFUSE_DTYPE
#define OPTFUSE_DTYPE 1
#endif
#ifndef GATED
#define GATED 0
#endif
#ifndef ACTIVATION
#define ACTIVATION 0
#endif
#ifndef BIAS_MODE
#define BIAS_MODE 0
#endif
#ifndef RESIDUAL_MODE
#define RESIDUAL_MODE 0
#endif
#ifndef RESIDUAL_BEFORE
#define RESIDUAL_BEFORE 0
#endif
#ifndef ALPHA
#define ALPHA 1.0f
#endif
#ifndef STAGES
#define STAGES 4
#endif
// Tile order: GROUP_M row blocks of A sweep all column blocks before the next group starts, so
// the CTAs running at once read few distinct A rows and W stays in L2.
#ifndef GROUP_M
#define GROUP_M 8
#endif
#if !defined(N_DIM) || !defined(K_DIM)
#error "define N_DIM and K_DIM"
#endif
#if GATED && (BIAS_MODE || RESIDUAL_MODE)
#error "GatedGemm has no bias or residual"
#endif

#ifndef PINGPONG
#define PINGPONG 0
#endif
#if PINGPONG && GATED
#error "GatedGemm runs the cooperative schedule"
#endif
// Tensor maps (HOST_MAPS 1; launch.py's run-time plans, which the classic plugin launches): A's, W's
// and a TMA residual's maps come encoded by the host (cuTensorMapEncodeTiled) as __grid_constant__
// parameters after y. HOST_MAPS 0 (QDP's AOT path: pointers and int32 scalars only): each CTA
// builds them (sm90/tma.cuh), which takes its producer about 1 us before the first load (H100 probe).
#ifndef HOST_MAPS
#define HOST_MAPS 0
#endif
#if IN_FP8 && (PINGPONG || EPILOGUE_WG || !W_SCALE_MODE)
#error "FP8 runs the cooperative schedule, with its weight scales"
#endif
#ifndef EPILOGUE_WG
#define EPILOGUE_WG 0
#endif
// Split-K (pingpong only; launch.py's launch_plan, for M too small to give every SM a tile): the
// K_BLOCKS k-blocks of a tile in SPLIT_K equal ranges, each a work unit of its own; a unit writes
// its fp32 partial tile to the workspace (y's pointer: SPLIT_K planes of [M, N] fp32) and
// gemm_sm90_splitk_reduce (sm90/splitk_reduce.cuh) adds the planes and applies the epilogue.
#ifndef SPLIT_K
#define SPLIT_K 1
#endif
#if SPLIT_K > 1 && !PINGPONG
#error "split-K runs the pingpong schedule"
#endif
#if EPILOGUE_WG && PINGPONG
#error "the epilogue warps serve the cooperative schedule"
#endif
// Narrow tiles (NARROW 1, GemmEpilogue at 16 bits; launch.py's launch_plan, for M whose 128 x 256
// tiles would leave most SMs idle): the cooperative schedule on 128 x 128 tiles, m64n128k16 per
// consumer warpgroup. Where a pingpong CTA has one tile, one warpgroup issues both 64-row slabs and
// then runs the whole epilogue alone; here both warpgroups share the tile, so each issues half the
// MMAs and runs half the epilogue. A full residual comes by cp.async (the third tensor map would not
// fit in a 128-column tile row).
#ifndef NARROW
#define NARROW 0
#endif
#if NARROW && (PINGPONG || EPILOGUE_WG || GATED || IN_FP8)
#error "narrow tiles: the cooperative schedule of a 16-bit GemmEpilogue"
#endif
// Tile width (TILE_N 192, GemmEpilogue at 16 bits on the cooperative schedule; launch.py's
// launch_plan): with N = 768 at M = 4096 the 96 tiles of 128 x 256 leave 36 of 132 SMs idle and
// 128 of 128 x 192 fill 128; the wave takes three quarters of the time. m64n192k16 per consumer
// warpgroup, 96 accumulator registers; the epilogue passes over the whole 192 columns at once.
#ifndef TILE_N
#define TILE_N (PINGPONG || NARROW ? 128 : 256)
#endif
#if TILE_N == 192 && (PINGPONG || NARROW || EPILOGUE_WG || GATED || IN_FP8 || SPLIT_K > 1)
#error "128 x 192 tiles: the cooperative schedule of a 16-bit GemmEpilogue"
#endif
#if TILE_N != 192 && TILE_N != (PINGPONG || NARROW ? 128 : 256)
#error "TILE_N: 192, or the schedule's own width"
#endif
#define BLOCK_M 128                      // rows of A per tile (cooperative: 64 per consumer warpgroup)
#define BLOCK_N TILE_N                   // rows of W per tile
#define BLOCK_K (128 / IN_BYTES)         // one 128-byte swizzle row: 64 16-bit or 128 FP8 values
#define OUT_N (GATED ? 128 : BLOCK_N)    // output columns per tile
#define SLABS (PINGPONG ? 2 : 1)         // 64-row wgmma slabs per consumer warpgroup and tile
#define SLAB_N (BLOCK_N)                 // columns of one slab's wgmma (m64n256 / m64n128)
#define K_BLOCKS ((K_DIM + BLOCK_K - 1) / BLOCK_K)
#define UNIT_K_BLOCKS (K_BLOCKS / SPLIT_K)  // k-blocks of one work unit
#if K_BLOCKS % SPLIT_K
#error "SPLIT_K must divide the k-blocks"
#endif
#define N_TILES ((N_DIM + OUT_N - 1) / OUT_N)
#define A_BYTES (BLOCK_M * 128)          // 16 KB
#define W_BYTES (BLOCK_N * 128)          // 32 KB (128 x 192 tiles: 24 KB)
#define K_STEP (32 / IN_BYTES)           // K of one wgmma: 32 bytes of the swizzle row
#define STAGE_BYTES (A_BYTES + W_BYTES)
#define NTHREADS 384                     // producer warpgroup + two consumer warpgroups
// A full residual arrives in shared memory while the mainloop runs (its loads would otherwise
// stall the epilogue): by TMA (cooperative) or by the warpgroup's own cp.async (pingpong, narrow
// tiles). Cooperative 128 x 256 tiles (RESIDUAL_IN_RING): the residual's first 128 columns come
// into the epilogue stage, its last 128 into a ring slot that the producer fills after the tile's
// k-blocks, one more ring position per tile; the stage stays 64 x 128 a warpgroup and the ring keeps
// 4 stages (with a 64 x 256 stage it had 3: 1.03-1.05x the time at K = 3072-11008, H100).
// 128 x 192 tiles: the whole 64 x 192 residual in the stage (4 stages of 40 KB fit beside it).
#define RESIDUAL_TMA (RESIDUAL_MODE == 2 && !PINGPONG && !EPILOGUE_WG && !NARROW)
#define RESIDUAL_IN_RING (RESIDUAL_TMA && BLOCK_N == 256)
#define RESIDUAL_STAGED (RESIDUAL_MODE == 2 && !EPILOGUE_WG && SPLIT_K == 1)  // split-K: the reduce adds it
#define EPI_ROWS (64 * SLABS)                   // rows of a warpgroup's tile
#define ACC_REGS (SLABS * BLOCK_N / 2)          // accumulator registers in use (m64n128 / n192 / n256; pingpong 2 x n128)
#define EPI_COLS (BLOCK_N == 192 ? OUT_N : 128)  // output columns per epilogue pass
#define EPI_BYTES (EPI_ROWS * EPI_COLS * 2)
#if EPILOGUE_WG
#define PRODUCER_REGS 72                 // the producer's warpgroup also runs the epilogue warps
#define CONSUMER_REGS 216                // 128 * 72 + 256 * 216 = 384 * 168, what the launch allocates
#define EPI_REGION (BLOCK_M * 256 * 2)   // the 64 KB hand-over tile (sm90/epilogue_wg.cuh)
#else
#define PRODUCER_REGS 40
#define CONSUMER_REGS 232                // 128 * 40 + 256 * 232 = 384 * 168, what the launch allocates
#define EPI_REGION (2 * EPI_BYTES)       // each consumer warpgroup's epilogue stage
#endif

#include "../common/sm90.cuh"  // WG_TY, mbarriers, proxy fence, tensor-map publishing, wgmma fences, descriptors
#include "sm90/tma.cuh"
#include "sm90/wgmma.cuh"
#include "sm90/epilogue.cuh"
#include "sm90/epilogue_wg.cuh"
#include "sm90/splitk_reduce.cuh"

// Shared memory (1024-byte aligned for the swizzle): STAGES x [A box | W box], each consumer
// warpgroup's epilogue stage, then the full and empty barriers of each ring stage and of each
// epilogue stage (residual landed / stage free).
#define SLOT_A(s) (base + (s) * STAGE_BYTES)
#define SLOT_W(s) (base + (s) * STAGE_BYTES + A_BYTES)
#define SLOT_EPI(c) (base + STAGES * STAGE_BYTES + (c) * EPI_BYTES)
#define BARS (base + STAGES * STAGE_BYTES + EPI_REGION)
#define BAR_FULL(s) (BARS + 8 * (s))
#define BAR_EMPTY(s) (BARS + 8 * (STAGES + (s)))
#define BAR_RES_FULL(c) (BARS + 8 * (2 * STAGES + (c)))
#define BAR_RES_EMPTY(c) (BARS + 8 * (2 * STAGES + 2 + (c)))
#define BAR_HANDED (BARS + 8 * (2 * STAGES + 4))  // the hand-over tile is written (EPILOGUE_WG)
#define BAR_TAKEN (BARS + 8 * (2 * STAGES + 5))   // ... and read: free for the next tile

// Work unit t -> (row block, column block) in GROUP_M-row groups, and its first k-block: the
// units of split s are the tiles' units s * tiles .. s * tiles + tiles - 1 (without split-K, unit
// = tile), so the units running at once read the same K range of A.
__device__ __forceinline__ void tile_coords(int t, int tiles_m, int& mb, int& nb, int& kb0) {
    const int tiles = tiles_m * N_TILES;
    kb0 = (t / tiles) * UNIT_K_BLOCKS;
    t -= (t / tiles) * tiles;
    const int per_group = GROUP_M * N_TILES;
    const int group = t / per_group, first = group * GROUP_M;
    const int size = min(tiles_m - first, GROUP_M);
    const int r = t - group * per_group;
    mb = first + r % size;
    nb = r / size;
}

extern "C" __global__ void __launch_bounds__(NTHREADS, 1) gemm_sm90(
    const in_t* __restrict__ A, const in_t* __restrict__ W,
#if GATED
    const in_t* __restrict__ W_up,
#endif
#if BIAS_MODE
    const u16* __restrict__ bias,
#endif
#if RESIDUAL_MODE
    const u16* __restrict__ residual,
#endif
#if IN_FP8
    const float* __restrict__ a_scale, const float* __restrict__ w_scale,
#if GATED
    const float* __restrict__ w_up_scale,
#endif
#endif
    int M, u16* __restrict__ Y
#if HOST_MAPS
    , const __grid_constant__ TensorMap map_a, const __grid_constant__ TensorMap map_w
#if RESIDUAL_TMA
    , const __grid_constant__ TensorMap map_residual
#endif
#endif
    ) {
#if !BIAS_MODE
    const u16* bias = nullptr;
#endif
#if !RESIDUAL_MODE
    const u16* residual = nullptr;
#endif
#if IN_FP8
    // the dequantization scale of each output column pair (sm90/epilogue.cuh, scale_pair)
    const Scales scales{*a_scale, w_scale,
#if GATED
                        w_up_scale
#else
                        nullptr
#endif
    };
#else
    const Scales scales{};
#endif
    const int tiles_m = (M + BLOCK_M - 1) / BLOCK_M;
    const int num_tiles = tiles_m * N_TILES * SPLIT_K;  // work units
    const int G = gridDim.x;
    if ((int)blockIdx.x >= num_tiles) return;  // the whole CTA, before any barrier exists

    extern __shared__ unsigned char smem_raw[];
    const u32 raw = smem_addr(smem_raw);
    const u32 base = (raw + 1023u) & ~1023u;
    // warpgroup index, broadcast from lane 0 so that ptxas knows it is warp-uniform
    const int wg = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);

    if (threadIdx.x == 0) {
#if HOST_MAPS
        // the maps' first use (the producer's first loads) finds them in the descriptor cache
        tmap_prefetch(&map_a);
        tmap_prefetch(&map_w);
#if RESIDUAL_TMA
        tmap_prefetch(&map_residual);
#endif
#endif
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(BAR_FULL(s), 1);   // the producer's expect_tx arrival (+ the TMA bytes)
            mbar_init(BAR_EMPTY(s), PINGPONG ? 4 : 8);  // one arrival per consuming warp
        }
        for (int c = 0; c < 2; ++c) {
            mbar_init(BAR_RES_FULL(c), 1);   // expect_tx arrival + the residual's bytes
            mbar_init(BAR_RES_EMPTY(c), 4);  // one arrival per warp of the warpgroup
        }
#if EPILOGUE_WG
        mbar_init(BAR_HANDED, 8);  // one arrival per consumer warp
        mbar_init(BAR_TAKEN, 3);   // one arrival per epilogue warp
#endif
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {
        // ================= producer warpgroup: one thread issues every copy =================
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(PRODUCER_REGS));
#if EPILOGUE_WG
        if (threadIdx.x >= 32) {
            // ========== warps 1-3: the epilogue of each tile once the consumers hand it over ==========
            int tc = 0;
            for (int t = blockIdx.x; t + G < num_tiles; t += G, ++tc) {  // all but the last tile
                int mb, nb, kb0;
                tile_coords(t, tiles_m, mb, nb, kb0);
                mbar_wait(BAR_HANDED, tc & 1);
                epilogue_tile(SLOT_EPI(0), Y, bias, residual, M, mb * BLOCK_M, nb * OUT_N);
                mbar_arrive_warp(BAR_TAKEN);
            }
            return;
        }
#else
        if (threadIdx.x >= 32) return;
#endif
        int mb, nb, kb0;
#if HOST_MAPS
        if (threadIdx.x != 0) return;
        const void* const tmap_a = &map_a;
        const void* const tmap_w = &map_w;
#if RESIDUAL_TMA
        const void* const tmap_residual = &map_residual;
#endif
#if GATED
        const int gate_idx = W <= W_up ? 0 : 1;  // the host's pair map starts at the lower weight
#endif
#else
        // Tensor maps (A, W and the residual: 3 x 128 bytes) live in the first row of the output tile this CTA
        // writes last: no other CTA writes there, and that tile's epilogue runs only after every
        // TMA transfer of this CTA has landed (its consumers waited for all of them). launch_sm90.py
        // admits only N whose every tile row holds the maps; y is 64-byte aligned (pointer_align).
        // They are built in ring slot 0, free until the first load below.
        tile_coords(blockIdx.x + (num_tiles - 1 - blockIdx.x) / G * G, tiles_m, mb, nb, kb0);
#if SPLIT_K > 1
        // the unit's partial tile: plane kb0 / UNIT_K_BLOCKS of the fp32 workspace
        unsigned char* maps = reinterpret_cast<unsigned char*>(reinterpret_cast<float*>(Y) + (long long)(kb0 / UNIT_K_BLOCKS) * M * N_DIM
                                                               + (long long)mb * BLOCK_M * N_DIM + nb * OUT_N);
#else
        unsigned char* maps = reinterpret_cast<unsigned char*>(Y + (long long)mb * BLOCK_M * N_DIM + nb * OUT_N);
#endif
        const u32 stage = SLOT_A(0);
        constexpr int N_MAPS = RESIDUAL_TMA ? 3 : 2;
        for (int i = 0; i < N_MAPS; ++i)
            asm volatile("st.shared.u32 [%0], %1;" ::"r"(stage + 128 * i + 4 * threadIdx.x), "r"(0u) : "memory");
        __syncwarp();
#if GATED
        // gate and up as one [2, N, K] tensor from the lower of the two addresses
        const bool gate_first = W <= W_up;
        const in_t* w_lo = gate_first ? W : W_up;
        const u64 gap = gate_first ? (u64)(W_up - W) * IN_BYTES : (u64)(W - W_up) * IN_BYTES;
        const int gate_idx = gate_first ? 0 : 1;
#endif
        if (threadIdx.x == 0) {
            tmap_encode_2d(stage, A, (u32)M, K_DIM, BLOCK_M, IN_BYTES);
#if GATED
            tmap_encode_pair(stage + 128, w_lo, gap ? gap : (u64)N_DIM * K_DIM * IN_BYTES, N_DIM, K_DIM, BLOCK_N / 2, IN_BYTES);
#else
            tmap_encode_2d(stage + 128, W, N_DIM, K_DIM, BLOCK_N, IN_BYTES);
#endif
#if RESIDUAL_TMA
            tmap_encode_2d(stage + 256, residual, (u32)M, N_DIM, 64, 2);
#endif
        }
        __syncwarp();
        for (int i = 0; i < N_MAPS; ++i) tmap_publish(maps + 128 * i, stage + 128 * i);
        fence_proxy_async();  // TMA (async proxy) writes slot 0 after these generic writes
        __syncwarp();
        if (threadIdx.x != 0) return;
        const void* const tmap_a = maps;
        const void* const tmap_w = maps + 128;
#if RESIDUAL_TMA
        const void* const tmap_residual = maps + 256;
#endif
#endif  // HOST_MAPS

        int it = 0;  // k-blocks loaded so far: ring slot and phase
        int tc = 0;  // tiles loaded so far: epilogue stage phase
        for (int t = blockIdx.x; t < num_tiles; t += G, ++tc) {
            tile_coords(t, tiles_m, mb, nb, kb0);
            const int m0 = mb * BLOCK_M, n0 = nb * OUT_N;
            for (int kb = 0; kb < UNIT_K_BLOCKS; ++kb, ++it) {
#if RESIDUAL_TMA
                // Once the ring holds this tile's first k-blocks (they load while the consumers
                // finish the last tile), the residual (its first EPI_COLS columns): the consumers'
                // last epilogue has to free the stages first, and waiting for that earlier would
                // delay the ring.
                if (kb == (K_BLOCKS < STAGES ? K_BLOCKS : STAGES) - 1) {
                    for (int c = 0; c < 2; ++c) {
                        mbar_wait(BAR_RES_EMPTY(c), (tc & 1) ^ 1);
                        mbar_expect_tx(BAR_RES_FULL(c), EPI_BYTES);
                        for (int b = 0; b < EPI_COLS / 64; ++b)
                            tma_load_2d(SLOT_EPI(c) + b * (64 * 128), tmap_residual, n0 + 64 * b, m0 + 64 * c, BAR_RES_FULL(c));
                    }
                }
#endif
                const int s = it % STAGES;
                mbar_wait(BAR_EMPTY(s), ((it / STAGES) & 1) ^ 1);  // a fresh barrier passes parity 1
                mbar_expect_tx(BAR_FULL(s), STAGE_BYTES);        // zero-filled tails count too
                const int k0 = (kb0 + kb) * BLOCK_K;
                tma_load_2d(SLOT_A(s), tmap_a, k0, m0, BAR_FULL(s));
#if GATED
                tma_load_3d(SLOT_W(s), tmap_w, k0, n0, gate_idx, BAR_FULL(s));
                tma_load_3d(SLOT_W(s) + W_BYTES / 2, tmap_w, k0, n0, 1 - gate_idx, BAR_FULL(s));
#else
                tma_load_2d(SLOT_W(s), tmap_w, k0, n0, BAR_FULL(s));
#endif
            }
#if RESIDUAL_IN_RING
            {   // the residual's last 128 columns, in the ring position after the tile's k-blocks:
                // each warpgroup's 64 x 128 at SLOT_A(s) + c * EPI_BYTES, laid out as its stage
                const int s = it % STAGES;
                mbar_wait(BAR_EMPTY(s), ((it / STAGES) & 1) ^ 1);
                mbar_expect_tx(BAR_FULL(s), 2 * EPI_BYTES);
                for (int c = 0; c < 2; ++c)
                    for (int b = 0; b < 2; ++b)
                        tma_load_2d(SLOT_A(s) + c * EPI_BYTES + b * (64 * 128), tmap_residual, n0 + 128 + 64 * b, m0 + 64 * c,
                                    BAR_FULL(s));
                ++it;
            }
#endif
        }
    } else {
#if PINGPONG
        // ================= consumer warpgroups: every other tile of this CTA each =================
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(CONSUMER_REGS));
        const int c = wg - 1;
        float acc[128];  // slab s (rows 64 s .. 64 s + 63) in acc[64 s .. 64 s + 63]
        int i = c;       // this CTA's units i = c, c + 2, ...: ring positions i * UNIT_K_BLOCKS ...
        for (int t = blockIdx.x + c * G; t < num_tiles; t += 2 * G, i += 2) {
            int mb, nb, kb0;
            tile_coords(t, tiles_m, mb, nb, kb0);
            const int m0 = mb * BLOCK_M, n0 = nb * OUT_N;
#if RESIDUAL_STAGED
            stage_residual(residual, M, m0, n0, SLOT_EPI(c));  // lands while this warpgroup waits and computes
#endif
            // Turns (named barriers 3 + c, both warpgroups): a warpgroup starts its mainloop once the
            // other has waited for every k-block of the tile before. Needed for correctness, not
            // only for speed: a ring slot's full barrier may be only one phase behind the position
            // waited for, or its parity wait passes early.
            if (i > 0) asm volatile("bar.sync %0, 256;" ::"r"(3 + c) : "memory");
#pragma unroll
            for (int r = 0; r < 128; ++r) acc[r] = 0.f;
            int it = i * UNIT_K_BLOCKS;
            for (int kb = 0; kb < UNIT_K_BLOCKS; ++kb, ++it) {
                const int s = it % STAGES;
                mbar_wait(BAR_FULL(s), (it / STAGES) & 1);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < BLOCK_K / 16; ++kk) {
                    const u64 dw = kmajor_desc(SLOT_W(s) + kk * 32);
                    wgmma_n128(*reinterpret_cast<float(*)[64]>(&acc[0]), kmajor_desc(SLOT_A(s) + kk * 32), dw);
                    wgmma_n128(*reinterpret_cast<float(*)[64]>(&acc[64]), kmajor_desc(SLOT_A(s) + 64 * 128 + kk * 32), dw);
                }
                wgmma_commit();
                if (kb > 0) {
                    wgmma_wait<1>();
                    mbar_arrive_warp(BAR_EMPTY((it - 1) % STAGES));
                }
            }
            if (t + G < num_tiles) asm volatile("bar.arrive %0, 256;" ::"r"(3 + (1 - c)) : "memory");  // the next tile's turn
            wgmma_wait<0>();
            fence_regs(acc);
            mbar_arrive_warp(BAR_EMPTY((it - 1) % STAGES));
#if SPLIT_K > 1
            store_partial(acc, reinterpret_cast<float*>(Y) + (long long)(kb0 / UNIT_K_BLOCKS) * M * N_DIM, M, m0, n0);
#else
            store_tile(acc, Y, bias, residual, scales, M, m0, n0, SLOT_EPI(c), 0, 0);
#endif
        }
#else
        // ================= consumer warpgroups: 64 rows of the tile each =================
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(CONSUMER_REGS));
        const int c = wg - 1;
        float acc[128];
        int it = 0, tc = 0;
        for (int t = blockIdx.x; t < num_tiles; t += G, ++tc) {
            int mb, nb, kb0;
            tile_coords(t, tiles_m, mb, nb, kb0);
#if RESIDUAL_STAGED && !RESIDUAL_TMA
            stage_residual(residual, M, mb * BLOCK_M + c * 64, nb * OUT_N, SLOT_EPI(c));  // narrow tiles
#endif
#pragma unroll
            for (int i = 0; i < ACC_REGS; ++i) acc[i] = 0.f;
#if IN_FP8
            // FP8: the wgmma accumulator keeps fewer bits than fp32 (a whole K of 768 put outputs
            // 1.7 % off), so each k-block's product (128 values of K) is promoted into acc. There
            // is room for one 64 x 128 partial, not a second 64 x 256: the k-block runs as two
            // halves of W's rows (the tile's columns 0-127, then 128-255; GatedGemm: the gate,
            // then the up rows), each waited for and added; while one warpgroup waits and adds, the
            // tensor cores run the other's MMAs (they still idle about a third of the time on
            // square-4k: README, the FP8 table).
            float part[64];
            for (int kb = 0; kb < K_BLOCKS; ++kb, ++it) {
                const int s = it % STAGES;
                mbar_wait(BAR_FULL(s), (it / STAGES) & 1);
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    wgmma_fence();  // part's registers were read by the last half's additions
#pragma unroll
                    for (int kk = 0; kk < BLOCK_K / K_STEP; ++kk)  // K_STEP columns = 32 bytes of the swizzle row
                        wgmma_n128_fp8(part, kmajor_desc(SLOT_A(s) + c * (64 * 128) + kk * 32),
                                       kmajor_desc(SLOT_W(s) + h * (128 * 128) + kk * 32), kk > 0);
                    wgmma_commit();
                    wgmma_wait<0>();
                    fence_regs(part);
                    if (h == 1) mbar_arrive_warp(BAR_EMPTY(s));  // the slot's MMAs are done
#pragma unroll
                    for (int i = 0; i < 64; ++i) acc[64 * h + i] += part[i];
                }
            }
            fence_regs(acc);
#else
            for (int kb = 0; kb < K_BLOCKS; ++kb, ++it) {
                const int s = it % STAGES;
                mbar_wait(BAR_FULL(s), (it / STAGES) & 1);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < BLOCK_K / K_STEP; ++kk) {  // K_STEP columns = 32 bytes of the swizzle row
#if NARROW
                    wgmma_n128(*reinterpret_cast<float(*)[64]>(&acc[0]), kmajor_desc(SLOT_A(s) + c * (64 * 128) + kk * 32),
                               kmajor_desc(SLOT_W(s) + kk * 32));
#elif BLOCK_N == 192
                    wgmma_n192(*reinterpret_cast<float(*)[96]>(&acc[0]), kmajor_desc(SLOT_A(s) + c * (64 * 128) + kk * 32),
                               kmajor_desc(SLOT_W(s) + kk * 32));
#else
                    wgmma_n256(acc, kmajor_desc(SLOT_A(s) + c * (64 * 128) + kk * 32), kmajor_desc(SLOT_W(s) + kk * 32));
#endif
                }
                wgmma_commit();
                if (kb > 0) {
                    wgmma_wait<1>();  // k-block kb - 1 is done: its slot goes back to the producer
                    mbar_arrive_warp(BAR_EMPTY((it - 1) % STAGES));
                }
            }
            wgmma_wait<0>();
            fence_regs(*reinterpret_cast<float(*)[ACC_REGS]>(&acc[0]));
            mbar_arrive_warp(BAR_EMPTY((it - 1) % STAGES));
#endif
#if EPILOGUE_WG
            mbar_wait(BAR_TAKEN, (tc & 1) ^ 1);  // the epilogue warps have read the previous tile
            if (t + G < num_tiles) {
                handover_store(acc, SLOT_EPI(0), c);
                mbar_arrive_warp(BAR_HANDED);
                continue;
            }
            // The CTA's last tile has no mainloop left to hide an epilogue behind: its consumers
            // write it themselves (bias and residual from global memory), as the maps require.
#endif
#if RESIDUAL_TMA
            // The last tile's first row holds the maps that warpgroup 1's residual load reads:
            // warpgroup 0 overwrites it only once that load has landed too (the ring part: store_tile
            // waits for all of it before the columns that hold the residual's map).
            if (c == 0 && t + G >= num_tiles) mbar_wait(BAR_RES_FULL(1), tc & 1);
#endif
#if RESIDUAL_IN_RING
            const int ring_res = it % STAGES, ring_phase = (it / STAGES) & 1;
            ++it;
            store_tile(acc, Y, bias, residual, scales, M, mb * BLOCK_M + c * 64, nb * OUT_N, SLOT_EPI(c), BAR_RES_FULL(c), tc & 1,
                       SLOT_A(ring_res) + c * EPI_BYTES, BAR_FULL(ring_res), ring_phase);
            fence_proxy_async();  // the next loads (TMA) overwrite what these threads read
            mbar_arrive_warp(BAR_EMPTY(ring_res));
#else
            store_tile(acc, Y, bias, residual, scales, M, mb * BLOCK_M + c * 64, nb * OUT_N, SLOT_EPI(c), BAR_RES_FULL(c), tc & 1);
#endif
#if RESIDUAL_TMA
#if !RESIDUAL_IN_RING
            fence_proxy_async();  // the next residual (TMA) overwrites what these threads read
#endif
            mbar_arrive_warp(BAR_RES_EMPTY(c));
#endif
        }
#endif
    }
}
