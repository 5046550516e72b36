"""Public API: forward (and, with the backward kernels, backward / vjp).

Layout as flash-attn: q (batch, seqlen_q, heads_q, head_dim), k and v
(batch, seqlen_k, heads_kv, head_dim) with heads_q % heads_kv == 0.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Optional, Tuple, Union

import numpy as np

if TYPE_CHECKING:  # CuPy is imported lazily at run time
    from cupy import ndarray

from . import (_checks, call_cache, capture, device_check, fp8, head_dims, heuristics, interop, launch, options, params,
               programmable, sm90, variants, varlen)
from .config import TILED_DQ_MODES
from .dispatch import device_info, fit_to_device, get_kernel, smem_bytes

HEAD_DIMS = range(8, heuristics.MAX_HEAD_DIM + 1, 8)
LOG2E = 1.4426950408889634


def forward(q: ndarray, k: ndarray, v: ndarray, *, causal: bool = False,
            softmax_scale: Optional[float] = None, window_size: Tuple[int, int] = (-1, -1),
            attention_chunk: int = 0, softcap: float = 0.0, alibi_slopes: Optional[ndarray] = None,
            sinks: Optional[ndarray] = None, return_lse: bool = False,
            out: Optional[ndarray] = None, bias: Optional[ndarray] = None, dropout_p: float = 0.0,
            seed: Union[int, ndarray, None] = None, offset: int = 0, block_mask: Optional[ndarray] = None,
            block_size: Union[int, Tuple[int, int]] = 128, score_mod=None, mask_mod=None,
            _mask_offsets: Optional[Tuple[int, int]] = None
            ) -> Union[ndarray, Tuple[ndarray, ndarray]]:
    """Exact attention ``softmax(q k^T * softmax_scale) v``, computed tile by tile.

    Args:
        q: ``(batch, seqlen_q, heads_q, head_dim)`` CuPy array, float16, bfloat16 or float32, or a
            CUDA array of another framework (torch, JAX: read in place through DLPack; results come
            back in that framework, see :mod:`cuflash.interop`).
            head_dim a multiple of 8 up to 576 (above 256: cuflash/head_dims.py).
        k: ``(batch, seqlen_k, heads_kv, head_dim)``, same dtype and device; heads_q % heads_kv == 0.
        v: ``(batch, seqlen_k, heads_kv, head_dim_v)``: like ``k``, with a head dim of its own (a multiple of 8
            up to 512, above 64 where either is above 256; e.g. 128 beside q's 192, as DeepSeek's MLA trains).
            The output then has head_dim_v.
        causal: mask keys after the query, aligned to the bottom-right corner: query i sees
            keys j <= i + seqlen_k - seqlen_q.
        softmax_scale: defaults to ``1 / sqrt(head_dim)``.
        window_size: ``(left, right)``: query i, at key position p = i + seqlen_k - seqlen_q (the
            bottom-right alignment of causal), sees keys p - left <= j <= p + right; -1 unbounded (as
            flash-attn). With ``causal=True`` right must be -1 or 0. Key tiles outside the window are
            never visited: the cost follows the window.
        attention_chunk: 0 (off), or a chunk length c: query i sees only keys of its own chunk,
            j // c == p // c (Llama 4's chunked attention with ``causal=True``).
        softcap: 0 (off), or c > 0: each scaled score s = softmax_scale * q.k becomes c * tanh(s / c).
        alibi_slopes: float32 ``(heads_q,)`` or ``(batch, heads_q)``: adds ``-slope * |p - j|`` to each
            score (after the softcap, before the masks).
        sinks: ``(heads_q,)`` float32 or q's dtype: a learned logit per head (not scaled) that joins every
            row's softmax denominator without a value; the returned lse includes it.
        return_lse: also return the log-sum-exp.
        out: optional output buffer ``(batch, seqlen_q, heads_q, head_dim_v)`` in q's dtype, sharing no memory
            with q, k or v (ValueError otherwise).
        bias, dropout_p, seed, offset, block_mask, block_size, score_mod, mask_mod: programmable attention
            (cuflash/programmable.py; fp16 / bf16, dense; Hopper's kernels or the portable ones). ``bias``: float32 or q's dtype, broadcastable to (batch, heads_q,
            seqlen_q, seqlen_k), added to the scaled score after softcap and ALiBi. ``dropout_p`` in [0, 1) with
            ``seed`` (an int, or a CuPy uint64 (2,) array of (seed, offset) read on the device) and ``offset``:
            Philox dropout of the probabilities (cuflash.philox.dropout_keep_mask gives the mask); lse is that of
            the undropped ones. ``block_mask``: bool (batch or 1, heads_q or 1, ceil(seqlen_q / bq),
            ceil(seqlen_k / bk)) at ``block_size`` bq or (bq, bk): keys in off blocks are hidden and tiles only
            off blocks cover are never visited. ``score_mod`` / ``mask_mod``: cuflash.ScoreMod / cuflash.MaskMod,
            user modifiers in CUDA C.

    Returns:
        ``out`` ``(batch, seqlen_q, heads_q, head_dim_v)``, or ``(out, lse)`` with ``lse`` float32
        ``(batch, heads_q, seqlen_q)``,
        the natural-log log-sum-exp of the scaled scores (and the sink). A query row that sees no key gets
        output 0 and lse -inf (its sink, with sinks). seqlen_q == 0 gives empty results; seqlen_k == 0
        gives zeros and -inf (the sinks).
    """
    # _mask_offsets (internal: ring attention's steps, cuflash/distributed/ring.py): the mask policy's
    # (diag, key_offset) for q and k that are views of a longer sequence. The programmable arguments are tested
    # inline (programmable.given's test): this is the plain call's hot path.
    if (bias is not None or dropout_p or seed is not None or block_mask is not None or score_mod is not None
            or mask_mod is not None):
        return _forward_programmable(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                                     attention_chunk=attention_chunk, softcap=softcap, alibi_slopes=alibi_slopes,
                                     sinks=sinks, return_lse=return_lse, out=out, bias=bias, dropout_p=dropout_p,
                                     seed=seed, offset=offset, block_mask=block_mask, block_size=block_size,
                                     score_mod=score_mod, mask_mod=mask_mod)
    variant_sig = variants.call_signature(window_size, attention_chunk, softcap, alibi_slopes, sinks)
    if _mask_offsets is not None:
        variant_sig = None
    key = None if variant_sig is None else call_cache.fwd_key(q, k, v, out, causal, softmax_scale, return_lse,
                                                              variant_sig)
    lse = None
    if key is not None:
        call = _fwd_calls.get(key)
        if call is not None:   # a call seen before: same arrays, options, stream and backend
            launched, out, lse = call.replay(key, q, out, return_lse)
            if launched:
                return (out, lse) if return_lse else out
            # Allocated at other addresses than the recorded ones: the checked path, on these arrays.
    elif interop.needs_conversion(q, k, v, out, alibi_slopes, sinks):   # torch / JAX: CuPy views, results back
        return interop.call(forward, {"q": q, "k": k, "v": v, "out": out, "alibi_slopes": alibi_slopes,
                                      "sinks": sinks}, buffers=("out",), causal=causal,
                            softmax_scale=softmax_scale, window_size=window_size, attention_chunk=attention_chunk,
                            softcap=softcap, return_lse=return_lse)
    # Every check runs before the device is touched (fwd_key declines when there is no usable device),
    # so a machine without a GPU reports a bad argument as one with a GPU does.
    opts = options.current()
    dims, out_shape, scale, causal, return_lse, var = _check_forward(
        q, k, v, out, causal, softmax_scale, return_lse, window_size, attention_chunk, softcap, alibi_slopes, sinks,
        plain=variant_sig == ())
    b, nq, nk, hq, hkv, d = dims
    dev = q.data.device_id

    def launch_fn(o, l_):
        prepared = _launch_fwd(q, k, v, o, l_, causal=bool(causal), scale=scale, dims=(b, nq, nk, hq, hkv, d),
                               device_id=dev, opts=opts, var=var, mask_offsets=_mask_offsets)
        # Recorded under the options it was planned with (another thread may have changed them since the key).
        if key is not None and prepared is not None and key[call_cache.OPTIONS_TOKEN] == opts.token:
            _fwd_calls.record(key, prepared, o, l_, dev)

    return _run_forward(launch_fn, out, out_shape, q.dtype, (b, hq, nq), nk, return_lse, dev, lse, var.sinks)


def _check_forward(q, k, v, out, causal, softmax_scale, return_lse, window_size, attention_chunk, softcap,
                   alibi_slopes, sinks, plain: bool = False):
    """The forward's checks, before the device is touched: returns ((B, Nq, Nk, Hq, Hkv, D), out's shape, scale,
    causal, return_lse, the checked Variants: variants.NONE where ``plain`` says no variant argument was given)."""
    b, nq, nk, hq, hkv, d = _checks.check_qkv_cached(q, k, v, allow_dv=True)
    out_shape = (b, nq, hq, v.shape[3])
    scale = _checks.check_scale(softmax_scale, d)
    causal = _checks.check_flag("causal", causal)
    return_lse = _checks.check_flag("return_lse", return_lse)
    dev = q.data.device_id
    var = variants.NONE if plain else variants.from_arguments(
        window_size, attention_chunk, softcap, alibi_slopes, sinks, causal=causal, batch=b, heads_q=hq,
        device_id=dev, q_dtype=q.dtype)
    if out is not None:
        _checks.check_out_cached("out", out, out_shape, q.dtype, dev)
        # Here only: a call cache hit has the addresses, shapes and strides of a call that passed.
        _checks.check_no_overlap((("out", out),), (("q", q), ("k", k), ("v", v)))
    return (b, nq, nk, hq, hkv, d), out_shape, scale, causal, return_lse, var


def _forward_programmable(q, k, v, *, causal, softmax_scale, window_size, attention_chunk, softcap, alibi_slopes,
                          sinks, return_lse, out, bias, dropout_p, seed, offset, block_mask, block_size, score_mod,
                          mask_mod):
    """forward with programmable parts: every argument checked (the programmable ones by programmable.py), then
    the programmable kernels."""
    arrays = {"q": q, "k": k, "v": v, "out": out, "alibi_slopes": alibi_slopes, "sinks": sinks, "bias": bias,
              "block_mask": block_mask}
    numbers = {"seed": seed}
    if hasattr(seed, "shape") and hasattr(seed, "dtype"):   # a device seed: an array like the others
        arrays["seed"], numbers = seed, {}
    if interop.needs_conversion(*arrays.values()):
        return interop.call(_forward_programmable, arrays, buffers=("out",), causal=causal,
                            softmax_scale=softmax_scale, window_size=window_size, attention_chunk=attention_chunk,
                            softcap=softcap, return_lse=return_lse, dropout_p=dropout_p, offset=offset,
                            block_size=block_size, score_mod=score_mod, mask_mod=mask_mod, **numbers)
    opts = options.current()
    dims, out_shape, scale, causal, return_lse, var = _check_forward(
        q, k, v, out, causal, softmax_scale, return_lse, window_size, attention_chunk, softcap, alibi_slopes, sinks)
    b, nq, nk, hq, hkv, d = dims
    dev = q.data.device_id
    prog = programmable.check_arguments(q, bias=bias, dropout_p=dropout_p, seed=seed, offset=offset,
                                        block_mask=block_mask, block_size=block_size, score_mod=score_mod,
                                        mask_mod=mask_mod, batch=b, heads_q=hq, seqlen_q=nq, seqlen_k=nk,
                                        device_id=dev)
    if prog.empty:   # e.g. a seed with dropout_p 0
        return forward(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                       attention_chunk=attention_chunk, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                       return_lse=return_lse, out=out)

    def launch_fn(o, l_):
        programmable.launch_forward(q, k, v, o, l_, prog, causal=bool(causal), scale=scale,
                                    dims=(b, nq, nk, hq, hkv, d), device_id=dev, opts=opts, var=var)

    return _run_forward(launch_fn, out, out_shape, q.dtype, (b, hq, nq), nk, return_lse, dev, None, var.sinks)


def _run_forward(launch_fn, out, shape, dtype, lse_shape, seqlen_k: int, return_lse: bool, device_id: int,
                 lse=None, sinks=None):
    """Allocates what the caller did not give, handles the empty cases (no query rows: nothing to do;
    no keys: zeros and lse -inf, no kernel) and calls ``launch_fn(out, lse)`` otherwise."""
    import cupy

    try:
        with cupy.cuda.Device(device_id):
            if out is None:
                out = cupy.empty(shape, dtype=dtype)
            if return_lse and lse is None:
                lse = cupy.empty(lse_shape, dtype=np.float32)
            if out.size:
                if seqlen_k == 0:
                    out.fill(0)
                    if lse is not None:   # no key: the lse is the sink's alone
                        lse[...] = -np.inf if sinks is None else sinks[None, :, None]
                else:
                    launch_fn(out, lse)
    except RuntimeError as e:   # no driver, no GPU, an old driver or GPU: say which, and what to do
        device_check.reraise_explained(e)
        raise
    return (out, lse) if return_lse else out


# The forward's call cache (call_cache.py): a hit replays the recorded launch.
_fwd_calls = call_cache.CallCache()
# (dtype, head_dim, causal, device, options token, short, long) -> (kernel, config, shared memory bytes):
# keeps the heuristics and the module lookup off the hot path.
_fwd_plans = call_cache.Plans(_fwd_calls)


def _fwd_plan(dtype, head_dim: int, causal: bool, device_id: int, short: bool = False, long_seqs: bool = False,
              opts: Optional[options.Options] = None, variant: variants.MaskVariant = variants.PLAIN,
              head_dim_v: int = 0):
    opts = opts or options.current()
    key = (dtype, head_dim, causal, device_id, opts.token, short, long_seqs, variant, head_dim_v)
    plan = _fwd_plans.get(key)
    if plan is None:
        cc, _ = device_info(device_id, opts)
        cfg = heuristics.fwd_config(_checks.dtype_name(dtype), head_dim, causal, cc, short=short, long_seqs=long_seqs,
                                    opts=opts, variant=variant, head_dim_v=head_dim_v)
        cfg = fit_to_device(cfg, device_id, opts)   # portable tiles shrink on GPUs with less shared memory
        plan = _fwd_plans[key] = (get_kernel(cfg, device_id, opts.nvrtc_defines), cfg,
                                  smem_bytes(cfg, device_id, opts.nvrtc_defines))
    return plan


def _launch_fwd(q, k, v, out, lse, *, causal: bool, scale: float, dims, device_id: int,
                opts: Optional[options.Options] = None, var: variants.Variants = variants.NONE,
                mask_offsets: Optional[Tuple[int, int]] = None):
    """Launches the forward on the current stream; returns the launch as a ``launch.Prepared`` for the
    call cache, or None where it cannot be replayed as is (O through a stand-in, CuPy's launch path).
    ``mask_offsets``: (diag, key_offset) of the mask policy (variants.Variants.param_values), for a step of
    ring attention."""
    b, nq, nk, hq, hkv, d = dims
    opts = opts or options.current()
    kern, cfg, smem = _fwd_plan(q.dtype, d, causal, device_id, heuristics.fwd_short(nq, nk), heuristics.fwd_long(nq, nk),
                                opts, var.kernel, v.shape[3])
    extra = ()
    written = out   # where the kernel writes O: out, or a compact stand-in copied into it after
    if cfg.fam.arch_specific:  # sm90 (opt-in): tensor maps, or sm80 where TMA cannot address the inputs
        kern, cfg, smem, extra, written = sm90.fwd_launch_args(kern, cfg, smem, q, k, v, device_id, out)
    p = params.pack_bytes(params.FWD_PARAMS, (
        q.data.ptr, k.data.ptr, v.data.ptr, written.data.ptr, lse.data.ptr if lse is not None else 0,
        *params.element_strides(q), *params.element_strides(k), *params.element_strides(v),
        *params.element_strides(written),
        b, nq, nk, hq, hq // hkv, d, scale, scale * LOG2E, *var.param_values(nq, nk, scale, *(mask_offsets or ())),
        *params.DENSE_VARLEN_VALUES))
    grid = launch.fwd_grid(cfg, b, hq, nq)
    prepared = launch.prepare(kern, cfg, grid, p, smem, extra)
    if prepared is None:
        launch.launch(kern, cfg, grid, p, smem, extra)
    else:
        prepared.on_current_stream()
    if written is not out:
        out[...] = written
        capture.keep_if_capturing(written)   # a captured graph writes the stand-in on every replay
        return None
    return prepared


# ---------------------------------------------------------------------------
# Packed batches of sequences of their own lengths (varlen)


def forward_varlen(q: ndarray, k: ndarray, v: ndarray, cu_seqlens_q: ndarray, cu_seqlens_k: ndarray,
                   max_seqlen_q: int, max_seqlen_k: int, *, seqused_q: Optional[ndarray] = None,
                   seqused_k: Optional[ndarray] = None, causal: bool = False, softmax_scale: Optional[float] = None,
                   window_size: Tuple[int, int] = (-1, -1), attention_chunk: int = 0, softcap: float = 0.0,
                   alibi_slopes: Optional[ndarray] = None, sinks: Optional[ndarray] = None, return_lse: bool = False,
                   out: Optional[ndarray] = None, check_offsets: Optional[bool] = None, lse: Optional[ndarray] = None,
                   bias: Optional[ndarray] = None, dropout_p: float = 0.0, seed: Union[int, ndarray, None] = None,
                   offset: int = 0, block_mask: Optional[ndarray] = None,
                   block_size: Union[int, Tuple[int, int]] = 128, score_mod=None, mask_mod=None
                   ) -> Union[ndarray, Tuple[ndarray, ndarray]]:
    """Attention over a packed batch of sequences of different lengths (flash-attn's ``flash_attn_varlen_func``).

    Sequence ``b`` is queries ``q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]`` against keys and values
    ``k[cu_seqlens_k[b]:cu_seqlens_k[b + 1]]`` and ``v[...]``, computed as :func:`forward` would on that
    sequence alone; no work is spent on padding.

    Args:
        q: ``(total_q, heads_q, head_dim)`` CuPy array, float16, bfloat16 or float32 (or a CUDA torch / JAX
            array, as in :func:`forward`).
        k: ``(total_k, heads_kv, head_dim)``, same dtype and device; heads_q % heads_kv == 0.
        v: ``(total_k, heads_kv, head_dim_v)``: a head dim of its own allowed, as in :func:`forward`.
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch + 1,)`` offsets of the sequences' first rows (0 first,
            the totals last), on q's device.
        max_seqlen_q, max_seqlen_k: Python ints, at least every sequence's length (the grid covers
            max_seqlen_q rows of every sequence).
        seqused_q, seqused_k: optional int32 ``(batch,)``: sequence b uses only its first seqused[b] rows
            (queries) or keys; rows past them are not read, and their outputs are 0 (lse -inf).
        causal: per sequence, aligned bottom-right: query i sees keys j <= i + len_k - len_q.
        softmax_scale, window_size, attention_chunk, softcap, sinks: as in :func:`forward`, per sequence.
        alibi_slopes: float32 ``(heads_q,)`` or ``(batch, heads_q)`` (row b for sequence b).
        return_lse: also return the log-sum-exp.
        out: optional output buffer ``(total_q, heads_q, head_dim_v)`` in q's dtype, sharing no memory with the
            inputs.
        check_offsets: whether to copy the offsets (and seqused) to the host and check them
            (cuflash.varlen describes the checks): None (default) checks unless the current stream is
            capturing a CUDA graph; pass False under ``torch.compile`` / ``jax.jit`` or wherever no
            synchronization is allowed. Unchecked, a bad offset gives wrong results for its sequence but
            never a read or a write outside the arrays.
        lse: optional buffer for the log-sum-exp (with ``return_lse=True``): float32 ``(heads_q, total_q)``,
            C-contiguous, sharing no memory with the inputs or ``out`` (a framework's preallocated output).
        bias, dropout_p, seed, offset, block_mask, block_size, score_mod, mask_mod: programmable attention as in
            :func:`forward` (fp16 / bf16; the portable kernels on every GPU), per sequence as if the batch were
            padded to ``(batch, max_seqlen_q, max_seqlen_k)``: sequence b sees ``bias[b, :, :len_q, :len_k]``
            (bias broadcastable to ``(batch, heads_q, max_seqlen_q, max_seqlen_k)``), the block mask's entries
            at its own positions (``(batch or 1, heads_q or 1, ceil(max_seqlen_q / bq), ceil(max_seqlen_k /
            bk))``), dropout's mask of batch index b (``dropout_keep_mask(seed, offset, batch, heads_q,
            max_seqlen_q, max_seqlen_k, p)[b, :, :len_q, :len_k]``), and modifiers get ``b`` and positions
            ``q_idx`` / ``kv_idx`` within the sequence (a MaskMod's tiles are evaluated at positions below the
            max lengths).

    Returns:
        ``out`` ``(total_q, heads_q, head_dim_v)``, or ``(out, lse)`` with ``lse`` float32 ``(heads_q,
        total_q)`` (flash-attn's packed layout).
    """
    arrays = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k,
              "seqused_q": seqused_q, "seqused_k": seqused_k, "alibi_slopes": alibi_slopes, "sinks": sinks,
              "out": out, "lse": lse, "bias": bias, "block_mask": block_mask}
    numbers = {"seed": seed}
    if hasattr(seed, "shape") and hasattr(seed, "dtype"):   # a device seed: an array like the others
        arrays["seed"], numbers = seed, {}
    if interop.needs_conversion(*arrays.values()):
        return interop.call(forward_varlen, arrays, buffers=("out", "lse"), max_seqlen_q=max_seqlen_q,
                            max_seqlen_k=max_seqlen_k, causal=causal, softmax_scale=softmax_scale,
                            window_size=window_size, attention_chunk=attention_chunk, softcap=softcap,
                            return_lse=return_lse, check_offsets=check_offsets, dropout_p=dropout_p, offset=offset,
                            block_size=block_size, score_mod=score_mod, mask_mod=mask_mod, **numbers)
    lay = varlen.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=seqused_q,
                              seqused_k=seqused_k, check_offsets=check_offsets, allow_dv=True)
    out_shape = (lay.total_q, lay.heads_q, lay.head_dim_v)
    scale = _checks.check_scale(softmax_scale, lay.head_dim_qk)
    causal = _checks.check_flag("causal", causal)
    return_lse = _checks.check_flag("return_lse", return_lse)
    dev = lay.device_id
    var = variants.from_arguments(window_size, attention_chunk, softcap, alibi_slopes, sinks, causal=causal,
                                  batch=lay.batch, heads_q=lay.heads_q, device_id=dev, q_dtype=q.dtype)
    if out is not None:
        _checks.check_out("out", out, out_shape, q.dtype, dev)
    if lse is not None:   # the kernels write it as (heads_q, total_q) rows
        if not return_lse:
            raise ValueError("lse is the buffer of the log-sum-exp that return_lse=True returns; pass return_lse=True")
        _checks.check_lse(lse, (lay.heads_q, lay.total_q), dev, layout="(heads_q, total_q)")
        if not lse.flags.c_contiguous:
            raise ValueError(f"lse must be C-contiguous (heads_q, total_q) float32, got strides {lse.strides}")
    _checks.check_no_overlap((("out", out), ("lse", lse)), (("q", q), ("k", k), ("v", v)))
    prog = _varlen_programmable(q, lay, bias, dropout_p, seed, offset, block_mask, block_size, score_mod, mask_mod)
    import cupy

    try:
        with cupy.cuda.Device(dev):
            out = cupy.empty(out_shape, dtype=q.dtype) if out is None else out
            if return_lse and lse is None:
                lse = cupy.empty((lay.heads_q, lay.total_q), dtype=np.float32)
            if seqused_q is not None:   # rows past a sequence's used ones: no kernel writes them
                out.fill(0)
                if lse is not None:
                    lse.fill(-np.inf)
            if lay.total_q and lay.batch and lay.max_seqlen_q:
                if lay.total_k == 0 or lay.max_seqlen_k == 0:   # no sequence has a key
                    out.fill(0)
                    if lse is not None:
                        lse[...] = -np.inf if var.sinks is None else var.sinks[:, None]
                elif prog is not None:
                    programmable.launch_forward_varlen(q, k, v, out, lse, lay, prog, causal=bool(causal), scale=scale,
                                                       opts=options.current(), var=var)
                else:
                    _launch_fwd_varlen(q, k, v, out, lse, lay, causal=bool(causal), scale=scale, var=var)
    except RuntimeError as e:   # no driver, no GPU, an old driver or GPU: say which, and what to do
        device_check.reraise_explained(e)
        raise
    return (out, lse) if return_lse else out


def _varlen_programmable(q, lay: varlen.VarlenLayout, bias, dropout_p, seed, offset, block_mask, block_size,
                         score_mod, mask_mod) -> Optional[programmable.ProgArgs]:
    """A varlen call's checked programmable arguments (at the padded shape (batch, heads_q, max_seqlen_q,
    max_seqlen_k)), or None where it has none."""
    if not programmable.given(bias, dropout_p, seed, block_mask, score_mod, mask_mod):
        return None
    prog = programmable.check_arguments(q, bias=bias, dropout_p=dropout_p, seed=seed, offset=offset,
                                        block_mask=block_mask, block_size=block_size, score_mod=score_mod,
                                        mask_mod=mask_mod, batch=lay.batch, heads_q=lay.heads_q,
                                        seqlen_q=lay.max_seqlen_q, seqlen_k=lay.max_seqlen_k,
                                        device_id=lay.device_id)
    return None if prog.empty else prog


def _packed_strides(x) -> tuple[int, int, int]:
    """(batch, row, head) element strides of a packed (total, heads, head_dim) array: batch 0 (the kernels
    reach a sequence through its offsets, common/varlen.cuh)."""
    return 0, x.strides[0] // x.itemsize, x.strides[1] // x.itemsize


def _varlen_values(lay: varlen.VarlenLayout, tile_rows: int = 0, offsets_bad=None) -> tuple:
    """The params' varlen fields (params._VARLEN_FIELDS); ``tile_rows``: the sm90 backward's query tile (its
    padded per-sequence stats rows and dQ tiles: sm90.varlen_padded_rows); ``offsets_bad``: the sm90 ordered
    backward's int32 flag (kernels_cu/common/varlen.cuh: flag_decreasing_offsets), zeroed."""
    return (lay.cu_seqlens_q.data.ptr, lay.cu_seqlens_k.data.ptr,
            0 if lay.seqused_q is None else lay.seqused_q.data.ptr,
            0 if lay.seqused_k is None else lay.seqused_k.data.ptr, lay.total_q, lay.total_k, tile_rows,
            0 if offsets_bad is None else offsets_bad.data.ptr)


