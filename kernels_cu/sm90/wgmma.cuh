// Warpgroup MMA (wgmma, sm_90a): shared-memory matrix descriptors, the
// fence / commit / wait protocol, and the generated m64nNk16 wrappers.
//
// Accumulator layout of m64nN (f32), per thread: warp w of the warpgroup owns
// rows 16w..16w+15; with g = lane / 4, t = lane % 4, register 4j + e holds
// row 16w + g + 8 * (e / 2), column 8j + 2t + (e % 2) -- the mma.sync m16n8
// C fragment repeated over N / 8 column blocks. The A-from-registers fragment
// of m64k16 is the mma.sync m16n8k16 A fragment of the warp's 16 rows.
#pragma once
#ifndef __CUDA_ARCH_FEAT_SM90_ALL
#error "kernels_cu/sm90 needs the sm_90a target (wgmma, setmaxnreg)"
#endif
#include "../common/numeric.cuh"
#include "../common/smem.cuh"
#include "wgmma_ops.cuh"

// Matrix descriptor of a 128-byte-swizzled tile (the layout TMA writes with
// CU_TENSOR_MAP_SWIZZLE_128B and a 128-byte inner box): rows of 128 bytes,
// 8-row groups of 1024 bytes, 1024-byte aligned.
//   K-major operand (rows = M or N, 64 K-elements per row): SBO = 1024 between
//     8-row groups, LBO unused; a k16 step inside the row adds 32 bytes.
//   MN-major operand (rows = K, 64 MN-elements per row): SBO = 1024 between
//     8-row groups of K, LBO = byte distance to the next 64-wide MN block.
// kRowBytes = 64: the 64-byte swizzle (rows of 64 bytes, 8-row groups of 512 bytes, 512-byte aligned).
template <int kRowBytes = 128>
__device__ __forceinline__ u64 make_desc_swizzled(u32 smem_addr, u32 lbo_bytes, u32 sbo_bytes) {
    static_assert(kRowBytes == 128 || kRowBytes == 64, "128- or 64-byte swizzle");
    u64 desc = 0;
    desc |= static_cast<u64>((smem_addr & 0x3FFFF) >> 4);
    desc |= static_cast<u64>((lbo_bytes & 0x3FFFF) >> 4) << 16;
    desc |= static_cast<u64>((sbo_bytes & 0x3FFFF) >> 4) << 32;
    desc |= static_cast<u64>(kRowBytes == 128 ? 1 : 2) << 62;  // layout type 1: 128-byte swizzle, 2: 64-byte
    return desc;
}
__device__ __forceinline__ u64 make_desc_sw128(u32 smem_addr, u32 lbo_bytes, u32 sbo_bytes) {
    return make_desc_swizzled<128>(smem_addr, lbo_bytes, sbo_bytes);
}

// A descriptor as a base plus byte offsets. Its low word holds the start address >> 4 in bits 0-13 and the
// LBO from bit 16: shared memory is < 256 KB, so a 16-byte multiple added to an address inside it never
// carries out of the address field, and the high word (SBO, swizzle) is fixed. The k-steps of a product
// then cost one 32-bit add each from one base, where ptxas rebuilt the whole encoding per wgmma (five
// uniform-datapath instructions).
template <int kRowBytes = 128>
struct SmemDesc {
    u32 lo, hi;
    __device__ __forceinline__ SmemDesc(u32 smem_addr, u32 lbo_bytes, u32 sbo_bytes) {
        const u64 d = make_desc_swizzled<kRowBytes>(smem_addr, lbo_bytes, sbo_bytes);
        lo = static_cast<u32>(d);
        hi = static_cast<u32>(d >> 32);
    }
    // The descriptor of smem_addr + byte_offset (a multiple of 16).
    __device__ __forceinline__ u64 at(u32 byte_offset) const {
        u64 d;
        asm("mov.b64 %0, {%1, %2};" : "=l"(d) : "r"(lo + (byte_offset >> 4)), "r"(hi));
        return d;
    }
};

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// acc (=) A B^T over the (padded) head dim, issued and committed, not waited for: A = the 64 rows at
// a_rows (a shared-memory address), B = the kN rows at b_rows, both K-major in blocks of 128-byte
// swizzled rows (64 columns of fp16, 128 of fp8; block c of a tile of R rows starts R * 128 bytes
// after block c - 1). A k-step is 32 bytes of the row: k16 in fp16, k32 in fp8. kRowBytes = 64: rows of
// 64 bytes in the 64-byte swizzle (fp8 at head dims <= 64).
template <typename Tag, int kN, int kPad, int kARows, int kBRows, int kRowBytes = 128>
__device__ __forceinline__ void wgmma_ss_rows_product(float (&acc)[kN / 2], u32 a_rows, u32 b_rows) {
    constexpr int kSteps = kRowBytes / 32;   // k-steps per row block
    const SmemDesc<kRowBytes> a_desc(a_rows, 16, 8 * kRowBytes), b_desc(b_rows, 16, 8 * kRowBytes);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kPad * ElemTraits<Tag>::kBytes / 32; ++kk) {
        const u64 da = a_desc.at((kk / kSteps) * kARows * kRowBytes + (kk % kSteps) * 32);
        const u64 db = b_desc.at((kk / kSteps) * kBRows * kRowBytes + (kk % kSteps) * 32);
        WgmmaSS<Tag, kN>::template run<false>(acc, da, db, kk > 0);
    }
    wgmma_commit();
}

// Ends ptxas's scheduling region here: a uniform branch over a no-op, always taken for the value
// passed (which must be >= 0 and the same across the warp), that ptxas cannot fold away. ptxas schedules within a basic block and
// otherwise hoists a `wgmma.wait_group` above independent work (the softmax of the overlap
// schedule) and so serialises it with the GEMM it was meant to overlap; the work before this
// point stays before the wait that follows it.
__device__ __forceinline__ void scheduling_barrier(int nonnegative) {
    asm volatile("{\n"
                 " .reg .pred p;\n"
                 " setp.ge.s32 p, %0, 0;\n"
                 " @p bra.uni SCHED_BARRIER_SKIP;\n"
                 " nanosleep.u32 0;\n"
                 " SCHED_BARRIER_SKIP:\n"
                 "}\n" ::"r"(nonnegative) : "memory");
}

// Keeps the compiler from moving reads or writes of accumulator registers
// across an in-flight wgmma (call on every register before and after).
template <int N>
__device__ __forceinline__ void fence_operand(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_operand(u32 (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

// Stores four 8x8 16-bit matrices transposed (sm_90 stmatrix): register q of every thread is its
// mma-fragment piece of matrix q (row lane / 4, columns 2 (lane % 4), +1), and lane 8q + i gives
// the shared-memory address of row i of the transpose (16 contiguous bytes).
__device__ __forceinline__ void stmatrix_x4_trans(u32 addr, u32 m0, u32 m1, u32 m2, u32 m3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 ::"r"(addr), "r"(m0), "r"(m1), "r"(m2), "r"(m3) : "memory");
}

// The same without the transpose: lane 8q + i gives the address of row i of matrix q itself.
__device__ __forceinline__ void stmatrix_x4(u32 addr, u32 m0, u32 m1, u32 m2, u32 m3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 ::"r"(addr), "r"(m0), "r"(m1), "r"(m2), "r"(m3) : "memory");
}

// Register budget per thread of the calling warpgroup (a multiple of 8 in [24, 256]).
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs)); }
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs)); }
