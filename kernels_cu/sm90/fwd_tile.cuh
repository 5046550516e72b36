// The Hopper forward's compile-time tile shape and its shared-memory layout.
#pragma once
#include "../common/numeric.cuh"
#include "pipeline.cuh"

// Consumer schedules: each warpgroup on its own (simple), or with the softmax of key tile i overlapping
// the P V product of tile i - 1 (overlap).
enum class FwdSchedule : int { kSimple = 0, kOverlap = 1 };

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
    static constexpr int kSmemLimit = 232448;   // opt-in shared memory per block on sm_90
    // Persistent kernels: two Q buffers where shared memory allows (FwdSharedStorage::kBytes), so that
    // the next tile's Q is loaded while the consumers finish this one, and a consumer warpgroup done
    // with a tile starts the next without waiting for the others.
    static constexpr int kQBuffersPersistent =
        1024 + 2 * kQBytes + 2 * kStages * kKVBytes + 8 * (2 * 2 + 4 * kStages + 1) <= kSmemLimit ? 2 : 1;
    static_assert(kBlockM % 64 == 0 && kConsumerWGs >= 1 && kConsumerWGs <= 3, "kBlockM: 64, 128 or 192");
    static_assert(kNWarps_ == 4 * (kConsumerWGs + 1), "one producer and kBlockM / 64 consumer warpgroups");
    static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "kBlockN");
    static_assert(!kFp8 || kBlockN % 128 == 0, "fp8: V^T tiles are whole 128-key (128-byte) rows");
};

// setmaxnreg moves registers inside the CTA's launch allocation only (168 per thread at 384 threads, 128
// at 512): producer + consumers must stay within it, or setmaxnreg.inc waits forever. The persistent
// producer (its tile loop) needs more than 24: 40 + 2 * 232 = 3 * 168.
template <class Tile, bool kPersistent>
struct FwdRegisterSplit {
    static constexpr int kProducer = !kPersistent ? 24 : (Tile::kConsumerWGs == 2 ? 40 : 32);
    static constexpr int kConsumer = Tile::kConsumerWGs == 2 ? (kPersistent ? 232 : 240) : 160;
    static_assert(kProducer + Tile::kConsumerWGs * kConsumer <= (Tile::kConsumerWGs == 2 ? 504 : 512),
                  "setmaxnreg budget");
};

// Shared memory, from a 1024-byte aligned base (the swizzle atoms' alignment): kQBuffers Q tiles, the
// K and V rings (kStages slots each), then the mbarriers and (persistent) the tile slots by which the
// producer hands each Q buffer's tile index to the consumers.
template <class Tile, int kQBuffers>
struct FwdSharedStorage {
    static constexpr int kStages = Tile::kStages;
    char* raw;   // the dynamic shared memory as the kernel sees it
    u32 q, k, v, bars;

    // Dynamic shared memory the kernel is launched with: the tiles, the barriers (and tile slots: at most 8
    // bytes), and 1024 bytes of slack for the base's alignment.
    static constexpr int kBytes = 1024 + kQBuffers * Tile::kQBytes + 2 * kStages * Tile::kKVBytes
                                  + 8 * (2 * kQBuffers + 4 * kStages + 1);

