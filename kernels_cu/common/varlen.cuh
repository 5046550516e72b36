// Packed (varlen) batches: where sequence b lies in the packed arrays, and its params as a dense problem.
//
// A kernel built with MaskVariant::kVarlen reads sequence b's rows and lengths from cu_seqlens / seqused
// (FwdParams / BwdParams, CUFLASH_VARLEN_PARAMS), then runs it as a dense problem of batch 1: seq_params gives
// params whose pointers start at the sequence's first row, whose seqlen_q / seqlen_k are its lengths and
// whose mask diagonal is its own (bottom-right alignment per sequence), and the kernel passes batch 0 from
// there on (batch strides and ALiBi's batch row are folded into the pointers). So the mask policy, the tile
// loops and the loads need nothing of their own for varlen; what differs is the layout of the per-row
// statistics (lse, delta: (heads_q, total_q) rows, stat_offset) and of the float32 dQ sums.
//
// Offsets are clamped here, before any address is formed (cuflash/varlen.py states the contract): a bad
// offset or seqused gives wrong results for its sequence, never a read or a write outside the arrays.
#pragma once
#include "numeric.cuh"
#include "params.cuh"

// Sequence b's rows: q rows [q_start, q_start + seqlen_q), k / v rows [k_start, k_start + seqlen_k).
struct SeqSpan {
    int q_start, k_start, seqlen_q, seqlen_k;
};

// start = clamp(cu[b], 0, total), end = clamp(cu[b + 1], start, total), len = min(end - start, max_len),
// and with seqused, len = clamp(used[b], 0, len).
__device__ __forceinline__ void packed_rows(const int* cu, const int* used, int b, int total, int max_len, int& start,
                                            int& len) {
    start = min(max(cu[b], 0), total);
    const int end = min(max(cu[b + 1], start), total);
    len = min(end - start, max_len);
    if (used != nullptr) len = min(max(used[b], 0), len);
}

template <class Params>
__device__ __forceinline__ SeqSpan seq_span(const Params& p, int batch) {
    SeqSpan s;
    packed_rows(p.cu_seqlens_q, p.seqused_q, batch, p.total_q, p.seqlen_q, s.q_start, s.seqlen_q);
    packed_rows(p.cu_seqlens_k, p.seqused_k, batch, p.total_k, p.seqlen_k, s.k_start, s.seqlen_k);
    return s;
}

template <int kElemBytes>
__device__ __forceinline__ const void* rows_from(const void* x, i64 row_stride, int row) {
    return static_cast<const char*>(x) + static_cast<i64>(row) * row_stride * kElemBytes;
}
template <int kElemBytes>
__device__ __forceinline__ void* rows_from(void* x, i64 row_stride, int row) {
    return static_cast<char*>(x) + static_cast<i64>(row) * row_stride * kElemBytes;
}

// The mask policy's fields of one sequence: its own diagonal (seqlen_k - seqlen_q; varlen takes no ring
// offsets) and ALiBi's row of slopes.
template <class Params>
__device__ __forceinline__ void bind_mask(Params& s, const SeqSpan& span, int batch) {
    s.seqlen_q = span.seqlen_q;
    s.seqlen_k = span.seqlen_k;
    s.mask_diag = span.seqlen_k - span.seqlen_q;
    if (s.alibi_slopes != nullptr) s.alibi_slopes += static_cast<i64>(batch) * s.alibi_batch_stride;
    s.alibi_batch_stride = 0;   // whatever batch index the kernel passes on
}

// The fields both params have: q, k, v and o at the sequence's first rows, lse at its first of each head's row,
// the mask's lengths and diagonal. kElemBytes: the bytes of an element of q, k, v and o.
template <int kElemBytes, class Params>
__device__ __forceinline__ void bind_common(Params& s, const SeqSpan& span, int batch) {
    s.q = rows_from<kElemBytes>(s.q, s.q_row_stride, span.q_start);
    s.k = rows_from<kElemBytes>(s.k, s.k_row_stride, span.k_start);
    s.v = rows_from<kElemBytes>(s.v, s.v_row_stride, span.k_start);
    s.o = rows_from<kElemBytes>(s.o, s.o_row_stride, span.q_start);
    if (s.lse != nullptr) s.lse += span.q_start;
    bind_mask(s, span, batch);
}

// Sequence `batch` of a varlen forward as a dense problem of batch 1 (the kernel then passes batch 0).
template <int kElemBytes>
__device__ __forceinline__ FwdParams seq_params(const FwdParams& p, const SeqSpan& span, int batch) {
    FwdParams s = p;
    bind_common<kElemBytes>(s, span, batch);
    return s;
}

