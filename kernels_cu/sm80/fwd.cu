// FlashAttention-2 forward for sm_80 and newer: mma.sync m16n8k16 on fp16/bf16,
// fp32 accumulation, cp.async tile loads, online softmax in exp2.
//
// One CTA per (query tile, head, batch; varlen: of the longest sequence, the tiles past a sequence's end
// leaving at once). Each warp owns kMTiles 16-row slices
// of the query tile. K/V tiles stream through a two-stage shared-memory ring:
// the loads of tile n-1 are in flight during the whole of iteration n, which
// hides L2/HBM latency even when a tile's math is short. Key tiles are visited
// from last to first, so the tiles that need masking (sequence end, causal
// diagonal) come first. Which key tiles a query tile visits, which elements are
// hidden, the score modifier and the sink come from the mask policy
// (common/mask.cuh) built from the kernel's MaskVariant.
#include "../common/numeric.cuh"
#include "../common/params.cuh"
#include "../common/mask.cuh"
#include "../common/programmable.cuh"
#include "../common/softmax.cuh"
#include "../common/varlen.cuh"
#include "mma.cuh"
#include "copy.cuh"

// kHeadDimV_: v's (and the output's) head dim where it differs from q's and k's (0: the same).
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kHeadDimV_ = 0>
struct FwdTile {
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kHeadDimPad = (kHeadDim + 15) / 16 * 16;  // MMA k-steps are 16 wide
    static constexpr int kHeadDimV = kHeadDimV_ ? kHeadDimV_ : kHeadDim;
    static constexpr int kBlockM = kBlockM_;
    static constexpr int kBlockN = kBlockN_;
    static constexpr int kNWarps = kNWarps_;
    static constexpr int kThreads = kNWarps * 32;
    // Warps beyond one per 16-row slice split O's columns (head dims above 256, whose O would take 256
    // registers a thread in one warp): kColSplit warps share each row slice, each computing its S and softmax
    // again (bitwise the same) and P V over its share of the columns.
    static constexpr int kColSplit = 16 * kNWarps > kBlockM ? 16 * kNWarps / kBlockM : 1;
    // V's and O's columns padded to whole 16-column pairs per warp (the P V product takes two n8 tiles at once).
    static constexpr int kHeadDimPadV = (kHeadDimV + 16 * kColSplit - 1) / (16 * kColSplit) * (16 * kColSplit);
    static constexpr int kRowWarps = kNWarps / kColSplit;          // warps along the rows
    static constexpr int kMTiles = kBlockM / (16 * kRowWarps);     // 16-row slices per warp
    static constexpr int kNTilesO = kHeadDimPadV / 8 / kColSplit;  // n8 tiles of O per warp
    // S is computed kSubN keys at a time: a stage of kBlockN keys costs one pair
    // of barriers, while the S and O accumulators together stay within about
    // 176 registers per thread (the rest of the 255 go to fragments and indices).
    static constexpr int kSubN =
        kMTiles * 4 * (kBlockN / 8 + kNTilesO) <= 176 || kBlockN <= 32 ? kBlockN : kBlockN / 2;
    static constexpr int kNTilesS = kSubN / 8;                     // n8 tiles of one S sub-tile
    // Whether a masked tile of a window may take each row's key bounds once (MaskPolicy::row_keys) rather than
    // test each element: not where S holds 128 registers per thread, next to which the bounds spill.
    static constexpr bool kRowBoundsFit = kMTiles * kNTilesS * 4 <= 64;
    // One 16-byte pad per row: 8 consecutive rows then start in different
    // banks, so ldmatrix and the fragment stores are conflict-free.
    // (Q, K and V rows alike: the widest of the two head dims; O is staged in Q's rows.)
    static constexpr int kSmemStride = (kHeadDimPad > kHeadDimPadV ? kHeadDimPad : kHeadDimPadV) + 8;
    static constexpr int kStages = 2;                              // K/V ring depth
    static constexpr int kSmemElems = (kBlockM + 2 * kStages * kBlockN) * kSmemStride;
    static_assert(kBlockM % (16 * kRowWarps) == 0 && kRowWarps * kColSplit == kNWarps,
                  "kBlockM: a multiple of 16 * kNWarps, or 16 * kNWarps / kColSplit with warps splitting O's columns");
    static_assert(kNTilesO % 2 == 0 && kNTilesO * 8 * kColSplit == kHeadDimPadV, "O's columns: whole 16-column pairs per warp");
    static_assert(kBlockN % 16 == 0, "kBlockN must be a multiple of 16");
    static_assert(kSubN % 16 == 0, "S sub-tiles must be a multiple of 16 keys");
    static_assert(kHeadDim % 8 == 0, "head_dim must be a multiple of 8");
};