def _launch_fwd_varlen(q, k, v, out, lse, lay: varlen.VarlenLayout, *, causal: bool, scale: float,
                       var: variants.Variants, opts: Optional[options.Options] = None) -> None:
    """Launches the varlen forward on the current stream: the kernels' MaskVariant with varlen on, one CTA
    (or persistent tile) per query tile of max_seqlen_q rows, head and sequence."""
    opts = opts or options.current()
    max_q, max_k = lay.max_seqlen_q, lay.max_seqlen_k
    kernel_variant = dataclasses.replace(var.kernel, varlen=True)
    kern, cfg, smem = _fwd_plan(q.dtype, lay.head_dim_qk, causal, lay.device_id, heuristics.fwd_short(max_q, max_k),
                                heuristics.fwd_long(max_q, max_k), opts, kernel_variant, lay.head_dim_v)
    extra = ()
    written = out
    if cfg.fam.arch_specific:   # tensor maps over the packed rows, as a batch of one
        kern, cfg, smem, extra, written = sm90.fwd_launch_args(kern, cfg, smem, q[None], k[None], v[None],
                                                               lay.device_id, out[None])
        written = written[0]
    p = params.pack_bytes(params.FWD_PARAMS, (
        q.data.ptr, k.data.ptr, v.data.ptr, written.data.ptr, lse.data.ptr if lse is not None else 0,
        *_packed_strides(q), *_packed_strides(k), *_packed_strides(v), *_packed_strides(written),
        lay.batch, max_q, max_k, lay.heads_q, lay.heads_q // lay.heads_kv, lay.head_dim_qk, scale, scale * LOG2E,
        *var.param_values(max_q, max_k, scale), *_varlen_values(lay)))
    launch.launch(kern, cfg, launch.fwd_grid(cfg, lay.batch, lay.heads_q, max_q), p, smem, extra)
    if written is not out:
        out[...] = written
        capture.keep_if_capturing(written)


