// The Hopper forward's producer: the TMA loads of Q and of the K / V ring.
#pragma once
#include "../common/params.cuh"
#include "../common/mask.cuh"
#include "../common/varlen.cuh"
#include "tma.cuh"
#include "pipeline.cuh"
#include "fwd_tile.cuh"
#include "fwd_scheduler.cuh"

// The producer: one thread of warpgroup 0 issues every TMA load of the CTA. Per tile: Q into a Q buffer
// (persistent: handed to the consumers with the tile's index through the buffer's tile slot), then K and V of
// each key tile the mask policy visits (FwdKeyTiles: the consumers walk the same ones in the same order) into
// the kStages-deep ring; each load completes on a "full" mbarrier and waits for the stage's "empty" one.
// Varlen: the tensor maps span the packed rows (batch 1), and a tile's rows start at its sequence's.
// pp: programmable attention's parameters (null unless Mask::VariantType::kProg), for a block-sparse list.
template <class Tile, class Mask, int kQBuffers, int kMode, bool kPersistent, int kCluster>
__device__ __forceinline__ void fwd_producer(const FwdParams& params, const TmaDesc& tma_q, const TmaDesc& tma_k,
                                             const TmaDesc& tma_v, int* tile_counter,
                                             const FwdSmem<Tile, kQBuffers>& smem, volatile int* tile_slot,
                                             const PersistentOrder& order, const ProgParams* pp) {
    constexpr int kBlockM = Tile::kBlockM, kBlockN = Tile::kBlockN, kStages = Tile::kStages;
    constexpr int kPadV = Tile::kHeadDimV;
    const u32 sQ = smem.q, sK = smem.k, sV = smem.v;
    const int num_tiles = order.num_tiles;
    tma_prefetch_desc(&tma_q);
    tma_prefetch_desc(&tma_k);
    tma_prefetch_desc(&tma_v);
    int it = 0, q_count = 0;   // K/V ring iterations and Q tiles handed out so far (the phases)
    int t = kPersistent ? static_cast<int>(blockIdx.x) : 0;
    // Clusters: this CTA issues column blocks cb with cb % kCluster == its rank, to every CTA.
    const int cluster_rank = kCluster > 1 ? static_cast<int>(cluster_ctarank()) : 0;
    auto load_kv_block = [&](u32 dst, const TmaDesc* desc, u32 bar, int cb, int c0, int c1, int head_kv,
                             int batch) {
        if constexpr (kCluster == 1) {
            tma_load_4d(dst, desc, bar, c0, c1, head_kv, batch);
        } else if (cb % kCluster == cluster_rank) {
            tma_load_4d_multicast(dst, desc, bar, c0, c1, head_kv, batch, static_cast<u16>((1 << kCluster) - 1));
        }
    };
    // V of key tile n_block (its sequence's keys from row k_row0) into the ring stage of iteration v_it, once
    // the consumers have freed it.
    auto load_v = [&](int v_it, int n_block, int head_kv, int batch, int k_row0) {
        const int key_row = k_row0 + n_block * kBlockN;
        const PipelineState<kStages> ring(v_it);
        const int stage = ring.stage();
        const u32 v_dst = sV + stage * Tile::kVSlotBytes;
        mbar_wait(smem.v_empty(stage), ring.empty_phase());
        mbar_arrive_expect_tx(smem.v_full(stage), Tile::kVBytes);
        if constexpr (Tile::kFp8) {   // V^T: 128-key blocks of kPadV rows
#pragma unroll
            for (int cb = 0; cb < kBlockN / 128; ++cb)
                tma_load_4d(v_dst + cb * kPadV * 128, &tma_v, smem.v_full(stage), key_row + cb * 128, 0, head_kv,
                            batch);
        } else {
#pragma unroll
            for (int cb = 0; cb < Tile::kColBlocksV; ++cb)
                load_kv_block(v_dst + cb * kBlockN * 128, &tma_v, smem.v_full(stage), cb, cb * 64, key_row, head_kv,
                              batch);
        }
    };
    // Persistent 16-bit overlap schedule, two consumer warpgroups (128-row tiles): K runs one key tile
    // ahead of V (K_i, then V_{i-1}; a tile's first K before the previous tile's last V), since K's
    // stage is freed as soon as Q K^T has read it and V's only after P V (docs/design.md: the K/V
    // ring). The 192-row tiles lost with it.
    constexpr bool kKAhead = kPersistent && kMode == kModeOverlap && !Tile::kFp8 && Tile::kConsumerWGs == 2;
    int pending_v_it = -1, pending_v_block = 0, pending_v_head_kv = 0, pending_v_batch = 0, pending_v_row0 = 0;
    auto flush_v = [&]() {   // the V load deferred behind the next K (kKAhead)
        if (kKAhead && pending_v_it >= 0) {
            load_v(pending_v_it, pending_v_block, pending_v_head_kv, pending_v_batch, pending_v_row0);
            pending_v_it = -1;
        }
    };
    for (;;) {
        int m_block, head, batch;
        const PipelineState<kQBuffers> q_ring(q_count);
        const int qb = q_ring.stage();                           // this tile's Q buffer
        const u32 q_phase = q_ring.phase();
        if constexpr (kPersistent) {
            if (t >= num_tiles) {   // no work left: tell the consumers, reset the counter
                flush_v();
                mbar_wait(smem.q_empty(qb), q_phase ^ 1);
                tile_slot[qb] = t;
                mbar_arrive(smem.q_full(qb));
                if (atomicAdd(tile_counter + 1, 1) == static_cast<int>(gridDim.x) - 1) {
                    tile_counter[0] = 0;   // every CTA has taken its last tile: ready for the next launch
                    tile_counter[1] = 0;
                }
                break;
            }
            order.template coords<Mask::kUnevenWork>(t, params.heads_q, m_block, head, batch);
        } else {
            order.template grid_coords<Mask::kUnevenWork>(params.heads_q, m_block, head, batch);
        }
        // Varlen: the mask policy of the tile's sequence, and where its rows start.
        FwdParams seq;
        int q_row0 = 0, k_row0 = 0;
        if constexpr (Mask::kVarlen) {
            const SeqSpan span = seq_span(params, batch);
            seq = seq_params<Tile::kElemBytes>(params, span, batch);
            q_row0 = span.q_start;
            k_row0 = span.k_start;
            batch = 0;
        }
        const FwdParams& p = Mask::kVarlen ? seq : params;
        const int t_cur = t;
        const int head_kv = head / p.heads_per_kv;
        const FwdKeyTiles<Mask, typename Mask::VariantType> key_tiles(p, m_block, pp, batch, head);
        const int n_tiles = key_tiles.count();
        auto publish = [&]() {   // persistent: hand the tile to the consumers with its Q
            mbar_wait(smem.q_empty(qb), q_phase ^ 1);
            tile_slot[qb] = t_cur;
        };
        // Persistent: claim the next tile. Only the next trip round the loop reads it, so it is
        // claimed once this tile's Q and first K/V loads have gone out: the atomic's round trip
        // to L2 then delays none of them (A/B: level with claiming it first, kept for clarity).
        // Clusters: a static order (every gridDim.x-th tile), so that the CTAs of a cluster go through
        // tile pairs of one (head, batch) in step.
        auto claim_next = [&]() {
            if constexpr (kCluster > 1) t += static_cast<int>(gridDim.x);
            else t = atomicAdd(tile_counter, 1) + static_cast<int>(gridDim.x);
        };
        if (n_tiles <= 0) {
            if (!kPersistent) break;
            flush_v();
            publish();
            mbar_arrive(smem.q_full(qb));
            claim_next();
            ++q_count;
            continue;
        }
        auto load_q = [&]() {
            if (kPersistent) publish();
            mbar_arrive_expect_tx(smem.q_full(qb), Tile::kQBytes);
#pragma unroll
            for (int cb = 0; cb < Tile::kColBlocks; ++cb)
                tma_load_4d(sQ + qb * Tile::kQBytes + cb * kBlockM * Tile::kRowBytes, &tma_q, smem.q_full(qb),
                            cb * Tile::kBlockCols, q_row0 + m_block * kBlockM, head, batch);
        };
        if (!kPersistent) load_q();
        for (int i = 0; i < n_tiles; ++i, ++it) {
            const int n_block = key_tiles.tile(i);
            const PipelineState<kStages> ring(it);
            const int stage = ring.stage();
            const u32 parity = ring.phase();
            const u32 k_dst = sK + stage * Tile::kKSlotBytes;
            mbar_wait(smem.k_empty(stage), ring.empty_phase());
            mbar_arrive_expect_tx(smem.k_full(stage), Tile::kKBytes);
#pragma unroll
            for (int cb = 0; cb < Tile::kColBlocks; ++cb)
                load_kv_block(k_dst + cb * kBlockN * Tile::kRowBytes, &tma_k, smem.k_full(stage), cb,
                              cb * Tile::kBlockCols, k_row0 + n_block * kBlockN, head_kv, batch);
#ifdef CUFLASH_SM90_FWD_TRACE   // slot 7 of consumer warpgroup 0's record: the tile's first K load issued
            if (kPersistent && i == 0 && q_count < 16)
                reinterpret_cast<unsigned long long*>(tile_counter + 64)[(blockIdx.x * 3 * 16 + q_count) * 8 + 7] =
                    clock64();
#endif
            if (kKAhead) {
                flush_v();   // V_{i-1}, or the previous tile's last V
                pending_v_it = it;
                pending_v_block = n_block;
                pending_v_row0 = k_row0;
                pending_v_head_kv = head_kv;
                pending_v_batch = batch;
            }
            // Persistent: the tile's first K load goes out before the wait for the Q buffer.
            if (kPersistent && i == 0) load_q();
            if (!kKAhead) load_v(it, n_block, head_kv, batch, k_row0);
            if (kPersistent && i == 0) claim_next();
        }
        ++q_count;
        if (!kPersistent) break;
    }
}
