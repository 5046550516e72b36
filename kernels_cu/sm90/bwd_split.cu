// The Hopper backward at head dims above 256 (split accumulators): three kernels, one per gradient, each holding
// its gradient's 64 rows x (up to 512) columns in float32 split by columns over two consumer warpgroups (at 512
// columns one warpgroup would need 256 registers a thread for them), with no atomics (deterministic).
//
//   dV: rows = 64 keys, steps over the query tiles of every query head of the GQA group:
//         S^T = K Q^T (warpgroup 0),  P^T = exp2(S^T * scale_log2 - lse2),  dV[:, half c] += P^T dO[:, half c]
//   dK: the same rows and steps:
//         S^T = K Q^T (warpgroup 0) beside dP^T = V dO^T (warpgroup 1),  dS^T = P^T (dP^T - delta),
//         dK[:, half c] += dS^T Q[:, half c],  dK *= softmax_scale
//   dQ: rows = 64 queries of one head, steps over its key tiles:
//         S = Q K^T (warpgroup 0) beside dP = dO V^T (warpgroup 1),  dS = P (dP - delta),
//         dQ[:, half c] += dS K[:, half c],  dQ *= softmax_scale
// Per step, warpgroup 0 hands P (times the score modifier's derivative) to warpgroup 1 in float32 through shared
// memory, in its own accumulator order (thread t of each warpgroup holds the same elements); the warpgroup that
// forms the step's weights (dV: 0, else 1) stores them as the 16-bit K-major A operand of the accumulating product
// (128-byte swizzle, stmatrix), and both warpgroups then add their columns. Two named barriers per step order the
// hand-offs. The producer warpgroup's first thread loads the rows' tiles once and each step's two tiles (one
// buffer each: a 64 x 576 tile alone is 72 KB) by TMA. lse2 and delta come from the preprocess's stats rows
// (BwdParams.stats, padded to whole 64-row tiles with lse2 = +inf, so that rows past the end get P = 0). The mask
// policy (common/mask.cuh) gives each row tile its steps and the hidden elements; a score modifier applies before
// the mask, its derivative multiplies dS. Varlen (MaskVariant::kVarlen): the CTA's row tile of its sequence as a
// dense problem of batch 1 (common/varlen.cuh), the tensor maps over the packed rows, the stats rows of each
// sequence in whole 64-row tiles from its padded row (padded_row0). 16-bit.
#include "../common/numeric.cuh"
#include "../common/params.cuh"
#include "../common/mask.cuh"
#include "../common/bwd_math.cuh"
#include "../common/smem.cuh"
#include "../common/varlen.cuh"
#include "wgmma.cuh"
#include "tma.cuh"
#include "pipeline.cuh"

enum BwdSplitProduct { kProductDv = 0, kProductDk = 1, kProductDq = 2 };

// kBlockM: the rows (64); kBlockN: the rows of each step's tiles (the other side: 64 or 32).
template <typename Tag, int kHeadDim, int kBlockM_, int kBlockN_, int kNWarps, int kHeadDimV_, int kProduct>
struct BwdSplitTile {
    static constexpr int kHeadDimQK = kHeadDim;
    static constexpr int kBlockM = kBlockM_, kBlockN = kBlockN_;
    static constexpr int kHeadDimV = kHeadDimV_ ? kHeadDimV_ : kHeadDim;
    static constexpr int kPadQK = (kHeadDim + 63) / 64 * 64;
    static constexpr int kPadV = (kHeadDimV + 63) / 64 * 64;
    static constexpr bool kRowsAreKeys = kProduct != kProductDq;
    static constexpr bool kHasDp = kProduct != kProductDv;   // dK and dQ need dP; dV only P
    // The rows' tiles: R0 (K, or Q for dQ: q / k head dim) and R1 (V, or dO for dQ; not for dV); each step's:
    // C0 (Q, or K for dQ) and C1 (dO, or V for dQ). The accumulating product's B operand is dO (dV) or C0.
    static constexpr int kR0Bytes = kBlockM * kPadQK * 2;
    static constexpr int kR1Bytes = kHasDp ? kBlockM * kPadV * 2 : 0;
    static constexpr int kC0Bytes = kBlockN * kPadQK * 2;
    static constexpr int kC1Bytes = kBlockN * kPadV * 2;
    static constexpr int kAccPad = kProduct == kProductDv ? kPadV : kPadQK;
    // Warpgroup 0's columns; 1 has the rest: none for dK / dQ at q / k head dims up to 64 (v's above 256), where
    // warpgroup 1 computes dP and the weights only.
    static constexpr int kAccCols0 = (kAccPad / 64 + 1) / 2 * 64;
    static constexpr int kAccCols1 = kAccPad - kAccCols0;
    static constexpr int kWBytes = kBlockM * 64 * 2;               // the weights: one 128-byte row block
    static constexpr int kPBytes = kHasDp ? kBlockM * kBlockN * 4 : 0;   // warpgroup 0 -> 1, float32
    static constexpr int kBarriers = 5;                            // rows, C0 full / empty, C1 full / empty
    static constexpr int kSmemBytes =
        1024 + kR0Bytes + kR1Bytes + kC0Bytes + kC1Bytes + kWBytes + kPBytes + 8 * kBarriers;
    static constexpr int kProducerRegs = 40, kConsumerRegs = 232;
    static_assert(kBlockM == 64 && kNWarps == 12, "64 rows, a producer and two consumer warpgroups");
    static_assert(kBlockN == 64 || kBlockN == 32, "steps of 64 or 32 rows");
    static_assert((kAccCols1 > 0 || kProduct != kProductDv) && kAccCols0 <= 320,
                  "two column halves (at q / k head dim 576: 320 + 256); dV's v head dim above 64");
    static_assert(kSmemBytes <= 232448, "shared memory");
};

