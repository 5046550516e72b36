"""PyTorch front end: ``flash_attn_func`` on torch CUDA tensors, differentiable, under ``torch.compile``.

Importing this module imports torch (``import cuflash`` never does). The kernels run as two
``torch.library`` custom ops, ``cuflash::attention_forward`` (out, lse) and
``cuflash::attention_backward`` (dq, dk, dv), each with a fake (meta) implementation, so that
``torch.compile(fullgraph=True)`` traces them as single nodes without graph breaks, and with the
backward registered as the forward's autograd formula.

Memory and streams: the outputs are allocated by torch (``new_empty``) and written in place by the
kernels, and every other allocation of the call (the log-sum-exp, the backward's float32 workspaces)
also comes from torch's caching allocator; the kernels run on torch's current stream
(``cuflash.interop``). So the ops need no synchronisation, and under CUDA graph capture their memory
is the graph's. Before a capture, warm up: the kernels compile and load on their first call, and the
Hopper persistent forward makes its tile counter on the first call on each stream.
"""
from typing import Optional, Tuple, Union

import torch

from . import _checks, api, variants

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
            head_dim a multiple of 8 up to 256. Any strides (a copy is made only where the last
            dimension is not contiguous or a stride is not a multiple of 16 bytes).
        k, v: ``(batch, seqlen_k, heads_kv, head_dim)``, same dtype and device;
            heads_q % heads_kv == 0 (GQA / MQA).
        dropout_p: must be 0.0 (no dropout in cuflash's kernels).
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
        ValueError: ``dropout_p != 0``, shapes that do not agree, an unsupported head_dim, bad variant
            values (cuflash.forward's checks).
    """
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p must be 0.0: cuflash has no dropout, got {dropout_p}")
    if sinks is not None and learnable_sink is not None:
        raise ValueError("give sinks or learnable_sink (the same argument), not both")
    sinks = learnable_sink if sinks is None else sinks
    head_dim = _check_inputs(q, k, v)
    scale = _checks.check_scale(softmax_scale, head_dim)
    causal = _checks.check_flag("causal", causal)
    deterministic = _checks.check_flag("deterministic", deterministic)
    return_lse = _checks.check_flag("return_lse", return_lse)
    if isinstance(window_size, (tuple, list)) and len(window_size) == 2:
        window_size = tuple(-1 if w is None else w for w in window_size)
    left, right = variants.check_window(window_size)
    chunk = variants.check_chunk(attention_chunk)
    cap = variants.check_softcap(softcap)
    for name, x in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if x is not None and (not isinstance(x, torch.Tensor) or x.device != q.device):
            raise TypeError(f"{name} must be a torch.Tensor on {q.device}, got {type(x).__name__}"
                            + (f" on {x.device}" if isinstance(x, torch.Tensor) else ""))
    out, lse = attention_forward(q, k, v, scale, causal, left, right, chunk, cap, alibi_slopes, sinks, deterministic)
    return (out, lse) if return_lse else out


def _check_inputs(q, k, v) -> int:
    """Checks q, k, v from their metadata alone (so it also runs on fake tensors while
    ``torch.compile`` traces); returns head_dim."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__module__}.{type(x).__name__} "
                            f"(cuflash.forward takes CuPy arrays)")
        if x.device.type != "cuda":
            raise TypeError(f"{name} must be on a CUDA device, got a tensor on {x.device}; "
                            f"move it with {name}.cuda()")
        if x.dtype not in _DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
        if x.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, seqlen, heads, head_dim), "
                             f"got shape {tuple(x.shape)}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}), got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}")
    head_dim = _checks.check_qkv_shapes(q, k, v)[-1]
    if head_dim not in api.HEAD_DIMS:
        raise ValueError(f"head_dim must be a multiple of 8 from 8 to 256, got {head_dim}")
    return head_dim


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
    """``(out, lse)``: out ``(B, Nq, Hq, D)`` like q (contiguous), lse float32 ``(B, Hq, Nq)``."""
    q, k, v = _kernel_ready(q), _kernel_ready(k), _kernel_ready(v)
    out = q.new_empty(q.shape)
    return api.forward(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=(window_left, window_right),
                       attention_chunk=attention_chunk, softcap=softcap, alibi_slopes=_detached(alibi_slopes),
                       sinks=_detached(sinks), return_lse=True, out=out)


@attention_forward.register_fake
def _attention_forward_fake(q, k, v, softmax_scale, causal, window_left, window_right, attention_chunk, softcap,
                            alibi_slopes, sinks, deterministic):
    b, nq, hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, hq, nq), dtype=torch.float32)


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
