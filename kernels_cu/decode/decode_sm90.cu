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

// DecodeTile's kNWarps are the consumer warps. kFp8: the caches hold e4m3 values; the ring holds their bytes and
// each consumer warp turns its key slice of a stage into 16-bit rows in a buffer of its own (freeing the stage
// before its products), which step() reads as it reads a 16-bit stage.
template <int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN, int kConsumerWarps, bool kFp8>
struct DecodeSm90Tile : DecodeTile<kHeadDim, kHeadDimV, kBlockM, kBlockN, kConsumerWarps, CUFLASH_DECODE_SM90_STAGES> {
    using Base = DecodeTile<kHeadDim, kHeadDimV, kBlockM, kBlockN, kConsumerWarps, CUFLASH_DECODE_SM90_STAGES>;
    static constexpr int kBarrierBytes = 128;   // the full and empty barriers, before Q
    static_assert(2 * Base::kStages * 8 <= kBarrierBytes, "barriers of the ring");
    static constexpr int kElemBytes = kFp8 ? 1 : 2;
    // A stage's rows in bytes: fp8 rows padded by 16 bytes (a warp's 16-byte reads of 8 rows fall in distinct
    // bank groups), 16-bit rows as DecodeTile's.
    static constexpr int kRowBytesK = kFp8 ? Base::kHeadDim + 16 : Base::kStrideK * 2;
    static constexpr int kRowBytesV = kFp8 ? Base::kHeadDimV + 16 : Base::kStrideV * 2;
    static constexpr int kStageBytes = kBlockN * (kRowBytesK + kRowBytesV);
    static constexpr int kBufferElems = kFp8 ? Base::kSliceN * (Base::kStrideK + Base::kStrideV) : 0;   // a warp's
    static constexpr int kQBytes = Base::kQElems * 2;
    // After the loop the consumers' buffers and the ring hold the merge's partial results.
    static constexpr int kWorkBytes = kConsumerWarps * kBufferElems * 2 + Base::kStages * kStageBytes;
    static constexpr int kSmemBytes =
        kBarrierBytes + kQBytes + (kWorkBytes > Base::kRedBytes ? kWorkBytes : Base::kRedBytes);
    // Two CTAs an SM where their shared memory fits and 128 registers a thread hold S and O (up to 8 warps a CTA, O
    // rows of up to 128 columns, key slices of up to 32).
    static constexpr int kMinBlocks = 2 * kSmemBytes + 2048 <= 227 * 1024 && kConsumerWarps + kProducerWarps <= 8
                                      && Base::kHeadDimV <= 128 && Base::kSliceN <= 32 ? 2 : 1;
};

// kNWarps counts the producer warps too (the launch's threads): kNWarps - kProducerWarps consumer warps.
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV = 0>
__device__ const int decode_sm90_kernel_smem_bytes =
    DecodeSm90Tile<kHeadDim, kHeadDimV, kBlockM, kBlockN, kNWarps - kProducerWarps, false>::kSmemBytes;
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV = 0>
__device__ const int decode_sm90_fp8_kernel_smem_bytes =
    DecodeSm90Tile<kHeadDim, kHeadDimV, kBlockM, kBlockN, kNWarps - kProducerWarps, true>::kSmemBytes;

