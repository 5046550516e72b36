// The Hopper forward's tile order: which (query tile, head, batch) a CTA takes, and in what order.
#pragma once
#include "../common/numeric.cuh"
#include "../common/params.cuh"
#include "../common/mask.cuh"
#include "../common/programmable.cuh"

// Persistent tile order (kPersistent): tiles t = 0 .. num_m * heads_q * batch - 1, handed out
// dynamically (CTA c starts with tile c, then takes the next one from a global counter). Where every
// query tile has the same work, query tiles of one (head, batch) are adjacent (they share K/V in L2). Where
// the mask policy makes it uneven (MaskPolicy::kUnevenWork: causal, windows), the (head, batch) pairs go in
// equal sections whose K/V fit in L2, and inside a section the longest query tiles (most key tiles) come
// first, so that the short ones fill the tail.
constexpr int kSectionMB = 32;   // L2 budget of one causal section of (head, batch) pairs, in MB
// At most 32 (head, batch) pairs a section: the first wave of a section runs the longest query tile of
// every pair in it, each loading its pair's K / V from DRAM for the first time, and with short sequences
// a 32 MB section held 128 pairs or more (a burst that the CTAs of that wave all waited on).
constexpr int kSectionPairs = 32;
// Clusters of `cluster` CTAs (a policy that skips no key tiles): query tiles counted in whole clusters (the
// padding tiles have no rows: their CTAs only load their share of K / V), so that a cluster's tiles share a
// (head, batch).
struct PersistentOrder {
    int num_m, num_hb, num_tiles, group;
    __device__ __forceinline__ PersistentOrder(const FwdParams& p, int block_m, int kv_bytes_per_row, int cluster = 1) {
        num_m = (p.seqlen_q + block_m - 1) / block_m;
        num_m = (num_m + cluster - 1) / cluster * cluster;
        num_hb = p.heads_q * p.batch;
        num_tiles = num_m * num_hb;
        const long long kv_head = static_cast<long long>(p.seqlen_k) * kv_bytes_per_row;
        const long long g = (static_cast<long long>(kSectionMB) << 20) / (kv_head > 0 ? kv_head : 1);
        group = static_cast<int>(g < 1 ? 1 : (g > num_hb ? num_hb : g));
        if (group > kSectionPairs) group = kSectionPairs;
        const int sections = (num_hb + group - 1) / group;
        group = (num_hb + sections - 1) / sections;   // equal sections: no short one at the end
    }
    // One CTA per tile: (query tile, head, batch) from a 3-D grid; uneven work: a 1-D grid walked in the
    // persistent order (longest query tiles first within L2-sized sections of heads), so that the last wave
    // holds short tiles and the waves in flight share K/V in L2.
    template <bool kUnevenWork>
    __device__ __forceinline__ void grid_coords(int heads_q, int& m_block, int& head, int& batch) const {
        if constexpr (kUnevenWork) {
            coords<true>(static_cast<int>(blockIdx.x), heads_q, m_block, head, batch);
        } else {
            m_block = blockIdx.x;
            head = blockIdx.y;
            batch = blockIdx.z;
        }
    }
    template <bool kUnevenWork>
    __device__ __forceinline__ void coords(int t, int heads_q, int& m_block, int& head, int& batch) const {
        int hb;
        if (!kUnevenWork) {
            m_block = t % num_m;
            hb = t / num_m;
        } else {
            const int per_section = num_m * group;
            const int section = t / per_section;
            const int hb0 = section * group;
            const int g = min(group, num_hb - hb0);
            const int r = t - section * per_section;
            m_block = num_m - 1 - r / g;
            hb = hb0 + r % g;
        }
        head = hb % heads_q;
        batch = hb / heads_q;
    }
};

// The key tiles query tile m_block visits, in the order the producer loads them and the consumers take them:
// [n_block_min, n_block_max) from the last down (masked tiles at the diagonal first). The producer, the
// consumers' key loops and the idle warpgroups all walk count() tiles through tile(i), the one place that
// knows the range, and the K/V ring advances by count(). A block-sparse programmable variant walks its list
// instead (below).
template <class Mask, class Variant = PlainVariant, bool kSparse = Variant::kBlockSparse>
struct FwdKeyTiles {
    int n_block_min, n_block_max;
    __device__ __forceinline__ FwdKeyTiles(const Mask& mask, int m_block)
        : n_block_min(mask.n_block_min(m_block)), n_block_max(mask.n_block_max(m_block)) {
        // Varlen: the grid covers the longest sequence; a tile past this one's rows visits nothing.
        if (Mask::kVarlen && m_block * Mask::kBlockM >= mask.seqlen_q) n_block_max = n_block_min;
    }
    __device__ __forceinline__ FwdKeyTiles(const FwdParams& p, int m_block, const ProgParams*, int, int)
        : FwdKeyTiles(Mask(p), m_block) {}
    // Tiles visited (none when <= 0).
    __device__ __forceinline__ int count() const { return n_block_max - n_block_min; }
    // The i-th key tile visited (0 <= i < count()).
    __device__ __forceinline__ int tile(int i) const { return n_block_max - 1 - i; }
    // Whether an off block or the user's mask hides elements of the i-th tile (block sparsity alone).
    static __device__ __forceinline__ bool partial(int) { return false; }
};

// Block sparsity (ProgParams' lists, common/programmable.cuh: KeyTiles): the query tile's listed key tiles within
// the mask policy's range, last first, as the range's tiles are.
template <class Mask, class Variant>
struct FwdKeyTiles<Mask, Variant, true> {
    KeyTiles<Mask, Variant, true> list;
    __device__ __forceinline__ FwdKeyTiles(const FwdParams& p, int m_block, const ProgParams* pp, int batch, int head)
        : list(pp, batch, head, m_block, p) {}
    __device__ __forceinline__ int count() const { return list.count(); }
    __device__ __forceinline__ int tile(int i) const { return list.tile(list.count() - 1 - i); }
    __device__ __forceinline__ bool partial(int i) const { return list.partial(list.count() - 1 - i); }
};
