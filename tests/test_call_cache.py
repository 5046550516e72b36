"""The call caches of the forward and the backward (cuflash/call_cache.py): a repeated call replays its
recorded launches without the checks, and must still read the arrays' current contents, write where it is
told, and follow a change of stream, backend or arguments."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import BWD_TOL, FWD_TOL, assert_lse_matches, poisoned, randn, requires_gpu


def test_plans_clear_drops_recorded_calls():
    """Tuning scripts and tests clear the plans when they change the kernel choice; the calls
    recorded from those plans must go with them (CPU: no device needed)."""
    from cuflash import api, call_cache

    calls = call_cache.CallCache()
    plans = call_cache.Plans(calls)
    plans["plan"] = 1
    calls["call"] = 2
    plans.clear()
    assert not plans and not calls
    assert isinstance(api._fwd_plans, call_cache.Plans) and api._fwd_calls in api._fwd_plans._dependents


def test_key_declines_what_it_cannot_take():
    """NumPy arrays and scales that are not plain numbers take the checked path (which raises or
    converts); the key is never built from them (CPU)."""
    from cuflash import call_cache

    x = np.ones((1, 2, 1, 8), np.float16)
    assert call_cache.fwd_key(x, x, x, None, False, None, False) is None


def test_options_token_in_keys(monkeypatch):
    """The call cache's key and the plans' keys carry the options' token: equal settings share a token,
    other settings get another, so a changed option never replays a stale launch (CPU)."""
    from cuflash import call_cache, options

    base = options.use(options.Options())
    with options.override(fwd_backend="sm80") as sm80:
        assert sm80.token != base.token and options.current() is sm80
        with options.override(fwd_backend="auto") as again:
            assert again is base
    assert options.current() is base
    assert options.set(sm90_fwd_tiles=(128, 64, 12)).token not in (base.token, sm80.token)
    assert options.set(sm90_fwd_tiles=None) is base
    # A script that changes the environment and clears the plans gets the new setting.
    monkeypatch.setenv("CUFLASH_FWD_BACKEND", "sm80")
    call_cache.Plans().clear()
    assert options.current() is sm80
    # While the environment stays as it is, clearing plans keeps what set / override chose.
    options.set(fwd_backend="sm90")
    call_cache.Plans().clear()
    assert options.current().fwd_backend == "sm90"


def _inputs(rng, shape, dtype, count=3):
    return [randn(rng, shape, dtype) for _ in range(count)]


def _refill(rng, arrays, dtype):
    """New values in place: same addresses, so a repeated call hits the cache and must read them."""
    for x in arrays:
        x[...] = randn(rng, x.shape, dtype)


@requires_gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,dtype", [(64, "float16"), (128, "bfloat16"), (96, "float16"), (256, "bfloat16")])
def test_repeat_with_out_replays_without_checks(rng, monkeypatch, causal, d, dtype):
    import cuflash
    from cuflash import _checks
    from cuflash.reference import attention_reference, rel_err

    q, k, v = _inputs(rng, (2, 203, 4, d), dtype)
    k, v = k[:, :150, :2], v[:, :150, :2]   # GQA, seqlen_k != seqlen_q, strided views
    out = poisoned(q.shape, dtype)
    cuflash.forward(q, k, v, causal=causal, out=out)
    assert rel_err(out, attention_reference(q, k, v, causal=causal)[0]) <= FWD_TOL[dtype]

    def no_checks(*args, **kwargs):
        raise AssertionError("a repeated call must not run the checks")

    monkeypatch.setattr(_checks, "check_qkv_cached", no_checks)
    for _ in range(2):
        _refill(rng, (q, k, v), dtype)
        out.fill(np.nan)
        assert cuflash.forward(q, k, v, causal=causal, out=out) is out
        assert rel_err(out, attention_reference(q, k, v, causal=causal)[0]) <= FWD_TOL[dtype]


@requires_gpu
@pytest.mark.parametrize("return_lse", [False, True])
def test_repeat_allocating_output(rng, return_lse):
    """``out`` (and lse) allocated by each call: the pool hands back the last call's blocks, which are
    poisoned here, so a replay that skipped the kernel or wrote elsewhere cannot pass."""
    import cuflash
    from cuflash.reference import attention_reference, rel_err

    q, k, v = _inputs(rng, (1, 300, 3, 64), "float16")
    for _ in range(3):
        _refill(rng, (q, k, v), "float16")
        result = cuflash.forward(q, k, v, causal=True, return_lse=return_lse)
        o, lse = result if return_lse else (result, None)
        ref, ref_lse = attention_reference(q, k, v, causal=True)
        assert rel_err(o, ref) <= FWD_TOL["float16"]
        if return_lse:
            assert_lse_matches(lse, ref_lse, (1, 3, 300))
            lse.fill(np.nan)
        o.fill(np.nan)
        del o, lse, result


@requires_gpu
def test_other_stream_and_backend(rng, monkeypatch):
    """The same arrays on another stream, and after the forward backend changes, are other calls."""
    import cupy

    import cuflash
    from cuflash import api, options
    from cuflash.reference import attention_reference, rel_err

    q, k, v = _inputs(rng, (2, 129, 2, 64), "bfloat16")
    out = poisoned(q.shape, "bfloat16")
    cuflash.forward(q, k, v, out=out)
    before = len(api._fwd_calls)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        _refill(rng, (q, k, v), "bfloat16")
        out.fill(np.nan)
        cuflash.forward(q, k, v, out=out)
        stream.synchronize()
    assert len(api._fwd_calls) == before + 1
    assert rel_err(out, attention_reference(q, k, v)[0]) <= FWD_TOL["bfloat16"]
    options.set(fwd_backend="sm80")
    out.fill(np.nan)
    cuflash.forward(q, k, v, out=out)
    assert rel_err(out, attention_reference(q, k, v)[0]) <= FWD_TOL["bfloat16"]
    assert len(api._fwd_calls) == before + 2   # a new record: the backend is part of the key


@requires_gpu
def test_bad_arguments_after_a_recorded_call(rng):
    """A recorded call does not let a changed argument through: another shape or dtype of out, or a
    bad scale, still raises."""
    import cupy

    import cuflash

    q, k, v = _inputs(rng, (1, 64, 2, 64), "float16")
    out = poisoned(q.shape, "float16")
    cuflash.forward(q, k, v, out=out, softmax_scale=0.1)
    with pytest.raises(ValueError, match="out"):
        cuflash.forward(q, k, v, out=out[:, :32])
    with pytest.raises(TypeError, match="out"):
        cuflash.forward(q, k, v, out=cupy.empty(q.shape, cupy.float32))
    with pytest.raises(ValueError, match="softmax_scale"):
        cuflash.forward(q, k, v, out=out, softmax_scale=-0.1)
    with pytest.raises(TypeError, match="softmax_scale"):
        cuflash.forward(q, k, v, out=out, softmax_scale=True)


def test_key_declines_flags_that_are_not_bools():
    """A call cached with causal=True must not be replayed for causal="yes": the checked path rejects it (CPU)."""
    from cuflash import call_cache
    from conftest import fake_cupy_array

    x = fake_cupy_array((1, 2, 1, 8))
    assert call_cache.fwd_key(x, x, x, None, "yes", None, False) is None
    assert call_cache.fwd_key(x, x, x, None, True, None, np.bool_(False)) is None


def test_key_declines_without_a_device(device_forbidden):
    """No usable driver or GPU: no key, so the argument checks run and report first (CPU)."""
    from cuflash import call_cache
    from conftest import fake_cupy_array

    x = fake_cupy_array((1, 2, 1, 8))
    assert call_cache.fwd_key(x, x, x, None, False, None, False) is None


# ---------------------------------------------------------------------------- the backward's call cache


def test_bwd_key_declines_what_it_cannot_take(device_forbidden):
    """NumPy arrays, flags that are not bools, a non-contiguous lse, and no usable device take the checked
    path (CPU)."""
    from cuflash import api, call_cache
    from conftest import fake_cupy_array

    assert isinstance(api._bwd_plans, call_cache.Plans) and api._bwd_calls in api._bwd_plans._dependents
    x = fake_cupy_array((1, 4, 2, 8))
    lse = fake_cupy_array((1, 2, 4), np.float32)
    n = np.ones((1, 4, 2, 8), np.float16)
    assert call_cache.bwd_key(n, x, x, x, x, lse, None, None, None, None, False, None, False) is None
    assert call_cache.bwd_key(x, x, x, x, x, lse, None, None, None, None, "yes", None, False) is None
    assert call_cache.bwd_key(x, x, x, x, x, lse, None, None, None, None, False, None, np.bool_(True)) is None
    assert call_cache.bwd_key(x, x, x, x, x, lse, None, n, None, None, False, None, False) is None
    strided = fake_cupy_array((1, 2, 4), np.float32, strides=(64, 32, 4))
    assert call_cache.bwd_key(x, x, x, x, x, strided, None, None, None, None, False, None, False) is None
    # A usable device aside, a plain call has a key; here the stream lookup fails as without a driver.
    assert call_cache.bwd_key(x, x, x, x, x, lse, None, None, None, None, False, None, False) is None


def _bwd_case(rng, shape, dtype, causal, **variant):
    """q, k, v, dout (fresh values in place on each call), and the forward's out and lse at fixed addresses."""
    import cuflash

    q, k, v, dout = _inputs(rng, shape, dtype, 4)
    out = poisoned(q.shape, dtype)
    lse = cuflash.forward(q, k, v, causal=causal, out=out, return_lse=True, **variant)[1]

    def refill():
        _refill(rng, (q, k, v, dout), dtype)
        lse[...] = cuflash.forward(q, k, v, causal=causal, out=out, return_lse=True, **variant)[1]

    return q, k, v, dout, out, lse, refill


