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

Varlen (packed) operands: forward ``(q, k, v, cu_seqlens_q, cu_seqlens_k[, seqused_q][, seqused_k]
[, alibi_slopes][, sinks]) -> (out, lse)``; backward ``(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k
[, seqused_q][, seqused_k][, alibi_slopes][, sinks][, dlse]) -> (dq, dk, dv[, dsinks])``, with q, out, dout,
dq ``(total_q, heads_q, head_dim)``, k, v, dk, dv ``(total_k, heads_kv, head_dim)``, the offsets int32
``(batch + 1,)``, seqused int32 ``(batch,)`` and lse, dlse float32 ``(heads_q, total_q)``; the attributes
``max_seqlen_q``, ``max_seqlen_k`` and ``has_seqused_q`` / ``has_seqused_k`` / ``has_dlse`` besides the dense
ones. They are never merged: JAX maps them with ``vmap_method="sequential"`` (one call per mapped element).
On CUDA the offsets are not checked (``check_offsets=False``: their check copies them to the host, a
synchronisation, and under jit they are values the host does not have); on the host they are
(``cuflash.varlen.validate_offsets``), since the reference reads them there anyway.

Programmable (bias, dropout, block masks, modifiers) operands follow the variants' (and, in the varlen backward,
dlse): ``[, bias][, block_mask][, rng][, modifier tensors...]`` as the attributes has_bias / has_block_mask /
has_rng / mods say, with dropout_p, block_q, block_k; their backwards return dbias (the bias's shape and dtype) and
the score modifier's tensors' float32 gradients after dsinks. The varlen ones
(``FORWARD_VARLEN_PROG`` / ``BACKWARD_VARLEN_PROG``) take the varlen operands and attributes besides, and call
``cuflash.forward_varlen`` / ``backward_varlen`` (offsets unchecked, as above).
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
FORWARD_VARLEN = "cuflash_attention_varlen_fwd"
BACKWARD_VARLEN = "cuflash_attention_varlen_bwd"
KVCACHE = "cuflash_attention_kvcache"
FORWARD_PROG = "cuflash_attention_prog_fwd"
BACKWARD_PROG = "cuflash_attention_prog_bwd"
FORWARD_VARLEN_PROG = "cuflash_attention_varlen_prog_fwd"
BACKWARD_VARLEN_PROG = "cuflash_attention_varlen_prog_bwd"

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


def _varlen_kwargs(call: Call, operands: list) -> tuple[dict, list]:
    """The offsets arguments of ``cuflash.forward_varlen`` / ``backward_varlen`` from a varlen call: the
    operands ``cu_seqlens_q, cu_seqlens_k`` then seqused_q, seqused_k (as has_seqused_q / has_seqused_k say)
    and the attributes max_seqlen_q / max_seqlen_k. Returns them and the operands after them."""
    a = call.attrs
    rest = list(operands)
    cu_q, cu_k = rest.pop(0), rest.pop(0)
    used_q = rest.pop(0) if a.get("has_seqused_q") else None
    used_k = rest.pop(0) if a.get("has_seqused_k") else None
    return dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=int(a["max_seqlen_q"]),
                max_seqlen_k=int(a["max_seqlen_k"]), seqused_q=used_q, seqused_k=used_k), rest


def _forward_into(q, k, v, out, lse, *, causal: bool, softmax_scale: float, window_size=(-1, -1),
                  attention_chunk: int = 0, softcap: float = 0.0, alibi_slopes=None, sinks=None) -> None:
    """``cuflash.forward`` writing both ``out`` and ``lse`` into given buffers.

    ``forward`` takes ``out=`` but allocates lse itself; this reaches its checked path
    (``api._run_forward`` / ``api._launch_fwd``) so that lse is written into XLA's buffer rather than
    copied there. A public ``lse=`` argument of ``forward`` would replace it.
    """
    from . import _checks, api, variants

    b, nq, nk, hq, hkv, d = _checks.check_qkv_cached(q, k, v, allow_dv=True)
    out_shape = (b, nq, hq, v.shape[3])
    scale = _checks.check_scale(softmax_scale, d)
    dev = q.data.device_id
    _checks.check_out_cached("out", out, out_shape, q.dtype, dev)
    _checks.check_lse_cached(lse, (b, hq, nq), dev)
    var = variants.from_arguments(window_size, attention_chunk, softcap, alibi_slopes, sinks, causal=causal, batch=b,
                                  heads_q=hq, device_id=dev, q_dtype=q.dtype)

    def launch(o, l_):
        api._launch_fwd(q, k, v, o, l_, causal=causal, scale=scale, dims=(b, nq, nk, hq, hkv, d), device_id=dev,
                        var=var)

    api._run_forward(launch, out, out_shape, q.dtype, (b, hq, nq), nk, True, dev, lse, var.sinks)


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


