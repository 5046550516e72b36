"""PyTorch front end of programmable attention (issue #45): ``cuflash.torch.attention`` (and ``attention_varlen``
for packed batches) with a bias, dropout, a block mask and user modifiers, differentiable with respect to q, k, v,
the bias and the score modifier's tensors that have ``tensor_grads``, as the custom ops
``cuflash::attention_forward_prog`` / ``cuflash::attention_backward_prog`` (and their ``attention_varlen_`` twins;
fake implementations for ``torch.compile``; the backward registered as the forward's autograd formula).

Modifiers cross the ops' fixed schema as their key (a string: cuflash.modifiers.Modifiers.key) and the list of
their tensors: the ScoreMod / MaskMod objects are kept here by key, and each call binds them to the tensors it is
given (as CuPy views). Dropout's seed is drawn on the device from torch's CUDA generator at each forward call
(``torch.manual_seed`` reproduces it, and a captured CUDA graph draws a new one on each replay) and saved for the
backward. Imported by :mod:`cuflash.torch`.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from . import _checks, block_sparse
from .modifiers import MaskMod, Modifiers, ScoreMod

Tensor = torch.Tensor

# Modifiers.key -> (score_mod, mask_mod) as the caller built them; their tensors are replaced per call.
_MODIFIERS: dict = {}
# (key, tensor addresses) -> the bound MaskMod, so that its tile evaluation (cached on the object) is reused.
_BOUND_MASKS: dict = {}


def _call_options(q, causal, return_lse, window_size, attention_chunk, softcap, block_size, dropout_p, score_mod,
                  mask_mod) -> tuple:
    """attention's and attention_varlen's static arguments, checked: (causal, return_lse, (window left, right,
    chunk, softcap), (block rows, block keys), the modifiers' registry key, their tensors, the dropout's rng state
    (int64 (2,) on q's device, drawn from torch's generator) or None)."""
    from .torch import _variant_options

    causal = _checks.check_flag("causal", causal)
    return_lse = _checks.check_flag("return_lse", return_lse)
    variant = _variant_options(window_size, attention_chunk, softcap)
    block = block_sparse.check_block_size(block_size)
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    key, tensors = register(score_mod, mask_mod)
    rng_state = None
    if dropout_p > 0:
        rng_state = torch.randint(0, 2**62, (2,), device=q.device, dtype=torch.int64)
    return causal, return_lse, variant, block, key, tensors, rng_state


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, softmax_scale: Optional[float] = None,
              window_size: Tuple[int, int] = (-1, -1), attention_chunk: int = 0, softcap: float = 0.0,
              alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None, bias: Optional[Tensor] = None,
              dropout_p: float = 0.0, block_mask: Optional[Tensor] = None, block_size=128,
              score_mod: Optional[ScoreMod] = None, mask_mod: Optional[MaskMod] = None, return_lse: bool = False):
    """Programmable attention on torch CUDA tensors (cuflash.forward's arguments and meaning, flash-attn's
    layout), differentiable with respect to q, k, v, ``bias`` and the tensors of ``score_mod`` that have
    ``tensor_grads``. The modifiers' tensors are torch CUDA tensors on q's device. Returns ``out`` or
    ``(out, lse)``."""
    from .torch import _check_inputs

    scale = _checks.check_scale(softmax_scale, _check_inputs(q, k, v))
    causal, return_lse, (left, right, chunk, cap), (bq, bk), key, tensors, rng_state = _call_options(
        q, causal, return_lse, window_size, attention_chunk, softcap, block_size, dropout_p, score_mod, mask_mod)
    out, lse = attention_forward_prog(q, k, v, bias, rng_state, block_mask, tensors, scale, causal, left, right, chunk,
                                      cap, alibi_slopes, sinks, float(dropout_p), bq, bk, key)
    return (out, lse) if return_lse else out


def register(score_mod: Optional[ScoreMod], mask_mod: Optional[MaskMod]) -> Tuple[str, List[Tensor]]:
    """(key, tensors) of the modifiers as the ops take them ("" and [] for none), kept by key."""
    if score_mod is None and mask_mod is None:
        return "", []
    mods = Modifiers(score_mod, mask_mod)
    _MODIFIERS[mods.key] = (score_mod, mask_mod)
    tensors = list(mods.slots.values())
    for name, t in zip(mods.slots, tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"modifier tensor {name!r} must be a torch.Tensor here, got {type(t).__name__}")
    return mods.key, tensors


def _bound(key: str, tensors: List[Tensor]):
    """The caller's modifiers of ``key`` bound to ``tensors`` (CuPy views, in slot order)."""
    if not key:
        return None, None
    import cupy

    score_mod, mask_mod = _MODIFIERS[key]
    views = [cupy.from_dlpack(t.detach()) for t in tensors]
    names = list(Modifiers(score_mod, mask_mod).slots)
    arrays = dict(zip(names, views))
    bound_score = None if score_mod is None else ScoreMod(
        score_mod.source, score_mod.grad, tensors={n: arrays[n] for n in score_mod.tensors},
        tensor_grads=score_mod.tensor_grads)
    bound_mask = None
    if mask_mod is not None:
        addresses = (key,) + tuple(t.data_ptr() for t in tensors)
        bound_mask = _BOUND_MASKS.get(addresses)
        if bound_mask is None:
            bound_mask = _BOUND_MASKS[addresses] = MaskMod(mask_mod.source,
                                                           tensors={n: arrays[n] for n in mask_mod.tensors},
                                                           per_batch=mask_mod.per_batch, per_head=mask_mod.per_head)
    return bound_score, bound_mask


