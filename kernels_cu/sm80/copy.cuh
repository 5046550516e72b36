// Global -> shared tile copies with cp.async (sm_80+), 16 bytes per thread per step.
#pragma once
#include "../common/numeric.cuh"
#include "layout.cuh"

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
    // src-size 0 zero-fills the destination: rows past the sequence end read nothing.
    const u32 dst = static_cast<u32>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(dst), "l"(gmem), "r"(valid ? 16 : 0));
}

// The same with src_bytes (0..16) read and the rest of the 16 bytes zero-filled.
__device__ __forceinline__ void cp_async_16_bytes(void* smem, const void* gmem, int src_bytes) {
    const u32 dst = static_cast<u32>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(gmem), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }

template <int kPending>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(kPending)); }

// A tile copy in a fixed number of steps, each thread at one 16-byte column (col_valid: that column is inside the
// tensor) and rows kThreads / chunks-per-row apart, so that a step costs a 64-bit add and a compare, not a division
// of the thread's chunk index and a run-time trip count: the portable kernels are bound by instruction issue, and
// the copies' integer work was a third of their key loops. Rows >= rows_valid and an invalid column are zero-filled.
// Layout: the shared tile's (layout.cuh); a thread's rows keep their column placement (kRowStep a multiple of its
// kRowPeriod), so that its swizzle folds to a constant.
template <typename T, int kRows, int kCols, class Layout, int kThreads>
__device__ __forceinline__ void copy_rows_fixed_steps(T* smem, const T* gmem, i64 row_stride, int rows_valid,
                                                      bool col_valid, int tid) {
    constexpr int kChunk = 16 / static_cast<int>(sizeof(T));
    constexpr int kChunksPerRow = kCols / kChunk;
    constexpr int kChunks = kRows * kChunksPerRow;
    constexpr int kRowStep = kThreads / kChunksPerRow;
    const int row0 = static_cast<int>(static_cast<unsigned>(tid) / kChunksPerRow);
    const int col = static_cast<int>(static_cast<unsigned>(tid) % kChunksPerRow) * kChunk;
    static_assert(kRowStep % Layout::kRowPeriod == 0, "a thread's rows must keep their column placement");
    const T* src = gmem + row0 * row_stride + col;
    T* const dst0 = smem + Layout::offset(row0, col);   // swizzled rows: whole rows on from the first
    const i64 step = kRowStep * row_stride;
#pragma unroll
    for (int i = 0; i < (kChunks + kThreads - 1) / kThreads; ++i) {
        const int row = row0 + i * kRowStep;
        if (kChunks % kThreads == 0 || row < kRows) {
            const bool valid = col_valid && row < rows_valid;
            // (Padded rows keep the address form the forward was tuned with: ptxas schedules the two differently.)
            T* const dst = Layout::kRowPeriod == 1 ? smem + row * Layout::kStride + col
                                                   : dst0 + i * kRowStep * Layout::kStride;
            cp_async_16(dst, valid ? src : gmem, valid);
        }
        src += step;
    }
}

// Copy rows [0, kRows) x cols [0, kCols) of a 16-bit tile; rows >= rows_valid are zero-filled.
// gmem points at row 0; consecutive rows are row_stride elements apart.
template <int kRows, int kCols, class Layout, int kThreads>
__device__ __forceinline__ void load_tile_async(u16* smem, const u16* gmem, i64 row_stride,
                                                int rows_valid, int tid) {
    // Make the stride opaque here, so the per-chunk offsets are recomputed at each
    // call (a few IMADs) instead of being hoisted out of the main loop, where
    // they would stay live (in registers) for the kernel's whole life.
    asm volatile("" : "+l"(row_stride), "+r"(tid));
    constexpr int kChunksPerRow = kCols / 8;
    constexpr int kChunks = kRows * kChunksPerRow;
    if constexpr (kThreads % kChunksPerRow == 0) {
        copy_rows_fixed_steps<u16, kRows, kCols, Layout, kThreads>(smem, gmem, row_stride, rows_valid, true, tid);
    } else {
#pragma unroll
        for (int c = tid; c < kChunks; c += kThreads) {
            const int row = c / kChunksPerRow;
            const int col = (c % kChunksPerRow) * 8;
            const bool valid = row < rows_valid;
            const u16* src = gmem + (valid ? row * row_stride + col : 0);
            static_assert(Layout::kRowPeriod == 1, "swizzled tiles take the fixed steps");
            cp_async_16(smem + row * Layout::kStride + col, src, valid);
        }
    }
}