template <class Tile>
struct BwdSplitSmem {
    u32 r0, r1, c0, c1, w, p, bars;
    __device__ __forceinline__ explicit BwdSplitSmem(const char* raw) {
        r0 = (smem_u32(raw) + 1023) & ~1023u;
        r1 = r0 + Tile::kR0Bytes;
        c0 = r1 + Tile::kR1Bytes;
        c1 = c0 + Tile::kC0Bytes;
        w = c1 + Tile::kC1Bytes;
        p = w + Tile::kWBytes;
        bars = p + Tile::kPBytes;
    }
    __device__ __forceinline__ u32 rows_full() const { return bars; }
    __device__ __forceinline__ u32 c0_full() const { return bars + 8; }
    __device__ __forceinline__ u32 c0_empty() const { return bars + 16; }
    __device__ __forceinline__ u32 c1_full() const { return bars + 24; }
    __device__ __forceinline__ u32 c1_empty() const { return bars + 32; }
};

// Named barriers of a step (256 consumer threads): A, warpgroup 0's P is out and the last step's products are
// done; B, the step's weights are in shared memory.
constexpr int kBwdSplitBarrierA = 1, kBwdSplitBarrierB = 2;

// A CTA's row tile: its index, head (kv head for dK / dV, query head for dQ) and batch (varlen: 0), and where its
// sequence starts: its first packed q and k rows (the tensor maps' coordinates) and its stats rows' padded start.
struct BwdSplitCta {
    int row_block, head, batch;
    int q_row0, k_row0, stat_row0;
};

// The steps of a row tile, in order, for the producer and both consumer warpgroups alike: dK / dV, the query
// tiles [m_block_min, m_block_max) of each query head of the group; dQ, the key tiles [n_block_min, n_block_max).
template <class Tile, class Mask>
struct BwdSplitSteps {
    int first, last, heads, head0;   // per head: tiles [first, last); heads of the group from head0
    __device__ __forceinline__ BwdSplitSteps(const BwdParams& p, int row_block, int head) {
        const Mask mask(p);
        if constexpr (Tile::kRowsAreKeys) {
            first = mask.m_block_min(row_block);
            last = mask.m_block_max(row_block);
            heads = p.heads_per_kv;
            head0 = head * p.heads_per_kv;
        } else {
            first = mask.n_block_min(row_block);
            last = mask.n_block_max(row_block);
            heads = 1;
            head0 = head;
        }
        if (last < first) last = first;
    }
    __device__ __forceinline__ int count() const { return (last - first) * heads; }
    __device__ __forceinline__ int tile(int i) const { return first + i % (last - first); }
    __device__ __forceinline__ int step_head(int i) const { return head0 + i / (last - first); }
};

