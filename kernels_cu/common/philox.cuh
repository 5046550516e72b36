// Dropout's random bits: Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011),
// a counter-based generator, so that the backward regenerates the forward's keep mask from the element's
// coordinates instead of storing it. cuflash/philox.py is the NumPy twin of every function here; the tests
// check both against Random123's known answers and against each other (this header also compiles as host C++).
//
// The keep mask of one (batch, head) is cut into units of 8 elements, one Philox call each, 16 bits per element:
//   row_unit = (i / 16) * 8 + i % 8,   col_unit = (j / 16) * 4 + (j % 8) / 2,
//   slot     = ((i / 8) % 2) * 4 + ((j / 8) % 2) * 2 + j % 2        (word slot / 2, low half first),
// for query row i and key column j (local to the sequence). That unit is exactly what one thread holds of a
// 16 x 16 score block in the mma.sync / wgmma accumulator layout (rows g, g + 8; columns 2c, 2c + 1, 8 + 2c,
// 9 + 2c), so a forward thread makes one call per block; a kernel holding S^T (keys as rows) needs two calls per
// block and uses half of each. counter = (row_unit, col_unit, batch * heads + head, offset_lo), key = (seed_lo,
// seed_hi ^ offset_hi). An element is kept when its 16 bits are >= threshold = round(dropout_p * 65536): kept
// with probability 1 - threshold / 65536, dropout_p to within 2^-17.
#pragma once

#ifndef CUFLASH_HD
#define CUFLASH_HD __host__ __device__ __forceinline__
#endif

struct PhiloxWords {
    unsigned x, y, z, w;
};

CUFLASH_HD void philox_mulhilo(unsigned a, unsigned b, unsigned& hi, unsigned& lo) {
#ifdef __CUDA_ARCH__
    lo = a * b;
    hi = __umulhi(a, b);
#else
    const unsigned long long p = static_cast<unsigned long long>(a) * b;
    lo = static_cast<unsigned>(p);
    hi = static_cast<unsigned>(p >> 32);
#endif
}

// Philox4x32 with 10 rounds: the key is bumped by the Weyl constants between rounds.
CUFLASH_HD PhiloxWords philox4x32_10(PhiloxWords c, unsigned k0, unsigned k1) {
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        unsigned hi0, lo0, hi1, lo1;
        philox_mulhilo(0xD2511F53u, c.x, hi0, lo0);
        philox_mulhilo(0xCD9E8D57u, c.z, hi1, lo1);
        c = PhiloxWords{hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
    }
    return c;
}

// One (batch, head)'s dropout stream: the key and the counter words that do not depend on the element.
struct DropoutStream {
    unsigned key0, key1;   // seed_lo, seed_hi ^ offset_hi
    unsigned stream;       // batch * heads + head
    unsigned offset_lo;
    unsigned threshold;    // keep when the element's 16 bits are >= threshold (0 .. 65535)

    CUFLASH_HD DropoutStream(unsigned long long seed, unsigned long long offset, unsigned stream_,
                             unsigned threshold_)
        : key0(static_cast<unsigned>(seed)),
          key1(static_cast<unsigned>(seed >> 32) ^ static_cast<unsigned>(offset >> 32)),
          stream(stream_), offset_lo(static_cast<unsigned>(offset)), threshold(threshold_) {}

    // The 128 bits of unit (row_unit, col_unit): 8 elements of 16 bits.
    CUFLASH_HD PhiloxWords unit_bits(unsigned row_unit, unsigned col_unit) const {
        return philox4x32_10(PhiloxWords{row_unit, col_unit, stream, offset_lo}, key0, key1);
    }
    // The 8 keep flags of a unit, bit s for slot s.
    CUFLASH_HD unsigned unit_keep(unsigned row_unit, unsigned col_unit) const {
        const PhiloxWords r = unit_bits(row_unit, col_unit);
        const unsigned words[4] = {r.x, r.y, r.z, r.w};
        unsigned keep = 0;
#pragma unroll
        for (int s = 0; s < 8; ++s) {
            const unsigned bits = (words[s >> 1] >> (16 * (s & 1))) & 0xFFFFu;
            keep |= (bits >= threshold ? 1u : 0u) << s;
        }
        return keep;
    }

    CUFLASH_HD static unsigned row_unit(int i) { return static_cast<unsigned>((i >> 4) * 8 + (i & 7)); }
    CUFLASH_HD static unsigned col_unit(int j) { return static_cast<unsigned>((j >> 4) * 4 + ((j & 7) >> 1)); }
    CUFLASH_HD static int slot(int i, int j) { return ((i >> 3) & 1) * 4 + ((j >> 3) & 1) * 2 + (j & 1); }

    // One element's flag (a whole Philox call for one bit: for tests and rare paths, not for kernels' tiles).
    CUFLASH_HD bool keep(int i, int j) const {
        return (unit_keep(row_unit(i), col_unit(j)) >> slot(i, j)) & 1u;
    }
};
