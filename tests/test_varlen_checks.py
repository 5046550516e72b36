"""The varlen argument checks (cuflash.varlen), on the CPU: every error of check_varlen before the device
is touched (CuPy arrays over memory never allocated: conftest.fake_cupy_array), every error of the host
validator of the offsets on NumPy arrays, the valid layouts, and which path check_offsets=None takes
with and without a CUDA graph capture (the stream query and the device-to-host copy stubbed)."""
from __future__ import annotations

import types

import ml_dtypes
import numpy as np
import pytest

from cuflash import capture, varlen
from cuflash.varlen import VarlenLayout, check_varlen, validate_offsets
from conftest import fake_cupy_array as arr
from conftest import requires_gpu

I32 = np.int32


def _touched(*args, **kwargs):
    raise AssertionError("the device was touched before the argument checks raised")


@pytest.fixture
def no_device(device_forbidden, monkeypatch):
    """device_forbidden, and the varlen checks' own ways to the device (the capture query, the copy)."""
    import cupy

    monkeypatch.setattr(cupy.cuda, "get_current_stream", _touched)
    monkeypatch.setattr(capture, "stream_is_capturing", _touched)
    monkeypatch.setattr(varlen, "_copy_to_host", _touched)


def _args(total_q=10, total_k=12, hq=4, hkv=2, d=64, dv=None, batch=2, dtype=np.float16, max_q=8, max_k=8,
          device_id=0):
    return dict(q=arr((total_q, hq, d), dtype, device_id=device_id),
                k=arr((total_k, hkv, d), dtype, device_id=device_id),
                v=arr((total_k, hkv, d if dv is None else dv), dtype, device_id=device_id),
                cu_seqlens_q=arr((batch + 1,), I32, device_id=device_id),
                cu_seqlens_k=arr((batch + 1,), I32, device_id=device_id),
                max_seqlen_q=max_q, max_seqlen_k=max_k)


