// The Hopper forward's epilogue: O and lse.
#pragma once
#include "../common/params.cuh"
#include "../common/varlen.cuh"
#include "tma.cuh"
#include "pipeline.cuh"
#include "fwd_tile.cuh"

// The epilogue: O normalised by the row sums (16-bit: staged through this warpgroup's rows of its Q buffer,
// then a TMA store (persistent) or 16-byte stores; fp8 and wide persistent tiles: straight from the
// accumulators), and lse. `idle`: the warpgroup has no rows (and did not wait for the Q load). kVarlen: p is the
// sequence's (seq_params), whose rows end before the tile's may: no TMA store, which would write whole tiles.
template <class Tile, int kQBuffers, bool kPersistent, bool kVarlen>
__device__ __forceinline__ void fwd_epilogue(const FwdParams& p, const FwdSmem<Tile, kQBuffers>& smem, const TmaDesc* tma_o,
                                             const float (&acc_o)[Tile::kHeadDimV / 2], const float (&inv_sum)[2],
                                             const float (&lse)[2], int m_block, int head, int batch, int qb, int cw,
                                             bool idle, int row0, int& o_store_buffer) {
    using OutTag = typename ElemTraits<typename Tile::Tag>::OutTag;
    constexpr int kBlockM = Tile::kBlockM, kPadV = Tile::kHeadDimV, kHeadDim = Tile::kHeadDimO;
    // 16-bit O goes out through shared memory (kStageO): written straight from the accumulators it would be
    // 4-byte stores, each warp touching eight rows per instruction, and the warps wait on them before the next
    // tile. The staging area is this warpgroup's rows of its Q buffer, which only its own (finished) Q K^T
    // products read: the same 64-column blocks of 128-byte rows, 16-byte chunk c of row r at c ^ (r % 8).
    // fp8 Q rows are too narrow for O's: those store directly, and so do the persistent kernels above head
    // dim 128 (the staging code spills the overlap one at 192 under the causal mask) and an O wider than Q.
    constexpr bool kStageO = Tile::template kStageO<kPersistent>;
    // Persistent: staged O leaves through one TMA store per warpgroup, issued by its first thread, so that the
    // warpgroup goes on to the next tile at once; that thread releases the Q buffer once the store has read it,
    // at the next tile's start (two Q buffers: the producer is then loading the other one), or at once (one).
    constexpr bool kTmaStoreO = kPersistent && kStageO && !kVarlen;
    constexpr int kOStagedBarrier = 4;   // named barriers 4..6, one per consumer warpgroup: its staged rows are complete
    extern __shared__ char smem_raw[];
    const u32 sQ = smem.q;
    const int lane = threadIdx.x & 31;
    const int warp = (threadIdx.x >> 5) & 3;
    const int g = lane >> 2, t4 = lane & 3;
    u16* gO = static_cast<u16*>(p.o) + batch * p.o_batch_stride + head * p.o_head_stride;
    if constexpr (kStageO) {
        if (!idle) {   // an idle warpgroup has no rows to store (and did not wait for the Q load)
            char* sO = smem_raw + (sQ + qb * Tile::kQBytes + cw * 64 * 128 - smem_u32(smem_raw));
            // The warp's ldmatrix of these Q rows (kQInRegs, or the kept max's recompute) read what other
            // lanes now overwrite.
            __syncwarp();
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = warp * 16 + g + 8 * h;
#pragma unroll
                for (int j = 0; j < kPadV / 8; ++j)
                    *reinterpret_cast<u32*>(sO + (j / 8) * kBlockM * 128 + r * 128 + (((j % 8) ^ (r % 8)) * 16)
                                            + 4 * t4) =
                        ElemTraits<OutTag>::pack2(acc_o[4 * j + 2 * h] * inv_sum[h],
                                                  acc_o[4 * j + 2 * h + 1] * inv_sum[h]);
            }
            if constexpr (kTmaStoreO) {
                fence_proxy_async_smem();   // the staged rows, visible to the TMA engine
                named_barrier_sync(kOStagedBarrier + cw, 128);
                if ((threadIdx.x & 127) == 0) {
                    const u32 rows = sQ + qb * Tile::kQBytes + cw * 64 * 128;
#pragma unroll
                    for (int cb = 0; cb < kPadV / 64; ++cb)
                        tma_store_4d(tma_o, rows + cb * kBlockM * 128, cb * 64, m_block * kBlockM + cw * 64, head,
                                     batch);
                    bulk_commit_group();
                    if constexpr (kQBuffers == 2) {
                        o_store_buffer = qb;
                    } else {
                        bulk_wait_read();
                    }
                }
            } else {
            named_barrier_sync(kOStagedBarrier + cw, 128);
            constexpr int kChunks = kPadV / 8;   // 16-byte chunks of a row
            const int row_base = m_block * kBlockM + cw * 64;
#pragma unroll
            for (int k = 0; k < 64 * kChunks / 128; ++k) {
                const int idx = k * 128 + (threadIdx.x & 127);
                const int r = idx / kChunks, c = idx % kChunks;
                if (row_base + r < p.seqlen_q && c * 8 < kHeadDim)
                    *reinterpret_cast<uint4*>(gO + (row_base + r) * p.o_row_stride + c * 8) =
                        *reinterpret_cast<const uint4*>(sO + (c / 8) * kBlockM * 128 + r * 128
                                                        + (((c % 8) ^ (r % 8)) * 16));
            }
            }
        }
        if (kPersistent && o_store_buffer != qb) mbar_arrive(smem.q_empty(qb));
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
                p.lse[stat_offset<kVarlen>(p, batch, head) + row] = lse[h];
        }
    }
}