def _check_grads(grads, q, k, v, dout, causal, dtype, **variant):
    from cuflash.reference import attention_reference_backward, rel_err

    ref = attention_reference_backward(dout, q, k, v, causal=causal, **variant)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
        assert rel_err(got, want) <= BWD_TOL[dtype], name


def _no_checks(*args, **kwargs):
    raise AssertionError("a repeated call must not run the checks")


@requires_gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,dtype", [(64, "float16"), (128, "bfloat16")])
def test_backward_repeat_replays_without_checks(rng, monkeypatch, causal, d, dtype):
    """Gradients given: the second and third calls replay (the checks would raise) and read the new values."""
    import cuflash
    from cuflash import _checks

    q, k, v, dout, out, lse, refill = _bwd_case(rng, (2, 203, 4, d), dtype, causal)
    grads = [poisoned(x.shape, dtype) for x in (q, k, v)]
    cuflash.backward(dout, q, k, v, out, lse, causal=causal, dq=grads[0], dk=grads[1], dv=grads[2])
    _check_grads(grads, q, k, v, dout, causal, dtype)
    for _ in range(2):
        refill()
        for g in grads:
            g.fill(np.nan)
        with monkeypatch.context() as m:
            m.setattr(_checks, "check_qkv_cached", _no_checks)
            result = cuflash.backward(dout, q, k, v, out, lse, causal=causal, dq=grads[0], dk=grads[1], dv=grads[2])
        assert all(r is g for r, g in zip(result, grads))
        _check_grads(grads, q, k, v, dout, causal, dtype)


