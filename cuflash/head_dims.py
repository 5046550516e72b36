"""Head dims: which ones the API takes, and the backward with a value head dim of its own (``Dv != Dqk``), by
zero padding to the larger one.

Every kernel family takes head dims that are multiples of 8 up to 256, forward and backward, q's and v's alike.
Above that, q / k up to 576 and v up to 512 (head dim 512, MLA's absorbed 576 / 512): in fp16 / bf16 the forward
on Hopper's split-V kernel (kernels_cu/sm90/fwd_split.cuh) and elsewhere on the portable kernel with O's columns
split over warps (kernels_cu/sm80/fwd.cu: kColSplit), the backward on Hopper only (one kernel per gradient,
kernels_cu/sm90/bwd_split.cu); in float32 the exact kernels, forward and backward, anywhere. Dense and varlen
alike (tests/test_large_head_dims.py, on an H200).

The backward kernels take one head dim. Padding the narrower side with zero columns to ``D = max(Dqk, Dv)``
leaves every product the same: with ``Dv < Dqk``, v, out and dout gain zero columns, so ``dO V^T``, ``rowsum(dO *
O)`` and ``P^T dO`` are unchanged and dv's padded columns come out 0; with ``Dv > Dqk``, q and k gain zero
columns, so ``Q K^T`` is unchanged (the softmax scale stays ``1 / sqrt(Dqk)``, passed explicitly) and dq's and dk's
padded columns come out 0. The cost: the copies, and the padded side's share of the products run at ``D``
(at (192, 128): dP and dV at 192 columns instead of 128, a sixth more of the backward's tensor work). In
fp16 / bf16 with ``Dv < Dqk`` the Hopper backward makes no copies (:class:`NarrowV`: TMA's zero fill pads
v and dout as they are loaded; 10-20 % faster at (192, 128), BENCHMARKS.md); kernels that take ``Dv``
natively would remove the padded products too; the forward already does (``kHeadDimV``).

Works on NumPy and CuPy arrays alike (``tests/test_head_dims.py`` checks the identity on the float64 reference,
without a GPU).
"""
from __future__ import annotations

from typing import Callable, Tuple

MAX_HEAD_DIM = 256                          # every kernel family, forward and backward
LARGE_HEAD_DIM_QK, LARGE_HEAD_DIM_V = 576, 512   # the large head dims' limits (q / k, v)


def is_large(head_dim: int, head_dim_v: int) -> bool:
    """Whether q's or v's head dim is above the standard ones (MAX_HEAD_DIM)."""
    return max(head_dim, head_dim_v) > MAX_HEAD_DIM


def check(head_dim: int, head_dim_v: int) -> None:
    """ValueError unless q's / k's head dim ``head_dim`` is a multiple of 8 from 8 to 576 and v's ``head_dim_v``
    one from 8 to 512, v's above 64 where either is above 256 (the split-V kernel gives each of its two
    warpgroups at least one 64-column block of V)."""
    for name, value, top in (("head_dim", head_dim, LARGE_HEAD_DIM_QK),
                             ("v's head_dim", head_dim_v, LARGE_HEAD_DIM_V)):
        if value % 8 or not 8 <= value <= top:
            raise ValueError(f"{name} must be a multiple of 8 from 8 to {top}, got {value}")
    if is_large(head_dim, head_dim_v) and head_dim_v <= 64:
        raise ValueError(f"v's head_dim must be above 64 where q's is above {MAX_HEAD_DIM} (got q / k {head_dim}, "
                         f"v {head_dim_v}): the split-V kernel gives each of its two warpgroups 64 columns of V")


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
    """``((dout, q, k, v, out) padded to one head dim, unpad)`` (head dims up to 256): ``unpad(dq, dk, dv)`` gives the gradients of
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


class NarrowV:
    """The 16-bit backward with v narrower than q (``Dv < Dqk``, head dims up to 256) and no padded copies of v,
    out and dout where the Hopper kernel reads them: its tensor maps span v's and dout's own ``Dv`` columns and
    TMA fills the columns past them with zeros, so every product is that of the padded arrays (module docstring),
    and the preprocess reads out and dout over ``Dv`` columns (its own BwdParams with ``head_dim = Dv``). The dK/dV
    kernel writes ``Dqk`` columns of dV: into a workspace, whose first ``Dv`` columns :meth:`deliver_dv` copies
    into the caller's dv. Where the portable kernels run instead (``sm90_reads`` False) v, out and dout are
    padded here. False (``bool``) where v is as wide as q."""

    def __init__(self, dout, q, k, v, out, dv, *, sm90_reads: bool, zero_workspace: bool = False):
        self.width, self.head_dim = v.shape[-1], q.shape[-1]
        self._dv = dv
        if not self:
            return
        if not sm90_reads:
            (dout, q, k, v, out), _ = padded(dout, q, k, v, out)
        xp = _module(dv)
        alloc = xp.zeros if zero_workspace else xp.empty   # zeros: keys that no kernel writes (varlen seqused_k)
        self.dv_wide = alloc(dv.shape[:-1] + (self.head_dim,), dtype=dv.dtype)
        self._arrays = (dout, q, k, v, out, self.dv_wide)
        self._preprocess_width = out.shape[-1]

    def __bool__(self) -> bool:
        return self.width < self.head_dim

    def arrays(self) -> tuple:
        """(dout, q, k, v, out, dv) as the kernels take them."""
        return self._arrays

    def preprocess_params(self, values: tuple) -> bytes:
        """The preprocess's BwdParams: ``values`` (every field) with head_dim out's width."""
        from . import params

        return params.pack_bytes(params.BWD_PARAMS, params.replaced(params.BWD_PARAMS, values,
                                                                    head_dim=self._preprocess_width))

    def deliver_dv(self) -> None:
        """dV's first ``Dv`` columns into the caller's dv (on the current stream); the workspaces kept alive
        under CUDA graph capture."""
        from . import capture

        self._dv[...] = self.dv_wide[..., :self.width]
        capture.keep_if_capturing(*self._arrays)
