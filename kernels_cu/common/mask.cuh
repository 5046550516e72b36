// The mask / score-modifier policy: what a kernel asks about the attention pattern, on every family.
//
// A kernel's mainloop asks its policy which key tiles a query tile visits (and, in the backward,
// which query tiles a key tile is visited by), whether a visited tile has masked elements, which
// elements those are, and how a visible score is modified before the softmax (with the derivative
// the backward multiplies dS by). Each kernel walks its own accumulator layout and calls
// `visible(row, col)` per element, so a new pattern (a sliding window, sinks, block sparsity) or
// score modifier (softcap, ALiBi) is a new policy type with the same members, plus its tests; the
// kernels take the policy as a template argument.
//
// Rows and columns are global query / key indices; scores are q . k before the softmax scale.
#pragma once
#include "block_range.cuh"

// No mask, or the causal mask aligned to the bottom-right corner (query row i sees keys
// j <= i + seqlen_k - seqlen_q, as flash-attn >= 2.1); keys past seqlen_k are masked either way.
template <int kBlockM, int kBlockN, bool kIsCausal>
struct CausalMask {
    using Range = BlockRange<kBlockM, kBlockN, kIsCausal>;
    static constexpr bool kHasScoreMod = false;   // scores pass unchanged: no modifier, no derivative
    int seqlen_q, seqlen_k;

    __device__ __forceinline__ CausalMask(int seqlen_q_, int seqlen_k_) : seqlen_q(seqlen_q_), seqlen_k(seqlen_k_) {}
    // From a kernel's parameters (FwdParams, BwdParams): built where it is asked, so that the lengths are
    // read from the parameter bank at each use rather than held in registers across the key loop.
    template <class Params>
    __device__ __forceinline__ explicit CausalMask(const Params& p) : seqlen_q(p.seqlen_q), seqlen_k(p.seqlen_k) {}
    // Key tiles [n_block_min, n_block_max) that query tile m_block visits (none when max <= min).
    __device__ __forceinline__ int n_block_min(int /*m_block*/) const { return 0; }
    __device__ __forceinline__ int n_block_max(int m_block) const { return Range::n_block_max(m_block, seqlen_q, seqlen_k); }
    // The first query tile that visits key tile n_block (the backward's dK / dV pass).
    __device__ __forceinline__ int m_block_min(int n_block) const { return Range::m_block_min(n_block, seqlen_q, seqlen_k); }
    // Whether tile (m_block, n_block) has a masked element: only those tiles test elements.
    __device__ __forceinline__ bool needs_mask(int m_block, int n_block) const {
        return Range::needs_mask(m_block, n_block, seqlen_q, seqlen_k);
    }
    __device__ __forceinline__ bool visible(int row, int col) const { return key_visible<kIsCausal>(row, col, seqlen_q, seqlen_k); }
    // The score modifier and its derivative d(modified) / d(score) (identity here).
    __device__ __forceinline__ float modify_score(float s, int /*row*/, int /*col*/) const { return s; }
    __device__ __forceinline__ float score_derivative(float /*s*/, int /*row*/, int /*col*/) const { return 1.f; }
};
