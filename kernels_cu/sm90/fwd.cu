// FlashAttention forward for Hopper (sm_90a): TMA loads, wgmma, warp specialisation.
//
// A CTA works on query tiles of kBlockM = 64 * (consumer warpgroups) rows: one per CTA, or (persistent)
// one after another in the order of PersistentOrder (fwd_scheduler.cuh). Warpgroup 0 is the producer
// (fwd_producer.cuh): it gives up registers and one thread issues the TMA loads of Q and of a kStages-deep
// ring of K and V tiles, each completing on a "full" mbarrier and released by the consumers on an "empty"
// one. Each consumer warpgroup owns 64 query rows and runs, per tile, a key loop (fwd_mainloop.cuh, built
// from the parts in fwd_math.cuh):
//   S = Q K^T  (wgmma; K from 128-byte-swizzled shared memory, Q from there or from registers)
//   the mask policy (common/mask.cuh), then the online softmax in exp2 on the accumulators
//   (common/softmax.cuh: a warpgroup's m64 accumulator gives each warp the m16 row ownership of mma.sync)
//   O += P V   (wgmma, P from registers, V from shared memory as an MN-major B)
// then the epilogue (fwd_epilogue.cuh: O and lse). Key tiles are visited from last to first, so masked tiles
// come first. Two consumer schedules (kMode): simple; overlap (S_i = Q K_i^T and O += P_{i-1} V_{i-1}
// issued back to back, the softmax of tile i after S_i lands, with the kept running max).
// Shared tiles hold 128-byte row blocks (64 fp16 or 128 fp8 columns, TMA's 128-byte swizzle); head dims
// are padded to whole blocks with TMA's zero fill. fp8 (e4m3): both wgmma operands must be K-major, so V
// arrives transposed (V^T, head_dim rows of keys, written by aux/fp8.cu with the keys of every 32-key step
// in the order of the P fragment: see FwdMath::pack_p); S is scaled by the q and k descales, O by the v
// descale, and the output is bf16. docs/design.md describes the design and its invariants.
#include "../common/numeric.cuh"
#include "../common/params.cuh"
#include "../common/mask.cuh"
#include "../common/softmax.cuh"
#include "../common/mma_sync.cuh"
#include "../common/varlen.cuh"
#include "wgmma.cuh"
#include "tma.cuh"
#include "pipeline.cuh"

#include "fwd_tile.cuh"
#include "fwd_scheduler.cuh"
#include "fwd_producer.cuh"
#include "fwd_math.cuh"
#include "fwd_mainloop.cuh"
#include "fwd_epilogue.cuh"
#include "fwd_split.cuh"

// The consumer warpgroups' tile loop (64 query rows each): take a tile (persistent: the index the producer
// published with its Q), run the schedule's key loop over it, store O and lse.
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kMode, bool kPersistent,
          int kCluster, int kQBuffers, int kHeadDimV>
