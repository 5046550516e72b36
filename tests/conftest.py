"""Shared fixtures: GPU detection, random inputs, poisoned outputs, error bounds."""
from __future__ import annotations

import math
import os
import zlib
from collections import Counter

import numpy as np
import pytest


def _gpu_reason() -> str | None:
    """Why the GPU tests cannot run here, in cuflash.device_check's words (as ``python -m cuflash`` and the
    library's DeviceUnavailableError say it), or None."""
    try:
        import cupy  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"CuPy is not importable ({e})"
    from cuflash.device_check import diagnose

    try:
        problem = diagnose()
    except Exception as e:  # noqa: BLE001 - a broken setup must say so, not crash the collection
        return f"the CUDA setup could not be read ({type(e).__name__}: {e})"
    return None if problem is None else f"cuflash cannot run its kernels here: {problem.case}"


GPU_SKIP_REASON = _gpu_reason()
GPU_REASON_PREFIX = "needs an NVIDIA GPU"
requires_gpu = pytest.mark.skipif(GPU_SKIP_REASON is not None,
                                  reason=f"{GPU_REASON_PREFIX}: {GPU_SKIP_REASON}")


def planned_cc() -> int:
    """The compute capability that the dispatcher plans for on the current device (dispatch.device_info: the
    device's own, or CUFLASH_PLAN_CC's), which decides the kernels a call takes: what the gates of the tests of
    one GPU's kernels (the Hopper ones, the fp8 forward) read, so that an H100 planned as an A100 skips them."""
    import cupy

    from cuflash import dispatch

    return dispatch.device_info(cupy.cuda.Device().id)[0]


def pytest_addoption(parser) -> None:
    parser.addoption("--require-gpu", action="store_true",
                     help="fail (instead of skipping the GPU tests) where no usable GPU is found, and where "
                          "GPU tests were selected but none ran (dev/device_run.sh passes it)")


def pytest_configure(config) -> None:
    if config.getoption("--require-gpu") and GPU_SKIP_REASON is not None:
        raise pytest.UsageError(f"--require-gpu: {GPU_SKIP_REASON}")


def _is_gpu_test(item) -> bool:
    """Whether the test is marked as needing a GPU: a skipif whose reason names one (requires_gpu, and the
    torch / JAX / multi-GPU variants), whether or not it skips here."""
    for mark in item.iter_markers("skipif"):
        reason = str(mark.kwargs.get("reason", ""))
        if "GPU" in reason or "CUDA" in reason:
            return True
    return False


_gpu_tests: set = set()
_gpu_outcomes: Counter = Counter()


def pytest_collection_modifyitems(config, items) -> None:
    _gpu_tests.update(item.nodeid for item in items if _is_gpu_test(item))


def pytest_runtest_logreport(report) -> None:
    """Each marked GPU test's outcome, once (its call; its setup where that failed or skipped)."""
    if report.nodeid in _gpu_tests and (report.when == "call" or report.outcome != "passed"):
        if report.when != "teardown":
            _gpu_outcomes[report.outcome] += 1


def pytest_sessionfinish(session, exitstatus) -> None:
    ran = _gpu_outcomes["passed"] + _gpu_outcomes["failed"]
    if session.config.getoption("--require-gpu") and _gpu_tests and ran == 0 and exitstatus == 0:
        session.exitstatus = 1   # GPU tests selected, a GPU found, and not one of them ran


# No test needs cuBLAS (the bench extra): cuflash.attention_reference_chunked, the float64 reference of the long
# sequences, computes on the host with NumPy where cuBLAS is missing.


# Relative-norm error bounds against the float64 reference, per dtype.
FWD_TOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-5}
# On each of dq, dk, dv: 1.25-1.5x the forward's. Measured on an H100 (2026-11-23) over test_bwd.py's
# cases: worst fp16 4.5e-4, bf16 3.4e-3, fp32 1.5e-6 (typical 3e-4, 2.4e-3, 5e-7), about the inputs' rounding.
BWD_TOL = {"float16": 2.5e-3, "bfloat16": 2e-2, "float32": 1.5e-5}
# lse, any dtype: |lse - ref| <= LSE_RTOL * max(1, |ref|) on every row. The kernels' lse is float32 sums of
# float32 probabilities of scores accumulated in float32 from the same (rounded) inputs as the reference,
# about 1e-6 relative; set CUFLASH_ERRLOG=path to log each test's worst ratio to the bound.
LSE_RTOL = 1e-5
# fp8: the scores come from e4m3 products accumulated by the fp8 tensor cores, whose accumulator keeps
# fewer bits than float32 on Hopper: per row the worst seen on an H100 (2026-11-26) was 5.1e-3 * max(1, |lse|)
# (one key, D=256), hence 1e-2. Check with CUFLASH_ERRLOG.
LSE_RTOL_FP8 = 1e-2
# Long sequences checked on every row: each row's relative error (over head_dim) within this many times the
# dtype's whole-array bound, so that one wrong row cannot hide in the norm of 32k good ones.
ROW_TOL_FACTOR = 4


