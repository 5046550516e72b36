// The sm90 backward's consumer mainloop: per step (one query tile of one query head), a consumer
// warpgroup computes S^T and dP^T of its keys, P^T and dS^T, adds P^T dO to dV and dS^T Q to dK, and
// hands its dQ slice (dS K) to its dQ writer warp.
#pragma once
#include "bwd_dq_writer.cuh"

// What a consumer thread owns: its warpgroup's keys, query columns and dK / dV / dQ columns (the dQ rows,
// with 128-row query tiles, are BwdMainloop::run's dq_row0).
template <class Tile>
struct BwdConsumerThread {
    static constexpr int kBlockM = Tile::kBlockM;
    // Query columns of a warpgroup's S^T / dP^T: all kBlockM, or (kSplitSdP) its half.
    static constexpr int kQCols = Tile::kSplitSdP ? kBlockM / 2 : kBlockM;
    int cw, lane, warp, g, t4;
    int key_wg;      // 64-key block of this warpgroup
    int key_local;   // this thread's key rows: key_local (+ 8)
    int kv_col0;     // this warpgroup's dK / dV columns
    int dq_col0;     // and dQ columns
    int q_off;       // and first query column of S^T / dP^T
    __device__ __forceinline__ explicit BwdConsumerThread(int wg)
        : cw(wg - 1), lane(threadIdx.x & 31), warp((threadIdx.x >> 5) & 3), g(lane >> 2), t4(lane & 3),
          key_wg(Tile::kSplitD ? 0 : cw), key_local(key_wg * 64 + warp * 16 + g),
          kv_col0(Tile::kSplitD ? cw * Tile::kKvCols : 0), dq_col0(kBlockM == 64 ? cw * Tile::kDqCols : 0),
          q_off(Tile::kSplitSdP ? cw * kQCols : 0) {}
};

// Mask: the mask / score-modifier policy (common/mask.cuh); every mask question of the step goes to it, and
// the tuning choices below ask its traits.
template <typename Tag, class Tile, class Mask>
struct BwdMainloop {
    static constexpr int kBlockM = Tile::kBlockM, kBlockN = Tile::kBlockN, kStages = Tile::kStages;
    static constexpr int kPad = Tile::kHeadDimPad;
    static constexpr int kKvCols = Tile::kKvCols, kKvPiece = Tile::kKvPiece;
    static constexpr int kDqCols = Tile::kDqCols, kDqPiece = Tile::kDqPiece;
    static constexpr bool kSplitSdP = Tile::kSplitSdP;
    static constexpr int kQCols = BwdConsumerThread<Tile>::kQCols;
    // lse2 / delta of this thread's query columns read while S^T / dP^T run, not after the wait, where
    // their shared-memory latency sat at the head of the P^T / dS^T chain. Not where tiles are skipped
    // (causal: slower there) nor with 128-row query steps (64 registers of them spill).
    // Nor with programmable parts (their per-element work needs the registers).
    static constexpr bool kStatsEarly = kQCols <= 64 && !Mask::kSkipsTiles && !Mask::VariantType::kProg;
    // dV, then dQ, then dK, as three wgmma groups, so that the dQ slice is written to shared memory while
    // dK runs (the tensor cores were idle while it was, after a wait for all three). Not split-D: no
    // registers for it (and the slices wait for the ring stage there).
    static constexpr bool kDqEarly = !Tile::kDqInRing && !kSplitSdP && kPad <= 192;

    using KvAcc = float[kKvCols / 2];       // dK or dV of a warpgroup: 64 keys x kKvCols
    using SdpAcc = float[kQCols / 2];       // S^T or dP^T: 64 keys x kQCols queries
    using DqAcc = float[kDqCols / 2];       // the dQ slice
    using Frags = u32[kQCols / 16][4];      // P^T or dS^T as wgmma A fragments, one per k16 step
    using StatRow = float2[kQCols / 8];     // lse2 or delta of this thread's query columns
    // Programmable: the bias loaded ahead (load_bias_t) where registers allow it, beside 64 keys a warpgroup pair
    // (split-D tiles, head dim 256); beside 128 its 32 registers spilled.
    static constexpr bool kBiasAhead = Mask::VariantType::kBias && kBlockN == 64;
    using BiasT = float[kBiasAhead ? kQCols / 2 : 1];

