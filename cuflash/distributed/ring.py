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
from .plan import step_block, valid_rows, variant_blocks
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


class StepVariants:
    """How a call's variant arguments reach the ring's steps. Softcap reaches every step as it is. A positional
    variant (window, chunks, ALiBi) splits each step into blocks of contiguous global positions
    (plan.variant_blocks), each run with the mask policy's offsets and causal as a window bound. Sinks are
    left out of the steps and joined once, to the merged result (``join_sinks``)."""

    def __init__(self, causal: bool, var=None):
        from .. import variants

        self.var = var if var is not None else variants.NONE
        self.causal = causal
        self.positional = self.var.local or self.var.alibi_slopes is not None
        self.pattern = (causal, self.var.window_left, self.var.window_right, self.var.attention_chunk)

    def blocks(self, rank: int, source: int, world: int, n: int, seqlen) -> list:
        if self.positional:
            return variant_blocks(rank, source, world, n, self.pattern, seqlen)
        blk = step_block(rank, source, world, n, self.causal, seqlen)
        return [] if blk is None else [blk]

    def step_kwargs(self, blk) -> dict:
        """The keyword arguments of a step's api.forward / api.backward for block ``blk``."""
        var = self.var
        if var.plain:
            return dict(causal=blk.causal)
        kw = dict(softcap=var.softcap, alibi_slopes=var.alibi_slopes)
        if blk.q_pos < 0:
            return dict(kw, causal=blk.causal)
        right = 0 if self.causal else var.window_right
        return dict(kw, causal=False, window_size=(var.window_left, right), attention_chunk=var.attention_chunk,
                    _mask_offsets=blk.mask_offsets)

    def whole_kwargs(self) -> dict:
        """The variant arguments of a single-GPU call on the whole (unsharded) sequence."""
        var = self.var
        if var.plain:
            return dict(causal=self.causal)
        return dict(causal=self.causal, window_size=(var.window_left, var.window_right),
                    attention_chunk=var.attention_chunk, softcap=var.softcap, alibi_slopes=var.alibi_slopes,
                    sinks=var.sinks)


def join_sinks(out_acc, lse_acc, sinks) -> None:
    """Adds each head's sink to the merged float32 result in place: lse' = log(e^lse + e^sink), out scaled
    by e^(lse - lse') (rows that saw no key keep out 0 and get lse = sink)."""
    xp = _xp()
    s = sinks.astype(xp.float32)[None, :, None]
    joined = xp.logaddexp(lse_acc, s)
    out_acc *= xp.exp(lse_acc - joined).transpose(0, 2, 1)[..., None]
    lse_acc[...] = joined


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


