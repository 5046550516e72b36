// The sm90 backward's producer: one thread of warpgroup 0 loads K and V once, then streams each step's
// Q and dO tiles (with their rows of lse2 / delta) through the kStages-deep TMA ring. rows: where the sequence's
// packed rows start (q_row0, k_row0: varlen, in shared memory, read where used; dense: constant 0).
#pragma once
#include "bwd_tile.cuh"

template <class Tile>
struct BwdProducer {
    static constexpr int kBlockM = Tile::kBlockM, kBlockN = Tile::kBlockN, kStages = Tile::kStages;
    // lse2 and delta rows of one query tile (BwdParams.stats, padded to whole query tiles).
    static constexpr u32 kStatBytes = kBlockM * 4;

    template <class Steps, class Rows>
    static __device__ __forceinline__ void run(const BwdParams& p, const BwdSmem<Tile>& smem, const Steps& steps,
                                               const TmaDesc& tma_q, const TmaDesc& tma_k, const TmaDesc& tma_v,
                                               const TmaDesc& tma_do, int n0, int head_kv, int batch, int head0,
                                               const Rows& rows) {
        tma_prefetch_desc(&tma_q);
        tma_prefetch_desc(&tma_k);
        tma_prefetch_desc(&tma_v);
        tma_prefetch_desc(&tma_do);
        mbar_arrive_expect_tx(smem.bar_kv(), 2 * Tile::kKVBytes);
#pragma unroll
        for (int cb = 0; cb < Tile::kColBlocks; ++cb) {
            tma_load_4d(smem.k + cb * kBlockN * 128, &tma_k, smem.bar_kv(), cb * 64, rows.k_row0 + n0, head_kv, batch);
            tma_load_4d(smem.v + cb * kBlockN * 128, &tma_v, smem.bar_kv(), cb * 64, rows.k_row0 + n0, head_kv, batch);
        }
        for (int i = 0; i < steps.n_iter; ++i) {
            const int head = head0 + i / steps.n_m;
            const int m0 = steps.query_tile(i) * kBlockM;
            const PipelineState<kStages> pipe(i);
            const int stage = pipe.stage();
            mbar_wait(smem.bar_empty(stage), pipe.empty_phase());
            const u32 q_dst = smem.q_stage(stage), do_dst = smem.dout_stage(stage);
            // The query tile's lse2 and delta rows come with its Q and dO, as one more bulk copy each: no
            // warp spends registers and a round trip per step on them. A 32-bit index ((batch * heads_q
            // * 2 + 1) * stat_rows < 2^32, api.py checks it): a 64-bit one spills.
            const float* stats = p.stats + ((static_cast<unsigned>(batch) * p.heads_q + head) * 2u * p.stat_rows + m0);
            mbar_arrive_expect_tx(smem.bar_q_full(stage), Tile::kQBytes + kStatBytes);
#pragma unroll
            for (int cb = 0; cb < Tile::kColBlocks; ++cb)
                tma_load_4d(q_dst + cb * kBlockM * 128, &tma_q, smem.bar_q_full(stage), cb * 64, rows.q_row0 + m0, head,
                            batch);
            bulk_load(smem.stats + stage * kBlockM * 4, stats, kStatBytes, smem.bar_q_full(stage));
            mbar_arrive_expect_tx(smem.bar_do_full(stage), Tile::kQBytes + kStatBytes);
#pragma unroll
            for (int cb = 0; cb < Tile::kColBlocks; ++cb)
                tma_load_4d(do_dst + cb * kBlockM * 128, &tma_do, smem.bar_do_full(stage), cb * 64, rows.q_row0 + m0, head,
                            batch);
            bulk_load(smem.stats + (kStages + stage) * kBlockM * 4, stats + p.stat_rows, kStatBytes,
                      smem.bar_do_full(stage));
        }
    }
};
