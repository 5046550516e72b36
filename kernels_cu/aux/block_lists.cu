// The block-sparse key-tile lists of a programmable call in one launch (the host built them with a few dozen array
// operations, most of a block-sparse call's time at N = 4096): one CTA per (batch, head, query tile). Each key
// tile's coverage is read from the user's blocks it overlaps (some on: visited; all on: untested) and the mask
// modifier's tile state; the visited ones are written last first, with bit 31 where elements are to be tested, as
// cuflash/block_sparse.py's key_tile_lists orders them (entries past the count are not written).
#include "../common/numeric.cuh"
#include "../common/params.cuh"

template <int kNWarps>
__global__ void __launch_bounds__(kNWarps * 32)
block_lists_kernel(const BlockListsParams t) {
    constexpr int kThreads = kNWarps * 32;
    __shared__ int warp_counts[kNWarps];
    const int m = blockIdx.x, head = blockIdx.y % t.heads, batch = blockIdx.y / t.heads;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const i64 row = (static_cast<i64>(blockIdx.y) * t.m_tiles + m);
    int* out = t.index + row * t.n_tiles;
    // The user's query blocks this tile overlaps (rows past seqlen_q not counted).
    const int r0 = m * t.block_m / t.block_q;
    const int r1 = (min((m + 1) * t.block_m, t.seqlen_q) - 1) / t.block_q + 1;
    int base = 0;   // entries written so far
    for (int j0 = 0; j0 < t.n_tiles; j0 += kThreads) {
        const int j = j0 + static_cast<int>(threadIdx.x);   // position in the last-first order
        bool any = false, all = false;
        if (j < t.n_tiles) {
            const int n = t.n_tiles - 1 - j;
            any = true;
            all = true;
            if (t.block_mask != nullptr) {
                const int c0 = n * t.block_n / t.block_k;
                const int c1 = (min((n + 1) * t.block_n, t.seqlen_k) - 1) / t.block_k + 1;
                const unsigned char* blocks = t.block_mask + batch * t.mask_batch_stride + head * t.mask_head_stride;
                bool some = false, every = true;
                for (int r = r0; r < r1; ++r)
                    for (int c = c0; c < c1; ++c) {
                        const bool on = blocks[r * t.mask_row_stride + c] != 0;
                        some |= on;
                        every &= on;
                    }
                any = some;
                all = every;
            }
            if (t.state != nullptr) {
                const int s = t.state[batch * t.state_batch_stride + head * t.state_head_stride
                                      + static_cast<i64>(m) * t.n_tiles + n];
                any = any && s >= 1;
                all = all && s == 2;
            }
            all = all && any;
        }
        // Each visited tile's place: the visited ones before it in this chunk (ballots, then the warps' counts).
        const unsigned ballot = __ballot_sync(0xffffffffu, any);
        if (lane == 0) warp_counts[warp] = __popc(ballot);
        __syncthreads();
        int before = base + __popc(ballot & ((1u << lane) - 1u));
        int chunk = 0;
        for (int w = 0; w < kNWarps; ++w) {
            if (w < warp) before += warp_counts[w];
            chunk += warp_counts[w];
        }
        if (any) out[before] = (t.n_tiles - 1 - j) | (all ? 0 : static_cast<int>(0x80000000u));
        base += chunk;
        __syncthreads();   // warp_counts is rewritten by the next chunk
    }
    if (threadIdx.x == 0) t.count[row] = base;
}
