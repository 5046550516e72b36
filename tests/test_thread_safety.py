"""Caches under threads, on the CPU: each kernel is compiled once however many threads ask for it on a
cold start (different kernels side by side), and the argument-check and call caches give every thread
the answer of the uncached check while other threads fill and clear them."""
from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import pytest

from conftest import fake_cupy_array

pytest.importorskip("cupy")


class _FakeModule:
    """Stands for cupy.RawModule: counts compiles per source and options, and how many run at once."""

    lock = threading.Lock()
    compiles: dict = {}
    running = 0
    most_at_once = 0

    def __init__(self, code, options, name_expressions):
        cls = type(self)
        with cls.lock:
            key = (options, tuple(name_expressions))
            cls.compiles[key] = cls.compiles.get(key, 0) + 1
            cls.running += 1
            cls.most_at_once = max(cls.most_at_once, cls.running)
        time.sleep(0.05)   # NVRTC's time, without the GIL
        with cls.lock:
            cls.running -= 1

    def get_function(self, name):
        return type("FakeKernel", (), {"name": name})()


@pytest.fixture
def fake_compiler(monkeypatch):
    import cupy

    from cuflash import dispatch, options

    _FakeModule.compiles, _FakeModule.running, _FakeModule.most_at_once = {}, 0, 0
    monkeypatch.setattr(cupy, "RawModule", _FakeModule)
    monkeypatch.setattr(cupy.cuda, "Device", lambda *a: contextlib.nullcontext())
    monkeypatch.setattr(dispatch, "real_device_info", lambda device_id: (90, 232448))
    monkeypatch.setattr(dispatch, "_kernels", {})
    monkeypatch.setattr(dispatch, "_modules", {})
    monkeypatch.setattr(dispatch, "_smem", {})
    monkeypatch.setattr(dispatch, "_module_int", lambda module, expr, device_id: 1024)   # no module to read
    monkeypatch.setattr(dispatch, "_key_locks", {})
    options.set(nvrtc_defines=())   # conftest restores the options after the test
    return dispatch


def _run_threads(n: int, fn) -> list:
    results, errors = [None] * n, []
    barrier = threading.Barrier(n)

    def body(i):
        barrier.wait()
        try:
            results[i] = fn(i)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    return results


def test_one_kernel_compiled_once_for_sixteen_threads(fake_compiler):
    from cuflash import heuristics

    cfg = heuristics.fwd_config("float16", 64, True, 90)
    kernels = _run_threads(16, lambda i: fake_compiler.get_kernel(cfg, 0))
    assert sum(_FakeModule.compiles.values()) == 1
    assert all(k is kernels[0] for k in kernels)


def test_different_kernels_compile_side_by_side_each_once(fake_compiler):
    from cuflash import heuristics

    cfgs = [heuristics.fwd_config(dt, d, c, 90) for dt in ("float16", "bfloat16") for d in (64, 128)
            for c in (False, True)]
    kernels = _run_threads(32, lambda i: fake_compiler.get_kernel(cfgs[i % len(cfgs)], 0))
    assert len(_FakeModule.compiles) == len(cfgs) and set(_FakeModule.compiles.values()) == {1}
    for i, k in enumerate(kernels):
        assert k is fake_compiler.get_kernel(cfgs[i % len(cfgs)], 0)
    assert _FakeModule.most_at_once > 1, "compiles of different kernels waited for each other"


def test_check_caches_agree_with_the_checks_while_other_threads_clear_them(monkeypatch):
    """Tiny caches, cleared all the time by eight threads with different shapes: every call returns
    what the uncached check returns, or raises what it raises."""
    from cuflash import _checks, api

    monkeypatch.setattr(_checks, "_VALIDATED_MAX", 4)
    shapes = [((b, n, h, d), (b, m, h // g, d)) for b in (1, 2) for n, m in ((7, 9), (16, 16))
              for h, g in ((4, 2), (2, 1)) for d in (64, 72, 260)]

    def _outcome(check, out, shape):
        try:
            check("out", out, shape, np.float16, 0)
        except ValueError as e:
            return str(e)
        return None

    def uncached(q, k):
        try:
            return _checks.check_qkv(q, k, k, api.HEAD_DIMS)
        except ValueError as e:
            return type(e)

    def worker(i):
        rng = np.random.default_rng(i)
        for _ in range(400):
            qs, ks = shapes[rng.integers(len(shapes))]
            q, k = fake_cupy_array(qs), fake_cupy_array(ks)
            try:
                got = _checks.check_qkv_cached(q, k, k, api.HEAD_DIMS)
            except ValueError as e:
                got = type(e)
            assert got == uncached(q, k)
            out = fake_cupy_array(qs, offset=16 * int(rng.integers(2)) + 2 * int(rng.integers(2)))
            assert _outcome(_checks.check_out_cached, out, qs) == _outcome(_checks.check_out, out, qs)

    _run_threads(8, worker)


def test_call_cache_bounded_under_threads(monkeypatch):
    """Recording past the bound clears the cache; lookups on other threads meanwhile find a recorded
    call of their own key or nothing, never another key's."""
    from cuflash import call_cache

    monkeypatch.setattr(call_cache, "CALLS_MAX", 8)
    calls = call_cache.CallCache()

    class _Out:
        def __init__(self, ptr):
            self.data = type("D", (), {"ptr": ptr})()
            self.shape = (1,)

    def worker(i):
        for j in range(2000):
            key = (i, j % 13, 0, 0)   # key[-2] is the device
            calls.record(key, ("launch", key), _Out(j), None, 0)
            found = calls.get((i, (j * 7) % 13, 0, 0))
            assert found is None or found.launch == ("launch", (i, (j * 7) % 13, 0, 0))
        assert len(calls) <= 8 + 8   # each thread may add one after another's clear

    _run_threads(8, worker)
