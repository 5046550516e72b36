// Exact float32 FlashAttention forward on CUDA cores: every product is an FFMA
// in float32 (no tensor cores, no TF32), online softmax in exp2.
//
// One CTA per (query tile, head, batch). Q, K and V tiles live in shared
// memory as float rows padded by 4 floats; K and V stream through one buffer
// each with cp.async, the V load of tile n overlapping S = Q K_n^T and the K
// load of tile n-1 overlapping O += P V_n (as in sm80/fwd.cu). Key tiles are
// visited from last to first, so the tiles that need masking come first. The
// mask policy (common/mask.cuh, exact math) built from the kernel's MaskVariant
// gives the key tiles, the hidden elements, the score modifier and the sink.
// fwd_prog_kernel (a ProgVariant, ProgParams; common/programmable.cuh) adds
// programmable attention in `if constexpr` hooks: the bias and the user's
// modifiers per element, block-sparse key tiles by position, dropout's flags
// per tile in shared memory (DropoutTile: the 16-bit kernels' mask).
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
// probabilities for every key of the tile. Each thread's running max and
// partial sum live in shared memory too (sStat, private slots).
//
// Exactness: S is a float32 FMA chain over head_dim, P = exp2(s * scale_log2
// - max) with ex2.approx (2 ulp), O a float32 FMA chain over the keys, then
// one IEEE division. Against a float64 reference the relative error is a few
// 1e-7 (head dims 32..256, up to 4096 keys), well inside the 1e-5 budget.
//
// Registers: only the O accumulators are live across the key-tile loop.
// Indices and pointers are re-derived from the special registers and the
// (constant-bank) parameters after every inner loop, and the softmax
// statistics sit in shared memory, because ptxas otherwise spills such
// long-lived, rarely used values to reach an occupancy step. The tile table
// (cuflash/heuristics.py) is checked to compile without spills for every head
// dim; a new tile shape should be checked the same way.
//
// Shared memory banking: a float row stride of kHeadDim + 4 (kHeadDim % 8 ==
// 0) is an odd number of 16-byte units, so the float4 reads of 8 consecutive
// rows at one column hit 8 different 16-byte bank groups (K rows in S, Q rows
// across the row groups of a warp). sP rows are kBlockN + 8 floats apart: the
// scalar P stores of a warp (4 rows x 8 keys) and the float4 P reads of 4 rows
// are conflict-free for kBlockN % 32 == 0.
#include "../common/numeric.cuh"
#include "../common/params.cuh"
#include "../common/mask.cuh"
#include "../common/programmable.cuh"
#include "../common/varlen.cuh"

// Unroll factors of the S (head_dim, step 4) and P V (keys, step 4) loops.
constexpr int kSimtUnrollD = 2;
constexpr int kSimtUnrollJ = 1;

// kHeadDimV_: v's (and the output's) head dim where it differs from q's and k's (0: the same).
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kHeadDimV_ = 0>
struct SimtFwdTile {
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kHeadDimV = kHeadDimV_ ? kHeadDimV_ : kHeadDim;
    static constexpr int kBlockM = kBlockM_;
    static constexpr int kBlockN = kBlockN_;
    static constexpr int kNWarps = kNWarps_;
    static constexpr int kThreads = kNWarps * 32;
    static constexpr int kChunks = kHeadDimV / 4;  // float4 chunks per row of V and O
    // Threads per row group: 8 for head_dim >= 32, fewer for tiny head dims so
    // that the O column chunks are not mostly padding; at least kThreads /
    // kBlockM so that every thread owns a query row.
    static constexpr int kNXPref = kHeadDimV >= 32 ? 8 : (kHeadDimV >= 16 ? 4 : 2);
    static constexpr int kNXMin = kThreads / kBlockM;
    static constexpr int kNX = kNXPref > kNXMin ? kNXPref : (kNXMin > 0 ? kNXMin : 1);
    static constexpr int kNY = kThreads / kNX;
    static constexpr int kRows = kBlockM / kNY;     // query rows per thread
    static constexpr int kKeys = kBlockN / kNX;     // keys per thread in S
    static constexpr int kOChunks = (kChunks + kNX - 1) / kNX;  // O float4 chunks per thread
    static constexpr int kOChunksFull = kChunks / kNX;          // ... that are never past head_dim
    static constexpr int kStride = (kHeadDim > kHeadDimV ? kHeadDim : kHeadDimV) + 4;   // floats per Q/K/V row
    static constexpr int kPStride = kBlockN + 8;    // floats per P row
    // Q, K, V tiles, the P tile, and two softmax statistics per (thread, row).
    static constexpr int kSmemFloats = (kBlockM + 2 * kBlockN) * kStride + kBlockM * kPStride + 2 * kBlockM * kNX;

