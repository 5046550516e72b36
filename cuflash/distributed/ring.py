"""The ring schedules of one rank: forward and backward as generators over the steps (transport.py runs them).

Forward, step ``s``: the keys and values of rank ``(rank - s) % world`` are here; the next ones travel
in while this step's kernels run; the step's output and log-sum-exp are merged into float32 sums through
the log-sum-exps (plan.py says which rows meet which).

Backward, step ``s``: with the final output and log-sum-exp, each step's gradients are exact parts of the
whole: dQ parts are summed here, and the dK / dV sums of the visiting keys travel with them, one rank
behind, each rank adding its part, until they reach their owner after the last step.
"""
from __future__ import annotations

from .. import api
from . import partials
from .plan import step_block, valid_rows
from .transport import Exchange, Wait


# Tests set this to fill every buffer the schedules allocate with NaN, so that a part left unwritten shows.
_POISON_BUFFERS = False


def _xp():
    """The array module the schedules allocate with: CuPy (the CPU tests put NumPy here, with NumPy
    stand-ins for the kernels, to check the schedules' logic without a GPU)."""
    import cupy

    return cupy


def _empty(shape, dtype):
    import numpy as np

    x = _xp().empty(shape, dtype=dtype)
    if _POISON_BUFFERS:
        x.fill(np.nan)
    return x


def _contiguous(x):
    return x if x.flags.c_contiguous else _xp().ascontiguousarray(x)


class _Visiting:
    """The keys and values visiting this rank: the current block, and receive buffers so that the next
    block arrives in one while the current one is read (one for a ring of two, two otherwise)."""

    def __init__(self, k, v, world: int):
        self.current = (k, v)
        self.world = world
        self._spare = [(_empty(k.shape, k.dtype), _empty(v.shape, v.dtype)) for _ in range(min(world - 1, 2))]
        self._incoming = None

    def pass_on(self, step: int):
        """The exchange that sends the current block on and receives the next one; None at the last step."""
        if step >= self.world - 1:
            return None
        self._incoming = self._spare[step % len(self._spare)]
        return Exchange(self.current, self._incoming)

    def arrived(self) -> None:
        self.current, self._incoming = self._incoming, None


def _valid(rank: int, world: int, n: int, seqlen) -> int:
    """This rank's rows before the padding (all of them without ``seqlen``)."""
    return n if seqlen is None else valid_rows(rank, world, n, seqlen)


def _single_padded_forward(q, k, v, valid: int, causal: bool, softmax_scale: float):
    """world == 1 with padding: the rows before it, zeros and lse -inf after."""
    import numpy as np

    out = _xp().zeros(q.shape, q.dtype)
    lse = _xp().full((q.shape[0], q.shape[2], q.shape[1]), -np.inf, dtype=np.float32)
    if valid:
        rows = slice(0, valid)
        _, part_lse = api.forward(q[:, rows], k[:, rows], v[:, rows], causal=causal, softmax_scale=softmax_scale,
                                  return_lse=True, out=out[:, rows])
        lse[:, :, rows] = part_lse
    return out, lse


def forward_schedule(q, k, v, rank: int, world: int, *, causal: bool, softmax_scale: float, seqlen=None):
    """Yields exchanges and waits; returns ``(out, lse)`` of this rank's queries against every rank's
    keys: out like ``q``, lse float32 ``(batch, heads_q, local_seqlen)``. ``seqlen``: the real length of a
    padded sequence (plan.py); padded rows get 0 and lse -inf. Arguments already checked."""
    import numpy as np

    b, n, hq, d = q.shape
    valid = _valid(rank, world, n, seqlen)
    if world == 1:   # no ring: the single-GPU call, without the float32 sums
        if valid < n:
            return _single_padded_forward(q, k, v, valid, causal, softmax_scale)
        return api.forward(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True)
        yield   # a generator all the same
    k, v = _contiguous(k), _contiguous(v)
    out_acc = _empty((b, n, hq, d), np.float32)
    if valid < n:
        out_acc[:, valid:] = 0   # no step writes the padded rows
    lse_acc = _xp().full((b, hq, n), -np.inf, dtype=np.float32)
    part = _empty(q.shape, q.dtype)
    visiting = _Visiting(k, v, world)
    for s in range(world):
        exchange = visiting.pass_on(s)
        handle = (yield exchange) if exchange else None
        blk = step_block(rank, (rank - s) % world, world, n, causal, seqlen)
        if blk is not None:
            kc, vc = visiting.current
            _, part_lse = api.forward(q[:, blk.q_rows], kc[:, blk.k_rows], vc[:, blk.k_rows], causal=blk.causal,
                                      softmax_scale=softmax_scale, return_lse=True, out=part[:, blk.q_rows])
            partials.merge(out_acc, lse_acc, part, part_lse, blk.q_start)
        if exchange:
            yield Wait(handle)
            visiting.arrived()
    return partials.convert(out_acc, q.dtype), lse_acc