def _prog_kwargs(call: Call, operands: list, device: bool) -> dict:
    """Programmable attention's arguments of ``cuflash.forward`` / ``backward`` from a programmable call: the
    operands after the variants' ``[bias][, block_mask][, rng][, modifier tensors...]`` (as has_bias /
    has_block_mask / has_rng and the modifiers of the ``mods`` key say; rng: uint32 (4,), the (seed, offset) pair as
    little-endian words) and the attributes dropout_p, block_q, block_k, mods. ``device``: the rng words as the
    uint64 (2,) device array the kernels read, the modifiers bound to the tensors' buffers; else (host) the seed
    as ints, and modifiers refused."""
    a = call.attrs
    rest = list(operands)
    bias = rest.pop(0) if a.get("has_bias") else None
    block_mask = rest.pop(0) if a.get("has_block_mask") else None
    p = float(a.get("dropout_p", 0.0))
    kwargs = dict(bias=bias, block_mask=block_mask, block_size=(int(a["block_q"]), int(a["block_k"])), dropout_p=p)
    if a.get("has_rng"):
        words = rest.pop(0)
        if device:
            kwargs["seed"] = words.view(np.uint64)
        else:
            w = [int(x) for x in np.asarray(words, dtype=np.uint32)]
            kwargs.update(seed=w[0] | w[1] << 32, offset=w[2] | w[3] << 32)
    if a.get("mods"):
        if not device:
            raise ValueError("score_mod / mask_mod run on a GPU only (XLA:CPU has no CUDA compiler for them)")
        from .jax import modifiers_of
        from .modifiers import Modifiers, bind

        score_mod, mask_mod = modifiers_of(a["mods"])
        names = list(Modifiers(score_mod, mask_mod).slots)
        kwargs["score_mod"], kwargs["mask_mod"] = bind(score_mod, mask_mod, dict(zip(names, rest[:len(names)])))
    return kwargs


def _n_prog(call: Call) -> int:
    return sum(int(bool(call.attrs.get(f))) for f in ("has_bias", "has_block_mask", "has_rng"))


def cuda_forward_prog(call: Call) -> None:
    """(q, k, v[, alibi_slopes][, sinks][, bias][, block_mask][, rng]) -> (out, lse) with cuflash's programmable
    forward on XLA's stream (lse copied into XLA's buffer)."""
    from .api import forward

    with _on_xla_device(call, call.args[0].ptr) as (dev, stream):
        arrays = _device_arrays(call, dev)
        q, k, v = arrays[:3]
        out, lse = arrays[-2:]
        n_extra = _n_extras(call)
        _log(FORWARD_PROG, call, stream)
        _, lse_ = forward(q, k, v, causal=bool(call.attrs["causal"]), softmax_scale=float(call.attrs["softmax_scale"]),
                          return_lse=True, out=out, **_variant_kwargs(call, arrays[3:3 + n_extra]),
                          **_prog_kwargs(call, arrays[3 + n_extra:-2], True))
        lse[...] = lse_


