"""cuflash from JAX: ``dot_product_attention`` as an XLA custom call, differentiable, usable under ``jax.jit``.

    import cuflash.jax
    out = jax.jit(cuflash.jax.dot_product_attention, static_argnames="causal")(q, k, v, causal=True)

The forward and the backward are XLA FFI custom calls (``jax.ffi.ffi_call``) whose handlers are Python
functions behind ctypes trampolines (``cuflash/xla_ffi.py``): no compiled extension, no build step. XLA
passes its own device buffers and its stream; the kernels read and write those buffers on that stream,
so nothing is copied and nothing synchronises. Eagerly, JAX runs the same custom call op by op.

Packed batches of sequences of their own lengths (flash-attn's varlen layout) go through
``dot_product_attention_varlen``, over two more custom calls:

    f = jax.jit(cuflash.jax.dot_product_attention_varlen, static_argnames=("max_seqlen_q", "max_seqlen_k"))
    out = f(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=512, max_seqlen_k=512)

Decoding over a KV cache goes through ``flash_attn_with_kvcache`` (one more custom call; the caches it appends
to come back as results aliased to the cache operands).

Importing ``cuflash`` does not import this module (nor JAX); ``import cuflash.jax`` does.
"""
from __future__ import annotations

import functools
import threading
from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from . import _checks, head_dims, jax_targets, variants, varlen, xla_ffi
from .varlen import INDEX_DTYPE

