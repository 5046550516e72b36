// The parts of the decode kernels (kernels_cu/decode/decode.cu: a cp.async ring for every GPU; decode_sm90.cu: a
// producer warp's bulk copies on Hopper): the tile shape, a sequence's cache addressing, a CTA's share of the work,
// the consumer warps' online softmax over key tiles in shared memory, and the merge of the warps' partial results.
//
//   - GQA packed: a CTA takes one KV head of one sequence and every query row that reads it, the
//     seqlen_q x heads_per_kv rows (token t, head h_kv * heads_per_kv + g) packed into kBlockM-row tiles, so a
//     key is loaded once for all the query heads that share it.
//   - Split-KV: the sequence's keys are split over gridDim.y CTAs of keys_per_split keys; each writes its
//     normalised partial result and lse (float32), merged by combine.cu. With one split the CTA writes the
//     output itself.
//   - Inside a CTA the consumer warps are a kWarpsM x kWarpsN grid: warp (wm, wn) owns 16 packed rows and a
//     kSliceN-key slice of every key tile, with its own running max, sum and O; the kWarpsN partial results of a
//     row are merged through shared memory at the end. At one 16-row tile (a single token, GQA up to 16) every
//     warp reads different keys and no tensor-core work is repeated.
// The mask policy (common/mask.cuh) sees token indices as rows and key positions as columns, with the
// diagonal at seqlen_k - seqlen_q (new tokens at the end of the cache), as the dense kernels.
#pragma once
#include "../common/launch_order.cuh"
#include "../common/numeric.cuh"
#include "../common/params.cuh"
#include "../common/mask.cuh"
#include "../sm80/copy.cuh"
#include "../sm80/mma.cuh"

// The ring keeps two CTAs on an SM: 3 stages up to 256 columns of K and V together, else 2 (kLatent: 3 of K alone).
// kLatent (MLA's shared latent cache): V is the first kHeadDimV columns of the K rows (a stage holds K only), and the
// warps of a row group split O's columns instead of the keys (O rows of 512 columns do not fit one warp's registers):
// each computes the whole tile's scores, the same in every warp of the group.
template <int kHeadDim_, int kHeadDimV_, int kBlockM_, int kBlockN_, int kNWarps_, bool kLatent_ = false>
struct DecodeTile {
    static constexpr bool kLatent = kLatent_;
    static constexpr int kHeadDim = kHeadDim_, kHeadDimV = kHeadDimV_ ? kHeadDimV_ : kHeadDim_;
    static constexpr int kBlockM = kBlockM_, kBlockN = kBlockN_, kNWarps = kNWarps_, kThreads = kNWarps_ * 32;
    static constexpr int kWarpsM = kBlockM / 16, kWarpsN = kNWarps / kWarpsM;
    static constexpr int kSliceN = kLatent ? kBlockN : kBlockN / kWarpsN;    // a warp's keys of a tile
    static constexpr int kOCols = kLatent ? kHeadDimV / kWarpsN : kHeadDimV;  // a warp's columns of O
    // Rows padded by 16 bytes: ldmatrix's eight row addresses fall in distinct bank groups.
    static constexpr int kStrideK = kHeadDim + 8, kStrideV = kLatent ? kStrideK : kHeadDimV + 8;
    static constexpr int kStages = kLatent || kHeadDim + kHeadDimV <= 256 ? 3 : 2;
    static constexpr int kQElems = kBlockM * kStrideK;
    static constexpr int kStageElems = kBlockN * (kStrideK + (kLatent ? 0 : kStrideV));
    // The end's merge of the warps' partial results (over the drained ring): O rows and (max, sum) per warp, or per
    // row group (kLatent: its warps' columns side by side, their (max, sum) the same).
    static constexpr int kMergeWarps = kLatent ? kWarpsM : kNWarps, kMergeWarpsN = kLatent ? 1 : kWarpsN;
    static constexpr int kRedStride = kHeadDimV + 4;
    static constexpr int kRedBytes = kMergeWarps * 16 * (kRedStride + 2) * 4;
    static constexpr int kSmemBytes = (kQElems + kStages * kStageElems) * 2 > kQElems * 2 + kRedBytes
                                          ? (kQElems + kStages * kStageElems) * 2 : kQElems * 2 + kRedBytes;
    static_assert(kBlockM % 16 == 0 && kNWarps % kWarpsM == 0, "16-row warps tiling the rows");
    static_assert(kSliceN % 16 == 0 && kOCols % 16 == 0, "each warp's keys and O columns are whole 16-wide MMA steps");
    static_assert(kHeadDim % 16 == 0 && kHeadDimV % 16 == 0, "head-dim buckets of whole MMA steps");
};

