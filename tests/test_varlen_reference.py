"""CPU only (issue #43): the float64 references with v's head dim different from q/k's, against an
explicit softmax formula and finite differences, and the packed variable-length references against the
dense reference run sequence by sequence (exactly: they are computed the same way) and against the
formula; bad offsets refused naming the argument."""
from __future__ import annotations

import numpy as np
import pytest

from cuflash.reference import (_reference_by_chunks, attention_reference, attention_reference_backward,
                               attention_reference_varlen, attention_reference_varlen_backward, rel_err,
                               visible_mask)
from conftest import requires_gpu


def _formula(q, k, v, causal, scale, window=(-1, -1), softcap=0.0, slopes=None, sinks=None):
    """softmax(q k^T * scale) v head by head, spelled out with NumPy (dense layout, GQA by index)."""
    b, nq, hq, _ = q.shape
    nk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    g = hq // hkv
    out, lse = np.zeros((b, nq, hq, dv)), np.full((b, hq, nq), -np.inf)
    vis = visible_mask(nq, nk, causal, window)
    for bi in range(b):
        for h in range(hq):
            s = q[bi, :, h] @ k[bi, :, h // g].T * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            if slopes is not None:
                s = s - slopes[bi, h] * np.abs(np.arange(nq)[:, None] + nk - nq - np.arange(nk)[None, :])
            e = np.where(vis, np.exp(np.where(vis, s, 0.0)), 0.0)
            total = e.sum(axis=1) + (np.exp(sinks[h]) if sinks is not None else 0.0)
            seen = total > 0
            out[bi, seen, h] = (e[seen] / total[seen, None]) @ v[bi, :, h // g]
            lse[bi, h, seen] = np.log(total[seen])
    return out, lse


def _assert_close_lse(lse, ref, rtol=1e-12):
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref))
    fin = np.isfinite(ref)
    np.testing.assert_allclose(lse[fin], ref[fin], rtol=rtol)


# ---------------------------------------------------------------------------
# Dv != Dqk, dense

DIM_PAIRS = [(16, 8), (8, 24), (192, 128), (128, 64), (576, 512)]


@pytest.mark.parametrize("dqk,dv", DIM_PAIRS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk,hq,hkv", [(5, 7, 2, 2), (7, 4, 4, 2), (3, 3, 3, 1)])
def test_dv_forward_matches_formula(dqk, dv, causal, nq, nk, hq, hkv):
    rng = np.random.default_rng(dqk * 7 + dv + nq * 1000 + causal)
    q = rng.standard_normal((2, nq, hq, dqk))
    k = rng.standard_normal((2, nk, hkv, dqk))
    v = rng.standard_normal((2, nk, hkv, dv))
    out, lse = attention_reference(q, k, v, causal=causal)   # the default scale: 1/sqrt(Dqk)
    assert out.shape == (2, nq, hq, dv) and lse.shape == (2, hq, nq)
    ref_out, ref_lse = _formula(q, k, v, causal, 1.0 / np.sqrt(dqk))
    assert np.abs(ref_out).max() > 0.1   # never a comparison of zeros
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    _assert_close_lse(lse, ref_lse)


def _loss_and_grads(forward, backward, args, dout, dlse, kwargs, names):
    """The scalar loss sum(out * dout) + sum(lse * dlse) (finite lse) and its central differences for every
    element of the named inputs, beside the backward's gradients."""
    def loss(a):
        o, l_ = forward(*[a[n] for n in ("q", "k", "v")], **{**kwargs, **({"sinks": a["sinks"]} if "sinks" in a
                                                                       else {})})
        return float((o * dout).sum() + (np.where(np.isfinite(l_), l_, 0.0) * dlse).sum())

    grads = backward(dout, *[args[n] for n in ("q", "k", "v")], dlse=dlse, **kwargs)
    assert len(grads) == len(names)
    eps = 1e-6
    for name, g in zip(names, grads):
        assert g.shape == args[name].shape, name
        num = np.zeros_like(args[name])
        for idx in np.ndindex(args[name].shape):
            a = {n: x.copy() for n, x in args.items()}
            a[name][idx] += eps
            up = loss(a)
            a[name][idx] -= 2 * eps
            num[idx] = (up - loss(a)) / (2 * eps)
        assert np.abs(num).max() > 1e-3, name   # the gradient is not trivially zero
        assert rel_err(g, num) < 1e-7, (name, rel_err(g, num))


@pytest.mark.parametrize("dqk,dv", [(16, 8), (8, 24)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2)])
def test_dv_backward_matches_finite_differences(dqk, dv, causal, hq, hkv):
    rng = np.random.default_rng(dqk * 31 + dv + hq + causal)
    nq, nk = 4, 5
    args = {"q": rng.standard_normal((1, nq, hq, dqk)), "k": rng.standard_normal((1, nk, hkv, dqk)),
            "v": rng.standard_normal((1, nk, hkv, dv))}
    dout, dlse = rng.standard_normal((1, nq, hq, dv)), rng.standard_normal((1, hq, nq))
    _loss_and_grads(attention_reference, attention_reference_backward, args, dout, dlse,
                    dict(causal=causal), ["q", "k", "v"])