// The producer: one thread loads the rows' tiles once, then each step's C0 and C1 into their buffers, each
// once the consumers have freed it.
template <class Tile, class Mask>
__device__ __forceinline__ void bwd_split_producer(const BwdParams& p, const BwdSplitSmem<Tile>& smem,
                                                   const TmaDesc& tma_r0, const TmaDesc& tma_r1,
                                                   const TmaDesc& tma_c0, const TmaDesc& tma_c1, const BwdSplitCta& cta) {
    constexpr int kBlockM = Tile::kBlockM, kBlockN = Tile::kBlockN;
    const int row_block = cta.row_block, head = cta.head, batch = cta.batch;
    // The packed rows of the row tile's side and of the steps' side.
    const int rows_row0 = Tile::kRowsAreKeys ? cta.k_row0 : cta.q_row0;
    const int steps_row0 = Tile::kRowsAreKeys ? cta.q_row0 : cta.k_row0;
    const BwdSplitSteps<Tile, Mask> steps(p, row_block, head);
    const int n = steps.count();
    if (n <= 0) return;   // nothing to load (the consumers store zeros): no copy may outlive the CTA
    // The rows' own head: the kv head (dK / dV) or the query head (dQ).
    mbar_arrive_expect_tx(smem.rows_full(), Tile::kR0Bytes + Tile::kR1Bytes);
#pragma unroll
    for (int cb = 0; cb < Tile::kPadQK / 64; ++cb)
        tma_load_4d(smem.r0 + cb * kBlockM * 128, &tma_r0, smem.rows_full(), cb * 64, rows_row0 + row_block * kBlockM,
                    head, batch);
    if constexpr (Tile::kHasDp) {
#pragma unroll
        for (int cb = 0; cb < Tile::kPadV / 64; ++cb)
            tma_load_4d(smem.r1 + cb * kBlockM * 128, &tma_r1, smem.rows_full(), cb * 64,
                        rows_row0 + row_block * kBlockM, head, batch);
    }
    for (int i = 0; i < n; ++i) {
        const PipelineState<1> ring(i);
        const int row = steps_row0 + steps.tile(i) * kBlockN;
        // The step's head: a query head of the group (dK / dV), or the kv head of the query head (dQ).
        const int step_head = Tile::kRowsAreKeys ? steps.step_head(i) : head / p.heads_per_kv;
        auto load_c0 = [&]() {
            mbar_wait(smem.c0_empty(), ring.empty_phase());
            mbar_arrive_expect_tx(smem.c0_full(), Tile::kC0Bytes);
#pragma unroll
            for (int cb = 0; cb < Tile::kPadQK / 64; ++cb)
                tma_load_4d(smem.c0 + cb * kBlockN * 128, &tma_c0, smem.c0_full(), cb * 64, row, step_head, batch);
        };
        auto load_c1 = [&]() {
            mbar_wait(smem.c1_empty(), ring.empty_phase());
            mbar_arrive_expect_tx(smem.c1_full(), Tile::kC1Bytes);
#pragma unroll
            for (int cb = 0; cb < Tile::kPadV / 64; ++cb)
                tma_load_4d(smem.c1 + cb * kBlockN * 128, &tma_c1, smem.c1_full(), cb * 64, row, step_head, batch);
        };
        // First the buffer the last step freed first: C1 after dP (dK, dQ), C0 after S (dV).
        if constexpr (Tile::kHasDp) {
            load_c1();
            load_c0();
        } else {
            load_c0();
            load_c1();
        }
    }
}