def _call(a: dict, **kw) -> VarlenLayout:
    a = dict(a)
    pos = [a.pop(n) for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")]
    return check_varlen(*pos, **a, **kw)


def _set(**changes):
    return lambda a: a.update(changes)


# (id, change to the valid arguments of _args(), exception, message)
ERRORS = [
    ("q-numpy", _set(q=np.zeros((10, 4, 64), np.float16)), TypeError, r"q must be a cupy.ndarray.*cupy.asarray\(q\)"),
    ("k-list", _set(k=[[1.0]]), TypeError, r"k must be a cupy.ndarray, got builtins.list"),
    ("v-none", _set(v=None), TypeError, r"v must be a cupy.ndarray, got builtins.NoneType"),
    ("q-4d", _set(q=arr((1, 10, 4, 64))), ValueError, r"q must have 3 dimensions \(total_q, heads_q, head_dim\)"),
    ("k-2d", _set(k=arr((12, 128))), ValueError, r"k must have 3 dimensions \(total_k, heads_kv, head_dim\)"),
    ("q-float64", _set(q=arr((10, 4, 64), np.float64)), TypeError, "q must be float16, bfloat16 or float32"),
    ("v-int8", _set(v=arr((12, 2, 64), np.int8)), TypeError, "v must be float16, bfloat16 or float32"),
    ("k-dtype", _set(k=arr((12, 2, 64), np.float32)), TypeError, r"k must have the dtype of q \(float16\)"),
    ("v-device", _set(v=arr((12, 2, 64), device_id=1)), ValueError, "v is on device 1 but q is on device 0"),
    ("q-negative-stride", _set(q=arr((10, 4, 64))[::-1]), ValueError, "q has a negative stride"),
    ("k-last-dim", _set(k=arr((12, 2, 128))[..., ::2]), ValueError, "k must be contiguous in its last dimension"),
    ("v-total", _set(v=arr((11, 2, 64))), ValueError, r"k and v must have the same \(total_k, heads_kv\)"),
    ("v-heads", _set(v=arr((12, 1, 64))), ValueError, r"k and v must have the same \(total_k, heads_kv\)"),
    ("k-head-dim", _set(k=arr((12, 2, 32)), v=arr((12, 2, 32))), ValueError,
     r"k must have the head_dim of q \(64\), got 32"),
    ("heads-0", _set(q=arr((10, 0, 64)), k=arr((12, 0, 64)), v=arr((12, 0, 64))), ValueError, "heads must be >= 1"),
    ("gqa", _set(q=arr((10, 3, 64))), ValueError, r"heads_q \(3\) must be a multiple of heads_kv \(2\)"),
    ("head-dim-60", lambda a: a.update(_args(d=60)), ValueError,
     "head_dim must be a multiple of 8 from 8 to 576, got 60"),
    ("head-dim-584", lambda a: a.update(_args(d=584)), ValueError,
     "head_dim must be a multiple of 8 from 8 to 576, got 584"),
    ("dv-without-allow", _set(v=arr((12, 2, 32))), ValueError, r"v must have the head_dim of q \(64\), got 32"),
    ("dv-260", _set(v=arr((12, 2, 260)), allow_dv=True), ValueError,
     "v's head_dim must be a multiple of 8 from 8 to 512, got 260"),
    ("dv-520", _set(v=arr((12, 2, 520)), allow_dv=True), ValueError,
     "v's head_dim must be a multiple of 8 from 8 to 512, got 520"),
    ("dv-36", _set(v=arr((12, 2, 36)), allow_dv=True), ValueError, "v's head_dim must be a multiple of 8 .*got 36"),
    ("allow-dv-str", _set(allow_dv="yes"), TypeError, "allow_dv must be a bool"),
    ("q-misaligned", _set(q=arr((10, 4, 64), offset=2)), ValueError, "q must start on a 16-byte boundary"),
    ("cu-q-numpy", _set(cu_seqlens_q=np.zeros(3, I32)), TypeError,
     r"cu_seqlens_q must be a cupy.ndarray of int32 \(batch \+ 1,\).*cupy.asarray\(cu_seqlens_q, dtype=cupy.int32\)"),
    ("cu-k-list", _set(cu_seqlens_k=[0, 6, 12]), TypeError, "cu_seqlens_k must be a cupy.ndarray of int32"),
    ("cu-q-int64", _set(cu_seqlens_q=arr((3,), np.int64)), TypeError, "cu_seqlens_q must be int32, got int64"),
    ("cu-k-uint32", _set(cu_seqlens_k=arr((3,), np.uint32)), TypeError, "cu_seqlens_k must be int32, got uint32"),
    ("cu-q-2d", _set(cu_seqlens_q=arr((1, 3), I32)), ValueError,
     r"cu_seqlens_q must be 1-D \(batch \+ 1,\), got shape \(1, 3\)"),
    ("cu-q-empty", _set(cu_seqlens_q=arr((0,), I32)), ValueError, r"cu_seqlens_q must have length batch \+ 1 >= 1"),
    ("cu-q-device", _set(cu_seqlens_q=arr((3,), I32, device_id=1)), ValueError,
     "cu_seqlens_q is on device 1 but q is on device 0"),
    ("cu-k-strided", _set(cu_seqlens_k=arr((6,), I32)[::2]), ValueError,
     r"cu_seqlens_k must be contiguous.*cupy.ascontiguousarray\(cu_seqlens_k\)"),
    ("cu-q-misaligned", _set(cu_seqlens_q=arr((3,), I32, offset=2)), ValueError,
     "cu_seqlens_q must start on a 4-byte boundary"),
    ("cu-k-length", _set(cu_seqlens_k=arr((4,), I32)), ValueError,
     r"cu_seqlens_k must have the length of cu_seqlens_q \(batch \+ 1 = 3\), got 4"),
    ("seqused-q-numpy", _set(seqused_q=np.zeros(2, I32)), TypeError,
     r"seqused_q must be a cupy.ndarray of int32 \(batch,\)"),
    ("seqused-k-int64", _set(seqused_k=arr((2,), np.int64)), TypeError, "seqused_k must be int32, got int64"),
    ("seqused-q-length", _set(seqused_q=arr((3,), I32)), ValueError,
     r"seqused_q must have shape \(batch,\) = \(2,\), got \(3,\)"),
    ("seqused-k-2d", _set(seqused_k=arr((2, 1), I32)), ValueError, r"seqused_k must be 1-D \(batch,\)"),
    ("seqused-k-device", _set(seqused_k=arr((2,), I32, device_id=1)), ValueError,
     "seqused_k is on device 1 but q is on device 0"),
    ("max-q-bool", _set(max_seqlen_q=True), TypeError, "max_seqlen_q must be a Python int >= 0.*got builtins.bool"),
    ("max-k-float", _set(max_seqlen_k=8.0), TypeError, "max_seqlen_k must be a Python int >= 0.*got builtins.float"),
    ("max-q-device", _set(max_seqlen_q=arr((), I32)), TypeError, "max_seqlen_q must be a Python int >= 0.*cupy"),
    ("max-q-none", _set(max_seqlen_q=None), TypeError, "max_seqlen_q must be a Python int"),
    ("max-k-negative", _set(max_seqlen_k=-1), ValueError, "max_seqlen_k must be >= 0, got -1"),
    ("max-q-too-small", _set(max_seqlen_q=4), ValueError,
     r"max_seqlen_q \(4\) is smaller than a sequence: 2 sequences of at most 4 tokens cannot pack total_q = "
     r"q.shape\[0\] = 10"),
    ("max-k-zero", _set(max_seqlen_k=0), ValueError, r"max_seqlen_k \(0\) is smaller than a sequence"),
    ("batch-0-rows", _set(cu_seqlens_q=arr((1,), I32), cu_seqlens_k=arr((1,), I32)), ValueError,
     r"cu_seqlens_q has length 1 \(no sequences\).*total_q = q.shape\[0\] = 10"),
    ("total-k-int32", _set(k=arr((2**31, 2, 64), strides=(0, 0, 2)), v=arr((2**31, 2, 64), strides=(0, 0, 2))),
     ValueError, r"total_k \(k.shape\[0\]\) must be <= 2147483647: cu_seqlens_k is int32"),
    ("batch-grid", lambda a: a.update(_args(total_q=0, total_k=0, batch=65536)), ValueError, "batch must be <= 65535"),
    ("seqlens-int32", _set(max_seqlen_q=2**30, max_seqlen_k=2**30), ValueError, "seqlen_q \\+ seqlen_k must be <="),
    ("check-offsets-str", _set(check_offsets="no"), TypeError, "check_offsets must be a bool"),
]


@pytest.mark.usefixtures("no_device")
@pytest.mark.parametrize("check_offsets", [False, None])
@pytest.mark.parametrize("change,exc,match", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_check_varlen_errors(change, exc, match, check_offsets):
    """Each raises the error named, before the device (the copy, the capture query) is touched, with
    check_offsets False and with the default: the copy-free checks all come first."""
    a = _args()
    a["check_offsets"] = check_offsets
    change(a)
    with pytest.raises(exc, match=match):
        _call(a)


def test_error_table_is_valid_without_its_change(no_device):
    """The base arguments of ERRORS pass (with the offsets' checks off): each case fails by its change."""
    layout = _call(_args(), check_offsets=False)
    assert (layout.batch, layout.total_q, layout.total_k) == (2, 10, 12)


VALID = [
    ("plain", {}, dict(batch=2, total_q=10, total_k=12, heads_q=4, heads_kv=2, head_dim_qk=64, head_dim_v=64)),
    ("mqa-bf16", dict(hq=8, hkv=1, dtype=ml_dtypes.bfloat16), dict(heads_q=8, heads_kv=1)),
    ("float32-d8", dict(d=8, dtype=np.float32), dict(head_dim_qk=8, head_dim_v=8)),
    ("d256", dict(d=256), dict(head_dim_qk=256)),
    ("d512", dict(d=512), dict(head_dim_qk=512, head_dim_v=512)),
    ("batch-0", dict(total_q=0, total_k=0, batch=0, max_q=0, max_k=0), dict(batch=0, total_q=0, total_k=0)),
    ("empty-q-and-k", dict(total_q=0, total_k=0, max_q=0, max_k=0), dict(batch=2, total_q=0, total_k=0)),
    ("single-tokens", dict(total_q=3, total_k=3, batch=3, max_q=1, max_k=1), dict(max_seqlen_q=1, max_seqlen_k=1)),
    ("max-above-total", dict(max_q=4096, max_k=4096), dict(max_seqlen_q=4096, max_seqlen_k=4096)),
    ("max-exact", dict(total_q=10, batch=2, max_q=5), dict(max_seqlen_q=5)),
]


@pytest.mark.usefixtures("no_device")
@pytest.mark.parametrize("kw,expect", [v[1:] for v in VALID], ids=[v[0] for v in VALID])
def test_valid_layouts(kw, expect):
    a = _args(**kw)
    layout = _call(a, check_offsets=False)
    for field, value in expect.items():
        assert getattr(layout, field) == value, field
    assert layout.cu_seqlens_q is a["cu_seqlens_q"] and layout.cu_seqlens_k is a["cu_seqlens_k"]
    assert layout.seqused_q is None and layout.seqused_k is None
    assert layout.offsets_checked is False and layout.device_id == 0


def test_valid_dv_and_seqused(no_device):
    a = _args(dv=128)
    su_q, su_k = arr((2,), I32), arr((2,), I32)
    layout = _call(a, allow_dv=True, seqused_q=su_q, seqused_k=su_k, check_offsets=False)
    assert (layout.head_dim_qk, layout.head_dim_v) == (64, 128)
    assert layout.seqused_q is su_q and layout.seqused_k is su_k


@pytest.mark.parametrize("d,dv", [(576, 512), (64, 512), (512, 80)])
def test_valid_head_dims_above_256(no_device, d, dv):
    layout = _call(_args(d=d, dv=dv), allow_dv=True, check_offsets=False)
    assert (layout.head_dim_qk, layout.head_dim_v) == (d, dv)


def test_numpy_ints_and_flags(no_device):
    layout = _call(dict(_args(), max_seqlen_q=np.int64(8), max_seqlen_k=np.int32(6)), check_offsets=np.False_)
    assert (layout.max_seqlen_q, layout.max_seqlen_k) == (8, 6)
    assert type(layout.max_seqlen_q) is int and layout.offsets_checked is False


def test_head_dims_parameter(no_device):
    with pytest.raises(ValueError, match="head_dim must be a multiple of 16 from 16 to 256, got 8"):
        _call(_args(d=8), head_dims=range(16, 257, 16), check_offsets=False)
    with pytest.raises(ValueError, match="head_dim must be one of 64, 128, got 96"):
        _call(_args(d=96), head_dims=(64, 128), check_offsets=False)
    assert _call(_args(d=128), head_dims=(64, 128), check_offsets=False).head_dim_qk == 128
    with pytest.raises(ValueError, match="v's head_dim must be a multiple of 8 from 8 to 512, got 520"):
        _call(_args(d=128, dv=520), head_dims=(64, 128), allow_dv=True, check_offsets=False)


def test_layout_is_frozen_and_compares_by_identity(no_device):
    layout = _call(_args(), check_offsets=False)
    with pytest.raises(AttributeError):
        layout.batch = 3
    assert layout == layout and layout != _call(_args(), check_offsets=False)


# --- validate_offsets: the host validator, on NumPy arrays -------------------------------------------------

def _validate(cu_q, cu_k, total_q=None, total_k=None, max_q=100, max_k=100, su_q=None, su_k=None):
    cu_q, cu_k = np.asarray(cu_q, I32), np.asarray(cu_k, I32)
    validate_offsets(cu_q, cu_k, int(cu_q[-1]) if total_q is None else total_q,
                     int(cu_k[-1]) if total_k is None else total_k, max_q, max_k,
                     None if su_q is None else np.asarray(su_q, I32), None if su_k is None else np.asarray(su_k, I32))


OFFSET_ERRORS = [
    ("q-start", dict(cu_q=[1, 4, 10], cu_k=[0, 6, 12]), r"cu_seqlens_q must start at 0, got cu_seqlens_q\[0\] = 1"),
    ("k-start-negative", dict(cu_q=[0, 4, 10], cu_k=[-2, 6, 12]),
     r"cu_seqlens_k must start at 0, got cu_seqlens_k\[0\] = -2"),
    ("k-decreasing", dict(cu_q=[0, 4, 10, 10], cu_k=[0, 5, 3, 12]),
     r"cu_seqlens_k must be non-decreasing: cu_seqlens_k\[2\] = 3 < cu_seqlens_k\[1\] = 5 \(sequence 1 would have "
     r"length -2\)"),
    ("q-first-decrease", dict(cu_q=[0, 4, 2, 1, 10], cu_k=[0, 1, 2, 3, 4]),
     r"cu_seqlens_q\[2\] = 2 < cu_seqlens_q\[1\] = 4"),
    # int32 differences would wrap (2^31 - 1 -> -2^31 reads as +1): the validator computes in int64
    ("q-wrap", dict(cu_q=[0, 2**31 - 1, -2**31], cu_k=[0, 1, 2], total_q=-2**31),
     r"cu_seqlens_q\[2\] = -2147483648 < cu_seqlens_q\[1\] = 2147483647 \(sequence 1 would have length -4294967295\)"),
    ("q-end-short", dict(cu_q=[0, 4, 9], cu_k=[0, 6, 12], total_q=10),
     r"cu_seqlens_q must end at total_q = q.shape\[0\] = 10, got cu_seqlens_q\[2\] = 9"),
    ("k-end-long", dict(cu_q=[0, 4, 10], cu_k=[0, 6, 13], total_k=12),
     r"cu_seqlens_k must end at total_k = k.shape\[0\] = 12, got cu_seqlens_k\[2\] = 13"),
    ("batch-0-end", dict(cu_q=[0], cu_k=[0], total_q=0, total_k=3),
     r"cu_seqlens_k must end at total_k = k.shape\[0\] = 3"),
    ("q-longer-than-max", dict(cu_q=[0, 4, 10, 17], cu_k=[0, 1, 2, 3], max_q=5),
     r"max_seqlen_q \(5\) is smaller than sequence 1: its length is cu_seqlens_q\[2\] - cu_seqlens_q\[1\] "
     r"= 10 - 4 = 6"),
    ("k-longer-than-max", dict(cu_q=[0, 1], cu_k=[0, 9], max_k=8),
     r"max_seqlen_k \(8\) is smaller than sequence 0: .* = 9 - 0 = 9"),
    ("seqused-q-negative", dict(cu_q=[0, 4, 10], cu_k=[0, 6, 12], su_q=[4, -1]),
     r"seqused_q\[1\] = -1 must be in \[0, 6\] \(sequence 1's packed length, cu_seqlens_q\[2\] - cu_seqlens_q\[1\]\)"),
    ("seqused-k-long", dict(cu_q=[0, 4, 10], cu_k=[0, 6, 12], su_k=[7, 9]), r"seqused_k\[0\] = 7 must be in \[0, 6\]"),
    ("seqused-k-empty-seq", dict(cu_q=[0, 4, 10], cu_k=[0, 0, 12], su_k=[0, 13]),
     r"seqused_k\[1\] = 13 must be in \[0, 12\]"),
    ("seqused-q-shape", dict(cu_q=[0, 4, 10], cu_k=[0, 6, 12], su_q=[4]),
     r"seqused_q must have shape \(batch,\) = \(2,\), got \(1,\)"),
    ("lengths-differ", dict(cu_q=[0, 4, 10], cu_k=[0, 12]),
     r"cu_seqlens_k must have the length of cu_seqlens_q \(3\), got 2"),
]


@pytest.mark.parametrize("kw,match", [e[1:] for e in OFFSET_ERRORS], ids=[e[0] for e in OFFSET_ERRORS])
def test_validate_offsets_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        _validate(**kw)


@pytest.mark.parametrize("cu_q,cu_k,match", [
    (np.zeros(0, I32), np.zeros(0, I32), r"cu_seqlens_q must have length batch \+ 1 >= 1"),
    (np.zeros((1, 3), I32), np.zeros(3, I32), "cu_seqlens_q must be a 1-D integer array"),
    (np.zeros(3, I32), np.zeros(3, np.float32), "cu_seqlens_k must be a 1-D integer array, got float32"),
])
def test_validate_offsets_bad_arrays(cu_q, cu_k, match):
    with pytest.raises(ValueError, match=match):
        validate_offsets(cu_q, cu_k, 0, 0, 1, 1)


@pytest.mark.parametrize("kw", [
    dict(cu_q=[0, 4, 10], cu_k=[0, 6, 12]),
    dict(cu_q=[0, 0, 5, 5], cu_k=[0, 3, 3, 3]),                          # empty sequences
    dict(cu_q=[0, 1, 2, 3], cu_k=[0, 1, 2, 3], max_q=1, max_k=1),        # single tokens, max exact
    dict(cu_q=[0, 4, 10], cu_k=[0, 6, 12], su_q=[2, 6], su_k=[0, 5]),    # seqused shorter (and 0)
    dict(cu_q=[0, 0], cu_k=[0, 0], max_q=0, max_k=0, su_q=[0], su_k=[0]),
    dict(cu_q=[0], cu_k=[0]),                                             # no sequences
    dict(cu_q=[0, 2**31 - 1], cu_k=[0, 2**31 - 1], max_q=2**31 - 1, max_k=2**31 - 1),
])
def test_validate_offsets_valid(kw):
    _validate(**kw)


def test_validate_offsets_takes_any_integer_dtype():
    validate_offsets(np.array([0, 3, 7], np.int64), [0, 2, 2], 7, 2, 4, 2, np.array([3, 0], np.uint8), None)


# --- check_offsets: which path runs ------------------------------------------------------------------------

class _Device:
    """Stand-ins for the stream query and the copy, recording what check_varlen asked of them."""

    def __init__(self, monkeypatch, capturing: bool, host: list | None = None):
        import cupy

        self.capturing, self.host = capturing, host
        self.stream_devices: list = []
        self.queried: list = []
        self.copied: list = []
        monkeypatch.setattr(cupy.cuda, "get_current_stream", self._stream)
        monkeypatch.setattr(capture, "stream_is_capturing", self._is_capturing)
        monkeypatch.setattr(varlen, "_copy_to_host", self._copy)

    def _stream(self, device_id=-1):
        self.stream_devices.append(device_id)
        return types.SimpleNamespace(ptr=0x5000 + device_id)

    def _is_capturing(self, ptr):
        self.queried.append(ptr)
        return self.capturing

    def _copy(self, arrays, device_id):
        self.copied.append((list(arrays), device_id))
        return [np.asarray(h, I32) for h in self.host]


GOOD_HOST = [[0, 4, 10], [0, 6, 12]]


@pytest.mark.usefixtures("device_forbidden")
def test_default_is_off_under_capture(monkeypatch):
    dev = _Device(monkeypatch, capturing=True, host=[[0, 99, 10], [5, 6, 12]])   # bad: must not be read
    layout = _call(_args(device_id=1))
    assert layout.offsets_checked is False
    assert dev.stream_devices == [1] and dev.queried == [0x5001]   # q's device's current stream
    assert dev.copied == []


@pytest.mark.usefixtures("device_forbidden")
def test_default_is_on_in_eager_calls(monkeypatch):
    dev = _Device(monkeypatch, capturing=False, host=GOOD_HOST)
    a = _args(device_id=1)
    layout = _call(a)
    assert layout.offsets_checked is True and dev.queried == [0x5001]
    (arrays, device_id), = dev.copied
    assert device_id == 1 and len(arrays) == 2
    assert arrays[0] is a["cu_seqlens_q"] and arrays[1] is a["cu_seqlens_k"]


@pytest.mark.usefixtures("device_forbidden")
@pytest.mark.parametrize("host,match", [
    ([[0, 4, 9], [0, 6, 12]], r"cu_seqlens_q must end at total_q = q.shape\[0\] = 10"),
    ([[0, 4, 10], [0, 13, 12]], r"cu_seqlens_k must be non-decreasing"),
    ([[0, 1, 10], [0, 6, 12]], r"max_seqlen_q \(8\) is smaller than sequence 1"),
])
def test_default_validates_the_copied_offsets(monkeypatch, host, match):
    """The copy's values reach validate_offsets with the totals of the shapes and the max_seqlens given."""
    dev = _Device(monkeypatch, capturing=False, host=host)
    with pytest.raises(ValueError, match=match):
        _call(_args())
    assert len(dev.copied) == 1


@pytest.mark.usefixtures("device_forbidden")
def test_seqused_copied_in_order_and_validated(monkeypatch):
    a = _args()
    su_q, su_k = arr((2,), I32), arr((2,), I32)
    dev = _Device(monkeypatch, capturing=False, host=GOOD_HOST + [[4, 6], [6, 13]])
    with pytest.raises(ValueError, match=r"seqused_k\[1\] = 13 must be in \[0, 6\]"):
        _call(a, seqused_q=su_q, seqused_k=su_k)
    arrays = dev.copied[0][0]
    assert [x is y for x, y in zip(arrays, (a["cu_seqlens_q"], a["cu_seqlens_k"], su_q, su_k))] == [True] * 4

    dev = _Device(monkeypatch, capturing=False, host=GOOD_HOST + [[3, 6]])   # seqused_k alone
    layout = _call(a, seqused_k=su_k)
    assert layout.offsets_checked and dev.copied[0][0][2] is su_k and len(dev.copied[0][0]) == 3


@pytest.mark.usefixtures("device_forbidden")
def test_true_forces_the_copy_under_capture(monkeypatch):
    dev = _Device(monkeypatch, capturing=True, host=GOOD_HOST)
    assert _call(_args(), check_offsets=True).offsets_checked is True
    assert dev.queried == [] and len(dev.copied) == 1


@pytest.mark.usefixtures("device_forbidden")
def test_false_neither_queries_nor_copies(monkeypatch):
    dev = _Device(monkeypatch, capturing=False, host=[[1, 2, 3], [4, 5, 6]])   # bad: must not be read
    assert _call(_args(), check_offsets=False).offsets_checked is False
    assert dev.queried == [] and dev.copied == [] and dev.stream_devices == []


def test_copy_to_host_waits_once(monkeypatch):
    """_copy_to_host queues every copy without blocking into slices of one pinned buffer, on the current
    stream of the device given, and synchronizes that stream once (CuPy's device calls stubbed)."""
    import contextlib

    import cupy
    import cupyx

    log = []

    class Stream:
        def synchronize(self):
            log.append("sync")

    stream = Stream()

    class Source:
        def __init__(self, values):
            self.values = np.asarray(values, I32)
            self.size = self.values.size

        def get(self, stream=None, out=None, blocking=True):
            log.append(("get", stream is stream_, blocking, out.base is not None))
            out[...] = self.values

    stream_ = stream
    monkeypatch.setattr(cupy.cuda, "Device", lambda d: (log.append(("device", d)), contextlib.nullcontext())[1])
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda *a: stream)
    monkeypatch.setattr(cupyx, "empty_pinned", lambda shape, dtype: np.full(shape, -7, dtype))
    got = varlen._copy_to_host([Source([0, 4, 10]), Source([0, 6, 12]), Source([3, 5])], 1)
    assert [g.tolist() for g in got] == [[0, 4, 10], [0, 6, 12], [3, 5]]
    assert log == [("device", 1)] + [("get", True, False, True)] * 3 + ["sync"]


# ---------------------------------------------------------------------------- on the GPU: the real copy


def _gpu_packed(lengths_q, lengths_k, heads=2, d=64):
    import cupy

    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q = cupy.ones((total_q, heads, d), cupy.float16)
    k = cupy.ones((total_k, heads, d), cupy.float16)
    cu_q = cupy.asarray(np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32))
    cu_k = cupy.asarray(np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32))
    return q, k, cu_q, cu_k


