// Decoding: a few new query tokens of each sequence against its KV cache (cuflash.forward_kvcache), on every GPU.
//
// Memory-bound: each key is read once and used by few rows, so the kernel is organised around keeping enough loads
// in flight on every SM, not around tensor-core occupancy. The work split, the consumer warps' math and the merge are
// decode_parts.cuh's; this shell streams the keys through a kStages-deep cp.async ring that every warp fills and
// reads in turn (16-bit caches, or fp8 ones converted by each warp: DecodeRingTile). A paged cache is read through
// the block table row by row (any page size that is a multiple of 16 keys: a 16-key group never straddles a page).
#include "decode_parts.cuh"

// The ring's tile: DecodeTile's for 16-bit caches (kElemBytes 2). An fp8 cache (1: e4m3 bytes, sm_89+ conversions):
// the ring holds the cache's bytes, rows padded by 16 bytes (a warp's 16-byte reads of 8 rows fall in distinct bank
// groups), and each warp turns its key slice of a stage into 16-bit rows in a buffer of its own before its products,
// as decode_sm90.cu's consumers do. A float32 cache (4): Q and the ring hold float rows padded by 16 bytes, two
// stages, and the products are scalar (DecodeRows' float32 steps). Shared memory: Q (and, fp8, its rows' scales),
// the warps' buffers, the ring; after the loop the merge's partial results over the buffers and the ring.
template <int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN, int kNWarps, int kElemBytes_>
struct DecodeRingTile : DecodeTile<kHeadDim, kHeadDimV, kBlockM, kBlockN, kNWarps> {
    using Base = DecodeTile<kHeadDim, kHeadDimV, kBlockM, kBlockN, kNWarps>;
    static constexpr int kElemBytes = kElemBytes_;
    static constexpr bool kFp8 = kElemBytes == 1;
    static constexpr int kStages = kElemBytes == 4 ? 2 : Base::kStages;
    static constexpr int kRowBytesK = kElemBytes == 2 ? Base::kStrideK * 2 : Base::kHeadDim * kElemBytes + 16;
    static constexpr int kRowBytesV = kElemBytes == 2 ? Base::kStrideV * 2 : Base::kHeadDimV * kElemBytes + 16;
    static constexpr int kStageBytes = kBlockN * (kRowBytesK + kRowBytesV);
    static constexpr int kBufferElems = kFp8 ? Base::kSliceN * (Base::kStrideK + Base::kStrideV) : 0;   // a warp's
    static constexpr int kQBytes = kElemBytes == 4 ? kBlockM * kRowBytesK
                                                   : Base::kQElems * 2 + (kFp8 ? kBlockM * 4 : 0);
    static constexpr int kRingOffset = kQBytes + kNWarps * kBufferElems * 2;
    static constexpr int kWorkBytes = kRingOffset - kQBytes + kStages * kStageBytes;
    static constexpr int kSmemBytes = kQBytes + (kWorkBytes > Base::kRedBytes ? kWorkBytes : Base::kRedBytes);
};

// A 16-bit or float32 cache (Tag: float for float32), or (the fp8 kernel) e4m3 bytes.
template <typename Tag, bool kFp8> constexpr int kRingElemBytes = kFp8 ? 1 : kIsF32<Tag> ? 4 : 2;

template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV = 0>
__device__ const int decode_kernel_smem_bytes =
    DecodeRingTile<kHeadDim, kHeadDimV, kBlockM, kBlockN, kNWarps, kRingElemBytes<Tag, false>>::kSmemBytes;
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV = 0>
__device__ const int decode_fp8_kernel_smem_bytes =
    DecodeRingTile<kHeadDim, kHeadDimV, kBlockM, kBlockN, kNWarps, kRingElemBytes<Tag, true>>::kSmemBytes;

// A stage's keys [n0, n0 + kBlockN) (those below key_end), by all the CTA's threads.
template <class Tile, class Work>
__device__ __forceinline__ void load_stage(const DecodeParams& p, const Work& w, unsigned char* stage, int n0, int tid) {
    const unsigned char* gK = Tile::kElemBytes == 1 ? w.gK8 : reinterpret_cast<const unsigned char*>(w.gK);
    const unsigned char* gV = Tile::kElemBytes == 1 ? w.gV8 : reinterpret_cast<const unsigned char*>(w.gV);
    if constexpr (Tile::kElemBytes == 4) {   // (DecodeWork's pointers count 16-bit elements)
        gK = static_cast<const unsigned char*>(p.k) + static_cast<i64>(w.head_kv) * p.k_head_stride * 4;
        gV = static_cast<const unsigned char*>(p.v) + static_cast<i64>(w.head_kv) * p.v_head_stride * 4;
    }
    load_keys_by_row<Tile, Tile::kThreads, Tile::kElemBytes, Tile::kRowBytesK, Tile::kRowBytesV>(
        p, w.at, gK, gV, stage, stage + Tile::kBlockN * Tile::kRowBytesK, n0, w.key_hi, tid);
}