def cuda_backward_prog(call: Call) -> None:
    """(dout, q, k, v, out, lse[, alibi_slopes][, sinks][, bias][, block_mask][, rng]) -> (dq, dk, dv[, dsinks]
    [, dbias]) with cuflash's programmable backward on XLA's stream."""
    from .api import backward

    with _on_xla_device(call, call.args[0].ptr) as (dev, stream):
        arrays = _device_arrays(call, dev)
        n_args = len(call.args)
        dout, q, k, v, out, lse = arrays[:6]
        n_extra = _n_extras(call)
        kwargs = _variant_kwargs(call, arrays[6:6 + n_extra])
        prog = _prog_kwargs(call, arrays[6 + n_extra:n_args], True)
        rets = arrays[n_args:]
        _log(BACKWARD_PROG, call, stream)
        grads = backward(dout, q, k, v, out, lse, causal=bool(call.attrs["causal"]),
                         softmax_scale=float(call.attrs["softmax_scale"]),
                         deterministic=bool(call.attrs["deterministic"]), dq=rets[0], dk=rets[1], dv=rets[2],
                         **kwargs, **prog)
        _store_prog_grads(rets[3:], grads[3:], prog)


def _store_prog_grads(bufs: list, grads, prog: dict) -> None:
    """Writes a programmable backward's results after (dq, dk, dv) into XLA's result buffers: dsinks, dbias, then
    the score modifier's tensor gradients (``backward``'s dict {name: gradient}) in slot order."""
    rest = list(grads)
    if rest and isinstance(rest[-1], dict):   # the score modifier's tensor gradients, in slot order
        from .modifiers import Modifiers

        by_name = rest.pop()
        rest += [by_name[n] for n in Modifiers(prog.get("score_mod"), prog.get("mask_mod")).slots if n in by_name]
    for buf, g in zip(bufs, rest):   # dsinks, dbias, the tensors' gradients
        buf[...] = g


def _forward_varlen_into(q, k, v, out, lse, **kwargs) -> None:
    """``cuflash.forward_varlen`` writing ``out`` and ``lse`` into XLA's buffers, with the offsets unchecked."""
    from .api import forward_varlen

    forward_varlen(q, k, v, return_lse=True, out=out, lse=lse, check_offsets=False, **kwargs)


def _device_arrays(call: Call, dev: int) -> list:
    """CuPy arrays over every argument and result buffer, as XLA shapes them (varlen: nothing merged)."""
    return [_device_array(b, b.shape, dev) for b in (*call.args, *call.rets)]


def _forward_varlen_call(call: Call, target: str, programmable: bool) -> None:
    """A varlen forward target's body: the arguments after the offsets are the variants' extras, then (with
    ``programmable``) the programmable ones; out and lse are written into XLA's buffers."""
    with _on_xla_device(call, call.args[0].ptr) as (dev, stream):
        arrays = _device_arrays(call, dev)
        q, k, v = arrays[:3]
        out, lse = arrays[-2:]
        offsets, rest = _varlen_kwargs(call, arrays[3:-2])
        n_extra = _n_extras(call)
        prog = _prog_kwargs(call, rest[n_extra:], True) if programmable else {}
        _log(target, call, stream)
        _forward_varlen_into(q, k, v, out, lse, causal=bool(call.attrs["causal"]),
                             softmax_scale=float(call.attrs["softmax_scale"]), **offsets,
                             **_variant_kwargs(call, rest[:n_extra]), **prog)


def _backward_varlen_call(call: Call, target: str, programmable: bool) -> None:
    """A varlen backward target's body: after the offsets the variants' extras, dlse (has_dlse), then (with
    ``programmable``) the programmable arguments; dq, dk, dv and the further gradients go into XLA's buffers. Its
    float32 workspaces come from CuPy's memory pool on XLA's stream, as the dense backward's."""
    from .api import backward_varlen

    with _on_xla_device(call, call.args[0].ptr) as (dev, stream):
        arrays = _device_arrays(call, dev)
        n_args = len(call.args)
        dout, q, k, v, out, lse = arrays[:6]
        offsets, rest = _varlen_kwargs(call, arrays[6:n_args])
        n_extra = _n_extras(call)
        kwargs = _variant_kwargs(call, rest[:n_extra])
        rest = rest[n_extra:]
        dlse = rest.pop(0) if call.attrs.get("has_dlse") else None
        prog = _prog_kwargs(call, rest, True) if programmable else {}
        rets = arrays[n_args:]
        _log(target, call, stream)
        grads = backward_varlen(dout, q, k, v, out, lse, causal=bool(call.attrs["causal"]),
                                softmax_scale=float(call.attrs["softmax_scale"]),
                                deterministic=bool(call.attrs["deterministic"]), dlse=dlse, dq=rets[0], dk=rets[1],
                                dv=rets[2], check_offsets=False, **offsets, **kwargs, **prog)
        _store_prog_grads(rets[3:], grads[3:], prog)


