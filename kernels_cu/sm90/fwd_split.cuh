// The Hopper forward's split-V schedule (kModeSplit), for head dims above 256: 64-row query tiles whose O
// (64 x 512 float32: 256 registers a thread in one warpgroup) is split by columns over two consumer
// warpgroups. Warpgroup 0 computes S = Q K^T (both operands from shared memory), the mask and the online
// softmax, then hands P (16-bit, 128-byte swizzled, the wgmma A layout) and each row's rescale factor to
// warpgroup 1 through shared memory, and computes O[:, :kVCols0] += P V with P from its registers; warpgroup
// 1 computes O[:, kVCols0:] += P V from the shared P. Two P buffers (where they fit: Tile::kPBuffers) let
// warpgroup 0 go on to the next key tile's S while warpgroup 1 still reads the last P. The K / V ring has two
// stages where they fit, else one (head dim 512: a 64 x 576 K tile alone is 72 KB): the producer refills a K slot
// once S has read it and a V slot once both warpgroups are done.
#pragma once
#include "../common/numeric.cuh"
#include "../common/params.cuh"
#include "../common/mask.cuh"
#include "../common/softmax.cuh"
#include "../common/smem.cuh"
#include "../common/varlen.cuh"
#include "wgmma.cuh"
#include "pipeline.cuh"
#include "fwd_tile.cuh"
#include "fwd_math.cuh"
#include "fwd_scheduler.cuh"

// Named barriers of the hand-offs (ids 4..6 are the other schedules' O staging; 256 threads each).
constexpr int kSplitPFullBarrier = 8;    // + buffer: warpgroup 0 has written P and the rescale factors
constexpr int kSplitPFreeBarrier = 10;   // + buffer: warpgroup 1 is done with them
constexpr int kSplitStatsBarrier = 12;   // warpgroup 0 has written the rows' inverse sums

// Split V's shared memory past the V slot (Tile::kExtraBytes): kPBuffers P buffers, then per consumer thread a
// rescale slot per P buffer and one inverse-sum slot, two floats each (the thread's rows g and g + 8;
// thread t of warpgroup 1 owns the rows of thread t of warpgroup 0).
template <class Tile>
struct SplitSlots {
    u32 p, rescale, inv_sum;
    __device__ __forceinline__ explicit SplitSlots(u32 extra)
        : p(extra), rescale(extra + Tile::kPBuffers * Tile::kPBytes),
          inv_sum(extra + Tile::kPBuffers * (Tile::kPBytes + 128 * 8)) {}
    __device__ __forceinline__ u32 p_buf(int b) const { return p + b * Tile::kPBytes; }
    __device__ __forceinline__ u32 rescale_slot(int b, int t) const { return rescale + (b * 128 + t) * 8; }
    __device__ __forceinline__ u32 inv_sum_slot(int t) const { return inv_sum + t * 8; }
};

// The parts both warpgroups use: O's rescale and its store, over kCols columns from col0.
template <class Tile>
struct SplitMath {
    using OutTag = typename ElemTraits<typename Tile::Tag>::OutTag;
    template <int kCols>
    static __device__ __forceinline__ void rescale_o(float (&acc_o)[kCols / 2], float r0, float r1) {
#pragma unroll
        for (int j = 0; j < kCols / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[4 * j + e] *= (e >> 1) ? r1 : r0;
    }
    // O += P V over V's columns [col0, col0 + kCols): P from registers (pa) or from shared memory (p_src).
    template <int kCols, bool kPInRegs>
    static __device__ __forceinline__ void issue_pv(float (&acc_o)[kCols / 2], const u32 (&pa)[Tile::kBlockN / 16][4],
                                                    u32 p_src, u32 v_src, int col0) {
        constexpr int kBlockN = Tile::kBlockN;
        const SmemDesc<> v_desc(v_src + (col0 / 64) * kBlockN * 128, kBlockN * 128, 1024);
        const SmemDesc<> p_desc(p_src, 16, 1024);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) {   // V, MN-major: 16 key rows per step
            if constexpr (kPInRegs)
                WgmmaRS<typename Tile::Tag, kCols>::template run<true>(acc_o, pa[kk], v_desc.at(kk * 16 * 128), 1);
            else
                WgmmaSS<typename Tile::Tag, kCols>::template run<true>(acc_o, p_desc.at(kk * 32),
                                                                       v_desc.at(kk * 16 * 128), 1);
        }
        wgmma_commit();
    }
    // O's columns [col0, col0 + kCols) of this thread's rows (row0, row0 + 8) normalised, those before the
    // output's head dim; rows past seqlen_q skipped.
    template <int kCols>
    static __device__ __forceinline__ void store_o(const FwdParams& p, const float (&acc_o)[kCols / 2],
                                                   const float (&inv_sum)[2], int col0, int row0, int t4, int head,
                                                   int batch) {
        u16* gO = static_cast<u16*>(p.o) + batch * p.o_batch_stride + head * p.o_head_stride;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + 8 * h;
            if (row < p.seqlen_q) {
                u16* o_row = gO + row * p.o_row_stride;
#pragma unroll
                for (int j = 0; j < kCols / 8; ++j) {
                    const int col = col0 + 8 * j + 2 * t4;
                    if (col < Tile::kHeadDimO)
                        *reinterpret_cast<u32*>(o_row + col) = ElemTraits<OutTag>::pack2(
                            acc_o[4 * j + 2 * h] * inv_sum[h], acc_o[4 * j + 2 * h + 1] * inv_sum[h]);
                }
            }
        }
    }
};

