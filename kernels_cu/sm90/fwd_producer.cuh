// The Hopper forward's producer: one thread of warpgroup 0 issues every TMA load of the CTA.
//
// Per tile: Q into a Q buffer (persistent: handed to the consumers with the tile's index through the
// buffer's tile slot), then K and V of each key tile the mask leaves visible, from last to first, into a
// kStages-deep ring; each load completes on a "full" mbarrier and waits for the stage's "empty" one.
// Persistent: the next tile's loads start while the consumers finish this one. Clusters: this CTA loads
// the column blocks cb with cb % kCluster == its rank and multicasts them to every CTA of the cluster.
#pragma once
#include "../common/params.cuh"
#include "../common/mask.cuh"
#include "tma.cuh"
#include "pipeline.cuh"
#include "fwd_tile.cuh"
#include "fwd_scheduler.cuh"

template <class Tile, int kQBuffers, class Scheduler, class Mask, FwdSchedule kSchedule, bool kPersistent,
          int kCluster>
struct FwdProducer {
    using Smem = FwdSharedStorage<Tile, kQBuffers>;
    static constexpr int kStages = Tile::kStages;
    static constexpr int kBlockM = Tile::kBlockM, kBlockN = Tile::kBlockN;
    static constexpr int kPadV = Tile::kHeadDimV;
    // Persistent 16-bit overlap schedule with two consumer warpgroups: K runs one key tile ahead of V
    // (K_i, then V_{i-1}; a tile's first K before the previous tile's last V), since K's stage is freed as
    // soon as Q K^T has read it and V's only after P V. The 192-row tiles lost with it.
    static constexpr bool kKAhead = kPersistent && kSchedule == FwdSchedule::kOverlap && !Tile::kFp8
                                    && Tile::kConsumerWGs == 2;

    const FwdParams& p;
    const TmaDesc& tma_q;
    const TmaDesc& tma_k;
    const TmaDesc& tma_v;
    const Smem& smem;
    const Scheduler& sched;
    int* tile_counter;
    int cluster_rank;
    // The V load deferred behind the next K (kKAhead): its ring iteration (-1: none), key tile, head, batch.
    int pending_v_it = -1, pending_v_block = 0, pending_v_head_kv = 0, pending_v_batch = 0;

    // One column block of a K or V tile (clusters: only this CTA's share, multicast).
    __device__ __forceinline__ void load_kv_block(u32 dst, const TmaDesc* desc, u32 bar, int cb, int c0, int c1,
                                                  int head_kv, int batch) const {
        if constexpr (kCluster == 1) {
            tma_load_4d(dst, desc, bar, c0, c1, head_kv, batch);
        } else if (cb % kCluster == cluster_rank) {
            tma_load_4d_multicast(dst, desc, bar, c0, c1, head_kv, batch, static_cast<u16>((1 << kCluster) - 1));
        }
    }
    // K of key tile n_block into the ring stage of iteration `ring`, once the consumers have freed it.
    __device__ __forceinline__ void load_k(PipelineState<kStages> ring, int n_block, int head_kv, int batch) const {
        const int stage = ring.stage();
        const u32 dst = smem.k_stage(stage);
        mbar_wait(smem.k_empty(stage), ring.empty_phase());
        mbar_arrive_expect_tx(smem.k_full(stage), Tile::kKBytes);
#pragma unroll
        for (int cb = 0; cb < Tile::kColBlocks; ++cb)
            load_kv_block(dst + cb * kBlockN * Tile::kRowBytes, &tma_k, smem.k_full(stage), cb,
                          cb * Tile::kBlockCols, n_block * kBlockN, head_kv, batch);
    }
    // V of key tile n_block likewise (fp8: V^T, in 128-key blocks of kPadV rows).
    __device__ __forceinline__ void load_v(PipelineState<kStages> ring, int n_block, int head_kv, int batch) const {
        const int stage = ring.stage();
        const u32 dst = smem.v_stage(stage);
        mbar_wait(smem.v_empty(stage), ring.empty_phase());
        mbar_arrive_expect_tx(smem.v_full(stage), Tile::kVBytes);
        if constexpr (Tile::kFp8) {
#pragma unroll
            for (int cb = 0; cb < kBlockN / 128; ++cb)
                tma_load_4d(dst + cb * kPadV * 128, &tma_v, smem.v_full(stage), n_block * kBlockN + cb * 128, 0,
                            head_kv, batch);
        } else {
#pragma unroll
            for (int cb = 0; cb < Tile::kColBlocks; ++cb)
                load_kv_block(dst + cb * kBlockN * 128, &tma_v, smem.v_full(stage), cb, cb * 64, n_block * kBlockN,
                              head_kv, batch);
        }
    }
    __device__ __forceinline__ void flush_v() {
        if (kKAhead && pending_v_it >= 0) {
            load_v(PipelineState<kStages>(pending_v_it), pending_v_block, pending_v_head_kv, pending_v_batch);
            pending_v_it = -1;
        }
    }
    // Persistent: wait until Q buffer qb is free and publish the tile that goes with it.
    __device__ __forceinline__ void publish(PipelineState<kQBuffers> q_ring, int t) const {
        mbar_wait(smem.q_empty(q_ring.stage()), q_ring.empty_phase());
        smem.tile_slot()[q_ring.stage()] = t;
    }
    __device__ __forceinline__ void load_q(PipelineState<kQBuffers> q_ring, int t, TileCoord c) const {
        const int qb = q_ring.stage();
        if (kPersistent) publish(q_ring, t);
        mbar_arrive_expect_tx(smem.q_full(qb), Tile::kQBytes);
#pragma unroll
        for (int cb = 0; cb < Tile::kColBlocks; ++cb)
            tma_load_4d(smem.q_buffer(qb) + cb * kBlockM * Tile::kRowBytes, &tma_q, smem.q_full(qb),
                        cb * Tile::kBlockCols, c.m_block * kBlockM, c.head, c.batch);
    }

