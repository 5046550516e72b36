"""Forward pass against the float64 reference (GPU)."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import (FWD_TOL, assert_close_on_every_row, assert_lse_matches, planned_cc, poisoned, randn,
                      requires_gpu)

pytestmark = requires_gpu


def _check(rng, dtype, b, nq, nk, hq, hkv, d, causal, scale=None, **kw):
    import cupy
    import cuflash
    from cuflash.reference import attention_reference, rel_err

    q = randn(rng, (b, nq, hq, d), dtype)
    k = randn(rng, (b, nk, hkv, d), dtype)
    v = randn(rng, (b, nk, hkv, d), dtype)
    out = poisoned(q.shape, dtype)
    o, lse = cuflash.forward(q, k, v, causal=causal, softmax_scale=scale, return_lse=True, out=out, **kw)
    assert o is out
    cupy.cuda.get_current_stream().synchronize()
    ref_o, ref_lse = attention_reference(q, k, v, causal=causal, softmax_scale=scale)
    err = rel_err(o, ref_o)
    assert err <= FWD_TOL[dtype], f"out rel err {err:.3e} > {FWD_TOL[dtype]:.1e}"
    assert_lse_matches(lse, ref_lse, (b, hq, nq))
    return o


DTYPES = ["float16", "bfloat16", "float32"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen", [1, 17, 128, 1000])
def test_seqlens(rng, dtype, causal, seqlen):
    _check(rng, dtype, 2, seqlen, seqlen, 3, 3, 64, causal)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_long(rng, dtype, causal):
    _check(rng, dtype, 1, 4097, 4097, 1, 1, 128, causal)


@pytest.mark.parametrize("dtype,head_dim", [("bfloat16", 128), ("float16", 256)])
def test_long_sequences(rng, dtype, head_dim):
    """32k tokens and more (heuristics.fwd_long): on Hopper the tuned table's overlap kernels run in clusters
    of two CTAs that share each K / V tile. Every row against float64 (on the GPU, by chunks of query rows):
    the whole output in relative norm, each row within a few times that bound, and every lse."""
    import cupy
    import cuflash
    from cuflash import api, heuristics
    from cuflash.reference import attention_reference_chunked

    n = heuristics.SM90_FWD_CLUSTER_SEQLEN + 77
    q = randn(rng, (1, n, 2, head_dim), dtype)
    k = randn(rng, (1, n, 1, head_dim), dtype)
    v = randn(rng, (1, n, 1, head_dim), dtype)
    out = poisoned(q.shape, dtype)
    o, lse = cuflash.forward(q, k, v, return_lse=True, out=out)
    cupy.cuda.get_current_stream().synchronize()
    device = cupy.cuda.Device()
    if planned_cc() == 90 and heuristics.fwd_backend() in ("auto", "sm90") \
            and heuristics.fwd_cluster_mode() != "0":
        _, cfg, _ = api._fwd_plan(q.dtype, head_dim, False, device.id, False, True)
        assert cfg.fam.schedule == "overlap" and cfg.cluster == 2, cfg.family
    ref_o, ref_lse = attention_reference_chunked(q, k, v)
    assert_close_on_every_row("out", o, ref_o, dtype, FWD_TOL)
    assert_lse_matches(lse, ref_lse, (1, 2, n))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("nq,nk", [(1100, 1237), (2100, 2213)])
def test_past_short_sequences(rng, dtype, causal, head_dim, nq, nk):
    # seqlen_q > 1024: the Hopper dispatcher's table kernels (shorter ones take _SM90_FWD_SHORT's,
    # which the other tests here reach), with more query tiles than SMs at 2100
    _check(rng, dtype, 1, nq, nk, 2, 1, head_dim, causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(113, 203), (203, 113), (1, 239), (239, 1), (799, 3), (64, 1000)])
def test_unequal_lengths(rng, dtype, causal, nq, nk):
    _check(rng, dtype, 1, nq, nk, 2, 2, 64, causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 192, 256, 8, 40, 72, 136, 200])
def test_head_dims(rng, dtype, head_dim):
    _check(rng, dtype, 1, 190, 257, 2, 2, head_dim, causal=False)
    _check(rng, dtype, 1, 257, 190, 2, 1, head_dim, causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", [(8, 2), (8, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_mqa(rng, dtype, hq, hkv, causal):
    _check(rng, dtype, 2, 300, 333, hq, hkv, 64, causal)


@pytest.mark.parametrize("dtype", DTYPES)
def test_custom_scale(rng, dtype):
    _check(rng, dtype, 1, 100, 100, 2, 2, 64, False, scale=0.3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_views(rng, dtype):
    """q, k, v as views into a packed (B, N, 3, H, D) buffer and a head-sliced out: no copies."""
    import cupy
    import cuflash
    from cuflash.reference import attention_reference, rel_err

    b, n, h, d = 2, 150, 4, 64
    qkv = randn(rng, (b, n, 3, h, d), dtype)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    assert not q.flags.c_contiguous
    big = poisoned((b, n, 2 * h, d), dtype)
    out = big[:, :, ::2]
    o = cuflash.forward(q, k, v, causal=True, out=out)
    ref, _ = attention_reference(q, k, v, causal=True)
    assert rel_err(o, ref) <= FWD_TOL[dtype]
    assert bool(cupy.isnan(big[:, :, 1::2].astype(cupy.float32)).all()), "wrote outside the out view"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_non_default_stream(rng, dtype):
    import cupy
    import cuflash
    from cuflash.reference import attention_reference, rel_err

    q, k, v = (randn(rng, (1, 257, 2, 64), dtype) for _ in range(3))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        o = cuflash.forward(q, k, v)
        stream.synchronize()
    assert rel_err(o, attention_reference(q, k, v)[0]) <= FWD_TOL[dtype]


def test_fully_masked_rows(rng):
    """Causal with seqlen_q > seqlen_k: the first rows see no key -> 0 and -inf, never NaN."""
    import cupy
    import cuflash

    q = randn(rng, (1, 300, 2, 64), "float16")
    k = randn(rng, (1, 100, 2, 64), "float16")
    v = randn(rng, (1, 100, 2, 64), "float16")
    o, lse = cuflash.forward(q, k, v, causal=True, return_lse=True)
    assert not bool(cupy.isnan(o.astype(cupy.float32)).any())
    assert bool((o[:, :200] == 0).all())
    assert bool(cupy.isneginf(lse[:, :, :200]).all())
    assert bool(cupy.isfinite(lse[:, :, 200:]).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_sequences(dtype):
    import cupy
    import cuflash

    q = cupy.ones((2, 0, 2, 64), dtype=cupy.float16 if dtype == "float16" else cupy.float32)
    k = cupy.ones((2, 5, 2, 64), dtype=q.dtype)
    o, lse = cuflash.forward(q, k, k, return_lse=True)
    assert o.shape == q.shape and lse.shape == (2, 2, 0)
    q = cupy.ones((2, 7, 2, 64), dtype=q.dtype)
    k = cupy.ones((2, 0, 2, 64), dtype=q.dtype)
    o, lse = cuflash.forward(q, k, k, return_lse=True)
    assert bool((o == 0).all()) and bool(cupy.isneginf(lse).all())


def test_deterministic_repeat(rng):
    import cupy
    import cuflash

    q, k, v = (randn(rng, (2, 333, 4, 128), "bfloat16") for _ in range(3))
    a = cuflash.forward(q, k, v, causal=True)
    b = cuflash.forward(q, k, v, causal=True)
    assert bool(cupy.array_equal(a.view(cupy.uint16), b.view(cupy.uint16)))


def test_naive_error_ratio(rng):
    """FlashAttention-style bound: error at most ~2x that of naive attention in the input dtype."""
    import cuflash
    from cuflash.reference import attention_reference, rel_err

    q, k, v = (randn(rng, (2, 512, 4, 64), "float16") for _ in range(3))
    ref, _ = attention_reference(q, k, v, causal=True)
    o = cuflash.forward(q, k, v, causal=True)
    # naive in fp16 storage with fp32 math, rounded like a fp16 framework would; in NumPy on the host,
    # since @ on CuPy arrays needs cuBLAS, which the test install leaves out
    qf, kf, vf = (x.get().astype(np.float32).transpose(0, 2, 1, 3) for x in (q, k, v))
    s = (qf @ kf.transpose(0, 1, 3, 2)) / np.float32(np.sqrt(64))
    s = np.where(np.tril(np.ones((512, 512), dtype=bool)), s, -np.inf)
    pr = np.exp(s - s.max(-1, keepdims=True))
    pr = (pr / pr.sum(-1, keepdims=True)).astype(np.float16).astype(np.float32)
    naive = (pr @ vf).transpose(0, 2, 1, 3).astype(np.float16)
    assert rel_err(o, ref) <= 2 * rel_err(naive, ref) + 1e-4
