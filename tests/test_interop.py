"""Arrays of other frameworks through the public entry points (cuflash/interop.py).

CPU: which arguments take the conversion path, and the TypeErrors (host memory, mixed frameworks,
immutable output buffers) raised from metadata before the device is touched. GPU: torch tensors
(and JAX arrays where JAX imports) read in place, results in the caller's framework, bitwise equal
to the CuPy path on the same memory and within the suite's bounds of the float64 reference (values,
lse and gradients), on torch's current stream, with torch-allocated memory.
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import cuflash
from cuflash import interop
from conftest import BWD_TOL, FWD_TOL, GPU_SKIP_REASON, assert_lse_matches, fake_cupy_array as arr, planned_cc, to_host
from cuflash.reference import attention_reference, attention_reference_backward, rel_err

QKV = (1, 4, 2, 64)


class CudaStandIn:
    """A DLPack producer on CUDA device 0 whose memory must never be read (CPU tests)."""

    def __dlpack__(self, stream=None, **kwargs):
        raise AssertionError("the array was read: a TypeError should have come first")

    def __dlpack_device__(self):
        return (2, 0)


class HostStandIn(CudaStandIn):
    def __dlpack_device__(self):
        return (1, 0)   # kDLCPU


class _JaxGpu:
    platform, id = "gpu", 0


class JaxStandIn(CudaStandIn):
    """Looks like a JAX array on a GPU (module name and devices()), for the immutability check."""

    def devices(self):
        return {_JaxGpu()}


JaxStandIn.__module__ = "jax._src.array"


def _cpu_tensor(shape=QKV, dtype="float16"):
    torch = pytest.importorskip("torch")
    return torch.zeros(shape, dtype=getattr(torch, dtype))


# ---- CPU: which calls convert, and the TypeErrors before the device ----

def test_import_cuflash_imports_neither_torch_nor_jax():
    code = ("import sys, cuflash, cuflash.api, cuflash.interop; "
            "assert 'torch' not in sys.modules and 'jax' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cupy_numpy_and_non_arrays_take_the_plain_path():
    assert not interop.needs_conversion(arr(QKV), None, arr(QKV))
    assert not interop.needs_conversion(np.zeros(3), [1.0], "x", 1.0)   # the checks' own TypeErrors
    assert interop.needs_conversion(arr(QKV), CudaStandIn())


@pytest.mark.usefixtures("device_forbidden")
@pytest.mark.parametrize("name", ["q", "k", "v", "out"])
def test_cpu_torch_tensor_to_forward(name):
    args = {"q": CudaStandIn(), "k": CudaStandIn(), "v": CudaStandIn(), "out": None}
    args[name] = _cpu_tensor()
    match = rf"{name} must be a cupy.ndarray or a CUDA array.*torch tensor on cpu.*{name}\.cuda\(\)"
    with pytest.raises(TypeError, match=match):
        cuflash.forward(**args)


@pytest.mark.usefixtures("device_forbidden")
def test_cpu_torch_tensors_to_every_entry_point():
    t, lse = _cpu_tensor(), _cpu_tensor((1, 2, 4), "float32")
    u8 = _cpu_tensor(dtype="uint8")
    calls = {
        "dout": lambda: cuflash.backward(t, t, t, t, t, lse),
        "x": lambda: cuflash.quantize_fp8(t),
        "q": lambda: cuflash.forward_fp8(u8, u8, u8, 1.0, 1.0, 1.0),
        "descale_k": lambda: cuflash.forward_fp8(arr(QKV, np.uint8), arr(QKV, np.uint8), arr(QKV, np.uint8),
                                                 1.0, _cpu_tensor((1,), "float32"), 1.0),
    }
    for name, fn in calls.items():
        with pytest.raises(TypeError, match=rf"{name} must be a cupy.ndarray or a CUDA array.*{name}\.cuda\(\)"):
            fn()
    with pytest.raises(TypeError, match=r"q must be .*torch tensor on cpu"):
        cuflash.vjp(t, t, t)


@pytest.mark.usefixtures("device_forbidden")
def test_cpu_tensor_among_cupy_arrays_is_named():
    with pytest.raises(TypeError, match=r"lse must be a cupy.ndarray or a CUDA array.*lse\.cuda\(\)"):
        cuflash.backward(arr(QKV), arr(QKV), arr(QKV), arr(QKV), arr(QKV), _cpu_tensor((1, 2, 4), "float32"))


@pytest.mark.usefixtures("device_forbidden")
def test_host_dlpack_array_is_refused():
    with pytest.raises(TypeError, match=r"k must be .* on DLPack device type 1, not CUDA"):
        cuflash.forward(CudaStandIn(), HostStandIn(), CudaStandIn())


@pytest.mark.usefixtures("device_forbidden")
def test_numpy_beside_a_foreign_array_gets_the_hint():
    with pytest.raises(TypeError, match=r"v must be .*numpy.ndarray \(host memory\); convert with cupy.asarray\(v\)"):
        cuflash.forward(CudaStandIn(), CudaStandIn(), np.zeros(QKV, np.float16))


@pytest.mark.usefixtures("device_forbidden")
@pytest.mark.parametrize("name", ["k", "v", "out"])
def test_mixed_frameworks_are_named(name):
    args = {"q": arr(QKV), "k": arr(QKV), "v": arr(QKV), "out": arr(QKV)}
    args[name] = CudaStandIn()
    with pytest.raises(TypeError, match=rf"q is a cupy array but {name} is a test_interop array"):
        cuflash.forward(**args)


@pytest.mark.usefixtures("device_forbidden")
def test_mixed_frameworks_in_backward():
    with pytest.raises(TypeError, match=r"dout is a test_interop array but q is a cupy array"):
        cuflash.backward(CudaStandIn(), arr(QKV), arr(QKV), arr(QKV), arr(QKV), arr((1, 2, 4), np.float32))


@pytest.mark.usefixtures("device_forbidden")
def test_immutable_output_buffers_are_refused():
    x = JaxStandIn
    with pytest.raises(TypeError, match=r"out: JAX arrays are immutable"):
        cuflash.forward(x(), x(), x(), out=x())
    with pytest.raises(TypeError, match=r"dk: JAX arrays are immutable"):
        cuflash.backward(x(), x(), x(), x(), x(), x(), dk=x())


@pytest.mark.usefixtures("device_forbidden")
def test_cupy_path_never_converts(monkeypatch):
    def converted(*args, **kwargs):
        raise AssertionError("a CuPy call went through interop.call")

    monkeypatch.setattr(interop, "call", converted)
    with pytest.raises(ValueError, match="batch size"):
        cuflash.forward(arr(QKV), arr((2, 4, 2, 64)), arr((2, 4, 2, 64)), out=arr(QKV))
    with pytest.raises(ValueError, match="lse must have shape"):
        cuflash.backward(arr(QKV), arr(QKV), arr(QKV), arr(QKV), arr(QKV), arr((1, 4, 2), np.float32))


def test_results_in_torch_memory_become_tensors_on_its_storage():
    """A result cuflash allocated from torch's allocator (a CuPy array whose memory is a torch block)
    goes back as a tensor on that block's storage, with the array's offset, shape, strides and dtype
    (CPU: the same bookkeeping over a CPU block)."""
    import cupy
    import ml_dtypes

    torch = pytest.importorskip("torch")
    block = torch.zeros(4096, dtype=torch.uint8)
    memory = cupy.cuda.UnownedMemory(block.data_ptr(), block.numel(), block, 0)
    a = cupy.ndarray((2, 3, 4), ml_dtypes.bfloat16, memptr=cupy.cuda.MemoryPointer(memory, 64), strides=(48, 16, 2))
    t = interop._TORCH.from_cupy(a)
    assert t.dtype == torch.bfloat16 and t.shape == (2, 3, 4) and t.stride() == (24, 8, 1)
    assert t.data_ptr() == block.data_ptr() + 64
    assert t.untyped_storage().data_ptr() == block.untyped_storage().data_ptr()


# ---- GPU: torch tensors in place, results back in torch ----

def _torch_cuda():
    torch = pytest.importorskip("torch")
    if GPU_SKIP_REASON is not None:
        pytest.skip(f"needs an NVIDIA GPU: {GPU_SKIP_REASON}")
    if not torch.cuda.is_available():
        pytest.skip("needs PyTorch with CUDA")
    return torch


def _torch_qkv(torch, dtype, b=2, nq=77, nk=133, hq=4, hkv=2, d=64, requires_grad=False):
    g = torch.Generator(device="cuda").manual_seed(0)
    dt = getattr(torch, dtype)
    return tuple(torch.randn(shape, device="cuda", dtype=dt, generator=g).requires_grad_(requires_grad)
                 for shape in ((b, nq, hq, d), (b, nk, hkv, d), (b, nk, hkv, d)))


def _against_float64(dtype, q, k, v, causal, out, lse=None, dout=None, grads=None):
    """A torch / JAX call's results against the float64 reference on the same inputs: out (and lse) within the
    suite's bounds (FWD_TOL, LSE_RTOL per row), and dq, dk, dv within BWD_TOL where given."""
    hq, kh, vh = map(to_host, (q, k, v))
    ref_out, ref_lse = attention_reference(hq, kh, vh, causal=causal)
    err = rel_err(to_host(out), ref_out)
    assert err <= FWD_TOL[dtype], f"out rel err {err:.3e} against float64"
    if lse is not None:
        b, nq, h, _ = hq.shape
        assert_lse_matches(lse, ref_lse, (b, h, nq))
    if grads is not None:
        refs = attention_reference_backward(to_host(dout), hq, kh, vh, causal=causal)
        for name, g, r in zip(("dq", "dk", "dv"), grads, refs):
            err = rel_err(to_host(g), r)
            assert err <= BWD_TOL[dtype], f"{name} rel err {err:.3e} against float64"


