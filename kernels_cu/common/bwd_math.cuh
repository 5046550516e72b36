// Scalar pieces of the backward shared by the tensor-core (sm80/bwd.cu) and
// CUDA-core (simt/bwd.cu) kernels, and the element storage of each dtype tag.
//
// The backward recomputes P = exp(S * scale - lse) from the scores and the
// forward's log-sum-exp, in the log2 domain: P = exp2(S * scale_log2 - lse2),
// lse2 = lse * log2(e). Then dS = P * (dP - delta), delta = rowsum(dO * O).
#pragma once
#include "numeric.cuh"

#define CUFLASH_LOG2E 1.44269504088896340736f

// log2-domain reference of one query row. A row that saw no key in the forward
// (lse = -inf), or a row past the sequence end, gets +inf so that every P of
// the row is exp2(finite or -inf - inf) = 0, never NaN.
__device__ __forceinline__ float bwd_lse2(float lse) {
    return lse == -CUFLASH_INF ? CUFLASH_INF : lse * CUFLASH_LOG2E;
}

__device__ __forceinline__ float bwd_prob(float s, float scale_log2, float lse2) {
    return exp2f(fmaf(s, scale_log2, -lse2));
}

// Storage of one element: fp16/bf16 tags as raw 16-bit words, float as float.
template <typename Tag> struct ElemStorage {
    using T = u16;
    static __device__ __forceinline__ float to_float(T x) { return ElemTraits<Tag>::to_float(x); }
};
template <> struct ElemStorage<float> {
    using T = float;
    static __device__ __forceinline__ float to_float(T x) { return x; }
};

// Sum of the products of the elements of two 16-byte chunks.
template <typename Tag>
__device__ __forceinline__ float chunk_dot(const uint4& a, const uint4& b) {
    const u32 wa[4] = {a.x, a.y, a.z, a.w};
    const u32 wb[4] = {b.x, b.y, b.z, b.w};
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        s = fmaf(ElemTraits<Tag>::to_float(static_cast<u16>(wa[i] & 0xffff)),
                 ElemTraits<Tag>::to_float(static_cast<u16>(wb[i] & 0xffff)), s);
        s = fmaf(ElemTraits<Tag>::to_float(static_cast<u16>(wa[i] >> 16)),
                 ElemTraits<Tag>::to_float(static_cast<u16>(wb[i] >> 16)), s);
    }
    return s;
}
template <>
__device__ __forceinline__ float chunk_dot<float>(const uint4& a, const uint4& b) {
    float s = __uint_as_float(a.x) * __uint_as_float(b.x);
    s = fmaf(__uint_as_float(a.y), __uint_as_float(b.y), s);
    s = fmaf(__uint_as_float(a.z), __uint_as_float(b.z), s);
    return fmaf(__uint_as_float(a.w), __uint_as_float(b.w), s);
}
