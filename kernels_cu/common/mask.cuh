// The mask / score-modifier policy: the one place an attention pattern lives, on every family.
//
// A kernel takes a MaskVariant (which parts of the pattern are on: a type, part of its name and of the cache
// key) and builds its policy, MaskPolicy<kBlockM, kBlockN, Variant>, from its parameters wherever it asks a
// question (nothing held in registers across a loop). The policy says which key tiles a query tile visits
// ([n_block_min, n_block_max)) and, in the backward, which query tiles a key tile is visited by
// ([m_block_min, m_block_max)); whether a visited tile has hidden elements and which; how a visible score is
// modified before the softmax (with the derivative the backward multiplies dS by); and a row's sink logit.
// Kernels walk their own accumulator layouts and test each element of a masked tile against its row's key
// bounds (row_keys), its column's row bounds (col_rows) or visible(row, col).
//
// Rows and columns are local query / key indices (0 .. seqlen). Positions for windows, chunks and ALiBi are
// taken on the diagonal: query row i sits at key position i + diag, where diag = seqlen_k - seqlen_q (the
// bottom-right alignment of flash-attn >= 2.1) plus, for a step of ring attention, the shards' offsets
// (FwdParams.mask_diag); chunks are counted from absolute key position 0 (FwdParams.key_offset is the
// absolute position of local key 0).
//
// The score a modifier sees is s = softmax_scale * q.k (flash-attn's convention), modified in flash-attn's
// order: softcap, then ALiBi, then the masks. Kernels keep unscaled scores (the scale is folded into the
// exponential), so the policy converts: softcap_in = softmax_scale / softcap, softcap_out = softcap /
// softmax_scale, and ALiBi's slope is divided by softmax_scale.
#pragma once
#include "block_range.cuh"

// Which parts of the pattern a kernel is built with (each one off costs nothing: the code is not there).
//   kCausal   keys after the diagonal are hidden (window_right = 0);
//   kLocal    a sliding window [pos - window_left, pos + window_right] and/or chunks of attention_chunk keys
//             (run-time values: FwdParams.window_left / window_right / attention_chunk);
//   kSoftcap  s -> softcap * tanh(s / softcap);
//   kAlibi    s -> s - slope[batch, head] * |pos - key|;
//   kSink     a learned logit per head joins each row's softmax denominator (the epilogue's business);
//   kChunk    with kLocal, chunks are on: only then is there code for their divisions (a window alone keeps
//             its bounds to adds and compares, which keeps the backward's key loop small);
//   kVarlen   packed sequences of their own lengths (common/varlen.cuh): a kernel runs each sequence as a dense
//             problem of batch 1 whose params (lengths, pointers, diagonal) are the sequence's, so the policy
//             itself sees only seqlen_q / seqlen_k.
struct NoMods;   // common/programmable.cuh

template <bool kCausal_, bool kLocal_, bool kSoftcap_, bool kAlibi_, bool kSink_, bool kChunk_ = false,
          bool kVarlen_ = false>
struct MaskVariant {
    static constexpr bool kCausal = kCausal_, kLocal = kLocal_, kSoftcap = kSoftcap_, kAlibi = kAlibi_,
                          kSink = kSink_, kChunk = kLocal_ && kChunk_, kVarlen = kVarlen_;
    // Programmable attention's parts (common/programmable.cuh: ProgVariant derives from a MaskVariant): none.
    static constexpr bool kProg = false, kBias = false, kDropout = false, kBlockSparse = false;
    using Bias = void;
    using Mods = NoMods;
};
using PlainVariant = MaskVariant<false, false, false, false, false>;
using CausalVariant = MaskVariant<true, false, false, false, false>;