__device__ __forceinline__ void fwd_consumer(const FwdParams& params,
                                             const FwdSmem<Sm90FwdTile<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, kHeadDimV>, kQBuffers>& smem,
                                             volatile int* tile_slot, const PersistentOrder& order, const int cw,
                                             int* tile_counter, Fp8Descale descale, const TmaDesc* tma_o,
                                             const ProgParams* pp) {
    using Tile = Sm90FwdTile<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, kHeadDimV>;
    using Mask = MaskPolicy<kBlockM, kBlockN, Variant>;
    using OutTag = typename ElemTraits<Tag>::OutTag;
    constexpr int kStages = Tile::kStages;
    constexpr int kPad = Tile::kHeadDimPad;
    constexpr int kPadV = Tile::kHeadDimV;
    extern __shared__ char smem_raw[];
    const u32 sQ = smem.q, sK = smem.k, sV = smem.v;
    const int num_tiles = order.num_tiles;
    const int lane = threadIdx.x & 31;
    const int warp = (threadIdx.x >> 5) & 3;
    const int g = lane >> 2, t4 = lane & 3;
    int it = 0, q_count = 0;   // K/V ring iterations and Q tiles consumed so far (the phases)
    int settle_tiles = 1;      // the overlap schedule's kept-max state (below)
    bool kept_failed = false;  // whether a kept step failed in the last query tile
    // Persistent, O through a TMA store: the Q buffer whose store this thread issued and has not yet
    // seen read (-1: none), released to the producer once it has been.
    int o_store_buffer = -1;
    for (int k_tile = 0;; ++k_tile) {
        int m_block, head, batch;
        const PipelineState<kQBuffers> q_ring(q_count);
        const int qb = q_ring.stage();   // this tile's Q buffer
        const u32 q_phase = q_ring.phase();
        CUFLASH_FWD_TRACE(0, clock64());
        CUFLASH_FWD_TRACE(5, sm_id());
        if constexpr (kPersistent) {
            mbar_wait(smem.q_full(qb), q_phase);   // Q and the tile index have landed
            if (o_store_buffer >= 0) {   // the previous tile's O store (kTmaStoreO): read by now, as a rule
                bulk_wait_read();
                mbar_arrive(smem.q_empty(o_store_buffer));
                o_store_buffer = -1;
            }
            CUFLASH_FWD_TRACE(1, clock64());
            // Broadcast from lane 0: ptxas then knows the tile (and so the ring stage and Q buffer of every
            // key tile) is warp-uniform and keeps the wgmma descriptors in uniform registers.
            const int t = __shfl_sync(0xffffffff, tile_slot[qb], 0);
            if (t >= num_tiles) break;
            order.template coords<Mask::kUnevenWork>(t, params.heads_q, m_block, head, batch);
        } else {
            if (k_tile > 0) break;
            order.template grid_coords<Mask::kUnevenWork>(params.heads_q, m_block, head, batch);
        }
        // Varlen: the tile's sequence as a dense problem of batch 1 (common/varlen.cuh).
        FwdParams seq;
        if constexpr (Variant::kVarlen) {
            seq = seq_params<Tile::kElemBytes>(params, seq_span(params, batch), batch);
            batch = 0;
        }
        const FwdParams& p = Variant::kVarlen ? seq : params;
        // The key tiles this query tile visits (the producer loads the same ones in the same order).
        const FwdKeyTiles<Mask, Variant> key_tiles(p, m_block, pp, batch, head);
        const int n_tiles = key_tiles.count();
        const int row0 = m_block * kBlockM + cw * 64 + warp * 16 + g;   // this thread's rows: row0, row0 + 8

        float acc_o[kPadV / 2];
    #pragma unroll
        for (int i = 0; i < kPadV / 2; ++i) acc_o[i] = 0.f;
        // The running max may trail by up to 2^8: most key tiles then leave it, and O, alone.
        constexpr int kMaxSlackLog2 = 8;
        // fp16: a max that moves is set 2^8 above the row's largest score (OnlineSoftmax's headroom), so that
        // the kept max below takes scores up to 2^22 above it before P passes its bound, where a sharp head's
        // later maxima mostly fall. fp16 keeps 11 bits down to 2^-14, so probabilities down to 2^-6 of the
        // largest lose nothing, and smaller ones at most what bf16 P loses; larger headrooms cost accuracy on
        // N(0, 1) inputs. bf16 P needs none (its bound is 2^48), fp8 keeps no max.
        constexpr int kHeadroomLog2 = (kIsBf16<Tag> || Tile::kFp8) ? 0 : 8;
        OnlineSoftmax<1, kBlockN / 8, kMaxSlackLog2, kHeadroomLog2> softmax;
        softmax.init();

        // Q as wgmma A fragments, where the schedule keeps it in registers (FwdMath::kQInRegs).
        u32 qa[FwdMath<Tile, kMode>::kQInRegs ? kPad / 16 : 1][4];
        // fp8: the q and k descales scale S (with a score modifier: before it, FwdMath::apply_mask); the v
        // descale scales O in the epilogue.
        float scale_log2 = p.scale_log2, o_scale = 1.f, s_descale = 1.f;
        if constexpr (Tile::kFp8) {
            if constexpr (Mask::kHasScoreMod) s_descale = *descale.q * *descale.k;
            else scale_log2 *= *descale.q * *descale.k;
            o_scale = *descale.v;
        }
        if constexpr (Variant::kDropout) o_scale = pp->dropout_scale;   // 1 / (1 - dropout_p), with 1 / rowsum

        // A warpgroup whose 64 rows all lie past seqlen_q (the last query tile when seqlen_q is not a
        // multiple of kBlockM, e.g. 1024 rows in 192-row tiles) keeps the ring's phases (waits for each
        // stage, releases it) but runs no GEMM, leaving the tensor cores to the others.
        const bool idle = m_block * kBlockM + cw * 64 >= p.seqlen_q;
        if (idle) {
            for (int i = 0; i < n_tiles; ++i) {
                const PipelineState<kStages> ring(it + i);
                const int stage = ring.stage();
                const u32 parity = ring.phase();
                mbar_wait(smem.k_full(stage), parity);
                FwdMath<Tile, kMode>::template release_kv<kCluster>(lane, smem.k_empty(stage));
                mbar_wait(smem.v_full(stage), parity);
                FwdMath<Tile, kMode>::template release_kv<kCluster>(lane, smem.v_empty(stage));
            }
        }
        if (!kPersistent && n_tiles > 0 && !idle) mbar_wait(smem.q_full(0), 0);
        static_assert(!Variant::kProg || kMode == kModeOverlap, "programmable parts: the overlap schedule");
        if (n_tiles > 0 && !idle && kMode != kModeOverlap) {
            softmax = fwd_mainloop_simple<Tile, Mask, kMode, kCluster, kQBuffers>(
                p, smem, it, key_tiles, scale_log2, acc_o, softmax, qa, qb, cw, lane, warp, t4, m_block, head, batch, row0);
        }
        if (n_tiles > 0 && !idle && kMode == kModeOverlap) {
            softmax = fwd_mainloop_overlap<Tile, Mask, kMode, kCluster, kQBuffers, kPersistent>(
                p, smem, it, key_tiles, scale_log2, s_descale, acc_o, softmax, qa, settle_tiles, kept_failed, qb, cw, lane,
                warp, t4, m_block, head, batch, row0, k_tile, tile_counter, pp);
        }

        constexpr bool kStageO = Tile::template kStageO<kPersistent>;
        // Every QK GEMM of this tile is done (and, staged, so is the epilogue's use of the Q buffer):
        // the producer may load the next Q into it (persistent).
        if (kPersistent && !kStageO) mbar_arrive(smem.q_empty(qb));
        it += n_tiles > 0 ? n_tiles : 0;
        ++q_count;

        // Epilogue: normalise and store O (rows past seqlen_q and padded columns skipped) and lse (with a sink:
        // its logit in each row's denominator; a row that saw no key gets O = 0 and lse = the sink).
        float inv_sum[2], lse[2];
        softmax.template finalize<Mask::kHasSink>(inv_sum, lse, sink_log2<Variant>(p, head));
        inv_sum[0] *= o_scale;
        inv_sum[1] *= o_scale;
        fwd_epilogue<Tile, kQBuffers, kPersistent, Variant::kVarlen>(p, smem, tma_o, acc_o, inv_sum, lse, m_block, head, batch, qb, cw, idle,
                                                   row0, o_store_buffer);
        CUFLASH_FWD_TRACE(4, clock64());
    }
}

