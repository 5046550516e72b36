// FlashAttention-2 backward for sm_80 and newer: mma.sync m16n8k16 on fp16/bf16,
// fp32 accumulation, cp.async tile loads. P is recomputed from Q, K and the
// forward's lse; no seqlen x seqlen buffer exists.
//
// Kernels (instantiated per head-dim bucket; the run-time head_dim masks columns):
//   bwd_dkdv_kernel     one CTA per (key tile, kv head, batch): holds K_n, V_n and
//                       the dK/dV accumulators, streams the query tiles of every
//                       query head of its GQA group past them. No atomics.
//   bwd_dkdv_dq_kernel  the same, and also adds dS K into a float32 dq_accum with
//                       atomics (fast, not bitwise deterministic); bwd_postprocess
//                       scales and converts.
//   bwd_dq_kernel       one CTA per (query tile, head, batch): recomputes S, P, dP,
//                       dS over the key tiles and keeps dQ in registers
//                       (deterministic mode).
//
// dK/dV kernel, per query tile (Bm rows) against the key tile (Bn rows):
//   S^T  = K Q^T       (Bn x Bm; K as A operand, Q as B operand: warps split n x m)
//   dP^T = V dO^T
//   P^T  = exp2(S^T * scale_log2 - lse2[m]),  dS^T = P^T * (dP^T - delta[m])
//   P^T, dS^T -> shared memory (16-bit, [key][query])
//   dK  += dS^T Q      (A = dS^T from smem, B = Q transposed on load: warps split n x d)
//   dV  += P^T dO
//   dQ_m += dS K       (A = dS, i.e. dS^T transposed on load: warps split m x d)
// Pipeline: the Q tile of the next step loads while dV and dQ are computed, the
// dO tile while dQ and the next S^T are computed. lse2/delta of the next step
// are fetched into registers early and stored to smem late.
#include "../common/numeric.cuh"
#include "../common/params.cuh"
#include "../common/mask.cuh"
#include "../common/programmable.cuh"
#include "../common/varlen.cuh"
#include "../common/bwd_math.cuh"
#include "mma.cuh"
#include "copy.cuh"

// Unroll factor of the k-loops of the products whose operands both come from
// shared memory: full unrolling lets ptxas hoist every fragment load and
// run out of registers next to the dK/dV accumulators.
constexpr int kBwdKkUnroll = 2;

__host__ __device__ constexpr int bwd_imin(int a, int b) { return a < b ? a : b; }
__host__ __device__ constexpr int bwd_imax(int a, int b) { return a > b ? a : b; }

// ---------------------------------------------------------------------------
// Pieces shared by both dK/dV kernel versions (bwd_dkdv_body and bwd_dkdv2_body below):
// they differ in the warp grids, the shared-memory layout and the schedule of loads,
// barriers and products within a step, not in the products themselves. zero_acc and
// warp_mma_smem also serve the dQ kernel (bwd_dq_kernel).

// Geometry of a dK/dV tile, given its warp grids: three products with kMTiles x kNTiles
// m16n8 accumulator tiles per warp.
//   1: S^T, dP^T (kBlockN x kBlockM), kWarpsN1 x kWarpsM1 warps;
//   2: dK, dV    (kBlockN x head_dim), kWarpsN2 x kWarpsD2 warps;
//   3: dQ        (kBlockM x head_dim), kWarpsM3 x kWarpsD3 warps.
// A warp count <= 0 means no grid fits (the versions' static_asserts say so). kSwizzle: the 16-bit tiles' rows
// swizzled where their width allows (layout.cuh), else padded.
template <int kHeadDim_, int kHeadDimPad_, int kBlockM_, int kBlockN_, int kNWarps_,
          int kWarpsN1_, int kWarpsN2_, int kWarpsM3_, bool kSwizzle_ = false>
struct BwdDkdvGeometry {
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kHeadDimPad = kHeadDimPad_;
    static constexpr int kBlockM = kBlockM_;   // query rows per step
    static constexpr int kBlockN = kBlockN_;   // keys held by the CTA
    static constexpr int kNWarps = kNWarps_;
    static constexpr int kThreads = kNWarps * 32;
    static constexpr int kWarpsN1 = kWarpsN1_;
    static constexpr int kWarpsM1 = kNWarps / (kWarpsN1 > 0 ? kWarpsN1 : 1);
    static constexpr int kWarpsN2 = kWarpsN2_;
    static constexpr int kWarpsD2 = kNWarps / (kWarpsN2 > 0 ? kWarpsN2 : 1);
    static constexpr int kWarpsM3 = kWarpsM3_;
    static constexpr int kWarpsD3 = kNWarps / (kWarpsM3 > 0 ? kWarpsM3 : 1);
    static constexpr int kMTiles1 = kBlockN / kWarpsN1 / 16;
    static constexpr int kNTiles1 = kBlockM / kWarpsM1 / 8;
    static constexpr int kMTiles2 = kBlockN / kWarpsN2 / 16;
    static constexpr int kNTiles2 = kHeadDimPad / kWarpsD2 / 8;
    static constexpr int kMTiles3 = kBlockM / kWarpsM3 / 16;
    static constexpr int kNTiles3 = kHeadDimPad / kWarpsD3 / 8;
    // dQ n-tiles per pass (<= 8, even, dividing kNTiles3).
    static constexpr int kNTiles3Chunk = kNTiles3 % 8 == 0 ? 8 : (kNTiles3 % 6 == 0 ? 6 : (kNTiles3 % 4 == 0 ? 4 : 2));
    using RowsD = SmemRows16<kHeadDimPad, kSwizzle_>;   // Q, dO, K, V rows
    using RowsP = SmemRows16<kBlockM, kSwizzle_>;       // P^T, dS^T rows
    static constexpr int kStride = RowsD::kStride;
    static constexpr int kStrideP = RowsP::kStride;
};