// Where sequence `batch`'s keys live: key j's row offset (in elements) in the K and V caches.
struct CacheAddress {
    const int* pages;   // the sequence's block-table row (paged), else null
    int page_size, page_shift, last_page;
    i64 k_base, v_base; // contiguous: the offset of the sequence's key 0 (its cache row and left pad); paged: 0
    int cache_row, key_offset;   // contiguous: the sequence's cache row and left pad (a tensor map's coordinates)

    // Key j's page index in the table (a shift for power-of-two page sizes) and its row in the page.
    __device__ __forceinline__ int page_index(int key) const { return page_shift >= 0 ? key >> page_shift : key / page_size; }
    __device__ __forceinline__ int slot(int key) const {
        return page_shift >= 0 ? key & (page_size - 1) : key - (key / page_size) * page_size;
    }
    // The page of key j (paged; a table entry out of range reads a page that exists: wrong keys, never a bad
    // address). A plain load: the loads of a tile's rows go out together.
    __device__ __forceinline__ int page(int key) const {
        return pages != nullptr ? min(max(pages[page_index(key)], 0), last_page) : 0;
    }
    __device__ __forceinline__ i64 k_offset(const DecodeParams& p, int key, int pg) const {
        return pages != nullptr ? pg * p.k_batch_stride + slot(key) * p.k_row_stride : k_base + key * p.k_row_stride;
    }
    __device__ __forceinline__ i64 v_offset(const DecodeParams& p, int key, int pg) const {
        return pages != nullptr ? pg * p.v_batch_stride + slot(key) * p.v_row_stride : v_base + key * p.v_row_stride;
    }
};

// A CTA's share: one sequence, one KV head, one tile of packed query rows, the keys of one split (narrowed to what
// the tile's tokens can see), and where those keys live. kAlignedTiles: the first key narrowed down to a multiple of
// the tile (the rows' own bounds mask the keys before theirs), so that a tile never straddles a page's 16-row parts
// (TMA boxes).
template <int kBlockM, int kBlockN, class Variant, bool kAlignedTiles = false>
struct DecodeWork {
    DecodeParams s;   // the call's parameters with this sequence's seqlen_k and mask diagonal (the mask reads them)
    CacheAddress at;
    const u16* gK;    // the KV head's column 0 in the caches (16-bit caches; gK8 / gV8: fp8 ones)
    const u16* gV;
    const unsigned char* gK8;
    const unsigned char* gV8;
    float v_scale;    // an fp8 V cache's scale for this KV head (1: 16-bit); K's is folded into s's score scales
    int split, head_kv, batch, group, rows, row0;
    int key_lo, key_hi, n_tiles;

