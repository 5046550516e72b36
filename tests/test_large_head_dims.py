"""GPU: head dims above 256 (issue #43: head dim 512, MLA's absorbed (576, 512)) against the float64 reference: the
forward's Hopper split-V kernel (fp16 / bf16, kernels_cu/sm90/fwd_split.cuh) and exact float32 kernel, dense and
varlen; the backward's three Hopper kernels (kernels_cu/sm90/bwd_split.cu), dense. Causal and not, GQA, odd
lengths, one key and one query, the variants, the score distributions of cuflash.distributions, v as a view of k
(the absorbed MLA form). Outputs poisoned, every row compared, lse to its own bound. The forward's kernel forced at
ordinary head dims (CUFLASH_FWD_BACKEND=sm90_split) too. (CPU: tests/test_compile_large_head_dims.py.)"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import (BWD_TOL, FWD_TOL, assert_close_on_every_row, assert_grads_close_on_every_row, assert_lse_matches,
                      dtype_of, planned_cc, poisoned, requires_gpu)

pytestmark = [requires_gpu, pytest.mark.usefixtures("hopper_kernels_only")]

# (q / k head dim, v head dim): 512, MLA's absorbed shape, uneven column-block splits (320: 192 + 128 columns of
# V per warpgroup; 448: 256 + 192), the narrowest V the split takes, a V wider than q, a q / k of one column
# block (the backward's dK / dQ then in warpgroup 0's columns alone), and head dims that the portable column split
# pads to whole 16-column pairs per warp (272, v 80).
PAIRS = [(512, 512), (576, 512), (320, 320), (448, 448), (576, 128), (128, 512), (64, 512), (272, 272), (512, 80)]


def _rand(rng, shape, dtype):
    import cupy

    return cupy.asarray(rng.standard_normal(shape).astype(np.float32).astype(dtype_of(dtype)))


def _needs(dtype, portable: bool = False):
    """Skips what this GPU does not run: the Hopper kernels (fp16 / bf16 unless ``portable``) need cc 9.0."""
    if dtype != "float32" and not portable and planned_cc() != 90:
        pytest.skip("fp16 / bf16 at head dims above 256 on the Hopper kernels: compute capability 9.0")


# (options, dtype, the family that runs): the Hopper split-V kernel, the portable kernel's column split, float32.
FAMILIES = [({}, "bfloat16", "sm90_fwd_split"), ({}, "float16", "sm90_fwd_split"),
            ({"fwd_backend": "sm80"}, "bfloat16", "sm80_fwd"), ({"fwd_backend": "sm80"}, "float16", "sm80_fwd"),
            ({}, "float32", "simt_fwd")]


def _family(q, dv, causal):
    import cupy
    from cuflash import api

    _, cfg, _ = api._fwd_plan(q.dtype, q.shape[-1], causal, cupy.cuda.Device().id, head_dim_v=dv)
    return cfg.family


@pytest.mark.parametrize("family,dtype,runs", FAMILIES)
@pytest.mark.parametrize("dqk,dv", PAIRS)
@pytest.mark.parametrize("causal", [False, True])
def test_dense(rng, family, dtype, runs, dqk, dv, causal):
    import cupy
    import cuflash
    from cuflash.reference import attention_reference

    _needs(dtype, portable=runs != "sm90_fwd_split")
    cuflash.options.set(**family)
    b, nq, nk, hq, hkv = 2, 139, 211, 4, 2
    q, k, v = _rand(rng, (b, nq, hq, dqk), dtype), _rand(rng, (b, nk, hkv, dqk), dtype), _rand(rng, (b, nk, hkv, dv), dtype)
    assert _family(q, dv, causal) == runs
    out = poisoned((b, nq, hq, dv), dtype)
    o, lse = cuflash.forward(q, k, v, causal=causal, return_lse=True, out=out)
    assert o is out
    ref_o, ref_lse = attention_reference(q, k, v, causal=causal)
    assert_close_on_every_row("out", o, cupy.asarray(ref_o), dtype, FWD_TOL)
    assert_lse_matches(lse, ref_lse, (b, hq, nq))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("nq,nk", [(1, 1), (1, 300), (300, 1), (64, 64), (65, 129), (2000, 2000), (777, 3001)])
def test_lengths(rng, dtype, nq, nk):
    """One key or one query, whole and partial 64-row / 64-key tiles, long rows (P's two buffers reused many
    times), Nq != Nk both ways (bottom-right causal)."""
    import cupy
    import cuflash
    from cuflash.reference import attention_reference

    _needs(dtype)
    q, k, v = _rand(rng, (1, nq, 2, 512), dtype), _rand(rng, (1, nk, 1, 512), dtype), _rand(rng, (1, nk, 1, 512), dtype)
    for causal in (False, True):
        out = poisoned((1, nq, 2, 512), dtype)
        o, lse = cuflash.forward(q, k, v, causal=causal, return_lse=True, out=out)
        ref_o, ref_lse = attention_reference(q, k, v, causal=causal)
        assert_close_on_every_row("out", o, cupy.asarray(ref_o), dtype, FWD_TOL)
        assert_lse_matches(lse, ref_lse, (1, 2, nq))


@pytest.mark.parametrize("dist", ["normal", "outlier12", "sharp", "sink", "mixed"])
@pytest.mark.parametrize("causal", [False, True])
def test_distributions(dist, causal):
    """Realistic score distributions (cuflash.distributions): sharp rows and attention sinks move the running
    max, which warpgroup 1 learns only through the rescale factors warpgroup 0 hands over."""
    import cupy
    import cuflash
    from cuflash.bench import Shape
    from cuflash.distributions import make_inputs
    from cuflash.reference import attention_reference

    _needs("bfloat16")
    q, k, v = make_inputs(Shape(1, 10, 1024, 512, "bfloat16", causal, heads_kv=5), dist, seed=3)
    out = poisoned(q.shape, "bfloat16")
    o, lse = cuflash.forward(q, k, v, causal=causal, return_lse=True, out=out)
    ref_o, ref_lse = attention_reference(q, k, v, causal=causal)
    assert_close_on_every_row("out", o, cupy.asarray(ref_o), "bfloat16", FWD_TOL)
    assert_lse_matches(lse, ref_lse, (1, 10, 1024))


@pytest.mark.parametrize("causal", [False, True])
def test_absorbed_mla(rng, causal):
    """MLA decoding in its absorbed form: 128 query heads share one latent KV head of 576 columns, and v is its
    first 512 (a view of k: TMA reads it with k's row stride)."""
    import cupy
    import cuflash
    from cuflash.reference import attention_reference

    _needs("bfloat16")
    q = _rand(rng, (2, 3, 128, 576), "bfloat16")
    kv = _rand(rng, (2, 1031, 1, 576), "bfloat16")
    v = kv[..., :512]
    out = poisoned((2, 3, 128, 512), "bfloat16")
    o, lse = cuflash.forward(q, kv, v, causal=causal, softmax_scale=0.1, return_lse=True, out=out)
    ref_o, ref_lse = attention_reference(q, kv, cupy.ascontiguousarray(v), causal=causal, softmax_scale=0.1)
    assert_close_on_every_row("out", o, cupy.asarray(ref_o), "bfloat16", FWD_TOL)
    assert_lse_matches(lse, ref_lse, (2, 128, 3))


@pytest.mark.parametrize("variant", [dict(window_size=(100, 0)), dict(softcap=20.0), dict(sinks=True),
                                     dict(alibi_slopes=True)])
def test_variants(rng, variant):
    """The mask policy's variants run through warpgroup 0's S alone."""
    import cupy
    import cuflash
    from cuflash.reference import attention_reference

    _needs("bfloat16")
    hq = 4
    q, k, v = (_rand(rng, (1, 333, hq, 512), "bfloat16") for _ in range(3))
    kw = dict(variant)
    if kw.get("sinks"):
        kw["sinks"] = cupy.asarray(rng.standard_normal(hq).astype(np.float32))
    if kw.get("alibi_slopes"):
        kw["alibi_slopes"] = cupy.asarray(rng.uniform(0.01, 0.2, hq).astype(np.float32))
    causal = "window_size" in kw or "alibi_slopes" in kw
    out = poisoned(q.shape, "bfloat16")
    o, lse = cuflash.forward(q, k, v, causal=causal, return_lse=True, out=out, **kw)
    ref_o, ref_lse = attention_reference(q, k, v, causal=causal, **kw)
    assert_close_on_every_row("out", o, cupy.asarray(ref_o), "bfloat16", FWD_TOL)
    assert_lse_matches(lse, ref_lse, (1, hq, 333))


@pytest.mark.parametrize("family,dtype,runs", FAMILIES[::2])
@pytest.mark.parametrize("dqk,dv", [(512, 512), (576, 512)])
def test_varlen(rng, family, dtype, runs, dqk, dv):
    import cupy
    import cuflash
    from cuflash.reference import attention_reference_varlen

    _needs(dtype, portable=runs != "sm90_fwd_split")
    cuflash.options.set(**family)
    lq, lk = [0, 1, 13, 131, 64, 257], [3, 1, 0, 131, 200, 257]
    cu_q = cupy.asarray(np.concatenate([[0], np.cumsum(lq)]).astype(np.int32))
    cu_k = cupy.asarray(np.concatenate([[0], np.cumsum(lk)]).astype(np.int32))
    q, k, v = _rand(rng, (sum(lq), 4, dqk), dtype), _rand(rng, (sum(lk), 2, dqk), dtype), _rand(rng, (sum(lk), 2, dv), dtype)
    for causal in (False, True):
        out = poisoned((sum(lq), 4, dv), dtype)
        o, lse = cuflash.forward_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal, return_lse=True, out=out)
        ref_o, ref_lse = attention_reference_varlen(q, k, v, cu_q, cu_k, causal=causal)
        assert_close_on_every_row("out", o, cupy.asarray(ref_o), dtype, FWD_TOL)
        assert_lse_matches(lse, ref_lse, ref_lse.shape)