// The same for the backward: the gradients and dO at the sequence's rows, lse and delta at its first row of
// each head's (heads_q, total_q) row, the row-major float32 dQ sums (dq_accum_rows = total_q) likewise.
template <int kElemBytes>
__device__ __forceinline__ BwdParams seq_params(const BwdParams& p, const SeqSpan& span, int batch) {
    BwdParams s = p;
    bind_common<kElemBytes>(s, span, batch);
    s.dout = rows_from<kElemBytes>(p.dout, p.do_row_stride, span.q_start);
    s.dq = rows_from<kElemBytes>(p.dq, p.dq_row_stride, span.q_start);
    s.dk = rows_from<kElemBytes>(p.dk, p.dk_row_stride, span.k_start);
    s.dv = rows_from<kElemBytes>(p.dv, p.dv_row_stride, span.k_start);
    if (p.delta != nullptr) s.delta = p.delta + span.q_start;
    if (p.dlse != nullptr) s.dlse = p.dlse + span.q_start;
    if (p.dq_accum != nullptr) s.dq_accum = p.dq_accum + static_cast<i64>(span.q_start) * p.dq_accum_cols;
    return s;
}

// Where head `head` of batch `batch` starts in lse / delta (and, times the columns, in the row-major dQ sums):
// dense (batch, heads_q, seqlen_q); varlen (heads_q, total_q), the pointers already at the sequence's row
// (seq_params). (The host passes batch strides of 0 with varlen, so a kernel may go on indexing by its batch.)
template <bool kVarlen, class Params>
__device__ __forceinline__ i64 stat_offset(const Params& p, int batch, int head) {
    if constexpr (kVarlen) return static_cast<i64>(head) * p.total_q;
    else return (static_cast<i64>(batch) * p.heads_q + head) * p.seqlen_q;
}

// A kernel's body on its CTA's problem: with kVarlen, the params of sequence blockIdx.z (seq_params), unless the
// CTA's tile starts at or past that sequence's end (tile_start: its first query row, kQueryTiles, or key), where it
// leaves at once (the grid covers the longest sequence); else p itself. kShared: the sequence's params in static
// shared memory, read where used (a kernel whose registers are all taken: held in registers, they spill).
template <bool kVarlen, int kElemBytes, bool kQueryTiles, bool kShared = false, class Params, class Body>
__device__ __forceinline__ void on_cta_sequence(const Params& p, int tile_start, Body&& body) {
    if constexpr (kVarlen && kShared) {
        __shared__ Params bound;
        if (threadIdx.x == 0) bound = seq_params<kElemBytes>(p, seq_span(p, blockIdx.z), blockIdx.z);
        __syncthreads();
        if (tile_start >= (kQueryTiles ? bound.seqlen_q : bound.seqlen_k)) return;
        body(bound);
    } else if constexpr (kVarlen) {
        const SeqSpan span = seq_span(p, blockIdx.z);
        if (tile_start >= (kQueryTiles ? span.seqlen_q : span.seqlen_k)) return;
        body(seq_params<kElemBytes>(p, span, blockIdx.z));
    } else {
        body(p);
    }
}

// The sm90 backward's per-sequence rows of the stats (lse2, delta) and of the dQ tiles: sequence b's query tiles
// start at padded row (start / tile_rows + b) * tile_rows, start its clamped first row (packed_rows), so that
// every sequence's tiles are whole and apart (cuflash/sm90.py: varlen_padded_rows allocates total_q + batch *
// tile_rows rows, rounded up to a tile).
__device__ __forceinline__ int padded_row0(int q_start, int batch, int tile_rows) {
    return (q_start / tile_rows + batch) * tile_rows;
}

// The sm90 ordered (deterministic) backward adds each dQ tile's slices in a fixed order, each key tile waiting
// for its turn on the tile's semaphore. Sequences' padded tiles are apart only while the clamped q offsets never
// decrease; unchecked offsets that do could give two sequences one tile and so a turn nobody takes, a hang. The
// preprocess flags a decrease (one pair per sequence, CTAs of row tile 0 and head 0), and the dK/dV kernel,
// which runs after it on the stream, then does nothing: wrong gradients, as any bad offset gives, never a hang.
__device__ __forceinline__ void flag_decreasing_offsets(const BwdParams& p, int batch) {
    if (p.offsets_bad == nullptr || blockIdx.x != 0 || blockIdx.y != 0 || threadIdx.x != 0) return;
    const int start = min(max(p.cu_seqlens_q[batch], 0), p.total_q);
    const int next = min(max(p.cu_seqlens_q[batch + 1], 0), p.total_q);
    if (next < start) *p.offsets_bad = 1;
}
__device__ __forceinline__ bool offsets_flagged(const BwdParams& p) {
    return p.offsets_bad != nullptr && *static_cast<volatile int*>(p.offsets_bad) != 0;
}
