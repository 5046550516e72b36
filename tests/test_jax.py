"""cuflash.jax: the XLA FFI custom calls from JAX (tests skip where JAX is not installed).

CPU: the ctypes layouts against jaxlib's C header (compiled with the system C compiler), the metadata
handshake, registration with XLA, lowering to the custom calls, argument errors, and the whole path
(jit, custom_vjp, vmap, errors raised inside a handler) run by XLA:CPU on the host target, whose body is
the float64 reference. GPU (skip without a CUDA JAX backend and a CuPy device): values and gradients
against ``jax.nn.dot_product_attention`` (implementation="xla") and the float64 reference, eagerly and
under jit, on XLA's buffers (pointers compared) and stream.
"""
from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import BWD_TOL, FWD_TOL

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import cuflash.jax as cj  # noqa: E402
from cuflash import jax_targets, xla_ffi  # noqa: E402
from cuflash.reference import attention_reference, attention_reference_backward, rel_err  # noqa: E402

JNP_DTYPES = {"float16": jnp.float16, "bfloat16": jnp.bfloat16, "float32": jnp.float32}


def _gpu_device():
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return None
    try:
        import cupy

        return gpus[0] if gpus and cupy.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:  # noqa: BLE001
        return None


GPU = _gpu_device()
requires_jax_gpu = pytest.mark.skipif(GPU is None, reason="needs a CUDA JAX backend and a CuPy device")
CPU = jax.devices("cpu")[0]


def _inputs(rng, shape_q, shape_kv, dtype_name, device):
    """q, k, v as JAX arrays on ``device`` (committed there, so jit runs there)."""
    dt = JNP_DTYPES[dtype_name]
    return tuple(jax.device_put(jnp.asarray(rng.standard_normal(s).astype(np.float32)).astype(dt), device)
                 for s in (shape_q, shape_kv, shape_kv))


def _f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


# ---------------------------------------------------------------------------
# CPU: import, ABI, handshake


def test_import_cuflash_does_not_import_jax():
    code = "import sys, cuflash; assert 'jax' not in sys.modules, 'import cuflash imported jax'; print('ok')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


_ABI_PROGRAM = """
#include <stdio.h>
#include <stddef.h>
#include "xla/ffi/api/c_api.h"
#if XLA_FFI_API_MINOR >= 4   /* renamed in 0.4 (ABI-compatible): the ctypes mirror keeps the 0.3 names */
#define XLA_FFI_Extension_Base XLA_FFI_InternalExtension
#define XLA_FFI_Error_GetMessage_Args XLA_FFI_Error_GetDetails_Args
#define XLA_FFI_Error_GetMessage XLA_FFI_Error_GetDetails
#endif
#define OFF(s, f) printf(#s "." #f " %zu\\n", offsetof(s, f))
#define SIZE(s) printf(#s " %zu\\n", (size_t)s##_STRUCT_SIZE)
int main(void) {
  OFF(XLA_FFI_CallFrame, api); OFF(XLA_FFI_CallFrame, ctx); OFF(XLA_FFI_CallFrame, stage);
  OFF(XLA_FFI_CallFrame, args); OFF(XLA_FFI_CallFrame, rets); OFF(XLA_FFI_CallFrame, attrs);
  OFF(XLA_FFI_CallFrame, future); SIZE(XLA_FFI_CallFrame);
  OFF(XLA_FFI_Args, size); OFF(XLA_FFI_Args, types); OFF(XLA_FFI_Args, args);
  OFF(XLA_FFI_Rets, rets); OFF(XLA_FFI_Attrs, names); OFF(XLA_FFI_Attrs, attrs);
  OFF(XLA_FFI_Buffer, dtype); OFF(XLA_FFI_Buffer, data); OFF(XLA_FFI_Buffer, rank); OFF(XLA_FFI_Buffer, dims);
  OFF(XLA_FFI_Scalar, value); OFF(XLA_FFI_ByteSpan, len);
  OFF(XLA_FFI_Metadata, api_version); OFF(XLA_FFI_Metadata, traits); OFF(XLA_FFI_Metadata, state_type_id);
  SIZE(XLA_FFI_Metadata); SIZE(XLA_FFI_Metadata_Extension); SIZE(XLA_FFI_Api_Version);
  OFF(XLA_FFI_Metadata_Extension, metadata); OFF(XLA_FFI_Extension_Base, type);
  OFF(XLA_FFI_Error_Create_Args, message); OFF(XLA_FFI_Error_Create_Args, errc);
  OFF(XLA_FFI_Error_GetMessage_Args, message); OFF(XLA_FFI_Stream_Get_Args, stream);
  OFF(XLA_FFI_DeviceOrdinal_Get_Args, device_ordinal);
  OFF(XLA_FFI_Api, XLA_FFI_Error_Create); OFF(XLA_FFI_Api, XLA_FFI_Error_GetMessage);
  OFF(XLA_FFI_Api, XLA_FFI_Error_Destroy); OFF(XLA_FFI_Api, XLA_FFI_Stream_Get);
  OFF(XLA_FFI_Api, XLA_FFI_DeviceOrdinal_Get);
  return 0;
}
"""

