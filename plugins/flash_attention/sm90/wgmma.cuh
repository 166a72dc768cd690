// kernel_sm90.cu, the mainloop's MMAs: the m64nN instructions (16-bit and, FP8, E4M3) and the
// S = Q K^T / O += P V issue loops over one key block (fences, waits and descriptors: plugins/common/sm90.cuh).

// fence_regs (plugins/common/sm90.cuh) for the packed P registers.
template <int N>
__device__ __forceinline__ void fence_regs(u32 (&r)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}

// Accumulator operand lists (ACC_REGS_32 / 64, ACC_OPS_8: plugins/common/sm90.cuh).
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

#if FP8
// E4M3 (FP8: 8-bit operands have no transposed mode, so B is K-major in both products; S = Q K^T
// is plugins/common/sm90.cuh's wgmma_ss_n128_e4m3).
// d += A[64 x 32] (registers) @ B[32 x 128] (smem, K-major: V^T's keys contiguous).
__device__ __forceinline__ void wgmma_rs_n128_e4m3(float (&d)[64], const u32 (&a)[4], u64 desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" ACC_REGS_64
        "}, {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
        : ACC_OPS_64
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(1));
}
#endif

// S = Q K^T for this warpgroup's 64 rows: one wgmma per 32 bytes of the head dim (D / 16 at 16
// bits, D / 32 in E4M3); the k-step's offset in bytes is the same for both.
__device__ __forceinline__ void issue_qk(float (&s)[64], u32 q_s, u32 k_s) {
#pragma unroll
    for (int kk = 0; kk < D * ELEM_BYTES / 32; ++kk) {
        const u32 koff = (kk & 3) * 32;  // within a 128-byte chunk
        const u64 da = make_desc(q_s + (kk >> 2) * (BLOCK_M * 128) + koff, 16, 1024);
        const u64 db = make_desc(k_s + (kk >> 2) * (BLOCK_N * 128) + koff, 16, 1024);
#if FP8
        if (kk == 0)
            wgmma_ss_n128_e4m3<0>(s, da, db);
        else
            wgmma_ss_n128_e4m3<1>(s, da, db);
#else
        if (kk == 0)
            wgmma_ss_n128<0>(s, da, db);
        else
            wgmma_ss_n128<1>(s, da, db);
#endif
    }
}

#if FP8
// O += P V: BLOCK_N / 32 E4M3 wgmmas over the keys; B is the V^T tile, [D rows, BLOCK_N keys] in
// one 128-byte chunk, read K-major like K in S = Q K^T (the lbo argument is unused).
__device__ __forceinline__ void issue_pv(float (&o)[O_REGS], const u32 (&p)[P_KSTEPS][4], u32 v_s, u32 = 0) {
#pragma unroll
    for (int kk = 0; kk < P_KSTEPS; ++kk) wgmma_rs_n128_e4m3(o, p[kk], make_desc(v_s + kk * 32, 16, 1024));
}
#else
// O += P V: BLOCK_N / 16 wgmmas over the keys; V is N-major (head dim contiguous).
// lbo: from V's first 64-column chunk to its second (D = 128) or to the ones tile (ONES_SUM).
__device__ __forceinline__ void issue_pv(float (&o)[O_REGS], const u32 (&p)[P_KSTEPS][4], u32 v_s, u32 lbo = BLOCK_N * 128) {
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
#endif
