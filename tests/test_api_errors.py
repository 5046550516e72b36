"""Argument checks of every entry point, on the CPU: each runs before the device is touched, so a
machine without a GPU gets the TypeError / ValueError a GPU machine gets. The CuPy arrays here are
metadata over memory that is never allocated (conftest.fake_cupy_array)."""
from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash import _checks
from conftest import fake_cupy_array as arr

pytestmark = pytest.mark.usefixtures("device_forbidden")

QKV = (1, 4, 2, 64)


def _qkv(dtype=np.float16, shape=QKV):
    return arr(shape, dtype), arr(shape, dtype), arr(shape, dtype)


def test_numpy_input_is_rejected_with_a_hint():
    q = np.zeros((1, 4, 1, 64), np.float16)
    with pytest.raises(TypeError, match=r"q must be a cupy.ndarray.*cupy.asarray\(q\)"):
        cuflash.forward(q, q, q)


def test_list_input_is_rejected():
    with pytest.raises(TypeError, match="q must be a cupy.ndarray"):
        cuflash.forward([[1.0]], None, None)


@pytest.mark.parametrize("which", ["k", "v"])
def test_numpy_k_or_v_is_rejected(which):
    q, k, v = _qkv()
    args = {"k": k, "v": v, which: np.zeros(QKV, np.float16)}
    with pytest.raises(TypeError, match=f"{which} must be a cupy.ndarray"):
        cuflash.forward(q, args["k"], args["v"])


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_softmax_scale_values(bad):
    with pytest.raises(ValueError, match="softmax_scale"):
        _checks.check_scale(bad, 64)
    with pytest.raises(ValueError, match="softmax_scale"):
        cuflash.forward(*_qkv(), softmax_scale=bad)


@pytest.mark.parametrize("bad", ["0.1", True, [0.1]])
def test_bad_softmax_scale_types(bad):
    with pytest.raises(TypeError, match="softmax_scale"):
        _checks.check_scale(bad, 64)
    with pytest.raises(TypeError, match="softmax_scale"):
        cuflash.forward(*_qkv(), softmax_scale=bad)


def test_default_scale():
    assert _checks.check_scale(None, 64) == 0.125


SHAPE_ERRORS = [
    ((1, 4, 2, 64), (1, 4, 2, 64), (1, 4, 2), ValueError, "v must have 4 dimensions"),
    ((1, 4, 2, 64), (2, 4, 2, 64), (2, 4, 2, 64), ValueError, "batch size"),
    ((1, 4, 2, 64), (1, 4, 2, 32), (1, 4, 2, 32), ValueError, "head_dim"),
    ((1, 4, 3, 64), (1, 4, 2, 64), (1, 4, 2, 64), ValueError, "multiple of heads_kv"),
    ((1, 4, 0, 64), (1, 4, 0, 64), (1, 4, 0, 64), ValueError, "heads must be >= 1"),
    ((1, 4, 2, 60), (1, 4, 2, 60), (1, 4, 2, 60), ValueError, "multiple of 8"),
    ((1, 4, 2, 584), (1, 4, 2, 584), (1, 4, 2, 584), ValueError, "head_dim must be a multiple of 8 from 8 to 576"),
    ((1, 4, 2, 512), (1, 4, 2, 512), (1, 4, 2, 520), ValueError, "v's head_dim must be a multiple of 8 from 8 to 512"),
    ((1, 4, 2, 516), (1, 4, 2, 516), (1, 4, 2, 516), ValueError, "multiple of 8 from 8 to 576, got 516"),
    ((1, 4, 2, 512), (1, 4, 2, 512), (1, 4, 2, 64), ValueError, "v's head_dim must be above 64"),
    ((1, 4, 2, 64), (1, 4, 2, 64), (1, 5, 2, 64), ValueError, "same shape"),
]


@pytest.mark.parametrize("q_shape,k_shape,v_shape,exc,match", SHAPE_ERRORS)
def test_shape_errors(q_shape, k_shape, v_shape, exc, match):
    with pytest.raises(exc, match=match):
        cuflash.forward(arr(q_shape), arr(k_shape), arr(v_shape))


@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.int8])
def test_unsupported_dtype(dtype):
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        cuflash.forward(*_qkv(dtype))


def test_mismatched_dtypes():
    with pytest.raises(TypeError, match="k must have the dtype of q"):
        cuflash.forward(arr(QKV), arr(QKV, np.float32), arr(QKV))


def test_last_dim_not_contiguous():
    x = arr((1, 4, 2, 128))[..., ::2]
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        cuflash.forward(x, x, x)


def test_misaligned_view():
    x = arr((1, 4, 2, 72))[..., 4:68]
    with pytest.raises(ValueError, match="16-byte boundary"):
        cuflash.forward(x, x, x)


