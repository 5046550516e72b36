// Backward postprocess (atomic-dQ mode): dq = dq_accum * softmax_scale in the
// output dtype. dq_accum is float32 (batch, heads_q, seqlen_q, head_dim),
// contiguous; dq may be any strided view. 8 threads per row, 8 elements each
// per step (two float4 reads, one 16-byte write).
#include "../common/numeric.cuh"
#include "../common/params.cuh"

template <typename Tag, int kNWarps>
__global__ void __launch_bounds__(kNWarps * 32)
bwd_postprocess_kernel(const BwdParams p) {
    constexpr int kThreadsPerRow = 8;
    constexpr int kRows = kNWarps * 32 / kThreadsPerRow;
    const int tid = threadIdx.x;
    const int sub = tid % kThreadsPerRow;
    const int row = blockIdx.x * kRows + tid / kThreadsPerRow;
    const int head = blockIdx.y;
    const int batch = blockIdx.z;
    if (row >= p.seqlen_q) return;

    const i64 row_index = (static_cast<i64>(batch) * p.heads_q + head) * p.seqlen_q + row;
    const float4* src = reinterpret_cast<const float4*>(p.dq_accum + row_index * p.head_dim);
    u16* dst = static_cast<u16*>(p.dq) + batch * p.dq_batch_stride + row * p.dq_row_stride
               + head * p.dq_head_stride;
    const float s = p.softmax_scale;
    for (int c = sub; c < p.head_dim / 8; c += kThreadsPerRow) {
        const float4 a = src[2 * c];
        const float4 b = src[2 * c + 1];
        uint4 r;
        r.x = ElemTraits<Tag>::pack2(a.x * s, a.y * s);
        r.y = ElemTraits<Tag>::pack2(a.z * s, a.w * s);
        r.z = ElemTraits<Tag>::pack2(b.x * s, b.y * s);
        r.w = ElemTraits<Tag>::pack2(b.z * s, b.w * s);
        *reinterpret_cast<uint4*>(dst + c * 8) = r;
    }
}
