// Programmable attention's kernel parts (issue #45; docs/design.md, "Programmable attention"): a bias added to
// the score, dropout, block-sparse tile lists and the user's modifiers, read from ProgParams (common/params.cuh),
// the second parameter of the kernels built with a ProgVariant. A plain MaskVariant has kProg false and none of
// this code.
#pragma once
#include "numeric.cuh"
#include "params.cuh"
#include "mask.cuh"
#include "philox.cuh"

template <class T> struct IsVoid { static constexpr bool value = false; };
template <> struct IsVoid<void> { static constexpr bool value = true; };
template <class T> struct IsFloat { static constexpr bool value = false; };
template <> struct IsFloat<float> { static constexpr bool value = true; };

// No user modifiers (cuflash/modifiers.py generates the struct that replaces it, with the same members).
struct NoMods {
    static constexpr bool kScoreMod = false, kScoreGrad = false, kTensorGrads = false, kMaskMod = false;
    __device__ __forceinline__ explicit NoMods(const ProgParams&) {}
};

// A MaskVariant (Base: the built-in pattern) with the programmable parts. BiasT: the bias's element type (float,
// f16_tag, bf16_tag), void for none. A type of its own, derived from the base, so that the plain kernels keep
// their names.
template <class Base, class BiasT, bool kDropout_, bool kBlockSparse_, class Mods_ = NoMods>
struct ProgVariant : Base {
    static constexpr bool kProg = true;
    using Bias = BiasT;
    static constexpr bool kBias = !IsVoid<BiasT>::value;
    static constexpr bool kDropout = kDropout_, kBlockSparse = kBlockSparse_;
    using Mods = Mods_;
};

template <class T> __device__ __forceinline__ float bias_to_float(const void* base, i64 at) {
    if constexpr (IsVoid<T>::value) {
        return 0.f;
    } else if constexpr (IsFloat<T>::value) {
        return static_cast<const float*>(base)[at];
    } else {
        return ElemTraits<T>::to_float(static_cast<const u16*>(base)[at]);
    }
}

// The score modifiers and the element tests of one (batch, head), built where asked (as MaskPolicy). Scores are
// the kernels' unscaled q.k after the built-in modifiers (MaskPolicy::modify_score); the user's modifier sees them
// scaled (FlexAttention's convention), so the policy multiplies by softmax_scale and divides back.
// Who adds a forward's bias (ProgPolicy's kBiasBy): the portable forward, into S's accumulators before Q K^T
// unless softcap comes between them (then modify_score); the kernel itself (the Hopper forward's prefetched
// bias); modify_score.
enum : int { kBiasFirstUnlessSoftcap = 0, kBiasByKernel = 1, kBiasByPolicy = 2 };

template <class Variant, int kBiasBy = kBiasFirstUnlessSoftcap>
struct ProgPolicy {
    using Mods = typename Variant::Mods;
    // Whether scores change (kernels then call modify_score on every visible element) and whether the tiles the
    // lists mark as partial have elements to test.
    static constexpr bool kBiasFirst = Variant::kBias && !Variant::kSoftcap;
    static constexpr bool kPolicyAddsBias =
        Variant::kBias && (kBiasBy == kBiasByPolicy || (kBiasBy == kBiasFirstUnlessSoftcap && !kBiasFirst));
    static constexpr bool kModifiesScore = kPolicyAddsBias || Mods::kScoreMod;
    static constexpr bool kTestsElements = Variant::kBlockSparse || Mods::kMaskMod;

    const ProgParams& pp;
    int batch, head;
    float scale, inv_scale;

    __device__ __forceinline__ ProgPolicy(const ProgParams& pp_, int batch_, int head_, float softmax_scale)
        : pp(pp_), batch(batch_), head(head_), scale(softmax_scale), inv_scale(1.f / softmax_scale) {}