template <int kMT, int kNT>
__device__ __forceinline__ void zero_acc(float (&acc)[kMT][kNT][4]) {
#pragma unroll
    for (int t = 0; t < kMT; ++t)
#pragma unroll
        for (int n = 0; n < kNT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[t][n][e] = 0.f;
}

// acc (kMT x kNT m16n8 tiles at A row row0, B column col0) += A B over kKSteps 16-wide
// k-steps, both operands from shared memory laid out as RowsA / RowsB (layout.cuh). A is stored [m][k], or [k][m]
// if kATrans; B is stored [n][k], or [k][n] if kBKn. Swizzled rows step within a warp's slice (layout.cuh): row0 /
// col0 along a stored row a multiple of the slice's width, kMT / kNT there a power of two.
template <typename Tag, int kKSteps, int kUnroll, bool kATrans, bool kBKn, class RowsA, class RowsB, int kMT, int kNT>
__device__ __forceinline__ void warp_mma_smem(float (&acc)[kMT][kNT][4], const u16* sA, int row0,
                                              const u16* sB, int col0, int lane) {
    static_assert(!kATrans || RowsA::kRowPeriod == 1 || (kMT & (kMT - 1)) == 0, "swizzled A^T: kMT a power of two");
    static_assert(!kBKn || RowsB::kRowPeriod == 1 || (kNT & (kNT - 1)) == 0, "swizzled B: kNT a power of two");
    // Each operand's lane address once (as load_a_frag / load_b_frag_* form it, transposed where stored [k][m]),
    // every step a constant offset from it (an XOR of the column bits where swizzled), which ptxas folds into
    // ldmatrix's immediate: element indices per fragment cost more integer instructions than the products' own
    // issue slots can hide.
    const u32 a_base = smem_u32(sA + (kATrans ? RowsA::offset((lane & 7) + (lane >> 4) * 8, row0 + ((lane >> 3) & 1) * 8)
                                              : RowsA::offset(row0 + (lane & 15), (lane >> 4) * 8)));
    const u32 b_base = smem_u32(sB + (kBKn ? RowsB::offset((lane & 7) + ((lane >> 3) & 1) * 8, col0 + (lane >> 4) * 8)
                                           : RowsB::offset(col0 + (lane & 7) + (lane >> 4) * 8, ((lane >> 3) & 1) * 8)));
#pragma unroll kUnroll
    for (int kk = 0; kk < kKSteps; ++kk) {
        u32 a[kMT][4];
#pragma unroll
        for (int t = 0; t < kMT; ++t) {
            if constexpr (kATrans) ldmatrix_x4_trans(a[t], RowsA::step_bytes(a_base, kk * 16, t * 16));
            else ldmatrix_x4(a[t], RowsA::step_bytes(a_base, t * 16, kk * 16));
        }
#pragma unroll
        for (int nn = 0; nn < kNT / 2; ++nn) {
            u32 b[4];
            if constexpr (kBKn) ldmatrix_x4_trans(b, RowsB::step_bytes(b_base, kk * 16, nn * 16));
            else ldmatrix_x4(b, RowsB::step_bytes(b_base, nn * 16, kk * 16));
#pragma unroll
            for (int t = 0; t < kMT; ++t) {
                Mma16816<Tag>::run(acc[t][2 * nn], a[t], b[0], b[1]);
                Mma16816<Tag>::run(acc[t][2 * nn + 1], a[t], b[2], b[3]);
            }
        }
    }
}

// One thread of a dK/dV CTA (key tile blockIdx.x, kv head blockIdx.y, batch blockIdx.z):
// its indices, its warp's slices of the three products, and the steps both versions share.
template <typename Tag, class Tile, class Variant>
struct BwdDkdvThread {
    using Mask = MaskPolicy<Tile::kBlockM, Tile::kBlockN, Variant>;   // the mask policy (common/mask.cuh)
    static constexpr int kBlockM = Tile::kBlockM, kBlockN = Tile::kBlockN;
    static constexpr int kPad = Tile::kHeadDimPad, kThreads = Tile::kThreads;
    using RowsD = typename Tile::RowsD;
    using RowsP = typename Tile::RowsP;
    static constexpr int kMT1 = Tile::kMTiles1, kNT1 = Tile::kNTiles1;
    static constexpr int kMT2 = Tile::kMTiles2, kNT2 = Tile::kNTiles2;
    static constexpr int kMT3 = Tile::kMTiles3, kNT3 = Tile::kNTiles3;

    const BwdParams& p;
    int tid, lane, g, t4;
    int n_block, head_kv, batch, n0, keys_valid, hd;
    const u16 *gK, *gV;      // this CTA's key tile
    const u16 *gQb, *gdOb;   // Q, dO of this batch
    // Step it = 0 .. n_iter - 1 visits query tile m_block_of(it) of query head head_of(it): the n_m tiles
    // [m_begin, m_begin + n_m) of each head of the GQA group from head0, those the mask policy says see this
    // key tile ([m_block_min, m_block_max)). The range lives here and in m_block_of only.
    int m_begin, n_m, n_iter, head0;
    int row1, col1;   // key row, query column of this warp's S^T slice
    int row2, col2;   // key row, head-dim column of this warp's dK/dV slice
    int row3, col3;   // query row, head-dim column of this warp's dQ slice

    __device__ __forceinline__ explicit BwdDkdvThread(const BwdParams& params) : p(params) {
        tid = threadIdx.x;
        lane = tid & 31;
        const int warp = tid >> 5;
        g = lane >> 2;
        t4 = lane & 3;
        n_block = blockIdx.x;
        head_kv = blockIdx.y;
        batch = blockIdx.z;
        n0 = n_block * kBlockN;
        keys_valid = min(kBlockN, p.seqlen_k - n0);
        hd = p.head_dim;
        gK = static_cast<const u16*>(p.k) + batch * p.k_batch_stride + head_kv * p.k_head_stride + n0 * p.k_row_stride;
        gV = static_cast<const u16*>(p.v) + batch * p.v_batch_stride + head_kv * p.v_head_stride + n0 * p.v_row_stride;
        gQb = static_cast<const u16*>(p.q) + batch * p.q_batch_stride;
        gdOb = static_cast<const u16*>(p.dout) + batch * p.do_batch_stride;
        m_begin = Mask(p).m_block_min(n_block);
        const int m_end = Mask(p).m_block_max(n_block);
        n_m = m_end > m_begin ? m_end - m_begin : 0;
        n_iter = n_m * p.heads_per_kv;
        head0 = head_kv * p.heads_per_kv;
        row1 = warp % Tile::kWarpsN1 * kMT1 * 16;
        col1 = warp / Tile::kWarpsN1 * kNT1 * 8;
        row2 = warp % Tile::kWarpsN2 * kMT2 * 16;
        col2 = warp / Tile::kWarpsN2 * kNT2 * 8;
        row3 = warp % Tile::kWarpsM3 * kMT3 * 16;
        col3 = warp / Tile::kWarpsM3 * kNT3 * 8;
    }

    __device__ __forceinline__ int head_of(int it) const { return head0 + it / n_m; }
    __device__ __forceinline__ int m_block_of(int it) const { return m_begin + it % n_m; }

    // lse2 / delta of query tile (head, m_block): thread i < kBlockM fetches lse2[i],
    // thread kBlockM + i fetches delta[i]; stored at sStat[tid] (lse2, then delta).
    __device__ __forceinline__ float fetch_row_stat(int head, int m_block) const {
        const int i = tid < kBlockM ? tid : tid - kBlockM;
        const int row = m_block * kBlockM + i;
        const i64 idx = stat_offset<Variant::kVarlen>(p, batch, head) + row;
        if (tid < kBlockM) return row < p.seqlen_q ? bwd_lse2(p.lse[idx]) : CUFLASH_INF;
        if (tid < 2 * kBlockM) return row < p.seqlen_q ? p.delta[idx] : 0.f;
        return 0.f;
    }
    __device__ __forceinline__ void store_row_stat(float* sStat, float x) const {
        if (tid < 2 * kBlockM) sStat[tid] = x;
    }

    __device__ __forceinline__ void load_kv(u16* sK, u16* sV) const {
        load_tile_async_pred<u16, kBlockN, kPad, RowsD, kThreads>(sK, gK, p.k_row_stride, keys_valid, hd, tid);
        load_tile_async_pred<u16, kBlockN, kPad, RowsD, kThreads>(sV, gV, p.v_row_stride, keys_valid, hd, tid);
    }
    __device__ __forceinline__ void load_q(u16* sQ, int head, int m_block) const {
        const int m0 = m_block * kBlockM;
        load_tile_async_pred<u16, kBlockM, kPad, RowsD, kThreads>(
            sQ, gQb + head * p.q_head_stride + m0 * p.q_row_stride, p.q_row_stride, p.seqlen_q - m0, hd, tid);
    }
    __device__ __forceinline__ void load_do(u16* sdO, int head, int m_block) const {
        const int m0 = m_block * kBlockM;
        load_tile_async_pred<u16, kBlockM, kPad, RowsD, kThreads>(
            sdO, gdOb + head * p.do_head_stride + m0 * p.do_row_stride, p.do_row_stride, p.seqlen_q - m0, hd, tid);
    }

    // acc (key x query) += sKV sQdO^T: S^T = K Q^T or dP^T = V dO^T.
    template <int kUnroll>
    __device__ __forceinline__ void key_query_product(float (&acc)[kMT1][kNT1][4], const u16* sKV,
                                                      const u16* sQdO) const {
        warp_mma_smem<Tag, kPad / 16, kUnroll, false, false, RowsD, RowsD>(acc, sKV, row1, sQdO, col1, lane);
    }
    // acc (key x head dim) += sPdS sQdO: dK += dS^T Q or dV += P^T dO.
    __device__ __forceinline__ void key_dim_product(float (&acc)[kMT2][kNT2][4], const u16* sPdS,
                                                    const u16* sQdO) const {
        warp_mma_smem<Tag, kBlockM / 16, kBwdKkUnroll, false, true, RowsP, RowsD>(acc, sPdS, row2, sQdO, col2, lane);
    }

    // P^T = exp2(S^T * scale_log2 - lse2), dS^T = P^T * (dP^T - delta), masked, to sP / sdS
    // (16-bit, [key][query]). Element (t, n, e) of the accumulators: key row1 + t*16 + g + (e>>1)*8,
    // query col1 + n*8 + 2*t4 + (e&1). kStatPairs: lse2 / delta pairs read as one float2 each.
    // head: the query head (the score modifier's ALiBi slope).
    // pp: programmable attention's parameters (Variant::kProg; else null): the bias, the user's modifiers and
    // the tile's state under block sparsity on the scores, dropout on P (sP holds the dropped P that dV takes,
    // dS the gradient through the dropped dP), dbias and the modifiers' tensor gradients accumulated.
    template <bool kStatPairs>
    __device__ __forceinline__ void store_p_ds(const float (&acc_s)[kMT1][kNT1][4], const float (&acc_dp)[kMT1][kNT1][4],
                                               const float* sLse2, const float* sDelta, int head, int m_block,
                                               u16* sP, u16* sdS, const ProgParams* pp = nullptr) const {
        const int m0 = m_block * kBlockM;
        const bool mask = Mask(p).needs_mask(m_block, n_block);
        const Mask mod(p, batch, head);   // the score modifier (unused, so not built, without one)
        int state = 2;                    // programmable: the tile's state (common/programmable.cuh)
        unsigned keep_pairs[kMT1][2];     // dropout: the two units of each 16 x 16 block (kept from even n)
        float dbias_rows[kMT1][2];        // a bias broadcast over the queries: each key row's sum
        // Element (t, n, h) of this thread's slice: RowsP::step of its first (rows and columns add as whole blocks).
        const int p_off0 = RowsP::offset(row1 + g, col1 + 2 * t4);
        if constexpr (Variant::kBlockSparse) state = prog_tile_state(*pp, batch, head, m_block, n_block);
        if constexpr (Variant::kBias) {
#pragma unroll
            for (int t = 0; t < kMT1; ++t) dbias_rows[t][0] = dbias_rows[t][1] = 0.f;
        }
#pragma unroll
        for (int n = 0; n < kNT1; ++n) {
            const int qc = col1 + n * 8 + 2 * t4;
            float2 l, d;
            if constexpr (kStatPairs) {
                l = *reinterpret_cast<const float2*>(sLse2 + qc);
                d = *reinterpret_cast<const float2*>(sDelta + qc);
            } else {
                l = make_float2(sLse2[qc], sLse2[qc + 1]);
                d = make_float2(sDelta[qc], sDelta[qc + 1]);
            }
            if constexpr (Variant::kDropout) {
                if ((n & 1) == 0) {
                    const DropoutLanes lanes(*pp, batch, p.heads_q, head);
#pragma unroll
                    for (int t = 0; t < kMT1; ++t)
#pragma unroll
                        for (int e1 = 0; e1 < 2; ++e1)
                            keep_pairs[t][e1] = lanes.block_keep_t(m0 + col1 + n * 8, n0 + row1 + t * 16, g, t4, e1);
                }
            }
#pragma unroll
            for (int t = 0; t < kMT1; ++t) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int kr = row1 + t * 16 + g + h * 8;
                    float s0 = acc_s[t][n][2 * h], s1 = acc_s[t][n][2 * h + 1];
                    float grad0 = 1.f, grad1 = 1.f;   // the score modifier's derivatives (where it has one)
                    if constexpr (Mask::kHasScoreMod) {
                        grad0 = mod.score_derivative(s0, m0 + qc, n0 + kr);
                        grad1 = mod.score_derivative(s1, m0 + qc + 1, n0 + kr);
                        s0 = mod.modify_score(s0, m0 + qc, n0 + kr);
                        s1 = mod.modify_score(s1, m0 + qc + 1, n0 + kr);
                    }
                    const float base0 = s0, base1 = s1;   // after the built-in modifiers
                    float ugrad0 = 1.f, ugrad1 = 1.f;     // programmable: the user score modifier's derivatives
                    if constexpr (Variant::kProg) {
                        const ProgPolicy<Variant> prog(*pp, batch, head, p.softmax_scale);
                        s0 = prog_score(prog, s0, m0 + qc, n0 + kr, ugrad0);
                        s1 = prog_score(prog, s1, m0 + qc + 1, n0 + kr, ugrad1);
                    }
                    float p0 = bwd_prob(s0, p.scale_log2, l.x);
                    float p1 = bwd_prob(s1, p.scale_log2, l.y);
                    if (mask) {
                        // Per element: a query row meets only kMT1 * 2 keys here, and the bounds held across
                        // them (MaskPolicy::row_keys) spill at d128.
                        if (!Mask(p).visible(m0 + qc, n0 + kr)) p0 = 0.f;
                        if (!Mask(p).visible(m0 + qc + 1, n0 + kr)) p1 = 0.f;
                    }
                    float ds0, ds1;
                    if constexpr (Variant::kProg) {
                        const ProgPolicy<Variant> prog(*pp, batch, head, p.softmax_scale);
                        ds0 = prog_element_t(prog, base0, ugrad0, p0, acc_dp[t][n][2 * h], d.x, state, m0 + qc,
                                             n0 + kr, n & 1, h, keep_pairs[t][0], dbias_rows[t][h]);
                        ds1 = prog_element_t(prog, base1, ugrad1, p1, acc_dp[t][n][2 * h + 1], d.y, state, m0 + qc + 1,
                                             n0 + kr, n & 1, h, keep_pairs[t][1], dbias_rows[t][h]);
                    } else {
                        ds0 = p0 * (acc_dp[t][n][2 * h] - d.x);
                        ds1 = p1 * (acc_dp[t][n][2 * h + 1] - d.y);
                    }
                    if constexpr (Mask::kHasScoreMod) {
                        ds0 *= grad0;
                        ds1 *= grad1;
                    }
                    const int off = RowsP::step(p_off0, t * 16 + h * 8, n * 8);
                    *reinterpret_cast<u32*>(sP + off) = ElemTraits<Tag>::pack2(p0, p1);
                    *reinterpret_cast<u32*>(sdS + off) = ElemTraits<Tag>::pack2(ds0, ds1);
                }
            }
        }
        if constexpr (Variant::kBias) {   // a bias broadcast over the queries: one add per key row and warp column
            if (pp->dbias_row_stride == 0) {
#pragma unroll
                for (int t = 0; t < kMT1; ++t)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        float sum = dbias_rows[t][h];
                        sum += __shfl_xor_sync(0xffffffff, sum, 1);
                        sum += __shfl_xor_sync(0xffffffff, sum, 2);
                        const int key = n0 + row1 + t * 16 + g + h * 8;
                        if (t4 == 0 && key < p.seqlen_k)
                            atomicAdd(pp->dbias_accum + batch * pp->dbias_batch_stride + head * pp->dbias_head_stride
                                      + key * pp->dbias_col_stride, sum);
                    }
            }
        }
    }

    // Programmable attention's score and rest at one element of S^T (common/programmable.cuh).
    __device__ __forceinline__ float prog_score(const ProgPolicy<Variant>& prog, float s, int q, int k,
                                                float& ugrad) const {
        return prog_bwd_score(prog, p, s, q, k, ugrad);
    }
    __device__ __forceinline__ float prog_element_t(const ProgPolicy<Variant>& prog, float base, float ugrad,
                                                    float& p_io, float dp, float delta, int state, int q, int k, int qh,
                                                    int h, unsigned keep_bits, float& row_sum) const {
        return prog_bwd_element(prog, base, ugrad, p_io, dp, delta, state, q, k, p.seqlen_q, p.seqlen_k,
                                (keep_bits >> DropoutLanes::t_slot(qh, h, g)) & 1u, row_sum);
    }

    // dq_accum[query tile (head, m_block)] += dS K; A = dS (query x key), read from dS^T
    // transposed. Column chunks of kNT3c n-tiles bound the live accumulators. add_pair(dst, a, b)
    // adds a to dst[0] and b to dst[1].
    template <class AddPair>
    __device__ __forceinline__ void add_dq(const u16* sdS, const u16* sK, int head, int m_block,
                                           AddPair add_pair) const {
        constexpr int kNT3c = Tile::kNTiles3Chunk;
        const int m0 = m_block * kBlockM;
        float* gdq = p.dq_accum + stat_offset<Variant::kVarlen>(p, batch, head) * hd;
#pragma unroll 1
        for (int chunk = 0; chunk < kNT3 / kNT3c; ++chunk) {
            const int colc = col3 + chunk * kNT3c * 8;
            float acc_dq[kMT3][kNT3c][4];
            zero_acc(acc_dq);
            warp_mma_smem<Tag, kBlockN / 16, kBwdKkUnroll, true, true, RowsP, RowsD>(
                acc_dq, sdS, row3, sK, colc, lane);
#pragma unroll
            for (int t = 0; t < kMT3; ++t)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = m0 + row3 + t * 16 + g + h * 8;
                    if (row < p.seqlen_q) {
                        float* dst = gdq + static_cast<i64>(row) * hd;
#pragma unroll
                        for (int n = 0; n < kNT3c; ++n) {
                            const int col = colc + n * 8 + 2 * t4;  // even; hd % 8 == 0
                            if (col < hd) add_pair(dst + col, acc_dq[t][n][2 * h], acc_dq[t][n][2 * h + 1]);
                        }
                    }
                }
        }
    }

    // Epilogue: dK * softmax_scale and dV, staged through the K / V buffers.
    __device__ __forceinline__ void store_dkdv(const float (&acc_dk)[kMT2][kNT2][4],
                                               const float (&acc_dv)[kMT2][kNT2][4], u16* sK, u16* sV) const {
        __syncthreads();  // every warp is done with sK, sV (also when n_iter == 0: uniform)
        const int off0 = RowsD::offset(row2 + g, col2 + 2 * t4);
#pragma unroll
        for (int t = 0; t < kMT2; ++t)
#pragma unroll
            for (int n = 0; n < kNT2; ++n)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int off = RowsD::step(off0, t * 16 + h * 8, n * 8);
                    *reinterpret_cast<u32*>(sK + off) = ElemTraits<Tag>::pack2(
                        acc_dk[t][n][2 * h] * p.softmax_scale, acc_dk[t][n][2 * h + 1] * p.softmax_scale);
                    *reinterpret_cast<u32*>(sV + off) =
                        ElemTraits<Tag>::pack2(acc_dv[t][n][2 * h], acc_dv[t][n][2 * h + 1]);
                }
        __syncthreads();
        u16* gdK = static_cast<u16*>(p.dk) + batch * p.dk_batch_stride + head_kv * p.dk_head_stride
                   + n0 * p.dk_row_stride;
        u16* gdV = static_cast<u16*>(p.dv) + batch * p.dv_batch_stride + head_kv * p.dv_head_stride
                   + n0 * p.dv_row_stride;
        store_tile_pred<u16, kBlockN, kPad, RowsD, kThreads>(gdK, sK, p.dk_row_stride, keys_valid, hd, tid);
        store_tile_pred<u16, kBlockN, kPad, RowsD, kThreads>(gdV, sV, p.dv_row_stride, keys_valid, hd, tid);
    }
};