def backward_varlen(dout: ndarray, q: ndarray, k: ndarray, v: ndarray, out: ndarray, lse: ndarray,
                    cu_seqlens_q: ndarray, cu_seqlens_k: ndarray, max_seqlen_q: int, max_seqlen_k: int, *,
                    seqused_q: Optional[ndarray] = None, seqused_k: Optional[ndarray] = None, causal: bool = False,
                    softmax_scale: Optional[float] = None, window_size: Tuple[int, int] = (-1, -1),
                    attention_chunk: int = 0, softcap: float = 0.0, alibi_slopes: Optional[ndarray] = None,
                    sinks: Optional[ndarray] = None, dlse: Optional[ndarray] = None, deterministic: bool = False,
                    dq: Optional[ndarray] = None, dk: Optional[ndarray] = None, dv: Optional[ndarray] = None,
                    check_offsets: Optional[bool] = None, bias: Optional[ndarray] = None, dropout_p: float = 0.0,
                    seed: Union[int, ndarray, None] = None, offset: int = 0, block_mask: Optional[ndarray] = None,
                    block_size: Union[int, Tuple[int, int]] = 128, score_mod=None, mask_mod=None,
                    _padded: bool = False) -> Tuple[ndarray, ...]:
    """Gradients of :func:`forward_varlen` with respect to q, k and v.

    Args:
        dout: ``(total_q, heads_q, head_dim)``, the gradient of ``out``; shaped and typed like q.
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k: as given to
            :func:`forward_varlen`.
        out: its output; lse: its log-sum-exp, float32 ``(heads_q, total_q)`` (``return_lse=True``).
        causal, softmax_scale, window_size, attention_chunk, softcap, alibi_slopes, sinks: as given to the
            forward.
        dlse: optional gradient of lse, float32 ``(heads_q, total_q)``.
        deterministic: bitwise reproducible results (dQ from its own kernel, no atomics).
        dq, dk, dv: optional output buffers shaped and typed like q, k, v, sharing no memory with the inputs.
        check_offsets: as in :func:`forward_varlen`.
        bias, dropout_p, seed, offset, block_mask, block_size, score_mod, mask_mod: as given to
            :func:`forward_varlen` (its portable kernels' deterministic pair; v's head dim that of q).

    Returns:
        ``(dq, dk, dv)`` packed like q, k, v (rows and keys outside every sequence's used range: 0), and with
        ``sinks`` ``(dq, dk, dv, dsinks)``; with a ``bias``, ``dbias`` (its shape and dtype, summed over its
        broadcast dims; 0 past the sequences' lengths) follows, and with a ``score_mod`` that has
        ``tensor_grads``, a dict {tensor name: float32 gradient} comes last, as :func:`backward` returns them.
    """
    arrays = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse, "cu_seqlens_q": cu_seqlens_q,
              "cu_seqlens_k": cu_seqlens_k, "seqused_q": seqused_q, "seqused_k": seqused_k,
              "alibi_slopes": alibi_slopes, "sinks": sinks, "dlse": dlse, "dq": dq, "dk": dk, "dv": dv,
              "bias": bias, "block_mask": block_mask}
    numbers = {"seed": seed}
    if hasattr(seed, "shape") and hasattr(seed, "dtype"):   # a device seed: an array like the others
        arrays["seed"], numbers = seed, {}
    if interop.needs_conversion(*arrays.values()):
        return interop.call(backward_varlen, arrays, buffers=("dq", "dk", "dv"), max_seqlen_q=max_seqlen_q,
                            max_seqlen_k=max_seqlen_k, causal=causal, softmax_scale=softmax_scale,
                            window_size=window_size, attention_chunk=attention_chunk, softcap=softcap,
                            deterministic=deterministic, check_offsets=check_offsets, dropout_p=dropout_p,
                            offset=offset, block_size=block_size, score_mod=score_mod, mask_mod=mask_mod, **numbers)
    lay = varlen.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=seqused_q,
                              seqused_k=seqused_k, check_offsets=check_offsets, allow_dv=True,
                              head_dims_checked=_padded)
    dev = lay.device_id
    out_shape = (lay.total_q, lay.heads_q, lay.head_dim_v)
    _checks.check_like("dout", dout, "q", q, out_shape)
    _checks.check_like("out", out, "q", q, out_shape)
    stat_shape = (lay.heads_q, lay.total_q)
    _checks.check_lse(lse, stat_shape, dev, layout="(heads_q, total_q)")
    if dlse is not None:
        _checks.check_lse(dlse, stat_shape, dev, name="dlse", layout="(heads_q, total_q)")
    scale = _checks.check_scale(softmax_scale, lay.head_dim_qk)
    causal = _checks.check_flag("causal", causal)
    deterministic = _checks.check_flag("deterministic", deterministic)
    var = variants.from_arguments(window_size, attention_chunk, softcap, alibi_slopes, sinks, causal=causal,
                                  batch=lay.batch, heads_q=lay.heads_q, device_id=dev, q_dtype=q.dtype)
    for name, buf, ref in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if buf is not None:
            _checks.check_out(name, buf, ref.shape, ref.dtype, dev)
    _checks.check_no_overlap((("dq", dq), ("dk", dk), ("dv", dv)),
                             (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse)))
    prog = _varlen_programmable(q, lay, bias, dropout_p, seed, offset, block_mask, block_size, score_mod, mask_mod)
    if prog is not None:
        return _backward_varlen_programmable(dout, q, k, v, out, lse, dq, dk, dv, lay, prog, causal=bool(causal),
                                             scale=scale, var=var, dlse=dlse, sinks=sinks)
    large = head_dims.is_large(lay.head_dim_qk, lay.head_dim_v) and q.dtype != np.float32   # the split kernels
    narrow_v = lay.head_dim_v < lay.head_dim_qk and q.dtype != np.float32   # _launch_bwd_varlen: head_dims.NarrowV
    if lay.head_dim_v != lay.head_dim_qk and not (large or narrow_v):   # as backward: zero padding (head_dims.py)
        (dout_p, q_p, k_p, v_p, out_p), unpad = head_dims.padded(dout, q, k, v, out)
        grads = backward_varlen(dout_p, q_p, k_p, v_p, out_p, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, seqused_q=seqused_q, seqused_k=seqused_k, causal=causal,
                                softmax_scale=scale, window_size=window_size, attention_chunk=attention_chunk,
                                softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, dlse=dlse,
                                deterministic=deterministic, check_offsets=False, _padded=True)   # checked above
        return head_dims.deliver(unpad(*grads[:3]), (dq, dk, dv)) + tuple(grads[3:])
    import cupy

    try:
        with cupy.cuda.Device(dev):
            dq = cupy.empty(q.shape, dtype=q.dtype) if dq is None else dq
            dk = cupy.empty(k.shape, dtype=k.dtype) if dk is None else dk
            dv = cupy.empty(v.shape, dtype=v.dtype) if dv is None else dv
            dsinks = None if var.sinks is None else cupy.zeros(lay.heads_q, dtype=np.float32)
            runs = lay.batch and lay.max_seqlen_q and lay.max_seqlen_k and lay.total_q and lay.total_k
            # Rows and keys that no kernel writes: past seqused, or every one where no sequence has both.
            if seqused_q is not None or not runs:
                dq.fill(0)
            if seqused_k is not None or not runs:
                dk.fill(0)
                dv.fill(0)
            if runs:
                lse = lse if lse.flags.c_contiguous else cupy.ascontiguousarray(lse)
                if dlse is not None and not dlse.flags.c_contiguous:
                    dlse = cupy.ascontiguousarray(dlse)
                launch_fn = _launch_bwd_varlen_large if large else \
                    functools.partial(_launch_bwd_varlen, deterministic=deterministic)
                delta = launch_fn(dout, q, k, v, out, lse, dq, dk, dv, lay, causal=bool(causal), scale=scale, var=var,
                                  dlse=dlse)
                if dsinks is not None:   # as the dense backward: sum over rows of P(sink) (dlse - delta)
                    dsinks = -(cupy.exp(var.sinks[:, None] - lse) * delta).sum(axis=1)
            elif dsinks is not None and dlse is not None and lay.total_q:
                dsinks = dlse.astype(np.float32).sum(axis=1)   # no key anywhere: P(sink) = 1
    except RuntimeError as e:   # no driver, no GPU, an old driver or GPU: say which, and what to do
        device_check.reraise_explained(e)
        raise
    if sinks is None:
        return dq, dk, dv
    return dq, dk, dv, dsinks if dsinks.dtype == sinks.dtype else dsinks.astype(sinks.dtype)


