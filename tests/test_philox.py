"""CPU-only: dropout's generator. cuflash.philox against Random123's known answers; kernels_cu/common/philox.cuh,
built as host C++, against cuflash.philox bit for bit; and the keep rule's statistics."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cuflash import philox
from cuflash.compile import load_source
from host_cxx import run_header

# Random123's kat_vectors, "philox4x32 10": counter (4 words), key (2 words), result (4 words).
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", KNOWN_ANSWERS)
def test_numpy_philox_known_answers(counter, key, expected):
    assert tuple(int(x) for x in philox.philox4x32_10(counter, key)) == expected


def _host_program(tmp_path, body: str) -> str:
    return run_header(tmp_path, "common/philox.cuh", body)


def test_header_matches_known_answers_and_numpy(tmp_path):
    rng = np.random.default_rng(7)
    cases = [(c, k) for c, k, _ in KNOWN_ANSWERS] + [
        (tuple(int(x) for x in rng.integers(0, 2**32, 4)), tuple(int(x) for x in rng.integers(0, 2**32, 2)))
        for _ in range(20)]
    body = "\n".join(
        f"{{ PhiloxWords r = philox4x32_10(PhiloxWords{{{c[0]}u, {c[1]}u, {c[2]}u, {c[3]}u}}, {k[0]}u, {k[1]}u);"
        f' printf("%u %u %u %u\\n", r.x, r.y, r.z, r.w); }}' for c, k in cases)
    lines = _host_program(tmp_path, body).split("\n")
    for (c, k), line in zip(cases, lines):
        assert tuple(int(x) for x in line.split()) == tuple(int(x) for x in philox.philox4x32_10(c, k))
    for (_, _, expected), line in zip(KNOWN_ANSWERS, lines):
        assert tuple(int(x) for x in line.split()) == expected


@pytest.mark.parametrize("seed,offset,p", [(0, 0, 0.1), (2**63 + 12345, 7, 0.5), (99, 2**40 + 3, 0.9)])
def test_header_keep_flags_match_numpy_mask(tmp_path, seed, offset, p):
    """Every element of odd-sized blocks (rows and columns past several 16-wide units, GQA-like head counts)."""
    batch, heads, nq, nk = 2, 3, 37, 45
    mask = philox.dropout_keep_mask(seed, offset, batch, heads, nq, nk, p)
    thr = philox.dropout_threshold(p)
    body = (f"for (int b = 0; b < {batch}; ++b) for (int h = 0; h < {heads}; ++h) {{"
            f" DropoutStream s({seed}ull, {offset}ull, b * {heads} + h, {thr}u);"
            f" for (int i = 0; i < {nq}; ++i) {{ for (int j = 0; j < {nk}; ++j) putchar(s.keep(i, j) ? '1' : '0');"
            f" putchar('\\n'); }} }}")
    rows = _host_program(tmp_path, body).split()
    got = np.array([[c == "1" for c in row] for row in rows]).reshape(batch, heads, nq, nk)
    np.testing.assert_array_equal(got, mask)


def test_unit_covers_a_thread_of_the_accumulator_layout():
    """The 8 slots of one unit are the 8 elements that lane (g, c) holds of a 16 x 16 score block."""
    for g in range(8):
        for c in range(4):
            rows, cols = (g, g + 8), (2 * c, 2 * c + 1, 8 + 2 * c, 9 + 2 * c)
            units = {((i >> 4) * 8 + (i & 7), (j >> 4) * 4 + ((j & 7) >> 1)) for i in rows for j in cols}
            slots = {((i >> 3) & 1) * 4 + ((j >> 3) & 1) * 2 + (j & 1) for i in rows for j in cols}
            assert len(units) == 1 and slots == set(range(8))


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_rate_within_binomial_bounds(p):
    mask = philox.dropout_keep_mask(1234, 0, 2, 4, 257, 300, p)
    n = mask.size
    rate = mask.mean()
    keep = 1.0 - philox.dropout_threshold(p) / 65536.0
    assert abs(keep - (1 - p)) <= 2.0 ** -17
    assert abs(rate - keep) < 5 * math.sqrt(keep * (1 - keep) / n)
    # Streams differ: another head, another offset, another seed are (nearly) independent draws.
    for other in (philox.dropout_keep_mask(1234, 1, 2, 4, 257, 300, p), philox.dropout_keep_mask(1235, 0, 2, 4, 257, 300, p)):
        agree = (other == mask).mean()
        expected = keep * keep + (1 - keep) * (1 - keep)
        assert abs(agree - expected) < 5 * math.sqrt(expected * (1 - expected) / n)
    agree = (mask[0, 0] == mask[0, 1]).mean()
    assert abs(agree - (keep**2 + (1 - keep) ** 2)) < 5 * math.sqrt(0.25 / mask[0, 0].size)


def test_same_arguments_same_mask_and_bad_arguments_raise():
    a = philox.dropout_keep_mask(5, 6, 1, 2, 33, 17, 0.25)
    np.testing.assert_array_equal(a, philox.dropout_keep_mask(5, 6, 1, 2, 33, 17, 0.25))
    assert philox.dropout_keep_mask(5, 6, 1, 2, 33, 17, 0.0).all()
    with pytest.raises(ValueError, match="dropout_p"):
        philox.dropout_keep_mask(5, 6, 1, 2, 3, 3, 1.0)
    with pytest.raises(TypeError, match="seed"):
        philox.dropout_keep_mask(5.0, 6, 1, 2, 3, 3, 0.1)
    with pytest.raises(ValueError, match="offset"):
        philox.dropout_keep_mask(5, -1, 1, 2, 3, 3, 0.1)


def test_header_compiles_for_the_device():
    """Through NVRTC for sm_80, as the kernels include it."""
    from cupy.cuda import nvrtc

    src = load_source("common/philox.cuh") + (
        '\nextern "C" __global__ void probe(unsigned* out, unsigned long long seed) {'
        " DropoutStream s(seed, 3ull, blockIdx.x, 6554u);"
        " out[threadIdx.x] = s.unit_keep(threadIdx.x, threadIdx.y); }\n")
    prog = nvrtc.createProgram(src, "philox_probe.cu", [], [])
    try:
        nvrtc.compileProgram(prog, ["-arch=compute_80", "-std=c++17"])
    except nvrtc.NVRTCError as e:
        raise AssertionError(nvrtc.getProgramLog(prog)) from e
    finally:
        nvrtc.destroyProgram(prog)