_ABI_EXPECTED = {
    "XLA_FFI_CallFrame": xla_ffi.CallFrame, "XLA_FFI_Args": xla_ffi.Args, "XLA_FFI_Rets": xla_ffi.Rets,
    "XLA_FFI_Attrs": xla_ffi.Attrs, "XLA_FFI_Buffer": xla_ffi.Buffer, "XLA_FFI_Scalar": xla_ffi.Scalar,
    "XLA_FFI_ByteSpan": xla_ffi.ByteSpan, "XLA_FFI_Metadata": xla_ffi.Metadata,
    "XLA_FFI_Metadata_Extension": xla_ffi.MetadataExtension, "XLA_FFI_Extension_Base": xla_ffi.ExtensionBase,
    "XLA_FFI_Error_Create_Args": xla_ffi.ErrorCreateArgs, "XLA_FFI_Error_GetMessage_Args": xla_ffi._ErrorArgs,
    "XLA_FFI_Stream_Get_Args": xla_ffi.StreamGetArgs, "XLA_FFI_DeviceOrdinal_Get_Args": xla_ffi.DeviceOrdinalGetArgs,
    "XLA_FFI_Api": xla_ffi.Api, "XLA_FFI_Api_Version": xla_ffi.ApiVersion,
}
_SIZES = {"XLA_FFI_CallFrame": xla_ffi.CALL_FRAME_SIZE, "XLA_FFI_Metadata": xla_ffi.METADATA_SIZE,
          "XLA_FFI_Metadata_Extension": xla_ffi.METADATA_EXTENSION_SIZE, "XLA_FFI_Api_Version": xla_ffi.API_VERSION_SIZE}


def test_ctypes_layouts_match_jaxlib_header(tmp_path):
    """Every offset and struct size the handlers read, as the C compiler lays out jaxlib's c_api.h."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler to read the header's layouts")
    src = tmp_path / "abi.c"
    src.write_text(_ABI_PROGRAM)
    exe = tmp_path / "abi"
    subprocess.run([cc, "-std=c11", "-I", jax.ffi.include_dir(), str(src), "-o", str(exe)], check=True)
    lines = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split("\n")
    checked = 0
    for line in filter(None, lines):
        name, value = line.rsplit(" ", 1)
        if "." in name:
            struct, fld = name.split(".")
            assert getattr(_ABI_EXPECTED[struct], fld).offset == int(value), name
        else:
            assert _SIZES[name] == int(value), name
        checked += 1
    assert checked == _ABI_PROGRAM.count("OFF(") + _ABI_PROGRAM.count("SIZE(") - 2   # less the two #defines


def test_handler_answers_the_metadata_query():
    """XLA asks each handler for its API version and traits at registration, with no API table: the
    answer is the version given and no traits (not command-buffer compatible, so never graph-captured)."""
    called = []
    handler = xla_ffi.make_handler(called.append, (0, 7))
    md = xla_ffi.Metadata(xla_ffi.METADATA_SIZE, xla_ffi.ApiVersion(xla_ffi.API_VERSION_SIZE), 0xFF, 0)
    ext = xla_ffi.MetadataExtension(xla_ffi.ExtensionBase(xla_ffi.METADATA_EXTENSION_SIZE,
                                                          xla_ffi.EXTENSION_METADATA, None), ctypes.pointer(md))
    frame = xla_ffi.CallFrame(xla_ffi.CALL_FRAME_SIZE, ctypes.cast(ctypes.pointer(ext), ctypes.POINTER(xla_ffi.ExtensionBase)))
    assert handler(ctypes.pointer(frame)) is None
    assert (md.api_version.major_version, md.api_version.minor_version) == (0, 7)
    assert md.traits == 0 and not called


def test_api_version_is_jaxlibs():
    assert cj.ffi_api_version() == xla_ffi.header_version(jax.ffi.include_dir())


def test_registration_is_accepted_by_xla():
    """XLA:CPU runs the metadata query of every target at registration (a refused one raises here)."""
    cj.register_targets()
    cj.register_targets()   # once per process
    assert len(cj._handlers) == len(jax_targets.BODIES)


def test_handler_errors_reach_the_caller():
    """An exception in a body becomes an XLA error with its message; an API error (no stream on the
    host) is read back through XLA's error API."""
    def body(call):
        call.stream()

    handler = xla_ffi.make_handler(body, cj.ffi_api_version())
    cj._handlers.append(handler)
    jax.ffi.register_ffi_target("cuflash_test_stream_on_host", xla_ffi.capsule(handler), platform="cpu")
    x = jax.device_put(jnp.ones(4), CPU)
    with pytest.raises(Exception, match="XLA_FFI_Stream_Get failed"):
        jax.ffi.ffi_call("cuflash_test_stream_on_host", jax.ShapeDtypeStruct((4,), jnp.float32))(x).block_until_ready()


