// Exact float32 FlashAttention-2 backward on CUDA cores: every product is an
// FFMA in float32 (no tensor cores, no TF32). P is recomputed from Q, K and the
// forward's lse; no seqlen x seqlen buffer exists.
//
//   bwd_dkdv_kernel  one CTA per (key tile, kv head, batch), looping over the
//                    query heads of the GQA group and their query tiles:
//                    S^T = K Q^T, dP^T = V dO^T, P^T and dS^T -> shared memory,
//                    dV += P^T dO, dK += dS^T Q (registers). No atomics.
//   bwd_dq_kernel    one CTA per (query tile, head, batch), looping over the key
//                    tiles: S = Q K^T, dP = dO V^T, dS -> shared memory,
//                    dQ += dS K (registers). No atomics.
// Both are deterministic; both are instantiated per head-dim bucket, the
// run-time head_dim zero-fills the padding columns. The mask policy (common/mask.cuh,
// exact math) built from the kernel's MaskVariant gives the tiles each loop visits,
// the hidden elements and the score modifier.
//
// Programmable attention (bwd_dkdv_prog_kernel, bwd_dq_prog_kernel: a ProgVariant and ProgParams; the
// portable pair's parts of common/programmable.cuh at each element): the bias and the user's score modifier on
// the scores, the tiles' hidden elements (dK / dV: each tile's state; dQ: the block-sparse lists), dropout's
// flags drawn per tile into shared memory (DropoutTile: the 16-bit kernels' mask), and, in the dK / dV pass
// alone, dbias and the modifiers' tensor gradients.
//
// Both kernels do the same two steps on a tile of R "row" vectors (the side
// that owns the accumulators) against C "column" vectors:
//   scores: the kThreads threads form a kGR x kGC grid; thread (tr, tc) owns the
//           kTR x kTC scores (tr + i * kGR, tc + j * kGC), dot products over
//           the head dim with float4 shared-memory reads. tc is the fastest
//           index, so the 8 threads of a float4 phase read 8 different column
//           rows; rows are kHeadDim + 4 floats apart (an odd number of 16-byte
//           units), so those reads are conflict-free.
//   rows:   kTPR threads per output row, thread owns float4 chunks
//           osub + j * kTPR of row orow; acc[row] += sum_c W[row][c] * X[c][:]
//           with W (P^T, dS^T or dS) in shared memory rows of C + 1 floats.
#include "../common/numeric.cuh"
#include "../common/params.cuh"
#include "../common/mask.cuh"
#include "../common/programmable.cuh"
#include "../common/bwd_math.cuh"
#include "../common/varlen.cuh"
#include "../sm80/copy.cuh"

template <int kHeadDim_, int kRowsT_, int kColsT_, int kNWarps_>
struct SimtBwdTile {
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kR = kRowsT_;
    static constexpr int kC = kColsT_;
    static constexpr int kNWarps = kNWarps_;
    static constexpr int kThreads = kNWarps * 32;
    static constexpr int kStride = kHeadDim + 4;   // floats per Q/K/V/dO row
    static constexpr int kStrideW = kC + 1;        // floats per P / dS row
    // Score micro-tile.
    static constexpr int kTC = kR * kC >= 4 * kThreads ? 2 : 1;
    static constexpr int kTR = kR * kC / (kThreads * kTC);
    static constexpr int kGC = kC / kTC;
    static constexpr int kGR = kR / kTR;
    // Output rows.
    static constexpr int kTPR = kThreads / kR;
    static constexpr int kChunks = kHeadDim / 4;
    static constexpr int kCPT = kChunks / kTPR;
    // Shared memory: the dK/dV kernel holds K, V (rows), Q, dO (columns), P^T and dS^T,
    // lse2 and delta; the dQ kernel Q, dO (rows), K, V (columns) and dS.
    static constexpr int kSmemBytesDkdv = ((2 * kR + 2 * kC) * kStride + 2 * kR * kStrideW + 2 * kC) * 4;
    static constexpr int kSmemBytesDq = ((2 * kR + 2 * kC) * kStride + kR * kStrideW) * 4;
    static_assert(kTR >= 1 && kGC * kGR == kThreads && kGR * kTR == kR && kGC * kTC == kC, "score grid");
    static_assert(kThreads % kR == 0 && kChunks % kTPR == 0 && kCPT >= 1, "output grid");
    static_assert(kThreads >= 2 * kC, "one thread per lse / delta value");
    static_assert(kHeadDim % 8 == 0, "head_dim must be a multiple of 8");
};

