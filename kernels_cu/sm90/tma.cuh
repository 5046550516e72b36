// Tensor-memory-accelerator (TMA) tile loads: cp.async.bulk.tensor from a
// tensor map passed by value as a __grid_constant__ kernel parameter, completing
// on an mbarrier (complete_tx counts the whole box, zero-filled parts too).
#pragma once
#ifndef __CUDA_ARCH_FEAT_SM90_ALL
#error "kernels_cu/sm90 needs the sm_90a target"
#endif
#include "../common/numeric.cuh"

// The 128 opaque bytes of a CUtensorMap (built on the host by cuflash/tma.py).
struct alignas(64) TmaDesc {
    unsigned long long data[16];
};

__device__ __forceinline__ void tma_prefetch_desc(const TmaDesc* desc) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(desc)) : "memory");
}

__device__ __forceinline__ void tma_load_2d(u32 dst, const TmaDesc* desc, u32 bar, int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n"
        ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(desc)), "r"(bar), "r"(c0), "r"(c1)
        : "memory");
}

__device__ __forceinline__ void tma_load_3d(u32 dst, const TmaDesc* desc, u32 bar, int c0, int c1, int c2) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n"
        ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(desc)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
        : "memory");
}

// bytes (a multiple of 16) from a 16-byte aligned global address, completing on the mbarrier at `bar`.
__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

__device__ __forceinline__ void tma_load_4d(u32 dst, const TmaDesc* desc, u32 bar, int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];\n"
        ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(desc)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
}

// The same box into this CTA's offset `dst` of every CTA in `cta_mask` (a cluster), each completing
// its bytes on the mbarrier at offset `bar` of that CTA.
__device__ __forceinline__ void tma_load_4d_multicast(u32 dst, const TmaDesc* desc, u32 bar, int c0, int c1, int c2,
                                                      int c3, u16 cta_mask) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%3, %4, %5, %6}], [%2], %7;\n"
        ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(desc)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
          "h"(cta_mask)
        : "memory");
}

// Shared -> global tile store (the box at the given coordinates; elements outside the tensor are not
// written), in the issuing thread's bulk-async group: commit, then wait (.read: until the shared-memory
// source may be reused).
__device__ __forceinline__ void tma_store_4d(const TmaDesc* desc, u32 src, int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
        ::"l"(reinterpret_cast<unsigned long long>(desc)), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
}
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until this thread's bulk operations have read their shared-memory source.
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// Waits until this thread's bulk operations are complete (their writes performed).
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// The SM this thread runs on (the diagnostic traces of fwd.cu and bwd.cu).
__device__ __forceinline__ u32 sm_id() {
    u32 smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    return smid;
}
