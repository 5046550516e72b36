// The sm90 backward's dQ writer: one lane of a producer-warpgroup warp per consumer warpgroup (warps 2
// and 3) adds that warpgroup's dQ slice of each step to the tile-contiguous float32 dq_accum with one
// bulk reduce (cp.reduce.async.bulk), so that the consumers never wait on L2 (bwd_postprocess_tiled
// converts dq_accum). Unordered mode: the first key tile to reach a slice stores it (a claim on the
// slice's semaphore); ordered mode: the key tiles add in a fixed order (a semaphore per slice, waited on
// and released here), so that dQ is bitwise reproducible.
#pragma once
#include "bwd_scheduler.cuh"

// dst[0 .. bytes) = src[0 .. bytes), one bulk copy of the async proxy.
__device__ __forceinline__ void bulk_store(float* dst, u32 src, u32 bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(src), "r"(bytes) : "memory");
    bulk_commit_group();
}
// dst[0 .. bytes) += src[0 .. bytes) (float32), one bulk operation of the async proxy.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, u32 src, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 ::"l"(dst), "r"(src), "r"(bytes) : "memory");
    bulk_commit_group();
}
__device__ __forceinline__ void fence_proxy_async_global() {
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
__device__ __forceinline__ int semaphore_load_acquire(const int* sem) {
    int seen;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(sem) : "memory");
    return seen;
}
// Spins until *sem == value (acquire: later reads see the writes released before it).
__device__ __forceinline__ void semaphore_wait(const int* sem, int value) {
    while (semaphore_load_acquire(sem) != value) {}
}
__device__ __forceinline__ void semaphore_release_add(int* sem, int value = 1) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(sem), "r"(value) : "memory");
}
// *sem += 1, returning the old value (acquire: if it holds a released flag, its writes are seen).
__device__ __forceinline__ int semaphore_acquire_add(int* sem) {
    int old;
    asm volatile("atom.acquire.gpu.global.add.s32 %0, [%1], 1;\n" : "=r"(old) : "l"(sem) : "memory");
    return old;
}
// Spins until *sem >= value (acquire).
__device__ __forceinline__ void semaphore_wait_at_least(const int* sem, int value) {
    while (semaphore_load_acquire(sem) < value) {}
}

// Unordered mode: the key tile whose dQ warp claims a slice (its atomic add on the slice's semaphore
// returns 0) stores it and, once the store is performed, adds kDqSliceReady; the others add into it
// after they see that flag. The preprocess then zeroes only the semaphores, not the float32 sums (about
// half of its time). The claimer waits on nothing between its claim and its store, so every wait ends.
constexpr int kDqSliceReady = 1 << 24;   // above any count of key tiles adding into one slice

// The dQ slots: one staging slice per consumer warpgroup, filled and drained once per step (a ring of
// one buffer: the phases of its dq_full / dq_empty barriers alternate with the step).
using BwdDqSlotState = PipelineState<1>;

template <class Tile, class Mask>
struct BwdDqWriter {
    static constexpr int kBlockM = Tile::kBlockM, kStages = Tile::kStages, kDqMode = Tile::kDqMode;
    static constexpr int kWarps = Tile::kConsumerWGs;   // warps 2 .. 2 + kWarps of the producer warpgroup
    static constexpr bool kClaim = kDqMode == kDqTile && CUFLASH_SM90_BWD_CLAIM_FIRST;
    // A slice's semaphore is read a step ahead, its round trip hidden behind the wait for the consumers;
    // a slice already stored is then added with no atomic at all, and only the others are claimed, after
    // that wait. A claim itself must never go out before the slice is in shared memory: the claimer's
    // consumers could then be held up (through the two warpgroups' common barriers) by its other dQ warp
    // waiting on a CTA that waits on this claim. Not the split-D tiles of patterns that skip tiles: the
    // value read ahead spills this 24-register warp at D=192 (causal).
    static constexpr bool kClaimEarly = kClaim && !(Mask::kSkipsTiles && Tile::kDqInRing);
    // The ordered mode's position computed at the top of the step (run): with a window.
    static constexpr bool kOrderFirst = Mask::kLocal;