// Issue key tile n_block's K and V into ring stage `stage` (K then V, each kBlockN rows).
template <typename Tile>
__device__ __forceinline__ void load_kv(u16* sKV, const u16* gK, i64 k_row_stride, const u16* gV,
                                        i64 v_row_stride, int seqlen_k, int n_block, int stage, int tid) {
    constexpr int kTileElems = Tile::kBlockN * Tile::kSmemStride;
    const int n0 = n_block * Tile::kBlockN;
    u16* sK = sKV + (2 * stage) * kTileElems;
    load_tile_async<Tile::kBlockN, Tile::kHeadDim, SmemRows<Tile::kSmemStride>, Tile::kThreads>(
        sK, gK + n0 * k_row_stride, k_row_stride, seqlen_k - n0, tid);
    load_tile_async<Tile::kBlockN, Tile::kHeadDimV, SmemRows<Tile::kSmemStride>, Tile::kThreads>(
        sK + kTileElems, gV + n0 * v_row_stride, v_row_stride, seqlen_k - n0, tid);
}

// The kernel's dynamic shared memory (the dispatcher reads it from the compiled module).
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV = 0>
__device__ const int fwd_kernel_smem_bytes = FwdTile<kHeadDim, kBlockM, kBlockN, kNWarps, kHeadDimV>::kSmemElems * 2;

// S's start where the bias is added first (ProgPolicy::kBiasFirst): bias / softmax_scale at the elements inside
// the sequences, 0 elsewhere.
template <class Tile, class Variant>
__device__ __forceinline__ void bias_scores(float (&acc_s)[Tile::kMTiles][Tile::kNTilesS][4], const ProgParams& pp,
                                            const FwdParams& p, int seq, int head, int row0, int col0, int g, int t4) {
    const ProgPolicy<Variant> prog(pp, seq, head, p.softmax_scale);
#pragma unroll
    for (int t = 0; t < Tile::kMTiles; ++t)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + t * 16 + g + h * 8;
            const i64 row_at = prog.bias_row(row);
#pragma unroll
            for (int n = 0; n < Tile::kNTilesS; ++n)
#pragma unroll
                for (int e = 2 * h; e < 2 * h + 2; ++e) {
                    const int col = col0 + n * 8 + 2 * t4 + (e & 1);
                    acc_s[t][n][e] = row < p.seqlen_q && col < p.seqlen_k ? prog.bias(row_at, col) * prog.inv_scale : 0.f;
                }
        }
}