def test_long_rows_by_chunks(rng):
    """8k x 8k at head dim 512 against float64 by chunks of query rows."""
    import cuflash
    from cuflash.reference import attention_reference_chunked

    _needs("bfloat16")
    n = 8192 + 37
    q, k, v = (_rand(rng, (1, n, 2, 512), "bfloat16") for _ in range(3))
    for causal in (False, True):
        out = poisoned(q.shape, "bfloat16")
        o, lse = cuflash.forward(q, k, v, causal=causal, return_lse=True, out=out)
        ref_o, ref_lse = attention_reference_chunked(q, k, v, causal=causal)
        assert_close_on_every_row("out", o, ref_o, "bfloat16", FWD_TOL)
        assert_lse_matches(lse, ref_lse, (1, 2, n))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d,dv", [(128, 128), (96, 96), (256, 256), (192, 128), (64, 128)])
@pytest.mark.parametrize("causal", [False, True])
def test_split_kernel_at_ordinary_head_dims(rng, dtype, d, dv, causal):
    """The split-V kernel forced (CUFLASH_FWD_BACKEND=sm90_split) where the other kernels also run."""
    import cupy
    import cuflash
    from cuflash.reference import attention_reference

    _needs(dtype)
    with cuflash.options.override(fwd_backend="sm90_split"):
        q, k, v = _rand(rng, (2, 203, 4, d), dtype), _rand(rng, (2, 190, 1, d), dtype), _rand(rng, (2, 190, 1, dv), dtype)
        assert _family(q, dv, causal) == "sm90_fwd_split"
        out = poisoned((2, 203, 4, dv), dtype)
        o, lse = cuflash.forward(q, k, v, causal=causal, return_lse=True, out=out)
    ref_o, ref_lse = attention_reference(q, k, v, causal=causal)
    assert_close_on_every_row("out", o, cupy.asarray(ref_o), dtype, FWD_TOL)
    assert_lse_matches(lse, ref_lse, (2, 4, 203))