// Warpgroup 0: per key tile S, the mask, the softmax, P and the rescale factors out to warpgroup 1, then its
// columns of O. Returns after the epilogue (its O columns and lse).
template <class Tile, class Mask, class Variant>
__device__ __forceinline__ void split_softmax_warpgroup(const FwdParams& p, const FwdSmem<Tile, 1>& smem,
                                                        const SplitSlots<Tile>& slots, const FwdKeyTiles<Mask>& key_tiles,
                                                        int m_block, int head, int batch) {
    using Math = FwdMath<Tile, kModeSplit>;
    using Split = SplitMath<Tile>;
    using Tag = typename Tile::Tag;
    constexpr int kBlockN = Tile::kBlockN, kPSteps = Math::kPSteps, kCols = Tile::kVCols0;
    static_assert(!Math::kQInRegs, "split V: Q K^T reads Q from shared memory");
    const int tid = threadIdx.x & 127, lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
    const int g = lane >> 2, t4 = lane & 3;
    const int row0 = m_block * 64 + warp * 16 + g;
    // As the other schedules: the running max may trail by 2^8; fp16 takes 2^8 of headroom (fwd.cu).
    constexpr int kHeadroomLog2 = kIsBf16<Tag> ? 0 : 8;
    OnlineSoftmax<1, kBlockN / 8, 8, kHeadroomLog2> softmax;
    softmax.init();
    float acc_o[kCols / 2];
#pragma unroll
    for (int i = 0; i < kCols / 2; ++i) acc_o[i] = 0.f;
    const u32 qa_unused[1][4] = {};
    const int n_tiles = key_tiles.count();
    if (n_tiles > 0) mbar_wait(smem.q_full(0), 0);
    for (int i = 0; i < n_tiles; ++i) {
        const int n_block = key_tiles.tile(i);
        const PipelineState<Tile::kStages> ring(i);
        const int stage = ring.stage();
        const u32 parity = ring.phase();
        float acc_s[kBlockN / 2];
        mbar_wait(smem.k_full(stage), parity);
        Math::issue_qk(acc_s, smem.k + stage * Tile::kKSlotBytes, qa_unused, smem.q, 0, 0);
        wgmma_wait<0>();
        fence_operand(acc_s);
        mbar_arrive(smem.k_empty(stage));
        Math::template apply_mask<Mask>(acc_s, n_block, p, m_block, row0, t4, batch, head);
        float rescale[2];
        const bool moved = __any_sync(0xffffffff, softmax.step(Math::s3_of(acc_s), p.scale_log2, rescale));
        u32 pa[kPSteps][4];
        Math::pack_p(pa, acc_s);
        // P and the factors out to warpgroup 1, once it is done with this buffer's last ones.
        const int buf = i % Tile::kPBuffers;
        if (i >= Tile::kPBuffers) named_barrier_sync(kSplitPFreeBarrier + buf, 256);
        {
            const int q = lane >> 3, r = warp * 16 + (q & 1) * 8 + (lane & 7);
#pragma unroll
            for (int kk = 0; kk < kPSteps; ++kk)
                stmatrix_x4(slots.p_buf(buf) + swizzle128(r, 2 * kk + (q >> 1)), pa[kk][0], pa[kk][1], pa[kk][2],
                            pa[kk][3]);
        }
        st_shared_f2(slots.rescale_slot(buf, tid), rescale[0], rescale[1]);
        fence_proxy_async_smem();   // P, visible to warpgroup 1's wgmma
        named_barrier_arrive(kSplitPFullBarrier + buf, 256);
        if (moved) Split::template rescale_o<kCols>(acc_o, rescale[0], rescale[1]);
        mbar_wait(smem.v_full(stage), parity);
        Split::template issue_pv<kCols, true>(acc_o, pa, 0, smem.v + stage * Tile::kVSlotBytes, 0);
        wgmma_wait<0>();
        fence_operand(acc_o);
        mbar_arrive(smem.v_empty(stage));
    }
    float inv_sum[2], lse[2];
    softmax.template finalize<Mask::kHasSink>(inv_sum, lse, sink_log2<Variant>(p, head));
    st_shared_f2(slots.inv_sum_slot(tid), inv_sum[0], inv_sum[1]);
    named_barrier_arrive(kSplitStatsBarrier, 256);
    Split::template store_o<kCols>(p, acc_o, inv_sum, 0, row0, t4, head, batch);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = row0 + 8 * h;
        if (row < p.seqlen_q && p.lse != nullptr && t4 == 0)
            p.lse[stat_offset<Variant::kVarlen>(p, batch, head) + row] = lse[h];
    }
}