// One query tile of one (head, batch) of a dense problem. pp: programmable attention's parameters (null unless
// Variant::kProg); seq: the batch index those see (varlen: the sequence, while batch is 0).
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV>
__device__ __forceinline__ void fwd_tile(const FwdParams& p, const int m_block, const int head, const int batch,
                                         const ProgParams* pp, const int seq) {
    using Tile = FwdTile<kHeadDim, kBlockM, kBlockN, kNWarps, kHeadDimV>;
    using Mask = MaskPolicy<kBlockM, kBlockN, Variant>;   // the mask policy (common/mask.cuh)
    using Mma = Mma16816<Tag>;
    constexpr int kMTiles = Tile::kMTiles;
    constexpr int kStride = Tile::kSmemStride;

    extern __shared__ __align__(128) u16 smem[];
    u16* sQ = smem;
    u16* sKV = sQ + kBlockM * kStride;  // stage s: K at sKV + 2s*tile, V at sKV + (2s+1)*tile
    constexpr int kTileElems = kBlockN * kStride;

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int head_kv = head / p.heads_per_kv;

    const int row_base = m_block * kBlockM;
    const int rows_valid = min(kBlockM, p.seqlen_q - row_base);
    const u16* gQ = static_cast<const u16*>(p.q) + batch * p.q_batch_stride + head * p.q_head_stride
                    + row_base * p.q_row_stride;
    const u16* gK = static_cast<const u16*>(p.k) + batch * p.k_batch_stride + head_kv * p.k_head_stride;
    const u16* gV = static_cast<const u16*>(p.v) + batch * p.v_batch_stride + head_kv * p.v_head_stride;

    // The key tiles this query tile visits, [n_block_min, n_block_max), walked from the last down. The first is
    // a constant where the policy never skips leading tiles, so that the loop bounds fold in the front end. With
    // block sparsity the loop walks positions in the query tile's list instead (KeyTiles: tile(n) is the key tile
    // of position n; without sparsity, n itself, written as the constant-folded select `kBlockSparse ? tile(n) :
    // n` in the loads, where a call of the identity changed the windowed kernels' register allocation).
    const KeyTiles<Mask, Variant> key_tiles(pp, seq, head, m_block, p);
    const int n_block_min = Mask::kLocal && !Variant::kBlockSparse ? Mask(p).n_block_min(m_block) : 0;
    const int n_block_max = Variant::kBlockSparse ? key_tiles.count() : Mask(p).n_block_max(m_block);

    // Fragment coordinates of this thread: rows (g, g + 8) of each m-tile, and (column split) its O columns.
    const int warp_row0 = (Tile::kColSplit == 1 ? warp : warp % Tile::kRowWarps) * kMTiles * 16;
    const int col0 = Tile::kColSplit == 1 ? 0 : warp / Tile::kRowWarps * Tile::kNTilesO * 8;
    const int g = lane >> 2;
    const int t4 = lane & 3;

    float acc_o[kMTiles][Tile::kNTilesO][4];
#pragma unroll
    for (int t = 0; t < kMTiles; ++t)
#pragma unroll
        for (int n = 0; n < Tile::kNTilesO; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[t][n][e] = 0.f;

    OnlineSoftmax<kMTiles, Tile::kNTilesS> softmax;
    softmax.init();

    if (n_block_max > n_block_min) {
        if constexpr (Tile::kHeadDimV == kHeadDim && Tile::kHeadDimPadV == Tile::kHeadDimPad) {
            zero_pad_cols<kBlockM + 2 * Tile::kStages * kBlockN, kHeadDim, Tile::kHeadDimPad, kStride, Tile::kThreads>(
                smem, tid);
        } else {   // each tile's own pad columns (a load may write the others meanwhile)
            zero_pad_cols<kBlockM, kHeadDim, Tile::kHeadDimPad, kStride, Tile::kThreads>(sQ, tid);
#pragma unroll
            for (int s = 0; s < Tile::kStages; ++s) {
                zero_pad_cols<kBlockN, kHeadDim, Tile::kHeadDimPad, kStride, Tile::kThreads>(sKV + 2 * s * kTileElems, tid);
                zero_pad_cols<kBlockN, Tile::kHeadDimV, Tile::kHeadDimPadV, kStride, Tile::kThreads>(
                    sKV + (2 * s + 1) * kTileElems, tid);
            }
        }
        load_tile_async<kBlockM, kHeadDim, SmemRows<kStride>, Tile::kThreads>(sQ, gQ, p.q_row_stride, rows_valid, tid);
        load_kv<Tile>(sKV, gK, p.k_row_stride, gV, p.v_row_stride, p.seqlen_k, (Variant::kBlockSparse ? key_tiles.tile(n_block_max - 1) : n_block_max - 1), 0, tid);
        cp_async_commit();
        if (n_block_max - 2 >= n_block_min)
            load_kv<Tile>(sKV, gK, p.k_row_stride, gV, p.v_row_stride, p.seqlen_k, (Variant::kBlockSparse ? key_tiles.tile(n_block_max - 2) : n_block_max - 2), 1,
                          tid);
        cp_async_commit();  // possibly empty: keeps "all but the newest group" meaning tile n

        for (int position = n_block_max - 1, stage = 0; position >= n_block_min; --position, stage ^= 1) {
            const int n_block = key_tiles.tile(position);
            const int n0 = n_block * kBlockN;
            const u16* sK = sKV + (2 * stage) * kTileElems;
            const u16* sV = sK + kTileElems;
            cp_async_wait<1>();
            __syncthreads();  // tile n (and Q) landed for every thread's copies

            // Q's A fragments at one 32-bit shared address plus constants, which ptxas folds into ldmatrix's
            // immediate offsets (an element index costs three integer instructions per ldmatrix).
            const u32 q_frag_base = smem_u32(sQ + (warp_row0 + (lane & 15)) * kStride + (lane >> 4) * 8);
            const bool tile_needs_mask = Mask(p).needs_mask(m_block, n_block);
            const bool tile_partial = key_tiles.partial(position);
#pragma unroll 1
            for (int sub = 0; sub < kBlockN / Tile::kSubN; ++sub) {
                // S = Q K_n^T over keys [sub * kSubN, (sub + 1) * kSubN) of the stage
                float acc_s[kMTiles][Tile::kNTilesS][4];
                if constexpr (ProgPolicy<Variant>::kBiasFirst) {
                    // The bias as the accumulators' start: its loads land in S's own registers.
                    bias_scores<Tile, Variant>(acc_s, *pp, p, seq, head, row_base + warp_row0, n0 + sub * Tile::kSubN,
                                               g, t4);
                } else {
#pragma unroll
                    for (int t = 0; t < kMTiles; ++t)
#pragma unroll
                        for (int n = 0; n < Tile::kNTilesS; ++n)
#pragma unroll
                            for (int e = 0; e < 4; ++e) acc_s[t][n][e] = 0.f;
                }
#pragma unroll
                for (int kk = 0; kk < Tile::kHeadDimPad / 16; ++kk) {
                    u32 a[kMTiles][4];
#pragma unroll
                    for (int t = 0; t < kMTiles; ++t) {
                        ldmatrix_x4(a[t], q_frag_base + ((t * 16) * kStride + kk * 16) * 2);
                    }
#pragma unroll
                    for (int nn = 0; nn < Tile::kNTilesS / 2; ++nn) {
                        u32 b[4];
                        load_b_frag_nk<kStride>(b, sK, sub * Tile::kSubN + nn * 16, kk * 16, lane);
#pragma unroll
                        for (int t = 0; t < kMTiles; ++t) {
                            Mma::run(acc_s[t][2 * nn], a[t], b[0], b[1]);
                            Mma::run(acc_s[t][2 * nn + 1], a[t], b[2], b[3]);
                        }
                    }
                }

                if constexpr (Mask::kHasScoreMod) {
                    const Mask mask(p, batch, head);
#pragma unroll
                    for (int t = 0; t < kMTiles; ++t)
#pragma unroll
                        for (int n = 0; n < Tile::kNTilesS; ++n)
#pragma unroll
                            for (int e = 0; e < 4; ++e)
                                acc_s[t][n][e] = mask.modify_score(
                                    acc_s[t][n][e], row_base + warp_row0 + t * 16 + g + (e >> 1) * 8,
                                    n0 + sub * Tile::kSubN + n * 8 + 2 * t4 + (e & 1));
                }
                if constexpr (Variant::kProg) {
                    prog_scores<Tile::kMTiles, Tile::kNTilesS, Variant>(acc_s, *pp, p, seq, head, row_base + warp_row0,
                                               n0 + sub * Tile::kSubN, g, t4, tile_partial);
                }
                if (tile_needs_mask) {
                    if constexpr (Mask::kLocal && Tile::kRowBoundsFit) {
                        // A window's bounds once per row (MaskPolicy::row_keys), one row at a time so that
                        // only its two bounds are live next to the accumulators.
#pragma unroll
                        for (int t = 0; t < kMTiles; ++t)
#pragma unroll
                            for (int h = 0; h < 2; ++h) {
                                int lo, hi;
                                Mask(p).row_keys(row_base + warp_row0 + t * 16 + g + h * 8, lo, hi);
#pragma unroll
                                for (int n = 0; n < Tile::kNTilesS; ++n)
#pragma unroll
                                    for (int e = 2 * h; e < 2 * h + 2; ++e) {
                                        const int col = n0 + sub * Tile::kSubN + n * 8 + 2 * t4 + (e & 1);
                                        if (col < lo || col > hi) acc_s[t][n][e] = -CUFLASH_INF;
                                    }
                            }
                    } else {
#pragma unroll
                        for (int t = 0; t < kMTiles; ++t)
#pragma unroll
                            for (int n = 0; n < Tile::kNTilesS; ++n)
#pragma unroll
                                for (int e = 0; e < 4; ++e) {
                                    const int row = row_base + warp_row0 + t * 16 + g + (e >> 1) * 8;
                                    const int col = n0 + sub * Tile::kSubN + n * 8 + 2 * t4 + (e & 1);
                                    if (!Mask(p).visible(row, col))
                                        acc_s[t][n][e] = -CUFLASH_INF;
                                }
                    }
                }

                float rescale[2 * kMTiles];
                // Once the running maxima settle, most tiles leave them unchanged: skip
                // the accumulator rescale (a multiply per output element) when no row
                // of the warp moved.
                if (__any_sync(0xffffffff, softmax.step(acc_s, p.scale_log2, rescale))) {
#pragma unroll
                    for (int t = 0; t < kMTiles; ++t)
#pragma unroll
                        for (int n = 0; n < Tile::kNTilesO; ++n)
#pragma unroll
                            for (int e = 0; e < 4; ++e) acc_o[t][n][e] *= rescale[2 * t + (e >> 1)];
                }
                if constexpr (Variant::kDropout) {   // after the row sums: lse is that of the undropped P
                    dropout_probs<Tile::kMTiles, Tile::kNTilesS>(acc_s, DropoutLanes(*pp, seq, p.heads_q, head), row_base + warp_row0,
                                        n0 + sub * Tile::kSubN, g, t4);
                }

                // O += P V_n, P taken from the S accumulators.
#pragma unroll
                for (int kk = 0; kk < Tile::kNTilesS / 2; ++kk) {
                    u32 a[kMTiles][4];
#pragma unroll
                    for (int t = 0; t < kMTiles; ++t) pack_a_from_acc<Tag>(a[t], acc_s[t][2 * kk], acc_s[t][2 * kk + 1]);
#pragma unroll
                    for (int nn = 0; nn < Tile::kNTilesO / 2; ++nn) {
                        u32 b[4];
                        load_b_frag_kn<kStride>(b, sV, sub * Tile::kSubN + kk * 16, col0 + nn * 16, lane);
#pragma unroll
                        for (int t = 0; t < kMTiles; ++t) {
                            Mma::run(acc_o[t][2 * nn], a[t], b[0], b[1]);
                            Mma::run(acc_o[t][2 * nn + 1], a[t], b[2], b[3]);
                        }
                    }
                }
            }
            __syncthreads();  // every warp is done with this stage: refill it with tile n-2 (if in the range)
            if (position - 2 >= n_block_min)
                load_kv<Tile>(sKV, gK, p.k_row_stride, gV, p.v_row_stride, p.seqlen_k, (Variant::kBlockSparse ? key_tiles.tile(position - 2) : position - 2), stage,
                              tid);
            cp_async_commit();
        }
    }

    // Epilogue: normalise, stage O through shared memory for 16-byte stores.
    float inv_sum[2 * kMTiles], lse[2 * kMTiles];
    softmax.template finalize<Mask::kHasSink>(inv_sum, lse, sink_log2<Variant>(p, head));
    if constexpr (Variant::kDropout) {
#pragma unroll
        for (int r = 0; r < 2 * kMTiles; ++r) inv_sum[r] *= pp->dropout_scale;
    }
    __syncthreads();  // every warp is done with sQ (and an empty key range is uniform)
#pragma unroll
    for (int t = 0; t < kMTiles; ++t)
#pragma unroll
        for (int n = 0; n < Tile::kNTilesO; ++n)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = warp_row0 + t * 16 + g + h * 8;
                const float s = inv_sum[2 * t + h];
                *reinterpret_cast<u32*>(sQ + row * kStride + col0 + n * 8 + 2 * t4) =
                    ElemTraits<Tag>::pack2(acc_o[t][n][2 * h] * s, acc_o[t][n][2 * h + 1] * s);
            }
    // Output pointers are formed only now: live across the main loop they would cost registers.
    u16* gO = static_cast<u16*>(p.o) + batch * p.o_batch_stride + head * p.o_head_stride
              + row_base * p.o_row_stride;
    if (p.lse != nullptr && t4 == 0 && (Tile::kColSplit == 1 || warp < Tile::kRowWarps)) {
        float* gLse = p.lse + stat_offset<Variant::kVarlen>(p, batch, head) + row_base;
#pragma unroll
        for (int t = 0; t < kMTiles; ++t)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = warp_row0 + t * 16 + g + h * 8;
                if (row < rows_valid) gLse[row] = lse[2 * t + h];
            }
    }
    __syncthreads();
    store_tile<kBlockM, Tile::kHeadDimV, SmemRows<kStride>, Tile::kThreads>(gO, sQ, p.o_row_stride, rows_valid, tid);
}