// kCluster: 1, or 2 for clusters of two CTAs on adjacent query tiles of one (head, batch), under a policy
// that skips no key tiles (the two tiles then visit the same key tiles), 16-bit, an even number of 64-column blocks (head dims
// 65..128, 193..256). Each CTA loads every other column block of each K and V tile and multicasts it to
// both, which halves the tiles' L2 -> SM traffic; a ring stage is refilled once the consumers of both
// CTAs have freed it. The grid counts query tiles in whole clusters (launch.py: fwd_grid).
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kMode,
          bool kPersistent = false, int kCluster = 1, int kHeadDimV = 0>
__device__ __forceinline__ void fwd_body(const FwdParams& p, const TmaDesc& tma_q, const TmaDesc& tma_k,
                                         const TmaDesc& tma_v, int* tile_counter = nullptr,
                                         Fp8Descale descale = {}, const TmaDesc* tma_o = nullptr,
                                         const ProgParams* pp = nullptr) {
    using Tile = Sm90FwdTile<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, kHeadDimV>;
    constexpr int kStages = Tile::kStages;
    constexpr int kPad = Tile::kHeadDimPad;
    constexpr int kPadV = Tile::kHeadDimV;
    using Mask = MaskPolicy<kBlockM, kBlockN, Variant>;
    // The CTAs of a cluster load each K / V tile together, so their query tiles must visit the same key tiles.
    static_assert(kCluster == 1 || (!Mask::kSkipsTiles && !Tile::kFp8 && Tile::kColBlocks % kCluster == 0),
                  "clusters: a policy that skips no key tiles, 16-bit, whole column blocks per CTA");
    static_assert(Tile::kSplitV == (kMode == kModeSplit) && (!Tile::kSplitV || (!kPersistent && kCluster == 1)),
                  "split V: the split schedule's tiles (64 rows, two consumer warpgroups), one CTA per tile");
    // setmaxnreg only moves registers inside the CTA's launch allocation (168 per thread at 384
    // threads, 128 at 512): producer + consumers must stay within it or setmaxnreg.inc waits
    // forever. The persistent producer (tile loop) needs more than 24: 40 + 2 * 232 = 3 * 168.
    constexpr int kProducerRegs = !kPersistent ? Tile::kProducerRegs : (Tile::kConsumerWGs == 2 ? 40 : 32);
    constexpr int kConsumerRegs = !kPersistent ? Tile::kConsumerRegs : (Tile::kConsumerWGs == 2 ? 232 : 160);
    static_assert(kProducerRegs + Tile::kConsumerWGs * kConsumerRegs <= (Tile::kConsumerWGs == 2 ? 504 : 512),
                  "setmaxnreg budget");

    constexpr int kQBuffers = kPersistent ? Tile::kQBuffersPersistent : 1;

    extern __shared__ char smem_raw[];
    const FwdSmem<Tile, kQBuffers> smem(smem_raw);
    const u32 bars = smem.bars;
    // Persistent: the tile the producer hands to the consumers with each Q (>= num_tiles: done), per buffer.
    volatile int* tile_slot =
        reinterpret_cast<volatile int*>(smem_raw + (bars + 8 * (2 * kQBuffers + 4 * kStages) - smem_u32(smem_raw)));

    const PersistentOrder order(p, kBlockM, (kPad + kPadV) * Tile::kElemBytes, kCluster);
    // Broadcast from lane 0 so that ptxas knows the warpgroup index is warp-uniform: shared-memory
    // addresses and wgmma descriptors built from it then stay in uniform registers (no R2UR per wgmma).
    const int wg = __shfl_sync(0xffffffff, static_cast<int>(threadIdx.x) / 128, 0);

    if (threadIdx.x == 0) {
#pragma unroll
        for (int b = 0; b < kQBuffers; ++b) {
            mbar_init(smem.q_full(b), 1);
            mbar_init(smem.q_empty(b), Tile::kConsumerWGs * 128);
        }
#pragma unroll
        for (int s = 0; s < kStages; ++s) {
            mbar_init(smem.k_full(s), 1);
            mbar_init(smem.v_full(s), 1);
            // Clusters: one arrival per consumer warp of each CTA (release_kv); else every consumer thread.
            // Split V: warpgroup 0 alone reads K.
            mbar_init(smem.k_empty(s), kCluster > 1 ? kCluster * Tile::kConsumerWGs * 4
                                                    : (Tile::kSplitV ? 1 : Tile::kConsumerWGs) * 128);
            mbar_init(smem.v_empty(s), kCluster > 1 ? kCluster * Tile::kConsumerWGs * 4 : Tile::kConsumerWGs * 128);
        }
        fence_barrier_init();
    }
    if constexpr (kCluster > 1) {
        if (cluster_nctarank() != kCluster) __trap();   // launched without its cluster: would hang
        cluster_sync();
    } else {
        __syncthreads();
    }

    if (wg == 0) {
        // Producer warpgroup.
        setmaxnreg_dec<kProducerRegs>();
        if (threadIdx.x == 0) {
            fwd_producer<Tile, Mask, kQBuffers, kMode, kPersistent, kCluster>(p, tma_q, tma_k, tma_v, tile_counter, smem,
                                                                              tile_slot, order, pp);
        }
    } else {
        // Consumer warpgroups: 64 query rows each.
        setmaxnreg_inc<kConsumerRegs>();
        if constexpr (Tile::kSplitV) {
            fwd_split_consumer<Tile, Variant>(p, smem, order, wg - 1);
        } else {
            fwd_consumer<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, Variant, kMode, kPersistent, kCluster, kQBuffers,
                         kHeadDimV>(p, smem, tile_slot, order, wg - 1, tile_counter, descale, tma_o, pp);
        }
    }
    if constexpr (kCluster > 1) cluster_sync();   // the other CTA may still signal this one's barriers
}

