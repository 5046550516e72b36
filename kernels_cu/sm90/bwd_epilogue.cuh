// The sm90 backward's epilogue: dK * softmax_scale and dV of the CTA's key tile, through shared memory
// into full 16-byte global stores.
#pragma once
#include "bwd_mainloop.cuh"

// Written straight from the accumulators they would be 4-byte stores, each warp touching eight rows per
// instruction, and the CTA waits on them before its SM takes the next key tile. The K and V tiles are
// free once both warpgroups' last dQ products (which read all of K) are done: dK goes where K was, dV
// where V was, as [key][column] rows of kHeadDimPad elements with 16-byte chunk c of row r at chunk
// c ^ (r % 8) (no bank conflicts on either side).
template <typename Tag, class Tile>
struct BwdEpilogue {
    static constexpr int kBlockN = Tile::kBlockN, kPad = Tile::kHeadDimPad, kKvCols = Tile::kKvCols;
    static constexpr int kChunks = kPad / 8;   // 16-byte chunks per row
    static constexpr int kThreads = Tile::kConsumerWGs * 128;
    static_assert(kBlockN * kChunks % kThreads == 0, "whole rounds of 16-byte chunks");
    using KvAcc = float[kKvCols / 2];

    // 16-byte chunk `chunk` of row `row` of the staged tile at base.
    template <typename Char>
    static __device__ __forceinline__ Char* staged_chunk(Char* base, int row, int chunk) {
        return base + row * (kPad * 2) + ((chunk ^ (row % 8)) * 16);
    }
    // This thread's accumulator registers (rows key_local, key_local + 8) -> the staged tile at dst.
    static __device__ void stage_tile(const BwdSmem<Tile>& smem, const BwdConsumerThread<Tile>& thr,
                                      u32 dst, const KvAcc& acc, float scale) {
        char* base = smem.generic(dst);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = thr.key_local + 8 * h;
#pragma unroll
            for (int j = 0; j < kKvCols / 8; ++j) {
                const int chunk = Tile::kKvAtomPieces ? Tile::kv_chunk_col(thr.cw, j) / 8 : thr.kv_col0 / 8 + j;
                *reinterpret_cast<u32*>(staged_chunk(base, row, chunk) + 4 * thr.t4) =
                    ElemTraits<Tag>::pack2(acc[4 * j + 2 * h] * scale, acc[4 * j + 2 * h + 1] * scale);
            }
        }
    }
    // The staged tile at src -> rows n0 .. of dst (the rows and columns inside the tensor).
    static __device__ void store_tile(const BwdParams& p, const BwdSmem<Tile>& smem, int n0, int ctid,
                                      u32 src, u16* dst, i64 row_stride) {
        const char* base = smem.raw + (src - smem_u32(smem.raw));
#pragma unroll
        for (int it = 0; it < kBlockN * kChunks / kThreads; ++it) {
            const int idx = it * kThreads + ctid;
            const int row = idx / kChunks, chunk = idx % kChunks;
            if (n0 + row < p.seqlen_k && chunk * 8 < p.head_dim)
                *reinterpret_cast<uint4*>(dst + (n0 + row) * row_stride + chunk * 8) =
                    *reinterpret_cast<const uint4*>(base + row * (kPad * 2) + ((chunk ^ (row % 8)) * 16));
        }
    }

    static __device__ __forceinline__ void store(const BwdParams& p, const BwdSmem<Tile>& smem,
                                                 const BwdConsumerThread<Tile>& thr, const KvAcc& acc_dk,
                                                 const KvAcc& acc_dv, int n0, int head_kv, int batch) {
        if (threadIdx.x == 128) CUFLASH_BWD_TRACE(4, clock64());
        bwd_barrier_sync<Tile>(BwdBarrier::kEpilogue);
        stage_tile(smem, thr, smem.k, acc_dk, p.softmax_scale);
        stage_tile(smem, thr, smem.v, acc_dv, 1.f);
        bwd_barrier_sync<Tile>(BwdBarrier::kEpilogue);
        const int ctid = threadIdx.x - 128;   // this thread among the consumer warpgroups'
        store_tile(p, smem, n0, ctid, smem.k, static_cast<u16*>(p.dk) + batch * p.dk_batch_stride + head_kv * p.dk_head_stride,
                   p.dk_row_stride);
        store_tile(p, smem, n0, ctid, smem.v, static_cast<u16*>(p.dv) + batch * p.dv_batch_stride + head_kv * p.dv_head_stride,
                   p.dv_row_stride);
        if (threadIdx.x == 128) CUFLASH_BWD_TRACE(5, clock64());
    }
};