    static_assert(kHeadDim % 8 == 0 && kHeadDimV % 8 == 0, "head dims must be multiples of 8");
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
// rows kStride floats apart; rows >= rows_valid are zero-filled. Thread tid
// copies the 16-byte chunk tid % kCPR of rows tid / kCPR + k * kRowsPerPass,
// so that it needs one source pointer and one constant step, not an address
// per chunk (the few threads past kRowsPerPass * kCPR idle).
template <int kRows, int kHeadDim, int kStride, int kThreads>
__device__ __forceinline__ void simt_load_tile(float* smem, const float* gmem, i64 row_stride,
                                               int rows_valid, int tid) {
    constexpr int kCPR = kHeadDim / 4;
    constexpr int kRowsPerPass = kThreads / kCPR;
    constexpr int kPasses = (kRows + kRowsPerPass - 1) / kRowsPerPass;
    static_assert(kRowsPerPass >= 1, "need at least head_dim / 4 threads");
    if (kThreads % kCPR != 0 && tid >= kRowsPerPass * kCPR) return;
    const int row0 = tid / kCPR;
    const int col = (tid % kCPR) * 4;
    const float* src = gmem + row0 * row_stride + col;
    float* dst = smem + row0 * kStride + col;
    const i64 src_step = kRowsPerPass * row_stride;
#pragma unroll
    for (int k = 0; k < kPasses; ++k) {
        const int row = row0 + k * kRowsPerPass;
        if (kRows % kRowsPerPass == 0 || row < kRows) {
            const bool valid = row < rows_valid;
            simt_cp_async_16(dst + k * kRowsPerPass * kStride, valid ? src : gmem, valid);
        }
        src += src_step;
    }
}

// Special registers read through asm volatile: the front end can neither merge
// these reads with earlier ones nor hoist them out of a loop (ptxas may still
// merge them; then the value is one register, not a chain of derived ones).
__device__ __forceinline__ int simt_read_tid() {
    int r;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(r));
    return r;
}

__device__ __forceinline__ int3 simt_read_ctaid() {
    int3 r;
    asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(r.x));
    asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(r.y));
    asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(r.z));
    return r;
}

// Where this CTA and thread stand. Formed afresh (from the special registers
// and the kernel parameters, which live in constant memory) after each inner
// loop and in the epilogue, so that no index or pointer stays live across
// the main loop: ptxas's occupancy heuristics otherwise like to spill such
// long-lived, rarely used values.
// kHeaviestFirst: query tiles see different numbers of keys, the last the most: launch them first.
template <int kBlockM, int kNX, bool kHeaviestFirst>
struct SimtCoords {
    int tx, ty;       // position in the kNY x kNX thread grid
    int row_base;     // first query row of the tile
    int head, batch;

    static __device__ __forceinline__ SimtCoords read() {
        SimtCoords c;
        const int tid = simt_read_tid();
        const int3 cta = simt_read_ctaid();
        c.tx = tid % kNX;
        c.ty = tid / kNX;
        c.row_base = (kHeaviestFirst ? static_cast<int>(gridDim.x) - 1 - cta.x : cta.x) * kBlockM;
        c.head = cta.y;
        c.batch = cta.z;
        return c;
    }
};

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

