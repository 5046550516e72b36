"""cuflash.jax.flash_attn_with_kvcache: decoding over a KV cache through its XLA custom call (tests skip where JAX is
not installed).

CPU: the whole path (jit, donation, the functional append aliased to the cache operands, paged caches, rotary,
variants, GQA) run by XLA:CPU on the host target, whose body is the float64 KV-cache reference; argument errors
while tracing. GPU (skip without a usable GPU and a CUDA JAX backend): out, lse and the caches after the append
against the float64 reference, the kernels on XLA's buffers and stream.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import FWD_TOL, assert_lse_matches

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import cuflash.jax as cj  # noqa: E402
from cuflash.reference import attention_reference_kvcache, rel_err  # noqa: E402
from jax_platforms import CPU, PLATFORMS  # noqa: E402

B, HQ, HKV, D, CAP = 2, 8, 2, 64, 96


def _put(x, device, dtype=None):
    x = jnp.asarray(x) if dtype is None else jnp.asarray(np.asarray(x, np.float32)).astype(dtype)
    return jax.device_put(x, device)


def _case(rng, device, *, paged: bool, nq: int = 2, n_new: int = 2):
    """q, caches, new k / v, cache_seqlens, block table (paged: pages of 16 in a shuffled order)."""
    dt = jnp.bfloat16
    q = _put(rng.standard_normal((B, nq, HQ, D)), device, dt)
    k_new = _put(rng.standard_normal((B, n_new, HKV, D)), device, dt)
    v_new = _put(rng.standard_normal((B, n_new, HKV, D)), device, dt)
    lens = np.array([5, CAP - n_new], np.int32)
    if paged:
        pages = B * CAP // 16
        k_cache = _put(rng.standard_normal((pages, 16, HKV, D)), device, dt)
        v_cache = _put(rng.standard_normal((pages, 16, HKV, D)), device, dt)
        table = _put(rng.permutation(pages).astype(np.int32).reshape(B, -1), device)
    else:
        k_cache = _put(rng.standard_normal((B, CAP, HKV, D)), device, dt)
        v_cache = _put(rng.standard_normal((B, CAP, HKV, D)), device, dt)
        table = None
    return q, k_cache, v_cache, k_new, v_new, _put(lens, device), table


def _host(x):
    return np.asarray(jax.device_get(x)).astype(np.float64)


@pytest.mark.parametrize("device", PLATFORMS)
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("rotary", [False, True])
def test_append_and_attend_under_jit(rng, device, paged, rotary):
    q, k_cache, v_cache, k_new, v_new, lens, table = _case(rng, device, paged=paged)
    extra = {}
    if rotary:
        ang = np.arange(CAP + 4)[:, None] * (0.05 * np.arange(1, D // 4 + 1))[None]   # rotary_dim = D / 2
        extra = dict(rotary_cos=_put(np.cos(ang).astype(np.float32), device),
                     rotary_sin=_put(np.sin(ang).astype(np.float32), device), rotary_interleaved=False)

    def step(q, k_cache, v_cache, k_new, v_new, lens, table):
        return cj.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, block_table=table,
                                          causal=True, return_lse=True, **extra)

    out, lse, k_after, v_after = jax.jit(step)(q, k_cache, v_cache, k_new, v_new, lens, table)
    ref_extra = {name: (np.asarray(jax.device_get(x)) if name != "rotary_interleaved" else x)
                 for name, x in extra.items()}
    ro, rl, rk, rv = attention_reference_kvcache(
        _host(q), _host(k_cache), _host(v_cache), _host(k_new), _host(v_new), cache_seqlens=np.asarray(lens),
        block_table=None if table is None else np.asarray(table), causal=True,
        rotary_dtype=jnp.bfloat16 if rotary else None, **ref_extra)
    assert out.shape == (B, 2, HQ, D) and lse.shape == (B, HQ, 2)
    assert rel_err(_host(out), ro) <= FWD_TOL["bfloat16"]
    assert_lse_matches(lse, rl, (B, HQ, 2), **({"rtol": 2e-3} if rotary else {}))
    # The caches after the call: the appended slots as the reference wrote them, the rest as they were.
    assert rel_err(_host(k_after), rk) <= 1e-2 and rel_err(_host(v_after), rv) == 0.0
    unchanged = rk == _host(k_cache)
    assert np.array_equal(_host(k_after)[unchanged], _host(k_cache)[unchanged])


@pytest.mark.parametrize("device", PLATFORMS)
def test_donated_caches_and_no_append(rng, device):
    """Donated caches come back as the results (written in place); without k / v only out (and lse) return."""
    q, k_cache, v_cache, k_new, v_new, lens, _ = _case(rng, device, paged=False, nq=1, n_new=1)
    k0, v0 = _host(k_cache), _host(v_cache)
    f = jax.jit(lambda q, kc, vc, k, v, n: cj.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=n),
                donate_argnums=(1, 2))
    out, k_after, v_after = f(q, k_cache, v_cache, k_new, v_new, lens)
    _, _, rk, rv = attention_reference_kvcache(_host(q), k0, v0, _host(k_new), _host(v_new), cache_seqlens=np.asarray(lens))
    assert np.array_equal(_host(k_after), rk) and np.array_equal(_host(v_after), rv)
    only = cj.flash_attn_with_kvcache(q, k_after, v_after, cache_seqlens=np.asarray(lens) + 1)
    ro, _, _, _ = attention_reference_kvcache(_host(q), rk, rv, cache_seqlens=np.asarray(lens) + 1)
    assert not isinstance(only, tuple) and rel_err(_host(only), ro) <= FWD_TOL["bfloat16"]
    assert rel_err(_host(out), ro) <= FWD_TOL["bfloat16"]


@pytest.mark.parametrize("device", PLATFORMS)
@pytest.mark.parametrize("paged", [False, True])
def test_mla_latent_cache_under_jit(rng, device, paged):
    """v_cache=None (MLA's latent cache: head_dim 576, V the first 512 columns of the K rows): out (.., 512) and lse
    against the float64 reference given V as those columns, and the one cache result after the append (a donated
    operand written in place)."""
    if device.platform != "cpu" and not _hopper(device):
        pytest.skip("MLA's latent cache needs the Hopper decode kernel (compute capability 9.0)")
    dt, hq, cap = jnp.bfloat16, 16, 128
    q = _put(rng.standard_normal((B, 2, hq, 576)), device, dt)
    k_new = _put(rng.standard_normal((B, 2, 1, 576)), device, dt)
    lens = _put(np.array([9, cap - 2], np.int32), device)
    if paged:
        pages = B * cap // 64
        k_cache = _put(rng.standard_normal((pages, 64, 1, 576)), device, dt)
        table = _put(rng.permutation(pages).astype(np.int32).reshape(B, -1), device)
    else:
        k_cache = _put(rng.standard_normal((B, cap, 1, 576)), device, dt)
        table = None
    k0 = _host(k_cache)
    f = jax.jit(lambda q, kc, k, n, t: cj.flash_attn_with_kvcache(q, kc, None, k, cache_seqlens=n, block_table=t,
                                                                   causal=True, return_lse=True), donate_argnums=(1,))
    out, lse, k_after = f(q, k_cache, k_new, lens, table)
    kn = _host(k_new)
    ro, rl, rk, _ = attention_reference_kvcache(
        _host(q), k0, k0[..., :512].copy(), kn, kn[..., :512].copy(), cache_seqlens=np.asarray(lens),
        block_table=None if table is None else np.asarray(table), causal=True)
    assert out.shape == (B, 2, hq, 512) and lse.shape == (B, hq, 2)
    assert rel_err(_host(out), ro) <= FWD_TOL["bfloat16"]
    assert_lse_matches(lse, rl, (B, hq, 2))
    assert np.array_equal(_host(k_after), rk)


@pytest.mark.parametrize("device", PLATFORMS)
@pytest.mark.parametrize("paged", [False, True])
def test_fp8_caches_under_jit(rng, device, paged):
    """float8_e4m3fn caches with descales ((batch, heads_kv) on a contiguous cache, (heads_kv,) on a paged one):
    out and lse against the float64 reference over the dequantised caches, the new tokens stored as
    e4m3(x * (1 / descale)) and every other byte unchanged, the caches returned as float8."""
    import ml_dtypes

    if device.platform != "cpu" and not _at_least_ada(device):
        pytest.skip("fp8 caches need compute capability 8.9+")
    e4m3 = ml_dtypes.float8_e4m3fn
    q, k_cache, v_cache, k_new, v_new, lens, table = _case(rng, device, paged=paged, nq=1, n_new=1)
    shape = (HKV,) if paged else (B, HKV)
    kd, vd = (rng.uniform(0.03, 0.12, shape).astype(np.float32) for _ in range(2))
    rows = k_cache.shape[0]
    k_rows, v_rows = (np.broadcast_to(x, (rows, HKV)) for x in (kd, vd))   # (contiguous: row b is sequence b)
    k8 = (_host(k_cache).astype(np.float32) / k_rows[:, None, :, None]).astype(e4m3)
    v8 = (_host(v_cache).astype(np.float32) / v_rows[:, None, :, None]).astype(e4m3)
    f = jax.jit(lambda q, kc, vc, k, v, n, t, kd, vd: cj.flash_attn_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=n, block_table=t, causal=True, return_lse=True, k_descale=kd, v_descale=vd))
    out, lse, k_after, v_after = f(q, _put(k8, device), _put(v8, device), k_new, v_new, lens, table,
                                   _put(kd, device), _put(vd, device))
    assert k_after.dtype == jnp.float8_e4m3fn and v_after.dtype == jnp.float8_e4m3fn
    # The appended slots: e4m3(x / descale) of the new tokens; everything else as it was.
    k8_want, v8_want = k8.copy(), v8.copy()
    n, t = np.asarray(lens), None if table is None else np.asarray(table)
    for b in range(B):
        j = int(n[b])
        r, s = (b, j) if t is None else (int(t[b, j // 16]), j % 16)
        seq_kd, seq_vd = (x if x.ndim == 1 else x[b] for x in (kd, vd))
        k8_want[r, s] = (_host(k_new)[b, 0].astype(np.float32) * (np.float32(1) / seq_kd)[:, None]).astype(e4m3)
        v8_want[r, s] = (_host(v_new)[b, 0].astype(np.float32) * (np.float32(1) / seq_vd)[:, None]).astype(e4m3)
    got_k, got_v = (np.asarray(jax.device_get(x)).view(np.uint8) for x in (k_after, v_after))
    assert np.array_equal(got_k, k8_want.view(np.uint8)) and np.array_equal(got_v, v8_want.view(np.uint8))
    ro, rl, _, _ = attention_reference_kvcache(
        _host(q), k8_want.astype(np.float64) * k_rows[:, None, :, None],
        v8_want.astype(np.float64) * v_rows[:, None, :, None], cache_seqlens=n + 1, block_table=t, causal=True)
    assert rel_err(_host(out), ro) <= FWD_TOL["bfloat16"]
    assert_lse_matches(lse, rl, (B, HQ, 1))


def _at_least_ada(device) -> bool:
    """Whether a JAX GPU device has compute capability 8.9 or newer (the e4m3 conversions)."""
    return float(getattr(device, "compute_capability", 0) or 0) >= 8.9


def _hopper(device) -> bool:
    """Whether a JAX GPU device has compute capability 9.0."""
    return getattr(device, "compute_capability", "") in ("9.0", 9.0)


def test_argument_errors_while_tracing(rng):
    q, k_cache, v_cache, k_new, v_new, lens, _ = _case(rng, CPU, paged=False)
    with pytest.raises(ValueError, match="cache_seqlens"):
        cj.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens.astype(jnp.int64) if jax.config.jax_enable_x64
                                   else lens.astype(jnp.int16))
    with pytest.raises(ValueError, match="k and v"):
        cj.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, cache_seqlens=lens)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        cj.flash_attn_with_kvcache(q.astype(jnp.float32), k_cache, v_cache, cache_seqlens=lens)
    with pytest.raises(ValueError, match="page size"):
        cj.flash_attn_with_kvcache(q, k_cache[:, :40], v_cache[:, :40], cache_seqlens=lens,
                                   block_table=jnp.zeros((B, 3), jnp.int32))
    with pytest.raises(ValueError, match="block_table"):
        cj.flash_attn_with_kvcache(q, k_cache[:, :32], v_cache[:, :32], cache_seqlens=lens,
                                   block_table=jnp.zeros((B, 3), jnp.float32))
    with pytest.raises(ValueError, match="multiple"):
        cj.flash_attn_with_kvcache(q[:, :, :7], k_cache, v_cache, cache_seqlens=lens)
    with pytest.raises(ValueError, match="576"):   # v_cache=None: MLA's latent cache only
        cj.flash_attn_with_kvcache(q, k_cache, None, cache_seqlens=lens)
    with pytest.raises(ValueError, match="v must be None"):
        cj.flash_attn_with_kvcache(q, k_cache, None, k_new, v_new, cache_seqlens=lens)
    with pytest.raises(ValueError, match="fp8 caches only"):
        cj.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, k_descale=0.5)
    k8 = k_cache.astype(jnp.float8_e4m3fn)
    with pytest.raises(TypeError, match="v_cache must have k_cache's dtype"):
        cj.flash_attn_with_kvcache(q, k8, v_cache, cache_seqlens=lens)
    with pytest.raises(ValueError, match="k_descale must have one element"):
        cj.flash_attn_with_kvcache(q, k8, k8, cache_seqlens=lens, k_descale=jnp.ones((3,), jnp.float32),
                                   v_descale=jnp.ones((3,), jnp.float32))
    with pytest.raises(ValueError, match="positive"):
        cj.flash_attn_with_kvcache(q, k8, k8, cache_seqlens=lens, k_descale=-1.0)


def test_cache_leftpad_on_the_host_target(rng):
    """cache_leftpad travels as an operand: the host target's result is the reference's with it."""
    q, k_cache, v_cache, k_new, v_new, lens, _ = _case(rng, CPU, paged=False)
    pads = jnp.asarray(np.array([3, 10], np.int32))
    out, lse, k_after, v_after = jax.jit(lambda *a: cj.flash_attn_with_kvcache(
        a[0], a[1], a[2], a[3], a[4], cache_seqlens=a[5], cache_leftpad=a[6], causal=True, return_lse=True))(
        q, k_cache, v_cache, k_new, v_new, lens, pads)
    ro, rl, _, _ = attention_reference_kvcache(_host(q), _host(k_cache), _host(v_cache), _host(k_new), _host(v_new),
                                               cache_seqlens=np.asarray(lens), cache_leftpad=np.asarray(pads),
                                               causal=True)
    assert rel_err(_host(out), ro) <= FWD_TOL["bfloat16"]
    assert_lse_matches(lse, rl, (B, HQ, 2))
