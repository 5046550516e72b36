// The sm90 backward's shape (Sm90BwdTile), its shared-memory layout and mbarriers (BwdSmem), its named
// barriers (BwdBarrier) and the diagnostic trace build (CUFLASH_SM90_BWD_TRACE).
#pragma once
#include "../common/numeric.cuh"
#include "../common/params.cuh"
#include "../common/mask.cuh"
#include "../common/bwd_math.cuh"
#include "../common/programmable.cuh"
#include "wgmma.cuh"
#include "tma.cuh"
#include "pipeline.cuh"

// How a CTA's dQ slices reach global memory (bwd.cu's header comment): bulk reduces in any order, or in
// ascending key-tile order (bitwise reproducible). The values are the Python side's (launch / tests).
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
    static constexpr int kStages = 2;
    static constexpr int kQBytes = kBlockM * kHeadDimPad * 2;  // Q or dO tile
    static constexpr int kKVBytes = kBlockN * kHeadDimPad * 2; // K or V tile
    static constexpr int kDsBytes = kBlockM * kBlockN * 2;     // one dS buffer
    // Split-D: each consumer warpgroup computes S^T / dP^T of its half of the query rows only (both
    // computing all of them would double those two GEMMs, two fifths of the step's tensor work) and
    // stores its P^T and dS^T into common shared buffers, from which the other warpgroup's dV / dK
    // products take that half (SS, MN-major A).
    static constexpr bool kSplitSdP = kSplitD;
    // 64 x 64 16-bit buffers per step parity: dS; kSplitSdP: dS and P^T.
    static constexpr int kDsCopies = kSplitD ? 2 : 1;
    // dQ slice of a consumer warpgroup: with 64-row query tiles, all rows and 1 / kConsumerWGs of the
    // columns; with 128-row tiles, 64 rows and all columns.
    static constexpr int kDqCols = kBlockM == 64 ? kHeadDimPad / kConsumerWGs : kHeadDimPad;
    static constexpr int kKvPiece = kKvCols % 64 == 0 ? kKvCols : 32;
    static constexpr int kDqPiece = kDqCols % 64 == 0 || kDqCols < 64 ? kDqCols : 32;
    // Split-D warpgroups whose dK / dV columns are no whole number of 64-column atoms (head dim 192: 96 each)
    // take columns 64c .. 64c + 63 and 128 + 32c .. 128 + 32c + 31: two pieces that each start an atom (n64 +
    // n32) rather than 96c .. 96c + 95 in three n32 pieces (the SS half of the products reads its A operand
    // once per piece).
    static constexpr bool kKvAtomPieces = kSplitD && kKvCols % 64 != 0;
    static constexpr int kKvPieces = kKvAtomPieces ? kKvCols / 64 + 1 : kKvCols / kKvPiece;
    // With kKvAtomPieces, piece kPc of warpgroup c: kWidth columns from kColBase + c * kWidth, its accumulators
    // from register kAccOffset (the whole 64-column blocks first, then the tails).
    template <int kPc>
    struct KvPiece {
        static constexpr bool kTail = kPc == kKvPieces - 1;
        static constexpr int kWidth = kTail ? kKvCols % 64 : 64;
        static constexpr int kColBase = kPc * kConsumerWGs * 64;
        static constexpr int kColStep = kWidth;
        static constexpr int kAccOffset = kPc * 32;
    };
    // With kKvAtomPieces: the first column of warpgroup cw's accumulator chunk j (8 columns: registers 4j .. 4j + 3).
    static __device__ __forceinline__ int kv_chunk_col(int cw, int j) {
        return j < 8 * (kKvCols / 64) ? (j / 8) * kConsumerWGs * 64 + cw * 64 + (j % 8) * 8
                                      : (kKvCols / 64) * kConsumerWGs * 64 + cw * (kKvCols % 64) + (j % 8) * 8;
    }
    // One float32 staging slice (64 rows x kDqCols) per consumer warpgroup, in the accumulator order:
    // chunk j (registers 4j..4j+3) of thread t at float 512 j + 4 t.
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
    // Bytes after the 1024-byte aligned base (the entry points export it with the slack: bwd.cu).
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

// Named barriers among the consumer warpgroups (id 0 is __syncthreads; the ids are the ones the
// kernel has always used, so that its code stays the same).
enum class BwdBarrier : int {
    kDsReady = 1,       // every warpgroup's dS (split-D: and P^T) of the step is in shared memory
    kRingStageRead = 4, // split-D: both warpgroups are done with the stage's Q and dO (the dQ slices go there)
    kEpilogue = 5,      // dK / dV staging: K and V are free / the staged tiles are complete
};
template <class Tile>
__device__ __forceinline__ void bwd_barrier_sync(BwdBarrier id) {
    named_barrier_sync(static_cast<int>(id), Tile::kConsumerWGs * 128);
}

