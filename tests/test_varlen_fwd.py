"""GPU: the varlen forward (issue #43) against the float64 varlen reference, on every kernel family.

Batches mix empty sequences, single tokens, primes and long sequences, with q and k lengths that differ per
sequence (some with queries and no key); causal and not; GQA; seqused; the variants; the score
distributions of cuflash.distributions; head dims off the tuned ones. Outputs are poisoned before each call
and every row is compared; lse to its own bound. Varlen results also equal the dense API run sequence by
sequence. With the offset checks off, bad offsets must not write outside the output.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import FWD_TOL, assert_close_on_every_row, assert_lse_matches, dtype_of, poisoned, requires_gpu

pytestmark = [requires_gpu, pytest.mark.usefixtures("hopper_kernels_only")]

# Sequence lengths of q and of k (same batch): empty, single tokens, primes, tile edges, keys without queries
# and queries without keys.
LENGTHS_Q = [0, 1, 13, 131, 128, 257, 7, 64, 1, 0]
LENGTHS_K = [3, 1, 0, 131, 200, 257, 19, 1, 64, 0]

# (backend options, dtype): the Hopper kernels where the device is one (else the portable ones again), the
# portable mma.sync kernels, the float32 kernels.
FAMILIES = [({}, "bfloat16"), ({}, "float16"), ({"fwd_backend": "sm80"}, "float16"),
            ({"fwd_backend": "sm80"}, "bfloat16"), ({}, "float32")]


def _offsets(lengths):
    import cupy

    return cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))


def _packed(rng, lengths_q, lengths_k, hq, hkv, d, dtype):
    import cupy

    dt = dtype_of(dtype)
    tq, tk = sum(lengths_q), sum(lengths_k)
    q = cupy.asarray(rng.standard_normal((tq, hq, d)).astype(np.float32).astype(dt))
    k = cupy.asarray(rng.standard_normal((tk, hkv, d)).astype(np.float32).astype(dt))
    v = cupy.asarray(rng.standard_normal((tk, hkv, d)).astype(np.float32).astype(dt))
    return q, k, v, _offsets(lengths_q), _offsets(lengths_k)


def _run(q, k, v, cu_q, cu_k, lengths_q, lengths_k, dtype, **kw):
    """forward_varlen into a poisoned buffer, compared with the reference on every row, and lse."""
    import cupy
    import cuflash
    from cuflash.reference import attention_reference_varlen

    out = poisoned(q.shape, dtype)
    o, lse = cuflash.forward_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), return_lse=True, out=out,
                                    **kw)
    assert o is out and lse.shape == (q.shape[1], q.shape[0])
    ref_kw = {key: val for key, val in kw.items() if key != "check_offsets"}
    ref_o, ref_lse = attention_reference_varlen(q, k, v, cu_q, cu_k, **ref_kw)
    if q.shape[0]:
        assert_close_on_every_row("out", o, cupy.asarray(ref_o), dtype, FWD_TOL)
        assert_lse_matches(lse, ref_lse, ref_lse.shape, rtol=5e-5 if kw.get("softcap") else 1e-5)
    return o, lse


@pytest.mark.parametrize("family,dtype", FAMILIES)
@pytest.mark.parametrize("causal", [False, True])
def test_mixed_lengths(rng, family, dtype, causal):
    import cuflash

    cuflash.options.set(**family)
    q, k, v, cu_q, cu_k = _packed(rng, LENGTHS_Q, LENGTHS_K, 4, 2, 64, dtype)
    _run(q, k, v, cu_q, cu_k, LENGTHS_Q, LENGTHS_K, dtype, causal=causal)


@pytest.mark.parametrize("d", [32, 72, 128, 256])
@pytest.mark.parametrize("family", [{}, {"fwd_backend": "sm80"}])
def test_head_dims(rng, d, family):
    import cuflash

    cuflash.options.set(**family)
    lq, lk = [129, 1, 64, 300], [129, 77, 64, 299]
    q, k, v, cu_q, cu_k = _packed(rng, lq, lk, 2, 1, d, "bfloat16")
    _run(q, k, v, cu_q, cu_k, lq, lk, "bfloat16", causal=d % 64 == 0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_seqused(rng, dtype):
    """seqused shorter than the packed lengths: the unused rows are neither read nor written (out 0, lse -inf)."""
    import cupy

    lq, lk = [40, 7, 130, 5], [50, 9, 140, 0]
    q, k, v, cu_q, cu_k = _packed(rng, lq, lk, 2, 2, 64, dtype)
    used_q = cupy.asarray(np.array([33, 0, 130, 2], np.int32))
    used_k = cupy.asarray(np.array([50, 4, 77, 0], np.int32))
    for causal in (False, True):
        _run(q, k, v, cu_q, cu_k, lq, lk, dtype, causal=causal, seqused_q=used_q, seqused_k=used_k)


@pytest.mark.parametrize("family", [{}, {"fwd_backend": "sm80"}])
@pytest.mark.parametrize("kw", [dict(window_size=(37, 5)), dict(causal=True, window_size=(64, 0), softcap=20.0),
                                dict(causal=True, attention_chunk=48), dict(alibi="batch"),
                                dict(causal=True, alibi="heads", sinks=True)])
def test_variants(rng, family, kw):
    import cuflash

    cuflash.options.set(**family)
    q, k, v, cu_q, cu_k = _packed(rng, LENGTHS_Q, LENGTHS_K, 4, 2, 64, "float16")
    _run(q, k, v, cu_q, cu_k, LENGTHS_Q, LENGTHS_K, "float16", **variant_arguments(rng, kw, 4, len(LENGTHS_Q)))


def variant_arguments(rng, kw: dict, hq: int, batch: int) -> dict:
    """The case's variant arguments with its ALiBi slopes ("batch": (batch, hq); "heads": (hq,)) and sinks drawn."""
    import cupy

    kw = dict(kw)
    alibi = kw.pop("alibi", None)
    if alibi:
        shape = (batch, hq) if alibi == "batch" else (hq,)
        kw["alibi_slopes"] = cupy.asarray(rng.uniform(0.01, 0.5, shape).astype(np.float32))
    if kw.pop("sinks", False):
        kw["sinks"] = cupy.asarray(rng.standard_normal(hq).astype(np.float32))
    return kw


