// Programmable attention's parts in the Hopper forward's consumer (issue #45; common/programmable.cuh): one
// warp's 16 rows of an S tile in the wgmma accumulator layout, which is mma.sync's, so that the portable kernels'
// parts serve as they are.
#pragma once
#include "../common/params.cuh"
#include "../common/programmable.cuh"

// For a plain variant: nothing (the key loop's calls sit behind `if constexpr (Variant::kProg)`).
template <class Variant, int kBlockN, bool kProg = Variant::kProg>
struct FwdProg {
    __device__ __forceinline__ FwdProg(const ProgParams*, int, int, int, int, int) {}
};

template <class Variant, int kBlockN>
struct FwdProg<Variant, kBlockN, true> {
    const ProgParams& pp;
    int batch, head, heads, row0, g, t4;   // row0: the warp's first row; (g, t4): the lane
    __device__ __forceinline__ FwdProg(const ProgParams* pp_, int batch_, int head_, int heads_, int row0_, int lane)
        : pp(*pp_), batch(batch_), head(head_), heads(heads_), row0(row0_), g(lane >> 2), t4(lane & 3) {}
    // The bias (added here, not before Q K^T as the portable kernel does: ProgPolicy::kBiasFirst) and the user's
    // score modifier, then (a tile the block-sparse lists mark partial) the elements an off block or the user's
    // mask hides: on unscaled scores, before the built-in mask.
    __device__ __forceinline__ void scores(float (&s)[1][kBlockN / 8][4], const FwdParams& p, int n_block,
                                           bool partial) const {
        prog_scores<1, kBlockN / 8, Variant, false>(s, pp, p, batch, head, row0, n_block * kBlockN, g, t4, partial);
    }
    // Dropout on the probabilities (their row sums taken: lse is the undropped one).
    __device__ __forceinline__ void dropout(float (&s)[1][kBlockN / 8][4], int n_block) const {
        if constexpr (Variant::kDropout)
            dropout_probs<1, kBlockN / 8>(s, DropoutLanes(pp, batch, heads, head), row0, n_block * kBlockN, g, t4);
    }
};
