// FlashAttention-2 backward for Hopper (sm_90a): dK, dV and dQ on wgmma in one kernel.
//
// One CTA per (key tile of kBlockN = 64 * consumer warpgroups keys, kv head, batch), looping over the
// query tiles (kBlockM = 64 or 128 rows) of every query head of its GQA group. Its parts:
//   bwd_tile.cuh       Sm90BwdTile (the shape), BwdSmem (shared-memory layout, mbarriers), BwdBarrier
//                      (named barriers), the trace build;
//   bwd_scheduler.cuh  BwdTileScheduler (which key tile / (kv head, batch) a CTA takes: sections of L2,
//                      the causal heaviest-first and ordered-dQ orders) and BwdSteps (its query tiles);
//   bwd_producer.cuh   BwdProducer: warpgroup 0 lowers its registers; one thread loads K and V once and
//                      streams Q and dO tiles through a kStages-deep TMA ring (128-byte swizzle,
//                      "full"/"empty" mbarriers), each with its rows of lse2 / delta (written by the
//                      preprocess, padded to whole query tiles: BwdParams.stats);
//   bwd_mainloop.cuh   BwdMainloop: consumer warpgroup c owns keys 64c..64c+63 of the tile; per query tile
//                        S^T  = K_c Q^T          wgmma SS (K and Q K-major)
//                        dP^T = V_c dO^T         wgmma SS
//                        P^T  = exp2(S^T * scale_log2 - lse2[m]),  dS^T = P^T * (dP^T - delta[m])
//                        dV_c += P^T dO          wgmma RS (P^T from the accumulators, dO MN-major)
//                        dK_c += dS^T Q          wgmma RS (dS^T from the accumulators, Q MN-major)
//                        dS -> shared memory as [query][key] (128-byte swizzle, K-major A of dQ),
//                        double-buffered; one named barrier per step between the consumer warpgroups
//                        dQ slice c = dS K       wgmma SS (dS K-major, K MN-major; kBlockM = 64: columns
//                                                split between the warpgroups, 128: rows split),
//                      the slice to shared memory in the accumulators' own order ("dq_full" mbarrier);
//                      every mask question goes to the mask policy (common/mask.cuh), a template
//                      parameter;
//   bwd_dq_writer.cuh  BwdDqWriter: a producer warp per slice (warps 2, 3) adds it to a tile-contiguous
//                      dq_accum with one bulk reduce (cp.reduce.async.bulk): one L2 operation per slice
//                      instead of thousands of 8-byte atomics (bwd_postprocess_tiled converts), and no wait
//                      in the consumers. kDqTileOrdered adds the key tiles' slices in a fixed order (a
//                      semaphore per slice, waited on and released by those warps), so dQ is bitwise
//                      reproducible;
//   bwd_epilogue.cuh   BwdEpilogue: dK, dV through shared memory into 16-byte global stores.
// Split-D tiles (head dims 192 / 256): both warpgroups own the same 64 keys and half of the head dim
// each; each computes S^T / dP^T for half of the query rows, stores its P^T and dS^T halves into shared
// memory, and the dV / dK products take the other half from there (one named barrier per step between
// them). No shared memory is left for the dQ slices: they go into the Q / dO buffers of the ring stage
// just consumed. Causal: query tiles before the key tile's first visible row are skipped; odd lengths
// and head dims come from TMA's zero fill plus masking (P = 0 outside).
#include "bwd_tile.cuh"
#include "bwd_scheduler.cuh"
#include "bwd_producer.cuh"
#include "bwd_dq_writer.cuh"
#include "bwd_mainloop.cuh"
#include "bwd_epilogue.cuh"

