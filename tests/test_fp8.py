"""fp8 (e4m3) forward on Hopper: quantisation, V^T layout, attention against the float64 reference
of the dequantised inputs, argument checks. CPU parts: compile + SASS of every instantiation,
the NumPy quantisation reference, and the checks that need no device."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import LSE_RTOL_FP8, assert_lse_matches, planned_cc, requires_gpu
from cuflash import heuristics, options
from cuflash.config import KernelConfig

# ||out - ref|| / ||ref|| against float64 attention of the dequantised inputs. The error comes from
# rounding P to e4m3 (3 mantissa bits: ~3.6 % rms per element; ~2.4 % of the output norm for random
# inputs in a float64 simulation at D=64 and 128, N=1024); the lse comes from exact fp8 products summed
# by the fp8 tensor cores (conftest.LSE_RTOL_FP8).
FP8_TOL = 0.04


def _quantize_ref(x: np.ndarray):
    """NumPy mirror of cuflash.quantize_fp8: (e4m3 bytes, descale)."""
    import ml_dtypes

    x = x.astype(np.float32)
    amax = np.float32(np.abs(x).max()) if x.size else np.float32(0)
    descale = np.float32(amax / np.float32(448)) if amax > 0 else np.float32(1)
    x8 = np.clip(x / descale, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return x8.view(np.uint8), descale


def _dequantize(x8: np.ndarray, descale) -> np.ndarray:
    import ml_dtypes

    return x8.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * float(descale)


def _vt_key(kp: int) -> int:
    """Mirror of fp8_vt_key (kernels_cu/aux/fp8.cu): V^T position within a 32-key step -> key."""
    r = kp & 15
    return (kp & 16) + 2 * (r >> 2) + (r & 1) + 8 * ((r >> 1) & 1)


def test_vt_key_order_is_a_permutation_matching_the_fragments():
    """Position 4t + i (+16) of a step holds the accumulator key of thread t's i-th value: keys
    2t, 2t+1 of the step's first and second 8-key blocks (third and fourth for +16)."""
    order = [_vt_key(kp) for kp in range(32)]
    assert sorted(order) == list(range(32))
    for t in range(4):
        assert order[4 * t:4 * t + 4] == [2 * t, 2 * t + 1, 8 + 2 * t, 9 + 2 * t]
        assert order[16 + 4 * t:20 + 4 * t] == [16 + 2 * t, 17 + 2 * t, 24 + 2 * t, 25 + 2 * t]


def test_quantize_reference_round_trip():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 77, 5)).astype(np.float32) * 3
    x8, descale = _quantize_ref(x)
    assert descale == np.float32(np.abs(x).max() / 448)
    back = _dequantize(x8, descale)
    assert np.abs(back).max() <= np.abs(x).max() * (1 + 1e-6)
    assert np.linalg.norm(back - x) / np.linalg.norm(x) < 0.04   # 3 mantissa bits


def test_fp8_configs_cover_every_head_dim():
    for d in range(16, 257, 16):
        for causal in (False, True):
            for short in (False, True):
                cfg = heuristics.fp8_fwd_config(d, causal, short)
                assert cfg.family in ("sm90_fwd_fp8", "sm90_fwd_fp8_p") and cfg.block_n % 128 == 0


def test_fp8_persistent_kernels(monkeypatch):
    """Persistent at head dims <= 128 at every length; short sequences also at causal 192."""
    options.use(options.Options())
    for d, causal, persistent in ((64, False, True), (64, True, True), (128, False, True), (128, True, True),
                                  (192, False, False), (192, True, True), (256, False, False), (256, True, False)):
        short = heuristics.fp8_fwd_config(d, causal, short=True)
        assert short.family == ("sm90_fwd_fp8_p" if persistent else "sm90_fwd_fp8"), (d, causal)
    assert heuristics.fp8_fwd_config(64, True, short=True).block_m == 128  # 192 rows: slower under the mask
    for d in (64, 128):
        for causal in (False, True):
            assert heuristics.fp8_fwd_config(d, causal).family == "sm90_fwd_fp8_p"
    assert heuristics.fp8_fwd_config(192, True).family == "sm90_fwd_fp8"
    assert heuristics.fp8_fwd_config(256, True).family == "sm90_fwd_fp8"
    options.set(sm90_fp8_persistent=False)
    assert heuristics.fp8_fwd_config(64, False).family == "sm90_fwd_fp8"


def test_fp8_instantiations_compile_without_spills():
    from compile_checks import assert_all_compile

    assert_all_compile(heuristics.all_fp8_fwd_configs(), "90a", no_warnings=True)


