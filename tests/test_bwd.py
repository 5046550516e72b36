"""Backward pass against the float64 reference's analytic gradients (GPU).

Every test draws fresh random inputs, runs the forward for out and lse, poisons the
gradient buffers with NaN and compares dq, dk, dv with
cuflash.reference.attention_reference_backward in relative norm. Set CUFLASH_ERRLOG=path
to append every measured error to a file.
"""
from __future__ import annotations

import math
import os

import numpy as np
import pytest

from conftest import BWD_TOL, planned_cc, poisoned, randn, rel_err_gpu, requires_gpu

pytestmark = requires_gpu

DTYPES = ["float16", "bfloat16", "float32"]


def grad_err(x, ref, floor: float) -> float:
    """||x - ref|| / max(||ref||, floor); inf if x has a NaN or inf.

    ``floor`` (a tenth of the gradients' natural size) keeps the measure meaningful where the
    exact gradient is ~0, e.g. dq and dk when every query sees a single key: there the kernels
    return rounding noise (P = 1 up to an ulp, dP - delta ~ 1e-7 in float32), the reference 0.
    """
    x = x.get().astype(np.float64) if hasattr(x, "get") else np.asarray(x, np.float64)
    if not np.all(np.isfinite(x)):
        return math.inf
    num = np.linalg.norm((x - ref).ravel())
    den = max(np.linalg.norm(ref.ravel()), floor)
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return float(num / den)


def _log(line: str) -> None:
    path = os.environ.get("CUFLASH_ERRLOG")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def check_bwd(rng, dtype, b, nq, nk, hq, hkv, d, causal, *, deterministic=False, scale=None, tol=None,
              inputs=None, bufs=None, label=""):
    """Run forward + backward and compare with the reference; returns (dq, dk, dv, errors)."""
    import cupy
    import cuflash
    from cuflash.reference import attention_reference_backward

    if inputs is None:
        q = randn(rng, (b, nq, hq, d), dtype)
        k = randn(rng, (b, nk, hkv, d), dtype)
        v = randn(rng, (b, nk, hkv, d), dtype)
        dout = randn(rng, (b, nq, hq, d), dtype)
    else:
        q, k, v, dout = inputs
    out, lse = cuflash.forward(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
    if bufs is None:
        bufs = (poisoned(q.shape, dtype), poisoned(k.shape, dtype), poisoned(v.shape, dtype))
    dq, dk, dv = cuflash.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale,
                                  deterministic=deterministic, dq=bufs[0], dk=bufs[1], dv=bufs[2])
    assert dq is bufs[0] and dk is bufs[1] and dv is bufs[2]
    cupy.cuda.get_current_stream().synchronize()
    ref = attention_reference_backward(dout, q, k, v, causal=causal, softmax_scale=scale)
    floor = 0.1 * max(np.linalg.norm(r.ravel()) * math.sqrt(x.size / r.size) for r, x in zip(ref, (dq, dk, dv))
                       if r.size)
    errs = [grad_err(x, r, floor) for x, r in zip((dq, dk, dv), ref)]
    tol = BWD_TOL[dtype] if tol is None else tol
    _log(f"{label or 'bwd'} {dtype} b={b} nq={nq} nk={nk} hq={hq} hkv={hkv} d={d} causal={causal} "
         f"det={deterministic} scale={scale} | dq {errs[0]:.3e} dk {errs[1]:.3e} dv {errs[2]:.3e}")
    names = ("dq", "dk", "dv")
    bad = [f"{n} {e:.3e}" for n, e in zip(names, errs) if not e <= tol]
    assert not bad, f"rel err > {tol:.1e}: {', '.join(bad)} (all: {[f'{e:.2e}' for e in errs]})"
    return dq, dk, dv, errs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen", [1, 17, 128, 1000])
def test_seqlens(rng, dtype, causal, seqlen):
    check_bwd(rng, dtype, 2, seqlen, seqlen, 3, 3, 64, causal, label="seqlens")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_long(rng, dtype, causal):
    check_bwd(rng, dtype, 1, 4097, 4097, 1, 1, 128 if dtype != "float32" else 64, causal, label="long")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(113, 203), (203, 113), (1, 239), (239, 1), (799, 3), (64, 1000)])