def _detached(x: Optional[Tensor]) -> Optional[Tensor]:
    return None if x is None else x.detach()


@torch.library.custom_op("cuflash::attention_forward_prog", mutates_args=())
def attention_forward_prog(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], rng_state: Optional[Tensor],
                           block_mask: Optional[Tensor], mod_tensors: List[Tensor], softmax_scale: float, causal: bool,
                           window_left: int, window_right: int, attention_chunk: int, softcap: float,
                           alibi_slopes: Optional[Tensor], sinks: Optional[Tensor], dropout_p: float, block_q: int,
                           block_k: int, mods: str) -> Tuple[Tensor, Tensor]:
    """``(out, lse)`` of cuflash.forward with the programmable arguments."""
    from . import api
    from .torch import _kernel_ready, _out_shape

    q, k, v = _kernel_ready(q), _kernel_ready(k), _kernel_ready(v)
    score_mod, mask_mod = _bound(mods, mod_tensors)
    out = q.new_empty(_out_shape(q, v))
    return api.forward(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=(window_left, window_right),
                       attention_chunk=attention_chunk, softcap=softcap, alibi_slopes=_detached(alibi_slopes),
                       sinks=_detached(sinks), return_lse=True, out=out, bias=_detached(bias), dropout_p=dropout_p,
                       seed=rng_state, block_mask=block_mask, block_size=(block_q, block_k), score_mod=score_mod,
                       mask_mod=mask_mod)


@attention_forward_prog.register_fake
def _attention_forward_prog_fake(q, k, v, bias, rng_state, block_mask, mod_tensors, softmax_scale, causal, window_left,
                                 window_right, attention_chunk, softcap, alibi_slopes, sinks, dropout_p, block_q,
                                 block_k, mods):
    from .torch import _out_shape

    b, nq, hq, _ = q.shape
    return q.new_empty(_out_shape(q, v)), q.new_empty((b, hq, nq), dtype=torch.float32)


@torch.library.custom_op("cuflash::attention_backward_prog", mutates_args=())
def attention_backward_prog(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                            dlse: Optional[Tensor], bias: Optional[Tensor], rng_state: Optional[Tensor],
                            block_mask: Optional[Tensor], mod_tensors: List[Tensor], softmax_scale: float,
                            causal: bool, window_left: int, window_right: int, attention_chunk: int, softcap: float,
                            alibi_slopes: Optional[Tensor], sinks: Optional[Tensor], dropout_p: float, block_q: int,
                            block_k: int, mods: str) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, List[Tensor]]:
    """``(dq, dk, dv, dsinks, dbias, mod_grads)``: dsinks / dbias empty without sinks / bias; mod_grads one per
    modifier tensor (float32, the tensor's shape; empty for those without tensor_grads)."""
    from . import api
    from .torch import _kernel_ready

    dout, q, k, v, out = (_kernel_ready(x) for x in (dout, q, k, v, out))
    score_mod, mask_mod = _bound(mods, mod_tensors)
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    grads = list(api.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                              window_size=(window_left, window_right), attention_chunk=attention_chunk,
                              softcap=softcap, alibi_slopes=_detached(alibi_slopes), sinks=_detached(sinks),
                              dlse=None if dlse is None else dlse.contiguous(), dq=dq, dk=dk, dv=dv,
                              bias=_detached(bias), dropout_p=dropout_p, seed=rng_state, block_mask=block_mask,
                              block_size=(block_q, block_k), score_mod=score_mod, mask_mod=mask_mod))
    return _split_grads(grads, q, bias, sinks, mods, mod_tensors)