@requires_gpu
@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_repeat_allocating_gradients(rng, monkeypatch, deterministic):
    """Gradients allocated by each call: the pool hands back the last call's blocks, poisoned here, so a
    replay that skipped a kernel or wrote elsewhere cannot pass; deterministic replays give the same bits."""
    import cupy

    import cuflash
    from cuflash import api, call_cache

    replayed = []
    replay = call_cache.RecordedBackward.replay

    def counted(self, *args):
        result = replay(self, *args)
        replayed.append(result is not None)
        return result

    monkeypatch.setattr(call_cache.RecordedBackward, "replay", counted)
    q, k, v, dout, out, lse, refill = _bwd_case(rng, (1, 300, 3, 64), "float16", True)
    # A first call plans the kernels, whose cached device-side pieces take blocks of the pool between the
    # call's own allocations. After it a call mostly allocates what the one before freed and replays; where
    # the test's own arrays (the copies, the checks' temporaries) moved a block, it records anew (seen on
    # an H200: [True, True] and [False, True] after the first, without and with deterministic).
    warm = cuflash.backward(dout, q, k, v, out, lse, causal=True, deterministic=deterministic)
    del warm
    replayed.clear()
    before = len(api._bwd_calls)
    first = None
    for i in range(3):
        if i:
            lse[...] = cuflash.forward(q, k, v, causal=True, out=out, return_lse=True)[1]
        grads = cuflash.backward(dout, q, k, v, out, lse, causal=True, deterministic=deterministic)
        _check_grads(grads, q, k, v, dout, True, "float16")
        if deterministic:
            if first is None:
                first = [g.copy() for g in grads]
            else:
                assert all(bool(cupy.array_equal(a, b)) for a, b in zip(first, grads))
        for g in grads:
            g.fill(np.nan)
        del grads, g   # every reference dropped: the pool hands the blocks to the next call
    assert len(api._bwd_calls) == before and len(replayed) == 3 and True in replayed[1:]


