// FlashAttention forward for Hopper (sm_90a): TMA loads, wgmma, warp specialisation.
//
// One CTA per (query tile, head, batch), kBlockM = 64 * (consumer warpgroups).
// Warpgroup 0 is the producer: it lowers its registers and one thread issues
// the TMA loads of Q and of a kStages-deep ring of K and V tiles, each tile
// completing on a "full" mbarrier and released by the consumers on an
// "empty" one. Each consumer warpgroup owns 64 query rows:
//   S = Q K^T  (wgmma, both operands from 128-byte-swizzled shared memory)
//   online softmax in exp2 on the accumulators (common/softmax.cuh: a
//   warpgroup's m64 accumulator gives each warp the m16 row ownership of mma.sync)
//   O += P V   (wgmma, P from registers, V from shared memory as an MN-major B)
// Key tiles are visited from last to first, so masked tiles come first.
// Two consumer schedules share this body (kMode): simple; overlap (S_i = Q K_i^T
// and O += P_{i-1} V_{i-1} issued back to back, the softmax of tile i after S_i
// lands). docs/design.md describes the design and its invariants.
// Shared tiles hold 128-byte row blocks (64 fp16 or 128 fp8 columns, TMA's
// 128-byte swizzle); head dims are padded to whole blocks with TMA's zero fill.
// fp8 (e4m3): both wgmma operands must be K-major, so V arrives transposed (V^T,
// head_dim rows of keys, written by aux/fp8.cu with the keys of every 32-key
// step in the order of the P fragment: see pack_p); S is scaled by the q and k
// descales, O by the v descale, and the output is bf16.
#include "../common/numeric.cuh"
#include "../common/params.cuh"
#include "../common/mask.cuh"
#include "../common/softmax.cuh"
#include "../common/mma_sync.cuh"
#include "wgmma.cuh"
#include "tma.cuh"
#include "pipeline.cuh"

// Consumer schedules: each warpgroup on its own, or with the softmax of one key tile
// overlapping the P V product of the previous one.
constexpr int kModeSimple = 0, kModeOverlap = 1;

// fp8 V^T rows (the P V product's N): the head dim rounded up to a wgmma N of the tuned head dims
// (cuflash/sm90.py: fp8_v_rows mirrors this).
__host__ __device__ constexpr int fp8_v_rows(int head_dim) {
    return head_dim <= 32 ? 32 : head_dim <= 64 ? 64 : head_dim <= 96 ? 96 : head_dim <= 128 ? 128
         : head_dim <= 192 ? 192 : 256;
}

template <typename Tag_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_>
struct Sm90FwdTile {
    using Tag = Tag_;
    static constexpr int kElemBytes = ElemTraits<Tag>::kBytes;
    static constexpr bool kFp8 = kElemBytes == 1;
    static constexpr int kHeadDim = kHeadDim_;
    // Bytes of a swizzled Q / K row block: 128, or 64 for fp8 head dims <= 64 (the 64-byte swizzle,
    // so that Q K^T does not run over 64 zero columns).
    static constexpr int kRowBytes = kFp8 && kHeadDim <= 64 ? 64 : 128;
    static constexpr int kBlockCols = kRowBytes / kElemBytes;   // columns of one row block
    static constexpr int kHeadDimPad = (kHeadDim + kBlockCols - 1) / kBlockCols * kBlockCols;  // Q and K
    static constexpr int kColBlocks = kHeadDimPad / kBlockCols;
    // Columns of V and O: fp16 V is an MN-major B in 64-column blocks; fp8 V^T has one row per column.
    static constexpr int kHeadDimV = kFp8 ? fp8_v_rows(kHeadDim) : kHeadDimPad;
    static constexpr int kKeyStep = 32 / kElemBytes;        // keys per k-step of the P V product
    static constexpr int kBlockM = kBlockM_;
    static constexpr int kBlockN = kBlockN_;
    static constexpr int kConsumerWGs = kBlockM / 64;
    static constexpr int kThreads = kNWarps_ * 32;
    static constexpr int kStages = 2;
    static constexpr int kQBytes = kBlockM * kHeadDimPad * kElemBytes;
    static constexpr int kKBytes = kBlockN * kHeadDimPad * kElemBytes;
    static constexpr int kVBytes = kBlockN * kHeadDimV * kElemBytes;   // V (fp16) or V^T (fp8) tile
    static constexpr int kKVBytes = kKBytes > kVBytes ? kKBytes : kVBytes;   // one ring slot
    static constexpr int kProducerRegs = 24;
    static constexpr int kConsumerRegs = kConsumerWGs == 2 ? 240 : 160;
    // Persistent kernels: two Q buffers where shared memory allows (fwd_smem_bytes), so that
    // the next tile's Q is loaded while the consumers finish this one, and a consumer warpgroup done
    // with a tile starts the next without waiting for the others.
    static constexpr int kSmemLimit = 232448;   // opt-in shared memory per block on sm_90
    static constexpr int kQBuffersPersistent =
        1024 + 2 * kQBytes + 2 * kStages * kKVBytes + 8 * (5 + 4 * kStages) <= kSmemLimit ? 2 : 1;
    static_assert(kBlockM % 64 == 0 && kConsumerWGs >= 1 && kConsumerWGs <= 3, "kBlockM: 64, 128 or 192");
    static_assert(kNWarps_ == 4 * (kConsumerWGs + 1), "one producer and kBlockM / 64 consumer warpgroups");
    static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "kBlockN");
    static_assert(!kFp8 || kBlockN % 128 == 0, "fp8: V^T tiles are whole 128-key (128-byte) rows");
};

// Persistent tile order (kPersistent): tiles t = 0 .. num_m * heads_q * batch - 1, handed out
// dynamically (CTA c starts with tile c, then takes the next one from a global counter). Without
// the mask, query tiles of one (head, batch) are adjacent (they share K/V in L2). With it, the
// (head, batch) pairs go in equal sections whose K/V fit in L2, and inside a section the longest
// query tiles (most key tiles) come first, so that the short ones fill the tail.
constexpr int kSectionMB = 32;   // L2 budget of one causal section of (head, batch) pairs, in MB
// At most 32 (head, batch) pairs a section: the first wave of a section runs the longest query tile of
// every pair in it, each loading its pair's K / V from DRAM for the first time, and with short sequences
// a 32 MB section held 128 pairs or more (a burst that the CTAs of that wave all waited on).
constexpr int kSectionPairs = 32;
// Clusters of `cluster` CTAs (not causal): query tiles counted in whole clusters (the padding tiles have
// no rows: their CTAs only load their share of K / V), so that a cluster's tiles share a (head, batch).
struct PersistentOrder {
    int num_m, num_hb, num_tiles, group;
    __device__ __forceinline__ PersistentOrder(const FwdParams& p, int block_m, int kv_bytes_per_row, int cluster = 1) {
        num_m = (p.seqlen_q + block_m - 1) / block_m;
        num_m = (num_m + cluster - 1) / cluster * cluster;
        num_hb = p.heads_q * p.batch;
        num_tiles = num_m * num_hb;
        const long long kv_head = static_cast<long long>(p.seqlen_k) * kv_bytes_per_row;
        const long long g = (static_cast<long long>(kSectionMB) << 20) / (kv_head > 0 ? kv_head : 1);
        group = static_cast<int>(g < 1 ? 1 : (g > num_hb ? num_hb : g));
        if (group > kSectionPairs) group = kSectionPairs;
        const int sections = (num_hb + group - 1) / group;
        group = (num_hb + sections - 1) / sections;   // equal sections: no short one at the end
    }
    template <bool kIsCausal>
    __device__ __forceinline__ void coords(int t, int heads_q, int& m_block, int& head, int& batch) const {
        int hb;
        if (!kIsCausal) {
            m_block = t % num_m;
            hb = t / num_m;
        } else {
            const int per_section = num_m * group;
            const int section = t / per_section;
            const int hb0 = section * group;
            const int g = min(group, num_hb - hb0);
            const int r = t - section * per_section;
            m_block = num_m - 1 - r / g;
            hb = hb0 + r % g;
        }
        head = hb % heads_q;
        batch = hb / heads_q;
    }
};