// acc[i][j] = <rows[tr + i * kGR], cols[tc + j * kGC]> over the (padded) head dim.
template <class Tile>
__device__ __forceinline__ void simt_scores(float (&acc)[Tile::kTR][Tile::kTC], const float* rows,
                                            const float* cols, int tr, int tc) {
#pragma unroll
    for (int i = 0; i < Tile::kTR; ++i)
#pragma unroll
        for (int j = 0; j < Tile::kTC; ++j) acc[i][j] = 0.f;
#pragma unroll 4
    for (int k = 0; k < Tile::kHeadDim; k += 4) {
        float4 a[Tile::kTR], b[Tile::kTC];
#pragma unroll
        for (int i = 0; i < Tile::kTR; ++i)
            a[i] = *reinterpret_cast<const float4*>(rows + (tr + i * Tile::kGR) * Tile::kStride + k);
#pragma unroll
        for (int j = 0; j < Tile::kTC; ++j)
            b[j] = *reinterpret_cast<const float4*>(cols + (tc + j * Tile::kGC) * Tile::kStride + k);
#pragma unroll
        for (int i = 0; i < Tile::kTR; ++i)
#pragma unroll
            for (int j = 0; j < Tile::kTC; ++j) {
                float s = acc[i][j];
                s = fmaf(a[i].x, b[j].x, s);
                s = fmaf(a[i].y, b[j].y, s);
                s = fmaf(a[i].z, b[j].z, s);
                acc[i][j] = fmaf(a[i].w, b[j].w, s);
            }
    }
}

// acc[j] += sum_c w[orow][c] * x[c][chunk osub + j * kTPR].
template <class Tile>
__device__ __forceinline__ void simt_rows(float4 (&acc)[Tile::kCPT], const float* w, const float* x,
                                          int orow, int osub) {
#pragma unroll 4
    for (int c = 0; c < Tile::kC; ++c) {
        const float wv = w[orow * Tile::kStrideW + c];
#pragma unroll
        for (int j = 0; j < Tile::kCPT; ++j) {
            const float4 xv = *reinterpret_cast<const float4*>(x + c * Tile::kStride + 4 * (osub + j * Tile::kTPR));
            acc[j].x = fmaf(wv, xv.x, acc[j].x);
            acc[j].y = fmaf(wv, xv.y, acc[j].y);
            acc[j].z = fmaf(wv, xv.z, acc[j].z);
            acc[j].w = fmaf(wv, xv.w, acc[j].w);
        }
    }
}

// Float4 stores of one output row's chunks (columns < cols_valid), times scale.
template <class Tile>
__device__ __forceinline__ void simt_store_row(float* dst, const float4 (&acc)[Tile::kCPT], float scale,
                                               int osub, int cols_valid) {
#pragma unroll
    for (int j = 0; j < Tile::kCPT; ++j) {
        const int col = 4 * (osub + j * Tile::kTPR);
        if (col < cols_valid)
            *reinterpret_cast<float4*>(dst + col) =
                make_float4(acc[j].x * scale, acc[j].y * scale, acc[j].z * scale, acc[j].w * scale);
    }
}