// Warpgroup 1: per key tile, the rescale factors and P from warpgroup 0, then its columns of O; then its
// epilogue with the inverse row sums from warpgroup 0.
template <class Tile, class Mask>
__device__ __forceinline__ void split_pv_warpgroup(const FwdParams& p, const FwdSmem<Tile, 1>& smem,
                                                   const SplitSlots<Tile>& slots, const FwdKeyTiles<Mask>& key_tiles,
                                                   int m_block, int head, int batch) {
    using Split = SplitMath<Tile>;
    constexpr int kCols = Tile::kVCols1;
    const int tid = threadIdx.x & 127, lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
    const int g = lane >> 2, t4 = lane & 3;
    const int row0 = m_block * 64 + warp * 16 + g;
    float acc_o[kCols / 2];
#pragma unroll
    for (int i = 0; i < kCols / 2; ++i) acc_o[i] = 0.f;
    const u32 pa_unused[Tile::kBlockN / 16][4] = {};
    const int n_tiles = key_tiles.count();
    for (int i = 0; i < n_tiles; ++i) {
        const int buf = i % Tile::kPBuffers;
        named_barrier_sync(kSplitPFullBarrier + buf, 256);
        float r0, r1;
        ld_shared_f2(slots.rescale_slot(buf, tid), r0, r1);
        if (__any_sync(0xffffffff, r0 != 1.f || r1 != 1.f)) Split::template rescale_o<kCols>(acc_o, r0, r1);
        const PipelineState<Tile::kStages> ring(i);
        mbar_wait(smem.v_full(ring.stage()), ring.phase());
        Split::template issue_pv<kCols, false>(acc_o, pa_unused, slots.p_buf(buf),
                                               smem.v + ring.stage() * Tile::kVSlotBytes, Tile::kVCols0);
        wgmma_wait<0>();
        fence_operand(acc_o);
        mbar_arrive(smem.v_empty(ring.stage()));
        // Warpgroup 0 waits for this buffer again only if it has a later tile for it.
        if (i + Tile::kPBuffers < n_tiles) named_barrier_arrive(kSplitPFreeBarrier + buf, 256);
    }
    named_barrier_sync(kSplitStatsBarrier, 256);
    float inv_sum[2];
    ld_shared_f2(slots.inv_sum_slot(tid), inv_sum[0], inv_sum[1]);
    Split::template store_o<kCols>(p, acc_o, inv_sum, Tile::kVCols0, row0, t4, head, batch);
}

// The consumers of one query tile (one CTA per tile): its coordinates, its sequence (varlen), its key tiles.
template <class Tile, class Variant>
__device__ __forceinline__ void fwd_split_consumer(const FwdParams& params, const FwdSmem<Tile, 1>& smem,
                                                   const PersistentOrder& order, const int cw) {
    using Mask = MaskPolicy<Tile::kBlockM, Tile::kBlockN, Variant>;
    int m_block, head, batch;
    order.template grid_coords<Mask::kUnevenWork>(params.heads_q, m_block, head, batch);
    FwdParams seq;
    if constexpr (Variant::kVarlen) {
        seq = seq_params<Tile::kElemBytes>(params, seq_span(params, batch), batch);
        batch = 0;
    }
    const FwdParams& p = Variant::kVarlen ? seq : params;
    const FwdKeyTiles<Mask> key_tiles(Mask(p), m_block);
    const SplitSlots<Tile> slots(smem.extra);
    if (cw == 0) split_softmax_warpgroup<Tile, Mask, Variant>(p, smem, slots, key_tiles, m_block, head, batch);
    else split_pv_warpgroup<Tile, Mask>(p, smem, slots, key_tiles, m_block, head, batch);
}