def cuda_forward_varlen(call: Call) -> None:
    """(q, k, v, cu_seqlens_q, cu_seqlens_k[, seqused_q][, seqused_k][, alibi_slopes][, sinks]) -> (out, lse)
    with cuflash's varlen forward on XLA's stream; the offsets are not checked (no host synchronisation)."""
    _forward_varlen_call(call, FORWARD_VARLEN, False)


def cuda_backward_varlen(call: Call) -> None:
    """(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k[, seqused_q][, seqused_k][, alibi_slopes][, sinks]
    [, dlse]) -> (dq, dk, dv[, dsinks]) with cuflash's varlen backward on XLA's stream, the offsets unchecked."""
    _backward_varlen_call(call, BACKWARD_VARLEN, False)


def cuda_forward_varlen_prog(call: Call) -> None:
    """(q, k, v, cu_seqlens_q, cu_seqlens_k[, seqused_q][, seqused_k][, alibi_slopes][, sinks][, bias][, block_mask]
    [, rng][, modifier tensors...]) -> (out, lse) with cuflash's programmable varlen forward on XLA's stream, into
    XLA's buffers, the offsets unchecked."""
    _forward_varlen_call(call, FORWARD_VARLEN_PROG, True)


def cuda_backward_varlen_prog(call: Call) -> None:
    """(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k[, seqused_q][, seqused_k][, alibi_slopes][, sinks]
    [, dlse][, bias][, block_mask][, rng][, modifier tensors...]) -> (dq, dk, dv[, dsinks][, dbias][, the tensors'
    gradients]) with cuflash's programmable varlen backward on XLA's stream, the offsets unchecked."""
    _backward_varlen_call(call, BACKWARD_VARLEN_PROG, True)


def _kvcache_kwargs(call: Call, operands: list) -> tuple[dict, object, object]:
    """``cuflash.forward_kvcache``'s arguments from a KV-cache call: the operands after (q, k_cache, v_cache)
    (after (q, k_cache) for MLA's latent cache, the ``latent`` attribute)
    ``cache_seqlens[, k, v][, rotary_cos, rotary_sin][, cache_batch_idx][, block_table][, cache_leftpad]
    [, k_descale, v_descale][, alibi_slopes][, sinks]`` (``k`` alone when latent; the descales with ``fp8``)
    (as the has_* attributes say) and the attributes. Returns (kwargs, k, v)."""
    a = call.attrs
    rest = list(operands)
    kwargs = dict(cache_seqlens=rest.pop(0))
    k = v = None
    if a.get("has_kv"):
        k = rest.pop(0)
        v = None if a.get("latent") else rest.pop(0)
    if a.get("has_rotary"):
        kwargs.update(rotary_cos=rest.pop(0), rotary_sin=rest.pop(0))
    if a.get("has_cache_batch_idx"):
        kwargs["cache_batch_idx"] = rest.pop(0)
    if a.get("has_block_table"):
        kwargs["block_table"] = rest.pop(0)
    if a.get("has_cache_leftpad"):
        kwargs["cache_leftpad"] = rest.pop(0)
    if a.get("fp8"):
        kwargs.update(k_descale=rest.pop(0), v_descale=rest.pop(0))
    kwargs.update(_variant_kwargs(call, rest), causal=bool(a["causal"]), softmax_scale=float(a["softmax_scale"]),
                  rotary_interleaved=bool(a["rotary_interleaved"]))
    return kwargs, k, v


