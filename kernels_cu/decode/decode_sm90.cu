// Decoding on Hopper: decode.cu's work split and math (decode_parts.cuh), the keys streamed by producer warps.
//
// decode.cu's warps issue their own cp.async chunks and wait for the oldest tile together, so a block-table read
// or a slow warp holds up the next tile's issue and the bytes in flight drop. Here kProducerWarps warps only fill
// the ring (cp.async chunks, a row's address computed once; rows past the last key and columns past head_dim
// zero-filled), each thread's copies of a stage counted on the stage's "full" mbarrier as they land
// (cp.async.mbarrier.arrive.noinc); the consumer warps wait on that barrier, compute, and release the stage on its
// "empty" barrier, never waiting for each other inside the loop. The producers run up to kStages tiles ahead, so a
// table read's latency hides behind the consumers' work. (One bulk copy per key row from a single producer warp
// ran at half the bandwidth: BENCHMARKS.md.)
#include "decode_parts.cuh"
#include "../sm90/pipeline.cuh"

#ifndef CUFLASH_DECODE_SM90_STAGES
#define CUFLASH_DECODE_SM90_STAGES 0   // 0: DecodeTile's depth (two CTAs per SM)
#endif
// The producer warps (cuflash/kvcache.py's SM90_PRODUCER_WARPS: the launch's threads count them).
#ifndef CUFLASH_DECODE_SM90_PRODUCER_WARPS
#define CUFLASH_DECODE_SM90_PRODUCER_WARPS 4
#endif
constexpr int kProducerWarps = CUFLASH_DECODE_SM90_PRODUCER_WARPS;

// DecodeTile's kNWarps are the consumer warps.
template <int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN, int kConsumerWarps>
struct DecodeSm90Tile : DecodeTile<kHeadDim, kHeadDimV, kBlockM, kBlockN, kConsumerWarps, CUFLASH_DECODE_SM90_STAGES> {
    using Base = DecodeTile<kHeadDim, kHeadDimV, kBlockM, kBlockN, kConsumerWarps, CUFLASH_DECODE_SM90_STAGES>;
    static constexpr int kBarrierBytes = 128;   // the full and empty barriers, before Q
    static_assert(2 * Base::kStages * 8 <= kBarrierBytes, "barriers of the ring");
    static constexpr int kSmemBytes = kBarrierBytes + Base::kSmemBytes;
    // Two CTAs an SM where their shared memory fits and 128 registers a thread hold O (up to 8 warps a CTA, O rows of
    // up to 128 columns).
    static constexpr int kMinBlocks =
        2 * kSmemBytes + 2048 <= 227 * 1024 && kConsumerWarps + kProducerWarps <= 8 && Base::kHeadDimV <= 128 ? 2 : 1;
};

// kNWarps counts the producer warps too (the launch's threads): kNWarps - kProducerWarps consumer warps.
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV = 0>
__device__ const int decode_sm90_kernel_smem_bytes =
    DecodeSm90Tile<kHeadDim, kHeadDimV, kBlockM, kBlockN, kNWarps - kProducerWarps>::kSmemBytes;

// This thread's cp.async copies so far arrive on the mbarrier at `bar` once they have landed (the barrier's count
// includes the arrival: .noinc).
__device__ __forceinline__ void cp_async_arrive(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// The producers: tile by tile, wait for the stage to be free, issue its copies, and have them counted on its
// "full" barrier (ptid: the thread's index among the producers).
template <class Tile, class Work>
__device__ __forceinline__ void decode_producer(const DecodeParams& p, const Work& w, u16* sRing, u32 full_bar,
                                                u32 empty_bar, int ptid) {
    constexpr int kThreads = kProducerWarps * 32;
    for (int it = 0; it < w.n_tiles; ++it) {
        const int stage = it % Tile::kStages;
        mbar_wait(empty_bar + stage * 8, ((it / Tile::kStages) & 1) ^ 1);
        load_keys_by_row<Tile, kThreads>(p, w.at, w.gK, w.gV, sRing + stage * Tile::kStageElems,
                                         w.key_lo + it * Tile::kBlockN, w.key_hi, ptid);
        cp_async_arrive(full_bar + stage * 8);
    }
}

template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV_ = 0>
__global__ void __launch_bounds__(kNWarps * 32,
                                  (DecodeSm90Tile<kHeadDim, kHeadDimV_, kBlockM, kBlockN, kNWarps - kProducerWarps>::kMinBlocks))
decode_sm90_kernel(const DecodeParams p) {
    constexpr int kConsumerWarps = kNWarps - kProducerWarps;
    using Tile = DecodeSm90Tile<kHeadDim, kHeadDimV_, kBlockM, kBlockN, kConsumerWarps>;
    constexpr int kStages = Tile::kStages, kConsumers = kConsumerWarps * 32;

    extern __shared__ __align__(128) u16 smem[];
    const u32 full_bar = static_cast<u32>(__cvta_generic_to_shared(smem));
    const u32 empty_bar = full_bar + kStages * 8;
    u16* sQ = smem + Tile::kBarrierBytes / 2;
    u16* sRing = sQ + Tile::kQElems;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const DecodeWork<kBlockM, kBlockN, Variant> w(p);

    if (tid == 0) {
        for (int st = 0; st < kStages; ++st) {
            mbar_init(full_bar + st * 8, kProducerWarps * 32);
            mbar_init(empty_bar + st * 8, kConsumerWarps);
        }
        fence_barrier_init();
    }
    __syncthreads();

    if (warp >= kConsumerWarps) {   // the producers: no barrier below waits for them
        decode_producer<Tile>(p, w, sRing, full_bar, empty_bar, tid - kConsumers);
        return;
    }

    const int wm = warp / Tile::kWarpsN, wn = warp % Tile::kWarpsN;
    load_q<Tile>(p, w, sQ, tid, kConsumers);
    cp_async_commit();
    cp_async_wait<0>();
    named_barrier_sync(1, kConsumers);   // Q landed for every consumer

    DecodeRows<Tag, Tile, Variant> rows(p, w, wm, lane);
    for (int it = 0; it < w.n_tiles; ++it) {
        const int stage = it % kStages;
        mbar_wait(full_bar + stage * 8, (it / kStages) & 1);
        const u16* sK = sRing + stage * Tile::kStageElems;
        const u16* sV = sK + kBlockN * Tile::kStrideK;
        rows.step(p, w, sQ, sK, sV, w.key_lo + it * kBlockN + wn * Tile::kSliceN, wm, wn, lane);
        __syncwarp();
        if (lane == 0) mbar_arrive(empty_bar + stage * 8);
    }
    rows.reduce_sums();
    named_barrier_sync(1, kConsumers);   // every consumer is done with the ring (and every copy has landed)

    float* red = reinterpret_cast<float*>(sRing);
    rows.store_partial(red, warp, lane);
    named_barrier_sync(1, kConsumers);
    merge_and_store<Tag, Tile, Variant>(p, w, red, tid, kConsumers);
}