def forward_schedule(q, k, v, rank: int, world: int, *, causal: bool, softmax_scale: float, seqlen=None,
                     var=None):
    """Yields exchanges and waits; returns ``(out, lse)`` of this rank's queries against every rank's
    keys: out like ``q``, lse float32 ``(batch, heads_q, local_seqlen)``. ``seqlen``: the real length of a
    padded sequence (plan.py); padded rows get 0 and lse -inf. ``var``: the checked variant arguments
    (variants.Variants) over global positions. Arguments already checked."""
    import numpy as np

    b, n, hq, d = q.shape
    valid = _valid(rank, world, n, seqlen)
    sv = StepVariants(causal, var)
    if world == 1:   # no ring: the single-GPU call, without the float32 sums
        if valid < n:
            if not sv.var.plain:
                raise NotImplementedError("a padded ring of one rank with attention variants: pass the "
                                          "unpadded sequence to cuflash.forward")
            return _single_padded_forward(q, k, v, valid, causal, softmax_scale)
        return api.forward(q, k, v, softmax_scale=softmax_scale, return_lse=True, **sv.whole_kwargs())
        yield   # a generator all the same
    k, v = _contiguous(k), _contiguous(v)
    out_acc = _empty((b, n, hq, d), np.float32)
    if valid < n or sv.positional:
        out_acc[:, valid:] = 0   # no step writes the padded rows
    if sv.positional:
        out_acc[...] = 0   # a row may meet no block of a step's window
    lse_acc = _xp().full((b, hq, n), -np.inf, dtype=np.float32)
    part = _empty(q.shape, q.dtype)
    visiting = _Visiting(k, v, world)
    for s in range(world):
        exchange = visiting.pass_on(s)
        handle = (yield exchange) if exchange else None
        for blk in sv.blocks(rank, (rank - s) % world, world, n, seqlen):
            kc, vc = visiting.current
            _, part_lse = api.forward(q[:, blk.q_rows], kc[:, blk.k_rows], vc[:, blk.k_rows],
                                      softmax_scale=softmax_scale, return_lse=True, out=part[:, blk.q_rows],
                                      **sv.step_kwargs(blk))
            partials.merge(out_acc, lse_acc, part, part_lse, blk.q_start)
        if exchange:
            yield Wait(handle)
            visiting.arrived()
    if sv.var.sinks is not None:
        join_sinks(out_acc, lse_acc, sv.var.sinks)
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
                      deterministic: bool, seqlen=None, var=None, dlse=None):
    """Yields exchanges and waits; returns ``(dq, dk, dv)`` of this rank's shards (the dK / dV of its own
    keys, summed over every rank's queries), and with sinks ``dsinks``: this rank's rows' part (the caller
    sums it over the ranks, as for any replicated parameter). ``seqlen``: as for the forward; padded rows
    get 0. ``var``, ``dlse``: the variant arguments and the lse gradient. Arguments already checked."""
    import numpy as np

    b, n, hq, d = q.shape
    valid = _valid(rank, world, n, seqlen)
    sv = StepVariants(causal, var)
    if world == 1:
        if valid < n:
            if not sv.var.plain or dlse is not None:
                raise NotImplementedError("a padded ring of one rank with attention variants: pass the "
                                          "unpadded sequence to cuflash.backward")
            return _single_padded_backward(dout, q, k, v, out, lse, valid, causal, softmax_scale, deterministic)
        extra = {} if dlse is None else {"dlse": dlse}
        return api.backward(dout, q, k, v, out, lse, softmax_scale=softmax_scale, deterministic=deterministic,
                            **extra, **sv.whole_kwargs())
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
    if sv.positional:   # blocks may leave rows and keys of a step untouched: every contribution is added
        dq_acc[...] = 0
        for x in sums[0]:
            x[...] = 0
    first = not sv.positional   # whether a step's first contribution is stored rather than added
    sums_here, sums_handle = 0, None

    def rows_of(x, blk):
        if x is None or (blk.q_start == 0 and blk.q_stop == n):
            return x
        found = step_lses.get((id(x), blk.q_start, blk.q_stop))
        if found is None:
            found = step_lses[id(x), blk.q_start, blk.q_stop] = _contiguous(x[:, :, blk.q_rows])
        return found

    for s in range(world):
        exchange = visiting.pass_on(s)
        handle = (yield exchange) if exchange else None
        blocks = sv.blocks(rank, (rank - s) % world, world, n, seqlen)
        for blk in blocks:
            kc, vc = visiting.current
            qr, kr = blk.q_rows, blk.k_rows
            extra = {} if dlse is None else {"dlse": rows_of(dlse, blk)}
            api.backward(dout[:, qr], q[:, qr], kc[:, kr], vc[:, kr], out[:, qr], rows_of(lse, blk),
                         softmax_scale=softmax_scale, deterministic=deterministic, **extra,
                         dq=dq_part[:, qr], dk=dk_part[:, kr], dv=dv_part[:, kr], **sv.step_kwargs(blk))
            partials.accumulate(dq_acc, dq_part, blk.q_start, blk.q_stop - blk.q_start, assign=first and s == 0)
            if blocks.index(blk) == 0 and s > 0:
                yield Wait(sums_handle)   # the sums of these keys from the ranks before
            dk_sum, dv_sum = sums[sums_here]
            rows = blk.k_stop - blk.k_start
            partials.accumulate(dk_sum, dk_part, blk.k_start, rows, assign=first and s == 0)
            partials.accumulate(dv_sum, dv_part, blk.k_start, rows, assign=first and s == 0)
        if not blocks and s > 0:
            yield Wait(sums_handle)
        # On to the next rank; after the last step that is the keys' owner.
        sums_handle = yield Exchange(sums[sums_here], sums[1 - sums_here])
        sums_here = 1 - sums_here
        if exchange:
            yield Wait(handle)
            visiting.arrived()
    yield Wait(sums_handle)
    dk_sum, dv_sum = sums[sums_here]
    grads = (partials.convert(dq_acc, q.dtype), partials.convert(dk_sum, k.dtype), partials.convert(dv_sum, v.dtype))
    if sv.var.sinks is None:
        return grads
    return (*grads, _dsinks_part(dout, out, lse, dlse, sv.var.sinks, valid))


def _dsinks_part(dout, out, lse, dlse, sinks, valid: int):
    """This rank's part of d loss / d sinks: the sum over its rows of P(sink) (dlse - rowsum(dout * out))."""
    xp = _xp()
    r = slice(0, valid)
    delta = (dout[:, r].astype(xp.float32) * out[:, r].astype(xp.float32)).sum(axis=-1).transpose(0, 2, 1)
    if dlse is not None:
        delta = delta - dlse[:, :, r]
    p_sink = xp.exp(sinks.astype(xp.float32)[None, :, None] - lse[:, :, r])
    return (-(p_sink * delta)).sum(axis=(0, 2)).astype(sinks.dtype)
