"""Random invalid calls of every entry point (CPU, in CI): each must raise TypeError or ValueError, naming
one of the arguments it was given wrong, before anything touches a device.

A draw starts from a valid call of random size and dtype and spoils it one to three ways: an array
replaced by NumPy or a Python object, an unsupported dtype, wrong ndim, a strided last dimension, a
misaligned pointer or stride, another device, shapes that disagree (at most one such change, so that two
cannot cancel), an output that is the wrong shape or dtype, stride-0 or overlapping, a flag that is not a
bool, a bad scale or descale. The arrays are metadata over memory that is never allocated
(conftest.fake_cupy_array) and the ``device_forbidden`` fixture fails the test if a call gets past its
checks. CUFLASH_FUZZ_SEED fixes the seed (printed with any failure); CUFLASH_FUZZ_INVALID_CALLS the
number of calls per entry point (default 400).
"""
from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass, field

import numpy as np
import pytest

from conftest import dtype_of, fake_cupy_array

pytestmark = [pytest.mark.usefixtures("device_forbidden"), pytest.mark.fuzz]

BAD_DTYPES = (np.float64, np.int32, np.int8, np.bool_, np.complex64)
BAD_FLAGS = ("False", "True", 1, 0, None, 1.0, np.int64(1), [True])
BAD_SCALES = (-1.0, 0.0, float("nan"), float("inf"), -float("inf"), "0.1", True, False, [0.1], complex(1, 0),
              np.float32(-1.0), np.float64(0.0), -3)
BAD_DESCALES = (-1.0, 0.0, float("nan"), float("inf"), "1", True, None)
JUNK = (3, 1.5, "q", [[1.0]], object(), b"bytes", {"a": 1})


@dataclass
class Draw:
    """One call being spoilt: its arguments and, per change made, the words its error may name."""

    rng: np.random.Generator
    args: dict
    dims: dict
    numpy_arrays: bool = False   # the entry takes NumPy arrays (the host reference)
    names: list = field(default_factory=list)
    changes: list = field(default_factory=list)
    shape_changed: bool = False

    def note(self, change: str, *names: str) -> None:
        self.changes.append(change)
        self.names.extend(names)


def _arr(shape, dtype, **kw):
    return fake_cupy_array(tuple(shape), dtype, **kw)