    __device__ __forceinline__ void run() {
        tma_prefetch_desc(&tma_q);
        tma_prefetch_desc(&tma_k);
        tma_prefetch_desc(&tma_v);
        int it = 0, q_count = 0;   // K/V ring iterations and Q tiles handed out so far (the phases)
        int t = sched.first_tile();
        for (;;) {
            const PipelineState<kQBuffers> q_ring(q_count);
            TileCoord c;
            if constexpr (kPersistent) {
                if (t >= sched.num_tiles) {   // no work left: tell the consumers, reset the counter
                    flush_v();
                    publish(q_ring, t);
                    mbar_arrive(smem.q_full(q_ring.stage()));
                    sched.retire(tile_counter);
                    break;
                }
                c = sched.coords(t, p.heads_q);
            } else {
                c = sched.grid_coords(p.heads_q);
            }
            const int t_cur = t;
            const int head_kv = c.head / p.heads_per_kv;
            const int n_block_max = Mask(p).n_block_max(c.m_block);
            if (n_block_max <= 0) {
                if (!kPersistent) break;
                flush_v();
                publish(q_ring, t_cur);
                mbar_arrive(smem.q_full(q_ring.stage()));
                t = sched.next_tile(t, tile_counter);
                ++q_count;
                continue;
            }
            if (!kPersistent) load_q(q_ring, t_cur, c);
            for (int i = 0; i < n_block_max; ++i, ++it) {
                const int n_block = n_block_max - 1 - i;
                load_k(PipelineState<kStages>(it), n_block, head_kv, c.batch);
#ifdef CUFLASH_SM90_FWD_TRACE   // slot 7 of consumer warpgroup 0's record: the tile's first K load issued
                if (kPersistent && i == 0 && q_count < 16)
                    reinterpret_cast<unsigned long long*>(tile_counter + 64)[(blockIdx.x * 3 * 16 + q_count) * 8 + 7] =
                        clock64();
#endif
                if (kKAhead) {
                    flush_v();   // V_{i-1}, or the previous tile's last V
                    pending_v_it = it;
                    pending_v_block = n_block;
                    pending_v_head_kv = head_kv;
                    pending_v_batch = c.batch;
                }
                // Persistent: the tile's first K load goes out before the wait for the Q buffer, and the next
                // tile is claimed once this one's first loads have gone out (the atomic's round trip to L2
                // then delays none of them).
                if (kPersistent && i == 0) load_q(q_ring, t_cur, c);
                if (!kKAhead) load_v(PipelineState<kStages>(it), n_block, head_kv, c.batch);
                if (kPersistent && i == 0) t = sched.next_tile(t, tile_counter);
            }
            ++q_count;
            if (!kPersistent) break;
        }
    }
};