def _single_padded_backward(dout, q, k, v, out, lse, valid: int, causal: bool, softmax_scale: float,
                            deterministic: bool):
    """world == 1 with padding: the gradients of the rows before it, zeros after."""
    dq, dk, dv = (_xp().zeros(x.shape, x.dtype) for x in (q, k, v))
    if valid:
        r = slice(0, valid)
        api.backward(dout[:, r], q[:, r], k[:, r], v[:, r], out[:, r], _contiguous(lse[:, :, r]), causal=causal,
                     softmax_scale=softmax_scale, deterministic=deterministic, dq=dq[:, r], dk=dk[:, r], dv=dv[:, r])
    return dq, dk, dv


def backward_schedule(dout, q, k, v, out, lse, rank: int, world: int, *, causal: bool, softmax_scale: float,
                      deterministic: bool, seqlen=None):
    """Yields exchanges and waits; returns ``(dq, dk, dv)`` of this rank's shards (the dK / dV of its own
    keys, summed over every rank's queries). ``seqlen``: as for the forward; padded rows get 0.
    Arguments already checked."""
    import numpy as np

    b, n, hq, d = q.shape
    valid = _valid(rank, world, n, seqlen)
    if world == 1:
        if valid < n:
            return _single_padded_backward(dout, q, k, v, out, lse, valid, causal, softmax_scale, deterministic)
        return api.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                            deterministic=deterministic)
        yield
    k, v = _contiguous(k), _contiguous(v)
    lse = _contiguous(lse)
    step_lses = {}   # (first, last) query row -> that part of the log-sum-exp, contiguous
    dq_acc = _empty(q.shape, np.float32)
    dq_part = _empty(q.shape, q.dtype)
    dk_part, dv_part = _empty(k.shape, k.dtype), _empty(v.shape, v.dtype)
    visiting = _Visiting(k, v, world)
    # The travelling float32 dK / dV sums: one is added to while the other is in flight.
    sums = [(_empty(k.shape, np.float32), _empty(v.shape, np.float32)) for _ in range(2)]
    if valid < n:   # no step writes the padded rows: zero here, and in the sums of this rank's own keys
        dq_acc[:, valid:] = 0
        for x in sums[0]:
            x[:, valid:] = 0
    sums_here, sums_handle = 0, None
    for s in range(world):
        exchange = visiting.pass_on(s)
        handle = (yield exchange) if exchange else None
        blk = step_block(rank, (rank - s) % world, world, n, causal, seqlen)
        if blk is not None:
            kc, vc = visiting.current
            qr, kr = blk.q_rows, blk.k_rows
            if blk.q_start == 0 and blk.q_stop == n:
                step_lse = lse
            else:
                step_lse = step_lses.get((blk.q_start, blk.q_stop))
                if step_lse is None:
                    step_lse = step_lses[blk.q_start, blk.q_stop] = _contiguous(lse[:, :, qr])
            api.backward(dout[:, qr], q[:, qr], kc[:, kr], vc[:, kr], out[:, qr], step_lse, causal=blk.causal,
                         softmax_scale=softmax_scale, deterministic=deterministic,
                         dq=dq_part[:, qr], dk=dk_part[:, kr], dv=dv_part[:, kr])
            partials.accumulate(dq_acc, dq_part, blk.q_start, blk.q_stop - blk.q_start, assign=s == 0)
        if s > 0:
            yield Wait(sums_handle)   # the sums of these keys from the ranks before
        if blk is not None:
            dk_sum, dv_sum = sums[sums_here]
            rows = blk.k_stop - blk.k_start
            partials.accumulate(dk_sum, dk_part, blk.k_start, rows, assign=s == 0)
            partials.accumulate(dv_sum, dv_part, blk.k_start, rows, assign=s == 0)
        # On to the next rank; after the last step that is the keys' owner.
        sums_handle = yield Exchange(sums[sums_here], sums[1 - sums_here])
        sums_here = 1 - sums_here
        if exchange:
            yield Wait(handle)
            visiting.arrived()
    yield Wait(sums_handle)
    dk_sum, dv_sum = sums[sums_here]
    return partials.convert(dq_acc, q.dtype), partials.convert(dk_sum, k.dtype), partials.convert(dv_sum, v.dtype)
