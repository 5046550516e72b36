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

// Decoding over a KV cache (kernels_cu/decode/decode.cu): a few query tokens per sequence against a cache of
// keys, contiguous (batch_cache, cache rows, heads_kv, head_dim) or paged (num_pages, page_size, heads_kv,
// head_dim) through block_table. Sequence b attends to keys [0, seqlen_k) with seqlen_k = cache_seqlens[b] +
// seqlen_new (clamped to the cache's capacity), its key range split into CTAs of keys_per_split keys.
struct DecodeParams {
    const void* q;              // (batch, seqlen_q, heads_q, head_dim)
    const void* k;              // the K cache (see above)
    const void* v;              // the V cache, head_dim_v wide
    void* o;                    // (batch, seqlen_q, heads_q, head_dim_v), written where o_partial is null
    float* lse;                 // (batch, heads_q, seqlen_q) or null, written where o_partial is null
    float* o_partial;           // (num_splits, batch, seqlen_q, heads_q, head_dim_v) float32, or null: each split's
    float* lse_partial;         // result and its lse (num_splits, batch, heads_q, seqlen_q), merged by combine
    const int* cache_seqlens;   // (batch,) keys already in the cache
    const int* cache_batch_idx; // (batch,) the cache row of each sequence (contiguous cache), or null
    const int* block_table;     // (batch, block_table_batch_stride) pages of each sequence, or null
    const int* cache_leftpad;   // (batch,) where each sequence's keys start in its cache row, or null (0): key j of
                                // sequence b is cache position cache_leftpad[b] + j, and it has cache_seqlens[b] +
                                // seqlen_new - cache_leftpad[b] keys
    const float* k_scale;       // fp8 caches: the value of a stored element is element * scale, the scale of KV head h
    const float* v_scale;       // at [b * scale_batch_stride + h * scale_head_stride] (float32) for sequence b, or
                                // null: k_scale_value / v_scale_value
    i64 q_batch_stride, q_row_stride, q_head_stride;
    i64 k_batch_stride, k_row_stride, k_head_stride;   // batch: a cache row, or a page
    i64 v_batch_stride, v_row_stride, v_head_stride;
    i64 o_batch_stride, o_row_stride, o_head_stride;
    i64 block_table_batch_stride;
    int batch;
    int seqlen_q;
    int seqlen_k;               // set per sequence in the kernel (the mask policy reads it)
    int heads_q;
    int heads_per_kv;
    int head_dim;
    int head_dim_v;
    int seqlen_new;             // tokens appended before the call (their keys count in every sequence)
    int cache_capacity;         // keys a sequence can hold: cache rows, or max_blocks * page_size
    int cache_rows;             // contiguous: batch_cache, the cache_batch_idx clamp; paged: num_pages
    int page_size;              // 0: contiguous
    int page_shift;             // log2(page_size) where it is a power of two, else -1 (a division per row)
    int keys_per_split;         // a multiple of the kernel's key tile
    int num_splits;
    int scale_batch_stride;     // the scales' layout: (batch, heads_kv) (heads_kv, 1), (heads_kv,) (0, 1), one (0, 0)
    int scale_head_stride;
    float k_scale_value;        // the scales where the pointers are null (1 for 16-bit caches)
    float v_scale_value;
    float softmax_scale;
    float scale_log2;
    CUFLASH_MASK_PARAMS
};

// Merging partial attention results through their lse (kernels_cu/decode/combine.cu, cuflash.combine):
// out = sum_s exp(lse_s - lse) out_s with lse = log sum_s exp(lse_s), a split whose lse_s is -inf skipped.
struct CombineParams {
    const void* outs;           // (num_splits, batch, seqlen, heads, head_dim), contiguous
    const float* lses;          // (num_splits, batch, heads, seqlen), contiguous
    void* out;                  // (batch, seqlen, heads, head_dim), rows out_row_stride apart (a row: one (b, t, h))
    float* lse;                 // (batch, heads, seqlen) or null
    i64 out_batch_stride, out_row_stride, out_head_stride;
    int num_splits;
    int batch;
    int seqlen;
    int heads;
    int head_dim;
    int outs_float32;           // 1: outs are float32; 0: the output's type
};

// Appending new keys and values to a KV cache, with the rotary embedding of the new keys and of the queries
// (kernels_cu/decode/append.cu; cuflash.forward_kvcache runs it before decode_kernel). Positions: new token i of
// sequence b at cache_seqlens[b] + i; query token t at cache_seqlens[b] + t (q_positions_step 1: causal or a
// window) or at cache_seqlens[b] (0), as flash-attn.
struct AppendParams {
    const void* k_new;          // (batch, seqlen_new, heads_kv, head_dim), or null (rotary of q only)
    const void* v_new;          // (batch, seqlen_new, heads_kv, head_dim_v)
    void* k_cache;              // as DecodeParams.k / v
    void* v_cache;
    const void* q;              // (batch, seqlen_q, heads_q, head_dim), or null (no rotary)
    void* q_rot;                // q rotated, contiguous like q's shape
    const float* rotary_cos;    // (seqlen_ro, rotary_dim / 2) float32, contiguous, or null
    const float* rotary_sin;
    const int* cache_seqlens;
    const int* cache_batch_idx;
    const int* block_table;
    const int* cache_leftpad;   // as DecodeParams: rotary positions count from it (cache rows do not)
    const float* k_scale;       // fp8 caches: as DecodeParams (a new element is stored as e4m3(x / scale))
    const float* v_scale;
    i64 k_new_batch_stride, k_new_row_stride, k_new_head_stride;
    i64 v_new_batch_stride, v_new_row_stride, v_new_head_stride;
    i64 k_batch_stride, k_row_stride, k_head_stride;
    i64 v_batch_stride, v_row_stride, v_head_stride;
    i64 q_batch_stride, q_row_stride, q_head_stride;
    i64 block_table_batch_stride;
    int batch;
    int seqlen_new;
    int seqlen_q;
    int heads_kv;
    int heads_q;
    int head_dim;
    int head_dim_v;
    int rotary_dim;             // 0: none
    int rotary_interleaved;     // 1: pairs (2i, 2i + 1); 0: pairs (i, i + rotary_dim / 2)
    int seqlen_ro;              // rows of the cos / sin tables (a position past them takes the last row)
    int q_positions_step;
    int cache_capacity;
    int cache_rows;
    int page_size;              // 0: contiguous
    int scale_batch_stride;
    int scale_head_stride;
    float k_scale_value;
    float v_scale_value;
};

