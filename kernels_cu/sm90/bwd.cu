// FlashAttention-2 backward for Hopper (sm_90a): dK, dV and dQ on wgmma in one kernel.
//
// One CTA per (key tile of kBlockN = 64 * consumer warpgroups keys, kv head, batch),
// looping over the query tiles (kBlockM = 64 or 128 rows) of every query head of its GQA
// group. Warpgroup 0 is the producer: it lowers its registers; one thread loads K
// and V once and then streams Q and dO tiles through a kStages-deep TMA ring
// (128-byte swizzle, "full"/"empty" mbarriers), each with its rows of lse2 / delta
// (written by the preprocess, padded to whole query tiles: BwdParams.stats).
// Consumer warpgroup c owns keys 64c..64c+63 of the tile; per query tile:
//   S^T  = K_c Q^T          wgmma SS (K and Q K-major)
//   dP^T = V_c dO^T         wgmma SS
//   P^T  = exp2(S^T * scale_log2 - lse2[m]),  dS^T = P^T * (dP^T - delta[m])
//   dV_c += P^T dO          wgmma RS (P^T from the accumulators, dO MN-major)
//   dK_c += dS^T Q          wgmma RS (dS^T from the accumulators, Q MN-major)
//   dS -> shared memory as [query][key] (128-byte swizzle, K-major A of dQ),
//   double-buffered; one named barrier per step between the consumer warpgroups
//   dQ slice c += dS K      wgmma SS (dS K-major, K MN-major; kBlockM = 64: columns split
//                           between the warpgroups, 128: rows split), then
//   dQ mode kDqAtomic: red.global.add.v2.f32 into the float32 dq_accum (bwd_postprocess converts);
//   kDqTile / kDqTileOrdered: the slice goes to shared memory in the accumulators' own order
//   ("dq_full" mbarrier) and a producer warp per slice (warps 2, 3) adds it to a tile-contiguous
//   dq_accum with one bulk reduce (cp.reduce.async.bulk): one L2 operation per slice instead of
//   thousands of 8-byte atomics (bwd_postprocess_tiled converts), and no wait in the consumers.
//   kDqTileOrdered adds the key tiles' slices in a fixed order (a semaphore per slice, waited on and
//   released by those warps), so dQ is bitwise reproducible. Split-D tiles (head dims 192 / 256, no
//   shared memory to spare) stage the slices in the Q / dO buffers of the ring stage just consumed.
// Split-D tiles: both warpgroups own the same 64 keys and half of the head dim each; each computes
// S^T / dP^T for half of the query rows, stores its P^T and dS^T halves into shared memory, and the
// dV / dK products take the other half from there (one named barrier per step between them).
// Causal: query tiles before the key tile's first visible row are skipped; odd
// lengths and head dims come from TMA's zero fill plus masking (P = 0 outside).
#include "../common/numeric.cuh"
#include "../common/params.cuh"
#include "../common/block_range.cuh"
#include "../common/bwd_math.cuh"
#include "wgmma.cuh"
#include "tma.cuh"
#include "pipeline.cuh"

// How a CTA's dQ slices reach global memory (see the header comment).
enum Sm90DqMode { kDqTile = 1, kDqTileOrdered = 2 };

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kDqMode_>
struct Sm90BwdTile {
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kHeadDimPad = (kHeadDim + 63) / 64 * 64;
    static constexpr int kColBlocks = kHeadDimPad / 64;
    static constexpr int kBlockM = kBlockM_;
    static constexpr int kBlockN = kBlockN_;
    // One producer warpgroup and kNWarps / 4 - 1 consumer warpgroups:
    // - two, 64 keys each (128-key tiles);
    // - split-D tiles (head dims 192 / 256): 64 keys per CTA and two consumer warpgroups that each
    //   compute S^T / dP^T of those keys for half of the query rows (kSplitSdP) and each own half of
    //   the head dim of dK, dV and dQ, so that the float32 dK/dV accumulators fit in registers;
    // - one (64 keys, 64-row query steps, head dims <= 64): a small CTA, two per SM, so that one
    //   CTA's start (K/V loads, the first step) and end (dK/dV stores) overlap the other's steps.
    static constexpr int kConsumerWGs = kNWarps_ / 4 - 1;
    static constexpr bool kSplitD = kBlockN == 64 && kConsumerWGs == 2;
    static constexpr int kCtasPerSm = kConsumerWGs == 1 ? 2 : 1;
    // dK / dV columns of one consumer warpgroup; wgmma N of one piece of a column slice (a piece
    // never starts inside a 64-column swizzle atom and runs into the next one).
    static constexpr int kKvCols = kSplitD ? kHeadDimPad / 2 : kHeadDimPad;
    static constexpr int kThreads = kNWarps_ * 32;
    static constexpr int kStages = 2;                        // launch.py mirrors this
    static constexpr int kQBytes = kBlockM * kHeadDimPad * 2;  // Q or dO tile
    static constexpr int kKVBytes = kBlockN * kHeadDimPad * 2; // K or V tile
    static constexpr int kDsBytes = kBlockM * kBlockN * 2;     // one dS buffer
    // Split-D: each consumer warpgroup computes S^T / dP^T of its half of the query rows only (32 of 64:
    // both computing all of them doubled those two GEMMs, two fifths of the step's tensor work) and
    // stores its P^T and dS^T into common shared buffers, from which the other warpgroup's dV / dK
    // products take that half (SS, MN-major A). -DCUFLASH_SM90_BWD_DUP_SDP builds the earlier form:
    // both warpgroups compute all of S^T / dP^T and each stores the whole dS into its own buffers, so
    // that they need no common barrier (-DCUFLASH_SM90_BWD_SHARED_DS there: one dS, half stored by each).
    static constexpr bool kSplitSdP = kSplitD;
    // 64 x 64 16-bit buffers per step parity: dS (common or one per warpgroup); kSplitSdP: dS and P^T.
    static constexpr int kDsCopies = kSplitD ? 2 : 1;
    // dQ slice of a consumer warpgroup: with 64-row query tiles, all rows and 1 / kConsumerWGs of the
    // columns; with 128-row tiles, 64 rows and all columns.
    static constexpr int kDqCols = kBlockM == 64 ? kHeadDimPad / kConsumerWGs : kHeadDimPad;
    static constexpr int kKvPiece = kKvCols % 64 == 0 ? kKvCols : 32;
    static constexpr int kDqPiece = kDqCols % 64 == 0 || kDqCols < 64 ? kDqCols : 32;
    // Tile dQ modes: one float32 staging slice (64 rows x kDqCols) per consumer warpgroup, in the
    // accumulator order: chunk j (registers 4j..4j+3) of thread t at float 512 j + 4 t.
    static constexpr int kDqMode = kDqMode_;
    static constexpr int kDqSliceFloats = 64 * kDqCols;
    // Split-D tiles have no shared memory left for the slices (231 KB at d=256): a warpgroup's slice
    // (64 x 128 floats) goes into the Q (warpgroup 0) or dO (1) buffer of the step's ring stage once
    // both warpgroups are done with it, and the stage is freed when the bulk reduce has read it.
    static constexpr bool kDqInRing = kSplitD;
    static constexpr int kDqStageBytes = kDqInRing ? 0 : kConsumerWGs * kDqSliceFloats * 4;
    // kv, q_full / do_full / empty per stage, dq_full / dq_empty per consumer warpgroup.
    static constexpr int kBarriers = 1 + 3 * kStages + 2 * kConsumerWGs;
    // setmaxnreg moves registers within the CTA's launch allocation (65536 / kCtasPerSm / threads each):
    // 128 * (24 + 2 * 240) <= 384 * 168, and 128 * (24 + 232) == 256 * 128.
    static constexpr int kProducerRegs = 24;
    static constexpr int kConsumerRegs = kConsumerWGs == 1 ? 232 : 240;
    // Bytes after the 1024-byte aligned base (launch.py mirrors this).
    static constexpr int kSmemBytes = 2 * kKVBytes + 2 * kStages * kQBytes + 2 * kDsCopies * kDsBytes
                                      + kDqStageBytes + 2 * kStages * kBlockM * 4 + 8 * kBarriers;
    static_assert(kBlockM == 64 || kBlockM == 128, "query tile: 64 or 128 rows");
    static_assert((kBlockN == 128 && kConsumerWGs == 2) || kSplitD
                      || (kBlockN == 64 && kConsumerWGs == 1 && kBlockM == 64 && kHeadDimPad == 64),
                  "two consumer warpgroups of 64 keys, or of the same 64 keys and half the head dim each, "
                  "or one of 64 keys (head dims <= 64, 64-row query steps)");
    static_assert(!kSplitD || kBlockM == 64, "split-D tiles: 64-row query tiles");
    static_assert(kKvPiece <= 128 && kDqPiece <= 128, "wgmma N of one piece");
    static_assert(kDqCols % 16 == 0 && kDqCols <= 128, "dQ slice");
    static_assert(!kDqInRing || kDqSliceFloats * 4 == kQBytes, "split-D dQ slice: one Q / dO ring buffer");
};

