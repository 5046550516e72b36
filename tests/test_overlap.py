"""CPU-only: an output buffer that shares memory with an array the call reads (forward's out with q, k,
v; backward's dq, dk, dv with dout, q, k, v, out, lse or with each other) is refused with a ValueError
naming both, before the device is touched; interleaved views of one buffer that share no element pass.
The arrays are metadata over memory that is never allocated (conftest.fake_cupy_array)."""
from __future__ import annotations

import types

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash import _overlap, api, call_cache
from conftest import fake_cupy_array as arr

QKV = (1, 4, 2, 64)
MiB = 1 << 20


def _separate(count, shape=QKV, dtype=np.float16):
    """``count`` arrays in separate (never allocated) buffers, 1 MiB apart."""
    return [arr(shape, dtype, offset=(i + 1) * MiB) for i in range(count)]


# ---- the geometry ----

def test_separate_and_touching_buffers_do_not_overlap():
    a, b = _separate(2)
    assert not _overlap.shares_memory(a, b)
    x = arr((2, 4, 2, 64))
    assert not _overlap.shares_memory(x[:1], x[1:])   # one ends where the other starts


def test_same_and_sliced_views_overlap():
    x = arr((2, 8, 4, 64))
    assert _overlap.shares_memory(x, x)
    assert _overlap.shares_memory(x[:, :5], x[:, 4:])       # one sequence row in common
    assert _overlap.shares_memory(x[:, :, :2], x[:, :, 1:3])  # one head in common
    assert not _overlap.shares_memory(x[:, :, :2], x[:, :, 2:])
    assert _overlap.shares_memory(x[:, ::-1], x[:, 3])      # negative strides


def test_interleaved_packed_views_do_not_overlap():
    """q, k, v, out as slices of one (batch, seqlen, 4, heads, head_dim) buffer: their byte ranges
    interleave, their elements do not."""
    buf = arr((2, 16, 4, 2, 64))
    views = [buf[:, :, i] for i in range(4)]
    assert _overlap.byte_range(views[0])[1] > _overlap.byte_range(views[3])[0]
    assert not any(_overlap.shares_memory(views[i], views[j]) for i in range(4) for j in range(i + 1, 4))


def test_empty_arrays_and_other_devices_do_not_overlap():
    x = arr(QKV)
    assert not _overlap.shares_memory(x[:, :0], x)
    assert not _overlap.shares_memory(arr(QKV, device_id=1), x)


# ---- the entry points: before the device (conftest.device_forbidden) ----

pytestmark = pytest.mark.usefixtures("device_forbidden")


class ReachedTheDevice(Exception):
    pass


@pytest.fixture
def passes_checks(monkeypatch):
    """``passes_checks(call)``: the call got past every argument check, to the device work."""
    def reached(*args, **kwargs):
        raise ReachedTheDevice

    monkeypatch.setattr(api, "_run_forward", reached)
    monkeypatch.setattr(api, "_backward_on_device", reached)

    def check(call):
        with pytest.raises(ReachedTheDevice):
            call()
    return check


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_forward_out_overlapping_an_input(which):
    q, k, v = _separate(3)
    args = {"q": q, "k": k, "v": v}
    with pytest.raises(ValueError, match=f"out overlaps {which} in memory"):
        cuflash.forward(q, k, v, out=args[which])
    partly = arr(QKV, offset=("q", "k", "v").index(which) * MiB + MiB + 128)   # from its third row on
    with pytest.raises(ValueError, match=f"out overlaps {which}"):
        cuflash.forward(q, k, v, out=partly)


def test_forward_out_in_a_packed_buffer(passes_checks):
    buf = arr((1, 4, 4, 2, 64))
    q, k, v, out = (buf[:, :, i] for i in range(4))
    passes_checks(lambda: cuflash.forward(q, k, v, out=out))
    with pytest.raises(ValueError, match="out overlaps k"):
        cuflash.forward(q, k, v, out=buf[:, :, 1])
    passes_checks(lambda: cuflash.forward(*_separate(3), out=_separate(4)[3]))