def _valid_dims(rng, fp8: bool = False) -> dict:
    hkv, group = int(rng.integers(1, 4)), int(rng.integers(1, 4))
    step = 16 if fp8 else 8
    return {"b": int(rng.integers(1, 4)), "nq": int(rng.integers(1, 70)), "nk": int(rng.integers(1, 70)),
            "hq": hkv * group, "hkv": hkv, "d": step * int(rng.integers(1, 256 // step + 1)),
            "dtype": "uint8" if fp8 else str(rng.choice(["float16", "bfloat16", "float32"]))}


def _np_dtype(name: str):
    return np.uint8 if name == "uint8" else dtype_of(name)


def _shapes(dims: dict) -> dict:
    b, nq, nk, hq, hkv, d = (dims[x] for x in ("b", "nq", "nk", "hq", "hkv", "d"))
    qs, kvs = (b, nq, hq, d), (b, nk, hkv, d)
    return {"q": qs, "k": kvs, "v": kvs, "dout": qs, "out": qs, "dq": qs, "dk": kvs, "dv": kvs,
            "lse": (b, hq, nq), "x": qs}


# ---- changes to one array argument; None where the change does not apply to it ----

def _to_numpy(draw, name, x):
    return np.zeros(x.shape, np.float32)


def _to_junk(draw, name, x):
    return JUNK[draw.rng.integers(len(JUNK))]


def _bad_dtype(draw, name, x):
    return _arr(x.shape, BAD_DTYPES[draw.rng.integers(len(BAD_DTYPES))])


def _wrong_ndim(draw, name, x):
    shape = x.shape[:-2] + x.shape[-1:] if draw.rng.random() < 0.5 else x.shape[:-1] + (1,) + x.shape[-1:]
    return _arr(shape, x.dtype)


def _strided_last_dim(draw, name, x):
    return _arr(x.shape[:-1] + (2 * x.shape[-1],), x.dtype)[..., ::2]


def _misaligned_pointer(draw, name, x):
    return _arr(x.shape, x.dtype, offset=x.itemsize)


def _misaligned_stride(draw, name, x):
    if all(n == 1 for n in x.shape[:-1]):
        return None   # no stride is ever used: nothing to misalign
    return _arr(x.shape[:-1] + (x.shape[-1] + 1,), x.dtype)[..., :x.shape[-1]]


def _other_device(draw, name, x):
    return _arr(x.shape, x.dtype, device_id=1)


def _stride_zero(draw, name, x):
    dims = [i for i, n in enumerate(x.shape[:-1]) if n > 1]
    if not dims:
        return None
    strides = list(x.strides)
    strides[dims[draw.rng.integers(len(dims))]] = 0
    return _arr(x.shape, x.dtype, strides=tuple(strides))


def _overlapping(draw, name, x):
    dims = [i for i, n in enumerate(x.shape[:-1]) if n > 1]
    if not dims or x.shape[-1] * x.itemsize <= 16:
        return None
    strides = list(x.strides)
    strides[dims[draw.rng.integers(len(dims))]] = 16   # aligned, but rows fold onto each other
    return _arr(x.shape, x.dtype, strides=tuple(strides))


def _other_float_dtype(draw, name, x):
    others = [d for d in ("float16", "bfloat16", "float32") if np.dtype(dtype_of(d)) != x.dtype]
    return _arr(x.shape, dtype_of(others[draw.rng.integers(len(others))]))


def _float16(draw, name, x):
    return _arr(x.shape, np.float16)


def _not_an_array(draw, name, x):
    return ("q", None, object())[draw.rng.integers(3)]


def _complex(draw, name, x):
    return np.zeros(x.shape, np.complex128)


def _strings(draw, name, x):
    return np.full(x.shape, "a")


def _wrong_ndim_numpy(draw, name, x):
    return np.zeros(x.shape[:-1], np.float64)


ARRAY_CHANGES = {   # role -> changes that spoil an argument of that role whatever else is changed
    "input": (_to_numpy, _to_junk, _bad_dtype, _wrong_ndim, _strided_last_dim, _misaligned_pointer,
              _misaligned_stride, _other_device),
    "output": (_to_numpy, _to_junk, _bad_dtype, _wrong_ndim, _strided_last_dim, _misaligned_pointer,
               _misaligned_stride, _other_device, _stride_zero, _overlapping, _other_float_dtype),
    "lse": (_to_numpy, _to_junk, _float16, _wrong_ndim, _other_device),
    "fp8_input": (_to_numpy, _to_junk, _float16, _wrong_ndim, _strided_last_dim, _other_device),
    "fp8_tma_input": (_to_numpy, _to_junk, _float16, _wrong_ndim, _strided_last_dim, _misaligned_pointer,
                      _misaligned_stride, _other_device),
    "quantize_input": (_to_numpy, _to_junk, _bad_dtype),
    "reference_input": (_not_an_array, _complex, _strings, _wrong_ndim_numpy),
}


# ---- changes to the shapes of several arguments at once (at most one a draw) ----

def _reshape(draw, names, **new) -> dict:
    """``names`` rebuilt with the changed dims (an argument's dtype and kind kept where it has them)."""
    shapes = _shapes(dict(draw.dims, **new))
    out = {}
    for name in names:
        x = draw.args.get(name)
        dtype = x.dtype if hasattr(x, "dtype") else (np.float32 if name == "lse" else _np_dtype(draw.dims["dtype"]))
        out[name] = np.zeros(shapes[name], dtype) if draw.numpy_arrays else _arr(shapes[name], dtype)
    return out


def _kv_batch(draw):
    return _reshape(draw, ("k", "v"), b=draw.dims["b"] + 1), ("batch",)


def _kv_head_dim(draw):
    d = draw.dims["d"]
    step = 16 if draw.dims["dtype"] == "uint8" else 8
    return _reshape(draw, ("k", "v"), d=d + step if d + step <= 256 else d - step), ("head_dim",)


def _v_length(draw):
    return _reshape(draw, ("v",), nk=draw.dims["nk"] + 1), ("same shape",)


def _gqa_ratio(draw):
    return _reshape(draw, ("k", "v"), hkv=draw.dims["hq"] + 1), ("heads_q", "heads_kv")


def _no_query_heads(draw):
    return _reshape(draw, ("q",), hq=0), ("heads",)


def _unsupported_head_dim(draw):
    bad = (8, 24, 40, 264) if draw.dims["dtype"] == "uint8" else (4, 12, 20, 300, 584)
    names = [n for n in draw.args if n in _shapes(draw.dims) and (draw.args[n] is not None or n in "qkv")]
    return _reshape(draw, names, d=int(draw.rng.choice(bad))), ("head_dim",)


def _wrong_shape_of(name):
    def change(draw):
        x = draw.args.get(name)
        if not hasattr(x, "shape"):
            return None
        shape = list(x.shape)
        shape[int(draw.rng.integers(len(shape)))] += 1
        return {name: np.zeros(shape, x.dtype) if draw.numpy_arrays else _arr(shape, x.dtype)}, (name,)
    change.__name__ = f"_wrong_shape_of_{name}"
    return change


@dataclass(frozen=True)
class EntryPoint:
    name: str
    make: object          # rng -> (args, dims)
    call: object          # args -> None (raises)
    arrays: dict          # argument -> role
    flags: tuple = ()
    scale: bool = True
    descales: tuple = ()
    shape_changes: tuple = ()


def _kernel_args(rng, names, optional=()):
    dims = _valid_dims(rng)
    shapes, dt = _shapes(dims), _np_dtype(dims["dtype"])
    args = {n: _arr(shapes[n], np.float32 if n == "lse" else dt) for n in names}
    args.update({n: None for n in optional})
    return args, dims


def _fp8_args(rng):
    dims = _valid_dims(rng, fp8=True)
    shapes = _shapes(dims)
    args = {n: _arr(shapes[n], np.uint8) for n in ("q", "k", "v")}
    args.update({"descale_q": 1.0, "descale_k": _arr((1,), np.float32), "descale_v": 0.5, "out": None})
    return args, dims


def _reference_args(rng, names):
    dims = _valid_dims(rng)
    shapes = _shapes(dims)
    return {n: np.zeros(shapes[n], np.float32) for n in names}, dims


def _options(args, names):
    return {n: args[n] for n in names if n in args}


def _call_forward(a):
    import cuflash

    cuflash.forward(a["q"], a["k"], a["v"], **_options(a, ("causal", "softmax_scale", "return_lse", "out")))


def _call_vjp(a):
    import cuflash

    cuflash.vjp(a["q"], a["k"], a["v"], **_options(a, ("causal", "softmax_scale", "deterministic")))


def _call_backward(a):
    import cuflash

    cuflash.backward(a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"],
                     **_options(a, ("causal", "softmax_scale", "deterministic", "dq", "dk", "dv")))


def _call_pullback(a):
    from cuflash import api

    pullback = api.AttentionVJP(a["q"], a["k"], a["v"], a["out"], a["lse"], False, None, False)
    pullback(a["dout"], **_options(a, ("dq", "dk", "dv")))


def _call_forward_fp8(a):
    import cuflash

    cuflash.forward_fp8(a["q"], a["k"], a["v"], a["descale_q"], a["descale_k"], a["descale_v"],
                        **_options(a, ("causal", "softmax_scale", "return_lse", "out")))


def _call_quantize(a):
    import cuflash

    cuflash.quantize_fp8(a["x"])


def _call_reference(a):
    import cuflash

    cuflash.attention_reference(a["q"], a["k"], a["v"], **_options(a, ("causal", "softmax_scale")))


def _call_reference_backward(a):
    import cuflash

    cuflash.attention_reference_backward(a["dout"], a["q"], a["k"], a["v"], **_options(a, ("causal", "softmax_scale")))


def _call_reference_chunked(a):
    import cuflash

    cuflash.attention_reference_chunked(a["q"], a["k"], a["v"], a["dout"], **_options(a, ("causal", "softmax_scale")))


QKV_SHAPE_CHANGES = (_kv_batch, _kv_head_dim, _v_length, _gqa_ratio, _no_query_heads, _unsupported_head_dim)
REFERENCE_SHAPE_CHANGES = (_kv_batch, _kv_head_dim, _v_length, _gqa_ratio, _no_query_heads)
INPUTS = {"q": "input", "k": "input", "v": "input"}
OUTPUTS = {"dq": "output", "dk": "output", "dv": "output"}

ENTRY_POINTS = [
    EntryPoint("forward", lambda rng: _kernel_args(rng, ("q", "k", "v"), ("out",)), _call_forward,
               {**INPUTS, "out": "output"}, ("causal", "return_lse"),
               shape_changes=QKV_SHAPE_CHANGES + (_wrong_shape_of("out"),)),
    EntryPoint("vjp", lambda rng: _kernel_args(rng, ("q", "k", "v")), _call_vjp, INPUTS, ("causal", "deterministic"),
               shape_changes=QKV_SHAPE_CHANGES),
    EntryPoint("backward", lambda rng: _kernel_args(rng, ("dout", "q", "k", "v", "out", "lse"), ("dq", "dk", "dv")),
               _call_backward, {**INPUTS, "dout": "input", "out": "input", "lse": "lse", **OUTPUTS},
               ("causal", "deterministic"),
               shape_changes=QKV_SHAPE_CHANGES + tuple(_wrong_shape_of(n)
                                                       for n in ("dout", "out", "lse", "dq", "dk", "dv"))),
    EntryPoint("pullback", lambda rng: _kernel_args(rng, ("dout", "q", "k", "v", "out", "lse"), ("dq", "dk", "dv")),
               _call_pullback, {"dout": "input", **OUTPUTS}, scale=False,
               shape_changes=tuple(_wrong_shape_of(n) for n in ("dout", "dq", "dk", "dv"))),
    EntryPoint("forward_fp8", _fp8_args, _call_forward_fp8,
               {"q": "fp8_tma_input", "k": "fp8_tma_input", "v": "fp8_input", "out": "output"},
               ("causal", "return_lse"),
               descales=("descale_q", "descale_k", "descale_v"),
               shape_changes=QKV_SHAPE_CHANGES + (_wrong_shape_of("out"),)),
    EntryPoint("quantize_fp8", lambda rng: _kernel_args(rng, ("x",)), _call_quantize, {"x": "quantize_input"},
               scale=False),
    EntryPoint("attention_reference", lambda rng: _reference_args(rng, ("q", "k", "v")), _call_reference,
               {"q": "reference_input", "k": "reference_input", "v": "reference_input"}, ("causal",),
               shape_changes=REFERENCE_SHAPE_CHANGES),
    EntryPoint("attention_reference_backward", lambda rng: _reference_args(rng, ("dout", "q", "k", "v")),
               _call_reference_backward, {n: "reference_input" for n in ("dout", "q", "k", "v")}, ("causal",),
               shape_changes=REFERENCE_SHAPE_CHANGES + (_wrong_shape_of("dout"),)),
    EntryPoint("attention_reference_chunked", lambda rng: _kernel_args(rng, ("q", "k", "v", "dout")),
               _call_reference_chunked, {n: "reference_input" for n in ("dout", "q", "k", "v")}, ("causal",),
               shape_changes=REFERENCE_SHAPE_CHANGES + (_wrong_shape_of("dout"),)),
]


def _describe(value) -> str:
    """A value for a failure message (an array's repr would read its device memory)."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"{type(value).__module__}.{type(value).__name__}({value.dtype}, {tuple(value.shape)})"
    return repr(value)


def _spoil(entry: EntryPoint, draw: Draw) -> None:
    """Applies one change (chosen among the entry's kinds of change) to the draw's call."""
    kinds = ["array"] + ["flag"] * bool(entry.flags) + ["scale"] * entry.scale + ["descale"] * bool(entry.descales)
    if entry.shape_changes and not draw.shape_changed:
        kinds.append("shape")
    rng = draw.rng
    for _ in range(20):   # a change that does not apply to this call draws again
        kind = kinds[rng.integers(len(kinds))]
        if kind == "flag":
            name = entry.flags[rng.integers(len(entry.flags))]
            draw.args[name] = BAD_FLAGS[rng.integers(len(BAD_FLAGS))]
            return draw.note(f"{name}={_describe(draw.args[name])}", name)
        if kind == "scale":
            draw.args["softmax_scale"] = BAD_SCALES[rng.integers(len(BAD_SCALES))]
            return draw.note(f"softmax_scale={_describe(draw.args['softmax_scale'])}", "softmax_scale")
        if kind == "descale":
            name = entry.descales[rng.integers(len(entry.descales))]
            value = rng.integers(len(BAD_DESCALES) + 3)
            draw.args[name] = (BAD_DESCALES[value] if value < len(BAD_DESCALES) else
                               (_arr((1,), np.float64), _arr((2,), np.float32),
                                _arr((1,), np.float32, device_id=1))[value - len(BAD_DESCALES)])
            return draw.note(f"{name}={_describe(draw.args[name])}", name)
        if kind == "shape":
            change = entry.shape_changes[rng.integers(len(entry.shape_changes))]
            made = change(draw)
            if made is None:
                continue
            new, words = made
            draw.args.update(new)
            draw.shape_changed = True
            return draw.note(change.__name__, *words)
        name = list(entry.arrays)[rng.integers(len(entry.arrays))]
        if name in draw.names:
            continue   # a second change to one argument could undo the first (3 dims, then 4 again)
        role = entry.arrays[name]
        x = draw.args.get(name)
        if x is None or not hasattr(x, "shape"):   # an optional output not given yet: a valid one first
            dtype = dtype_of("bfloat16") if entry.name == "forward_fp8" else _np_dtype(draw.dims["dtype"])
            x = _arr(_shapes(draw.dims)[name], dtype)
        changes = ARRAY_CHANGES[role]
        change = changes[rng.integers(len(changes))]
        if change is _other_device and name == "q":
            continue   # the others' device is q's: moving q alone would move the reference point
        new = change(draw, name, x)
        if new is None:
            continue
        draw.args[name] = new
        return draw.note(f"{name}: {change.__name__}", name)
    if not draw.changes:
        raise AssertionError("no change applies to this call")   # later ones may find none left (one argument)


def _seed() -> int:
    value = os.environ.get("CUFLASH_FUZZ_SEED")
    return int(value) if value else secrets.randbits(32)


SEED = _seed()


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=lambda e: e.name)
def test_random_invalid_calls_raise_before_the_device(entry):
    n = int(os.environ.get("CUFLASH_FUZZ_INVALID_CALLS", "400"))
    failures = []
    for i in range(n):
        rng = np.random.default_rng([SEED, i, len(entry.name)])
        args, dims = entry.make(rng)
        draw = Draw(rng, args, dims, numpy_arrays=entry.name in ("attention_reference", "attention_reference_backward"))
        for _ in range(int(rng.integers(1, 4))):
            _spoil(entry, draw)
        where = f"call {i} ({'; '.join(draw.changes)}; {dims})"
        try:
            entry.call(draw.args)
        except (TypeError, ValueError) as e:
            message = str(e)
            if not any(re.search(rf"(?<![A-Za-z_]){re.escape(w)}(?![A-Za-z_])", message) for w in draw.names):
                failures.append(f"{where}: the message names none of {sorted(set(draw.names))}: {message}")
        except Exception as e:  # noqa: BLE001 - anything else is a failure, the device fixture's included
            failures.append(f"{where}: raised {type(e).__name__}: {e}")
        else:
            failures.append(f"{where}: no error")
    assert not failures, (f"CUFLASH_FUZZ_SEED={SEED}: {len(failures)} of {n} {entry.name} calls:\n"
                          + "\n".join(failures[:12]))


@pytest.mark.parametrize("make", [lambda s: _arr(s, np.float16, strides=(0,) + _arr(s, np.float16).strides[1:]),
                                  lambda s: _arr(s, np.float16, strides=(4096, 128, 16, 2))],
                         ids=["stride 0", "rows folded"])
@pytest.mark.parametrize("name", ["out", "dq"])
def test_outputs_that_overlap_themselves(make, name):
    """An output whose elements share addresses (a broadcast, or strides that fold rows onto each other) is
    refused like any other bad output."""
    import cuflash

    q = _arr((2, 5, 3, 64), np.float16)
    with pytest.raises(ValueError, match=f"{name} must not overlap itself"):
        if name == "out":
            cuflash.forward(q, q, q, out=make(q.shape))
        else:
            cuflash.backward(q, q, q, q, q, _arr((2, 3, 5), np.float32), dq=make(q.shape))