    // Bulk reduce of consumer warpgroup cw's dQ slice of each query tile (ordered mode: after the key tiles
    // before this one, and released when its writes are performed). Varlen: each head has stat_rows / kBlockM
    // tiles, and p's dq_accum and dq_semaphore start at the sequence's first (bwd.cu: BwdSeqShared).
    template <class Steps>
    static __device__ __forceinline__ void run(const BwdParams& p, const BwdSmem<Tile>& smem, const Steps& steps,
                                               int n_block, int batch, int head0, int cw) {
        const int m_blocks = Mask::kVarlen ? p.stat_rows / kBlockM : ceil_div(p.seqlen_q, kBlockM);
        // (batch, head, query tile) of step i; 32 bits (tiles of 64 rows: < 2^31 while batch * heads_q *
        // seqlen_q < 2^37), which keeps this 24-register warp from spilling.
        auto slice_index = [&](int i) {
            const int head = head0 + i / steps.n_m;
            return static_cast<int>((static_cast<unsigned>(batch) * p.heads_q + head) * m_blocks + steps.query_tile(i));
        };
        // Unordered: if not yet stored a slice is claimed once it is in shared memory, and a stored slice's
        // flag is released as soon as the store is performed, before any wait on another CTA's flag: no
        // wait is circular.
        // This key tile's position among those reaching query tile m_block (the mask policy's, built from
        // the parameters).
        auto dq_order = [&](int m_block) { return BwdDqOrder<Mask>::position(Mask(p), m_block, n_block); };
        int tile_next = slice_index(0);
        int seen_next = kClaimEarly ? semaphore_load_acquire(p.dq_semaphore + tile_next * Tile::kConsumerWGs + cw) : 0;
        for (int i = 0; i < steps.n_iter; ++i) {
            // Ordered: BwdDqOrder's position among the key tiles [n_block_min, n_block_max) of this query
            // tile. The first (order 0) stores its slice, so that the preprocess zeroes only the query tiles
            // that no key tile reaches. kOrderFirst: computed here, while few values are live (a window's
            // chunks take a division, which spilled this 24-register warp where the order is used).
            const int order_first = kDqMode == kDqTileOrdered && kOrderFirst ? dq_order(steps.query_tile(i)) : -1;
            const PipelineState<kStages> pipe(i);
            const u32 dq_stage = Tile::kDqInRing ? (cw == 0 ? smem.q : smem.dout) + pipe.stage() * Tile::kQBytes
                                                 : smem.dq_slice(cw);
            const int tile = tile_next;
            float* dst = p.dq_accum + static_cast<i64>(tile) * (kBlockM * Tile::kHeadDimPad) + cw * Tile::kDqSliceFloats;
            int* sem = p.dq_semaphore + tile * Tile::kConsumerWGs + cw;
            mbar_wait(smem.bar_dq_full(cw), BwdDqSlotState(i).phase());
            // Slices in the ring: the warpgroup stages its next slice only after this (dq_empty), so that it
            // cannot complete two dq_full phases before this warp polls (a parity wait would then miss one
            // and hang: the next stage waits on this warp to free the ring). Staging buffers have the
            // handshake already: dq_empty below, once the reduce has read the slice.
            if constexpr (Tile::kDqInRing) mbar_arrive(smem.bar_dq_empty(cw));
            const int seen = kClaimEarly && seen_next >= kDqSliceReady ? seen_next
                           : kClaim ? semaphore_acquire_add(sem) : 0;
            const int order = kDqMode != kDqTileOrdered ? -1 : kOrderFirst ? order_first : dq_order(steps.query_tile(i));
            bool first = CUFLASH_SM90_BWD_FIRST_STORE && order == 0;
            if constexpr (kDqMode == kDqTileOrdered) {
                semaphore_wait(sem, order);
                fence_proxy_async_global();
            } else if constexpr (kClaim) {
                first = seen == 0;
                if (!first) {
                    if (seen < kDqSliceReady) semaphore_wait_at_least(sem, kDqSliceReady);
                    fence_proxy_async_global();
                }
            }
            if (first) bulk_store(dst, dq_stage, Tile::kDqSliceFloats * 4);
            else bulk_reduce_add_f32(dst, dq_stage, Tile::kDqSliceFloats * 4);
            bulk_wait_read();
            mbar_arrive(Tile::kDqInRing ? smem.bar_empty(pipe.stage()) : smem.bar_dq_empty(cw));
            if (kDqMode == kDqTileOrdered || (kClaim && first)) {
                bulk_wait_all();
                fence_proxy_async_global();
                semaphore_release_add(sem, kDqMode == kDqTileOrdered ? 1 : kDqSliceReady);
            }
            if (i + 1 < steps.n_iter) {
                tile_next = slice_index(i + 1);
                if (kClaimEarly) seen_next = semaphore_load_acquire(p.dq_semaphore + tile_next * Tile::kConsumerWGs + cw);
            }
        }
        // Each reduce has read its slice (wait_group.read above), so the CTA's shared memory may go; the
        // adds themselves complete before the grid does, so the CTA need not wait for them (as a TMA
        // store's epilogue does not).
        if (cw == 0) CUFLASH_BWD_TRACE(6, clock64());
    }
};