// -DCUFLASH_SM90_FWD_TRACE (dev/trace.py fwd, persistent kernels only): clock64 stamps per CTA,
// consumer warpgroup and tile (the first 16) after the two tile-counter ints: u64[(cta * 3 + cw) * 16 +
// tile][8], slots 0 tile start, 1 Q landed, 2 first K landed, 3 key loop done, 4 epilogue done, 5 SM id,
// 6 key tiles, 7 (warpgroup 0's record, written by the producer) first K load issued. A diagnostic build only.
#ifdef CUFLASH_SM90_FWD_TRACE
#define CUFLASH_FWD_TRACE(slot, value)                                                                       \
    do {                                                                                                     \
        if (kPersistent && (threadIdx.x & 127) == 0 && k_tile < 16)                                          \
            reinterpret_cast<unsigned long long*>(tile_counter + 64)[((blockIdx.x * 3 + cw) * 16 + k_tile) * 8 \
                                                                     + (slot)] = (value);                   \
    } while (0)
#else
#define CUFLASH_FWD_TRACE(slot, value)
#endif

// -DCUFLASH_SM90_FWD_COUNT_FALLBACKS (tests): how often a warp left the kept-max fast path of the overlap
// schedule, [0] re-based from its probabilities, [1] computed S again, and [2] how many key-tile steps it took
// in the kept-max state; read back through the module global.
#ifdef CUFLASH_SM90_FWD_COUNT_FALLBACKS
__device__ unsigned long long cuflash_fwd_fallbacks[3];
#define CUFLASH_FWD_COUNT(kind) \
    do { if (lane == 0) atomicAdd(cuflash_fwd_fallbacks + (kind), 1ull); } while (0)
#else
#define CUFLASH_FWD_COUNT(kind)
#endif

// fp8 only: the per-tensor scales of the e4m3 inputs (x = x8 * descale), float32 scalars on the device.
struct Fp8Descale {
    const float* q = nullptr;
    const float* k = nullptr;
    const float* v = nullptr;
};

// Shared memory, from a 1024-byte aligned base (the swizzle atoms' alignment): kQBuffers Q tiles, the K and V
// rings (kStages slots each), then the mbarriers and (persistent) the tile slots by which the producer hands
// each Q buffer's tile index to the consumers.
template <class Tile, int kQBuffers>
struct FwdSmem {
    static constexpr int kStages = Tile::kStages;
    u32 q, k, v, bars;
    __device__ __forceinline__ explicit FwdSmem(const char* smem_raw) {
        q = (smem_u32(smem_raw) + 1023) & ~1023u;
        k = q + kQBuffers * Tile::kQBytes;
        v = k + kStages * Tile::kKVBytes;
        bars = v + kStages * Tile::kKVBytes;
    }
    __device__ __forceinline__ u32 q_full(int b) const { return bars + 8 * b; }   // Q buffer b (and its tile slot) loaded
    __device__ __forceinline__ u32 k_full(int s) const { return bars + 8 * (kQBuffers + s); }
    __device__ __forceinline__ u32 v_full(int s) const { return bars + 8 * (kQBuffers + kStages + s); }
    __device__ __forceinline__ u32 k_empty(int s) const { return bars + 8 * (kQBuffers + 2 * kStages + s); }
    __device__ __forceinline__ u32 v_empty(int s) const { return bars + 8 * (kQBuffers + 3 * kStages + s); }
    // Persistent: Q buffer b (and its tile slot) free again.
    __device__ __forceinline__ u32 q_empty(int b) const { return bars + 8 * (kQBuffers + 4 * kStages + b); }
};

