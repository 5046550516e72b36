// Exact float32 FlashAttention forward on CUDA cores: every product is an FFMA
// in float32 (no tensor cores, no TF32), online softmax in exp2.
//
// One CTA per (query tile, head, batch). Q, K and V tiles live in shared
// memory as float rows padded by 4 floats; K and V stream through one buffer
// each with cp.async, the V load of tile n overlapping S = Q K_n^T and the K
// load of tile n-1 overlapping O += P V_n (as in sm80/fwd.cu). Key tiles are
// visited from last to first, so the tiles that need masking come first.
//
// Thread layout: the kThreads threads form a kNY x kNX grid, tx = tid % kNX
// (fastest), ty = tid / kNX. A row group (the kNX threads of one ty) lies
// inside one warp. Thread (ty, tx) owns
//   * query rows ty + i * kNY (i < kRows) of the tile, for S, the softmax
//     statistics, O and the output;
//   * keys tx + k * kNX (k < kKeys) of S: kRows x kKeys scores in registers;
//   * float4 column chunks tx + c * kNX (c < kOChunks) of O: kRows x 4 *
//     kOChunks accumulators in registers.
// The row max / row sum reductions are xor-shuffles inside the row group, and
// P goes through shared memory (sP) so that each thread can read its rows'
// probabilities for every key of the tile.
//
// Shared memory banking: a float row stride of kHeadDim + 4 (kHeadDim % 8 ==
// 0) is an odd number of 16-byte units, so the float4 reads of 8 consecutive
// rows at one column hit 8 different 16-byte bank groups (K rows in S, Q rows
// across the row groups of a warp). sP rows are kBlockN + 8 floats apart: the
// scalar P stores of a warp (4 rows x 8 keys) and the float4 P reads of 4 rows
// are conflict-free for kBlockN % 32 == 0.
#include "../common/numeric.cuh"
#include "../common/params.cuh"
#include "../common/block_range.cuh"

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_>
struct SimtFwdTile {
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kBlockM = kBlockM_;
    static constexpr int kBlockN = kBlockN_;
    static constexpr int kNWarps = kNWarps_;
    static constexpr int kThreads = kNWarps * 32;
    static constexpr int kChunks = kHeadDim / 4;  // float4 chunks per row
    // Threads per row group: 8 for head_dim >= 32, fewer for tiny head dims so
    // that the O column chunks are not mostly padding; at least kThreads /
    // kBlockM so that every thread owns a query row.
    static constexpr int kNXPref = kHeadDim >= 32 ? 8 : (kHeadDim >= 16 ? 4 : 2);
    static constexpr int kNXMin = kThreads / kBlockM;
    static constexpr int kNX = kNXPref > kNXMin ? kNXPref : (kNXMin > 0 ? kNXMin : 1);
    static constexpr int kNY = kThreads / kNX;
    static constexpr int kRows = kBlockM / kNY;     // query rows per thread
    static constexpr int kKeys = kBlockN / kNX;     // keys per thread in S
    static constexpr int kOChunks = (kChunks + kNX - 1) / kNX;  // O float4 chunks per thread
    static constexpr int kOChunksFull = kChunks / kNX;          // ... that are never past head_dim
    static constexpr int kStride = kHeadDim + 4;    // floats per Q/K/V row in shared memory
    static constexpr int kPStride = kBlockN + 8;    // floats per P row
    static constexpr int kSmemFloats = (kBlockM + 2 * kBlockN) * kStride + kBlockM * kPStride;

    static_assert(kHeadDim % 8 == 0, "head_dim must be a multiple of 8");
    static_assert(kNX <= 32 && 32 % kNX == 0, "a row group must lie inside one warp");
    static_assert(kThreads % kNX == 0 && kBlockM % kNY == 0, "kBlockM must be a multiple of kThreads / kNX");
    static_assert(kBlockN % kNX == 0 && kBlockN % 4 == 0, "kBlockN must be a multiple of kNX and of 4");
};

