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
// just consumed. A key tile visits only the query tiles the mask policy gives it ([m_block_min,
// m_block_max): causal, windows, chunks); odd lengths and head dims come from TMA's zero fill plus masking
// (P = 0 outside). The kernels take a MaskVariant (common/mask.cuh): the policy is
// MaskPolicy<kBlockM, kBlockN, Variant>; a score modifier is applied before the mask and its derivative
// multiplies dS; sinks need no code here (lse includes them). Varlen (MaskVariant::kVarlen): the CTA runs its
// key tile of its sequence as a dense problem of batch 1 (common/varlen.cuh); the tensor maps span the packed
// rows, and the stats rows and dQ tiles of each sequence start at its padded row (padded_row0).
#include "../common/varlen.cuh"
#include "bwd_tile.cuh"
#include "bwd_scheduler.cuh"
#include "bwd_producer.cuh"
#include "bwd_dq_writer.cuh"
#include "bwd_mainloop.cuh"
#include "bwd_epilogue.cuh"

// Varlen: the CTA's sequence as a dense problem of batch 1 (seq_params, batch 0 from there on), in shared memory
// after the tile's (every thread reads its fields there as it needs them: held in registers across setmaxnreg,
// they spilled the producer warpgroup's 24 registers), with the padded stats rows and dQ tiles folded into the
// pointers, and where its packed rows start (the tensor maps' coordinates). Dense: rows 0 (BwdDenseRows).
template <class Tile>
struct BwdSeqShared {
    BwdParams params;
    int q_row0, k_row0;
    // One thread, before a __syncthreads.
    __device__ __forceinline__ void bind(const BwdParams& p, int batch) {
        const SeqSpan span = seq_span(p, batch);
        params = seq_params<2>(p, span, batch);
        const int tile0 = padded_row0(span.q_start, batch, Tile::kBlockM) / Tile::kBlockM;
        params.stats = p.stats + tile0 * Tile::kBlockM;
        params.dq_accum = p.dq_accum + static_cast<i64>(tile0) * (Tile::kBlockM * Tile::kHeadDimPad);
        params.dq_semaphore = p.dq_semaphore + tile0 * Tile::kConsumerWGs;
        q_row0 = span.q_start;
        k_row0 = span.k_start;
    }
};
// Registers per thread after setmaxnreg. Varlen, ordered dQ, 128-row query tiles, no window: 8 more for the
// producer warpgroup (the ordered dQ writers' reads of the sequence's fields in shared memory spilled at 24),
// taken from the consumers (elsewhere they need them: 64-row tiles, windows, ALiBi spill at 232).
template <class Tile, class Mask>
struct BwdRegs {
    static constexpr int kShift =
        Mask::kVarlen && Tile::kDqMode == kDqTileOrdered && Tile::kBlockM == 128 && !Mask::kLocal ? 8 : 0;
    static constexpr int kProducer = Tile::kProducerRegs + kShift;
    static constexpr int kConsumer = Tile::kConsumerRegs - (Tile::kConsumerWGs == 2 ? kShift : 0);
    static_assert(kProducer + Tile::kConsumerWGs * kConsumer <= (Tile::kConsumerWGs == 2 ? 504 : 512),
                  "setmaxnreg budget");
};
struct BwdDenseRows {
    static constexpr int q_row0 = 0, k_row0 = 0;
};
template <class Tile, class Variant>
__host__ __device__ constexpr int bwd_seq_smem_bytes() {
    return Variant::kVarlen ? (static_cast<int>(sizeof(BwdSeqShared<Tile>)) + 15) / 16 * 16 : 0;
}

// A consumer warpgroup: the mainloop over the CTA's steps, then the epilogue.
template <typename Tag, class Tile, class Mask, class Steps>
__device__ __forceinline__ void bwd_consumer(const BwdParams& p, const BwdSmem<Tile>& smem, int n_block, int n0,
                                             int head_kv, int batch, int wg, const ProgParams* pp) {
    setmaxnreg_inc<BwdRegs<Tile, Mask>::kConsumer>();
    // The steps again (not the CTA's), from an opaque copy of seqlen_q so that ptxas cannot hoist them
    // above setmaxnreg: a value live across setmaxnreg may go to local memory (128-row tiles). (Batch and
    // head 0: the steps ask no score question; the mainloop builds the modifier's policy per step.)
    int seqlen_q_opaque = p.seqlen_q;
    asm volatile("" : "+r"(seqlen_q_opaque));
    const Steps steps(n_block, Mask(p, seqlen_q_opaque, 0, 0), p.seqlen_k, p.heads_per_kv);
    const BwdConsumerThread<Tile> thr(wg);
    const BwdMainloop<Tag, Tile, Mask> mainloop(p, smem, thr, n_block, n0, pp);
    mainloop.template run<BwdEpilogue<Tag, Tile>>(steps, head_kv, batch);
}