_DTYPES = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32))


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
                          softmax_scale: Optional[float] = None, window_size: Tuple[int, int] = (-1, -1),
                          attention_chunk: int = 0, softcap: float = 0.0, alibi_slopes: Optional[jax.Array] = None,
                          sinks: Optional[jax.Array] = None, deterministic: bool = False,
                          bias: Optional[jax.Array] = None, dropout_p: float = 0.0,
                          dropout_seed: Union[int, jax.Array, None] = None, block_mask: Optional[jax.Array] = None,
                          block_size: Union[int, Tuple[int, int]] = 128, score_mod=None, mask_mod=None) -> jax.Array:
    """Exact attention ``softmax(q k^T * softmax_scale) v`` by cuflash's kernels, with a custom VJP.

    Args:
        q: ``(batch, seqlen_q, heads_q, head_dim)``, float16, bfloat16 or float32 (the layout of
            ``jax.nn.dot_product_attention``); head_dim a multiple of 8 up to 576 (v's up to 512;
            cuflash/head_dims.py).
        k, v: ``(batch, seqlen_k, heads_kv, head_dim)``, q's dtype; heads_q % heads_kv == 0 (GQA / MQA).
        causal: query i sees keys j <= i + seqlen_k - seqlen_q (bottom-right aligned; the same as
            ``jax.nn.dot_product_attention(is_causal=True)`` when seqlen_q == seqlen_k).
        softmax_scale: defaults to ``1 / sqrt(head_dim)``.
        window_size, attention_chunk, softcap: as ``cuflash.forward`` (static: Python values).
        alibi_slopes: float32 ``(heads_q,)`` or ``(batch, heads_q)`` (not differentiated).
        sinks: ``(heads_q,)``, float32 or q's dtype: a learned logit per head (differentiated).
        deterministic: bitwise reproducible gradients (see ``cuflash.backward``).
        bias: an additive bias broadcastable to ``(batch, heads_q, seqlen_q, seqlen_k)`` (at most 4 dims, each 1
            or that size), float32 or q's dtype, added to the scaled score (differentiated: its gradient in its
            own shape). Programmable attention (issue #45; ``cuflash.forward``): 16-bit q.
        dropout_p: dropout of the probabilities, with ``dropout_seed``: a Python int, or a uint32 array ``(4,)``
            of the (seed, offset) pair as little-endian 32-bit words (:func:`dropout_seed`: from a JAX key), an
            operand, so that a jitted step draws a new mask per call without retracing.
        block_mask: bool ``(batch or 1, heads_q or 1, ceil(seqlen_q / bq), ceil(seqlen_k / bk))`` at
            ``block_size`` bq or (bq, bk): keys in off blocks are hidden and their tiles skipped.
        score_mod, mask_mod: ``cuflash.ScoreMod`` / ``cuflash.MaskMod`` whose tensors are JAX arrays (operands of
            the calls; a score modifier's ``tensor_grads`` are their gradients, cast to their dtypes). GPU only:
            XLA:CPU has no CUDA compiler for them.

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
    left, right, chunk, cap = _check_variant_options(causal, window_size, attention_chunk, softcap)
    alibi_slopes, sinks = _check_alibi_and_sinks(alibi_slopes, sinks, b, hq, q.dtype)
    register_targets()
    opts = _Opts(causal, scale, deterministic, left, right, chunk, cap)
    if bias is None and not dropout_p and block_mask is None and score_mod is None and mask_mod is None:
        return _attention(q, k, v, alibi_slopes, sinks, opts)
    full = (b, hq, q.shape[1], k.shape[1])
    bias, rng, block_mask, tensors, popts = _check_programmable(q.dtype, full, bias, dropout_p, dropout_seed,
                                                                block_mask, block_size, score_mod, mask_mod, opts)
    return _attention_prog(q, k, v, alibi_slopes, sinks, bias, block_mask, rng, tensors, popts)


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
    d = _checks.check_qkv_shapes(q, k, v, allow_dv=True)[-1]
    _check_head_dims(d, v.shape[-1])
    return d


def _check_head_dims(d: int, dv: int) -> None:
    """q's head dim and v's (which may differ: the output has v's) are both kernels' head dims
    (head_dims.check)."""
    head_dims.check(d, dv)


def _out_shape(q, v) -> tuple:
    """The output's shape: q's, with v's head dim."""
    return tuple(q.shape[:-1]) + (v.shape[-1],)


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
        return jnp.zeros(_out_shape(q, v), q.dtype), lse
    extra, flags = _extras(alibi_slopes, sinks)
    method = "broadcast_all" if not extra else "sequential"
    call = jax.ffi.ffi_call(jax_targets.FORWARD,
                            (jax.ShapeDtypeStruct(_out_shape(q, v), q.dtype), jax.ShapeDtypeStruct(lse_shape, jnp.float32)),
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


# ---------------------------------------------------------------------------
# Programmable attention: bias (with its gradient), dropout, block masks


class _ProgOpts(tuple):
    """The static options of a programmable call: the dense ones (``_Opts``, or a varlen call's ``_VarlenOpts``),
    dropout_p, the block size, the modifiers' key ("" for none: their templates in _MODIFIERS) and which optional
    operands there are."""

    def __new__(cls, opts, dropout_p: float, block_q: int, block_k: int, mods: str = ""):
        return super().__new__(cls, (opts, dropout_p, block_q, block_k, mods))

    def attrs(self, bias, block_mask, rng) -> dict:
        opts, p, bq, bk, mods = self
        return dict(**opts.attrs(), dropout_p=np.float32(p), block_q=np.int32(bq), block_k=np.int32(bk),
                    has_bias=bias is not None, has_block_mask=block_mask is not None, has_rng=rng is not None,
                    mods=mods)


# The modifiers of the calls traced so far by key (their templates: the handlers bind them to XLA's buffers).
_MODIFIERS: dict = {}


def modifiers_of(key: str) -> tuple:
    """(score_mod, mask_mod) of a traced call's modifiers ``key`` (jax_targets binds them to the operands)."""
    return _MODIFIERS[key]


def dropout_seed(key: jax.Array) -> jax.Array:
    """A ``dropout_seed`` operand (uint32 ``(4,)``: a 64-bit seed and offset) drawn from a JAX PRNG key."""
    return jax.random.bits(key, (4,), jnp.uint32)


def _check_programmable(q_dtype, full: tuple, bias, dropout_p, seed, block_mask, block_size, score_mod, mask_mod,
                        opts, names: str = "(batch, heads_q, seqlen_q, seqlen_k)") -> tuple:
    """(bias, rng words or None, block_mask, the modifiers' tensors in slot order, _ProgOpts), checked as
    ``cuflash.forward`` checks them, at the attention's shape ``full`` = (batch, heads_q, seqlen_q, seqlen_k) (a
    varlen call's: (batch, heads_q, max_seqlen_q, max_seqlen_k), which ``names`` names in the messages); ``opts``:
    the call's static options (``_Opts`` or ``_VarlenOpts``), kept in the returned _ProgOpts."""
    from . import block_sparse, philox
    from .modifiers import Modifiers, bind

    if np.dtype(q_dtype) not in (np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)):
        raise ValueError(f"bias, dropout and block masks take float16, bfloat16 or float32 q, got {q_dtype}")
    b, hq, nq, nk = full
    if bias is not None:
        bias = jnp.asarray(bias)
        if np.dtype(bias.dtype) not in (np.dtype(jnp.float32), np.dtype(q_dtype)):
            raise TypeError(f"bias must be float32 or q's dtype {q_dtype}, got {bias.dtype}")
        shape4 = (1,) * (4 - bias.ndim) + tuple(bias.shape)
        if bias.ndim > 4 or any(n not in (1, f) for n, f in zip(shape4, full)):
            raise ValueError(f"bias must broadcast to {names} = {full} (at most 4 dims, each 1 or that size), got "
                             f"shape {tuple(bias.shape)}")
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, (int, float, np.integer, np.floating)):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {type(dropout_p).__name__} {dropout_p!r}")
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    rng = None
    if p > 0:
        if seed is None:
            raise ValueError("dropout_p > 0 needs a dropout_seed (an int, or a uint32 array (4,): "
                             "cuflash.jax.dropout_seed(key)): the backward regenerates the mask from it")
        if isinstance(seed, (int, np.integer)) and not isinstance(seed, (bool, np.bool_)):
            s = philox._check_u64("dropout_seed", seed)
            rng = jnp.asarray(np.array([s & 0xFFFFFFFF, s >> 32, 0, 0], dtype=np.uint32))
        else:
            rng = jnp.asarray(seed)
            if rng.shape != (4,) or np.dtype(rng.dtype) != np.dtype(np.uint32):
                raise ValueError(f"dropout_seed must be an int or a uint32 array (4,), got {rng.dtype} "
                                 f"{tuple(rng.shape)}")
    bq, bk = block_sparse.check_block_size(block_size)
    if block_mask is not None:
        block_mask = jnp.asarray(block_mask)
        block_sparse.check_block_mask(block_mask, b, hq, nq, nk, (bq, bk))
    tensors, key = (), ""
    if score_mod is not None or mask_mod is not None:
        mods = Modifiers(score_mod, mask_mod)
        for name, t in mods.slots.items():
            if not isinstance(t, jax.Array):
                raise TypeError(f"modifier tensor {name!r} must be a JAX array here, got {type(t).__name__}")
        mods.check_compiles()
        key = mods.key
        # Templates over shapes and dtypes alone (a traced call's tensors are tracers, not to be kept).
        _MODIFIERS[key] = bind(score_mod, mask_mod, {n: jax.ShapeDtypeStruct(t.shape, t.dtype)
                                                     for n, t in mods.slots.items()})
        tensors = tuple(mods.slots.values())
    return bias, rng, block_mask, tensors, _ProgOpts(opts, p, bq, bk, key)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def _attention_prog(q, k, v, alibi_slopes, sinks, bias, block_mask, rng, tensors, popts: _ProgOpts):
    return _forward_prog(q, k, v, alibi_slopes, sinks, bias, block_mask, rng, tensors, popts)[0]


def _attention_prog_fwd(q, k, v, alibi_slopes, sinks, bias, block_mask, rng, tensors, popts: _ProgOpts):
    out, lse = _forward_prog(q, k, v, alibi_slopes, sinks, bias, block_mask, rng, tensors, popts)
    return out, (q, k, v, alibi_slopes, sinks, bias, block_mask, rng, tensors, out, lse)


def _tensor_grads(popts: _ProgOpts, tensors: tuple) -> list:
    """The slots (index, tensor) whose gradient the score modifier's tensor_grads give, in slot order."""
    if not popts[4]:
        return []
    from .modifiers import Modifiers

    score_mod, mask_mod = _MODIFIERS[popts[4]]
    names = list(Modifiers(score_mod, mask_mod).slots)
    wanted = set(score_mod.tensor_grads) if score_mod is not None else set()
    return [(i, t) for i, (name, t) in enumerate(zip(names, tensors)) if name in wanted]


def _prog_operands(bias, block_mask, rng, tensors) -> tuple:
    """A programmable call's operands after the variants': ``[bias][, block_mask][, rng][, modifier tensors...]``
    (which are there: ``_ProgOpts.attrs``)."""
    return tuple(x for x in (bias, block_mask, rng) if x is not None) + tuple(tensors)


