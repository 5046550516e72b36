// The Hopper forward's tile scheduler: which (query tile, head, batch) a CTA works on, in what order.
//
// One CTA per tile: a 3-D grid (query tile, head, batch), except under the causal mask, where a 1-D grid
// walks the persistent order below so that the last wave holds short tiles.
// Persistent (kPersistent): gridDim.x = min(tiles, SMs); CTA c starts with tile c and then claims the next
// from a global counter (two ints, zero at launch; the last CTA to run out of tiles resets them). Without
// the mask, the query tiles of one (head, batch) are adjacent (they share K / V in L2). With it, the
// (head, batch) pairs go in equal sections whose K / V fit in L2, and inside a section the longest query
// tiles (most key tiles) come first, so that the short ones fill the tail.
// Clusters (kCluster CTAs, not causal): query tiles are counted in whole clusters (the padding tiles have no
// rows: their CTAs only load their share of K / V), and tiles are taken in a static order (every gridDim.x-th)
// so that the CTAs of a cluster go through tile pairs of one (head, batch) in step.
#pragma once
#include "../common/params.cuh"

struct TileCoord {
    int m_block, head, batch;
};

template <int kBlockM, bool kIsCausal, bool kPersistent, int kCluster>
struct FwdTileScheduler {
    // L2 budget of one causal section of (head, batch) pairs, and at most this many pairs a section: the
    // first wave of a section loads every pair's K / V from DRAM at once, and with short sequences a
    // 32 MB section held 128 pairs or more (a burst that the CTAs of that wave all waited on).
    static constexpr int kSectionMB = 32;
    static constexpr int kSectionPairs = 32;

    int num_m, num_hb, num_tiles, group;

    __device__ __forceinline__ FwdTileScheduler(const FwdParams& p, int kv_bytes_per_row) {
        num_m = (p.seqlen_q + kBlockM - 1) / kBlockM;
        num_m = (num_m + kCluster - 1) / kCluster * kCluster;
        num_hb = p.heads_q * p.batch;
        num_tiles = num_m * num_hb;
        const long long kv_head = static_cast<long long>(p.seqlen_k) * kv_bytes_per_row;
        const long long g = (static_cast<long long>(kSectionMB) << 20) / (kv_head > 0 ? kv_head : 1);
        group = static_cast<int>(g < 1 ? 1 : (g > num_hb ? num_hb : g));
        if (group > kSectionPairs) group = kSectionPairs;
        const int sections = (num_hb + group - 1) / group;
        group = (num_hb + sections - 1) / sections;   // equal sections: no short one at the end
    }
    // The coordinates of persistent tile t.
    __device__ __forceinline__ TileCoord coords(int t, int heads_q) const {
        TileCoord c;
        int hb;
        if (!kIsCausal) {
            c.m_block = t % num_m;
            hb = t / num_m;
        } else {
            const int per_section = num_m * group;
            const int section = t / per_section;
            const int hb0 = section * group;
            const int gr = min(group, num_hb - hb0);
            const int r = t - section * per_section;
            c.m_block = num_m - 1 - r / gr;
            hb = hb0 + r % gr;
        }
        c.head = hb % heads_q;
        c.batch = hb / heads_q;
        return c;
    }
    // One CTA per tile: this CTA's tile.
    __device__ __forceinline__ TileCoord grid_coords(int heads_q) const {
        if constexpr (kIsCausal) {
            return coords(static_cast<int>(blockIdx.x), heads_q);
        } else {
            return TileCoord{static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z)};
        }
    }
    __device__ __forceinline__ int first_tile() const { return kPersistent ? static_cast<int>(blockIdx.x) : 0; }
    // The tile after t for this CTA (persistent; the producer claims it, one atomic per tile).
    __device__ __forceinline__ int next_tile(int t, int* tile_counter) const {
        if constexpr (kCluster > 1) return t + static_cast<int>(gridDim.x);
        else return atomicAdd(tile_counter, 1) + static_cast<int>(gridDim.x);
    }
    // Called by each CTA's producer once it has run out of tiles: the last one resets the counter for the
    // next launch.
    __device__ __forceinline__ void retire(int* tile_counter) const {
        if (atomicAdd(tile_counter + 1, 1) == static_cast<int>(gridDim.x) - 1) {
            tile_counter[0] = 0;
            tile_counter[1] = 0;
        }
    }
};
