// kernel_sm90.cu, the mainloop's MMAs: wgmma fences and waits, shared-memory descriptors, the
// m64nN instructions, and the S = Q K^T / O += P V issue loops over one key block.

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