def _prog_results(q, k, v, sinks, bias, with_grads) -> tuple:
    """The programmable backward's results: dq, dk, dv[, dsinks float32][, dbias][, the tensors' float32
    gradients]."""
    results = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    if sinks is not None:
        results.append(jax.ShapeDtypeStruct(sinks.shape, jnp.float32))
    if bias is not None:
        results.append(jax.ShapeDtypeStruct(bias.shape, bias.dtype))
    results += [jax.ShapeDtypeStruct(t.shape, jnp.float32) for _, t in with_grads]
    return tuple(results)


def _prog_cotangents(grads, sinks, bias, tensors, with_grads) -> tuple:
    """(dq, dk, dv, dsinks, dbias, dtensors) from the programmable backward's results (``_prog_results``): dsinks
    in the sinks' dtype, dtensors a tuple per modifier tensor (None for those without tensor_grads and for integer
    ones)."""
    grads = list(grads)
    dsinks = grads.pop(3).astype(sinks.dtype) if sinks is not None else None
    dbias = grads.pop(3) if bias is not None else None
    dtensors = [None] * len(tensors)   # tensors without tensor_grads (and integer ones): no gradient
    for (i, t), g in zip(with_grads, grads[3:]):
        dtensors[i] = g.astype(t.dtype) if jnp.issubdtype(t.dtype, jnp.floating) else None
    return grads[0], grads[1], grads[2], dsinks, dbias, tuple(dtensors)


def _attention_prog_bwd(popts: _ProgOpts, residuals, dout):
    q, k, v, alibi_slopes, sinks, bias, block_mask, rng, tensors, out, lse = residuals
    extra, flags = _extras(alibi_slopes, sinks)
    with_grads = _tensor_grads(popts, tensors)
    call = jax.ffi.ffi_call(jax_targets.BACKWARD_PROG, _prog_results(q, k, v, sinks, bias, with_grads),
                            vmap_method="sequential")
    grads = call(dout.astype(q.dtype), q, k, v, out, lse, *extra, *_prog_operands(bias, block_mask, rng, tensors),
                 **popts.attrs(bias, block_mask, rng), **flags, deterministic=popts[0][2])
    dq, dk, dv, dsinks, dbias, dtensors = _prog_cotangents(grads, sinks, bias, tensors, with_grads)
    dslopes = None if alibi_slopes is None else jnp.zeros_like(alibi_slopes)   # slopes are not learned
    return dq, dk, dv, dslopes, dsinks, dbias, None, None, dtensors


_attention_prog.defvjp(_attention_prog_fwd, _attention_prog_bwd)


def _forward_prog(q, k, v, alibi_slopes, sinks, bias, block_mask, rng, tensors, popts: _ProgOpts):
    """(out, lse) of a programmable call."""
    b, nq, hq, _ = q.shape
    extra, flags = _extras(alibi_slopes, sinks)
    call = jax.ffi.ffi_call(jax_targets.FORWARD_PROG, (jax.ShapeDtypeStruct(_out_shape(q, v), q.dtype),
                                                       jax.ShapeDtypeStruct((b, hq, nq), jnp.float32)),
                            vmap_method="sequential")
    return call(q, k, v, *extra, *_prog_operands(bias, block_mask, rng, tensors), **popts.attrs(bias, block_mask, rng),
                **flags)


# ---------------------------------------------------------------------------
# Packed variable-length batches


