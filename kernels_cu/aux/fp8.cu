// fp8 (e4m3) helpers for the Hopper forward (sm_89+ for the conversions).
//
// fp8_amax_kernel / fp8_quantize_kernel: per-tensor quantisation x8 = e4m3(x / descale) with
// descale = amax(|x|) / 448, so that the largest magnitude maps to e4m3's largest finite value.
// fp8_transpose_v_kernel: V -> V^T for the P V product (fp8 wgmma takes K-major operands only),
// keys reordered within each 32-key step to the order of the P register fragment (sm90/fwd.cu).
#include "../common/numeric.cuh"

typedef unsigned char u8;

template <typename T> struct LoadFloat;
template <> struct LoadFloat<f16_tag> {
    static __device__ __forceinline__ float at(const void* x, i64 i) {
        return ElemTraits<f16_tag>::to_float(static_cast<const u16*>(x)[i]);
    }
};
template <> struct LoadFloat<bf16_tag> {
    static __device__ __forceinline__ float at(const void* x, i64 i) {
        return ElemTraits<bf16_tag>::to_float(static_cast<const u16*>(x)[i]);
    }
};
template <> struct LoadFloat<float> {
    static __device__ __forceinline__ float at(const void* x, i64 i) { return static_cast<const float*>(x)[i]; }
};

// amax_bits: one u32 set to 0 before the launch; receives the bits of max |x|. Non-negative floats
// order as their bit patterns, and |NaN| is above +inf, so a NaN anywhere wins and reaches descale.
template <typename Tag, int kNWarps>
__global__ void __launch_bounds__(kNWarps * 32) fp8_amax_kernel(const void* x, i64 n, u32* amax_bits) {
    u32 m = 0;
    for (i64 i = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<i64>(gridDim.x) * blockDim.x)
        m = max(m, __float_as_uint(fabsf(LoadFloat<Tag>::at(x, i))));
    m = __reduce_max_sync(0xffffffff, m);
    if ((threadIdx.x & 31) == 0 && m != 0) atomicMax(amax_bits, m);
}

// descale[0] = amax / 448 (1 when x is all zeros); x8 = e4m3(x / descale), rounded to nearest, saturated.
template <typename Tag, int kNWarps>
__global__ void __launch_bounds__(kNWarps * 32) fp8_quantize_kernel(const void* x, i64 n, const u32* amax_bits,
                                                                     u8* x8, float* descale) {
    const float amax = __uint_as_float(*amax_bits);
    const float d = amax > 0.f ? amax / 448.f : (amax == 0.f ? 1.f : amax);   // NaN / inf pass through
    if (blockIdx.x == 0 && threadIdx.x == 0) descale[0] = d;
    // Four elements per thread and step: one pack4 (two cvt.e4m3x2) and one 32-bit store when aligned.
    const i64 n4 = n / 4;
    for (i64 i = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; i < n4;
         i += static_cast<i64>(gridDim.x) * blockDim.x) {
        const i64 e = 4 * i;
        reinterpret_cast<u32*>(x8)[i] = ElemTraits<e4m3_tag>::pack4(
            LoadFloat<Tag>::at(x, e) / d, LoadFloat<Tag>::at(x, e + 1) / d, LoadFloat<Tag>::at(x, e + 2) / d,
            LoadFloat<Tag>::at(x, e + 3) / d);
    }
    if (blockIdx.x == 0 && threadIdx.x < n - 4 * n4) {
        const i64 e = 4 * n4 + threadIdx.x;
        x8[e] = static_cast<u8>(ElemTraits<e4m3_tag>::pack4(LoadFloat<Tag>::at(x, e) / d, 0.f, 0.f, 0.f) & 0xff);
    }
}

// Position kp (0..31) of a 32-key step of V^T -> the key it holds. The fp8 A fragment of P gives
// thread t columns 4t..4t+3 (and 16 + those); its accumulator holds keys 2t, 2t+1 of each 8-key
// block, packed two blocks per register: columns 4t + {0, 1, 2, 3} hold keys 2t + {0, 1, 8, 9}.
__device__ __forceinline__ int fp8_vt_key(int kp) {
    const int r = kp & 15;
    return (kp & 16) + 2 * (r >> 2) + (r & 1) + 8 * ((r >> 1) & 1);
}