    // The bias of row `row` starts at bias_row(row) (elements; computed once per row); its columns are 0 or 1
    // apart (the host's rule: a bias broadcast along the keys, or contiguous keys), so that a column's offset is a
    // 32-bit select rather than a 64-bit product per element.
    __device__ __forceinline__ i64 bias_row(int row) const {
        return batch * pp.bias_batch_stride + head * pp.bias_head_stride + row * pp.bias_row_stride;
    }
    __device__ __forceinline__ float bias(i64 row_at, int col) const {
        return bias_to_float<typename Variant::Bias>(pp.bias, row_at + (pp.bias_col_stride != 0 ? col : 0));
    }
    // Whether every lane's two adjacent columns (col even) can be read by one load: contiguous keys, and the
    // base and every row start aligned to the pair (uniform: checked once, the loads then branch-free).
    __device__ __forceinline__ bool bias_pairs() const {
        constexpr int kElemBytes = IsFloat<typename Variant::Bias>::value ? 4 : 2;
        return pp.bias_col_stride == 1 && (reinterpret_cast<unsigned long long>(pp.bias) & (2 * kElemBytes - 1)) == 0
               && ((pp.bias_batch_stride | pp.bias_head_stride | pp.bias_row_stride) & 1) == 0;
    }
    // The raw 16-bit values of columns col, col + 1 (col even; {col, col + 1} as lo, hi) of the row starting at
    // row_at, 0 outside the sequences: one 32-bit load where `pairs` (bias_pairs), else two. Predicated, no branches.
    __device__ __forceinline__ u32 bias_pair_raw(i64 row_at, int col, bool row_in, int seqlen_k, bool pairs) const {
        const bool both = row_in && col + 1 < seqlen_k, first = row_in && col < seqlen_k;
        const u16* at = static_cast<const u16*>(pp.bias) + row_at + (pp.bias_col_stride != 0 ? col : 0);
        if (pairs) return both ? *reinterpret_cast<const u32*>(at) : (first ? static_cast<u32>(at[0]) : 0u);
        const u32 lo = first ? at[0] : 0u;
        const u32 hi = both ? at[pp.bias_col_stride != 0 ? 1 : 0] : 0u;
        return lo | (hi << 16);
    }
    // Columns col, col + 1 of the row starting at row_at by one load (bias_pairs), 0 outside the sequences
    // (row_in: the row is inside); predicated loads, no branches, so that a tile's loads issue together.
    __device__ __forceinline__ float2 bias_pair(i64 row_at, int col, bool row_in, int seqlen_k) const {
        using T = typename Variant::Bias;
        const bool both = row_in && col + 1 < seqlen_k, first = row_in && col + 1 == seqlen_k;
        float2 v;
        if constexpr (IsFloat<T>::value) {
            const float* at = static_cast<const float*>(pp.bias) + row_at + col;
            v = both ? *reinterpret_cast<const float2*>(at) : make_float2(first ? at[0] : 0.f, 0.f);
        } else {
            const u16* at = static_cast<const u16*>(pp.bias) + row_at + col;
            const u32 two = both ? *reinterpret_cast<const u32*>(at) : (first ? static_cast<u32>(at[0]) : 0u);
            v.x = (both || first) ? ElemTraits<T>::to_float(static_cast<u16>(two & 0xFFFFu)) : 0.f;
            v.y = both ? ElemTraits<T>::to_float(static_cast<u16>(two >> 16)) : 0.f;
        }
        return v;
    }
    // The modified unscaled score of element (row, col), whose bias row starts at row_at (kBias).
    __device__ __forceinline__ float modify_score(float s, int row, int col, i64 row_at) const {
        if constexpr (kPolicyAddsBias) s = fmaf(bias(row_at, col), inv_scale, s);
        if constexpr (Mods::kScoreMod) s = Mods(pp).score_mod(s * scale, batch, head, row, col) * inv_scale;
        return s;
    }
    // An element of a tile the lists mark partial: the user's block covering it is on and the user's mask holds.
    __device__ __forceinline__ bool visible(int row, int col) const {
        bool on = true;
        if constexpr (Variant::kBlockSparse) {   // null: the lists are a MaskMod's alone
            if (pp.block_mask != nullptr)
                on = pp.block_mask[batch * pp.block_mask_batch_stride + head * pp.block_mask_head_stride
                               + (row / pp.block_q) * pp.block_mask_row_stride + col / pp.block_k] != 0;
        }
        if constexpr (Mods::kMaskMod) on = on && Mods(pp).mask_mod(batch, head, row, col);
        return on;
    }
};

// The key tiles a forward's query tile visits, by position: without block sparsity the position is the key tile
// itself (the kernel walks the mask policy's range, its loop the plain kernels' own); with it, position n of
// count() is the n-th last of the query tile's list entries within the policy's range [n_min, n_max), so that a
// loop from the last position down visits them last first. partial(n): an off block or the user's mask hides
// elements of that tile, to test with ProgPolicy::visible.
template <class Mask, class Variant, bool kSparse = Variant::kBlockSparse>
struct KeyTiles {
    template <class Params>
    __device__ __forceinline__ KeyTiles(const ProgParams*, int, int, int, const Params&) {}
    static __device__ __forceinline__ int count() { return 0; }
    static __device__ __forceinline__ int tile(int n) { return n; }
    static __device__ __forceinline__ bool partial(int) { return false; }
};