def test_unequal_lengths(rng, dtype, causal, nq, nk):
    check_bwd(rng, dtype, 1, nq, nk, 2, 2, 64, causal, label="unequal")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 192, 256, 8, 40, 72, 136, 200])
def test_head_dims(rng, dtype, head_dim):
    check_bwd(rng, dtype, 1, 190, 257, 2, 2, head_dim, False, label="head_dims")
    check_bwd(rng, dtype, 1, 257, 190, 2, 1, head_dim, True, label="head_dims")


# Split-D tiles (head dims above 128 on Hopper): each consumer warpgroup computes S^T / dP^T for its half
# of a query tile's rows and takes the other half's P^T / dS^T from shared memory; odd and unequal
# lengths end query tiles inside either half.
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk,deterministic", [(1000, 1000, False), (113, 203, False), (203, 113, True),
                                                 (47, 1, False), (1, 239, False), (300, 300, True)])
def test_split_d_tiles(rng, dtype, head_dim, causal, nq, nk, deterministic):
    check_bwd(rng, dtype, 2, nq, nk, 4, 2, head_dim, causal, deterministic=deterministic, label="split_d")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 192, 256, 40, 136])
@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_mode(rng, dtype, head_dim, causal):
    """The dQ-kernel path (no atomics) against the reference, GQA included."""
    check_bwd(rng, dtype, 2, 211, 300, 4, 2, head_dim, causal, deterministic=True, label="det")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(300, 100), (130, 300), (1, 77), (257, 257)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_workspace_poisoned(rng, monkeypatch, head_dim, causal, nq, nk, deterministic):
    """The float32 dQ workspace filled with NaN before the kernels run: every part of it that a result
    reads must be written first (the ordered Hopper mode stores each query tile's first slice instead of
    adding it, and leaves only the query tiles that see no key, causal with seqlen_q > seqlen_k, to the
    preprocess to zero)."""
    from cuflash import api

    monkeypatch.setattr(api, "_POISON_WORKSPACE", True)
    check_bwd(rng, "bfloat16", 2, nq, nk, 4, 2, head_dim, causal, deterministic=deterministic, label="poisoned")


@pytest.mark.slow
@pytest.mark.parametrize("deterministic", [False, True])
def test_workspace_poisoned_negative_control(rng, monkeypatch, deterministic):
    """The control of test_workspace_poisoned on Hopper: a build that adds every dQ slice
    (-DCUFLASH_SM90_BWD_FIRST_STORE=0 -DCUFLASH_SM90_BWD_CLAIM_FIRST=0) gets every sum zeroed and passes;
    the same build with the zeroing cut to what a stored first slice would cover
    (sm90._NEGATIVE_CONTROL_SKIP_ZEROING) leaves NaN in dQ, which the poisoned check must catch."""
    from cuflash import api, options, sm90

    if planned_cc() != 90:
        pytest.skip("the first-slice stores are the Hopper backward's")
    monkeypatch.setattr(api, "_POISON_WORKSPACE", True)
    options.set(bwd_backend="sm90", nvrtc_defines=("-DCUFLASH_SM90_BWD_FIRST_STORE=0",
                                                   "-DCUFLASH_SM90_BWD_CLAIM_FIRST=0"))
    args = (rng, "bfloat16", 2, 257, 257, 4, 2, 64, False)
    check_bwd(*args, deterministic=deterministic, label="poisoned-control-zeroed")
    monkeypatch.setattr(sm90, "_NEGATIVE_CONTROL_SKIP_ZEROING", True)
    with pytest.raises(AssertionError, match="dq"):
        check_bwd(*args, deterministic=deterministic, label="poisoned-control")