// Version 1: every product on the warp grid that splits the keys first; the head dim is
// padded so that every warp's column slice is whole 16-wide MMA steps.
__host__ __device__ constexpr int bwd_dkdv_head_dim_pad(int head_dim, int block_m, int block_n, int nwarps) {
    const int align = 16 * bwd_imax(nwarps / bwd_imin(nwarps, block_n / 16), nwarps / bwd_imin(nwarps, block_m / 16));
    return (head_dim + align - 1) / align * align;
}

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_>
struct BwdDkdvTile
    : BwdDkdvGeometry<kHeadDim_, bwd_dkdv_head_dim_pad(kHeadDim_, kBlockM_, kBlockN_, kNWarps_), kBlockM_, kBlockN_,
                      kNWarps_, bwd_imin(kNWarps_, kBlockN_ / 16), bwd_imin(kNWarps_, kBlockN_ / 16),
                      bwd_imin(kNWarps_, kBlockM_ / 16)> {
    using Base = BwdDkdvGeometry<kHeadDim_, bwd_dkdv_head_dim_pad(kHeadDim_, kBlockM_, kBlockN_, kNWarps_), kBlockM_,
                                 kBlockN_, kNWarps_, bwd_imin(kNWarps_, kBlockN_ / 16),
                                 bwd_imin(kNWarps_, kBlockN_ / 16), bwd_imin(kNWarps_, kBlockM_ / 16)>;
    static constexpr int kSmemElems = (2 * kBlockM_ + 2 * kBlockN_) * Base::kStride + 2 * kBlockN_ * Base::kStrideP;
    static constexpr int kSmemBytes = kSmemElems * 2 + 2 * kBlockM_ * 4;  // + lse2, delta

    static_assert(kNWarps_ % Base::kWarpsN1 == 0 && kNWarps_ % Base::kWarpsM3 == 0, "warp grid");
    static_assert(kBlockN_ % (16 * Base::kWarpsN1) == 0 && kBlockM_ % (16 * Base::kWarpsM1) == 0, "GEMM 1 tiles");
    static_assert(Base::kNTiles1 % 2 == 0 && Base::kNTiles2 % 2 == 0 && Base::kNTiles3 % 2 == 0,
                  "n-tiles come in pairs");
    static_assert(kBlockM_ % (16 * Base::kWarpsM3) == 0, "GEMM 5 tiles");
    static_assert(Base::kThreads >= 2 * kBlockM_, "one thread per lse / delta value");
    static_assert(kHeadDim_ % 8 == 0, "head_dim must be a multiple of 8");
};

