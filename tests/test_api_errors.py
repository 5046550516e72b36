"""Argument checks: CPU-only where no device is needed, the rest on the GPU."""
from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash import _checks
from conftest import requires_gpu


def test_numpy_input_is_rejected_with_a_hint():
    q = np.zeros((1, 4, 1, 64), np.float16)
    with pytest.raises(TypeError, match=r"q must be a cupy.ndarray.*cupy.asarray\(q\)"):
        cuflash.forward(q, q, q)


def test_list_input_is_rejected():
    with pytest.raises(TypeError, match="q must be a cupy.ndarray"):
        cuflash.forward([[1.0]], None, None)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_softmax_scale_values(bad):
    with pytest.raises(ValueError, match="softmax_scale"):
        _checks.check_scale(bad, 64)


@pytest.mark.parametrize("bad", ["0.1", True, [0.1]])
def test_bad_softmax_scale_types(bad):
    with pytest.raises(TypeError, match="softmax_scale"):
        _checks.check_scale(bad, 64)


def test_default_scale():
    assert _checks.check_scale(None, 64) == 0.125


# ---- checks that need CuPy arrays, hence a device ----

def _arr(shape, dtype=np.float16):
    import cupy

    return cupy.ones(shape, dtype=dtype)


@requires_gpu
@pytest.mark.parametrize(
    "q_shape,k_shape,v_shape,exc,match",
    [
        ((1, 4, 2, 64), (1, 4, 2, 64), (1, 4, 2), ValueError, "v must have 4 dimensions"),
        ((1, 4, 2, 64), (2, 4, 2, 64), (2, 4, 2, 64), ValueError, "batch size"),
        ((1, 4, 2, 64), (1, 4, 2, 32), (1, 4, 2, 32), ValueError, "head_dim"),
        ((1, 4, 3, 64), (1, 4, 2, 64), (1, 4, 2, 64), ValueError, "multiple of heads_kv"),
        ((1, 4, 2, 60), (1, 4, 2, 60), (1, 4, 2, 60), ValueError, "multiple of 8"),
        ((1, 4, 2, 264), (1, 4, 2, 264), (1, 4, 2, 264), ValueError, "from 8 to 256"),
        ((1, 4, 2, 64), (1, 4, 2, 64), (1, 5, 2, 64), ValueError, "same shape"),
    ],
)
def test_shape_errors(q_shape, k_shape, v_shape, exc, match):
    with pytest.raises(exc, match=match):
        cuflash.forward(_arr(q_shape), _arr(k_shape), _arr(v_shape))


@requires_gpu
@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.int8])
def test_unsupported_dtype(dtype):
    x = _arr((1, 4, 2, 64), dtype)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        cuflash.forward(x, x, x)


@requires_gpu
def test_mismatched_dtypes():
    with pytest.raises(TypeError, match="k must have the dtype of q"):
        cuflash.forward(_arr((1, 4, 2, 64)), _arr((1, 4, 2, 64), np.float32), _arr((1, 4, 2, 64)))


@requires_gpu
def test_last_dim_not_contiguous():
    x = _arr((1, 4, 2, 128))[..., ::2]
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        cuflash.forward(x, x, x)


@requires_gpu
def test_misaligned_view():
    x = _arr((1, 4, 2, 72))[..., 4:68]
    with pytest.raises(ValueError, match="16-byte boundary"):
        cuflash.forward(x, x, x)


@requires_gpu
def test_bad_out():
    x = _arr((1, 4, 2, 64))
    with pytest.raises(ValueError, match="out must have shape"):
        cuflash.forward(x, x, x, out=_arr((1, 4, 2, 32)))
    with pytest.raises(TypeError, match="out must have dtype"):
        cuflash.forward(x, x, x, out=_arr((1, 4, 2, 64), np.float32))
    with pytest.raises(TypeError, match="out must be a cupy.ndarray"):
        cuflash.forward(x, x, x, out=np.zeros((1, 4, 2, 64), np.float16))


@requires_gpu
def test_inputs_on_different_devices():
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    q = _arr((1, 4, 2, 64))
    with cupy.cuda.Device(1):
        k = _arr((1, 4, 2, 64))
    with pytest.raises(ValueError, match="device"):
        cuflash.forward(q, k, k)
