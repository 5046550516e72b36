// The new tokens' keys and values into the KV cache, rotated (rotary embedding) on the way, and the queries
// rotated into q_rot (cuflash.forward_kvcache: AppendParams). Positions count from the sequence's left pad
// (cache_leftpad), as its keys do; cache rows do not. One warp per row (a new token's KV head, or a
// query token's head); memory-bound and small beside the attention that follows.
//
// A position past the cache's capacity, or a block-table entry out of range, is skipped: nothing is written
// outside the cache.
#include "../common/numeric.cuh"
#include "../common/params.cuh"

// A Tag's array elements: 16-bit words (fp16, bf16), or float (float32, whose tag is float itself).
template <typename Tag> struct ElemOf { using type = u16; };
template <> struct ElemOf<float> { using type = float; };
template <typename Tag> using Elem = typename ElemOf<Tag>::type;

template <typename Tag>
__device__ __forceinline__ float elem_to_float(Elem<Tag> x) {
    if constexpr (kIsF32<Tag>) return x;
    else return ElemTraits<Tag>::to_float(x);
}
template <typename Tag>
__device__ __forceinline__ Elem<Tag> to_elem(float x) {
    if constexpr (kIsF32<Tag>) return x;
    else return static_cast<u16>(ElemTraits<Tag>::pack2(x, 0.f) & 0xffff);
}

// Where a row's elements go: a cache of Tag (or q_rot) takes them as they are (rounded to Tag where computed); an
// fp8 cache takes e4m3(x / scale), rounded to nearest and saturated to +-448.
template <typename Tag>
struct StoreRow {
    Elem<Tag>* dst;
    __device__ __forceinline__ void put(int i, float x) const { dst[i] = to_elem<Tag>(x); }
    __device__ __forceinline__ void copy(int i, Elem<Tag> raw) const { dst[i] = raw; }
};
template <typename Tag>
struct StoreRowE4m3 {
    unsigned char* dst;
    float inv_scale;
    __device__ __forceinline__ void put(int i, float x) const {
#if CUFLASH_E4M3_IN_SOFTWARE
        dst[i] = f32_to_e4m3(x * inv_scale);
#else
        dst[i] = static_cast<unsigned char>(ElemTraits<e4m3_tag>::pack4(x * inv_scale, 0.f, 0.f, 0.f) & 0xff);
#endif
    }
    __device__ __forceinline__ void copy(int i, u16 raw) const { put(i, ElemTraits<Tag>::to_float(raw)); }
};

// Row `src` (head_dim wide) into a row of `out`, its first rotary_dim columns rotated to position `pos`.
template <typename Tag, class Store>
__device__ __forceinline__ void rotate_row(const AppendParams& p, const Elem<Tag>* src, const Store& out, int width,
                                           int pos, bool rotate, int lane) {
    const int half = rotate ? p.rotary_dim / 2 : 0;
    if (half > 0) {
        const int row = min(max(pos, 0), p.seqlen_ro - 1);
        for (int i = lane; i < half; i += 32) {
            const float c = p.rotary_cos[static_cast<i64>(row) * half + i];
            const float s = p.rotary_sin[static_cast<i64>(row) * half + i];
            const int i0 = p.rotary_interleaved ? 2 * i : i, i1 = p.rotary_interleaved ? 2 * i + 1 : i + half;
            const float x0 = elem_to_float<Tag>(src[i0]), x1 = elem_to_float<Tag>(src[i1]);
            out.put(i0, x0 * c - x1 * s);
            out.put(i1, x0 * s + x1 * c);
        }
    }
    for (int i = 2 * half + lane; i < width; i += 32) out.copy(i, src[i]);
}