@pytest.mark.parametrize("head_dim,causal", [(64, False), (64, True), (128, False), (128, True), (256, False)])
def test_many_ctas_in_flight(rng, head_dim, causal):
    """Several waves of CTAs adding into the same dQ tiles at once: on Hopper the first key tile to reach a
    dQ slice stores it and the others wait for that store, so this is where a circular wait between CTAs
    would hang and a lost ordering would show. Both the default mode and the deterministic one (an
    independent fixed order) against float64 on the GPU, by chunks of query rows (B=4 H=16 N=2048: 1024
    CTAs at d=128, ~8 waves)."""
    import cupy
    import cuflash
    from cuflash.reference import attention_reference_chunked

    q, k, v, dout = (randn(rng, (4, 2048, 16, head_dim), "float16") for _ in range(4))
    out, lse = cuflash.forward(q, k, v, causal=causal, return_lse=True)
    ref = attention_reference_chunked(q, k, v, dout, causal=causal)[2:]
    fast = [poisoned(q.shape, "float16") for _ in range(3)]
    ordered = [poisoned(q.shape, "float16") for _ in range(3)]
    for _ in range(3):   # repeated: an occasional circular wait or race has several chances to show
        cuflash.backward(dout, q, k, v, out, lse, causal=causal, dq=fast[0], dk=fast[1], dv=fast[2])
        cuflash.backward(dout, q, k, v, out, lse, causal=causal, deterministic=True,
                         dq=ordered[0], dk=ordered[1], dv=ordered[2])
        cupy.cuda.get_current_stream().synchronize()
        for mode, grads in (("default", fast), ("deterministic", ordered)):
            for name, x, r in zip(("dq", "dk", "dv"), grads, ref):
                err = rel_err_gpu(x, r)
                _log(f"many_ctas {mode} d={head_dim} causal={causal} {name} {err:.3e}")
                assert err <= BWD_TOL["float16"], f"{mode} {name}: rel err {err:.3e} against float64"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", [(8, 2), (8, 1)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_gqa_mqa(rng, dtype, hq, hkv, causal, deterministic):
    check_bwd(rng, dtype, 2, 300, 333, hq, hkv, 64, causal, deterministic=deterministic, label="gqa")


@pytest.mark.parametrize("head_dim,causal,deterministic",
                         [(64, False, False), (64, True, False), (64, False, True), (128, True, False),
                          (128, False, True), (128, True, True)])
def test_many_groups(rng, head_dim, causal, deterministic):
    """More (kv head, batch) groups than one L2 section of the Hopper backward's 1-D grid holds
    (kernels_cu/sm90/bwd_scheduler.cuh: BwdTileScheduler::block; a group is 4 * d * (nq * heads_per_kv + nk) bytes, a section
    8 MB, 24 MB for the ordered kernel above d=64), so that the grid spans several sections and the
    last one is partial: 70 groups of 208 KB (d=64) or 417 KB (d=128)."""
    check_bwd(rng, "float16", 7, 257, 300, 20, 10, head_dim, causal, deterministic=deterministic,
              label="many_groups")


@pytest.mark.parametrize("head_dim,nq", [(128, 1500), (256, 1000)])
def test_causal_tail_section(rng, head_dim, nq):
    """Causal: the last (kv head, batch) groups of the Hopper backward's 1-D grid share one wider section
    (kernels_cu/sm90/bwd_scheduler.cuh: BwdTileScheduler::block, kCausalTailGroups = 12 within 48 MB): 19 groups of
    1.5 MB (d=128) or 2 MB (d=256), so sections of 5 + 2 or 4 + 3 groups come before the last 12."""
    check_bwd(rng, "bfloat16", 1, nq, nq, 19, 19, head_dim, True, label="causal_tail_section")


@pytest.mark.parametrize("dtype", DTYPES)
def test_custom_scale(rng, dtype):
    check_bwd(rng, dtype, 1, 100, 130, 2, 2, 64, False, scale=0.3, label="scale")
    check_bwd(rng, dtype, 1, 130, 100, 2, 1, 96, True, scale=0.05, label="scale")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("deterministic", [False, True])