def _split_grads(grads: list, q: Tensor, bias, sinks, mods: str, mod_tensors: List[Tensor]) -> tuple:
    """The backward's results (dq, dk, dv, [dsinks], [dbias], [{name: gradient}]) in the ops' fixed layout:
    ``(dq, dk, dv, dsinks, dbias, mod_grads)``, empty tensors for what the call has not."""
    dq, dk, dv = grads[:3]
    rest = grads[3:]
    dsinks = rest.pop(0) if sinks is not None else q.new_empty((0,))
    dbias = rest.pop(0) if bias is not None else q.new_empty((0,))
    by_name = rest.pop(0) if rest else {}
    names = list(Modifiers(*_MODIFIERS[mods]).slots) if mods else []
    mod_grads = [by_name[n] if n in by_name else t.new_empty((0,), dtype=torch.float32)
                 for n, t in zip(names, mod_tensors)]
    return dq, dk, dv, dsinks, dbias, mod_grads


@attention_backward_prog.register_fake
def _attention_backward_prog_fake(dout, q, k, v, out, lse, dlse, bias, rng_state, block_mask, mod_tensors,
                                  softmax_scale, causal, window_left, window_right, attention_chunk, softcap,
                                  alibi_slopes, sinks, dropout_p, block_q, block_k, mods):
    dsinks = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty((0,))
    dbias = bias.new_empty(bias.shape) if bias is not None else q.new_empty((0,))
    with_grads = set(_MODIFIERS[mods][0].tensor_grads) if mods and _MODIFIERS[mods][0] is not None else set()
    names = list(Modifiers(*_MODIFIERS[mods]).slots) if mods else []
    mod_grads = [t.new_empty(t.shape, dtype=torch.float32) if n in with_grads else t.new_empty((0,), dtype=torch.float32)
                 for n, t in zip(names, mod_tensors)]
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks, dbias, mod_grads


def _save_for_backward(ctx, inputs, output) -> None:
    q, k, v, bias, rng_state, block_mask, mod_tensors, *options = inputs
    out, lse = output
    *flags, alibi_slopes, sinks, dropout_p, block_q, block_k, mods = options
    ctx.save_for_backward(q, k, v, out, lse, bias, rng_state, block_mask, alibi_slopes, sinks, *mod_tensors)
    ctx.flags, ctx.rest = tuple(flags), (dropout_p, block_q, block_k, mods)
    ctx.n_mod = len(mod_tensors)


def _vjp(ctx, dout, dlse):
    q, k, v, out, lse, bias, rng_state, block_mask, alibi_slopes, sinks, *mod_tensors = ctx.saved_tensors
    dq, dk, dv, dsinks, dbias, mod_grads = attention_backward_prog(
        dout, q, k, v, out, lse, dlse, bias, rng_state, block_mask, mod_tensors, *ctx.flags, alibi_slopes, sinks,
        *ctx.rest)
    tensor_grads = [None if g.numel() == 0 and t.numel() != 0 else g.to(t.dtype) for g, t in zip(mod_grads, mod_tensors)]
    return (dq, dk, dv, dbias if bias is not None else None, None, None, tensor_grads) + (None,) * 6 + \
        (None, dsinks if sinks is not None else None) + (None,) * 4


attention_forward_prog.register_autograd(_vjp, setup_context=_save_for_backward)


# ---------------------------------------------------------------------------
# Packed (varlen) batches: cuflash.forward_varlen / backward_varlen with the programmable arguments.


def attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, *, seqused_q: Optional[Tensor] = None, seqused_k: Optional[Tensor] = None,
                     causal: bool = False, softmax_scale: Optional[float] = None,
                     window_size: Tuple[int, int] = (-1, -1), attention_chunk: int = 0, softcap: float = 0.0,
                     alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
                     bias: Optional[Tensor] = None, dropout_p: float = 0.0, block_mask: Optional[Tensor] = None,
                     block_size=128, score_mod: Optional[ScoreMod] = None, mask_mod: Optional[MaskMod] = None,
                     return_lse: bool = False):
    """Programmable attention on a packed batch of torch CUDA tensors (cuflash.forward_varlen's arguments and
    meaning: sequence b sees batch index b of the bias, block mask, dropout stream and modifiers at its own
    positions), differentiable with respect to q, k, v, ``bias``, ``sinks`` and the tensors of ``score_mod`` that
    have ``tensor_grads``. q ``(total_q, heads_q, head_dim)``; returns ``out`` ``(total_q, heads_q, head_dim_v)`` or
    ``(out, lse)`` with lse float32 ``(heads_q, total_q)``."""
    from .torch import _check_max_seqlen, _check_varlen_inputs

    scale = _checks.check_scale(softmax_scale, _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q,
                                                                     seqused_k))
    max_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k)
    causal, return_lse, (left, right, chunk, cap), (bq, bk), key, tensors, rng_state = _call_options(
        q, causal, return_lse, window_size, attention_chunk, softcap, block_size, dropout_p, score_mod, mask_mod)
    check_offsets = False if torch.compiler.is_compiling() else None
    out, lse = attention_varlen_forward_prog(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, seqused_q, seqused_k,
                                             bias, rng_state, block_mask, tensors, scale, causal, left, right, chunk,
                                             cap, alibi_slopes, sinks, float(dropout_p), bq, bk, key, check_offsets)
    return (out, lse) if return_lse else out


@torch.library.custom_op("cuflash::attention_varlen_forward_prog", mutates_args=())
def attention_varlen_forward_prog(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                  max_seqlen_q: int, max_seqlen_k: int, seqused_q: Optional[Tensor],
                                  seqused_k: Optional[Tensor], bias: Optional[Tensor], rng_state: Optional[Tensor],
                                  block_mask: Optional[Tensor], mod_tensors: List[Tensor], softmax_scale: float,
                                  causal: bool, window_left: int, window_right: int, attention_chunk: int,
                                  softcap: float, alibi_slopes: Optional[Tensor], sinks: Optional[Tensor],
                                  dropout_p: float, block_q: int, block_k: int, mods: str,
                                  check_offsets: Optional[bool]) -> Tuple[Tensor, Tensor]:
    """``(out, lse)`` of cuflash.forward_varlen with the programmable arguments."""
    from . import api
    from .torch import _index, _kernel_ready, _out_shape

    q, k, v = _kernel_ready(q), _kernel_ready(k), _kernel_ready(v)
    score_mod, mask_mod = _bound(mods, mod_tensors)
    out = q.new_empty(_out_shape(q, v))
    return api.forward_varlen(q, k, v, _index(cu_seqlens_q), _index(cu_seqlens_k), max_seqlen_q, max_seqlen_k,
                              seqused_q=_index(seqused_q), seqused_k=_index(seqused_k), causal=causal,
                              softmax_scale=softmax_scale, window_size=(window_left, window_right),
                              attention_chunk=attention_chunk, softcap=softcap, alibi_slopes=_detached(alibi_slopes),
                              sinks=_detached(sinks), return_lse=True, out=out, check_offsets=check_offsets,
                              bias=_detached(bias), dropout_p=dropout_p, seed=rng_state, block_mask=block_mask,
                              block_size=(block_q, block_k), score_mod=score_mod, mask_mod=mask_mod)


@attention_varlen_forward_prog.register_fake
def _attention_varlen_forward_prog_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                                        seqused_k, bias, rng_state, block_mask, mod_tensors, softmax_scale, causal,
                                        window_left, window_right, attention_chunk, softcap, alibi_slopes, sinks,
                                        dropout_p, block_q, block_k, mods, check_offsets):
    from .torch import _out_shape

    total_q, hq, _ = q.shape
    return q.new_empty(_out_shape(q, v)), q.new_empty((hq, total_q), dtype=torch.float32)


