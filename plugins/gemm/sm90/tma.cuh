// kernel_sm90.cu, the producer's loads: tensor maps (built on the device, or passed in by the host:
// HOST_MAPS) and TMA box copies into the 128-byte swizzle layout wgmma reads. Needs
// plugins/common/sm90.cuh.
//
// A QDP kernel gets pointers and int32 scalars only, so no host-encoded tensor map there: one thread
// writes each map into zeroed shared memory with tensormap.replace (PTX encodings: rank - 1,
// elemtype 0 uint8 / 6 f16 / 10 bf16, swizzle 3 = 128 bytes, fill 0 = zeros) and copies it to global memory
// the CTA alone owns (kernel_sm90.cu, "Tensor maps"). Boxes are one 128-byte swizzle row wide (64
// 16-bit or 128 FP8 columns) by `box_rows` rows; rows and columns past the tensor's end read as
// zeros, which is how the M, N and K tails are handled.

#define TMAP_SET(sm, field, val) \
    asm volatile("tensormap.replace.tile." field ".shared::cta.b1024.b32 [%0], %1;" ::"r"(sm), "n"(val) : "memory")
#define TMAP_SET_ORD(sm, field, ord, val) \
    asm volatile("tensormap.replace.tile." field ".shared::cta.b1024.b32 [%0], %1, %2;" ::"r"(sm), "n"(ord), "r"(val) : "memory")
#define TMAP_STRIDE(sm, ord, val) \
    asm volatile("tensormap.replace.tile.global_stride.shared::cta.b1024.b64 [%0], %1, %2;" ::"r"(sm), "n"(ord), "l"(val) : "memory")

// elemtype: 0 uint8 (E4M3 bits), 6 f16, 10 bf16
__device__ __forceinline__ void tmap_common(u32 sm, const void* g, int elem_bytes) {
    asm volatile("tensormap.replace.tile.global_address.shared::cta.b1024.b64 [%0], %1;" ::"r"(sm), "l"(g) : "memory");
    if (elem_bytes == 1)
        TMAP_SET(sm, "elemtype", 0);
    else
        TMAP_SET(sm, "elemtype", OPTFUSE_DTYPE == 1 ? 6 : 10);
    TMAP_SET(sm, "interleave_layout", 0);
    TMAP_SET(sm, "swizzle_mode", 3);
    TMAP_SET(sm, "fill_mode", 0);
}

// [rows, cols] row-major matrix of elem_bytes values (cols contiguous, rows cols * elem_bytes
// bytes apart); boxes of one 128-byte row.
__device__ __forceinline__ void tmap_encode_2d(u32 sm, const void* g, u32 rows, u32 cols, u32 box_rows, int elem_bytes) {
    tmap_common(sm, g, elem_bytes);
    TMAP_SET(sm, "rank", 1);
    TMAP_SET_ORD(sm, "box_dim", 0, 128u / elem_bytes);
    TMAP_SET_ORD(sm, "box_dim", 1, box_rows);
    TMAP_SET_ORD(sm, "global_dim", 0, cols);
    TMAP_SET_ORD(sm, "global_dim", 1, rows);
    TMAP_STRIDE(sm, 0, (u64)cols * elem_bytes);
    TMAP_SET_ORD(sm, "element_stride", 0, 1u);
    TMAP_SET_ORD(sm, "element_stride", 1, 1u);
}

// Two [rows, cols] matrices anywhere in memory as one [2, rows, cols] tensor: the third dim's
// stride is the distance between them (`g` is the lower one). One map serves both gated weights.
__device__ __forceinline__ void tmap_encode_pair(u32 sm, const void* g, u64 pair_stride, u32 rows, u32 cols, u32 box_rows,
                                                 int elem_bytes) {
    tmap_common(sm, g, elem_bytes);
    TMAP_SET(sm, "rank", 2);
    TMAP_SET_ORD(sm, "box_dim", 0, 128u / elem_bytes);
    TMAP_SET_ORD(sm, "box_dim", 1, box_rows);
    TMAP_SET_ORD(sm, "box_dim", 2, 1u);
    TMAP_SET_ORD(sm, "global_dim", 0, cols);
    TMAP_SET_ORD(sm, "global_dim", 1, rows);
    TMAP_SET_ORD(sm, "global_dim", 2, 2u);
    TMAP_STRIDE(sm, 0, (u64)cols * elem_bytes);
    TMAP_STRIDE(sm, 1, pair_stride);
    TMAP_SET_ORD(sm, "element_stride", 0, 1u);
    TMAP_SET_ORD(sm, "element_stride", 1, 1u);
    TMAP_SET_ORD(sm, "element_stride", 2, 1u);
}

// Box at (column c0, row c1) of a 2-D map into shared memory; completes on `bar` by bytes.
__device__ __forceinline__ void tma_load_2d(u32 dst, const void* tmap, int c0, int c1, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
        ::"r"(dst), "l"(tmap), "r"(c0), "r"(c1), "r"(bar) : "memory");
}

// Box at (column c0, row c1, matrix c2) of a pair map.
__device__ __forceinline__ void tma_load_3d(u32 dst, const void* tmap, int c0, int c1, int c2, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
        ::"r"(dst), "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}
