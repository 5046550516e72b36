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
//
// Three ways to fill a stage (kLoad): TMA tensor-map boxes of a 16-bit cache (the default where TMA can address the
// cache: one thread issues a box per 64 columns of a tile, or per page part of it; the rows land as 128-byte swizzled
// panels; 5-9 % faster than cp.async, BENCHMARKS.md), cp.async chunks of a 16-bit cache, or of an fp8 cache (each
// consumer warp then converts its key slice to 16-bit rows in a buffer of its own). A box loads whole rows up to its
// end, so V's rows past the CTA's last key are dropped from the consumers' fragments (DecodeRows::step's kMaskV)
// rather than zeroed in shared memory (generic stores into a stage the async proxy refills).
#include "decode_parts.cuh"
#include "../sm90/pipeline.cuh"
#include "../sm90/tma.cuh"

// The producer warps (cuflash/kvcache.py's SM90_PRODUCER_WARPS: the launch's threads count them). Four beat two on
// paged caches and tie on contiguous ones; one halves the bandwidth (BENCHMARKS.md).
constexpr int kProducerWarps = 4;

constexpr int kLoadCpAsync = 0, kLoadCpAsyncFp8 = 1, kLoadTma = 2;
// Producer warps by way of filling: TMA's boxes come from one thread (cuflash/kvcache.py: SM90_TMA_PRODUCER_WARPS).
template <int kLoad> constexpr int kProducersOf = kLoad == kLoadTma ? 1 : kProducerWarps;

// DecodeTile's kNWarps are the consumer warps. kLoadCpAsyncFp8: the caches hold e4m3 values; the ring holds their
// bytes and each consumer warp turns its key slice of a stage into 16-bit rows in a buffer of its own (freeing the
// stage before its products), which step() reads as it reads a 16-bit stage.
template <int kHeadDim, int kHeadDimV, int kBlockM, int kBlockN, int kConsumerWarps, int kLoad, bool kLatent = false>
struct DecodeSm90Tile
    : DecodeTile<kHeadDim, kHeadDimV, kBlockM, kBlockN, kConsumerWarps, kLatent> {
    using Base = DecodeTile<kHeadDim, kHeadDimV, kBlockM, kBlockN, kConsumerWarps, kLatent>;
    static constexpr bool kFp8 = kLoad == kLoadCpAsyncFp8, kTma = kLoad == kLoadTma;
    // DecodeTile's ring depth: 4 or 5 TMA stages measured 1-3 % slower at batch 1 and 8 (BENCHMARKS.md).
    static constexpr int kStages = Base::kStages;
    static constexpr int kBarrierBytes = 128;   // the full and empty barriers, before Q
    static_assert(2 * kStages * 8 <= kBarrierBytes, "barriers of the ring");
    static constexpr int kElemBytes = kFp8 ? 1 : 2;
    // A stage's rows in bytes: fp8 rows padded by 16 bytes (a warp's 16-byte reads of 8 rows fall in distinct
    // bank groups), 16-bit rows as DecodeTile's; TMA: 64-column panels of 128-byte rows (K's panels, then V's).
    static constexpr int kRowBytesK = kFp8 ? Base::kHeadDim + 16 : Base::kStrideK * 2;
    static constexpr int kRowBytesV = kFp8 ? Base::kHeadDimV + 16 : Base::kStrideV * 2;
    static constexpr int kKBytes = kTma ? kBlockN * Base::kHeadDim * 2 : kBlockN * kRowBytesK;
    static constexpr int kStageBytes = kTma ? kBlockN * (Base::kHeadDim + Base::kHeadDimV) * 2
                                            : kBlockN * (kRowBytesK + (kLatent ? 0 : kRowBytesV));
    static constexpr int kBufferElems = kFp8 ? Base::kSliceN * (Base::kStrideK + Base::kStrideV) : 0;   // a warp's
    static constexpr int kQBytes = Base::kQElems * 2 + (kFp8 ? kBlockM * 4 : 0);   // (+ Q's row scales)
    // TMA's swizzled panels start on 1024-byte boundaries: the ring's offset is rounded up, and the base aligned at
    // run time (kAlignSlack bytes of room).
    static constexpr int kAlignSlack = kTma ? 1024 : 0;
    static constexpr int kRingOffset = kTma ? (kBarrierBytes + kQBytes + 1023) / 1024 * 1024
                                            : kBarrierBytes + kQBytes + kConsumerWarps * kBufferElems * 2;
    // After the loop the consumers' buffers and the ring hold the merge's partial results.
    static constexpr int kWorkBytes = kRingOffset - kBarrierBytes - kQBytes + kStages * kStageBytes;
    static constexpr int kSmemBytes =
        kAlignSlack + kBarrierBytes + kQBytes + (kWorkBytes > Base::kRedBytes ? kWorkBytes : Base::kRedBytes);
    // Two CTAs an SM where their shared memory fits and 128 registers a thread hold S and O (up to 8 warps a CTA, O
    // rows of up to 128 columns, key slices of up to 32).
    static constexpr int kMinBlocks = 2 * kSmemBytes + 2048 <= 227 * 1024 && kConsumerWarps + kProducersOf<kLoad> <= 8
                                      && Base::kHeadDimV <= 128 && Base::kSliceN <= 32 ? 2 : 1;
};