// The ordered dQ mode stores each query tile's first slice (order 0) instead of adding it, so that the
// preprocess need not zero those sums; 0 adds it too (a negative control for the tests).
#ifndef CUFLASH_SM90_BWD_FIRST_STORE
#define CUFLASH_SM90_BWD_FIRST_STORE 1
#endif
// The unordered tile mode does the same for whichever key tile reaches a slice first: its dQ warp claims
// the slice (an atomic add on the slice's semaphore that returns 0), stores it, and once the store is
// performed adds kDqSliceReady; the others add into it after they see that flag. The preprocess then
// zeroes only the semaphores, not the float32 sums (134 MB at B=4 H=16 N=4096 D=128: about half of its
// time). The claimer waits on nothing between its claim and its store, so every wait ends. 0 adds every
// slice (a negative control for the tests; for timing, with $CUFLASH_SM90_BWD_ZERO_DQ_ACCUM=1 so that the
// preprocess zeroes the sums: cuflash/sm90.py).
#ifndef CUFLASH_SM90_BWD_CLAIM_FIRST
#ifdef CUFLASH_SM90_BWD_TRACE
#define CUFLASH_SM90_BWD_CLAIM_FIRST 0   // the trace build keeps its records in dq_semaphore (dQ is wrong)
#else
#define CUFLASH_SM90_BWD_CLAIM_FIRST 1
#endif
#endif
constexpr int kDqSliceReady = 1 << 24;   // above any count of key tiles adding into one slice
// 1: the dQ warp reads each step's semaphore one step ahead (the load's round trip hidden behind the wait for
// the consumers); a slice already stored is then added with no atomic at all, and only the others are
// claimed, after that wait. 0: every slice claimed after the wait. A claim itself must never go out
// before the slice is in shared memory: the claimer's consumers could then be held up (through the two
// warpgroups' common barriers) by its other dQ warp waiting on a CTA that waits on this claim.
#ifndef CUFLASH_SM90_BWD_CLAIM_EARLY
#define CUFLASH_SM90_BWD_CLAIM_EARLY 1
#endif

// dst[0 .. bytes) = src[0 .. bytes), one bulk copy of the async proxy.
__device__ __forceinline__ void bulk_store(float* dst, u32 src, u32 bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(src), "r"(bytes) : "memory");
    bulk_commit_group();
}
// dst[0 .. bytes) += src[0 .. bytes) (float32), one bulk operation of the async proxy.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, u32 src, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 ::"l"(dst), "r"(src), "r"(bytes) : "memory");
    bulk_commit_group();
}
__device__ __forceinline__ void fence_proxy_async_global() {
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
__device__ __forceinline__ int semaphore_load_acquire(const int* sem) {
    int seen;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(sem) : "memory");
    return seen;
}
// Spins until *sem == value (acquire: later reads see the writes released before it).
__device__ __forceinline__ void semaphore_wait(const int* sem, int value) {
    while (semaphore_load_acquire(sem) != value) {}
}
__device__ __forceinline__ void semaphore_release_add(int* sem, int value = 1) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(sem), "r"(value) : "memory");
}
// *sem += 1, returning the old value (acquire: if it holds a released flag, its writes are seen).
__device__ __forceinline__ int semaphore_acquire_add(int* sem) {
    int old;
    asm volatile("atom.acquire.gpu.global.add.s32 %0, [%1], 1;\n" : "=r"(old) : "l"(sem) : "memory");
    return old;
}
// Spins until *sem >= value (acquire).
__device__ __forceinline__ void semaphore_wait_at_least(const int* sem, int value) {
    while (semaphore_load_acquire(sem) < value) {}
}

// L2 budget of one section of the 1-D grid (bwd_block), in MB: about one wave of CTAs at head dim 64
// (4 groups of 32 key tiles at N = 4096). The ordered kernel above head dim 64 keeps wider sections:
// its CTAs wait on the key tiles before them, and at d = 256 (8 MB groups of 64 key tiles) one group
// per section is half a wave and a longer chain of such waits (8.2 -> 8.5 ms, H100).
#ifndef CUFLASH_SM90_BWD_SECTION_MB
#define CUFLASH_SM90_BWD_SECTION_MB 8
#endif
// Causal, the last section is wider (bwd_block): up to CUFLASH_SM90_BWD_CAUSAL_TAIL_GROUPS groups within
// CUFLASH_SM90_BWD_CAUSAL_TAIL_MB. Backward TFLOP/s off / on (H100, 2026-11-24, six alternating rounds):
// B=4 H=16 N=4096 D=128 bf16 535 / 551, D=96 411 / 423, D=192 356 / 363, D=256 396 / 402, D=64 fp16
// 447 / 447; B=2 N=8192 D=128 574 / 590; B=8 N=2048 D=128 fp16 444 / 452; B=1 N=16384 605 / 605.
// Every group in one section (64 at N=4096) thrashed the L2: D=128 293, D=256 137.
#ifndef CUFLASH_SM90_BWD_CAUSAL_TAIL_GROUPS
#define CUFLASH_SM90_BWD_CAUSAL_TAIL_GROUPS 12
#endif
#ifndef CUFLASH_SM90_BWD_CAUSAL_TAIL_MB
#define CUFLASH_SM90_BWD_CAUSAL_TAIL_MB 48
#endif
#ifndef CUFLASH_SM90_BWD_ORDERED_SECTION_MB
#define CUFLASH_SM90_BWD_ORDERED_SECTION_MB 24
#endif
// Causal, the ordered kernel's key tiles wait on the next one (a step ahead), not on a chain across the
// group, and a narrower section keeps more of the L2 for it. Deterministic backward TFLOP/s, 24 / 12 MB
// (H100, 2026-11-24, B=4 H=16 N=4096): D=256 fp16 342 / 356, D=128 fp16 478 / 495, D=96 bf16 359 / 384,
// D=192 bf16 328 / 327, B=1 N=16384 D=128 569 / 580 (default mode: 395, 517, 409, 352, 620).
#ifndef CUFLASH_SM90_BWD_ORDERED_CAUSAL_SECTION_MB
#define CUFLASH_SM90_BWD_ORDERED_CAUSAL_SECTION_MB 12
#endif