// One consumer warpgroup (cw 0 or 1): its column half of the gradient over every step, then its store.
template <typename Tag, class Tile, class Mask, int kProduct, int kCw>
__device__ __forceinline__ void bwd_split_consumer(const BwdParams& p, const BwdSplitSmem<Tile>& smem,
                                                   const BwdSplitCta& cta) {
    const int row_block = cta.row_block, head = cta.head, batch = cta.batch;
    constexpr int kBlockM = Tile::kBlockM, kBlockN = Tile::kBlockN;
    constexpr int kCols = kCw == 0 ? Tile::kAccCols0 : Tile::kAccCols1;
    constexpr int kCol0 = kCw == 0 ? 0 : Tile::kAccCols0;
    constexpr int kKSteps = kBlockN / 16;   // k16 steps of the accumulating product
    using OutTag = typename ElemTraits<Tag>::OutTag;
    const int tid = threadIdx.x & 127, lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
    const int g = lane >> 2, t4 = lane & 3;
    const BwdSplitSteps<Tile, Mask> steps(p, row_block, head);
    const int n = steps.count();
    float acc[kCols > 0 ? kCols / 2 : 1];
#pragma unroll
    for (int i = 0; i < kCols / 2; ++i) acc[i] = 0.f;
    if (n > 0) mbar_wait(smem.rows_full(), 0);
    const int r_first = row_block * kBlockM + warp * 16 + g;   // this thread's rows: r_first, r_first + 8
    for (int i = 0; i < n; ++i) {
        const u32 parity = PipelineState<1>(i).phase();
        const int c_block = steps.tile(i);
        const int q_head = Tile::kRowsAreKeys ? steps.step_head(i) : head;   // the step's query head
        const int c_first = c_block * kBlockN + 2 * t4;   // this thread's columns: c_first + 8 j + (0, 1)
        float s[kBlockN / 2];   // warpgroup 0: S^T / S, then P (times the derivative); 1: dP^T / dP, then dS
        if constexpr (kCw == 0) {
            mbar_wait(smem.c0_full(), parity);
            wgmma_ss_rows_product<Tag, kBlockN, Tile::kPadQK, kBlockM, kBlockN>(s, smem.r0, smem.c0);
            wgmma_wait<0>();
            fence_operand(s);
            if constexpr (kProduct == kProductDv) mbar_arrive(smem.c0_empty());   // Q: S^T's alone
            // P (dV: P^T) and, for dK / dQ, times the score modifier's derivative, with the mask.
            const Mask mask(p);
            const Mask mod(p, batch, q_head);
            const bool masked = mask.needs_mask(Tile::kRowsAreKeys ? c_block : row_block,
                                                Tile::kRowsAreKeys ? row_block : c_block);
            const float* lse2 = p.stats + (static_cast<i64>(batch) * p.heads_q + q_head) * 2 * p.stat_rows + cta.stat_row0;
#pragma unroll
            for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = r_first + 8 * (e >> 1), c = c_first + 8 * j + (e & 1);
                    const int qrow = Tile::kRowsAreKeys ? c : r, key = Tile::kRowsAreKeys ? r : c;
                    const float raw = s[4 * j + e];
                    float sm = mod.modify_score(raw, qrow, key);
                    if (masked && !mask.visible(qrow, key)) sm = -CUFLASH_INF;
                    float pr = bwd_prob(sm, p.scale_log2, lse2[qrow]);
                    if constexpr (Tile::kHasDp && Mask::kHasScoreMod) pr *= mod.score_derivative(raw, qrow, key);
                    s[4 * j + e] = pr;
                }
            if constexpr (Tile::kHasDp) {
#pragma unroll
                for (int k = 0; k < kBlockN / 2; ++k) st_shared_f32(smem.p + (k * 128 + tid) * 4, s[k]);
            }
        } else if constexpr (Tile::kHasDp) {
            mbar_wait(smem.c1_full(), parity);
            wgmma_ss_rows_product<Tag, kBlockN, Tile::kPadV, kBlockM, kBlockN>(s, smem.r1, smem.c1);
            wgmma_wait<0>();
            fence_operand(s);
            mbar_arrive(smem.c1_empty());   // dO / V: dP's alone
        }
        // A: warpgroup 0's P is out, and both warpgroups' products of the last step have read the weights.
        named_barrier_sync(kBwdSplitBarrierA, 256);
        if constexpr (kCw == (kProduct == kProductDv ? 0 : 1)) {
            if constexpr (Tile::kHasDp) {   // dS = P (dP - delta)
                const float* delta = p.stats + (static_cast<i64>(batch) * p.heads_q + q_head) * 2 * p.stat_rows
                                     + p.stat_rows + cta.stat_row0;
#pragma unroll
                for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int r = r_first + 8 * (e >> 1), c = c_first + 8 * j + (e & 1);
                        const float dl = delta[Tile::kRowsAreKeys ? c : r];
                        s[4 * j + e] = ld_shared_f32(smem.p + ((4 * j + e) * 128 + tid) * 4) * (s[4 * j + e] - dl);
                    }
            }
            // The weights as the A operand: rows x kBlockN, 128-byte swizzled; one stmatrix per k16 step.
            const int q = lane >> 3, row = warp * 16 + (q & 1) * 8 + (lane & 7);
#pragma unroll
            for (int kk = 0; kk < kKSteps; ++kk) {
                const float* x = s + 8 * kk;
                stmatrix_x4(smem.w + swizzle128(row, 2 * kk + (q >> 1)), ElemTraits<Tag>::pack2(x[0], x[1]),
                            ElemTraits<Tag>::pack2(x[2], x[3]), ElemTraits<Tag>::pack2(x[4], x[5]),
                            ElemTraits<Tag>::pack2(x[6], x[7]));
            }
            fence_proxy_async_smem();
        }
        named_barrier_sync(kBwdSplitBarrierB, 256);   // B: the weights are in
        // acc += W X[:, kCol0 .. kCol0 + kCols): X = dO (dV) or C0 (Q for dK, K for dQ), MN-major.
        const u32 x_full = kProduct == kProductDv ? smem.c1_full() : smem.c0_full();
        const u32 x_empty = kProduct == kProductDv ? smem.c1_empty() : smem.c0_empty();
        const u32 x_tile = kProduct == kProductDv ? smem.c1 : smem.c0;
        mbar_wait(x_full, parity);
        if constexpr (kCols > 0) {
            // In pieces of at most 256 columns (wgmma's N): 320 (head dim 576's first half) as 256 + 64.
            constexpr int kPiece0 = kCols < 256 ? kCols : 256, kPiece1 = kCols - kPiece0;
            const SmemDesc<> w_desc(smem.w, 16, 1024);
            const SmemDesc<> x_desc(x_tile + (kCol0 / 64) * kBlockN * 128, kBlockN * 128, 1024);
            float (&acc0)[kPiece0 / 2] = *reinterpret_cast<float(*)[kPiece0 / 2]>(acc);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < kKSteps; ++kk) {
                WgmmaSS<Tag, kPiece0>::template run<true>(acc0, w_desc.at(kk * 32), x_desc.at(kk * 16 * 128), 1);
                if constexpr (kPiece1 > 0) {
                    float (&acc1)[kPiece1 / 2] = *reinterpret_cast<float(*)[kPiece1 / 2]>(acc + kPiece0 / 2);
                    WgmmaSS<Tag, kPiece1>::template run<true>(acc1, w_desc.at(kk * 32),
                                                               x_desc.at((kPiece0 / 64) * kBlockN * 128 + kk * 16 * 128), 1);
                }
            }
            wgmma_commit();
            wgmma_wait<0>();
            fence_operand(acc);
        }
        mbar_arrive(x_empty);
    }
    // The store: rows past the sequence and padded columns skipped; dK and dQ times the softmax scale.
    const float scale = kProduct == kProductDv ? 1.f : p.softmax_scale;
    u16* out;
    i64 row_stride;
    int rows, width;
    if constexpr (kProduct == kProductDv) {
        out = static_cast<u16*>(p.dv) + batch * p.dv_batch_stride + head * p.dv_head_stride;
        row_stride = p.dv_row_stride;
        rows = p.seqlen_k;
        width = Tile::kHeadDimV;
    } else if constexpr (kProduct == kProductDk) {
        out = static_cast<u16*>(p.dk) + batch * p.dk_batch_stride + head * p.dk_head_stride;
        row_stride = p.dk_row_stride;
        rows = p.seqlen_k;
        width = Tile::kHeadDimQK;
    } else {
        out = static_cast<u16*>(p.dq) + batch * p.dq_batch_stride + head * p.dq_head_stride;
        row_stride = p.dq_row_stride;
        rows = p.seqlen_q;
        width = Tile::kHeadDimQK;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = r_first + 8 * h;
        if (kCols > 0 && row < rows) {
#pragma unroll
            for (int j = 0; j < kCols / 8; ++j) {
                const int col = kCol0 + 8 * j + 2 * t4;
                if (col < width)
                    *reinterpret_cast<u32*>(out + row * row_stride + col) =
                        ElemTraits<OutTag>::pack2(acc[4 * j + 2 * h] * scale, acc[4 * j + 2 * h + 1] * scale);
            }
        }
    }
}