// pp: programmable attention's parameters (Variant::kProg; else null).
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, bool kAtomicDq>
__device__ __forceinline__ void bwd_dkdv_body(const BwdParams& p, const ProgParams* pp = nullptr) {
    using Tile = BwdDkdvTile<kHeadDim, kBlockM, kBlockN, kNWarps>;
    constexpr int kStride = Tile::kStride;
    constexpr int kStrideP = Tile::kStrideP;

    extern __shared__ __align__(128) u16 smem[];
    u16* sQ = smem;
    u16* sdO = sQ + kBlockM * kStride;
    u16* sK = sdO + kBlockM * kStride;
    u16* sV = sK + kBlockN * kStride;
    u16* sP = sV + kBlockN * kStride;      // P^T  [key][query]
    u16* sdS = sP + kBlockN * kStrideP;    // dS^T [key][query]
    float* sLse2 = reinterpret_cast<float*>(sdS + kBlockN * kStrideP);
    float* sDelta = sLse2 + kBlockM;

    const BwdDkdvThread<Tag, Tile, Variant> th(p);

    float acc_dk[Tile::kMTiles2][Tile::kNTiles2][4], acc_dv[Tile::kMTiles2][Tile::kNTiles2][4];
    zero_acc(acc_dk);
    zero_acc(acc_dv);

    if (th.n_iter > 0) {
        th.load_kv(sK, sV);
        th.load_q(sQ, th.head0, th.m_begin);
        cp_async_commit();
        th.load_do(sdO, th.head0, th.m_begin);
        cp_async_commit();
        th.store_row_stat(sLse2, th.fetch_row_stat(th.head0, th.m_begin));  // sDelta = sLse2 + kBlockM

        for (int it = 0; it < th.n_iter; ++it) {
            const int head = th.head_of(it);
            const int m_block = th.m_block_of(it);
            const bool has_next = it + 1 < th.n_iter;
            const int head_next = th.head_of(it + 1);
            const int m_next = th.m_block_of(it + 1);

            cp_async_wait<1>();
            __syncthreads();  // K, V, Q_it landed; lse2/delta of it visible; sdS free

            float acc_s[Tile::kMTiles1][Tile::kNTiles1][4];
            zero_acc(acc_s);
            th.template key_query_product<kBwdKkUnroll>(acc_s, sK, sQ);  // S^T = K Q^T

            cp_async_wait<0>();
            __syncthreads();  // dO_it landed

            float acc_dp[Tile::kMTiles1][Tile::kNTiles1][4];
            zero_acc(acc_dp);
            th.template key_query_product<kBwdKkUnroll>(acc_dp, sV, sdO);  // dP^T = V dO^T

            th.template store_p_ds<false>(acc_s, acc_dp, sLse2, sDelta, head, m_block, sP, sdS, pp);
            __syncthreads();  // P^T, dS^T complete; every warp is done with sLse2/sDelta

            th.key_dim_product(acc_dk, sdS, sQ);  // dK += dS^T Q
            __syncthreads();  // every warp is done with sQ
            if (has_next) th.load_q(sQ, head_next, m_next);
            cp_async_commit();
            const float stat_next = has_next ? th.fetch_row_stat(head_next, m_next) : 0.f;

            th.key_dim_product(acc_dv, sP, sdO);  // dV += P^T dO
            __syncthreads();  // every warp is done with sdO
            if (has_next) th.load_do(sdO, head_next, m_next);
            cp_async_commit();
            if (has_next) th.store_row_stat(sLse2, stat_next);

            if constexpr (kAtomicDq)  // scalar atomics on every arch (version 2 has the vector ones)
                th.add_dq(sdS, sK, head, m_block, [](float* dst, float a, float b) {
                    atomicAdd(dst, a);
                    atomicAdd(dst + 1, b);
                });
        }
    }
    th.store_dkdv(acc_dk, acc_dv, sK, sV);
}

