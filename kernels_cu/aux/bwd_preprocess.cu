// Backward preprocess: delta = rowsum(dout * out) - dlse in float32, one value per (batch, head, query row)
// (sm90: into the stats rows beside lse2, BwdParams.stats, and not into delta), and zero the float32
// dq_accum (atomic dQ mode; the sm90 tile modes only where no key tile writes: BwdParams.dq_zero_rows)
// and the tile modes' dq_semaphore.
//
// Memory-bound: 8 threads per row read 16-byte chunks of dout and out (any
// head_dim, strided views), reduce with shuffles inside the 8-lane group; the
// summation order is fixed, so delta is deterministic.
#include "../common/numeric.cuh"
#include "../common/params.cuh"
#include "../common/bwd_math.cuh"
#include "../common/varlen.cuh"

// Varlen (kVarlen, batch 0): the sequence's rows start at packed row q_start (lse, delta: (heads_q, total_q);
// row-major dq_accum: (heads_q, total_q, head_dim)) and at padded row pad_row0 (sm90: the stats rows and dQ
// tiles, whole tiles of p.tile_rows per sequence), and its length is seqlen_q; seq_index: its index (for the
// semaphores, counted over the whole grid). Dense: q_start = pad_row0 = 0, p.seqlen_q, seq_index = batch.
template <typename Tag, int kNWarps, bool kVarlen>
__device__ __forceinline__ void bwd_preprocess_body(const BwdParams& p, const int batch, const int q_start,
                                                    const int seqlen_q, const int pad_row0, const int seq_index) {
    using T = typename ElemStorage<Tag>::T;
    constexpr int kThreadsPerRow = 8;
    constexpr int kRows = kNWarps * 32 / kThreadsPerRow;
    constexpr int kChunk = 16 / static_cast<int>(sizeof(T));
    const int tid = threadIdx.x;
    const int sub = tid % kThreadsPerRow;
    const int row = blockIdx.x * kRows + tid / kThreadsPerRow;   // the grid covers seqlen_q and dq_accum_rows
    const int head = blockIdx.y;
    const bool valid = row < seqlen_q;
    const int packed_row = q_start + row;   // the row in q's layout (dense: the row)

    float acc = 0.f;
    if (valid) {
        const T* o = static_cast<const T*>(p.o) + batch * p.o_batch_stride + packed_row * p.o_row_stride
                     + head * p.o_head_stride;
        const T* d = static_cast<const T*>(p.dout) + batch * p.do_batch_stride + packed_row * p.do_row_stride
                     + head * p.do_head_stride;
        const int chunks = p.head_dim / kChunk;
        for (int c = sub; c < chunks; c += kThreadsPerRow) {
            const uint4 a = *reinterpret_cast<const uint4*>(o + c * kChunk);
            const uint4 b = *reinterpret_cast<const uint4*>(d + c * kChunk);
            acc += chunk_dot<Tag>(a, b);
        }
    }
#pragma unroll
    for (int off = 1; off < kThreadsPerRow; off <<= 1) acc += __shfl_xor_sync(0xffffffff, acc, off);

    const i64 row_index = stat_offset<kVarlen>(p, batch, head) + packed_row;
    // A gradient of lse adds dlse[i] * P[i, j] to dS[i, j]: the same as taking it off delta.
    if (valid && p.dlse != nullptr) acc -= p.dlse[row_index];
    if (valid && sub == 0 && p.delta != nullptr) p.delta[row_index] = acc;   // null: the sm90 kernel reads stats
    // Varlen: the rows of the sequence's whole tiles (the grid covers max_seqlen_q rounded up to a tile).
    const int stat_rows = kVarlen ? ceil_div(seqlen_q, max(p.tile_rows, 1)) * p.tile_rows : p.stat_rows;
    if (p.stats != nullptr && row < stat_rows && sub == 0) {
        float* stats = p.stats + (static_cast<i64>(batch) * p.heads_q + head) * 2 * p.stat_rows + pad_row0;
        stats[row] = bwd_lse2(valid ? p.lse[row_index] : -CUFLASH_INF);
        stats[p.stat_rows + row] = valid ? acc : 0.f;
    }
    // Zeroing the dq_accum here saves a memset pass: its stores go out beside this kernel's loads.
    // (Varlen: the sequence's rows only, or its whole tiles, the rest of the grid's rows being the next
    // sequences'; every one of them, since which query tiles no key tile reaches differs per sequence.)
    const bool tiled = kVarlen && p.tile_rows > 0;
    if (p.dq_accum != nullptr && row < (kVarlen ? min(p.dq_zero_rows, tiled ? stat_rows : seqlen_q) : p.dq_zero_rows)) {
        const i64 accum_row = (static_cast<i64>(batch) * p.heads_q + head) * p.dq_accum_rows
                              + (tiled ? pad_row0 + row : packed_row);
        float4* dst = reinterpret_cast<float4*>(p.dq_accum + accum_row * p.dq_accum_cols);
        for (int c = sub; c < p.dq_accum_cols / 4; c += kThreadsPerRow) dst[c] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    // One semaphore per thread: the grid has at least 8 threads per row of dq_accum, and there are at
    // most 2 semaphores (slices) per 64 rows.
    const i64 thread = ((static_cast<i64>(seq_index) * p.heads_q + head) * gridDim.x + blockIdx.x) * blockDim.x + tid;
    if (thread < p.dq_semaphores) p.dq_semaphore[thread] = 0;
}

// The varlen form (cu_seqlens_q set) is a run-time branch: these kernels are memory-bound.
template <typename Tag, int kNWarps>
__global__ void __launch_bounds__(kNWarps * 32)
bwd_preprocess_kernel(const BwdParams p) {
    if (p.cu_seqlens_q != nullptr) {
        int q_start, seqlen_q;
        packed_rows(p.cu_seqlens_q, p.seqused_q, blockIdx.z, p.total_q, p.seqlen_q, q_start, seqlen_q);
        const int pad_row0 = p.tile_rows > 0 ? padded_row0(q_start, blockIdx.z, p.tile_rows) : 0;
        flag_decreasing_offsets(p, blockIdx.z);
        bwd_preprocess_body<Tag, kNWarps, true>(p, 0, q_start, seqlen_q, pad_row0, blockIdx.z);
    } else {
        bwd_preprocess_body<Tag, kNWarps, false>(p, blockIdx.z, 0, p.seqlen_q, 0, blockIdx.z);
    }
}