def test_forward_fp8_out_overlapping_an_input_or_a_descale():
    q, k, v = _separate(3, dtype=np.uint8)
    out = arr(QKV, ml_dtypes.bfloat16, offset=4 * MiB)
    with pytest.raises(ValueError, match="out overlaps v in memory"):
        cuflash.forward_fp8(q, k, v, 1.0, 1.0, 1.0, out=arr(QKV, ml_dtypes.bfloat16, offset=3 * MiB))
    descale = arr((1,), np.float32, offset=4 * MiB + 128)
    with pytest.raises(ValueError, match="out overlaps descale_k"):
        cuflash.forward_fp8(q, k, v, 1.0, descale, 1.0, out=out)


def _bwd(**change):
    dout, q, k, v, out = _separate(5)
    args = dict(dout=dout, q=q, k=k, v=v, out=out, lse=arr((1, 2, 4), np.float32, offset=6 * MiB))
    args.update(change)
    grads = {g: args.pop(g) for g in ("dq", "dk", "dv") if g in args}
    return cuflash.backward(args["dout"], args["q"], args["k"], args["v"], args["out"], args["lse"], **grads)


@pytest.mark.parametrize("grad,ref", [("dq", "q"), ("dk", "k"), ("dv", "v")])
@pytest.mark.parametrize("other", ["dout", "q", "k", "v", "out"])
def test_backward_gradient_overlapping_an_input(grad, ref, other):
    offset = {"dout": 1, "q": 2, "k": 3, "v": 4, "out": 5}[other] * MiB
    with pytest.raises(ValueError, match=f"{grad} overlaps {other} in memory"):
        _bwd(**{grad: arr(QKV, offset=offset)})


def test_backward_gradient_overlapping_lse_or_another_gradient(passes_checks):
    with pytest.raises(ValueError, match="dk overlaps lse"):
        _bwd(dk=arr(QKV, offset=6 * MiB - 64))
    dq = arr(QKV, offset=8 * MiB)
    with pytest.raises(ValueError, match="dv overlaps dq in memory: the kernels would write dv while writing dq"):
        _bwd(dq=dq, dv=dq)
    passes_checks(lambda: _bwd(dq=dq, dk=arr(QKV, offset=9 * MiB), dv=arr(QKV, offset=10 * MiB)))


# ---- the forward's call cache: a replay never stands in for an overlapping call ----

@pytest.fixture
def stand_in_device(device_forbidden, monkeypatch):
    """A usable device as the call cache sees it (a stream, a device), and launches that only count."""
    launches = []

    def prepared(stream):
        launches.append("replayed")

    def launch_fwd(q, k, v, out, lse, **kwargs):
        launches.append("checked")
        return prepared

    def run_forward(launch_fn, out, shape, dtype, lse_shape, seqlen_k, return_lse, device_id, lse=None, sinks=None):
        launch_fn(out, lse)
        return out

    monkeypatch.setattr(call_cache, "_current_stream", lambda: types.SimpleNamespace(ptr=7))
    monkeypatch.setattr(call_cache, "_current_device", lambda: 0)
    monkeypatch.setattr(api, "_fwd_calls", call_cache.CallCache())
    monkeypatch.setattr(api, "_launch_fwd", launch_fwd)
    monkeypatch.setattr(api, "_run_forward", run_forward)
    return launches


def test_call_cache_never_replays_an_overlapping_call(stand_in_device):
    q, k, v, out = _separate(4)
    cuflash.forward(q, k, v, out=out)
    cuflash.forward(q, k, v, out=out)
    assert stand_in_device == ["checked", "replayed"] and len(api._fwd_calls) == 1
    # The same shapes, strides and dtypes, k moved onto out: another key, so the checked path refuses it.
    with pytest.raises(ValueError, match="out overlaps k"):
        cuflash.forward(q, out, v, out=out)
    for _ in range(2):   # refused every time: an overlapping call is never recorded
        with pytest.raises(ValueError, match="out overlaps q"):
            cuflash.forward(q, k, v, out=q)
    assert len(api._fwd_calls) == 1 and stand_in_device == ["checked", "replayed"]