    __device__ __forceinline__ explicit DecodeWork(const DecodeParams& p) : s(p) {
        using Mask = MaskPolicy<kBlockM, kBlockN, Variant>;
        split = blockIdx.y;   // grid: (KV head x row tile, split, sequence), heads fastest
        const int m_tiles = ceil_div(p.seqlen_q * p.heads_per_kv, kBlockM);
        const int m_block = blockIdx.x % m_tiles;
        head_kv = blockIdx.x / m_tiles;
        batch = blockIdx.z;
        group = p.heads_per_kv;
        rows = p.seqlen_q * group;

        // This sequence's keys: the cache's plus the appended ones from its left pad on (contiguous caches only:
        // the host refuses a pad with a block table), never past what the cache holds.
        const int pad = p.cache_leftpad != nullptr ? min(max(p.cache_leftpad[batch], 0), p.cache_capacity) : 0;
        s.seqlen_k = min(max(p.cache_seqlens[batch], 0) + p.seqlen_new, p.cache_capacity) - pad;
        s.seqlen_k = max(s.seqlen_k, 0);
        s.mask_diag = s.seqlen_k - p.seqlen_q + p.mask_diag;

        at.page_size = p.page_size;
        at.page_shift = p.page_shift;
        at.last_page = p.cache_rows - 1;
        at.pages = p.block_table != nullptr ? p.block_table + batch * p.block_table_batch_stride : nullptr;
        int row = batch;
        if (p.cache_batch_idx != nullptr) row = min(max(p.cache_batch_idx[batch], 0), p.cache_rows - 1);
        at.cache_row = row;
        at.key_offset = pad;
        at.k_base = at.pages != nullptr ? 0 : row * p.k_batch_stride + pad * p.k_row_stride;
        at.v_base = at.pages != nullptr ? 0 : row * p.v_batch_stride + pad * p.v_row_stride;
        gK = static_cast<const u16*>(p.k) + head_kv * p.k_head_stride;
        gV = static_cast<const u16*>(p.v) + head_kv * p.v_head_stride;
        gK8 = static_cast<const unsigned char*>(p.k) + head_kv * p.k_head_stride;
        gV8 = static_cast<const unsigned char*>(p.v) + head_kv * p.v_head_stride;
        // An fp8 cache stores K / k_scale: q . K = k_scale (q . K8), so the scale multiplies the score scale (and the
        // score modifiers' conversions, which divide by it); V's multiplies the output.
        const int scale_at = batch * p.scale_batch_stride + head_kv * p.scale_head_stride;
        v_scale = p.v_scale != nullptr ? p.v_scale[scale_at] : p.v_scale_value;
        const float k_scale = p.k_scale != nullptr ? p.k_scale[scale_at] : p.k_scale_value;
        if (k_scale != 1.f) {
            s.softmax_scale *= k_scale;
            s.scale_log2 *= k_scale;
            s.softcap_in *= k_scale;
            s.softcap_out /= k_scale;
            s.alibi_scale /= k_scale;
        }

        // The keys this CTA visits: its split, narrowed to what the tile's first and last tokens can see.
        row0 = m_block * kBlockM;
        const int t_first = row0 / group, t_last = min(p.seqlen_q - 1, (row0 + kBlockM - 1) / group);
        key_lo = split * p.keys_per_split;
        key_hi = min(s.seqlen_k, key_lo + p.keys_per_split);
        if constexpr (Mask::kSkipsTiles) {   // a row's first and last visible keys never decrease with the row
            const Mask mask(s, p.seqlen_q, batch, 0);
            int lo, hi;
            mask.row_keys(t_first, lo, hi);
            key_lo = max(key_lo, kAlignedTiles ? lo / kBlockN * kBlockN : lo);
            mask.row_keys(t_last, lo, hi);
            key_hi = min(key_hi, hi + 1);
        }
        n_tiles = key_hi > key_lo ? ceil_div(key_hi - key_lo, kBlockN) : 0;
    }
};

// Q rows of the tile (token t = row / group, head head_kv * group + row % group) by cp.async, over `threads`
// threads; rows past the tokens and columns past head_dim zero-filled. The caller commits and waits.
// kElemBytes 4: float32 rows of Tile::kRowBytesK bytes (their 16-byte chunks hold 4 columns).
template <class Tile, int kElemBytes = 2, class Work>
__device__ __forceinline__ void load_q(const DecodeParams& p, const Work& w, u16* sQ, int tid, int threads) {
    using Elem = typename PickType<kElemBytes == 4, float, u16>::type;
    constexpr int kHeadDim = Tile::kHeadDim, kChunk = 16 / kElemBytes;
    constexpr int kStride = kElemBytes == 4 ? Tile::kRowBytesK / 4 : Tile::kStrideK;   // (in elements)
    Elem* dst = reinterpret_cast<Elem*>(sQ);
    for (int c = tid; c < Tile::kBlockM * (kHeadDim / kChunk); c += threads) {
        const int r = c / (kHeadDim / kChunk), col = (c % (kHeadDim / kChunk)) * kChunk;
        const int row = w.row0 + r;
        const bool valid = row < w.rows && col < p.head_dim;
        const int t = valid ? row / w.group : 0, h = w.head_kv * w.group + (valid ? row % w.group : 0);
        const Elem* src = static_cast<const Elem*>(p.q) + w.batch * p.q_batch_stride + t * p.q_row_stride
                          + h * p.q_head_stride + col;
        cp_async_16(dst + r * kStride + col, src, valid);
    }
}