def _cupy_view(x):
    """The CuPy view cuflash reads a torch tensor through (interop's own conversion)."""
    return interop._TORCH.to_cupy("x", x)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_views_share_memory(dtype):
    torch = _torch_cuda()
    q, _, _ = _torch_qkv(torch, dtype)
    strided = torch.empty(2, 77, 3, 4, 64, device="cuda", dtype=q.dtype)[:, :, 1]
    for x in (q, strided, q.requires_grad_(True)):
        view = _cupy_view(x)
        assert view.data.ptr == x.data_ptr()
        assert view.shape == tuple(x.shape) and view.strides == tuple(s * x.element_size() for s in x.stride())
    back = interop._TORCH.from_cupy(_cupy_view(q))
    assert back.dtype == q.dtype and back.data_ptr() == q.data_ptr() and torch.equal(back, q)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("causal", [False, True])
def test_torch_forward_equals_cupy_forward(dtype, causal):
    torch = _torch_cuda()
    q, k, v = _torch_qkv(torch, dtype)
    out, lse = cuflash.forward(q, k, v, causal=causal, return_lse=True)
    assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.dtype == torch.float32 and lse.shape == (2, 4, 77)
    ref, ref_lse = cuflash.forward(*map(_cupy_view, (q, k, v)), causal=causal, return_lse=True)
    torch.cuda.synchronize()
    assert torch.equal(out, interop._TORCH.from_cupy(ref)) and torch.equal(lse, interop._TORCH.from_cupy(ref_lse))
    _against_float64(dtype, q, k, v, causal, out, lse)

    given = torch.full_like(q, float("nan"))
    assert cuflash.forward(q, k, v, causal=causal, out=given) is given
    assert torch.equal(given, out)