@requires_gpu
def test_gpu_offsets_copied_and_validated():
    """Real device arrays: the default copies the offsets and seqused once and validates their values; a
    decreasing offset or a seqused past its sequence raises, naming the argument."""
    import cupy

    q, k, cu_q, cu_k = _gpu_packed([5, 0, 7], [3, 4, 9])
    used = cupy.asarray(np.array([5, 0, 6], np.int32))
    layout = check_varlen(q, k, k, cu_q, cu_k, 7, 9, seqused_q=used)
    assert layout.offsets_checked and layout.batch == 3 and (layout.total_q, layout.total_k) == (12, 16)
    bad = cu_q.copy()
    bad[2] = 3   # 0, 5, 3, 12: decreasing
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        check_varlen(q, k, k, bad, cu_k, 7, 9)
    with pytest.raises(ValueError, match="seqused_k"):
        check_varlen(q, k, k, cu_q, cu_k, 7, 9, seqused_k=cupy.asarray(np.array([3, 5, 9], np.int32)))
    with pytest.raises(ValueError, match="max_seqlen_k"):
        check_varlen(q, k, k, cu_q, cu_k, 7, 8)


@requires_gpu
def test_gpu_default_is_off_under_a_real_capture():
    """Under a real CUDA graph capture the default makes no copy (a sync there would break the capture)."""
    import cupy

    q, k, cu_q, cu_k = _gpu_packed([4, 6], [6, 2])
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            layout = check_varlen(q, k, k, cu_q, cu_k, 6, 6)
        finally:
            stream.end_capture()
    assert not layout.offsets_checked