// Keys [n0, n0 + kBlockN) (those below key_end; the rest zero-filled) into a ring stage, by cp.async over kThreads
// threads (tid: the thread's index among them): 8 threads per key row (each warp instruction covers four rows'
// 128-byte segments), each thread the same 16-byte column chunks of kBlockN * 8 / kThreads rows, a row's address and
// block-table entry (one for K and V) computed once per row, the table reads of all its rows in flight before the
// copies (asm volatile, which the compiler does not move loads across). (Per-chunk addresses cost 1.0-1.6x the time
// in the portable kernel and a third more registers: BENCHMARKS.md.) kElemBytes: 2 (a 16-bit cache) or 1 (fp8);
// sK / sV: the stage's K and V rows, kRowBytesK / kRowBytesV apart.
template <class Tile, int kThreads, int kElemBytes, int kRowBytesK, int kRowBytesV>
__device__ __forceinline__ void load_keys_by_row(const DecodeParams& p, const CacheAddress& at,
                                                 const unsigned char* gK, const unsigned char* gV, unsigned char* sK,
                                                 unsigned char* sV, int n0, int key_end, int tid) {
    constexpr int kLanesPerRow = 8, kRowsPerPass = kThreads / kLanesPerRow, kPasses = Tile::kBlockN / kRowsPerPass;
    constexpr int kElems = 16 / kElemBytes, kPassCols = kLanesPerRow * kElems;   // a chunk's, a pass's columns
    static_assert(kThreads % kLanesPerRow == 0 && Tile::kBlockN % kRowsPerPass == 0, "whole rows per pass");
    const int sub = tid % kLanesPerRow, first_row = tid / kLanesPerRow;
    int page[kPasses];
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
        const int key = n0 + first_row + i * kRowsPerPass;
        page[i] = key < key_end ? at.page(key) : 0;
    }
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
        const int row = first_row + i * kRowsPerPass, key = n0 + row;
        const bool valid = key < key_end;
        const unsigned char* k_src = gK + (valid ? at.k_offset(p, key, page[i]) * kElemBytes : 0);
        const unsigned char* v_src = gV + (valid ? at.v_offset(p, key, page[i]) * kElemBytes : 0);
        // A chunk reads the row's bytes up to head_dim (a chunk of 16 fp8 columns may hold 8), zero-fills the rest.
#pragma unroll
        for (int j = 0; j < ceil_div(Tile::kHeadDim, kPassCols); ++j) {
            const int col = sub * kElems + kPassCols * j;
            if (Tile::kHeadDim % kPassCols == 0 || col < Tile::kHeadDim)
                cp_async_16_bytes(sK + row * kRowBytesK + col * kElemBytes, k_src + col * kElemBytes,
                                  valid ? min(max((p.head_dim - col) * kElemBytes, 0), 16) : 0);
        }
#pragma unroll
        for (int j = 0; j < (Tile::kLatent ? 0 : ceil_div(Tile::kHeadDimV, kPassCols)); ++j) {   // (kLatent: V is K)
            const int col = sub * kElems + kPassCols * j;
            if (Tile::kHeadDimV % kPassCols == 0 || col < Tile::kHeadDimV)
                cp_async_16_bytes(sV + row * kRowBytesV + col * kElemBytes, v_src + col * kElemBytes,
                                  valid ? min(max((p.head_dim_v - col) * kElemBytes, 0), 16) : 0);
        }
    }
}

// Two e4m3 values (the low byte first) -> two 16-bit values of Tag in one word, low first. Exact: every e4m3 value is
// an fp16 and a bf16 value. (bf16 through float: integer bit work instead ran at 0.6x: BENCHMARKS.md.)
template <typename Tag>
__device__ __forceinline__ u32 e4m3x2_to(u16 x) {
    u32 h;
#if CUFLASH_E4M3_IN_SOFTWARE   // before sm_89: common/e4m3.cuh's integer code
    h = e4m3_to_f16_bits(static_cast<unsigned char>(x & 0xff))
        | static_cast<u32>(e4m3_to_f16_bits(static_cast<unsigned char>(x >> 8))) << 16;
#else
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(x));
#endif
    if constexpr (kIsBf16<Tag>) {
        return ElemTraits<bf16_tag>::pack2(ElemTraits<f16_tag>::to_float(static_cast<u16>(h & 0xffff)),
                                           ElemTraits<f16_tag>::to_float(static_cast<u16>(h >> 16)));
    } else {
        return h;
    }
}

// kRows rows of kCols e4m3 values (kSrcStride bytes apart) -> 16-bit rows of Tag (kDstStride elements apart), by the
// 32 lanes of a warp, 16 values a lane at a time.
template <typename Tag, int kRows, int kCols, int kSrcStride, int kDstStride>
__device__ __forceinline__ void dequant_rows(const unsigned char* src, u16* dst, int lane) {
    constexpr int kChunks = kCols / 16;
    static_assert(kCols % 16 == 0, "whole 16-byte chunks");
#pragma unroll
    for (int c = lane; c < kRows * kChunks; c += 32) {
        const int r = c / kChunks, col = (c % kChunks) * 16;
        const uint4 x = *reinterpret_cast<const uint4*>(src + r * kSrcStride + col);
        const u32 words[4] = {x.x, x.y, x.z, x.w};
        u32 out[8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            out[2 * i] = e4m3x2_to<Tag>(static_cast<u16>(words[i] & 0xffff));
            out[2 * i + 1] = e4m3x2_to<Tag>(static_cast<u16>(words[i] >> 16));
        }
        *reinterpret_cast<uint4*>(dst + r * kDstStride + col) = make_uint4(out[0], out[1], out[2], out[3]);
        *reinterpret_cast<uint4*>(dst + r * kDstStride + col + 8) = make_uint4(out[4], out[5], out[6], out[7]);
    }
}