// Zero the padding columns [kCols, kColsPad) once; tile loads never touch them.
template <int kRows, int kCols, int kColsPad, int kSmemStride, int kThreads>
__device__ __forceinline__ void zero_pad_cols(u16* smem, int tid) {
    if constexpr (kColsPad > kCols) {
        constexpr int kPad = kColsPad - kCols;
        for (int i = tid; i < kRows * kPad; i += kThreads) {
            smem[(i / kPad) * kSmemStride + kCols + i % kPad] = 0;
        }
    }
}

// Store a 16-bit tile from shared memory to global in 16-byte chunks, rows < rows_valid.
template <int kRows, int kCols, class Layout, int kThreads>
__device__ __forceinline__ void store_tile(u16* gmem, const u16* smem, i64 row_stride,
                                           int rows_valid, int tid) {
    constexpr int kChunksPerRow = kCols / 8;
    constexpr int kChunks = kRows * kChunksPerRow;
#pragma unroll
    for (int c = tid; c < kChunks; c += kThreads) {
        const int row = c / kChunksPerRow;
        const int col = (c % kChunksPerRow) * 8;
        if (row < rows_valid) {
            static_assert(Layout::kRowPeriod == 1, "padded rows");
            *reinterpret_cast<uint4*>(gmem + row * row_stride + col) =
                *reinterpret_cast<const uint4*>(smem + row * Layout::kStride + col);
        }
    }
}

// Variants with a run-time column count, for kernels instantiated for a head-dim
// bucket (the backward): T is the element type (u16 or float), 16-byte chunks;
// cols_valid is a multiple of the chunk width (head_dim is a multiple of 8).
// Chunks at rows >= rows_valid or columns >= cols_valid are zero-filled.
template <typename T, int kRows, int kCols, class Layout, int kThreads>
__device__ __forceinline__ void load_tile_async_pred(T* smem, const T* gmem, i64 row_stride,
                                                     int rows_valid, int cols_valid, int tid) {
    constexpr int kChunk = 16 / static_cast<int>(sizeof(T));
    constexpr int kChunksPerRow = kCols / kChunk;
    constexpr int kChunks = kRows * kChunksPerRow;
    static_assert(kCols % kChunk == 0, "columns must be whole 16-byte chunks");
    // (16-bit tiles only: the float32 CUDA-core kernels keep the loop, under which their dQ kernel does not spill.)
    if constexpr (kThreads % kChunksPerRow == 0 && sizeof(T) == 2) {
        const int col = static_cast<int>(static_cast<unsigned>(tid) % kChunksPerRow) * kChunk;
        copy_rows_fixed_steps<T, kRows, kCols, Layout, kThreads>(smem, gmem, row_stride, rows_valid,
                                                                      col < cols_valid, tid);
    } else {
#pragma unroll
        for (int c = tid; c < kChunks; c += kThreads) {
            const int row = c / kChunksPerRow;
            const int col = (c % kChunksPerRow) * kChunk;
            const bool valid = row < rows_valid && col < cols_valid;
            const T* src = gmem + (valid ? row * row_stride + col : 0);
            static_assert(Layout::kRowPeriod == 1, "swizzled tiles take the fixed steps");
            cp_async_16(smem + row * Layout::kStride + col, src, valid);
        }
    }
}

// Store rows < rows_valid, columns < cols_valid of a tile in 16-byte chunks.
template <typename T, int kRows, int kCols, class Layout, int kThreads>
__device__ __forceinline__ void store_tile_pred(T* gmem, const T* smem, i64 row_stride,
                                                int rows_valid, int cols_valid, int tid) {
    constexpr int kChunk = 16 / static_cast<int>(sizeof(T));
    constexpr int kChunksPerRow = kCols / kChunk;
    constexpr int kChunks = kRows * kChunksPerRow;
#pragma unroll
    for (int c = tid; c < kChunks; c += kThreads) {
        const int row = c / kChunksPerRow;
        const int col = (c % kChunksPerRow) * kChunk;
        if (row < rows_valid && col < cols_valid) {
            *reinterpret_cast<uint4*>(gmem + row * row_stride + col) = *reinterpret_cast<const uint4*>(
                Layout::kRowPeriod == 1 ? smem + row * Layout::kStride + col : smem + Layout::offset(row, col));
        }
    }
}