// Shared memory, after the 1024-byte aligned base (the 128-byte swizzle's atoms):
//   K, V                 one tile each (64-column swizzle atoms, kBlockN * 128 bytes apart)
//   Q[kStages], dO[kStages]  the ring
//   dS[2][kDsCopies]     double-buffered by step parity (split-D: dS and P^T)
//   dQ slices            [kConsumerWGs] float32 staging slices (none with kDqInRing)
//   stats                lse2[kStages][kBlockM], delta[kStages][kBlockM]
//   mbarriers            kv; q_full, do_full, empty per stage; dq_full, dq_empty per consumer warpgroup
// Addresses are 32-bit shared-window addresses; generic() gives a C++ pointer for plain loads / stores.
template <class Tile>
struct BwdSmem {
    static constexpr int kStages = Tile::kStages;
    char* raw;
    u32 k, v, q, dout, ds, dq_stage, stats, bars;

    __device__ __forceinline__ explicit BwdSmem(char* raw_) : raw(raw_) {
        k = (smem_u32(raw) + 1023) & ~1023u;
        v = k + Tile::kKVBytes;
        q = v + Tile::kKVBytes;
        dout = q + kStages * Tile::kQBytes;
        ds = dout + kStages * Tile::kQBytes;
        dq_stage = ds + 2 * Tile::kDsCopies * Tile::kDsBytes;
        stats = dq_stage + Tile::kDqStageBytes;
        bars = stats + 2 * kStages * Tile::kBlockM * 4;
    }
    __device__ __forceinline__ char* generic(u32 addr) const { return raw + (addr - smem_u32(raw)); }
    __device__ __forceinline__ float* stat_ptr() const { return reinterpret_cast<float*>(generic(stats)); }
    __device__ __forceinline__ u32 q_stage(int s) const { return q + s * Tile::kQBytes; }
    __device__ __forceinline__ u32 dout_stage(int s) const { return dout + s * Tile::kQBytes; }
    // A consumer warpgroup's dQ staging slice (not with kDqInRing).
    __device__ __forceinline__ u32 dq_slice(int cw) const { return dq_stage + cw * Tile::kDqSliceFloats * 4; }

    __device__ __forceinline__ u32 bar_kv() const { return bars; }
    // A ring stage's Q (with lse2) / dO (with delta) has landed; the stage may be refilled.
    __device__ u32 bar_q_full(int s) const { return bars + 8 * (1 + s); }
    __device__ u32 bar_do_full(int s) const { return bars + 8 * (1 + kStages + s); }
    __device__ u32 bar_empty(int s) const { return bars + 8 * (1 + 2 * kStages + s); }
    // A consumer warpgroup's dQ slice is in shared memory / has been read by the bulk reduce.
    __device__ u32 bar_dq_full(int c) const { return bars + 8 * (1 + 3 * kStages + c); }
    __device__ u32 bar_dq_empty(int c) const { return bars + 8 * (1 + 3 * kStages + Tile::kConsumerWGs + c); }

    // One thread, before the CTA's first __syncthreads.
    __device__ __forceinline__ void init_barriers() const {
        mbar_init(bar_kv(), 1);
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
};

// -DCUFLASH_SM90_BWD_TRACE (dev/trace.py bwd): per CTA, the SM and clock64 stamps of its phases in
// dq_semaphore (as u64[16]: 0-7 phases, 8-14 the end of the first 7 steps, 15 the kernel's entry, before
// the CTA's coordinates are computed); a diagnostic build only. CUFLASH_BWD_TRACE needs the
// BwdParams `p` in scope.
#ifdef CUFLASH_SM90_BWD_TRACE
__device__ __forceinline__ void bwd_trace(const BwdParams& p, int slot, unsigned long long value) {
    const i64 cta = blockIdx.x + static_cast<i64>(gridDim.x) * (blockIdx.y + static_cast<i64>(gridDim.y) * blockIdx.z);
    reinterpret_cast<unsigned long long*>(p.dq_semaphore)[cta * 16 + slot] = value;
}
#define CUFLASH_BWD_TRACE(slot, value) bwd_trace(p, slot, value)
#else
#define CUFLASH_BWD_TRACE(slot, value)
#endif