@pytest.mark.parametrize("dist", ["outlier12", "sharp", "sink"])
def test_distributions(dist):
    """The score distributions of cuflash.distributions, each sequence cut from a dense batch (so every
    sequence has its sink at its own key 0)."""
    import cupy
    from cuflash.bench import Shape
    from cuflash.distributions import make_inputs

    lengths = [700, 1, 1023, 64, 300]
    dq, dk, dv = make_inputs(Shape(len(lengths), 4, max(lengths), 128, "bfloat16", True, heads_kv=2), dist, seed=3)
    q = cupy.concatenate([dq[b, :n] for b, n in enumerate(lengths)])
    k = cupy.concatenate([dk[b, :n] for b, n in enumerate(lengths)])
    v = cupy.concatenate([dv[b, :n] for b, n in enumerate(lengths)])
    cu = _offsets(lengths)
    for causal in (False, True):
        _run(q, k, v, cu, cu, lengths, lengths, "bfloat16", causal=causal)


def test_long_sequences(rng):
    """Long sequences against float64 (not only kernel against kernel)."""
    lq, lk = [4099, 17, 2048], [4099, 3000, 1]
    q, k, v, cu_q, cu_k = _packed(rng, lq, lk, 2, 1, 128, "bfloat16")
    for causal in (False, True):
        _run(q, k, v, cu_q, cu_k, lq, lk, "bfloat16", causal=causal)


@pytest.mark.parametrize("family,dtype", [({}, "bfloat16"), ({"fwd_backend": "sm80"}, "float16"), ({}, "float32")])
def test_equals_dense_per_sequence(rng, family, dtype):
    """Sequence by sequence, the dense API on the same rows gives the same output and lse."""
    import cupy
    import cuflash
    from conftest import rel_err_gpu

    cuflash.options.set(**family)
    lq, lk = [300, 5, 129], [280, 64, 129]
    q, k, v, cu_q, cu_k = _packed(rng, lq, lk, 4, 1, 64, dtype)
    o, lse = cuflash.forward_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True, return_lse=True)
    sq, sk = 0, 0
    for nq, nk in zip(lq, lk):
        do, dl = cuflash.forward(q[None, sq:sq + nq], k[None, sk:sk + nk], v[None, sk:sk + nk], causal=True,
                                 return_lse=True)
        assert rel_err_gpu(o[sq:sq + nq], do[0]) <= FWD_TOL[dtype] / 4
        assert_lse_matches(lse[:, sq:sq + nq], dl[0], (4, nq))   # -inf alike (causal rows that see no key)
        sq, sk = sq + nq, sk + nk


