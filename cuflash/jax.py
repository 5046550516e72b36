"""cuflash from JAX: ``dot_product_attention`` as an XLA custom call, differentiable, usable under ``jax.jit``.

    import cuflash.jax
    out = jax.jit(cuflash.jax.dot_product_attention, static_argnames="causal")(q, k, v, causal=True)

The forward and the backward are XLA FFI custom calls (``jax.ffi.ffi_call``) whose handlers are Python
functions behind ctypes trampolines (``cuflash/xla_ffi.py``): no compiled extension, no build step. XLA
passes its own device buffers and its stream; the kernels read and write those buffers on that stream,
so nothing is copied and nothing synchronises. Eagerly, JAX runs the same custom call op by op.

Importing ``cuflash`` does not import this module (nor JAX); ``import cuflash.jax`` does.
"""
from __future__ import annotations

import functools
import threading
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _checks, jax_targets, variants, xla_ffi
from .api import HEAD_DIMS

_DTYPES = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32))


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
                          softmax_scale: Optional[float] = None, window_size: Tuple[int, int] = (-1, -1),
                          attention_chunk: int = 0, softcap: float = 0.0, alibi_slopes: Optional[jax.Array] = None,
                          sinks: Optional[jax.Array] = None, deterministic: bool = False) -> jax.Array:
    """Exact attention ``softmax(q k^T * softmax_scale) v`` by cuflash's kernels, with a custom VJP.

    Args:
        q: ``(batch, seqlen_q, heads_q, head_dim)``, float16, bfloat16 or float32 (the layout of
            ``jax.nn.dot_product_attention``); head_dim a multiple of 8 up to 256.
        k, v: ``(batch, seqlen_k, heads_kv, head_dim)``, q's dtype; heads_q % heads_kv == 0 (GQA / MQA).
        causal: query i sees keys j <= i + seqlen_k - seqlen_q (bottom-right aligned; the same as
            ``jax.nn.dot_product_attention(is_causal=True)`` when seqlen_q == seqlen_k).
        softmax_scale: defaults to ``1 / sqrt(head_dim)``.
        window_size, attention_chunk, softcap: as ``cuflash.forward`` (static: Python values).
        alibi_slopes: float32 ``(heads_q,)`` or ``(batch, heads_q)`` (not differentiated).
        sinks: ``(heads_q,)``, float32 or q's dtype: a learned logit per head (differentiated).
        deterministic: bitwise reproducible gradients (see ``cuflash.backward``).

    Returns:
        ``out`` shaped and typed like ``q``. Rows that see no key are 0.

    On a GPU the kernels run on XLA's stream over XLA's buffers. On the CPU backend the float64 NumPy
    reference computes the same function (slow; for tests and for code written away from a GPU).
    ``jax.vmap`` over q, k, v merges the mapped axis into the batch (not with alibi_slopes or sinks).
    Argument errors raise ``TypeError`` / ``ValueError`` while tracing, with the messages of
    ``cuflash.forward``.
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    d = _check_inputs(q, k, v)
    b, _, hq, _ = q.shape
    scale = _checks.check_scale(softmax_scale, d)
    causal = _checks.check_flag("causal", causal)
    deterministic = _checks.check_flag("deterministic", deterministic)
    left, right = variants.check_window(window_size)
    if causal and right > 0:
        raise ValueError(f"window_size[1] must be -1 or 0 with causal=True, got {right}")
    chunk = variants.check_chunk(attention_chunk)
    cap = variants.check_softcap(softcap)
    if alibi_slopes is not None:
        alibi_slopes = jnp.asarray(alibi_slopes)
        if alibi_slopes.shape not in ((hq,), (b, hq)) or alibi_slopes.dtype != jnp.float32:
            raise ValueError(f"alibi_slopes must be float32 of shape ({hq},) or ({b}, {hq}), got "
                             f"{alibi_slopes.dtype} {alibi_slopes.shape}")
    if sinks is not None:
        sinks = jnp.asarray(sinks)
        if sinks.shape != (hq,) or sinks.dtype not in (jnp.float32, q.dtype):
            raise ValueError(f"sinks must be float32 or {q.dtype} of shape ({hq},), got {sinks.dtype} {sinks.shape}")
    register_targets()
    opts = _Opts(causal, scale, deterministic, left, right, chunk, cap)
    return _attention(q, k, v, alibi_slopes, sinks, opts)


class _Opts(tuple):
    """The static options of one call (hashable: custom_vjp's nondiff argument)."""

    def __new__(cls, causal, scale, deterministic, left, right, chunk, softcap):
        return super().__new__(cls, (causal, scale, deterministic, left, right, chunk, softcap))

    def attrs(self) -> dict:
        causal, scale, _, left, right, chunk, softcap = self
        return dict(causal=causal, softmax_scale=scale, window_left=np.int32(left), window_right=np.int32(right),
                    attention_chunk=np.int32(chunk), softcap=np.float32(softcap))


def _check_inputs(q, k, v) -> int:
    """The checks of ``cuflash.forward`` that read shapes and dtypes; returns head_dim."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, seqlen, heads, head_dim), got shape {x.shape}")
        if np.dtype(x.dtype) not in _DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}), got {x.dtype}")
    d = _checks.check_qkv_shapes(q, k, v)[-1]
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim must be a multiple of 8 from 8 to 256, got {d}")
    return d


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, alibi_slopes, sinks, opts: _Opts):
    return _forward(q, k, v, alibi_slopes, sinks, opts)[0]


def _attention_fwd(q, k, v, alibi_slopes, sinks, opts: _Opts):
    out, lse = _forward(q, k, v, alibi_slopes, sinks, opts)
    return out, (q, k, v, alibi_slopes, sinks, out, lse)   # what the backward reads: no seqlen^2 buffer


def _attention_bwd(opts: _Opts, residuals, dout):
    q, k, v, alibi_slopes, sinks, out, lse = residuals
    dq, dk, dv, dsinks = _backward(dout, q, k, v, alibi_slopes, sinks, out, lse, opts)
    dslopes = None if alibi_slopes is None else jnp.zeros_like(alibi_slopes)   # slopes are not learned
    return dq, dk, dv, dslopes, dsinks


_attention.defvjp(_attention_fwd, _attention_bwd)


def _extras(alibi_slopes, sinks) -> tuple:
    """The optional operands (alibi slopes, sinks as float32) and the attributes that say which are there."""
    operands = tuple(x for x in (alibi_slopes, None if sinks is None else sinks.astype(jnp.float32)) if x is not None)
    return operands, dict(has_alibi=alibi_slopes is not None, has_sinks=sinks is not None,
                          alibi_per_batch=alibi_slopes is not None and alibi_slopes.ndim == 2)


def _forward(q, k, v, alibi_slopes, sinks, opts: _Opts):
    """(out, lse): out like q, lse float32 (batch, heads_q, seqlen_q)."""
    b, nq, hq, _ = q.shape
    lse_shape = (b, hq, nq)
    if q.size == 0 or k.size == 0:   # no rows, or rows that see no key: no custom call (and no empty buffers)
        lse = jnp.full(lse_shape, -jnp.inf, jnp.float32)
        if sinks is not None:
            lse = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None], lse_shape)
        return jnp.zeros(q.shape, q.dtype), lse
    extra, flags = _extras(alibi_slopes, sinks)
    method = "broadcast_all" if not extra else "sequential"
    call = jax.ffi.ffi_call(jax_targets.FORWARD,
                            (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(lse_shape, jnp.float32)),
                            vmap_method=method)
    out, lse = call(q, k, v, *extra, **opts.attrs(), **flags)
    return out, lse


def _backward(dout, q, k, v, alibi_slopes, sinks, out, lse, opts: _Opts):
    """(dq, dk, dv, dsinks) shaped and typed like q, k, v, sinks (dsinks None without sinks)."""
    if q.size == 0 or k.size == 0:
        dsinks = None if sinks is None else jnp.zeros_like(sinks)
        return jnp.zeros(q.shape, q.dtype), jnp.zeros(k.shape, k.dtype), jnp.zeros(v.shape, v.dtype), dsinks
    extra, flags = _extras(alibi_slopes, sinks)
    results = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    if sinks is not None:
        results.append(jax.ShapeDtypeStruct(sinks.shape, jnp.float32))
    method = "broadcast_all" if not extra else "sequential"
    call = jax.ffi.ffi_call(jax_targets.BACKWARD, tuple(results), vmap_method=method)
    grads = call(dout.astype(q.dtype), q, k, v, out, lse, *extra, **opts.attrs(), **flags,
                 deterministic=opts[2])
    dsinks = None if sinks is None else grads[3].astype(sinks.dtype)
    return grads[0], grads[1], grads[2], dsinks


# The ctypes handlers given to XLA: XLA keeps their addresses, so they are kept for the life of the
# process (from before their registration: one that fails partway must not free the ones before it).
_handlers: list = []
_registered = False
_register_lock = threading.Lock()


def ffi_api_version() -> tuple:
    """The XLA FFI API version the handlers report: jaxlib's header's (the version its XLA speaks),
    else the one ``xla_ffi``'s layouts follow."""
    return xla_ffi.header_version(jax.ffi.include_dir()) or (xla_ffi.API_MAJOR, xla_ffi.API_MINOR)


def register_targets() -> None:
    """Registers the forward and backward targets for CUDA and the host, once per process.

    JAX's backends start first: a registration XLA refuses then raises here, naming the target, instead
    of stopping the backend from starting later.
    """
    global _registered
    if _registered:
        return
    with _register_lock:
        if _registered:
            return
        jax.devices()
        made = jax_targets.handlers(ffi_api_version())
        _handlers.extend(made.values())
        for (name, platform), handler in made.items():
            jax.ffi.register_ffi_target(name, xla_ffi.capsule(handler), platform=platform)
        _registered = True


__all__ = ["dot_product_attention", "register_targets", "ffi_api_version"]