@pytest.mark.parametrize("family,dtype", [("fp8_transpose_v", "float8_e4m3fn"), ("fp8_amax", "float16"),
                                          ("fp8_amax", "bfloat16"), ("fp8_amax", "float32"),
                                          ("fp8_quantize", "float16"), ("fp8_quantize", "bfloat16"),
                                          ("fp8_quantize", "float32")])
@pytest.mark.parametrize("cc", ["89", "90"])
def test_fp8_helpers_compile(family, dtype, cc):
    from compile_checks import assert_all_compile

    assert_all_compile([KernelConfig(family, dtype, 0, False, 0, 0, 8)], cc, no_warnings=True)


def _fp8_sass_configs():
    return [heuristics.fp8_fwd_config(d, causal) for d in heuristics.TUNED_HEAD_DIMS for causal in (False, True)]


@pytest.mark.parametrize("cfg", _fp8_sass_configs(), ids=lambda c: c.key())
def test_fp8_sass_uses_qgmma_without_local_memory(cfg):
    """Hopper's fp8 warpgroup MMA disassembles as QGMMA (HGMMA is the 16-bit one)."""
    from sass_tools import opcode_counts, sass, tools_available

    missing = tools_available()
    if missing:
        pytest.skip(f"SASS tools not found ({missing})")
    ops = opcode_counts(sass(cfg, "90a"))
    assert ops["QGMMA"] > 0, f"no QGMMA in {cfg.key()}: {ops.most_common(10)}"
    assert ops["HGMMA"] == 0 and ops["HMMA"] == 0
    assert ops["LDL"] == 0 and ops["STL"] == 0, f"local memory traffic in {cfg.key()}"


def test_host_arrays_rejected_without_a_device():
    import cuflash

    x = np.zeros((1, 4, 1, 64), dtype=np.uint8)
    with pytest.raises(TypeError, match="q must be a cupy.ndarray"):
        cuflash.forward_fp8(x, x, x, 1.0, 1.0, 1.0)
    with pytest.raises(TypeError, match="x must be a cupy.ndarray"):
        cuflash.quantize_fp8(np.ones(4, dtype=np.float32))


# ---------------------------------------------------------------------------
# GPU (compute capability 9.0)


def _hopper():
    if planned_cc() != 90:
        pytest.skip("the fp8 forward needs compute capability 9.0")


def _rand_fp8(rng, shape):
    """Random e4m3 inputs with their descale, quantised on the device; and the dequantised float64."""
    import cupy
    import cuflash

    x = cupy.asarray(rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.5, 4))
    x8, descale = cuflash.quantize_fp8(x)
    return x8, descale, _dequantize(x8.get(), descale.get()[0])


def check_fp8(rng, b, nq, nk, hq, hkv, d, causal, scale=None, float_descales=False):
    import cupy
    import cuflash
    from cuflash.reference import attention_reference, rel_err

    q8, dq, qf = _rand_fp8(rng, (b, nq, hq, d))
    k8, dk, kf = _rand_fp8(rng, (b, nk, hkv, d))
    v8, dv, vf = _rand_fp8(rng, (b, nk, hkv, d))
    if float_descales:
        dq, dk, dv = (float(x.get()[0]) for x in (dq, dk, dv))
    out = cupy.empty(q8.shape, dtype=cuflash.api._checks.BFLOAT16)
    out.fill(np.nan)
    o, lse = cuflash.forward_fp8(q8, k8, v8, dq, dk, dv, causal=causal, softmax_scale=scale, return_lse=True,
                                 out=out)
    assert o is out
    cupy.cuda.get_current_stream().synchronize()
    ref_o, ref_lse = attention_reference(qf, kf, vf, causal=causal, softmax_scale=scale)
    err = rel_err(o, ref_o)
    assert err <= FP8_TOL, f"out rel err {err:.3e} > {FP8_TOL}"
    assert_lse_matches(lse, ref_lse, (b, hq, nq), rtol=LSE_RTOL_FP8)
    return err


@requires_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("shape", [(1,), (3,), (5, 7), (2, 33, 3, 64), (1000, 1003)])
def test_quantize_matches_numpy(rng, dtype, shape):
    import cupy
    import cuflash
    from conftest import dtype_of

    _hopper()
    host = (rng.standard_normal(shape) * 5).astype(np.float32).astype(dtype_of(dtype))
    x8, descale = cuflash.quantize_fp8(cupy.asarray(host))
    ref8, ref_descale = _quantize_ref(host.astype(np.float32))
    assert x8.dtype == np.uint8 and x8.shape == tuple(shape) and descale.shape == (1,)
    assert np.float32(descale.get()[0]) == ref_descale
    np.testing.assert_array_equal(x8.get(), ref8)