def dot_product_attention_varlen(q: jax.Array, k: jax.Array, v: jax.Array, cu_seqlens_q: jax.Array,
                                 cu_seqlens_k: jax.Array, max_seqlen_q: int, max_seqlen_k: int, *,
                                 seqused_q: Optional[jax.Array] = None, seqused_k: Optional[jax.Array] = None,
                                 causal: bool = False, softmax_scale: Optional[float] = None,
                                 window_size: Tuple[int, int] = (-1, -1), attention_chunk: int = 0,
                                 softcap: float = 0.0, alibi_slopes: Optional[jax.Array] = None,
                                 sinks: Optional[jax.Array] = None, return_lse: bool = False,
                                 deterministic: bool = False, bias: Optional[jax.Array] = None,
                                 dropout_p: float = 0.0, dropout_seed: Union[int, jax.Array, None] = None,
                                 block_mask: Optional[jax.Array] = None,
                                 block_size: Union[int, Tuple[int, int]] = 128, score_mod=None,
                                 mask_mod=None) -> Union[jax.Array, Tuple[jax.Array, jax.Array]]:
    """Exact attention over a packed batch of sequences of their own lengths (``cuflash.forward_varlen``,
    flash-attn's ``flash_attn_varlen_func`` layout) by cuflash's kernels, with a custom VJP.

    Sequence ``b`` is queries ``q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]`` against keys and values
    ``k[cu_seqlens_k[b]:cu_seqlens_k[b + 1]]``, ``v[...]``, computed as ``dot_product_attention`` would on
    that sequence alone; no work is spent on padding.

    Args:
        q: ``(total_q, heads_q, head_dim)``, float16, bfloat16 or float32; head_dim a multiple of 8 up to 576
            (v's up to 512; cuflash/head_dims.py).
        k, v: ``(total_k, heads_kv, head_dim)``, q's dtype; heads_q % heads_kv == 0 (GQA / MQA).
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch + 1,)``, the offsets of the sequences' first rows: 0
            first, non-decreasing, the totals last (not differentiated).
        max_seqlen_q, max_seqlen_k: Python ints (static under ``jax.jit``: close over them or name them in
            ``static_argnames``), at least every sequence's length: the kernels' grid covers max_seqlen_q
            rows of every sequence.
        seqused_q, seqused_k: optional int32 ``(batch,)``: sequence b uses only its first seqused[b] rows
            (queries) or keys; the other rows get out 0, lse -inf and zero gradients.
        causal: per sequence, query i sees keys j <= i + len_k - len_q (bottom-right aligned).
        softmax_scale: defaults to ``1 / sqrt(head_dim)``.
        window_size, attention_chunk, softcap: as ``cuflash.forward``, per sequence (static: Python values).
        alibi_slopes: float32 ``(heads_q,)`` or ``(batch, heads_q)`` (row b for sequence b; not differentiated).
        sinks: ``(heads_q,)``, float32 or q's dtype: a learned logit per head (differentiated).
        return_lse: also return the log-sum-exp (differentiated too).
        deterministic: bitwise reproducible gradients (see ``cuflash.backward_varlen``; the programmable
            backward computes dq, dk, dv deterministically either way, dbias and the modifiers' tensor gradients
            by float32 atomics).
        bias, dropout_p, dropout_seed, block_mask, block_size, score_mod, mask_mod: programmable attention as in
            ``dot_product_attention`` (16-bit q; ``cuflash.forward_varlen``'s portable kernels on every GPU), per
            sequence as if the batch were padded to ``(batch, max_seqlen_q, max_seqlen_k)``:

            - ``bias``: broadcastable to ``(batch, heads_q, max_seqlen_q, max_seqlen_k)`` (at most 4 dims, each 1
              or that size), float32 or q's dtype; sequence b adds ``bias[b, :, :len_q, :len_k]`` to its scaled
              scores. Differentiated: its gradient in its own shape and dtype (summed over its broadcast dims, 0
              past the sequences' lengths).
            - ``dropout_p`` with ``dropout_seed`` (a Python int, or a uint32 array ``(4,)`` of the (seed, offset)
              words, :func:`dropout_seed`): sequence b draws the mask of batch index b,
              ``cuflash.dropout_keep_mask(seed, offset, batch, heads_q, max_seqlen_q, max_seqlen_k, p)[b, :,
              :len_q, :len_k]``.
            - ``block_mask``: bool ``(batch or 1, heads_q or 1, ceil(max_seqlen_q / bq), ceil(max_seqlen_k /
              bk))`` at ``block_size`` bq or (bq, bk), read at each sequence's own positions.
            - ``score_mod``, ``mask_mod``: ``cuflash.ScoreMod`` / ``cuflash.MaskMod`` whose tensors are JAX arrays
              (operands of the calls; a score modifier's ``tensor_grads`` are their gradients, cast to their
              dtypes); they get the sequence's index ``b`` and positions ``q_idx`` / ``kv_idx`` within it. GPU
              only: XLA:CPU has no CUDA compiler for them.

            Without any of them (the default) the plain varlen calls run, as before. Their backward takes v's head
            dim equal to q's, head dims up to 256 and a score_mod with its ``grad`` (ValueError while tracing the
            gradient otherwise).

    Returns:
        ``out`` shaped and typed like ``q`` (rows that see no key are 0), or with ``return_lse``
        ``(out, lse)``, lse float32 ``(heads_q, total_q)`` (flash-attn's packed layout; -inf for rows that
        see no key). Under ``jax.grad`` the gradients of q, k, v, sinks, bias and the score modifier's tensors
        with ``tensor_grads`` (the offsets, seqused, alibi_slopes, block_mask and dropout_seed get none).

    The offsets' values are not checked on a GPU: their check (``cuflash.varlen``) copies them to the host
    and waits, which a jitted program must not do (and under jit they are values the host does not have).
    A bad offset or seqused gives wrong results for the sequences it touches, and rows outside every
    sequence are left unwritten, but no kernel reads or writes outside the arrays (the kernels clamp the
    offsets). On JAX's CPU backend the float64 reference runs instead and checks them (an XLA error naming
    the offset). ``jax.vmap`` maps the custom calls sequentially (one call per mapped element: packed
    batches of their own offsets cannot be merged). Argument errors that shapes and dtypes show raise
    ``TypeError`` / ``ValueError`` while tracing, with the messages of ``cuflash.forward_varlen``.
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    cu_seqlens_q, cu_seqlens_k = jnp.asarray(cu_seqlens_q), jnp.asarray(cu_seqlens_k)
    seqused_q = None if seqused_q is None else jnp.asarray(seqused_q)
    seqused_k = None if seqused_k is None else jnp.asarray(seqused_k)
    d = _check_varlen_inputs(q, k, v)
    total_q, hq, _ = q.shape
    batch = _check_offsets_shapes(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    max_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k)
    varlen.check_totals(batch, total_q, k.shape[0], max_q, max_k)
    _checks.check_limits(batch, max_q, max_k, hq, k.shape[1])
    scale = _checks.check_scale(softmax_scale, d)
    causal = _checks.check_flag("causal", causal)
    deterministic = _checks.check_flag("deterministic", deterministic)
    return_lse = _checks.check_flag("return_lse", return_lse)
    left, right, chunk, cap = _check_variant_options(causal, window_size, attention_chunk, softcap)
    alibi_slopes, sinks = _check_alibi_and_sinks(alibi_slopes, sinks, batch, hq, q.dtype)
    register_targets()
    opts = _VarlenOpts(_Opts(causal, scale, deterministic, left, right, chunk, cap), max_q, max_k, return_lse)
    if bias is None and not dropout_p and block_mask is None and score_mod is None and mask_mod is None:
        return _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, sinks, opts)
    bias, rng, block_mask, tensors, popts = _check_programmable(
        q.dtype, (batch, hq, max_q, max_k), bias, dropout_p, dropout_seed, block_mask, block_size, score_mod,
        mask_mod, opts, names="(batch, heads_q, max_seqlen_q, max_seqlen_k)")
    return _attention_varlen_prog(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, sinks,
                                  bias, block_mask, rng, tensors, popts)


class _VarlenOpts(tuple):
    """The static options of one varlen call: the dense ``_Opts``, the max_seqlens and return_lse (hashable:
    custom_vjp's nondiff argument)."""

    def __new__(cls, opts: _Opts, max_seqlen_q: int, max_seqlen_k: int, return_lse: bool):
        return super().__new__(cls, (opts, max_seqlen_q, max_seqlen_k, return_lse))

    @property
    def deterministic(self) -> bool:
        return self[0][2]

    @property
    def return_lse(self) -> bool:
        return self[3]

    def attrs(self) -> dict:
        # int64: the attribute must hold any max_seqlen check_limits lets through, which int32 bounds only jointly.
        return dict(self[0].attrs(), max_seqlen_q=np.int64(self[1]), max_seqlen_k=np.int64(self[2]))


def _check_varlen_inputs(q, k, v) -> int:
    """The checks of ``cuflash.forward_varlen`` that read q, k, v's shapes and dtypes; returns head_dim."""
    for name, x, rows, heads in (("q", q, "total_q", "heads_q"), ("k", k, "total_k", "heads_kv"),
                                 ("v", v, "total_k", "heads_kv")):
        if x.ndim != 3:
            raise ValueError(f"{name} must have 3 dimensions ({rows}, {heads}, head_dim): the sequences packed "
                             f"along the first, got shape {x.shape}")
        if np.dtype(x.dtype) not in _DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}), got {x.dtype}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must have the same shape in (total_k, heads_kv), got k {k.shape} and v {v.shape}")
    d = q.shape[2]
    if k.shape[2] != d:
        raise ValueError(f"k must have the head_dim of q ({d}), got {k.shape[2]}")
    _checks.check_heads(q.shape[1], k.shape[1])
    _check_head_dims(d, v.shape[2])
    return d