def dtype_of(name: str):
    import ml_dtypes

    return {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[name]


@pytest.fixture(autouse=True)
def _restore_cuflash_options():
    """Whatever a test sets with cuflash.options.set / use / reload, the next one starts from the settings in
    force before it (after monkeypatch has put the environment back)."""
    from cuflash import options

    before = options.current()
    yield
    options.use(before)


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test id so failures can be replayed."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)


def randn(rng, shape, dtype_name: str):
    """A random CuPy array (never zeros) of the named dtype."""
    import cupy

    host = rng.standard_normal(shape).astype(np.float32)
    return cupy.asarray(host.astype(dtype_of(dtype_name)))


def poisoned(shape, dtype_name: str):
    """An output buffer filled with NaN, so unwritten elements cannot pass."""
    import cupy

    out = cupy.empty(shape, dtype=dtype_of(dtype_name))
    out.fill(np.nan)
    return out


def _errlog(line: str) -> None:
    path = os.environ.get("CUFLASH_ERRLOG")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def to_host(x) -> np.ndarray:
    """A CuPy array, a PyTorch tensor, a JAX array or anything NumPy takes, as a NumPy array (same dtype)."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "detach") and hasattr(x, "cpu"):   # torch (NumPy has no bfloat16: widened, exactly)
        x = x.detach().cpu()
        return (x.float() if str(x.dtype) == "torch.bfloat16" else x).numpy()
    if hasattr(x, "get") and hasattr(x, "device"):   # CuPy
        return x.get()
    return np.asarray(x)


def assert_lse_matches(lse, ref_lse, shape, rtol: float = LSE_RTOL) -> None:
    """The kernel's lse (CuPy, PyTorch or JAX; float32 ``shape``) against the float64 reference (NumPy,
    CuPy or PyTorch): -inf exactly where the reference is (rows that see no key), else within
    rtol * max(1, |ref|) per row."""
    lse_h = to_host(lse)
    ref_lse = to_host(ref_lse).astype(np.float64)
    assert lse_h.dtype == np.float32 and lse_h.shape == tuple(shape)
    fin = np.isfinite(ref_lse)
    assert np.array_equal(np.isneginf(lse_h), ~fin), "lse must be -inf exactly for rows that see no key"
    if fin.any():
        got, ref = lse_h[fin].astype(np.float64), ref_lse[fin]
        ratio = np.abs(got - ref) / (rtol * np.maximum(1.0, np.abs(ref)))
        worst = int(np.argmax(ratio))   # the first NaN if there is one, which fails below
        _errlog(f"lse shape={tuple(shape)} rtol={rtol:.0e}: worst |err| / bound {ratio[worst]:.3f} "
                f"(err {abs(got[worst] - ref[worst]):.3e} at lse {ref[worst]:.4g})")
        assert ratio[worst] <= 1.0, (f"lse err {abs(got[worst] - ref[worst]):.3e} at lse {ref[worst]:.6g} > "
                                     f"{rtol:.0e} * max(1, |lse|)")


def rel_err_gpu(x, ref) -> float:
    """||x - ref|| / ||ref|| over the whole array, computed on the GPU in float64; inf if x has NaN or inf."""
    import cupy

    x, ref = cupy.asarray(x, cupy.float64), cupy.asarray(ref, cupy.float64)
    if not bool(cupy.isfinite(x).all()):
        return math.inf
    den = float(cupy.linalg.norm(ref.ravel()))
    num = float(cupy.linalg.norm((x - ref).ravel()))
    return (0.0 if num == 0.0 else math.inf) if den == 0.0 else num / den


def row_errors(x, ref):
    """Per row of (batch, seqlen, heads, head_dim) arrays on the GPU: ||x - ref|| / ||ref|| over head_dim
    (CuPy float64, shape (batch, seqlen, heads)); inf where x has NaN or inf, or ref is 0 and x is not."""
    import cupy

    x, ref = cupy.asarray(x, cupy.float64), cupy.asarray(ref, cupy.float64)
    num, den = cupy.linalg.norm(x - ref, axis=-1), cupy.linalg.norm(ref, axis=-1)
    err = cupy.where(den > 0, num / cupy.where(den > 0, den, 1.0), cupy.where(num > 0, cupy.inf, 0.0))
    return cupy.where(cupy.isfinite(x).all(axis=-1), err, cupy.inf)


def assert_close_on_every_row(name: str, x, ref, dtype_name: str, tol: dict) -> None:
    """The whole array within ``tol[dtype]`` in relative norm and every row within ROW_TOL_FACTOR times it."""
    err = rel_err_gpu(x, ref)
    rows = row_errors(x, ref)
    worst = float(rows.max()) if rows.size else 0.0
    _errlog(f"{name} {dtype_name} shape={tuple(x.shape)}: rel err {err:.3e}, worst row {worst:.3e}")
    assert err <= tol[dtype_name], f"{name} rel err {err:.3e} > {tol[dtype_name]:.1e}"
    bound = ROW_TOL_FACTOR * tol[dtype_name]
    bad = int((rows > bound).sum())
    assert bad == 0, f"{name}: {bad} rows with rel err > {bound:.1e} (worst {worst:.3e})"


def assert_grads_close_on_every_row(names, grads, refs, dtype_name: str, tol: dict, label: str = "",
                                    per_row: bool = True) -> None:
    """Gradients against their references: each within ``tol[dtype]`` in relative norm and every row within
    ROW_TOL_FACTOR times it, both measured against at least a floor, a tenth of the gradients' natural size (the
    largest one's root-mean-square row norm). Where the exact gradient is ~0 (a query that sees one key, or a
    one-hot softmax under sharp scores) the kernels return rounding noise (dP - delta ~ 1e-7 in float32) and the
    float64 reference 0: a relative measure without the floor would call that noise infinitely wrong. NaN and inf
    still fail. ``per_row=False``: the whole arrays only (sharp scores: bf16's rounding of near-one-hot
    probabilities moves a few rows of dq past the row bound on the dense kernels too; tests/test_varlen_bwd.py)."""
    import cupy

    refs = [cupy.asarray(r, cupy.float64) for r in refs]
    rms_row = max((float(cupy.linalg.norm(r.ravel())) / math.sqrt(max(1, r.size // r.shape[-1])) for r in refs
                   if r.size), default=0.0)
    floor = 0.1 * rms_row
    bound = ROW_TOL_FACTOR * tol[dtype_name]
    for name, x, ref in zip(names, grads, refs):
        name = f"{label} {name}".strip()
        x = cupy.asarray(x, cupy.float64)
        finite = cupy.isfinite(x).all(axis=-1)
        rows_num = cupy.linalg.norm(x - ref, axis=-1)
        rows = cupy.where(finite, rows_num / cupy.maximum(cupy.linalg.norm(ref, axis=-1), max(floor, 1e-300)),
                          cupy.inf)
        n_rows = max(1, ref.size // ref.shape[-1]) if ref.size else 1
        whole_den = max(float(cupy.linalg.norm(ref.ravel())), floor * math.sqrt(n_rows))
        num = float(cupy.linalg.norm((x - ref).ravel())) if bool(finite.all()) else math.inf
        err = num / whole_den if whole_den > 0 else (0.0 if num == 0.0 else math.inf)
        worst = float(rows.max()) if rows.size else 0.0
        _errlog(f"{name} {dtype_name} shape={tuple(x.shape)}: rel err {err:.3e} (floor {floor:.2e}), "
                f"worst row {worst:.3e}")
        assert err <= tol[dtype_name], f"{name} rel err {err:.3e} > {tol[dtype_name]:.1e}"
        bad = int((rows > bound).sum())
        assert bad == 0 or not per_row, f"{name}: {bad} rows with rel err > {bound:.1e} (worst {worst:.3e})"


def assert_programmable_grads_close(grads, refs, dtype_name: str, *, dbias_of=None, tensor_refs=None,
                                    per_row: bool = True) -> None:
    """A programmable backward's results against the float64 reference's: dq, dk, dv (every row unless
    ``per_row`` is False), then dbias (the shape and dtype of the bias ``dbias_of``; whole array) and the score
    modifier's tensor gradients (``tensor_refs``: {name: reference}), and nothing more."""
    import cupy

    assert_grads_close_on_every_row(("dq", "dk", "dv"), grads[:3], refs[:3], dtype_name, BWD_TOL, per_row=per_row)
    rest = list(grads[3:])
    if dbias_of is not None:
        dbias = rest.pop(0)
        assert dbias.shape == dbias_of.shape and dbias.dtype == dbias_of.dtype
        assert_grads_close_on_every_row(("dbias",), [dbias.astype(cupy.float64)], [refs[3]], dtype_name, BWD_TOL,
                                        per_row=False)
    if tensor_refs:
        got = rest.pop(0)
        for name, ref in tensor_refs.items():
            assert_grads_close_on_every_row((f"d_{name}",), [got[name].reshape(ref.shape)], [ref], dtype_name,
                                            BWD_TOL, per_row=False)
    assert not rest