    using Variant = typename Mask::VariantType;

    const BwdParams& p;
    const BwdSmem<Tile>& smem;
    const BwdConsumerThread<Tile>& thr;
    int n_block, n0;
    const ProgParams* pp;   // programmable attention's parameters (Variant::kProg; else null)

    // The helpers that were lambdas of the earlier single function are plain inline functions (not
    // __forceinline__), so that the compiler simplifies and inlines them as it did the lambdas.
    __device__ __forceinline__ BwdMainloop(const BwdParams& p_, const BwdSmem<Tile>& smem_,
                                           const BwdConsumerThread<Tile>& thr_, int n_block_, int n0_,
                                           const ProgParams* pp_ = nullptr)
        : p(p_), smem(smem_), thr(thr_), n_block(n_block_), n0(n0_), pp(pp_) {}
    // The mask policy, built from the kernel parameters at each question (as the kernel has always read
    // them: at each use, nothing kept in registers across the loop). The score modifier's is built per step
    // with the step's query head (probs_and_ds).
    __device__ __forceinline__ Mask mask() const { return Mask(p); }

    // acc = this warpgroup's 64 rows of key_tile (K or V) times query_tile^T (Q or dO), both K-major.
    __device__ void key_query_product(SdpAcc& acc, u32 key_tile, u32 query_tile) const {
        wgmma_ss_rows_product<Tag, kQCols, kPad, kBlockN, kBlockM>(acc, key_tile + thr.key_wg * 64 * 128,
                                                                   query_tile + thr.q_off * 128);
    }
    // lse2 / delta of this thread's query columns 8j + 2 t4 (+ 1).
    __device__ void load_stats(int j, const float* lse2_s, const float* delta_s, StatRow& lse2_v,
                               StatRow& delta_v) const {
        lse2_v[j] = *reinterpret_cast<const float2*>(lse2_s + thr.q_off + 8 * j + 2 * thr.t4);
        delta_v[j] = *reinterpret_cast<const float2*>(delta_s + thr.q_off + 8 * j + 2 * thr.t4);
    }

