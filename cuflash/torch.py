"""PyTorch front end: ``flash_attn_func`` and ``flash_attn_varlen_func`` on torch CUDA tensors, differentiable,
under ``torch.compile``.

Importing this module imports torch (``import cuflash`` never does). The kernels run as
``torch.library`` custom ops, ``cuflash::attention_forward`` (out, lse) and
``cuflash::attention_backward`` (dq, dk, dv), and for packed variable-length batches
``cuflash::attention_forward_varlen`` and ``cuflash::attention_backward_varlen``, each with a fake (meta)
implementation, so that ``torch.compile(fullgraph=True)`` traces them as single nodes without graph
breaks, and with each backward registered as its forward's autograd formula.

Memory and streams: the outputs are allocated by torch (``new_empty``) and written in place by the
kernels, and every other allocation of the call (the log-sum-exp, the backward's float32 workspaces)
also comes from torch's caching allocator; the kernels run on torch's current stream
(``cuflash.interop``). So the ops need no synchronisation, and under CUDA graph capture their memory
is the graph's. Before a capture, warm up: the kernels compile and load on their first call, and the
Hopper persistent forward makes its tile counter on the first call on each stream.
"""
from typing import Optional, Tuple, Union

import torch

from . import _checks, api, head_dims, kvcache, variants

if not hasattr(torch, "library") or not hasattr(torch.library, "custom_op"):   # pragma: no cover
    raise ImportError(f"cuflash.torch needs PyTorch >= 2.4 (torch.library.custom_op), found {torch.__version__}")