# A fake device address: 256-byte aligned, far from anything real. Arrays over it are never read.
_FAKE_PTR = 1 << 40


def fake_cupy_array(shape, dtype=np.float16, *, strides=None, offset: int = 0, device_id: int = 0):
    """A real ``cupy.ndarray`` over memory that is never allocated or read: CuPy builds it from the
    metadata alone, without a driver, so the argument checks (which read only shape, dtype, strides,
    the address and the device id) run on a CPU-only machine. Never pass one to a call that would
    launch a kernel: the tests that use it give at least one bad argument."""
    import cupy

    nbytes = 1 << 30
    mem = cupy.cuda.UnownedMemory(_FAKE_PTR, nbytes, None, device_id=device_id)
    return cupy.ndarray(shape, dtype, memptr=cupy.cuda.MemoryPointer(mem, offset), strides=strides)


@pytest.fixture
def device_forbidden(monkeypatch):
    """The state of a machine without a usable GPU, on any machine: the call cache's stream lookup
    fails as CuPy's does there, and whatever would allocate or launch raises, so a test passes only if
    the argument checks raise first."""
    import cupy
    from cupy.cuda.runtime import CUDARuntimeError

    from cuflash import api, call_cache

    def no_driver(*args, **kwargs):
        raise CUDARuntimeError(35)   # cudaErrorInsufficientDriver

    def touched(*args, **kwargs):
        raise AssertionError("the device was touched before the argument checks raised")

    call_cache._ndarray or call_cache._bind_cupy()
    monkeypatch.setattr(call_cache, "_current_stream", no_driver)
    monkeypatch.setattr(api, "_run_forward", touched)
    for name in ("empty", "zeros", "full", "ascontiguousarray"):
        monkeypatch.setattr(cupy, name, touched)