// pp: programmable attention's parameters (Variant::kProg; else null).
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant>
__device__ __forceinline__ void bwd_dkdv_body(const BwdParams& p, const ProgParams* pp = nullptr) {
    using Tile = SimtBwdTile<kHeadDim, kBlockN, kBlockM, kNWarps>;  // rows: keys, columns: queries
    using Mask = MaskPolicy<kBlockM, kBlockN, Variant, true>;   // the mask policy (common/mask.cuh), exact tanh
    using Keep = DropoutTile<kBlockM, kBlockN>;                 // dropout's flags of a (query, key) tile
    constexpr int kStride = Tile::kStride;
    constexpr int kStrideW = Tile::kStrideW;
    constexpr int kThreads = Tile::kThreads;

    extern __shared__ __align__(128) float smemf[];
    float* sK = smemf;
    float* sV = sK + kBlockN * kStride;
    float* sQ = sV + kBlockN * kStride;
    float* sdO = sQ + kBlockM * kStride;
    float* sP = sdO + kBlockM * kStride;     // P^T  [key][query]
    float* sdS = sP + kBlockN * kStrideW;    // dS^T [key][query]
    float* sLse2 = sdS + kBlockN * kStrideW;
    float* sDelta = sLse2 + kBlockM;
    unsigned char* sKeep = reinterpret_cast<unsigned char*>(sDelta + kBlockM);   // dropout (Keep)

    const int tid = threadIdx.x;
    const int tc = tid % Tile::kGC, tr = tid / Tile::kGC;
    const int osub = tid % Tile::kTPR, orow = tid / Tile::kTPR;
    const int n_block = blockIdx.x;
    const int head_kv = blockIdx.y;
    const int batch = blockIdx.z;
    const int n0 = n_block * kBlockN;
    const int keys_valid = min(kBlockN, p.seqlen_k - n0);
    const int hd = p.head_dim;

    const float* gK = static_cast<const float*>(p.k) + batch * p.k_batch_stride + head_kv * p.k_head_stride
                      + n0 * p.k_row_stride;
    const float* gV = static_cast<const float*>(p.v) + batch * p.v_batch_stride + head_kv * p.v_head_stride
                      + n0 * p.v_row_stride;

    // Step it visits query tile m_begin + it % n_m of query head head0 + it / n_m: the query tiles
    // [m_block_min, m_block_max) that the mask policy says see this key tile, for each head of the GQA group.
    const Mask mask(p);
    const int m_begin = mask.m_block_min(n_block);
    const int m_end = mask.m_block_max(n_block);
    const int n_m = m_end > m_begin ? m_end - m_begin : 0;
    const int n_iter = n_m * p.heads_per_kv;
    const int head0 = head_kv * p.heads_per_kv;

    float4 acc_dk[Tile::kCPT], acc_dv[Tile::kCPT];
#pragma unroll
    for (int j = 0; j < Tile::kCPT; ++j) {
        acc_dk[j] = make_float4(0.f, 0.f, 0.f, 0.f);
        acc_dv[j] = make_float4(0.f, 0.f, 0.f, 0.f);
    }

    if (n_iter > 0) {
        load_tile_async_pred<float, kBlockN, kHeadDim, SmemRows<kStride>, kThreads>(sK, gK, p.k_row_stride, keys_valid, hd, tid);
        load_tile_async_pred<float, kBlockN, kHeadDim, SmemRows<kStride>, kThreads>(sV, gV, p.v_row_stride, keys_valid, hd, tid);
        cp_async_commit();
        for (int it = 0; it < n_iter; ++it) {
            const int head = head0 + it / n_m;
            const int m_block = m_begin + it % n_m;
            const int m0 = m_block * kBlockM;
            const float* gQ = static_cast<const float*>(p.q) + batch * p.q_batch_stride + head * p.q_head_stride
                              + m0 * p.q_row_stride;
            const float* gdO = static_cast<const float*>(p.dout) + batch * p.do_batch_stride
                               + head * p.do_head_stride + m0 * p.do_row_stride;
            if constexpr (Variant::kDropout)   // before the barrier below: the last step read its flags before its own
                Keep::template fill<kThreads>(sKeep, DropoutLanes(*pp, batch, p.heads_q, head), m0, n0, tid);
            load_tile_async_pred<float, kBlockM, kHeadDim, SmemRows<kStride>, kThreads>(
                sQ, gQ, p.q_row_stride, p.seqlen_q - m0, hd, tid);
            load_tile_async_pred<float, kBlockM, kHeadDim, SmemRows<kStride>, kThreads>(
                sdO, gdO, p.do_row_stride, p.seqlen_q - m0, hd, tid);
            cp_async_commit();
            if (tid < 2 * kBlockM) {
                const int i = tid < kBlockM ? tid : tid - kBlockM;
                const int row = m0 + i;
                const i64 idx = stat_offset<Variant::kVarlen>(p, batch, head) + row;
                if (tid < kBlockM) sLse2[i] = row < p.seqlen_q ? bwd_lse2(p.lse[idx]) : CUFLASH_INF;
                else sDelta[i] = row < p.seqlen_q ? p.delta[idx] : 0.f;
            }
            cp_async_wait<0>();
            __syncthreads();  // K, V, Q, dO, lse2, delta in shared memory

            float s[Tile::kTR][Tile::kTC], dp[Tile::kTR][Tile::kTC];
            simt_scores<Tile>(s, sK, sQ, tr, tc);
            simt_scores<Tile>(dp, sV, sdO, tr, tc);
            const bool mask = Mask(p).needs_mask(m_block, n_block);
            int state = 2;                  // programmable: the tile's state (common/programmable.cuh)
            float dbias_rows[Tile::kTR];    // a bias broadcast over the queries: each key row's sum
            if constexpr (Variant::kBlockSparse) state = prog_tile_state(*pp, batch, head, m_block, n_block);
            if constexpr (Variant::kBias) {
#pragma unroll
                for (int i = 0; i < Tile::kTR; ++i) dbias_rows[i] = 0.f;
            }
#pragma unroll
            for (int i = 0; i < Tile::kTR; ++i)
#pragma unroll
                for (int j = 0; j < Tile::kTC; ++j) {
                    const int kr = tr + i * Tile::kGR;  // key
                    const int qc = tc + j * Tile::kGC;  // query
                    float sv = s[i][j], grad = 1.f;   // grad: the score modifier's derivative
                    if constexpr (Mask::kHasScoreMod) {
                        const Mask mod(p, batch, head);
                        grad = mod.score_derivative(sv, m0 + qc, n0 + kr);
                        sv = mod.modify_score(sv, m0 + qc, n0 + kr);
                    }
                    const float base = sv;   // after the built-in modifiers
                    float ugrad = 1.f;       // programmable: the user score modifier's derivative
                    if constexpr (Variant::kProg)
                        sv = prog_bwd_score(ProgPolicy<Variant>(*pp, batch, head, p.softmax_scale), p, sv, m0 + qc,
                                            n0 + kr, ugrad);
                    float pv = bwd_prob(sv, p.scale_log2, sLse2[qc]);
                    if (mask && !Mask(p).visible(m0 + qc, n0 + kr)) pv = 0.f;
                    float ds_prog = 0.f;   // programmable: the hidden elements, dropout (pv becomes the dropped P
                                           // that dV takes), dbias and the tensor gradients
                    if constexpr (Variant::kProg)
                        ds_prog = prog_bwd_element(ProgPolicy<Variant>(*pp, batch, head, p.softmax_scale), base, ugrad,
                                                   pv, dp[i][j], sDelta[qc], state, m0 + qc, n0 + kr, p.seqlen_q,
                                                   p.seqlen_k, Variant::kDropout && Keep::keep(sKeep, qc, kr),
                                                   dbias_rows[i]);
                    sP[kr * kStrideW + qc] = pv;
                    float ds;
                    if constexpr (Variant::kProg) ds = ds_prog;
                    else ds = pv * (dp[i][j] - sDelta[qc]);
                    if constexpr (Mask::kHasScoreMod) ds *= grad;
                    sdS[kr * kStrideW + qc] = ds;
                }
            if constexpr (Variant::kBias) {   // a bias broadcast over the queries: one add per key row and step
                if (pp->dbias_row_stride == 0) {
                    static_assert(Tile::kGC <= 32 && 32 % Tile::kGC == 0, "a key row's threads lie inside one warp");
#pragma unroll
                    for (int i = 0; i < Tile::kTR; ++i) {
                        float sum = dbias_rows[i];
#pragma unroll
                        for (int off = Tile::kGC / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, off);
                        const int key = n0 + tr + i * Tile::kGR;
                        if (tc == 0 && key < p.seqlen_k)
                            atomicAdd(pp->dbias_accum + batch * pp->dbias_batch_stride + head * pp->dbias_head_stride
                                      + key * pp->dbias_col_stride, sum);
                    }
                }
            }
            __syncthreads();  // P^T, dS^T complete

            simt_rows<Tile>(acc_dv, sP, sdO, orow, osub);
            simt_rows<Tile>(acc_dk, sdS, sQ, orow, osub);
            __syncthreads();  // every thread is done with sQ, sdO, sP, sdS, sLse2, sDelta
        }
    }

    if (orow < keys_valid) {
        float* gdK = static_cast<float*>(p.dk) + batch * p.dk_batch_stride + head_kv * p.dk_head_stride
                     + (n0 + orow) * p.dk_row_stride;
        float* gdV = static_cast<float*>(p.dv) + batch * p.dv_batch_stride + head_kv * p.dv_head_stride
                     + (n0 + orow) * p.dv_row_stride;
        simt_store_row<Tile>(gdK, acc_dk, p.softmax_scale, osub, hd);
        simt_store_row<Tile>(gdV, acc_dv, 1.f, osub, hd);
    }
}

