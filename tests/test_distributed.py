"""Ring attention (cuflash.distributed): the zig-zag plan on the CPU, every rank in one process against
float64 on one GPU, and the real NCCL ring against one GPU and float64 where several GPUs are visible."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import BWD_TOL, FWD_TOL, GPU_SKIP_REASON, assert_lse_matches, randn, requires_gpu
from conftest import fake_cupy_array as arr

from cuflash.distributed import plan
from cuflash.distributed.transport import Exchange, Wait, run_local


# ---------------------------------------------------------------------------------------------------------
# The plan, on the CPU


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("causal", [False, True])
def test_steps_cover_the_mask_once(world, causal):
    """Over all ranks and steps, every (query, key) pair the global mask keeps is computed exactly once,
    and none that it drops."""
    local = 2 * 3   # chunks of 3 rows
    n = local * world
    pos = [np.array(plan.chunk_positions(r, world, local)) for r in range(world)]
    seen = np.zeros((n, n), dtype=np.int64)
    for rank in range(world):
        for s in range(world):
            src = (rank - s) % world
            blk = plan.step_block(rank, src, world, local, causal)
            assert blk is not None
            qp, kp = pos[rank][blk.q_rows], pos[src][blk.k_rows]
            visible = np.ones((len(qp), len(kp)), dtype=bool)
            if blk.causal:
                assert len(qp) == len(kp)
                visible = np.tril(visible)
            seen[np.ix_(qp, kp)] += visible
    want = np.tril(np.ones((n, n), dtype=np.int64)) if causal else np.ones((n, n), dtype=np.int64)
    np.testing.assert_array_equal(seen, want)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_causal_work_is_balanced(world):
    """Under the causal mask every rank computes the same number of (query, key) pairs."""
    local = 8
    work = []
    for rank in range(world):
        w = 0
        for s in range(world):
            blk = plan.step_block(rank, (rank - s) % world, world, local, True)
            rows, cols = blk.q_stop - blk.q_start, blk.k_stop - blk.k_start
            w += rows * (rows + 1) // 2 if blk.causal else rows * cols
        work.append(w)
    assert len(set(work)) == 1, work


@pytest.mark.parametrize("world", [1, 2, 4])
def test_zigzag_shard_round_trip(world):
    x = np.random.default_rng(0).standard_normal((2, 8 * world, 3, 4))
    shards = [plan.zigzag_shard(x, world, r) for r in range(world)]
    for r, s in enumerate(shards):
        np.testing.assert_array_equal(s, x[:, plan.chunk_positions(r, world, 8)])
    np.testing.assert_array_equal(plan.zigzag_unshard(shards), x)


def test_zigzag_shard_errors():
    x = np.zeros((1, 10, 1, 8))
    with pytest.raises(ValueError, match="rank must be in"):
        plan.zigzag_shard(x, 1, 1)
    with pytest.raises(ValueError, match="one array per rank"):
        plan.zigzag_unshard([])


@pytest.mark.parametrize("n,world", [(10, 2), (1, 2), (5, 4), (13, 3), (7, 1), (12, 2)])
def test_zigzag_shard_pads_and_unshard_drops_the_padding(n, world):
    x = np.random.default_rng(0).standard_normal((2, n, 3, 4))
    padded = plan.padded_length(n, world)
    shards = [plan.zigzag_shard(x, world, r) for r in range(world)]
    assert all(s.shape == (2, padded // world, 3, 4) for s in shards)
    whole = np.concatenate([x, np.zeros((2, padded - n, 3, 4))], axis=1)
    np.testing.assert_array_equal(plan.zigzag_unshard(shards), whole)
    np.testing.assert_array_equal(plan.zigzag_unshard(shards, seqlen=n), x)


@pytest.mark.parametrize("n,world", [(10, 2), (1, 2), (5, 4), (13, 3), (23, 4), (2, 3)])
def test_padding_is_a_suffix_of_every_rank(n, world):
    local = plan.padded_length(n, world) // world
    for r in range(world):
        pos = np.array(plan.chunk_positions(r, world, local))
        valid = plan.valid_rows(r, world, local, n)
        assert (pos[:valid] < n).all() and (pos[valid:] >= n).all()


@pytest.mark.parametrize("n,world", [(10, 2), (1, 2), (5, 4), (13, 3), (23, 4), (2, 3), (17, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_padded_steps_cover_the_mask_once(n, world, causal):
    """With padding: every pair of real tokens the mask keeps is computed once, and no pair with a padded one."""
    local = plan.padded_length(n, world) // world
    pos = [np.array(plan.chunk_positions(r, world, local)) for r in range(world)]
    seen = np.zeros((n, n), dtype=np.int64)
    for rank in range(world):
        for s in range(world):
            src = (rank - s) % world
            blk = plan.step_block(rank, src, world, local, causal, seqlen=n)
            if blk is None:
                continue
            qp, kp = pos[rank][blk.q_rows], pos[src][blk.k_rows]
            assert (qp < n).all() and (kp < n).all(), "a step reaches padded rows"
            visible = np.ones((len(qp), len(kp)), dtype=bool)
            if blk.causal:
                assert len(qp) == len(kp)
                visible = np.tril(visible)
            seen[np.ix_(qp, kp)] += visible
    want = np.tril(np.ones((n, n), dtype=np.int64)) if causal else np.ones((n, n), dtype=np.int64)
    np.testing.assert_array_equal(seen, want)


def test_check_padded():
    assert plan.check_padded(None, 2, 6) is None
    assert plan.check_padded(12, 2, 6) is None   # no padding
    assert plan.check_padded(10, 2, 6) == 10
    with pytest.raises(ValueError, match=r"seqlen must be in \[1, world \* local_seqlen = 12\]"):
        plan.check_padded(13, 2, 6)
    with pytest.raises(ValueError, match="even local seqlen"):
        plan.check_padded(9, 2, 5)
    with pytest.raises(TypeError, match="seqlen must be an int"):
        plan.check_padded(10.0, 2, 6)


def test_ring_fingerprints_and_disagreement():
    from cuflash.distributed import transport

    a = ("forward", (1, 8, 2, 64), (1, 8, 2, 64), "float16", True, 0.125, None)
    b = ("forward", (1, 6, 2, 64), (1, 6, 2, 64), "float16", True, 0.125, None)
    fa, fb = transport.fingerprint(a), transport.fingerprint(b)
    assert fa == transport.fingerprint(tuple(a)) and fa != fb
    assert transport.disagreement([fa, fa, fa], 1, a) is None
    for rank in range(3):   # every rank gets the error, naming the others
        message = transport.disagreement([fa, fb, fa], rank, a if rank != 1 else b)
        assert message is not None and "disagree" in message and "hang" in message


def test_communicator_rank_and_size_are_checked():
    from cuflash.distributed import transport

    class Comm:
        def rank_id(self):
            return 1

        def size(self):
            return 2

    with pytest.raises(ValueError, match="the communicator is rank 1 of 2, but NcclRing was given rank 0 of 2"):
        transport.NcclRing(Comm(), 0, 2)
    with pytest.raises(ValueError, match="rank 1 of 2, but NcclRing was given rank 1 of 4"):
        transport.NcclRing(Comm(), 1, 4)


def _schedule(kinds):
    for kind in kinds:
        yield kind
    return len(kinds)


def test_run_local_refuses_schedules_out_of_step():
    with pytest.raises(RuntimeError, match="out of step"):
        run_local([_schedule([Wait(None)]), _schedule([Exchange((), ())])])
    with pytest.raises(RuntimeError, match="out of step"):
        run_local([_schedule([Wait(None)]), _schedule([])])
    assert run_local([_schedule([Wait(None)] * 2), _schedule([Wait(None)] * 2)]) == [2, 2]


@pytest.mark.usefixtures("device_forbidden")
def test_argument_errors_before_the_device():
    import cuflash.distributed as cfd

    q = arr((1, 8, 2, 64))
    with pytest.raises(TypeError, match="group must be a cuflash.distributed.NcclRing"):
        cfd.ring_forward(q, q, q, object())
    with pytest.raises(ValueError, match="even local seqlen"):
        odd = arr((1, 7, 2, 64))
        cfd.local_ring_forward([odd], [odd], [odd], causal=True)
    with pytest.raises(ValueError, match="same rows"):
        cfd.local_ring_forward([q], [arr((1, 6, 2, 64))], [arr((1, 6, 2, 64))])
    with pytest.raises(ValueError, match="2 shards"):
        cfd.local_ring_forward([q, q], [q], [q, q])
    with pytest.raises(TypeError, match="causal must be a bool"):
        cfd.local_ring_forward([q], [q], [q], causal="yes")
    with pytest.raises(TypeError, match="one array per rank"):
        cfd.local_ring_forward(q, q, q)
    with pytest.raises(ValueError, match="same shape"):
        r = arr((1, 4, 2, 64))
        cfd.local_ring_forward([q, r], [q, r], [q, r])


class _NumpyKernels:
    """NumPy stand-ins for what the schedules call (cuflash.forward / backward and the float32 merges), so
    that the schedules' logic (the zig-zag blocks, the exchanges, the merges, the travelling dK / dV
    sums) runs on the CPU against the float64 reference."""

    @staticmethod
    def forward(q, k, v, *, causal, softmax_scale, return_lse, out=None):
        from cuflash.reference import attention_reference

        o, lse = attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale)
        if out is None:
            out = np.empty(q.shape, q.dtype)
        out[...] = o
        return out, lse.astype(np.float32)

    @staticmethod
    def backward(dout, q, k, v, out, lse, *, causal, softmax_scale, deterministic, dq=None, dk=None, dv=None):
        """Gradients of one block with the final out and lse: P = exp(S - lse), dS = P (dP - rowsum(dO O))."""
        from cuflash.reference import visible_mask

        dq, dk, dv = (np.empty(x.shape, x.dtype) if g is None else g for g, x in ((dq, q), (dk, k), (dv, v)))

        b, nq, hq, d = q.shape
        group = hq // k.shape[2]
        mask = visible_mask(nq, k.shape[1], causal)
        dk[...] = 0
        dv[...] = 0
        for bi in range(b):
            for h in range(hq):
                kh, vh, do = k[bi, :, h // group], v[bi, :, h // group], dout[bi, :, h]
                s = q[bi, :, h] @ kh.T * softmax_scale
                p = np.where(mask, np.exp(s - lse[bi, h][:, None]), 0.0)
                dv[bi, :, h // group] += p.T @ do
                ds = p * (do @ vh.T - (do * out[bi, :, h]).sum(axis=1, keepdims=True))
                dq[bi, :, h] = softmax_scale * ds @ kh
                dk[bi, :, h // group] += softmax_scale * ds.T @ q[bi, :, h]
        return dq, dk, dv

    @staticmethod
    def merge(out_acc, lse_acc, part, part_lse, row0):
        rows = slice(row0, row0 + part_lse.shape[2])
        la, lp = lse_acc[:, :, rows], part_lse
        lse = np.logaddexp(la, lp)
        with np.errstate(invalid="ignore"):   # both -inf: the where's other branch
            wa = np.where(np.isneginf(la), 0.0, np.exp(la - lse)).transpose(0, 2, 1)[..., None]
            # As the kernel: a row whose sums are still empty takes the part as it is (0 if it saw no key either).
            wp = np.where(np.isneginf(la), 1.0, np.exp(lp - lse)).transpose(0, 2, 1)[..., None]
        acc = np.where(wa == 0, 0.0, out_acc[:, rows])
        out_acc[:, rows] = wa * acc + wp * part[:, rows]
        lse_acc[:, :, rows] = lse

    @staticmethod
    def accumulate(acc, part, row0, rows, *, assign):
        r = slice(row0, row0 + rows)
        acc[:, r] = part[:, r] if assign else acc[:, r] + part[:, r]

    @staticmethod
    def convert(x, dtype):
        return x.astype(dtype)


def _block_scores(q, k, h, bi, group, scale, causal, window_size, attention_chunk, softcap, alibi_slopes,
                  mask_offsets):
    """Scores (after softcap and ALiBi) and the visibility mask of one (batch, head) of a block whose rows and
    keys are views of a longer sequence (the mask policy's (diag, key_offset)), in float64."""
    nq, nk = q.shape[1], k.shape[1]
    diag, key_offset = mask_offsets if mask_offsets is not None else (nk - nq, 0)
    s = q[bi, :, h] @ k[bi, :, h // group].T * scale
    grad = np.ones_like(s)
    if softcap:
        tt = np.tanh(s / softcap)
        s, grad = softcap * tt, 1 - tt * tt
    pos = np.arange(nq)[:, None] + diag + key_offset
    j = np.arange(nk)[None, :] + key_offset
    if alibi_slopes is not None:
        slope = alibi_slopes[h] if alibi_slopes.ndim == 1 else alibi_slopes[bi, h]
        s = s - float(slope) * np.abs(pos - j)
    left, right = window_size
    vis = np.ones((nq, nk), bool)
    if causal:
        vis &= j <= pos
    if right >= 0:
        vis &= j <= pos + right
    if left >= 0:
        vis &= j >= pos - left
    if attention_chunk:
        vis &= (j // attention_chunk) == (pos // attention_chunk)
    return s, grad, vis


class _NumpyVariantKernels(_NumpyKernels):
    """The stand-ins with the variants and the mask policy's offsets (what the ring's positional steps pass)."""

    @staticmethod
    def forward(q, k, v, *, causal, softmax_scale, return_lse, out=None, window_size=(-1, -1), attention_chunk=0,
                softcap=0.0, alibi_slopes=None, sinks=None, _mask_offsets=None):
        assert sinks is None, "the ring joins the sinks itself, once"
        b, nq, hq, d = q.shape
        group = hq // k.shape[2]
        o, lse = np.zeros(q.shape), np.full((b, hq, nq), -np.inf)
        for bi in range(b):
            for h in range(hq):
                s, _, vis = _block_scores(q, k, h, bi, group, softmax_scale, causal, window_size, attention_chunk,
                                          softcap, alibi_slopes, _mask_offsets)
                s = np.where(vis, s, -np.inf)
                m = s.max(axis=1, keepdims=True)
                m = np.where(np.isfinite(m), m, 0.0)
                e = np.exp(s - m)
                tot = e.sum(axis=1, keepdims=True)
                with np.errstate(divide="ignore", invalid="ignore"):
                    o[bi, :, h] = np.where(tot > 0, e / np.where(tot > 0, tot, 1), 0) @ v[bi, :, h // group]
                    lse[bi, h] = np.where(tot[:, 0] > 0, np.log(np.where(tot[:, 0] > 0, tot[:, 0], 1)) + m[:, 0],
                                          -np.inf)
        if out is None:
            out = np.empty(q.shape, q.dtype)
        out[...] = o
        return out, lse.astype(np.float32)

    @staticmethod
    def backward(dout, q, k, v, out, lse, *, causal, softmax_scale, deterministic, dq=None, dk=None, dv=None,
                 window_size=(-1, -1), attention_chunk=0, softcap=0.0, alibi_slopes=None, sinks=None, dlse=None,
                 _mask_offsets=None):
        assert sinks is None
        dq, dk, dv = (np.empty(x.shape, x.dtype) if g is None else g for g, x in ((dq, q), (dk, k), (dv, v)))
        b, nq, hq, d = q.shape
        group = hq // k.shape[2]
        dk[...] = 0
        dv[...] = 0
        for bi in range(b):
            for h in range(hq):
                kh, vh, do = k[bi, :, h // group], v[bi, :, h // group], dout[bi, :, h]
                s, grad, vis = _block_scores(q, k, h, bi, group, softmax_scale, causal, window_size, attention_chunk,
                                             softcap, alibi_slopes, _mask_offsets)
                with np.errstate(invalid="ignore"):
                    p = np.where(vis, np.exp(s - lse[bi, h][:, None]), 0.0)
                delta = (do * out[bi, :, h]).sum(axis=1, keepdims=True)
                if dlse is not None:
                    delta = delta - dlse[bi, h][:, None]
                dv[bi, :, h // group] += p.T @ do
                ds = p * (do @ vh.T - delta) * grad
                dq[bi, :, h] = softmax_scale * ds @ kh
                dk[bi, :, h // group] += softmax_scale * ds.T @ q[bi, :, h]
        return dq, dk, dv


@pytest.fixture
def numpy_ring(monkeypatch):
    from cuflash.distributed import ring

    monkeypatch.setattr(ring, "_xp", lambda: np)
    monkeypatch.setattr(ring, "api", _NumpyKernels)
    monkeypatch.setattr(ring, "partials", _NumpyKernels)


def _numpy_copy(src, dst):
    np.copyto(dst, src)


@pytest.mark.usefixtures("numpy_ring")
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("causal", [False, True])
def test_schedules_on_the_cpu(world, causal):
    """The forward and backward schedules of every rank, run in lockstep with NumPy for the kernels and the
    copies, give the float64 reference's out, lse and gradients on the whole sequence (GQA, batch 2)."""
    from cuflash.distributed import ring
    from cuflash.reference import attention_reference, attention_reference_backward

    rng = np.random.default_rng(world * 2 + causal)
    n, scale = 2 * world * 3, 0.3
    q, dout = rng.standard_normal((2, n, 4, 8)), rng.standard_normal((2, n, 4, 8))
    k, v = rng.standard_normal((2, n, 2, 8)), rng.standard_normal((2, n, 2, 8))
    qs, ks, vs, dos = ([plan.zigzag_shard(x, world, r) for r in range(world)] for x in (q, k, v, dout))
    fwd = run_local([ring.forward_schedule(qs[r], ks[r], vs[r], r, world, causal=causal, softmax_scale=scale)
                     for r in range(world)], copy=_numpy_copy)
    outs, lses = [o for o, _ in fwd], [l_ for _, l_ in fwd]
    ref_o, ref_lse = attention_reference(q, k, v, causal=causal, softmax_scale=scale)
    np.testing.assert_allclose(plan.zigzag_unshard(outs), ref_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(plan.zigzag_unshard(lses, axis=2), ref_lse, rtol=1e-5, atol=1e-5)
    bwd = run_local([ring.backward_schedule(dos[r], qs[r], ks[r], vs[r], outs[r], lses[r], r, world, causal=causal,
                                            softmax_scale=scale, deterministic=False) for r in range(world)],
                    copy=_numpy_copy)
    refs = attention_reference_backward(dout, q, k, v, causal=causal, softmax_scale=scale)
    for i, name in enumerate(("dq", "dk", "dv")):
        got = plan.zigzag_unshard([g[i] for g in bwd])
        np.testing.assert_allclose(got, refs[i], rtol=1e-4, atol=1e-4, err_msg=name)


@pytest.mark.usefixtures("numpy_ring")
@pytest.mark.parametrize("n,world", [(10, 2), (1, 2), (5, 4), (13, 3), (7, 1), (22, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_padded_schedules_on_the_cpu(n, world, causal):
    """A sequence that does not cut into 2 * world chunks: padded by zigzag_shard, the padding left out by
    the schedules (seqlen=n): the unpadded results equal the float64 reference, padded rows are 0 / -inf."""
    from cuflash.distributed import ring
    from cuflash.reference import attention_reference, attention_reference_backward

    rng = np.random.default_rng(n * 7 + world + causal)
    scale = 0.3
    q, dout = rng.standard_normal((2, n, 4, 8)), rng.standard_normal((2, n, 4, 8))
    k, v = rng.standard_normal((2, n, 2, 8)), rng.standard_normal((2, n, 2, 8))
    qs, ks, vs, dos = ([plan.zigzag_shard(x, world, r) for r in range(world)] for x in (q, k, v, dout))
    fwd = run_local([ring.forward_schedule(qs[r], ks[r], vs[r], r, world, causal=causal, softmax_scale=scale,
                                           seqlen=n) for r in range(world)], copy=_numpy_copy)
    outs, lses = [o for o, _ in fwd], [l_ for _, l_ in fwd]
    ref_o, ref_lse = attention_reference(q, k, v, causal=causal, softmax_scale=scale)
    np.testing.assert_allclose(plan.zigzag_unshard(outs, seqlen=n), ref_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(plan.zigzag_unshard(lses, axis=2, seqlen=n), ref_lse, rtol=1e-5, atol=1e-5)
    padded_out = plan.zigzag_unshard(outs)[:, n:]
    assert (padded_out == 0).all() and np.isneginf(plan.zigzag_unshard(lses, axis=2)[:, :, n:]).all()
    bwd = run_local([ring.backward_schedule(dos[r], qs[r], ks[r], vs[r], outs[r], lses[r], r, world, causal=causal,
                                            softmax_scale=scale, deterministic=False, seqlen=n) for r in range(world)],
                    copy=_numpy_copy)
    refs = attention_reference_backward(dout, q, k, v, causal=causal, softmax_scale=scale)
    for i, name in enumerate(("dq", "dk", "dv")):
        whole = plan.zigzag_unshard([g[i] for g in bwd])
        np.testing.assert_allclose(whole[:, :n], refs[i], rtol=1e-4, atol=1e-4, err_msg=name)
        assert (whole[:, n:] == 0).all(), f"{name}: padded rows not 0"


@pytest.mark.usefixtures("device_forbidden")
def test_padded_argument_errors_before_the_device():
    import cuflash.distributed as cfd

    q = arr((1, 8, 2, 64))
    with pytest.raises(ValueError, match=r"seqlen must be in \[1, world \* local_seqlen = 16\]"):
        cfd.local_ring_forward([q, q], [q, q], [q, q], seqlen=17)
    with pytest.raises(TypeError, match="seqlen must be an int"):
        cfd.local_ring_forward([q, q], [q, q], [q, q], seqlen="15")


def test_ring_helpers_compile():
    """The merge / accumulate / convert kernels build for sm_80 and sm_90 without spills."""
    pytest.importorskip("cupy")
    from compile_checks import assert_all_compile
    from cuflash.distributed import partials

    for cc in ("80", "90"):
        assert_all_compile(partials.configs(), cc, no_warnings=True)


# ---------------------------------------------------------------------------------------------------------
# Every rank in one process, on one GPU, against float64


@pytest.fixture
def poison_ring_buffers(monkeypatch):
    from cuflash.distributed import ring

    monkeypatch.setattr(ring, "_POISON_BUFFERS", True)


def _shards(x, world):
    return [plan.zigzag_shard(x, world, r) for r in range(world)]


CASES = [  # world, chunk rows, heads_q, heads_kv, head_dim, dtype
    (1, 37, 2, 2, 64, "float16"),
    (2, 37, 4, 2, 64, "bfloat16"),
    (3, 19, 4, 1, 128, "float16"),
    (4, 50, 2, 2, 128, "bfloat16"),
    (2, 1, 2, 1, 64, "float16"),       # one row per chunk
    (2, 160, 4, 2, 128, "bfloat16"),   # chunks past one tile
    (3, 21, 2, 2, 32, "float32"),
    (2, 45, 3, 3, 96, "float16"),
    (2, 33, 2, 1, 256, "bfloat16"),
]


@requires_gpu
@pytest.mark.usefixtures("poison_ring_buffers")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world,chunk,hq,hkv,d,dtype", CASES)
def test_local_ring_forward(rng, world, chunk, hq, hkv, d, dtype, causal):
    import cuflash.distributed as cfd
    from cuflash.reference import attention_reference, rel_err

    n = 2 * world * chunk
    q, k, v = randn(rng, (2, n, hq, d), dtype), randn(rng, (2, n, hkv, d), dtype), randn(rng, (2, n, hkv, d), dtype)
    outs, lses = cfd.local_ring_forward(_shards(q, world), _shards(k, world), _shards(v, world), causal=causal,
                                        return_lse=True)
    out, lse = cfd.zigzag_unshard(outs), cfd.zigzag_unshard(lses, axis=2)
    ref_o, ref_lse = attention_reference(q, k, v, causal=causal)
    assert out.dtype == q.dtype
    err = rel_err(out, ref_o)
    assert err <= FWD_TOL[dtype], f"out rel err {err:.3e} > {FWD_TOL[dtype]:.1e}"
    assert_lse_matches(lse, ref_lse, (2, hq, n))


@requires_gpu
@pytest.mark.usefixtures("poison_ring_buffers")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("world,chunk,hq,hkv,d,dtype", CASES)
def test_local_ring_backward(rng, world, chunk, hq, hkv, d, dtype, causal, deterministic):
    import cuflash.distributed as cfd
    from cuflash.reference import attention_reference_backward, rel_err

    n = 2 * world * chunk
    q, k, v = randn(rng, (2, n, hq, d), dtype), randn(rng, (2, n, hkv, d), dtype), randn(rng, (2, n, hkv, d), dtype)
    dout = randn(rng, q.shape, dtype)
    qs, ks, vs, dos = (_shards(x, world) for x in (q, k, v, dout))
    outs, lses = cfd.local_ring_forward(qs, ks, vs, causal=causal, return_lse=True)
    dqs, dks, dvs = cfd.local_ring_backward(dos, qs, ks, vs, outs, lses, causal=causal, deterministic=deterministic)
    refs = attention_reference_backward(dout, q, k, v, causal=causal)
    for name, shards, ref in zip(("dq", "dk", "dv"), (dqs, dks, dvs), refs):
        got = cfd.zigzag_unshard(shards)
        assert got.dtype == q.dtype and got.shape == ref.shape
        err = rel_err(got, ref)
        assert err <= BWD_TOL[dtype], f"{name} rel err {err:.3e} > {BWD_TOL[dtype]:.1e}"


@requires_gpu
def test_local_ring_deterministic_backward_is_bitwise_repeatable(rng):
    import cupy
    import cuflash.distributed as cfd

    world, n = 3, 6 * 40
    q, k, v, dout = (randn(rng, (1, n, 4, 64), "bfloat16") for _ in range(4))
    qs, ks, vs, dos = (_shards(x, world) for x in (q, k, v, dout))
    outs, lses = cfd.local_ring_forward(qs, ks, vs, causal=True, return_lse=True)
    runs = [cfd.local_ring_backward(dos, qs, ks, vs, outs, lses, causal=True, deterministic=True) for _ in range(2)]
    for a, b in zip(*runs):
        for x, y in zip(a, b):
            assert bool(cupy.all(x.view(np.uint16) == y.view(np.uint16)))


@requires_gpu
@pytest.mark.usefixtures("poison_ring_buffers")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,world", [(77, 2), (5, 4), (301, 3), (131, 1)])
def test_local_ring_padded(rng, n, world, causal):
    """Sequences that do not cut into 2 * world chunks, padded inside: forward and backward against float64."""
    import cupy
    import cuflash.distributed as cfd
    from cuflash.reference import attention_reference, attention_reference_backward, rel_err

    q, dout = randn(rng, (2, n, 4, 64), "float16"), randn(rng, (2, n, 4, 64), "float16")
    k, v = randn(rng, (2, n, 2, 64), "float16"), randn(rng, (2, n, 2, 64), "float16")
    qs, ks, vs, dos = (_shards(x, world) for x in (q, k, v, dout))
    outs, lses = cfd.local_ring_forward(qs, ks, vs, causal=causal, return_lse=True, seqlen=n)
    ref_o, ref_lse = attention_reference(q, k, v, causal=causal)
    out = cfd.zigzag_unshard(outs)
    assert rel_err(out[:, :n], ref_o) <= FWD_TOL["float16"]
    assert bool((out[:, n:] == 0).all())
    assert_lse_matches(cfd.zigzag_unshard(lses, axis=2, seqlen=n), ref_lse, (2, 4, n))
    grads = cfd.local_ring_backward(dos, qs, ks, vs, outs, lses, causal=causal, seqlen=n)
    refs = attention_reference_backward(dout, q, k, v, causal=causal)
    for name, shards, ref in zip(("dq", "dk", "dv"), grads, refs):
        got = cfd.zigzag_unshard(shards)
        assert rel_err(got[:, :n], ref) <= BWD_TOL["float16"], name
        assert bool(cupy.all(got[:, n:] == 0)), name


# ---------------------------------------------------------------------------------------------------------
# The NCCL ring, one process per GPU


def _gpus() -> int:
    if GPU_SKIP_REASON is not None:
        return 0
    from cuflash.distributed.launch import gpu_count

    return gpu_count()


requires_gpus = pytest.mark.skipif(_gpus() < 2, reason="needs 2 or more GPUs (the NCCL ring)")


@requires_gpus
@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
def test_nccl_ring_at_32k_against_one_gpu_and_float64(causal):
    """N=32768, GQA 8/2, D=128, bf16, on every visible GPU: the ring's shards, gathered, against float64 (by
    chunks of rows on the GPU) within the single-GPU bounds, and close to single-GPU cuflash."""
    from cuflash.distributed.check import Case, bounds_of, check_case

    case = Case(1, 32768, 8, 2, 128, "bfloat16", causal)
    result = check_case(_gpus(), case)
    bounds = bounds_of(case.dtype)
    for name, err in result["ring"].items():
        assert err <= bounds[name], f"ring {name} err {err:.3e} > {bounds[name]:.1e} ({result})"
    for name, err in result["ring_vs_single"].items():   # both near float64: near each other
        assert err <= 2 * bounds[name], f"ring vs one GPU {name} err {err:.3e} ({result})"


def test_missing_nccl_says_what_to_install(monkeypatch):
    pytest.importorskip("cupy")
    from cupy.cuda import nccl

    from cuflash.distributed import transport

    monkeypatch.setattr(nccl, "available", False)
    with pytest.raises(RuntimeError, match="nvidia-nccl-cu12.*distributed-cuda12"):
        transport.NcclRing.from_unique_id(None, 0, 1)


def _disagreeing_rank(group):
    """Rank 1 calls with another local length: every rank must raise the agreement error, none hang."""
    import cupy

    import cuflash.distributed as cfd

    n = 64 if group.rank == 0 else 32
    q = cupy.ones((1, n, 2, 64), dtype=np.float16)
    try:
        cfd.ring_forward(q, q, q, group, causal=True)
    except ValueError as e:
        return str(e)
    return None


@requires_gpus
def test_nccl_ranks_that_disagree_raise_on_every_rank():
    from cuflash.distributed.launch import run_ranks

    messages = run_ranks(_disagreeing_rank, 2, timeout_s=120)
    assert all(m is not None and "disagree" in m for m in messages), messages


def _padded_rank(group, n: int, causal: bool):
    """The ring on a padded sequence of n tokens, then close() through the context manager."""
    import cupy

    import cuflash.distributed as cfd

    rs = cupy.random.RandomState(5)
    q, k, v, dout = (rs.standard_normal((1, n, 2, 64), dtype=np.float32).astype(np.float16) for _ in range(4))
    with group:
        shard = [cfd.zigzag_shard(x, group.world, group.rank) for x in (q, k, v, dout)]
        out, lse = cfd.ring_forward(*shard[:3], group, causal=causal, return_lse=True, seqlen=n)
        out2 = cfd.ring_forward(*shard[:3], group, causal=causal, seqlen=n)   # agreed: no second check
        dq, dk, dv = cfd.ring_backward(shard[3], *shard[:3], out, lse, group, causal=causal, seqlen=n)
        assert bool(cupy.array_equal(out, out2))
    try:
        cfd.ring_forward(*shard[:3], group, causal=causal, seqlen=n)
        closed = False
    except RuntimeError:
        closed = True
    return {"out": out.get(), "lse": lse.get(), "dq": dq.get(), "dk": dk.get(), "dv": dv.get(), "closed": closed}


@requires_gpus
@pytest.mark.parametrize("causal", [False, True])
def test_nccl_ring_pads_inside_and_closes(causal):
    import cupy

    import cuflash
    from cuflash.distributed.launch import run_ranks
    from cuflash.reference import rel_err

    n = 1001   # not a multiple of 2 * world
    results = run_ranks(_padded_rank, 2, (n, causal), timeout_s=240)
    assert all(r["closed"] for r in results)
    rs = cupy.random.RandomState(5)
    q, k, v, dout = (rs.standard_normal((1, n, 2, 64), dtype=np.float32).astype(np.float16) for _ in range(4))
    out, lse = cuflash.forward(q, k, v, causal=causal, return_lse=True)
    grads = cuflash.backward(dout, q, k, v, out, lse, causal=causal)
    got = {name: plan.zigzag_unshard([cupy.asarray(r[name]) for r in results], axis=2 if name == "lse" else 1,
                                     seqlen=n) for name in ("out", "lse", "dq", "dk", "dv")}
    assert rel_err(got["out"], out) <= 2 * FWD_TOL["float16"]
    assert float(cupy.abs(got["lse"] - lse).max()) <= 1e-3
    for name, ref in zip(("dq", "dk", "dv"), grads):
        assert rel_err(got[name], ref) <= 2 * BWD_TOL["float16"], name


RING_VARIANTS = {
    "window_causal": dict(causal=True, window_size=(7, 0)),
    "window_both": dict(window_size=(5, 3)),
    "chunk_causal": dict(causal=True, attention_chunk=8),
    "chunk_window": dict(causal=True, attention_chunk=10, window_size=(4, 0)),
    "alibi": dict(alibi_slopes=np.array([0.3, 0.1, 0.05, 0.2])),
    "alibi_causal_softcap": dict(causal=True, softcap=1.5, alibi_slopes=np.array([0.3, 0.1, 0.05, 0.2])),
    "sinks_window": dict(causal=True, window_size=(6, 0), sinks=np.array([0.5, -1.0, 2.0, 0.0])),
    "softcap": dict(softcap=2.0),
}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", sorted(RING_VARIANTS))
def test_variant_schedules_on_the_cpu(monkeypatch, world, name):
    """The ring with the variants over global positions (positional blocks with the mask policy's offsets, the
    sinks joined once, dsinks summed over the ranks, dlse), NumPy for the kernels, against the float64
    reference on the whole sequence."""
    from cuflash import variants
    from cuflash.distributed import ring
    from cuflash.reference import attention_reference, attention_reference_backward

    monkeypatch.setattr(ring, "_xp", lambda: np)
    monkeypatch.setattr(ring, "api", _NumpyVariantKernels)
    monkeypatch.setattr(ring, "partials", _NumpyKernels)
    kwargs = RING_VARIANTS[name]
    causal = kwargs.get("causal", False)
    rng = np.random.default_rng(world)
    n, scale = 2 * world * 6, 0.4
    q, dout = rng.standard_normal((2, n, 4, 8)), rng.standard_normal((2, n, 4, 8))
    k, v = rng.standard_normal((2, n, 2, 8)), rng.standard_normal((2, n, 2, 8))
    dlse = rng.standard_normal((2, 4, n))
    var = variants.Variants(*kwargs.get("window_size", (-1, -1)), kwargs.get("attention_chunk", 0),
                            kwargs.get("softcap", 0.0), causal, kwargs.get("alibi_slopes"), kwargs.get("sinks"))
    qs, ks, vs, dos = ([plan.zigzag_shard(x, world, r) for r in range(world)] for x in (q, k, v, dout))
    dlses = [plan.zigzag_shard(dlse, world, r, axis=2) for r in range(world)]
    fwd = run_local([ring.forward_schedule(qs[r], ks[r], vs[r], r, world, causal=causal, softmax_scale=scale, var=var)
                     for r in range(world)], copy=_numpy_copy)
    outs, lses = [o for o, _ in fwd], [l_ for _, l_ in fwd]
    ref_kwargs = {key: val for key, val in kwargs.items()}
    ref_o, ref_lse = attention_reference(q, k, v, softmax_scale=scale, **ref_kwargs)
    np.testing.assert_allclose(plan.zigzag_unshard(outs), ref_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(plan.zigzag_unshard(lses, axis=2), ref_lse, rtol=1e-5, atol=1e-5)
    bwd = run_local([ring.backward_schedule(dos[r], qs[r], ks[r], vs[r], outs[r], lses[r], r, world, causal=causal,
                                            softmax_scale=scale, deterministic=False, var=var, dlse=dlses[r])
                     for r in range(world)], copy=_numpy_copy)
    refs = attention_reference_backward(dout, q, k, v, softmax_scale=scale, dlse=dlse, **ref_kwargs)
    for i, gname in enumerate(("dq", "dk", "dv")):
        got = plan.zigzag_unshard([g[i] for g in bwd])
        np.testing.assert_allclose(got, refs[i], rtol=1e-4, atol=1e-4, err_msg=gname)
    if "sinks" in kwargs:
        np.testing.assert_allclose(sum(g[3] for g in bwd), refs[3], rtol=1e-4, atol=1e-4, err_msg="dsinks")


@pytest.mark.parametrize("world", [2, 4])
def test_a_window_visits_only_the_steps_it_reaches(world):
    """With a window shorter than a chunk, a rank's queries meet only the key chunks next to theirs."""
    n = 2 * world * 32
    local = n // world
    for rank in range(world):
        steps = sum(bool(plan.variant_blocks(rank, (rank - s) % world, world, local, (True, 16, 0, 0)))
                    for s in range(world))
        assert steps <= 3


@requires_gpu
@pytest.mark.usefixtures("poison_ring_buffers")
@pytest.mark.parametrize("name", ["window_causal", "chunk_window", "alibi_causal_softcap", "sinks_window"])
@pytest.mark.parametrize("world", [2, 3])
def test_local_ring_with_variants(rng, world, name):
    """The ring's positional blocks (the mask policy's offsets), its sinks joined once and dsinks summed over the
    ranks, on the GPU kernels, against float64 on the whole sequence."""
    import cupy
    import cuflash.distributed as cfd
    from cuflash.reference import attention_reference, attention_reference_backward, rel_err

    kwargs = dict(RING_VARIANTS[name])
    kwargs["window_size"] = tuple(4 * w if w > 0 else w for w in kwargs.get("window_size", (-1, -1)))
    if kwargs.get("attention_chunk"):
        kwargs["attention_chunk"] *= 8
    host = dict(kwargs)
    causal = kwargs.pop("causal", False)
    for key in ("alibi_slopes", "sinks"):
        if key in kwargs:
            kwargs[key] = cupy.asarray(np.asarray(kwargs[key], np.float32))
    n, dtype = 2 * world * 48, "bfloat16"
    q, k, v = randn(rng, (2, n, 4, 64), dtype), randn(rng, (2, n, 2, 64), dtype), randn(rng, (2, n, 2, 64), dtype)
    dout = randn(rng, q.shape, dtype)
    qs, ks, vs, dos = (_shards(x, world) for x in (q, k, v, dout))
    outs, lses = cfd.local_ring_forward(qs, ks, vs, causal=causal, return_lse=True, **kwargs)
    out, lse = cfd.zigzag_unshard(outs), cfd.zigzag_unshard(lses, axis=2)
    ref_o, ref_lse = attention_reference(q, k, v, **host)
    assert rel_err(out, ref_o) <= FWD_TOL[dtype]
    assert_lse_matches(lse, ref_lse, (2, 4, n), rtol=5e-5 if "softcap" in host else 1e-5)
    grads = cfd.local_ring_backward(dos, qs, ks, vs, outs, lses, causal=causal, **kwargs)
    refs = attention_reference_backward(dout, q, k, v, **host)
    for i, gname in enumerate(("dq", "dk", "dv")):
        err = rel_err(cfd.zigzag_unshard(grads[i]), refs[i])
        assert err <= BWD_TOL[dtype], f"{gname} rel err {err:.3e}"
    if "sinks" in host:
        dsinks = sum(d.get().astype(np.float64) for d in grads[3])
        assert np.abs(dsinks - refs[3]).max() <= BWD_TOL[dtype] * max(1.0, float(np.linalg.norm(refs[3])))