@pytest.mark.parametrize("family,dtype", [({}, "bfloat16"), ({"fwd_backend": "sm80"}, "float16"), ({}, "float32")])
def test_bad_offsets_unchecked_stay_inside(rng, family, dtype):
    """check_offsets=False with offsets that are out of range, decreasing or negative: wrong rows at most,
    never a write outside the output (guard rows around it keep their values) nor a fault."""
    import cupy
    import cuflash

    cuflash.options.set(**family)
    lq = [30, 40, 50]
    q, k, v, _, _ = _packed(rng, lq, lq, 2, 2, 64, dtype)
    total = q.shape[0]
    guard = 64
    big = cupy.full((total + 2 * guard, 2, 64), 7, dtype=q.dtype)
    out = big[guard:guard + total]
    bad = [[0, 1000, 50, total], [0, -5, 2**31 - 1, total], [0, 40, 20, 10], [-100, 30, 70, 2**30]]
    for offsets in bad:
        cu = cupy.asarray(np.array(offsets, np.int32))
        cuflash.forward_varlen(q, k, v, cu, cu, 64, 64, causal=True, out=out, check_offsets=False)
        cupy.cuda.get_current_stream().synchronize()
        assert bool((big[:guard] == 7).all()) and bool((big[guard + total:] == 7).all())


def kernel_configs(cc: int = 90) -> list:
    """The KernelConfigs this file's cases run (for dev/precompile.py's varlen_tests group)."""
    from cuflash import heuristics
    from cuflash.variants import MaskVariant

    def one(dtype, d, causal, backend=None, max_q=257, max_k=257, **variant):
        var = MaskVariant(varlen=True, **variant)
        return heuristics.fwd_config(dtype, d, causal, cc, backend=backend, short=heuristics.fwd_short(max_q, max_k),
                                     long_seqs=heuristics.fwd_long(max_q, max_k), variant=var)

    out = []
    for causal in (False, True):
        for family, dtype in FAMILIES:
            out.append(one(dtype, 64, causal, family.get("fwd_backend")))
        for backend in (None, "sm80"):
            out.append(one("bfloat16", 128, causal, backend, 300, 299))
            out.append(one("bfloat16", 64, causal, backend, 300, 299))
            out.append(one("float16", 64, causal, backend, 130, 140))
        out.append(one("float32", 64, causal, None, 130, 140))
        out.append(one("bfloat16", 128, causal, None, 1023, 1023))
        out.append(one("bfloat16", 128, causal, None, 4099, 4099))
    for d in (32, 72, 128, 256):
        for backend in (None, "sm80"):
            out.append(one("bfloat16", d, d % 64 == 0, backend, 300, 299))
    for backend in (None, "sm80"):
        out.append(one("float16", 64, False, backend, local=True))
        out.append(one("float16", 64, True, backend, local=True, softcap=True))
        out.append(one("float16", 64, True, backend, local=True, chunk=True))
        out.append(one("float16", 64, False, backend, alibi=True))
        out.append(one("float16", 64, True, backend, alibi=True, sink=True))
    return list({c.key(): c for c in out}.values())


def test_lse_buffer(rng):
    """lse= (with return_lse): the log-sum-exp written into the caller's (heads_q, total_q) buffer, poisoned first,
    equal to the one forward_varlen allocates; seqused's unused rows get -inf there too. Refused: without
    return_lse, another shape or dtype, a non-contiguous view, a buffer overlapping q."""
    import cupy
    import cuflash

    lq, lk = [40, 7, 130, 5], [50, 9, 140, 3]
    q, k, v, cu_q, cu_k = _packed(rng, lq, lk, 2, 1, 64, "bfloat16")
    used_q = cupy.asarray(np.array([33, 7, 130, 2], np.int32))
    for seqused in (None, used_q):
        buf = cupy.full((2, sum(lq)), np.nan, dtype=np.float32)
        o, lse = cuflash.forward_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), return_lse=True, lse=buf,
                                        seqused_q=seqused)
        o2, lse2 = cuflash.forward_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), return_lse=True, seqused_q=seqused)
        assert lse is buf and bool(cupy.all((lse == lse2) | (cupy.isinf(lse) & cupy.isinf(lse2))))
        assert not bool(cupy.any(cupy.isnan(lse)))
    args = (q, k, v, cu_q, cu_k, max(lq), max(lk))
    good = cupy.empty((2, sum(lq)), dtype=np.float32)
    with pytest.raises(ValueError, match="return_lse=True"):
        cuflash.forward_varlen(*args, lse=good)
    with pytest.raises(ValueError, match="shape"):
        cuflash.forward_varlen(*args, return_lse=True, lse=cupy.empty((sum(lq), 2), dtype=np.float32))
    with pytest.raises(TypeError, match="float32"):
        cuflash.forward_varlen(*args, return_lse=True, lse=good.astype(np.float16))
    with pytest.raises(ValueError, match="C-contiguous"):
        cuflash.forward_varlen(*args, return_lse=True, lse=cupy.empty((sum(lq), 2), dtype=np.float32).T)
    with pytest.raises(ValueError, match="overlaps"):
        cuflash.forward_varlen(*args, return_lse=True, lse=q.view(np.float32).reshape(-1)[:2 * sum(lq)].reshape(2, -1))
