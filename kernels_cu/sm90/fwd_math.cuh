// The Hopper forward's GEMM and softmax parts of one key tile.
#pragma once
#include "../common/numeric.cuh"
#include "../common/params.cuh"
#include "../common/mma_sync.cuh"
#include "../common/smem.cuh"
#include "wgmma.cuh"
#include "pipeline.cuh"
#include "fwd_tile.cuh"

// The consumer's GEMM and softmax parts on one S tile: Q K^T and P V on wgmma, the kept max's mma.sync
// recompute, the mask policy, O's rescale and P's register fragment.
template <class Tile, int kMode>
struct FwdMath {
    using Tag = typename Tile::Tag;
    static constexpr int kBlockM = Tile::kBlockM, kBlockN = Tile::kBlockN;
    static constexpr int kPad = Tile::kHeadDimPad, kPadV = Tile::kHeadDimV;
    static constexpr int kPSteps = kBlockN / Tile::kKeyStep;   // k-steps of P V per key tile
    // 16-bit tiles: this warpgroup's 64 Q rows as wgmma A fragments (k16 step kk in qa[kk]), loaded
    // once per tile, so that Q K^T reads only K from shared memory (a third less of the key loop's
    // shared-memory reads: docs/design.md, Q in registers). The overlap schedule with three warpgroups,
    // above head dim 128 or above 128 keys a tile spills with the extra registers, so it keeps the
    // shared-memory operand there.
    static constexpr bool kQInRegs = !Tile::kFp8 && kBlockN <= 128
                                     && ((kMode == kModeOverlap && kBlockM == 128 && kPad <= 128)
                                         || (kMode == kModeSimple && kPad <= 64));