__device__ __forceinline__ void simt_cp_async_16(void* smem, const void* gmem, bool valid) {
    // src-size 0 zero-fills the destination: rows past the sequence end read nothing.
    const u32 dst = static_cast<u32>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(dst), "l"(gmem), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void simt_cp_async_commit() { asm volatile("cp.async.commit_group;"); }

__device__ __forceinline__ void simt_cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

// Copy rows [0, kRows) of a float tile (kHeadDim columns) into shared memory
// rows kStride floats apart; rows >= rows_valid are zero-filled.
template <int kRows, int kHeadDim, int kStride, int kThreads>
__device__ __forceinline__ void simt_load_tile(float* smem, const float* gmem, i64 row_stride,
                                               int rows_valid, int tid) {
    constexpr int kChunksPerRow = kHeadDim / 4;
    constexpr int kTotal = kRows * kChunksPerRow;
#pragma unroll
    for (int c = tid; c < kTotal; c += kThreads) {
        const int row = c / kChunksPerRow;
        const int col = (c % kChunksPerRow) * 4;
        const bool valid = row < rows_valid;
        const float* src = gmem + (valid ? row * row_stride + col : 0);
        simt_cp_async_16(smem + row * kStride + col, src, valid);
    }
}

// Reductions over the kNX lanes of a row group (consecutive lanes).
template <int kNX>
__device__ __forceinline__ float group_max(float x) {
#pragma unroll
    for (int off = kNX / 2; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, off));
    return x;
}

template <int kNX>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
    for (int off = kNX / 2; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffff, x, off);
    return x;
}