// The kernel's parts. Each re-derives the thread's coordinates (Coords::read) rather than holding them:
// across the key loop only acc_o and the key tile stay in registers.
// Programmable attention (Variant::kProg, fwd_prog_kernel; common/programmable.cuh) passes its parameters (pp),
// the block-sparse key tiles by position (Tiles, as the portable forward's: without sparsity the position is the
// key tile, and Tiles is empty) and the position; the plain kernels' parts ignore them.
template <int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV = 0>
struct SimtFwd {
    using Tile = SimtFwdTile<kHeadDim, kBlockM, kBlockN, kNWarps, kHeadDimV>;
    using Mask = MaskPolicy<kBlockM, kBlockN, Variant, true>;   // the mask policy (common/mask.cuh), exact tanh
    using Coords = SimtCoords<kBlockM, Tile::kNX, Mask::kUnevenWork>;
    using Tiles = KeyTiles<Mask, Variant>;
    using Keep = DropoutTile<kBlockM, kBlockN>;   // dropout's flags of a tile, in shared memory after sm.stat
    static constexpr int kThreads = Tile::kThreads;
    static constexpr int kNX = Tile::kNX;
    static constexpr int kNY = Tile::kNY;
    static constexpr int kRows = Tile::kRows;
    static constexpr int kKeys = Tile::kKeys;
    static constexpr int kChunks = Tile::kChunks;
    static constexpr int kOChunks = Tile::kOChunks;
    static constexpr int kOChunksFull = Tile::kOChunksFull;
    static constexpr int kStride = Tile::kStride;
    static constexpr int kPStride = Tile::kPStride;

    // Shared memory: Q, K, V, P tiles, then the per-thread softmax statistics of its kRows rows,
    // [kRows][2][kThreads]: the running max (log2 domain of the scaled scores, -inf until a visible key)
    // and the partial sum of exp2(...). Only this thread touches its slots. Kept here rather than in
    // registers: they are used once per key tile, so ptxas would happily spill them to reach an
    // occupancy step.
    struct Smem {
        float* q;
        float* k;
        float* v;
        float* p;
        float* stat;
        __device__ __forceinline__ explicit Smem(float* base)
            : q(base), k(q + kBlockM * kStride), v(k + kBlockN * kStride), p(v + kBlockN * kStride),
              stat(p + kBlockM * kPStride) {}
    };

    static __device__ __forceinline__ unsigned char* keep_flags(const Smem& sm) {
        return reinterpret_cast<unsigned char*>(sm.stat + 2 * kBlockM * kNX);
    }

    // The query tile's block-sparse key tiles (empty without sparsity).
    static __device__ __forceinline__ Tiles key_tiles(const FwdParams& p, const ProgParams* pp) {
        if constexpr (Variant::kBlockSparse) {
            const Coords c = Coords::read();
            return Tiles(pp, c.batch, c.head, c.row_base / kBlockM, p);
        } else {
            return Tiles(pp, 0, 0, 0, p);
        }
    }

    // K or V rows [n0, n0 + kBlockN) of this CTA's kv head.
    static __device__ __forceinline__ const float* kv_tile(const FwdParams& p, const void* base, i64 batch_stride,
                                                           i64 head_stride, i64 row_stride, const Coords& c, int n0) {
        return static_cast<const float*>(base) + c.batch * batch_stride + (c.head / p.heads_per_kv) * head_stride
               + n0 * row_stride;
    }

    // The key tiles this CTA visits are [n_block_min, n_block_max) of the policy, walked from the last down:
    // prologue() returns the last, the loop runs while has_key_tile(). Re-derived where asked, like the
    // coordinates (nothing held across the loop); the first is the constant 0 where the policy never skips
    // leading tiles, so that reading the coordinates for it leaves no trace in the code.
    static __device__ __forceinline__ int first_key_tile(const FwdParams& p) {
        if constexpr (Mask::kLocal) return Mask(p).n_block_min(Coords::read().row_base / kBlockM);
        else return 0;
    }
    // (Block sparsity: n_block is a position in the query tile's list, counting down to 0.)
    static __device__ __forceinline__ bool has_key_tile(const FwdParams& p, int n_block) {
        if constexpr (Variant::kBlockSparse) return n_block >= 0;
        else return n_block >= first_key_tile(p);
    }
    // Whether a tile is left after n_block.
    static __device__ __forceinline__ bool has_next_key_tile(const FwdParams& p, int n_block) {
        return n_block > first_key_tile(p);
    }