// v: (batch, seqlen_k, heads_kv, head_dim) e4m3 bytes, head_dim (a multiple of 16, <= 256) contiguous,
// base and strides (bytes) multiples of 16. vt: (batch, heads_kv, head_dim, seqlen_k_pad) contiguous,
// seqlen_k_pad a multiple of 32; keys at and past seqlen_k are zero. One CTA: kKeys keys of one
// (kv head, batch), all head dims: 16-byte loads of V rows into shared memory; then a task is 4 rows
// x 16 key positions: sixteen 4-byte loads, a 4x4 byte transpose per 4 keys, four 16-byte stores.
// Consecutive lanes take consecutive 16-position chunks of the same rows, so that a warp's stores
// cover whole 128-byte row segments (rows of V^T are seqlen_k_pad bytes apart); the shared rows are
// stored with their 16-byte chunks XOR-swizzled by key / 16, so that those lanes (keys 16 apart)
// read different banks.
template <int kNWarps>
__global__ void __launch_bounds__(kNWarps * 32)
fp8_transpose_v_kernel(const u8* v, u8* vt, i64 v_batch_stride, i64 v_row_stride, i64 v_head_stride, int seqlen_k,
                       int seqlen_k_pad, int heads_kv, int head_dim) {
    constexpr int kKeys = 128;
    __shared__ __align__(16) u8 tile[kKeys * 256];   // rows of head_dim bytes
    const int key0 = blockIdx.x * kKeys, h = blockIdx.y, b = blockIdx.z;
    const u8* src = v + b * v_batch_stride + h * v_head_stride;
    const int chunks = head_dim / 16;
    // XOR mask of the chunk swizzle: chunks a power of two (else no swizzle), at most 8 key groups.
    const int swz_mask = (chunks & (chunks - 1)) ? 0 : min(chunks, 8) - 1;
    for (int i = threadIdx.x; i < kKeys * chunks; i += blockDim.x) {
        const int r = i / chunks, c = i - r * chunks;
        uint4 x = make_uint4(0, 0, 0, 0);
        if (key0 + r < seqlen_k) x = *reinterpret_cast<const uint4*>(src + (key0 + r) * v_row_stride + 16 * c);
        *reinterpret_cast<uint4*>(tile + r * head_dim + 16 * (c ^ ((r >> 4) & swz_mask))) = x;
    }
    __syncthreads();
    u8* dst = vt + (static_cast<i64>(b) * heads_kv + h) * head_dim * static_cast<i64>(seqlen_k_pad) + key0;
    const int n_chunks = min(kKeys, seqlen_k_pad - key0) / 16;   // 16-position chunks (seqlen_k_pad % 32 == 0)
    for (int task = threadIdx.x; task < (head_dim / 4) * n_chunks; task += blockDim.x) {
        const int c = task % n_chunks, d4 = task / n_chunks;   // positions 16 c .., rows 4 d4 .. 4 d4 + 3
        // byte offset of column 4 d4 in a shared row of key group c
        const int col = 16 * ((d4 >> 2) ^ (c & swz_mask)) + 4 * (d4 & 3);
        u32 rows[4][4];   // rows[e][q]: row 4 d4 + e, positions 16 c + 4 q ..
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            u32 w[4];
#pragma unroll
            for (int j = 0; j < 4; ++j)   // position 16 c + 4 q + j holds key 16 c + fp8_vt_key(4 q + j)
                w[j] = *reinterpret_cast<const u32*>(tile + (16 * c + fp8_vt_key(4 * q + j)) * head_dim + col);
            const u32 t0 = __byte_perm(w[0], w[1], 0x5140), t1 = __byte_perm(w[0], w[1], 0x7362);
            const u32 t2 = __byte_perm(w[2], w[3], 0x5140), t3 = __byte_perm(w[2], w[3], 0x7362);
            rows[0][q] = __byte_perm(t0, t2, 0x5410);
            rows[1][q] = __byte_perm(t0, t2, 0x7632);
            rows[2][q] = __byte_perm(t1, t3, 0x5410);
            rows[3][q] = __byte_perm(t1, t3, 0x7632);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e)
            *reinterpret_cast<uint4*>(dst + static_cast<i64>(4 * d4 + e) * seqlen_k_pad + 16 * c) =
                make_uint4(rows[e][0], rows[e][1], rows[e][2], rows[e][3]);
    }
}