def _backward_varlen_programmable(dout, q, k, v, out, lse, dq, dk, dv, lay: varlen.VarlenLayout,
                                  prog: programmable.ProgArgs, *, causal: bool, scale: float, var: variants.Variants,
                                  dlse, sinks) -> Tuple[ndarray, ...]:
    """backward_varlen with programmable parts, its arguments checked: the programmable backward's portable pair
    per sequence (programmable.launch_backward_varlen)."""
    import cupy

    if lay.head_dim_v != lay.head_dim_qk:
        raise ValueError(f"bias, dropout, block masks and modifiers take v's head dim equal to q's in the backward "
                         f"so far, got {lay.head_dim_v} and {lay.head_dim_qk}")
    if lay.head_dim_qk > heuristics.MAX_HEAD_DIM:
        raise ValueError(f"bias, dropout, block masks and modifiers take head dims up to {heuristics.MAX_HEAD_DIM} "
                         f"in the backward so far, got {lay.head_dim_qk}")
    if prog.modifiers is not None and prog.modifiers.score_mod is not None and prog.modifiers.score_mod.grad is None:
        raise ValueError("the backward of a score_mod needs its grad (CUDA C returning d(new score) / d(score))")
    dev = lay.device_id
    dbias, tensor_grads, dsinks = None, {}, None
    try:
        with cupy.cuda.Device(dev):
            dq = cupy.empty(q.shape, dtype=q.dtype) if dq is None else dq
            dk = cupy.empty(k.shape, dtype=k.dtype) if dk is None else dk
            dv = cupy.empty(v.shape, dtype=v.dtype) if dv is None else dv
            runs = lay.batch and lay.max_seqlen_q and lay.max_seqlen_k and lay.total_q and lay.total_k
            if lay.seqused_q is not None or not runs:   # rows and keys that no kernel writes
                dq.fill(0)
            if lay.seqused_k is not None or not runs:
                dk.fill(0)
                dv.fill(0)
            if runs:
                lse = lse if lse.flags.c_contiguous else cupy.ascontiguousarray(lse)
                if dlse is not None and not dlse.flags.c_contiguous:
                    dlse = cupy.ascontiguousarray(dlse)
                delta, dbias, tensor_grads = programmable.launch_backward_varlen(
                    dout, q, k, v, out, lse, dq, dk, dv, lay, prog, causal=causal, scale=scale,
                    opts=options.current(), var=var, dlse=dlse)
                if var.sinks is not None:   # as the plain varlen backward: P(sink) (dlse - delta) over the rows
                    dsinks = -(cupy.exp(var.sinks[:, None] - lse) * delta).sum(axis=1)
            else:   # no kernel: zero gradients (and, with no key anywhere, P(sink) = 1)
                if prog.bias is not None:
                    dbias = cupy.zeros(prog.bias_shape, dtype=prog.bias.dtype)
                if prog.modifiers is not None and prog.modifiers.score_mod is not None:
                    tensor_grads = {name: cupy.zeros(prog.modifiers.slots[name].shape, dtype=np.float32)
                                    for name in prog.modifiers.score_mod.tensor_grads}
                if var.sinks is not None:
                    dsinks = (dlse.astype(np.float32).sum(axis=1) if dlse is not None
                              else cupy.zeros(lay.heads_q, dtype=np.float32))
    except RuntimeError as e:   # no driver, no GPU, an old driver or GPU: say which, and what to do
        device_check.reraise_explained(e)
        raise
    return _programmable_grads(dq, dk, dv, sinks, dsinks, dbias, tensor_grads)


def _programmable_grads(dq, dk, dv, sinks, dsinks, dbias, tensor_grads) -> tuple:
    """A programmable backward's result: (dq, dk, dv[, dsinks in the sinks' dtype][, dbias][, {tensor: gradient}])."""
    result = (dq, dk, dv)
    if sinks is not None:
        result += (dsinks if dsinks.dtype == sinks.dtype else dsinks.astype(sinks.dtype),)
    if dbias is not None:
        result += (dbias,)
    if tensor_grads:
        result += (tensor_grads,)
    return result


