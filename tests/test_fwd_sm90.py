"""The Hopper forward (the tuned table, CUFLASH_FWD_BACKEND=sm90, and each kernel kind forced) against
the float64 reference (GPU, compute capability 9.0). tests/test_fwd.py runs the whole forward suite on
this path when the variable is set for the session."""
from __future__ import annotations

import pytest

from conftest import planned_cc, requires_gpu
from test_fwd import _check

pytestmark = requires_gpu


@pytest.fixture(autouse=True, params=["sm90", "sm90_overlap", "sm90_simple_p", "sm90_overlap_p",
                                      "sm90_overlap_x2", "sm90_overlap_x2_p", "sm90_split"])
def sm90_backend(request, monkeypatch):
    from cuflash import options

    if planned_cc() != 90:
        pytest.skip("needs compute capability 9.0 (sm_90a)")
    with options.override(fwd_backend=request.param, sm90_fwd_tiles=None):
        yield request.param


def test_selected(sm90_backend):
    from cuflash import api, heuristics

    import cupy

    _, cfg, _ = api._fwd_plan(cupy.dtype("float16"), 128, False, cupy.cuda.Device().id)
    if sm90_backend == "sm90":
        assert cfg.family in heuristics.SM90_FWD_FAMILIES.values()
    else:
        assert cfg.family == heuristics.SM90_FWD_FAMILIES[sm90_backend[len("sm90_"):]]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("nq,nk", [(128, 128), (1000, 1000), (113, 203), (203, 113), (1, 239), (239, 1)])
def test_main_head_dims(rng, dtype, causal, d, nq, nk):
    _check(rng, dtype, 2, nq, nk, 2, 2, d, causal)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [8, 40, 96, 136, 192, 256])
def test_other_head_dims(rng, dtype, d):
    _check(rng, dtype, 1, 190, 257, 2, 2, d, causal=False)
    _check(rng, dtype, 1, 257, 190, 2, 1, d, causal=True)


@pytest.mark.parametrize("causal", [False, True])
def test_gqa_long(rng, causal):
    _check(rng, "bfloat16", 1, 2049, 2049, 8, 2, 128, causal)


def test_persistent_sections(rng):
    """Several waves of tiles per SM; at d=256 and 4096 keys the causal order groups 6 of the 9
    heads per L2 section (the last section is partial)."""
    _check(rng, "bfloat16", 1, 4096, 4096, 9, 3, 256, True)
    _check(rng, "float16", 3, 1500, 1500, 37, 37, 64, False)


@pytest.mark.parametrize("d", [64, 128])
def test_causal_sections_of_many_heads(rng, d):
    """Short causal sequences of 111 (head, batch) pairs: the persistent order's sections hold at most 32
    pairs (kernels_cu/sm90/fwd.cu, CUFLASH_SM90_FWD_SECTION_HEADS), so four sections of 28, and unequal
    query / key lengths."""
    _check(rng, "bfloat16", 3, 300, 300, 37, 37, d, True)
    _check(rng, "float16", 3, 200, 333, 37, 37, d, True)


def test_unaligned_strides_fall_back(rng):
    """Row strides that are not multiples of 16 bytes cannot be TMA-loaded: the portable kernel runs."""
    from conftest import randn

    import cupy
    import cuflash
    from cuflash.reference import attention_reference, rel_err

    big = [randn(rng, (1, 100, 3, 72), "float16") for _ in range(3)]
    q, k, v = (x[..., :64] for x in big)  # row stride 3 * 72 * 2 = 432 bytes
    o = cuflash.forward(q, k, v)
    cupy.cuda.get_current_stream().synchronize()
    ref, _ = attention_reference(q, k, v)
    assert rel_err(o, ref) <= 2e-3


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_output_tma_cannot_address(rng, causal, d):
    """An ``out`` no tensor map can describe (a size-1 batch dim whose stride is not a multiple of 16
    bytes): the persistent kernels, which store O with TMA, write a compact stand-in and copy it over;
    the rest of ``out``'s buffer stays as it was."""
    from conftest import poisoned, randn
    from cupy.lib.stride_tricks import as_strided

    import cupy
    import cuflash
    from cuflash.reference import attention_reference, rel_err

    q, k, v = (randn(rng, (1, 300, 2, d), "bfloat16") for _ in range(3))
    backing = poisoned((1, 300, 2, d), "bfloat16")
    out = as_strided(backing, shape=backing.shape, strides=(8,) + backing.strides[1:])
    o, lse = cuflash.forward(q, k, v, causal=causal, out=out, return_lse=True)
    assert o is out
    cupy.cuda.get_current_stream().synchronize()
    ref, ref_lse = attention_reference(q, k, v, causal=causal)
    assert rel_err(o, ref) <= 1.6e-2
    assert rel_err(lse, ref_lse) <= 1e-5


# Other tile shapes (more consumer warpgroups, wider key tiles), where they fit in shared memory.
@pytest.mark.parametrize("tiles,d,dtype", [("192,128,16", 64, "float16"), ("128,176,12", 128, "bfloat16"),
                                           ("128,176,12", 64, "float16")])
@pytest.mark.parametrize("causal", [False, True])
def test_tile_variants(rng, monkeypatch, sm90_backend, tiles, d, dtype, causal):
    from cuflash import options

    options.set(sm90_fwd_tiles=options.parse_tiles("sm90_fwd_tiles", tiles))
    for nq, nk in [(1000, 1000), (113, 203), (203, 113), (239, 1)]:
        _check(rng, dtype, 2, nq, nk, 3, 1, d, causal)


@pytest.mark.parametrize("scale", [0.5, 8.0])
@pytest.mark.parametrize("causal", [False, True])
def test_growing_logits(rng, scale, causal):
    """Scores that grow along the key loop (key tiles are visited last to first), so that most key tiles
    raise the running max, at the larger scale by more than exp2's range: the key loop's fast path, which
    keeps the running max (kernels_cu/sm90/fwd.cu, kKeepMax), must fall back to the full softmax step."""
    from conftest import FWD_TOL, assert_lse_matches, poisoned, randn

    import cupy
    import cuflash
    from cuflash.reference import attention_reference, rel_err

    b, nq, nk, h, d = 1, 700, 900, 2, 128
    q, v = randn(rng, (b, nq, h, d), "bfloat16"), randn(rng, (b, nk, h, d), "bfloat16")
    ramp = cupy.linspace(5.0, 1.0, nk, dtype=cupy.float32).reshape(1, nk, 1, 1)
    k = (randn(rng, (b, nk, h, d), "float32") * ramp).astype(q.dtype)
    out = poisoned(q.shape, "bfloat16")
    o, lse = cuflash.forward(q, k, v, causal=causal, softmax_scale=scale, return_lse=True, out=out)
    cupy.cuda.get_current_stream().synchronize()
    ref_o, ref_lse = attention_reference(q, k, v, causal=causal, softmax_scale=scale)
    err = rel_err(o, ref_o)
    assert err <= FWD_TOL["bfloat16"], f"out rel err {err:.3e}"
    assert_lse_matches(lse, ref_lse, (b, h, nq))