    // Statistics initialised; Q and the first K tile on their way. Returns the first-visited (last) key tile
    // (block sparsity: its position).
    static __device__ __forceinline__ int prologue(const FwdParams& p, const Smem& sm, const Tiles& tiles) {
        const Coords c = Coords::read();
        const int tid = c.ty * kNX + c.tx;
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
            sm.stat[(2 * i) * kThreads + tid] = -CUFLASH_INF;
            sm.stat[(2 * i + 1) * kThreads + tid] = 0.f;
        }
        const int n_block =
            Variant::kBlockSparse ? tiles.count() - 1 : Mask(p).n_block_max(c.row_base / kBlockM) - 1;
        if (has_key_tile(p, n_block)) {
            const float* gQ = static_cast<const float*>(p.q) + c.batch * p.q_batch_stride + c.head * p.q_head_stride
                              + c.row_base * p.q_row_stride;
            simt_load_tile<kBlockM, kHeadDim, kStride, kThreads>(sm.q, gQ, p.q_row_stride, p.seqlen_q - c.row_base, tid);
            const int n0 = (Variant::kBlockSparse ? tiles.tile(n_block) : n_block) * kBlockN;
            simt_load_tile<kBlockN, kHeadDim, kStride, kThreads>(
                sm.k, kv_tile(p, p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride, c, n0), p.k_row_stride,
                p.seqlen_k - n0, tid);
            simt_cp_async_commit();
        }
        return n_block;
    }

    // Dropout's flags of key tile n_block, drawn before scores' barrier: every thread read the previous tile's
    // before softmax's.
    static __device__ __forceinline__ void draw_keep(const FwdParams& p, const ProgParams& pp, const Smem& sm,
                                                     int n_block) {
        const Coords c = Coords::read();
        Keep::template fill<kThreads>(keep_flags(sm), DropoutLanes(pp, c.batch, p.heads_q, c.head), c.row_base,
                                      n_block * kBlockN, c.ty * kNX + c.tx);
    }

    // V_n on its way, then S = Q K_n^T: each thread a kRows x kKeys block, float4 steps along head_dim.
    static __device__ __forceinline__ void scores(const FwdParams& p, const Smem& sm, int n_block,
                                                  float (&acc_s)[kRows][kKeys]) {
        const Coords c = Coords::read();
        const int n0 = n_block * kBlockN;
        simt_cp_async_wait_all();
        __syncthreads();  // K_n landed; every thread is done reading V_{n+1} and sP
        simt_load_tile<kBlockN, Tile::kHeadDimV, kStride, kThreads>(
            sm.v, kv_tile(p, p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride, c, n0), p.v_row_stride,
            p.seqlen_k - n0, c.ty * kNX + c.tx);
        simt_cp_async_commit();
#pragma unroll
        for (int i = 0; i < kRows; ++i)
#pragma unroll
            for (int k = 0; k < kKeys; ++k) acc_s[i][k] = 0.f;
        const float* q_ptr = sm.q + c.ty * kStride;
        const float* k_ptr = sm.k + c.tx * kStride;
#pragma unroll kSimtUnrollD
        for (int d = 0; d < kHeadDim; d += 4) {
            float4 qv[kRows], kv[kKeys];
#pragma unroll
            for (int i = 0; i < kRows; ++i) qv[i] = *reinterpret_cast<const float4*>(q_ptr + i * kNY * kStride + d);
#pragma unroll
            for (int k = 0; k < kKeys; ++k) kv[k] = *reinterpret_cast<const float4*>(k_ptr + k * kNX * kStride + d);
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

    // The mask policy, the online softmax in the log2 domain (P to shared memory, O rescaled), then the next
    // K tile on its way. Programmable: the bias, the user's modifiers and the partial tiles' tests between the
    // built-in modifiers and masks, dropout on P after the row sums (lse is the undropped P's).
    static __device__ __forceinline__ void softmax(const FwdParams& p, const Smem& sm, int n_block,
                                                   float (&acc_s)[kRows][kKeys], float (&acc_o)[kRows][kOChunks][4],
                                                   const ProgParams* pp, const Tiles& tiles, int position) {
        const Coords c = Coords::read();
        const int n0 = n_block * kBlockN;
        if constexpr (Mask::kHasScoreMod) {
            const Mask mod(p, c.batch, c.head);
#pragma unroll
            for (int i = 0; i < kRows; ++i)
#pragma unroll
                for (int k = 0; k < kKeys; ++k)
                    acc_s[i][k] = mod.modify_score(acc_s[i][k], c.row_base + c.ty + i * kNY, n0 + c.tx + k * kNX);
        }
        if constexpr (Variant::kProg) {
            using Prog = ProgPolicy<Variant, kBiasByPolicy>;
            const Prog prog(*pp, c.batch, c.head, p.softmax_scale);
            const bool partial = tiles.partial(position);
#pragma unroll
            for (int i = 0; i < kRows; ++i) {
                const int row = c.row_base + c.ty + i * kNY;
                const i64 row_at = Prog::kPolicyAddsBias ? prog.bias_row(row) : 0;
#pragma unroll
                for (int k = 0; k < kKeys; ++k) {
                    const int col = n0 + c.tx + k * kNX;
                    acc_s[i][k] = prog_score_at(prog, acc_s[i][k], row, col, row_at,
                                                row < p.seqlen_q && col < p.seqlen_k, partial);
                }
            }
        }
        if (Mask(p).needs_mask(c.row_base / kBlockM, n_block)) {
#pragma unroll
            for (int i = 0; i < kRows; ++i) {
                const int row = c.row_base + c.ty + i * kNY;
                int lo = 0, hi = 0;   // a window's bounds once per row (MaskPolicy::row_keys)
                if constexpr (Mask::kLocal) Mask(p).row_keys(row, lo, hi);
#pragma unroll
                for (int k = 0; k < kKeys; ++k) {
                    const int col = n0 + c.tx + k * kNX;
                    if constexpr (Mask::kLocal) {
                        if (col < lo || col > hi) acc_s[i][k] = -CUFLASH_INF;
                    } else {
                        if (!Mask(p).visible(row, col)) acc_s[i][k] = -CUFLASH_INF;
                    }
                }
            }
        }
        const int tid = c.ty * kNX + c.tx;
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
            float mx = -CUFLASH_INF;
#pragma unroll
            for (int k = 0; k < kKeys; ++k) mx = fmaxf(mx, acc_s[i][k]);
            mx = group_max<kNX>(mx) * p.scale_log2;
            const float old_max = sm.stat[(2 * i) * kThreads + tid];
            const float new_max = fmaxf(old_max, mx);
            // A row that has seen no visible key keeps max -inf; use 0 as the
            // reference so that exp2(-inf - ref) = 0 rather than NaN.
            const float ref = new_max == -CUFLASH_INF ? 0.f : new_max;
            const float rescale = exp2f(old_max - ref);
            float sum = 0.f;
            float* p_row = sm.p + (c.ty + i * kNY) * kPStride + c.tx;
#pragma unroll
            for (int k = 0; k < kKeys; ++k) {
                float pk = exp2f(fmaf(acc_s[i][k], p.scale_log2, -ref));
                sum += pk;
                if constexpr (Variant::kDropout) {
                    if (!Keep::keep(keep_flags(sm), c.ty + i * kNY, c.tx + k * kNX)) pk = 0.f;
                }
                p_row[k * kNX] = pk;
            }
            sm.stat[(2 * i) * kThreads + tid] = new_max;
            sm.stat[(2 * i + 1) * kThreads + tid] = fmaf(sm.stat[(2 * i + 1) * kThreads + tid], rescale, sum);
#pragma unroll
            for (int cc = 0; cc < kOChunks; ++cc)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_o[i][cc][e] *= rescale;
        }
        simt_cp_async_wait_all();
        __syncthreads();  // V_n landed and sP written; every thread is done reading K_n
        if constexpr (Variant::kBlockSparse) {   // the list's next tile
            if (position > 0) {
                const int n_next = tiles.tile(position - 1) * kBlockN;
                simt_load_tile<kBlockN, kHeadDim, kStride, kThreads>(
                    sm.k, kv_tile(p, p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride, c, n_next),
                    p.k_row_stride, p.seqlen_k - n_next, tid);
                simt_cp_async_commit();
            }
        } else if (has_next_key_tile(p, n_block)) {
            const int n_prev = n0 - kBlockN;
            simt_load_tile<kBlockN, kHeadDim, kStride, kThreads>(
                sm.k, kv_tile(p, p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride, c, n_prev), p.k_row_stride,
                p.seqlen_k - n_prev, tid);
            simt_cp_async_commit();
        }
    }

    // O += P V_n: four keys per step, P read as float4 per row. Chunks past head_dim (only in the last,
    // partial round of a row group) read a valid column instead and are never stored.
    static __device__ __forceinline__ void pv(const Smem& sm, float (&acc_o)[kRows][kOChunks][4]) {
        const Coords c = Coords::read();
        const float* p_ptr = sm.p + c.ty * kPStride;
        int v_col[kOChunks];
#pragma unroll
        for (int cc = 0; cc < kOChunks; ++cc) {
            const int chunk = c.tx + cc * kNX;
            v_col[cc] = 4 * (cc < kOChunksFull ? chunk : min(chunk, kChunks - 1));
        }
#pragma unroll kSimtUnrollJ
        for (int j = 0; j < kBlockN; j += 4) {
            float4 pv[kRows];
#pragma unroll
            for (int i = 0; i < kRows; ++i) pv[i] = *reinterpret_cast<const float4*>(p_ptr + i * kNY * kPStride + j);
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
                const float* v_row = sm.v + (j + jj) * kStride;
#pragma unroll
                for (int cc = 0; cc < kOChunks; ++cc) {
                    const float4 v = *reinterpret_cast<const float4*>(v_row + v_col[cc]);
#pragma unroll
                    for (int i = 0; i < kRows; ++i) {
                        const float pij = jj == 0 ? pv[i].x : jj == 1 ? pv[i].y : jj == 2 ? pv[i].z : pv[i].w;
                        acc_o[i][cc][0] = fmaf(pij, v.x, acc_o[i][cc][0]);
                        acc_o[i][cc][1] = fmaf(pij, v.y, acc_o[i][cc][1]);
                        acc_o[i][cc][2] = fmaf(pij, v.z, acc_o[i][cc][2]);
                        acc_o[i][cc][3] = fmaf(pij, v.w, acc_o[i][cc][3]);
                    }
                }
            }
        }
    }

    // Normalise and store straight from registers (a row group writes kNX consecutive 16-byte chunks of a
    // row), and lse. With a sink, its logit joins the denominator, all taken against max(row max, sink) so that
    // nothing overflows; a row with no visible key gets output 0 and lse = the sink. Dropout: 1 / (1 - p) with
    // 1 / rowsum.
    static __device__ __forceinline__ void epilogue(const FwdParams& p, const Smem& sm,
                                                    const float (&acc_o)[kRows][kOChunks][4], const ProgParams* pp) {
        const Coords c = Coords::read();
        const int tid = c.ty * kNX + c.tx;
        const int rows_valid = min(kBlockM, p.seqlen_q - c.row_base);
        float* gO = static_cast<float*>(p.o) + c.batch * p.o_batch_stride + c.head * p.o_head_stride
                    + c.row_base * p.o_row_stride;
        float* gLse = p.lse ? p.lse + stat_offset<Variant::kVarlen>(p, c.batch, c.head) + c.row_base : nullptr;
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
            const float sum = group_sum<kNX>(sm.stat[(2 * i + 1) * kThreads + tid]);
            const bool empty = !(sum > 0.f);
            float inv_sum, lse2;   // lse2: log2 domain of the scaled scores
            if constexpr (Mask::kHasSink) {
                const float row_max = sm.stat[(2 * i) * kThreads + tid];
                const float sink2 = sink_log2<Variant>(p, c.head);
                const float mx = fmaxf(row_max, sink2);
                const float keys = empty ? 0.f : exp2f(row_max - mx);
                const float total = fmaf(sum, keys, exp2f(sink2 - mx));
                inv_sum = keys / total;
                lse2 = mx + log2f(total);
            } else {
                inv_sum = empty ? 0.f : 1.f / sum;
            }
            if constexpr (Variant::kDropout) inv_sum *= pp->dropout_scale;
            const int row = c.ty + i * kNY;
            if (row < rows_valid) {
                float* o_row = gO + row * p.o_row_stride;
#pragma unroll
                for (int cc = 0; cc < kOChunks; ++cc) {
                    if (cc < kOChunksFull || c.tx + cc * kNX < kChunks) {
                        *reinterpret_cast<float4*>(o_row + 4 * (c.tx + cc * kNX)) =
                            make_float4(acc_o[i][cc][0] * inv_sum, acc_o[i][cc][1] * inv_sum,
                                        acc_o[i][cc][2] * inv_sum, acc_o[i][cc][3] * inv_sum);
                    }
                }
                if (gLse != nullptr && c.tx == 0) {
                    if constexpr (Mask::kHasSink) gLse[row] = lse2 * CUFLASH_LN2;
                    else gLse[row] = empty ? -CUFLASH_INF : (sm.stat[(2 * i) * kThreads + tid] + log2f(sum)) * CUFLASH_LN2;
                }
            }
        }
    }
};