// The steps of key tile n_block: the n_m query tiles from m_begin on (causal: from its diagonal) of
// each query head of its GQA group, n_iter in all; step i takes query head head0 + i / n_m and query
// tile steps.query_tile(i). Rotated, each key tile starts at its own query tile and wraps around, so that
// the key tiles running side by side add into different dQ tiles at a time rather than all into the same
// one, and (claimed slices, CUFLASH_SM90_BWD_CLAIM_FIRST) the key tiles after the first reach a tile a step
// or more after it, when its store is done. Applies to the unordered, non-causal tiles.
// -DCUFLASH_SM90_BWD_ROTATE: 0 off; 1 the 128-row tiles only (head dims <= 64), start n_block mod n_m
// (H100, 2026-11-24: B=16 N=1024 D=64 fp16 318 -> 324; the 64-row tiles lost then, D=128 N=1024 412 -> 404);
// 2 all tiles, n_block mod n_m; 3 (default) all tiles, start n_block * n_m / n_blocks, so that the
// key tiles reaching one query tile are evenly spaced in steps (2 apart at seqlen_q = seqlen_k with
// 64-row tiles). With the claimed slices, backward TFLOP/s (H100, 2026-11-24, A/B in one run) 1 / 3:
// B=4 N=4096 D=128 bf16 589 / 615 (dQ sums zeroed by the preprocess, not rotated: 606), D=64 fp16 499 / 511.
#ifndef CUFLASH_SM90_BWD_ROTATE
#define CUFLASH_SM90_BWD_ROTATE 3
#endif
template <int kBlockM, int kBlockN, bool kIsCausal, bool kRotate>
struct BwdSteps {
    int n_block, m_begin, n_m, n_iter, rotation;
    __device__ __forceinline__ BwdSteps(int n_block_, int seqlen_q, int seqlen_k, int heads_per_kv)
        : n_block(n_block_) {
        m_begin = BlockRange<kBlockM, kBlockN, kIsCausal>::m_block_min(n_block, seqlen_q, seqlen_k);
        const int m_end = ceil_div(seqlen_q, kBlockM);
        n_m = m_end > m_begin ? m_end - m_begin : 0;
        n_iter = n_m * heads_per_kv;
        rotation = 0;
        if (kRotate && n_m > 0) {
            rotation = CUFLASH_SM90_BWD_ROTATE == 3
                ? static_cast<int>(static_cast<unsigned>(n_block * n_m) / static_cast<unsigned>(ceil_div(seqlen_k, kBlockN)))
                : n_block % n_m;
        }
    }
    __device__ __forceinline__ int query_tile(int i) const {
        int t = i % n_m;
        if (kRotate) {
            t += rotation;
            if (t >= n_m) t -= n_m;
        }
        return m_begin + t;
    }
};

struct BwdBlock {
    int n_block, head_kv, batch;
};

// -DCUFLASH_SM90_BWD_TRACE (scripts/bwd_trace.py): per CTA, the SM and clock64 stamps of its phases in
// dq_semaphore (as u64[16]: 0-7 phases, 8-14 the end of the first 7 steps, 15 the kernel's entry, before
// the CTA's coordinates are computed); a diagnostic build only.
#ifdef CUFLASH_SM90_BWD_TRACE
__device__ __forceinline__ void bwd_trace(const BwdParams& p, int slot, unsigned long long value) {
    const i64 cta = blockIdx.x + static_cast<i64>(gridDim.x) * (blockIdx.y + static_cast<i64>(gridDim.y) * blockIdx.z);
    reinterpret_cast<unsigned long long*>(p.dq_semaphore)[cta * 16 + slot] = value;
}
#define CUFLASH_BWD_TRACE(slot, value) bwd_trace(p, slot, value)
#else
#define CUFLASH_BWD_TRACE(slot, value)
#endif

// The (key tile, kv head, batch) of this CTA. A 1-D grid (causal and ordered-dQ kernels always; the
// others with 128-row query tiles, launch.py: bwd_dkdv_grid) is walked key-tile-major within sections
// of (kv head, batch) groups whose Q, dO, K and V fit in CUFLASH_SM90_BWD_SECTION_MB of L2. Causal (not ordered):
// heaviest first -- key tile n sees the query tiles from its diagonal on, so low n carry the most
// work -- so that the last wave holds short CTAs only. Ordered dQ: a query tile's slices are added in
// ascending key-tile order (causal: from the diagonal key tile down, the order in which the CTAs
// reach it), and CTAs start in that order too (each waits only on CTAs launched before it, so all
// make progress). Otherwise the grid is (key tile, kv head, batch); with one group both readings agree.
template <int kBlockN, int kHeadDim, bool kIsCausal, int kDqMode>
__device__ __forceinline__ BwdBlock bwd_block(const BwdParams& p) {
    if (kIsCausal || kDqMode == kDqTileOrdered || (gridDim.y == 1 && gridDim.z == 1)) {
        // Unsigned 32-bit divisions and one float division: every CTA pays this chain before its first
        // TMA load. With a 64-bit division and signed ones, kernel entry to the CTA's start took 1555
        // cycles at B=16 N=1024 D=64, now 1266 (607 on the 3-D grid; scripts/bwd_trace.py).
        const unsigned n_blocks = ceil_div(p.seqlen_k, kBlockN);
        const unsigned heads_kv = static_cast<unsigned>(p.heads_q) / static_cast<unsigned>(p.heads_per_kv);
        const unsigned groups = p.batch * heads_kv;
        // Whole groups per section: any value >= 1 covers the grid (n_blocks x groups CTAs) exactly once,
        // so float rounding only has to be the same in every thread, which it is.
        constexpr float kSectionBytes = static_cast<float>((kDqMode == kDqTileOrdered && kHeadDim > 64
                                                                ? (kIsCausal ? CUFLASH_SM90_BWD_ORDERED_CAUSAL_SECTION_MB
                                                                             : CUFLASH_SM90_BWD_ORDERED_SECTION_MB)
                                                                : CUFLASH_SM90_BWD_SECTION_MB) << 20);
        const float group_bytes = 4.f * kHeadDim * (static_cast<float>(p.seqlen_q) * p.heads_per_kv + p.seqlen_k);
        const unsigned per_section = static_cast<unsigned>(
            fminf(static_cast<float>(groups), fmaxf(1.f, floorf(__fdividef(kSectionBytes, group_bytes)))));
        const unsigned linear = blockIdx.x;
        unsigned first_group, section_groups;
        // Causal (not ordered): the last groups (up to CUFLASH_SM90_BWD_CAUSAL_TAIL_GROUPS of them, within
        // CUFLASH_SM90_BWD_CAUSAL_TAIL_MB) share one section, so that the last waves take the heaviest key
        // tiles of all of them first: fewer SMs idle at the end while a late heavy tile finishes.
        constexpr unsigned kTailMax = kIsCausal && kDqMode != kDqTileOrdered ? CUFLASH_SM90_BWD_CAUSAL_TAIL_GROUPS : 0;
        const unsigned tail_fit = static_cast<unsigned>(
            fminf(static_cast<float>(min(kTailMax, groups)),
                  floorf(__fdividef(static_cast<float>(CUFLASH_SM90_BWD_CAUSAL_TAIL_MB << 20), group_bytes))));
        const unsigned tail = tail_fit > per_section ? tail_fit : 0;
        if (linear >= (groups - tail) * n_blocks) {
            first_group = groups - tail;
            section_groups = tail;
        } else {
            first_group = linear / (per_section * n_blocks) * per_section;
            section_groups = min(per_section, groups - tail - first_group);
        }
        const unsigned within = linear - first_group * n_blocks;
        // Ordered dQ: key tiles in rank order (ascending; causal: from the last down), so that a CTA only
        // waits on CTAs launched before it, and key-tile-major inside a section, so that one wave holds
        // a few key tiles of many groups (a chain of ~132 / per_section links per wave, not n_blocks).
        const unsigned n_order = within / section_groups;
        const unsigned group = first_group + (within - n_order * section_groups);
        const unsigned batch = group / heads_kv;
        const int n_block = kDqMode == kDqTileOrdered && kIsCausal ? static_cast<int>(n_blocks - 1 - n_order)
                                                                   : static_cast<int>(n_order);
        return {n_block, static_cast<int>(group - batch * heads_kv), static_cast<int>(batch)};
    } else {
        return {static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z)};
    }
}

