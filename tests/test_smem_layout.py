"""CPU-only: kernels_cu/sm80/layout.cuh, the portable backward's shared-memory rows, built as host C++: every
element its own place, the steps the kernels take from a thread's first element equal to the offsets they stand
for, and ldmatrix phases and fragment stores free of bank conflicts."""
from __future__ import annotations

import pytest

from host_cxx import run_header

# For each layout: a 16-row tile of its width. Slices of W columns (powers of two) starting at multiples of W, as
# warp_mma_smem, store_p_ds and store_dkdv walk them: ldmatrix lanes start at a half (+0 / +8) and step by 16
# columns, fragment stores start at an even column of a block and step by 8.
CHECKS = r"""
template <class L, int kCols>
int check(const char* name) {
    int bad = 0;
    static int seen[16 * 136];
    for (int i = 0; i < 16 * L::kStride; ++i) seen[i] = 0;
    for (int r = 0; r < 16; ++r)
        for (int c = 0; c < kCols; ++c) {
            const int off = L::offset(r, c);
            if (off < r * L::kStride || off >= (r + 1) * L::kStride || seen[off]++) { ++bad; printf("%s place %d %d\n", name, r, c); }
            if (c % 8 && off != L::offset(r, c - 1) + 1) { ++bad; printf("%s chunk %d %d\n", name, r, c); }
        }
    const unsigned base = 4096u + 5u * 2u * L::kStride;   // a tile aligned to a row only
    for (int width = 16; width <= kCols; width *= 2)
        for (int w = 0; w < kCols / width; ++w)
            for (int r = 0; r < 8; ++r)
                for (int dr = 0; dr + r < 16; dr += 8) {
                    for (int half = 0; half < 2; ++half)   // ldmatrix
                        for (int dc = 0; dc < width; dc += 16) {
                            const int c = w * width + half * 8;
                            const int want = L::offset(r + dr, c + dc);
                            if (L::step(L::offset(r, c), dr, dc) != want
                                || L::step_bytes(base + 2u * L::offset(r, c), dr, dc) != base + 2u * want) {
                                ++bad; printf("%s ldmatrix step w%d %d %d +%d +%d\n", name, width, r, c, dr, dc);
                            }
                        }
                    for (int e = 0; e < 8; e += 2)   // fragment stores
                        for (int dc = 0; dc < width; dc += 8) {
                            const int c = w * width + e;
                            if (L::step(L::offset(r, c), dr, dc) != L::offset(r + dr, c + dc)) {
                                ++bad; printf("%s store step w%d %d %d +%d +%d\n", name, width, r, c, dr, dc);
                            }
                        }
                }
    // An ldmatrix phase: eight rows' same 16-byte chunk, eight different 4-bank groups.
    for (int r0 = 0; r0 < 16; r0 += 8)
        for (int c = 0; c < kCols; c += 8) {
            unsigned groups = 0;
            for (int r = r0; r < r0 + 8; ++r) groups |= 1u << ((2 * L::offset(r, c) / 16) % 8);
            if (groups != 0xffu) { ++bad; printf("%s ldmatrix conflict rows %d chunk %d\n", name, r0, c / 8); }
        }
    // A fragment store: lane (g, t4) writes 4 bytes at (row g, column 2 t4) of an 8 x 8 block, 32 different banks.
    for (int c0 = 0; c0 < kCols; c0 += 8) {
        unsigned long long banks = 0;
        for (int g = 0; g < 8; ++g)
            for (int t4 = 0; t4 < 4; ++t4) banks |= 1ull << ((2 * L::offset(g, c0 + 2 * t4) / 4) % 32);
        if (banks != 0xffffffffull) { ++bad; printf("%s store conflict chunk %d\n", name, c0 / 8); }
    }
    return bad;
}
"""


@pytest.mark.parametrize("cols", [64, 128])
@pytest.mark.parametrize("kind", ["swizzled", "padded"])
def test_smem_rows(tmp_path, cols, kind):
    layout = f"SmemRowsSwizzled<{cols}>" if kind == "swizzled" else f"SmemRows<{cols + 8}>"
    header = "sm80/layout.cuh"
    body = f'int bad = check<{layout}, {cols}>("{layout}"); printf("bad %d\\n", bad);'
    out = run_header(tmp_path, header, body, prelude=CHECKS)
    assert out.strip().endswith("bad 0"), out


def test_rows16_picks_the_swizzle_where_it_fits(tmp_path):
    body = ('printf("%d %d %d %d\\n", SmemRows16<64, true>::kStride, SmemRows16<128, true>::kStride, '
            'SmemRows16<96, true>::kStride, SmemRows16<128, false>::kStride);')
    assert run_header(tmp_path, "sm80/layout.cuh", body).split() == ["64", "128", "104", "136"]
