// Warp-level tensor-core primitives for sm_80+: ldmatrix and mma.sync m16n8k16.
//
// Fragment layouts (PTX ISA, "mma.m16n8k16"), with g = lane / 4, t = lane % 4:
//   A 16x16: a[0] = (g, 2t..2t+1)  a[1] = (g+8, 2t..)  a[2] = (g, 2t+8..)  a[3] = (g+8, 2t+8..)
//   B 16x8 : b[0] = (k 2t..2t+1, n g)   b[1] = (k 2t+8.., n g)
//   C 16x8 : c[0..1] = (g, 2t..2t+1)    c[2..3] = (g+8, 2t..2t+1)
// The C layout of two neighbouring n-tiles is exactly the A layout of one
// 16-wide k-slice, which lets P = softmax(S) feed the P @ V product from
// registers (see pack_a_from_acc).
#pragma once
#include "../common/numeric.cuh"
#include "../common/smem.cuh"
#include "../common/mma_sync.cuh"

// ldmatrix_x4 (common/smem.cuh) on a generic pointer into shared memory.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* smem_row) { ldmatrix_x4(r, smem_u32(smem_row)); }

__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const void* smem_row) {
    ldmatrix_x4_trans(r, smem_u32(smem_row));
}

// A fragment (16 x 16, row-major in smem) at (row0, col0) of a tile with
// kStride elements per row.
template <int kStride>
__device__ __forceinline__ void load_a_frag(u32 (&a)[4], const u16* tile, int row0, int col0, int lane) {
    ldmatrix_x4(a, tile + (row0 + (lane & 15)) * kStride + col0 + (lane >> 4) * 8);
}

// B fragments of two n-tiles (n0..n0+15) from a tile stored [n][k] (K for S = Q K^T):
// b[0], b[1] for n-tile n0; b[2], b[3] for n-tile n0 + 8.
template <int kStride>
__device__ __forceinline__ void load_b_frag_nk(u32 (&b)[4], const u16* tile, int n0, int k0, int lane) {
    ldmatrix_x4(b, tile + (n0 + (lane & 7) + (lane >> 4) * 8) * kStride + k0 + ((lane >> 3) & 1) * 8);
}

// B fragments of two n-tiles from a tile stored [k][n] (V for O = P V), transposed on load.
template <int kStride>
__device__ __forceinline__ void load_b_frag_kn(u32 (&b)[4], const u16* tile, int k0, int n0, int lane) {
    ldmatrix_x4_trans(b, tile + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * kStride + n0 + (lane >> 4) * 8);
}

// Accumulators of n-tiles 2*kk and 2*kk+1 (float) -> A fragment of k-slice kk.
template <typename Tag>
__device__ __forceinline__ void pack_a_from_acc(u32 (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
    a[0] = ElemTraits<Tag>::pack2(lo[0], lo[1]);
    a[1] = ElemTraits<Tag>::pack2(lo[2], lo[3]);
    a[2] = ElemTraits<Tag>::pack2(hi[0], hi[1]);
    a[3] = ElemTraits<Tag>::pack2(hi[2], hi[3]);
}