def test_strided_views(rng, dtype, deterministic):
    """Inputs as views into packed buffers, gradients written into views of a poisoned buffer."""
    import cupy

    b, n, h, d = 2, 150, 4, 64
    qkv = randn(rng, (b, n, 3, h, d), dtype)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    dout = randn(rng, (b, n, 2 * h, d), dtype)[:, :, 1::2]
    assert not q.flags.c_contiguous and not dout.flags.c_contiguous
    big = poisoned((b, n, 4, h, d), dtype)
    check_bwd(rng, dtype, b, n, n, h, h, d, True, deterministic=deterministic, inputs=(q, k, v, dout),
              bufs=(big[:, :, 0], big[:, :, 2], big[:, :, 3]), label="strided")
    assert bool(cupy.isnan(big[:, :, 1].astype(cupy.float32)).all()), "wrote outside the gradient views"


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("deterministic", [False, True])
def test_views_tma_cannot_address(rng, d, deterministic):
    """A size-1 batch dim whose stride is not a multiple of 16 bytes passes the checks (the dim is
    never stepped) but no tensor map can describe it: the Hopper path hands the whole backward to
    the portable kernels, dQ reduction included."""
    from cupy.lib.stride_tricks import as_strided

    n, h = 200, 2

    def odd_batch_stride(x):
        return as_strided(x, shape=x.shape, strides=(8,) + x.strides[1:])

    q, k, v, dout = (odd_batch_stride(randn(rng, (1, n, h, d), "bfloat16")) for _ in range(4))
    assert q.strides[0] == 8
    check_bwd(rng, "bfloat16", 1, n, n, h, h, d, True, deterministic=deterministic, inputs=(q, k, v, dout),
              label="no-tma")


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_non_default_stream(rng, dtype):
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        check_bwd(rng, dtype, 1, 257, 300, 2, 1, 64, True, label="stream")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("deterministic", [False, True])
def test_fully_masked_rows(rng, dtype, deterministic):
    """Causal with seqlen_q > seqlen_k: the first rows see no key -> their dq is exactly 0, no NaN."""
    import cupy

    dq, dk, dv, _ = check_bwd(rng, dtype, 1, 300, 100, 2, 2, 64, True, deterministic=deterministic,
                              label="masked")
    for x in (dq, dk, dv):
        assert not bool(cupy.isnan(x.astype(cupy.float32)).any())
    assert bool((dq[:, :200] == 0).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_sequences(dtype):
    import cupy
    import cuflash
    from conftest import dtype_of

    dt = dtype_of(dtype)
    q = cupy.ones((2, 0, 2, 64), dtype=dt)
    k = cupy.ones((2, 5, 1, 64), dtype=dt)
    lse = cupy.zeros((2, 2, 0), dtype=cupy.float32)
    dq, dk, dv = cuflash.backward(q, q, k, k, q, lse)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape
    assert bool((dk == 0).all()) and bool((dv == 0).all())
    q = cupy.ones((2, 7, 2, 64), dtype=dt)
    k = cupy.ones((2, 0, 1, 64), dtype=dt)
    lse = cupy.full((2, 2, 7), -cupy.inf, dtype=cupy.float32)
    dq, dk, dv = cuflash.backward(q, q, k, k, q, lse)
    assert bool((dq == 0).all()) and dk.shape == k.shape


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_vjp(rng, dtype, causal):
    import cupy
    import cuflash
    from cuflash.reference import attention_reference, attention_reference_backward, rel_err

    q = randn(rng, (2, 177, 4, 64), dtype)
    k = randn(rng, (2, 201, 2, 64), dtype)
    v = randn(rng, (2, 201, 2, 64), dtype)
    dout = randn(rng, q.shape, dtype)
    out, pullback = cuflash.vjp(q, k, v, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert set(pullback.__slots__) >= {"q", "k", "v", "out", "lse"}
    assert not hasattr(pullback, "__dict__"), "the pullback keeps only what the backward needs"
    assert pullback.lse.shape == (2, 4, 177) and pullback.lse.dtype == np.float32
    dq, dk, dv = pullback(dout)
    cupy.cuda.get_current_stream().synchronize()
    ref_out, _ = attention_reference(q, k, v, causal=causal)
    assert rel_err(out, ref_out) <= 2e-2
    for x, r in zip((dq, dk, dv), attention_reference_backward(dout, q, k, v, causal=causal)):
        assert rel_err(x, r) <= BWD_TOL[dtype]


def test_finite_differences_float32(rng):
    """d/dx sum(dout * forward(q, k, v)) by central differences in float32 on a tiny shape."""
    import cupy
    import cuflash

    b, nq, nk, hq, hkv, d = 1, 5, 7, 2, 1, 8
    q = randn(rng, (b, nq, hq, d), "float32")
    k = randn(rng, (b, nk, hkv, d), "float32")
    v = randn(rng, (b, nk, hkv, d), "float32")
    dout = randn(rng, (b, nq, hq, d), "float32")
    dout_h = dout.get().astype(np.float64)
    for causal in (False, True):
        out, pullback = cuflash.vjp(q, k, v, causal=causal)
        grads = [g.get().astype(np.float64) for g in pullback(dout)]

        def loss(qq, kk, vv):
            o = cuflash.forward(qq, kk, vv, causal=causal)
            return float((o.get().astype(np.float64) * dout_h).sum())

        for which, x in enumerate((q, k, v)):
            host = x.get()
            num = np.zeros(host.shape)
            for idx in np.ndindex(host.shape):
                plus, minus = host.copy(), host.copy()
                plus[idx] += np.float32(1e-2)
                minus[idx] -= np.float32(1e-2)
                h = float(plus[idx]) - float(minus[idx])  # the step as represented in float32
                args_p = [q, k, v]
                args_m = [q, k, v]
                args_p[which] = cupy.asarray(plus)
                args_m[which] = cupy.asarray(minus)
                num[idx] = (loss(*args_p) - loss(*args_m)) / h
            err = np.linalg.norm((grads[which] - num).ravel()) / np.linalg.norm(num.ravel())
            _log(f"fd causal={causal} {'qkv'[which]} rel err {err:.3e}")
            assert err <= 5e-4, f"d{'qkv'[which]} (causal={causal}): finite-difference rel err {err:.3e}"


def test_peak_memory_is_linear_at_32k(rng):
    """seqlen 32k: the backward's extra memory is O(seqlen * head_dim), far from seqlen^2."""
    import cupy
    import cuflash

    b, n, h, d = 1, 32768, 2, 64
    q, k, v, dout = (randn(rng, (b, n, h, d), "float16") for _ in range(4))
    out, lse = cuflash.forward(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = (cupy.empty_like(x) for x in (q, k, v))
    cupy.cuda.get_current_stream().synchronize()
    pool = cupy.get_default_memory_pool()
    for det in (False, True):
        pool.free_all_blocks()
        before = pool.total_bytes()
        cuflash.backward(dout, q, k, v, out, lse, causal=True, deterministic=det, dq=dq, dk=dk, dv=dv)
        cupy.cuda.get_current_stream().synchronize()
        extra = pool.total_bytes() - before  # freed blocks stay cached: an upper bound of the peak
        linear = b * n * h * d * 4            # one float32 (batch, seqlen, heads, head_dim) tensor
        _log(f"memory n={n} det={det}: extra {extra / 2**20:.1f} MiB (float32 q-sized tensor "
             f"{linear / 2**20:.1f} MiB, seqlen^2 fp16 {n * n * 2 / 2**30:.1f} GiB)")
        assert extra <= 2 * linear, f"extra memory {extra} bytes > 2 float32 q-sized tensors"
    from cuflash.reference import attention_reference_chunked

    refs = attention_reference_chunked(q, k, v, dout, causal=True)[2:]
    for name, x, r in zip(("dq", "dk", "dv"), (dq, dk, dv), refs):
        err = rel_err_gpu(x, r)
        _log(f"32k causal deterministic {name} {err:.3e}")
        assert err <= BWD_TOL["float16"], f"{name}: rel err {err:.3e} against float64"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
def test_small_shared_memory_tiles(rng, monkeypatch, dtype, head_dim):
    """The tiles for ~99 KB devices (sm_86, sm_89, sm_120), run here on whatever GPU is present."""
    import cuflash.api as api
    from cuflash import heuristics

    monkeypatch.setattr(heuristics, "smem_class", lambda cc: "small")
    monkeypatch.setattr(api, "_bwd_plans", {})
    for det in (False, True):
        check_bwd(rng, dtype, 2, 203, 150, 4, 2, head_dim, True, deterministic=det, label="small_smem")
        check_bwd(rng, dtype, 1, 150, 203, 2, 1, head_dim, False, deterministic=det, label="small_smem")


# ---- argument errors: raised before any kernel runs ----

def _no_launch(monkeypatch):
    import cuflash.api as api

    def fail(*a, **k):
        raise AssertionError("a kernel was launched before the arguments were rejected")

    monkeypatch.setattr(api, "_launch_bwd", fail)


def _good(dtype="float16", b=1, nq=9, nk=11, hq=4, hkv=2, d=64):
    import cupy
    from conftest import dtype_of

    dt = dtype_of(dtype)
    q = cupy.ones((b, nq, hq, d), dtype=dt)
    k = cupy.ones((b, nk, hkv, d), dtype=dt)
    lse = cupy.zeros((b, hq, nq), dtype=cupy.float32)
    return dict(dout=q.copy(), q=q, k=k, v=k.copy(), out=q.copy(), lse=lse)


def _call(a, **kw):
    import cuflash

    return cuflash.backward(a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], **kw)


@pytest.mark.parametrize("field,make,exc,match", [
    ("dout", lambda a, cp: a["dout"][:, :5], ValueError, "dout must have the shape of q"),
    ("dout", lambda a, cp: a["dout"].astype(cp.float32), TypeError, "dout must have the dtype of q"),
    ("dout", lambda a, cp: a["dout"].get(), TypeError, "dout must be a cupy.ndarray"),
    ("out", lambda a, cp: a["out"][:, :, :2], ValueError, "out must have the shape of q"),
    ("out", lambda a, cp: a["out"].astype(cp.float32), TypeError, "out must have the dtype of q"),
    ("lse", lambda a, cp: a["lse"].astype(cp.float16), TypeError, "lse must be float32"),
    ("lse", lambda a, cp: a["lse"].astype(cp.float64), TypeError, "lse must be float32"),
    ("lse", lambda a, cp: a["lse"][:, :2], ValueError, r"lse must have shape \(batch, heads_q, seqlen_q\)"),
    ("lse", lambda a, cp: a["lse"].transpose(0, 2, 1), ValueError, "lse must have shape"),
    ("lse", lambda a, cp: a["lse"].get(), TypeError, "lse must be a cupy.ndarray"),
    ("lse", lambda a, cp: None, TypeError, "lse must be a cupy.ndarray"),
    ("k", lambda a, cp: a["k"][:, :, :1], ValueError, "same shape"),
    ("v", lambda a, cp: a["v"].astype(cp.float32), TypeError, "v must have the dtype of q"),
    ("q", lambda a, cp: a["q"][:, :, :3], ValueError, "multiple of heads_kv"),
])
def test_argument_errors(monkeypatch, field, make, exc, match):
    import cupy

    _no_launch(monkeypatch)
    a = _good()
    a[field] = make(a, cupy)
    with pytest.raises(exc, match=match):
        _call(a)


@pytest.mark.parametrize("name,shape_of,dtype,exc,match", [
    ("dq", "k", None, ValueError, "dq must have shape"),
    ("dk", "q", None, ValueError, "dk must have shape"),
    ("dv", "v", "float32", TypeError, "dv must have dtype"),
])
def test_output_buffer_errors(monkeypatch, name, shape_of, dtype, exc, match):
    import cupy

    _no_launch(monkeypatch)
    a = _good()
    buf = cupy.empty(a[shape_of].shape, dtype=dtype or a["q"].dtype)
    with pytest.raises(exc, match=match):
        _call(a, **{name: buf})


def test_bad_scale_is_rejected(monkeypatch):
    _no_launch(monkeypatch)
    with pytest.raises(ValueError, match="softmax_scale"):
        _call(_good(), softmax_scale=-1.0)