// pp: programmable attention's parameters (Variant::kProg; else null).
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant>
__device__ __forceinline__ void bwd_dq_body(const BwdParams& p, const ProgParams* pp = nullptr) {
    using Tile = SimtBwdTile<kHeadDim, kBlockM, kBlockN, kNWarps>;  // rows: queries, columns: keys
    using Mask = MaskPolicy<kBlockM, kBlockN, Variant, true>;   // the mask policy (common/mask.cuh), exact tanh
    using Keep = DropoutTile<kBlockM, kBlockN>;                 // dropout's flags of a (query, key) tile
    constexpr int kStride = Tile::kStride;
    constexpr int kStrideW = Tile::kStrideW;
    constexpr int kThreads = Tile::kThreads;

    extern __shared__ __align__(128) float smemf[];
    float* sQ = smemf;
    float* sdO = sQ + kBlockM * kStride;
    float* sK = sdO + kBlockM * kStride;
    float* sV = sK + kBlockN * kStride;
    float* sdS = sV + kBlockN * kStride;     // dS [query][key]
    unsigned char* sKeep = reinterpret_cast<unsigned char*>(sdS + kBlockM * kStrideW);   // dropout (Keep)

    const int tid = threadIdx.x;
    const int tc = tid % Tile::kGC, tr = tid / Tile::kGC;
    const int osub = tid % Tile::kTPR, orow = tid / Tile::kTPR;
    // Where query tiles see different numbers of keys, the heaviest (the last, for causal) go first.
    const int m_block = Mask::kUnevenWork ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int head = blockIdx.y;
    const int batch = blockIdx.z;
    const int head_kv = head / p.heads_per_kv;
    const int hd = p.head_dim;
    const int m0 = m_block * kBlockM;
    const int rows_valid = min(kBlockM, p.seqlen_q - m0);

    const float* gQ = static_cast<const float*>(p.q) + batch * p.q_batch_stride + head * p.q_head_stride
                      + m0 * p.q_row_stride;
    const float* gdO = static_cast<const float*>(p.dout) + batch * p.do_batch_stride + head * p.do_head_stride
                       + m0 * p.do_row_stride;
    const float* gK = static_cast<const float*>(p.k) + batch * p.k_batch_stride + head_kv * p.k_head_stride;
    const float* gV = static_cast<const float*>(p.v) + batch * p.v_batch_stride + head_kv * p.v_head_stride;

    float lse2[Tile::kTR], delta[Tile::kTR];
    {
        const i64 base = stat_offset<Variant::kVarlen>(p, batch, head);
#pragma unroll
        for (int i = 0; i < Tile::kTR; ++i) {
            const int row = m0 + tr + i * Tile::kGR;
            lse2[i] = row < p.seqlen_q ? bwd_lse2(p.lse[base + row]) : CUFLASH_INF;
            delta[i] = row < p.seqlen_q ? p.delta[base + row] : 0.f;
        }
    }

    float4 acc_dq[Tile::kCPT];
#pragma unroll
    for (int j = 0; j < Tile::kCPT; ++j) acc_dq[j] = make_float4(0.f, 0.f, 0.f, 0.f);

    // The key tiles this query tile visits, [n_block_min, n_block_max). The first is a constant where the policy
    // never skips leading tiles, so that the loop bounds fold in the front end. With block sparsity the loop walks
    // positions in the query tile's list (KeyTiles, first to last: the key tiles in increasing order, as without).
    const KeyTiles<Mask, Variant> key_tiles(pp, batch, head, m_block, p);
    const int n_block_min = Mask::kLocal && !Variant::kBlockSparse ? Mask(p).n_block_min(m_block) : 0;
    const int n_block_max = Variant::kBlockSparse ? key_tiles.count() : Mask(p).n_block_max(m_block);
    if (n_block_max > n_block_min) {
        load_tile_async_pred<float, kBlockM, kHeadDim, SmemRows<kStride>, kThreads>(sQ, gQ, p.q_row_stride, rows_valid, hd, tid);
        load_tile_async_pred<float, kBlockM, kHeadDim, SmemRows<kStride>, kThreads>(sdO, gdO, p.do_row_stride, rows_valid, hd, tid);
        for (int position = n_block_min; position < n_block_max; ++position) {
            const int n_block = Variant::kBlockSparse ? key_tiles.tile(position) : position;
            const int n0 = n_block * kBlockN;
            if constexpr (Variant::kDropout)   // before the barrier below: the last step read its flags before its own
                Keep::template fill<kThreads>(sKeep, DropoutLanes(*pp, batch, p.heads_q, head), m0, n0, tid);
            load_tile_async_pred<float, kBlockN, kHeadDim, SmemRows<kStride>, kThreads>(
                sK, gK + n0 * p.k_row_stride, p.k_row_stride, p.seqlen_k - n0, hd, tid);
            load_tile_async_pred<float, kBlockN, kHeadDim, SmemRows<kStride>, kThreads>(
                sV, gV + n0 * p.v_row_stride, p.v_row_stride, p.seqlen_k - n0, hd, tid);
            cp_async_commit();
            cp_async_wait<0>();
            __syncthreads();  // Q, dO, K_n, V_n in shared memory

            float s[Tile::kTR][Tile::kTC], dp[Tile::kTR][Tile::kTC];
            simt_scores<Tile>(s, sQ, sK, tr, tc);
            simt_scores<Tile>(dp, sdO, sV, tr, tc);
            const bool mask = Mask(p).needs_mask(m_block, n_block);
            const bool partial = key_tiles.partial(position);   // block sparsity: elements to test
            // A window's bounds once per row (MaskPolicy::row_keys).
            int lo[Tile::kTR], hi[Tile::kTR];
            if constexpr (Mask::kLocal) {
                if (mask) {
#pragma unroll
                    for (int i = 0; i < Tile::kTR; ++i) Mask(p).row_keys(m0 + tr + i * Tile::kGR, lo[i], hi[i]);
                }
            }
#pragma unroll
            for (int i = 0; i < Tile::kTR; ++i)
#pragma unroll
                for (int j = 0; j < Tile::kTC; ++j) {
                    const int qr = tr + i * Tile::kGR;
                    const int kc = tc + j * Tile::kGC;
                    float sv = s[i][j], grad = 1.f;   // grad: the score modifier's derivative
                    if constexpr (Mask::kHasScoreMod) {
                        const Mask mod(p, batch, head);
                        grad = mod.score_derivative(sv, m0 + qr, n0 + kc);
                        sv = mod.modify_score(sv, m0 + qr, n0 + kc);
                    }
                    float ugrad = 1.f;   // programmable: the user score modifier's derivative
                    if constexpr (Variant::kProg)
                        sv = prog_bwd_score(ProgPolicy<Variant>(*pp, batch, head, p.softmax_scale), p, sv, m0 + qr,
                                            n0 + kc, ugrad);
                    float pv = bwd_prob(sv, p.scale_log2, lse2[i]);
                    if constexpr (Mask::kLocal) {
                        if (mask && (n0 + kc < lo[i] || n0 + kc > hi[i])) pv = 0.f;
                    } else {
                        if (mask && !Mask(p).visible(m0 + qr, n0 + kc)) pv = 0.f;
                    }
                    float dpv = dp[i][j];
                    if constexpr (Variant::kProg) {   // a partial tile's hidden elements, dropout
                        if constexpr (Variant::kBlockSparse) {
                            const bool inside = m0 + qr < p.seqlen_q && n0 + kc < p.seqlen_k;
                            if (partial && !(inside && ProgPolicy<Variant>(*pp, batch, head, p.softmax_scale)
                                                           .visible(m0 + qr, n0 + kc)))
                                pv = 0.f;
                        }
                        if constexpr (Variant::kDropout)
                            dpv = Keep::keep(sKeep, qr, kc) ? dpv * pp->dropout_scale : 0.f;
                        pv *= ugrad;
                    }
                    float ds = pv * (dpv - delta[i]);
                    if constexpr (Mask::kHasScoreMod) ds *= grad;
                    sdS[qr * kStrideW + kc] = ds;
                }
            __syncthreads();  // dS complete

            simt_rows<Tile>(acc_dq, sdS, sK, orow, osub);
            __syncthreads();  // every thread is done with sK, sV, sdS
        }
    }

    if (orow < rows_valid) {
        float* gdQ = static_cast<float*>(p.dq) + batch * p.dq_batch_stride + head * p.dq_head_stride
                     + (m0 + orow) * p.dq_row_stride;
        simt_store_row<Tile>(gdQ, acc_dq, p.softmax_scale, osub, hd);
    }
}