@torch.library.custom_op("cuflash::attention_varlen_backward_prog", mutates_args=())
def attention_varlen_backward_prog(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                   dlse: Optional[Tensor], cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                   max_seqlen_q: int, max_seqlen_k: int, seqused_q: Optional[Tensor],
                                   seqused_k: Optional[Tensor], bias: Optional[Tensor], rng_state: Optional[Tensor],
                                   block_mask: Optional[Tensor], mod_tensors: List[Tensor], softmax_scale: float,
                                   causal: bool, window_left: int, window_right: int, attention_chunk: int,
                                   softcap: float, alibi_slopes: Optional[Tensor], sinks: Optional[Tensor],
                                   dropout_p: float, block_q: int, block_k: int, mods: str
                                   ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, List[Tensor]]:
    """``(dq, dk, dv, dsinks, dbias, mod_grads)`` as attention_backward_prog's (the offsets unchecked, as the plain
    varlen backward's: the forward saw them)."""
    from . import api
    from .torch import _index, _kernel_ready

    dout, q, k, v, out = (_kernel_ready(x) for x in (dout, q, k, v, out))
    score_mod, mask_mod = _bound(mods, mod_tensors)
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    grads = list(api.backward_varlen(
        dout, q, k, v, out, lse, _index(cu_seqlens_q), _index(cu_seqlens_k), max_seqlen_q, max_seqlen_k,
        seqused_q=_index(seqused_q), seqused_k=_index(seqused_k), causal=causal, softmax_scale=softmax_scale,
        window_size=(window_left, window_right), attention_chunk=attention_chunk, softcap=softcap,
        alibi_slopes=_detached(alibi_slopes), sinks=_detached(sinks), dlse=None if dlse is None else dlse.contiguous(),
        dq=dq, dk=dk, dv=dv, check_offsets=False, bias=_detached(bias), dropout_p=dropout_p, seed=rng_state,
        block_mask=block_mask, block_size=(block_q, block_k), score_mod=score_mod, mask_mod=mask_mod))
    return _split_grads(grads, q, bias, sinks, mods, mod_tensors)


@attention_varlen_backward_prog.register_fake
def _attention_varlen_backward_prog_fake(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                         max_seqlen_k, seqused_q, seqused_k, bias, rng_state, block_mask, mod_tensors,
                                         softmax_scale, causal, window_left, window_right, attention_chunk, softcap,
                                         alibi_slopes, sinks, dropout_p, block_q, block_k, mods):
    return _attention_backward_prog_fake(dout, q, k, v, out, lse, dlse, bias, rng_state, block_mask, mod_tensors,
                                         softmax_scale, causal, window_left, window_right, attention_chunk, softcap,
                                         alibi_slopes, sinks, dropout_p, block_q, block_k, mods)


def _save_for_backward_varlen(ctx, inputs, output) -> None:
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, bias, rng_state,
     block_mask, mod_tensors, *options) = inputs
    out, lse = output
    *flags, alibi_slopes, sinks, dropout_p, block_q, block_k, mods, _check_offsets = options
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, bias, rng_state,
                          block_mask, alibi_slopes, sinks, *mod_tensors)
    ctx.max_seqlens, ctx.flags, ctx.rest = (max_seqlen_q, max_seqlen_k), tuple(flags), (dropout_p, block_q, block_k,
                                                                                        mods)


def _vjp_varlen(ctx, dout, dlse):
    (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, bias, rng_state, block_mask, alibi_slopes,
     sinks, *mod_tensors) = ctx.saved_tensors
    dq, dk, dv, dsinks, dbias, mod_grads = attention_varlen_backward_prog(
        dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, *ctx.max_seqlens, seqused_q, seqused_k, bias,
        rng_state, block_mask, mod_tensors, *ctx.flags, alibi_slopes, sinks, *ctx.rest)
    tensor_grads = [None if g.numel() == 0 and t.numel() != 0 else g.to(t.dtype) for g, t in zip(mod_grads, mod_tensors)]
    # In the forward op's input order: q, k, v; offsets, max lengths, seqused; bias; rng_state, block_mask; the
    # modifier tensors; the six options; alibi_slopes, sinks; dropout_p, block_q, block_k, mods, check_offsets.
    return (dq, dk, dv) + (None,) * 6 + (dbias if bias is not None else None, None, None, tensor_grads) + \
        (None,) * 6 + (None, dsinks if sinks is not None else None) + (None,) * 5


attention_varlen_forward_prog.register_autograd(_vjp_varlen, setup_context=_save_for_backward_varlen)