// The producer: one thread of warpgroup 0 issues every TMA load of the CTA. Per tile: Q into a Q buffer
// (persistent: handed to the consumers with the tile's index through the buffer's tile slot), then K and V of
// each key tile the mask leaves visible, from last to first, into the kStages-deep ring; each load completes on
// a "full" mbarrier and waits for the stage's "empty" one.
template <class Tile, int kQBuffers, bool kIsCausal, int kMode, bool kPersistent, int kCluster>
__device__ __forceinline__ void fwd_producer(const FwdParams& p, const TmaDesc& tma_q, const TmaDesc& tma_k,
                                             const TmaDesc& tma_v, int* tile_counter,
                                             const FwdSmem<Tile, kQBuffers>& smem, volatile int* tile_slot,
                                             const PersistentOrder& order) {
    constexpr int kBlockM = Tile::kBlockM, kBlockN = Tile::kBlockN, kStages = Tile::kStages;
    constexpr int kPadV = Tile::kHeadDimV;
    using Mask = CausalMask<kBlockM, kBlockN, kIsCausal>;
    const u32 sQ = smem.q, sK = smem.k, sV = smem.v;
    const int num_tiles = order.num_tiles;
    auto grid_coords = [&](int& m_block, int& head, int& batch) {
        if constexpr (kIsCausal) {
            order.template coords<true>(static_cast<int>(blockIdx.x), p.heads_q, m_block, head, batch);
        } else {
            m_block = blockIdx.x;
            head = blockIdx.y;
            batch = blockIdx.z;
        }
    };
    tma_prefetch_desc(&tma_q);
    tma_prefetch_desc(&tma_k);
    tma_prefetch_desc(&tma_v);
    int it = 0, q_count = 0;   // K/V ring iterations and Q tiles handed out so far (the phases)
    int t = kPersistent ? static_cast<int>(blockIdx.x) : 0;
    // Clusters: this CTA issues column blocks cb with cb % kCluster == its rank, to every CTA.
    const int cluster_rank = kCluster > 1 ? static_cast<int>(cluster_ctarank()) : 0;
    auto load_kv_block = [&](u32 dst, const TmaDesc* desc, u32 bar, int cb, int c0, int c1, int head_kv,
                             int batch) {
        if constexpr (kCluster == 1) {
            tma_load_4d(dst, desc, bar, c0, c1, head_kv, batch);
        } else if (cb % kCluster == cluster_rank) {
            tma_load_4d_multicast(dst, desc, bar, c0, c1, head_kv, batch, static_cast<u16>((1 << kCluster) - 1));
        }
    };
    // V of key tile n_block into the ring stage of iteration v_it, once the consumers have freed it.
    auto load_v = [&](int v_it, int n_block, int head_kv, int batch) {
        const PipelineState<kStages> ring(v_it);
        const int stage = ring.stage();
        const u32 v_dst = sV + stage * Tile::kKVBytes;
        mbar_wait(smem.v_empty(stage), ring.empty_phase());
        mbar_arrive_expect_tx(smem.v_full(stage), Tile::kVBytes);
        if constexpr (Tile::kFp8) {   // V^T: 128-key blocks of kPadV rows
#pragma unroll
            for (int cb = 0; cb < kBlockN / 128; ++cb)
                tma_load_4d(v_dst + cb * kPadV * 128, &tma_v, smem.v_full(stage), n_block * kBlockN + cb * 128,
                            0, head_kv, batch);
        } else {
#pragma unroll
            for (int cb = 0; cb < Tile::kColBlocks; ++cb)
                load_kv_block(v_dst + cb * kBlockN * 128, &tma_v, smem.v_full(stage), cb, cb * 64,
                              n_block * kBlockN, head_kv, batch);
        }
    };
    // Persistent 16-bit overlap schedule, two consumer warpgroups (128-row tiles): K runs one key tile
    // ahead of V (K_i, then V_{i-1}; a tile's first K before the previous tile's last V), since K's
    // stage is freed as soon as Q K^T has read it and V's only after P V (docs/design.md: the K/V
    // ring). The 192-row tiles lost with it.
    constexpr bool kKAhead = kPersistent && kMode == kModeOverlap && !Tile::kFp8 && Tile::kConsumerWGs == 2;
    int pending_v_it = -1, pending_v_block = 0, pending_v_head_kv = 0, pending_v_batch = 0;
    auto flush_v = [&]() {   // the V load deferred behind the next K (kKAhead)
        if (kKAhead && pending_v_it >= 0) {
            load_v(pending_v_it, pending_v_block, pending_v_head_kv, pending_v_batch);
            pending_v_it = -1;
        }
    };
    for (;;) {
        int m_block, head, batch;
        const PipelineState<kQBuffers> q_ring(q_count);
        const int qb = q_ring.stage();                           // this tile's Q buffer
        const u32 q_phase = q_ring.phase();
        if constexpr (kPersistent) {
            if (t >= num_tiles) {   // no work left: tell the consumers, reset the counter
                flush_v();
                mbar_wait(smem.q_empty(qb), q_phase ^ 1);
                tile_slot[qb] = t;
                mbar_arrive(smem.q_full(qb));
                if (atomicAdd(tile_counter + 1, 1) == static_cast<int>(gridDim.x) - 1) {
                    tile_counter[0] = 0;   // every CTA has taken its last tile: ready for the next launch
                    tile_counter[1] = 0;
                }
                break;
            }
            order.template coords<kIsCausal>(t, p.heads_q, m_block, head, batch);
        } else {
            grid_coords(m_block, head, batch);
        }
        const int t_cur = t;
        const int head_kv = head / p.heads_per_kv;
        const int n_block_max = Mask(p).n_block_max(m_block);
        auto publish = [&]() {   // persistent: hand the tile to the consumers with its Q
            mbar_wait(smem.q_empty(qb), q_phase ^ 1);
            tile_slot[qb] = t_cur;
        };
        // Persistent: claim the next tile. Only the next trip round the loop reads it, so it is
        // claimed once this tile's Q and first K/V loads have gone out: the atomic's round trip
        // to L2 then delays none of them (A/B: level with claiming it first, kept for clarity).
        // Clusters: a static order (every gridDim.x-th tile), so that the CTAs of a cluster go through
        // tile pairs of one (head, batch) in step.
        auto claim_next = [&]() {
            if constexpr (kCluster > 1) t += static_cast<int>(gridDim.x);
            else t = atomicAdd(tile_counter, 1) + static_cast<int>(gridDim.x);
        };
        if (n_block_max <= 0) {
            if (!kPersistent) break;
            flush_v();
            publish();
            mbar_arrive(smem.q_full(qb));
            claim_next();
            ++q_count;
            continue;
        }
        auto load_q = [&]() {
            if (kPersistent) publish();
            mbar_arrive_expect_tx(smem.q_full(qb), Tile::kQBytes);
#pragma unroll
            for (int cb = 0; cb < Tile::kColBlocks; ++cb)
                tma_load_4d(sQ + qb * Tile::kQBytes + cb * kBlockM * Tile::kRowBytes, &tma_q, smem.q_full(qb),
                            cb * Tile::kBlockCols, m_block * kBlockM, head, batch);
        };
        if (!kPersistent) load_q();
        for (int i = 0; i < n_block_max; ++i, ++it) {
            const int n_block = n_block_max - 1 - i;
            const PipelineState<kStages> ring(it);
            const int stage = ring.stage();
            const u32 parity = ring.phase();
            const u32 k_dst = sK + stage * Tile::kKVBytes;
            mbar_wait(smem.k_empty(stage), ring.empty_phase());
            mbar_arrive_expect_tx(smem.k_full(stage), Tile::kKBytes);
#pragma unroll
            for (int cb = 0; cb < Tile::kColBlocks; ++cb)
                load_kv_block(k_dst + cb * kBlockN * Tile::kRowBytes, &tma_k, smem.k_full(stage), cb,
                              cb * Tile::kBlockCols, n_block * kBlockN, head_kv, batch);
#ifdef CUFLASH_SM90_FWD_TRACE   // slot 7 of consumer warpgroup 0's record: the tile's first K load issued
            if (kPersistent && i == 0 && q_count < 16)
                reinterpret_cast<unsigned long long*>(tile_counter + 64)[(blockIdx.x * 3 * 16 + q_count) * 8 + 7] =
                    clock64();
#endif
            if (kKAhead) {
                flush_v();   // V_{i-1}, or the previous tile's last V
                pending_v_it = it;
                pending_v_block = n_block;
                pending_v_head_kv = head_kv;
                pending_v_batch = batch;
            }
            // Persistent: the tile's first K load goes out before the wait for the Q buffer.
            if (kPersistent && i == 0) load_q();
            if (!kKAhead) load_v(it, n_block, head_kv, batch);
            if (kPersistent && i == 0) claim_next();
        }
        ++q_count;
        if (!kPersistent) break;
    }
}

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
                                                   int cw, int lane, int warp, int row0, int t4, const FwdParams& p) {
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
                        c[e] = Mask(p).modify_score(c[e], row0 + 8 * (e >> 1), n_block * kBlockN + 8 * j + 2 * t4 + (e & 1));
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
    // where a tile that needs the mask hides a key.
    template <class Mask>
    static __device__ __forceinline__ void apply_mask(float (&acc_s)[kBlockN / 2], int n_block, const FwdParams& p,
                                                      int m_block, int row0, int t4) {
        if constexpr (Mask::kHasScoreMod) {
#pragma unroll
            for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    acc_s[4 * j + e] = Mask(p).modify_score(acc_s[4 * j + e], row0 + 8 * (e >> 1),
                                                            n_block * kBlockN + 8 * j + 2 * t4 + (e & 1));
        }
        if (Mask(p).needs_mask(m_block, n_block)) {
            const int n0 = n_block * kBlockN;
#pragma unroll
            for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (!Mask(p).visible(row0 + 8 * (e >> 1), n0 + 8 * j + 2 * t4 + (e & 1)))
                        acc_s[4 * j + e] = -CUFLASH_INF;
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

// The simple schedule's key loop: per key tile, S, the softmax and P V, each waited for.
template <class Tile, class Mask, int kMode, int kCluster, int kQBuffers, class Softmax>
__device__ __forceinline__ Softmax fwd_mainloop_simple(
    const FwdParams& p, const FwdSmem<Tile, kQBuffers>& smem, const int it, const int n_block_max, const float scale_log2,
    float (&acc_o)[Tile::kHeadDimV / 2], Softmax softmax,
    u32 (&qa)[FwdMath<Tile, kMode>::kQInRegs ? Tile::kHeadDimPad / 16 : 1][4], const int qb, const int cw, const int lane,
    const int warp, const int t4, const int m_block, const int row0) {
    using Math = FwdMath<Tile, kMode>;
    using Tag = typename Tile::Tag;
    constexpr int kBlockN = Tile::kBlockN, kStages = Tile::kStages, kPad = Tile::kHeadDimPad;
    constexpr int kPSteps = Math::kPSteps;
    constexpr bool kQInRegs = Math::kQInRegs;
    const u32 sQ = smem.q, sK = smem.k, sV = smem.v;
    auto release_kv = [&](u32 bar) {
        if constexpr (kCluster == 1) {
            mbar_arrive(bar);
        } else {
            __syncwarp();   // every lane's reads of the stage (qk_warp) are done
            if (lane < kCluster) mbar_arrive_cluster(bar, lane);
        }
    };
    auto s3_of = [](float (&acc)[kBlockN / 2]) -> float (&)[1][kBlockN / 8][4] { return Math::s3_of(acc); };
    auto load_q_frags = [&]() { Math::load_q_frags(qa, sQ, qb, cw, lane, warp); };
    auto qk_warp = [&](float (&acc_s)[kBlockN / 2], u32 k_src, int n_block) {
        Math::template qk_warp<Mask>(acc_s, k_src, n_block, sQ, qb, cw, lane, warp, row0, t4, p);
    };
    auto issue_qk = [&](float (&acc_s)[kBlockN / 2], u32 k_src) { Math::issue_qk(acc_s, k_src, qa, sQ, qb, cw); };
    auto issue_pv = [&](const u32 (&pa)[kPSteps][4], u32 v_src) { Math::issue_pv(acc_o, pa, v_src); };
    auto mask = [&](float (&acc_s)[kBlockN / 2], int n_block) {
        Math::template apply_mask<Mask>(acc_s, n_block, p, m_block, row0, t4);
    };
    auto rescale_o = [&](const float (&rescale)[2]) { Math::rescale_o(acc_o, rescale); };
    auto pack_p = [&](u32 (&pa)[kPSteps][4], const float (&acc_s)[kBlockN / 2]) { Math::pack_p(pa, acc_s); };
    load_q_frags();
    for (int i = 0; i < n_block_max; ++i) {
        const int n_block = n_block_max - 1 - i;
        const PipelineState<kStages> ring(it + i);
        const int stage = ring.stage();
        const u32 parity = ring.phase();
        float acc_s[kBlockN / 2];
        mbar_wait(smem.k_full(stage), parity);
        issue_qk(acc_s, sK + stage * Tile::kKVBytes);
        wgmma_wait<0>();
        fence_operand(acc_s);
        release_kv(smem.k_empty(stage));
        mask(acc_s, n_block);
        float rescale[2];
        if (__any_sync(0xffffffff, softmax.step(s3_of(acc_s), scale_log2, rescale))) rescale_o(rescale);
        u32 pa[kPSteps][4];
        pack_p(pa, acc_s);
        mbar_wait(smem.v_full(stage), parity);
        issue_pv(pa, sV + stage * Tile::kKVBytes);
        wgmma_wait<0>();
        fence_operand(acc_o);
        release_kv(smem.v_empty(stage));
    }
    return softmax;
}

// The overlap schedule's key loop: Q K^T of key tile i and O += P_{i-1} V_{i-1} issued back to back, the
// softmax of tile i while P V computes. `it`: the K/V ring iterations before this tile.
template <class Tile, class Mask, int kMode, int kCluster, int kQBuffers, bool kPersistent, class Softmax>
__device__ __forceinline__ Softmax fwd_mainloop_overlap(
    const FwdParams& p, const FwdSmem<Tile, kQBuffers>& smem, const int it, const int n_block_max, const float scale_log2,
    float (&acc_o)[Tile::kHeadDimV / 2], Softmax softmax,
    u32 (&qa)[FwdMath<Tile, kMode>::kQInRegs ? Tile::kHeadDimPad / 16 : 1][4], int& settle_tiles, bool& kept_failed,
    const int qb, const int cw, const int lane, const int warp, const int t4, const int m_block, const int row0,
    const int k_tile, int* tile_counter) {
    using Math = FwdMath<Tile, kMode>;
    using Tag = typename Tile::Tag;
    constexpr int kBlockN = Tile::kBlockN, kStages = Tile::kStages, kPad = Tile::kHeadDimPad;
    constexpr int kPSteps = Math::kPSteps;
    constexpr bool kQInRegs = Math::kQInRegs;
    const u32 sQ = smem.q, sK = smem.k, sV = smem.v;
    auto release_kv = [&](u32 bar) {
        if constexpr (kCluster == 1) {
            mbar_arrive(bar);
        } else {
            __syncwarp();   // every lane's reads of the stage (qk_warp) are done
            if (lane < kCluster) mbar_arrive_cluster(bar, lane);
        }
    };
    auto s3_of = [](float (&acc)[kBlockN / 2]) -> float (&)[1][kBlockN / 8][4] { return Math::s3_of(acc); };
    auto load_q_frags = [&]() { Math::load_q_frags(qa, sQ, qb, cw, lane, warp); };
    auto qk_warp = [&](float (&acc_s)[kBlockN / 2], u32 k_src, int n_block) {
        Math::template qk_warp<Mask>(acc_s, k_src, n_block, sQ, qb, cw, lane, warp, row0, t4, p);
    };
    auto issue_qk = [&](float (&acc_s)[kBlockN / 2], u32 k_src) { Math::issue_qk(acc_s, k_src, qa, sQ, qb, cw); };
    auto issue_pv = [&](const u32 (&pa)[kPSteps][4], u32 v_src) { Math::issue_pv(acc_o, pa, v_src); };
    auto mask = [&](float (&acc_s)[kBlockN / 2], int n_block) {
        Math::template apply_mask<Mask>(acc_s, n_block, p, m_block, row0, t4);
    };
    auto rescale_o = [&](const float (&rescale)[2]) { Math::rescale_o(acc_o, rescale); };
    auto pack_p = [&](u32 (&pa)[kPSteps][4], const float (&acc_s)[kBlockN / 2]) { Math::pack_p(pa, acc_s); };
    // Intra-warpgroup overlap: the softmax of key tile i runs while the
    // tensor cores compute O += P_{i-1} V_{i-1}.
    // 16-bit: a warp whose rows' max has settled takes each key tile's probabilities against the
    // running max as it stands (OnlineSoftmax::probs_at_running_max: no FMNMX chain, no quad
    // shuffles, no rescale). Where some row passes 2^kKeepMaxBoundLog2, the warp re-bases those rows
    // from their probabilities (OnlineSoftmax::rebase: the max of p, p / max; no S needed) and returns to
    // the full step until key tiles move none of its maxima. The decision is per warp and adaptive:
    // trained models' sharp heads move some row's max on many key tiles, and a warpgroup-wide fallback
    // (computing S again for all 64 rows, as this kernel first did) cost up to 26 % there. Only a score
    // 2^112 (bf16 2^120) above a settled max makes the warp compute its S again (qk_warp; the K stage is
    // therefore freed after the softmax in the kept-max state). -DCUFLASH_SM90_FWD_KEEP_MAX=0: the full step
    // alone (the baseline of BENCHMARKS.md's distribution table).
#ifndef CUFLASH_SM90_FWD_KEEP_MAX
#define CUFLASH_SM90_FWD_KEEP_MAX 1
#endif
    // The bound on a thread's partial row sum (so on each probability) in the kept-max state: fp16 P
    // holds up to 2^15; bf16 P has float32's range, and 2^48 still leaves O's float32 sums 2^79 of room
    // for |V| times the number of keys. The wider bound makes re-bases rarer on sharp heads.
    constexpr int kKeepMaxBoundLog2 = kIsBf16<Tag> ? 48 : 14;
    constexpr bool kKeepMax = CUFLASH_SM90_FWD_KEEP_MAX && !Tile::kFp8;
    u32 pa[kPSteps][4];
    // Per warp: whether its rows' max has settled, so that the next key tile tries the kept max. It
    // starts unsettled (the first key tile, partial or on the causal diagonal, may leave a row a weak
    // max) and leaves that state when a kept step fails; it comes back after `settle_tiles` full steps
    // in a row that move no max. That number doubles with each failure, up to 64 (a failed step stalls
    // the warpgroup's next GEMMs, so it costs more than a full step), and lives across the persistent
    // tile loop: a query tile whose kept steps never failed brings it down by a quarter, so that a warp
    // that met a sharp head comes back to the kept max on a diffuse one, while a warp on a head whose
    // max keeps moving stays with the full step. With three consumer warpgroups (head dim 64, a
    // softmax-bound tile) a failure costs the most and it never comes down; in fp16 there (whose P bound
    // sharp heads pass again and again) a warp's first failure ends its kept max for the kernel.
    int settled = 0;   // full steps in a row that moved no max; the kept max once it reaches settle_tiles
    constexpr int kSettleTilesMax = 64;
    constexpr bool kSettleDecay = Tile::kConsumerWGs < 3;
    constexpr bool kFailureEndsKeptMax = !kSettleDecay && !kIsBf16<Tag>;
    // bf16 with two consumer warpgroups: a full step counts towards settling whether or not it moved a
    // max (rows with no max yet excepted), since the kept state absorbs later maxima up to 2^48 above
    // it; sharp heads, whose maxima keep moving by small amounts, then need not stay on the full step.
    // At head dim 64 (three warpgroups) it lost on the mixed and outlier heads.
    constexpr bool kMovesAbsorbed = kIsBf16<Tag> && kSettleDecay;
    constexpr int kNeverSettles = 0x7fffffff;   // a settle count that `settled` cannot reach
    if (kSettleDecay && !kept_failed) settle_tiles = max(1, settle_tiles - settle_tiles / 4);
    kept_failed = false;
    load_q_frags();
    {
        float acc_s[kBlockN / 2];
        const PipelineState<kStages> ring(it);
        const int stage0 = ring.stage();
        mbar_wait(smem.k_full(stage0), ring.phase());
        CUFLASH_FWD_TRACE(2, clock64());
        CUFLASH_FWD_TRACE(6, n_block_max);
        issue_qk(acc_s, sK + stage0 * Tile::kKVBytes);
        wgmma_wait<0>();
        fence_operand(acc_s);
        release_kv(smem.k_empty(stage0));
        mask(acc_s, n_block_max - 1);
        float rescale[2];
        softmax.step(s3_of(acc_s), scale_log2, rescale);  // acc_o is still 0: no rescale
        pack_p(pa, acc_s);
    }
    // At head dims 65-128, O's rescale for key tile i is applied at step i + 1 while Q K^T_{i+1} runs,
    // just before O += P_i V_i, rather than between the wait for P_{i-1} V_{i-1} and that issue, where
    // this warpgroup's tensor work would wait on it: it pays on the heads whose max keeps moving. At 64
    // (three warpgroups) and 256 it measured level or worse, so there it stays after the wait.
    constexpr bool kRescaleUnderQk = !Tile::kFp8 && Tile::kHeadDimPad == 128;
    float pending_rescale[2] = {1.f, 1.f};
    bool rescale_pending = false;   // warp-uniform
    for (int i = 1; i < n_block_max; ++i) {
        const int n_block = n_block_max - 1 - i;
        const PipelineState<kStages> ring(it + i), ring_prev(it + i - 1);
        const int stage = ring.stage(), prev = ring_prev.stage();
        const u32 parity = ring.phase(), prev_parity = ring_prev.phase();
        float acc_s[kBlockN / 2];
        mbar_wait(smem.k_full(stage), parity);
        issue_qk(acc_s, sK + stage * Tile::kKVBytes);
        if (kRescaleUnderQk && rescale_pending) rescale_o(pending_rescale);
        mbar_wait(smem.v_full(prev), prev_parity);
        issue_pv(pa, sV + prev * Tile::kKVBytes);
        wgmma_wait<1>();  // S_i is ready (groups complete in order)
        fence_operand(acc_s);
        // Per warp, and only between the GEMMs: wgmma must run at one PC for all four warps of the
        // warpgroup (a build with the two states in loops of their own broke that: synccheck).
        const bool full_step = !kKeepMax || settled < settle_tiles;
        // The kept-max state holds K for a possible recompute; the full step frees it at once.
        if (full_step) release_kv(smem.k_empty(stage));
        mask(acc_s, n_block);
        float rescale[2] = {1.f, 1.f};
        bool max_changed = false, unset = false;
        if (full_step) {
            // A row with no max yet counts as moved (its factor is 0 on an O of 0): not settled.
            unset = kKeepMax && softmax.has_unset_row();
            max_changed = softmax.step(s3_of(acc_s), scale_log2, rescale) || unset;
        } else if constexpr (kKeepMax) {
            CUFLASH_FWD_COUNT(2);
            float sums[2];
            const bool ok =
                softmax.template probs_at_running_max<kKeepMaxBoundLog2>(s3_of(acc_s), scale_log2, sums);
            if (__any_sync(0xffffffff, !ok)) {
                if (__all_sync(0xffffffff, softmax.rebase_possible(sums))) {
                    max_changed = softmax.rebase(s3_of(acc_s), sums, rescale);
                    CUFLASH_FWD_COUNT(0);
                } else {
                    qk_warp(acc_s, sK + stage * Tile::kKVBytes, n_block);   // masked as the probabilities were
                    max_changed = softmax.step(s3_of(acc_s), scale_log2, rescale);
                    CUFLASH_FWD_COUNT(1);
                }
                settled = 0;
                settle_tiles = kFailureEndsKeptMax ? kNeverSettles : min(2 * settle_tiles, kSettleTilesMax);
                kept_failed = true;
            } else {
                softmax.add_sums(sums);
            }
            release_kv(smem.k_empty(stage));
        }
        // Pin the softmax before the wait: the fences consume its results and the
        // scheduling barrier keeps ptxas from hoisting the wait above them.
        fence_operand(acc_s);
        fence_operand(rescale);
        fence_operand(softmax.row_sum);
        scheduling_barrier(p.seqlen_k);
        wgmma_wait<0>();  // O += P_{i-1} V_{i-1} done
        fence_operand(acc_o);
        const bool warp_moved = __any_sync(0xffffffff, max_changed);
        if constexpr (kRescaleUnderQk) {
            rescale_pending = warp_moved;
            pending_rescale[0] = rescale[0];
            pending_rescale[1] = rescale[1];
        } else if (warp_moved) {
            rescale_o(rescale);   // this warp's rows only
        }
        if (kKeepMax && full_step)
            settled = (kMovesAbsorbed ? __any_sync(0xffffffff, unset) : warp_moved) ? 0 : settled + 1;
        pack_p(pa, acc_s);
        release_kv(smem.v_empty(prev));
    }
    const PipelineState<kStages> ring_last(it + n_block_max - 1);
    const int last = ring_last.stage();
    if (kRescaleUnderQk && rescale_pending) rescale_o(pending_rescale);
    mbar_wait(smem.v_full(last), ring_last.phase());
    issue_pv(pa, sV + last * Tile::kKVBytes);
    wgmma_wait<0>();
    fence_operand(acc_o);
    release_kv(smem.v_empty(last));
    CUFLASH_FWD_TRACE(3, clock64());
    return softmax;
}

// The epilogue: O normalised by the row sums (16-bit: staged through this warpgroup's rows of its Q buffer,
// then a TMA store (persistent) or 16-byte stores; fp8 and wide persistent tiles: straight from the
// accumulators), and lse. `idle`: the warpgroup has no rows (and did not wait for the Q load).
template <class Tile, int kQBuffers, bool kPersistent>
__device__ __forceinline__ void fwd_epilogue(const FwdParams& p, const FwdSmem<Tile, kQBuffers>& smem, const TmaDesc* tma_o,
                                             const float (&acc_o)[Tile::kHeadDimV / 2], const float (&inv_sum)[2],
                                             const float (&lse)[2], int m_block, int head, int batch, int qb, int cw,
                                             bool idle, int row0, int& o_store_buffer) {
    using OutTag = typename ElemTraits<typename Tile::Tag>::OutTag;
    constexpr int kBlockM = Tile::kBlockM, kPadV = Tile::kHeadDimV, kHeadDim = Tile::kHeadDim;
    // 16-bit O goes out through shared memory (kStageO): written straight from the accumulators it would be
    // 4-byte stores, each warp touching eight rows per instruction, and the warps wait on them before the next
    // tile. The staging area is this warpgroup's rows of its Q buffer, which only its own (finished) Q K^T
    // products read: the same 64-column blocks of 128-byte rows, 16-byte chunk c of row r at c ^ (r % 8).
    // fp8 Q rows are too narrow for O's: those store directly, and so do the persistent kernels above head
    // dim 128 (the staging code spills the overlap one at 192 under the causal mask).
    constexpr bool kStageO = !Tile::kFp8 && !(kPersistent && kPadV > 128);
    // Persistent: staged O leaves through one TMA store per warpgroup, issued by its first thread, so that the
    // warpgroup goes on to the next tile at once; that thread releases the Q buffer once the store has read it,
    // at the next tile's start (two Q buffers: the producer is then loading the other one), or at once (one).
    constexpr bool kTmaStoreO = kPersistent && kStageO;
    constexpr int kOStagedBarrier = 4;   // named barriers 4..6, one per consumer warpgroup: its staged rows are complete
    extern __shared__ char smem_raw[];
    const u32 sQ = smem.q;
    const int lane = threadIdx.x & 31;
    const int warp = (threadIdx.x >> 5) & 3;
    const int g = lane >> 2, t4 = lane & 3;
    u16* gO = static_cast<u16*>(p.o) + batch * p.o_batch_stride + head * p.o_head_stride;
    if constexpr (kStageO) {
        if (!idle) {   // an idle warpgroup has no rows to store (and did not wait for the Q load)
            char* sO = smem_raw + (sQ + qb * Tile::kQBytes + cw * 64 * 128 - smem_u32(smem_raw));
            // The warp's ldmatrix of these Q rows (kQInRegs, or the kept max's recompute) read what other
            // lanes now overwrite.
            __syncwarp();
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = warp * 16 + g + 8 * h;
#pragma unroll
                for (int j = 0; j < kPadV / 8; ++j)
                    *reinterpret_cast<u32*>(sO + (j / 8) * kBlockM * 128 + r * 128 + (((j % 8) ^ (r % 8)) * 16)
                                            + 4 * t4) =
                        ElemTraits<OutTag>::pack2(acc_o[4 * j + 2 * h] * inv_sum[h],
                                                  acc_o[4 * j + 2 * h + 1] * inv_sum[h]);
            }
            if constexpr (kTmaStoreO) {
                fence_proxy_async_smem();   // the staged rows, visible to the TMA engine
                named_barrier_sync(kOStagedBarrier + cw, 128);
                if ((threadIdx.x & 127) == 0) {
                    const u32 rows = sQ + qb * Tile::kQBytes + cw * 64 * 128;
#pragma unroll
                    for (int cb = 0; cb < kPadV / 64; ++cb)
                        tma_store_4d(tma_o, rows + cb * kBlockM * 128, cb * 64, m_block * kBlockM + cw * 64, head,
                                     batch);
                    bulk_commit_group();
                    if constexpr (kQBuffers == 2) {
                        o_store_buffer = qb;
                    } else {
                        bulk_wait_read();
                    }
                }
            } else {
            named_barrier_sync(kOStagedBarrier + cw, 128);
            constexpr int kChunks = kPadV / 8;   // 16-byte chunks of a row
            const int row_base = m_block * kBlockM + cw * 64;
#pragma unroll
            for (int k = 0; k < 64 * kChunks / 128; ++k) {
                const int idx = k * 128 + (threadIdx.x & 127);
                const int r = idx / kChunks, c = idx % kChunks;
                if (row_base + r < p.seqlen_q && c * 8 < kHeadDim)
                    *reinterpret_cast<uint4*>(gO + (row_base + r) * p.o_row_stride + c * 8) =
                        *reinterpret_cast<const uint4*>(sO + (c / 8) * kBlockM * 128 + r * 128
                                                        + (((c % 8) ^ (r % 8)) * 16));
            }
            }
        }
        if (kPersistent && o_store_buffer != qb) mbar_arrive(smem.q_empty(qb));
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = row0 + 8 * h;
        if (row < p.seqlen_q) {
            if constexpr (!kStageO) {
                u16* o_row = gO + row * p.o_row_stride;
#pragma unroll
                for (int j = 0; j < kPadV / 8; ++j) {
                    const int col = 8 * j + 2 * t4;
                    if (col < kHeadDim)
                        *reinterpret_cast<u32*>(o_row + col) = ElemTraits<OutTag>::pack2(
                            acc_o[4 * j + 2 * h] * inv_sum[h], acc_o[4 * j + 2 * h + 1] * inv_sum[h]);
                }
            }
            if (p.lse != nullptr && t4 == 0)
                p.lse[(static_cast<i64>(batch) * p.heads_q + head) * p.seqlen_q + row] = lse[h];
        }
    }
}

// The consumer warpgroups' tile loop (64 query rows each): take a tile (persistent: the index the producer
// published with its Q), run the schedule's key loop over it, store O and lse.
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, bool kIsCausal, int kMode, bool kPersistent,
          int kCluster, int kQBuffers>
__device__ __forceinline__ void fwd_consumer(const FwdParams& p,
                                             const FwdSmem<Sm90FwdTile<Tag, kHeadDim, kBlockM, kBlockN, kNWarps>, kQBuffers>& smem,
                                             volatile int* tile_slot, const PersistentOrder& order, const int cw,
                                             int* tile_counter, Fp8Descale descale, const TmaDesc* tma_o) {
    using Tile = Sm90FwdTile<Tag, kHeadDim, kBlockM, kBlockN, kNWarps>;
    using Mask = CausalMask<kBlockM, kBlockN, kIsCausal>;
    using OutTag = typename ElemTraits<Tag>::OutTag;
    constexpr int kStages = Tile::kStages;
    constexpr int kPad = Tile::kHeadDimPad;
    constexpr int kPadV = Tile::kHeadDimV;
    extern __shared__ char smem_raw[];
    const u32 sQ = smem.q, sK = smem.k, sV = smem.v;
    const int num_tiles = order.num_tiles;
    auto grid_coords = [&](int& m_block, int& head, int& batch) {
        if constexpr (kIsCausal) {
            order.template coords<true>(static_cast<int>(blockIdx.x), p.heads_q, m_block, head, batch);
        } else {
            m_block = blockIdx.x;
            head = blockIdx.y;
            batch = blockIdx.z;
        }
    };
    const int lane = threadIdx.x & 31;
    const int warp = (threadIdx.x >> 5) & 3;
    const int g = lane >> 2, t4 = lane & 3;
    int it = 0, q_count = 0;   // K/V ring iterations and Q tiles consumed so far (the phases)
    int settle_tiles = 1;      // the overlap schedule's kept-max state (below)
    bool kept_failed = false;  // whether a kept step failed in the last query tile
    // Frees a K or V ring stage: every thread arrives, or (clusters) one lane of each warp per CTA of the
    // cluster (the warps of a warpgroup may leave a stage at different times: see qk_warp).
    auto release_kv = [&](u32 bar) {
        if constexpr (kCluster == 1) {
            mbar_arrive(bar);
        } else {
            __syncwarp();   // every lane's reads of the stage (qk_warp) are done
            if (lane < kCluster) mbar_arrive_cluster(bar, lane);
        }
    };
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
            order.template coords<kIsCausal>(t, p.heads_q, m_block, head, batch);
        } else {
            if (k_tile > 0) break;
            grid_coords(m_block, head, batch);
        }
        const int n_block_max = Mask(p).n_block_max(m_block);
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
        // fp8: the q and k descales scale S; the v descale scales O in the epilogue.
        float scale_log2 = p.scale_log2, o_scale = 1.f;
        if constexpr (Tile::kFp8) {
            scale_log2 *= *descale.q * *descale.k;
            o_scale = *descale.v;
        }

        // A warpgroup whose 64 rows all lie past seqlen_q (the last query tile when seqlen_q is not a
        // multiple of kBlockM, e.g. 1024 rows in 192-row tiles) keeps the ring's phases (waits for each
        // stage, releases it) but runs no GEMM, leaving the tensor cores to the others.
        const bool idle = m_block * kBlockM + cw * 64 >= p.seqlen_q;
        if (idle) {
            for (int i = 0; i < n_block_max; ++i) {
                const PipelineState<kStages> ring(it + i);
                const int stage = ring.stage();
                const u32 parity = ring.phase();
                mbar_wait(smem.k_full(stage), parity);
                release_kv(smem.k_empty(stage));
                mbar_wait(smem.v_full(stage), parity);
                release_kv(smem.v_empty(stage));
            }
        }
        if (!kPersistent && n_block_max > 0 && !idle) mbar_wait(smem.q_full(0), 0);
        if (n_block_max > 0 && !idle && kMode != kModeOverlap) {
            softmax = fwd_mainloop_simple<Tile, Mask, kMode, kCluster, kQBuffers>(
                p, smem, it, n_block_max, scale_log2, acc_o, softmax, qa, qb, cw, lane, warp, t4, m_block, row0);
        }
        if (n_block_max > 0 && !idle && kMode == kModeOverlap) {
            softmax = fwd_mainloop_overlap<Tile, Mask, kMode, kCluster, kQBuffers, kPersistent>(
                p, smem, it, n_block_max, scale_log2, acc_o, softmax, qa, settle_tiles, kept_failed, qb, cw, lane, warp, t4,
                m_block, row0, k_tile, tile_counter);
        }

        constexpr bool kStageO = !Tile::kFp8 && !(kPersistent && kPadV > 128);   // as fwd_epilogue's
        // Every QK GEMM of this tile is done (and, staged, so is the epilogue's use of the Q buffer):
        // the producer may load the next Q into it (persistent).
        if (kPersistent && !kStageO) mbar_arrive(smem.q_empty(qb));
        it += n_block_max > 0 ? n_block_max : 0;
        ++q_count;

        // Epilogue: normalise and store O (rows past seqlen_q and padded columns skipped) and lse.
        float inv_sum[2], lse[2];
        softmax.finalize(inv_sum, lse);
        inv_sum[0] *= o_scale;
        inv_sum[1] *= o_scale;
        fwd_epilogue<Tile, kQBuffers, kPersistent>(p, smem, tma_o, acc_o, inv_sum, lse, m_block, head, batch, qb, cw, idle,
                                                   row0, o_store_buffer);
        CUFLASH_FWD_TRACE(4, clock64());
    }
}