def _launch_bwd_varlen(dout, q, k, v, out, lse, dq, dk, dv, lay: varlen.VarlenLayout, *, causal: bool, scale: float,
                       deterministic: bool, var: variants.Variants, dlse=None,
                       opts: Optional[options.Options] = None):
    """Launches the varlen backward on the current stream: the preprocess, the dK/dV kernel (Hopper: with
    its dQ tiles; portable: with dQ sums or a dQ kernel after), then the postprocess. Returns delta
    ``(heads_q, total_q)`` float32 (with sinks, 0 outside the used rows).

    The Hopper kernel keeps each sequence's stats rows (lse2, delta) and dQ tiles in whole query tiles from
    its padded row (kernels_cu/common/varlen.cuh: padded_row0; sm90.varlen_padded_rows): ``tile_rows`` is its
    query tile, 0 for the portable kernels, whose lse, delta and dQ sums are (heads_q, total_q) rows."""
    import cupy

    opts = opts or options.current()
    kernel_variant = dataclasses.replace(var.kernel, sink=False, varlen=True)   # no sink code in the backward
    hq, total_q, d, b = lay.heads_q, lay.total_q, lay.head_dim_qk, lay.batch

    def plan(backend=None):
        return _bwd_plan(q.dtype, d, causal, deterministic, lay.device_id, backend=backend, opts=opts,
                         variant=kernel_variant)

    pre, dkdv, dq_kernel, post = plan()
    extra, tile_rows, padded = (), 0, 0
    if dkdv[1].fam.arch_specific:   # tensor maps over the packed rows, as a batch of one
        maps = sm90.bwd_tensor_maps(dkdv[1], q[None], k[None], v[None], dout[None])
        tile_rows = dkdv[1].block_m
        padded = sm90.varlen_padded_rows(total_q, b, tile_rows)
        if maps is None or hq * 2 * padded >= 2**32:   # the stats index is 32-bit (bwd_producer.cuh)
            pre, dkdv, dq_kernel, post = plan("sm80")
            tile_rows = padded = 0
        else:
            extra = (maps,)
    narrow = head_dims.NarrowV(dout, q, k, v, out, dv, sm90_reads=bool(extra), zero_workspace=True)
    if narrow:
        dout, q, k, v, out, dv = narrow.arrays()
    kern, cfg, smem = dkdv
    # delta's rows outside every sequence are never written: zeros where dsinks sums over all rows (with sinks).
    delta = (cupy.zeros if var.sinks is not None else cupy.empty)((hq, total_q), dtype=np.float32)
    # The ordered dQ's guard against unchecked decreasing offsets (a hang otherwise: varlen.cuh).
    offsets_bad = cupy.zeros(1, dtype=np.int32) if tile_rows and cfg.fam.dq_mode == "ordered" else None
    stats = semaphores = dq_accum = None
    accum_rows, accum_cols, n_semaphores = total_q, d, 0
    if tile_rows:
        stats = cupy.empty(hq * 2 * padded, dtype=np.float32)
        accum_rows, accum_cols = padded, sm90.padded_head_dim(cfg.head_dim)
        n_semaphores = hq * (padded // tile_rows) * sm90.BWD_CONSUMER_WARPGROUPS
        semaphores = cupy.empty(n_semaphores, dtype=np.int32)
    if post is not None:
        dq_accum = cupy.empty(hq * accum_rows * accum_cols, dtype=np.float32)
        if _POISON_WORKSPACE:   # every float the preprocess does not zero, and every semaphore, shows
            dq_accum.fill(np.nan)
            if semaphores is not None and cfg.fam.dq_mode != "ordered":
                semaphores.fill((1 << 24) + 3)
    values = (
        q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, dout.data.ptr, lse.data.ptr, delta.data.ptr,
        dq_accum.data.ptr if dq_accum is not None else 0, dq.data.ptr, dk.data.ptr, dv.data.ptr,
        semaphores.data.ptr if semaphores is not None else 0,
        *_packed_strides(q), *_packed_strides(k), *_packed_strides(v), *_packed_strides(out), *_packed_strides(dout),
        *_packed_strides(dq), *_packed_strides(dk), *_packed_strides(dv),
        b, lay.max_seqlen_q, lay.max_seqlen_k, hq, hq // lay.heads_kv, d, scale, scale * LOG2E,
        accum_rows, accum_cols, accum_rows, n_semaphores,   # every dQ row of a sequence zeroed (varlen.cuh)
        stats.data.ptr if stats is not None else 0, padded,
        *var.param_values(lay.max_seqlen_q, lay.max_seqlen_k, scale), dlse.data.ptr if dlse is not None else 0,
        *_varlen_values(lay, tile_rows, offsets_bad))
    p = params.pack_bytes(params.BWD_PARAMS, values)
    max_q = lay.max_seqlen_q
    pkern, pcfg, psmem = pre
    # The preprocess covers each sequence's whole tiles (Hopper: its stats rows), reading out and dout over
    # their own width.
    pre_rows = -(-max_q // tile_rows) * tile_rows if tile_rows else max_q
    launch.launch(pkern, pcfg, launch.bwd_row_grid(pcfg, b, hq, pre_rows), narrow.preprocess_params(values)
                  if narrow else p, psmem)
    launch.launch(kern, cfg, launch.bwd_dkdv_grid(cfg, b, lay.heads_kv, lay.max_seqlen_k), p, smem, extra)
    kern, cfg, smem = post if post is not None else dq_kernel
    launch.launch(kern, cfg, launch.bwd_row_grid(cfg, b, hq, max_q), p, smem)
    capture.keep_if_capturing(delta, dq_accum, stats, semaphores, offsets_bad)
    if narrow:
        narrow.deliver_dv()
    return delta


# ---------------------------------------------------------------------------
# fp8 (e4m3) forward, Hopper only


def quantize_fp8(x: ndarray) -> Tuple[ndarray, ndarray]:
    """Per-tensor fp8 (e4m3) quantisation for :func:`forward_fp8`.

    Args:
        x: CuPy array of any shape, float16, bfloat16 or float32 (or a CUDA torch / JAX array, as in
            :func:`forward`: the results then come back in its framework).

    Returns:
        ``(x8, descale)``: ``x8`` a contiguous uint8 array shaped like ``x`` holding the e4m3fn bytes
        of ``x / descale`` (round to nearest even, saturated to +-448), and ``descale`` a float32
        array of shape ``(1,)`` on the device, ``max|x| / 448`` (1 when ``x`` is all zeros), so that
        ``x ~= x8 * descale``. No host synchronisation.
    """
    if interop.needs_conversion(x):
        return interop.call(quantize_fp8, {"x": x})
    try:
        return fp8.quantize(x)
    except RuntimeError as e:
        device_check.reraise_explained(e)
        raise


def forward_fp8(q: ndarray, k: ndarray, v: ndarray, descale_q: Union[ndarray, float],
                descale_k: Union[ndarray, float], descale_v: Union[ndarray, float], *, causal: bool = False,
                softmax_scale: Optional[float] = None, window_size: Tuple[int, int] = (-1, -1),
                attention_chunk: int = 0, softcap: float = 0.0, alibi_slopes: Optional[ndarray] = None,
                sinks: Optional[ndarray] = None, return_lse: bool = False,
                out: Optional[ndarray] = None) -> Union[ndarray, Tuple[ndarray, ndarray]]:
    """Attention over fp8 (e4m3) inputs on Hopper (compute capability 9.0), bfloat16 output.

    Computes ``forward(q8 * descale_q, k8 * descale_k, v8 * descale_v)`` with both products on the
    fp8 tensor cores: the probabilities P are rounded to e4m3 before P V (FlashAttention-3's fp8
    scheme), so expect errors of a few percent of the output's norm, not fp16's 1e-3.

    Args:
        q: ``(batch, seqlen_q, heads_q, head_dim)`` uint8 CuPy array of e4m3fn bytes
            (:func:`quantize_fp8`); head_dim a multiple of 16 up to 256. CUDA torch tensors (uint8 or
            float8_e4m3fn) and JAX arrays are read in place, as in :func:`forward`.
        k, v: ``(batch, seqlen_k, heads_kv, head_dim)``, the same; heads_q % heads_kv == 0.
        descale_q, descale_k, descale_v: the per-tensor scales: float32 CuPy arrays of one element
            (as :func:`quantize_fp8` returns; read on the device) or positive floats (ValueError for
            one that is 0, subnormal or inf as float32). An array's value is not checked, since reading
            it would synchronise with the device: a NaN, negative or zero descale gives NaN or wrong
            output, not an error.
        causal, softmax_scale, return_lse: as in :func:`forward` (the scale applies to the
            dequantised scores).
        window_size, attention_chunk, softcap, alibi_slopes, sinks: as in :func:`forward` (on the
            dequantised scores).
        out: optional bfloat16 output buffer shaped like ``q``, sharing no memory with the inputs.

    Returns:
        ``out`` (bfloat16, shaped like q), or ``(out, lse)`` with ``lse`` float32
        ``(batch, heads_q, seqlen_q)`` as in :func:`forward`.

    Raises:
        RuntimeError: the device is not a Hopper GPU.
    """
    if interop.needs_conversion(q, k, v, out, descale_q, descale_k, descale_v):   # torch / JAX arrays
        descales = {"descale_q": descale_q, "descale_k": descale_k, "descale_v": descale_v}
        arrays = {name: x for name, x in descales.items() if hasattr(x, "__dlpack__")}   # not the floats
        numbers = {name: x for name, x in descales.items() if name not in arrays}
        return interop.call(forward_fp8, {"q": q, "k": k, "v": v, "out": out, "alibi_slopes": alibi_slopes,
                                          "sinks": sinks, **arrays}, buffers=("out",),
                            **numbers, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse,
                            window_size=window_size, attention_chunk=attention_chunk, softcap=softcap)
    b, nq, nk, hq, hkv, d = fp8.check_fp8_qkv(q, k, v)
    scale = _checks.check_scale(softmax_scale, d)
    causal = _checks.check_flag("causal", causal)
    return_lse = _checks.check_flag("return_lse", return_lse)
    dev = q.device.id
    var = variants.from_arguments(window_size, attention_chunk, softcap, alibi_slopes, sinks, causal=causal,
                                  batch=b, heads_q=hq, device_id=dev)
    named = (("descale_q", descale_q), ("descale_k", descale_k), ("descale_v", descale_v))
    for name, x in named:   # all of them before a float descale goes to the device
        fp8.check_descale(name, x, dev)
    if out is not None:
        _checks.check_out_cached("out", out, q.shape, _checks.BFLOAT16, dev)
        _checks.check_no_overlap((("out", out),), (("q", q), ("k", k), ("v", v), *named))
    try:
        descales = tuple(fp8.descale_array(name, x, dev) for name, x in named)
    except RuntimeError as e:
        device_check.reraise_explained(e)
        raise
    return _run_forward(lambda o, lse: fp8.launch_forward(q, k, v, o, lse, descales, causal=bool(causal),
                                                         scale=scale, dims=(b, nq, nk, hq, hkv, d), device_id=dev,
                                                         var=var),
                        out, q.shape, _checks.BFLOAT16, (b, hq, nq), nk, return_lse, dev, sinks=var.sinks)


# ---------------------------------------------------------------------------
# Backward


def backward(dout: ndarray, q: ndarray, k: ndarray, v: ndarray, out: ndarray, lse: ndarray, *,
             causal: bool = False, softmax_scale: Optional[float] = None, window_size: Tuple[int, int] = (-1, -1),
             attention_chunk: int = 0, softcap: float = 0.0, alibi_slopes: Optional[ndarray] = None,
             sinks: Optional[ndarray] = None, dlse: Optional[ndarray] = None, deterministic: bool = False,
             dq: Optional[ndarray] = None, dk: Optional[ndarray] = None,
             dv: Optional[ndarray] = None, bias: Optional[ndarray] = None, dropout_p: float = 0.0,
             seed: Union[int, ndarray, None] = None, offset: int = 0, block_mask: Optional[ndarray] = None,
             block_size: Union[int, Tuple[int, int]] = 128, score_mod=None, mask_mod=None,
             _mask_offsets: Optional[Tuple[int, int]] = None, _padded: bool = False) -> Tuple[ndarray, ...]:
    """Gradients of ``out = forward(q, k, v)`` with respect to q, k and v.

    FlashAttention-2 backward: P is recomputed tile by tile from q, k and the forward's
    log-sum-exp, so the extra memory is O(batch * heads * seqlen * head_dim), never O(seqlen^2).

    Args:
        dout: gradient of the loss with respect to ``out``; shaped and typed like ``out`` (q's shape with v's
            head dim).
        q, k, v: the forward's inputs (same layout and dtypes as :func:`forward`).
        out: the forward's output. With v's head dim different from q's, the kernels run at the larger of the
            two, the narrower arrays padded with zero columns (cuflash/head_dims.py: a copy of them and a sixth
            more tensor work at (192, 128)).
        lse: the forward's log-sum-exp, float32 ``(batch, heads_q, seqlen_q)``
            (``forward(..., return_lse=True)``).
        causal, softmax_scale, window_size, attention_chunk, softcap, alibi_slopes, sinks: as given to
            the forward.
        dlse: optional gradient of the loss with respect to ``lse``, float32 ``(batch, heads_q, seqlen_q)``
            (when the forward's lse feeds the loss too).
        deterministic: bitwise reproducible results: on Hopper the key tiles' dQ partial sums
            are added in a fixed order (on an H100 3-9 % slower at head dims <= 128, 11-13 % at
            256: README), elsewhere dQ
            comes from its own kernel instead of float32 atomics (about 2x slower). float32 inputs
            are always deterministic.
        dq, dk, dv: optional output buffers shaped and typed like q, k, v (may be strided views),
            sharing no memory with each other or with dout, q, k, v, out, lse (ValueError otherwise).
        bias, dropout_p, seed, offset, block_mask, block_size, score_mod, mask_mod: as given to the forward
            (programmable attention: Hopper's kernels, or the portable pair elsewhere and with ``deterministic``).

    Arrays of another framework (CUDA torch tensors, JAX arrays) are read in place and the
    gradients come back in that framework, as in :func:`forward`.

    Returns:
        ``(dq, dk, dv)`` shaped and typed like ``q``, ``k``, ``v``, and with ``sinks`` ``(dq, dk, dv,
        dsinks)``, dsinks shaped and typed like sinks (deterministic). With GQA/MQA, dk and dv of a
        KV head are the sums over the query heads that share it. With a ``bias``, its gradient ``dbias``
        (its shape and dtype, summed over its broadcast dims) follows; with a ``score_mod`` that has
        ``tensor_grads``, a dict {tensor name: float32 gradient} comes last.
    """
    if programmable.given(bias, dropout_p, seed, block_mask, score_mod, mask_mod):
        return _backward_programmable(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                                      window_size=window_size, attention_chunk=attention_chunk, softcap=softcap,
                                      alibi_slopes=alibi_slopes, sinks=sinks, dlse=dlse, dq=dq, dk=dk, dv=dv,
                                      bias=bias, dropout_p=dropout_p, seed=seed, offset=offset, block_mask=block_mask,
                                      block_size=block_size, score_mod=score_mod, mask_mod=mask_mod,
                                      deterministic=deterministic)
    # The call cache (call_cache.py): a call seen before replays its launches. Not with sinks (dsinks is
    # computed on the host side), a ring step's offsets, or the tests' poisoned workspaces (a replay would
    # skip the poisoning).
    variant_sig = None if sinks is not None or _mask_offsets is not None or _POISON_WORKSPACE else \
        variants.call_signature(window_size, attention_chunk, softcap, alibi_slopes, sinks)
    key = None if variant_sig is None else call_cache.bwd_key(dout, q, k, v, out, lse, dlse, dq, dk, dv, causal,
                                                              softmax_scale, deterministic, variant_sig)
    if key is not None:
        call = _bwd_calls.get(key)
        if call is not None:
            grads = call.replay(key, q, k, v, dq, dk, dv)
            if grads is not None:
                return grads
    elif interop.needs_conversion(dout, q, k, v, out, lse, dq, dk, dv, alibi_slopes, sinks, dlse):   # torch / JAX
        return interop.call(backward, {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse,
                                       "dq": dq, "dk": dk, "dv": dv, "alibi_slopes": alibi_slopes, "sinks": sinks,
                                       "dlse": dlse}, buffers=("dq", "dk", "dv"),
                            causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                            attention_chunk=attention_chunk, softcap=softcap, deterministic=deterministic)
    opts = options.current()
    dims, scale, causal, var = _check_backward(dout, q, k, v, out, lse, dlse, dq, dk, dv, causal, softmax_scale,
                                               window_size, attention_chunk, softcap, alibi_slopes, sinks,
                                               allow_dv=True, head_dims_checked=_padded)
    b, nq, nk, hq, hkv, d = dims
    dev = q.data.device_id
    deterministic = _checks.check_flag("deterministic", deterministic)
    # A value head dim of its own: the kernels' one head dim, by zero padding (head_dims.py); the large head dims'
    # 16-bit kernels take both, and the 16-bit kernels a narrower v (_launch_bwd: head_dims.NarrowV).
    if v.shape[3] != d and not (q.dtype != np.float32 and (head_dims.is_large(d, v.shape[3]) or v.shape[3] < d)):
        (dout_p, q_p, k_p, v_p, out_p), unpad = head_dims.padded(dout, q, k, v, out)
        grads = backward(dout_p, q_p, k_p, v_p, out_p, lse, causal=causal, softmax_scale=scale,
                         window_size=window_size, attention_chunk=attention_chunk, softcap=softcap,
                         alibi_slopes=alibi_slopes, sinks=sinks, dlse=dlse, deterministic=deterministic,
                         _mask_offsets=_mask_offsets, _padded=True)
        return head_dims.deliver(unpad(*grads[:3]), (dq, dk, dv)) + tuple(grads[3:])
    try:
        grads, recorded = _backward_on_device(dout, q, k, v, out, lse, dq, dk, dv, causal, scale, deterministic,
                                              (b, nq, nk, hq, hkv, d), dev, var, dlse, _mask_offsets,
                                              record=key is not None, opts=opts)
    except RuntimeError as e:   # no driver, no GPU, an old driver or GPU: say which, and what to do
        device_check.reraise_explained(e)
        raise
    # Recorded under the options it was planned with (another thread may have changed them since the key).
    if recorded is not None and key[call_cache.OPTIONS_TOKEN] == opts.token:
        _bwd_calls.record(key, recorded, dev)
    if sinks is None:
        return grads[:3]
    dsinks = grads[3] if grads[3].dtype == sinks.dtype else grads[3].astype(sinks.dtype)
    return (*grads[:3], dsinks)


def _check_backward(dout, q, k, v, out, lse, dlse, dq, dk, dv, causal, softmax_scale, window_size, attention_chunk,
                    softcap, alibi_slopes, sinks, allow_dv: bool = False, head_dims_checked: bool = False):
    """The backward's checks, before the device is touched: returns ((B, Nq, Nk, Hq, Hkv, D), scale, causal, the
    checked Variants)."""
    b, nq, nk, hq, hkv, d = _checks.check_qkv_cached(q, k, v, allow_dv=allow_dv, head_dims_checked=head_dims_checked)
    out_shape = (b, nq, hq, v.shape[3])
    _checks.check_like_cached("dout", dout, "q", q, out_shape)
    _checks.check_like_cached("out", out, "q", q, out_shape)
    dev = q.data.device_id
    _checks.check_lse_cached(lse, (b, hq, nq), dev)
    scale = _checks.check_scale(softmax_scale, d)
    causal = _checks.check_flag("causal", causal)
    var = variants.from_arguments(window_size, attention_chunk, softcap, alibi_slopes, sinks, causal=causal,
                                  batch=b, heads_q=hq, device_id=dev, q_dtype=q.dtype)
    if dlse is not None:
        _checks.check_lse_cached(dlse, (b, hq, nq), dev, name="dlse")
    for name, buf, ref in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if buf is not None:
            _checks.check_out_cached(name, buf, ref.shape, ref.dtype, dev)
    _checks.check_no_overlap((("dq", dq), ("dk", dk), ("dv", dv)),
                             (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse)))
    return (b, nq, nk, hq, hkv, d), scale, causal, var


def _backward_programmable(dout, q, k, v, out, lse, *, causal, softmax_scale, window_size, attention_chunk, softcap,
                           alibi_slopes, sinks, dlse, dq, dk, dv, bias, dropout_p, seed, offset, block_mask,
                           block_size, score_mod, mask_mod, deterministic=False):
    """backward with programmable parts (the forward's, _forward_programmable): checked, then the programmable
    kernels."""
    import cupy

    arrays = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv,
              "alibi_slopes": alibi_slopes, "sinks": sinks, "dlse": dlse, "bias": bias, "block_mask": block_mask}
    numbers = {"seed": seed}
    if hasattr(seed, "shape") and hasattr(seed, "dtype"):   # a device seed: an array like the others
        arrays["seed"], numbers = seed, {}
    if interop.needs_conversion(*arrays.values()):
        return interop.call(_backward_programmable, arrays, buffers=("dq", "dk", "dv"), causal=causal,
                            softmax_scale=softmax_scale, window_size=window_size, attention_chunk=attention_chunk,
                            softcap=softcap, dropout_p=dropout_p, offset=offset, block_size=block_size,
                            score_mod=score_mod, mask_mod=mask_mod, deterministic=deterministic, **numbers)
    opts = options.current()
    deterministic = _checks.check_flag("deterministic", deterministic)
    dims, scale, causal, var = _check_backward(dout, q, k, v, out, lse, dlse, dq, dk, dv, causal, softmax_scale,
                                               window_size, attention_chunk, softcap, alibi_slopes, sinks)
    b, nq, nk, hq, hkv, d = dims
    dev = q.data.device_id
    prog = programmable.check_arguments(q, bias=bias, dropout_p=dropout_p, seed=seed, offset=offset,
                                        block_mask=block_mask, block_size=block_size, score_mod=score_mod,
                                        mask_mod=mask_mod, batch=b, heads_q=hq, seqlen_q=nq, seqlen_k=nk,
                                        device_id=dev)
    if prog.empty:   # e.g. a seed with dropout_p 0
        return backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                        attention_chunk=attention_chunk, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                        dlse=dlse, deterministic=True, dq=dq, dk=dk, dv=dv)
    if score_mod is not None and score_mod.grad is None:
        raise ValueError("the backward of a score_mod needs its grad (CUDA C returning d(new score) / d(score))")
    if d > heuristics.MAX_HEAD_DIM:
        raise ValueError(f"bias, dropout, block masks and modifiers take head dims up to {heuristics.MAX_HEAD_DIM} in "
                         f"the backward so far, got {d}")
    if b == 0 or nq == 0 or nk == 0:
        raise ValueError("bias, dropout, block masks and modifiers need batch, seqlen_q and seqlen_k >= 1 in the "
                         "backward so far")
    try:
        with cupy.cuda.Device(dev):
            dq = cupy.empty(q.shape, dtype=q.dtype) if dq is None else dq
            dk = cupy.empty(k.shape, dtype=k.dtype) if dk is None else dk
            dv = cupy.empty(v.shape, dtype=v.dtype) if dv is None else dv
            if not lse.flags.c_contiguous:
                lse = cupy.ascontiguousarray(lse)
            if dlse is not None and not dlse.flags.c_contiguous:
                dlse = cupy.ascontiguousarray(dlse)
            dsinks, dbias, tensor_grads = programmable.launch_backward(
                dout, q, k, v, out, lse, dq, dk, dv, prog, causal=bool(causal), scale=scale,
                dims=(b, nq, nk, hq, hkv, d), device_id=dev, opts=opts, var=var, dlse=dlse,
                deterministic=deterministic)
    except RuntimeError as e:
        device_check.reraise_explained(e)
        raise
    return _programmable_grads(dq, dk, dv, sinks, dsinks, dbias, tensor_grads)