// kFp8: the caches hold e4m3 (new keys and values in Tag, stored divided by their KV head's scale).
// Rows (one per warp) are counted in 32 bits: the host keeps them below 2^31 (kvcache.py), and 64-bit division
// went through a called routine whose registers spilled on sm_120.
template <typename Tag, int kNWarps, bool kFp8>
__device__ __forceinline__ void kvcache_append_body(const AppendParams& p) {
    const unsigned warp = blockIdx.x * kNWarps + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    const unsigned kv_rows = p.k_new != nullptr ? static_cast<unsigned>(p.batch * p.seqlen_new * p.heads_kv) : 0u;
    const unsigned q_rows = p.q != nullptr ? static_cast<unsigned>(p.batch * p.seqlen_q * p.heads_q) : 0u;
    if (warp < kv_rows) {
        const int h = static_cast<int>(warp % p.heads_kv);
        const int i = static_cast<int>((warp / p.heads_kv) % p.seqlen_new);
        const int b = static_cast<int>(warp / (p.heads_kv * p.seqlen_new));
        const int pos = max(p.cache_seqlens[b], 0) + i;   // the cache position; rotary counts from the left pad
        const int pad = p.cache_leftpad != nullptr ? max(p.cache_leftpad[b], 0) : 0;
        if (pos >= p.cache_capacity) return;
        i64 k_off, v_off;
        if (p.block_table != nullptr) {
            const int page = p.block_table[b * p.block_table_batch_stride + pos / p.page_size];
            if (page < 0 || page >= p.cache_rows) return;
            const int slot = pos % p.page_size;
            k_off = page * p.k_batch_stride + slot * p.k_row_stride;
            v_off = page * p.v_batch_stride + slot * p.v_row_stride;
        } else {
            const int row = p.cache_batch_idx != nullptr ? p.cache_batch_idx[b] : b;
            if (row < 0 || row >= p.cache_rows) return;
            k_off = row * p.k_batch_stride + static_cast<i64>(pos) * p.k_row_stride;
            v_off = row * p.v_batch_stride + static_cast<i64>(pos) * p.v_row_stride;
        }
        k_off += h * p.k_head_stride;
        v_off += h * p.v_head_stride;
        const Elem<Tag>* k_src = static_cast<const Elem<Tag>*>(p.k_new) + b * p.k_new_batch_stride
                                 + i * p.k_new_row_stride + h * p.k_new_head_stride;
        const Elem<Tag>* v_src = static_cast<const Elem<Tag>*>(p.v_new) + b * p.v_new_batch_stride
                                 + i * p.v_new_row_stride + h * p.v_new_head_stride;
        if constexpr (kFp8) {
            const int at = b * p.scale_batch_stride + h * p.scale_head_stride;
            const float k_scale = p.k_scale != nullptr ? p.k_scale[at] : p.k_scale_value;
            const float v_scale = p.v_scale != nullptr ? p.v_scale[at] : p.v_scale_value;
            const StoreRowE4m3<Tag> k_out{static_cast<unsigned char*>(p.k_cache) + k_off, 1.f / k_scale};
            const StoreRowE4m3<Tag> v_out{static_cast<unsigned char*>(p.v_cache) + v_off, 1.f / v_scale};
            rotate_row<Tag>(p, k_src, k_out, p.head_dim, pos - pad, p.rotary_cos != nullptr, lane);
            rotate_row<Tag>(p, v_src, v_out, p.head_dim_v, pos, false, lane);
        } else {
            rotate_row<Tag>(p, k_src, StoreRow<Tag>{static_cast<Elem<Tag>*>(p.k_cache) + k_off}, p.head_dim,
                            pos - pad, p.rotary_cos != nullptr, lane);
            rotate_row<Tag>(p, v_src, StoreRow<Tag>{static_cast<Elem<Tag>*>(p.v_cache) + v_off}, p.head_dim_v, pos,
                            false, lane);
        }
    } else if (warp < kv_rows + q_rows) {
        const unsigned r = warp - kv_rows;
        const int h = static_cast<int>(r % p.heads_q);
        const int t = static_cast<int>((r / p.heads_q) % p.seqlen_q);
        const int b = static_cast<int>(r / (p.heads_q * p.seqlen_q));
        const int pad = p.cache_leftpad != nullptr ? max(p.cache_leftpad[b], 0) : 0;
        const int pos = max(p.cache_seqlens[b], 0) - pad + t * p.q_positions_step;
        const Elem<Tag>* src = static_cast<const Elem<Tag>*>(p.q) + b * p.q_batch_stride + t * p.q_row_stride
                               + h * p.q_head_stride;
        Elem<Tag>* dst = static_cast<Elem<Tag>*>(p.q_rot)
                         + ((static_cast<i64>(b) * p.seqlen_q + t) * p.heads_q + h) * p.head_dim;
        rotate_row<Tag>(p, src, StoreRow<Tag>{dst}, p.head_dim, pos, true, lane);
    }
}

template <typename Tag, int kNWarps>
__global__ void __launch_bounds__(kNWarps * 32) kvcache_append_kernel(const AppendParams p) {
    kvcache_append_body<Tag, kNWarps, false>(p);
}

// The same into e4m3 caches (the conversions in software before sm_89: common/e4m3.cuh).
template <typename Tag, int kNWarps>
__global__ void __launch_bounds__(kNWarps * 32) kvcache_append_fp8_kernel(const AppendParams p) {
    kvcache_append_body<Tag, kNWarps, true>(p);
}