@pytest.mark.parametrize("kw,exc,match", [
    (dict(bias=arr((2, 4, 8, 9), np.float32)), ValueError, r"bias must broadcast to \(batch, heads_q, seqlen_q, "
                                                           r"seqlen_k\) = \(2, 4, 8, 8\)"),
    (dict(bias=arr((8, 8), np.float64)), TypeError, "bias must be float32 or q's dtype"),
    (dict(dropout_p=0.1), ValueError, "needs a seed"),
    (dict(dropout_p=1.5, seed=1), ValueError, r"dropout_p must be in \[0, 1\)"),
    (dict(block_mask=arr((2, 4, 2, 2), np.bool_), block_size=8), ValueError, "block_mask must have shape"),
    (dict(score_mod="return score;"), TypeError, "score_mod must be a cuflash.ScoreMod"),
])
@pytest.mark.parametrize("which", ["forward", "backward"])
def test_programmable_arguments_checked_at_the_padded_shape(no_device, kw, exc, match, which):
    """forward_varlen / backward_varlen check bias, dropout, block masks and modifiers against (batch, heads_q,
    max_seqlen_q, max_seqlen_k) before the device is touched."""
    import cuflash

    a = _args()
    if which == "forward":
        call = lambda: cuflash.forward_varlen(**a, check_offsets=False, **kw)   # noqa: E731
    else:
        out, dout, lse = arr((10, 4, 64)), arr((10, 4, 64)), arr((4, 10), np.float32)
        call = lambda: cuflash.backward_varlen(dout, a["q"], a["k"], a["v"], out, lse, a["cu_seqlens_q"],   # noqa: E731
                                               a["cu_seqlens_k"], 8, 8, check_offsets=False, **kw)
    with pytest.raises(exc, match=match):
        call()


def test_programmable_backward_takes_equal_head_dims(no_device):
    import cuflash

    a = _args(dv=32)
    out, dout, lse = arr((10, 4, 32)), arr((10, 4, 32)), arr((4, 10), np.float32)
    with pytest.raises(ValueError, match="v's head dim equal to q's"):
        cuflash.backward_varlen(dout, a["q"], a["k"], a["v"], out, lse, a["cu_seqlens_q"], a["cu_seqlens_k"], 8, 8,
                                check_offsets=False, bias=arr((8, 8), np.float32))