def test_decode_reads_buffers_and_attributes():
    """Buffers, dims, dtypes, scalar / string attributes and the device ordinal as XLA:CPU passes them."""
    seen = []

    def body(call):
        seen.append(call)
        assert call.device_ordinal() == 0   # read through XLA's API table
        ctypes.memmove(call.rets[0].ptr, call.args[0].ptr, call.args[0].nbytes)

    handler = xla_ffi.make_handler(body, cj.ffi_api_version())
    cj._handlers.append(handler)
    jax.ffi.register_ffi_target("cuflash_test_decode", xla_ffi.capsule(handler), platform="cpu")
    x = jax.device_put(jnp.arange(24, dtype=jnp.bfloat16).reshape(2, 3, 4), CPU)
    y = jax.jit(lambda x: jax.ffi.ffi_call("cuflash_test_decode", jax.ShapeDtypeStruct(x.shape, x.dtype))(
        x, flag=True, scale=0.125, n=np.int32(3), name="abc"))(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    (call,) = seen
    assert call.args[0].shape == (2, 3, 4) and call.args[0].dtype == "bfloat16" and call.args[0].nbytes == 48
    assert call.attrs == {"flag": True, "scale": 0.125, "n": 3, "name": "abc"}


def test_cuda_forward_writes_lse_into_xlas_buffer(monkeypatch):
    """The CUDA forward hands XLA's lse buffer to ``api._run_forward`` and ``api._launch_fwd`` (private:
    this fails on a machine without a GPU if api.py changes them), with no device touched here."""
    pytest.importorskip("cupy")
    import inspect

    from conftest import fake_cupy_array
    from cuflash import api

    seen = {}

    def run_forward(launch_fn, out, shape, dtype, lse_shape, seqlen_k, return_lse, device_id, lse=None, sinks=None):
        seen.update(launch_fn=launch_fn, out=out, lse=lse, return_lse=return_lse, lse_shape=lse_shape)

    monkeypatch.setattr(api, "_run_forward", run_forward)
    mib = 1 << 20
    q, out = fake_cupy_array((2, 16, 4, 64)), fake_cupy_array((2, 16, 4, 64), offset=mib)
    k, v = fake_cupy_array((2, 24, 2, 64), offset=2 * mib), fake_cupy_array((2, 24, 2, 64), offset=3 * mib)
    lse = fake_cupy_array((2, 4, 16), np.float32, offset=4 * mib)
    jax_targets._forward_into(q, k, v, out, lse, causal=True, softmax_scale=0.1)
    assert seen["out"] is out and seen["lse"] is lse and seen["return_lse"] is True
    assert seen["lse_shape"] == (2, 4, 16)
    inspect.signature(api._launch_fwd).bind(q, k, v, out, lse, causal=True, scale=0.1, dims=(2, 16, 24, 4, 2, 64),
                                            device_id=0)


# ---------------------------------------------------------------------------
# CPU: tracing, lowering, errors


def test_lowers_to_the_custom_calls():
    q = jax.ShapeDtypeStruct((2, 16, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 16, 2, 64), jnp.bfloat16)
    fwd = jax.jit(lambda q, k, v: cj.dot_product_attention(q, k, v, causal=True)).lower(q, kv, kv).as_text()
    assert "stablehlo.custom_call @cuflash_attention_fwd" in fwd
    assert "causal = true" in fwd and "softmax_scale = 1.250000e-01 : f64" in fwd
    loss = lambda q, k, v: cj.dot_product_attention(q, k, v).astype(jnp.float32).sum()  # noqa: E731
    bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).as_text()
    assert "@cuflash_attention_fwd" in bwd and "@cuflash_attention_bwd" in bwd and "deterministic = false" in bwd
    assert "dot_general" not in bwd   # no attention matrix outside the kernels


