// Programmable attention's parts in the Hopper forward's consumer (issue #45; common/programmable.cuh): one
// warp's 16 rows of an S tile in the wgmma accumulator layout, which is mma.sync's, so that the portable kernels'
// parts serve as they are.
#pragma once
#include "../common/params.cuh"
#include "../common/programmable.cuh"

// For a plain variant: nothing (the key loop's calls sit behind `if constexpr (Variant::kProg)`).
template <bool kFirst, class A, class B> struct Select { using type = A; };
template <class A, class B> struct Select<false, A, B> { using type = B; };

template <class Variant, int kBlockN, bool kProg = Variant::kProg>
struct FwdProg {
    static constexpr bool kAhead = false;
    using BiasRegs = float[1][4];
    __device__ __forceinline__ FwdProg(const ProgParams*, int, int, int, int, int) {}
};

template <class Variant, int kBlockN>
struct FwdProg<Variant, kBlockN, true> {
    // A tile's bias / softmax_scale in this thread's accumulator elements, loaded ahead of S (read after S
    // landed, the loads' latency stalled every key tile); not beside a user modifier, whose registers with these
    // spilled (modify_score then adds the bias after S lands: kBiasByPolicy).
    static constexpr bool kPrefetchBias = Variant::kBias && !Variant::Mods::kScoreMod && !Variant::Mods::kMaskMod;
    // A 16-bit bias goes a whole key tile ahead: the next tile's raw pairs load while this one's are used (a
    // tile's Q K^T alone did not hide a load from DRAM); a float one as the tile's Q K^T runs, in floats.
    static constexpr bool kAhead = kPrefetchBias && !IsFloat<typename Variant::Bias>::value;
    using BiasRegs = typename Select<kAhead, u32[kBlockN / 8][2], float[kPrefetchBias ? kBlockN / 8 : 1][4]>::type;
    static constexpr int kBiasBy = kPrefetchBias ? kBiasByKernel : kBiasByPolicy;
    using Policy = ProgPolicy<Variant, kBiasBy>;

    const ProgParams& pp;
    int batch, head, heads, row0, g, t4;   // row0: the warp's first row; (g, t4): the lane
    __device__ __forceinline__ FwdProg(const ProgParams* pp_, int batch_, int head_, int heads_, int row0_, int lane)
        : pp(*pp_), batch(batch_), head(head_), heads(heads_), row0(row0_), g(lane >> 2), t4(lane & 3) {}

    // Key tile n_block's bias: kAhead, its raw pairs (call a tile before its scores); else the floats, as its
    // Q K^T runs. A lane's two columns of an n8 block are adjacent: one load for the pair where aligned
    // (ProgPolicy::bias_pairs); a bias broadcast over the queries (key padding) gives the lane's second row the
    // first one's values.
    __device__ __forceinline__ void load_bias(BiasRegs& b, const FwdParams& p, int n_block) const {
        if constexpr (kPrefetchBias) {
            const Policy prog(pp, batch, head, p.softmax_scale);
            const bool one_row = pp.bias_row_stride == 0, pairs = prog.bias_pairs();
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = row0 + g + 8 * h;
                const bool row_in = row < p.seqlen_q;
                if (h == 1 && one_row) {
#pragma unroll
                    for (int j = 0; j < kBlockN / 8; ++j) {
                        if constexpr (kAhead) {
                            b[j][1] = row_in ? b[j][0] : 0u;
                        } else {
                            b[j][2] = row_in ? b[j][0] : 0.f;
                            b[j][3] = row_in ? b[j][1] : 0.f;
                        }
                    }
                    continue;
                }
                const i64 row_at = prog.bias_row(row);
                if constexpr (kAhead) {
#pragma unroll
                    for (int j = 0; j < kBlockN / 8; ++j)
                        b[j][h] = prog.bias_pair_raw(row_at, n_block * kBlockN + 8 * j + 2 * t4, row_in, p.seqlen_k,
                                                     pairs);
                } else if (pairs) {
#pragma unroll
                    for (int j = 0; j < kBlockN / 8; ++j) {
                        const float2 v = prog.bias_pair(row_at, n_block * kBlockN + 8 * j + 2 * t4, row_in, p.seqlen_k);
                        b[j][2 * h] = v.x * prog.inv_scale;
                        b[j][2 * h + 1] = v.y * prog.inv_scale;
                    }
                } else {
#pragma unroll
                    for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
                        for (int e = 2 * h; e < 2 * h + 2; ++e) {
                            const int col = n_block * kBlockN + 8 * j + 2 * t4 + (e & 1);
                            b[j][e] = row_in && col < p.seqlen_k ? prog.bias(row_at, col) * prog.inv_scale : 0.f;
                        }
                }
            }
        }
    }
    static __device__ __forceinline__ void copy(BiasRegs& to, const BiasRegs& from) {
        constexpr int kWords = sizeof(BiasRegs) / 4;
#pragma unroll
        for (int i = 0; i < kWords; ++i) reinterpret_cast<u32*>(to)[i] = reinterpret_cast<const u32*>(from)[i];
    }
    // The bias (b: load_bias's) and the user's score modifier, then (a tile the block-sparse lists mark partial)
    // the elements an off block or the user's mask hides: on unscaled scores, before the built-in mask.
    __device__ __forceinline__ void scores(float (&s)[1][kBlockN / 8][4], const BiasRegs& b, const FwdParams& p,
                                           int n_block, bool partial) const {
        if constexpr (kAhead) {
            using T = typename Variant::Bias;
            const float inv_scale = 1.f / p.softmax_scale;
#pragma unroll
            for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const u32 two = b[j][e >> 1];
                    s[0][j][e] = fmaf(ElemTraits<T>::to_float(static_cast<u16>((e & 1) ? two >> 16 : two & 0xFFFFu)),
                                      inv_scale, s[0][j][e]);
                }
        } else if constexpr (kPrefetchBias) {
#pragma unroll
            for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[0][j][e] += b[j][e];
        }
        prog_scores<1, kBlockN / 8, Variant, kBiasBy>(s, pp, p, batch, head, row0, n_block * kBlockN, g, t4, partial);
    }
    // Dropout on the probabilities (their row sums taken: lse is the undropped one).
    __device__ __forceinline__ void dropout(float (&s)[1][kBlockN / 8][4], int n_block) const {
        if constexpr (Variant::kDropout)
            dropout_probs<1, kBlockN / 8>(s, DropoutLanes(pp, batch, heads, head), row0, n_block * kBlockN, g, t4);
    }
};