    // Frees a K or V ring stage: every thread arrives, or (clusters) one lane of each warp per CTA of the
    // cluster (the warps of a warpgroup may leave a stage at different times: see qk_warp).
    template <int kCluster>
    static __device__ __forceinline__ void release_kv(int lane, u32 bar) {
        if constexpr (kCluster == 1) {
            mbar_arrive(bar);
        } else {
            __syncwarp();   // every lane's reads of the stage (qk_warp) are done
            if (lane < kCluster) mbar_arrive_cluster(bar, lane);
        }
    }
    static __device__ __forceinline__ float (&s3_of(float (&acc)[kBlockN / 2]))[1][kBlockN / 8][4] {
        return *reinterpret_cast<float(*)[1][kBlockN / 8][4]>(acc);
    }
    // This warp's 16 Q rows, k16 step kk, as an mma A fragment (the wgmma RS A fragment of the warp):
    // lane l addresses row l % 8 (+ 8 for odd l / 8) of the 16-byte chunk 2 kk + (l / 16).
    static __device__ __forceinline__ void load_q_frag(u32 (&a)[4], int kk, u32 sQ, int qb, int cw, int lane, int warp) {
        const u32 q_rows = sQ + qb * Tile::kQBytes + cw * 64 * 128;
        const int q = lane >> 3, r = warp * 16 + (q & 1) * 8 + (lane & 7);
        const int chunk = (2 * kk + (q >> 1)) % 8;   // 16-byte chunk in its 64-column block
        ldmatrix_x4(a, swizzle128(q_rows + (kk / 4) * kBlockM * 128, r, chunk));
    }
    static __device__ __forceinline__ void load_q_frags(u32 (&qa)[kQInRegs ? kPad / 16 : 1][4], u32 sQ, int qb, int cw,
                                                        int lane, int warp) {
        if constexpr (kQInRegs) {
#pragma unroll
            for (int kk = 0; kk < kPad / 16; ++kk) load_q_frag(qa[kk], kk, sQ, qb, cw, lane, warp);
        }
    }
    // S of this warp's 16 rows alone, with mma.sync (its accumulator layout is the wgmma one): the kept-max
    // softmax's recompute, taken only where a score passed a settled running max by more than 2^120, so it
    // must not wait for the other warps, nor take registers or instruction cache from the key loop (loops,
    // not unrolled: unrolled, this path spilled or doubled the kernel). Even so its presence slows the full
    // step at head dim 64, in every form tried; what would remove it: docs/design.md, open directions.
    template <class Mask>
    static __device__ __forceinline__ void qk_warp(float (&acc_s)[kBlockN / 2], u32 k_src, int n_block, u32 sQ, int qb,
                                                   int cw, int lane, int warp, int row0, int t4, const FwdParams& p,
                                                   int batch, int head) {
        if constexpr (!Tile::kFp8) {
#pragma unroll 1
            for (int j = 0; j < kBlockN / 8; ++j) {   // key block of 8
                float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 1
                for (int kk = 0; kk < kPad / 16; ++kk) {
                    u32 a[4], b[2];
                    load_q_frag(a, kk, sQ, qb, cw, lane, warp);
                    // Lanes 0..15 address key 8 j + l % 8, 16-byte chunk 2 kk + l / 8 (b0, b1).
                    const int n = 8 * j + (lane & 7), chunk = (2 * kk + ((lane >> 3) & 1)) % 8;
                    ldmatrix_x2(b, swizzle128(k_src + (kk / 4) * kBlockN * 128, n, chunk));
                    Mma16816<Tag>::run(c, a, b[0], b[1]);
                }
                if constexpr (Mask::kHasScoreMod) {   // the scores the probabilities came from
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        c[e] = Mask(p, batch, head).modify_score(c[e], row0 + 8 * (e >> 1),
                                                                 n_block * kBlockN + 8 * j + 2 * t4 + (e & 1));
                }
                // acc_s holds the probabilities against the lower running max: where one is 0 (masked, or
                // underflowed), it is 0 against the new max too, so S there becomes -inf (the mask's
                // effect, without its index arithmetic and registers). Static indices keep acc_s in registers.
#pragma unroll
                for (int jj = 0; jj < kBlockN / 8; ++jj)
                    if (jj == j) {
#pragma unroll
                        for (int e = 0; e < 4; ++e)
                            acc_s[4 * jj + e] = acc_s[4 * jj + e] == 0.f ? -CUFLASH_INF : c[e];
                    }
            }
        }
    }
    // S = Q K^T of one key tile (issued, not waited for).
    static __device__ __forceinline__ void issue_qk(float (&acc_s)[kBlockN / 2], u32 k_src,
                                                    const u32 (&qa)[kQInRegs ? kPad / 16 : 1][4], u32 sQ, int qb, int cw) {
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
                acc_s, sQ + qb * Tile::kQBytes + cw * 64 * Tile::kRowBytes, k_src);
        }
    }
    // O += P V of one key tile (issued, not waited for).
    static __device__ __forceinline__ void issue_pv(float (&acc_o)[kPadV / 2], const u32 (&pa)[kPSteps][4], u32 v_src) {
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
    // The mask policy on one S tile: its score modifier on every element (where it has one), then -inf
    // where a tile that needs the mask hides a key. batch and head: ALiBi's slope. s_descale (fp8 with a
    // modifier): the product of the q and k descales, so that the modifier sees q.k rather than its
    // quantised form (the caller's scale then leaves the descales out).
    template <class Mask>
    static __device__ __forceinline__ void apply_mask(float (&acc_s)[kBlockN / 2], int n_block, const FwdParams& p,
                                                      int m_block, int row0, int t4, int batch, int head,
                                                      float s_descale = 1.f) {
        modify_scores<Mask>(acc_s, n_block, p, row0, t4, batch, head, s_descale);
        mask_scores<Mask>(acc_s, n_block, p, m_block, row0, t4);
    }
    // apply_mask's two halves, between which the programmable parts go (FwdProg).
    template <class Mask>
    static __device__ __forceinline__ void modify_scores(float (&acc_s)[kBlockN / 2], int n_block, const FwdParams& p,
                                                         int row0, int t4, int batch, int head, float s_descale) {
        if constexpr (Mask::kHasScoreMod) {
#pragma unroll
            for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float s = Tile::kFp8 ? acc_s[4 * j + e] * s_descale : acc_s[4 * j + e];
                    acc_s[4 * j + e] = Mask(p, batch, head).modify_score(s, row0 + 8 * (e >> 1),
                                                                         n_block * kBlockN + 8 * j + 2 * t4 + (e & 1));
                }
        }
    }
    template <class Mask>
    static __device__ __forceinline__ void mask_scores(float (&acc_s)[kBlockN / 2], int n_block, const FwdParams& p,
                                                       int m_block, int row0, int t4) {
        if (Mask(p).needs_mask(m_block, n_block)) {
            const int n0 = n_block * kBlockN;
            if constexpr (Mask::kLocal) {   // a window's bounds once per row (MaskPolicy::row_keys)
                int lo[2], hi[2];
#pragma unroll
                for (int h = 0; h < 2; ++h) Mask(p).row_keys(row0 + 8 * h, lo[h], hi[h]);
#pragma unroll
                for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int col = n0 + 8 * j + 2 * t4 + (e & 1);
                        if (col < lo[e >> 1] || col > hi[e >> 1]) acc_s[4 * j + e] = -CUFLASH_INF;
                    }
            } else {
#pragma unroll
                for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        if (!Mask(p).visible(row0 + 8 * (e >> 1), n0 + 8 * j + 2 * t4 + (e & 1)))
                            acc_s[4 * j + e] = -CUFLASH_INF;
            }
        }
    }
    static __device__ __forceinline__ void rescale_o(float (&acc_o)[kPadV / 2], const float (&rescale)[2]) {
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
};