// Entry points: the overlap schedule (the softmax of one key tile overlapping the P V product of the
// previous one) one CTA per tile, and persistent kernels of both schedules (gridDim.x = min(tiles, SMs)),
// the simple one persistent only (the tuned table takes nothing else): each CTA loops over tiles
// in PersistentOrder, the producer loading the next tile's K/V and Q while the consumers finish the
// current one; tile_counter: two ints, zero at launch (the last CTA to run out of tiles resets them).
// 64-row tiles (8 warps: one consumer warpgroup) are built for two CTAs per SM (128 registers a thread
// at launch; setmaxnreg moves them from the producer to the consumer).
// Cluster variants (kCluster = 2, the overlap schedule): `attrs` carries their __cluster_dims__.
// Each entry point's dynamic shared memory, <name>_smem_bytes<same template arguments> (the dispatcher reads
// it from the compiled module): kQBuffers Q tiles, the K and V rings, the mbarriers and tile slots, and 1024
// bytes of slack for the base's alignment.
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, bool kPersistent, int kHeadDimV = 0>
__host__ __device__ constexpr int fwd_smem_bytes() {
    using Tile = Sm90FwdTile<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, kHeadDimV>;
    constexpr int kQBuffers = kPersistent ? Tile::kQBuffersPersistent : 1;
    return 1024 + kQBuffers * Tile::kQBytes + Tile::kStages * (Tile::kKSlotBytes + Tile::kVSlotBytes)
           + Tile::kExtraBytes + 8 * (2 * kQBuffers + 1 + 4 * Tile::kStages);
}
#define CUFLASH_SM90_FWD_SMEM(name, persistent)                                                                 \
    template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV = 0> \
    __device__ const int name##_smem_bytes =                                                                    \
        fwd_smem_bytes<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, persistent, kHeadDimV>();