template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant>
__global__ void __launch_bounds__(kNWarps * 32, 1)
bwd_dkdv_kernel(const BwdParams p) {
    on_cta_sequence<Variant::kVarlen, 2, false>(p, blockIdx.x * kBlockN, [](const BwdParams& ps) {
        bwd_dkdv_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, Variant, false>(ps);
    });
}

template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant>
__global__ void __launch_bounds__(kNWarps * 32, 1)
bwd_dkdv_dq_kernel(const BwdParams p) {
    on_cta_sequence<Variant::kVarlen, 2, false>(p, blockIdx.x * kBlockN, [](const BwdParams& ps) {
        bwd_dkdv_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, Variant, true>(ps);
    });
}

// Programmable attention (Variant: a ProgVariant): dK / dV (dQ by bwd_dq_prog_kernel), dbias and the modifiers'
// tensor gradients.
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant>
__global__ void __launch_bounds__(kNWarps * 32, 1)
bwd_dkdv_prog_kernel(const BwdParams p, const ProgParams pp) {
    static_assert(Variant::kProg, "bwd_dkdv_prog_kernel takes a ProgVariant");
    on_cta_sequence<Variant::kVarlen, 2, false>(p, blockIdx.x * kBlockN, [&pp](const BwdParams& ps) {
        bwd_dkdv_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, Variant, false>(ps, &pp);
    });
}

// ---------------------------------------------------------------------------
// dQ kernel (deterministic mode): one CTA per (query tile, head, batch); each
// warp owns kMTiles 16-row slices of the query tile (as the forward). Per key
// tile: dP = dO V^T, S = Q K^T, P, dS in registers, dQ += dS K with dS fed from
// the accumulators as the A operand. The V load of the previous key tile
// overlaps S, dS and dQ += dS K; the K load overlaps dP.

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_>
struct BwdDqTile {
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kHeadDimPad = (kHeadDim + 15) / 16 * 16;
    static constexpr int kBlockM = kBlockM_;
    static constexpr int kBlockN = kBlockN_;
    static constexpr int kNWarps = kNWarps_;
    static constexpr int kThreads = kNWarps * 32;
    static constexpr int kMTiles = kBlockM / (16 * kNWarps);
    static constexpr int kNTilesS = kBlockN / 8;
    static constexpr int kNTilesO = kHeadDimPad / 8;
    static constexpr int kStride = kHeadDimPad + 8;
    static constexpr int kSmemElems = (2 * kBlockM + 2 * kBlockN) * kStride;
    static constexpr int kSmemBytes = kSmemElems * 2;
    static_assert(kBlockM % (16 * kNWarps) == 0, "kBlockM must be a multiple of 16 * kNWarps");
    static_assert(kBlockN % 16 == 0, "kBlockN must be a multiple of 16");
    static_assert(kHeadDim % 8 == 0, "head_dim must be a multiple of 8");
};