// The kernel's dynamic shared memory (the dispatcher reads it from the compiled module).
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV = 0>
__device__ const int fwd_kernel_smem_bytes = SimtFwdTile<kHeadDim, kBlockM, kBlockN, kNWarps, kHeadDimV>::kSmemFloats * 4;

// One query tile of a dense problem (varlen: of one sequence, seq_params). pp: programmable attention's
// parameters (null unless Variant::kProg).
template <int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV>
__device__ __forceinline__ void fwd_tile(const FwdParams& p, const ProgParams* pp) {
    using Fwd = SimtFwd<kHeadDim, kBlockM, kBlockN, kNWarps, Variant, kHeadDimV>;
    extern __shared__ __align__(16) float smem_f32[];
    const typename Fwd::Smem sm(smem_f32);
    float acc_o[Fwd::kRows][Fwd::kOChunks][4];
#pragma unroll
    for (int i = 0; i < Fwd::kRows; ++i)
#pragma unroll
        for (int cc = 0; cc < Fwd::kOChunks; ++cc)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[i][cc][e] = 0.f;
    // The loop walks positions: without block sparsity a position is the key tile itself (the constant-folded
    // select below), with it the query tile's list gives the tile (Tiles).
    const typename Fwd::Tiles tiles = Fwd::key_tiles(p, pp);
    for (int position = Fwd::prologue(p, sm, tiles); Fwd::has_key_tile(p, position); --position) {
        const int n_block = Variant::kBlockSparse ? tiles.tile(position) : position;
        if constexpr (Variant::kDropout) Fwd::draw_keep(p, *pp, sm, n_block);
        float acc_s[Fwd::kRows][Fwd::kKeys];
        Fwd::scores(p, sm, n_block, acc_s);
        Fwd::softmax(p, sm, n_block, acc_s, acc_o, pp, tiles, position);
        Fwd::pv(sm, acc_o);
    }
    Fwd::epilogue(p, sm, acc_o, pp);
}