def test_torch_results_use_torch_memory():
    """Outputs cuflash allocates for a torch call come from torch's caching allocator, not CuPy's pool."""
    import cupy

    torch = _torch_cuda()
    q, k, v = _torch_qkv(torch, "float16")
    cuflash.forward(q, k, v)   # first use of this stream: kernels loaded, Hopper's tile counter made
    torch.cuda.synchronize()
    pool = cupy.get_default_memory_pool()
    used, before = pool.used_bytes(), torch.cuda.memory_allocated()
    out, lse = cuflash.forward(q, k, v, return_lse=True)
    dq, dk, dv = cuflash.backward(torch.ones_like(out), q, k, v, out, lse)
    assert pool.used_bytes() == used
    grown = torch.cuda.memory_allocated() - before
    assert grown >= sum(x.numel() * x.element_size() for x in (out, lse, dq, dk, dv))
    del out, lse, dq, dk, dv
    torch.cuda.synchronize()
    # back to torch's cache; the slack is for small process-lifetime buffers (tile counters) a call may add
    assert torch.cuda.memory_allocated() - before <= 64 * 1024


def test_torch_current_stream_orders_the_call():
    """On a side stream, a kernel that writes q after a long sleep, then cuflash: without running on torch's
    current stream cuflash would read q before the write."""
    torch = _torch_cuda()
    q, k, v = _torch_qkv(torch, "float16")
    q_new = torch.randn_like(q)
    expected = cuflash.forward(q_new, k, v)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)   # about 0.1 s of GPU clock
        q.copy_(q_new)
        out = cuflash.forward(q, k, v)
    side.synchronize()
    assert torch.equal(out, expected)