// pp: programmable attention's parameters (Variant::kProg; else null).
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant>
__device__ __forceinline__ void bwd_dq_body(const BwdParams& p, const ProgParams* pp = nullptr) {
    using Tile = BwdDqTile<kHeadDim, kBlockM, kBlockN, kNWarps>;
    using Mask = MaskPolicy<kBlockM, kBlockN, Variant>;   // the mask policy (common/mask.cuh)
    using Mma = Mma16816<Tag>;
    constexpr int kMTiles = Tile::kMTiles;
    constexpr int kStride = Tile::kStride;
    constexpr int kPad = Tile::kHeadDimPad;
    constexpr int kThreads = Tile::kThreads;

    extern __shared__ __align__(128) u16 smem[];
    u16* sQ = smem;
    u16* sdO = sQ + kBlockM * kStride;
    u16* sK = sdO + kBlockM * kStride;
    u16* sV = sK + kBlockN * kStride;

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int g = lane >> 2;
    const int t4 = lane & 3;
    // Where query tiles see different numbers of keys, the heaviest (the last, for causal) go first.
    const int m_block = Mask::kUnevenWork ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int head = blockIdx.y;
    const int batch = blockIdx.z;
    const int head_kv = head / p.heads_per_kv;
    const int hd = p.head_dim;
    const int m0 = m_block * kBlockM;
    const int rows_valid = min(kBlockM, p.seqlen_q - m0);

    const u16* gQ = static_cast<const u16*>(p.q) + batch * p.q_batch_stride + head * p.q_head_stride
                    + m0 * p.q_row_stride;
    const u16* gdO = static_cast<const u16*>(p.dout) + batch * p.do_batch_stride + head * p.do_head_stride
                     + m0 * p.do_row_stride;
    const u16* gK = static_cast<const u16*>(p.k) + batch * p.k_batch_stride + head_kv * p.k_head_stride;
    const u16* gV = static_cast<const u16*>(p.v) + batch * p.v_batch_stride + head_kv * p.v_head_stride;

    const int warp_row0 = warp * kMTiles * 16;
    // lse2 / delta of this thread's rows (g and g + 8 of each m-tile).
    float lse2[2 * kMTiles], delta[2 * kMTiles];
    {
        const i64 base = stat_offset<Variant::kVarlen>(p, batch, head);
#pragma unroll
        for (int r = 0; r < 2 * kMTiles; ++r) {
            const int row = m0 + warp_row0 + (r >> 1) * 16 + g + (r & 1) * 8;
            lse2[r] = row < p.seqlen_q ? bwd_lse2(p.lse[base + row]) : CUFLASH_INF;
            delta[r] = row < p.seqlen_q ? p.delta[base + row] : 0.f;
        }
    }

    float acc_dq[kMTiles][Tile::kNTilesO][4];
    zero_acc(acc_dq);

    // The key tile of K or V from key n0 (gKV: key 0 of this kv head) into sKV; keys past seqlen_k
    // are zero-filled.
    auto load_key_tile = [&](u16* sKV, const u16* gKV, i64 row_stride, int n0) {
        load_tile_async_pred<u16, kBlockN, kPad, SmemRows<kStride>, kThreads>(
            sKV, gKV + n0 * row_stride, row_stride, p.seqlen_k - n0, hd, tid);
    };
    // acc (query x key) = sQdO sKV^T on this warp's query rows: S = Q K^T or dP = dO V^T. The
    // dK/dV kernels' key_query_product with the operands swapped (queries are the rows here).
    // A score modifier's registers (its constants, ALiBi's distances) leave no room for the fragments of two
    // k-steps in flight.
    constexpr int kQkUnroll = Mask::kHasScoreMod ? 1 : kBwdKkUnroll;
    auto query_key_product = [&](float (&acc)[kMTiles][Tile::kNTilesS][4], const u16* sQdO, const u16* sKV) {
        zero_acc(acc);
        warp_mma_smem<Tag, kPad / 16, kQkUnroll, false, false, SmemRows<kStride>, SmemRows<kStride>>(acc, sQdO, warp_row0,
                                                                                               sKV, 0, lane);
    };

    // The key tiles this query tile visits, [n_block_min, n_block_max), walked from the last down. The first is
    // a constant where the policy never skips leading tiles, so that the loop bounds fold in the front end. With
    // block sparsity the loop walks positions in the query tile's list (KeyTiles, as the forward's).
    const KeyTiles<Mask, Variant> key_tiles(pp, batch, head, m_block, p);
    const int n_block_min = Mask::kLocal && !Variant::kBlockSparse ? Mask(p).n_block_min(m_block) : 0;
    const int n_block_max = Variant::kBlockSparse ? key_tiles.count() : Mask(p).n_block_max(m_block);
    if (n_block_max > n_block_min) {
        load_tile_async_pred<u16, kBlockM, kPad, SmemRows<kStride>, kThreads>(sQ, gQ, p.q_row_stride, rows_valid, hd, tid);
        load_tile_async_pred<u16, kBlockM, kPad, SmemRows<kStride>, kThreads>(sdO, gdO, p.do_row_stride, rows_valid, hd,
                                                                              tid);
        load_key_tile(sV, gV, p.v_row_stride,
                      (Variant::kBlockSparse ? key_tiles.tile(n_block_max - 1) : n_block_max - 1) * kBlockN);
        cp_async_commit();

        for (int position = n_block_max - 1; position >= n_block_min; --position) {
            const int n_block = key_tiles.tile(position);
            const int n0 = n_block * kBlockN;
            cp_async_wait<0>();
            __syncthreads();  // Q, dO, V_n landed; every warp is done reading K_{n+1}
            load_key_tile(sK, gK, p.k_row_stride, n0);
            cp_async_commit();

            float acc_dp[kMTiles][Tile::kNTilesS][4];
            query_key_product(acc_dp, sdO, sV);  // dP = dO V_n^T

            cp_async_wait<0>();
            __syncthreads();  // K_n landed; every warp is done reading V_n
            if (position > n_block_min) {
                load_key_tile(sV, gV, p.v_row_stride,
                              Variant::kBlockSparse ? key_tiles.tile(position - 1) * kBlockN : n0 - kBlockN);
                cp_async_commit();
            }

            float acc_s[kMTiles][Tile::kNTilesS][4];
            query_key_product(acc_s, sQ, sK);  // S = Q K_n^T

            // dS = P * (dP - delta), in place in acc_s.
            const bool mask = Mask(p).needs_mask(m_block, n_block);
            const Mask mod(p, batch, head);   // the score modifier (unused, so not built, without one)
            unsigned keep_blocks[kMTiles];    // dropout: each 16 x 16 block's flags (from even n)
            // A window's bounds once per row (MaskPolicy::row_keys).
            int lo[2 * kMTiles], hi[2 * kMTiles];
            if constexpr (Mask::kLocal) {
                if (mask) {
#pragma unroll
                    for (int r = 0; r < 2 * kMTiles; ++r)
                        Mask(p).row_keys(m0 + warp_row0 + (r >> 1) * 16 + g + (r & 1) * 8, lo[r], hi[r]);
                }
            }
#pragma unroll
            for (int t = 0; t < kMTiles; ++t)
#pragma unroll
                for (int n = 0; n < Tile::kNTilesS; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int r = 2 * t + (e >> 1);
                        float sv = acc_s[t][n][e], grad = 1.f;   // grad: the score modifier's derivative
                        if constexpr (Mask::kHasScoreMod) {
                            const int row = m0 + warp_row0 + t * 16 + g + (e >> 1) * 8;
                            const int col = n0 + n * 8 + 2 * t4 + (e & 1);
                            grad = mod.score_derivative(sv, row, col);
                            sv = mod.modify_score(sv, row, col);
                        }
                        float ugrad = 1.f;   // programmable: the user score modifier's derivative
                        if constexpr (Variant::kProg)
                            sv = prog_bwd_score(ProgPolicy<Variant>(*pp, batch, head, p.softmax_scale), p, sv,
                                                m0 + warp_row0 + t * 16 + g + (e >> 1) * 8,
                                                n0 + n * 8 + 2 * t4 + (e & 1), ugrad);
                        float pv = bwd_prob(sv, p.scale_log2, lse2[r]);
                        if (mask) {
                            const int row = m0 + warp_row0 + t * 16 + g + (e >> 1) * 8;
                            const int col = n0 + n * 8 + 2 * t4 + (e & 1);
                            if constexpr (Mask::kLocal) {
                                if (col < lo[r] || col > hi[r]) pv = 0.f;
                            } else {
                                if (!Mask(p).visible(row, col)) pv = 0.f;
                            }
                        }
                        float dpv = acc_dp[t][n][e];
                        if constexpr (Variant::kProg) {   // hidden elements, dropout (keep_pairs: even n's units)
                            const int row = m0 + warp_row0 + t * 16 + g + (e >> 1) * 8;
                            const int col = n0 + n * 8 + 2 * t4 + (e & 1);
                            if constexpr (Variant::kBlockSparse) {
                                if (key_tiles.partial(position)
                                    && !(row < p.seqlen_q && col < p.seqlen_k
                                         && ProgPolicy<Variant>(*pp, batch, head, p.softmax_scale).visible(row, col)))
                                    pv = 0.f;
                            }
                            if constexpr (Variant::kDropout) {
                                if ((n & 1) == 0 && e == 0)
                                    keep_blocks[t] = DropoutLanes(*pp, batch, p.heads_q, head).block_keep(
                                        m0 + warp_row0 + t * 16, n0 + n * 8, g, t4);
                                dpv = (keep_blocks[t] >> DropoutLanes::slot(n & 1, e)) & 1u ? dpv * pp->dropout_scale
                                                                                              : 0.f;
                            }
                            pv *= ugrad;
                        }
                        if constexpr (Mask::kHasScoreMod) pv *= grad;   // dS = P dP' * (d modified / d score)
                        acc_s[t][n][e] = pv * (dpv - delta[r]);
                    }

            // dQ += dS K_n, dS taken from the accumulators.
#pragma unroll
            for (int kk = 0; kk < Tile::kNTilesS / 2; ++kk) {
                u32 a[kMTiles][4];
#pragma unroll
                for (int t = 0; t < kMTiles; ++t) pack_a_from_acc<Tag>(a[t], acc_s[t][2 * kk], acc_s[t][2 * kk + 1]);
#pragma unroll
                for (int nn = 0; nn < Tile::kNTilesO / 2; ++nn) {
                    u32 b[4];
                    load_b_frag_kn<kStride>(b, sK, kk * 16, nn * 16, lane);
#pragma unroll
                    for (int t = 0; t < kMTiles; ++t) {
                        Mma::run(acc_dq[t][2 * nn], a[t], b[0], b[1]);
                        Mma::run(acc_dq[t][2 * nn + 1], a[t], b[2], b[3]);
                    }
                }
            }
        }
    }

    // Epilogue: dQ * softmax_scale, staged through sQ for 16-byte stores.
    __syncthreads();  // every warp is done with sQ, sK (an empty key range is uniform)
#pragma unroll
    for (int t = 0; t < kMTiles; ++t)
#pragma unroll
        for (int n = 0; n < Tile::kNTilesO; ++n)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = warp_row0 + t * 16 + g + h * 8;
                *reinterpret_cast<u32*>(sQ + row * kStride + n * 8 + 2 * t4) = ElemTraits<Tag>::pack2(
                    acc_dq[t][n][2 * h] * p.softmax_scale, acc_dq[t][n][2 * h + 1] * p.softmax_scale);
            }
    __syncthreads();
    u16* gdQ = static_cast<u16*>(p.dq) + batch * p.dq_batch_stride + head * p.dq_head_stride + m0 * p.dq_row_stride;
    store_tile_pred<u16, kBlockM, kPad, SmemRows<kStride>, kThreads>(gdQ, sQ, p.dq_row_stride, rows_valid, hd, tid);
}

