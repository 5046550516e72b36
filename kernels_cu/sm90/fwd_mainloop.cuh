// The Hopper forward's key loops, one per consumer schedule.
#pragma once
#include "../common/params.cuh"
#include "../common/softmax.cuh"
#include "wgmma.cuh"
#include "pipeline.cuh"
#include "fwd_tile.cuh"
#include "fwd_math.cuh"
#include "fwd_scheduler.cuh"
#include "fwd_prog.cuh"

// The simple schedule's key loop: per key tile, S, the softmax and P V, each waited for. `key_tiles`: the key
// tiles of query tile m_block (at least one); `it`: the K/V ring iterations before them.
template <class Tile, class Mask, int kMode, int kCluster, int kQBuffers, class Softmax, class KeyTiles>
__device__ __forceinline__ Softmax fwd_mainloop_simple(
    const FwdParams& p, const FwdSmem<Tile, kQBuffers>& smem, const int it, const KeyTiles key_tiles,
    const float scale_log2, float (&acc_o)[Tile::kHeadDimV / 2], Softmax softmax,
    u32 (&qa)[FwdMath<Tile, kMode>::kQInRegs ? Tile::kHeadDimPad / 16 : 1][4], const int qb, const int cw, const int lane,
    const int warp, const int t4, const int m_block, const int head, const int batch, const int row0) {
    using Math = FwdMath<Tile, kMode>;
    using Tag = typename Tile::Tag;
    constexpr int kBlockN = Tile::kBlockN, kStages = Tile::kStages;
    constexpr int kPSteps = Math::kPSteps;
    const u32 sQ = smem.q, sK = smem.k, sV = smem.v;
    Math::load_q_frags(qa, sQ, qb, cw, lane, warp);
    const int n_tiles = key_tiles.count();
    for (int i = 0; i < n_tiles; ++i) {
        const int n_block = key_tiles.tile(i);
        const PipelineState<kStages> ring(it + i);
        const int stage = ring.stage();
        const u32 parity = ring.phase();
        float acc_s[kBlockN / 2];
        mbar_wait(smem.k_full(stage), parity);
        Math::issue_qk(acc_s, sK + stage * Tile::kKSlotBytes, qa, sQ, qb, cw);
        wgmma_wait<0>();
        fence_operand(acc_s);
        Math::template release_kv<kCluster>(lane, smem.k_empty(stage));
        Math::template apply_mask<Mask>(acc_s, n_block, p, m_block, row0, t4, batch, head);
        float rescale[2];
        if (__any_sync(0xffffffff, softmax.step(Math::s3_of(acc_s), scale_log2, rescale))) Math::rescale_o(acc_o, rescale);
        u32 pa[kPSteps][4];
        Math::pack_p(pa, acc_s);
        mbar_wait(smem.v_full(stage), parity);
        Math::issue_pv(acc_o, pa, sV + stage * Tile::kVSlotBytes);
        wgmma_wait<0>();
        fence_operand(acc_o);
        Math::template release_kv<kCluster>(lane, smem.v_empty(stage));
    }
    return softmax;
}