// tanh on the SFU (sm_75+).
__device__ __forceinline__ float tanh_approx(float x) {
    float r;
    asm("tanh.approx.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// floor(a / b) for b > 0 and any sign of a.
__device__ __forceinline__ int floor_div(int a, int b) {
    const int q = a / b;
    return (a % b != 0 && a < 0) ? q - 1 : q;
}

// kExactMath: the float32 family's precise tanh; the 16-bit families use tanh.approx (2^-11 relative, below
// their P's own rounding).
template <int kBlockM_, int kBlockN_, class Variant, bool kExactMath = false>
struct MaskPolicy {
    static constexpr bool kCausal = Variant::kCausal, kLocal = Variant::kLocal;
    static constexpr int kBlockM = kBlockM_, kBlockN = kBlockN_;
    // Traits the schedulers and tile choices ask (not the pattern's name): whether a query tile may skip key
    // tiles (and a key tile query tiles), and whether the work per query tile differs (heaviest first).
    static constexpr bool kSkipsTiles = kCausal || kLocal;
    static constexpr bool kUnevenWork = kCausal || kLocal;
    static constexpr bool kHasScoreMod = Variant::kSoftcap || Variant::kAlibi;
    static constexpr bool kHasSink = Variant::kSink;
    static constexpr bool kVarlen = Variant::kVarlen;
    using VariantType = Variant;
    using Range = BlockRange<kBlockM, kBlockN, kCausal>;

    int seqlen_q, seqlen_k;
    int diag;               // local key position of query row 0's diagonal
    int left, right;        // window bounds (kLocal; unbounded: a large value, set by the host)
    int chunk, key_offset;  // kLocal: chunks of `chunk` keys (0: none) counted from absolute key 0
    float softcap_in, softcap_out;
    float alibi_slope;      // this (batch, head)'s slope / softmax_scale (kAlibi)

    template <class Params>
    __device__ __forceinline__ void init(const Params& p, int seqlen_q_, int batch, int head) {
        seqlen_q = seqlen_q_;
        seqlen_k = p.seqlen_k;
        diag = (kLocal || Variant::kAlibi) ? p.mask_diag : seqlen_k - seqlen_q;
        if constexpr (kLocal) {
            left = p.window_left;
            right = p.window_right;
            chunk = p.attention_chunk;
            key_offset = p.key_offset;
        }
        if constexpr (Variant::kSoftcap) {
            softcap_in = p.softcap_in;
            softcap_out = p.softcap_out;
        }
        if constexpr (Variant::kAlibi) alibi_slope = p.alibi_slopes[batch * p.alibi_batch_stride + head] * p.alibi_scale;
    }
    // From a kernel's parameters (FwdParams, BwdParams), built where it is asked, so that the values are read
    // from the parameter bank at each use rather than held in registers across a loop. batch and head matter
    // to the score modifier only (ALiBi's slope).
    template <class Params>
    __device__ __forceinline__ explicit MaskPolicy(const Params& p, int batch = 0, int head = 0) {
        init(p, p.seqlen_q, batch, head);
    }
    // The same with seqlen_q given (the sm90 backward passes an opaque copy: see bwd.cu).
    template <class Params>
    __device__ __forceinline__ MaskPolicy(const Params& p, int seqlen_q_, int batch, int head) {
        init(p, seqlen_q_, batch, head);
    }

    // The last key a row sees (inclusive; may be past seqlen_k or negative) and the first (may be negative).
    __device__ __forceinline__ int key_hi(int row) const {
        const int pos = row + diag;
        int hi = pos + right;   // causal: right = 0
        if constexpr (kLocal) {
            if (Variant::kChunk && chunk > 0) hi = min(hi, (floor_div(pos + key_offset, chunk) + 1) * chunk - 1 - key_offset);
        }
        return hi;
    }
    __device__ __forceinline__ int key_lo(int row) const {
        const int pos = row + diag;
        int lo = pos - left;
        if (Variant::kChunk && chunk > 0) lo = max(lo, floor_div(pos + key_offset, chunk) * chunk - key_offset);
        return lo;
    }

    // Key tiles [n_block_min, n_block_max) that query tile m_block visits (none when max <= min).
    __device__ __forceinline__ int n_block_min(int m_block) const {
        if constexpr (!kLocal) {
            return 0;
        } else {
            const int lo = key_lo(m_block * kBlockM);   // key_lo grows with the row: the tile's first row
            return lo <= 0 ? 0 : lo / kBlockN;
        }
    }
    __device__ __forceinline__ int n_block_max(int m_block) const {
        if constexpr (!kLocal) {
            return Range::n_block_max(m_block, seqlen_q, seqlen_k);
        } else {
            const int hi = key_hi((m_block + 1) * kBlockM - 1);
            return min(ceil_div(seqlen_k, kBlockN), hi < 0 ? 0 : hi / kBlockN + 1);
        }
    }
    // Query tiles [m_block_min, m_block_max) that visit key tile n_block (the backward's dK / dV pass).
    __device__ __forceinline__ int m_block_min(int n_block) const {
        if constexpr (!kLocal) {
            return Range::m_block_min(n_block, seqlen_q, seqlen_k);
        } else {
            // The first row whose key_hi reaches the tile's first key c: pos + right >= c and, with chunks,
            // pos in c's chunk or later.
            const int c = n_block * kBlockN;
            int first_pos = c - right;
            if (Variant::kChunk && chunk > 0) first_pos = max(first_pos, floor_div(c + key_offset, chunk) * chunk - key_offset);
            const int first_row = first_pos - diag;
            return first_row <= 0 ? 0 : first_row / kBlockM;
        }
    }
    __device__ __forceinline__ int m_block_max(int n_block) const {
        const int all = ceil_div(seqlen_q, kBlockM);
        if constexpr (!kLocal) {
            return all;
        } else {
            // The last row whose key_lo is at most the tile's last key c: pos - left <= c and, with chunks,
            // pos in c's chunk or earlier.
            const int c = (n_block + 1) * kBlockN - 1;
            int last_pos = c + left;
            if (Variant::kChunk && chunk > 0) last_pos = min(last_pos, (floor_div(c + key_offset, chunk) + 1) * chunk - 1 - key_offset);
            const int last_row = last_pos - diag;
            return last_row < 0 ? 0 : min(all, last_row / kBlockM + 1);
        }
    }
    // Whether tile (m_block, n_block) has a hidden element: only those tiles test elements.
    __device__ __forceinline__ bool needs_mask(int m_block, int n_block) const {
        if constexpr (!kLocal) {
            return Range::needs_mask(m_block, n_block, seqlen_q, seqlen_k);
        } else {
            if ((n_block + 1) * kBlockN > seqlen_k) return true;
            // Every row sees the whole tile when its first row reaches the last key and its last row the first.
            return key_hi(m_block * kBlockM) < (n_block + 1) * kBlockN - 1
                   || key_lo((m_block + 1) * kBlockM - 1) > n_block * kBlockN;
        }
    }
    // The keys a row sees, [lo, hi] (none when hi < lo): visible(row, col) is lo <= col <= hi. For a kernel
    // that tests a row's elements one by one, so that the bounds (a division each, with chunks) are computed
    // once per row: per element, each in its own branch, the compiler does not merge them.
    __device__ __forceinline__ void row_keys(int row, int& lo, int& hi) const {
        if constexpr (!kLocal) {
            lo = 0;
            hi = kCausal ? min(seqlen_k - 1, row + seqlen_k - seqlen_q) : seqlen_k - 1;
        } else {
            lo = key_lo(row);
            hi = min(seqlen_k - 1, key_hi(row));
        }
    }
    // The rows that see key col, [lo, hi] (none when hi < lo): visible(row, col) is lo <= row <= hi. For a
    // kernel whose threads hold few key columns and many rows (the sm90 backward's S^T), so that an element's
    // test is two compares against its column's bounds and a select, with no branch.
    __device__ __forceinline__ void col_rows(int col, int& lo, int& hi) const {
        constexpr int kAll = 1 << 30;   // beyond any row
        lo = -kAll;
        hi = kAll;
        if constexpr (kLocal) {
            lo = col - diag - right;
            hi = col - diag + left;
            if (Variant::kChunk && chunk > 0) {
                const int start = floor_div(col + key_offset, chunk) * chunk - key_offset;   // col's chunk
                lo = max(lo, start - diag);
                hi = min(hi, start + chunk - 1 - diag);
            }
        } else if constexpr (kCausal) {
            lo = col - (seqlen_k - seqlen_q);
        }
        if (col >= seqlen_k) lo = kAll;
    }
    __device__ __forceinline__ bool visible(int row, int col) const {
        if constexpr (!kLocal) {
            return key_visible<kCausal>(row, col, seqlen_q, seqlen_k);
        } else {
            return col < seqlen_k && col <= key_hi(row) && col >= key_lo(row);
        }
    }

    // The score modifier on an unscaled score q.k, and its derivative d(modified) / d(score).
    __device__ __forceinline__ float modify_score(float s, int row, int col) const {
        if constexpr (Variant::kSoftcap) s = softcap_out * tanh_(s * softcap_in);
        if constexpr (Variant::kAlibi) s -= alibi_slope * static_cast<float>(abs(row + diag - col));
        return s;
    }
    __device__ __forceinline__ float score_derivative(float s, int /*row*/, int /*col*/) const {
        if constexpr (Variant::kSoftcap) {
            const float t = tanh_(s * softcap_in);
            return fmaf(-t, t, 1.f);
        } else {
            return 1.f;
        }
    }
    static __device__ __forceinline__ float tanh_(float x) {
        if constexpr (kExactMath) return tanhf(x);
        else return tanh_approx(x);
    }
};

// A row's sink logit in the log2 domain of the scaled scores (sinks are not multiplied by softmax_scale).
template <class Variant, class Params>
__device__ __forceinline__ float sink_log2(const Params& p, int head) {
    if constexpr (Variant::kSink) return p.sinks[head] * 1.4426950408889634f;
    else return -CUFLASH_INF;
}