def _backward_on_device(dout, q, k, v, out, lse, dq, dk, dv, causal: bool, scale: float, deterministic: bool,
                        dims, dev: int, var: variants.Variants = variants.NONE, dlse=None, mask_offsets=None,
                        record: bool = False, opts: Optional[options.Options] = None):
    """The backward after its checks: allocates what the caller did not give and launches. Returns
    ``((dq, dk, dv, dsinks), recorded)``: dsinks float32 (heads_q,) or None without sinks; recorded, with
    ``record``, the call as call_cache.RecordedBackward where it can be replayed as is, else None."""
    import cupy

    b, nq, nk, hq, hkv, d = dims
    given = (dq is not None, dk is not None, dv is not None)
    with cupy.cuda.Device(dev):
        dq = cupy.empty(q.shape, dtype=q.dtype) if dq is None else dq
        dk = cupy.empty(k.shape, dtype=k.dtype) if dk is None else dk
        dv = cupy.empty(v.shape, dtype=v.dtype) if dv is None else dv
        dsinks = None if var.sinks is None else cupy.zeros(hq, dtype=np.float32)
        if b == 0:
            return (dq, dk, dv, dsinks), None
        if nq == 0 or nk == 0:  # no query sees a key: every gradient is 0 but the sinks'
            for x in (dq, dk, dv):
                if x.size:
                    x.fill(0)
            if dsinks is not None and nq and dlse is not None:   # P(sink) = 1: d lse / d sink = 1, out = 0
                dsinks[...] = dlse.astype(np.float32).sum(axis=(0, 2))
            return (dq, dk, dv, dsinks), None
        if not lse.flags.c_contiguous:
            lse = cupy.ascontiguousarray(lse)
            capture.keep_if_capturing(lse)
        if dlse is not None and not dlse.flags.c_contiguous:
            dlse = cupy.ascontiguousarray(dlse)
            capture.keep_if_capturing(dlse)
        record = record and lse.flags.c_contiguous and (dlse is None or dlse.flags.c_contiguous)
        dsinks, launches, workspaces = _launch_bwd(dout, q, k, v, out, lse, dq, dk, dv, causal=causal, scale=scale,
                                                   deterministic=deterministic, dims=dims, device_id=dev, var=var,
                                                   dlse=dlse, mask_offsets=mask_offsets, record=record,
                                                   opts=opts)
    recorded = None
    if launches is not None:
        grad_ptrs = tuple(0 if was_given else x.data.ptr for was_given, x in zip(given, (dq, dk, dv)))
        recorded = call_cache.RecordedBackward(launches, workspaces, grad_ptrs)
    return (dq, dk, dv, dsinks), recorded


# Tests set this to fill the backward's float32 dQ workspace with NaN before the kernels run, so that
# any part of it that no kernel initialises shows in the result.
_POISON_WORKSPACE = False

# (dtype, head_dim, causal, deterministic, device, options token, backend, short) ->
# [(kernel, config, smem) or None] * 4 for preprocess, dkdv, dq, postprocess.
# The backward's call cache (call_cache.py): a hit replays the recorded launches.
_bwd_calls = call_cache.BackwardCallCache()
_bwd_plans = call_cache.Plans(_bwd_calls)


def _bwd_plan(dtype, head_dim: int, causal: bool, deterministic: bool, device_id: int,
              backend: Optional[str] = None, short: bool = False, opts: Optional[options.Options] = None,
              variant: variants.MaskVariant = variants.PLAIN):
    opts = opts or options.current()
    backend = opts.bwd_backend if backend is None else backend
    key = (dtype, head_dim, causal, deterministic, device_id, opts.token, backend, short, variant)
    plan = _bwd_plans.get(key)
    if plan is None:
        cc, _ = device_info(device_id, opts)
        cfgs = heuristics.bwd_configs(_checks.dtype_name(dtype), head_dim, causal, cc, deterministic, backend=backend,
                                      short=short, opts=opts, variant=variant)
        plan = _bwd_plans[key] = tuple(
            None if c is None else (get_kernel(c, device_id, opts.nvrtc_defines), c,
                                    smem_bytes(c, device_id, opts.nvrtc_defines))
            for c in (cfgs.preprocess, cfgs.dkdv, cfgs.dq, cfgs.postprocess))
    return plan


