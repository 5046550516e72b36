// FlashAttention forward for Hopper (sm_90a): TMA loads, wgmma, warp specialisation.
//
// A CTA computes query tiles of kBlockM = 64 * (consumer warpgroups) rows. Warpgroup 0 is the producer
// (fwd_producer.cuh): it gives up registers and one thread issues every TMA load, Q and a kStages-deep ring
// of K and V tiles, each completing on a "full" mbarrier and released by the consumers on an "empty" one.
// Each consumer warpgroup owns 64 query rows and runs the mainloop (fwd_mainloop.cuh: Q K^T, the online
// softmax, P V, in one of two schedules) and the epilogue (fwd_epilogue.cuh: O and lse). The tile scheduler
// (fwd_scheduler.cuh) says which tiles a CTA takes: one CTA per tile, or persistent CTAs looping over tiles
// in an L2-friendly order, optionally in clusters of two that share K / V loads by TMA multicast. Key tiles
// are visited from last to first, so masked tiles come first; which ones, and which elements are masked,
// the mask policy says (common/mask.cuh). Shared tiles hold 128-byte row blocks (64 fp16 or 128 fp8
// columns, TMA's 128-byte swizzle); head dims are padded to whole blocks with TMA's zero fill.
// fp8 (e4m3): both wgmma operands must be K-major, so V arrives transposed (V^T, head_dim rows of keys,
// written by aux/fp8.cu with the keys of every 32-key step in the order of the P fragment: see pack_p);
// S is scaled by the q and k descales, O by the v descale, and the output is bf16.
// docs/design.md describes the design and its invariants.
#include "../common/numeric.cuh"
#include "../common/params.cuh"
#include "../common/mask.cuh"
#include "wgmma.cuh"
#include "tma.cuh"
#include "pipeline.cuh"
#include "fwd_tile.cuh"
#include "fwd_scheduler.cuh"
#include "fwd_producer.cuh"
#include "fwd_mainloop.cuh"
#include "fwd_epilogue.cuh"

// The consumer warpgroups' tile loop: take a tile (persistent: the index the producer published with its Q),
// run the mainloop over its key tiles, store O and lse.
template <class Tile, int kQBuffers, class Scheduler, class Mask, FwdSchedule kSchedule, bool kPersistent,
          int kCluster>
__device__ __forceinline__ void fwd_consumer(const FwdParams& p, const FwdSharedStorage<Tile, kQBuffers>& smem,
                                             const Scheduler& sched, int cw, int* tile_counter,
                                             Fp8Descale descale, const TmaDesc* tma_o) {
    KeptMaxState kept;
    int it = 0, q_count = 0;   // K/V ring iterations and Q tiles consumed so far (the phases)
    FwdEpilogue<Tile, kQBuffers, kPersistent> epilogue{p, smem, tma_o, cw};
    for (int k_tile = 0;; ++k_tile) {
        const PipelineState<kQBuffers> q_ring(q_count);
        const int qb = q_ring.stage();
        const FwdTrace trace{tile_counter, cw, k_tile, kPersistent && (threadIdx.x & 127) == 0};
        CUFLASH_FWD_TRACE(trace, 0, clock64());
        CUFLASH_FWD_TRACE(trace, 5, sm_id());
        TileCoord c;
        if constexpr (kPersistent) {
            mbar_wait(smem.q_full(qb), q_ring.phase());   // Q and the tile index have landed
            epilogue.release_previous_store(qb);
            CUFLASH_FWD_TRACE(trace, 1, clock64());
            // Broadcast from lane 0: ptxas then knows the tile (and so the ring stage and Q buffer of every
            // key tile) is warp-uniform and keeps the wgmma descriptors in uniform registers.
            const int t = __shfl_sync(0xffffffff, smem.tile_slot()[qb], 0);
            if (t >= sched.num_tiles) break;
            c = sched.coords(t, p.heads_q);
        } else {
            if (k_tile > 0) break;
            c = sched.grid_coords(p.heads_q);
        }
        const int n_block_max = Mask(p).n_block_max(c.m_block);
        FwdMainloop<Tile, kQBuffers, Mask, kSchedule, kCluster> mainloop(smem, p, kept, cw, qb, c.m_block);
        // fp8: the q and k descales scale S; the v descale scales O in the epilogue.
        float scale_log2 = p.scale_log2, o_scale = 1.f;
        if constexpr (Tile::kFp8) {
            scale_log2 *= *descale.q * *descale.k;
            o_scale = *descale.v;
        }
        // A warpgroup whose rows all lie past seqlen_q runs no GEMM, leaving the tensor cores to the others.
        const bool idle = c.m_block * Tile::kBlockM + cw * 64 >= p.seqlen_q;
        const PipelineState<Tile::kStages> ring(it);
        if (idle) mainloop.skip(ring, n_block_max);
        if (!kPersistent && n_block_max > 0 && !idle) mbar_wait(smem.q_full(0), 0);
        if (n_block_max > 0 && !idle) {
            if constexpr (kSchedule == FwdSchedule::kOverlap) mainloop.run_overlap(ring, n_block_max, scale_log2, trace);
            else mainloop.run_simple(ring, n_block_max, scale_log2);
        }
        epilogue.q_buffer_read(qb);
        it += n_block_max > 0 ? n_block_max : 0;
        ++q_count;
        epilogue.store(mainloop.acc_o, mainloop.softmax, c, qb, idle, o_scale, mainloop.row0);
        CUFLASH_FWD_TRACE(trace, 4, clock64());
    }
}

