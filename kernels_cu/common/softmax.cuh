// Online softmax over mma.sync accumulator fragments.
//
// Each thread holds, per 16-row m-tile, two rows (g and g + 8, g = lane / 4),
// each spread over the 4 lanes of a quad. Running maxima are kept in the
// log2 domain of the scaled scores (score * softmax_scale * log2 e), so every
// exponential is one exp2. Row sums stay per-thread partial sums until the end.
#pragma once
#include "numeric.cuh"

// 1/x within 1 ulp, without the IEEE slow path's subroutine call (which would
// force registers onto the stack in the epilogue).
__device__ __forceinline__ float fast_rcp(float x) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}

// The max over row (t, h) of a thread's accumulator fragment (elements 2h and 2h + 1 of each n tile) and
// `init`, then across the quad of threads that shares the row.
template <int kMTiles, int kNTiles>
__device__ __forceinline__ float fragment_row_max(const float (&x)[kMTiles][kNTiles][4], int t, int h, float init) {
    float mx = init;
#pragma unroll
    for (int n = 0; n < kNTiles; ++n) mx = fmaxf(mx, fmaxf(x[t][n][2 * h], x[t][n][2 * h + 1]));
    return quad_max(mx);
}

__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffff, x, 1);
    return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// kRows rows per thread (2 per m-tile), kNTiles n8-tiles of scores per row.
// kMaxSlackLog2 > 0: the running max may trail the true one by up to that much (log2 domain), so
// that most steps keep it and need no rescale of the output; probabilities then reach up to
// 2^kMaxSlackLog2 (fine in fp16/bf16 and float32), and the final normalisation by the row sum taken
// against the same max makes the result exact as before.
// kHeadroomLog2 > 0: a max that moves is set that much above the row's largest score, so that the
// probabilities stay at most 2^-kHeadroomLog2 (2^(kMaxSlackLog2 - kHeadroomLog2) with the slack) and a later
// score may pass the max by that much more before a 16-bit P overflows (the kept max's fp16 bound).
template <int kMTiles, int kNTiles, int kMaxSlackLog2 = 0, int kHeadroomLog2 = 0>
struct OnlineSoftmax {
    static constexpr int kRows = 2 * kMTiles;
    float row_max[kRows];   // log2 domain; -inf until a visible key is seen
    float row_sum[kRows];   // per-thread partial sums of exp2(...)

    __device__ __forceinline__ void init() {
#pragma unroll
        for (int r = 0; r < kRows; ++r) { row_max[r] = -CUFLASH_INF; row_sum[r] = 0.f; }
    }