template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kDqMode>
__device__ __forceinline__ void bwd_body(const BwdParams& params, const TmaDesc& tma_q, const TmaDesc& tma_k,
                                         const TmaDesc& tma_v, const TmaDesc& tma_do, const ProgParams* pp = nullptr) {
    using Mask = MaskPolicy<kBlockM, kBlockN, Variant>;
    using Tile = Sm90BwdTile<kHeadDim, kBlockM, kBlockN, kNWarps, kDqMode>;
    using Scheduler = BwdTileScheduler<kBlockM, kBlockN, kHeadDim, Mask, kDqMode>;
    using Steps = BwdSteps<kBlockM, kBlockN, Mask, Scheduler::kRotate>;
    using DqWriter = BwdDqWriter<Tile, Mask>;

    extern __shared__ char smem_raw[];
    const BwdSmem<Tile> smem(smem_raw);
    if (threadIdx.x == 0) CUFLASH_BWD_TRACE(15, clock64());   // kernel entry
    const BwdBlock blk = Scheduler::block(params);
    constexpr bool kVarlen = Variant::kVarlen;
    auto& seq = *reinterpret_cast<BwdSeqShared<Tile>*>(smem.generic(smem.k + Tile::kSmemBytes));   // varlen only
    if constexpr (kVarlen) {
        if (kDqMode == kDqTileOrdered && offsets_flagged(params)) return;   // varlen.cuh: flag_decreasing_offsets
        if (threadIdx.x == 0) seq.bind(params, blk.batch);
        __syncthreads();
        if (blk.n_block * kBlockN >= seq.params.seqlen_k) return;   // past the sequence's keys (the whole CTA)
    }
    const BwdParams& p = kVarlen ? seq.params : params;
    const int batch = kVarlen ? 0 : blk.batch;
    const int n0 = blk.n_block * kBlockN;
    const Steps steps(blk.n_block, Mask(p), p.seqlen_k, p.heads_per_kv);
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
        setmaxnreg_dec<BwdRegs<Tile, Mask>::kProducer>();
        const int warp = threadIdx.x / 32;
        if (warp == 0 && threadIdx.x == 0 && steps.n_iter > 0) {
            if constexpr (kVarlen) {
                BwdProducer<Tile>::run(p, smem, steps, tma_q, tma_k, tma_v, tma_do, n0, blk.head_kv, batch, head0, seq);
            } else {
                BwdProducer<Tile>::run(p, smem, steps, tma_q, tma_k, tma_v, tma_do, n0, blk.head_kv, batch, head0,
                                       BwdDenseRows{});
            }
        } else if (DqWriter::kWarps > 0 && warp >= 2 && warp < 2 + DqWriter::kWarps && (threadIdx.x & 31) == 0
                   && steps.n_iter > 0) {
            // (kWarps > 0 always holds: the term is kept because the front end's code for this condition,
            // and with it the kernel's SASS, differs without it.)
            DqWriter::run(p, smem, steps, blk.n_block, batch, head0, warp - 2);
        }
    } else {
        bwd_consumer<Tag, Tile, Mask, Steps>(p, smem, blk.n_block, n0, blk.head_kv, batch, wg, pp);
    }
}

// The entry points (cuflash/config.py names them; their template parameters are the launch's).
#define CUFLASH_SM90_BWD_KERNEL(name, mode)                                                                  \
    template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant>                \
    __global__ void __launch_bounds__(kNWarps * 32,                                                            \
                                      (Sm90BwdTile<kHeadDim, kBlockM, kBlockN, kNWarps, mode>::kCtasPerSm))    \
    name(const BwdParams p, const __grid_constant__ TmaDesc tma_q, const __grid_constant__ TmaDesc tma_k,      \
         const __grid_constant__ TmaDesc tma_v, const __grid_constant__ TmaDesc tma_do) {                      \
        bwd_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, Variant, mode>(p, tma_q, tma_k, tma_v, tma_do);     \
    }
CUFLASH_SM90_BWD_KERNEL(bwd_dkdv_dqtile_kernel, kDqTile)
CUFLASH_SM90_BWD_KERNEL(bwd_dkdv_dqtile_ordered_kernel, kDqTileOrdered)
#undef CUFLASH_SM90_BWD_KERNEL

// Each entry point's dynamic shared memory, <name>_smem_bytes<same template arguments> (the dispatcher reads
// it from the compiled module): Sm90BwdTile::kSmemBytes after the base, and 1024 bytes of slack for the
// base's alignment.
// Programmable attention (Variant: a dense ProgVariant; issue #45): dK / dV with dQ in tiles as
// bwd_dkdv_dqtile_kernel, dbias and the modifiers' tensor gradients, with ProgParams after the tensor maps.
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant>
__global__ void __launch_bounds__(kNWarps * 32, (Sm90BwdTile<kHeadDim, kBlockM, kBlockN, kNWarps, kDqTile>::kCtasPerSm))
bwd_dkdv_dqtile_prog_kernel(const BwdParams p, const __grid_constant__ TmaDesc tma_q,
                            const __grid_constant__ TmaDesc tma_k, const __grid_constant__ TmaDesc tma_v,
                            const __grid_constant__ TmaDesc tma_do, const __grid_constant__ ProgParams pp) {
    static_assert(Variant::kProg && !Variant::kVarlen, "bwd_dkdv_dqtile_prog_kernel takes a dense ProgVariant");
    bwd_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, Variant, kDqTile>(p, tma_q, tma_k, tma_v, tma_do, &pp);
}

#define CUFLASH_SM90_BWD_SMEM(name, mode)                                                                    \
    template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant>                \
    __device__ const int name##_smem_bytes =                                                                   \
        1024 + Sm90BwdTile<kHeadDim, kBlockM, kBlockN, kNWarps, mode>::kSmemBytes                              \
        + bwd_seq_smem_bytes<Sm90BwdTile<kHeadDim, kBlockM, kBlockN, kNWarps, mode>, Variant>();
CUFLASH_SM90_BWD_SMEM(bwd_dkdv_dqtile_kernel, kDqTile)
CUFLASH_SM90_BWD_SMEM(bwd_dkdv_dqtile_ordered_kernel, kDqTileOrdered)
CUFLASH_SM90_BWD_SMEM(bwd_dkdv_dqtile_prog_kernel, kDqTile)
#undef CUFLASH_SM90_BWD_SMEM