// A consumer warpgroup: the mainloop over the CTA's steps, then the epilogue.
template <typename Tag, class Tile, bool kIsCausal, class Mask, class Steps>
__device__ __forceinline__ void bwd_consumer(const BwdParams& p, const BwdSmem<Tile>& smem, int n_block, int n0,
                                             int head_kv, int batch, int wg) {
    constexpr int kBlockM = Tile::kBlockM, kBlockN = Tile::kBlockN, kStages = Tile::kStages, kPad = Tile::kHeadDimPad, kDqCols = Tile::kDqCols;
    using Range = BlockRange<kBlockM, kBlockN, kIsCausal>;
    const u32 sK = smem.k, sV = smem.v, sQ = smem.q, sdO = smem.dout, sdS = smem.ds, sDqStage = smem.dq_stage;
    float* stat_ptr = smem.stat_ptr();
    char* smem_raw = smem.raw;
    const int head0 = head_kv * p.heads_per_kv;
    const u32 bar_kv = smem.bar_kv();
    auto bar_q_full = [&](int s) { return smem.bar_q_full(s); };
    auto bar_do_full = [&](int s) { return smem.bar_do_full(s); };
    auto bar_empty = [&](int s) { return smem.bar_empty(s); };
    auto bar_dq_full = [&](int c) { return smem.bar_dq_full(c); };
    auto bar_dq_empty = [&](int c) { return smem.bar_dq_empty(c); };
        setmaxnreg_inc<Tile::kConsumerRegs>();
        // The steps again (shadowing the CTA's), from an opaque copy of seqlen_q so that ptxas cannot
        // hoist them above setmaxnreg: a value live across setmaxnreg may go to local memory (128-row tiles).
        int seqlen_q_opaque = p.seqlen_q;
        asm volatile("" : "+r"(seqlen_q_opaque));
        const Steps steps(n_block, Mask(seqlen_q_opaque, p.seqlen_k), seqlen_q_opaque, p.seqlen_k, p.heads_per_kv);
        const BwdConsumerThread<Tile> thr(wg);
        const int cw = thr.cw, lane = thr.lane, warp = thr.warp, g = thr.g, t4 = thr.t4;
        constexpr bool kSplitD = Tile::kSplitD;
        constexpr int kKvCols = Tile::kKvCols, kKvPiece = Tile::kKvPiece, kDqPiece = Tile::kDqPiece;
        const int key_wg = thr.key_wg, key_local = thr.key_local, kv_col0 = thr.kv_col0, dq_col0 = thr.dq_col0;
        const int dq_row0 = kBlockM == 64 ? 0 : cw * 64;
        constexpr bool kSplitSdP = Tile::kSplitSdP;
        constexpr int kQCols = kSplitSdP ? kBlockM / 2 : kBlockM;
        const int q_off = thr.q_off;

        float acc_dk[kKvCols / 2], acc_dv[kKvCols / 2];
#pragma unroll
        for (int i = 0; i < kKvCols / 2; ++i) { acc_dk[i] = 0.f; acc_dv[i] = 0.f; }

        if (steps.n_iter > 0) mbar_wait(bar_kv, 0);
        if (threadIdx.x == 128) CUFLASH_BWD_TRACE(2, clock64());
        for (int i = 0; i < steps.n_iter; ++i) {
            const int head = head0 + i / steps.n_m;
            const int m_block = steps.query_tile(i);
            const int m0 = m_block * kBlockM;
            const int stage = i % kStages;
            const u32 parity = (i / kStages) & 1;
            const u32 q_src = sQ + stage * Tile::kQBytes, do_src = sdO + stage * Tile::kQBytes;
            const u32 ds_buf = sdS + ((i & 1) * Tile::kDsCopies + 0)
                                         * Tile::kDsBytes;
            const u32 p_buf = ds_buf + Tile::kDsBytes;   // kSplitSdP: the common P^T

            // S^T = K_c Q^T and dP^T = V_c dO^T (rows: this warpgroup's 64 keys; columns: its kQCols queries).
            float acc_s[kQCols / 2], acc_dp[kQCols / 2];
            // acc = this warpgroup's 64 rows of key_tile (K or V) times query_tile^T (Q or dO), both K-major.
            auto key_query_product = [&](float (&acc)[kQCols / 2], u32 key_tile, u32 query_tile) {
                wgmma_ss_rows_product<Tag, kQCols, kPad, kBlockN, kBlockM>(acc, key_tile + key_wg * 64 * 128,
                                                                           query_tile + q_off * 128);
            };
            mbar_wait(bar_q_full(stage), parity);
            key_query_product(acc_s, sK, q_src);
            mbar_wait(bar_do_full(stage), parity);
            key_query_product(acc_dp, sV, do_src);
            // kStatsEarly: lse2 / delta of this thread's query columns read while S^T / dP^T run, not after the
            // wait, where their shared-memory latency sat at the head of the P^T / dS^T chain (ncu: 40 % of the
            // consumer warps' stall cycles on shared-memory scoreboards). H100 A/B (NOTES, fifteenth session),
            // backward TFLOP/s: D=128 bf16 600 -> 608, fp16 585 -> 592, D=96 463 -> 473; the causal rows lost
            // about 1 % (D=128 517 -> 512, D=256 381 -> 378) and keep the late reads; 128-row query steps (64
            // registers of them) spill with it. -DCUFLASH_SM90_BWD_STATS_LATE: after the wait everywhere.
            constexpr bool kStatsEarly = kQCols <= 64 && !kIsCausal;
            const float* lse2_s = stat_ptr + stage * kBlockM;
            const float* delta_s = stat_ptr + (kStages + stage) * kBlockM;
            float2 lse2_v[kQCols / 8], delta_v[kQCols / 8];
            auto load_stats = [&](int j) {
                lse2_v[j] = *reinterpret_cast<const float2*>(lse2_s + q_off + 8 * j + 2 * t4);
                delta_v[j] = *reinterpret_cast<const float2*>(delta_s + q_off + 8 * j + 2 * t4);
            };
            if constexpr (kStatsEarly) {
#pragma unroll
                for (int j = 0; j < kQCols / 8; ++j) load_stats(j);
            }
            wgmma_wait<0>();
            fence_operand(acc_s);
            fence_operand(acc_dp);
            if (threadIdx.x == 128 && i == 0) CUFLASH_BWD_TRACE(3, clock64());

            // P^T and dS^T. Register 4j + e: key key_local + 8 (e >> 1), query m0 + q_off + 8j + 2 t4 + (e & 1).
            // Masked scores -> -inf on the tiles that need it (P = exp2(-inf - lse2) = 0: lse2 is never
            // -inf), so that the loop below carries no per-element test.
            if (Range::needs_mask(m_block, n_block, p.seqlen_q, p.seqlen_k)) {
#pragma unroll
                for (int j = 0; j < kQCols / 8; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        if (!key_visible<kIsCausal>(m0 + q_off + 8 * j + 2 * t4 + (e & 1), n0 + key_local + 8 * (e >> 1),
                                                    p.seqlen_q, p.seqlen_k))
                            acc_s[4 * j + e] = -CUFLASH_INF;
            }
#pragma unroll
            for (int j = 0; j < kQCols / 8; ++j) {
                if constexpr (!kStatsEarly) load_stats(j);
                const float2 l2 = lse2_v[j], dl = delta_v[j];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float pr = bwd_prob(acc_s[4 * j + e], p.scale_log2, (e & 1) ? l2.y : l2.x);
                    acc_dp[4 * j + e] = pr * (acc_dp[4 * j + e] - ((e & 1) ? dl.y : dl.x));
                    acc_s[4 * j + e] = pr;
                }
            }
            // A-register fragments of P^T and dS^T (k16 step kk = query columns q_off + 16kk ..+ 15).
            u32 pa[kQCols / 16][4], dsa[kQCols / 16][4];
#pragma unroll
            for (int kk = 0; kk < kQCols / 16; ++kk)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    pa[kk][r] = ElemTraits<Tag>::pack2(acc_s[8 * kk + 2 * r], acc_s[8 * kk + 2 * r + 1]);
                    dsa[kk][r] = ElemTraits<Tag>::pack2(acc_dp[8 * kk + 2 * r], acc_dp[8 * kk + 2 * r + 1]);
                }
            // dS -> shared memory, [query][key] K-major for the dQ product: this warpgroup's keys are
            // 64-column block key_wg; the 8 keys kl of chunk kl / 8 of query row m are 16 bytes at
            // m * 128 + ((kl / 8) ^ (m % 8)) * 16. dsa[kk][q] is the 8 x 8 (key, query) block
            // (keys + 8 (q & 1), queries 16 kk + 8 (q >> 1)); one transposing stmatrix per k16 step
            // stores the four (a single instruction instead of 32 two-byte stores per thread).
            // Split-D: each warpgroup stores its query half of dS and of P^T into the common buffers
            // (kSplitSdP); or, both holding all of dS, each stores all of it into its own buffer
            // (kDsCopies = 2), or warpgroup cw stores the query steps kk % 2 == cw of the common one.
            // Causal 128-row query tiles keep two-byte stores: stmatrix, which saves the non-causal step about
            // 130 instructions a warp, measured slower there (sm90/NOTES.md).
            if constexpr (kBlockM == 64 || !kIsCausal) {
                const u32 ds_base = ds_buf + key_wg * kBlockM * 128;
                const int q = lane >> 3, row = lane & 7;             // this lane's block and row
                const int kchunk = 2 * warp + (q & 1);               // (key_local % 64) / 8 of block q
#pragma unroll
                for (int kk = 0; kk < kQCols / 16; ++kk) {
                    const int m = q_off + 16 * kk + 8 * (q >> 1) + row;      // m % 8 == row
                    stmatrix_x4_trans(ds_base + m * 128 + ((kchunk ^ row) << 4), dsa[kk][0], dsa[kk][1], dsa[kk][2],
                                      dsa[kk][3]);
                    if constexpr (kSplitSdP)
                        stmatrix_x4_trans(p_buf + m * 128 + ((kchunk ^ row) << 4), pa[kk][0], pa[kk][1], pa[kk][2],
                                          pa[kk][3]);
                }
            } else {
                char* ds_ptr = smem_raw + (ds_buf + key_wg * kBlockM * 128 - smem_u32(smem_raw));
#pragma unroll
                for (int kk = 0; kk < kBlockM / 16; ++kk)
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const int m = 16 * kk + 8 * (r >> 1) + 2 * t4;      // query of the low half
                        const int kchunk = 2 * warp + (r & 1);              // (key_local % 64) / 8
                        const u32 w = dsa[kk][r];
                        *reinterpret_cast<u16*>(ds_ptr + m * 128 + ((kchunk ^ (m & 7)) << 4) + g * 2) =
                            static_cast<u16>(w & 0xffff);
                        *reinterpret_cast<u16*>(ds_ptr + (m + 1) * 128 + ((kchunk ^ ((m + 1) & 7)) << 4) + g * 2) =
                            static_cast<u16>(w >> 16);
                    }
            }
            fence_proxy_async_smem();

            // kSplitSdP: the other warpgroup's query half of P^T and dS^T is in shared memory once it passes
            // here. Passing it also means that the other warpgroup finished step i - 1 (every wgmma waited
            // for), whose buffers (the other parity) this one overwrites at step i + 1: no race.
            if constexpr (kSplitSdP) named_barrier_sync(1, Tile::kConsumerWGs * 128);

            // dV += P^T dO, dK += dS^T Q (B operands MN-major: k16 step = 16 query rows). A: this warpgroup's
            // P^T / dS^T fragments over its query steps; kSplitSdP: then the other half's from shared
            // memory, stored [query][key] (so an MN-major A: 8-query row groups 1024 bytes apart).
            wgmma_fence();
            // Column c of the B tile: 64-column block c / 64 (kBlockM * 128 bytes apart), byte (c % 64) * 2.
            auto kv_product = [&](float (&acc)[kKvCols / 2], const u32 (&frag)[kQCols / 16][4], u32 b_tile,
                                  u32 other_a) {
#pragma unroll
                for (int pc = 0; pc < kKvCols / kKvPiece; ++pc) {
                    const int col = kv_col0 + pc * kKvPiece;
                    auto& d = *reinterpret_cast<float(*)[kKvPiece / 2]>(acc + pc * (kKvPiece / 2));
                    const u32 b_cols = b_tile + (col / 64) * kBlockM * 128 + (col % 64) * 2;
                    const SmemDesc<> b_desc(b_cols, kBlockM * 128, 1024);
#pragma unroll
                    for (int kk = 0; kk < kQCols / 16; ++kk)
                        WgmmaRS<Tag, kKvPiece>::template run<true>(d, frag[kk], b_desc.at((q_off + 16 * kk) * 128), 1);
                    if constexpr (kSplitSdP) {
                        const int other = kQCols - q_off;   // the other warpgroup's first query
                        const SmemDesc<> a_desc(other_a, 64 * 128, 1024);
#pragma unroll
                        for (int kk = 0; kk < kQCols / 16; ++kk) {
                            const int q = other + 16 * kk;
                            WgmmaSS<Tag, kKvPiece>::template run<true, true>(d, a_desc.at(q * 128), b_desc.at(q * 128), 1);
                        }
                    }
                }
            };
            // kDqEarly: dV, then dQ, then dK, as three groups, so that the dQ slice is written to shared
            // memory while dK runs (the tensor cores were idle while it was, after a wait for all three).
            // H100 A/B (sm90/NOTES.md, fourteenth session), backward TFLOP/s: D=128 bf16 N=4096 569 -> 589,
            // causal 485 -> 513, D=96 429 -> 461, D=64 fp16 467 -> 488. -DCUFLASH_SM90_BWD_DQ_EARLY=0: off.
            constexpr bool kDqEarly = !Tile::kDqInRing
                                      && !kSplitSdP && kPad <= 192;
            kv_product(acc_dv, pa, do_src, p_buf);
            if constexpr (!kDqEarly) kv_product(acc_dk, dsa, q_src, ds_buf);
            wgmma_commit();
            // d=256, both warpgroups computing all of S^T / dP^T: the dK, dV and dQ accumulators (3 x 64
            // registers) and the P^T / dS^T fragments do not fit in 240 registers together, and ptxas would
            // then serialise every wgmma of the kernel (C7512): dV and dK complete before dQ starts. With
            // half the fragments (kSplitSdP) they fit, and dQ is issued behind them (H100 A/B: d=256 bf16
            // 408 -> 413 TFLOP/s, causal 374 -> 383).
            // Every consumer warpgroup's half of dS (kDsCopies = 2: every warp's part of this
            // warpgroup's copy) is in shared memory (kSplitSdP: synchronised before dV / dK).
            if constexpr (!kSplitSdP) named_barrier_sync(1, Tile::kConsumerWGs * 128);

            // Declared here, not before the loop: the first wgmma ignores its input, but the "+f" operands
            // would otherwise keep the last step's values live across the loop.
            float acc_dq[kDqCols / 2];
            // dQ[dq_row0 .., dq_col0 .. dq_col0 + kDqCols) = dS K (A = dS K-major; B = K MN-major, k16 = 16 keys).
            wgmma_fence();