template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, bool kIsCausal, int kDqMode>
__device__ __forceinline__ void bwd_body(const BwdParams& p, const TmaDesc& tma_q, const TmaDesc& tma_k,
                                         const TmaDesc& tma_v, const TmaDesc& tma_do) {
    using Tile = Sm90BwdTile<kHeadDim, kBlockM, kBlockN, kNWarps, kDqMode>;
    using Range = BlockRange<kBlockM, kBlockN, kIsCausal>;
    constexpr int kStages = Tile::kStages;
    constexpr int kPad = Tile::kHeadDimPad;
    constexpr int kDqCols = Tile::kDqCols;

    extern __shared__ char smem_raw[];
    const u32 sK = (smem_u32(smem_raw) + 1023) & ~1023u;
    const u32 sV = sK + Tile::kKVBytes;
    const u32 sQ = sV + Tile::kKVBytes;                       // [kStages]
    const u32 sdO = sQ + kStages * Tile::kQBytes;             // [kStages]
    const u32 sdS = sdO + kStages * Tile::kQBytes;            // [2][kDsCopies]
    const u32 sDqStage = sdS + 2 * Tile::kDsCopies * Tile::kDsBytes;  // [kConsumerWGs] dQ slices (tile modes)
    const u32 sStat = sDqStage + Tile::kDqStageBytes;  // lse2[kStages][kBlockM], delta[kStages][kBlockM]
    const u32 bars = sStat + 2 * kStages * kBlockM * 4;
    float* stat_ptr = reinterpret_cast<float*>(smem_raw + (sStat - smem_u32(smem_raw)));
    const u32 bar_kv = bars;
    auto bar_q_full = [&](int s) { return bars + 8 * (1 + s); };
    auto bar_do_full = [&](int s) { return bars + 8 * (1 + kStages + s); };
    auto bar_empty = [&](int s) { return bars + 8 * (1 + 2 * kStages + s); };
    // Tile dQ modes: a consumer warpgroup's slice is in shared memory / has been read by the bulk reduce.
    auto bar_dq_full = [&](int c) { return bars + 8 * (1 + 3 * kStages + c); };
    auto bar_dq_empty = [&](int c) { return bars + 8 * (1 + 3 * kStages + Tile::kConsumerWGs + c); };

    if (threadIdx.x == 0) CUFLASH_BWD_TRACE(15, clock64());   // kernel entry
    const BwdBlock blk = bwd_block<kBlockN, kHeadDim, kIsCausal, kDqMode>(p);
    const int n_block = blk.n_block;
    const int head_kv = blk.head_kv;
    const int batch = blk.batch;
    const int n0 = n_block * kBlockN;
    constexpr bool kRotate = CUFLASH_SM90_BWD_ROTATE && kDqMode != kDqTileOrdered && !kIsCausal
                             && (kBlockM == 128 || (CUFLASH_SM90_BWD_ROTATE >= 2 && CUFLASH_SM90_BWD_CLAIM_FIRST));
    using Steps = BwdSteps<kBlockM, kBlockN, kIsCausal, kRotate>;
    const Steps steps(n_block, p.seqlen_q, p.seqlen_k, p.heads_per_kv);
    const int head0 = head_kv * p.heads_per_kv;
    // Broadcast from lane 0 so that ptxas knows the warpgroup index is warp-uniform: shared-memory
    // addresses and wgmma descriptors built from it then stay in uniform registers (no R2UR per wgmma).
    const int wg = __shfl_sync(0xffffffff, static_cast<int>(threadIdx.x) / 128, 0);

    if (threadIdx.x == 0) {
        mbar_init(bar_kv, 1);
#pragma unroll
        for (int s = 0; s < kStages; ++s) {
            mbar_init(bar_q_full(s), 1);   // the TMA thread (Q and lse2, dO and delta)
            mbar_init(bar_do_full(s), 1);
            // Freed by every consumer thread, or (dQ slices in the ring) by the two dQ warps.
            mbar_init(bar_empty(s), Tile::kDqInRing ? Tile::kConsumerWGs : Tile::kConsumerWGs * 128);
        }
#pragma unroll
        for (int c = 0; c < Tile::kConsumerWGs; ++c) {
            mbar_init(bar_dq_full(c), 128);
            mbar_init(bar_dq_empty(c), 1);
        }
        fence_barrier_init();
    }
    __syncthreads();
#ifdef CUFLASH_SM90_BWD_TRACE
    if (threadIdx.x == 0) {
        CUFLASH_BWD_TRACE(0, sm_id());
        CUFLASH_BWD_TRACE(1, clock64());
        CUFLASH_BWD_TRACE(7, steps.n_iter);
    }
#endif

    if (wg == 0) {
        setmaxnreg_dec<Tile::kProducerRegs>();
        const int warp = threadIdx.x / 32;
        if (warp == 0 && threadIdx.x == 0 && steps.n_iter > 0) {
            tma_prefetch_desc(&tma_q);
            tma_prefetch_desc(&tma_k);
            tma_prefetch_desc(&tma_v);
            tma_prefetch_desc(&tma_do);
            mbar_arrive_expect_tx(bar_kv, 2 * Tile::kKVBytes);
#pragma unroll
            for (int cb = 0; cb < Tile::kColBlocks; ++cb) {
                tma_load_4d(sK + cb * kBlockN * 128, &tma_k, bar_kv, cb * 64, n0, head_kv, batch);
                tma_load_4d(sV + cb * kBlockN * 128, &tma_v, bar_kv, cb * 64, n0, head_kv, batch);
            }
            for (int i = 0; i < steps.n_iter; ++i) {
                const int head = head0 + i / steps.n_m;
                const int m0 = steps.query_tile(i) * kBlockM;
                const int stage = i % kStages;
                mbar_wait(bar_empty(stage), ((i / kStages) & 1) ^ 1);
                const u32 q_dst = sQ + stage * Tile::kQBytes, do_dst = sdO + stage * Tile::kQBytes;
                // The query tile's lse2 and delta rows (BwdParams.stats) with its Q and dO, as one more bulk copy
                // each: no warp spends registers and a round trip per step on them.
                constexpr u32 kStatBytes = kBlockM * 4;
                // 32-bit: (batch * heads_q * 2 + 1) * stat_rows < 2^32 (api.py checks it); a 64-bit index spills.
                const float* stats = p.stats + ((static_cast<unsigned>(batch) * p.heads_q + head) * 2u * p.stat_rows + m0);
                mbar_arrive_expect_tx(bar_q_full(stage), Tile::kQBytes + kStatBytes);
#pragma unroll
                for (int cb = 0; cb < Tile::kColBlocks; ++cb)
                    tma_load_4d(q_dst + cb * kBlockM * 128, &tma_q, bar_q_full(stage), cb * 64, m0, head, batch);
                bulk_load(sStat + stage * kBlockM * 4, stats, kStatBytes, bar_q_full(stage));
                mbar_arrive_expect_tx(bar_do_full(stage), Tile::kQBytes + kStatBytes);
#pragma unroll
                for (int cb = 0; cb < Tile::kColBlocks; ++cb)
                    tma_load_4d(do_dst + cb * kBlockM * 128, &tma_do, bar_do_full(stage), cb * 64, m0, head, batch);
                bulk_load(sStat + (kStages + stage) * kBlockM * 4, stats + p.stat_rows, kStatBytes, bar_do_full(stage));
            }
        } else if (kDqMode != 0 && warp >= 2 && warp < 2 + Tile::kConsumerWGs && (threadIdx.x & 31) == 0
                   && steps.n_iter > 0) {
            // Bulk reduce of consumer warpgroup cw's dQ slice of each query tile (ordered mode: after
            // the key tiles before this one, and released when its writes are performed).
            const int cw = warp - 2;
            const int m_blocks = ceil_div(p.seqlen_q, kBlockM);
            // (batch, head, query tile) of step i; 32 bits (tiles of 64 rows: < 2^31 while batch * heads_q *
            // seqlen_q < 2^37), which keeps this 24-register warp from spilling.
            auto slice_index = [&](int i) {
                const int head = head0 + i / steps.n_m;
                return static_cast<int>((static_cast<unsigned>(batch) * p.heads_q + head) * m_blocks + steps.query_tile(i));
            };
            constexpr bool kClaim = kDqMode == kDqTile && CUFLASH_SM90_BWD_CLAIM_FIRST;
            // Unordered: a slice's semaphore is read a step ahead (CUFLASH_SM90_BWD_CLAIM_EARLY); if not yet
            // stored it is claimed once the slice is in shared memory, and a stored slice's flag is released
            // as soon as the store is performed, before any wait on another CTA's flag: no wait is circular.
            int tile_next = slice_index(0);
            // (Not the causal split-D tiles: the value read ahead spills this 24-register warp at D=192.)
            constexpr bool kClaimEarly = kClaim && !(kIsCausal && Tile::kDqInRing);
            int seen_next = kClaimEarly ? semaphore_load_acquire(p.dq_semaphore + tile_next * Tile::kConsumerWGs + cw) : 0;
            for (int i = 0; i < steps.n_iter; ++i) {
                const u32 dq_stage = Tile::kDqInRing ? (cw == 0 ? sQ : sdO) + (i % kStages) * Tile::kQBytes
                                                     : sDqStage + cw * Tile::kDqSliceFloats * 4;
                const int tile = tile_next;
                float* dst = p.dq_accum + static_cast<i64>(tile) * (kBlockM * kPad) + cw * Tile::kDqSliceFloats;
                int* sem = p.dq_semaphore + tile * Tile::kConsumerWGs + cw;
                mbar_wait(bar_dq_full(cw), i & 1);
                // Slices in the ring: the warpgroup stages its next slice only after this (dq_empty), so that
                // it cannot complete two dq_full phases before this warp polls (a parity wait would then
                // miss one and hang: the next stage waits on this warp to free the ring). Staging buffers
                // have the handshake already: dq_empty below, once the reduce has read the slice.
                if constexpr (Tile::kDqInRing) mbar_arrive(bar_dq_empty(cw));
                const int seen = kClaimEarly && seen_next >= kDqSliceReady ? seen_next
                               : kClaim ? semaphore_acquire_add(sem) : 0;
                // Ordered: ascending key tiles, or (causal) down from the last key tile this query tile sees.
                // The first (order 0) stores its slice, so that the preprocess need not zero dq_accum.
                const int order = kDqMode != kDqTileOrdered ? -1
                                : kIsCausal ? Range::n_block_max(steps.query_tile(i), p.seqlen_q, p.seqlen_k) - 1 - n_block
                                            : n_block;
                bool first = CUFLASH_SM90_BWD_FIRST_STORE && order == 0;
                if constexpr (kDqMode == kDqTileOrdered) {
                    semaphore_wait(sem, order);
                    fence_proxy_async_global();
                } else if constexpr (kClaim) {
                    first = seen == 0;
                    if (!first) {
                        if (seen < kDqSliceReady) semaphore_wait_at_least(sem, kDqSliceReady);
                        fence_proxy_async_global();
                    }
                }
                if (first) bulk_store(dst, dq_stage, Tile::kDqSliceFloats * 4);
                else bulk_reduce_add_f32(dst, dq_stage, Tile::kDqSliceFloats * 4);
                bulk_wait_read();
                mbar_arrive(Tile::kDqInRing ? bar_empty(i % kStages) : bar_dq_empty(cw));
                if (kDqMode == kDqTileOrdered || (kClaim && first)) {
                    bulk_wait_all();
                    fence_proxy_async_global();
                    semaphore_release_add(sem, kDqMode == kDqTileOrdered ? 1 : kDqSliceReady);
                }
                if (i + 1 < steps.n_iter) {
                    tile_next = slice_index(i + 1);
                    if (kClaimEarly) seen_next = semaphore_load_acquire(p.dq_semaphore + tile_next * Tile::kConsumerWGs + cw);
                }
            }
            // Each reduce has read its slice (wait_group.read above), so the CTA's shared memory may go;
            // the adds themselves complete before the grid does, so the CTA need not wait for them
            // (as a TMA store's epilogue does not).
            if (cw == 0) CUFLASH_BWD_TRACE(6, clock64());
        }
    } else {
        setmaxnreg_inc<Tile::kConsumerRegs>();
        // The steps again (shadowing the CTA's), from an opaque copy of seqlen_q so that ptxas cannot
        // hoist them above setmaxnreg: a value live across setmaxnreg may go to local memory (128-row tiles).
        int seqlen_q_opaque = p.seqlen_q;
        asm volatile("" : "+r"(seqlen_q_opaque));
        const Steps steps(n_block, seqlen_q_opaque, p.seqlen_k, p.heads_per_kv);
        const int cw = wg - 1;
        const int lane = threadIdx.x & 31;
        const int warp = (threadIdx.x >> 5) & 3;
        const int g = lane >> 2, t4 = lane & 3;
        constexpr bool kSplitD = Tile::kSplitD;
        constexpr int kKvCols = Tile::kKvCols, kKvPiece = Tile::kKvPiece, kDqPiece = Tile::kDqPiece;
        const int key_wg = kSplitD ? 0 : cw;             // 64-key block of this warpgroup
        const int key_local = key_wg * 64 + warp * 16 + g;   // this thread's key rows: key_local (+ 8)
        const int kv_col0 = kSplitD ? cw * kKvCols : 0;      // this warpgroup's dK / dV columns
        const int dq_col0 = kBlockM == 64 ? cw * kDqCols : 0;   // this warpgroup's dQ columns
        const int dq_row0 = kBlockM == 64 ? 0 : cw * 64;        // and rows
        // Query columns of this warpgroup's S^T / dP^T: all kBlockM, or (kSplitSdP) its half from q_off on.
        constexpr bool kSplitSdP = Tile::kSplitSdP;
        constexpr int kQCols = kSplitSdP ? kBlockM / 2 : kBlockM;
        const int q_off = kSplitSdP ? cw * kQCols : 0;

        float acc_dk[kKvCols / 2], acc_dv[kKvCols / 2];
#pragma unroll
        for (int i = 0; i < kKvCols / 2; ++i) { acc_dk[i] = 0.f; acc_dv[i] = 0.f; }

        if (steps.n_iter > 0) mbar_wait(bar_kv, 0);
        if (threadIdx.x == 128) CUFLASH_BWD_TRACE(2, clock64());
        for (int i = 0; i < steps.n_iter; ++i) {
            const int head = head0 + i / steps.n_m;
            const int m_block = steps.query_tile(i);
            const int m0 = m_block * kBlockM;
            const int stage = i % kStages;
            const u32 parity = (i / kStages) & 1;
            const u32 q_src = sQ + stage * Tile::kQBytes, do_src = sdO + stage * Tile::kQBytes;
            const u32 ds_buf = sdS + ((i & 1) * Tile::kDsCopies + 0)
                                         * Tile::kDsBytes;
            const u32 p_buf = ds_buf + Tile::kDsBytes;   // kSplitSdP: the common P^T

            // S^T = K_c Q^T and dP^T = V_c dO^T (rows: this warpgroup's 64 keys; columns: its kQCols queries).
            float acc_s[kQCols / 2], acc_dp[kQCols / 2];
            // acc = this warpgroup's 64 rows of key_tile (K or V) times query_tile^T (Q or dO), both K-major.
            auto key_query_product = [&](float (&acc)[kQCols / 2], u32 key_tile, u32 query_tile) {
                wgmma_ss_rows_product<Tag, kQCols, kPad, kBlockN, kBlockM>(acc, key_tile + key_wg * 64 * 128,
                                                                           query_tile + q_off * 128);
            };
            mbar_wait(bar_q_full(stage), parity);
            key_query_product(acc_s, sK, q_src);
            mbar_wait(bar_do_full(stage), parity);
            key_query_product(acc_dp, sV, do_src);
            // kStatsEarly: lse2 / delta of this thread's query columns read while S^T / dP^T run, not after the
            // wait, where their shared-memory latency sat at the head of the P^T / dS^T chain (ncu: 40 % of the
            // consumer warps' stall cycles on shared-memory scoreboards). H100 A/B (NOTES, fifteenth session),
            // backward TFLOP/s: D=128 bf16 600 -> 608, fp16 585 -> 592, D=96 463 -> 473; the causal rows lost
            // about 1 % (D=128 517 -> 512, D=256 381 -> 378) and keep the late reads; 128-row query steps (64
            // registers of them) spill with it. -DCUFLASH_SM90_BWD_STATS_LATE: after the wait everywhere.
            constexpr bool kStatsEarly = kQCols <= 64 && !kIsCausal;
            const float* lse2_s = stat_ptr + stage * kBlockM;
            const float* delta_s = stat_ptr + (kStages + stage) * kBlockM;
            float2 lse2_v[kQCols / 8], delta_v[kQCols / 8];
            auto load_stats = [&](int j) {
                lse2_v[j] = *reinterpret_cast<const float2*>(lse2_s + q_off + 8 * j + 2 * t4);
                delta_v[j] = *reinterpret_cast<const float2*>(delta_s + q_off + 8 * j + 2 * t4);
            };
            if constexpr (kStatsEarly) {
#pragma unroll
                for (int j = 0; j < kQCols / 8; ++j) load_stats(j);
            }
            wgmma_wait<0>();
            fence_operand(acc_s);
            fence_operand(acc_dp);
            if (threadIdx.x == 128 && i == 0) CUFLASH_BWD_TRACE(3, clock64());

            // P^T and dS^T. Register 4j + e: key key_local + 8 (e >> 1), query m0 + q_off + 8j + 2 t4 + (e & 1).
            // Masked scores -> -inf on the tiles that need it (P = exp2(-inf - lse2) = 0: lse2 is never
            // -inf), so that the loop below carries no per-element test.
            if (Range::needs_mask(m_block, n_block, p.seqlen_q, p.seqlen_k)) {
#pragma unroll
                for (int j = 0; j < kQCols / 8; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        if (!key_visible<kIsCausal>(m0 + q_off + 8 * j + 2 * t4 + (e & 1), n0 + key_local + 8 * (e >> 1),
                                                    p.seqlen_q, p.seqlen_k))
                            acc_s[4 * j + e] = -CUFLASH_INF;
            }
#pragma unroll
            for (int j = 0; j < kQCols / 8; ++j) {
                if constexpr (!kStatsEarly) load_stats(j);
                const float2 l2 = lse2_v[j], dl = delta_v[j];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float pr = bwd_prob(acc_s[4 * j + e], p.scale_log2, (e & 1) ? l2.y : l2.x);
                    acc_dp[4 * j + e] = pr * (acc_dp[4 * j + e] - ((e & 1) ? dl.y : dl.x));
                    acc_s[4 * j + e] = pr;
                }
            }
            // A-register fragments of P^T and dS^T (k16 step kk = query columns q_off + 16kk ..+ 15).
            u32 pa[kQCols / 16][4], dsa[kQCols / 16][4];
#pragma unroll
            for (int kk = 0; kk < kQCols / 16; ++kk)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    pa[kk][r] = ElemTraits<Tag>::pack2(acc_s[8 * kk + 2 * r], acc_s[8 * kk + 2 * r + 1]);
                    dsa[kk][r] = ElemTraits<Tag>::pack2(acc_dp[8 * kk + 2 * r], acc_dp[8 * kk + 2 * r + 1]);
                }
            // dS -> shared memory, [query][key] K-major for the dQ product: this warpgroup's keys are
            // 64-column block key_wg; the 8 keys kl of chunk kl / 8 of query row m are 16 bytes at
            // m * 128 + ((kl / 8) ^ (m % 8)) * 16. dsa[kk][q] is the 8 x 8 (key, query) block
            // (keys + 8 (q & 1), queries 16 kk + 8 (q >> 1)); one transposing stmatrix per k16 step
            // stores the four (a single instruction instead of 32 two-byte stores per thread).
            // Split-D: each warpgroup stores its query half of dS and of P^T into the common buffers
            // (kSplitSdP); or, both holding all of dS, each stores all of it into its own buffer
            // (kDsCopies = 2), or warpgroup cw stores the query steps kk % 2 == cw of the common one.
            // Causal 128-row query tiles keep two-byte stores: stmatrix, which saves the non-causal step about
            // 130 instructions a warp, measured slower there (sm90/NOTES.md).
            if constexpr (kBlockM == 64 || !kIsCausal) {
                const u32 ds_base = ds_buf + key_wg * kBlockM * 128;
                const int q = lane >> 3, row = lane & 7;             // this lane's block and row
                const int kchunk = 2 * warp + (q & 1);               // (key_local % 64) / 8 of block q
#pragma unroll
                for (int kk = 0; kk < kQCols / 16; ++kk) {
                    const int m = q_off + 16 * kk + 8 * (q >> 1) + row;      // m % 8 == row
                    stmatrix_x4_trans(ds_base + m * 128 + ((kchunk ^ row) << 4), dsa[kk][0], dsa[kk][1], dsa[kk][2],
                                      dsa[kk][3]);
                    if constexpr (kSplitSdP)
                        stmatrix_x4_trans(p_buf + m * 128 + ((kchunk ^ row) << 4), pa[kk][0], pa[kk][1], pa[kk][2],
                                          pa[kk][3]);
                }
            } else {
                char* ds_ptr = smem_raw + (ds_buf + key_wg * kBlockM * 128 - smem_u32(smem_raw));
#pragma unroll
                for (int kk = 0; kk < kBlockM / 16; ++kk)
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const int m = 16 * kk + 8 * (r >> 1) + 2 * t4;      // query of the low half
                        const int kchunk = 2 * warp + (r & 1);              // (key_local % 64) / 8
                        const u32 w = dsa[kk][r];
                        *reinterpret_cast<u16*>(ds_ptr + m * 128 + ((kchunk ^ (m & 7)) << 4) + g * 2) =
                            static_cast<u16>(w & 0xffff);
                        *reinterpret_cast<u16*>(ds_ptr + (m + 1) * 128 + ((kchunk ^ ((m + 1) & 7)) << 4) + g * 2) =
                            static_cast<u16>(w >> 16);
                    }
            }
            fence_proxy_async_smem();

            // kSplitSdP: the other warpgroup's query half of P^T and dS^T is in shared memory once it passes
            // here. Passing it also means that the other warpgroup finished step i - 1 (every wgmma waited
            // for), whose buffers (the other parity) this one overwrites at step i + 1: no race.
            if constexpr (kSplitSdP) named_barrier_sync(1, Tile::kConsumerWGs * 128);

            // dV += P^T dO, dK += dS^T Q (B operands MN-major: k16 step = 16 query rows). A: this warpgroup's
            // P^T / dS^T fragments over its query steps; kSplitSdP: then the other half's from shared
            // memory, stored [query][key] (so an MN-major A: 8-query row groups 1024 bytes apart).
            wgmma_fence();
            // Column c of the B tile: 64-column block c / 64 (kBlockM * 128 bytes apart), byte (c % 64) * 2.
            auto kv_product = [&](float (&acc)[kKvCols / 2], const u32 (&frag)[kQCols / 16][4], u32 b_tile,
                                  u32 other_a) {
#pragma unroll
                for (int pc = 0; pc < kKvCols / kKvPiece; ++pc) {
                    const int col = kv_col0 + pc * kKvPiece;
                    auto& d = *reinterpret_cast<float(*)[kKvPiece / 2]>(acc + pc * (kKvPiece / 2));
                    const u32 b_cols = b_tile + (col / 64) * kBlockM * 128 + (col % 64) * 2;
                    const SmemDesc<> b_desc(b_cols, kBlockM * 128, 1024);
#pragma unroll
                    for (int kk = 0; kk < kQCols / 16; ++kk)
                        WgmmaRS<Tag, kKvPiece>::template run<true>(d, frag[kk], b_desc.at((q_off + 16 * kk) * 128), 1);
                    if constexpr (kSplitSdP) {
                        const int other = kQCols - q_off;   // the other warpgroup's first query
                        const SmemDesc<> a_desc(other_a, 64 * 128, 1024);
#pragma unroll
                        for (int kk = 0; kk < kQCols / 16; ++kk) {
                            const int q = other + 16 * kk;
                            WgmmaSS<Tag, kKvPiece>::template run<true, true>(d, a_desc.at(q * 128), b_desc.at(q * 128), 1);
                        }
                    }
                }
            };
            // kDqEarly: dV, then dQ, then dK, as three groups, so that the dQ slice is written to shared
            // memory while dK runs (the tensor cores were idle while it was, after a wait for all three).
            // H100 A/B (sm90/NOTES.md, fourteenth session), backward TFLOP/s: D=128 bf16 N=4096 569 -> 589,
            // causal 485 -> 513, D=96 429 -> 461, D=64 fp16 467 -> 488. -DCUFLASH_SM90_BWD_DQ_EARLY=0: off.
            constexpr bool kDqEarly = !Tile::kDqInRing
                                      && !kSplitSdP && kPad <= 192;
            kv_product(acc_dv, pa, do_src, p_buf);
            if constexpr (!kDqEarly) kv_product(acc_dk, dsa, q_src, ds_buf);
            wgmma_commit();
            // d=256, both warpgroups computing all of S^T / dP^T: the dK, dV and dQ accumulators (3 x 64
            // registers) and the P^T / dS^T fragments do not fit in 240 registers together, and ptxas would
            // then serialise every wgmma of the kernel (C7512): dV and dK complete before dQ starts. With
            // half the fragments (kSplitSdP) they fit, and dQ is issued behind them (H100 A/B: d=256 bf16
            // 408 -> 413 TFLOP/s, causal 374 -> 383).
            // Every consumer warpgroup's half of dS (kDsCopies = 2: every warp's part of this
            // warpgroup's copy) is in shared memory (kSplitSdP: synchronised before dV / dK).
            if constexpr (!kSplitSdP) named_barrier_sync(1, Tile::kConsumerWGs * 128);

            // Declared here, not before the loop: the first wgmma ignores its input, but the "+f" operands
            // would otherwise keep the last step's values live across the loop.
            float acc_dq[kDqCols / 2];
            // dQ[dq_row0 .., dq_col0 .. dq_col0 + kDqCols) = dS K (A = dS K-major; B = K MN-major, k16 = 16 keys).
            wgmma_fence();
#pragma unroll
            for (int pc = 0; pc < kDqCols / kDqPiece; ++pc) {
                const int col = dq_col0 + pc * kDqPiece;
                auto& dq = *reinterpret_cast<float(*)[kDqPiece / 2]>(acc_dq + pc * (kDqPiece / 2));
                const SmemDesc<> ds_desc(ds_buf + dq_row0 * 128, 16, 1024);
                const SmemDesc<> k_desc(sK + (col / 64) * kBlockN * 128 + (col % 64) * 2, kBlockN * 128, 1024);
#pragma unroll
                for (int kk = 0; kk < kBlockN / 16; ++kk)
                    WgmmaSS<Tag, kDqPiece>::template run<true>(dq, ds_desc.at((kk / 4) * kBlockM * 128 + (kk % 4) * 32),
                                                               k_desc.at(kk * 16 * 128), kk > 0);
            }
            wgmma_commit();
            // Slice -> shared memory (16-byte stores, each warp's 512 bytes contiguous) once the
            // previous one has been read (ring: once both warpgroups are done with this stage's Q
            // and dO), then over to this warpgroup's dQ warp.
            auto stage_dq_slice = [&]() {
                u32 dq_stage;
                mbar_wait(bar_dq_empty(cw), (i & 1) ^ 1);   // the dQ warp has taken the previous slice
                if constexpr (Tile::kDqInRing) {
                    named_barrier_sync(4, Tile::kConsumerWGs * 128);
                    dq_stage = (cw == 0 ? sQ : sdO) + (i % kStages) * Tile::kQBytes;
                } else {
                    dq_stage = sDqStage + cw * Tile::kDqSliceFloats * 4;
                }
                float* stage_ptr = reinterpret_cast<float*>(smem_raw + (dq_stage - smem_u32(smem_raw)));
#pragma unroll
                for (int j = 0; j < kDqCols / 8; ++j)
                    *reinterpret_cast<float4*>(stage_ptr + 512 * j + 4 * (threadIdx.x & 127)) =
                        make_float4(acc_dq[4 * j], acc_dq[4 * j + 1], acc_dq[4 * j + 2], acc_dq[4 * j + 3]);
                fence_proxy_async_smem();
                mbar_arrive(bar_dq_full(cw));
            };
            if constexpr (kDqEarly) {
                wgmma_fence();
                kv_product(acc_dk, dsa, q_src, ds_buf);
                wgmma_commit();
                wgmma_wait<1>();   // dV and dQ done
                fence_operand(acc_dv);
                fence_operand(acc_dq);
#pragma unroll
                for (int kk = 0; kk < kQCols / 16; ++kk) fence_operand(pa[kk]);
                stage_dq_slice();
            }
            wgmma_wait<0>();
            fence_operand(acc_dv);
            fence_operand(acc_dk);
            fence_operand(acc_dq);
#pragma unroll
            for (int kk = 0; kk < kQCols / 16; ++kk) { fence_operand(pa[kk]); fence_operand(dsa[kk]); }
            if constexpr (!Tile::kDqInRing) mbar_arrive(bar_empty(stage));

            if constexpr (!kDqEarly) {   // (kDqEarly: staged above, while dK ran)
                stage_dq_slice();
            }
            if (threadIdx.x == 128 && i < 7) CUFLASH_BWD_TRACE(8 + i, clock64());
        }

        // Epilogue: dK * softmax_scale and dV through shared memory into full 16-byte global stores.
        // Written straight from the accumulators they would be 4-byte stores, each warp touching eight
        // rows per instruction; the CTA waits on them before its SM takes the next key tile (+5 % on the
        // backward at seqlen 1024, sm90/NOTES.md eighth session). The K and V tiles are free once both
        // warpgroups' last dQ products (which read all of K) are done: dK goes where K was, dV where V
        // was, as [key][column] rows with 16-byte chunk c of row r at chunk c ^ (r % 8) (no bank
        // conflicts on either side).
        if (threadIdx.x == 128) CUFLASH_BWD_TRACE(4, clock64());
        named_barrier_sync(5, Tile::kConsumerWGs * 128);
        auto stage_tile = [&](u32 dst, const float (&acc)[kKvCols / 2], float scale) {
            char* base = smem_raw + (dst - smem_u32(smem_raw));
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = key_local + 8 * h;
#pragma unroll
                for (int j = 0; j < kKvCols / 8; ++j) {
                    const int chunk = kv_col0 / 8 + j;
                    *reinterpret_cast<u32*>(base + row * (kPad * 2) + ((chunk ^ (row % 8)) * 16) + 4 * t4) =
                        ElemTraits<Tag>::pack2(acc[4 * j + 2 * h] * scale, acc[4 * j + 2 * h + 1] * scale);
                }
            }
        };
        stage_tile(sK, acc_dk, p.softmax_scale);
        stage_tile(sV, acc_dv, 1.f);
        named_barrier_sync(5, Tile::kConsumerWGs * 128);
        constexpr int kChunks = kPad / 8;   // 16-byte chunks per row
        static_assert(kBlockN * kChunks % (Tile::kConsumerWGs * 128) == 0, "whole rounds of 16-byte chunks");
        const int ctid = threadIdx.x - 128;
        auto store_tile = [&](u32 src, u16* dst, i64 row_stride) {
            const char* base = smem_raw + (src - smem_u32(smem_raw));
#pragma unroll
            for (int it = 0; it < kBlockN * kChunks / (Tile::kConsumerWGs * 128); ++it) {
                const int idx = it * Tile::kConsumerWGs * 128 + ctid;
                const int row = idx / kChunks, chunk = idx % kChunks;
                if (n0 + row < p.seqlen_k && chunk * 8 < p.head_dim)
                    *reinterpret_cast<uint4*>(dst + (n0 + row) * row_stride + chunk * 8) =
                        *reinterpret_cast<const uint4*>(base + row * (kPad * 2) + ((chunk ^ (row % 8)) * 16));
            }
        };
        store_tile(sK, static_cast<u16*>(p.dk) + batch * p.dk_batch_stride + head_kv * p.dk_head_stride,
                   p.dk_row_stride);
        store_tile(sV, static_cast<u16*>(p.dv) + batch * p.dv_batch_stride + head_kv * p.dv_head_stride,
                   p.dv_row_stride);
        if (threadIdx.x == 128) CUFLASH_BWD_TRACE(5, clock64());
    }
}

#define CUFLASH_SM90_BWD_KERNEL(name, mode)                                                                  \
    template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, bool kIsCausal>               \
    __global__ void __launch_bounds__(kNWarps * 32,                                                            \
                                      (Sm90BwdTile<kHeadDim, kBlockM, kBlockN, kNWarps, mode>::kCtasPerSm))    \
    name(const BwdParams p, const __grid_constant__ TmaDesc tma_q, const __grid_constant__ TmaDesc tma_k,      \
         const __grid_constant__ TmaDesc tma_v, const __grid_constant__ TmaDesc tma_do) {                      \
        bwd_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, kIsCausal, mode>(p, tma_q, tma_k, tma_v, tma_do);   \
    }
CUFLASH_SM90_BWD_KERNEL(bwd_dkdv_dqtile_kernel, kDqTile)
CUFLASH_SM90_BWD_KERNEL(bwd_dkdv_dqtile_ordered_kernel, kDqTileOrdered)
#undef CUFLASH_SM90_BWD_KERNEL
