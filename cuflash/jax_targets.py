"""The bodies of cuflash's XLA custom calls: what runs when a jitted JAX program reaches the attention.

Each body gets a decoded call frame (``xla_ffi.Call``): XLA's buffers, never copies of them, and the
attributes ``causal``, ``softmax_scale`` (and ``deterministic`` for the backward). On CUDA the buffers
become CuPy arrays over XLA's memory and the kernels launch on XLA's stream; on the host platform the
float64 NumPy reference computes the same results (slow: for tests and for code developed without a GPU).

Buffers may carry leading dims that ``jax.vmap`` added (``vmap_method="broadcast_all"``): they are merged
into the batch dim, a view of the same row-major memory.

Operands: forward ``(q, k, v) -> (out, lse)``; backward ``(dout, q, k, v, out, lse) -> (dq, dk, dv)``, with
q, out, dout, dq ``(batch, seqlen_q, heads_q, head_dim)``, k, v, dk, dv ``(batch, seqlen_k, heads_kv,
head_dim)`` and lse float32 ``(batch, heads_q, seqlen_q)``. JAX handles empty shapes without a call.
"""
from __future__ import annotations

import ctypes
import math
from contextlib import contextmanager
from typing import Callable, Optional

import numpy as np

from . import xla_ffi
from .capture import external_stream
from .xla_ffi import BufferView, Call

FORWARD = "cuflash_attention_fwd"
BACKWARD = "cuflash_attention_bwd"

# Tests set this to a list: each call then appends (target, [argument pointers], [result pointers], stream),
# so that they can check that the kernels read and wrote JAX's own buffers on XLA's stream.
CALL_LOG: Optional[list] = None


def _as_4d(buf: BufferView, batch_dims: int) -> tuple:
    """The buffer's shape with its leading ``batch_dims`` dims (vmap axes and batch) merged into one."""
    lead = math.prod(buf.shape[:batch_dims])
    return (lead, *buf.shape[batch_dims:])


def _shapes(call: Call) -> list:
    """Every buffer's shape as 4D (q-like) or 3D (lse): vmap's leading dims merged into the batch."""
    lead = len(call.args[0].shape) - 3   # q is (..., seqlen_q, heads_q, head_dim)
    return [_as_4d(b, lead) for b in (*call.args, *call.rets)]


def _log(target: str, call: Call, stream: int) -> None:
    if CALL_LOG is not None:
        CALL_LOG.append((target, [b.ptr for b in call.args], [b.ptr for b in call.rets], stream))


# ---------------------------------------------------------------------------
# CUDA: cuflash's kernels on XLA's buffers and stream


_streams: dict = {}   # stream pointer -> CuPy stream object (XLA keeps its streams for the client's life)


@contextmanager
def _on_xla_device(call: Call, ptr: int):
    """Makes the device that holds ``ptr`` and XLA's stream for this call current in CuPy; yields the
    device id and the stream pointer. The primary context is made current explicitly: XLA's thread may
    not have one, and the launches go through the driver API."""
    import cupy

    device = cupy.cuda.runtime.pointerGetAttributes(ptr).device
    stream_ptr = call.stream()
    stream = _streams.get(stream_ptr)
    if stream is None:
        stream = _streams[stream_ptr] = external_stream(stream_ptr, device)
    with cupy.cuda.Device(device):
        cupy.cuda.runtime.setDevice(device)
        with stream:
            yield device, stream_ptr


def _device_array(buf: BufferView, shape: tuple, device: int):
    """A CuPy array over XLA's buffer (no copy, no ownership: XLA keeps it alive during the call)."""
    import cupy

    mem = cupy.cuda.UnownedMemory(buf.ptr, buf.nbytes, None, device)
    return cupy.ndarray(shape, dtype=xla_ffi.numpy_dtype(buf.dtype), memptr=cupy.cuda.MemoryPointer(mem, 0))


def _variant_kwargs(call: Call, extras: list) -> dict:
    """The variant arguments of ``cuflash.forward`` / ``backward`` from the call's attributes and its optional
    operands (alibi slopes, then sinks, as the attributes has_alibi / has_sinks say)."""
    a = call.attrs
    extras = list(extras)
    slopes = extras.pop(0) if a.get("has_alibi") else None
    sinks = extras.pop(0) if a.get("has_sinks") else None
    return dict(window_size=(int(a.get("window_left", -1)), int(a.get("window_right", -1))),
                attention_chunk=int(a.get("attention_chunk", 0)), softcap=float(a.get("softcap", 0.0)),
                alibi_slopes=slopes, sinks=sinks)


def _n_extras(call: Call) -> int:
    return int(bool(call.attrs.get("has_alibi"))) + int(bool(call.attrs.get("has_sinks")))