template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant>
__global__ void __launch_bounds__(kNWarps * 32, 1)
bwd_dq_kernel(const BwdParams p) {
    const int m_block = MaskPolicy<kBlockM, kBlockN, Variant>::kUnevenWork ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    on_cta_sequence<Variant::kVarlen, 2, true>(p, m_block * kBlockM, [](const BwdParams& ps) {
        bwd_dq_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, Variant>(ps);
    });
}

// Programmable attention (Variant: a ProgVariant): dQ.
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant>
__global__ void __launch_bounds__(kNWarps * 32, 1)
bwd_dq_prog_kernel(const BwdParams p, const ProgParams pp) {
    static_assert(Variant::kProg, "bwd_dq_prog_kernel takes a ProgVariant");
    const int m_block = MaskPolicy<kBlockM, kBlockN, Variant>::kUnevenWork ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    on_cta_sequence<Variant::kVarlen, 2, true>(p, m_block * kBlockM, [&pp](const BwdParams& ps) {
        bwd_dq_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, Variant>(ps, &pp);
    });
}

// ---------------------------------------------------------------------------
// dK/dV kernel, version 2 (the portable default for head dims <= 128; CUFLASH_SM80_BWD_VARIANT=1
// selects version 1).
// Same products as bwd_dkdv_body, reorganised:
//   * Q / dO tiles (and lse2 / delta) in a two-stage ring: the loads of step it + 1
//     are issued at the top of step it and have the whole step to land (dO in one
//     stage where two do not fit the budget: BwdDkdvTile2::kDoStages);
//   * two barriers per step (top: tiles landed and the other stage free; after the
//     P^T / dS^T stores) instead of five (a third with one dO stage);
//   * 2-D warp grids for every product, chosen to minimise the ldmatrix count
//     (shared-memory bandwidth is the limiter of mma.sync on sm_90);
//   * dQ partial sums leave with red.global.add.v2.f32 on sm_90 (one vector
//     reduction per pair of columns), scalar atomics before;
//   * Q, dO, K, V, P^T and dS^T rows of 64 or 128 elements unpadded, swizzled (layout.cuh).


// Warps along M (the rest along N) of an M x N product that minimise the ldmatrix.x4
// count per 16-wide k-step, wn * M / 16 + wm * N / 16; ties go to more warps along M.
// Every warp's slice must be whole 16 x 16 steps. -1: no grid fits.
__host__ __device__ constexpr int bwd_pick_wm(int nwarps, int M, int N) {
    int best = -1, best_cost = 1 << 30;
    for (int wm = 1; wm <= nwarps; wm *= 2) {
        const int wn = nwarps / wm;
        if (wm * wn != nwarps || M % (16 * wm) != 0 || N % (16 * wn) != 0) continue;
        const int cost = wn * M / 16 + wm * N / 16;
        if (cost <= best_cost) { best = wm; best_cost = cost; }
    }
    return best;
}

// Its 16-bit tiles have swizzled rows where 64 or 128 elements wide (layout.cuh): at d=128 (64, 64, 8) fits the 99
// KB cards and (64, 128, 8) with two dO stages the A100 this way.
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kDoStages_ = 2>
struct BwdDkdvTile2
    : BwdDkdvGeometry<kHeadDim_, (kHeadDim_ + 15) / 16 * 16, kBlockM_, kBlockN_, kNWarps_,
                      bwd_pick_wm(kNWarps_, kBlockN_, kBlockM_),
                      bwd_pick_wm(kNWarps_, kBlockN_, (kHeadDim_ + 15) / 16 * 16),
                      bwd_pick_wm(kNWarps_, kBlockM_, (kHeadDim_ + 15) / 16 * 16), true> {
    using Base = BwdDkdvGeometry<kHeadDim_, (kHeadDim_ + 15) / 16 * 16, kBlockM_, kBlockN_, kNWarps_,
                                 bwd_pick_wm(kNWarps_, kBlockN_, kBlockM_),
                                 bwd_pick_wm(kNWarps_, kBlockN_, (kHeadDim_ + 15) / 16 * 16),
                                 bwd_pick_wm(kNWarps_, kBlockM_, (kHeadDim_ + 15) / 16 * 16), true>;
    static constexpr int kTileBytes = kBlockM_ * Base::kStride * 2;   // one stage of Q or dO
    // K, V, P^T, dS^T and two stages of lse2, delta
    static constexpr int kFixedBytes = 2 * kBlockN_ * (Base::kStride + Base::kStrideP) * 2 + 4 * kBlockM_ * 4;
    // dO's stages: two, or one where two would not fit (the 99 KB cards at d=128 with (64, 64, 8), as
    // FlashAttention-2 does): its next tile then loads once dV's product is done with it, behind a third barrier
    // per step.
    static constexpr int kDoStages = kDoStages_;
    static constexpr int kSmemBytes = kFixedBytes + (2 + kDoStages) * kTileBytes;

    static_assert(Base::kWarpsN1 > 0 && Base::kWarpsN2 > 0 && Base::kWarpsM3 > 0, "no warp grid fits these tiles");
    // Swizzled P^T / dS^T rows are stepped along a warp's kNTiles1 query blocks (store_p_ds), swizzled K / V rows
    // along its kNTiles2 head-dim blocks (store_dkdv); layout.cuh's steps need powers of two there.
    static_assert(Base::RowsP::kRowPeriod == 1 || (Base::kNTiles1 & (Base::kNTiles1 - 1)) == 0, "swizzled P^T rows");
    static_assert(Base::RowsD::kRowPeriod == 1 || (Base::kNTiles2 & (Base::kNTiles2 - 1)) == 0, "swizzled K rows");
    static_assert(Base::kThreads >= 2 * kBlockM_, "one thread per lse / delta value");
    static_assert(kDoStages == 1 || kDoStages == 2, "dO takes one or two stages");
    static_assert(kHeadDim_ % 8 == 0, "head_dim must be a multiple of 8");
};