def _check_offsets_shapes(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k) -> int:
    """The offsets and seqused arrays are int32 and 1-D of lengths batch + 1 and batch; returns batch.
    Their values are never read here (under jit there are none to read)."""
    for name, x, shape in (("cu_seqlens_q", cu_seqlens_q, "(batch + 1,)"), ("cu_seqlens_k", cu_seqlens_k,
                           "(batch + 1,)"), ("seqused_q", seqused_q, "(batch,)"), ("seqused_k", seqused_k, "(batch,)")):
        if x is None:
            continue
        if np.dtype(x.dtype) != INDEX_DTYPE:
            raise TypeError(f"{name} must be int32, got {x.dtype}; convert with {name}.astype(jnp.int32)")
        if x.ndim != 1:
            raise ValueError(f"{name} must be 1-D {shape}, got shape {x.shape}")
    if cu_seqlens_q.shape[0] < 1:
        raise ValueError("cu_seqlens_q must have length batch + 1 >= 1 (offsets of the sequences and the end of "
                         "the last), got length 0")
    batch = cu_seqlens_q.shape[0] - 1
    if cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(f"cu_seqlens_k must have the length of cu_seqlens_q (batch + 1 = {batch + 1}), "
                         f"got {cu_seqlens_k.shape[0]}")
    for name, x in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if x is not None and x.shape != (batch,):
            raise ValueError(f"{name} must have shape (batch,) = ({batch},), got {x.shape}")
    return batch