def _forward_into(q, k, v, out, lse, *, causal: bool, softmax_scale: float, window_size=(-1, -1),
                  attention_chunk: int = 0, softcap: float = 0.0, alibi_slopes=None, sinks=None) -> None:
    """``cuflash.forward`` writing both ``out`` and ``lse`` into given buffers.

    ``forward`` takes ``out=`` but allocates lse itself; this reaches its checked path
    (``api._run_forward`` / ``api._launch_fwd``) so that lse is written into XLA's buffer rather than
    copied there. A public ``lse=`` argument of ``forward`` would replace it.
    """
    from . import _checks, api, variants

    b, nq, nk, hq, hkv, d = _checks.check_qkv_cached(q, k, v, api.HEAD_DIMS)
    scale = _checks.check_scale(softmax_scale, d)
    dev = q.data.device_id
    _checks.check_out_cached("out", out, q.shape, q.dtype, dev)
    _checks.check_lse_cached(lse, (b, hq, nq), dev)
    var = variants.from_arguments(window_size, attention_chunk, softcap, alibi_slopes, sinks, causal=causal, batch=b,
                                  heads_q=hq, device_id=dev, q_dtype=q.dtype)

    def launch(o, l_):
        api._launch_fwd(q, k, v, o, l_, causal=causal, scale=scale, dims=(b, nq, nk, hq, hkv, d), device_id=dev,
                        var=var)

    api._run_forward(launch, out, q.shape, q.dtype, (b, hq, nq), nk, True, dev, lse, var.sinks)


def cuda_forward(call: Call) -> None:
    """(q, k, v[, alibi_slopes][, sinks]) -> (out, lse) with cuflash's forward kernels on XLA's stream."""
    shapes = _shapes(call)
    with _on_xla_device(call, call.args[0].ptr) as (dev, stream):
        arrays = [_device_array(b, s, dev) for b, s in zip((*call.args, *call.rets), shapes)]
        q, k, v = arrays[:3]
        out, lse = arrays[-2:]
        _log(FORWARD, call, stream)
        _forward_into(q, k, v, out, lse, causal=bool(call.attrs["causal"]),
                      softmax_scale=float(call.attrs["softmax_scale"]), **_variant_kwargs(call, arrays[3:-2]))


def cuda_backward(call: Call) -> None:
    """(dout, q, k, v, out, lse[, alibi_slopes][, sinks]) -> (dq, dk, dv[, dsinks]) with cuflash's backward
    kernels on XLA's stream. Its float32 workspaces (O(batch * heads * seqlen * head_dim)) come from CuPy's
    memory pool on that stream."""
    from .api import backward

    shapes = _shapes(call)
    with _on_xla_device(call, call.args[0].ptr) as (dev, stream):
        arrays = [_device_array(b, s, dev) for b, s in zip((*call.args, *call.rets), shapes)]
        dout, q, k, v, out, lse = arrays[:6]
        n_extra = _n_extras(call)
        kwargs = _variant_kwargs(call, arrays[6:6 + n_extra])
        dq, dk, dv = arrays[6 + n_extra:9 + n_extra]
        _log(BACKWARD, call, stream)
        grads = backward(dout, q, k, v, out, lse, causal=bool(call.attrs["causal"]),
                         softmax_scale=float(call.attrs["softmax_scale"]),
                         deterministic=bool(call.attrs["deterministic"]), dq=dq, dk=dk, dv=dv, **kwargs)
        if kwargs["sinks"] is not None:
            arrays[-1][...] = grads[3]


# ---------------------------------------------------------------------------
# Host: the float64 reference on XLA:CPU's buffers


def _host_array(buf: BufferView, shape: tuple) -> np.ndarray:
    """A writable NumPy view of a host buffer."""
    raw = (ctypes.c_byte * buf.nbytes).from_address(buf.ptr)
    return np.frombuffer(raw, dtype=xla_ffi.numpy_dtype(buf.dtype)).reshape(shape)


def host_forward(call: Call) -> None:
    """(q, k, v[, slopes][, sinks]) -> (out, lse) by ``cuflash.attention_reference`` (float64, rounded to the
    output dtype)."""
    from .reference import attention_reference

    arrays = [_host_array(b, s) for b, s in zip((*call.args, *call.rets), _shapes(call))]
    q, k, v = arrays[:3]
    out, lse = arrays[-2:]
    _log(FORWARD, call, 0)
    o, l_ = attention_reference(q, k, v, causal=bool(call.attrs["causal"]),
                                softmax_scale=float(call.attrs["softmax_scale"]), **_variant_kwargs(call, arrays[3:-2]))
    out[...] = o.astype(out.dtype)
    lse[...] = l_.astype(np.float32)


def host_backward(call: Call) -> None:
    """(dout, q, k, v, out, lse[, slopes][, sinks]) -> (dq, dk, dv[, dsinks]) by
    ``cuflash.attention_reference_backward`` (which recomputes the probabilities: out and lse are not read)."""
    from .reference import attention_reference_backward

    arrays = [_host_array(b, s) for b, s in zip((*call.args, *call.rets), _shapes(call))]
    dout, q, k, v = arrays[:4]
    n_extra = _n_extras(call)
    kwargs = _variant_kwargs(call, arrays[6:6 + n_extra])
    rets = arrays[6 + n_extra:]
    _log(BACKWARD, call, 0)
    grads = attention_reference_backward(dout, q, k, v, causal=bool(call.attrs["causal"]),
                                         softmax_scale=float(call.attrs["softmax_scale"]), **kwargs)
    for buf, g in zip(rets, grads):
        buf[...] = g.astype(buf.dtype)


# (target name, platform as jax.ffi.register_ffi_target names it) -> body
BODIES: dict[tuple[str, str], Callable[[Call], None]] = {
    (FORWARD, "CUDA"): cuda_forward,
    (BACKWARD, "CUDA"): cuda_backward,
    (FORWARD, "cpu"): host_forward,
    (BACKWARD, "cpu"): host_backward,
}


def handlers(version: tuple) -> dict:
    """A ctypes handler per (target, platform) speaking FFI API ``version``; the caller keeps them alive."""
    return {key: xla_ffi.make_handler(body, version) for key, body in BODIES.items()}

