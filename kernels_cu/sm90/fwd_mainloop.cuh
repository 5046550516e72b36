// The Hopper forward's consumer mainloop: one consumer warpgroup's 64 query rows against the key tiles
// of a query tile, S = Q K^T and O += P V on wgmma with the online softmax between them.
//
// S = Q K^T: K from the ring (128-byte swizzled); Q from shared memory, or (kQInRegs) loaded once per tile
// into wgmma A fragments, so that the key loop reads only K from shared memory. The softmax runs in exp2
// on the accumulators (common/softmax.cuh: a warpgroup's m64 accumulator gives each warp the m16 row
// ownership of mma.sync). O += P V: P from registers (the A fragment), V from the ring as an MN-major B
// (fp8: V^T, K-major). The mask policy (common/mask.cuh) says which key tiles are visited and which
// elements are masked. Two schedules (FwdSchedule): simple, and overlap, in which Q K^T of tile i and
// P V of tile i - 1 are issued back to back and the softmax of tile i runs while P V computes; the
// overlap schedule also keeps the running max where it has settled (the kept max, below).
#pragma once
#include "../common/numeric.cuh"
#include "../common/softmax.cuh"
#include "../common/mma_sync.cuh"
#include "../common/params.cuh"
#include "wgmma.cuh"
#include "pipeline.cuh"
#include "fwd_tile.cuh"

// The overlap schedule's kept-max state of one warp, carried across the persistent tile loop.
struct KeptMaxState {
    int settle_tiles = 1;      // full steps in a row that move no max before the warp tries the kept max
    bool failed = false;       // whether a kept step failed in the last query tile
};

template <class Tile, int kQBuffers, class Mask, FwdSchedule kSchedule, int kCluster>
struct FwdMainloop {
    using Tag = typename Tile::Tag;
    using Smem = FwdSharedStorage<Tile, kQBuffers>;
    static constexpr int kStages = Tile::kStages;
    static constexpr int kBlockM = Tile::kBlockM, kBlockN = Tile::kBlockN;
    static constexpr int kPad = Tile::kHeadDimPad, kPadV = Tile::kHeadDimV;
    static constexpr int kPSteps = kBlockN / Tile::kKeyStep;   // k-steps of P V per key tile
    // Q in registers pays where it does not spill: the overlap schedule with two warpgroups up to head
    // dim 128, the simple schedule up to 64, at most 128 keys a tile.
    static constexpr bool kQInRegs = !Tile::kFp8 && kBlockN <= 128
                                     && ((kSchedule == FwdSchedule::kOverlap && kBlockM == 128 && kPad <= 128)
                                         || (kSchedule == FwdSchedule::kSimple && kPad <= 64));
    // The running max may trail by up to 2^8: most key tiles then leave it, and O, alone.
    static constexpr int kMaxSlackLog2 = 8;
    // fp16: a max that moves is set 2^8 above the row's largest score (OnlineSoftmax's headroom), so that
    // the kept max below takes scores up to 2^22 above it before P passes its bound, where a sharp head's
    // later maxima mostly fall. fp16 keeps 11 bits down to 2^-14, so probabilities down to 2^-6 of the
    // largest lose nothing, and smaller ones at most what bf16 P loses; larger headrooms cost accuracy on
    // N(0, 1) inputs. bf16 P needs none (its bound is 2^48), fp8 keeps no max.
    static constexpr int kHeadroomLog2 = (kIsBf16<Tag> || Tile::kFp8) ? 0 : 8;
    using Softmax = OnlineSoftmax<1, kBlockN / 8, kMaxSlackLog2, kHeadroomLog2>;
    using Ring = PipelineState<kStages>;

    const Smem& smem;
    const FwdParams& p;
    KeptMaxState& kept;        // across tiles: the overlap schedule's kept-max state (run_overlap)
    const int cw, lane, warp, g, t4;
    const int qb, m_block, row0;   // Q buffer, query tile, this thread's first row (the second is row0 + 8)
    float acc_o[kPadV / 2];
    Softmax softmax;
    u32 qa[kQInRegs ? kPad / 16 : 1][4];

    // One query tile: built per tile, so that its values live no longer than the tile.
    __device__ __forceinline__ FwdMainloop(const Smem& smem_, const FwdParams& p_, KeptMaxState& kept_, int cw_,
                                           int qb_, int m_block_)
        : smem(smem_), p(p_), kept(kept_), cw(cw_), lane(threadIdx.x & 31), warp((threadIdx.x >> 5) & 3),
          g(lane >> 2), t4(lane & 3), qb(qb_), m_block(m_block_), row0(m_block * kBlockM + cw * 64 + warp * 16 + g) {
#pragma unroll
        for (int i = 0; i < kPadV / 2; ++i) acc_o[i] = 0.f;
        softmax.init();
    }