// bf16 query rows in shared memory -> fp16 in place, row r times 2^s_r with s_r putting its largest |q| in
// [2^14, 2^15): exact where a value stays within fp16's normal range (one 2^28 times or more below the row's largest
// may lose bits: negligible in the row's products); descales[r] = 2^-s_r. One warp a row, over `warps` warps.
template <class Tile>
__device__ __forceinline__ void rescale_q_to_f16(u16* sQ, float* descales, int warp, int warps, int lane) {
    for (int r = warp; r < Tile::kBlockM; r += warps) {
        u16* row = sQ + r * Tile::kStrideK;
        float amax = 0.f;
        for (int c = lane; c < Tile::kHeadDim; c += 32) amax = fmaxf(amax, fabsf(ElemTraits<bf16_tag>::to_float(row[c])));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, o));
        // floor(log2(amax)) from the exponent bits (amax a normal float, or 0: no scaling)
        const int e = amax > 0.f ? static_cast<int>((__float_as_uint(amax) >> 23) & 0xff) - 127 : 14;
        const int s = min(max(14 - e, -126), 126);
        const float up = __uint_as_float(static_cast<u32>(127 + s) << 23);
        __syncwarp();
        for (int c = lane; c < Tile::kHeadDim; c += 32)
            row[c] = static_cast<u16>(ElemTraits<f16_tag>::pack2(ElemTraits<bf16_tag>::to_float(row[c]) * up, 0.f) & 0xffff);
        if (lane == 0) descales[r] = __uint_as_float(static_cast<u32>(127 - s) << 23);
    }
}

// Where a stage's K or V rows sit, as step() reads their MMA fragments: rows of kStride elements (the cp.async
// stages, padded by 16 bytes). decode_sm90.cu adds TMA's swizzled panels.
template <int kStride>
struct PaddedRows {
    __device__ static __forceinline__ void b_nk(u32 (&b)[4], const u16* tile, int n0, int k0, int lane) {
        load_b_frag_nk<kStride>(b, tile, n0, k0, lane);
    }
    __device__ static __forceinline__ void b_kn(u32 (&b)[4], const u16* tile, int k0, int n0, int lane) {
        load_b_frag_kn<kStride>(b, tile, k0, n0, lane);
    }
};

// One consumer warp's rows: this thread's two (lane / 4 and lane / 4 + 8 of the warp's 16), their token, head and
// visible keys, and the online softmax's running max, sum and O over the warp's slice of each key tile.
template <class A, class B> constexpr bool kSameType = false;
template <class A> constexpr bool kSameType<A, A> = true;

// MmaTag: the products' type where it is not the output's (bf16 queries over an fp8 cache rescaled into fp16 by a
// power of two per row, rescale_q_to_f16: the rows' scores then carry 2^s, which q_descale takes back).
template <typename Tag, class Tile, class Variant, typename MmaTag = Tag>
struct DecodeRows {
    using Mask = MaskPolicy<Tile::kBlockM, Tile::kBlockN, Variant>;
    using Mma = Mma16816<MmaTag>;
    static constexpr int kHeadDim = Tile::kHeadDim, kOCols = Tile::kOCols, kSliceN = Tile::kSliceN;
    static constexpr bool kRescaledQ = !kSameType<Tag, MmaTag>;

    int row_token[2], row_head[2], row_lo[2], row_hi[2];
    int o_col0;   // the warp's first column of O (kLatent), else 0
    float acc_o[kOCols / 8][4];
    float row_max[2], row_sum[2];
    float q_descale[2];   // kRescaledQ: 2^-s of the thread's two rows

    template <class Work>
    __device__ __forceinline__ DecodeRows(const DecodeParams& p, const Work& w, int wm, int lane, int wn = 0)
        : o_col0(Tile::kLatent ? wn * kOCols : 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = w.row0 + wm * 16 + (lane >> 2) + 8 * h;
            const bool valid = row < w.rows;
            row_token[h] = valid ? row / w.group : 0;
            row_head[h] = w.head_kv * w.group + (valid ? row % w.group : 0);
            const Mask mask(w.s, p.seqlen_q, w.batch, row_head[h]);
            int lo, hi;
            mask.row_keys(row_token[h], lo, hi);
            row_lo[h] = max(lo, w.key_lo);
            row_hi[h] = valid ? min(hi, w.key_hi - 1) : -1;   // rows past the tokens see nothing
        }
#pragma unroll
        for (int j = 0; j < kOCols / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[j][e] = 0.f;
        row_max[0] = row_max[1] = -CUFLASH_INF;
        row_sum[0] = row_sum[1] = 0.f;
        q_descale[0] = q_descale[1] = 1.f;
    }