// The CTA's query tile: (query tile, head, batch) from the grid.
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV>
__device__ __forceinline__ void fwd_cta(const FwdParams& p, const ProgParams* pp) {
    // Where query tiles see different numbers of keys, the heaviest (the last, for causal) go first.
    const int m_block = MaskPolicy<kBlockM, kBlockN, Variant>::kUnevenWork ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    if constexpr (Variant::kVarlen) {
        const SeqSpan span = seq_span(p, blockIdx.z);
        if (m_block * kBlockM >= span.seqlen_q) return;
        fwd_tile<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, Variant, kHeadDimV>(seq_params<2>(p, span, blockIdx.z), m_block,
                                                                     blockIdx.y, 0, pp, blockIdx.z);
    } else {
        fwd_tile<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, Variant, kHeadDimV>(p, m_block, blockIdx.y, blockIdx.z, pp,
                                                                     blockIdx.z);
    }
}

template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV = 0>
__global__ void __launch_bounds__(kNWarps * 32, 1)
fwd_kernel(const FwdParams p) {
    fwd_cta<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, Variant, kHeadDimV>(p, nullptr);
}

// Programmable attention (Variant: a ProgVariant): the same with its parameters.
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV = 0>
__device__ const int fwd_prog_kernel_smem_bytes = fwd_kernel_smem_bytes<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, Variant, kHeadDimV>;

template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV = 0>
__global__ void __launch_bounds__(kNWarps * 32, 1)
fwd_prog_kernel(const FwdParams p, const ProgParams pp) {
    static_assert(Variant::kProg, "fwd_prog_kernel takes a ProgVariant");
    fwd_cta<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, Variant, kHeadDimV>(p, &pp);
}