#define CUFLASH_SM90_FWD_KERNEL(name, mode, cluster, attrs)                                                     \
    CUFLASH_SM90_FWD_SMEM(name, false)                                                                          \
    template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV = 0> \
    __global__ void __launch_bounds__(kNWarps * 32, kNWarps == 8 ? 2 : 1) attrs                                 \
    name(const FwdParams p, const __grid_constant__ TmaDesc tma_q, const __grid_constant__ TmaDesc tma_k,       \
         const __grid_constant__ TmaDesc tma_v) {                                                               \
        fwd_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, Variant, mode, false, cluster, kHeadDimV>(           \
            p, tma_q, tma_k, tma_v);                                                                            \
    }
#define CUFLASH_SM90_FWD_PERSISTENT_KERNEL(name, mode, cluster, attrs)                                          \
    CUFLASH_SM90_FWD_SMEM(name, true)                                                                           \
    template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV = 0> \
    __global__ void __launch_bounds__(kNWarps * 32, 1) attrs                                                    \
    name(const FwdParams p, const __grid_constant__ TmaDesc tma_q, const __grid_constant__ TmaDesc tma_k,       \
         const __grid_constant__ TmaDesc tma_v, const __grid_constant__ TmaDesc tma_o, int* tile_counter) {     \
        fwd_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, Variant, mode, true, cluster, kHeadDimV>(            \
            p, tma_q, tma_k, tma_v, tile_counter, {}, &tma_o);                                                  \
    }