// This thread's cp.async copies so far arrive on the mbarrier at `bar` once they have landed (the barrier's count
// includes the arrival: .noinc).
__device__ __forceinline__ void cp_async_arrive(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// The producers: tile by tile, wait for the stage to be free, issue its copies, and have them counted on its
// "full" barrier (ptid: the thread's index among the producers).
template <class Tile, class Work>
__device__ __forceinline__ void decode_producer(const DecodeParams& p, const Work& w, unsigned char* ring,
                                                u32 full_bar, u32 empty_bar, int ptid) {
    constexpr int kThreads = kProducerWarps * 32;
    const unsigned char* gK = Tile::kElemBytes == 1 ? w.gK8 : reinterpret_cast<const unsigned char*>(w.gK);
    const unsigned char* gV = Tile::kElemBytes == 1 ? w.gV8 : reinterpret_cast<const unsigned char*>(w.gV);
    for (int it = 0; it < w.n_tiles; ++it) {
        const int stage = it % Tile::kStages;
        mbar_wait(empty_bar + stage * 8, ((it / Tile::kStages) & 1) ^ 1);
        unsigned char* sK = ring + stage * Tile::kStageBytes;
        load_keys_by_row<Tile, kThreads, Tile::kElemBytes, Tile::kRowBytesK, Tile::kRowBytesV>(
            p, w.at, gK, gV, sK, sK + Tile::kBlockN * Tile::kRowBytesK, w.key_lo + it * Tile::kBlockN, w.key_hi, ptid);
        cp_async_arrive(full_bar + stage * 8);
    }
}

template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV_, bool kFp8>
__device__ __forceinline__ void decode_sm90_body(const DecodeParams& p) {
    constexpr int kConsumerWarps = kNWarps - kProducerWarps;
    using Tile = DecodeSm90Tile<kHeadDim, kHeadDimV_, kBlockM, kBlockN, kConsumerWarps, kFp8>;
    constexpr int kStages = Tile::kStages, kConsumers = kConsumerWarps * 32, kSliceN = Tile::kSliceN;

    extern __shared__ __align__(128) unsigned char smem_bytes[];
    const u32 full_bar = static_cast<u32>(__cvta_generic_to_shared(smem_bytes));
    const u32 empty_bar = full_bar + kStages * 8;
    u16* sQ = reinterpret_cast<u16*>(smem_bytes + Tile::kBarrierBytes);
    u16* buffers = reinterpret_cast<u16*>(smem_bytes + Tile::kBarrierBytes + Tile::kQBytes);
    unsigned char* ring = reinterpret_cast<unsigned char*>(buffers + kConsumerWarps * Tile::kBufferElems);

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
        decode_producer<Tile>(p, w, ring, full_bar, empty_bar, tid - kConsumers);
        return;
    }

    const int wm = warp / Tile::kWarpsN, wn = warp % Tile::kWarpsN;
    load_q<Tile>(p, w, sQ, tid, kConsumers);
    cp_async_commit();
    cp_async_wait<0>();
    named_barrier_sync(1, kConsumers);   // Q landed for every consumer

    DecodeRows<Tag, Tile, Variant> rows(p, w, wm, lane);
    u16* bK = buffers + warp * Tile::kBufferElems;
    u16* bV = bK + kSliceN * Tile::kStrideK;
    for (int it = 0; it < w.n_tiles; ++it) {
        const int stage = it % kStages;
        mbar_wait(full_bar + stage * 8, (it / kStages) & 1);
        const unsigned char* sK = ring + stage * Tile::kStageBytes;
        const unsigned char* sV = sK + kBlockN * Tile::kRowBytesK;
        const int n0 = w.key_lo + it * kBlockN + wn * kSliceN;
        if constexpr (kFp8) {
            dequant_rows<Tag, kSliceN, Tile::kHeadDim, Tile::kRowBytesK, Tile::kStrideK>(
                sK + wn * kSliceN * Tile::kRowBytesK, bK, lane);
            dequant_rows<Tag, kSliceN, Tile::kHeadDimV, Tile::kRowBytesV, Tile::kStrideV>(
                sV + wn * kSliceN * Tile::kRowBytesV, bV, lane);
            __syncwarp();
            if (lane == 0) mbar_arrive(empty_bar + stage * 8);   // the stage is free before the products
            rows.step(p, w, sQ, bK, bV, n0, wm, 0, lane);
            __syncwarp();   // every lane done with the buffer before the next tile's rows overwrite it
        } else {
            rows.step(p, w, sQ, reinterpret_cast<const u16*>(sK), reinterpret_cast<const u16*>(sV), n0, wm,
                      wn * kSliceN, lane);
            __syncwarp();
            if (lane == 0) mbar_arrive(empty_bar + stage * 8);
        }
    }
    rows.reduce_sums();
    named_barrier_sync(1, kConsumers);   // every consumer is done with the ring (and every copy has landed)

    float* red = reinterpret_cast<float*>(buffers);
    rows.store_partial(red, warp, lane);
    named_barrier_sync(1, kConsumers);
    merge_and_store<Tag, Tile, Variant>(p, w, red, tid, kConsumers);
}

template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV = 0>
__global__ void __launch_bounds__(kNWarps * 32, (DecodeSm90Tile<kHeadDim, kHeadDimV, kBlockM, kBlockN,
                                                                kNWarps - kProducerWarps, false>::kMinBlocks))
decode_sm90_kernel(const DecodeParams p) {
    decode_sm90_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, Variant, kHeadDimV, false>(p);
}

// The same over e4m3 caches (Tag: q's and the output's type), each stored element times its KV head's scale.
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV = 0>
__global__ void __launch_bounds__(kNWarps * 32, (DecodeSm90Tile<kHeadDim, kHeadDimV, kBlockM, kBlockN,
                                                                kNWarps - kProducerWarps, true>::kMinBlocks))
decode_sm90_fp8_kernel(const DecodeParams p) {
    decode_sm90_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, Variant, kHeadDimV, true>(p);
}