    // kRescaledQ: the rows' 2^-s from rescale_q_to_f16's table.
    __device__ __forceinline__ void read_q_descales(const float* descales, int wm, int lane) {
#pragma unroll
        for (int h = 0; h < 2; ++h) q_descale[h] = descales[wm * 16 + (lane >> 2) + 8 * h];
    }

    // The warp's kSliceN keys of one tile (sK, sV: K and V rows, the warp's first at row key_row0; n0: its first
    // key). kMaskV: V's rows may hold anything past the CTA's last key (TMA boxes load whole rows; the rows of a
    // box never issued are stale), so their values are dropped from the B fragments as they are loaded (P is 0
    // there, but 0 * NaN is not 0).
    template <class KRows = PaddedRows<Tile::kStrideK>, class VRows = PaddedRows<Tile::kStrideV>, bool kMaskV = false,
              class Work>
    __device__ __forceinline__ void step(const DecodeParams& p, const Work& w, const u16* sQ, const u16* sK,
                                         const u16* sV, int n0, int wm, int key_row0, int lane) {
        // S = Q K^T over the warp's 16 rows and kSliceN keys.
        float acc_s[kSliceN / 8][4];
#pragma unroll
        for (int j = 0; j < kSliceN / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_s[j][e] = 0.f;
        if constexpr (kIsF32<Tag>) {
            scores_f32(acc_s, sQ, sK, wm, key_row0, lane);
        } else {
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 16; ++kk) {
            u32 a[4];
            load_a_frag<Tile::kStrideK>(a, sQ, wm * 16, kk * 16, lane);
#pragma unroll
            for (int nn = 0; nn < kSliceN / 16; ++nn) {
                u32 b[4];
                KRows::b_nk(b, sK, key_row0 + nn * 16, kk * 16, lane);
                Mma::run(acc_s[2 * nn], a, b[0], b[1]);
                Mma::run(acc_s[2 * nn + 1], a, b[2], b[3]);
            }
        }
        }

        // The score modifier and the masks, in the log2 domain of the scaled scores; the online softmax.
        float tile_max[2] = {-CUFLASH_INF, -CUFLASH_INF};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const Mask mask(w.s, p.seqlen_q, w.batch, row_head[h]);
#pragma unroll
            for (int j = 0; j < kSliceN / 8; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int key = n0 + j * 8 + 2 * (lane & 3) + e;
                    float x = acc_s[j][2 * h + e];
                    if constexpr (kRescaledQ) x *= q_descale[h];   // exact: a power of two
                    if constexpr (Mask::kHasScoreMod) x = mask.modify_score(x, row_token[h], key);
                    x = (key >= row_lo[h] && key <= row_hi[h]) ? x * w.s.scale_log2 : -CUFLASH_INF;
                    acc_s[j][2 * h + e] = x;
                    tile_max[h] = fmaxf(tile_max[h], x);
                }
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffff, tile_max[h], 1));
            tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffff, tile_max[h], 2));
            const float new_max = fmaxf(row_max[h], tile_max[h]);
            const float base = new_max == -CUFLASH_INF ? 0.f : new_max;   // a row with nothing visible yet
            const float rescale = exp2f(row_max[h] - base);
            row_max[h] = new_max;
            row_sum[h] *= rescale;
#pragma unroll
            for (int j = 0; j < kOCols / 8; ++j) {
                acc_o[j][2 * h] *= rescale;
                acc_o[j][2 * h + 1] *= rescale;
            }