def pytest_terminal_summary(terminalreporter, config) -> None:
    """How many of the tests marked as needing a GPU ran, and each skip reason once, with its count: on a
    machine without a GPU over a thousand tests skip for the same reason, which pytest's -rs lists once
    per test function."""
    if _gpu_tests:
        ran = _gpu_outcomes["passed"] + _gpu_outcomes["failed"]
        line = (f"GPU tests: {ran} ran ({_gpu_outcomes['passed']} passed, {_gpu_outcomes['failed']} failed), "
                f"{_gpu_outcomes['skipped']} skipped, of {len(_gpu_tests)} selected")
        if GPU_SKIP_REASON is not None:
            line += f" ({GPU_SKIP_REASON})"
        terminalreporter.write_line(line)
        if config.getoption("--require-gpu") and ran == 0:
            terminalreporter.write_line("--require-gpu: no GPU test ran", red=True)
    reports = terminalreporter.stats.get("skipped", [])
    reasons = Counter()
    for rep in reports:
        longrepr = rep.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    if reasons:
        terminalreporter.section("skip reasons", sep="-")
        for reason, n in reasons.most_common():
            terminalreporter.write_line(f"{n:5d} skipped: {reason}")


@pytest.fixture
def hopper_kernels_only(monkeypatch):
    """The Hopper kernels must not give way to the portable ones unseen: a fallback (TMA refusing an input's
    pointer or strides) passes every numeric check while testing the wrong kernel. Tests whose inputs TMA can
    always address use this: the forward's fallback raises, and the backward's tensor maps must exist."""
    from cuflash import sm90

    def refuse(*args, **kwargs):
        raise AssertionError("the Hopper forward gave way to the portable kernel (sm90._portable_fwd)")

    maps = sm90.bwd_tensor_maps

    def bwd_maps(*args):
        found = maps(*args)
        assert found is not None, "the Hopper backward gave way to the portable kernels (no tensor maps)"
        return found

    monkeypatch.setattr(sm90, "_portable_fwd", refuse)
    monkeypatch.setattr(sm90, "bwd_tensor_maps", bwd_maps)
