"""Public API of ring attention: one process per GPU (``ring_forward`` / ``ring_backward`` with an
:class:`NcclRing`), or every rank in one process (``local_ring_forward`` / ``local_ring_backward``).

Each rank holds its zig-zag shard (plan.py) of q, k, v: ``(batch, local_seqlen, heads, head_dim)`` with
``local_seqlen = seqlen / world``, the same on every rank. The results are the rank's shard of what
:func:`cuflash.forward` / :func:`cuflash.backward` give on the whole sequence.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

from .. import _checks, variants
from . import ring
from .plan import check_padded
from .transport import NcclRing, run_local


def _check_local(q, k, v, causal, softmax_scale):
    b, nq, nk, hq, hkv, d = _checks.check_qkv(q, k, v)
    causal = _checks.check_flag("causal", causal)
    scale = _checks.check_scale(softmax_scale, d)
    if nq != nk:
        raise ValueError(f"q and k must hold the same rows of the sequence (local seqlen {nq} and {nk})")
    if causal and nq % 2:
        raise ValueError(f"a causal ring needs an even local seqlen (two zig-zag chunks), got {nq}")
    if nq == 0:
        raise ValueError("the local seqlen must be >= 1")
    return causal, scale


_VARIANT_DOC = """window_size, attention_chunk, softcap, alibi_slopes, sinks: as :func:`cuflash.forward`, over the
            global positions of the whole sequence (a window visits only the ring steps and chunks it reaches;
            the sinks join each row's softmax once)."""


def _check_variants(kwargs: dict, causal: bool, q, dlse=None, lse_shape=None):
    """The variant arguments of a ring call, checked against this rank's shard (variants.Variants)."""
    b, _, hq, _ = q.shape
    var = variants.from_arguments(kwargs.get("window_size", (-1, -1)), kwargs.get("attention_chunk", 0),
                                  kwargs.get("softcap", 0.0), kwargs.get("alibi_slopes"), kwargs.get("sinks"),
                                  causal=causal, batch=b, heads_q=hq, device_id=q.data.device_id, q_dtype=q.dtype)
    if dlse is not None:
        _checks.check_lse_cached(dlse, lse_shape, q.data.device_id, name="dlse")
    return var


def _variant_fingerprint(var) -> tuple:
    return (var.window_left, var.window_right, var.attention_chunk, var.softcap, var.alibi_slopes is not None,
            var.sinks is not None)


def _with_dsinks(grads, sinks):
    """The ring's gradients with dsinks in the sinks' dtype (as given)."""
    if sinks is None or len(grads) < 4:
        return tuple(grads)
    d = grads[3]
    return (*grads[:3], d if d.dtype == sinks.dtype else d.astype(sinks.dtype))


def _check_group(group, q) -> None:
    if not isinstance(group, NcclRing):
        raise TypeError(f"group must be a cuflash.distributed.NcclRing, got {type(group).__name__}")
    if q.data.device_id != group.device_id:
        raise ValueError(f"q is on device {q.data.device_id} but the group's communicator is on device "
                         f"{group.device_id}")


def ring_forward(q, k, v, group: NcclRing, *, causal: bool = False, softmax_scale: Optional[float] = None,
                 return_lse: bool = False, seqlen: Optional[int] = None, **variant_args):
    """Attention of this rank's queries against the whole sequence, the keys and values passed around
    the ring with NCCL while each step computes.

    Args:
        q: ``(batch, local_seqlen, heads_q, head_dim)``, this rank's zig-zag shard
            (:func:`zigzag_shard`); float16, bfloat16 or float32, on the group's device.
        k, v: ``(batch, local_seqlen, heads_kv, head_dim)``, the same rows of the keys and values.
        group: this rank's :class:`NcclRing`; every rank of it calls with the same shapes and options.
        causal: the causal mask over global positions (the zig-zag split balances its work).
        softmax_scale: defaults to ``1 / sqrt(head_dim)``.
        return_lse: also return the log-sum-exp, float32 ``(batch, heads_q, local_seqlen)`` (the
            backward needs it).
        seqlen: the sequence's real length when :func:`zigzag_shard` padded it (a length that does not
            cut into ``2 * world`` chunks); the padding is left out of every step (no key attends it),
            and its rows of the results are 0 (lse -inf). Default: ``world * local_seqlen``, no padding.
        """ + _VARIANT_DOC + """

    Every rank must call with the same shapes, dtype and options: the first call with a new combination
    compares them across the ranks (one all-gather, one host wait) and raises ValueError on every rank
    if they differ, rather than hang in mismatched transfers.

    Returns:
        ``out`` shaped like q, or ``(out, lse)``.
    """
    causal, scale = _check_local(q, k, v, causal, softmax_scale)
    return_lse = _checks.check_flag("return_lse", return_lse)
    var = _check_variants(_variant_kwargs(variant_args), causal, q)
    _check_group(group, q)
    seqlen = check_padded(seqlen, group.world, q.shape[1])
    group.agree(("forward", q.shape, k.shape, str(q.dtype), causal, scale, seqlen, _variant_fingerprint(var)))
    out, lse = group.run(ring.forward_schedule(q, k, v, group.rank, group.world, causal=causal,
                                               softmax_scale=scale, seqlen=seqlen, var=var))
    return (out, lse) if return_lse else out


_VARIANT_NAMES = ("window_size", "attention_chunk", "softcap", "alibi_slopes", "sinks")


def _variant_kwargs(kwargs: dict) -> dict:
    unknown = set(kwargs) - set(_VARIANT_NAMES)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {sorted(unknown)}")
    return kwargs


def ring_backward(dout, q, k, v, out, lse, group: NcclRing, *, causal: bool = False,
                  softmax_scale: Optional[float] = None, deterministic: bool = False, seqlen: Optional[int] = None,
                  dlse=None, **variant_args):
    """Gradients of :func:`ring_forward` for this rank's shard: ``(dq, dk, dv)`` shaped like q, k, v, and
    with ``sinks`` this rank's part of ``dsinks`` (sum it over the ranks, as any replicated parameter's
    gradient). ``dlse``: the gradient of this rank's lse, or None; the variant arguments as given to the
    forward.

    The dK / dV sums travel the ring one step behind the keys and reach their owner after the last
    step. ``out`` and ``lse`` are this rank's results of :func:`ring_forward`; ``deterministic`` makes
    every kernel's sums bitwise reproducible (the ring adds the parts in a fixed order anyway);
    ``seqlen`` as given to the forward (padded rows get 0).
    """
    causal, scale = _check_local(q, k, v, causal, softmax_scale)
    _checks.check_like_cached("dout", dout, "q", q)
    _checks.check_like_cached("out", out, "q", q)
    _checks.check_lse_cached(lse, (q.shape[0], q.shape[2], q.shape[1]), q.data.device_id)
    deterministic = _checks.check_flag("deterministic", deterministic)
    var = _check_variants(_variant_kwargs(variant_args), causal, q, dlse, (q.shape[0], q.shape[2], q.shape[1]))
    _check_group(group, q)
    seqlen = check_padded(seqlen, group.world, q.shape[1])
    group.agree(("backward", q.shape, k.shape, str(q.dtype), causal, scale, deterministic, seqlen,
                 _variant_fingerprint(var), dlse is not None))
    grads = group.run(ring.backward_schedule(dout, q, k, v, out, lse, group.rank, group.world, causal=causal,
                                             softmax_scale=scale, deterministic=deterministic, seqlen=seqlen,
                                             var=var, dlse=dlse))
    return _with_dsinks(grads, variant_args.get("sinks"))


def _check_shards(name: str, shards, world: Optional[int]) -> int:
    if not isinstance(shards, (list, tuple)) or not shards:
        raise TypeError(f"{name} must be a list with one array per rank, got {type(shards).__name__}")
    if world is not None and len(shards) != world:
        raise ValueError(f"{name} must hold {world} shards (one per rank), got {len(shards)}")
    return len(shards)


def local_ring_forward(q: Sequence, k: Sequence, v: Sequence, *, causal: bool = False,
                       softmax_scale: Optional[float] = None, return_lse: bool = False,
                       seqlen: Optional[int] = None, **variant_args) -> Union[List, Tuple[List, List]]:
    """The ring forward of every rank in this process, on the current GPU, the sends as device copies:
    checks a sharding (and the ring) without several GPUs. ``q``, ``k``, ``v``: lists of the ranks'
    shards, as :func:`ring_forward` takes them. Returns the list of outputs (and of lses)."""
    world = _check_shards("q", q, None)
    _check_shards("k", k, world)
    _check_shards("v", v, world)
    checked = [_check_local(q[r], k[r], v[r], causal, softmax_scale) for r in range(world)]
    causal, scale = checked[0]
    for r in range(1, world):
        if q[r].shape != q[0].shape or k[r].shape != k[0].shape:
            raise ValueError(f"every rank's shard must have the same shape: rank 0 q {tuple(q[0].shape)} "
                             f"k {tuple(k[0].shape)}, rank {r} q {tuple(q[r].shape)} k {tuple(k[r].shape)}")
    return_lse = _checks.check_flag("return_lse", return_lse)
    seqlen = check_padded(seqlen, world, q[0].shape[1])
    var = _check_variants(_variant_kwargs(variant_args), causal, q[0])
    results = run_local([ring.forward_schedule(q[r], k[r], v[r], r, world, causal=causal, softmax_scale=scale,
                                               seqlen=seqlen, var=var) for r in range(world)])
    outs, lses = [o for o, _ in results], [l_ for _, l_ in results]
    return (outs, lses) if return_lse else outs


def local_ring_backward(dout: Sequence, q: Sequence, k: Sequence, v: Sequence, out: Sequence, lse: Sequence, *,
                        causal: bool = False, softmax_scale: Optional[float] = None,
                        deterministic: bool = False, seqlen: Optional[int] = None, dlse: Optional[Sequence] = None,
                        **variant_args) -> Tuple[List, ...]:
    """The ring backward of every rank in this process (see :func:`local_ring_forward`). Returns the
    lists of dq, dk and dv shards (and, with sinks, of each rank's dsinks part)."""
    world = _check_shards("q", q, None)
    for name, x in (("dout", dout), ("k", k), ("v", v), ("out", out), ("lse", lse)):
        _check_shards(name, x, world)
    causal, scale = _check_local(q[0], k[0], v[0], causal, softmax_scale)
    for r in range(world):
        _check_local(q[r], k[r], v[r], causal, softmax_scale)
        if q[r].shape != q[0].shape or k[r].shape != k[0].shape:
            raise ValueError(f"every rank's shard must have the same shape: rank 0 q {tuple(q[0].shape)} "
                             f"k {tuple(k[0].shape)}, rank {r} q {tuple(q[r].shape)} k {tuple(k[r].shape)}")
        _checks.check_like_cached("dout", dout[r], "q", q[r])
        _checks.check_like_cached("out", out[r], "q", q[r])
        _checks.check_lse_cached(lse[r], (q[r].shape[0], q[r].shape[2], q[r].shape[1]), q[r].data.device_id)
    deterministic = _checks.check_flag("deterministic", deterministic)
    seqlen = check_padded(seqlen, world, q[0].shape[1])
    var = _check_variants(_variant_kwargs(variant_args), causal, q[0])
    if dlse is not None:
        _check_shards("dlse", dlse, world)
    results = run_local([ring.backward_schedule(dout[r], q[r], k[r], v[r], out[r], lse[r], r, world, causal=causal,
                                                softmax_scale=scale, deterministic=deterministic, seqlen=seqlen,
                                                var=var, dlse=None if dlse is None else dlse[r])
                         for r in range(world)])
    results = [_with_dsinks(x, variant_args.get("sinks")) for x in results]
    return tuple([x[i] for x in results] for i in range(len(results[0])))
