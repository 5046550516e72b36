"""The attention variants on the host, CPU only: the float64 reference against element-by-element
definitions and finite differences, the Python mirror of the mask policy's tile ranges against the
reference's mask, and every argument check before the device (fake CuPy arrays)."""
from __future__ import annotations

import math

import numpy as np
import pytest

import cuflash
from cuflash import variants
from cuflash.reference import attention_reference, attention_reference_backward, visible_mask
from conftest import fake_cupy_array as arr


def _brute_visible(nq, nk, causal, left, right, chunk):
    out = np.zeros((nq, nk), bool)
    for i in range(nq):
        p = i + nk - nq
        for j in range(nk):
            ok = True
            if causal and j > p:
                ok = False
            if not causal and right >= 0 and j > p + right:
                ok = False
            if left >= 0 and j < p - left:
                ok = False
            if chunk and math.floor(j / chunk) != math.floor(p / chunk):
                ok = False
            out[i, j] = ok
    return out


@pytest.mark.parametrize("nq,nk", [(7, 7), (5, 13), (13, 5), (1, 9), (9, 1)])
@pytest.mark.parametrize("causal,left,right,chunk", [
    (False, -1, -1, 0), (True, -1, -1, 0), (True, 2, 0, 0), (False, 3, 1, 0), (False, 0, 0, 0),
    (False, -1, 2, 0), (True, -1, -1, 4), (False, -1, -1, 3), (True, 1, 0, 3), (False, 100, 100, 0)])
def test_visible_mask_matches_its_definition(nq, nk, causal, left, right, chunk):
    assert np.array_equal(visible_mask(nq, nk, causal, (left, right), chunk),
                          _brute_visible(nq, nk, causal, left, right, chunk))


def _inputs(b=2, nq=6, nk=9, hq=4, hkv=2, d=8, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((b, nq, hq, d)), rng.standard_normal((b, nk, hkv, d)),
            rng.standard_normal((b, nk, hkv, d)), rng.standard_normal((b, nq, hq, d)))