Tensor = torch.Tensor
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                    causal: bool = False, window_size: Tuple[Optional[int], Optional[int]] = (-1, -1),
                    softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                    return_lse: bool = False, *, attention_chunk: int = 0, sinks: Optional[Tensor] = None,
                    learnable_sink: Optional[Tensor] = None) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Exact attention in flash-attn's layout, differentiable with respect to q, k, v, the sinks and lse.

    Args:
        q: ``(batch, seqlen_q, heads_q, head_dim)`` CUDA tensor, float16, bfloat16 or float32;
            head_dim a multiple of 8 up to 576 (v's up to 512; cuflash/head_dims.py). Any strides (a copy
            is made only where the last dimension is not contiguous or a stride is not a multiple of 16 bytes).
        k, v: ``(batch, seqlen_k, heads_kv, head_dim)``, same dtype and device;
            heads_q % heads_kv == 0 (GQA / MQA); v may have a head dim of its own (the output then has it).
        dropout_p: dropout of the probabilities (cuflash.torch.attention: programmable attention's kernels; the
            seed is drawn from torch's CUDA generator).
        softmax_scale: defaults to ``1 / sqrt(head_dim)``.
        causal: query i sees keys j <= i + seqlen_k - seqlen_q (bottom-right aligned).
        window_size: ``(left, right)`` as flash-attn (-1, or None as FA4 writes it: unbounded).
        softcap: 0 (off) or c > 0: scores become c * tanh(s / c).
        alibi_slopes: float32 ``(heads_q,)`` or ``(batch, heads_q)`` (not differentiated).
        deterministic: bitwise reproducible backward (a few percent slower).
        return_lse: also return the log-sum-exp (differentiable).
        attention_chunk: 0 (off) or a chunk length (Llama 4).
        sinks / learnable_sink: ``(heads_q,)`` a learned logit per head (FA4 names it learnable_sink);
            differentiable.

    Returns:
        ``out`` ``(batch, seqlen_q, heads_q, head_dim)`` (contiguous, q's dtype), or ``(out, lse)``
        with ``lse`` float32 ``(batch, heads_q, seqlen_q)``.

    Raises:
        TypeError: not torch tensors, not on a CUDA device, or an unsupported or mixed dtype; flags
            that are not bools.
        ValueError: shapes that do not agree, an unsupported head_dim, bad variant values (cuflash.forward's
            checks).
    """
    if sinks is not None and learnable_sink is not None:
        raise ValueError("give sinks or learnable_sink (the same argument), not both")
    sinks = learnable_sink if sinks is None else sinks
    if dropout_p != 0.0:   # programmable attention's kernels (cuflash/torch_programmable.py), deterministic
        return attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                         attention_chunk=attention_chunk, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                         dropout_p=dropout_p, return_lse=return_lse)
    head_dim = _check_inputs(q, k, v)
    scale = _checks.check_scale(softmax_scale, head_dim)
    causal = _checks.check_flag("causal", causal)
    deterministic = _checks.check_flag("deterministic", deterministic)
    return_lse = _checks.check_flag("return_lse", return_lse)
    left, right, chunk, cap = _variant_options(window_size, attention_chunk, softcap)
    for name, x in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if x is not None and (not isinstance(x, torch.Tensor) or x.device != q.device):
            raise TypeError(f"{name} must be a torch.Tensor on {q.device}, got {type(x).__name__}"
                            + (f" on {x.device}" if isinstance(x, torch.Tensor) else ""))
    out, lse = attention_forward(q, k, v, scale, causal, left, right, chunk, cap, alibi_slopes, sinks, deterministic)
    return (out, lse) if return_lse else out


def _variant_options(window_size, attention_chunk, softcap) -> Tuple[int, int, int, float]:
    """(window left, right, attention_chunk, softcap) checked as cuflash.forward checks them; a window bound may be
    None (FA4's unbounded)."""
    if isinstance(window_size, (tuple, list)) and len(window_size) == 2:
        window_size = tuple(-1 if w is None else w for w in window_size)
    left, right = variants.check_window(window_size)
    return left, right, variants.check_chunk(attention_chunk), variants.check_softcap(softcap)


def _check_inputs(q, k, v) -> int:
    """Checks q, k, v from their metadata alone (so it also runs on fake tensors while
    ``torch.compile`` traces); returns head_dim."""
    _check_tensors(q, k, v, 4, "(batch, seqlen, heads, head_dim)")
    head_dim = _checks.check_qkv_shapes(q, k, v, allow_dv=True)[-1]
    _check_head_dims(head_dim, v.shape[-1])
    return head_dim


def _check_head_dims(head_dim: int, head_dim_v: int) -> None:
    """q's head dim and v's (which may differ: the output has v's) are both kernels' head dims
    (head_dims.check)."""
    head_dims.check(head_dim, head_dim_v)


def _out_shape(q: Tensor, v: Tensor) -> tuple:
    """The output's shape: q's, with v's head dim."""
    return tuple(q.shape[:-1]) + (v.shape[-1],)


def _check_tensors(q, k, v, ndim: int, layout: str) -> None:
    """q, k, v are CUDA tensors of one supported dtype, on one device, with ``ndim`` dimensions."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__module__}.{type(x).__name__} "
                            f"(cuflash.forward takes CuPy arrays)")
        if x.device.type != "cuda":
            raise TypeError(f"{name} must be on a CUDA device, got a tensor on {x.device}; "
                            f"move it with {name}.cuda()")
        if x.dtype not in _DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
        if x.dim() != ndim:
            raise ValueError(f"{name} must have {ndim} dimensions {layout}, got shape {tuple(x.shape)}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}), got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}")


def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: Tuple[Optional[int], Optional[int]] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table: Optional[Tensor] = None, *,
                           seqused_q: Optional[Tensor] = None, seqused_k: Optional[Tensor] = None,
                           attention_chunk: int = 0) -> Union[Tensor, Tuple[Tensor, Tensor, None]]:
    """Exact attention over a packed batch of sequences of their own lengths, as flash-attn 2.x's
    ``flash_attn_varlen_func`` (same arguments, same order), differentiable with respect to q, k, v and lse.

    Sequence ``b`` is queries ``q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]`` against keys and values
    ``k[cu_seqlens_k[b]:cu_seqlens_k[b + 1]]``, ``v[...]`` (``cuflash.forward_varlen``); no work is spent
    on padding.

    Args:
        q: ``(total_q, heads_q, head_dim)`` CUDA tensor, float16, bfloat16 or float32; head_dim a
            multiple of 8 up to 576 (v's up to 512). Any strides (a copy is made only where the last dimension is not
            contiguous or a stride is not a multiple of 16 bytes).
        k, v: ``(total_k, heads_kv, head_dim)``, same dtype and device; heads_q % heads_kv == 0; v may have
            a head dim of its own (the output then has it).
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch + 1,)`` on q's device: the offsets of the sequences'
            first rows, 0 first and the totals last (not differentiated).
        max_seqlen_q, max_seqlen_k: Python ints, at least every sequence's length.
        dropout_p: dropout of the probabilities (cuflash.torch.attention_varlen: programmable attention's
            kernels, deterministic; its seed drawn from torch's CUDA generator).
        softmax_scale: defaults to ``1 / sqrt(head_dim)``.
        causal: per sequence, query i sees keys j <= i + len_k - len_q (bottom-right aligned).
        window_size: ``(left, right)`` as flash-attn (-1, or None as FA4 writes it: unbounded), per sequence.
        softcap: 0 (off) or c > 0: scores become c * tanh(s / c).
        alibi_slopes: float32 ``(heads_q,)`` or ``(batch, heads_q)`` (not differentiated).
        deterministic: bitwise reproducible backward.
        return_attn_probs: also return the log-sum-exp, as flash-attn does: ``(out, softmax_lse, None)``
            (no attention probabilities: cuflash never materialises them).
        block_table: must be None (no paged KV cache yet).
        seqused_q, seqused_k: optional int32 ``(batch,)``: sequence b uses only its first seqused[b]
            rows (queries) or keys (flash-attn 3's names); the other rows get out 0, lse -inf and zero
            gradients.
        attention_chunk: 0 (off) or a chunk length (Llama 4), per sequence.

    The offsets' values are checked on the host (a device-to-host copy and a wait) in eager forward calls
    only: not under ``torch.compile`` nor CUDA graph capture (where unchecked, a bad offset gives wrong
    results for its sequence but never a read or a write outside the tensors), and never in the backward,
    which autograd guarantees sees the offsets the forward saw.

    Returns:
        ``out`` ``(total_q, heads_q, head_dim)`` (contiguous, q's dtype), or with ``return_attn_probs``
        ``(out, softmax_lse, None)`` with ``softmax_lse`` float32 ``(heads_q, total_q)`` (-inf for rows
        that see no key).

    Raises:
        TypeError: not torch tensors, not on q's CUDA device, an unsupported or mixed dtype, offsets that
            are not int32, max_seqlen not an int, flags that are not bools.
        ValueError: ``dropout_p`` outside [0, 1), a ``block_table``, shapes that do not agree, an unsupported
            head_dim, bad variant values; in eager calls, offsets that do not describe the packed tensors
            (cuflash.forward_varlen's checks).
    """
    if dropout_p != 0.0:   # programmable attention's kernels (cuflash/torch_programmable.py), deterministic
        if block_table is not None:
            raise ValueError("block_table must be None: cuflash does not support a paged KV cache here")
        out = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=seqused_q,
                               seqused_k=seqused_k, causal=causal, softmax_scale=softmax_scale,
                               window_size=window_size, attention_chunk=attention_chunk, softcap=softcap,
                               alibi_slopes=alibi_slopes, dropout_p=dropout_p, return_lse=return_attn_probs)
        return (*out, None) if return_attn_probs else out
    if block_table is not None:
        raise ValueError("block_table must be None: cuflash does not support a paged KV cache yet")
    head_dim = _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    max_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k)
    scale = _checks.check_scale(softmax_scale, head_dim)
    causal = _checks.check_flag("causal", causal)
    deterministic = _checks.check_flag("deterministic", deterministic)
    return_attn_probs = _checks.check_flag("return_attn_probs", return_attn_probs)
    if isinstance(window_size, (tuple, list)) and len(window_size) == 2:
        window_size = tuple(-1 if w is None else w for w in window_size)
    left, right = variants.check_window(window_size)
    chunk = variants.check_chunk(attention_chunk)
    cap = variants.check_softcap(softcap)
    if alibi_slopes is not None and (not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.device != q.device):
        raise TypeError(f"alibi_slopes must be a torch.Tensor on {q.device}, got {type(alibi_slopes).__name__}"
                        + (f" on {alibi_slopes.device}" if isinstance(alibi_slopes, torch.Tensor) else ""))
    # Under torch.compile the offsets are traced values and no sync is allowed: no host check (None: the
    # check runs, unless the stream is capturing a CUDA graph).
    check_offsets = False if torch.compiler.is_compiling() else None
    out, lse = attention_forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, seqused_q, seqused_k,
                                        scale, causal, left, right, chunk, cap, alibi_slopes, deterministic,
                                        check_offsets)
    return (out, lse, None) if return_attn_probs else out


def _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k) -> int:
    """Checks the packed q, k, v and the offsets from their metadata alone (never the offsets' values,
    which cuflash.forward_varlen checks in eager calls); returns head_dim."""
    _check_tensors(q, k, v, 3, "(total, heads, head_dim)")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must have the same shape in (total_k, heads_kv), got k {tuple(k.shape)} and "
                         f"v {tuple(v.shape)}")
    _, heads_q, head_dim = q.shape
    if k.shape[2] != head_dim:
        raise ValueError(f"k must have the head_dim of q ({head_dim}), got {k.shape[2]}")
    _checks.check_heads(heads_q, k.shape[1])
    _check_head_dims(head_dim, v.shape[2])
    for name, x, shape in (("cu_seqlens_q", cu_seqlens_q, "(batch + 1,)"), ("cu_seqlens_k", cu_seqlens_k,
                           "(batch + 1,)"), ("seqused_q", seqused_q, "(batch,)"), ("seqused_k", seqused_k, "(batch,)")):
        if x is None and name.startswith("seqused"):
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of int32 {shape}, got "
                            f"{type(x).__module__}.{type(x).__name__}")
        if x.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {x.dtype}; convert with {name}.int()")
        if x.dim() != 1:
            raise ValueError(f"{name} must be 1-D {shape}, got shape {tuple(x.shape)}")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}")
    batch = cu_seqlens_q.shape[0] - 1
    if cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(f"cu_seqlens_k must have the length of cu_seqlens_q (batch + 1 = {batch + 1}), "
                         f"got {cu_seqlens_k.shape[0]}")
    for name, x in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if x is not None and x.shape[0] != batch:
            raise ValueError(f"{name} must have shape (batch,) = ({batch},), got {tuple(x.shape)}")
    return head_dim


def _check_max_seqlen(name: str, value) -> Union[int, "torch.SymInt"]:
    """A host int >= 0 (a SymInt while torch.compile traces with dynamic shapes); a tensor would need a
    device-to-host copy."""
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{name} must be a Python int >= 0 (a bound on every sequence's length, known on the "
                        f"host), got {type(value).__module__}.{type(value).__name__}")
    if isinstance(value, int) and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def _kernel_ready(x: Tensor) -> Tensor:
    """``x`` itself where the kernels can read it in place (last dimension contiguous, pointer and
    strides multiples of 16 bytes), else a contiguous copy; an incoming gradient is often neither
    (``out.sum()`` gives one of stride 0)."""
    size = x.element_size()
    if x.numel() == 0:
        return x
    aligned = x.data_ptr() % 16 == 0 and all(
        s * size % 16 == 0 for s, n in zip(x.stride()[:-1], x.shape[:-1]) if n > 1)
    if aligned and (x.stride(-1) == 1 or x.shape[-1] == 1):
        return x
    return x.clone(memory_format=torch.contiguous_format)


# ---------------------------------------------------------------------------
# The custom ops. Options travel as plain arguments (the scale already resolved, flags as bools) so
# that the schema is fixed; the forward takes `deterministic` only to hand it to its backward.


@torch.library.custom_op("cuflash::attention_forward", mutates_args=())
def attention_forward(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool, window_left: int,
                      window_right: int, attention_chunk: int, softcap: float, alibi_slopes: Optional[Tensor],
                      sinks: Optional[Tensor], deterministic: bool) -> Tuple[Tensor, Tensor]:
    """``(out, lse)``: out ``(B, Nq, Hq, Dv)`` (contiguous, q's dtype), lse float32 ``(B, Hq, Nq)``."""
    q, k, v = _kernel_ready(q), _kernel_ready(k), _kernel_ready(v)
    out = q.new_empty(_out_shape(q, v))
    return api.forward(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=(window_left, window_right),
                       attention_chunk=attention_chunk, softcap=softcap, alibi_slopes=_detached(alibi_slopes),
                       sinks=_detached(sinks), return_lse=True, out=out)


@attention_forward.register_fake
def _attention_forward_fake(q, k, v, softmax_scale, causal, window_left, window_right, attention_chunk, softcap,
                            alibi_slopes, sinks, deterministic):
    b, nq, hq, _ = q.shape
    return q.new_empty(_out_shape(q, v)), q.new_empty((b, hq, nq), dtype=torch.float32)


@torch.library.custom_op("cuflash::attention_backward", mutates_args=())
def attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       dlse: Optional[Tensor], softmax_scale: float, causal: bool, window_left: int,
                       window_right: int, attention_chunk: int, softcap: float, alibi_slopes: Optional[Tensor],
                       sinks: Optional[Tensor], deterministic: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dsinks)`` shaped and typed like q, k, v (contiguous) and sinks (empty without)."""
    dout, q, k, v, out = (_kernel_ready(x) for x in (dout, q, k, v, out))
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    grads = api.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                         window_size=(window_left, window_right), attention_chunk=attention_chunk, softcap=softcap,
                         alibi_slopes=_detached(alibi_slopes), sinks=_detached(sinks),
                         dlse=None if dlse is None else dlse.contiguous(), deterministic=deterministic,
                         dq=dq, dk=dk, dv=dv)
    dsinks = grads[3] if sinks is not None else q.new_empty((0,))
    return grads[0], grads[1], grads[2], dsinks


@attention_backward.register_fake
def _attention_backward_fake(dout, q, k, v, out, lse, dlse, softmax_scale, causal, window_left, window_right,
                             attention_chunk, softcap, alibi_slopes, sinks, deterministic):
    dsinks = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty((0,))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _detached(x: Optional[Tensor]) -> Optional[Tensor]:
    return None if x is None else x.detach()


_OPTIONS = ("softmax_scale", "causal", "window_left", "window_right", "attention_chunk", "softcap")


def _save_for_backward(ctx, inputs, output) -> None:
    q, k, v, *options, alibi_slopes, sinks, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, sinks)
    ctx.options, ctx.deterministic = tuple(options), deterministic


def _attention_vjp(ctx, dout, dlse):
    q, k, v, out, lse, alibi_slopes, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = attention_backward(dout, q, k, v, out, lse, dlse, *ctx.options, alibi_slopes, sinks,
                                            ctx.deterministic)
    return (dq, dk, dv) + (None,) * len(_OPTIONS) + (None, dsinks if sinks is not None else None, None)


attention_forward.register_autograd(_attention_vjp, setup_context=_save_for_backward)


# ---------------------------------------------------------------------------
# The varlen ops: packed (total, heads, head_dim) tensors and their int32 offsets. max_seqlen_q / max_seqlen_k
# are ints (SymInts when traced); check_offsets is None (eager: checked unless capturing) or False (traced).


@torch.library.custom_op("cuflash::attention_forward_varlen", mutates_args=())
def attention_forward_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                             max_seqlen_q: int, max_seqlen_k: int, seqused_q: Optional[Tensor],
                             seqused_k: Optional[Tensor], softmax_scale: float, causal: bool, window_left: int,
                             window_right: int, attention_chunk: int, softcap: float, alibi_slopes: Optional[Tensor],
                             deterministic: bool, check_offsets: Optional[bool]) -> Tuple[Tensor, Tensor]:
    """``(out, lse)``: out ``(total_q, Hq, Dv)`` (contiguous, q's dtype), lse float32 ``(Hq, total_q)``."""
    q, k, v = _kernel_ready(q), _kernel_ready(k), _kernel_ready(v)
    out = q.new_empty(_out_shape(q, v))
    return api.forward_varlen(q, k, v, _index(cu_seqlens_q), _index(cu_seqlens_k), max_seqlen_q, max_seqlen_k,
                              seqused_q=_index(seqused_q), seqused_k=_index(seqused_k), causal=causal,
                              softmax_scale=softmax_scale, window_size=(window_left, window_right),
                              attention_chunk=attention_chunk, softcap=softcap, alibi_slopes=_detached(alibi_slopes),
                              return_lse=True, out=out, check_offsets=check_offsets)


@attention_forward_varlen.register_fake
def _attention_forward_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                                   seqused_k, softmax_scale, causal, window_left, window_right, attention_chunk,
                                   softcap, alibi_slopes, deterministic, check_offsets):
    total_q, hq, _ = q.shape
    return q.new_empty(_out_shape(q, v)), q.new_empty((hq, total_q), dtype=torch.float32)


@torch.library.custom_op("cuflash::attention_backward_varlen", mutates_args=())
def attention_backward_varlen(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                              dlse: Optional[Tensor], cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                              max_seqlen_k: int, seqused_q: Optional[Tensor], seqused_k: Optional[Tensor],
                              softmax_scale: float, causal: bool, window_left: int, window_right: int,
                              attention_chunk: int, softcap: float, alibi_slopes: Optional[Tensor],
                              deterministic: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` shaped and typed like q, k, v (contiguous).

    The offsets are not checked on the host (check_offsets=False: no sync in the backward): called as the
    forward's autograd formula they are the tensors the forward saw, unchanged (autograd's version check on
    saved tensors refuses in-place writes), so the forward checked them where it could; and unchecked, a bad
    offset still never makes a kernel read or write outside the tensors."""
    dout, q, k, v, out = (_kernel_ready(x) for x in (dout, q, k, v, out))
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    dq, dk, dv = api.backward_varlen(
        dout, q, k, v, out, lse, _index(cu_seqlens_q), _index(cu_seqlens_k), max_seqlen_q, max_seqlen_k,
        seqused_q=_index(seqused_q), seqused_k=_index(seqused_k), causal=causal, softmax_scale=softmax_scale,
        window_size=(window_left, window_right), attention_chunk=attention_chunk, softcap=softcap,
        alibi_slopes=_detached(alibi_slopes), dlse=None if dlse is None else dlse.contiguous(),
        deterministic=deterministic, dq=dq, dk=dk, dv=dv, check_offsets=False)
    return dq, dk, dv


@attention_backward_varlen.register_fake
def _attention_backward_varlen_fake(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, seqused_q, seqused_k, softmax_scale, causal, window_left,
                                    window_right, attention_chunk, softcap, alibi_slopes, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _index(x: Optional[Tensor]) -> Optional[Tensor]:
    """An offsets or seqused tensor as the kernels read it (1-D, contiguous int32), or None."""
    return None if x is None else x.detach().contiguous()


# The forward's inputs after q, k, v: the offsets, the max_seqlens, seqused, the options, alibi_slopes,
# deterministic and check_offsets, none of them differentiated.
_VARLEN_NOT_DIFFERENTIATED = 2 + 2 + 2 + len(_OPTIONS) + 3


def _save_for_backward_varlen(ctx, inputs, output) -> None:
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, *options, alibi_slopes,
     deterministic, _check_offsets) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes)
    ctx.max_seqlens, ctx.options, ctx.deterministic = (max_seqlen_q, max_seqlen_k), tuple(options), deterministic


def _attention_varlen_vjp(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes = ctx.saved_tensors
    dq, dk, dv = attention_backward_varlen(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k,
                                           *ctx.max_seqlens, seqused_q, seqused_k, *ctx.options, alibi_slopes,
                                           ctx.deterministic)
    return (dq, dk, dv) + (None,) * _VARLEN_NOT_DIFFERENTIATED


attention_forward_varlen.register_autograd(_attention_varlen_vjp, setup_context=_save_for_backward_varlen)


# ---------------------------------------------------------------------------
# Decoding over a KV cache (flash-attn 2's flash_attn_with_kvcache). The op writes the new keys and values into
# the caches (declared mutated), so a captured decode step replays with whatever the caches and cache_seqlens hold.


def flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Optional[Tensor], k: Optional[Tensor] = None,
                            v: Optional[Tensor] = None, rotary_cos: Optional[Tensor] = None,
                            rotary_sin: Optional[Tensor] = None, cache_seqlens: Optional[Union[int, Tensor]] = None,
                            cache_batch_idx: Optional[Tensor] = None, cache_leftpad: Optional[Tensor] = None,
                            block_table: Optional[Tensor] = None, softmax_scale: Optional[float] = None,
                            causal: bool = False, window_size: Tuple[Optional[int], Optional[int]] = (-1, -1),
                            softcap: float = 0.0, rotary_interleaved: bool = True,
                            alibi_slopes: Optional[Tensor] = None, num_splits: int = 0,
                            return_softmax_lse: bool = False, *, sinks: Optional[Tensor] = None,
                            attention_chunk: int = 0, page_table: Optional[Tensor] = None,
                            batch_invariant: bool = False, k_descale: Optional[Tensor] = None,
                            v_descale: Optional[Tensor] = None) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """flash-attn 2's ``flash_attn_with_kvcache`` (same arguments, order and defaults) on torch CUDA tensors, as the
    custom op ``cuflash::attention_kvcache`` (CUDA graphs: warm up before capturing, as every op here).
    ``cache_seqlens`` None means every cache row is full (``k_cache.shape[1]`` keys). Extra keyword arguments:
    ``sinks``, ``attention_chunk``, ``page_table`` (FlashAttention-3's name for ``block_table``),
    ``batch_invariant``, and for fp8 caches (``torch.float8_e4m3fn`` or uint8 e4m3 bytes, Hopper) ``k_descale`` /
    ``v_descale``: float32 tensors of one element, ``(heads_kv,)`` or ``(batch, heads_kv)`` (FlashAttention-3's)
    (:func:`cuflash.forward_kvcache`). ``v_cache=None`` (with ``v=None``): MLA's latent cache, head_dim 576, V the
    first 512 columns of each K row (FlashMLA's layout, Hopper). Not differentiable (inference).

    Returns ``out`` ``(batch, seqlen_q, heads_q, head_dim_v)``, or ``(out, lse)`` with ``return_softmax_lse``."""
    if page_table is not None:
        if block_table is not None:
            raise ValueError("pass block_table or page_table (its other name), not both")
        block_table = page_table
    if not isinstance(q, Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if cache_seqlens is None or isinstance(cache_seqlens, int):
        full = k_cache.shape[1] if cache_seqlens is None else cache_seqlens
        if block_table is not None and cache_seqlens is None:
            full = block_table.shape[1] * k_cache.shape[1]
        cache_seqlens = torch.full((q.shape[0],), full, dtype=torch.int32, device=q.device)
    left, right = variants.check_window(window_size)
    scale = _checks.check_scale(softmax_scale, q.shape[-1])
    if k_cache.dtype == torch.float8_e4m3fn:   # as their bytes: DLPack has no float8 type everywhere
        k_cache = k_cache.view(torch.uint8)
        v_cache = None if v_cache is None else v_cache.view(torch.uint8)
    out, lse = attention_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                 cache_leftpad, block_table, scale, bool(causal), left, right, float(softcap),
                                 bool(rotary_interleaved), alibi_slopes, sinks, int(attention_chunk), int(num_splits),
                                 bool(batch_invariant), k_descale, v_descale)
    return (out, lse) if return_softmax_lse else out


@torch.library.custom_op("cuflash::attention_kvcache", mutates_args=("k_cache", "v_cache"))
def attention_kvcache(q: Tensor, k_cache: Tensor, v_cache: Optional[Tensor], k: Optional[Tensor], v: Optional[Tensor],
                      rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor], cache_seqlens: Tensor,
                      cache_batch_idx: Optional[Tensor], cache_leftpad: Optional[Tensor], block_table: Optional[Tensor],
                      softmax_scale: float,
                      causal: bool, window_left: int, window_right: int, softcap: float, rotary_interleaved: bool,
                      alibi_slopes: Optional[Tensor], sinks: Optional[Tensor], attention_chunk: int, num_splits: int,
                      batch_invariant: bool, k_descale: Optional[Tensor] = None,
                      v_descale: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``(out, lse)``: out ``(B, Nq, Hq, Dv)`` (contiguous, q's dtype), lse float32 ``(B, Hq, Nq)``."""
    return api.forward_kvcache(
        _kernel_ready(q), k_cache, v_cache, None if k is None else _kernel_ready(k),
        None if v is None else _kernel_ready(v), cache_seqlens=cache_seqlens, rotary_cos=rotary_cos,
        rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved, cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad, block_table=block_table, causal=causal, window_size=(window_left, window_right),
        softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, attention_chunk=attention_chunk,
        softmax_scale=softmax_scale, num_splits=num_splits, batch_invariant=batch_invariant, return_lse=True,
        k_descale=k_descale, v_descale=v_descale)


@attention_kvcache.register_fake
def _attention_kvcache_fake(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                            cache_leftpad, block_table, softmax_scale, causal, window_left, window_right, softcap,
                            rotary_interleaved, alibi_slopes, sinks, attention_chunk, num_splits, batch_invariant,
                            k_descale=None, v_descale=None):
    b, nq, hq, _ = q.shape
    dv = kvcache.MLA_HEAD_DIMS[1] if v_cache is None else v_cache.shape[-1]
    return q.new_empty((b, nq, hq, dv)), q.new_empty((b, hq, nq), dtype=torch.float32)


# Programmable attention (bias, dropout, block masks, modifiers): its own ops, in their own module.
from .torch_programmable import attention, attention_varlen  # noqa: E402,F401