def cuda_kvcache(call: Call) -> None:
    """(q, k_cache, v_cache, cache_seqlens[, k, v][, cos, sin][, cache_batch_idx][, block_table][, slopes][, sinks])
    -> (out, lse[, k_cache, v_cache]) with cuflash's decode kernels on XLA's stream; the cache results are aliased
    to the cache operands (XLA hands the same buffers, or copies of them made before the call), and the append
    writes into them. ``latent`` (MLA): no v_cache and no v, one cache result."""
    from .api import forward_kvcache

    latent = bool(call.attrs.get("latent"))
    with _on_xla_device(call, call.args[0].ptr) as (dev, stream):
        arrays = _device_arrays(call, dev)
        n_args, n_caches = len(call.args), 1 if latent else 2
        q, k_cache = arrays[:2]
        v_cache = None if latent else arrays[2]
        kwargs, k, v = _kvcache_kwargs(call, arrays[1 + n_caches:n_args])
        rets = arrays[n_args:]
        if k is not None:   # the results are the caches to write
            k_cache = rets[2]
            v_cache = None if latent else rets[3]
        _log(KVCACHE, call, stream)
        out, lse = forward_kvcache(q, k_cache, v_cache, k, v, num_splits=int(call.attrs["num_splits"]),
                                   batch_invariant=bool(call.attrs["batch_invariant"]), return_lse=True, **kwargs)
        rets[0][...] = out
        rets[1][...] = lse


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


def _host_varlen(call: Call, operands: list, q, k) -> tuple[dict, list]:
    """``_varlen_kwargs`` on the host, with the offsets' values checked as an eager ``forward_varlen`` checks
    them (ValueError, reported to XLA): the reference reads them here anyway, and it takes no max_seqlen, so
    a sequence longer than its max_seqlen (which the kernels would cut) is refused rather than computed."""
    from .varlen import validate_offsets

    offsets, rest = _varlen_kwargs(call, operands)
    validate_offsets(offsets["cu_seqlens_q"], offsets["cu_seqlens_k"], q.shape[0], k.shape[0],
                     offsets.pop("max_seqlen_q"), offsets.pop("max_seqlen_k"), offsets["seqused_q"],
                     offsets["seqused_k"])
    return offsets, rest


def host_forward_varlen(call: Call) -> None:
    """(q, k, v, cu_seqlens_q, cu_seqlens_k[, seqused_q][, seqused_k][, slopes][, sinks]) -> (out, lse) by
    ``cuflash.attention_reference_varlen`` (float64, rounded to the output dtype)."""
    from .reference import attention_reference_varlen

    arrays = [_host_array(b, b.shape) for b in (*call.args, *call.rets)]
    q, k, v = arrays[:3]
    out, lse = arrays[-2:]
    _log(FORWARD_VARLEN, call, 0)
    offsets, extras = _host_varlen(call, arrays[3:-2], q, k)
    o, l_ = attention_reference_varlen(q, k, v, causal=bool(call.attrs["causal"]),
                                       softmax_scale=float(call.attrs["softmax_scale"]), **offsets,
                                       **_variant_kwargs(call, extras))
    out[...] = o.astype(out.dtype)
    lse[...] = l_.astype(np.float32)


def host_backward_varlen(call: Call) -> None:
    """(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k[, seqused_q][, seqused_k][, slopes][, sinks][, dlse])
    -> (dq, dk, dv[, dsinks]) by ``cuflash.attention_reference_varlen_backward`` (out and lse are not read)."""
    from .reference import attention_reference_varlen_backward

    arrays = [_host_array(b, b.shape) for b in (*call.args, *call.rets)]
    n_args = len(call.args)
    dout, q, k, v = arrays[:4]
    _log(BACKWARD_VARLEN, call, 0)
    offsets, rest = _host_varlen(call, arrays[6:n_args], q, k)
    n_extra = _n_extras(call)
    kwargs = _variant_kwargs(call, rest[:n_extra])
    dlse = rest[n_extra] if call.attrs.get("has_dlse") else None
    grads = attention_reference_varlen_backward(dout, q, k, v, causal=bool(call.attrs["causal"]),
                                                softmax_scale=float(call.attrs["softmax_scale"]), dlse=dlse,
                                                **offsets, **kwargs)
    for buf, g in zip(arrays[n_args:], grads):
        buf[...] = g.astype(buf.dtype)