CUFLASH_SM90_FWD_KERNEL(fwd_overlap_kernel, kModeOverlap, 1, )
CUFLASH_SM90_FWD_KERNEL(fwd_split_kernel, kModeSplit, 1, )
CUFLASH_SM90_FWD_KERNEL(fwd_overlap_x2_kernel, kModeOverlap, 2, __cluster_dims__(2, 1, 1))
CUFLASH_SM90_FWD_PERSISTENT_KERNEL(fwd_persistent_kernel, kModeSimple, 1, )
CUFLASH_SM90_FWD_PERSISTENT_KERNEL(fwd_overlap_persistent_kernel, kModeOverlap, 1, )
CUFLASH_SM90_FWD_PERSISTENT_KERNEL(fwd_overlap_x2_persistent_kernel, kModeOverlap, 2, __cluster_dims__(2, 1, 1))
#undef CUFLASH_SM90_FWD_KERNEL
#undef CUFLASH_SM90_FWD_PERSISTENT_KERNEL

// Programmable attention (Variant: a ProgVariant; issue #45): the overlap schedule, one CTA per tile, with
// ProgParams after the tensor maps (__grid_constant__: read in place through the pointer the parts take).
CUFLASH_SM90_FWD_SMEM(fwd_prog_overlap_kernel, false)
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV = 0>
__global__ void __launch_bounds__(kNWarps * 32, 1)
fwd_prog_overlap_kernel(const FwdParams p, const __grid_constant__ TmaDesc tma_q, const __grid_constant__ TmaDesc tma_k,
                        const __grid_constant__ TmaDesc tma_v, const __grid_constant__ ProgParams pp) {
    static_assert(Variant::kProg && !Variant::kVarlen, "fwd_prog_overlap_kernel takes a dense ProgVariant");
    fwd_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, Variant, kModeOverlap, false, 1, kHeadDimV>(
        p, tma_q, tma_k, tma_v, nullptr, {}, nullptr, &pp);
}

CUFLASH_SM90_FWD_SMEM(fwd_fp8_kernel, false)
CUFLASH_SM90_FWD_SMEM(fwd_fp8_persistent_kernel, true)
#undef CUFLASH_SM90_FWD_SMEM

// fp8 (Tag = e4m3_tag) with the overlap schedule: tma_vt maps V^T (cuflash/fp8.py); descale_q, _k, _v
// point to the float32 per-tensor scales. One CTA per tile, or persistent.
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant>
__global__ void __launch_bounds__(kNWarps * 32, 1)
fwd_fp8_kernel(const FwdParams p, const __grid_constant__ TmaDesc tma_q, const __grid_constant__ TmaDesc tma_k,
               const __grid_constant__ TmaDesc tma_vt, const float* descale_q, const float* descale_k,
               const float* descale_v) {
    fwd_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, Variant, kModeOverlap>(
        p, tma_q, tma_k, tma_vt, nullptr, Fp8Descale{descale_q, descale_k, descale_v});
}
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant>
__global__ void __launch_bounds__(kNWarps * 32, 1)
fwd_fp8_persistent_kernel(const FwdParams p, const __grid_constant__ TmaDesc tma_q,
                          const __grid_constant__ TmaDesc tma_k, const __grid_constant__ TmaDesc tma_vt,
                          int* tile_counter, const float* descale_q, const float* descale_k,
                          const float* descale_v) {
    fwd_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, Variant, kModeOverlap, true>(
        p, tma_q, tma_k, tma_vt, tile_counter, Fp8Descale{descale_q, descale_k, descale_v});
}