// Programmable attention (issue #45): the second parameter of the kernels built with a programmable variant
// (dropout, a bias, block-sparse tile lists, user modifiers), so that the plain kernels' parameters stay as they
// are. Strides in elements; a broadcast dimension has stride 0.
struct ProgParams {
    const void* bias;           // element (b, h, i, j) at b * bias_batch_stride + h * bias_head_stride + ...
    float* dbias_accum;         // backward: float32 dbias sums, (b, h, i, j) at the dbias strides (0: summed)
    i64 bias_batch_stride, bias_head_stride, bias_row_stride, bias_col_stride;
    i64 dbias_batch_stride, dbias_head_stride, dbias_row_stride, dbias_col_stride;
    const unsigned long long* rng_state;   // (seed, offset) on the device, read by the kernel (a captured graph
                                           // replays with new values), or null: seed and offset below
    unsigned long long seed;
    unsigned long long offset;
    unsigned int dropout_threshold;   // common/philox.cuh: keep when an element's 16 bits are >= this
    float dropout_scale;              // 1 / (1 - dropout_p)
    // Block sparsity in the kernel's own tiles (cuflash/block_sparse.py: key_tile_lists): per (b, h, query tile)
    // the number of key tiles it visits and their indices, last first (bit 31: an off block covers part of the
    // tile, whose elements are tested against block_mask). Counts of (b, h, query tile) at b * kv_tiles_batch_stride
    // + h * kv_tiles_head_stride + tile (0 where broadcast); a list is a count's index times kv_tiles. (The
    // backward's dK / dV pass reads tile_state below.)
    const int* kv_tile_count;
    const int* kv_tile_index;
    i64 kv_tiles_batch_stride, kv_tiles_head_stride;
    int q_tiles, kv_tiles;                     // tiles per (b, h): the lists' row lengths
    const unsigned char* block_mask;           // the user's block mask (bool), for the tiles it covers in part
    i64 block_mask_batch_stride, block_mask_head_stride, block_mask_row_stride;
    int block_q, block_k;                      // its block size
    // The backward's dK / dV pass: each (b, h, query tile, key tile)'s state, 0 (hidden: contributes nothing),
    // 1 (elements to test), 2 (shown whole), at b * batch_stride + h * head_stride + m * kv_tiles + n; null: 2.
    const unsigned char* tile_state;
    i64 tile_state_batch_stride, tile_state_head_stride;
    // User modifiers' tensors (cuflash.ScoreMod / MaskMod, generated code reads them by name) and the float32
    // gradients of those that have one.
    const void* mod_tensor0;
    const void* mod_tensor1;
    const void* mod_tensor2;
    const void* mod_tensor3;
    const void* mod_tensor4;
    const void* mod_tensor5;
    const void* mod_tensor6;
    const void* mod_tensor7;
    float* mod_grad0;
    float* mod_grad1;
    float* mod_grad2;
    float* mod_grad3;
    float* mod_grad4;
    float* mod_grad5;
    float* mod_grad6;
    float* mod_grad7;
};

// A user mask modifier over the attention kernel's tiles (kernels_cu/aux/mask_tiles.cu).
struct MaskTilesParams {
    unsigned char* state;       // (batch', heads', m_tiles, n_tiles): 0 every element hidden, 1 some, 2 none
    int seqlen_q, seqlen_k;
    int heads;                  // heads' (1 where the modifier does not depend on h)
    int m_tiles, n_tiles;
};

// The block-sparse key-tile lists built on the device (aux/block_lists.cu, cuflash/block_sparse.py's
// key_tile_lists in one launch): per (b, h, query tile) of the kernel's block_m x block_n tiles, the key tiles that
// an on block of the user's mask and the mask modifier's tile states both show, last first.
struct BlockListsParams {
    const unsigned char* block_mask;   // (B', H', query blocks, key blocks) bool, or null
    i64 mask_batch_stride, mask_head_stride, mask_row_stride;   // elements (0 where broadcast)
    const unsigned char* state;        // the mask modifier's tile states (mask_tiles_kernel), or null
    i64 state_batch_stride, state_head_stride;   // elements (0 where broadcast); rows of n_tiles
    int* count;                        // (batch'', heads'', m_tiles)
    int* index;                        // (batch'', heads'', m_tiles, n_tiles)
    int heads;                         // heads'' of the output
    int seqlen_q, seqlen_k, block_q, block_k, block_m, block_n, m_tiles, n_tiles;
};
