// Single-warpgroup GEMM tiles that exercise the sm90 primitives one at a time
// (tests/test_sm90_primitives.py): TMA loads completing on an mbarrier, wgmma
// with A from a shared-memory descriptor or from registers, K-major and
// MN-major (transposed) B, and the accumulator fragment layout.
#include "../../kernels_cu/sm90/wgmma.cuh"
#include "../../kernels_cu/sm90/tma.cuh"
#include "../../kernels_cu/sm90/pipeline.cuh"

// Stores the m64nN accumulator of the warpgroup as a row-major float matrix.
template <int N>
__device__ __forceinline__ void store_acc(float* c, const float (&d)[N / 2]) {
    const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            c[(16 * warp + g + 8 * (e >> 1)) * N + 8 * j + 2 * t + (e & 1)] = d[4 * j + e];
}

// The one barrier the CTA's TMA loads complete on: initialised by thread 0, visible to all before use.
__device__ __forceinline__ void init_load_barrier(u32 bar) {
    if (threadIdx.x == 0) {
        mbar_init(bar, 1);
        fence_barrier_init();
    }
    __syncthreads();
}

// C (64 x N) = A (64 x K) B^T with A and B (N x K) K-major in global memory,
// both loaded by TMA into 128-byte-swizzled tiles (64-column blocks).
template <typename Tag, int N, int K>
__global__ void __launch_bounds__(128) gemm_ss_kernel(const __grid_constant__ TmaDesc ta,
                                                      const __grid_constant__ TmaDesc tb, float* c) {
    extern __shared__ char smem_raw[];
    const u32 sA = (smem_u32(smem_raw) + 1023) & ~1023u;
    const u32 sB = sA + 64 * K * 2;
    const u32 bar = sB + N * K * 2;
    init_load_barrier(bar);
    if (threadIdx.x == 0) {
        mbar_arrive_expect_tx(bar, (64 + N) * K * 2);
#pragma unroll
        for (int cb = 0; cb < K / 64; ++cb) {
            tma_load_2d(sA + cb * 64 * 128, &ta, bar, cb * 64, 0);
            tma_load_2d(sB + cb * N * 128, &tb, bar, cb * 64, 0);
        }
    }
    mbar_wait(bar, 0);
    float d[N / 2];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        const u64 da = make_desc_sw128(sA + (kk / 4) * 64 * 128 + (kk % 4) * 32, 16, 1024);
        const u64 db = make_desc_sw128(sB + (kk / 4) * N * 128 + (kk % 4) * 32, 16, 1024);
        WgmmaSS<Tag, N>::template run<false>(d, da, db, kk > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_operand(d);
    store_acc<N>(c, d);
}

// C (64 x N) = A (64 x K) B with A row-major in global memory, read into the
// wgmma A-register fragment, and B (K x N) row-major (MN-major) loaded by TMA.
template <typename Tag, int N, int K>
__global__ void __launch_bounds__(128) gemm_rs_kernel(const u16* a, const __grid_constant__ TmaDesc tb, float* c) {
    extern __shared__ char smem_raw[];
    const u32 sB = (smem_u32(smem_raw) + 1023) & ~1023u;
    const u32 bar = sB + N * K * 2;
    init_load_barrier(bar);
    if (threadIdx.x == 0) {
        mbar_arrive_expect_tx(bar, N * K * 2);
#pragma unroll
        for (int cb = 0; cb < N / 64; ++cb) tma_load_2d(sB + cb * K * 128, &tb, bar, cb * 64, 0);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int r0 = 16 * warp + g, r1 = r0 + 8;
    u32 frag[K / 16][4];
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        const int c0 = 16 * kk + 2 * t;
        frag[kk][0] = *reinterpret_cast<const u32*>(a + r0 * K + c0);
        frag[kk][1] = *reinterpret_cast<const u32*>(a + r1 * K + c0);
        frag[kk][2] = *reinterpret_cast<const u32*>(a + r0 * K + c0 + 8);
        frag[kk][3] = *reinterpret_cast<const u32*>(a + r1 * K + c0 + 8);
    }
    mbar_wait(bar, 0);
    float d[N / 2];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        const u64 db = make_desc_sw128(sB + kk * 16 * 128, K * 128, 1024);
        WgmmaRS<Tag, N>::template run<true>(d, frag[kk], db, kk > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_operand(d);
    store_acc<N>(c, d);
}