// The kernel body: the row tile's coordinates, the barriers, then the producer and the two consumer warpgroups.
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV, int kProduct>
__device__ __forceinline__ void bwd_split_body(const BwdParams& params, const TmaDesc& tma_r0, const TmaDesc& tma_r1,
                                               const TmaDesc& tma_c0, const TmaDesc& tma_c1) {
    using Tile = BwdSplitTile<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, kHeadDimV, kProduct>;
    // dK / dV: key tiles of 64 against query tiles of kBlockN rows; dQ: query tiles of 64 against key tiles.
    using Mask = MaskPolicy<Tile::kRowsAreKeys ? kBlockN : kBlockM, Tile::kRowsAreKeys ? kBlockM : kBlockN, Variant>;
    static_assert(!Variant::kSink, "sinks need no code in the backward");
    extern __shared__ char smem_raw[];
    const BwdSplitSmem<Tile> smem(smem_raw);
    // Grid: (row tiles, heads: kv heads for dK / dV, query heads for dQ, batch / sequences).
    BwdSplitCta cta{static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z), 0, 0, 0};
    BwdParams seq;
    if constexpr (Variant::kVarlen) {   // the grid covers the longest sequence: a tile past this one's leaves
        const SeqSpan span = seq_span(params, cta.batch);
        if (cta.row_block * kBlockM >= (Tile::kRowsAreKeys ? span.seqlen_k : span.seqlen_q)) return;
        seq = seq_params<2>(params, span, cta.batch);
        cta.q_row0 = span.q_start;
        cta.k_row0 = span.k_start;
        cta.stat_row0 = padded_row0(span.q_start, cta.batch, kBlockM);
        cta.batch = 0;
    }
    const BwdParams& p = Variant::kVarlen ? seq : params;
    const int wg = __shfl_sync(0xffffffff, static_cast<int>(threadIdx.x) / 128, 0);
    if (threadIdx.x == 0) {
        mbar_init(smem.rows_full(), 1);
        mbar_init(smem.c0_full(), 1);
        mbar_init(smem.c1_full(), 1);
        // C0 (Q / K) is read by warpgroup 0's S and, but for dV, by both products; C1 (dO / V) by warpgroup 1's
        // dP, or (dV) by both products.
        mbar_init(smem.c0_empty(), kProduct == kProductDv ? 128 : 256);
        mbar_init(smem.c1_empty(), kProduct == kProductDv ? 256 : 128);
        fence_barrier_init();
    }
    __syncthreads();
    if (wg == 0) {
        setmaxnreg_dec<Tile::kProducerRegs>();
        if (threadIdx.x == 0)
            bwd_split_producer<Tile, Mask>(p, smem, tma_r0, tma_r1, tma_c0, tma_c1, cta);
    } else {
        setmaxnreg_inc<Tile::kConsumerRegs>();
        if (wg == 1) bwd_split_consumer<Tag, Tile, Mask, kProduct, 0>(p, smem, cta);
        else bwd_split_consumer<Tag, Tile, Mask, kProduct, 1>(p, smem, cta);
    }
}