template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, bool kIsCausal>
__global__ void __launch_bounds__(kNWarps * 32)
fwd_kernel(const FwdParams p) {
    static_assert(sizeof(T) == 4, "simt_fwd is the float32 kernel");
    using Tile = SimtFwdTile<kHeadDim, kBlockM, kBlockN, kNWarps>;
    using Range = BlockRange<kBlockM, kBlockN, kIsCausal>;
    constexpr int kThreads = Tile::kThreads;
    constexpr int kNX = Tile::kNX;
    constexpr int kNY = Tile::kNY;
    constexpr int kRows = Tile::kRows;
    constexpr int kKeys = Tile::kKeys;
    constexpr int kChunks = Tile::kChunks;
    constexpr int kOChunks = Tile::kOChunks;
    constexpr int kOChunksFull = Tile::kOChunksFull;
    constexpr int kStride = Tile::kStride;
    constexpr int kPStride = Tile::kPStride;

    extern __shared__ __align__(16) float smem_f32[];
    float* sQ = smem_f32;
    float* sK = sQ + kBlockM * kStride;
    float* sV = sK + kBlockN * kStride;
    float* sP = sV + kBlockN * kStride;

    const int tid = threadIdx.x;
    const int tx = tid % kNX;
    const int ty = tid / kNX;
    // Causal tiles near the end of the sequence do the most work: launch them first.
    const int m_block = kIsCausal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int head = blockIdx.y;
    const int batch = blockIdx.z;
    const int head_kv = head / p.heads_per_kv;

    const int row_base = m_block * kBlockM;
    const int rows_valid = min(kBlockM, p.seqlen_q - row_base);
    const float* gQ = static_cast<const float*>(p.q) + batch * p.q_batch_stride + head * p.q_head_stride
                      + row_base * p.q_row_stride;
    const float* gK = static_cast<const float*>(p.k) + batch * p.k_batch_stride + head_kv * p.k_head_stride;
    const float* gV = static_cast<const float*>(p.v) + batch * p.v_batch_stride + head_kv * p.v_head_stride;
    float* gO = static_cast<float*>(p.o) + batch * p.o_batch_stride + head * p.o_head_stride
                + row_base * p.o_row_stride;
    float* gLse = p.lse ? p.lse + (static_cast<i64>(batch) * p.heads_q + head) * p.seqlen_q + row_base : nullptr;

    const int n_block_max = Range::n_block_max(m_block, p.seqlen_q, p.seqlen_k);

    // Column offset (floats) of this thread's O chunk c; the chunks past
    // head_dim (only in the last, partial round) read a valid column instead
    // and are never stored.
    auto o_col = [&](int c) {
        const int chunk = tx + c * kNX;
        return 4 * (c < kOChunksFull ? chunk : min(chunk, kChunks - 1));
    };

    float acc_o[kRows][kOChunks][4];
#pragma unroll
    for (int i = 0; i < kRows; ++i)
#pragma unroll
        for (int c = 0; c < kOChunks; ++c)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[i][c][e] = 0.f;
    float row_max[kRows];  // log2 domain of the scaled scores; -inf until a visible key
    float row_sum[kRows];  // per-thread partial sums of exp2(...), reduced at the end
#pragma unroll
    for (int i = 0; i < kRows; ++i) { row_max[i] = -CUFLASH_INF; row_sum[i] = 0.f; }

    if (n_block_max > 0) {
        simt_load_tile<kBlockM, kHeadDim, kStride, kThreads>(sQ, gQ, p.q_row_stride, rows_valid, tid);
        {
            const int n0 = (n_block_max - 1) * kBlockN;
            simt_load_tile<kBlockN, kHeadDim, kStride, kThreads>(
                sK, gK + n0 * p.k_row_stride, p.k_row_stride, p.seqlen_k - n0, tid);
        }
        simt_cp_async_commit();

        for (int n_block = n_block_max - 1; n_block >= 0; --n_block) {
            const int n0 = n_block * kBlockN;
            simt_cp_async_wait_all();
            __syncthreads();  // K_n landed; every thread is done reading V_{n+1} and sP
            simt_load_tile<kBlockN, kHeadDim, kStride, kThreads>(
                sV, gV + n0 * p.v_row_stride, p.v_row_stride, p.seqlen_k - n0, tid);
            simt_cp_async_commit();

            // S = Q K_n^T: each thread a kRows x kKeys block, float4 steps along head_dim.
            float acc_s[kRows][kKeys];
#pragma unroll
            for (int i = 0; i < kRows; ++i)
#pragma unroll
                for (int k = 0; k < kKeys; ++k) acc_s[i][k] = 0.f;
            {
                const float* q_ptr = sQ + ty * kStride;
                const float* k_ptr = sK + tx * kStride;
#pragma unroll 4
                for (int d = 0; d < kHeadDim; d += 4) {
                    float4 qv[kRows], kv[kKeys];
#pragma unroll
                    for (int i = 0; i < kRows; ++i)
                        qv[i] = *reinterpret_cast<const float4*>(q_ptr + i * kNY * kStride + d);
#pragma unroll
                    for (int k = 0; k < kKeys; ++k)
                        kv[k] = *reinterpret_cast<const float4*>(k_ptr + k * kNX * kStride + d);
#pragma unroll
                    for (int i = 0; i < kRows; ++i)
#pragma unroll
                        for (int k = 0; k < kKeys; ++k) {
                            float s = acc_s[i][k];
                            s = fmaf(qv[i].x, kv[k].x, s);
                            s = fmaf(qv[i].y, kv[k].y, s);
                            s = fmaf(qv[i].z, kv[k].z, s);
                            s = fmaf(qv[i].w, kv[k].w, s);
                            acc_s[i][k] = s;
                        }
                }
            }

            if (Range::needs_mask(m_block, n_block, p.seqlen_q, p.seqlen_k)) {
#pragma unroll
                for (int i = 0; i < kRows; ++i)
#pragma unroll
                    for (int k = 0; k < kKeys; ++k) {
                        const int row = row_base + ty + i * kNY;
                        const int col = n0 + tx + k * kNX;
                        if (!key_visible<kIsCausal>(row, col, p.seqlen_q, p.seqlen_k)) acc_s[i][k] = -CUFLASH_INF;
                    }
            }

            // Online softmax in the log2 domain; P to shared memory, O rescaled.
#pragma unroll
            for (int i = 0; i < kRows; ++i) {
                float mx = -CUFLASH_INF;
#pragma unroll
                for (int k = 0; k < kKeys; ++k) mx = fmaxf(mx, acc_s[i][k]);
                mx = group_max<kNX>(mx) * p.scale_log2;
                const float new_max = fmaxf(row_max[i], mx);
                // A row that has seen no visible key keeps max -inf; use 0 as the
                // reference so that exp2(-inf - ref) = 0 rather than NaN.
                const float ref = new_max == -CUFLASH_INF ? 0.f : new_max;
                const float rescale = exp2f(row_max[i] - ref);
                row_max[i] = new_max;
                float sum = 0.f;
                float* p_row = sP + (ty + i * kNY) * kPStride + tx;
#pragma unroll
                for (int k = 0; k < kKeys; ++k) {
                    const float pk = exp2f(fmaf(acc_s[i][k], p.scale_log2, -ref));
                    sum += pk;
                    p_row[k * kNX] = pk;
                }
                row_sum[i] = fmaf(row_sum[i], rescale, sum);
#pragma unroll
                for (int c = 0; c < kOChunks; ++c)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc_o[i][c][e] *= rescale;
            }

            simt_cp_async_wait_all();
            __syncthreads();  // V_n landed and sP written; every thread is done reading K_n
            if (n_block > 0) {
                const int n_prev = n0 - kBlockN;
                simt_load_tile<kBlockN, kHeadDim, kStride, kThreads>(
                    sK, gK + n_prev * p.k_row_stride, p.k_row_stride, p.seqlen_k - n_prev, tid);
                simt_cp_async_commit();
            }

            // O += P V_n: four keys per step, P read as float4 per row.
            {
                const float* p_ptr = sP + ty * kPStride;
#pragma unroll 2
                for (int j = 0; j < kBlockN; j += 4) {
                    float4 pv[kRows];
#pragma unroll
                    for (int i = 0; i < kRows; ++i)
                        pv[i] = *reinterpret_cast<const float4*>(p_ptr + i * kNY * kPStride + j);
#pragma unroll
                    for (int jj = 0; jj < 4; ++jj) {
                        const float* v_row = sV + (j + jj) * kStride;
#pragma unroll
                        for (int c = 0; c < kOChunks; ++c) {
                            const float4 v = *reinterpret_cast<const float4*>(v_row + o_col(c));
#pragma unroll
                            for (int i = 0; i < kRows; ++i) {
                                const float pij = jj == 0 ? pv[i].x : jj == 1 ? pv[i].y : jj == 2 ? pv[i].z : pv[i].w;
                                acc_o[i][c][0] = fmaf(pij, v.x, acc_o[i][c][0]);
                                acc_o[i][c][1] = fmaf(pij, v.y, acc_o[i][c][1]);
                                acc_o[i][c][2] = fmaf(pij, v.z, acc_o[i][c][2]);
                                acc_o[i][c][3] = fmaf(pij, v.w, acc_o[i][c][3]);
                            }
                        }
                    }
                }
            }
        }
    }

    // Epilogue: normalise and store straight from registers (a row group
    // writes kNX consecutive 16-byte chunks of a row).
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
        const float sum = group_sum<kNX>(row_sum[i]);
        const bool empty = !(sum > 0.f);
        const float inv_sum = empty ? 0.f : 1.f / sum;
        const int row = ty + i * kNY;
        if (row < rows_valid) {
            float* o_row = gO + row * p.o_row_stride;
#pragma unroll
            for (int c = 0; c < kOChunks; ++c) {
                if (c < kOChunksFull || tx + c * kNX < kChunks) {
                    *reinterpret_cast<float4*>(o_row + 4 * (tx + c * kNX)) =
                        make_float4(acc_o[i][c][0] * inv_sum, acc_o[i][c][1] * inv_sum,
                                    acc_o[i][c][2] * inv_sum, acc_o[i][c][3] * inv_sum);
                }
            }
            if (gLse != nullptr && tx == 0)
                gLse[row] = empty ? -CUFLASH_INF : (row_max[i] + log2f(sum)) * CUFLASH_LN2;
        }
    }
}