// The kernel: shared memory, barriers, the register split, then the producer or the consumer loop.
// kCluster: 1, or 2 for clusters of two CTAs on adjacent query tiles of one (head, batch), not causal (the
// two tiles then visit the same key tiles), 16-bit, an even number of 64-column blocks (head dims 65..128,
// 193..256): each CTA loads every other column block of each K and V tile and multicasts it to both, which
// halves the tiles' L2 -> SM traffic; a ring stage is refilled once the consumers of both CTAs freed it.
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, bool kIsCausal, FwdSchedule kSchedule,
          bool kPersistent = false, int kCluster = 1>
__device__ __forceinline__ void fwd_body(const FwdParams& p, const TmaDesc& tma_q, const TmaDesc& tma_k,
                                         const TmaDesc& tma_v, int* tile_counter = nullptr,
                                         Fp8Descale descale = {}, const TmaDesc* tma_o = nullptr) {
    using Tile = Sm90FwdTile<Tag, kHeadDim, kBlockM, kBlockN, kNWarps>;
    using Regs = FwdRegisterSplit<Tile, kPersistent>;
    using Scheduler = FwdTileScheduler<kBlockM, kIsCausal, kPersistent, kCluster>;
    using Mask = CausalMask<kBlockM, kBlockN, kIsCausal>;
    constexpr int kQBuffers = kPersistent ? Tile::kQBuffersPersistent : 1;
    static_assert(kCluster == 1 || (!kIsCausal && !Tile::kFp8 && Tile::kColBlocks % kCluster == 0),
                  "clusters: not causal, 16-bit, whole column blocks per CTA");

    extern __shared__ char smem_raw[];
    const FwdSharedStorage<Tile, kQBuffers> smem(smem_raw);
    const Scheduler sched(p, (Tile::kHeadDimPad + Tile::kHeadDimV) * Tile::kElemBytes);
    // Broadcast from lane 0 so that ptxas knows the warpgroup index is warp-uniform: shared-memory
    // addresses and wgmma descriptors built from it then stay in uniform registers (no R2UR per wgmma).
    const int wg = __shfl_sync(0xffffffff, static_cast<int>(threadIdx.x) / 128, 0);
    if (threadIdx.x == 0) smem.template init_barriers<Tile::kConsumerWGs, kCluster>();
    if constexpr (kCluster > 1) {
        if (cluster_nctarank() != kCluster) __trap();   // launched without its cluster: would hang
        cluster_sync();
    } else {
        __syncthreads();
    }

    if (wg == 0) {
        setmaxnreg_dec<Regs::kProducer>();
        if (threadIdx.x == 0) {
            FwdProducer<Tile, kQBuffers, Scheduler, Mask, kSchedule, kPersistent, kCluster> producer{
                p, tma_q, tma_k, tma_v, smem, sched, tile_counter,
                kCluster > 1 ? static_cast<int>(cluster_ctarank()) : 0};
            producer.run();
        }
    } else {
        setmaxnreg_inc<Regs::kConsumer>();
        fwd_consumer<Tile, kQBuffers, Scheduler, Mask, kSchedule, kPersistent, kCluster>(
            p, smem, sched, wg - 1, tile_counter, descale, tma_o);
    }
    if constexpr (kCluster > 1) cluster_sync();   // the other CTA may still signal this one's barriers
}