def _launch_bwd(dout, q, k, v, out, lse, dq, dk, dv, *, causal: bool, scale: float, deterministic: bool,
                dims, device_id: int, var: variants.Variants = variants.NONE, dlse=None,
                mask_offsets: Optional[Tuple[int, int]] = None, record: bool = False,
                opts: Optional[options.Options] = None, plans: Optional[tuple] = None, dkdv_tail: tuple = ()):
    """Launches the backward's kernels on the current stream; returns ``(dsinks, launches, workspaces)``:
    dsinks (float32, heads_q) with sinks, else None; with ``record``, the launches as ``launch.Prepared``
    and the workspaces as (size, dtype, address) in allocation order, for the call cache (launches None
    where they cannot be replayed as they are). ``mask_offsets``: as in _launch_fwd. ``plans``: (preprocess,
    Hopper dK / dV, postprocess) plans to run instead of the dispatcher's, the dK / dV kernel taking
    ``dkdv_tail`` after its tensor maps (programmable attention: programmable.launch_backward, which has checked
    that TMA addresses the inputs)."""
    import cupy

    workspaces = []

    def workspace(size, dtype):
        w = cupy.empty(size, dtype=dtype)
        workspaces.append((size, dtype, w.data.ptr))
        return w

    b, nq, nk, hq, hkv, d = dims
    opts = opts or options.current()
    # The backward has no sink code: the kernels without.
    variant = var.kernel if not var.kernel.sink else dataclasses.replace(var.kernel, sink=False)
    if head_dims.is_large(d, v.shape[3]) and q.dtype != np.float32:   # float32: the simt kernels' large bucket
        return _launch_bwd_large(dout, q, k, v, out, lse, dq, dk, dv, causal=causal, scale=scale, dims=dims,
                                 device_id=device_id, var=var, variant=variant, dlse=dlse, mask_offsets=mask_offsets,
                                 opts=opts)
    if plans is None:
        pre, dkdv, dq_kernel, post = _bwd_plan(q.dtype, d, causal, deterministic, device_id,
                                               short=heuristics.bwd_short(nk, causal, opts), opts=opts, variant=variant)
    else:
        (pre, dkdv, post), dq_kernel = plans, None
    kern, cfg, smem = dkdv
    extra = ()
    stat_rows = 0
    if cfg.fam.arch_specific:  # sm90: tensor maps, or the portable kernels where TMA cannot address an input
        maps = sm90.bwd_tensor_maps(cfg, q, k, v, dout)
        # lse2 and delta rows padded to whole query tiles (BwdParams.stats), indexed in 32 bits.
        stat_rows = -(-nq // cfg.block_m) * cfg.block_m
        if plans is not None and (maps is None or b * hq * 2 * stat_rows >= 2**32):
            raise RuntimeError("internal: the programmable Hopper backward's inputs were not checked for TMA")
        if maps is None or b * hq * 2 * stat_rows >= 2**32:
            pre, dkdv, dq_kernel, post = _bwd_plan(q.dtype, d, causal, deterministic, device_id, backend="sm80",
                                                   opts=opts, variant=variant)
            kern, cfg, smem = dkdv
            stat_rows = 0
        else:
            extra = (maps, *dkdv_tail)
    narrow = head_dims.NarrowV(dout, q, k, v, out, dv, sm90_reads=bool(extra))
    if narrow:
        dout, q, k, v, out, dv = narrow.arrays()
        record = False   # the copy into the caller's dv is no recorded launch
    # delta (rowsum(dout * out)) for the portable kernels; the sm90 kernel reads it from the stats rows.
    stats = workspace(b * hq * 2 * stat_rows, np.float32) if stat_rows else None
    delta = None if stat_rows else workspace((b, hq, nq), np.float32)
    # The float32 dQ sums, zeroed by the preprocess: rows (seqlen_q, head_dim), or (sm90 tile dQ)
    # query tiles of block_m rows and the padded head dim, in the accumulators' order.
    dq_accum = semaphores = None
    accum_rows, accum_cols = nq, d
    zero_rows = accum_rows
    n_semaphores = 0
    if cfg.fam.dq_mode in TILED_DQ_MODES:
        accum_rows, accum_cols = -(-nq // cfg.block_m) * cfg.block_m, sm90.padded_head_dim(cfg.head_dim)
        zero_rows = accum_rows
        # One semaphore per dQ slice, zeroed by the preprocess.
        n_semaphores = b * hq * (accum_rows // cfg.block_m) * sm90.BWD_CONSUMER_WARPGROUPS
        semaphores = workspace(n_semaphores, np.int32)
        if sm90.bwd_first_slice_stored(cfg, opts):
            # The first key tile to reach a query tile stores its slice instead of adding it: only the
            # query tiles that see no key (causal, seqlen_q > seqlen_k) are left for the preprocess to zero.
            # (With a ring step's offsets the rows that see no key need not lead: zero every row.)
            zero_rows = accum_rows if mask_offsets is not None else \
                (variants.first_seen_row(nq, nk, var) // cfg.block_m) * cfg.block_m
    if post is not None:
        dq_accum = workspace(b * hq * accum_rows * accum_cols, np.float32)
        if _POISON_WORKSPACE:
            record = False
            dq_accum.fill(np.nan)
            if semaphores is not None and cfg.fam.dq_mode != "ordered":
                semaphores.fill((1 << 24) + 3)   # "stored" (kDqSliceReady): every slice would be added
    layout = (*params.element_strides(q), *params.element_strides(k), *params.element_strides(v),
               *params.element_strides(out), *params.element_strides(dout), *params.element_strides(dq),
               *params.element_strides(dk), *params.element_strides(dv),
               b, nq, nk, hq, hq // hkv, d, scale, scale * LOG2E, accum_rows, accum_cols, zero_rows, n_semaphores,
               stats.data.ptr if stats is not None else 0, stat_rows,
               *var.param_values(nq, nk, scale, *(mask_offsets or ())), dlse.data.ptr if dlse is not None else 0,
               *params.DENSE_VARLEN_VALUES)
    pointers = (q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, dout.data.ptr, lse.data.ptr,
                delta.data.ptr if delta is not None else 0)
    outputs = (dq.data.ptr, dk.data.ptr, dv.data.ptr, semaphores.data.ptr if semaphores is not None else 0)
    values = (*pointers, dq_accum.data.ptr if dq_accum is not None else 0, *outputs, *layout)
    p = params.pack_bytes(params.BWD_PARAMS, values)
    # The preprocess reads out and dout over their own width (BwdParams.head_dim is Dqk for the other kernels).
    p_pre = narrow.preprocess_params(values) if narrow else p
    launches = [] if record else None

    def run(kern_, cfg_, grid, smem_, extra_=(), p_=p):
        prepared = launch.prepare(kern_, cfg_, grid, p_, smem_, extra_) if launches is not None else None
        if prepared is None:
            launch.launch(kern_, cfg_, grid, p_, smem_, extra_)
            return None
        prepared.on_current_stream()
        launches.append(prepared)
        return prepared

    pkern, pcfg, psmem = pre
    run(pkern, pcfg, launch.bwd_row_grid(pcfg, b, hq, max(nq, accum_rows, stat_rows)), psmem, p_=p_pre)
    dsinks = None
    if var.sinks is not None:
        # d loss / d sink = sum over rows of P(sink) (dlse - delta), with delta = rowsum(dout * out) - dlse as
        # the preprocess just wrote it (its own array, or the stats rows beside lse2); a fixed-order reduction.
        rows = delta if stats is None else stats.reshape(b, hq, 2, stat_rows)[:, :, 1, :nq]
        dsinks = -(cupy.exp(var.sinks[None, :, None] - lse) * rows).sum(axis=(0, 2))
    run(kern, cfg, launch.bwd_dkdv_grid(cfg, b, hkv, nk), smem, extra)
    kern, cfg, smem = post if post is not None else dq_kernel
    run(kern, cfg, launch.bwd_row_grid(cfg, b, hq, nq), smem)
    capture.keep_if_capturing(delta, dq_accum, semaphores, stats)   # the workspaces of a captured graph's kernels
    if narrow:
        narrow.deliver_dv()
    if launches is None or len(launches) != 3 or dsinks is not None:
        return dsinks, None, None
    return dsinks, tuple(launches), tuple(workspaces)


def _split_bwd_plan(dtype, head_dim: int, head_dim_v: int, causal: bool, device_id: int,
                    variant: variants.MaskVariant, opts: options.Options):
    """The large head dims' backward kernels (preprocess, dV, dK, dQ) as (kernel, config, shared memory), cached."""
    key = ("large", dtype, head_dim, head_dim_v, causal, device_id, opts.token, variant)
    plan = _bwd_plans.get(key)
    if plan is None:
        cc, _ = device_info(device_id, opts)
        cfgs = heuristics.large_bwd_configs(_checks.dtype_name(dtype), head_dim, head_dim_v, causal, cc, variant)
        plan = _bwd_plans[key] = tuple((get_kernel(c, device_id, opts.nvrtc_defines), c,
                                        smem_bytes(c, device_id, opts.nvrtc_defines)) for c in cfgs)
    return plan


def _run_split_bwd(plan, arrays: tuple, p: bytes, pre_grid: tuple, grids: dict) -> None:
    """Launches the preprocess and the three split kernels: ``arrays`` (q, k, v, dout) as the tensor maps see them
    (4-D; varlen: a batch of one), ``grids`` product -> grid. ValueError where TMA cannot address an input."""
    q, k, v, dout = arrays
    pre, *grads = plan
    # The tensor maps of each kernel: the rows' two tiles (64-row boxes) and the steps' two (block_n rows).
    tiles = {"dv": (k, k, q, dout), "dk": (k, v, q, dout), "dq": (q, dout, k, v)}
    maps = []
    for product, (_, cfg, _) in zip(heuristics.SPLIT_BWD_PRODUCTS, grads):
        found = sm90._maps(tiles[product], cfg.dtype, (64, 64, cfg.block_n, cfg.block_n))
        if found is None:
            raise ValueError("q, k, v, out and dout must be addressable by TMA (a contiguous last dim, 16-byte aligned "
                             f"strides) at head dims above {head_dims.MAX_HEAD_DIM}, where only the Hopper kernels "
                             "run; pass contiguous copies")
        maps.append(found)
    pkern, pcfg, psmem = pre
    launch.launch(pkern, pcfg, pre_grid, p, psmem)
    for product, (kern, cfg, smem), found in zip(heuristics.SPLIT_BWD_PRODUCTS, grads, maps):
        launch.launch(kern, cfg, grids[product], p, smem, (found,))


def _check_stat_rows(rows: int) -> None:
    if rows >= 2**32:
        raise ValueError(f"heads_q * the stats rows ({rows // 2}: batch * seqlen_q, or total_q, padded to 64-row tiles) "
                         f"must stay below 2^31 at head dims above {head_dims.MAX_HEAD_DIM} (indexed in 32 bits)")


def _launch_bwd_large(dout, q, k, v, out, lse, dq, dk, dv, *, causal: bool, scale: float, dims, device_id: int,
                      var: variants.Variants, variant: variants.MaskVariant, dlse=None,
                      mask_offsets: Optional[Tuple[int, int]] = None, opts: Optional[options.Options] = None):
    """_launch_bwd at head dims above 256 (head_dims.py): the preprocess (lse2 and delta into stats rows padded to
    whole 64-row tiles), then one Hopper kernel per gradient (kernels_cu/sm90/bwd_split.cu: dV, dK, dQ, each over
    its own 64-row tiles, no atomics: deterministic). Returns ``(dsinks, None, None)`` (not replayed by the call
    cache)."""
    import cupy

    b, nq, nk, hq, hkv, d = dims
    opts = opts or options.current()
    plan = _split_bwd_plan(q.dtype, d, v.shape[3], causal, device_id, variant, opts)
    stat_rows = -(-nq // 64) * 64
    _check_stat_rows(b * hq * 2 * stat_rows)
    stats = cupy.empty(b * hq * 2 * stat_rows, dtype=np.float32)
    # head_dim: v's, the width of the preprocess's rowsum(dout * out); the split kernels take both head dims as
    # template arguments.
    p = params.pack_bytes(params.BWD_PARAMS, (
        q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, dout.data.ptr, lse.data.ptr, 0, 0,
        dq.data.ptr, dk.data.ptr, dv.data.ptr, 0,
        *params.element_strides(q), *params.element_strides(k), *params.element_strides(v),
        *params.element_strides(out), *params.element_strides(dout), *params.element_strides(dq),
        *params.element_strides(dk), *params.element_strides(dv),
        b, nq, nk, hq, hq // hkv, v.shape[3], scale, scale * LOG2E, 0, 0, 0, 0, stats.data.ptr, stat_rows,
        *var.param_values(nq, nk, scale, *(mask_offsets or ())), dlse.data.ptr if dlse is not None else 0,
        *params.DENSE_VARLEN_VALUES))
    # dQ: the query tiles of each head; dK, dV: the key tiles of each kv head.
    grids = {"dv": (-(-nk // 64), hkv, b), "dk": (-(-nk // 64), hkv, b), "dq": (-(-nq // 64), hq, b)}
    _run_split_bwd(plan, (q, k, v, dout), p, launch.bwd_row_grid(plan[0][1], b, hq, stat_rows), grids)
    dsinks = None
    if var.sinks is not None:   # as _launch_bwd: from delta as the preprocess wrote it beside lse2
        rows = stats.reshape(b, hq, 2, stat_rows)[:, :, 1, :nq]
        dsinks = -(cupy.exp(var.sinks[None, :, None] - lse) * rows).sum(axis=(0, 2))
    capture.keep_if_capturing(stats)
    return dsinks, None, None


def _launch_bwd_varlen_large(dout, q, k, v, out, lse, dq, dk, dv, lay: varlen.VarlenLayout, *, causal: bool,
                             scale: float, var: variants.Variants, dlse=None, opts: Optional[options.Options] = None):
    """_launch_bwd_varlen at head dims above 256: _launch_bwd_large's kernels on the packed rows (a batch of one for
    the tensor maps), each sequence's stats rows in whole 64-row tiles from its padded row (varlen.cuh:
    padded_row0). Returns delta ``(heads_q, total_q)`` float32 (with sinks, 0 outside the used rows)."""
    import cupy

    opts = opts or options.current()
    variant = dataclasses.replace(var.kernel, sink=False, varlen=True)   # no sink code in the backward
    hq, b = lay.heads_q, lay.batch
    plan = _split_bwd_plan(q.dtype, lay.head_dim_qk, lay.head_dim_v, causal, lay.device_id, variant, opts)
    padded = sm90.varlen_padded_rows(lay.total_q, b, 64)
    _check_stat_rows(hq * 2 * padded)
    stats = cupy.empty(hq * 2 * padded, dtype=np.float32)
    # delta's rows outside every sequence are never written: zeros where dsinks sums over all rows (with sinks).
    delta = (cupy.zeros if var.sinks is not None else cupy.empty)((hq, lay.total_q), dtype=np.float32)
    p = params.pack_bytes(params.BWD_PARAMS, (
        q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, dout.data.ptr, lse.data.ptr, delta.data.ptr, 0,
        dq.data.ptr, dk.data.ptr, dv.data.ptr, 0,
        *_packed_strides(q), *_packed_strides(k), *_packed_strides(v), *_packed_strides(out), *_packed_strides(dout),
        *_packed_strides(dq), *_packed_strides(dk), *_packed_strides(dv),
        b, lay.max_seqlen_q, lay.max_seqlen_k, hq, hq // lay.heads_kv, lay.head_dim_v, scale, scale * LOG2E,
        0, 0, 0, 0, stats.data.ptr, padded,
        *var.param_values(lay.max_seqlen_q, lay.max_seqlen_k, scale), dlse.data.ptr if dlse is not None else 0,
        *_varlen_values(lay, 64, None)))
    max_q, max_k = lay.max_seqlen_q, lay.max_seqlen_k
    grids = {"dv": (-(-max_k // 64), lay.heads_kv, b), "dk": (-(-max_k // 64), lay.heads_kv, b),
             "dq": (-(-max_q // 64), hq, b)}
    # The preprocess covers each sequence's whole tiles (its stats rows).
    _run_split_bwd(plan, (q[None], k[None], v[None], dout[None]), p,
                   launch.bwd_row_grid(plan[0][1], b, hq, -(-max_q // 64) * 64), grids)
    capture.keep_if_capturing(delta, stats)
    return delta


class AttentionVJP:
    """The pullback returned by :func:`vjp`: ``dq, dk, dv = pullback(dout)`` (with sinks, ``dq, dk, dv,
    dsinks``).

    Holds only what the backward needs: q, k, v, out, lse and the variant arguments (no seqlen^2 buffer).
    """

    __slots__ = ("q", "k", "v", "out", "lse", "causal", "softmax_scale", "deterministic", "variant_args")

    def __init__(self, q, k, v, out, lse, causal, softmax_scale, deterministic, variant_args=None):
        self.q, self.k, self.v, self.out, self.lse = q, k, v, out, lse
        self.causal, self.softmax_scale, self.deterministic = causal, softmax_scale, deterministic
        self.variant_args = variant_args or {}

    def __call__(self, dout: ndarray, *, dlse: Optional[ndarray] = None, dq: Optional[ndarray] = None,
                 dk: Optional[ndarray] = None, dv: Optional[ndarray] = None) -> Tuple[ndarray, ...]:
        """``(dq, dk, dv)`` (and dsinks) for the output gradient ``dout`` (shaped and typed like q) and,
        optionally, the lse gradient ``dlse``: :func:`backward` with the forward's arrays and options;
        ``dq``/``dk``/``dv`` are optional output buffers."""
        return backward(dout, self.q, self.k, self.v, self.out, self.lse, causal=self.causal,
                        softmax_scale=self.softmax_scale, deterministic=self.deterministic, dlse=dlse,
                        dq=dq, dk=dk, dv=dv, **self.variant_args)


def vjp(q: ndarray, k: ndarray, v: ndarray, *, causal: bool = False,
        softmax_scale: Optional[float] = None, window_size: Tuple[int, int] = (-1, -1), attention_chunk: int = 0,
        softcap: float = 0.0, alibi_slopes: Optional[ndarray] = None, sinks: Optional[ndarray] = None,
        deterministic: bool = False, bias: Optional[ndarray] = None, dropout_p: float = 0.0,
        seed: Union[int, ndarray, None] = None, offset: int = 0, block_mask: Optional[ndarray] = None,
        block_size: Union[int, Tuple[int, int]] = 128, score_mod=None,
        mask_mod=None) -> Tuple[ndarray, AttentionVJP]:
    """Forward pass plus its pullback, in the style of ``jax.vjp``; arguments as :func:`forward`.

    ``out, pullback = cuflash.vjp(q, k, v, causal=True)``, then ``dq, dk, dv = pullback(dout)`` (and what
    :func:`backward` adds: dsinks, dbias, the modifiers' tensor gradients). The pullback keeps q, k, v, out and the
    log-sum-exp alive until it is dropped; a dropout seed given on the device is read again by the backward, so it
    must hold the same values then.
    """
    deterministic = _checks.check_flag("deterministic", deterministic)   # before the forward runs
    variant_args = dict(window_size=window_size, attention_chunk=attention_chunk, softcap=softcap,
                        alibi_slopes=alibi_slopes, sinks=sinks)
    if programmable.given(bias, dropout_p, seed, block_mask, score_mod, mask_mod):
        variant_args.update(bias=bias, dropout_p=dropout_p, seed=seed, offset=offset, block_mask=block_mask,
                            block_size=block_size, score_mod=score_mod, mask_mod=mask_mod)
    out, lse = forward(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True, **variant_args)
    return out, AttentionVJP(q, k, v, out, lse, bool(causal), softmax_scale, deterministic, variant_args)


# ---------------------------------------------------------------------------
# Decoding over a KV cache


def forward_kvcache(q: ndarray, k_cache: ndarray, v_cache: Optional[ndarray], k: Optional[ndarray] = None,
                    v: Optional[ndarray] = None, *, cache_seqlens, rotary_cos: Optional[ndarray] = None,
                    rotary_sin: Optional[ndarray] = None, rotary_interleaved: bool = True,
                    cache_batch_idx: Optional[ndarray] = None, cache_leftpad: Optional[ndarray] = None,
                    block_table: Optional[ndarray] = None, page_table: Optional[ndarray] = None,
                    causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Optional[ndarray] = None, sinks: Optional[ndarray] = None,
                    attention_chunk: int = 0, softmax_scale: Optional[float] = None, num_splits: int = 0,
                    batch_invariant: bool = False, return_lse: bool = False,
                    k_descale: Union[ndarray, float, None] = None, v_descale: Union[ndarray, float, None] = None
                    ) -> Union[ndarray, Tuple[ndarray, ndarray]]:
    """Attention of a few new query tokens per sequence over a KV cache, appending new keys first (flash-attn 2's
    ``flash_attn_with_kvcache``): decoding, chunked prefill and speculative decoding.

    Args:
        q: ``(batch, seqlen_q, heads_q, head_dim)``, float16 or bfloat16.
        k_cache, v_cache: the cache, contiguous ``(batch_cache, seqlen_cache, heads_kv, head_dim)`` (v:
            ``head_dim_v``), or paged ``(num_pages, page_size, heads_kv, head_dim)`` with ``block_table``; q's
            dtype, or fp8: uint8 arrays of e4m3fn bytes (Hopper), each stored element times ``k_descale`` /
            ``v_descale``; heads_q a multiple of heads_kv (GQA: the query heads that share a KV head read it once).
            ``v_cache=None``: MLA's latent cache (FlashMLA's layout, Hopper): head_dim 576, V the first 512 columns of
            each K row (out's head_dim 512); new tokens then come in ``k`` alone (``v=None``), without rotary.
        k, v: optional new keys and values ``(batch, seqlen_new, heads_kv, head_dim / head_dim_v)``, written into
            the caches in place at positions ``cache_seqlens[b] .. + seqlen_new`` (``cache_seqlens`` itself is
            not changed); attention then covers ``cache_seqlens[b] + seqlen_new`` keys.
        cache_seqlens: int32 ``(batch,)`` device array (or a Python int for every sequence): the keys already in
            the cache.
        rotary_cos, rotary_sin: optional ``(seqlen_ro, rotary_dim / 2)`` tables: q and the new k are rotated
            (rotary embedding) before use, the new keys at positions ``cache_seqlens[b] + i``, the queries at
            ``cache_seqlens[b] + t`` with causal or a window, else all at ``cache_seqlens[b]`` (flash-attn's
            convention); ``rotary_interleaved``: pairs ``(2i, 2i + 1)`` (GPT-J) or ``(i, i + rotary_dim / 2)``
            (GPT-NeoX).
        cache_batch_idx: optional int32 ``(batch,)``: the cache row of each sequence (contiguous cache).
        cache_leftpad: optional int32 ``(batch,)``: where each sequence's keys start in its cache row (left-padded
            batches; contiguous caches, as flash-attn): it has ``cache_seqlens[b] + seqlen_new - cache_leftpad[b]`` keys, its positions (rotary,
            causal alignment) count from there, and appends still land at ``cache_seqlens[b]``.
        block_table (or ``page_table``, FlashAttention-3's name): int32 ``(batch, max_blocks)``: sequence b's key
            j is row ``j % page_size`` of page ``block_table[b, j // page_size]``; page sizes: multiples of 16.
        causal, window_size, softcap, alibi_slopes, sinks, attention_chunk, softmax_scale: as :func:`forward`,
            the new tokens aligned to the end of each sequence's keys (bottom-right); a sink joins each row's
            softmax once however the keys are split.
        num_splits: key splits per sequence (split-KV, merged through lse); 0 picks from the work and the GPU.
        batch_invariant: a fixed number of keys per split (cuflash/kvcache.py: BATCH_INVARIANT_KEYS), so that a
            row's result is bitwise the same whatever else is in the batch.
        return_lse: also return lse ``(batch, heads_q, seqlen_q)`` float32.
        k_descale, v_descale: fp8 caches only (default 1): the value of a cached element is its e4m3 value times
            the descale of its KV head: a positive float or a float32 array of one element (per tensor), or a
            float32 array ``(heads_kv,)`` or ``(batch, heads_kv)`` (FlashAttention-3's shape); both of one shape.
            New keys and values (in q's dtype) are stored as ``e4m3(x / descale)`` (rounded to nearest, saturated
            at +-448), after the rotary embedding.

    Returns:
        out ``(batch, seqlen_q, heads_q, head_dim_v)`` in q's dtype, and lse with ``return_lse``.

    No device sync: ``cache_seqlens`` and ``block_table`` are read by the kernels only. Values they cannot check
    never lead outside the cache (cuflash/kvcache.py): keys are clamped to the cache's capacity, appended tokens
    past it are dropped, a block-table entry out of range reads the nearest page and is skipped by the append.
    """
    if page_table is not None:
        if block_table is not None:
            raise ValueError("pass block_table or page_table (its other name), not both")
        block_table = page_table
    if interop.needs_conversion(q, k_cache, v_cache, k, v, cache_seqlens, rotary_cos, rotary_sin, cache_batch_idx,
                                block_table, alibi_slopes, sinks, k_descale, v_descale):
        seqlens_is_int = isinstance(cache_seqlens, (int, np.integer))
        arrays = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v, "rotary_cos": rotary_cos,
                  "rotary_sin": rotary_sin, "cache_batch_idx": cache_batch_idx, "block_table": block_table,
                  "cache_leftpad": cache_leftpad, "alibi_slopes": alibi_slopes, "sinks": sinks}
        scalars = {}
        for name, x in (("k_descale", k_descale), ("v_descale", v_descale)):
            (scalars if x is None or isinstance(x, (int, float, np.number)) else arrays)[name] = x
        if not seqlens_is_int:
            arrays["cache_seqlens"] = cache_seqlens
        return interop.call(
            forward_kvcache, arrays, buffers=("k_cache", "v_cache"),
            **({"cache_seqlens": cache_seqlens} if seqlens_is_int else {}), rotary_interleaved=rotary_interleaved,
            causal=causal, window_size=window_size, softcap=softcap, attention_chunk=attention_chunk,
            softmax_scale=softmax_scale, num_splits=num_splits, batch_invariant=batch_invariant, return_lse=return_lse,
            **scalars)
    from . import kvcache

    latent = v_cache is None
    if latent:
        v_cache, v = kvcache.latent_views(q, k_cache, k, v, rotary_cos)
    lay, cache_seqlens = kvcache.check(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                                       rotary_cos, rotary_sin, cache_leftpad, latent=latent)
    descales = kvcache.check_descales(k_descale, v_descale, lay)
    scale = _checks.check_scale(softmax_scale, lay.head_dim)
    causal = _checks.check_flag("causal", causal)
    batch_invariant = _checks.check_flag("batch_invariant", batch_invariant)
    return_lse = _checks.check_flag("return_lse", return_lse)
    if isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: chosen from the work), got {num_splits!r}")
    var = variants.from_arguments(window_size, attention_chunk, softcap, alibi_slopes, sinks, causal=causal,
                                  batch=lay.batch, heads_q=lay.heads_q, device_id=lay.device_id, q_dtype=q.dtype)
    import cupy

    try:
        with cupy.cuda.Device(lay.device_id):
            out, lse = kvcache.run(q, k_cache, v_cache, k, v, cache_seqlens, lay, rotary_cos=rotary_cos,
                                   rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
                                   cache_batch_idx=cache_batch_idx, block_table=block_table, var=var, scale=scale,
                                   num_splits=int(num_splits), batch_invariant=batch_invariant,
                                   return_lse=return_lse, cache_leftpad=cache_leftpad, descales=descales)
    except RuntimeError as e:   # no driver, no GPU, an old driver or GPU: say which, and what to do
        device_check.reraise_explained(e)
        raise
    return (out, lse) if return_lse else out


def combine(outs: ndarray, lses: ndarray) -> Tuple[ndarray, ndarray]:
    """Merges partial attention results through their log-sum-exps (flash-attn's ``flash_attn_combine``): the
    results of one set of queries over disjoint parts of the keys (split-KV, cascade / shared-prefix attention,
    ring attention's steps).

    Args:
        outs: ``(num_splits, batch, seqlen, heads, head_dim)``, float32, float16 or bfloat16: each part's
            normalised output.
        lses: ``(num_splits, batch, heads, seqlen)`` float32: each part's lse (natural log); ``-inf`` marks a part
            with no key for that row, whose outs rows are not read (they may hold anything).

    Returns:
        ``(out, lse)``: out ``(batch, seqlen, heads, head_dim)`` in outs' dtype, ``sum_s exp(lses[s] - lse)
        outs[s]``, and lse ``(batch, heads, seqlen)`` float32, ``log sum_s exp(lses[s])`` (a row with no key
        anywhere: out 0, lse -inf). Fixed order over the parts: deterministic.
    """
    if interop.needs_conversion(outs, lses):
        return interop.call(combine, {"outs": outs, "lses": lses})
    from . import kvcache

    outs, lses = kvcache.check_combine(outs, lses)
    import cupy

    s, b, n, h, d = outs.shape
    try:
        with cupy.cuda.Device(outs.data.device_id):
            out = cupy.empty((b, n, h, d), dtype=outs.dtype)
            lse = cupy.empty((b, h, n), dtype=np.float32)
            if s == 0:
                out.fill(0)
                lse.fill(-np.inf)
            else:
                kvcache.combine_into(outs, lses, out, lse)
    except RuntimeError as e:
        device_check.reraise_explained(e)
        raise
    return out, lse