// A TMA stage's rows as step() reads them: 64-column panels of kRows 128-byte rows, 128-byte swizzled.
template <int kRows>
struct SwizzledPanels {
    __device__ static __forceinline__ const void* at(const u16* tile, int row, int col) {   // col: a multiple of 8
        return reinterpret_cast<const unsigned char*>(tile) + (col >> 6) * (kRows * 128) + swizzle128(row, (col & 63) >> 3);
    }
    __device__ static __forceinline__ void b_nk(u32 (&b)[4], const u16* tile, int n0, int k0, int lane) {
        ldmatrix_x4(b, at(tile, n0 + (lane & 7) + (lane >> 4) * 8, k0 + ((lane >> 3) & 1) * 8));
    }
    __device__ static __forceinline__ void b_kn(u32 (&b)[4], const u16* tile, int k0, int n0, int lane) {
        ldmatrix_x4_trans(b, at(tile, k0 + (lane & 7) + ((lane >> 3) & 1) * 8, n0 + (lane >> 4) * 8));
    }
};

// kNWarps counts the producer warps too (the launch's threads): kNWarps - kProducersOf<kLoad> consumer warps.
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV = 0>
__device__ const int decode_sm90_kernel_smem_bytes =
    DecodeSm90Tile<kHeadDim, kHeadDimV, kBlockM, kBlockN, kNWarps - kProducerWarps, kLoadCpAsync>::kSmemBytes;
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV = 0>
__device__ const int decode_sm90_fp8_kernel_smem_bytes =
    DecodeSm90Tile<kHeadDim, kHeadDimV, kBlockM, kBlockN, kNWarps - kProducerWarps, kLoadCpAsyncFp8>::kSmemBytes;
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV = 0>
__device__ const int decode_sm90_mla_kernel_smem_bytes =
    DecodeSm90Tile<kHeadDim, kHeadDimV, kBlockM, kBlockN, kNWarps - kProducerWarps, kLoadCpAsync, true>::kSmemBytes;
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV = 0>
__device__ const int decode_sm90_tma_kernel_smem_bytes =
    DecodeSm90Tile<kHeadDim, kHeadDimV, kBlockM, kBlockN, kNWarps - kProducersOf<kLoadTma>, kLoadTma>::kSmemBytes;

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

// Rows per TMA box: a whole tile for a contiguous cache; for a paged one the largest power of two that divides the
// page size, up to the tile (a tile's first key is a multiple of the tile, DecodeWork's kAlignedTiles, so no box
// straddles a page).
template <int kBlockN>
__device__ __forceinline__ int tma_box_rows(const DecodeParams& p) {
    return p.block_table != nullptr ? min(kBlockN, p.page_size & -p.page_size) : kBlockN;
}

// The TMA producer (one thread): tile by tile, the block-table entries of its boxes, then the wait for the stage, the
// bytes expected, and a box per 64 columns (per page part) of K and of V. A paged tile's boxes past the CTA's last
// key are not issued (their table entries may lie past the sequence's row).
template <class Tile, class Work>
__device__ __forceinline__ void decode_producer_tma(const DecodeParams& p, const Work& w, const TmaDesc* tma_k,
                                                    const TmaDesc* tma_v, u32 ring, u32 full_bar, u32 empty_bar) {
    constexpr int kBlockN = Tile::kBlockN, kMaxBoxes = kBlockN / 16;
    tma_prefetch_desc(tma_k);
    tma_prefetch_desc(tma_v);
    const bool paged = p.block_table != nullptr;
    const int box = tma_box_rows<kBlockN>(p);
    const u32 box_bytes = box * (Tile::kHeadDim + Tile::kHeadDimV) * 2;
    for (int it = 0; it < w.n_tiles; ++it) {
        const int stage = it % Tile::kStages, key0 = w.key_lo + it * kBlockN;
        const int boxes = paged ? ceil_div(min(key0 + kBlockN, w.key_hi) - key0, box) : 1;
        // The boxes' pages: their table reads in flight while the stage is waited for.
        int page[kMaxBoxes];
#pragma unroll
        for (int i = 0; i < kMaxBoxes; ++i) page[i] = paged && i < boxes ? w.at.page(key0 + i * box) : w.at.cache_row;
        mbar_wait(empty_bar + stage * 8, ((it / Tile::kStages) & 1) ^ 1);
        const u32 full = full_bar + stage * 8, sK = ring + stage * Tile::kStageBytes, sV = sK + Tile::kKBytes;
        mbar_arrive_expect_tx(full, boxes * box_bytes);
#pragma unroll
        for (int i = 0; i < kMaxBoxes; ++i) {
            if (i < boxes) {
                const int key = key0 + i * box, slot = paged ? w.at.slot(key) : key + w.at.key_offset;
#pragma unroll
                for (int c = 0; c < Tile::kHeadDim / 64; ++c)
                    tma_load_4d(sK + c * kBlockN * 128 + i * box * 128, tma_k, full, c * 64, w.head_kv, slot, page[i]);
#pragma unroll
                for (int c = 0; c < Tile::kHeadDimV / 64; ++c)
                    tma_load_4d(sV + c * kBlockN * 128 + i * box * 128, tma_v, full, c * 64, w.head_kv, slot, page[i]);
            }
        }
    }
}