// Entry points, one per gradient; <name>_smem_bytes (same template arguments) for the dispatcher. The tensor
// maps: the rows' two tiles (r1 unused for dV) and the steps' two (c0: Q or K, c1: dO or V), in 64-column boxes
// of kBlockM (rows) or kBlockN (steps) rows.
#define CUFLASH_SM90_BWD_SPLIT_KERNEL(name, product)                                                             \
    template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV = 0> \
    __device__ const int name##_smem_bytes =                                                                    \
        BwdSplitTile<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, kHeadDimV, product>::kSmemBytes;                \
    template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV = 0> \
    __global__ void __launch_bounds__(kNWarps * 32, 1)                                                          \
    name(const BwdParams p, const __grid_constant__ TmaDesc tma_r0, const __grid_constant__ TmaDesc tma_r1,     \
         const __grid_constant__ TmaDesc tma_c0, const __grid_constant__ TmaDesc tma_c1) {                      \
        bwd_split_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, Variant, kHeadDimV, product>(p, tma_r0, tma_r1, \
                                                                                              tma_c0, tma_c1);  \
    }
CUFLASH_SM90_BWD_SPLIT_KERNEL(bwd_split_dv_kernel, kProductDv)
CUFLASH_SM90_BWD_SPLIT_KERNEL(bwd_split_dk_kernel, kProductDk)
CUFLASH_SM90_BWD_SPLIT_KERNEL(bwd_split_dq_kernel, kProductDq)
#undef CUFLASH_SM90_BWD_SPLIT_KERNEL