#pragma unroll
            for (int j = 0; j < kSliceN / 8; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float pr = exp2f(acc_s[j][2 * h + e] - base);
                    acc_s[j][2 * h + e] = pr;
                    row_sum[h] += pr;
                }
        }

        // O += P V over the warp's keys (P from the S accumulators, as the A operand).
        if constexpr (kIsF32<Tag>) {
            accumulate_f32(acc_s, sV, key_row0, lane);
        } else {
#pragma unroll
        for (int kk = 0; kk < kSliceN / 16; ++kk) {
            u32 a[4];
            pack_a_from_acc<MmaTag>(a, acc_s[2 * kk], acc_s[2 * kk + 1]);
            // (kMaskV) A transposed B fragment's halves hold keys k, k + 1 (b[0], b[2]) and k + 8, k + 9 (b[1], b[3]).
            u32 keep_lo = ~0u, keep_hi = ~0u;
            if constexpr (kMaskV) {
                const int key = n0 + kk * 16 + 2 * (lane & 3);
                keep_lo = (key < w.key_hi ? 0xffffu : 0u) | (key + 1 < w.key_hi ? 0xffff0000u : 0u);
                keep_hi = (key + 8 < w.key_hi ? 0xffffu : 0u) | (key + 9 < w.key_hi ? 0xffff0000u : 0u);
            }
#pragma unroll
            for (int nn = 0; nn < kOCols / 16; ++nn) {
                u32 b[4];
                VRows::b_kn(b, sV, key_row0 + kk * 16, (Tile::kLatent ? o_col0 : 0) + nn * 16, lane);
                if constexpr (kMaskV) {
                    b[0] &= keep_lo; b[1] &= keep_hi; b[2] &= keep_lo; b[3] &= keep_hi;
                }
                Mma::run(acc_o[2 * nn], a, b[0], b[1]);
                Mma::run(acc_o[2 * nn + 1], a, b[2], b[3]);
            }
        }
        }
    }

    // Float32 (Tag float): the products in scalar arithmetic, into and from the accumulators' MMA layout (this
    // thread's rows lane / 4 and lane / 4 + 8 of the warp's 16, columns 2 * (lane % 4) + {0, 1} of each 8), over
    // float rows of Tile::kRowBytesK / kRowBytesV bytes (16 bytes of padding: a quad's four rows, and a warp's eight
    // Q rows, fall in distinct banks).
    __device__ __forceinline__ void scores_f32(float (&acc_s)[kSliceN / 8][4], const u16* sQ, const u16* sK, int wm,
                                               int key_row0, int lane) const {
        const unsigned char* q_bytes = reinterpret_cast<const unsigned char*>(sQ);
        const unsigned char* k_bytes = reinterpret_cast<const unsigned char*>(sK);
#pragma unroll 4
        for (int d = 0; d < kHeadDim; d += 4) {
            float4 q[2];
#pragma unroll
            for (int h = 0; h < 2; ++h)
                q[h] = *reinterpret_cast<const float4*>(q_bytes + (wm * 16 + (lane >> 2) + 8 * h) * Tile::kRowBytesK
                                                        + d * 4);
#pragma unroll
            for (int j = 0; j < kSliceN / 8; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float4 k = *reinterpret_cast<const float4*>(
                        k_bytes + (key_row0 + j * 8 + 2 * (lane & 3) + e) * Tile::kRowBytesK + d * 4);
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        float& s = acc_s[j][2 * h + e];
                        s = fmaf(q[h].x, k.x, fmaf(q[h].y, k.y, fmaf(q[h].z, k.z, fmaf(q[h].w, k.w, s))));
                    }
                }
        }
    }
    // O += P V: each key's probabilities of the thread's two rows from the quad lane that holds them.
    __device__ __forceinline__ void accumulate_f32(const float (&acc_s)[kSliceN / 8][4], const u16* sV, int key_row0,
                                                   int lane) {
        const unsigned char* v_bytes = reinterpret_cast<const unsigned char*>(sV);
#pragma unroll
        for (int n = 0; n < kSliceN; ++n) {
            const int holder = (lane & ~3) | ((n % 8) / 2);
            float pr[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) pr[h] = __shfl_sync(0xffffffff, acc_s[n / 8][2 * h + (n & 1)], holder);
            const unsigned char* v_row = v_bytes + (key_row0 + n) * Tile::kRowBytesV;
#pragma unroll
            for (int j = 0; j < kOCols / 8; ++j) {
                const float2 v = *reinterpret_cast<const float2*>(v_row + (j * 8 + 2 * (lane & 3)) * 4);
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    acc_o[j][2 * h] = fmaf(pr[h], v.x, acc_o[j][2 * h]);
                    acc_o[j][2 * h + 1] = fmaf(pr[h], v.y, acc_o[j][2 * h + 1]);
                }
            }
        }
    }

    // The row sums over the quad's lanes (each lane summed its own columns).
    __device__ __forceinline__ void reduce_sums() {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            row_sum[h] += __shfl_xor_sync(0xffffffff, row_sum[h], 1);
            row_sum[h] += __shfl_xor_sync(0xffffffff, row_sum[h], 2);
        }
    }

    // The warp's unnormalised O rows and (max, sum) into the merge's shared memory `red` (the drained ring): a block
    // per warp, or per row group (kLatent: the group's warps' columns side by side, (max, sum) from its first warp).
    __device__ __forceinline__ void store_partial(float* red, int warp, int lane) const {
        const int block = Tile::kLatent ? warp / Tile::kWarpsN : warp;
        float* red_o = red + block * 16 * Tile::kRedStride + (Tile::kLatent ? o_col0 : 0);
        float* red_ml = red + Tile::kMergeWarps * 16 * Tile::kRedStride + block * 16 * 2;
        const bool writes_ml = !Tile::kLatent || warp % Tile::kWarpsN == 0;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = (lane >> 2) + 8 * h;
#pragma unroll
            for (int j = 0; j < kOCols / 8; ++j)
                *reinterpret_cast<float2*>(red_o + r * Tile::kRedStride + j * 8 + 2 * (lane & 3)) =
                    make_float2(acc_o[j][2 * h], acc_o[j][2 * h + 1]);
            if ((lane & 3) == 0 && writes_ml) {
                red_ml[r * 2] = row_max[h];
                red_ml[r * 2 + 1] = row_sum[h];
            }
        }
    }
};

