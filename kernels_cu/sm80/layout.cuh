// Shared-memory layouts of row-major tiles: where element (row, col) lives, and how an address steps by whole
// 8 x 8 blocks (an ldmatrix's or a fragment store's constant offsets from a thread's first element).
#pragma once
#ifndef CUFLASH_HD   // (tests/test_smem_layout.py builds this header as host C++)
#define CUFLASH_HD __host__ __device__ __forceinline__
#endif
#include "../common/pick_type.cuh"

// Rows kStride elements apart: a tile of fewer columns padded (16-bit rows by 16 bytes keep ldmatrix and the
// fragment stores free of bank conflicts).
template <int kStride_>
struct SmemRows {
    static constexpr int kStride = kStride_;
    static constexpr int kRowPeriod = 1;   // rows after which the column placement repeats
    static CUFLASH_HD int offset(int row, int col) { return row * kStride + col; }
    // The offset dr rows and dc columns on from offset off (dr, dc multiples of 8).
    static CUFLASH_HD int step(int off, int dr, int dc) { return off + dr * kStride + dc; }
    // The same on 16-bit elements' shared-window byte addresses.
    static CUFLASH_HD unsigned step_bytes(unsigned addr, int dr, int dc) { return addr + (dr * kStride + dc) * 2; }
};

// 16-bit rows of kCols elements (64 or 128: 128 or 256 bytes) without padding; chunk c (16 bytes) of row r lies
// at chunk c ^ (r % 8), so the same chunk of eight consecutive rows (an ldmatrix phase) meets eight different
// bank groups (FlashAttention-2's layout). A tile takes kRows x kCols elements where the padded one takes
// kRows x (kCols + 8): at d=128 the 99 KB cards' dK / dV tiles fit this way only.
// step / step_bytes need dc's chunk bits clear in the starting column (col / 8 and dc / 8 add as an XOR): true
// of a warp's slice of a power-of-two number of 8-column blocks that starts at a multiple of its width, stepped
// within itself; step_bytes needs the tile's base address aligned to a row.
template <int kCols>
struct SmemRowsSwizzled {
    static_assert(kCols == 64 || kCols == 128, "swizzled rows are 128 or 256 bytes");
    static constexpr int kStride = kCols;
    static constexpr int kRowPeriod = 8;
    static CUFLASH_HD int offset(int row, int col) {
        return row * kCols + ((((col >> 3) ^ row) & 7) | ((col >> 3) & ~7)) * 8 + (col & 7);
    }
    static CUFLASH_HD int step(int off, int dr, int dc) { return (off ^ dc) + dr * kCols; }
    static CUFLASH_HD unsigned step_bytes(unsigned addr, int dr, int dc) {
        return (addr ^ static_cast<unsigned>(dc * 2)) + static_cast<unsigned>(dr * kCols * 2);
    }
};

// The rows of a 16-bit tile of kCols columns: swizzled where the layout allows it and kSwizzle asks, else padded.
template <int kCols, bool kSwizzle>
using SmemRows16 = typename PickType<kSwizzle && (kCols == 64 || kCols == 128), SmemRowsSwizzled<kCols>,
                                     SmemRows<kCols + 8>>::type;
