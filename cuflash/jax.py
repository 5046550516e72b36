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
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import _checks, jax_targets, xla_ffi
from .api import HEAD_DIMS

_DTYPES = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32))


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
                          softmax_scale: Optional[float] = None, deterministic: bool = False) -> jax.Array:
    """Exact attention ``softmax(q k^T * softmax_scale) v`` by cuflash's kernels, with a custom VJP.

    Args:
        q: ``(batch, seqlen_q, heads_q, head_dim)``, float16, bfloat16 or float32 (the layout of
            ``jax.nn.dot_product_attention``); head_dim a multiple of 8 up to 256.
        k, v: ``(batch, seqlen_k, heads_kv, head_dim)``, q's dtype; heads_q % heads_kv == 0 (GQA / MQA).
        causal: query i sees keys j <= i + seqlen_k - seqlen_q (bottom-right aligned; the same as
            ``jax.nn.dot_product_attention(is_causal=True)`` when seqlen_q == seqlen_k).
        softmax_scale: defaults to ``1 / sqrt(head_dim)``.
        deterministic: bitwise reproducible gradients (see ``cuflash.backward``).

    Returns:
        ``out`` shaped and typed like ``q``. Rows that see no key are 0.

    On a GPU the kernels run on XLA's stream over XLA's buffers. On the CPU backend the float64 NumPy
    reference computes the same function (slow; for tests and for code written away from a GPU).
    ``jax.vmap`` over any argument merges the mapped axis into the batch. Argument errors raise
    ``TypeError`` / ``ValueError`` while tracing, with the messages of ``cuflash.forward``.
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    d = _check_inputs(q, k, v)
    scale = _checks.check_scale(softmax_scale, d)
    causal = _checks.check_flag("causal", causal)
    deterministic = _checks.check_flag("deterministic", deterministic)
    register_targets()
    return _attention(q, k, v, causal, scale, deterministic)


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _attention(q, k, v, causal: bool, scale: float, deterministic: bool):
    return _forward(q, k, v, causal, scale)[0]


def _attention_fwd(q, k, v, causal: bool, scale: float, deterministic: bool):
    out, lse = _forward(q, k, v, causal, scale)
    return out, (q, k, v, out, lse)   # what the backward reads: no seqlen^2 buffer


def _attention_bwd(causal: bool, scale: float, deterministic: bool, residuals, dout):
    return _backward(dout, *residuals, causal, scale, deterministic)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _forward(q, k, v, causal: bool, scale: float):
    """(out, lse): out like q, lse float32 (batch, heads_q, seqlen_q)."""
    b, nq, hq, _ = q.shape
    lse_shape = (b, hq, nq)
    if q.size == 0 or k.size == 0:   # no rows, or rows that see no key: no custom call (and no empty buffers)
        return jnp.zeros(q.shape, q.dtype), jnp.full(lse_shape, -jnp.inf, jnp.float32)
    call = jax.ffi.ffi_call(jax_targets.FORWARD,
                            (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(lse_shape, jnp.float32)),
                            vmap_method="broadcast_all")
    out, lse = call(q, k, v, causal=causal, softmax_scale=scale)
    return out, lse


def _backward(dout, q, k, v, out, lse, causal: bool, scale: float, deterministic: bool):
    """(dq, dk, dv) shaped and typed like q, k, v."""
    if q.size == 0 or k.size == 0:
        return jnp.zeros(q.shape, q.dtype), jnp.zeros(k.shape, k.dtype), jnp.zeros(v.shape, v.dtype)
    call = jax.ffi.ffi_call(jax_targets.BACKWARD, tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)),
                            vmap_method="broadcast_all")
    dq, dk, dv = call(dout.astype(q.dtype), q, k, v, out, lse, causal=causal, softmax_scale=scale,
                      deterministic=deterministic)
    return dq, dk, dv


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
