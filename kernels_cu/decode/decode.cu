// Decoding: a few new query tokens of each sequence against its KV cache (cuflash.forward_kvcache), on every GPU.
//
// Memory-bound: each key is read once and used by few rows, so the kernel is organised around keeping enough loads
// in flight on every SM, not around tensor-core occupancy. The work split, the consumer warps' math and the merge are
// decode_parts.cuh's; this shell streams the keys through a kStages-deep cp.async ring that every warp fills and
// reads in turn. A paged cache is read through the block table row by row (any page size that is a multiple of 16
// keys: a 16-key group never straddles a page).
#include "decode_parts.cuh"

// A stage's keys [n0, n0 + kBlockN) (those below key_end), by all the CTA's threads.
template <class Tile>
__device__ __forceinline__ void load_stage(const DecodeParams& p, const CacheAddress& at, const u16* gK, const u16* gV,
                                           u16* stage, int n0, int key_end, int tid) {
    load_keys_by_row<Tile, Tile::kThreads, 2, Tile::kStrideK * 2, Tile::kStrideV * 2>(
        p, at, reinterpret_cast<const unsigned char*>(gK), reinterpret_cast<const unsigned char*>(gV),
        reinterpret_cast<unsigned char*>(stage), reinterpret_cast<unsigned char*>(stage + Tile::kBlockN * Tile::kStrideK),
        n0, key_end, tid);
}

template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV = 0>
__device__ const int decode_kernel_smem_bytes = DecodeTile<kHeadDim, kHeadDimV, kBlockM, kBlockN, kNWarps>::kSmemBytes;

template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV_ = 0>
__global__ void __launch_bounds__(kNWarps * 32, 1)
decode_kernel(const DecodeParams p) {
    using Tile = DecodeTile<kHeadDim, kHeadDimV_, kBlockM, kBlockN, kNWarps>;
    constexpr int kStages = Tile::kStages;

    extern __shared__ __align__(128) u16 smem[];
    u16* sQ = smem;
    u16* sRing = smem + Tile::kQElems;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / Tile::kWarpsN, wn = warp % Tile::kWarpsN;
    const DecodeWork<kBlockM, kBlockN, Variant> w(p);
    const int n_tiles = w.n_tiles;

    load_q<Tile>(p, w, sQ, tid, Tile::kThreads);
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) {
        if (st < n_tiles)
            load_stage<Tile>(p, w.at, w.gK, w.gV, sRing + st * Tile::kStageElems, w.key_lo + st * kBlockN, w.key_hi, tid);
        cp_async_commit();   // the first group holds Q too
    }

    DecodeRows<Tag, Tile, Variant> rows(p, w, wm, lane);
    for (int it = 0; it < n_tiles; ++it) {
        cp_async_wait<kStages - 2>();
        __syncthreads();   // tile `it` landed for every thread; stage (it - 1) % kStages is free
        {
            const int next = it + kStages - 1;
            if (next < n_tiles)
                load_stage<Tile>(p, w.at, w.gK, w.gV, sRing + (next % kStages) * Tile::kStageElems,
                                 w.key_lo + next * kBlockN, w.key_hi, tid);
            cp_async_commit();
        }
        const u16* sK = sRing + (it % kStages) * Tile::kStageElems;
        const u16* sV = sK + kBlockN * Tile::kStrideK;
        rows.step(p, w, sQ, sK, sV, w.key_lo + it * kBlockN + wn * Tile::kSliceN, wm, wn * Tile::kSliceN, lane);
    }
    cp_async_wait<0>();
    rows.reduce_sums();
    __syncthreads();   // every warp is done with the ring: the merge reuses it

    float* red = reinterpret_cast<float*>(sRing);
    rows.store_partial(red, warp, lane);
    __syncthreads();
    merge_and_store<Tag, Tile, Variant>(p, w, red, tid, Tile::kThreads);
}