def _grads_check(rng, dtype, b, nq, nk, hq, hkv, dqk, dv, causal, **kw):
    """backward against the float64 reference gradients, outputs poisoned, every row of each gradient."""
    import cupy
    import cuflash
    from cuflash.reference import attention_reference_backward

    q, k = _rand(rng, (b, nq, hq, dqk), dtype), _rand(rng, (b, nk, hkv, dqk), dtype)
    v, dout = _rand(rng, (b, nk, hkv, dv), dtype), _rand(rng, (b, nq, hq, dv), dtype)
    o, lse = cuflash.forward(q, k, v, causal=causal, return_lse=True, **kw)
    bufs = tuple(poisoned(x.shape, dtype) for x in (q, k, v))
    grads = cuflash.backward(dout, q, k, v, o, lse, causal=causal, dq=bufs[0], dk=bufs[1], dv=bufs[2], **kw)
    refs = attention_reference_backward(dout, q, k, v, causal=causal, **kw)
    assert all(got is buf for got, buf in zip(grads, bufs))
    assert_grads_close_on_every_row(("dq", "dk", "dv"), grads, refs, dtype, BWD_TOL)
    return grads


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("dqk,dv", PAIRS)
@pytest.mark.parametrize("causal", [False, True])
def test_backward(rng, dtype, dqk, dv, causal):
    """The three kernels of the large head dims' 16-bit backward (dV, dK, dQ: kernels_cu/sm90/bwd_split.cu), and
    the exact float32 kernels' large bucket (zero padding to one head dim), GQA."""
    _needs(dtype)
    _grads_check(rng, dtype, 2, 139, 211, 4, 2, dqk, dv, causal)