    // Turn raw scores s into probabilities in place (relative to the new
    // running max) and return, per row, the factor by which the output
    // accumulator must be rescaled. Returns whether any of this thread's rows
    // changed its max (otherwise every factor is exactly 1).
    __device__ __forceinline__ bool step(float (&s)[kMTiles][kNTiles][4], float scale_log2,
                                         float (&rescale)[kRows]) {
        bool changed = false;
#pragma unroll
        for (int t = 0; t < kMTiles; ++t) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = 2 * t + h;
                const float mx = fragment_row_max(s, t, h, -CUFLASH_INF) * scale_log2;
                const bool keep = kMaxSlackLog2 > 0 && mx <= row_max[r] + static_cast<float>(kMaxSlackLog2);
                const float new_max = keep ? row_max[r] : fmaxf(row_max[r], mx + static_cast<float>(kHeadroomLog2));
                // A row that has seen no visible key yet keeps max -inf; use 0 as
                // the reference so that exp2(-inf - ref) = 0 rather than NaN.
                const float ref = new_max == -CUFLASH_INF ? 0.f : new_max;
                rescale[r] = exp2f(row_max[r] - ref);
                changed |= new_max != row_max[r];
                row_max[r] = new_max;
                float sum = 0.f;
#pragma unroll
                for (int n = 0; n < kNTiles; ++n) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float p = exp2f(fmaf(s[t][n][2 * h + e], scale_log2, -ref));
                        s[t][n][2 * h + e] = p;
                        sum += p;
                    }
                }
                row_sum[r] = row_sum[r] * rescale[r] + sum;
            }
        }
        return changed;
    }

    // Probabilities against the running max as it stands, without looking for this tile's max (its
    // FMNMX chain and quad shuffles are most of the softmax's latency): s = exp2(s * scale_log2 - max) in
    // place, this thread's partial row sums in `sums` (not yet added). Returns whether every one of this
    // thread's partial sums (so every probability) is at most 2^kBoundLog2; NaN and inf fail. The caller
    // keeps no row without a max here (its probabilities would be inf or NaN).
    template <int kBoundLog2>
    __device__ __forceinline__ bool probs_at_running_max(float (&s)[kMTiles][kNTiles][4], float scale_log2,
                                                         float (&sums)[kRows]) const {
        bool ok = true;
#pragma unroll
        for (int t = 0; t < kMTiles; ++t) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = 2 * t + h;
                // The check (and the vote after it) waits on the sum: four partial sums, so that its chain of
                // dependent adds is a quarter as long (four measured fastest: docs/experiments.md).
                constexpr int kAccs = 4;
                float part[kAccs];
#pragma unroll
                for (int a = 0; a < kAccs; ++a) part[a] = 0.f;
#pragma unroll
                for (int n = 0; n < kNTiles; ++n) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float p = exp2f(fmaf(s[t][n][2 * h + e], scale_log2, -row_max[r]));
                        s[t][n][2 * h + e] = p;
                        part[(2 * n + e) % kAccs] += p;
                    }
                }
                sums[r] = (part[0] + part[1]) + (part[2] + part[3]);
                ok &= sums[r] <= static_cast<float>(1ull << kBoundLog2);
            }
        }
        return ok;
    }
    __device__ __forceinline__ void add_sums(const float (&sums)[kRows]) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) row_sum[r] += sums[r];
    }

    // Whether some row has no max yet (no visible key so far): probabilities against it mean nothing.
    __device__ __forceinline__ bool has_unset_row() const {
        bool unset = false;
#pragma unroll
        for (int r = 0; r < kRows; ++r) unset |= row_max[r] == -CUFLASH_INF;
        return unset;
    }

    // Whether rebase() can take over from probs_at_running_max() for this thread's rows: every partial sum
    // at most 2^(120 - kHeadroomLog2), so that the factor 2^-(log2(max p) + headroom) stays a normal float
    // (-ftz flushes 2^-127). Past it (a score that far above the running max, or inf) only S itself gives the
    // new max. NaN passes: it propagates
    // to the output either way.
    static constexpr float kRebaseSumLimit = static_cast<float>(1ull << (60 - kHeadroomLog2)) * 0x1p60f;
    __device__ __forceinline__ bool rebase_possible(const float (&sums)[kRows]) const {
        bool ok = true;
#pragma unroll
        for (int r = 0; r < kRows; ++r) ok &= !(sums[r] > kRebaseSumLimit);
        return ok;
    }

    // After probs_at_running_max() failed its bound, with rebase_possible() true for every thread of the
    // warp (quad shuffles): a row whose largest probability m passes 2^kMaxSlackLog2 moves its max up by
    // log2(m) and its probabilities, this tile's sums and its running sum down by 2^-log2(m), all in
    // registers (S is not needed: p / m is exp2 of the score against the new max). The partial sums are
    // added. Returns whether any of this thread's rows moved its max; `rescale` is O's factor per row.
    __device__ __forceinline__ bool rebase(float (&p)[kMTiles][kNTiles][4], const float (&sums)[kRows],
                                           float (&rescale)[kRows]) {
        bool changed = false;
#pragma unroll
        for (int t = 0; t < kMTiles; ++t) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = 2 * t + h;
                const float mx = fragment_row_max(p, t, h, 0.f);
                const bool move = mx > static_cast<float>(1 << kMaxSlackLog2);
                const float shift = move ? __log2f(mx) + static_cast<float>(kHeadroomLog2) : 0.f;
                const float f = exp2f(-shift);   // 1 where the max stands
                row_max[r] += shift;
                rescale[r] = f;
                changed |= move;
                row_sum[r] = (row_sum[r] + sums[r]) * f;
#pragma unroll
                for (int n = 0; n < kNTiles; ++n) {
                    p[t][n][2 * h] *= f;
                    p[t][n][2 * h + 1] *= f;
                }
            }
        }
        return changed;
    }

    // Final normaliser per row (1 / sum, 0 for a row with no visible key) and
    // the natural-log log-sum-exp (-inf for such a row).
    __device__ __forceinline__ void finalize(float (&inv_sum)[kRows], float (&lse)[kRows]) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            const float sum = quad_sum(row_sum[r]);
            const bool empty = !(sum > 0.f);
            inv_sum[r] = empty ? 0.f : fast_rcp(sum);
            lse[r] = empty ? -CUFLASH_INF : (row_max[r] + __log2f(sum)) * CUFLASH_LN2;
        }
    }
    // The same with a sink: a logit (log2 domain, sink_log2 in common/mask.cuh) that joins each row's
    // denominator without a value. Taken against max(row max, sink) so that neither term overflows; a row
    // with no visible key gets output 0 and lse = the sink.
    __device__ __forceinline__ void finalize_with_sink(float (&inv_sum)[kRows], float (&lse)[kRows], float sink2) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            const float sum = quad_sum(row_sum[r]);
            const float mx = fmaxf(row_max[r], sink2);
            const float keys = sum > 0.f ? sum * exp2f(row_max[r] - mx) : 0.f;
            const float total = keys + exp2f(sink2 - mx);
            inv_sum[r] = sum > 0.f ? exp2f(row_max[r] - mx) * fast_rcp(total) : 0.f;
            lse[r] = (mx + __log2f(total)) * CUFLASH_LN2;
        }
    }
    template <bool kSink>
    __device__ __forceinline__ void finalize(float (&inv_sum)[kRows], float (&lse)[kRows], float sink2) {
        if constexpr (kSink) finalize_with_sink(inv_sum, lse, sink2);
        else finalize(inv_sum, lse);
    }
};