    // The rows that see this thread's two key columns (key_local, key_local + 8), as offsets from its first
    // query row m0 + q_off + 2 t4: its element 4j + e is hidden when 8j + (e & 1) is outside column e >> 1's
    // [lo, hi] (the mask policy's col_rows; one bound pair per column, not per element). Windows and chunks
    // take it (per element, their visible() became branches); causal and the key bound keep visible(), whose
    // code is as small.
    __device__ __forceinline__ void col_bounds(int m0, int (&lo)[2], int (&hi)[2]) const {
        const int row0 = m0 + thr.q_off + 2 * thr.t4;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            mask().col_rows(n0 + thr.key_local + 8 * c, lo[c], hi[c]);
            lo[c] -= row0;
            hi[c] -= row0;
        }
    }
    // Bitwise, not short-circuit: two compares and a select per element, no branch.
    static __device__ __forceinline__ bool hidden(int r, int lo, int hi) { return (r < lo) | (r > hi); }

    // P^T and dS^T in place of S^T and dP^T. Register 4j + e: key key_local + 8 (e >> 1), query
    // m0 + q_off + 8j + 2 t4 + (e & 1). head, batch: the step's (the score modifier's, e.g. ALiBi's slope).
    __device__ __forceinline__ void probs_and_ds(int m_block, int m0, SdpAcc& acc_s, SdpAcc& acc_dp, const float* lse2_s,
                                                 const float* delta_s, StatRow& lse2_v, StatRow& delta_v,
                                                 [[maybe_unused]] int head, [[maybe_unused]] int batch,
                                                 [[maybe_unused]] const BiasT& bias_t) const {
        if constexpr (Variant::kProg) {
            prog_probs_and_ds(m_block, m0, acc_s, acc_dp, lse2_s, delta_s, lse2_v, delta_v, head, batch, bias_t);
        } else if constexpr (Mask::kHasScoreMod) {
            // One pass per element (modifier, mask, P, dS), so that a score's derivative is live for that
            // element only: a row of them (kQCols / 2 registers) spills the consumer.
            const Mask mod(p, batch, head);
            const bool masked = mask().needs_mask(m_block, n_block);
            int lo[2], hi[2];
            if (Mask::kLocal && masked) col_bounds(m0, lo, hi);
#pragma unroll
            for (int j = 0; j < kQCols / 8; ++j) {
                if constexpr (!kStatsEarly) load_stats(j, lse2_s, delta_s, lse2_v, delta_v);
                const float2 l2 = lse2_v[j], dl = delta_v[j];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int row = m0 + thr.q_off + 8 * j + 2 * thr.t4 + (e & 1);
                    const int col = n0 + thr.key_local + 8 * (e >> 1);
                    const float s = acc_s[4 * j + e];
                    const float ds = (acc_dp[4 * j + e] - ((e & 1) ? dl.y : dl.x)) * mod.score_derivative(s, row, col);
                    // The modifier before the mask: a modifier may map -inf to a finite score.
                    float s_mod = mod.modify_score(s, row, col);
                    if (masked && (Mask::kLocal ? hidden(8 * j + (e & 1), lo[e >> 1], hi[e >> 1]) : !mask().visible(row, col)))
                        s_mod = -CUFLASH_INF;
                    const float pr = bwd_prob(s_mod, p.scale_log2, (e & 1) ? l2.y : l2.x);
                    acc_dp[4 * j + e] = pr * ds;
                    acc_s[4 * j + e] = pr;
                }
            }
        } else {
            // Masked scores -> -inf on the tiles that need it (P = exp2(-inf - lse2) = 0: lse2 is never -inf),
            // so that the loop below carries no per-element test.
            if (mask().needs_mask(m_block, n_block)) {
                if constexpr (Mask::kLocal) {
                    int lo[2], hi[2];
                    col_bounds(m0, lo, hi);
#pragma unroll
                    for (int j = 0; j < kQCols / 8; ++j)
#pragma unroll
                        for (int e = 0; e < 4; ++e)
                            if (hidden(8 * j + (e & 1), lo[e >> 1], hi[e >> 1])) acc_s[4 * j + e] = -CUFLASH_INF;
                } else {
#pragma unroll
                    for (int j = 0; j < kQCols / 8; ++j)
#pragma unroll
                        for (int e = 0; e < 4; ++e)
                            if (!mask().visible(m0 + thr.q_off + 8 * j + 2 * thr.t4 + (e & 1), n0 + thr.key_local + 8 * (e >> 1)))
                                acc_s[4 * j + e] = -CUFLASH_INF;
                }
            }
#pragma unroll
            for (int j = 0; j < kQCols / 8; ++j) {
                if constexpr (!kStatsEarly) load_stats(j, lse2_s, delta_s, lse2_v, delta_v);
                const float2 l2 = lse2_v[j], dl = delta_v[j];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float pr = bwd_prob(acc_s[4 * j + e], p.scale_log2, (e & 1) ? l2.y : l2.x);
                    acc_dp[4 * j + e] = pr * (acc_dp[4 * j + e] - ((e & 1) ? dl.y : dl.x));
                    acc_s[4 * j + e] = pr;
                }
            }
        }
    }

    // probs_and_ds with programmable attention's parts (common/programmable.cuh), one pass per element as with a
    // score modifier: the built-in modifiers, the bias and the user's score modifier, the built-in mask, P, then
    // the tile's hidden elements, dropout (P^T becomes the dropped probabilities that dV takes), the modifiers'
    // tensor gradients and dbias. Dropout's flags come from the forward's units read transposed
    // (DropoutLanes::block_keep_t): this thread's keys are rows g, g + 8 of its warp's 16, its queries columns.
    // The bias of this thread's S^T elements / softmax_scale (0 outside the sequences), loaded while the step's
    // GEMMs run: read after S^T landed, each load's latency stalled the step (most of a (1, H, N, N) bias's
    // backward time, BENCHMARKS.md).
    __device__ __forceinline__ void load_bias_t(BiasT& bias_t, int m0, int head, int batch) const {
        if constexpr (kBiasAhead) {
            const ProgPolicy<Variant> prog(*pp, batch, head, p.softmax_scale);
#pragma unroll
            for (int j = 0; j < kQCols / 8; ++j)
#pragma unroll
                for (int e1 = 0; e1 < 2; ++e1) {
                    const int row = m0 + thr.q_off + 8 * j + 2 * thr.t4 + e1;
                    const i64 row_at = prog.bias_row(row);
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int col = n0 + thr.key_local + 8 * h;
                        bias_t[4 * j + 2 * h + e1] = row < p.seqlen_q && col < p.seqlen_k
                                                         ? prog.bias(row_at, col) * prog.inv_scale : 0.f;
                    }
                }
        }
    }
    __device__ __forceinline__ void prog_probs_and_ds(int m_block, int m0, SdpAcc& acc_s, SdpAcc& acc_dp,
                                                      const float* lse2_s, const float* delta_s, StatRow& lse2_v,
                                                      StatRow& delta_v, int head, int batch,
                                                      const BiasT& bias_t) const {
        const Mask mod(p, batch, head);
        const ProgPolicy<Variant> prog(*pp, batch, head, p.softmax_scale);
        const bool masked = mask().needs_mask(m_block, n_block);
        const int state = Variant::kBlockSparse ? prog_tile_state(*pp, batch, head, m_block, n_block) : 2;
        const int key0 = n0 + thr.key_wg * 64 + thr.warp * 16;   // the warp's first key
        float dbias_keys[2] = {0.f, 0.f};                         // a bias broadcast over the queries: per key
        unsigned keep_units[2] = {0u, 0u};
#pragma unroll
        for (int j = 0; j < kQCols / 8; ++j) {
            if constexpr (!kStatsEarly) load_stats(j, lse2_s, delta_s, lse2_v, delta_v);
            const float2 l2 = lse2_v[j], dl = delta_v[j];
            if constexpr (Variant::kDropout) {
                if ((j & 1) == 0) {
                    const DropoutLanes lanes(*pp, batch, p.heads_q, head);
#pragma unroll
                    for (int e1 = 0; e1 < 2; ++e1)
                        keep_units[e1] = lanes.block_keep_t(m0 + thr.q_off + 8 * j, key0, thr.g, thr.t4, e1);
                }
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = m0 + thr.q_off + 8 * j + 2 * thr.t4 + (e & 1);
                const int col = n0 + thr.key_local + 8 * (e >> 1);
                float s = acc_s[4 * j + e];
                float grad = 1.f;
                if constexpr (Mask::kHasScoreMod) {
                    grad = mod.score_derivative(s, row, col);
                    s = mod.modify_score(s, row, col);
                }
                const float base = s;
                float ugrad = 1.f;
                s = prog_bwd_score<kBiasAhead>(prog, p, s, row, col, ugrad, bias_t[kBiasAhead ? 4 * j + e : 0]);
                if (masked && !mask().visible(row, col)) s = -CUFLASH_INF;
                float pr = bwd_prob(s, p.scale_log2, (e & 1) ? l2.y : l2.x);
                const bool keep = (keep_units[e & 1] >> DropoutLanes::t_slot(j & 1, e >> 1, thr.g)) & 1u;
                const float ds = prog_bwd_element(prog, base, ugrad, pr, acc_dp[4 * j + e], (e & 1) ? dl.y : dl.x,
                                                  state, row, col, p.seqlen_q, p.seqlen_k, keep, dbias_keys[e >> 1]);
                acc_dp[4 * j + e] = ds * grad;
                acc_s[4 * j + e] = pr;
            }
        }
        if constexpr (Variant::kBias) {   // a bias broadcast over the queries: one add per key and quad
            if (pp->dbias_row_stride == 0) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float sum = dbias_keys[h];
                    sum += __shfl_xor_sync(0xffffffff, sum, 1);
                    sum += __shfl_xor_sync(0xffffffff, sum, 2);
                    const int key = n0 + thr.key_local + 8 * h;
                    if (thr.t4 == 0 && key < p.seqlen_k)
                        atomicAdd(pp->dbias_accum + batch * pp->dbias_batch_stride + head * pp->dbias_head_stride
                                  + key * pp->dbias_col_stride, sum);
                }
            }
        }
    }

    // dS -> shared memory, [query][key] K-major for the dQ product (128-byte swizzle): this warpgroup's keys
    // are 64-column block key_wg. dsa[kk][q] is the 8 x 8 (key, query) block (keys + 8 (q & 1), queries
    // 16 kk + 8 (q >> 1)); one transposing stmatrix per k16 step stores the four (a single instruction
    // instead of 32 two-byte stores per thread). Split-D: each warpgroup stores its query half of dS and of
    // P^T into the common buffers. 128-row query tiles of patterns that skip tiles keep two-byte stores:
    // stmatrix, which saves the non-causal step about 130 instructions a warp, measured slower causal
    // (docs/design.md: dS staging).
    __device__ __forceinline__ void store_ds(u32 ds_buf, u32 p_buf, const Frags& pa, const Frags& dsa) const {
        if constexpr (kBlockM == 64 || !Mask::kSkipsTiles) {
            const u32 ds_base = ds_buf + thr.key_wg * kBlockM * 128;
            const int q = thr.lane >> 3, row = thr.lane & 7;             // this lane's block and row
            const int kchunk = 2 * thr.warp + (q & 1);                   // (key_local % 64) / 8 of block q
#pragma unroll
            for (int kk = 0; kk < kQCols / 16; ++kk) {
                // swizzle128(m, kchunk), written with row = m % 8 (known to be lane & 7: with m % 8 the
                // SASS changes).
                const int m = thr.q_off + 16 * kk + 8 * (q >> 1) + row;
                stmatrix_x4_trans(ds_base + m * 128 + ((kchunk ^ row) << 4), dsa[kk][0], dsa[kk][1], dsa[kk][2],
                                  dsa[kk][3]);
                if constexpr (kSplitSdP)
                    stmatrix_x4_trans(p_buf + m * 128 + ((kchunk ^ row) << 4), pa[kk][0], pa[kk][1], pa[kk][2],
                                      pa[kk][3]);
            }
        } else {
            char* ds_ptr = smem.raw + (ds_buf + thr.key_wg * kBlockM * 128 - smem_u32(smem.raw));
#pragma unroll
            for (int kk = 0; kk < kBlockM / 16; ++kk)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int m = 16 * kk + 8 * (r >> 1) + 2 * thr.t4;      // query of the low half
                    const int kchunk = 2 * thr.warp + (r & 1);              // (key_local % 64) / 8
                    const u32 w = dsa[kk][r];
                    // swizzle128(m, kchunk) and swizzle128(m + 1, kchunk), written with & 7 (% 8 changes the SASS).
                    *reinterpret_cast<u16*>(ds_ptr + m * 128 + ((kchunk ^ (m & 7)) << 4) + thr.g * 2) = static_cast<u16>(w & 0xffff);
                    *reinterpret_cast<u16*>(ds_ptr + (m + 1) * 128 + ((kchunk ^ ((m + 1) & 7)) << 4) + thr.g * 2) =
                        static_cast<u16>(w >> 16);
                }
        }
    }

    // acc (dV or dK) += frag^T-side product with b_tile (dO or Q, MN-major: k16 step = 16 query rows). A:
    // this warpgroup's P^T / dS^T fragments over its query steps; kSplitSdP: then the other half's from
    // shared memory (other_a), stored [query][key] (an MN-major A: 8-query row groups 1024 bytes apart).
    // Column c of the B tile: 64-column block c / 64 (kBlockM * 128 bytes apart), byte (c % 64) * 2.
    __device__ void kv_product(KvAcc& acc, const Frags& frag, u32 b_tile, u32 other_a) const {
        if constexpr (Tile::kKvAtomPieces) {   // pieces of their own widths and columns (Tile::KvPiece)
            static_assert(Tile::kKvPieces == 2, "n64 + n32: head dim 192");
            using P0 = typename Tile::template KvPiece<0>;
            using P1 = typename Tile::template KvPiece<1>;
            kv_piece<P0::kWidth>(acc + P0::kAccOffset, P0::kColBase + thr.cw * P0::kColStep, frag, b_tile, other_a);
            kv_piece<P1::kWidth>(acc + P1::kAccOffset, P1::kColBase + thr.cw * P1::kColStep, frag, b_tile, other_a);
        } else {
#pragma unroll
            for (int pc = 0; pc < kKvCols / kKvPiece; ++pc)
                kv_piece<kKvPiece>(acc + pc * (kKvPiece / 2), thr.kv_col0 + pc * kKvPiece, frag, b_tile, other_a);
        }
    }
    // One piece: acc_piece (kWidth / 2 registers) += the product over columns col .. col + kWidth of b_tile.
    template <int kWidth>
    __device__ __forceinline__ void kv_piece(float* acc_piece, int col, const Frags& frag, u32 b_tile,
                                             u32 other_a) const {
        auto& d = *reinterpret_cast<float(*)[kWidth / 2]>(acc_piece);
        const u32 b_cols = b_tile + (col / 64) * kBlockM * 128 + (col % 64) * 2;
        const SmemDesc<> b_desc(b_cols, kBlockM * 128, 1024);
#pragma unroll
        for (int kk = 0; kk < kQCols / 16; ++kk)
            WgmmaRS<Tag, kWidth>::template run<true>(d, frag[kk], b_desc.at((thr.q_off + 16 * kk) * 128), 1);
        if constexpr (kSplitSdP) {
            const int other = kQCols - thr.q_off;   // the other warpgroup's first query
            const SmemDesc<> a_desc(other_a, 64 * 128, 1024);
#pragma unroll
            for (int kk = 0; kk < kQCols / 16; ++kk) {
                const int q = other + 16 * kk;
                WgmmaSS<Tag, kWidth>::template run<true, true>(d, a_desc.at(q * 128), b_desc.at(q * 128), 1);
            }
        }
    }

    // dQ[dq_row0 .., dq_col0 .. dq_col0 + kDqCols) = dS K (A = dS K-major from ds_rows, the dS rows of
    // dq_row0 on; B = K MN-major, k16 = 16 keys).
    __device__ __forceinline__ void dq_product(DqAcc& acc_dq, u32 ds_rows) const {
#pragma unroll
        for (int pc = 0; pc < kDqCols / kDqPiece; ++pc) {
            const int col = thr.dq_col0 + pc * kDqPiece;
            auto& dq = *reinterpret_cast<float(*)[kDqPiece / 2]>(acc_dq + pc * (kDqPiece / 2));
            const SmemDesc<> ds_desc(ds_rows, 16, 1024);
            const SmemDesc<> k_desc(smem.k + (col / 64) * kBlockN * 128 + (col % 64) * 2, kBlockN * 128, 1024);
#pragma unroll
            for (int kk = 0; kk < kBlockN / 16; ++kk)
                WgmmaSS<Tag, kDqPiece>::template run<true>(dq, ds_desc.at((kk / 4) * kBlockM * 128 + (kk % 4) * 32),
                                                           k_desc.at(kk * 16 * 128), kk > 0);
        }
    }

    // Slice -> shared memory (16-byte stores, each warp's 512 bytes contiguous) once the previous one has
    // been read (ring: once both warpgroups are done with this stage's Q and dO), then over to this
    // warpgroup's dQ warp.
    __device__ void stage_dq_slice(const int& i, const int& stage, const DqAcc& acc_dq) const {
        u32 dq_stage;
        mbar_wait(smem.bar_dq_empty(thr.cw), BwdDqSlotState(i).empty_phase());   // the previous slice is taken
        if constexpr (Tile::kDqInRing) {
            bwd_barrier_sync<Tile>(BwdBarrier::kRingStageRead);
            dq_stage = (thr.cw == 0 ? smem.q : smem.dout) + stage * Tile::kQBytes;
        } else {
            dq_stage = smem.dq_slice(thr.cw);
        }
        float* stage_ptr = reinterpret_cast<float*>(smem.generic(dq_stage));
#pragma unroll
        for (int j = 0; j < kDqCols / 8; ++j)
            *reinterpret_cast<float4*>(stage_ptr + 512 * j + 4 * (threadIdx.x & 127)) =
                make_float4(acc_dq[4 * j], acc_dq[4 * j + 1], acc_dq[4 * j + 2], acc_dq[4 * j + 3]);
        fence_proxy_async_smem();
        mbar_arrive(smem.bar_dq_full(thr.cw));
    }

    // Every step: step i takes query tile steps.query_tile(i) from ring stage PipelineState(i).stage().
    // Then the accumulated dK and dV go to the epilogue. The accumulators and the loop live here, with
    // the step's own arrays, so that the compiler sees them as in the kernel's earlier single function
    // (its SASS is unchanged; with them in the caller, or the step in its own function, it changes).
    template <class Epilogue, class Steps>
    __device__ __forceinline__ void run(const Steps& steps, int head_kv, int batch) const {
        float acc_dk[kKvCols / 2], acc_dv[kKvCols / 2];
#pragma unroll
        for (int i = 0; i < kKvCols / 2; ++i) { acc_dk[i] = 0.f; acc_dv[i] = 0.f; }

        if (steps.n_iter > 0) mbar_wait(smem.bar_kv(), 0);
        if (threadIdx.x == 128) CUFLASH_BWD_TRACE(2, clock64());
        // The dQ slice's rows (128-row query tiles: 64 per warpgroup). Computed here, not kept in thr:
        // equal to the K rows' offset there, and the code generated from a copy in thr differs.
        const int dq_row0 = kBlockM == 64 ? 0 : thr.cw * 64;
        for (int i = 0; i < steps.n_iter; ++i) {
            const int m_block = steps.query_tile(i);
            const int m0 = m_block * kBlockM;
            const PipelineState<kStages> pipe(i);
            const int stage = pipe.stage();
            const u32 phase = pipe.phase();
            const u32 q_src = smem.q_stage(stage), do_src = smem.dout_stage(stage);
            // dS (and P^T) double-buffered by step parity (i & 1: PipelineState<2>'s i % 2 changes the SASS).
            const u32 ds_buf = smem.ds + (i & 1) * Tile::kDsCopies * Tile::kDsBytes;
            const u32 p_buf = ds_buf + Tile::kDsBytes;   // kSplitSdP: the common P^T

            // S^T = K_c Q^T and dP^T = V_c dO^T (rows: this warpgroup's 64 keys; columns: its kQCols queries).
            float acc_s[kQCols / 2], acc_dp[kQCols / 2];
            mbar_wait(smem.bar_q_full(stage), phase);
            key_query_product(acc_s, smem.k, q_src);
            mbar_wait(smem.bar_do_full(stage), phase);
            key_query_product(acc_dp, smem.v, do_src);
            const float* lse2_s = smem.stat_ptr() + stage * kBlockM;
            const float* delta_s = smem.stat_ptr() + (kStages + stage) * kBlockM;
            float2 lse2_v[kQCols / 8], delta_v[kQCols / 8];
            if constexpr (kStatsEarly) {
#pragma unroll
                for (int j = 0; j < kQCols / 8; ++j) load_stats(j, lse2_s, delta_s, lse2_v, delta_v);
            }
            // The step's query head: the steps walk the GQA group's heads (BwdSteps).
            const int head = head_kv * p.heads_per_kv + i / steps.n_m;
            BiasT bias_t;
            load_bias_t(bias_t, m0, head, batch);
            wgmma_wait<0>();
            fence_operand(acc_s);
            fence_operand(acc_dp);
            if (threadIdx.x == 128 && i == 0) CUFLASH_BWD_TRACE(3, clock64());

            probs_and_ds(m_block, m0, acc_s, acc_dp, lse2_s, delta_s, lse2_v, delta_v, head, batch, bias_t);
            // A-register fragments of P^T and dS^T (k16 step kk = query columns q_off + 16kk ..+ 15).
            u32 pa[kQCols / 16][4], dsa[kQCols / 16][4];
#pragma unroll
            for (int kk = 0; kk < kQCols / 16; ++kk)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    pa[kk][r] = ElemTraits<Tag>::pack2(acc_s[8 * kk + 2 * r], acc_s[8 * kk + 2 * r + 1]);
                    dsa[kk][r] = ElemTraits<Tag>::pack2(acc_dp[8 * kk + 2 * r], acc_dp[8 * kk + 2 * r + 1]);
                }
            store_ds(ds_buf, p_buf, pa, dsa);
            fence_proxy_async_smem();

            // kSplitSdP: the other warpgroup's query half of P^T and dS^T is in shared memory once it passes here.
            // Passing it also means that the other warpgroup finished step i - 1 (every wgmma waited for), whose
            // buffers (the other parity) this one overwrites at step i + 1: no race.
            if constexpr (kSplitSdP) bwd_barrier_sync<Tile>(BwdBarrier::kDsReady);

            // dV += P^T dO, dK += dS^T Q.
            wgmma_fence();
            kv_product(acc_dv, pa, do_src, p_buf);
            if constexpr (!kDqEarly) kv_product(acc_dk, dsa, q_src, ds_buf);
            wgmma_commit();

            // Every consumer warpgroup's half of dS is in shared memory (kSplitSdP: synchronised before dV / dK).
            if constexpr (!kSplitSdP) bwd_barrier_sync<Tile>(BwdBarrier::kDsReady);

            // Declared here, not before the loop: the first wgmma ignores its input, but the "+f" operands
            // would otherwise keep the last step's values live across the loop.
            float acc_dq[kDqCols / 2];
            wgmma_fence();
            dq_product(acc_dq, ds_buf + dq_row0 * 128);
            wgmma_commit();
            if constexpr (kDqEarly) {
                wgmma_fence();
                kv_product(acc_dk, dsa, q_src, ds_buf);
                wgmma_commit();
                wgmma_wait<1>();   // dV and dQ done
                fence_operand(acc_dv);
                fence_operand(acc_dq);
#pragma unroll
                for (int kk = 0; kk < kQCols / 16; ++kk) fence_operand(pa[kk]);
                stage_dq_slice(i, stage, acc_dq);
            }
            wgmma_wait<0>();
            fence_operand(acc_dv);
            fence_operand(acc_dk);
            fence_operand(acc_dq);
#pragma unroll
            for (int kk = 0; kk < kQCols / 16; ++kk) { fence_operand(pa[kk]); fence_operand(dsa[kk]); }
            if constexpr (!Tile::kDqInRing) mbar_arrive(smem.bar_empty(stage));
            if constexpr (!kDqEarly) stage_dq_slice(i, stage, acc_dq);   // (kDqEarly: staged above, while dK ran)
            if (threadIdx.x == 128 && i < 7) CUFLASH_BWD_TRACE(8 + i, clock64());
        }
        Epilogue::store(p, smem, thr, acc_dk, acc_dv, n0, head_kv, batch);
    }
};