#pragma unroll
            for (int pc = 0; pc < kDqCols / kDqPiece; ++pc) {
                const int col = dq_col0 + pc * kDqPiece;
                auto& dq = *reinterpret_cast<float(*)[kDqPiece / 2]>(acc_dq + pc * (kDqPiece / 2));
                const SmemDesc<> ds_desc(ds_buf + dq_row0 * 128, 16, 1024);
                const SmemDesc<> k_desc(sK + (col / 64) * kBlockN * 128 + (col % 64) * 2, kBlockN * 128, 1024);
#pragma unroll
                for (int kk = 0; kk < kBlockN / 16; ++kk)
                    WgmmaSS<Tag, kDqPiece>::template run<true>(dq, ds_desc.at((kk / 4) * kBlockM * 128 + (kk % 4) * 32),
                                                               k_desc.at(kk * 16 * 128), kk > 0);
            }
            wgmma_commit();
            // Slice -> shared memory (16-byte stores, each warp's 512 bytes contiguous) once the
            // previous one has been read (ring: once both warpgroups are done with this stage's Q
            // and dO), then over to this warpgroup's dQ warp.
            auto stage_dq_slice = [&]() {
                u32 dq_stage;
                mbar_wait(bar_dq_empty(cw), (i & 1) ^ 1);   // the dQ warp has taken the previous slice
                if constexpr (Tile::kDqInRing) {
                    named_barrier_sync(4, Tile::kConsumerWGs * 128);
                    dq_stage = (cw == 0 ? sQ : sdO) + (i % kStages) * Tile::kQBytes;
                } else {
                    dq_stage = sDqStage + cw * Tile::kDqSliceFloats * 4;
                }
                float* stage_ptr = reinterpret_cast<float*>(smem_raw + (dq_stage - smem_u32(smem_raw)));
#pragma unroll
                for (int j = 0; j < kDqCols / 8; ++j)
                    *reinterpret_cast<float4*>(stage_ptr + 512 * j + 4 * (threadIdx.x & 127)) =
                        make_float4(acc_dq[4 * j], acc_dq[4 * j + 1], acc_dq[4 * j + 2], acc_dq[4 * j + 3]);
                fence_proxy_async_smem();
                mbar_arrive(bar_dq_full(cw));
            };
            if constexpr (kDqEarly) {
                wgmma_fence();
                kv_product(acc_dk, dsa, q_src, ds_buf);
                wgmma_commit();
                wgmma_wait<1>();   // dV and dQ done
                fence_operand(acc_dv);
                fence_operand(acc_dq);
#pragma unroll
                for (int kk = 0; kk < kQCols / 16; ++kk) fence_operand(pa[kk]);
                stage_dq_slice();
            }
            wgmma_wait<0>();
            fence_operand(acc_dv);
            fence_operand(acc_dk);
            fence_operand(acc_dq);
