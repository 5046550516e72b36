// The Hopper forward's epilogue: O normalised by the row sums, and lse.
//
// 16-bit O goes out through shared memory (kStageO): written straight from the accumulators it would be
// 4-byte stores, each warp touching eight rows per instruction, and the warps would wait on them before the
// next tile. The staging area is this warpgroup's rows of its Q buffer, which only its own (finished) Q K^T
// products read, in the same 128-byte swizzled row blocks. Persistent kernels send the staged rows out with
// one TMA store per warpgroup, issued by its first thread, so that the warpgroup goes on to the next tile at
// once; that thread releases the Q buffer once the store has read it (at the next tile's start with two Q
// buffers, at once with one). fp8 Q rows are too narrow for O's, so fp8 stores directly, and so do the
// persistent kernels above head dim 128 (the staging code spills the overlap one at 192 under the mask).
#pragma once
#include "../common/params.cuh"
#include "../common/softmax.cuh"
#include "tma.cuh"
#include "pipeline.cuh"
#include "fwd_tile.cuh"
#include "fwd_scheduler.cuh"

template <class Tile, int kQBuffers, bool kPersistent>
struct FwdEpilogue {
    using OutTag = typename ElemTraits<typename Tile::Tag>::OutTag;
    using Smem = FwdSharedStorage<Tile, kQBuffers>;
    static constexpr int kBlockM = Tile::kBlockM, kPadV = Tile::kHeadDimV, kHeadDim = Tile::kHeadDim;
    static constexpr bool kStageO = !Tile::kFp8 && !(kPersistent && kPadV > 128);
    static constexpr bool kTmaStoreO = kPersistent && kStageO;
    // Named barriers kStagedBarrier + cw, one per consumer warpgroup: its staged rows are complete (id 0 is
    // __syncthreads).
    static constexpr int kStagedBarrier = 1;

    const FwdParams& p;
    const Smem& smem;
    const TmaDesc* tma_o;
    const int cw;
    // Persistent with two Q buffers, O through a TMA store: whether this thread issued the last tile's store
    // and has not yet seen it read; its Q buffer is released to the producer once it has been. (A flag, not
    // the buffer's index: a predicate register, where the three-warpgroup tile has no general one to spare.)
    bool store_pending = false;

    // Persistent, at the start of the tile in Q buffer qb: the previous tile's O store (from the other
    // buffer) has read it by now, as a rule.
    __device__ __forceinline__ void release_previous_store(int qb) {
        if (store_pending) {
            bulk_wait_read();
            mbar_arrive(smem.q_empty(qb ^ 1));
            store_pending = false;
        }
    }
    // Every Q K^T of the tile is done: without staging, the producer may load the next Q into its buffer.
    __device__ __forceinline__ void q_buffer_read(int qb) const {
        if (kPersistent && !kStageO) mbar_arrive(smem.q_empty(qb));
    }

    // Stores this warpgroup's rows of O (acc_o / the row sums, times o_scale) and lse. `idle`: the
    // warpgroup has no rows (and did not wait for the Q load).
    template <class Softmax>
    __device__ __forceinline__ void store(const float (&acc_o)[kPadV / 2], Softmax& softmax, TileCoord c, int qb,
                                          bool idle, float o_scale, int row0) {
        const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3, g = lane >> 2, t4 = lane & 3;
        float inv_sum[2], lse[2];
        softmax.finalize(inv_sum, lse);
        inv_sum[0] *= o_scale;
        inv_sum[1] *= o_scale;
        u16* gO = static_cast<u16*>(p.o) + c.batch * p.o_batch_stride + c.head * p.o_head_stride;
        if constexpr (kStageO) {
            if (!idle) {
                char* sO = smem.generic(smem.q_buffer(qb) + cw * 64 * 128);
                // The warp's ldmatrix of these Q rows (Q in registers, or the kept max's recompute) read what
                // other lanes now overwrite.
                __syncwarp();
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = warp * 16 + g + 8 * h;
#pragma unroll
                    for (int j = 0; j < kPadV / 8; ++j)
                        *reinterpret_cast<u32*>(swizzle128(sO + (j / 8) * kBlockM * 128, r, j % 8) + 4 * t4) =
                            ElemTraits<OutTag>::pack2(acc_o[4 * j + 2 * h] * inv_sum[h], acc_o[4 * j + 2 * h + 1] * inv_sum[h]);
                }
                if constexpr (kTmaStoreO) {
                    fence_proxy_async_smem();   // the staged rows, visible to the TMA engine
                    named_barrier_sync(kStagedBarrier + cw, 128);
                    if ((threadIdx.x & 127) == 0) {
                        const u32 rows = smem.q_buffer(qb) + cw * 64 * 128;
#pragma unroll
                        for (int cb = 0; cb < kPadV / 64; ++cb)
                            tma_store_4d(tma_o, rows + cb * kBlockM * 128, cb * 64, c.m_block * kBlockM + cw * 64, c.head,
                                         c.batch);
                        bulk_commit_group();
                        if constexpr (kQBuffers == 2) {
                            store_pending = true;
                        } else {
                            bulk_wait_read();
                        }
                    }
                } else {
                    named_barrier_sync(kStagedBarrier + cw, 128);
                    store_staged(sO, gO, c.m_block * kBlockM + cw * 64);
                }
            }
            if (kPersistent && !store_pending) mbar_arrive(smem.q_empty(qb));
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + 8 * h;
            if (row < p.seqlen_q) {
                if constexpr (!kStageO) {
                    u16* o_row = gO + row * p.o_row_stride;
#pragma unroll
                    for (int j = 0; j < kPadV / 8; ++j) {
                        const int col = 8 * j + 2 * t4;
                        if (col < kHeadDim)
                            *reinterpret_cast<u32*>(o_row + col) = ElemTraits<OutTag>::pack2(
                                acc_o[4 * j + 2 * h] * inv_sum[h], acc_o[4 * j + 2 * h + 1] * inv_sum[h]);
                    }
                }
                if (p.lse != nullptr && t4 == 0)
                    p.lse[(static_cast<i64>(c.batch) * p.heads_q + c.head) * p.seqlen_q + row] = lse[h];
            }
        }
    }

    // One CTA per tile: the staged rows to global memory in 16-byte chunks (rows past seqlen_q and padded
    // columns skipped).
    __device__ __forceinline__ void store_staged(const char* sO, u16* gO, int row_base) const {
        constexpr int kChunks = kPadV / 8;   // 16-byte chunks of a row
#pragma unroll
        for (int k = 0; k < 64 * kChunks / 128; ++k) {
            const int idx = k * 128 + (threadIdx.x & 127);
            const int r = idx / kChunks, ch = idx % kChunks;
            if (row_base + r < p.seqlen_q && ch * 8 < kHeadDim)
                *reinterpret_cast<uint4*>(gO + (row_base + r) * p.o_row_stride + ch * 8) =
                    *reinterpret_cast<const uint4*>(swizzle128(sO + (ch / 8) * kBlockM * 128, r, ch % 8));
        }
    }
};