template <class Mask, class Variant>
struct KeyTiles<Mask, Variant, true> {
    const int* list;   // the entries within the range, last first
    int entries;
    template <class Params>
    __device__ __forceinline__ KeyTiles(const ProgParams* pp, int batch, int head, int m_block, const Params& p) {
        const int n_min = Mask::kLocal ? Mask(p).n_block_min(m_block) : 0;
        const int n_max = Mask(p).n_block_max(m_block);
        const i64 at = batch * pp->kv_tiles_batch_stride + head * pp->kv_tiles_head_stride + m_block;
        const int listed = pp->kv_tile_count[at];
        list = pp->kv_tile_index + at * pp->kv_tiles;
        int lo = 0;   // skip the entries at or past n_max, stop before n_min
        while (lo < listed && (list[lo] & 0x7FFFFFFF) >= n_max) ++lo;
        int hi = lo;
        while (hi < listed && (list[hi] & 0x7FFFFFFF) >= n_min) ++hi;
        list += lo;
        entries = hi - lo;
    }
    __device__ __forceinline__ int count() const { return entries; }
    __device__ __forceinline__ int tile(int n) const { return list[entries - 1 - n] & 0x7FFFFFFF; }
    __device__ __forceinline__ bool partial(int n) const { return list[entries - 1 - n] < 0; }
};

// The backward's state of tile (m_block, n_block) of (batch, head): 0 hidden, 1 elements to test, 2 shown whole
// (ProgParams.tile_state; none: 2).
__device__ __forceinline__ int prog_tile_state(const ProgParams& pp, int batch, int head, int m_block, int n_block) {
    if (pp.tile_state == nullptr) return 2;
    return pp.tile_state[batch * pp.tile_state_batch_stride + head * pp.tile_state_head_stride
                         + static_cast<i64>(m_block) * pp.kv_tiles + n_block];
}

// Dropout of one (batch, head): the keep flags of the 8 elements one lane holds of a 16 x 16 score block whose
// first row and column are row0 and col0 (multiples of 16), lane (g, c) = (lane / 4, lane % 4): bit slot s as
// common/philox.cuh numbers them (s = (e >> 1) * 4 + jb * 2 + (e & 1) for accumulator element e of the block's
// n8 tile jb).
struct DropoutLanes {
    DropoutStream stream;
    __device__ __forceinline__ DropoutLanes(const ProgParams& pp, int batch, int heads, int head)
        : stream(pp.rng_state ? pp.rng_state[0] : pp.seed, pp.rng_state ? pp.rng_state[1] : pp.offset,
                 static_cast<unsigned>(batch * heads + head), pp.dropout_threshold) {}
    __device__ __forceinline__ unsigned block_keep(int row0, int col0, int g, int c) const {
        return stream.unit_keep(static_cast<unsigned>((row0 >> 4) * 8 + g), static_cast<unsigned>((col0 >> 4) * 4 + c));
    }
    static __device__ __forceinline__ int slot(int jb, int e) { return (e >> 1) * 4 + jb * 2 + (e & 1); }

    // The transposed layout (S^T: keys as rows, a lane holding keys g, g + 8 and queries 2c, 2c + 1, 8 + 2c,
    // 9 + 2c of a 16 x 16 block whose first query and key are i0 and j0): its flags come from two units, one per
    // query parity e1; element (query half qh, key half h, parity e1) is bit t_slot(qh, h, g) of call e1.
    __device__ __forceinline__ unsigned block_keep_t(int i0, int j0, int g, int c, int e1) const {
        return stream.unit_keep(static_cast<unsigned>((i0 >> 4) * 8 + 2 * c + e1), static_cast<unsigned>((j0 >> 4) * 4 + (g >> 1)));
    }
    static __device__ __forceinline__ int t_slot(int qh, int h, int g) { return qh * 4 + h * 2 + (g & 1); }
};