// The CTA's query tile (batch: the grid's z, also under varlen, whose batch strides are 0).
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV>
__device__ __forceinline__ void fwd_cta(const FwdParams& p, const ProgParams* pp) {
    static_assert(sizeof(T) == 4, "simt_fwd is the float32 kernel");
    if constexpr (Variant::kVarlen) {
        using Fwd = SimtFwd<kHeadDim, kBlockM, kBlockN, kNWarps, Variant, kHeadDimV>;
        const SeqSpan span = seq_span(p, blockIdx.z);
        if (Fwd::Coords::read().row_base >= span.seqlen_q) return;   // past this sequence's rows
        fwd_tile<kHeadDim, kBlockM, kBlockN, kNWarps, Variant, kHeadDimV>(seq_params<4>(p, span, blockIdx.z), pp);
    } else {
        fwd_tile<kHeadDim, kBlockM, kBlockN, kNWarps, Variant, kHeadDimV>(p, pp);
    }
}

template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV = 0>
__global__ void __launch_bounds__(kNWarps * 32)
fwd_kernel(const FwdParams p) {
    fwd_cta<T, kHeadDim, kBlockM, kBlockN, kNWarps, Variant, kHeadDimV>(p, nullptr);
}

// Programmable attention (Variant: a ProgVariant): the same with its parameters, and dropout's flags after the
// shared memory's statistics. At least one CTA per SM asked for, as the backward's (an occupancy target spilled).
template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV = 0>
__device__ const int fwd_prog_kernel_smem_bytes =
    fwd_kernel_smem_bytes<T, kHeadDim, kBlockM, kBlockN, kNWarps, Variant, kHeadDimV>
    + (Variant::kDropout ? DropoutTile<kBlockM, kBlockN>::kBytes : 0);

template <typename T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, class Variant, int kHeadDimV = 0>
__global__ void __launch_bounds__(kNWarps * 32, 1)
fwd_prog_kernel(const FwdParams p, const ProgParams pp) {
    static_assert(Variant::kProg, "fwd_prog_kernel takes a ProgVariant");
    fwd_cta<T, kHeadDim, kBlockM, kBlockN, kNWarps, Variant, kHeadDimV>(p, &pp);
}