// The overlap schedule's key loop: Q K^T of key tile i and O += P_{i-1} V_{i-1} issued back to back, the
// softmax of tile i while P V computes. `key_tiles`: the key tiles of query tile m_block (at least one); `it`:
// the K/V ring iterations before them. s_descale: fp8 with a score modifier (FwdMath::apply_mask).
template <class Tile, class Mask, int kMode, int kCluster, int kQBuffers, bool kPersistent, class Softmax, class KeyTiles>
__device__ __forceinline__ Softmax fwd_mainloop_overlap(
    const FwdParams& p, const FwdSmem<Tile, kQBuffers>& smem, const int it, const KeyTiles key_tiles,
    const float scale_log2, const float s_descale, float (&acc_o)[Tile::kHeadDimV / 2], Softmax softmax,
    u32 (&qa)[FwdMath<Tile, kMode>::kQInRegs ? Tile::kHeadDimPad / 16 : 1][4], int& settle_tiles, bool& kept_failed,
    const int qb, const int cw, const int lane, const int warp, const int t4, const int m_block, const int head,
    const int batch, const int row0, const int k_tile, int* tile_counter, const ProgParams* pp) {
    using Math = FwdMath<Tile, kMode>;
    using Variant = typename Mask::VariantType;
    // Programmable attention (FwdProg): the bias, the user's modifiers and the partial tiles' tests between the
    // built-in modifiers and the built-in mask, dropout on P once the row sums have it.
    const FwdProg<Variant, Tile::kBlockN> prog(pp, batch, head, p.heads_q, row0 - (lane >> 2), lane);
    using Tag = typename Tile::Tag;
    constexpr int kBlockN = Tile::kBlockN, kStages = Tile::kStages;
    constexpr int kPSteps = Math::kPSteps;
    const u32 sQ = smem.q, sK = smem.k, sV = smem.v;
    // Intra-warpgroup overlap: the softmax of key tile i runs while the
    // tensor cores compute O += P_{i-1} V_{i-1}.
    // 16-bit: a warp whose rows' max has settled takes each key tile's probabilities against the
    // running max as it stands (OnlineSoftmax::probs_at_running_max: no FMNMX chain, no quad
    // shuffles, no rescale). Where some row passes 2^kKeepMaxBoundLog2, the warp re-bases those rows
    // from their probabilities (OnlineSoftmax::rebase: the max of p, p / max; no S needed) and returns to
    // the full step until key tiles move none of its maxima. The decision is per warp and adaptive:
    // trained models' sharp heads move some row's max on many key tiles, and a warpgroup-wide fallback
    // (computing S again for all 64 rows, as this kernel first did) cost up to 26 % there. Only a score
    // 2^112 (bf16 2^120) above a settled max makes the warp compute its S again (qk_warp; the K stage is
    // therefore freed after the softmax in the kept-max state). -DCUFLASH_SM90_FWD_KEEP_MAX=0: the full step
    // alone (the baseline of BENCHMARKS.md's distribution table).
#ifndef CUFLASH_SM90_FWD_KEEP_MAX
#define CUFLASH_SM90_FWD_KEEP_MAX 1
#endif
    // The bound on a thread's partial row sum (so on each probability) in the kept-max state: fp16 P
    // holds up to 2^15; bf16 P has float32's range, and 2^48 still leaves O's float32 sums 2^79 of room
    // for |V| times the number of keys. The wider bound makes re-bases rarer on sharp heads.
    constexpr int kKeepMaxBoundLog2 = kIsBf16<Tag> ? 48 : 14;
    // Programmable variants take the full step: the kept max's recompute (qk_warp) knows no bias or modifier.
    constexpr bool kKeepMax = CUFLASH_SM90_FWD_KEEP_MAX && !Tile::kFp8 && !Variant::kProg;
    u32 pa[kPSteps][4];
    // Per warp: whether its rows' max has settled, so that the next key tile tries the kept max. It
    // starts unsettled (the first key tile, partial or on the causal diagonal, may leave a row a weak
    // max) and leaves that state when a kept step fails; it comes back after `settle_tiles` full steps
    // in a row that move no max. That number doubles with each failure, up to 64 (a failed step stalls
    // the warpgroup's next GEMMs, so it costs more than a full step), and lives across the persistent
    // tile loop: a query tile whose kept steps never failed brings it down by a quarter, so that a warp
    // that met a sharp head comes back to the kept max on a diffuse one, while a warp on a head whose
    // max keeps moving stays with the full step. With three consumer warpgroups (head dim 64, a
    // softmax-bound tile) a failure costs the most and it never comes down; in fp16 there (whose P bound
    // sharp heads pass again and again) a warp's first failure ends its kept max for the kernel.
    int settled = 0;   // full steps in a row that moved no max; the kept max once it reaches settle_tiles
    constexpr int kSettleTilesMax = 64;
    constexpr bool kSettleDecay = Tile::kConsumerWGs < 3;
    constexpr bool kFailureEndsKeptMax = !kSettleDecay && !kIsBf16<Tag>;
    // bf16 with two consumer warpgroups: a full step counts towards settling whether or not it moved a
    // max (rows with no max yet excepted), since the kept state absorbs later maxima up to 2^48 above
    // it; sharp heads, whose maxima keep moving by small amounts, then need not stay on the full step.
    // At head dim 64 (three warpgroups) it lost on the mixed and outlier heads.
    constexpr bool kMovesAbsorbed = kIsBf16<Tag> && kSettleDecay;
    constexpr int kNeverSettles = 0x7fffffff;   // a settle count that `settled` cannot reach
    if (kSettleDecay && !kept_failed) settle_tiles = max(1, settle_tiles - settle_tiles / 4);
    kept_failed = false;
    const int n_tiles = key_tiles.count();
    using Prog = FwdProg<Variant, Tile::kBlockN>;
    typename Prog::BiasRegs bias_next;   // Prog::kAhead: the next key tile's bias, loading while this one runs
    if constexpr (Prog::kAhead) prog.load_bias(bias_next, p, key_tiles.tile(0));
    Math::load_q_frags(qa, sQ, qb, cw, lane, warp);
    {   // the first key tile: its softmax alone (no P V before it)
        float acc_s[kBlockN / 2];
        const PipelineState<kStages> ring(it);
        const int stage0 = ring.stage();
        mbar_wait(smem.k_full(stage0), ring.phase());
        CUFLASH_FWD_TRACE(2, clock64());
        CUFLASH_FWD_TRACE(6, n_tiles);
        Math::issue_qk(acc_s, sK + stage0 * Tile::kKSlotBytes, qa, sQ, qb, cw);
        typename Prog::BiasRegs bias;
        if constexpr (Prog::kAhead) {
            Prog::copy(bias, bias_next);
            if (n_tiles > 1) prog.load_bias(bias_next, p, key_tiles.tile(1));
        } else if constexpr (Variant::kProg) {
            prog.load_bias(bias, p, key_tiles.tile(0));
        }
        wgmma_wait<0>();
        fence_operand(acc_s);
        Math::template release_kv<kCluster>(lane, smem.k_empty(stage0));
        if constexpr (Variant::kProg) {
            Math::template modify_scores<Mask>(acc_s, key_tiles.tile(0), p, row0, t4, batch, head, s_descale);
            prog.scores(Math::s3_of(acc_s), bias, p, key_tiles.tile(0), key_tiles.partial(0));
            Math::template mask_scores<Mask>(acc_s, key_tiles.tile(0), p, m_block, row0, t4);
        } else {
            Math::template apply_mask<Mask>(acc_s, key_tiles.tile(0), p, m_block, row0, t4, batch, head, s_descale);
        }
        float rescale[2];
        softmax.step(Math::s3_of(acc_s), scale_log2, rescale);  // acc_o is still 0: no rescale
        if constexpr (Variant::kDropout) prog.dropout(Math::s3_of(acc_s), key_tiles.tile(0));
        Math::pack_p(pa, acc_s);
    }
    // At head dims 65-128, O's rescale for key tile i is applied at step i + 1 while Q K^T_{i+1} runs,
    // just before O += P_i V_i, rather than between the wait for P_{i-1} V_{i-1} and that issue, where
    // this warpgroup's tensor work would wait on it: it pays on the heads whose max keeps moving. At 64
    // (three warpgroups) and 256 it measured level or worse, so there it stays after the wait.
    constexpr bool kRescaleUnderQk = !Tile::kFp8 && Tile::kHeadDimPad == 128;
    float pending_rescale[2] = {1.f, 1.f};
    bool rescale_pending = false;   // warp-uniform
    for (int i = 1; i < n_tiles; ++i) {
        const int n_block = key_tiles.tile(i);
        const PipelineState<kStages> ring(it + i), ring_prev(it + i - 1);
        const int stage = ring.stage(), prev = ring_prev.stage();
        const u32 parity = ring.phase(), prev_parity = ring_prev.phase();
        float acc_s[kBlockN / 2];
        mbar_wait(smem.k_full(stage), parity);
        Math::issue_qk(acc_s, sK + stage * Tile::kKSlotBytes, qa, sQ, qb, cw);
        if (kRescaleUnderQk && rescale_pending) Math::rescale_o(acc_o, pending_rescale);
        mbar_wait(smem.v_full(prev), prev_parity);
        Math::issue_pv(acc_o, pa, sV + prev * Tile::kVSlotBytes);
        typename Prog::BiasRegs bias;
        if constexpr (Prog::kAhead) {
            Prog::copy(bias, bias_next);
            if (i + 1 < n_tiles) prog.load_bias(bias_next, p, key_tiles.tile(i + 1));
        } else if constexpr (Variant::kProg) {
            prog.load_bias(bias, p, n_block);
        }
        wgmma_wait<1>();  // S_i is ready (groups complete in order)
        fence_operand(acc_s);
        // Per warp, and only between the GEMMs: wgmma must run at one PC for all four warps of the
        // warpgroup (a build with the two states in loops of their own broke that: synccheck).
        const bool full_step = !kKeepMax || settled < settle_tiles;
        // The kept-max state holds K for a possible recompute; the full step frees it at once.
        if (full_step) Math::template release_kv<kCluster>(lane, smem.k_empty(stage));
        if constexpr (Variant::kProg) {
            Math::template modify_scores<Mask>(acc_s, n_block, p, row0, t4, batch, head, s_descale);
            prog.scores(Math::s3_of(acc_s), bias, p, n_block, key_tiles.partial(i));
            Math::template mask_scores<Mask>(acc_s, n_block, p, m_block, row0, t4);
        } else {
            Math::template apply_mask<Mask>(acc_s, n_block, p, m_block, row0, t4, batch, head, s_descale);
        }
        float rescale[2] = {1.f, 1.f};
        bool max_changed = false, unset = false;
        if (full_step) {
            // A row with no max yet counts as moved (its factor is 0 on an O of 0): not settled, so that the
            // kept max (probabilities against a max of -inf) is never tried while a row has none, as when a
            // window's first key tiles hide every key of some rows.
            unset = kKeepMax && softmax.has_unset_row();
            max_changed = softmax.step(Math::s3_of(acc_s), scale_log2, rescale) || unset;
        } else if constexpr (kKeepMax) {
            CUFLASH_FWD_COUNT(2);
            float sums[2];
            const bool ok =
                softmax.template probs_at_running_max<kKeepMaxBoundLog2>(Math::s3_of(acc_s), scale_log2, sums);
            if (__any_sync(0xffffffff, !ok)) {
                if (__all_sync(0xffffffff, softmax.rebase_possible(sums))) {
                    max_changed = softmax.rebase(Math::s3_of(acc_s), sums, rescale);
                    CUFLASH_FWD_COUNT(0);
                } else {
                    Math::template qk_warp<Mask>(acc_s, sK + stage * Tile::kKSlotBytes, n_block, sQ, qb, cw, lane, warp, row0,
                                                 t4, p, batch, head);   // masked as the probabilities were
                    max_changed = softmax.step(Math::s3_of(acc_s), scale_log2, rescale);
                    CUFLASH_FWD_COUNT(1);
                }
                settled = 0;
                settle_tiles = kFailureEndsKeptMax ? kNeverSettles : min(2 * settle_tiles, kSettleTilesMax);
                kept_failed = true;
            } else {
                softmax.add_sums(sums);
            }
            Math::template release_kv<kCluster>(lane, smem.k_empty(stage));
        }
        // Pin the softmax before the wait: the fences consume its results and the
        // scheduling barrier keeps ptxas from hoisting the wait above them.
        fence_operand(acc_s);
        fence_operand(rescale);
        fence_operand(softmax.row_sum);
        scheduling_barrier(p.seqlen_k);
        wgmma_wait<0>();  // O += P_{i-1} V_{i-1} done
        fence_operand(acc_o);
        const bool warp_moved = __any_sync(0xffffffff, max_changed);
        if constexpr (kRescaleUnderQk) {
            rescale_pending = warp_moved;
            pending_rescale[0] = rescale[0];
            pending_rescale[1] = rescale[1];
        } else if (warp_moved) {
            Math::rescale_o(acc_o, rescale);   // this warp's rows only
        }
        if (kKeepMax && full_step)
            settled = (kMovesAbsorbed ? __any_sync(0xffffffff, unset) : warp_moved) ? 0 : settled + 1;
        if constexpr (Variant::kDropout) prog.dropout(Math::s3_of(acc_s), n_block);
        Math::pack_p(pa, acc_s);
        Math::template release_kv<kCluster>(lane, smem.v_empty(prev));
    }
    const PipelineState<kStages> ring_last(it + n_tiles - 1);
    const int last = ring_last.stage();
    if (kRescaleUnderQk && rescale_pending) Math::rescale_o(acc_o, pending_rescale);
    mbar_wait(smem.v_full(last), ring_last.phase());
    Math::issue_pv(acc_o, pa, sV + last * Tile::kVSlotBytes);
    wgmma_wait<0>();
    fence_operand(acc_o);
    Math::template release_kv<kCluster>(lane, smem.v_empty(last));
    CUFLASH_FWD_TRACE(3, clock64());
    return softmax;
}