#pragma unroll
            for (int kk = 0; kk < kQCols / 16; ++kk) { fence_operand(pa[kk]); fence_operand(dsa[kk]); }
            if constexpr (!Tile::kDqInRing) mbar_arrive(bar_empty(stage));

            if constexpr (!kDqEarly) {   // (kDqEarly: staged above, while dK ran)
                stage_dq_slice();
            }
            if (threadIdx.x == 128 && i < 7) CUFLASH_BWD_TRACE(8 + i, clock64());
        }

        // Epilogue: dK * softmax_scale and dV through shared memory into full 16-byte global stores.
        // Written straight from the accumulators they would be 4-byte stores, each warp touching eight
        // rows per instruction; the CTA waits on them before its SM takes the next key tile (+5 % on the
        // backward at seqlen 1024, sm90/NOTES.md eighth session). The K and V tiles are free once both
        // warpgroups' last dQ products (which read all of K) are done: dK goes where K was, dV where V
        // was, as [key][column] rows with 16-byte chunk c of row r at chunk c ^ (r % 8) (no bank
        // conflicts on either side).
        if (threadIdx.x == 128) CUFLASH_BWD_TRACE(4, clock64());
        named_barrier_sync(5, Tile::kConsumerWGs * 128);
        auto stage_tile = [&](u32 dst, const float (&acc)[kKvCols / 2], float scale) {
            char* base = smem_raw + (dst - smem_u32(smem_raw));
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = key_local + 8 * h;
#pragma unroll
                for (int j = 0; j < kKvCols / 8; ++j) {
                    const int chunk = kv_col0 / 8 + j;
                    *reinterpret_cast<u32*>(base + row * (kPad * 2) + ((chunk ^ (row % 8)) * 16) + 4 * t4) =
                        ElemTraits<Tag>::pack2(acc[4 * j + 2 * h] * scale, acc[4 * j + 2 * h + 1] * scale);
                }
            }
        };
        stage_tile(sK, acc_dk, p.softmax_scale);
        stage_tile(sV, acc_dv, 1.f);
        named_barrier_sync(5, Tile::kConsumerWGs * 128);
        constexpr int kChunks = kPad / 8;   // 16-byte chunks per row
        static_assert(kBlockN * kChunks % (Tile::kConsumerWGs * 128) == 0, "whole rounds of 16-byte chunks");
        const int ctid = threadIdx.x - 128;
        auto store_tile = [&](u32 src, u16* dst, i64 row_stride) {
            const char* base = smem_raw + (src - smem_u32(smem_raw));
#pragma unroll
            for (int it = 0; it < kBlockN * kChunks / (Tile::kConsumerWGs * 128); ++it) {
                const int idx = it * Tile::kConsumerWGs * 128 + ctid;
                const int row = idx / kChunks, chunk = idx % kChunks;
                if (n0 + row < p.seqlen_k && chunk * 8 < p.head_dim)
                    *reinterpret_cast<uint4*>(dst + (n0 + row) * row_stride + chunk * 8) =
                        *reinterpret_cast<const uint4*>(base + row * (kPad * 2) + ((chunk ^ (row % 8)) * 16));
            }
        };
        store_tile(sK, static_cast<u16*>(p.dk) + batch * p.dk_batch_stride + head_kv * p.dk_head_stride,
                   p.dk_row_stride);
        store_tile(sV, static_cast<u16*>(p.dv) + batch * p.dv_batch_stride + head_kv * p.dv_head_stride,
                   p.dv_row_stride);
        if (threadIdx.x == 128) CUFLASH_BWD_TRACE(5, clock64());
}

