// Helpers of ring attention (cuflash/distributed): the partial results of each ring step are merged into
// float32 sums, which are converted to the inputs' dtype once at the end.
//
// All arrays are contiguous (batch, seqlen, width) with width = heads * head_dim; a step touches the rows
// [row0, row0 + rows) of every batch (the zig-zag split's second half, or all of them).
#include "../common/numeric.cuh"

template <typename Tag> struct Elem;
template <> struct Elem<f16_tag> {
    static __device__ __forceinline__ float load(const void* x, i64 i) {
        return ElemTraits<f16_tag>::to_float(static_cast<const u16*>(x)[i]);
    }
    static __device__ __forceinline__ void store2(void* y, i64 i, float a, float b) {
        *reinterpret_cast<u32*>(static_cast<u16*>(y) + i) = ElemTraits<f16_tag>::pack2(a, b);
    }
};
template <> struct Elem<bf16_tag> {
    static __device__ __forceinline__ float load(const void* x, i64 i) {
        return ElemTraits<bf16_tag>::to_float(static_cast<const u16*>(x)[i]);
    }
    static __device__ __forceinline__ void store2(void* y, i64 i, float a, float b) {
        *reinterpret_cast<u32*>(static_cast<u16*>(y) + i) = ElemTraits<bf16_tag>::pack2(a, b);
    }
};
template <> struct Elem<float> {
    static __device__ __forceinline__ float load(const void* x, i64 i) { return static_cast<const float*>(x)[i]; }
    static __device__ __forceinline__ void store2(void* y, i64 i, float a, float b) {
        *reinterpret_cast<float2*>(static_cast<float*>(y) + i) = make_float2(a, b);
    }
};

// Merges one step's attention (part, part_lse) into the running (out_acc, lse_acc) through their
// log-sum-exps: lse = log(e^lse_acc + e^part_lse), out = e^(lse_acc - lse) out_acc + e^(part_lse - lse) part.
// One warp per (batch, row, head). lse_acc = -inf marks rows without a result yet: out_acc is not read there
// (it may hold anything). part_lse is (batch, heads, rows); lse_acc (batch, heads, seqlen).
template <typename Tag, int kNWarps>
__global__ void __launch_bounds__(kNWarps * 32) ring_merge_kernel(
        float* out_acc, float* lse_acc, const void* part, const float* part_lse,
        int batch, int rows, int row0, int seqlen, int heads, int head_dim) {
    const i64 warp = blockIdx.x * static_cast<i64>(kNWarps) + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    const i64 n_warps = static_cast<i64>(batch) * rows * heads;
    if (warp >= n_warps) return;
    const int h = static_cast<int>(warp % heads);
    const int i = static_cast<int>((warp / heads) % rows);
    const int b = static_cast<int>(warp / (static_cast<i64>(heads) * rows));
    const int row = row0 + i;
    float* lse_at = lse_acc + (static_cast<i64>(b) * heads + h) * seqlen + row;
    const float la = *lse_at;
    const float lp = part_lse[(static_cast<i64>(b) * heads + h) * rows + i];
    const float m = fmaxf(la, lp);
    float wa = 0.f, wp = 0.f, lse = -CUFLASH_INF;
    if (m != -CUFLASH_INF) {   // both -inf: the row has seen no key so far, and still has not
        const float ea = expf(la - m), ep = expf(lp - m);
        lse = m + logf(ea + ep);
        wa = ea / (ea + ep);
        wp = ep / (ea + ep);
    }
    const i64 base = ((static_cast<i64>(b) * seqlen + row) * heads + h) * head_dim;
    for (int d = 2 * lane; d < head_dim; d += 64) {
        const float p0 = Elem<Tag>::load(part, base + d), p1 = Elem<Tag>::load(part, base + d + 1);
        float2 o = make_float2(wp * p0, wp * p1);
        if (wa != 0.f) {
            const float2 a = *reinterpret_cast<const float2*>(out_acc + base + d);
            o.x += wa * a.x;
            o.y += wa * a.y;
        }
        *reinterpret_cast<float2*>(out_acc + base + d) = o;
    }
    if (lane == 0) *lse_at = lse;
}

// acc[b, row0 + i, :] (+)= part[b, row0 + i, :] for i < rows: assign on the first contribution, add after.
// width is even (head_dim is a multiple of 8).
template <typename Tag, int kNWarps>
__global__ void __launch_bounds__(kNWarps * 32) ring_accumulate_kernel(
        float* acc, const void* part, int batch, int rows, int row0, int seqlen, int width, int assign) {
    const i64 pairs_per_batch = static_cast<i64>(rows) * width / 2;
    const i64 n = batch * pairs_per_batch;
    for (i64 t = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; t < n;
         t += static_cast<i64>(gridDim.x) * blockDim.x) {
        const i64 b = t / pairs_per_batch;
        const i64 e = (static_cast<i64>(row0) * width + 2 * (t % pairs_per_batch)) + b * seqlen * width;
        float2 p = make_float2(Elem<Tag>::load(part, e), Elem<Tag>::load(part, e + 1));
        if (!assign) {
            const float2 a = *reinterpret_cast<const float2*>(acc + e);
            p.x += a.x;
            p.y += a.y;
        }
        *reinterpret_cast<float2*>(acc + e) = p;
    }
}

// y = x converted to the element type, rounded to nearest; n even.
template <typename Tag, int kNWarps>
__global__ void __launch_bounds__(kNWarps * 32) ring_convert_kernel(const float* x, void* y, i64 n) {
    for (i64 t = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; 2 * t < n;
         t += static_cast<i64>(gridDim.x) * blockDim.x) {
        const float2 v = *reinterpret_cast<const float2*>(x + 2 * t);
        Elem<Tag>::store2(y, 2 * t, v.x, v.y);
    }
}