// Dropout's keep flags of a kRows x kCols tile (queries x keys from row0, col0: multiples of 16) in shared memory,
// for kernels whose threads hold their elements in another layout than mma.sync's (the float32 kernels): one byte
// per Philox unit, its 8 flags as block_keep draws them, each unit drawn once by the CTA's threads together
// (fill), then any element's flag read at its unit and bit slot (keep; common/philox.cuh's row_unit, col_unit,
// slot of the local row and column, which a tile at multiples of 16 shares with the global ones).
template <int kRows, int kCols>
struct DropoutTile {
    static constexpr int kRowUnits = kRows / 2, kColUnits = kCols / 4;
    static constexpr int kBytes = kRowUnits * kColUnits;
    static_assert(kRows % 16 == 0 && kCols % 16 == 0, "a dropout tile is whole 16 x 16 blocks");

    template <int kThreads>
    static __device__ __forceinline__ void fill(unsigned char* flags, const DropoutLanes& lanes, int row0, int col0,
                                                int tid) {
#pragma unroll
        for (int k = 0; k < (kBytes + kThreads - 1) / kThreads; ++k) {
            const int unit = tid + k * kThreads;
            if (kBytes % kThreads == 0 || unit < kBytes) {
                const unsigned row_unit = static_cast<unsigned>((row0 >> 1) + unit / kColUnits);
                const unsigned col_unit = static_cast<unsigned>((col0 >> 2) + unit % kColUnits);
                flags[unit] = static_cast<unsigned char>(lanes.stream.unit_keep(row_unit, col_unit));
            }
        }
    }
    // Element (row0 + r, col0 + c)'s flag.
    static __device__ __forceinline__ bool keep(const unsigned char* flags, int r, int c) {
        const int unit = DropoutStream::row_unit(r) * kColUnits + DropoutStream::col_unit(c);
        return (flags[unit] >> DropoutStream::slot(r, c)) & 1u;
    }
};

// Programmable attention on one S sub-tile (the mma.sync / wgmma accumulator layout: kMTiles x kNTiles blocks of
// 16 x 8, lane (g, t4)) whose first row and key are row0 and col0: the bias and the user's score modifier on the
// elements inside the sequences, then, in a tile the lists mark partial, the elements the user's blocks or mask
// hide.
template <int kMTiles, int kNTiles, class Variant, int kBiasBy = kBiasFirstUnlessSoftcap>
__device__ __forceinline__ void prog_scores(float (&acc_s)[kMTiles][kNTiles][4], const ProgParams& pp,
                                            const FwdParams& p, int seq, int head, int row0, int col0, int g, int t4,
                                            bool partial) {
    using Prog = ProgPolicy<Variant, kBiasBy>;
    const Prog prog(pp, seq, head, p.softmax_scale);
    // One row at a time, so that only its bias offset is live next to the accumulators.
#pragma unroll
    for (int t = 0; t < kMTiles; ++t)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + t * 16 + g + h * 8;
            const i64 row_at = Prog::kPolicyAddsBias ? prog.bias_row(row) : 0;
#pragma unroll
            for (int n = 0; n < kNTiles; ++n)
#pragma unroll
                for (int e = 2 * h; e < 2 * h + 2; ++e) {
                    const int col = col0 + n * 8 + 2 * t4 + (e & 1);
                    const bool inside = row < p.seqlen_q && col < p.seqlen_k;   // a modifier reads memory by them
                    if constexpr (Prog::kModifiesScore) {
                        if (inside) acc_s[t][n][e] = prog.modify_score(acc_s[t][n][e], row, col, row_at);
                    }
                    if constexpr (Prog::kTestsElements) {
                        if (partial && !(inside && prog.visible(row, col))) acc_s[t][n][e] = -CUFLASH_INF;
                    }
                }
        }
}

// prog_scores at one element of another layout (the float32 kernels: a thread's own rows and keys): the bias and
// the user's score modifier where the element is inside the sequences (row_at: its bias row, ProgPolicy::bias_row),
// then in a tile the lists mark partial, -inf where the user's blocks or mask hide it.
template <class Prog>
__device__ __forceinline__ float prog_score_at(const Prog& prog, float s, int row, int col, i64 row_at, bool inside,
                                               bool partial) {
    if constexpr (Prog::kModifiesScore) {
        if (inside) s = prog.modify_score(s, row, col, row_at);
    }
    if constexpr (Prog::kTestsElements) {
        if (partial && !(inside && prog.visible(row, col))) s = -CUFLASH_INF;
    }
    return s;
}

