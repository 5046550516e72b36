"""The backward with a value head dim of its own (``Dv != Dqk``), by zero padding to the larger one.

The backward kernels take one head dim. Padding the narrower side with zero columns to ``D = max(Dqk, Dv)``
leaves every product the same: with ``Dv < Dqk``, v, out and dout gain zero columns, so ``dO V^T``, ``rowsum(dO *
O)`` and ``P^T dO`` are unchanged and dv's padded columns come out 0; with ``Dv > Dqk``, q and k gain zero
columns, so ``Q K^T`` is unchanged (the softmax scale stays ``1 / sqrt(Dqk)``, passed explicitly) and dq's and dk's
padded columns come out 0. The cost: the copies, and the padded side's share of the products run at ``D``
(at (192, 128): dP and dV at 192 columns instead of 128, a sixth more of the backward's tensor work). Kernels
that take ``Dv`` natively would remove both; the forward already does (``kHeadDimV``).

Works on NumPy and CuPy arrays alike (``tests/test_head_dims.py`` checks the identity on the float64 reference,
without a GPU).
"""
from __future__ import annotations

from typing import Callable, Tuple


def _widened(x, width: int):
    """``x`` with zero columns appended to its last axis up to ``width`` (a new, contiguous array)."""
    xp = _module(x)
    wide = xp.zeros(x.shape[:-1] + (width,), dtype=x.dtype)
    wide[..., :x.shape[-1]] = x
    return wide


def _module(x):
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    import numpy

    return numpy


def padded(dout, q, k, v, out) -> Tuple[tuple, Callable]:
    """``((dout, q, k, v, out) padded to one head dim, unpad)``: ``unpad(dq, dk, dv)`` gives the gradients of
    the unpadded arrays (views of the padded ones' first columns). q, k: ``(..., Dqk)``; v, out, dout:
    ``(..., Dv)``; any leading dims (dense or packed)."""
    dqk, dv = q.shape[-1], v.shape[-1]
    if dv < dqk:
        arrays = (_widened(dout, dqk), q, k, _widened(v, dqk), _widened(out, dqk))
    else:
        arrays = (dout, _widened(q, dv), _widened(k, dv), v, out)

    def unpad(dq, dk, dvv):
        return dq[..., :dqk], dk[..., :dqk], dvv[..., :dv]

    return arrays, unpad


def deliver(grads: tuple, buffers: tuple) -> tuple:
    """The gradients into the caller's buffers where given (None: a contiguous copy of the slice)."""
    out = []
    for g, buf in zip(grads, buffers):
        if buf is None:
            out.append(_module(g).ascontiguousarray(g))
        else:
            buf[...] = g
            out.append(buf)
    return tuple(out)