def test_torch_backward_and_vjp_equal_cupy():
    torch = _torch_cuda()
    q, k, v = _torch_qkv(torch, "bfloat16", requires_grad=True)
    dout = torch.randn_like(q)
    out, pullback = cuflash.vjp(q, k, v, causal=True, deterministic=True)
    dq, dk, dv = pullback(dout)
    assert all(isinstance(x, torch.Tensor) and x.shape == y.shape and x.dtype == y.dtype
               for x, y in ((dq, q), (dk, k), (dv, v)))
    cq, ck, cv = map(_cupy_view, (q, k, v))
    c_out, c_lse = cuflash.forward(cq, ck, cv, causal=True, return_lse=True)
    ref = cuflash.backward(_cupy_view(dout), cq, ck, cv, c_out, c_lse, causal=True, deterministic=True)
    torch.cuda.synchronize()
    for x, r in zip((dq, dk, dv), ref):
        assert torch.equal(x, interop._TORCH.from_cupy(r))
    assert isinstance(out, torch.Tensor)
    _against_float64("bfloat16", q, k, v, True, out, c_lse, dout, (dq, dk, dv))
    bufs = [torch.empty_like(x) for x in (q, k, v)]
    got = pullback(dout, dq=bufs[0], dk=bufs[1], dv=bufs[2])
    assert all(g is b for g, b in zip(got, bufs))


def test_torch_mixed_with_cupy_is_named():
    torch = _torch_cuda()
    q, k, v = _torch_qkv(torch, "float16")
    with pytest.raises(TypeError, match="q is a torch array but k is a cupy array"):
        cuflash.forward(q, _cupy_view(k), v)


def test_torch_fp8():
    torch = _torch_cuda()
    if planned_cc() != 90:
        pytest.skip("the fp8 forward needs compute capability 9.0")
    q, k, v = _torch_qkv(torch, "bfloat16", d=128)
    (q8, dq), (k8, dk), (v8, _) = (cuflash.quantize_fp8(x) for x in (q, k, v))
    assert q8.dtype == torch.uint8 and dq.dtype == torch.float32 and dq.shape == (1,)
    out = cuflash.forward_fp8(q8, k8, v8, dq, dk, 1.0, causal=True)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    ref = cuflash.forward_fp8(*map(_cupy_view, (q8, k8, v8, dq, dk)), 1.0, causal=True)
    torch.cuda.synchronize()
    assert torch.equal(out, interop._TORCH.from_cupy(ref))
    if hasattr(torch, "float8_e4m3fn"):   # torch's own fp8 dtype crosses as its bytes
        e4m3 = [x.view(torch.float8_e4m3fn) for x in (q8, k8, v8)]
        assert torch.equal(cuflash.forward_fp8(*e4m3, dq, dk, 1.0, causal=True), out)