def test_abstract_evaluation():
    q = jax.ShapeDtypeStruct((3, 10, 8, 128), jnp.float16)
    kv = jax.ShapeDtypeStruct((3, 7, 2, 128), jnp.float16)
    out = jax.eval_shape(cj.dot_product_attention, q, kv, kv)
    assert out.shape == q.shape and out.dtype == q.dtype
    grads = jax.eval_shape(jax.grad(lambda q, k, v: cj.dot_product_attention(q, k, v).sum(), argnums=(0, 1, 2)),
                           q, kv, kv)
    assert [g.shape for g in grads] == [q.shape, kv.shape, kv.shape]


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(q=(2, 8, 4)), ValueError, "q must have 4 dimensions"),
    (dict(k=(2, 8, 3, 64)), ValueError, "k and v must have the same shape"),
    (dict(k=(2, 8, 3, 64), v=(2, 8, 3, 64)), ValueError, "multiple of heads_kv"),
    (dict(q=(2, 8, 4, 60), k=(2, 8, 2, 60), v=(2, 8, 2, 60)), ValueError, "head_dim must be a multiple of 8"),
    (dict(dtype="int32"), TypeError, "float16, bfloat16 or float32"),
    (dict(k_dtype="float32"), TypeError, "k must have the dtype of q"),
    (dict(causal="False"), TypeError, "causal must be a bool"),
    (dict(deterministic=1), TypeError, "deterministic must be a bool"),
    (dict(softmax_scale=-1.0), ValueError, "softmax_scale must be a positive finite"),
    (dict(softmax_scale="0.1"), TypeError, "softmax_scale must be a positive finite float or None"),
])
def test_argument_errors_raise_while_tracing(kwargs, exc, match):
    shapes = {"q": (2, 8, 4, 64), "k": (2, 8, 2, 64), "v": (2, 8, 2, 64)}
    shapes.update({n: kwargs.pop(n) for n in ("q", "k", "v") if n in kwargs})
    dtype = kwargs.pop("dtype", "float16")
    arrays = {n: jnp.zeros(s, dtype) for n, s in shapes.items()}
    if "k_dtype" in kwargs:
        arrays["k"] = arrays["k"].astype(kwargs.pop("k_dtype"))
    with pytest.raises(exc, match=match):
        jax.jit(lambda q, k, v: cj.dot_product_attention(q, k, v, **kwargs))(arrays["q"], arrays["k"], arrays["v"])


# ---------------------------------------------------------------------------
# Both platforms: values and gradients (the host target on CPU, the kernels on a GPU)

PLATFORMS = [pytest.param(CPU, id="cpu"), pytest.param(GPU, id="gpu", marks=requires_jax_gpu)]
# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim): small on the CPU (the reference is a Python loop).
SHAPES_EQUAL = [(2, 64, 64, 4, 4, 32), (1, 96, 96, 8, 2, 64), (2, 33, 33, 4, 1, 128)]


def _jax_nn(q, k, v, causal):
    """jax.nn.dot_product_attention (XLA implementation) in float32 on the same inputs, with float32
    products (JAX's default precision on a GPU would take TF32, as coarse as fp16)."""
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    with jax.default_matmul_precision("highest"):
        return jax.nn.dot_product_attention(*f32, is_causal=causal, implementation="xla")