    __device__ __forceinline__ explicit FwdSharedStorage(char* smem_raw) : raw(smem_raw) {
        q = (smem_u32(smem_raw) + 1023) & ~1023u;
        k = q + kQBuffers * Tile::kQBytes;
        v = k + kStages * Tile::kKVBytes;
        bars = v + kStages * Tile::kKVBytes;
    }
    __device__ __forceinline__ u32 q_buffer(int b) const { return q + b * Tile::kQBytes; }
    __device__ __forceinline__ u32 k_stage(int s) const { return k + s * Tile::kKVBytes; }
    __device__ __forceinline__ u32 v_stage(int s) const { return v + s * Tile::kKVBytes; }
    // Q buffer b (and its tile slot) loaded / free again (persistent).
    __device__ __forceinline__ u32 q_full(int b) const { return bars + 8 * b; }
    __device__ __forceinline__ u32 q_empty(int b) const { return bars + 8 * (kQBuffers + 4 * kStages + b); }
    __device__ __forceinline__ u32 k_full(int s) const { return bars + 8 * (kQBuffers + s); }
    __device__ __forceinline__ u32 v_full(int s) const { return bars + 8 * (kQBuffers + kStages + s); }
    __device__ __forceinline__ u32 k_empty(int s) const { return bars + 8 * (kQBuffers + 2 * kStages + s); }
    __device__ __forceinline__ u32 v_empty(int s) const { return bars + 8 * (kQBuffers + 3 * kStages + s); }
    // The tile index handed out with each Q buffer (>= the number of tiles: no work left).
    __device__ __forceinline__ volatile int* tile_slot() const {
        return reinterpret_cast<volatile int*>(raw + (bars + 8 * (2 * kQBuffers + 4 * kStages) - smem_u32(raw)));
    }
    // A generic pointer to shared address `addr` (the O staging rows).
    __device__ __forceinline__ char* generic(u32 addr) const { return raw + (addr - smem_u32(raw)); }

    // One thread: every barrier's arrival count. Consumers free a ring stage with one arrival per thread,
    // or, in clusters, one per warp of each CTA of the cluster.
    template <int kConsumerWGs, int kCluster>
    __device__ __forceinline__ void init_barriers() const {
#pragma unroll
        for (int b = 0; b < kQBuffers; ++b) {
            mbar_init(q_full(b), 1);
            mbar_init(q_empty(b), kConsumerWGs * 128);
        }
#pragma unroll
        for (int s = 0; s < kStages; ++s) {
            mbar_init(k_full(s), 1);
            mbar_init(v_full(s), 1);
            mbar_init(k_empty(s), kCluster > 1 ? kCluster * kConsumerWGs * 4 : kConsumerWGs * 128);
            mbar_init(v_empty(s), kCluster > 1 ? kCluster * kConsumerWGs * 4 : kConsumerWGs * 128);
        }
        fence_barrier_init();
    }
};

// -DCUFLASH_SM90_FWD_TRACE (dev/trace.py, persistent kernels only): clock64 stamps per CTA, consumer
// warpgroup and tile (the first 16) after the two tile-counter ints: u64[(cta * 3 + cw) * 16 + tile][8],
// slots 0 tile start, 1 Q landed, 2 first K landed, 3 key loop done, 4 epilogue done, 5 SM id, 6 key tiles,
// 7 (warpgroup 0's record, written by the producer) first K load issued. A diagnostic build only.
struct FwdTrace {
    int* tile_counter;
    int cw, tile;
    bool on;   // persistent, and the warpgroup's first thread
};
#ifdef CUFLASH_SM90_FWD_TRACE
#define CUFLASH_FWD_TRACE(trace, slot, value)                                                                   \
    do {                                                                                                        \
        if ((trace).on && (trace).tile < 16)                                                                    \
            reinterpret_cast<unsigned long long*>((trace).tile_counter + 64)                                    \
                [((blockIdx.x * 3 + (trace).cw) * 16 + (trace).tile) * 8 + (slot)] = (value);                   \
    } while (0)
#else
#define CUFLASH_FWD_TRACE(trace, slot, value)
#endif

// -DCUFLASH_SM90_FWD_COUNT_FALLBACKS (tests): how often a warp left the kept-max fast path of the overlap
// schedule, [0] re-based from its probabilities, [1] computed S again, and [2] how many key-tile steps it took
// in the kept-max state; read back through the module global.
#ifdef CUFLASH_SM90_FWD_COUNT_FALLBACKS
__device__ unsigned long long cuflash_fwd_fallbacks[3];
#define CUFLASH_FWD_COUNT(lane, kind) \
    do { if ((lane) == 0) atomicAdd(cuflash_fwd_fallbacks + (kind), 1ull); } while (0)
#else
#define CUFLASH_FWD_COUNT(lane, kind)
#endif

// fp8 only: the per-tensor scales of the e4m3 inputs (x = x8 * descale), float32 scalars on the device.
struct Fp8Descale {
    const float* q = nullptr;
    const float* k = nullptr;
    const float* v = nullptr;
};