def test_jax_arrays():
    jax = pytest.importorskip("jax")
    if GPU_SKIP_REASON is not None or not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("needs JAX on a GPU")
    import cupy
    import jax.numpy as jnp

    key = jax.random.PRNGKey(0)
    q, k, v = (jax.random.normal(kk, (2, 65, 4, 64), dtype=jnp.float16) for kk in jax.random.split(key, 3))
    out = cuflash.forward(q, k, v, causal=True)
    assert isinstance(out, jax.Array) and out.shape == q.shape and out.dtype == q.dtype
    ref = cuflash.forward(*(cupy.from_dlpack(x) for x in (q, k, v)), causal=True)
    assert np.array_equal(np.asarray(out), cupy.asnumpy(ref))

    out, lse = cuflash.forward(q, k, v, causal=True, return_lse=True)
    assert isinstance(lse, jax.Array)
    dout = jax.random.normal(jax.random.PRNGKey(1), q.shape, dtype=jnp.float16)
    grads = cuflash.backward(dout, q, k, v, out, lse, causal=True)
    assert all(isinstance(g, jax.Array) and g.shape == x.shape and g.dtype == x.dtype
               for g, x in zip(grads, (q, k, v)))
    _against_float64("float16", q, k, v, True, out, lse, dout, grads)


# ---- Output buffers and autograd, JAX ordering and lifetimes ----

def test_torch_out_buffer_bumps_its_version_counter():
    """A buffer written through DLPack is an in-place write autograd must know of: a tensor saved for a
    backward and then written as out= makes that backward raise, as any in-place write would."""
    torch = _torch_cuda()
    q, k, v = _torch_qkv(torch, "float16")
    out = torch.zeros_like(q)
    before = out._version
    cuflash.forward(q, k, v, out=out)
    assert out._version > before
    w = torch.ones_like(q, requires_grad=True)
    saved = torch.zeros_like(q)          # saved by the product for w's gradient
    loss = (w * saved).sum()
    cuflash.forward(q, k, v, out=saved)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    lse = cuflash.forward(q, k, v, return_lse=True)[1]
    versions = [x._version for x in (dq, dk, dv)]
    cuflash.backward(torch.ones_like(q), q, k, v, out, lse, dq=dq, dk=dk, dv=dv)
    assert all(x._version > b for x, b in zip((dq, dk, dv), versions))


def test_torch_out_buffer_that_requires_grad_is_refused():
    torch = _torch_cuda()
    q, k, v = _torch_qkv(torch, "float16")
    leaf = torch.zeros_like(q, requires_grad=True)
    with pytest.raises(TypeError, match="out requires grad: cuflash writes it outside autograd"):
        cuflash.forward(q, k, v, out=leaf)
    with pytest.raises(TypeError, match="out requires grad"):
        cuflash.forward(q, k, v, out=leaf * 1)   # a non-leaf: its write would not be in the graph either
    with torch.no_grad():   # as torch allows an in-place write into a leaf there
        assert cuflash.forward(q, k, v, out=leaf) is leaf
    assert torch.equal(leaf.detach(), cuflash.forward(q, k, v))


def _jax_gpu():
    jax = pytest.importorskip("jax")
    if GPU_SKIP_REASON is not None or not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("needs JAX on a GPU")
    return jax


def test_jax_inputs_are_ordered_after_jax_work_and_kept_alive():
    """q comes out of a long JAX computation still running when cuflash is called: the DLPack handshake makes
    CuPy's stream wait for it. The inputs, dropped right after the call, stay referenced until the kernels
    have finished (interop.keep_until_done), then go."""
    jax = _jax_gpu()
    import cupy
    import jax.numpy as jnp

    key = jax.random.PRNGKey(1)
    a = jax.random.normal(key, (4096, 4096), dtype=jnp.float32)
    k, v = (jax.random.normal(kk, (2, 256, 4, 64), dtype=jnp.float16) for kk in jax.random.split(key, 2))

    def slow_q(a):
        for _ in range(8):
            a = jnp.tanh(a @ a * 1e-3)
        return a[:128].reshape(2, 256, 4, 256)[..., :64].astype(jnp.float16)

    q_ready = jax.block_until_ready(jax.jit(slow_q)(a))
    expected = np.asarray(cuflash.forward(q_ready, k, v))
    for _ in range(3):
        q = jax.jit(slow_q)(a)   # dispatched, not finished
        out = cuflash.forward(q, k, v)
        assert interop.kept_alive_count() >= 1   # this call's inputs, until its kernels finish
        del q
        np.testing.assert_array_equal(np.asarray(out), expected)
    cupy.cuda.Device().synchronize()
    cuflash.forward(q_ready, k, v)   # drops the entries whose kernels finished
    assert interop.kept_alive_count() <= 1