def test_misaligned_pointer():
    x = arr(QKV, offset=2)
    with pytest.raises(ValueError, match="16-byte boundary"):
        cuflash.forward(x, x, x)


def test_bad_out():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="out must have shape"):
        cuflash.forward(q, k, v, out=arr((1, 4, 2, 32)))
    with pytest.raises(TypeError, match="out must have dtype"):
        cuflash.forward(q, k, v, out=arr(QKV, np.float32))
    with pytest.raises(TypeError, match="out must be a cupy.ndarray"):
        cuflash.forward(q, k, v, out=np.zeros(QKV, np.float16))
    with pytest.raises(ValueError, match="out must be contiguous in its last dimension"):
        cuflash.forward(q, k, v, out=arr((1, 4, 2, 128))[..., ::2])
    with pytest.raises(ValueError, match="out is on device 1"):
        cuflash.forward(q, k, v, out=arr(QKV, device_id=1))


def test_inputs_on_different_devices():
    q, k, v = arr(QKV), arr(QKV, device_id=1), arr(QKV, device_id=1)
    with pytest.raises(ValueError, match="k is on device 1 but q is on device 0"):
        cuflash.forward(q, k, v)


@pytest.mark.parametrize("flag", ["causal", "return_lse"])
@pytest.mark.parametrize("bad", ["false", None, 1])
def test_forward_flag_types(flag, bad):
    with pytest.raises(TypeError, match=f"{flag} must be a bool"):
        cuflash.forward(*_qkv(), **{flag: bad})


def test_numpy_bool_flag_is_a_bool():
    assert _checks.check_flag("causal", np.bool_(True)) is True


# ---- vjp: the forward's checks, and its own flag before the forward runs ----

def test_vjp_checks_like_forward():
    with pytest.raises(ValueError, match="batch size"):
        cuflash.vjp(arr(QKV), arr((2, 4, 2, 64)), arr((2, 4, 2, 64)))
    with pytest.raises(TypeError, match="causal must be a bool"):
        cuflash.vjp(*_qkv(), causal="yes")


def test_vjp_deterministic_flag():
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        cuflash.vjp(*_qkv(), deterministic="no")


# ---- backward ----

def _bwd_args(**change):
    q, k, v = _qkv()
    args = dict(dout=arr(QKV), q=q, k=k, v=v, out=arr(QKV), lse=arr((1, 2, 4), np.float32))
    args.update(change)
    return args


def _backward(kwargs=None, **change):
    a = _bwd_args(**change)
    return cuflash.backward(a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], **(kwargs or {}))


@pytest.mark.parametrize("q_shape,k_shape,v_shape,exc,match", SHAPE_ERRORS)
def test_backward_shape_errors(q_shape, k_shape, v_shape, exc, match):
    with pytest.raises(exc, match=match):
        _backward(q=arr(q_shape), k=arr(k_shape), v=arr(v_shape))


@pytest.mark.parametrize("name", ["dout", "out"])
def test_backward_like_q(name):
    with pytest.raises(TypeError, match=f"{name} must be a cupy.ndarray"):
        _backward(**{name: np.zeros(QKV, np.float16)})
    with pytest.raises(TypeError, match=f"{name} must have the dtype of q"):
        _backward(**{name: arr(QKV, np.float32)})
    with pytest.raises(ValueError, match=f"{name} must have the shape of q"):
        _backward(**{name: arr((1, 5, 2, 64))})
    with pytest.raises(ValueError, match=f"{name} is on device 1"):
        _backward(**{name: arr(QKV, device_id=1)})


def test_backward_lse():
    with pytest.raises(TypeError, match="lse must be a cupy.ndarray"):
        _backward(lse=np.zeros((1, 2, 4), np.float32))
    with pytest.raises(TypeError, match="lse must be float32"):
        _backward(lse=arr((1, 2, 4), np.float16))
    with pytest.raises(ValueError, match="lse must have shape"):
        _backward(lse=arr((1, 4, 2), np.float32))
    with pytest.raises(ValueError, match="lse is on device 1"):
        _backward(lse=arr((1, 2, 4), np.float32, device_id=1))


@pytest.mark.parametrize("name", ["dq", "dk", "dv"])
def test_backward_gradient_buffers(name):
    with pytest.raises(ValueError, match=f"{name} must have shape"):
        _backward({name: arr((1, 4, 2, 32))})
    with pytest.raises(TypeError, match=f"{name} must have dtype"):
        _backward({name: arr(QKV, np.float32)})
    with pytest.raises(TypeError, match=f"{name} must be a cupy.ndarray"):
        _backward({name: np.zeros(QKV, np.float16)})


@pytest.mark.parametrize("flag", ["causal", "deterministic"])
def test_backward_flag_types(flag):
    with pytest.raises(TypeError, match=f"{flag} must be a bool"):
        _backward({flag: "True"})