// Merges the kWarpsN warps' partial results of each row (store_partial's, in `red`) over `threads` threads and
// writes the CTA's rows: the output and lse (one split), or the split's float32 partial result and lse. The sink
// joins the denominator once (split 0).
template <typename Tag, class Tile, class Variant, class Work>
__device__ __forceinline__ void merge_and_store(const DecodeParams& p, const Work& w, const float* red, int tid,
                                                int threads) {
    constexpr int kNWarps = Tile::kMergeWarps, kWarpsN = Tile::kMergeWarpsN, kHeadDimV = Tile::kHeadDimV;
    const bool direct = p.o_partial == nullptr;
    constexpr int kChunks = kHeadDimV / 4;
    for (int c = tid; c < Tile::kBlockM * kChunks; c += threads) {
        const int r = c / kChunks, col = (c % kChunks) * 4;
        const int row = w.row0 + r;
        if (row >= w.rows) continue;
        const int t = row / w.group, head = w.head_kv * w.group + row % w.group;
        const int w0 = (r / 16) * kWarpsN, rr = r % 16;
        float m = w.split == 0 ? sink_log2<Variant>(p, head) : -CUFLASH_INF;
        const float sink = m;
#pragma unroll
        for (int k = 0; k < kWarpsN; ++k) m = fmaxf(m, red[kNWarps * 16 * Tile::kRedStride + ((w0 + k) * 16 + rr) * 2]);
        float l = 0.f;
        float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
        if (m != -CUFLASH_INF) {
            l = exp2f(sink - m);
#pragma unroll
            for (int k = 0; k < kWarpsN; ++k) {
                const float* ml = red + kNWarps * 16 * Tile::kRedStride + ((w0 + k) * 16 + rr) * 2;
                const float f = exp2f(ml[0] - m);   // 0 for a warp that saw nothing (ml[0] = -inf)
                l += f * ml[1];
                const float4 x = *reinterpret_cast<const float4*>(red + (w0 + k) * 16 * Tile::kRedStride
                                                                  + rr * Tile::kRedStride + col);
                o.x += f * x.x; o.y += f * x.y; o.z += f * x.z; o.w += f * x.w;
            }
            const float inv = w.v_scale / l;
            o.x *= inv; o.y *= inv; o.z *= inv; o.w *= inv;
        }
        const float lse = m == -CUFLASH_INF ? -CUFLASH_INF : (m + log2f(l)) * CUFLASH_LN2;
        if (direct) {
            if (col < p.head_dim_v) {
                if constexpr (kIsF32<Tag>) {
                    float* dst = static_cast<float*>(p.o) + w.batch * p.o_batch_stride + t * p.o_row_stride
                                 + head * p.o_head_stride + col;
                    *reinterpret_cast<float4*>(dst) = o;
                } else {
                    u16* dst = static_cast<u16*>(p.o) + w.batch * p.o_batch_stride + t * p.o_row_stride
                               + head * p.o_head_stride + col;
                    *reinterpret_cast<uint2*>(dst) = make_uint2(ElemTraits<Tag>::pack2(o.x, o.y), ElemTraits<Tag>::pack2(o.z, o.w));
                }
            }
            if (col == 0 && p.lse != nullptr) p.lse[(static_cast<i64>(w.batch) * p.heads_q + head) * p.seqlen_q + t] = lse;
        } else {
            const i64 split_row = (static_cast<i64>(w.split) * p.batch + w.batch) * p.seqlen_q + t;
            if (col < p.head_dim_v)
                *reinterpret_cast<float4*>(p.o_partial + (split_row * p.heads_q + head) * p.head_dim_v + col) = o;
            if (col == 0)
                p.lse_partial[((static_cast<i64>(w.split) * p.batch + w.batch) * p.heads_q + head) * p.seqlen_q + t] = lse;
        }
    }
}
