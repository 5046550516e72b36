// Kernel parameter blocks. Passed by value as one struct; cuflash/params.py
// mirrors each layout with a NumPy structured dtype, and a CPU test checks
// that sizes and offsets agree (tests/test_compile.py).
#pragma once
#include "numeric.cuh"

// The mask policy's run-time values (common/mask.cuh), the last fields of FwdParams and BwdParams (one list,
// so that the two layouts, and cuflash/params.py's _MASK_FIELDS, cannot drift apart); a kernel reads only those
// of the parts its MaskVariant has.
#define CUFLASH_MASK_PARAMS                                                                                     \
    int mask_diag;          /* query row i's diagonal is key position i + mask_diag (seqlen_k - seqlen_q + offsets) */ \
    int window_left;        /* kLocal: keys before / after the diagonal a row sees (unbounded: larger than any */   \
    int window_right;       /* distance; causal: window_right = 0) */                                         \
    int attention_chunk;    /* kChunk: chunks of keys a row keeps to (0: none) */                             \
    int key_offset;         /* kChunk: absolute position of key 0 (chunks are counted from absolute 0) */      \
    int alibi_batch_stride; /* kAlibi: floats between batches of alibi_slopes (0: one row for every batch) */ \
    float softcap_in;       /* kSoftcap: softmax_scale / softcap */                                          \
    float softcap_out;      /* kSoftcap: softcap / softmax_scale */                                          \
    float alibi_scale;      /* kAlibi: 1 / softmax_scale */                                                  \
    const float* alibi_slopes;  /* kAlibi: (batch, heads_q) or (heads_q,) float32 */                          \
    const float* sinks;     /* kSink: (heads_q,) float32 logits */

// Packed (varlen) batches, the last fields of FwdParams and BwdParams: read only by kernels built with
// MaskVariant::kVarlen (common/varlen.cuh), whose seqlen_q / seqlen_k hold max_seqlen_q / max_seqlen_k.
#define CUFLASH_VARLEN_PARAMS                                                                                   \
    const int* cu_seqlens_q;  /* (batch + 1,) row offsets of the sequences in the packed q (and out, lse) */     \
    const int* cu_seqlens_k;  /* (batch + 1,) row offsets in the packed k and v */                             \
    const int* seqused_q;     /* (batch,) rows used of each sequence, or null */                               \
    const int* seqused_k;                                                                                       \
    int total_q;              /* packed rows of q (lse: (heads_q, total_q)) and of k */                         \
    int total_k;                                                                                                \
    int tile_rows;            /* sm90 backward: the query tile by which sequences' stats rows and dQ tiles are */ \
                              /* padded (varlen.cuh: padded_row0); else 0 */                                   \
    int* offsets_bad;         /* sm90 ordered backward: set by the preprocess where cu_seqlens_q decreases */     \
                              /* (varlen.cuh: flag_decreasing_offsets); else null */

// Strides are in elements; the last (head_dim) dimension is contiguous.
struct FwdParams {
    const void* q;
    const void* k;
    const void* v;
    void* o;
    float* lse;            // (batch, heads_q, seqlen_q), contiguous; may be null
    i64 q_batch_stride, q_row_stride, q_head_stride;
    i64 k_batch_stride, k_row_stride, k_head_stride;
    i64 v_batch_stride, v_row_stride, v_head_stride;
    i64 o_batch_stride, o_row_stride, o_head_stride;
    int batch;
    int seqlen_q;
    int seqlen_k;
    int heads_q;
    int heads_per_kv;      // heads_q / heads_kv (GQA group size)
    int head_dim;
    float softmax_scale;
    float scale_log2;      // softmax_scale * log2(e), folded once on the host
    CUFLASH_MASK_PARAMS
    CUFLASH_VARLEN_PARAMS
};

// Backward (FlashAttention-2 split): bwd_preprocess (delta, zero dq_accum),
// the dK/dV kernel (and, in the atomic mode, dQ partial sums), then either
// bwd_postprocess (dq_accum -> dq) or the dQ kernel (deterministic, float32).
struct BwdParams {
    const void* q;
    const void* k;
    const void* v;
    const void* o;
    const void* dout;
    const float* lse;      // (batch, heads_q, seqlen_q), contiguous, natural log
    float* delta;          // (batch, heads_q, seqlen_q), contiguous: rowsum(dout * out); null for sm90 (stats)
    float* dq_accum;       // float32 dQ sums, null unless atomic or tile dQ: (batch, heads_q, seqlen_q, head_dim)
                           // contiguous, or (sm90 tile modes) tiles in the wgmma accumulator order
    void* dq;
    void* dk;              // (batch, seqlen_k, heads_kv, head_dim)
    void* dv;
    int* dq_semaphore;     // sm90 tile dQ: one int per (batch, head, query tile, slice), zeroed by the
                           // preprocess (dq_semaphores of them); else null
    i64 q_batch_stride, q_row_stride, q_head_stride;
    i64 k_batch_stride, k_row_stride, k_head_stride;
    i64 v_batch_stride, v_row_stride, v_head_stride;
    i64 o_batch_stride, o_row_stride, o_head_stride;
    i64 do_batch_stride, do_row_stride, do_head_stride;
    i64 dq_batch_stride, dq_row_stride, dq_head_stride;
    i64 dk_batch_stride, dk_row_stride, dk_head_stride;
    i64 dv_batch_stride, dv_row_stride, dv_head_stride;
    int batch;
    int seqlen_q;
    int seqlen_k;
    int heads_q;
    int heads_per_kv;      // heads_q / heads_kv (GQA group size)
    int head_dim;          // run-time head dim; kernels are instantiated per head-dim bucket
    float softmax_scale;
    float scale_log2;      // softmax_scale * log2(e)
    // dq_accum as the preprocess zeroes it: (batch, heads_q, dq_accum_rows, dq_accum_cols) floats
    // (seqlen_q x head_dim in rows; sm90 tile modes: query tiles x block_m rows, padded head dim).
    int dq_accum_rows;
    int dq_accum_cols;
    // Rows of each (batch, head) of dq_accum that the preprocess zeroes (<= dq_accum_rows): all of them,
    // or (sm90 ordered dQ, whose first contribution to a query tile is a store) those of the query tiles
    // that see no key at all (causal, seqlen_q > seqlen_k), which nothing else writes.
    int dq_zero_rows;
    int dq_semaphores;     // ints of dq_semaphore that the preprocess zeroes (0 without it)
    // sm90: lse2 and delta of each (batch, head) as rows [2][stat_rows] (stat_rows: whole query tiles; rows past
    // seqlen_q hold lse2 = +inf, delta = 0), written by the preprocess for the dK/dV kernel's producer to copy
    // by TMA; else null.
    float* stats;
    int stat_rows;
    CUFLASH_MASK_PARAMS
    const float* dlse;      // the gradient of lse (null: none): the preprocess takes it off delta
    CUFLASH_VARLEN_PARAMS
};