// kCluster: 1, or 2 for clusters of two CTAs on adjacent query tiles of one (head, batch), not causal
// (the two tiles then visit the same key tiles), 16-bit, an even number of 64-column blocks (head dims
// 65..128, 193..256). Each CTA loads every other column block of each K and V tile and multicasts it to
// both, which halves the tiles' L2 -> SM traffic; a ring stage is refilled once the consumers of both
// CTAs have freed it. The grid counts query tiles in whole clusters (launch.py: fwd_grid).
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, bool kIsCausal, int kMode,
          bool kPersistent = false, int kCluster = 1>
__device__ __forceinline__ void fwd_body(const FwdParams& p, const TmaDesc& tma_q, const TmaDesc& tma_k,
                                         const TmaDesc& tma_v, int* tile_counter = nullptr,
                                         Fp8Descale descale = {}, const TmaDesc* tma_o = nullptr) {
    using Tile = Sm90FwdTile<Tag, kHeadDim, kBlockM, kBlockN, kNWarps>;
    using Mask = CausalMask<kBlockM, kBlockN, kIsCausal>;   // the mask policy (common/mask.cuh)
    constexpr int kStages = Tile::kStages;
    constexpr int kPad = Tile::kHeadDimPad;
    constexpr int kPadV = Tile::kHeadDimV;
    using OutTag = typename ElemTraits<Tag>::OutTag;
    static_assert(kCluster == 1 || (!kIsCausal && !Tile::kFp8 && Tile::kColBlocks % kCluster == 0),
                  "clusters: not causal, 16-bit, whole column blocks per CTA");
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
    const u32 sQ = smem.q, sK = smem.k, sV = smem.v, bars = smem.bars;
    // Persistent: the tile the producer hands to the consumers with each Q (>= num_tiles: done), per buffer.
    volatile int* tile_slot =
        reinterpret_cast<volatile int*>(smem_raw + (bars + 8 * (2 * kQBuffers + 4 * kStages) - smem_u32(smem_raw)));

    const PersistentOrder order(p, kBlockM, (kPad + kPadV) * Tile::kElemBytes, kCluster);
    const int num_tiles = order.num_tiles;
    // One CTA per tile: (query tile, head, batch) from a 3-D grid; causal: a 1-D grid walked in the
    // persistent order (longest query tiles first within L2-sized sections of heads), so that the
    // last wave holds short tiles and the waves in flight share K/V in L2.
    auto grid_coords = [&](int& m_block, int& head, int& batch) {
        if constexpr (kIsCausal) {
            order.template coords<true>(static_cast<int>(blockIdx.x), p.heads_q, m_block, head, batch);
        } else {
            m_block = blockIdx.x;
            head = blockIdx.y;
            batch = blockIdx.z;
        }
    };
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
            mbar_init(smem.k_empty(s), kCluster > 1 ? kCluster * Tile::kConsumerWGs * 4 : Tile::kConsumerWGs * 128);
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
            fwd_producer<Tile, kQBuffers, kIsCausal, kMode, kPersistent, kCluster>(p, tma_q, tma_k, tma_v, tile_counter, smem,
                                                                                   tile_slot, order);
        }
    } else {
        // Consumer warpgroups: 64 query rows each.
        setmaxnreg_inc<kConsumerRegs>();
        fwd_consumer<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, kIsCausal, kMode, kPersistent, kCluster, kQBuffers>(
            p, smem, tile_slot, order, wg - 1, tile_counter, descale, tma_o);
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
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, bool kPersistent>
__host__ __device__ constexpr int fwd_smem_bytes() {
    using Tile = Sm90FwdTile<Tag, kHeadDim, kBlockM, kBlockN, kNWarps>;
    constexpr int kQBuffers = kPersistent ? Tile::kQBuffersPersistent : 1;
    return 1024 + kQBuffers * Tile::kQBytes + 2 * Tile::kStages * Tile::kKVBytes
           + 8 * (2 * kQBuffers + 1 + 4 * Tile::kStages);
}
#define CUFLASH_SM90_FWD_SMEM(name, persistent)                                                                \
    template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, bool kIsCausal>                \
    __device__ const int name##_smem_bytes = fwd_smem_bytes<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, persistent>();
#define CUFLASH_SM90_FWD_KERNEL(name, mode, cluster, attrs)                                                    \
    CUFLASH_SM90_FWD_SMEM(name, false)                                                                         \
    template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, bool kIsCausal>                \
    __global__ void __launch_bounds__(kNWarps * 32, kNWarps == 8 ? 2 : 1) attrs                                 \
    name(const FwdParams p, const __grid_constant__ TmaDesc tma_q, const __grid_constant__ TmaDesc tma_k,       \
         const __grid_constant__ TmaDesc tma_v) {                                                               \
        fwd_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, kIsCausal, mode, false, cluster>(p, tma_q, tma_k,    \
                                                                                            tma_v);             \
    }
#define CUFLASH_SM90_FWD_PERSISTENT_KERNEL(name, mode, cluster, attrs)                                         \
    CUFLASH_SM90_FWD_SMEM(name, true)                                                                          \
    template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, bool kIsCausal>                \
    __global__ void __launch_bounds__(kNWarps * 32, 1) attrs                                                    \
    name(const FwdParams p, const __grid_constant__ TmaDesc tma_q, const __grid_constant__ TmaDesc tma_k,       \
         const __grid_constant__ TmaDesc tma_v, const __grid_constant__ TmaDesc tma_o, int* tile_counter) {     \
        fwd_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, kIsCausal, mode, true, cluster>(                     \
            p, tma_q, tma_k, tma_v, tile_counter, {}, &tma_o);                                                  \
    }
CUFLASH_SM90_FWD_KERNEL(fwd_overlap_kernel, kModeOverlap, 1, )
CUFLASH_SM90_FWD_KERNEL(fwd_overlap_x2_kernel, kModeOverlap, 2, __cluster_dims__(2, 1, 1))
CUFLASH_SM90_FWD_PERSISTENT_KERNEL(fwd_persistent_kernel, kModeSimple, 1, )
CUFLASH_SM90_FWD_PERSISTENT_KERNEL(fwd_overlap_persistent_kernel, kModeOverlap, 1, )
CUFLASH_SM90_FWD_PERSISTENT_KERNEL(fwd_overlap_x2_persistent_kernel, kModeOverlap, 2, __cluster_dims__(2, 1, 1))
#undef CUFLASH_SM90_FWD_KERNEL
#undef CUFLASH_SM90_FWD_PERSISTENT_KERNEL

CUFLASH_SM90_FWD_SMEM(fwd_fp8_kernel, false)
CUFLASH_SM90_FWD_SMEM(fwd_fp8_persistent_kernel, true)
#undef CUFLASH_SM90_FWD_SMEM

// fp8 (Tag = e4m3_tag) with the overlap schedule: tma_vt maps V^T (cuflash/fp8.py); descale_q, _k, _v
// point to the float32 per-tensor scales. One CTA per tile, or persistent.
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, bool kIsCausal>
__global__ void __launch_bounds__(kNWarps * 32, 1)
fwd_fp8_kernel(const FwdParams p, const __grid_constant__ TmaDesc tma_q, const __grid_constant__ TmaDesc tma_k,
               const __grid_constant__ TmaDesc tma_vt, const float* descale_q, const float* descale_k,
               const float* descale_v) {
    fwd_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, kIsCausal, kModeOverlap>(
        p, tma_q, tma_k, tma_vt, nullptr, Fp8Descale{descale_q, descale_k, descale_v});
}
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, bool kIsCausal>
__global__ void __launch_bounds__(kNWarps * 32, 1)
fwd_fp8_persistent_kernel(const FwdParams p, const __grid_constant__ TmaDesc tma_q,
                          const __grid_constant__ TmaDesc tma_k, const __grid_constant__ TmaDesc tma_vt,
                          int* tile_counter, const float* descale_q, const float* descale_k,
                          const float* descale_v) {
    fwd_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, kIsCausal, kModeOverlap, true>(
        p, tma_q, tma_k, tma_vt, tile_counter, Fp8Descale{descale_q, descale_k, descale_v});
}
