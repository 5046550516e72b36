// mbarrier primitives (shared::cta) for TMA pipelines.
//
// Phase protocol: a consumer waits on a "full" barrier with parity
// (iteration / stages) & 1; a producer waits on the matching "empty" barrier
// with the opposite parity, which a freshly initialised barrier satisfies.
#pragma once
#ifndef __CUDA_ARCH_FEAT_SM90_ALL
#error "kernels_cu/sm90 needs the sm_90a target"
#endif
#include "../common/numeric.cuh"

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes barrier initialisation visible to the async proxy (TMA) and the other threads.
__device__ __forceinline__ void fence_barrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// A waiting thread is suspended until the phase completes or a system time limit passes, then tries again.
// (A suspend-time hint made ptxas sleep between tries; it gained nothing: docs/experiments.md.)
__device__ __forceinline__ bool mbar_try_wait(u32 bar, u32 parity) {
    u32 done;
    asm volatile("{\n.reg .pred p;\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 "selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    return done != 0;
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    while (!mbar_try_wait(bar, parity)) {}
}

// Orders this thread's generic-proxy shared-memory writes before later
// async-proxy (TMA, wgmma) accesses.
__device__ __forceinline__ void fence_proxy_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Thread-block clusters (sm_90): this CTA's rank in its cluster.
__device__ __forceinline__ u32 cluster_ctarank() {
    u32 rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
    return rank;
}
__device__ __forceinline__ u32 cluster_nctarank() {
    u32 n;
    asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(n));
    return n;
}
// Arrives on the mbarrier at this CTA's offset `bar` in CTA `cta` of the cluster (this one included).
// Default (.release.cta) semantics: `.release.cluster` costs a MEMBAR.ALL.GPU per arrival, and what it
// signals (a wgmma's reads of a ring stage) is complete once wgmma.wait_group has returned.
__device__ __forceinline__ void mbar_arrive_cluster(u32 bar, u32 cta) {
    asm volatile("{\n.reg .b32 remote;\n"
                 "mapa.shared::cluster.u32 remote, %0, %1;\n"
                 "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n"
                 ::"r"(bar), "r"(cta) : "memory");
}
// Every thread of every CTA in the cluster: barrier initialisation visible to the other CTAs before
// they signal or fill this one, and no CTA leaving while the others may still signal its barriers.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}

// Named barrier over `threads` threads (a multiple of 32); id 0 is __syncthreads.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Arrives at a named barrier without waiting (the other threads counted wait with bar.sync).
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// A ring of kStages buffers filled in turn: iteration `it` uses stage it % kStages, and its "full"
// barrier completes phase (it / kStages) & 1 (the "empty" barrier's wait takes the other parity, which
// a freshly initialised barrier satisfies). A value built from the iteration count, so that a loop
// over iterations keeps plain integer arithmetic (kStages is a power of two: shifts and masks).
template <int kStages>
struct PipelineState {
    int it;
    __device__ __forceinline__ explicit PipelineState(int iteration) : it(iteration) {}
    __device__ __forceinline__ int stage() const { return it % kStages; }
    __device__ __forceinline__ u32 phase() const { return static_cast<u32>(it / kStages) & 1; }
    __device__ __forceinline__ u32 empty_phase() const { return phase() ^ 1; }
    __device__ __forceinline__ PipelineState advanced(int n) const { return PipelineState(it + n); }
};

// Address of 16-byte chunk `chunk` (0..7) of row `row` in a tile of 128-byte rows at `base` (a shared
// address or a pointer), stored with the 128-byte swizzle (TMA's CU_TENSOR_MAP_SWIZZLE_128B and wgmma's
// matching layout): the chunk index is XORed with the row's index within its 8-row (1024-byte) atom, so
// that the 8 rows of an ldmatrix or a column read hit 8 different bank groups.
template <class Base>
__device__ __forceinline__ Base swizzle128(Base base, int row, int chunk) {
    return base + row * 128 + ((chunk ^ (row % 8)) << 4);
}
// The same as a byte offset from the tile's start.
__device__ __forceinline__ int swizzle128(int row, int chunk) { return row * 128 + ((chunk ^ (row % 8)) << 4); }