// Each kernel's dynamic shared memory (the dispatcher reads it from the compiled module).
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant>
__device__ const int bwd_dkdv_kernel_smem_bytes = SimtBwdTile<kHeadDim, kBlockN, kBlockM, kNWarps>::kSmemBytesDkdv;
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant>
__device__ const int bwd_dq_kernel_smem_bytes = SimtBwdTile<kHeadDim, kBlockM, kBlockN, kNWarps>::kSmemBytesDq;
// Programmable attention's: dropout's flags after the rest.
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant>
__device__ const int bwd_dkdv_prog_kernel_smem_bytes =
    SimtBwdTile<kHeadDim, kBlockN, kBlockM, kNWarps>::kSmemBytesDkdv
    + (Variant::kDropout ? DropoutTile<kBlockM, kBlockN>::kBytes : 0);
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant>
__device__ const int bwd_dq_prog_kernel_smem_bytes =
    SimtBwdTile<kHeadDim, kBlockM, kBlockN, kNWarps>::kSmemBytesDq
    + (Variant::kDropout ? DropoutTile<kBlockM, kBlockN>::kBytes : 0);

template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant>
__global__ void __launch_bounds__(kNWarps * 32)
bwd_dkdv_kernel(const BwdParams p) {
    on_cta_sequence<Variant::kVarlen, 4, false, true>(p, blockIdx.x * kBlockN, [](const BwdParams& ps) {
        bwd_dkdv_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, Variant>(ps);
    });
}

