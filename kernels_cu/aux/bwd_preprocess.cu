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

template <typename Tag, int kNWarps>
__global__ void __launch_bounds__(kNWarps * 32)
bwd_preprocess_kernel(const BwdParams p) {
    using T = typename ElemStorage<Tag>::T;
    constexpr int kThreadsPerRow = 8;
    constexpr int kRows = kNWarps * 32 / kThreadsPerRow;
    constexpr int kChunk = 16 / static_cast<int>(sizeof(T));
    const int tid = threadIdx.x;
    const int sub = tid % kThreadsPerRow;
    const int row = blockIdx.x * kRows + tid / kThreadsPerRow;   // the grid covers seqlen_q and dq_accum_rows
    const int head = blockIdx.y;
    const int batch = blockIdx.z;
    const bool valid = row < p.seqlen_q;

    float acc = 0.f;
    if (valid) {
        const T* o = static_cast<const T*>(p.o) + batch * p.o_batch_stride + row * p.o_row_stride
                     + head * p.o_head_stride;
        const T* d = static_cast<const T*>(p.dout) + batch * p.do_batch_stride + row * p.do_row_stride
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

    const i64 row_index = (static_cast<i64>(batch) * p.heads_q + head) * p.seqlen_q + row;
    // A gradient of lse adds dlse[i] * P[i, j] to dS[i, j]: the same as taking it off delta.
    if (valid && p.dlse != nullptr) acc -= p.dlse[row_index];
    if (valid && sub == 0 && p.delta != nullptr) p.delta[row_index] = acc;   // null: the sm90 kernel reads stats
    if (p.stats != nullptr && row < p.stat_rows && sub == 0) {
        float* stats = p.stats + (static_cast<i64>(batch) * p.heads_q + head) * 2 * p.stat_rows;
        stats[row] = bwd_lse2(valid ? p.lse[row_index] : -CUFLASH_INF);
        stats[p.stat_rows + row] = valid ? acc : 0.f;
    }
    // Zeroing the dq_accum here saves a memset pass: its stores go out beside this kernel's loads.
    if (p.dq_accum != nullptr && row < p.dq_zero_rows) {
        const i64 accum_row = (static_cast<i64>(batch) * p.heads_q + head) * p.dq_accum_rows + row;
        float4* dst = reinterpret_cast<float4*>(p.dq_accum + accum_row * p.dq_accum_cols);
        for (int c = sub; c < p.dq_accum_cols / 4; c += kThreadsPerRow) dst[c] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    // One semaphore per thread: the grid has at least 8 threads per row of dq_accum, and there are at
    // most 2 semaphores (slices) per 64 rows.
    const i64 thread = ((static_cast<i64>(batch) * p.heads_q + head) * gridDim.x + blockIdx.x) * blockDim.x + tid;
    if (thread < p.dq_semaphores) p.dq_semaphore[thread] = 0;
}