// Entry points. One CTA per tile (`_kernel`) or persistent (`_persistent_kernel`: gridDim.x = min(tiles,
// SMs), tile_counter two ints zero at launch); the simple schedule is built persistent only. 64-row tiles
// (8 warps) are built for two CTAs per SM. `attrs` carries the cluster variants' __cluster_dims__.
// Each entry point's dynamic shared memory, as <name>_smem_bytes<same template arguments>: the dispatcher reads
// it from the compiled module.
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, bool kPersistent>
__host__ __device__ constexpr int fwd_smem_bytes() {
    using Tile = Sm90FwdTile<Tag, kHeadDim, kBlockM, kBlockN, kNWarps>;
    return FwdSharedStorage<Tile, kPersistent ? Tile::kQBuffersPersistent : 1>::kBytes;
}
#define CUFLASH_SM90_FWD_SMEM(name, persistent)                                                                \
    template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, bool kIsCausal>                \
    __device__ const int name##_smem_bytes = fwd_smem_bytes<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, persistent>();
#define CUFLASH_SM90_FWD_KERNEL(name, schedule, cluster, attrs)                                                \
    CUFLASH_SM90_FWD_SMEM(name, false)                                                                         \
    template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, bool kIsCausal>                \
    __global__ void __launch_bounds__(kNWarps * 32, kNWarps == 8 ? 2 : 1) attrs                                 \
    name(const FwdParams p, const __grid_constant__ TmaDesc tma_q, const __grid_constant__ TmaDesc tma_k,       \
         const __grid_constant__ TmaDesc tma_v) {                                                               \
        fwd_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, kIsCausal, schedule, false, cluster>(p, tma_q, tma_k, \
                                                                                                tma_v);         \
    }
#define CUFLASH_SM90_FWD_PERSISTENT_KERNEL(name, schedule, cluster, attrs)                                     \
    CUFLASH_SM90_FWD_SMEM(name, true)                                                                          \
    template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, bool kIsCausal>                \
    __global__ void __launch_bounds__(kNWarps * 32, 1) attrs                                                    \
    name(const FwdParams p, const __grid_constant__ TmaDesc tma_q, const __grid_constant__ TmaDesc tma_k,       \
         const __grid_constant__ TmaDesc tma_v, const __grid_constant__ TmaDesc tma_o, int* tile_counter) {     \
        fwd_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, kIsCausal, schedule, true, cluster>(                 \
            p, tma_q, tma_k, tma_v, tile_counter, {}, &tma_o);                                                  \
    }
CUFLASH_SM90_FWD_KERNEL(fwd_overlap_kernel, FwdSchedule::kOverlap, 1, )
CUFLASH_SM90_FWD_KERNEL(fwd_overlap_x2_kernel, FwdSchedule::kOverlap, 2, __cluster_dims__(2, 1, 1))
CUFLASH_SM90_FWD_PERSISTENT_KERNEL(fwd_persistent_kernel, FwdSchedule::kSimple, 1, )
CUFLASH_SM90_FWD_PERSISTENT_KERNEL(fwd_overlap_persistent_kernel, FwdSchedule::kOverlap, 1, )
CUFLASH_SM90_FWD_PERSISTENT_KERNEL(fwd_overlap_x2_persistent_kernel, FwdSchedule::kOverlap, 2, __cluster_dims__(2, 1, 1))
#undef CUFLASH_SM90_FWD_KERNEL
#undef CUFLASH_SM90_FWD_PERSISTENT_KERNEL

// fp8 (Tag = e4m3_tag) with the overlap schedule: tma_vt maps V^T (cuflash/fp8.py); descale_q, _k, _v
// point to the float32 per-tensor scales. One CTA per tile, or persistent.
CUFLASH_SM90_FWD_SMEM(fwd_fp8_kernel, false)
CUFLASH_SM90_FWD_SMEM(fwd_fp8_persistent_kernel, true)
#undef CUFLASH_SM90_FWD_SMEM
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, bool kIsCausal>
__global__ void __launch_bounds__(kNWarps * 32, 1)
fwd_fp8_kernel(const FwdParams p, const __grid_constant__ TmaDesc tma_q, const __grid_constant__ TmaDesc tma_k,
               const __grid_constant__ TmaDesc tma_vt, const float* descale_q, const float* descale_k,
               const float* descale_v) {
    fwd_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, kIsCausal, FwdSchedule::kOverlap>(
        p, tma_q, tma_k, tma_vt, nullptr, Fp8Descale{descale_q, descale_k, descale_v});
}
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, bool kIsCausal>
__global__ void __launch_bounds__(kNWarps * 32, 1)
fwd_fp8_persistent_kernel(const FwdParams p, const __grid_constant__ TmaDesc tma_q,
                          const __grid_constant__ TmaDesc tma_k, const __grid_constant__ TmaDesc tma_vt,
                          int* tile_counter, const float* descale_q, const float* descale_k,
                          const float* descale_v) {
    fwd_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, kIsCausal, FwdSchedule::kOverlap, true>(
        p, tma_q, tma_k, tma_vt, tile_counter, Fp8Descale{descale_q, descale_k, descale_v});
}