template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV_, bool kFp8>
__device__ __forceinline__ void decode_body(const DecodeParams& p) {
    using Tile = DecodeRingTile<kHeadDim, kHeadDimV_, kBlockM, kBlockN, kNWarps, kRingElemBytes<Tag, kFp8>>;
    constexpr int kStages = Tile::kStages;
    // bf16 queries over an fp8 cache: fp16 products, Q's rows rescaled first (decode_sm90.cu's reasons).
    constexpr bool kF16Products = kFp8 && kIsBf16<Tag> && Tile::kHeadDimV <= 128;
    using MmaTag = typename PickType<kF16Products, f16_tag, Tag>::type;
    launch_dependents();   // the split merge (launched programmatically) may take its place now

    extern __shared__ __align__(128) unsigned char smem_bytes[];
    u16* sQ = reinterpret_cast<u16*>(smem_bytes);
    float* q_descales = reinterpret_cast<float*>(smem_bytes + Tile::kQElems * 2);
    u16* buffers = reinterpret_cast<u16*>(smem_bytes + Tile::kQBytes);
    unsigned char* ring = smem_bytes + Tile::kRingOffset;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / Tile::kWarpsN, wn = warp % Tile::kWarpsN;
    const DecodeWork<kBlockM, kBlockN, Variant> w(p);
    const int n_tiles = w.n_tiles;

    load_q<Tile, Tile::kElemBytes == 4 ? 4 : 2>(p, w, sQ, tid, Tile::kThreads);
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) {
        if (st < n_tiles) load_stage<Tile>(p, w, ring + st * Tile::kStageBytes, w.key_lo + st * kBlockN, tid);
        cp_async_commit();   // the first group holds Q too
    }

    DecodeRows<Tag, Tile, Variant, MmaTag> rows(p, w, wm, lane);
    if constexpr (kF16Products) {
        cp_async_wait<kStages - 2>();
        __syncthreads();   // Q landed
        rescale_q_to_f16<Tile>(sQ, q_descales, warp, kNWarps, lane);
        __syncthreads();
        rows.read_q_descales(q_descales, wm, lane);
    }
    u16* bK = buffers + warp * Tile::kBufferElems;
    u16* bV = bK + Tile::kSliceN * Tile::kStrideK;
    for (int it = 0; it < n_tiles; ++it) {
        cp_async_wait<kStages - 2>();
        __syncthreads();   // tile `it` landed for every thread; stage (it - 1) % kStages is free
        {
            const int next = it + kStages - 1;
            if (next < n_tiles)
                load_stage<Tile>(p, w, ring + (next % kStages) * Tile::kStageBytes, w.key_lo + next * kBlockN, tid);
            cp_async_commit();
        }
        const unsigned char* sK = ring + (it % kStages) * Tile::kStageBytes;
        const unsigned char* sV = sK + kBlockN * Tile::kRowBytesK;
        const int n0 = w.key_lo + it * kBlockN + wn * Tile::kSliceN;
        if constexpr (kFp8) {
            dequant_rows<MmaTag, Tile::kSliceN, Tile::kHeadDim, Tile::kRowBytesK, Tile::kStrideK>(
                sK + wn * Tile::kSliceN * Tile::kRowBytesK, bK, lane);
            dequant_rows<MmaTag, Tile::kSliceN, Tile::kHeadDimV, Tile::kRowBytesV, Tile::kStrideV>(
                sV + wn * Tile::kSliceN * Tile::kRowBytesV, bV, lane);
            __syncwarp();
            rows.step(p, w, sQ, bK, bV, n0, wm, 0, lane);
            __syncwarp();   // every lane done with the buffer before the next tile's rows overwrite it
        } else {
            rows.step(p, w, sQ, reinterpret_cast<const u16*>(sK), reinterpret_cast<const u16*>(sV), n0, wm,
                      wn * Tile::kSliceN, lane);
        }
    }
    cp_async_wait<0>();
    rows.reduce_sums();
    __syncthreads();   // every warp is done with the buffers and the ring: the merge reuses them

    float* red = reinterpret_cast<float*>(buffers);
    rows.store_partial(red, warp, lane);
    __syncthreads();
    merge_and_store<Tag, Tile, Variant>(p, w, red, tid, Tile::kThreads);
}

template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV = 0>
__global__ void __launch_bounds__(kNWarps * 32, 1)
decode_kernel(const DecodeParams p) {
    decode_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, Variant, kHeadDimV, false>(p);
}

// The same over e4m3 caches (Tag: q's and the output's type), each stored element times its KV head's scale (sm_89+).
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV = 0>
__global__ void __launch_bounds__(kNWarps * 32, 1)
decode_fp8_kernel(const DecodeParams p) {
    decode_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, Variant, kHeadDimV, true>(p);
}
