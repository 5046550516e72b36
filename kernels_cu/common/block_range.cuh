// Which key tiles a query tile visits, and which of them need masking.
//
// Causal attention is aligned to the bottom-right corner: query row i sees
// keys j <= i + (seqlen_k - seqlen_q), as flash-attn >= 2.1 does.
#pragma once
#include "numeric.cuh"

template <int kBlockM, int kBlockN, bool kIsCausal>
struct BlockRange {
    // One past the last key tile that query tile m_block sees (0: it sees none).
    static __device__ __forceinline__ int n_block_max(int m_block, int seqlen_q, int seqlen_k) {
        int n_max = ceil_div(seqlen_k, kBlockN);
        if (kIsCausal) {
            const int last_key = (m_block + 1) * kBlockM - 1 + seqlen_k - seqlen_q;  // inclusive
            n_max = min(n_max, last_key < 0 ? 0 : last_key / kBlockN + 1);
        }
        return n_max;
    }
    // First key tile that query tile n_block sees (for the dK/dV pass: key
    // tile n_block is seen by query rows i >= j - (seqlen_k - seqlen_q)).
    static __device__ __forceinline__ int m_block_min(int n_block, int seqlen_q, int seqlen_k) {
        if (!kIsCausal) return 0;
        const int first_row = n_block * kBlockN - (seqlen_k - seqlen_q);
        return first_row <= 0 ? 0 : first_row / kBlockM;
    }
    // Whether tile (m_block, n_block) has any masked element among valid rows.
    static __device__ __forceinline__ bool needs_mask(int m_block, int n_block, int seqlen_q, int seqlen_k) {
        if ((n_block + 1) * kBlockN > seqlen_k) return true;
        if (kIsCausal) {
            // The tile's top row sees keys <= m_block*kBlockM + seqlen_k - seqlen_q.
            return (n_block + 1) * kBlockN - 1 > m_block * kBlockM + seqlen_k - seqlen_q;
        }
        return false;
    }
};

// Whether key column `col` is visible from query row `row`.
template <bool kIsCausal>
__device__ __forceinline__ bool key_visible(int row, int col, int seqlen_q, int seqlen_k) {
    return col < seqlen_k && (!kIsCausal || col <= row + seqlen_k - seqlen_q);
}
