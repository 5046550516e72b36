"""CPU-only: the software e4m3 conversions (kernels_cu/common/e4m3.cuh, for GPUs before sm_89), built as host C++,
against ml_dtypes: every byte to fp16, and floats to bytes (round to nearest even, saturating) at every boundary and
on random values of every scale."""
from __future__ import annotations

import numpy as np

from host_cxx import run_header


def _run(tmp_path, body: str, stdin: str = "") -> str:
    return run_header(tmp_path, "common/e4m3.cuh", body, stdin)


def test_every_byte_to_fp16(tmp_path):
    import ml_dtypes

    got = np.array(_run(tmp_path, 'for (int b = 0; b < 256; ++b) printf("%u\\n", e4m3_to_f16_bits(b));').split(),
                   dtype=np.uint16)
    want = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float16)
    nan = np.isnan(want)
    assert nan.sum() == 2 and np.isnan(got.view(np.float16)[nan]).all()
    np.testing.assert_array_equal(got[~nan], want.view(np.uint16)[~nan])


def test_floats_to_bytes(tmp_path):
    import ml_dtypes

    rng = np.random.default_rng(8)
    codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    finite = codes[np.isfinite(codes)]
    mids = (np.sort(finite)[1:] + np.sort(finite)[:-1]) / 2          # every tie between neighbours
    near = np.concatenate([np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, -np.float32(np.inf))])
    xs = np.concatenate([finite, mids, near, rng.standard_normal(4000) * 10.0 ** rng.uniform(-5, 3, 4000),
                         [447.9, 448.0, 448.1, 463.9, 464.0, 500.0, 1e30, -1e30, 2.0 ** -10, 2.0 ** -11, 1e-30, 0.0,
                          -0.0, 2.0 ** -6, 2.0 ** -7 * 3]]).astype(np.float32)
    body = ('unsigned u; float f; while (scanf("%u", &u) == 1) { __builtin_memcpy(&f, &u, 4);'
            ' printf("%u\\n", f32_to_e4m3(f)); }')
    got = np.array(_run(tmp_path, body, "\n".join(str(v) for v in xs.view(np.uint32))).split(), dtype=np.uint8)
    want = np.clip(xs, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)   # satfinite: clamp, then round
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, [(float(xs[i]), int(got[i]), int(want[i])) for i in bad[:10]]
    nan = _run(tmp_path, 'printf("%u %u\\n", f32_to_e4m3(__builtin_nanf("")), f32_to_e4m3(-__builtin_nanf("")));')
    assert nan.split() == ["127", "255"]
