// kernel_sm90.cu, the producer's loads: TMA (tensor maps built on the device, or the host's:
// HOST_MAPS) and the 16-byte cp.async fallback, both into the 128-byte swizzle layout wgmma reads;
// FP8's V^T tiles. Needs barriers.cuh.

// ---- TMA ----
// A 3-D tensor map of a [heads, rows, cols] tensor (cols contiguous, rows row_bytes apart) with
// boxes of one 128-byte swizzle chunk of columns (64 16-bit or 128 8-bit elements) x box_rows rows
// x 1 head, landing in the 128-byte swizzle layout wgmma reads ("Shared memory" in kernel_sm90.cu).
// Elements past `cols` or `rows` read as zeros, as the cp.async path's zero fill does. Written by
// one thread into zeroed shared memory with tensormap.replace (the PTX encodings: rank - 1,
// elemtype 0 u8 (E4M3) / 6 f16 / 10 bf16, swizzle 3 = 128 bytes, fill 0 = zeros).
__device__ __forceinline__ void tmap_encode(u32 sm, const void* g, u32 cols, u32 rows, u32 heads, u32 box_rows,
                                            u32 row_bytes) {
#define TMAP_SET(field, val) asm volatile("tensormap.replace.tile." field ".shared::cta.b1024.b32 [%0], %1;" ::"r"(sm), "n"(val) : "memory")
#define TMAP_SET_ORD(field, ord, val) \
    asm volatile("tensormap.replace.tile." field ".shared::cta.b1024.b32 [%0], %1, %2;" ::"r"(sm), "n"(ord), "r"(val) : "memory")
    asm volatile("tensormap.replace.tile.global_address.shared::cta.b1024.b64 [%0], %1;" ::"r"(sm), "l"(g) : "memory");
    TMAP_SET("rank", 2);  // rank, elemtype and the modes are immediates
    TMAP_SET_ORD("box_dim", 0, (u32)CHUNK_ELEMS);
    TMAP_SET_ORD("box_dim", 1, box_rows);
    TMAP_SET_ORD("box_dim", 2, 1u);
    TMAP_SET_ORD("global_dim", 0, cols);
    TMAP_SET_ORD("global_dim", 1, rows);
    TMAP_SET_ORD("global_dim", 2, heads);
    asm volatile("tensormap.replace.tile.global_stride.shared::cta.b1024.b64 [%0], 0, %1;" ::"r"(sm), "l"((u64)row_bytes) : "memory");
    asm volatile("tensormap.replace.tile.global_stride.shared::cta.b1024.b64 [%0], 1, %1;" ::"r"(sm), "l"((u64)rows * row_bytes) : "memory");
    TMAP_SET_ORD("element_stride", 0, 1u);
    TMAP_SET_ORD("element_stride", 1, 1u);
    TMAP_SET_ORD("element_stride", 2, 1u);
    TMAP_SET("elemtype", FP8 ? 0 : OPTFUSE_DTYPE == 1 ? 6 : 10);
    TMAP_SET("interleave_layout", 0);
    TMAP_SET("swizzle_mode", 3);
    TMAP_SET("fill_mode", 0);
#undef TMAP_SET
#undef TMAP_SET_ORD
}

// Box (column c0, row c1, head c2) of a map into shared memory; completes on `bar` by bytes.
__device__ __forceinline__ void tma_load(u32 dst, const void* tmap, int c0, int c1, int c2, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
        ::"r"(dst), "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}

// Rows from row0 of one head, all D columns: D_CHUNKS boxes into the swizzle chunks of a tile whose
// chunks are chunk_bytes apart (a Q slot: BLOCK_M * 128; a K / V ring slot: BLOCK_N * 128).
__device__ __forceinline__ void tma_load_rows(u32 dst, u32 chunk_bytes, const void* tmap, int row0, int head, u32 bar) {
#pragma unroll
    for (int c = 0; c < D_CHUNKS; ++c) tma_load(dst + c * chunk_bytes, tmap, CHUNK_ELEMS * c, row0, head, bar);
}

// Key rows [row0, row0 + BLOCK_N) of one kv head from a K or V map into ring slot `dst`, counted
// on `bar`.
__device__ __forceinline__ void tma_load_kv(u32 dst, const void* tmap, int row0, int head, u32 bar) {
    mbar_expect_tx(bar, KV_BYTES);
    tma_load_rows(dst, BLOCK_N * 128, tmap, row0, head, bar);
}

#if FP8
// FP8's V^T ([kv heads, D, Skv], keys contiguous): keys [key0, key0 + BLOCK_N) of all D rows, one
// box (its map's columns are the keys, Sk of them: the padding keys up to Skv read as zeros).
__device__ __forceinline__ void tma_load_vt(u32 dst, const void* tmap, int key0, int head, u32 bar) {
    mbar_expect_tx(bar, KV_BYTES);
    tma_load(dst, tmap, key0, 0, head, bar);
}
#endif

// ---- cp.async: one tile of rows [row0, row0 + ROWS) into swizzled shared memory ----
template <int ROWS>
__device__ __forceinline__ void load_tile(u32 dst, const elem_t* src, int rows_valid, int ptid) {
    constexpr int UNITS = D * ELEM_BYTES / 16;  // 16-byte units per row
    constexpr int RSTEP = 128 / UNITS;          // rows one pass of the 128 threads covers (a multiple of 8)
    // Consecutive threads copy consecutive 16 bytes of a row (coalesced). A thread's row advances
    // by RSTEP per pass, so its swizzled position (u ^ row % 8) never changes: one address
    // computation, then constant offsets (the producer runs on few registers).
    const int r = ptid / UNITS, u = ptid % UNITS;
    const u32 off = (u >> 3) * (ROWS * 128) + r * 128 + (((u & 7) ^ (r & 7)) << 4);
    const elem_t* g = src + r * D + u * (16 / ELEM_BYTES);
    // Opaque to the compiler: otherwise it hoists one pointer per pass out of the key loop and the
    // producer spills; from here every pass is the same register plus an immediate offset.
    asm volatile("mov.b64 %0, %0;" : "+l"(g));
#pragma unroll
    for (int it = 0; it < ROWS / RSTEP; ++it) {
        const bool ok = r + it * RSTEP < rows_valid;
        cp_async16(dst + off + it * RSTEP * 128, ok ? g + it * RSTEP * D : src, ok ? 16u : 0u);
    }
}

#if FP8
// FP8's V^T tile: keys [0, BLOCK_N) from `src` (a kv head's V^T plus the block's first key) of all
// D rows, rows `row_keys` (Skv) apart; keys_valid = Sk - key0, the rest zero-filled (the padding
// keys of a row hold any bits).
__device__ __forceinline__ void load_vt_tile(u32 dst, const elem_t* src, int row_keys, int keys_valid, int ptid) {
    constexpr int UNITS = BLOCK_N / 16;  // 16-key units per row
    constexpr int RSTEP = 128 / UNITS;
    const int r = ptid / UNITS, u = ptid % UNITS;
    const u32 off = r * 128 + ((u ^ (r & 7)) << 4);
    const int left = keys_valid - 16 * u;
    const u32 bytes = left >= 16 ? 16u : left > 0 ? (u32)left : 0u;
    const elem_t* g = src + (long long)r * row_keys + 16 * u;
#pragma unroll
    for (int it = 0; it < D / RSTEP; ++it)
        cp_async16(dst + off + it * RSTEP * 128, bytes ? g + (long long)it * RSTEP * row_keys : src, bytes);
}
#endif
