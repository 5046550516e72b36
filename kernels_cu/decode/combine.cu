// Merging partial attention results through their log-sum-exps (split-KV decoding, cuflash.combine):
// lse = log sum_s exp(lse_s), out = sum_s exp(lse_s - lse) out_s. A split whose lse_s is -inf (no key, or no
// split there at all) is skipped without reading its rows, which may hold anything. One warp per (batch, token,
// head) row, in a fixed order over the splits (deterministic).
#include "../common/launch_order.cuh"
#include "../common/numeric.cuh"
#include "../common/params.cuh"

template <typename Tag> struct CombineIO;
template <> struct CombineIO<float> {
    static __device__ __forceinline__ float4 load4(const void* x, i64 i) {
        return *reinterpret_cast<const float4*>(static_cast<const float*>(x) + i);
    }
    static __device__ __forceinline__ void store4(void* y, i64 i, float4 v) {
        *reinterpret_cast<float4*>(static_cast<float*>(y) + i) = v;
    }
};
template <typename Tag> struct CombineIO {   // fp16 / bf16
    static __device__ __forceinline__ float4 load4(const void* x, i64 i) {
        const uint2 w = *reinterpret_cast<const uint2*>(static_cast<const u16*>(x) + i);
        return make_float4(ElemTraits<Tag>::to_float(w.x & 0xffff), ElemTraits<Tag>::to_float(w.x >> 16),
                           ElemTraits<Tag>::to_float(w.y & 0xffff), ElemTraits<Tag>::to_float(w.y >> 16));
    }
    static __device__ __forceinline__ void store4(void* y, i64 i, float4 v) {
        *reinterpret_cast<uint2*>(static_cast<u16*>(y) + i) =
            make_uint2(ElemTraits<Tag>::pack2(v.x, v.y), ElemTraits<Tag>::pack2(v.z, v.w));
    }
};

// OutTag: the output's element type (float, f16_tag, bf16_tag); the partial results are float32 or of that type
// (CombineParams.outs_float32, a uniform branch: the kernel is memory-bound).
template <typename OutTag, int kNWarps>
__global__ void __launch_bounds__(kNWarps * 32) combine_kernel(const CombineParams p) {
    grid_dependency_wait();   // (after a split decode launched with it: its partial results visible)
    const i64 warp = blockIdx.x * static_cast<i64>(kNWarps) + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    if (warp >= static_cast<i64>(p.batch) * p.seqlen * p.heads) return;
    const int h = static_cast<int>(warp % p.heads);
    const int t = static_cast<int>((warp / p.heads) % p.seqlen);
    const int b = static_cast<int>(warp / (static_cast<i64>(p.heads) * p.seqlen));
    const i64 split_stride_lse = static_cast<i64>(p.batch) * p.heads * p.seqlen;
    const i64 lse_index = (static_cast<i64>(b) * p.heads + h) * p.seqlen + t;
    // The largest lse and the sum of exp(lse_s - max), each lane over its splits, then across the warp.
    float m = -CUFLASH_INF;
    for (int s = lane; s < p.num_splits; s += 32) m = fmaxf(m, p.lses[s * split_stride_lse + lse_index]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, off));
    float sum = 0.f;
    if (m != -CUFLASH_INF)
        for (int s = lane; s < p.num_splits; s += 32) sum += expf(p.lses[s * split_stride_lse + lse_index] - m);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, off);
    const float lse = m == -CUFLASH_INF ? -CUFLASH_INF : m + logf(sum);

    const i64 split_stride = static_cast<i64>(p.batch) * p.seqlen * p.heads * p.head_dim;
    const i64 in_row = ((static_cast<i64>(b) * p.seqlen + t) * p.heads + h) * p.head_dim;
    const i64 out_row = b * p.out_batch_stride + t * p.out_row_stride + h * p.out_head_stride;
    for (int col = lane * 4; col < p.head_dim; col += 128) {
        float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int s = 0; s < p.num_splits && m != -CUFLASH_INF; ++s) {
            const float ls = p.lses[s * split_stride_lse + lse_index];
            if (ls == -CUFLASH_INF) continue;
            const float w = expf(ls - lse);
            const i64 at = s * split_stride + in_row + col;
            const float4 x = p.outs_float32 ? CombineIO<float>::load4(p.outs, at) : CombineIO<OutTag>::load4(p.outs, at);
            o.x += w * x.x; o.y += w * x.y; o.z += w * x.z; o.w += w * x.w;
        }
        CombineIO<OutTag>::store4(p.out, out_row + col, o);
    }
    if (lane == 0 && p.lse != nullptr) p.lse[lse_index] = lse;
}