template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant>
__global__ void __launch_bounds__(kNWarps * 32)
bwd_dq_kernel(const BwdParams p) {
    const int m_block = MaskPolicy<kBlockM, kBlockN, Variant, true>::kUnevenWork ? gridDim.x - 1 - blockIdx.x
                                                                                 : blockIdx.x;
    on_cta_sequence<Variant::kVarlen, 4, true>(p, m_block * kBlockM, [](const BwdParams& ps) {
        bwd_dq_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, Variant>(ps);
    });
}

// Programmable attention (Variant: a ProgVariant): dK / dV with dbias and the modifiers' tensor gradients, then dQ.
// At least one CTA per SM asked for: without it ptxas spilled the dQ kernel with every part on, at 80 registers.
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant>
__global__ void __launch_bounds__(kNWarps * 32, 1)
bwd_dkdv_prog_kernel(const BwdParams p, const ProgParams pp) {
    static_assert(Variant::kProg, "bwd_dkdv_prog_kernel takes a ProgVariant");
    on_cta_sequence<Variant::kVarlen, 4, false, true>(p, blockIdx.x * kBlockN, [&pp](const BwdParams& ps) {
        bwd_dkdv_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, Variant>(ps, &pp);
    });
}

template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant>
__global__ void __launch_bounds__(kNWarps * 32, 1)
bwd_dq_prog_kernel(const BwdParams p, const ProgParams pp) {
    static_assert(Variant::kProg, "bwd_dq_prog_kernel takes a ProgVariant");
    const int m_block = MaskPolicy<kBlockM, kBlockN, Variant, true>::kUnevenWork ? gridDim.x - 1 - blockIdx.x
                                                                                 : blockIdx.x;
    on_cta_sequence<Variant::kVarlen, 4, true>(p, m_block * kBlockM, [&pp](const BwdParams& ps) {
        bwd_dq_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, Variant>(ps, &pp);
    });
}