@pytest.mark.parametrize("nq,nk", [(1, 1), (1, 300), (300, 1), (64, 64), (65, 129), (1000, 1000), (777, 1501)])
def test_backward_lengths(rng, nq, nk):
    _needs("bfloat16")
    for causal in (False, True):
        _grads_check(rng, "bfloat16", 1, nq, nk, 2, 1, 512, 512, causal)


@pytest.mark.parametrize("variant", [dict(window_size=(100, 0)), dict(softcap=20.0), dict(alibi_slopes=True),
                                     dict(sinks=True)])
def test_backward_variants(rng, variant):
    """Windows (the mask policy's steps), softcap's derivative, ALiBi, sinks (dsinks from the stats rows)."""
    import cupy
    import cuflash
    from cuflash.reference import attention_reference_backward

    _needs("bfloat16")
    hq, n = 4, 333
    kw = dict(variant)
    if kw.get("alibi_slopes"):
        kw["alibi_slopes"] = cupy.asarray(rng.uniform(0.01, 0.2, hq).astype(np.float32))
    if kw.get("sinks"):
        kw["sinks"] = cupy.asarray(rng.standard_normal(hq).astype(np.float32))
        q, k, v, dout = (_rand(rng, (1, n, hq, 512), "bfloat16") for _ in range(4))
        o, lse = cuflash.forward(q, k, v, causal=True, return_lse=True, **kw)
        dq, dk, dv, dsinks = cuflash.backward(dout, q, k, v, o, lse, causal=True, **kw)
        refs = attention_reference_backward(dout, q, k, v, causal=True, **kw)
        assert_grads_close_on_every_row(("dq", "dk", "dv"), (dq, dk, dv), refs[:3], "bfloat16", BWD_TOL)
        ref_ds = cupy.asnumpy(refs[3])
        assert np.abs(cupy.asnumpy(dsinks) - ref_ds).max() <= 1e-2 * max(1.0, np.abs(ref_ds).max())
        return
    _grads_check(rng, "bfloat16", 1, n, n, hq, hq, 512, 512, True, **kw)


def test_backward_distributions():
    """Sharp scores and sinks through the recomputed P (lse2 per query column in the dK / dV kernels)."""
    import cupy
    import cuflash
    from cuflash.bench import Shape
    from cuflash.distributions import make_inputs
    from cuflash.reference import attention_reference_backward

    _needs("bfloat16")
    for dist in ("sharp", "sink", "outlier12"):
        q, k, v = make_inputs(Shape(1, 4, 700, 512, "bfloat16", True, heads_kv=2), dist, seed=5)
        dout = cupy.asarray(np.random.default_rng(1).standard_normal(q.shape).astype(np.float32)).astype(q.dtype)
        o, lse = cuflash.forward(q, k, v, causal=True, return_lse=True)
        grads = cuflash.backward(dout, q, k, v, o, lse, causal=True)
        refs = attention_reference_backward(dout, q, k, v, causal=True)
        # The sink distribution's bf16 dk error is 1.5x the bound on the dense kernels too (docs/testing.md).
        tol = {"bfloat16": 1.5 * BWD_TOL["bfloat16"]} if dist == "sink" else BWD_TOL
        # sharp and outlier12: the whole gradients only (per row, bf16's rounding of near-one-hot P moves a few
        # of the smallest rows of dq past the row bound, 0.12-0.15 against 0.08 on an H200; the dense D <= 256
        # kernels do the same: tests/test_varlen_bwd.py); every row where the scores are the sink's
        assert_grads_close_on_every_row(("dq", "dk", "dv"), grads, refs, "bfloat16", tol, label=dist,
                                        per_row=dist == "sink")


def test_backward_is_deterministic(rng):
    import cupy
    import cuflash

    _needs("bfloat16")
    q, k, v, dout = (_rand(rng, (1, 500, 2, 512), "bfloat16") for _ in range(4))
    o, lse = cuflash.forward(q, k, v, causal=True, return_lse=True)
    first = cuflash.backward(dout, q, k, v, o, lse, causal=True)
    again = cuflash.backward(dout, q, k, v, o, lse, causal=True)
    for a, b in zip(first, again):
        assert bool(cupy.all(a.view(cupy.uint16) == b.view(cupy.uint16)))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("dqk,dv", [(512, 512), (576, 512)])
