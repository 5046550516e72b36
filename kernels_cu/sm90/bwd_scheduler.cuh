// The sm90 backward's tile scheduler: which (key tile, kv head, batch) a CTA takes (BwdTileScheduler) and
// the query tiles it visits, in which order (BwdSteps).
#pragma once
#include "bwd_tile.cuh"

// The diagnostic negative controls of the first-slice stores (with either at 0 the preprocess zeroes the dQ
// sums: cuflash/sm90.py, bwd_first_slice_stored, reads these defines).
// CUFLASH_SM90_BWD_FIRST_STORE: the ordered mode stores each query tile's first slice (order 0) instead of
// adding it, so that the preprocess need not zero those sums; 0 adds it too.
#ifndef CUFLASH_SM90_BWD_FIRST_STORE
#define CUFLASH_SM90_BWD_FIRST_STORE 1
#endif
// CUFLASH_SM90_BWD_CLAIM_FIRST: the unordered mode does the same for whichever key tile reaches a slice
// first (BwdDqWriter); 0 adds every slice. The trace build keeps its records in dq_semaphore, so it
// cannot claim (its dQ is wrong).
#ifndef CUFLASH_SM90_BWD_CLAIM_FIRST
#ifdef CUFLASH_SM90_BWD_TRACE
#define CUFLASH_SM90_BWD_CLAIM_FIRST 0
#else
#define CUFLASH_SM90_BWD_CLAIM_FIRST 1
#endif
#endif

struct BwdBlock {
    int n_block, head_kv, batch;
};

// The ordered mode's fixed order of the key tiles that reach query tile m, [n_block_min(m), n_block_max(m))
// (the mask policy's): a slice waits until its semaphore counts its position, and position 0 stores. Patterns
// that skip tiles (causal, windows) go down from the last of them: key tile n starts its steps at its own
// first query tile m_block_min(n), which grows with n, so a query tile is reached first by its last key tile
// and then by the ones below it; the others go up from the first (every key tile starts at query tile 0, and
// at the same time). Every key tile of that range visits the query tile (the policy's two ranges agree), so
// each position is taken once. The scheduler starts the CTAs in the same order (kFromLast), so that
// a CTA only waits on CTAs launched before it.
template <class Mask>
struct BwdDqOrder {
    static constexpr bool kFromLast = Mask::kSkipsTiles;
    static __device__ __forceinline__ int position(const Mask& mask, int m_block, int n_block) {
        return kFromLast ? mask.n_block_max(m_block) - 1 - n_block : n_block - mask.n_block_min(m_block);
    }
};

// The (key tile, kv head, batch) of this CTA. A 1-D grid (patterns with uneven work per key tile, and
// ordered-dQ kernels, always; the others with 128-row query tiles, launch.py: bwd_dkdv_grid) is walked
// key-tile-major within sections of (kv head, batch) groups whose Q, dO, K and V fit in a share of the L2
// (kSectionMB), so that the CTAs running at a time reread K, V, Q and dO from L2. Uneven work (not
// ordered): heaviest first -- causal key tile n sees the query tiles from its diagonal on, so low n carry
// the most work -- so that the last wave holds short CTAs only. Ordered dQ: a query tile's slices are added
// in BwdDqOrder's order, and CTAs start in that order too (each waits only on CTAs launched before it, so
// all make progress). Otherwise the grid is (key tile, kv head, batch); with one group both readings agree.
// Mask: the mask policy; the choices below ask its traits.
template <int kBlockM, int kBlockN, int kHeadDim, class Mask, int kDqMode>
struct BwdTileScheduler {
    // L2 budget of one section, in MB: about one wave of CTAs at head dim 64. The ordered kernel above
    // head dim 64 keeps wider sections (its CTAs wait on the key tiles before them: one group per
    // section would be half a wave and a longer chain of such waits), narrower when it skips tiles (its
    // key tiles wait on the next one only, and the L2 left serves them).
    static constexpr int kSectionMB = 8;
    static constexpr int kOrderedSectionMB = 24;
    static constexpr int kOrderedCausalSectionMB = 12;
    // Uneven work (not ordered): the last groups, up to kCausalTailGroups of them within kCausalTailMB, share
    // one section, so that the last waves take the heaviest key tiles of all of them first: fewer SMs
    // idle at the end while a late heavy tile finishes (every group in one section thrashes the L2).
    static constexpr int kCausalTailGroups = 12;
    static constexpr int kCausalTailMB = 48;
    // The steps of a key tile start at a query tile of their own and wrap around (BwdSteps): the
    // unordered kernels whose key tiles all start at the same query tile (no tiles skipped), so that the
    // key tiles running side by side add into different dQ tiles at a time, and (claimed slices) the key
    // tiles after the first reach a tile once its store is done.
    static constexpr bool kRotate = kDqMode != kDqTileOrdered && !Mask::kSkipsTiles
                                    && (kBlockM == 128 || CUFLASH_SM90_BWD_CLAIM_FIRST);