// Dropout of one P sub-tile (probabilities in the S accumulators, first row and key row0 and col0): the dropped
// elements zeroed; 1 / (1 - dropout_p) is folded into the epilogue's 1 / rowsum.
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void dropout_probs(float (&acc_s)[kMTiles][kNTiles][4],
                                              const DropoutLanes& lanes, int row0, int col0, int g, int t4) {
#pragma unroll
    for (int t = 0; t < kMTiles; ++t)
#pragma unroll
        for (int nn = 0; nn < kNTiles / 2; ++nn) {
            const unsigned keep = lanes.block_keep(row0 + t * 16, col0 + nn * 16, g, t4);
#pragma unroll
            for (int jb = 0; jb < 2; ++jb)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (!((keep >> DropoutLanes::slot(jb, e)) & 1u)) acc_s[t][2 * nn + jb][e] = 0.f;
        }
}

// The backward's score at one element (query q, key k): the score after the built-in modifiers with the bias and
// the user's score modifier (ugrad: the latter's derivative), inside the sequences.
// (p: the kernel's parameters, for the sequences' lengths: read where used, as ints passed in they spilled the
// portable dQ kernel at d128.)
// bias_term: the element's bias / softmax_scale where the caller loaded it ahead (kBiasGiven), else read here.
template <bool kBiasGiven = false, class Variant, int kBiasBy, class Params>
__device__ __forceinline__ float prog_bwd_score(const ProgPolicy<Variant, kBiasBy>& prog, const Params& p,
                                                float s, int q, int k, float& ugrad, float bias_term = 0.f) {
    using Mods = typename Variant::Mods;
    if (q < p.seqlen_q && k < p.seqlen_k) {
        if constexpr (Variant::kBias) {
            if constexpr (kBiasGiven) s += bias_term;
            else s = fmaf(prog.bias(prog.bias_row(q), k), prog.inv_scale, s);
        }
        if constexpr (Mods::kScoreMod) {
            if constexpr (Mods::kScoreGrad) ugrad = Mods(prog.pp).score_grad(s * prog.scale, prog.batch, prog.head, q, k);
            s = Mods(prog.pp).score_mod(s * prog.scale, prog.batch, prog.head, q, k) * prog.inv_scale;
        }
    }
    return s;
}

// The backward's rest at one element (query q, key k; base: its score after the built-in modifiers; p_io its
// probability, the built-in masks applied; state: its tile's, prog_tile_state; keep: its dropout flag): the tile's
// hidden elements, dropout (p_io becomes the dropped probability that dV takes), the modifiers' tensor gradients
// and dbias (per element, or into row_sum where the bias is broadcast over the queries). Returns dS before the
// built-in modifiers' derivative.
template <class Variant, int kBiasBy>
__device__ __forceinline__ float prog_bwd_element(const ProgPolicy<Variant, kBiasBy>& prog, float base,
                                                  float ugrad, float& p_io, float dp, float delta, int state, int q,
                                                  int k, int seqlen_q, int seqlen_k, bool keep, float& row_sum) {
    using Mods = typename Variant::Mods;
    const ProgParams& pp = prog.pp;
    const bool inside = q < seqlen_q && k < seqlen_k;
    float pr = p_io;
    if constexpr (Variant::kBlockSparse) {
        if (state == 0 || (state == 1 && !(inside && prog.visible(q, k)))) pr = 0.f;
    }
    float dpd = dp, pd = pr;
    if constexpr (Variant::kDropout) {
        dpd = keep ? dp * pp.dropout_scale : 0.f;
        pd = keep ? pr * pp.dropout_scale : 0.f;
    }
    const float dscore = pr * (dpd - delta);   // the gradient of the modifier's output
    if constexpr (Mods::kTensorGrads) {
        if (inside && pr != 0.f) {
            float in = base;   // the modifier's input: the scaled score after the bias
            if constexpr (Variant::kBias) in = fmaf(prog.bias(prog.bias_row(q), k), prog.inv_scale, in);
            Mods(pp).tensor_grads(in * prog.scale, dscore, prog.batch, prog.head, q, k);
        }
    }
    const float ds = dscore * ugrad;           // of the score after the bias: dbias
    if constexpr (Variant::kBias) {
        if (inside) {
            if (pp.dbias_row_stride == 0) {
                row_sum += ds;
            } else {
                atomicAdd(pp.dbias_accum + prog.batch * pp.dbias_batch_stride + prog.head * pp.dbias_head_stride
                          + q * pp.dbias_row_stride + k * pp.dbias_col_stride, ds);
            }
        }
    }
    p_io = pd;
    return ds;
}