// dst[0] += a, dst[1] += b (dst 8-byte aligned), no return value.
__device__ __forceinline__ void red_add_f32x2(float* dst, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" :: "l"(dst), "f"(a), "f"(b) : "memory");
#else
    atomicAdd(dst, a);
    atomicAdd(dst + 1, b);
#endif
}

template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, bool kAtomicDq,
          int kDoStages>
__device__ __forceinline__ void bwd_dkdv2_body(const BwdParams& p) {
    using Tile = BwdDkdvTile2<kHeadDim, kBlockM, kBlockN, kNWarps, kDoStages>;
    constexpr int kStride = Tile::kStride;
    constexpr int kStrideP = Tile::kStrideP;
    constexpr int kTileM = kBlockM * kStride;

    // Swizzled rows XOR their column bits into addresses (layout.cuh): the tiles start on whole rows from here.
    extern __shared__ __align__(1024) u16 smem[];
    u16* sQ0 = smem;                      // stage s: Q at sQ0 + s * kTileM
    u16* sdO0 = sQ0 + 2 * kTileM;         // stage s: dO at sdO0 + s * kTileM (one stage: sdO0)
    u16* sK = sdO0 + kDoStages * kTileM;
    u16* sV = sK + kBlockN * kStride;
    u16* sP = sV + kBlockN * kStride;     // P^T  [key][query]
    u16* sdS = sP + kBlockN * kStrideP;   // dS^T [key][query]
    float* sStat0 = reinterpret_cast<float*>(sdS + kBlockN * kStrideP);  // stage s: lse2, delta at + s * 2 * kBlockM

    const BwdDkdvThread<Tag, Tile, Variant> th(p);

    float acc_dk[Tile::kMTiles2][Tile::kNTiles2][4], acc_dv[Tile::kMTiles2][Tile::kNTiles2][4];
    zero_acc(acc_dk);
    zero_acc(acc_dv);

    if (th.n_iter > 0) {
        th.load_kv(sK, sV);
        th.load_q(sQ0, th.head0, th.m_begin);
        th.load_do(sdO0, th.head0, th.m_begin);
        cp_async_commit();
        th.store_row_stat(sStat0, th.fetch_row_stat(th.head0, th.m_begin));

#pragma unroll 1
        for (int it = 0; it < th.n_iter; ++it) {
            const int stage = it & 1;
            const int head = th.head_of(it);
            const int m_block = th.m_block_of(it);
            const bool has_next = it + 1 < th.n_iter;

            cp_async_wait<0>();
            __syncthreads();  // Q, dO of it landed, its lse2 / delta visible; every warp is done
                              // with step it - 1 (the other stage, sP, sdS)
            float stat_next = 0.f;
            if (has_next) {
                const int head_next = th.head_of(it + 1);
                const int m_next = th.m_block_of(it + 1);
                th.load_q(sQ0 + (stage ^ 1) * kTileM, head_next, m_next);
                if constexpr (kDoStages == 2) th.load_do(sdO0 + (stage ^ 1) * kTileM, head_next, m_next);
                stat_next = th.fetch_row_stat(head_next, m_next);
            }
            cp_async_commit();

            const u16* sQ = sQ0 + stage * kTileM;
            const u16* sdO = sdO0 + (kDoStages == 2 ? stage : 0) * kTileM;
            const float* sLse2 = sStat0 + stage * 2 * kBlockM;
            const float* sDelta = sLse2 + kBlockM;

            float acc_s[Tile::kMTiles1][Tile::kNTiles1][4], acc_dp[Tile::kMTiles1][Tile::kNTiles1][4];
            zero_acc(acc_s);
            zero_acc(acc_dp);
            // Unrolled by 2 where it does not spill (at d=128 with 64 x 128 tiles it does).
            constexpr int kSUnroll = Tile::kHeadDimPad <= 64 ? 2 : 1;
            th.template key_query_product<kSUnroll>(acc_s, sK, sQ);   // S^T = K Q^T
            th.template key_query_product<kSUnroll>(acc_dp, sV, sdO); // dP^T = V dO^T

            th.template store_p_ds<true>(acc_s, acc_dp, sLse2, sDelta, head, m_block, sP, sdS);
            if (has_next) th.store_row_stat(sStat0 + (stage ^ 1) * 2 * kBlockM, stat_next);
            __syncthreads();  // P^T, dS^T complete

            th.key_dim_product(acc_dv, sP, sdO);  // dV += P^T dO
            if constexpr (kDoStages == 1) {
                __syncthreads();  // every warp is done with dO: its next tile loads during dK, dQ and the next S^T
                if (has_next) th.load_do(sdO0, th.head_of(it + 1), th.m_block_of(it + 1));
                cp_async_commit();
            }
            th.key_dim_product(acc_dk, sdS, sQ);  // dK += dS^T Q

            if constexpr (kAtomicDq)
                th.add_dq(sdS, sK, head, m_block, [](float* dst, float a, float b) { red_add_f32x2(dst, a, b); });
        }
    }
    th.store_dkdv(acc_dk, acc_dv, sK, sV);
}

// kDoStages: dO's stages (BwdDkdvTile2; one: the *_do1 families).
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kDoStages = 2>
__global__ void __launch_bounds__(kNWarps * 32, 1)
bwd_dkdv2_kernel(const BwdParams p) {
    on_cta_sequence<Variant::kVarlen, 2, false>(p, blockIdx.x * kBlockN, [](const BwdParams& ps) {
        bwd_dkdv2_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, Variant, false, kDoStages>(ps);
    });
}

template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kDoStages = 2>
__global__ void __launch_bounds__(kNWarps * 32, 1)
bwd_dkdv2_dq_kernel(const BwdParams p) {
    on_cta_sequence<Variant::kVarlen, 2, false>(p, blockIdx.x * kBlockN, [](const BwdParams& ps) {
        bwd_dkdv2_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, Variant, true, kDoStages>(ps);
    });
}

// Each kernel's dynamic shared memory, as <kernel>_smem_bytes<same template arguments> (the dispatcher reads it
// from the compiled module).
#define CUFLASH_SM80_BWD_SMEM(name, tile)                                                                      \
    template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant>                 \
    __device__ const int name##_smem_bytes = tile<kHeadDim, kBlockM, kBlockN, kNWarps>::kSmemBytes;
CUFLASH_SM80_BWD_SMEM(bwd_dkdv_kernel, BwdDkdvTile)
CUFLASH_SM80_BWD_SMEM(bwd_dkdv_dq_kernel, BwdDkdvTile)
CUFLASH_SM80_BWD_SMEM(bwd_dq_kernel, BwdDqTile)
CUFLASH_SM80_BWD_SMEM(bwd_dkdv_prog_kernel, BwdDkdvTile)
CUFLASH_SM80_BWD_SMEM(bwd_dq_prog_kernel, BwdDqTile)
#undef CUFLASH_SM80_BWD_SMEM
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kDoStages = 2>
__device__ const int bwd_dkdv2_kernel_smem_bytes = BwdDkdvTile2<kHeadDim, kBlockM, kBlockN, kNWarps, kDoStages>::kSmemBytes;
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kDoStages = 2>
__device__ const int bwd_dkdv2_dq_kernel_smem_bytes = bwd_dkdv2_kernel_smem_bytes<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, Variant, kDoStages>;