def test_reference_softcap_alibi_sinks_by_definition():
    q, k, v, _ = _inputs()
    b, nq, hq, d = q.shape
    nk = k.shape[1]
    slopes = np.array([0.5, 0.25, 0.125, 0.0625])
    sinks = np.array([0.3, -1.0, 2.0, 0.0])
    cap, scale = 5.0, 0.4
    out, lse = attention_reference(q, k, v, softmax_scale=scale, softcap=cap, alibi_slopes=slopes, sinks=sinks,
                                   window_size=(3, 1))
    vis = _brute_visible(nq, nk, False, 3, 1, 0)
    for bi in range(b):
        for h in range(hq):
            kh, vh = k[bi, :, h // 2], v[bi, :, h // 2]
            for i in range(nq):
                s = cap * np.tanh(scale * (q[bi, i, h] @ kh.T) / cap)
                s = s - slopes[h] * np.abs(i + nk - nq - np.arange(nk))
                s = np.where(vis[i], s, -np.inf)
                e = np.exp(s)
                total = e.sum() + np.exp(sinks[h])
                np.testing.assert_allclose(out[bi, i, h], (e / total) @ vh, rtol=1e-12, atol=1e-12)
                np.testing.assert_allclose(lse[bi, h, i], np.log(total), rtol=1e-12)


def test_reference_rows_without_keys_get_zero_and_their_sink():
    q, k, v, _ = _inputs(nq=9, nk=4)
    sinks = np.array([0.3, -1.0, 2.0, 0.0])
    out, lse = attention_reference(q, k, v, causal=True, sinks=sinks)
    # rows 0..4 see no key (causal, Nq > Nk)
    assert np.all(out[:, :5] == 0)
    np.testing.assert_array_equal(lse[:, :, :5], np.broadcast_to(sinks[None, :, None], (2, 4, 5)))
    out, lse = attention_reference(q, k, v, causal=True)
    assert np.all(out[:, :5] == 0) and np.all(lse[:, :, :5] == -np.inf)


@pytest.mark.parametrize("kwargs", [dict(softcap=2.0), dict(alibi_slopes=np.array([0.3, 0.1, 0.7, 0.05])),
                                    dict(window_size=(2, 1), softcap=3.0),
                                    dict(causal=True, attention_chunk=4, sinks=np.array([0.5, -0.5, 1.5, 0.0]))])
def test_reference_gradients_by_finite_differences(kwargs):
    q, k, v, dout = _inputs()
    rng = np.random.default_rng(5)
    dlse = rng.standard_normal((2, 4, 6))

    def loss(q_, k_, v_, sinks_=None):
        kw = dict(kwargs)
        if sinks_ is not None:
            kw["sinks"] = sinks_
        o, l_ = attention_reference(q_, k_, v_, softmax_scale=0.3, **kw)
        finite = np.isfinite(l_)
        return float((o * dout).sum() + (np.where(finite, l_, 0) * dlse).sum())

    grads = attention_reference_backward(dout, q, k, v, softmax_scale=0.3, dlse=dlse, **kwargs)
    names = ["q", "k", "v"] + (["sinks"] if "sinks" in kwargs else [])
    assert len(grads) == len(names)
    base = {"q": q, "k": k, "v": v}
    if "sinks" in kwargs:
        base["sinks"] = kwargs["sinks"]
    eps = 1e-6
    for name, g in zip(names, grads):
        x = base[name]
        for idx in [tuple(rng.integers(0, n) for n in x.shape) for _ in range(6)]:
            args = {n: base[n].copy() for n in base}
            args[name][idx] += eps
            up = loss(args["q"], args["k"], args["v"], args.get("sinks"))
            args[name][idx] -= 2 * eps
            down = loss(args["q"], args["k"], args["v"], args.get("sinks"))
            assert abs((up - down) / (2 * eps) - g[idx]) <= 1e-5 * max(1.0, abs(g[idx])), (name, idx)


# ---------------------------------------------------------------------------
# The policy's tile ranges (kernels_cu/common/mask.cuh), mirrored in Python


def _floor_div(a, b):
    return a // b


class _Policy:
    """MaskPolicy's range functions with the host's parameter values (variants.param_values)."""

    def __init__(self, var, nq, nk, bm, bn):
        vals = var.param_values(nq, nk, 0.5)
        self.diag, self.left, self.right, self.chunk, self.key_offset = vals[:5]
        self.nq, self.nk, self.bm, self.bn = nq, nk, bm, bn

    def hi(self, row):
        pos = row + self.diag
        h = pos + self.right
        if self.chunk:
            h = min(h, (_floor_div(pos + self.key_offset, self.chunk) + 1) * self.chunk - 1 - self.key_offset)
        return h

    def lo(self, row):
        pos = row + self.diag
        lo = pos - self.left
        if self.chunk:
            lo = max(lo, _floor_div(pos + self.key_offset, self.chunk) * self.chunk - self.key_offset)
        return lo

    def n_range(self, m):
        lo = self.lo(m * self.bm)
        hi = self.hi((m + 1) * self.bm - 1)
        return (0 if lo <= 0 else lo // self.bn), min(-(-self.nk // self.bn), 0 if hi < 0 else hi // self.bn + 1)

    def m_range(self, n):
        c = n * self.bn
        first = c - self.right
        if self.chunk:
            first = max(first, _floor_div(c + self.key_offset, self.chunk) * self.chunk - self.key_offset)
        first -= self.diag
        c = (n + 1) * self.bn - 1
        last = c + self.left
        if self.chunk:
            last = min(last, (_floor_div(c + self.key_offset, self.chunk) + 1) * self.chunk - 1 - self.key_offset)
        last -= self.diag
        all_ = -(-self.nq // self.bm)
        return (0 if first <= 0 else first // self.bm), (0 if last < 0 else min(all_, last // self.bm + 1))


@pytest.mark.parametrize("nq,nk", [(300, 300), (100, 700), (700, 100), (1, 513), (129, 1)])
@pytest.mark.parametrize("causal,window,chunk", [(True, (64, 0), 0), (False, (100, 30), 0), (True, (0, 0), 0),
                                                 (False, (-1, -1), 96), (True, (-1, -1), 64), (True, (40, 0), 128),
                                                 (False, (0, 0), 0), (False, (5, -1), 0)])
def test_policy_tile_ranges_cover_exactly_the_visible_tiles(nq, nk, causal, window, chunk):
    var = variants.Variants(window[0], window[1], chunk, 0.0, causal)
    assert var.local
    vis = visible_mask(nq, nk, causal, window, chunk)
    for bm, bn in ((128, 128), (64, 128), (192, 128), (128, 64)):
        pol = _Policy(var, nq, nk, bm, bn)
        for m in range(-(-nq // bm)):
            lo, hi = pol.n_range(m)
            tiles = vis[m * bm:(m + 1) * bm].reshape(-1, nk)
            seen = [n for n in range(-(-nk // bn)) if tiles[:, n * bn:(n + 1) * bn].any()]
            assert all(lo <= n < hi for n in seen), (m, lo, hi, seen)
            # no tile outside the window is visited: the range is exactly the visible tiles' span
            if seen:
                assert (lo, hi) == (seen[0], seen[-1] + 1), (m, lo, hi, seen)
        for n in range(-(-nk // bn)):
            lo, hi = pol.m_range(n)
            seen = [m for m in range(-(-nq // bm)) if vis[m * bm:(m + 1) * bm, n * bn:(n + 1) * bn].any()]
            assert all(lo <= m < hi for m in seen), (n, lo, hi, seen)
            if seen:
                assert (lo, hi) == (seen[0], seen[-1] + 1), (n, lo, hi, seen)


@pytest.mark.parametrize("nq,nk", [(300, 300), (700, 100), (9, 4)])
@pytest.mark.parametrize("causal,window,chunk", [(True, (-1, -1), 0), (False, (-1, 3), 0), (True, (5, 0), 16),
                                                 (False, (-1, -1), 16), (False, (2, -1), 0)])
def test_first_seen_row(nq, nk, causal, window, chunk):
    vis = visible_mask(nq, nk, causal, window, chunk)
    seen = vis.any(axis=1)
    first = variants.first_seen_row(nq, nk, variants.Variants(window[0], window[1], chunk, 0.0, causal))
    assert not seen[:first].any() and seen[first:].all()


# ---------------------------------------------------------------------------
# Argument checks before the device



def _qkv(dtype=np.float16, shape=(2, 4, 4, 64)):
    return arr(shape, dtype), arr(shape, dtype), arr(shape, dtype)


@pytest.mark.usefixtures("device_forbidden")
@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(window_size=(-2, 0)), ValueError, r"window_size\[0\] must be >= -1"),
    (dict(window_size=(0, -5)), ValueError, r"window_size\[1\] must be >= -1"),
    (dict(window_size=(1.5, 0)), TypeError, r"window_size\[0\] must be an int"),
    (dict(window_size=3), TypeError, "window_size must be a pair"),
    (dict(window_size=(1, 2, 3)), TypeError, "window_size must be a pair"),
    (dict(causal=True, window_size=(4, 2)), ValueError, "with causal=True"),
    (dict(softcap=-1.0), ValueError, "softcap must be a finite float >= 0"),
    (dict(softcap=float("inf")), ValueError, "softcap must be a finite float"),
    (dict(softcap=float("nan")), ValueError, "softcap must be a finite float"),
    (dict(softcap="3"), TypeError, "softcap must be a float"),
    (dict(attention_chunk=-4), ValueError, "attention_chunk must be >= 0"),
    (dict(attention_chunk=2.0), TypeError, "attention_chunk must be an int"),
    (dict(alibi_slopes=np.zeros(4, np.float32)), TypeError, "alibi_slopes must be a CuPy array"),
    (dict(alibi_slopes="slopes"), TypeError, "alibi_slopes must be a CuPy array"),
])
def test_bad_variant_arguments_raise_before_the_device(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        cuflash.forward(*_qkv(), **kwargs)


@pytest.mark.usefixtures("device_forbidden")
@pytest.mark.parametrize("name,x,exc,match", [
    ("alibi_slopes", (3,), ValueError, r"must have shape \(4,\) or \(2, 4\)"),
    ("alibi_slopes", ((2, 4), np.float16), TypeError, "alibi_slopes must be float32"),
    ("sinks", (4, 1), ValueError, r"sinks must have shape \(4,\)"),
    ("sinks", ((4,), np.float64), TypeError, "sinks must be float32 or float16"),
])
def test_bad_slopes_and_sinks(name, x, exc, match):
    shape, dtype = x if isinstance(x[0], tuple) else (x, np.float32)
    with pytest.raises(exc, match=match):
        cuflash.forward(*_qkv(), **{name: arr(shape, dtype)})
    q, k, v = _qkv()
    with pytest.raises(exc, match=match):
        cuflash.backward(q, q, k, v, q, arr((2, 4, 4), np.float32), **{name: arr(shape, dtype)})


@pytest.mark.usefixtures("device_forbidden")
def test_bad_dlse():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="dlse must have shape"):
        cuflash.backward(q, q, k, v, q, arr((2, 4, 4), np.float32), dlse=arr((2, 4, 3), np.float32))
    with pytest.raises(TypeError, match="dlse must be float32"):
        cuflash.backward(q, q, k, v, q, arr((2, 4, 4), np.float32), dlse=arr((2, 4, 4), np.float16))


def test_variant_keys():
    assert variants.NONE.kernel == variants.PLAIN and variants.NONE.cache_key() == ()
    v = variants.Variants(window_left=4, causal=True)
    assert v.kernel == variants.MaskVariant(local=True)
    assert variants.Variants(window_right=0, causal=True).kernel == variants.PLAIN   # causal alone
    assert (variants.MaskVariant(local=True, sink=True).template_arg(True)
            == "MaskVariant<true, true, false, false, true, false>")
    assert variants.Variants(attention_chunk=64).kernel == variants.MaskVariant(local=True, chunk=True)
    assert variants.Variants(attention_chunk=64).kernel.tag() == "LC"
    assert variants.call_signature((-1, -1), 0, 0.0, None, None) == ()
    assert variants.call_signature((8, 0), 0, 0.0, None, None) == ((8, 0), 0, 0.0, None, None)
    assert variants.call_signature([8, 0], 0, 0.0, None, None) is None   # a list: the checked path


def test_portable_fallback_keeps_the_variant(monkeypatch):
    """Where TMA cannot address an input the Hopper forward falls back to the portable kernel: with the
    call's variant, not the plain one."""
    from cuflash import heuristics, sm90

    monkeypatch.setattr(sm90, "get_kernel", lambda cfg, dev: None)
    monkeypatch.setattr(sm90, "smem_bytes", lambda cfg, dev: 0)
    var = variants.MaskVariant(local=True, sink=True)
    cfg = heuristics.fwd_config("bfloat16", 128, True, 90, variant=var)
    assert cfg.fam.sm90_fwd and cfg.variant == var
    _, portable, _ = sm90._portable_fwd(cfg, 0)
    assert portable.family == "sm80_fwd" and portable.variant == var