@requires_gpu
def test_backward_replay_with_a_window_and_dlse(rng, monkeypatch):
    """The variant arguments and dlse are part of the key: a replayed windowed call with dlse reads the new
    dlse, and another window is another call."""
    import cuflash
    from cuflash import _checks, api
    from cuflash.reference import attention_reference_backward, rel_err

    variant = {"window_size": (37, 5)}
    q, k, v, dout, out, lse, refill = _bwd_case(rng, (1, 257, 2, 64), "bfloat16", False, **variant)
    dlse = randn(rng, lse.shape, "float32")
    grads = [poisoned(x.shape, "bfloat16") for x in (q, k, v)]

    def call(**kw):
        return cuflash.backward(dout, q, k, v, out, lse, dlse=dlse, dq=grads[0], dk=grads[1], dv=grads[2], **kw)

    call(**variant)
    before = len(api._bwd_calls)
    refill()
    dlse[...] = randn(rng, lse.shape, "float32")
    with monkeypatch.context() as m:
        m.setattr(_checks, "check_qkv_cached", _no_checks)
        call(**variant)
    ref = attention_reference_backward(dout, q, k, v, dlse=dlse.get(), **variant)
    for got, want in zip(grads, ref):
        assert rel_err(got, want) <= BWD_TOL["bfloat16"]
    assert len(api._bwd_calls) == before
    call(window_size=(36, 5))
    assert len(api._bwd_calls) == before + 1


@requires_gpu
def test_backward_bad_arguments_after_a_recorded_call(rng):
    """A recorded backward does not let a changed argument through."""
    import cupy

    import cuflash

    q, k, v, dout, out, lse, _ = _bwd_case(rng, (1, 64, 2, 64), "float16", False)
    dq = poisoned(q.shape, "float16")
    cuflash.backward(dout, q, k, v, out, lse, dq=dq)
    with pytest.raises(ValueError, match="dq"):
        cuflash.backward(dout, q, k, v, out, lse, dq=dq[:, :32])
    with pytest.raises(TypeError, match="dq"):
        cuflash.backward(dout, q, k, v, out, lse, dq=cupy.empty(q.shape, cupy.float32))
    with pytest.raises(ValueError, match="dq"):
        cuflash.backward(dout, q, k, v, out, lse, dq=q)   # overlaps an input
    with pytest.raises(ValueError, match="softmax_scale"):
        cuflash.backward(dout, q, k, v, out, lse, dq=dq, softmax_scale=-0.1)