def _check_max_seqlen(name: str, value) -> int:
    """A Python int >= 0: it sizes the kernels' grid, so it must be known while tracing (a traced value
    would need a copy to the host)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a Python int >= 0 (static under jax.jit: close over it or pass it in "
                        f"static_argnames), got {type(value).__module__}.{type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


def _check_variant_options(causal: bool, window_size, attention_chunk, softcap) -> tuple:
    """``(window_left, window_right, attention_chunk, softcap)`` checked as ``cuflash.forward`` checks them (static
    Python values), with ``causal`` already a checked flag."""
    left, right = variants.check_window(window_size)
    if causal and right > 0:
        raise ValueError(f"window_size[1] must be -1 or 0 with causal=True, got {right}")
    return left, right, variants.check_chunk(attention_chunk), variants.check_softcap(softcap)


def _check_alibi_and_sinks(alibi_slopes, sinks, batch: int, hq: int, dtype) -> tuple:
    """alibi_slopes float32 ``(heads_q,)`` or ``(batch, heads_q)``, sinks ``(heads_q,)`` float32 or q's dtype,
    as JAX arrays (or None)."""
    if alibi_slopes is not None:
        alibi_slopes = jnp.asarray(alibi_slopes)
        if alibi_slopes.shape not in ((hq,), (batch, hq)) or alibi_slopes.dtype != jnp.float32:
            raise ValueError(f"alibi_slopes must be float32 of shape ({hq},) or ({batch}, {hq}), got "
                             f"{alibi_slopes.dtype} {alibi_slopes.shape}")
    if sinks is not None:
        sinks = jnp.asarray(sinks)
        if sinks.shape != (hq,) or sinks.dtype not in (jnp.float32, dtype):
            raise ValueError(f"sinks must be float32 or {dtype} of shape ({hq},), got {sinks.dtype} {sinks.shape}")
    return alibi_slopes, sinks


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, sinks,
                      opts: _VarlenOpts):
    out, lse = _forward_varlen(q, k, v, (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k), alibi_slopes, sinks,
                               opts)
    return (out, lse) if opts.return_lse else out


def _attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, sinks,
                          opts: _VarlenOpts):
    offsets = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    out, lse = _forward_varlen(q, k, v, offsets, alibi_slopes, sinks, opts)
    primal = (out, lse) if opts.return_lse else out
    return primal, (q, k, v, offsets, alibi_slopes, sinks, out, lse)


def _attention_varlen_bwd(opts: _VarlenOpts, residuals, cotangent):
    q, k, v, offsets, alibi_slopes, sinks, out, lse = residuals
    dout, dlse = cotangent if opts.return_lse else (cotangent, None)
    dq, dk, dv, dsinks = _backward_varlen(dout, dlse, q, k, v, offsets, alibi_slopes, sinks, out, lse, opts)
    dslopes = None if alibi_slopes is None else jnp.zeros_like(alibi_slopes)   # slopes are not learned
    # None: no cotangent for the integer offsets (JAX makes them float0 zeros where one is asked for).
    return dq, dk, dv, None, None, None, None, dslopes, dsinks


_attention_varlen.defvjp(_attention_varlen_fwd, _attention_varlen_bwd)


def _offset_operands(offsets) -> tuple:
    """The offsets operands (cu_seqlens_q, cu_seqlens_k, then the seqused given) and the attributes that
    say which seqused are there."""
    cu_q, cu_k, used_q, used_k = offsets
    operands = (cu_q, cu_k) + tuple(x for x in (used_q, used_k) if x is not None)
    return operands, dict(has_seqused_q=used_q is not None, has_seqused_k=used_k is not None)


def _forward_varlen(q, k, v, offsets: tuple, alibi_slopes, sinks, opts: _VarlenOpts):
    """(out, lse): out like q, lse float32 (heads_q, total_q)."""
    total_q, hq, _ = q.shape
    lse_shape = (hq, total_q)
    if q.size == 0 or k.size == 0:   # no rows, or no sequence has a key: no custom call (and no empty buffers)
        lse = jnp.full(lse_shape, -jnp.inf, jnp.float32)
        if sinks is not None:   # as cuflash.forward_varlen: every row's lse is its head's sink
            lse = jnp.broadcast_to(sinks.astype(jnp.float32)[:, None], lse_shape)
        return jnp.zeros(_out_shape(q, v), q.dtype), lse
    index, index_flags = _offset_operands(offsets)
    extra, flags = _extras(alibi_slopes, sinks)
    # Sequential under vmap: each mapped element has its own offsets, so they cannot merge into one batch.
    call = jax.ffi.ffi_call(jax_targets.FORWARD_VARLEN,
                            (jax.ShapeDtypeStruct(_out_shape(q, v), q.dtype), jax.ShapeDtypeStruct(lse_shape, jnp.float32)),
                            vmap_method="sequential")
    out, lse = call(q, k, v, *index, *extra, **opts.attrs(), **index_flags, **flags)
    return out, lse


def _backward_varlen(dout, dlse, q, k, v, offsets: tuple, alibi_slopes, sinks, out, lse, opts: _VarlenOpts):
    """(dq, dk, dv, dsinks) shaped and typed like q, k, v, sinks (dsinks None without sinks); ``dlse`` the
    cotangent of lse, or None where the forward did not return it."""
    if q.size == 0 or k.size == 0:
        dsinks = None
        if sinks is not None:   # lse is the sinks, broadcast over the rows (the forward's shortcut)
            dsinks = (jnp.zeros_like(sinks) if dlse is None else dlse.sum(axis=1)).astype(sinks.dtype)
        return jnp.zeros(q.shape, q.dtype), jnp.zeros(k.shape, k.dtype), jnp.zeros(v.shape, v.dtype), dsinks
    index, index_flags = _offset_operands(offsets)
    extra, flags = _extras(alibi_slopes, sinks)
    results = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    if sinks is not None:
        results.append(jax.ShapeDtypeStruct(sinks.shape, jnp.float32))
    tail = () if dlse is None else (dlse.astype(jnp.float32),)
    call = jax.ffi.ffi_call(jax_targets.BACKWARD_VARLEN, tuple(results), vmap_method="sequential")
    grads = call(dout.astype(q.dtype), q, k, v, out, lse, *index, *extra, *tail, **opts.attrs(), **index_flags,
                 **flags, has_dlse=dlse is not None, deterministic=opts.deterministic)
    dsinks = None if sinks is None else grads[3].astype(sinks.dtype)
    return grads[0], grads[1], grads[2], dsinks


# ---------------------------------------------------------------------------
# Packed variable-length batches with programmable attention: bias (with its gradient), dropout, block masks and
# modifiers, per sequence at batch index b


@functools.partial(jax.custom_vjp, nondiff_argnums=(13,))
def _attention_varlen_prog(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, sinks, bias,
                           block_mask, rng, tensors, popts: _ProgOpts):
    out, lse = _forward_varlen_prog(q, k, v, (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k), alibi_slopes, sinks,
                                    bias, block_mask, rng, tensors, popts)
    return (out, lse) if popts[0].return_lse else out


def _attention_varlen_prog_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, sinks, bias,
                               block_mask, rng, tensors, popts: _ProgOpts):
    offsets = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    out, lse = _forward_varlen_prog(q, k, v, offsets, alibi_slopes, sinks, bias, block_mask, rng, tensors, popts)
    primal = (out, lse) if popts[0].return_lse else out
    return primal, (q, k, v, offsets, alibi_slopes, sinks, bias, block_mask, rng, tensors, out, lse)


def _check_varlen_prog_backward(q, v, popts: _ProgOpts) -> None:
    """The programmable varlen backward's limits (``cuflash.backward_varlen``'s), raised while the gradient is
    traced rather than by the custom call."""
    d, dv = q.shape[2], v.shape[2]
    if dv != d:
        raise ValueError(f"bias, dropout, block masks and modifiers take v's head dim equal to q's in the backward "
                         f"so far, got {dv} and {d}")
    if d > head_dims.MAX_HEAD_DIM:
        raise ValueError(f"bias, dropout, block masks and modifiers take head dims up to {head_dims.MAX_HEAD_DIM} "
                         f"in the backward so far, got {d}")
    if popts[4]:
        score_mod, _ = _MODIFIERS[popts[4]]
        if score_mod is not None and score_mod.grad is None:
            raise ValueError("the backward of a score_mod needs its grad (CUDA C returning d(new score) / d(score))")


def _attention_varlen_prog_bwd(popts: _ProgOpts, residuals, cotangent):
    q, k, v, offsets, alibi_slopes, sinks, bias, block_mask, rng, tensors, out, lse = residuals
    opts = popts[0]
    dout, dlse = cotangent if opts.return_lse else (cotangent, None)
    _check_varlen_prog_backward(q, v, popts)
    with_grads = _tensor_grads(popts, tensors)
    if q.size == 0 or k.size == 0:   # no score anywhere (the forward made no call): the plain shortcut, zeros
        dq, dk, dv, dsinks = _backward_varlen(dout, dlse, q, k, v, offsets, alibi_slopes, sinks, out, lse, opts)
        dbias = None if bias is None else jnp.zeros_like(bias)
        dtensors = [None] * len(tensors)
        for i, t in with_grads:
            dtensors[i] = jnp.zeros_like(t) if jnp.issubdtype(t.dtype, jnp.floating) else None
        dtensors = tuple(dtensors)
    else:
        index, index_flags = _offset_operands(offsets)
        extra, flags = _extras(alibi_slopes, sinks)
        tail = () if dlse is None else (dlse.astype(jnp.float32),)
        call = jax.ffi.ffi_call(jax_targets.BACKWARD_VARLEN_PROG, _prog_results(q, k, v, sinks, bias, with_grads),
                                vmap_method="sequential")
        grads = call(dout.astype(q.dtype), q, k, v, out, lse, *index, *extra, *tail,
                     *_prog_operands(bias, block_mask, rng, tensors), **popts.attrs(bias, block_mask, rng),
                     **index_flags, **flags, has_dlse=dlse is not None, deterministic=opts.deterministic)
        dq, dk, dv, dsinks, dbias, dtensors = _prog_cotangents(grads, sinks, bias, tensors, with_grads)
    dslopes = None if alibi_slopes is None else jnp.zeros_like(alibi_slopes)   # slopes are not learned
    # None: no cotangent for the integer offsets, the block mask and the seed words.
    return dq, dk, dv, None, None, None, None, dslopes, dsinks, dbias, None, None, dtensors


_attention_varlen_prog.defvjp(_attention_varlen_prog_fwd, _attention_varlen_prog_bwd)


def _forward_varlen_prog(q, k, v, offsets: tuple, alibi_slopes, sinks, bias, block_mask, rng, tensors,
                         popts: _ProgOpts):
    """(out, lse) of a programmable varlen call: out like q, lse float32 (heads_q, total_q)."""
    if q.size == 0 or k.size == 0:   # no rows, or no sequence has a key: the plain shortcut (no custom call)
        return _forward_varlen(q, k, v, offsets, alibi_slopes, sinks, popts[0])
    total_q, hq, _ = q.shape
    index, index_flags = _offset_operands(offsets)
    extra, flags = _extras(alibi_slopes, sinks)
    call = jax.ffi.ffi_call(jax_targets.FORWARD_VARLEN_PROG,
                            (jax.ShapeDtypeStruct(_out_shape(q, v), q.dtype),
                             jax.ShapeDtypeStruct((hq, total_q), jnp.float32)), vmap_method="sequential")
    return call(q, k, v, *index, *extra, *_prog_operands(bias, block_mask, rng, tensors),
                **popts.attrs(bias, block_mask, rng), **index_flags, **flags)


# ---------------------------------------------------------------------------
# Decoding over a KV cache


def flash_attn_with_kvcache(q: jax.Array, k_cache: jax.Array, v_cache: Optional[jax.Array], k: Optional[jax.Array] = None,
                            v: Optional[jax.Array] = None, *, cache_seqlens, rotary_cos: Optional[jax.Array] = None,
                            rotary_sin: Optional[jax.Array] = None, rotary_interleaved: bool = True,
                            cache_batch_idx: Optional[jax.Array] = None, block_table: Optional[jax.Array] = None,
                            cache_leftpad: Optional[jax.Array] = None, causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            alibi_slopes: Optional[jax.Array] = None, sinks: Optional[jax.Array] = None,
                            attention_chunk: int = 0, softmax_scale: Optional[float] = None, num_splits: int = 0,
                            batch_invariant: bool = False, return_lse: bool = False, k_descale=None,
                            v_descale=None) -> tuple:
    """``cuflash.forward_kvcache`` for JAX arrays, under ``jax.jit`` (one XLA custom call, not differentiable).

    JAX arrays are values, so the append is functional: with new ``k`` / ``v`` the call returns the caches after
    it, ``(out, k_cache, v_cache)`` (``(out, lse, k_cache, v_cache)`` with ``return_lse``), as results aliased to
    the cache operands: donate them (``jax.jit(..., donate_argnums=...)``) and XLA writes in place, else it copies
    them first. Without ``k`` / ``v``: ``out`` (``(out, lse)``).

    Arguments as ``cuflash.forward_kvcache``: q ``(batch, seqlen_q, heads_q, head_dim)`` float16 / bfloat16; the
    caches contiguous ``(batch_cache, seqlen_cache, heads_kv, head_dim)`` or paged ``(num_pages, page_size,
    heads_kv, head_dim)`` with ``block_table`` int32 ``(batch, max_blocks)``; ``cache_seqlens`` int32 ``(batch,)``
    (or a Python int); the other options static Python values. On the CPU backend the float64 reference computes
    the same results (slow; for tests).

    ``v_cache=None`` (and ``v=None``): MLA's latent cache (FlashMLA's layout, Hopper): head_dim 576, V the first 512
    columns of each K row; ``out`` is 512 wide, and with new ``k`` the call returns ``(out[, lse], k_cache)``.

    fp8 caches: ``k_cache`` / ``v_cache`` ``jnp.float8_e4m3fn`` or uint8 (e4m3 bytes),
    ``k_descale`` / ``v_descale`` a float or float32 arrays of one element, ``(heads_kv,)`` or ``(batch, heads_kv)``:
    each cached element is its e4m3 value times its KV head's descale; new tokens (q's dtype) are stored as
    ``e4m3(x / descale)``; the caches come back in their dtype."""
    from .kvcache import MAX_HEAD_DIM, MLA_HEAD_DIMS

    latent = v_cache is None
    cache_dtype = jnp.asarray(k_cache).dtype
    fp8 = cache_dtype in (jnp.uint8, jnp.float8_e4m3fn)
    if fp8:
        if latent:
            raise ValueError("an fp8 latent cache (v_cache=None) is not supported yet")
        if jnp.asarray(v_cache).dtype != cache_dtype:
            raise TypeError(f"v_cache must have k_cache's dtype ({cache_dtype}: fp8 e4m3), got "
                            f"{jnp.asarray(v_cache).dtype}")
        # As their bytes through the custom call (XLA's FFI has no e4m3 type everywhere), back to float8 after it.
        k_cache, v_cache = (jax.lax.bitcast_convert_type(jnp.asarray(x), jnp.uint8) for x in (k_cache, v_cache))
    elif k_descale is not None or v_descale is not None:
        raise ValueError("k_descale / v_descale apply to fp8 caches only (k_cache is 16-bit here)")
    if latent:
        if v is not None:
            raise ValueError("with v_cache=None (MLA's latent cache) the new tokens are k alone: v must be None")
        if rotary_cos is not None:
            raise ValueError("rotary embedding with v_cache=None (MLA) is not supported: it would rotate V's columns")
        k_cache = jnp.asarray(k_cache)
        if k_cache.ndim != 4 or k_cache.shape[3] != MLA_HEAD_DIMS[0]:
            raise ValueError(f"with v_cache=None (MLA's latent cache) k_cache must be (rows, seqlen_cache, heads_kv, "
                             f"{MLA_HEAD_DIMS[0]}), got shape {k_cache.shape}")
        v_cache = k_cache[..., :MLA_HEAD_DIMS[1]]   # (shapes only: the operand is k_cache)
        if k is not None:
            v = jnp.asarray(k)[..., :MLA_HEAD_DIMS[1]]
    q, k_cache, v_cache = jnp.asarray(q), jnp.asarray(k_cache), jnp.asarray(v_cache)
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have 4 dimensions, got shape {x.shape}")
        if fp8 and name != "q":
            continue
        if x.dtype not in (jnp.float16, jnp.bfloat16):
            raise TypeError(f"{name} must be float16 or bfloat16 (the decode kernels' types), got {x.dtype}")
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}), got {x.dtype}")
    b, nq, hq, d = q.shape
    rows, cap, hkv, dk = k_cache.shape
    dv = v_cache.shape[3]
    if dk != d or v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"k_cache must be (rows, seqlen_cache, heads_kv, {d}) and v_cache share its first three "
                         f"dims, got {k_cache.shape} and {v_cache.shape}")
    for name, value in (("head_dim", d), ("v_cache's head_dim", dv)):
        if not latent and (value % 8 or not 8 <= value <= MAX_HEAD_DIM):
            raise ValueError(f"{name} must be a multiple of 8 from 8 to {MAX_HEAD_DIM}, got {value} (or "
                             f"{MLA_HEAD_DIMS} with v_cache=None, MLA)")
    _checks.check_heads(hq, hkv)

    def int_array(name, x, shape):
        x = jnp.asarray(x)
        if x.dtype != INDEX_DTYPE or x.shape != shape:
            raise ValueError(f"{name} must be int32 of shape {shape}, got {x.dtype} {x.shape}")
        return x

    if isinstance(cache_seqlens, (int, np.integer)) and not isinstance(cache_seqlens, bool):
        cache_seqlens = jnp.full((b,), int(cache_seqlens), INDEX_DTYPE)
    cache_seqlens = int_array("cache_seqlens", cache_seqlens, (b,))
    if block_table is not None:
        block_table = jnp.asarray(block_table)
        block_table = int_array("block_table", block_table, (b, block_table.shape[-1] if block_table.ndim else -1))
        if cap % 16:
            raise ValueError(f"the page size (k_cache.shape[1] with block_table) must be a multiple of 16, got {cap}")
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be combined with block_table")
    if cache_batch_idx is not None:
        cache_batch_idx = int_array("cache_batch_idx", cache_batch_idx, (b,))
    if cache_leftpad is not None:
        if block_table is not None:
            raise ValueError("cache_leftpad cannot be combined with block_table")
        cache_leftpad = int_array("cache_leftpad", cache_leftpad, (b,))
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new keys and their values), or neither")
    if k is not None:
        k, v = jnp.asarray(k), jnp.asarray(v)
        n_new = k.shape[1] if k.ndim == 4 else -1
        if k.shape != (b, n_new, hkv, d) or v.shape != (b, n_new, hkv, dv) or k.dtype != q.dtype or v.dtype != q.dtype:
            raise ValueError(f"k, v must be {q.dtype} of shapes (batch, seqlen_new, heads_kv, head_dim / head_dim_v) = "
                             f"({b}, n, {hkv}, {d}) / ({b}, n, {hkv}, {dv}), got {k.dtype} {k.shape}, {v.dtype} {v.shape}")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        rotary_cos, rotary_sin = jnp.asarray(rotary_cos, jnp.float32), jnp.asarray(rotary_sin, jnp.float32)
        if rotary_cos.ndim != 2 or rotary_cos.shape != rotary_sin.shape or not 0 < 2 * rotary_cos.shape[1] <= d:
            raise ValueError(f"rotary_cos / rotary_sin must be one (seqlen_ro, rotary_dim // 2) shape with rotary_dim "
                             f"<= head_dim ({d}), got {rotary_cos.shape} and {rotary_sin.shape}")
    scale = _checks.check_scale(softmax_scale, d)
    causal = _checks.check_flag("causal", causal)
    left, right, chunk, cap_ = _check_variant_options(causal, window_size, attention_chunk, softcap)
    alibi_slopes, sinks = _check_alibi_and_sinks(alibi_slopes, sinks, b, hq, q.dtype)
    descales = _check_descales(k_descale, v_descale, b, hkv) if fp8 else ()
    if isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0, got {num_splits!r}")
    has_kv = k is not None
    caches = (k_cache,) if latent else (k_cache, v_cache)   # the cache operands (and, with k, results)
    out_shape, lse_shape = (b, nq, hq, dv), (b, hq, nq)
    if q.size == 0:
        out, lse = jnp.zeros(out_shape, q.dtype), jnp.zeros(lse_shape, jnp.float32)
        results = (out, lse) if return_lse else (out,)
        return (*results, *caches) if has_kv else (results if return_lse else out)
    register_targets()
    operands = [q, *caches, cache_seqlens]
    new_tokens = (k,) if latent else (k, v)
    for group in (new_tokens, (rotary_cos, rotary_sin), (cache_batch_idx,), (block_table,), (cache_leftpad,),
                  descales):
        operands += [x for x in group if x is not None]
    extra, flags = _extras(alibi_slopes, sinks)
    results = [jax.ShapeDtypeStruct(out_shape, q.dtype), jax.ShapeDtypeStruct(lse_shape, jnp.float32)]
    if has_kv:
        results += [jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches]
    call = jax.ffi.ffi_call(jax_targets.KVCACHE, tuple(results), vmap_method="sequential",
                            input_output_aliases={1 + i: 2 + i for i in range(len(caches))} if has_kv else {})
    res = call(*operands, *extra, causal=causal, softmax_scale=scale, window_left=np.int32(left),
               window_right=np.int32(right), attention_chunk=np.int32(chunk), softcap=np.float32(cap_),
               rotary_interleaved=bool(rotary_interleaved), num_splits=np.int32(num_splits),
               batch_invariant=bool(batch_invariant), has_kv=has_kv, has_rotary=rotary_cos is not None,
               has_cache_batch_idx=cache_batch_idx is not None, has_block_table=block_table is not None,
               has_cache_leftpad=cache_leftpad is not None, latent=latent, fp8=fp8, **flags)
    out, lse = res[0], res[1]
    head = (out, lse) if return_lse else (out,)
    if has_kv:
        after = res[2:]
        if fp8 and cache_dtype != jnp.uint8:
            after = tuple(jax.lax.bitcast_convert_type(x, cache_dtype) for x in after)
        return (*head, *after)
    return head if return_lse else out


def _check_descales(k_descale, v_descale, batch: int, hkv: int) -> tuple:
    """An fp8 cache's descales as two float32 arrays of one shape: (1,) (a float, or left out: 1), (heads_kv,) or
    (batch, heads_kv)."""
    arrays = []
    for name, x in (("k_descale", k_descale), ("v_descale", v_descale)):
        if x is None or isinstance(x, (float, int, np.floating, np.integer)) and not isinstance(x, bool):
            value = 1.0 if x is None else float(x)
            if not (value > 0 and np.isfinite(value)):
                raise ValueError(f"{name} must be positive and finite, got {x!r}")
            x = jnp.full((1,), value, jnp.float32)
        x = jnp.asarray(x)
        if x.dtype != jnp.float32:
            raise TypeError(f"{name} must be float32, got {x.dtype}")
        if x.size != 1 and x.shape not in ((hkv,), (batch, hkv)):
            raise ValueError(f"{name} must have one element, or shape ({hkv},) or ({batch}, {hkv}), got {x.shape}")
        arrays.append(x.reshape((1,)) if x.size == 1 else x)
    if arrays[0].shape != arrays[1].shape:
        raise ValueError(f"k_descale and v_descale must have one shape, got {arrays[0].shape} and {arrays[1].shape}")
    return tuple(arrays)


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


__all__ = ["dot_product_attention", "dot_product_attention_varlen", "dropout_seed", "flash_attn_with_kvcache",
           "register_targets", "ffi_api_version"]