def test_backward_scale():
    with pytest.raises(ValueError, match="softmax_scale"):
        _backward({"softmax_scale": -1.0})


# ---- fp8: quantize_fp8 and forward_fp8 ----

def test_quantize_fp8_checks():
    with pytest.raises(TypeError, match="x must be a cupy.ndarray"):
        cuflash.quantize_fp8(np.zeros(4, np.float16))
    with pytest.raises(TypeError, match="x must be float16, bfloat16 or float32"):
        cuflash.quantize_fp8(arr((4,), np.float64))


def _fp8(shape=QKV, **kw):
    return arr(shape, np.uint8, **kw)


def _forward_fp8(q=None, k=None, v=None, descales=(1.0, 1.0, 1.0), **kwargs):
    return cuflash.forward_fp8(q if q is not None else _fp8(), k if k is not None else _fp8(),
                               v if v is not None else _fp8(), *descales, **kwargs)


def test_forward_fp8_inputs():
    with pytest.raises(TypeError, match="q must be a cupy.ndarray of e4m3 bytes"):
        _forward_fp8(q=np.zeros(QKV, np.uint8))
    with pytest.raises(TypeError, match="k must hold fp8 e4m3 bytes"):
        _forward_fp8(k=arr(QKV, np.float16))
    with pytest.raises(ValueError, match="v must have 4 dimensions"):
        _forward_fp8(v=_fp8((1, 4, 2)))
    with pytest.raises(ValueError, match="q must be contiguous in its last dimension"):
        _forward_fp8(q=_fp8((1, 4, 2, 128))[..., ::2])
    with pytest.raises(ValueError, match="k is on device 1"):
        _forward_fp8(k=_fp8(device_id=1))
    with pytest.raises(ValueError, match="batch size"):
        _forward_fp8(k=_fp8((2, 4, 2, 64)), v=_fp8((2, 4, 2, 64)))
    with pytest.raises(ValueError, match="fp8 head_dim must be a multiple of 16"):
        _forward_fp8(*(_fp8((1, 4, 2, 40)) for _ in range(3)))
    with pytest.raises(ValueError, match="k must start on a 16-byte boundary"):
        _forward_fp8(k=_fp8(offset=8))


def test_forward_fp8_accepts_ml_dtypes_e4m3_arrays():
    # Past the dtype check: the next error (batch) shows the e4m3 dtype was taken.
    e4m3 = ml_dtypes.float8_e4m3fn
    with pytest.raises(ValueError, match="batch size"):
        _forward_fp8(arr(QKV, e4m3), arr((2, 4, 2, 64), e4m3), arr((2, 4, 2, 64), e4m3))


@pytest.mark.parametrize("i", [0, 1, 2])
def test_forward_fp8_descales(i):
    name = ("descale_q", "descale_k", "descale_v")[i]

    def with_descale(x):
        d = [1.0, 1.0, 1.0]
        d[i] = x
        return _forward_fp8(descales=d)

    with pytest.raises(ValueError, match=f"{name} must be positive and finite"):
        with_descale(-1.0)
    with pytest.raises(TypeError, match=f"{name} must be a positive float"):
        with_descale("1")
    with pytest.raises(TypeError, match=f"{name} must be a float32 cupy array of one element"):
        with_descale(arr((2,), np.float32))
    with pytest.raises(ValueError, match=f"{name} is on device 1"):
        with_descale(arr((1,), np.float32, device_id=1))


def test_forward_fp8_options_and_out():
    with pytest.raises(ValueError, match="softmax_scale"):
        _forward_fp8(softmax_scale=0.0)
    with pytest.raises(TypeError, match="causal must be a bool"):
        _forward_fp8(causal="yes")
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        _forward_fp8(return_lse=None)
    with pytest.raises(TypeError, match="out must have dtype bfloat16"):
        _forward_fp8(out=arr(QKV, np.float16))
    with pytest.raises(ValueError, match="out must have shape"):
        _forward_fp8(out=arr((1, 4, 2, 32), ml_dtypes.bfloat16))


# ---- The kernels' limits (cuflash/_checks.py: check_limits), before any allocation ----

def _broadcast(shape, dtype=np.float16):
    """A fake array of any size: stride 0 on every dimension but the head dim (inputs may be broadcasts)."""
    return arr(shape, dtype, strides=(0, 0, 0, np.dtype(dtype).itemsize))