    static __device__ __forceinline__ float (&s3_of(float (&acc)[kBlockN / 2]))[1][kBlockN / 8][4] {
        return *reinterpret_cast<float(*)[1][kBlockN / 8][4]>(acc);
    }
    // Frees a K or V ring stage: every thread arrives, or (clusters) one lane of each warp per CTA of the
    // cluster (the warps of a warpgroup may leave a stage at different times: see qk_warp).
    __device__ __forceinline__ void release(u32 bar) const {
        if constexpr (kCluster == 1) {
            mbar_arrive(bar);
        } else {
            __syncwarp();   // every lane's reads of the stage (qk_warp) are done
            if (lane < kCluster) mbar_arrive_cluster(bar, lane);
        }
    }

    // ---- GEMM parts ----
    // This warp's 16 Q rows, k16 step kk, as an mma A fragment (the wgmma RS A fragment of the warp):
    // lane l addresses row l % 8 (+ 8 for odd l / 8) of the 16-byte chunk 2 kk + (l / 16).
    __device__ __forceinline__ void load_q_frag(u32 (&a)[4], int kk) const {
        const u32 q_rows = smem.q_buffer(qb) + cw * 64 * 128;
        const int q = lane >> 3, r = warp * 16 + (q & 1) * 8 + (lane & 7);
        const int chunk = (2 * kk + (q >> 1)) % 8;   // 16-byte chunk in its 64-column block
        ldmatrix_x4(a, swizzle128(q_rows + (kk / 4) * kBlockM * 128, r, chunk));
    }
    __device__ __forceinline__ void load_q_frags() {
        if constexpr (kQInRegs) {
#pragma unroll
            for (int kk = 0; kk < kPad / 16; ++kk) load_q_frag(qa[kk], kk);
        }
    }
    // S = Q K^T of one key tile (issued, not waited for).
    __device__ __forceinline__ void issue_qk(float (&acc_s)[kBlockN / 2], u32 k_src) {
        if constexpr (kQInRegs) {
            const SmemDesc<> k_desc(k_src, 16, 1024);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < kPad / 16; ++kk) {
                const u64 db = k_desc.at((kk / 4) * kBlockN * 128 + (kk % 4) * 32);
                WgmmaRS<Tag, kBlockN>::template run<false>(acc_s, qa[kk], db, kk > 0);
            }
            wgmma_commit();
        } else {
            wgmma_ss_rows_product<Tag, kBlockN, kPad, kBlockM, kBlockN, Tile::kRowBytes>(
                acc_s, smem.q_buffer(qb) + cw * 64 * Tile::kRowBytes, k_src);
        }
    }
    // O += P V of one key tile (issued, not waited for).
    __device__ __forceinline__ void issue_pv(const u32 (&pa)[kPSteps][4], u32 v_src) {
        const SmemDesc<> v_desc(v_src, Tile::kFp8 ? 16 : kBlockN * 128, 1024);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kPSteps; ++kk) {
            if constexpr (Tile::kFp8) {   // V^T, K-major: 32 keys (bytes) of its kPadV rows per step
                const u64 db = v_desc.at((kk / 4) * kPadV * 128 + (kk % 4) * 32);
                WgmmaRS<Tag, kPadV>::template run<false>(acc_o, pa[kk], db, 1);
            } else {                      // V, MN-major: 16 key rows per step
                const u64 db = v_desc.at(kk * 16 * 128);
                WgmmaRS<Tag, kPadV>::template run<true>(acc_o, pa[kk], db, 1);
            }
        }
        wgmma_commit();
    }
    // S of this warp's 16 rows alone, with mma.sync (its accumulator layout is the wgmma one): the kept-max
    // softmax's recompute, taken only where a score passed a settled running max by more than 2^120, so it
    // must not wait for the other warps, nor take registers or instruction cache from the key loop (loops,
    // not unrolled: unrolled, this path spilled or doubled the kernel). Even so its presence slows the full
    // step at head dim 64 (docs/design.md, open directions: a score bound would remove it).
    __device__ __forceinline__ void qk_warp(float (&acc_s)[kBlockN / 2], u32 k_src, int n_block) const {
        if constexpr (!Tile::kFp8) {
#pragma unroll 1
            for (int j = 0; j < kBlockN / 8; ++j) {   // key block of 8
                float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 1
                for (int kk = 0; kk < kPad / 16; ++kk) {
                    u32 a[4], b[2];
                    load_q_frag(a, kk);
                    // Lanes 0..15 address key 8 j + l % 8, 16-byte chunk 2 kk + l / 8 (b0, b1).
                    const int n = 8 * j + (lane & 7), chunk = (2 * kk + ((lane >> 3) & 1)) % 8;
                    ldmatrix_x2(b, swizzle128(k_src + (kk / 4) * kBlockN * 128, n, chunk));
                    Mma16816<Tag>::run(c, a, b[0], b[1]);
                }
                if constexpr (Mask::kHasScoreMod) {
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        c[e] = Mask(p).modify_score(c[e], row0 + 8 * (e >> 1), n_block * kBlockN + 8 * j + 2 * t4 + (e & 1));
                }
                // acc_s holds the probabilities against the lower running max: where one is 0 (masked, or
                // underflowed), it is 0 against the new max too, so S there becomes -inf (the mask's
                // effect, without its index arithmetic and registers). Static indices keep acc_s in registers.
#pragma unroll
                for (int jj = 0; jj < kBlockN / 8; ++jj)
                    if (jj == j) {
#pragma unroll
                        for (int e = 0; e < 4; ++e) acc_s[4 * jj + e] = acc_s[4 * jj + e] == 0.f ? -CUFLASH_INF : c[e];
                    }
            }
        }
    }

    // ---- softmax parts ----
    // The mask policy on one S tile: the score modifier on every element, then -inf where a tile that
    // needs the mask hides a key.
    __device__ __forceinline__ void apply_mask(float (&acc_s)[kBlockN / 2], int n_block) const {
        if constexpr (Mask::kHasScoreMod) {
#pragma unroll
            for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    acc_s[4 * j + e] = Mask(p).modify_score(acc_s[4 * j + e], row0 + 8 * (e >> 1),
                                                         n_block * kBlockN + 8 * j + 2 * t4 + (e & 1));
        }
        if (Mask(p).needs_mask(m_block, n_block)) {
            const int n0 = n_block * kBlockN;
#pragma unroll
            for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (!Mask(p).visible(row0 + 8 * (e >> 1), n0 + 8 * j + 2 * t4 + (e & 1))) acc_s[4 * j + e] = -CUFLASH_INF;
        }
    }
    __device__ __forceinline__ void rescale_o(const float (&rescale)[2]) {
#pragma unroll
        for (int j = 0; j < kPadV / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[4 * j + e] *= rescale[e >> 1];
    }
    // P in the wgmma A-register fragment: two n8 blocks of S per k16 step (fp16), four per k32
    // step (fp8). The fp8 A fragment wants keys 4t..4t+3 (and 16 + ...) of rows g and g + 8 where
    // the accumulator holds keys 2t, 2t+1 of each n8 block: each register takes two blocks' pairs
    // instead (keys 2t, 2t+1, 8+2t, 9+2t), and V^T's keys are stored in that order, so the
    // product is unchanged and no shuffle is needed.
    static __device__ __forceinline__ void pack_p(u32 (&pa)[kPSteps][4], const float (&acc_s)[kBlockN / 2]) {
#pragma unroll
        for (int kk = 0; kk < kPSteps; ++kk) {
            if constexpr (Tile::kFp8) {
                const float* s = acc_s + 16 * kk;
#pragma unroll
                for (int r = 0; r < 4; ++r) {   // r: (row half r % 2, block pair r / 2)
                    const int b = 8 * (r >> 1) + 2 * (r & 1);
                    pa[kk][r] = ElemTraits<Tag>::pack4(s[b], s[b + 1], s[b + 4], s[b + 5]);
                }
            } else {
#pragma unroll
                for (int r = 0; r < 4; ++r)
                    pa[kk][r] = ElemTraits<Tag>::pack2(acc_s[8 * kk + 2 * r], acc_s[8 * kk + 2 * r + 1]);
            }
        }
    }

    // A warpgroup whose 64 rows all lie past seqlen_q (the last query tile when seqlen_q is not a multiple
    // of kBlockM) keeps the ring's phases (waits for each stage, releases it) but runs no GEMM.
    __device__ __forceinline__ void skip(Ring ring, int n_block_max) const {
        for (int i = 0; i < n_block_max; ++i) {
            const Ring r = ring.advanced(i);
            mbar_wait(smem.k_full(r.stage()), r.phase());
            release(smem.k_empty(r.stage()));
            mbar_wait(smem.v_full(r.stage()), r.phase());
            release(smem.v_empty(r.stage()));
        }
    }

    // ---- schedules ----
    // Each key tile in turn: S, softmax, P V, each waited for.
    __device__ __forceinline__ void run_simple(Ring ring, int n_block_max, float scale_log2) {
        load_q_frags();
        for (int i = 0; i < n_block_max; ++i) {
            const int n_block = n_block_max - 1 - i;
            const Ring r = ring.advanced(i);
            const int stage = r.stage();
            float acc_s[kBlockN / 2];
            mbar_wait(smem.k_full(stage), r.phase());
            issue_qk(acc_s, smem.k_stage(stage));
            wgmma_wait<0>();
            fence_operand(acc_s);
            release(smem.k_empty(stage));
            apply_mask(acc_s, n_block);
            float rescale[2];
            if (__any_sync(0xffffffff, softmax.step(s3_of(acc_s), scale_log2, rescale))) rescale_o(rescale);
            u32 pa[kPSteps][4];
            pack_p(pa, acc_s);
            mbar_wait(smem.v_full(stage), r.phase());
            issue_pv(pa, smem.v_stage(stage));
            wgmma_wait<0>();
            fence_operand(acc_o);
            release(smem.v_empty(stage));
        }
    }

    // The overlap schedule. 16-bit: a warp whose rows' max has settled takes each key tile's probabilities
    // against the running max as it stands (OnlineSoftmax::probs_at_running_max: no max chain, no quad
    // shuffles, no rescale). Where some row passes 2^kKeepMaxBoundLog2, the warp re-bases those rows from
    // their probabilities (OnlineSoftmax::rebase: no S needed) and returns to the full step until key tiles
    // move none of its maxima. The decision is per warp and adaptive: trained models' sharp heads move some
    // row's max on many key tiles, where a warpgroup-wide fallback cost up to 26 %. Only a score 2^112 (bf16
    // 2^120) above a settled max makes the warp compute its S again (qk_warp; the K stage is therefore freed
    // after the softmax in the kept-max state). -DCUFLASH_SM90_FWD_KEEP_MAX=0 builds the full step alone
    // (the baseline of BENCHMARKS.md's distribution table).
    __device__ __forceinline__ void run_overlap(Ring ring, int n_block_max, float scale_log2, const FwdTrace& trace) {
#ifndef CUFLASH_SM90_FWD_KEEP_MAX
#define CUFLASH_SM90_FWD_KEEP_MAX 1
#endif
        // The bound on a thread's partial row sum (so on each probability) in the kept-max state: fp16 P
        // holds up to 2^15; bf16 P has float32's range, and 2^48 still leaves O's float32 sums 2^79 of room
        // for |V| times the number of keys. The wider bound makes re-bases rarer on sharp heads.
        constexpr int kKeepMaxBoundLog2 = kIsBf16<Tag> ? 48 : 14;
        constexpr bool kKeepMax = CUFLASH_SM90_FWD_KEEP_MAX && !Tile::kFp8;
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
        constexpr int kSettleTilesMax = 64;
        constexpr bool kSettleDecay = Tile::kConsumerWGs < 3;
        constexpr bool kFailureEndsKeptMax = !kSettleDecay && !kIsBf16<Tag>;
        // bf16 with two consumer warpgroups: a full step counts towards settling whether or not it moved a
        // max (rows with no max yet excepted), since the kept state absorbs later maxima up to 2^48 above
        // it; sharp heads, whose maxima keep moving by small amounts, then need not stay on the full step.
        // At head dim 64 (three warpgroups) it lost on the mixed and outlier heads.
        constexpr bool kMovesAbsorbed = kIsBf16<Tag> && kSettleDecay;
        constexpr int kNeverSettles = 0x7fffffff;   // a settle count that `settled` cannot reach
        // At head dims 65-128, O's rescale for key tile i is applied at step i + 1 while Q K^T_{i+1} runs,
        // just before O += P_i V_i, rather than between the wait for P_{i-1} V_{i-1} and that issue, where
        // this warpgroup's tensor work would wait on it. At 64 (three warpgroups) and 256 it measured level
        // or worse, so there it stays after the wait.
        constexpr bool kRescaleUnderQk = !Tile::kFp8 && Tile::kHeadDimPad == 128;

        u32 pa[kPSteps][4];
        int settled = 0;   // full steps in a row that moved no max; the kept max once it reaches settle_tiles
        if (kSettleDecay && !kept.failed) kept.settle_tiles = max(1, kept.settle_tiles - kept.settle_tiles / 4);
        kept.failed = false;
        load_q_frags();
        {
            float acc_s[kBlockN / 2];
            const int stage0 = ring.stage();
            mbar_wait(smem.k_full(stage0), ring.phase());
            CUFLASH_FWD_TRACE(trace, 2, clock64());
            CUFLASH_FWD_TRACE(trace, 6, n_block_max);
            issue_qk(acc_s, smem.k_stage(stage0));
            wgmma_wait<0>();
            fence_operand(acc_s);
            release(smem.k_empty(stage0));
            apply_mask(acc_s, n_block_max - 1);
            float rescale[2];
            softmax.step(s3_of(acc_s), scale_log2, rescale);  // acc_o is still 0: no rescale
            pack_p(pa, acc_s);
        }
        float pending_rescale[2] = {1.f, 1.f};
        bool rescale_pending = false;   // warp-uniform
        for (int i = 1; i < n_block_max; ++i) {
            const int n_block = n_block_max - 1 - i;
            const Ring r = ring.advanced(i), r_prev = ring.advanced(i - 1);
            const int stage = r.stage(), prev = r_prev.stage();
            float acc_s[kBlockN / 2];
            mbar_wait(smem.k_full(stage), r.phase());
            issue_qk(acc_s, smem.k_stage(stage));
            if (kRescaleUnderQk && rescale_pending) rescale_o(pending_rescale);
            mbar_wait(smem.v_full(prev), r_prev.phase());
            issue_pv(pa, smem.v_stage(prev));
            wgmma_wait<1>();  // S_i is ready (groups complete in order)
            fence_operand(acc_s);
            // Per warp, and only between the GEMMs: wgmma must run at one PC for all four warps of the
            // warpgroup (a build with the two states in loops of their own broke that: synccheck).
            const bool full_step = !kKeepMax || settled < kept.settle_tiles;
            // The kept-max state holds K for a possible recompute; the full step frees it at once.
            if (full_step) release(smem.k_empty(stage));
            apply_mask(acc_s, n_block);
            float rescale[2] = {1.f, 1.f};
            bool max_changed = false, unset = false;
            if (full_step) {
                // A row with no max yet counts as moved (its factor is 0 on an O of 0): not settled.
                unset = kKeepMax && softmax.has_unset_row();
                max_changed = softmax.step(s3_of(acc_s), scale_log2, rescale) || unset;
            } else if constexpr (kKeepMax) {
                CUFLASH_FWD_COUNT(lane, 2);
                float sums[2];
                const bool ok = softmax.template probs_at_running_max<kKeepMaxBoundLog2>(s3_of(acc_s), scale_log2, sums);
                if (__any_sync(0xffffffff, !ok)) {
                    if (__all_sync(0xffffffff, softmax.rebase_possible(sums))) {
                        max_changed = softmax.rebase(s3_of(acc_s), sums, rescale);
                        CUFLASH_FWD_COUNT(lane, 0);
                    } else {
                        qk_warp(acc_s, smem.k_stage(stage), n_block);   // masked as the probabilities were
                        max_changed = softmax.step(s3_of(acc_s), scale_log2, rescale);
                        CUFLASH_FWD_COUNT(lane, 1);
                    }
                    settled = 0;
                    kept.settle_tiles = kFailureEndsKeptMax ? kNeverSettles : min(2 * kept.settle_tiles, kSettleTilesMax);
                    kept.failed = true;
                } else {
                    softmax.add_sums(sums);
                }
                release(smem.k_empty(stage));
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
                rescale_o(rescale);   // this warp's rows only
            }
            if (kKeepMax && full_step)
                settled = (kMovesAbsorbed ? __any_sync(0xffffffff, unset) : warp_moved) ? 0 : settled + 1;
            pack_p(pa, acc_s);
            release(smem.v_empty(prev));
        }
        const Ring last = ring.advanced(n_block_max - 1);
        if (kRescaleUnderQk && rescale_pending) rescale_o(pending_rescale);
        mbar_wait(smem.v_full(last.stage()), last.phase());
        issue_pv(pa, smem.v_stage(last.stage()));
        wgmma_wait<0>();
        fence_operand(acc_o);
        release(smem.v_empty(last.stage()));
        CUFLASH_FWD_TRACE(trace, 3, clock64());
    }
};
