// The Hopper forward's tile shape, shared-memory layout, diagnostic hooks and fp8 scales.
#pragma once
#include "../common/numeric.cuh"
#include "pipeline.cuh"

// Consumer schedules: each warpgroup on its own, or with the softmax of one key tile
// overlapping the P V product of the previous one; split: two warpgroups on the same 64 rows, one computing
// S and the softmax, each the P V product of its half of V's columns (head dims above 256: fwd_split.cuh).
constexpr int kModeSimple = 0, kModeOverlap = 1, kModeSplit = 2;

// fp8 V^T rows (the P V product's N): the head dim rounded up to a wgmma N of the tuned head dims
// (cuflash/fp8.py: v_rows mirrors this, for the layout of V^T it writes).
__host__ __device__ constexpr int fp8_v_rows(int head_dim) {
    return head_dim <= 32 ? 32 : head_dim <= 64 ? 64 : head_dim <= 96 ? 96 : head_dim <= 128 ? 128
         : head_dim <= 192 ? 192 : 256;
}

// kHeadDimV_: v's (and the output's) head dim where it differs from q's and k's (0: the same).
template <typename Tag_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kHeadDimV_ = 0>
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
    static constexpr int kHeadDimO = kHeadDimV_ ? kHeadDimV_ : kHeadDim;   // columns of v and of the output
    // Columns of V and O: fp16 V is an MN-major B in 64-column blocks; fp8 V^T has one row per column.
    static constexpr int kHeadDimV = kFp8 ? fp8_v_rows(kHeadDim) : (kHeadDimO + kBlockCols - 1) / kBlockCols * kBlockCols;
    static constexpr int kColBlocksV = kHeadDimV / kBlockCols;   // 16-bit V's 64-column blocks
    static constexpr int kKeyStep = 32 / kElemBytes;        // keys per k-step of the P V product
    static constexpr int kBlockM = kBlockM_;
    static constexpr int kBlockN = kBlockN_;
    static constexpr int kConsumerWGs = kNWarps_ / 4 - 1;
    // Split V (kModeSplit): two consumer warpgroups on one 64-row tile; warpgroup 0 computes S and the softmax
    // and hands P to warpgroup 1 through shared memory; warpgroup c computes O's columns [kVCol0[c], +kVCols[c]).
    static constexpr bool kSplitV = kConsumerWGs * 64 > kBlockM;
    static constexpr int kThreads = kNWarps_ * 32;
    static constexpr int kQBytes = kBlockM * kHeadDimPad * kElemBytes;
    static constexpr int kKBytes = kBlockN * kHeadDimPad * kElemBytes;
    static constexpr int kVBytes = kBlockN * kHeadDimV * kElemBytes;   // V (fp16) or V^T (fp8) tile
    static constexpr int kKVBytes = kKBytes > kVBytes ? kKBytes : kVBytes;
    // Split V: kPBuffers P buffers (64 rows of up to 64 keys: one 128-byte swizzled row block each), then per
    // consumer thread a rescale slot per P buffer and one slot for the row sums' inverses, two floats each.
    // Two K / V stages where they fit beside one P buffer (64-key tiles of head dim 512 leave room for one), then
    // two P buffers where they fit too.
    static constexpr int kSmemLimit = 232448;   // opt-in shared memory per block on sm_90
    static constexpr int kPBytes = kBlockM * 128;
    static constexpr int kPSlotBytes = kPBytes + 128 * 8;
    __host__ __device__ static constexpr int split_bytes(int stages) {   // all but the P buffers and their slots
        return 1024 + kQBytes + stages * (kKBytes + kVBytes) + 128 * 8 + 8 * (3 + 4 * stages);
    }
    static constexpr int kStages = !kSplitV ? 2 : split_bytes(2) + kPSlotBytes <= kSmemLimit ? 2 : 1;
    static constexpr int kPBuffers = split_bytes(kStages) + 2 * kPSlotBytes <= kSmemLimit ? 2 : 1;
    // A ring slot of K and of V: the larger tile for both, or (split V) each its own.
    static constexpr int kKSlotBytes = kSplitV ? kKBytes : kKVBytes;
    static constexpr int kVSlotBytes = kSplitV ? kVBytes : kKVBytes;
    static constexpr int kVCols0 = kSplitV ? (kColBlocksV + 1) / 2 * kBlockCols : kHeadDimV;
    static constexpr int kVCols1 = kHeadDimV - kVCols0;
    static constexpr int kExtraBytes = kSplitV ? kPBuffers * kPSlotBytes + 128 * 8 : 0;
    static constexpr int kProducerRegs = 24;
    static constexpr int kConsumerRegs = kConsumerWGs == 2 ? 240 : 160;
    // Persistent kernels: two Q buffers where shared memory allows (fwd_smem_bytes), so that
    // the next tile's Q is loaded while the consumers finish this one, and a consumer warpgroup done
    // with a tile starts the next without waiting for the others.
    static constexpr int kQBuffersPersistent =
        1024 + 2 * kQBytes + 2 * kStages * kKVBytes + 8 * (5 + 4 * kStages) <= kSmemLimit ? 2 : 1;
    static_assert(kBlockM % 64 == 0 && kConsumerWGs >= 1 && kConsumerWGs <= 3, "kBlockM: 64, 128 or 192");
    static_assert(kConsumerWGs * 64 == kBlockM || (kBlockM == 64 && kConsumerWGs == 2),
                  "one producer and kBlockM / 64 consumer warpgroups, or two on 64 rows (split V)");
    static_assert(!kSplitV || (!kFp8 && (kBlockN == 64 || kBlockN == 32) && kVCols1 > 0),
                  "split V: 16-bit, 32- or 64-key tiles (P in one 128-byte row block), V of two column blocks or more");
    static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "kBlockN");
    static_assert(!kFp8 || kBlockN % 128 == 0, "fp8: V^T tiles are whole 128-key (128-byte) rows");
    static_assert(!kFp8 || kHeadDimV_ == 0, "fp8: v has q's head dim");
    // 16-bit O goes out through this warpgroup's rows of its Q buffer (fwd_epilogue) where they are wide enough;
    // fp8 and the persistent kernels above head dim 128 store straight from the accumulators.
    template <bool kPersistent>
    static constexpr bool kStageO = !kFp8 && !(kPersistent && kHeadDimV > 128) && kHeadDimV <= kHeadDimPad;
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
// rings (kStages slots each), split V's P buffers and slots, then the mbarriers and (persistent) the tile slots by which the producer hands
// each Q buffer's tile index to the consumers.
template <class Tile, int kQBuffers>
struct FwdSmem {
    static constexpr int kStages = Tile::kStages;
    u32 q, k, v, extra, bars;   // extra: split V's P buffers and slots (Tile::kExtraBytes)
    __device__ __forceinline__ explicit FwdSmem(const char* smem_raw) {
        q = (smem_u32(smem_raw) + 1023) & ~1023u;
        k = q + kQBuffers * Tile::kQBytes;
        v = k + kStages * Tile::kKSlotBytes;
        extra = v + kStages * Tile::kVSlotBytes;
        bars = extra + Tile::kExtraBytes;
    }
    __device__ __forceinline__ u32 q_full(int b) const { return bars + 8 * b; }   // Q buffer b (and its tile slot) loaded
    __device__ __forceinline__ u32 k_full(int s) const { return bars + 8 * (kQBuffers + s); }
    __device__ __forceinline__ u32 v_full(int s) const { return bars + 8 * (kQBuffers + kStages + s); }
    __device__ __forceinline__ u32 k_empty(int s) const { return bars + 8 * (kQBuffers + 2 * kStages + s); }
    __device__ __forceinline__ u32 v_empty(int s) const { return bars + 8 * (kQBuffers + 3 * kStages + s); }
    // Persistent: Q buffer b (and its tile slot) free again.
    __device__ __forceinline__ u32 q_empty(int b) const { return bars + 8 * (kQBuffers + 4 * kStages + b); }
};