    static __device__ __forceinline__ BwdBlock block(const BwdParams& p) {
        if (Mask::kUnevenWork || kDqMode == kDqTileOrdered || (gridDim.y == 1 && gridDim.z == 1)) {
            // Unsigned 32-bit divisions and one float division: every CTA pays this chain before its
            // first TMA load (64-bit and signed divisions made it a quarter longer).
            const unsigned n_blocks = ceil_div(p.seqlen_k, kBlockN);
            const unsigned heads_kv = static_cast<unsigned>(p.heads_q) / static_cast<unsigned>(p.heads_per_kv);
            const unsigned groups = p.batch * heads_kv;
            // Whole groups per section: any value >= 1 covers the grid (n_blocks x groups CTAs) exactly
            // once, so float rounding only has to be the same in every thread, which it is.
            constexpr float kSectionBytes = static_cast<float>((kDqMode == kDqTileOrdered && kHeadDim > 64
                                                                    ? (Mask::kSkipsTiles ? kOrderedCausalSectionMB : kOrderedSectionMB)
                                                                    : kSectionMB) << 20);
            const float group_bytes = 4.f * kHeadDim * (static_cast<float>(p.seqlen_q) * p.heads_per_kv + p.seqlen_k);
            const unsigned per_section = static_cast<unsigned>(
                fminf(static_cast<float>(groups), fmaxf(1.f, floorf(__fdividef(kSectionBytes, group_bytes)))));
            const unsigned linear = blockIdx.x;
            unsigned first_group, section_groups;
            constexpr unsigned kTailMax = Mask::kUnevenWork && kDqMode != kDqTileOrdered ? kCausalTailGroups : 0;
            const unsigned tail_fit = static_cast<unsigned>(
                fminf(static_cast<float>(min(kTailMax, groups)),
                      floorf(__fdividef(static_cast<float>(kCausalTailMB << 20), group_bytes))));
            const unsigned tail = tail_fit > per_section ? tail_fit : 0;
            if (linear >= (groups - tail) * n_blocks) {
                first_group = groups - tail;
                section_groups = tail;
            } else {
                first_group = linear / (per_section * n_blocks) * per_section;
                section_groups = min(per_section, groups - tail - first_group);
            }
            const unsigned within = linear - first_group * n_blocks;
            // Ordered dQ: key tiles in BwdDqOrder's order (ascending, or from the last down), so that a CTA
            // only waits on CTAs launched before it, and key-tile-major inside a section, so that one
            // wave holds a few key tiles of many groups (a chain of ~132 / per_section links per wave,
            // not n_blocks).
            const unsigned n_order = within / section_groups;
            const unsigned group = first_group + (within - n_order * section_groups);
            const unsigned batch = group / heads_kv;
            const int n_block = kDqMode == kDqTileOrdered && BwdDqOrder<Mask>::kFromLast
                                    ? static_cast<int>(n_blocks - 1 - n_order)
                                                                       : static_cast<int>(n_order);
            return {n_block, static_cast<int>(group - batch * heads_kv), static_cast<int>(batch)};
        } else {
            return {static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z)};
        }
    }
};

// The steps of key tile n_block: the n_m query tiles [m_block_min, m_block_max) that the mask policy says
// visit it, of each query head of its GQA group, n_iter in all; step i takes query head head0 + i / n_m and
// query tile query_tile(i). The producer, the consumers and the dQ writers walk the same steps (the one
// place the range is read: a policy with a list of tiles would change query_tile only). Rotated (kRotate),
// key tile n_block starts at query tile n_block * n_m / n_blocks and wraps around, so that the key tiles
// reaching one query tile are evenly spaced in steps.
template <int kBlockM, int kBlockN, class Mask, bool kRotate>
struct BwdSteps {
    int n_block, m_begin, n_m, n_iter, rotation;
    __device__ __forceinline__ BwdSteps(int n_block_, const Mask& mask, int seqlen_k, int heads_per_kv)
        : n_block(n_block_) {
        m_begin = mask.m_block_min(n_block);
        const int m_end = mask.m_block_max(n_block);
        n_m = m_end > m_begin ? m_end - m_begin : 0;
        n_iter = n_m * heads_per_kv;
        rotation = 0;
        if (kRotate && n_m > 0)
            rotation = static_cast<int>(static_cast<unsigned>(n_block * n_m) / static_cast<unsigned>(ceil_div(seqlen_k, kBlockN)));
    }
    __device__ __forceinline__ int query_tile(int i) const {
        int t = i % n_m;
        if (kRotate) {
            t += rotation;
            if (t >= n_m) t -= n_m;
        }
        return m_begin + t;
    }
};