def test_varlen_backward(rng, dtype, dqk, dv):
    """The split kernels on packed sequences (each sequence's stats rows from its padded row), float32 by zero
    padding: empty, single-token and odd sequences, GQA, causal and not, outputs poisoned."""
    import cupy
    import cuflash
    from cuflash.reference import attention_reference_varlen_backward

    _needs(dtype)
    lq, lk = [0, 1, 13, 131, 64, 257], [3, 1, 0, 131, 200, 257]
    cu_q = cupy.asarray(np.concatenate([[0], np.cumsum(lq)]).astype(np.int32))
    cu_k = cupy.asarray(np.concatenate([[0], np.cumsum(lk)]).astype(np.int32))
    q, k = _rand(rng, (sum(lq), 4, dqk), dtype), _rand(rng, (sum(lk), 2, dqk), dtype)
    v, dout = _rand(rng, (sum(lk), 2, dv), dtype), _rand(rng, (sum(lq), 4, dv), dtype)
    for causal in (False, True):
        o, lse = cuflash.forward_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal, return_lse=True)
        bufs = tuple(poisoned(x.shape, dtype) for x in (q, k, v))
        grads = cuflash.backward_varlen(dout, q, k, v, o, lse, cu_q, cu_k, max(lq), max(lk), causal=causal,
                                        dq=bufs[0], dk=bufs[1], dv=bufs[2])
        refs = attention_reference_varlen_backward(dout, q, k, v, cu_q, cu_k, causal=causal)
        assert_grads_close_on_every_row(("dq", "dk", "dv"), grads, refs, dtype, BWD_TOL)
        # queries of a sequence with no key and keys of one with no query: exactly 0, not merely small
        q0, k0 = int(cu_q[2]), int(cu_k[0])
        assert bool(cupy.all(grads[0][q0:q0 + lq[2]].astype(cupy.float32) == 0))
        assert bool(cupy.all(grads[1][k0:k0 + lk[0]].astype(cupy.float32) == 0))
        assert bool(cupy.all(grads[2][k0:k0 + lk[0]].astype(cupy.float32) == 0))


def test_torch_and_jax_wrappers(rng):
    """cuflash.torch and cuflash.jax take the large head dims, forward and backward."""
    import cupy
    from cuflash.reference import attention_reference, attention_reference_backward

    _needs("bfloat16")
    q, k = _rand(rng, (1, 70, 2, 576), "bfloat16"), _rand(rng, (1, 90, 2, 576), "bfloat16")
    v, dout = _rand(rng, (1, 90, 2, 512), "bfloat16"), _rand(rng, (1, 70, 2, 512), "bfloat16")
    ref_o, _ = attention_reference(q, k, v, causal=True)
    ref_grads = attention_reference_backward(dout, q, k, v, causal=True)
    try:
        import torch
        import cuflash.torch as ct
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        def as_cupy(t):   # CuPy reads no bfloat16 tensor through __cuda_array_interface__: DLPack, as float32
            return cupy.from_dlpack(t.detach().float().contiguous())

        tq, tk, tv = (torch.from_dlpack(x).clone().requires_grad_(True) for x in (q, k, v))
        o = ct.flash_attn_func(tq, tk, tv, causal=True)
        assert_close_on_every_row("out", as_cupy(o), cupy.asarray(ref_o), "bfloat16", FWD_TOL)
        o.backward(torch.from_dlpack(dout))
        assert_grads_close_on_every_row(("dq", "dk", "dv"), [as_cupy(t.grad) for t in (tq, tk, tv)], ref_grads,
                                        "bfloat16", BWD_TOL, label="torch")
    try:
        import jax
        import jax.numpy as jnp
        import cuflash.jax as cj
    except ImportError:
        jax = None
    if jax is not None and any(d.platform == "gpu" for d in jax.devices()):
        jq, jk, jv = (jnp.asarray(cupy.asnumpy(x)) for x in (q, k, v))
        o, pullback = jax.vjp(lambda *qkv: cj.dot_product_attention(*qkv, causal=True), jq, jk, jv)
        assert_close_on_every_row("out", cupy.asarray(np.asarray(o, np.float32)), cupy.asarray(ref_o), "bfloat16",
                                  FWD_TOL)
        grads = pullback(jnp.asarray(cupy.asnumpy(dout)))
        assert_grads_close_on_every_row(("dq", "dk", "dv"), [cupy.asarray(np.asarray(g, np.float32)) for g in grads],
                                        ref_grads, "bfloat16", BWD_TOL, label="jax")