template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, bool kIsCausal, int kDqMode,
          class Mask = CausalMask<kBlockM, kBlockN, kIsCausal>>
__device__ __forceinline__ void bwd_body(const BwdParams& p, const TmaDesc& tma_q, const TmaDesc& tma_k,
                                         const TmaDesc& tma_v, const TmaDesc& tma_do) {
    using Tile = Sm90BwdTile<kHeadDim, kBlockM, kBlockN, kNWarps, kDqMode>;
    using Scheduler = BwdTileScheduler<kBlockM, kBlockN, kHeadDim, kIsCausal, kDqMode>;
    using Steps = BwdSteps<kBlockM, kBlockN, Mask, Scheduler::kRotate>;

    extern __shared__ char smem_raw[];
    const BwdSmem<Tile> smem(smem_raw);
    if (threadIdx.x == 0) CUFLASH_BWD_TRACE(15, clock64());   // kernel entry
    const BwdBlock blk = Scheduler::block(p);
    const int n0 = blk.n_block * kBlockN;
    const Steps steps(blk.n_block, Mask(p.seqlen_q, p.seqlen_k), p.seqlen_q, p.seqlen_k, p.heads_per_kv);
    const int head0 = blk.head_kv * p.heads_per_kv;
    // Broadcast from lane 0 so that ptxas knows the warpgroup index is warp-uniform: shared-memory
    // addresses and wgmma descriptors built from it then stay in uniform registers (no R2UR per wgmma).
    const int wg = __shfl_sync(0xffffffff, static_cast<int>(threadIdx.x) / 128, 0);

    if (threadIdx.x == 0) smem.init_barriers();
    __syncthreads();
#ifdef CUFLASH_SM90_BWD_TRACE
    if (threadIdx.x == 0) {
        CUFLASH_BWD_TRACE(0, sm_id());
        CUFLASH_BWD_TRACE(1, clock64());
        CUFLASH_BWD_TRACE(7, steps.n_iter);
    }
#endif

    if (wg == 0) {
        setmaxnreg_dec<Tile::kProducerRegs>();
        const int warp = threadIdx.x / 32;
        if (warp == 0 && threadIdx.x == 0 && steps.n_iter > 0) {
            BwdProducer<Tile>::run(p, smem, steps, tma_q, tma_k, tma_v, tma_do, n0, blk.head_kv, blk.batch, head0);
        } else if (kDqMode != 0 && warp >= 2 && warp < 2 + Tile::kConsumerWGs && (threadIdx.x & 31) == 0
                   && steps.n_iter > 0) {
            BwdDqWriter<Tile, kIsCausal, Mask>::run(p, smem, steps, blk.n_block, blk.batch, head0, warp - 2);
        }
    } else {
        bwd_consumer<Tag, Tile, kIsCausal, Mask, Steps>(p, smem, blk.n_block, n0, blk.head_kv, blk.batch, wg);
    }
}

// The entry points (cuflash/config.py names them; their template parameters are the launch's).
#define CUFLASH_SM90_BWD_KERNEL(name, mode)                                                                  \
    template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, bool kIsCausal>               \
    __global__ void __launch_bounds__(kNWarps * 32,                                                            \
                                      (Sm90BwdTile<kHeadDim, kBlockM, kBlockN, kNWarps, mode>::kCtasPerSm))    \
    name(const BwdParams p, const __grid_constant__ TmaDesc tma_q, const __grid_constant__ TmaDesc tma_k,      \
         const __grid_constant__ TmaDesc tma_v, const __grid_constant__ TmaDesc tma_do) {                      \
        bwd_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, kIsCausal, mode>(p, tma_q, tma_k, tma_v, tma_do);   \
    }
CUFLASH_SM90_BWD_KERNEL(bwd_dkdv_dqtile_kernel, kDqTile)
CUFLASH_SM90_BWD_KERNEL(bwd_dkdv_dqtile_ordered_kernel, kDqTileOrdered)
#undef CUFLASH_SM90_BWD_KERNEL