def host_kvcache(call: Call) -> None:
    """The KV-cache call by ``cuflash.reference.attention_reference_kvcache`` (float64; the rotated keys rounded to
    the cache's dtype, as the cache stores them), the caches' results written whole."""
    from .reference import attention_reference_kvcache

    from .kvcache import MLA_HEAD_DIMS

    latent = bool(call.attrs.get("latent"))
    arrays = [_host_array(b, b.shape) for b in (*call.args, *call.rets)]
    n_args, n_caches = len(call.args), 1 if latent else 2
    q, k_cache = arrays[:2]
    kwargs, k, v = _kvcache_kwargs(call, arrays[1 + n_caches:n_args])
    if call.attrs.get("fp8"):
        _host_kvcache_fp8(call, q, k_cache, arrays[2], k, v, kwargs, arrays[n_args:])
        return
    if latent:   # V: the first 512 columns of the K rows (and of the new keys)
        v_cache, v = k_cache[..., :MLA_HEAD_DIMS[1]], None if k is None else k[..., :MLA_HEAD_DIMS[1]]
    else:
        v_cache = arrays[2]
    rets = arrays[n_args:]
    _log(KVCACHE, call, 0)
    out, lse, k_after, v_after = attention_reference_kvcache(
        q, k_cache, v_cache, k, v, rotary_dtype=q.dtype if kwargs.get("rotary_cos") is not None else None,
        **kwargs)
    rets[0][...] = out.astype(rets[0].dtype)
    rets[1][...] = lse.astype(np.float32)
    if k is not None:
        rets[2][...] = k_after.astype(rets[2].dtype)
        if not latent:
            rets[3][...] = v_after.astype(rets[3].dtype)