@pytest.mark.parametrize("device", PLATFORMS)
@pytest.mark.parametrize("shape", SHAPES_EQUAL, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_values_and_grads_match_jax_nn(rng, device, shape, causal, dtype, jit):
    b, nq, nk, hq, hkv, d = shape
    q, k, v = _inputs(rng, (b, nq, hq, d), (b, nk, hkv, d), dtype, device)
    dout = jax.device_put(jnp.asarray(rng.standard_normal((b, nq, hq, d)), JNP_DTYPES[dtype]), device)

    def ours(q, k, v):
        return cj.dot_product_attention(q, k, v, causal=causal)

    def pull(q, k, v, g):
        return jax.vjp(ours, q, k, v)[1](g)

    out = (jax.jit(ours) if jit else ours)(q, k, v)
    grads = (jax.jit(pull) if jit else pull)(q, k, v, dout)
    ref_out, pullback = jax.vjp(lambda q, k, v: _jax_nn(q, k, v, causal), q, k, v)
    ref_grads = pullback(dout.astype(jnp.float32))
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_err(_f64(out), _f64(ref_out)) <= FWD_TOL[dtype]
    for name, g, r, x in zip("qkv", grads, ref_grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        assert rel_err(_f64(g), _f64(r)) <= BWD_TOL[dtype], f"d{name}"


# seqlen_q != seqlen_k: causal is bottom-right aligned (jax.nn aligns top-left), so the float64 reference.
SHAPES_RAGGED = [(2, 40, 72, 4, 2, 64), (1, 72, 40, 4, 4, 32), (1, 1, 50, 2, 1, 64), (1, 37, 1, 2, 2, 16)]


@pytest.mark.parametrize("device", PLATFORMS)
@pytest.mark.parametrize("shape", SHAPES_RAGGED, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_ragged_lengths_match_float64(rng, device, shape, causal, dtype):
    b, nq, nk, hq, hkv, d = shape
    q, k, v = _inputs(rng, (b, nq, hq, d), (b, nk, hkv, d), dtype, device)
    dout = jax.device_put(jnp.asarray(rng.standard_normal((b, nq, hq, d)), JNP_DTYPES[dtype]), device)
    scale = 0.3
    f = jax.jit(lambda q, k, v: cj.dot_product_attention(q, k, v, causal=causal, softmax_scale=scale))
    out, pullback = jax.vjp(f, q, k, v)
    grads = pullback(dout)
    ref_out, _ = attention_reference(_f64(q), _f64(k), _f64(v), causal=causal, softmax_scale=scale)
    ref_grads = attention_reference_backward(_f64(dout), _f64(q), _f64(k), _f64(v), causal=causal, softmax_scale=scale)
    assert rel_err(_f64(out), ref_out) <= FWD_TOL[dtype]
    # dq and dk are ~0 where each query sees one key (P = 1): measured against a tenth of |dv| there.
    floor = 0.1 * np.linalg.norm(ref_grads[2])
    for name, g, r in zip("qkv", grads, ref_grads):
        g = _f64(g)
        assert np.all(np.isfinite(g)), f"d{name}"
        assert np.linalg.norm(g - r) <= BWD_TOL[dtype] * max(np.linalg.norm(r), floor), f"d{name}"


@pytest.mark.parametrize("device", PLATFORMS)
def test_vmap_merges_into_the_batch(rng, device):
    q, k, v = _inputs(rng, (3, 2, 24, 4, 32), (3, 2, 24, 2, 32), "float16", device)
    f = lambda q, k, v: cj.dot_product_attention(q, k, v, causal=True)  # noqa: E731
    out = jax.jit(jax.vmap(f))(q, k, v)
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(f(q[i], k[i], v[i])))
    g = jax.jit(jax.vmap(jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum())))(q, k, v)
    assert g.shape == q.shape and g.dtype == q.dtype
    for i in range(3):   # d(sum out)/dq of each mapped problem against float64 (dout = ones)
        ref_out, _ = attention_reference(_f64(q[i]), _f64(k[i]), _f64(v[i]), causal=True)
        assert rel_err(_f64(out[i]), ref_out) <= FWD_TOL["float16"], f"out[{i}]"
        ref_dq = attention_reference_backward(np.ones(q.shape[1:]), _f64(q[i]), _f64(k[i]), _f64(v[i]), causal=True)[0]
        assert rel_err(_f64(g[i]), ref_dq) <= BWD_TOL["float16"], f"dq[{i}]"


@pytest.mark.parametrize("device", PLATFORMS)
@pytest.mark.parametrize("nq, nk, b", [(0, 8, 2), (8, 0, 2), (8, 8, 0)])
def test_empty_shapes(device, nq, nk, b):
    q = jax.device_put(jnp.ones((b, nq, 2, 16), jnp.float16), device)
    k = jax.device_put(jnp.ones((b, nk, 2, 16), jnp.float16), device)
    out, pullback = jax.vjp(jax.jit(cj.dot_product_attention), q, k, k)
    assert out.shape == q.shape and not bool(jnp.any(out))
    dq, dk, dv = pullback(jnp.ones_like(out))
    assert dq.shape == q.shape and dk.shape == k.shape and not (bool(jnp.any(dq)) or bool(jnp.any(dk)))


@pytest.mark.parametrize("device", PLATFORMS)
def test_kernels_use_jaxs_buffers(rng, device):
    """Zero-copy: the custom calls receive the jitted function's own input buffers and the forward's
    result buffer is the array JAX returns (pointers compared)."""
    q, k, v = _inputs(rng, (2, 64, 4, 64), (2, 64, 2, 64), "bfloat16", device)
    jax_targets.CALL_LOG = []
    try:
        out = jax.jit(cj.dot_product_attention)(q, k, v)
        out.block_until_ready()
        log = list(jax_targets.CALL_LOG)
    finally:
        jax_targets.CALL_LOG = None
    (target, args, rets, stream), = log
    assert target == jax_targets.FORWARD
    assert args == [x.unsafe_buffer_pointer() for x in (q, k, v)]
    assert rets[0] == out.unsafe_buffer_pointer()
    if device.platform == "gpu":
        assert stream != 0   # XLA's own stream, not the legacy default stream


# ---------------------------------------------------------------------------
# GPU only


@requires_jax_gpu
def test_gpu_deterministic_grads_are_bitwise_repeatable(rng):
    q, k, v = _inputs(rng, (2, 512, 8, 128), (2, 512, 2, 128), "bfloat16", GPU)
    loss = jax.jit(jax.grad(lambda q, k, v: (cj.dot_product_attention(q, k, v, causal=True, deterministic=True)
                                            .astype(jnp.float32) ** 2).sum(), argnums=(0, 1, 2)))
    first = [np.asarray(g) for g in loss(q, k, v)]
    for _ in range(3):
        for a, b in zip(first, loss(q, k, v)):
            np.testing.assert_array_equal(a, np.asarray(b))


@requires_jax_gpu
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_training_step_shapes(rng, d):
    """A jitted value_and_grad at a size where the Hopper kernels run, with XLA work before and after the
    custom calls on the same stream (no host synchronisation in between): the loss against float64, the
    gradients against jax.nn (float32 XLA)."""
    q, k, v = _inputs(rng, (2, 1024, 8, d), (2, 1024, 8, d), "bfloat16", GPU)

    def loss(attn, q, k, v):
        out = attn(q * 0.5, k, v)   # an XLA op before: the kernels must see its result
        return (out.astype(jnp.float32) ** 2).mean() + 1.0

    # The value against float64: mean(out^2) is ~1e-2 here, so the loss's attention part is compared, not the
    # 1.0 added to it (a loss of 1.0, from an all-zero output, is off by 100% of that part).
    ref_out, _ = attention_reference(_f64(q) * 0.5, _f64(k), _f64(v), causal=True)
    ref_part = float(np.mean(ref_out ** 2))

    ours = jax.jit(jax.value_and_grad(lambda q, k, v: loss(lambda *a: cj.dot_product_attention(*a, causal=True),
                                                           q, k, v), argnums=(0, 1, 2)))
    ref = jax.jit(jax.value_and_grad(lambda q, k, v: loss(lambda *a: _jax_nn(*a, True), q, k, v), argnums=(0, 1, 2)))
    for _ in range(2):   # the second call replays the compiled executable
        (val, grads), (rval, rgrads) = ours(q, k, v), ref(q, k, v)
        part = float(val) - 1.0   # float32 at 1.0: about 1e-7 absolute, 1e-5 of the part
        assert abs(part - ref_part) <= FWD_TOL["bfloat16"] * ref_part, f"loss {float(val)!r}, float64 {1 + ref_part!r}"
        for g, r in zip(grads, rgrads):
            assert rel_err(_f64(g), _f64(r)) <= BWD_TOL["bfloat16"]


def test_cuda_target_is_registered_for_cuda():
    assert {p for (_, p) in jax_targets.BODIES} == {"CUDA", "cpu"}
    assert jax_targets.BODIES[(jax_targets.FORWARD, "CUDA")] is jax_targets.cuda_forward



# ---------------------------------------------------------------------------
# Variants: windows, chunks, softcap, ALiBi, sinks through the custom calls (attributes and extra operands)

JAX_VARIANTS = [
    dict(causal=True, window_size=(20, 0), sinks=True),
    dict(softcap=2.0, alibi=True),
    dict(causal=True, attention_chunk=24, window_size=(10, 0), softcap=5.0),
]


@pytest.mark.parametrize("kwargs", JAX_VARIANTS, ids=lambda k: "-".join(sorted(k)))
@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_variants_under_jit_and_grad(kwargs, platform):
    """Forward and gradients (q, k, v and the sinks) under jit against float64: on the CPU backend the
    custom calls run the reference (the plumbing: attributes, optional operands, dsinks), on a GPU the kernels."""
    device = CPU if platform == "cpu" else GPU
    if device is None:
        pytest.skip("needs a CUDA JAX backend and a CuPy device")
    rng = np.random.default_rng(3)
    b, nq, nk, hq, hkv, d = 2, 70, 90, 4, 2, 64
    dtype = "float32" if platform == "cpu" else "bfloat16"
    q, k, v = _inputs(rng, (b, nq, hq, d), (b, nk, hkv, d), dtype, device)
    kw = dict(kwargs)
    slopes = jax.device_put(jnp.asarray(rng.uniform(0.05, 0.3, hq).astype(np.float32)), device) \
        if kw.pop("alibi", False) else None
    sinks = jax.device_put(jnp.asarray(rng.normal(1.0, 1.0, hq).astype(np.float32)), device) \
        if kw.pop("sinks", False) else None
    dout = jax.device_put(jnp.asarray(rng.standard_normal((b, nq, hq, d)).astype(np.float32)), device)

    def loss(q, k, v, sinks):
        out = cj.dot_product_attention(q, k, v, alibi_slopes=slopes, sinks=sinks, **kw)
        return (out.astype(jnp.float32) * dout).sum(), out

    argnums = (0, 1, 2, 3) if sinks is not None else (0, 1, 2)
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(q, k, v, sinks)
    host = dict(kw, alibi_slopes=None if slopes is None else np.asarray(slopes),
                sinks=None if sinks is None else np.asarray(sinks))
    ref_o, _ = attention_reference(_f64(q), _f64(k), _f64(v), **host)
    refs = attention_reference_backward(np.asarray(dout, np.float64), _f64(q), _f64(k), _f64(v), **host)
    tol_o, tol_g = (FWD_TOL, BWD_TOL) if platform == "gpu" else ({dtype: 1e-6}, {dtype: 1e-6})
    assert rel_err(_f64(out), ref_o) <= tol_o[dtype]
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, refs):
        err = rel_err(_f64(g), r)
        assert err <= tol_g[dtype], f"{name} rel err {err:.3e}"