@pytest.mark.parametrize("axis", ["batch", "heads_q"])
def test_grid_yz_limit(axis):
    """batch and heads are grid y / z: 65535 reaches the device, 65536 is a ValueError naming the limit."""
    def shapes(n):
        return ((n, 4, 1, 64), (n, 4, 1, 64)) if axis == "batch" else ((1, 4, n, 64), (1, 4, 1, 64))

    q_shape, kv_shape = shapes(65535)
    with pytest.raises(AssertionError, match="device was touched"):
        cuflash.forward(_broadcast(q_shape), _broadcast(kv_shape), _broadcast(kv_shape))
    q_shape, kv_shape = shapes(65536)
    q, k = _broadcast(q_shape), _broadcast(kv_shape)
    with pytest.raises(ValueError, match=f"{axis} must be <= 65535 .*grid y/z limit.*got 65536"):
        cuflash.forward(q, k, k)
    lse = arr((q_shape[0], q_shape[2], 4), np.float32)
    with pytest.raises(ValueError, match=f"{axis} must be <= 65535"):
        cuflash.backward(q, q, k, k, q, lse)
    q8, k8 = _broadcast(q_shape, np.uint8), _broadcast(kv_shape, np.uint8)
    with pytest.raises(ValueError, match=f"{axis} must be <= 65535"):
        cuflash.forward_fp8(q8, k8, k8, 1.0, 1.0, 1.0)


def test_seqlen_int32_limit():
    limit = _checks.INT32_MAX - _checks.SEQLEN_MARGIN
    nq = 1 << 20
    q = _broadcast((1, nq, 1, 64))
    k = _broadcast((1, limit - nq, 1, 64))
    with pytest.raises(AssertionError, match="device was touched"):
        cuflash.forward(q, k, k)
    k = _broadcast((1, limit - nq + 1, 1, 64))
    with pytest.raises(ValueError, match=r"seqlen_q \+ seqlen_k must be <= 2147482623 .*int32"):
        cuflash.forward(q, k, k)
    with pytest.raises(ValueError, match=r"seqlen_q \+ seqlen_k must be <="):
        cuflash.backward(q, q, k, k, q, arr((1, 1, nq), np.float32))


def test_tile_count_limits():
    with pytest.raises(ValueError, match=r"batch \* heads_q \* seqlen_q = .* int32 tile counts"):
        q = _broadcast((65535, 1, 65535, 64))
        cuflash.forward(q, q, q)
    with pytest.raises(ValueError, match=r"batch \* heads_kv \* seqlen_k = .* int32 tile counts"):
        cuflash.forward(_broadcast((65535, 0, 65535, 64)), _broadcast((65535, 16, 65535, 64)),
                        _broadcast((65535, 16, 65535, 64)))


def test_check_limits_boundaries():
    """The tile counts on both sides of their limit (2^31 - 1 - 65536)."""
    _checks.check_limits(65535, 16, 0, 16383, 1)          # 2 * 65535 * 16383 query tiles of 16
    with pytest.raises(ValueError, match="heads_q .*tile counts"):
        _checks.check_limits(65535, 16, 0, 16384, 1)
    _checks.check_limits(65535, 0, 16, 32767, 32767)      # 65535 * 32767 key tiles
    with pytest.raises(ValueError, match="heads_kv .*tile counts"):
        _checks.check_limits(65535, 0, 16, 32768, 32768)


@pytest.mark.parametrize("name", ["q", "k", "v", "out"])
def test_negative_strides_are_refused(name):
    args = {"q": arr(QKV), "k": arr(QKV), "v": arr(QKV), "out": None}
    args[name] = arr(QKV)[:, ::-1]
    with pytest.raises(ValueError, match=f"{name} has a negative stride"):
        cuflash.forward(**args)


@pytest.mark.parametrize("name", ["dout", "q", "out", "dq", "dk"])
def test_negative_strides_are_refused_by_backward(name):
    args = {n: arr(QKV) for n in ("dout", "q", "k", "v", "out")}
    args["lse"] = arr((1, 2, 4), np.float32)
    args[name] = arr(QKV)[:, :, ::-1]   # dq, dk: output buffers
    with pytest.raises(ValueError, match=f"{name} has a negative stride"):
        cuflash.backward(**args)


def test_negative_strides_are_refused_by_fp8():
    with pytest.raises(ValueError, match="k has a negative stride"):
        _forward_fp8(k=_fp8()[:, ::-1])


@pytest.mark.parametrize("bad,match", [(1e-39, "below float32's smallest normal"), (1e-50, "below float32's"),
                                       (1e39, "overflows float32")])
@pytest.mark.parametrize("i", [0, 1, 2])
def test_forward_fp8_float_descales_as_float32(i, bad, match):
    name = ("descale_q", "descale_k", "descale_v")[i]
    d = [1.0, 1.0, 1.0]
    d[i] = bad
    with pytest.raises(ValueError, match=f"{name} = {re.escape(str(bad))} .*{match}"):
        _forward_fp8(descales=d)
    d[i] = float(np.finfo(np.float32).tiny)   # the smallest normal float32 passes the descale checks
    with pytest.raises(TypeError, match="causal must be a bool"):
        _forward_fp8(descales=d, causal="no")