def _host_kvcache_fp8(call: Call, q, k_cache, v_cache, k, v, kwargs: dict, rets: list) -> None:
    """host_kvcache over e4m3 caches, sequence by sequence (its descales dequantise the caches it reads): the new
    tokens (rotated) stored as e4m3(x * (1 / descale)), the attention over what the cache then holds."""
    import ml_dtypes

    from .reference import attention_reference_kvcache

    e4m3 = ml_dtypes.float8_e4m3fn
    k_ds, v_ds = kwargs.pop("k_descale"), kwargs.pop("v_descale")
    batch, hkv = q.shape[0], k_cache.shape[2]
    per_seq = {name: kwargs.pop(name, None) for name in ("cache_seqlens", "cache_batch_idx", "block_table",
                                                         "cache_leftpad")}
    slopes = kwargs.get("alibi_slopes")
    rotary = kwargs.get("rotary_cos") is not None
    k_bytes, v_bytes = k_cache.copy(), v_cache.copy()   # the caches after the append, as e4m3 bytes
    for b in range(batch):
        kd, vd = (np.asarray(x, np.float32).reshape(-1)[:1].repeat(hkv) if x.size == 1
                  else np.asarray(x, np.float32).reshape(-1, hkv)[0 if x.ndim == 1 else b] for x in (k_ds, v_ds))
        kept = {}

        def stored(_, k_new, v_new, kd=kd, vd=vd, kept=kept):
            kept["k"] = (k_new.astype(np.float32) * (np.float32(1) / kd)[:, None]).astype(e4m3)
            kept["v"] = (v_new.astype(np.float32) * (np.float32(1) / vd)[:, None]).astype(e4m3)
            return (kept["k"].astype(np.float64) * kd[:, None], kept["v"].astype(np.float64) * vd[:, None])

        seq = {name: (None if x is None else x[b:b + 1]) for name, x in per_seq.items()}
        if seq["cache_batch_idx"] is None and seq["block_table"] is None:   # (alone, it would read cache row 0)
            seq["cache_batch_idx"] = np.array([b], np.int32)
        extra = dict(kwargs)
        if slopes is not None and slopes.ndim == 2:
            extra["alibi_slopes"] = slopes[b:b + 1]
        o, lse, _, _ = attention_reference_kvcache(
            q[b:b + 1], k_cache.view(e4m3).astype(np.float64) * kd[None, None, :, None],
            v_cache.view(e4m3).astype(np.float64) * vd[None, None, :, None], None if k is None else k[b:b + 1],
            None if v is None else v[b:b + 1], rotary_dtype=q.dtype if rotary else None, stored=stored, **seq,
            **extra)
        rets[0][b] = o[0].astype(rets[0].dtype)
        rets[1][b] = lse[0].astype(np.float32)
        if k is None:
            continue
        # The appended slots, as the append kernel writes them: at cache_seqlens[b] + i, inside the capacity.
        n0, table, page = int(per_seq["cache_seqlens"][b]), per_seq["block_table"], k_cache.shape[1]
        capacity = table.shape[1] * page if table is not None else page
        row = int(seq["cache_batch_idx"][0]) if table is None else 0
        for i in range(min(k.shape[1], max(capacity - n0, 0))):
            j = n0 + i
            r, s = (int(table[b, j // page]), j % page) if table is not None else (row, j)
            k_bytes[r, s], v_bytes[r, s] = kept["k"][i].view(np.uint8), kept["v"][i].view(np.uint8)
    if k is not None:
        rets[2][...] = k_bytes
        rets[3][...] = v_bytes


def _host_prog(call: Call, operands: list, full: tuple) -> dict:
    """The reference's programmable fields (Programmable) of a programmable call's operands: dropout's keep mask
    drawn as the kernels draw it (cuflash.philox.dropout_keep_mask) at ``full`` = (batch, heads_q, seqlen_q,
    seqlen_k) (a varlen call's: (batch, heads_q, max_seqlen_q, max_seqlen_k))."""
    from .philox import dropout_keep_mask

    kw = _prog_kwargs(call, operands, False)
    out = dict(bias=kw["bias"], block_mask=kw["block_mask"], block_size=kw["block_size"])
    if kw["dropout_p"] > 0:
        out.update(dropout_p=kw["dropout_p"], dropout_mask=dropout_keep_mask(kw["seed"], kw["offset"], *full,
                                                                             kw["dropout_p"]))
    return out


def _dense_full(q, k) -> tuple:
    """(batch, heads_q, seqlen_q, seqlen_k) of dense q (batch, seqlen_q, heads_q, d) and k."""
    return q.shape[0], q.shape[2], q.shape[1], k.shape[1]


def host_forward_prog(call: Call) -> None:
    """The programmable forward by ``cuflash.attention_reference`` (float64)."""
    from .reference import attention_reference

    arrays = [_host_array(b, b.shape) for b in (*call.args, *call.rets)]
    q, k, v = arrays[:3]
    out, lse = arrays[-2:]
    n_extra = _n_extras(call)
    _log(FORWARD_PROG, call, 0)
    o, l_ = attention_reference(q, k, v, causal=bool(call.attrs["causal"]),
                                softmax_scale=float(call.attrs["softmax_scale"]),
                                **_variant_kwargs(call, arrays[3:3 + n_extra]),
                                **_host_prog(call, arrays[3 + n_extra:-2], _dense_full(q, k)))
    out[...] = o.astype(out.dtype)
    lse[...] = l_.astype(np.float32)


def host_backward_prog(call: Call) -> None:
    """The programmable backward by ``cuflash.attention_reference_backward`` (float64): dq, dk, dv[, dsinks]
    [, dbias]."""
    from .reference import attention_reference_backward

    arrays = [_host_array(b, b.shape) for b in (*call.args, *call.rets)]
    n_args = len(call.args)
    dout, q, k, v = arrays[:4]
    n_extra = _n_extras(call)
    _log(BACKWARD_PROG, call, 0)
    grads = attention_reference_backward(dout, q, k, v, causal=bool(call.attrs["causal"]),
                                         softmax_scale=float(call.attrs["softmax_scale"]),
                                         **_variant_kwargs(call, arrays[6:6 + n_extra]),
                                         **_host_prog(call, arrays[6 + n_extra:n_args], _dense_full(q, k)))
    for buf, g in zip(arrays[n_args:], grads):
        buf[...] = np.asarray(g).astype(buf.dtype)


def _varlen_full(call: Call, q, offsets: dict) -> tuple:
    """(batch, heads_q, max_seqlen_q, max_seqlen_k) of a varlen call (``offsets``: ``_host_varlen``'s): the padded
    shape its programmable arguments have."""
    return (offsets["cu_seqlens_q"].shape[0] - 1, q.shape[1], int(call.attrs["max_seqlen_q"]),
            int(call.attrs["max_seqlen_k"]))


def host_forward_varlen_prog(call: Call) -> None:
    """The programmable varlen forward by ``cuflash.attention_reference_varlen`` (float64; the offsets checked as
    ``host_forward_varlen`` checks them)."""
    from .reference import attention_reference_varlen

    arrays = [_host_array(b, b.shape) for b in (*call.args, *call.rets)]
    q, k, v = arrays[:3]
    out, lse = arrays[-2:]
    _log(FORWARD_VARLEN_PROG, call, 0)
    offsets, rest = _host_varlen(call, arrays[3:-2], q, k)
    n_extra = _n_extras(call)
    o, l_ = attention_reference_varlen(q, k, v, causal=bool(call.attrs["causal"]),
                                       softmax_scale=float(call.attrs["softmax_scale"]), **offsets,
                                       **_variant_kwargs(call, rest[:n_extra]),
                                       **_host_prog(call, rest[n_extra:], _varlen_full(call, q, offsets)))
    out[...] = o.astype(out.dtype)
    lse[...] = l_.astype(np.float32)


def host_backward_varlen_prog(call: Call) -> None:
    """The programmable varlen backward by ``cuflash.attention_reference_varlen_backward`` (float64): dq, dk,
    dv[, dsinks][, dbias] (out and lse are not read)."""
    from .reference import attention_reference_varlen_backward

    arrays = [_host_array(b, b.shape) for b in (*call.args, *call.rets)]
    n_args = len(call.args)
    dout, q, k, v = arrays[:4]
    _log(BACKWARD_VARLEN_PROG, call, 0)
    offsets, rest = _host_varlen(call, arrays[6:n_args], q, k)
    n_extra = _n_extras(call)
    kwargs = _variant_kwargs(call, rest[:n_extra])
    rest = rest[n_extra:]
    dlse = rest.pop(0) if call.attrs.get("has_dlse") else None
    grads = attention_reference_varlen_backward(dout, q, k, v, causal=bool(call.attrs["causal"]),
                                                softmax_scale=float(call.attrs["softmax_scale"]), dlse=dlse,
                                                **offsets, **kwargs, **_host_prog(call, rest, _varlen_full(call, q, offsets)))
    for buf, g in zip(arrays[n_args:], grads):
        buf[...] = np.asarray(g).astype(buf.dtype)


# (target name, platform as jax.ffi.register_ffi_target names it) -> body
BODIES: dict[tuple[str, str], Callable[[Call], None]] = {
    (FORWARD, "CUDA"): cuda_forward,
    (BACKWARD, "CUDA"): cuda_backward,
    (FORWARD_VARLEN, "CUDA"): cuda_forward_varlen,
    (BACKWARD_VARLEN, "CUDA"): cuda_backward_varlen,
    (KVCACHE, "CUDA"): cuda_kvcache,
    (FORWARD, "cpu"): host_forward,
    (BACKWARD, "cpu"): host_backward,
    (FORWARD_VARLEN, "cpu"): host_forward_varlen,
    (BACKWARD_VARLEN, "cpu"): host_backward_varlen,
    (KVCACHE, "cpu"): host_kvcache,
    (FORWARD_PROG, "CUDA"): cuda_forward_prog,
    (BACKWARD_PROG, "CUDA"): cuda_backward_prog,
    (FORWARD_PROG, "cpu"): host_forward_prog,
    (BACKWARD_PROG, "cpu"): host_backward_prog,
    (FORWARD_VARLEN_PROG, "CUDA"): cuda_forward_varlen_prog,
    (BACKWARD_VARLEN_PROG, "CUDA"): cuda_backward_varlen_prog,
    (FORWARD_VARLEN_PROG, "cpu"): host_forward_varlen_prog,
    (BACKWARD_VARLEN_PROG, "cpu"): host_backward_varlen_prog,
}


def handlers(version: tuple) -> dict:
    """A ctypes handler per (target, platform) speaking FFI API ``version``; the caller keeps them alive."""
    return {key: xla_ffi.make_handler(body, version) for key, body in BODIES.items()}

