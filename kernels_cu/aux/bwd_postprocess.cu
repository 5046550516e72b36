// Backward postprocess (atomic-dQ mode): dq = dq_accum * softmax_scale in the
// output dtype. dq_accum is float32 (batch, heads_q, seqlen_q, head_dim),
// contiguous; dq may be any strided view. 8 threads per row, 8 elements each
// per step (two float4 reads, one 16-byte write).
#include "../common/numeric.cuh"
#include "../common/params.cuh"
#include "../common/varlen.cuh"

// Varlen (kVarlen): p is the sequence's (seq_params), batch 0.
template <typename Tag, int kNWarps, bool kVarlen>
__device__ __forceinline__ void bwd_postprocess_body(const BwdParams& p, const int batch) {
    constexpr int kThreadsPerRow = 8;
    constexpr int kRows = kNWarps * 32 / kThreadsPerRow;
    const int tid = threadIdx.x;
    const int sub = tid % kThreadsPerRow;
    const int row = blockIdx.x * kRows + tid / kThreadsPerRow;
    const int head = blockIdx.y;
    if (row >= p.seqlen_q) return;

    const i64 row_index = stat_offset<kVarlen>(p, batch, head) + row;
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

// The varlen form (cu_seqlens_q set) is a run-time branch: this kernel is memory-bound.
template <typename Tag, int kNWarps>
__global__ void __launch_bounds__(kNWarps * 32)
bwd_postprocess_kernel(const BwdParams p) {
    if (p.cu_seqlens_q != nullptr) {
        const SeqSpan span = seq_span(p, blockIdx.z);
        bwd_postprocess_body<Tag, kNWarps, true>(seq_params<2>(p, span, blockIdx.z), 0);
    } else {
        bwd_postprocess_body<Tag, kNWarps, false>(p, blockIdx.z);
    }
}

// The same for the sm90 tile dQ modes (kernels_cu/sm90/bwd.cu): dq_accum holds, per (batch, head,
// query tile of kBlockM rows), kBlockM x kHeadDimPad floats as two warpgroup slices of 64 rows x
// kDqCols columns (kBlockM = 64: column halves; 128: row halves), each in the wgmma accumulator
// order: float 512 j + 4 t + e of a slice is register 4j + e of thread t = 32 w + 4 g + t4, i.e.
// row 16 w + g + 8 (e / 2), column 8 j + 2 t4 + (e % 2). One CTA per query tile; a thread writes 8
// consecutive columns of a row (16 bytes) from four float2 reads.
template <typename Tag, int kHeadDim, int kBlockM, int kNWarps>
__global__ void __launch_bounds__(kNWarps * 32)
bwd_postprocess_tiled_kernel(const BwdParams p) {
    constexpr int kHeadDimPad = (kHeadDim + 63) / 64 * 64;
    constexpr int kDqCols = kBlockM == 64 ? kHeadDimPad / 2 : kHeadDimPad;
    constexpr int kSliceFloats = 64 * kDqCols;
    static_assert(kBlockM == 64 || kBlockM == 128, "query tiles of 64 or 128 rows");
    const int m_block = blockIdx.x;
    const int head = blockIdx.y;
    int batch = blockIdx.z, m_blocks = gridDim.x, seqlen_q = p.seqlen_q, q_start = 0, tile0 = 0;
    if (p.cu_seqlens_q != nullptr) {   // varlen: the sequence's tiles from its padded row, its rows from q_start
        packed_rows(p.cu_seqlens_q, p.seqused_q, batch, p.total_q, p.seqlen_q, q_start, seqlen_q);
        if (m_block * kBlockM >= seqlen_q) return;
        m_blocks = p.dq_accum_rows / kBlockM;
        tile0 = padded_row0(q_start, batch, kBlockM) / kBlockM;
        batch = 0;
    }
    const float* tile = p.dq_accum + ((static_cast<i64>(batch) * p.heads_q + head) * m_blocks + tile0 + m_block)
                                         * (kBlockM * kHeadDimPad);
    const int groups = p.head_dim / 8;  // 8-column groups of a row
    const float s = p.softmax_scale;
    for (int item = threadIdx.x; item < kBlockM * groups; item += kNWarps * 32) {
        const int r = item / groups;
        const int col = (item % groups) * 8;
        const int row = m_block * kBlockM + r;
        if (row >= seqlen_q) break;  // items are row-major: the rest of this thread's rows are past the end
        const int slice = kBlockM == 64 ? col / kDqCols : r / 64;
        const int row_in = kBlockM == 64 ? r : r % 64;
        const int col_in = kBlockM == 64 ? col % kDqCols : col;
        // Register index 4j + e with e = 2 * (row_in % 16 >= 8) + (col % 2); thread 32 w + 4 g + t4.
        const int base = slice * kSliceFloats + (col_in / 8) * 512
                         + 4 * (32 * (row_in / 16) + 4 * (row_in % 8)) + 2 * ((row_in % 16) / 8);
        float v[8];
#pragma unroll
        for (int t4 = 0; t4 < 4; ++t4) {
            const float2 pair = *reinterpret_cast<const float2*>(tile + base + 4 * t4);
            v[2 * t4] = pair.x * s;
            v[2 * t4 + 1] = pair.y * s;
        }
        uint4 out;
        out.x = ElemTraits<Tag>::pack2(v[0], v[1]);
        out.y = ElemTraits<Tag>::pack2(v[2], v[3]);
        out.z = ElemTraits<Tag>::pack2(v[4], v[5]);
        out.w = ElemTraits<Tag>::pack2(v[6], v[7]);
        u16* dst = static_cast<u16*>(p.dq) + batch * p.dq_batch_stride + (q_start + row) * p.dq_row_stride
                   + head * p.dq_head_stride + col;
        *reinterpret_cast<uint4*>(dst) = out;
    }
}