@pytest.mark.parametrize("device", PLATFORMS)
@pytest.mark.parametrize("dqk,dv", [(192, 128), (64, 128)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_value_head_dim_of_its_own(rng, device, dqk, dv, causal):
    """v with a head dim of its own: the output takes it; values and gradients against float64 under jit."""
    b, nq, nk, hq, hkv = 2, 37, 53, 4, 2
    dt = JNP_DTYPES["bfloat16"]
    q, k, v, dout = (jax.device_put(jnp.asarray(rng.standard_normal(s).astype(np.float32)).astype(dt), device)
                     for s in ((b, nq, hq, dqk), (b, nk, hkv, dqk), (b, nk, hkv, dv), (b, nq, hq, dv)))
    f = jax.jit(lambda q, k, v: cj.dot_product_attention(q, k, v, causal=causal))
    out, pullback = jax.vjp(f, q, k, v)
    assert out.shape == (b, nq, hq, dv)
    grads = pullback(dout)
    ref_out, _ = attention_reference(_f64(q), _f64(k), _f64(v), causal=causal)
    ref_grads = attention_reference_backward(_f64(dout), _f64(q), _f64(k), _f64(v), causal=causal)
    assert rel_err(_f64(out), ref_out) <= FWD_TOL["bfloat16"]
    for name, g, r in zip("qkv", grads, ref_grads):
        assert g.shape == r.shape and np.linalg.norm(_f64(g) - r) <= BWD_TOL["bfloat16"] * np.linalg.norm(r), f"d{name}"