template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV_, int kLoad,
          bool kLatent = false>
__device__ __forceinline__ void decode_sm90_body(const DecodeParams& p, const TmaDesc* tma_k, const TmaDesc* tma_v) {
    constexpr int kConsumerWarps = kNWarps - kProducersOf<kLoad>;
    using Tile = DecodeSm90Tile<kHeadDim, kHeadDimV_, kBlockM, kBlockN, kConsumerWarps, kLoad, kLatent>;
    constexpr int kStages = Tile::kStages, kConsumers = kConsumerWarps * 32, kSliceN = Tile::kSliceN;
    constexpr bool kFp8 = Tile::kFp8, kTma = Tile::kTma;
    launch_dependents();   // the split merge (launched programmatically) may take its place now

    extern __shared__ __align__(128) unsigned char smem_raw[];
    unsigned char* smem_bytes = smem_raw;
    if constexpr (kTma) {   // the base on a 1024-byte boundary (the room is in kSmemBytes)
        const u32 raw = static_cast<u32>(__cvta_generic_to_shared(smem_raw));
        smem_bytes = smem_raw + (((raw + 1023) & ~1023u) - raw);
    }
    const u32 full_bar = static_cast<u32>(__cvta_generic_to_shared(smem_bytes));
    const u32 empty_bar = full_bar + kStages * 8;
    u16* sQ = reinterpret_cast<u16*>(smem_bytes + Tile::kBarrierBytes);
    u16* buffers = reinterpret_cast<u16*>(smem_bytes + Tile::kBarrierBytes + Tile::kQBytes);
    unsigned char* ring = smem_bytes + Tile::kRingOffset;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const DecodeWork<kBlockM, kBlockN, Variant, kTma> w(p);

    if (tid == 0) {
        for (int st = 0; st < kStages; ++st) {
            mbar_init(full_bar + st * 8, kTma ? 1 : kProducerWarps * 32);
            mbar_init(empty_bar + st * 8, kConsumerWarps);
        }
        fence_barrier_init();
    }
    __syncthreads();

    if (warp >= kConsumerWarps) {   // the producers: no barrier below waits for them
        if constexpr (kTma) {
            if (tid == kConsumers)
                decode_producer_tma<Tile>(p, w, tma_k, tma_v, static_cast<u32>(__cvta_generic_to_shared(ring)),
                                          full_bar, empty_bar);
        } else {
            decode_producer<Tile>(p, w, ring, full_bar, empty_bar, tid - kConsumers);
        }
        return;
    }

    const int wm = warp / Tile::kWarpsN, wn = warp % Tile::kWarpsN;
    load_q<Tile>(p, w, sQ, tid, kConsumers);
    cp_async_commit();
    cp_async_wait<0>();
    named_barrier_sync(1, kConsumers);   // Q landed for every consumer

    // bf16 queries over an fp8 cache: the products in fp16, Q's rows rescaled first by a power of two each
    // (rescale_q_to_f16), so that an e4m3 pair's conversion is one instruction (5-8 % faster than converting to bf16:
    // BENCHMARKS.md). Up to 128 columns of V: wider rows leave no registers for the rescale.
    constexpr bool kF16Products = kFp8 && kIsBf16<Tag> && Tile::kHeadDimV <= 128;
    using MmaTag = typename PickType<kF16Products, f16_tag, Tag>::type;
    float* q_descales = reinterpret_cast<float*>(smem_bytes + Tile::kBarrierBytes + Tile::kQElems * 2);
    if constexpr (kF16Products) {
        rescale_q_to_f16<Tile>(sQ, q_descales, warp, kConsumerWarps, lane);
        named_barrier_sync(1, kConsumers);
    }
    DecodeRows<Tag, Tile, Variant, MmaTag> rows(p, w, wm, lane, wn);
    if constexpr (kF16Products) rows.read_q_descales(q_descales, wm, lane);
    u16* bK = buffers + warp * Tile::kBufferElems;
    u16* bV = bK + kSliceN * Tile::kStrideK;
    for (int it = 0; it < w.n_tiles; ++it) {
        const int stage = it % kStages;
        mbar_wait(full_bar + stage * 8, (it / kStages) & 1);
        unsigned char* sK = ring + stage * Tile::kStageBytes;
        unsigned char* sV = kLatent ? sK : sK + Tile::kKBytes;   // (kLatent: V is the first columns of K's rows)
        const int slice = kLatent ? 0 : wn * kSliceN;   // the warp's first row of the tile
        const int n0 = w.key_lo + it * kBlockN + slice;
        if constexpr (kTma) {
            using Rows = SwizzledPanels<kBlockN>;
            rows.template step<Rows, Rows, true>(p, w, sQ, reinterpret_cast<const u16*>(sK),
                                                 reinterpret_cast<const u16*>(sV), n0, wm, wn * kSliceN, lane);
            __syncwarp();
            if (lane == 0) mbar_arrive(empty_bar + stage * 8);
        } else if constexpr (kFp8) {
            dequant_rows<MmaTag, kSliceN, Tile::kHeadDim, Tile::kRowBytesK, Tile::kStrideK>(
                sK + wn * kSliceN * Tile::kRowBytesK, bK, lane);
            dequant_rows<MmaTag, kSliceN, Tile::kHeadDimV, Tile::kRowBytesV, Tile::kStrideV>(
                sV + wn * kSliceN * Tile::kRowBytesV, bV, lane);
            __syncwarp();
            if (lane == 0) mbar_arrive(empty_bar + stage * 8);   // the stage is free before the products
            rows.step(p, w, sQ, bK, bV, n0, wm, 0, lane);
            __syncwarp();   // every lane done with the buffer before the next tile's rows overwrite it
        } else {
            rows.step(p, w, sQ, reinterpret_cast<const u16*>(sK), reinterpret_cast<const u16*>(sV), n0, wm, slice, lane);
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
                                                                kNWarps - kProducerWarps, kLoadCpAsync>::kMinBlocks))
decode_sm90_kernel(const DecodeParams p) {
    decode_sm90_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, Variant, kHeadDimV, kLoadCpAsync>(p, nullptr, nullptr);
}

// The same over e4m3 caches (Tag: q's and the output's type), each stored element times its KV head's scale.
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV = 0>
__global__ void __launch_bounds__(kNWarps * 32, (DecodeSm90Tile<kHeadDim, kHeadDimV, kBlockM, kBlockN,
                                                                kNWarps - kProducerWarps, kLoadCpAsyncFp8>::kMinBlocks))
decode_sm90_fp8_kernel(const DecodeParams p) {
    decode_sm90_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, Variant, kHeadDimV, kLoadCpAsyncFp8>(p, nullptr,
                                                                                                  nullptr);
}

// MLA's latent cache (FlashMLA's layout): V is the first kHeadDimV (512) columns of the K rows (576); the warps split
// O's columns (DecodeTile's kLatent).
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV = 0>
__global__ void __launch_bounds__(kNWarps * 32, 1)
decode_sm90_mla_kernel(const DecodeParams p) {
    decode_sm90_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, Variant, kHeadDimV, kLoadCpAsync, true>(p, nullptr,
                                                                                                    nullptr);
}

// The same over 16-bit caches by TMA: tensor maps over (head dim, heads, keys, cache rows) of a contiguous cache, or
// (head dim, heads, page rows, pages) of a paged one (cuflash/kvcache.py), boxes of 64 columns.
template <typename Tag, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV = 0>
__global__ void __launch_bounds__(kNWarps * 32, (DecodeSm90Tile<kHeadDim, kHeadDimV, kBlockM, kBlockN,
                                                                kNWarps - kProducersOf<kLoadTma>, kLoadTma>::kMinBlocks))
decode_sm90_tma_kernel(const DecodeParams p, const __grid_constant__ TmaDesc tma_k,
                       const __grid_constant__ TmaDesc tma_v) {
    decode_sm90_body<Tag, kHeadDim, kBlockM, kBlockN, kNWarps, Variant, kHeadDimV, kLoadTma>(p, &tma_k, &tma_v);
}
