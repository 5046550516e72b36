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
    with pytest.raises(ValueError, match="divisible by 2 \\* world = 4"):
        plan.zigzag_shard(x, 2, 0)
    with pytest.raises(ValueError, match="rank must be in"):
        plan.zigzag_shard(x, 1, 1)
    with pytest.raises(ValueError, match="one array per rank"):
        plan.zigzag_unshard([])


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
        wa = np.where(np.isneginf(la), 0.0, np.exp(la - lse)).transpose(0, 2, 1)[..., None]
        wp = np.exp(lp - lse).transpose(0, 2, 1)[..., None]
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