@pytest.mark.parametrize("dqk,dv", [(16, 8), (8, 24)])
@pytest.mark.parametrize("causal", [False, True])
def test_dv_chunked_path_matches_whole(dqk, dv, causal):
    """The GPU reference's chunked path (NumPy as its array module) takes Dv != Dqk too."""
    rng = np.random.default_rng(dqk + dv)
    q, k = rng.standard_normal((2, 11, 4, dqk)), rng.standard_normal((2, 6, 2, dqk))
    v, dout = rng.standard_normal((2, 6, 2, dv)), rng.standard_normal((2, 11, 4, dv))
    out, lse = attention_reference(q, k, v, causal=causal, softmax_scale=0.3)
    grads = attention_reference_backward(dout, q, k, v, causal=causal, softmax_scale=0.3)
    got = _reference_by_chunks(np, q, k, v, dout, causal, 0.3, 4)
    np.testing.assert_allclose(got[0], out, rtol=1e-12, atol=1e-12)
    _assert_close_lse(got[1], lse)
    for g, r in zip(got[2:], grads):
        assert g.shape == r.shape
        np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-12)


def test_dv_shape_checks():
    q, k = np.ones((1, 3, 2, 16)), np.ones((1, 3, 2, 16))
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        attention_reference(q, k, np.ones((1, 4, 2, 8)))
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        attention_reference(q, k, np.ones((1, 3, 1, 8)))
    with pytest.raises(ValueError, match="k must have the head_dim of q"):
        attention_reference(q, np.ones((1, 3, 2, 8)), np.ones((1, 3, 2, 8)))
    with pytest.raises(ValueError, match="dout must have the shape of q with v's head_dim"):
        attention_reference_backward(np.ones((1, 3, 2, 16)), q, k, np.ones((1, 3, 2, 8)))
    # The kernels' API keeps requiring equal head dims until kernels take Dv != Dqk.
    from cuflash._checks import check_qkv_shapes

    with pytest.raises(ValueError, match="k and v must have the same shape"):
        check_qkv_shapes(q, k, np.ones((1, 3, 2, 8)))


# ---------------------------------------------------------------------------
# Packed variable-length batches

# Per sequence (rows, keys): an empty one, a single token, primes, Nq > Nk with no key at all, a longer one.
LENS = [(0, 5), (1, 1), (7, 11), (13, 7), (3, 0), (31, 37)]
# With seqused: packed ranges longer than the used prefixes.
PADS = [(2, 0), (0, 2), (3, 1), (0, 4), (1, 2), (2, 3)]


def _packed(hq, hkv, dqk, dv, seqused, seed):
    """Packed q, k, v, dout, dlse and the offsets; with ``seqused``, each range is padded past its used
    prefix, the first sequence starts at an offset and the packed tensors end past the last range."""
    rng = np.random.default_rng(seed)
    used_q = np.array([n for n, _ in LENS])
    used_k = np.array([n for _, n in LENS])
    pad_q = np.array([p for p, _ in PADS]) if seqused else 0 * used_q
    pad_k = np.array([p for _, p in PADS]) if seqused else 0 * used_k
    start, tail = (2, 3) if seqused else (0, 0)
    cu_q = (start + np.concatenate([[0], np.cumsum(used_q + pad_q)])).astype(np.int32)
    cu_k = (start + np.concatenate([[0], np.cumsum(used_k + pad_k)])).astype(np.int32)
    tq, tk = int(cu_q[-1]) + tail, int(cu_k[-1]) + tail
    x = dict(q=rng.standard_normal((tq, hq, dqk)), k=rng.standard_normal((tk, hkv, dqk)),
             v=rng.standard_normal((tk, hkv, dv)), dout=rng.standard_normal((tq, hq, dv)),
             dlse=rng.standard_normal((hq, tq)), cu_q=cu_q, cu_k=cu_k)
    if seqused:
        x["seqused_q"], x["seqused_k"] = used_q.astype(np.int32), used_k.astype(np.int32)
    return x, [(int(cu_q[b]), int(used_q[b]), int(cu_k[b]), int(used_k[b])) for b in range(len(LENS))]