@requires_gpu
def test_quantize_zeros_and_nan():
    import cupy
    import cuflash

    _hopper()
    x8, descale = cuflash.quantize_fp8(cupy.zeros((3, 5), dtype=np.float16))
    assert descale.get()[0] == 1.0 and not x8.get().any()
    x = cupy.ones(100, dtype=np.float32)
    x[17] = np.nan
    _, descale = cuflash.quantize_fp8(x)
    assert np.isnan(descale.get()[0]), "a NaN input must not give a finite scale"


@requires_gpu
@pytest.mark.parametrize("offset", [8, 16])
@pytest.mark.parametrize("nk", [1, 31, 32, 100, 257])
def test_transpose_v_layout(rng, nk, offset):
    import cupy
    from cuflash import fp8

    _hopper()
    base = cupy.asarray(rng.integers(0, 256, (2, nk, 3, 80), dtype=np.uint8))
    # strided (row stride 240 bytes, head stride 80); offset 8 is not 16-byte aligned (copied first)
    v = base[..., offset:offset + 64]
    pad = -(-nk // 32) * 32
    vt = fp8.transpose_v(v, pad).get()
    host = v.get()
    expect = np.zeros((2, 3, 64, pad), dtype=np.uint8)
    for pos in range(pad):
        key = (pos & ~31) + _vt_key(pos & 31)
        if key < nk:
            expect[:, :, :, pos] = host[:, key]
    np.testing.assert_array_equal(vt, expect)


@requires_gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("nq,nk", [(128, 128), (1000, 1000), (113, 203), (203, 113), (1, 239), (239, 1)])
def test_forward_main_head_dims(rng, causal, d, nq, nk):
    _hopper()
    check_fp8(rng, 2, nq, nk, 2, 2, d, causal)


@requires_gpu
@pytest.mark.parametrize("d", [16, 48, 80, 96, 144, 192, 240])
def test_forward_other_head_dims(rng, d):
    _hopper()
    check_fp8(rng, 1, 190, 257, 2, 2, d, causal=False)
    check_fp8(rng, 1, 257, 190, 2, 1, d, causal=True)


@requires_gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 192, 256])
def test_forward_past_short_sequences(rng, causal, d):
    # seqlen_q > 1024: the kernels for longer sequences (shorter ones take heuristics._SM90_FWD_FP8_SHORT)
    _hopper()
    check_fp8(rng, 1, 1100, 1237, 2, 1, d, causal)


@requires_gpu
@pytest.mark.parametrize("causal", [False, True])
def test_forward_gqa_long(rng, causal):
    _hopper()
    check_fp8(rng, 1, 2049, 2049, 8, 2, 128, causal)


@requires_gpu
def test_forward_persistent_waves_and_scale(rng):
    _hopper()
    check_fp8(rng, 1, 4096, 4096, 9, 3, 128, True, scale=0.05)
    check_fp8(rng, 3, 1500, 1500, 37, 37, 64, False, float_descales=True)


@requires_gpu
def test_forward_empty_keys():
    import cupy
    import cuflash

    _hopper()
    q = cupy.ones((1, 5, 2, 64), dtype=np.uint8)
    k = cupy.ones((1, 0, 2, 64), dtype=np.uint8)
    o, lse = cuflash.forward_fp8(q, k, k, 1.0, 1.0, 1.0, return_lse=True)
    assert not o.get().astype(np.float32).any() and np.isneginf(lse.get()).all()


@requires_gpu
def test_forward_errors():
    import cupy
    import cuflash

    _hopper()
    q = cupy.ones((1, 8, 2, 64), dtype=np.uint8)
    with pytest.raises(TypeError, match="e4m3 bytes"):
        cuflash.forward_fp8(q.astype(np.float16), q, q, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="multiple of 16"):
        x = cupy.ones((1, 8, 2, 72), dtype=np.uint8)
        cuflash.forward_fp8(x, x, x, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="descale_k must be positive"):
        cuflash.forward_fp8(q, q, q, 1.0, -2.0, 1.0)
    with pytest.raises(TypeError, match="descale_v must be a float32"):
        cuflash.forward_fp8(q, q, q, 1.0, 1.0, cupy.ones(2, dtype=np.float32))
    with pytest.raises(ValueError, match="same shape"):
        cuflash.forward_fp8(q, q, q[:, :4], 1.0, 1.0, 1.0)
    with pytest.raises(TypeError, match="out must have dtype"):
        cuflash.forward_fp8(q, q, q, 1.0, 1.0, 1.0, out=cupy.empty(q.shape, dtype=np.float16))