VARIANTS = {
    "plain": {},
    "window": dict(window_size=(3, 1)),
    "softcap_alibi_bh": dict(softcap=2.0, alibi_slopes="bh"),
    "alibi_h": dict(alibi_slopes="h"),
    "sinks_dlse": dict(sinks=True, dlse=True),
    "chunk_window": dict(attention_chunk=4, window_size=(5, -1)),
}


def _variant_kwargs(name, hq, rng):
    kw = dict(VARIANTS[name])
    if kw.get("alibi_slopes") == "bh":
        kw["alibi_slopes"] = rng.uniform(0.05, 0.5, (len(LENS), hq))   # a different row per sequence
    elif kw.get("alibi_slopes") == "h":
        kw["alibi_slopes"] = rng.uniform(0.05, 0.5, hq)
    if kw.pop("sinks", False):
        kw["sinks"] = rng.standard_normal(hq)
    return kw, kw.pop("dlse", False)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("seqused", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hkv,dqk,dv", [(2, 2, 8, 8), (4, 1, 16, 8)])
def test_varlen_matches_dense_per_sequence(variant, seqused, causal, hq, hkv, dqk, dv):
    x, seqs = _packed(hq, hkv, dqk, dv, seqused, seed=hq * 10 + dqk + seqused * 3 + causal)
    kw, with_dlse = _variant_kwargs(variant, hq, np.random.default_rng(7))
    kw["causal"], kw["softmax_scale"] = causal, 0.4
    used = {k_: x[k_] for k_ in ("seqused_q", "seqused_k") if k_ in x}
    dlse = x["dlse"] if with_dlse else None
    out, lse = attention_reference_varlen(x["q"], x["k"], x["v"], x["cu_q"], x["cu_k"], **used, **kw)
    grads = attention_reference_varlen_backward(x["dout"], x["q"], x["k"], x["v"], x["cu_q"], x["cu_k"],
                                                **used, dlse=dlse, **kw)
    tq, tk = x["q"].shape[0], x["k"].shape[0]
    assert out.shape == (tq, hq, dv) and lse.shape == (hq, tq)
    assert len(grads) == (4 if "sinks" in kw else 3)
    rows_seen, keys_seen = np.zeros(tq, bool), np.zeros(tk, bool)
    dsinks = np.zeros(hq)
    for b, (r0, nq, c0, nk) in enumerate(seqs):
        rows, keys = slice(r0, r0 + nq), slice(c0, c0 + nk)
        rows_seen[rows], keys_seen[keys] = True, True
        dkw = dict(kw)
        if kw.get("alibi_slopes") is not None and kw["alibi_slopes"].ndim == 2:
            dkw["alibi_slopes"] = kw["alibi_slopes"][b:b + 1]
        qs, ks, vs = x["q"][None, rows], x["k"][None, keys], x["v"][None, keys]
        o, l_ = attention_reference(qs, ks, vs, **dkw)
        g = attention_reference_backward(x["dout"][None, rows], qs, ks, vs,
                                         dlse=None if dlse is None else dlse[None, :, rows], **dkw)
        # Computed the same way: exactly equal.
        assert np.array_equal(out[rows], o[0]) and np.array_equal(lse[:, rows], l_[0]), b
        assert np.array_equal(grads[0][rows], g[0][0]), b
        assert np.array_equal(grads[1][keys], g[1][0]) and np.array_equal(grads[2][keys], g[2][0]), b
        if "sinks" in kw:
            dsinks += g[3]
    if "sinks" in kw:
        assert np.array_equal(grads[3], dsinks) and np.abs(dsinks).max() > 1e-3
    # Rows and keys outside every used range: out 0, lse -inf, zero gradients.
    assert np.all(out[~rows_seen] == 0) and np.all(np.isneginf(lse[:, ~rows_seen]))
    assert np.all(grads[0][~rows_seen] == 0)
    assert np.all(grads[1][~keys_seen] == 0) and np.all(grads[2][~keys_seen] == 0)
    assert (~rows_seen).any() == seqused and (~keys_seen).any() == seqused
    # The used ranges hold values (no sequence silently skipped): the rows that see a key are nonzero.
    assert np.abs(out[rows_seen]).max() > 0.1 and np.abs(grads[1][keys_seen]).max() > 1e-3


def test_varlen_matches_formula():
    """Independently of the dense reference: the packed output against the softmax formula, sequence by
    sequence, with seqused, GQA, causal, Dv != Dqk, ALiBi (batch, Hq) and sinks."""
    hq, hkv, dqk, dv = 4, 2, 16, 8
    x, seqs = _packed(hq, hkv, dqk, dv, True, seed=11)
    rng = np.random.default_rng(3)
    slopes, sinks = rng.uniform(0.05, 0.5, (len(LENS), hq)), rng.standard_normal(hq)
    out, lse = attention_reference_varlen(x["q"], x["k"], x["v"], x["cu_q"], x["cu_k"], seqused_q=x["seqused_q"],
                                          seqused_k=x["seqused_k"], causal=True, alibi_slopes=slopes,
                                          sinks=sinks)
    for b, (r0, nq, c0, nk) in enumerate(seqs):
        rows, keys = slice(r0, r0 + nq), slice(c0, c0 + nk)
        o, l_ = _formula(x["q"][None, rows], x["k"][None, keys], x["v"][None, keys], True, 1 / np.sqrt(dqk),
                         slopes=slopes[b:b + 1], sinks=sinks)
        np.testing.assert_allclose(out[rows], o[0], rtol=1e-12, atol=1e-12)
        _assert_close_lse(lse[:, rows], l_[0])
    assert np.abs(out).max() > 0.1


def test_varlen_backward_matches_finite_differences():
    """The packed gradients (every element, padding included) against central differences of the packed
    loss: seqused, GQA, causal, Dv != Dqk, ALiBi (batch, Hq), sinks and dlse."""
    rng = np.random.default_rng(17)
    hq, hkv, dqk, dv = 2, 1, 4, 3
    cu_q, cu_k = np.array([0, 3, 3, 8], np.int32), np.array([1, 3, 6, 10], np.int32)
    seqused_q, seqused_k = np.array([2, 0, 5], np.int32), np.array([2, 3, 3], np.int32)
    tq, tk = 9, 11
    args = {"q": rng.standard_normal((tq, hq, dqk)), "k": rng.standard_normal((tk, hkv, dqk)),
            "v": rng.standard_normal((tk, hkv, dv)), "sinks": rng.standard_normal(hq)}
    dout, dlse = rng.standard_normal((tq, hq, dv)), rng.standard_normal((hq, tq))
    kwargs = dict(seqused_q=seqused_q, seqused_k=seqused_k, causal=True, softmax_scale=0.6,
                  alibi_slopes=rng.uniform(0.1, 0.4, (3, hq)))

    def fwd(q, k, v, **kw):
        return attention_reference_varlen(q, k, v, cu_q, cu_k, **kw)

    def bwd(do, q, k, v, **kw):
        return attention_reference_varlen_backward(do, q, k, v, cu_q, cu_k, sinks=args["sinks"], **kw)

    _loss_and_grads(fwd, bwd, args, dout, dlse, kwargs, ["q", "k", "v", "sinks"])


class _DeviceLike:
    """Stands in for a CuPy array (no GPU here): the references copy anything with ``get`` to the host."""

    def __init__(self, a):
        self._a = a

    def get(self):
        return self._a


def test_varlen_takes_device_like_offsets_and_lists():
    x, _ = _packed(2, 2, 8, 8, True, seed=1)
    ref = attention_reference_varlen(x["q"], x["k"], x["v"], x["cu_q"], x["cu_k"], seqused_q=x["seqused_q"],
                                     seqused_k=x["seqused_k"])
    got = attention_reference_varlen(x["q"], x["k"], x["v"], _DeviceLike(x["cu_q"]), x["cu_k"].tolist(),
                                     seqused_q=_DeviceLike(x["seqused_q"]), seqused_k=x["seqused_k"].astype(np.int64))
    assert np.array_equal(ref[0], got[0]) and np.array_equal(ref[1], got[1])


def test_varlen_empty_batch():
    q, k, v = np.ones((3, 2, 8)), np.ones((4, 2, 8)), np.ones((4, 2, 8))
    out, lse = attention_reference_varlen(q, k, v, np.array([0], np.int32), np.array([0], np.int32))
    assert np.all(out == 0) and np.all(np.isneginf(lse)) and lse.shape == (2, 3)
    dq, dk, dv = attention_reference_varlen_backward(np.ones((3, 2, 8)), q, k, v, np.array([0]), np.array([0]))
    assert not dq.any() and not dk.any() and not dv.any()


# ---------------------------------------------------------------------------
# Argument checks, naming the argument

_Q, _K, _V = np.ones((6, 2, 8)), np.ones((5, 1, 8)), np.ones((5, 1, 4))
_CU_Q, _CU_K = np.array([0, 2, 6], np.int32), np.array([0, 3, 5], np.int32)


@pytest.mark.parametrize("change,exc,match", [
    ({"cu_seqlens_q": np.array([[0, 2, 6]], np.int32)}, ValueError, "cu_seqlens_q must be 1-D"),
    ({"cu_seqlens_q": np.array([0, 4, 2], np.int32)}, ValueError, "cu_seqlens_q must be non-decreasing"),
    ({"cu_seqlens_k": np.array([0, 3, 6], np.int32)}, ValueError, "cu_seqlens_k ends at 6, past the 5"),
    ({"cu_seqlens_q": np.array([-1, 2, 6], np.int32)}, ValueError, "cu_seqlens_q must start at an offset >= 0"),
    ({"cu_seqlens_q": np.array([], np.int32)}, ValueError, "cu_seqlens_q must have length batch \\+ 1"),
    ({"cu_seqlens_k": np.array([0, 5], np.int32)}, ValueError, "cu_seqlens_k must have length batch \\+ 1 = 3"),
    ({"cu_seqlens_q": np.array([0.0, 2.0, 6.0])}, TypeError, "cu_seqlens_q must be a 1-D array of integers"),
    ({"cu_seqlens_k": None}, TypeError, "cu_seqlens_k must be a 1-D array of integers"),
    ({"seqused_q": np.array([1], np.int32)}, ValueError, "seqused_q must have length batch = 2"),
    ({"seqused_k": np.array([4, 1], np.int32)}, ValueError, "seqused_k must lie in"),
    ({"seqused_q": np.array([-1, 1], np.int32)}, ValueError, "seqused_q must lie in"),
    ({"seqused_k": np.array([True, False])}, TypeError, "seqused_k must be a 1-D array of integers"),
    ({"q": np.ones((1, 6, 2, 8))}, ValueError, "q must have 3 dimensions"),
    ({"v": np.ones((4, 1, 4))}, ValueError, "k and v must have the same shape"),
    ({"k": np.ones((5, 1, 4))}, ValueError, "k must have the head_dim of q"),
    ({"q": np.ones((6, 3, 8)), "k": np.ones((5, 2, 8)), "v": np.ones((5, 2, 4))}, ValueError,
     "multiple of heads_kv"),
    ({"alibi_slopes": np.ones((3, 2))}, ValueError, "alibi_slopes must have shape"),
    ({"sinks": np.ones(3)}, ValueError, "sinks must have shape"),
    ({"softcap": -1.0}, ValueError, "softcap"),
    ({"causal": "yes"}, TypeError, "causal must be a bool"),
])
@pytest.mark.parametrize("fn", ["forward", "backward"])
def test_varlen_argument_checks(change, exc, match, fn):
    args = {"q": _Q, "k": _K, "v": _V, "cu_seqlens_q": _CU_Q, "cu_seqlens_k": _CU_K, **change}
    q, k, v, cq, ck = (args.pop(n) for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"))
    with pytest.raises(exc, match=match):
        if fn == "forward":
            attention_reference_varlen(q, k, v, cq, ck, **args)
        else:
            attention_reference_varlen_backward(np.ones((6, 2, 4)), q, k, v, cq, ck, **args)


def test_varlen_backward_shape_checks():
    with pytest.raises(ValueError, match="dout must have the shape of q with v's head_dim"):
        attention_reference_varlen_backward(np.ones((6, 2, 8)), _Q, _K, _V, _CU_Q, _CU_K)
    with pytest.raises(ValueError, match="dlse must have the packed shape of lse"):
        attention_reference_varlen_backward(np.ones((6, 2, 4)), _Q, _K, _V, _CU_Q, _CU_K, dlse=np.ones((6, 2)))


@requires_gpu
def test_cupy_inputs_match_numpy():
    """CuPy arrays and offsets (read through .get()) give exactly what the NumPy ones give."""
    import cupy

    rng = np.random.default_rng(7)
    q, k, v = rng.standard_normal((9, 2, 16)), rng.standard_normal((11, 1, 16)), rng.standard_normal((11, 1, 8))
    cu_q, cu_k = np.array([0, 4, 9], np.int32), np.array([0, 6, 11], np.int32)
    want = attention_reference_varlen(q, k, v, cu_q, cu_k, causal=True)
    got = attention_reference_varlen(*(cupy.asarray(x) for x in (q, k, v, cu_q, cu_k)), causal=True)
    for a, b in zip(got, want):
        assert isinstance(a, np.ndarray) and np.array_equal(a, b)
