"""cuflash.jax.dot_product_attention_varlen: packed variable-length batches through the varlen XLA custom calls
(tests skip where JAX is not installed).

CPU: registration, lowering to the custom calls (the static max_seqlens and the optional operands as
attributes), abstract evaluation (float0 cotangents for the offsets), argument errors while tracing, the CUDA
bodies' calls of ``cuflash.forward_varlen`` / ``backward_varlen`` on fake device buffers (no offset check: no
host sync), and the whole path (jit, custom_vjp with and without lse, seqused, variants, vmap, empty totals,
bad offsets reported) run by XLA:CPU on the host targets, whose bodies are the float64 varlen references.
GPU (skip without a usable GPU and a CUDA JAX backend): out, lse and the gradients under jit against the
float64 references, on a packed batch with an empty query sequence, single tokens, queries without keys and
keys without queries, fp16 and bf16, causal and not, seqused; the kernels on XLA's buffers and stream.
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

from conftest import BWD_TOL, FWD_TOL, assert_lse_matches, requires_gpu

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import cuflash.jax as cj  # noqa: E402
from cuflash import jax_targets, xla_ffi  # noqa: E402
from cuflash.reference import attention_reference_varlen, attention_reference_varlen_backward, rel_err  # noqa: E402
from jax_platforms import CPU, GPU, PLATFORMS, requires_jax_gpu  # noqa: E402

JNP_DTYPES = {"float16": jnp.float16, "bfloat16": jnp.bfloat16, "float32": jnp.float32}

# Sequence lengths of q and of k (one batch): an empty query sequence with keys, single tokens, a prime, a
# long one over several tiles, and queries without keys (out 0, lse -inf, dq 0).
LENGTHS_Q = [0, 1, 13, 131, 64]
LENGTHS_K = [3, 1, 17, 131, 0]
HQ, HKV, D = 4, 2, 64


def _offsets(lengths, device=CPU):
    return jax.device_put(jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32), device)


def _packed(rng, dtype_name, lengths_q, lengths_k, device):
    """q, k, v and a dout, packed, as JAX arrays committed to ``device`` (so that jit runs there)."""
    tq, tk = sum(lengths_q), sum(lengths_k)
    shapes = ((tq, HQ, D), (tk, HKV, D), (tk, HKV, D), (tq, HQ, D))
    return tuple(jax.device_put(jnp.asarray(rng.standard_normal(s).astype(np.float32)).astype(JNP_DTYPES[dtype_name]),
                                device) for s in shapes)


def _f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _unseen(lengths_q, lengths_k, used_q, used_k, causal):
    """Masks of the packed query rows that see no key and of the key rows that no query sees (causal aligned
    bottom-right on the used rows, as the reference): their out and gradients are 0 exactly."""
    q_rows, k_rows = [], []
    for lq, lk, uq, uk in zip(lengths_q, lengths_k, used_q, used_k):
        i, j = np.arange(lq)[:, None], np.arange(lk)[None, :]
        sees = (i < uq) & (j < uk)
        if causal:
            sees &= j <= i + uk - uq
        q_rows.append(~sees.any(axis=1))
        k_rows.append(~sees.any(axis=0))
    return np.concatenate(q_rows), np.concatenate(k_rows)


def _shapes(lengths_q=LENGTHS_Q, lengths_k=LENGTHS_K, dtype=jnp.bfloat16):
    tq, tk, n = sum(lengths_q), sum(lengths_k), len(lengths_q) + 1
    return (jax.ShapeDtypeStruct((tq, HQ, D), dtype), jax.ShapeDtypeStruct((tk, HKV, D), dtype),
            jax.ShapeDtypeStruct((tk, HKV, D), dtype), jax.ShapeDtypeStruct((n,), jnp.int32),
            jax.ShapeDtypeStruct((n,), jnp.int32))


# ---------------------------------------------------------------------------
# CPU: registration, lowering, shapes, errors


def test_varlen_targets_are_registered_for_cuda_and_the_host():
    for target in (jax_targets.FORWARD_VARLEN, jax_targets.BACKWARD_VARLEN):
        assert {p for (t, p) in jax_targets.BODIES if t == target} == {"CUDA", "cpu"}
    assert jax_targets.BODIES[(jax_targets.FORWARD_VARLEN, "CUDA")] is jax_targets.cuda_forward_varlen
    cj.register_targets()   # XLA:CPU runs every target's metadata query here: a refused one raises
    assert len(cj._handlers) >= len(jax_targets.BODIES)


def test_lowers_to_the_varlen_custom_calls():
    args = _shapes()

    def f(q, k, v, cu_q, cu_k, used_k):
        return cj.dot_product_attention_varlen(q, k, v, cu_q, cu_k, 131, 131, seqused_k=used_k, causal=True)

    used = jax.ShapeDtypeStruct((len(LENGTHS_Q),), jnp.int32)
    fwd = jax.jit(f).lower(*args, used).as_text()
    assert "stablehlo.custom_call @cuflash_attention_varlen_fwd" in fwd
    for attr in ("max_seqlen_q = 131 : i64", "max_seqlen_k = 131 : i64", "causal = true", "has_seqused_q = false",
                 "has_seqused_k = true", "softmax_scale = 1.250000e-01 : f64"):
        assert attr in fwd, attr
    loss = lambda *a: f(*a).astype(jnp.float32).sum()  # noqa: E731
    bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args, used).as_text()
    assert "@cuflash_attention_varlen_fwd" in bwd and "@cuflash_attention_varlen_bwd" in bwd
    assert "has_dlse = false" in bwd and "deterministic = false" in bwd
    assert "dot_general" not in bwd   # no attention matrix outside the kernels

    def with_lse(q, k, v, cu_q, cu_k):
        out, lse = cj.dot_product_attention_varlen(q, k, v, cu_q, cu_k, 131, 131, return_lse=True)
        return out.astype(jnp.float32).sum() + lse.sum()

    assert "has_dlse = true" in jax.jit(jax.grad(with_lse, argnums=(0, 1, 2))).lower(*args).as_text()


def test_abstract_evaluation_and_float0_offset_cotangents():
    q, k, v, cu_q, cu_k = _shapes(dtype=jnp.float16)
    out, lse = jax.eval_shape(lambda *a: cj.dot_product_attention_varlen(*a, 131, 131, return_lse=True),
                              q, k, v, cu_q, cu_k)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (HQ, q.shape[0]) and lse.dtype == jnp.float32

    def pull(q, k, v, cu_q, cu_k):
        out, pullback = jax.vjp(lambda *a: cj.dot_product_attention_varlen(*a, 131, 131), q, k, v, cu_q, cu_k)
        return pullback(jnp.ones_like(out))

    grads = jax.eval_shape(pull, q, k, v, cu_q, cu_k)
    assert [(g.shape, g.dtype) for g in grads[:3]] == [(x.shape, x.dtype) for x in (q, k, v)]
    # The offsets are integers: JAX's cotangent for them is float0, and the custom VJP gives none.
    assert all(g.shape == cu_q.shape and g.dtype == jax.dtypes.float0 for g in grads[3:])


def _error_cases():
    n = len(LENGTHS_Q) + 1
    tq, tk = sum(LENGTHS_Q), sum(LENGTHS_K)
    return [
        (dict(q=(1, tq, HQ, D)), ValueError, r"q must have 3 dimensions \(total_q, heads_q, head_dim\)"),
        (dict(k=(tk, 3, D), v=(tk, 3, D)), ValueError, "multiple of heads_kv"),
        (dict(v=(tk + 1, HKV, D)), ValueError, "k and v must have the same shape"),
        (dict(v=(tk, HKV, 36)), ValueError, "v's head_dim must be a multiple of 8"),
        (dict(q=(tq, HQ, 60), k=(tk, HKV, 60), v=(tk, HKV, 60)), ValueError, "head_dim must be a multiple of 8"),
        (dict(dtype="int32"), TypeError, "float16, bfloat16 or float32"),
        (dict(cu_dtype="float32"), TypeError, "cu_seqlens_q must be int32, got float32"),
        (dict(cu_seqlens_k=(n - 1,)), ValueError, "cu_seqlens_k must have the length of cu_seqlens_q"),
        (dict(cu_seqlens_q=(0,), cu_seqlens_k=(0,)), ValueError, "cu_seqlens_q must have length batch \\+ 1 >= 1"),
        (dict(seqused_q=(n,)), ValueError, r"seqused_q must have shape \(batch,\) = \(5,\)"),
        (dict(max_seqlen_q=41), ValueError, r"max_seqlen_q \(41\) is smaller than a sequence"),
        (dict(max_seqlen_k=131.0), TypeError, "max_seqlen_k must be a Python int >= 0"),
        (dict(max_seqlen_q=-1), ValueError, "max_seqlen_q must be >= 0"),
        (dict(causal="False"), TypeError, "causal must be a bool"),
        (dict(return_lse=1), TypeError, "return_lse must be a bool"),
        (dict(causal=True, window_size=(4, 2)), ValueError, "window_size\\[1\\] must be -1 or 0 with causal=True"),
        (dict(softmax_scale=-1.0), ValueError, "softmax_scale must be a positive finite"),
        (dict(alibi_slopes=(HQ + 1,)), ValueError, "alibi_slopes must be float32 of shape"),
    ]


@pytest.mark.parametrize("case", range(len(_error_cases())))
def test_argument_errors_raise_while_tracing(case):
    kwargs, exc, match = _error_cases()[case]
    kwargs = dict(kwargs)
    tq, tk = sum(LENGTHS_Q), sum(LENGTHS_K)
    shapes = {"q": (tq, HQ, D), "k": (tk, HKV, D), "v": (tk, HKV, D)}
    shapes.update({n: kwargs.pop(n) for n in ("q", "k", "v") if n in kwargs})
    dtype = kwargs.pop("dtype", "float16")
    arrays = {n: jnp.zeros(s, dtype) for n, s in shapes.items()}
    cu_dtype = kwargs.pop("cu_dtype", "int32")
    for name, lengths in (("cu_seqlens_q", LENGTHS_Q), ("cu_seqlens_k", LENGTHS_K)):
        shape = kwargs.pop(name, None)
        arrays[name] = (_offsets(lengths) if shape is None else jnp.zeros(shape, jnp.int32)).astype(cu_dtype)
    for name in ("seqused_q", "alibi_slopes"):
        if name in kwargs:
            kwargs[name] = jnp.zeros(kwargs[name], jnp.int32 if name == "seqused_q" else jnp.float32)
    maxes = dict(max_seqlen_q=kwargs.pop("max_seqlen_q", 131), max_seqlen_k=kwargs.pop("max_seqlen_k", 131))
    with pytest.raises(exc, match=match):
        jax.jit(lambda q, k, v, cq, ck: cj.dot_product_attention_varlen(q, k, v, cq, ck, **maxes, **kwargs))(
            arrays["q"], arrays["k"], arrays["v"], arrays["cu_seqlens_q"], arrays["cu_seqlens_k"])


def test_traced_max_seqlen_is_refused_with_a_hint():
    q, k, v, cu_q, cu_k = (jnp.zeros(s.shape, s.dtype) for s in _shapes())
    with pytest.raises(TypeError, match="static under jax.jit"):
        jax.jit(cj.dot_product_attention_varlen)(q, k, v, cu_q, cu_k, 131, 131)


# ---------------------------------------------------------------------------
# CPU: the CUDA bodies on fake device buffers (CuPy arrays over addresses never touched)


@contextlib.contextmanager
def _fake_device(call, ptr):
    yield 0, 0x5EED   # device 0, a stream pointer


def _fake_call(arg_shapes, ret_shapes, attrs):
    """An xla_ffi.Call over fake, 256-byte aligned device addresses, one MiB apart."""
    def views(shapes, base):
        return [xla_ffi.BufferView(base + (i << 20), dtype, shape) for i, (shape, dtype) in enumerate(shapes)]
    return xla_ffi.Call(views(arg_shapes, 1 << 40), views(ret_shapes, (1 << 40) + (1 << 30)), attrs)


_ATTRS = dict(causal=True, softmax_scale=0.125, window_left=-1, window_right=-1, attention_chunk=0, softcap=0.0,
              has_alibi=False, has_sinks=False, alibi_per_batch=False, max_seqlen_q=131, max_seqlen_k=140,
              has_seqused_q=False, has_seqused_k=True)


def test_cuda_forward_body_reads_xlas_buffers(monkeypatch):
    """cuda_forward_varlen hands XLA's buffers (pointers compared), the offsets, seqused_k and the attributes
    to ``_forward_varlen_into``, which calls ``cuflash.forward_varlen`` with ``check_offsets=False`` (no
    host sync under jit), ``out=`` and ``lse=`` XLA's buffers."""
    pytest.importorskip("cupy")
    from cuflash import api

    tq, tk, b = sum(LENGTHS_Q), sum(LENGTHS_K), len(LENGTHS_Q)
    call = _fake_call([((tq, HQ, D), "bfloat16"), ((tk, HKV, D), "bfloat16"), ((tk, HKV, D), "bfloat16"),
                       ((b + 1,), "int32"), ((b + 1,), "int32"), ((b,), "int32")],
                      [((tq, HQ, D), "bfloat16"), ((HQ, tq), "float32")], dict(_ATTRS))
    monkeypatch.setattr(jax_targets, "_on_xla_device", _fake_device)
    forward_varlen_into = jax_targets._forward_varlen_into
    seen = {}
    monkeypatch.setattr(jax_targets, "_forward_varlen_into", lambda *a, **kw: seen.update(args=a, kwargs=kw))
    jax_targets.cuda_forward_varlen(call)
    q, k, v, out, lse = seen["args"]
    assert [x.data.ptr for x in (q, k, v, out, lse)] == [b_.ptr for b_ in (*call.args[:3], *call.rets)]
    kw = seen["kwargs"]
    assert kw["cu_seqlens_q"].data.ptr == call.args[3].ptr and kw["cu_seqlens_k"].data.ptr == call.args[4].ptr
    assert kw["seqused_q"] is None and kw["seqused_k"].data.ptr == call.args[5].ptr
    assert (kw["max_seqlen_q"], kw["max_seqlen_k"], kw["causal"], kw["softmax_scale"]) == (131, 140, True, 0.125)

    got = {}

    def forward_varlen(q, k, v, **kwargs):
        got.update(kwargs)
        return kwargs["out"], kwargs["lse"]

    monkeypatch.setattr(api, "forward_varlen", forward_varlen)
    forward_varlen_into(q, k, v, out, lse, **kw)
    assert got["check_offsets"] is False and got["return_lse"] is True and got["out"] is out and got["lse"] is lse


def test_cuda_backward_body_reads_xlas_buffers(monkeypatch):
    """cuda_backward_varlen calls ``cuflash.backward_varlen`` on XLA's buffers (dq, dk, dv its results),
    with dlse where has_dlse says so, ``check_offsets=False`` and the deterministic flag."""
    pytest.importorskip("cupy")
    from cuflash import api

    tq, tk, b = sum(LENGTHS_Q), sum(LENGTHS_K), len(LENGTHS_Q)
    qs, ks = ((tq, HQ, D), "float16"), ((tk, HKV, D), "float16")
    call = _fake_call([qs, qs, ks, ks, qs, ((HQ, tq), "float32"), ((b + 1,), "int32"), ((b + 1,), "int32"),
                       ((b,), "int32"), ((HQ, tq), "float32")], [qs, ks, ks],
                      dict(_ATTRS, deterministic=True, has_dlse=True))
    monkeypatch.setattr(jax_targets, "_on_xla_device", _fake_device)
    seen = {}

    def backward_varlen(*args, **kwargs):
        seen.update(args=args, kwargs=kwargs)
        return kwargs["dq"], kwargs["dk"], kwargs["dv"]

    monkeypatch.setattr(api, "backward_varlen", backward_varlen)
    jax_targets.cuda_backward_varlen(call)
    assert [x.data.ptr for x in seen["args"]] == [b_.ptr for b_ in call.args[:6]]
    kw = seen["kwargs"]
    assert [kw[n].data.ptr for n in ("dq", "dk", "dv")] == [b_.ptr for b_ in call.rets]
    assert kw["dlse"].data.ptr == call.args[9].ptr and kw["seqused_k"].data.ptr == call.args[8].ptr
    assert kw["check_offsets"] is False and kw["deterministic"] is True and kw["sinks"] is None
    assert (kw["max_seqlen_q"], kw["max_seqlen_k"]) == (131, 140)


# ---------------------------------------------------------------------------
# Both platforms: the host targets (float64 reference) on CPU, the kernels on a GPU


def _check_against_reference(device, dtype, causal, lengths_q, lengths_k, *, lse_grad, seqused=None, seed=0,
                             tol=None):
    """out, lse and the gradients of q, k, v under jit against the float64 references: whole-array relative
    norms (``tol``: (forward, backward) bounds; conftest's by default), lse per row, and 0 exactly on the rows
    that take part in no score."""
    rng = np.random.default_rng(seed)
    q, k, v, dout = _packed(rng, dtype, lengths_q, lengths_k, device)
    cu_q, cu_k = _offsets(lengths_q, device), _offsets(lengths_k, device)
    used = {} if seqused is None else {name: jax.device_put(jnp.asarray(u, jnp.int32), device)
                                       for name, u in zip(("seqused_q", "seqused_k"), seqused)}
    max_q, max_k = max(lengths_q), max(lengths_k)

    def f(q, k, v, cu_q, cu_k, used):
        return cj.dot_product_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, return_lse=True,
                                               **used)

    (out, lse), pullback = jax.vjp(jax.jit(f), q, k, v, cu_q, cu_k, used)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (HQ, q.shape[0]) and lse.dtype == jnp.float32
    dlse = None
    if lse_grad:   # the rows that see no key have lse -inf: no gradient is sent to them
        dlse = jnp.asarray(rng.standard_normal(lse.shape).astype(np.float32)) * jnp.isfinite(lse)
    grads = pullback((dout, jnp.zeros_like(lse) if dlse is None else dlse))[:3]

    host_used = {name: np.asarray(x) for name, x in used.items()}
    cu_host = (np.asarray(cu_q), np.asarray(cu_k))
    ref_out, ref_lse = attention_reference_varlen(_f64(q), _f64(k), _f64(v), *cu_host, causal=causal, **host_used)
    refs = attention_reference_varlen_backward(_f64(dout), _f64(q), _f64(k), _f64(v), *cu_host, causal=causal,
                                               dlse=None if dlse is None else _f64(dlse), **host_used)
    tol_o, tol_g = tol or (FWD_TOL[dtype], BWD_TOL[dtype])
    err = rel_err(_f64(out), ref_out)
    assert err <= tol_o, f"out rel err {err:.3e} > {tol_o:.1e}"
    assert_lse_matches(lse, ref_lse, (HQ, q.shape[0]))
    unseen_q, unseen_k = _unseen(lengths_q, lengths_k, *(seqused or (lengths_q, lengths_k)), causal)
    assert np.all(_f64(out)[unseen_q] == 0)
    # Whole-array norms for the gradients (not per row: a query that sees a single key has dq 0 up to
    # rounding, its row's relative error noise against 0), and 0 exactly on the rows that take part in no score.
    for name, x, g, ref, unseen in zip(("dq", "dk", "dv"), (q, k, v), grads, refs, (unseen_q, unseen_k, unseen_k)):
        assert g.dtype == x.dtype and g.shape == x.shape, name
        err = rel_err(_f64(g), ref)
        assert err <= tol_g, f"{name} rel err {err:.3e} > {tol_g:.1e}"
        assert np.all(_f64(g)[unseen] == 0), f"{name}: nonzero gradient on rows that take part in no score"


# The host targets round the float64 reference to the output dtype: float32 is exact to ~1e-7.
HOST_TOL = (1e-6, 1e-6)


@pytest.mark.parametrize("lse_grad", [False, True], ids=["dout", "dout_dlse"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_host_path_matches_the_reference(causal, lse_grad):
    """The plumbing on XLA:CPU (operand order, attributes, the lse cotangent, the custom VJP): float32 on the
    host targets against the references, as good as float32 rounding."""
    _check_against_reference(CPU, "float32", causal, LENGTHS_Q, LENGTHS_K, lse_grad=lse_grad, tol=HOST_TOL)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_host_path_seqused(causal):
    _check_against_reference(CPU, "float32", causal, [40, 7, 30, 5], [50, 9, 40, 1], lse_grad=True,
                             seqused=([33, 0, 30, 2], [50, 4, 17, 0]), tol=HOST_TOL)


def test_host_target_reports_bad_offsets():
    """On XLA:CPU the host target checks the offsets as an eager forward_varlen does (the error reaches the
    caller through XLA with its message); on a GPU they are not checked (no host sync)."""
    q, k, v, _ = _packed(np.random.default_rng(0), "float32", LENGTHS_Q, LENGTHS_K, CPU)
    bad = _offsets([0, 1, 13, 131, 63])   # ends one row short of total_q
    with pytest.raises(Exception, match=r"cu_seqlens_q must end at total_q = q.shape\[0\] = 209"):
        jax.jit(lambda q, k, v, cq, ck: cj.dot_product_attention_varlen(q, k, v, cq, ck, 131, 131))(
            q, k, v, bad, _offsets(LENGTHS_K)).block_until_ready()


JAX_VARIANTS = [
    dict(causal=True, window_size=(20, 0), sinks=True),
    dict(softcap=2.0, alibi=True),
    dict(alibi_per_batch=True, sinks=True, return_lse=True),
    dict(causal=True, attention_chunk=24, window_size=(10, 0), softcap=5.0),
]


@pytest.mark.parametrize("kwargs", JAX_VARIANTS, ids=lambda k: "-".join(sorted(k)))
@pytest.mark.parametrize("device", PLATFORMS)
def test_variants_under_jit_and_grad(kwargs, device):
    """Windows, chunks, softcap, ALiBi (per head and per sequence) and sinks (differentiated) through the
    varlen custom calls under jit against float64: on CPU the plumbing (attributes, optional operands, dsinks,
    the lse cotangent), on a GPU the kernels."""
    rng = np.random.default_rng(3)
    dtype = "float32" if device.platform == "cpu" else "bfloat16"
    q, k, v, dout = _packed(rng, dtype, LENGTHS_Q, LENGTHS_K, device)
    cu_q, cu_k = _offsets(LENGTHS_Q, device), _offsets(LENGTHS_K, device)
    kw = dict(kwargs)
    return_lse = kw.pop("return_lse", False)
    b = len(LENGTHS_Q)
    per_batch = kw.pop("alibi_per_batch", False)   # (batch, heads_q) slopes: row b for sequence b
    slopes = None
    if kw.pop("alibi", False) or per_batch:
        shape = (b, HQ) if per_batch else (HQ,)
        slopes = jax.device_put(jnp.asarray(rng.uniform(0.05, 0.3, shape).astype(np.float32)), device)
    sinks = jax.device_put(jnp.asarray(rng.normal(1.0, 1.0, HQ).astype(np.float32)), device) \
        if kw.pop("sinks", False) else None
    dlse = jnp.asarray(rng.standard_normal((HQ, q.shape[0])).astype(np.float32))

    def loss(q, k, v, sinks):
        res = cj.dot_product_attention_varlen(q, k, v, cu_q, cu_k, 131, 131, alibi_slopes=slopes, sinks=sinks,
                                              return_lse=return_lse, **kw)
        out, lse = res if return_lse else (res, None)
        value = (out.astype(jnp.float32) * dout.astype(jnp.float32)).sum()
        if lse is not None:   # lse is finite on every row here: the sinks make each row see something
            value = value + (lse * dlse).sum()
        return value, out

    argnums = (0, 1, 2, 3) if sinks is not None else (0, 1, 2)
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(q, k, v, sinks)
    host = dict(kw, alibi_slopes=None if slopes is None else np.asarray(slopes),
                sinks=None if sinks is None else np.asarray(sinks))
    cu_host = (np.asarray(cu_q), np.asarray(cu_k))
    ref_o, _ = attention_reference_varlen(_f64(q), _f64(k), _f64(v), *cu_host, **host)
    refs = attention_reference_varlen_backward(_f64(dout), _f64(q), _f64(k), _f64(v), *cu_host,
                                               dlse=_f64(dlse) if return_lse else None, **host)
    tol_o, tol_g = (FWD_TOL[dtype], BWD_TOL[dtype]) if device.platform != "cpu" else HOST_TOL
    assert rel_err(_f64(out), ref_o) <= tol_o
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, refs):
        err = rel_err(_f64(g), r)
        assert err <= tol_g, f"{name} rel err {err:.3e}"


@pytest.mark.parametrize("device", PLATFORMS)
def test_vmap_maps_the_calls_one_by_one(device):
    """jax.vmap over stacked packed batches with their own offsets: each element as its own call."""
    rng = np.random.default_rng(5)
    lengths = ([[5, 0, 27], [20, 12, 0]], [[9, 31, 0], [1, 20, 19]])   # the same totals, other offsets
    q, k, v, _ = _packed(rng, "float16", [32], [40], device)
    qs = jnp.stack([q, q[::-1]])
    ks, vs = jnp.stack([k, v]), jnp.stack([v, k])
    cu_q = jnp.stack([_offsets(x, device) for x in lengths[0]])
    cu_k = jnp.stack([_offsets(x, device) for x in lengths[1]])

    def f(q, k, v, cq, ck):
        return cj.dot_product_attention_varlen(q, k, v, cq, ck, 27, 31, causal=True)

    out = jax.jit(jax.vmap(f))(qs, ks, vs, cu_q, cu_k)
    g = jax.jit(jax.vmap(jax.grad(lambda *a: f(*a).astype(jnp.float32).sum())))(qs, ks, vs, cu_q, cu_k)
    assert out.shape == qs.shape and g.shape == qs.shape and g.dtype == qs.dtype
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(f(qs[i], ks[i], vs[i], cu_q[i], cu_k[i])))
        cu = (np.asarray(cu_q[i]), np.asarray(cu_k[i]))
        ref, _ = attention_reference_varlen(_f64(qs[i]), _f64(ks[i]), _f64(vs[i]), *cu, causal=True)
        assert rel_err(_f64(out[i]), ref) <= FWD_TOL["float16"], f"out[{i}]"
        ref_dq = attention_reference_varlen_backward(np.ones(qs.shape[1:]), _f64(qs[i]), _f64(ks[i]), _f64(vs[i]),
                                                     *cu, causal=True)[0]
        assert rel_err(_f64(g[i]), ref_dq) <= BWD_TOL["float16"], f"dq[{i}]"


@pytest.mark.parametrize("device", PLATFORMS)
@pytest.mark.parametrize("lengths_q, lengths_k", [([0, 0], [4, 8]), ([4, 8], [0, 0]), ([], [])], ids=str)
def test_empty_totals(device, lengths_q, lengths_k):
    """No rows, or no keys anywhere: no custom call; out 0, lse -inf (or the sinks, whose gradient is then
    the sum of dlse over the rows) and zero gradients."""
    q = jax.device_put(jnp.ones((sum(lengths_q), 2, 16), jnp.float16), device)
    k = jax.device_put(jnp.ones((sum(lengths_k), 2, 16), jnp.float16), device)
    cu_q, cu_k = _offsets(lengths_q, device), _offsets(lengths_k, device)
    sinks = jax.device_put(jnp.asarray([0.5, -1.0], jnp.float32), device)

    def f(q, k, v, sinks):
        return cj.dot_product_attention_varlen(q, k, v, cu_q, cu_k, 8, 8, sinks=sinks, return_lse=True)

    (out, lse), pullback = jax.vjp(jax.jit(f), q, k, k, sinks)
    assert out.shape == q.shape and not bool(jnp.any(out))
    np.testing.assert_array_equal(np.asarray(lse), np.broadcast_to(np.asarray(sinks)[:, None], (2, q.shape[0])))
    dq, dk, dv, dsinks = pullback((jnp.ones_like(out), jnp.ones_like(lse)))
    assert dq.shape == q.shape and dk.shape == k.shape and not (bool(jnp.any(dq)) or bool(jnp.any(dk)))
    np.testing.assert_array_equal(np.asarray(dsinks), np.full(2, q.shape[0], np.float32))
    out = jax.jit(lambda q, k: cj.dot_product_attention_varlen(q, k, k, cu_q, cu_k, 8, 8))(q, k)
    assert out.shape == q.shape and not bool(jnp.any(out))


@pytest.mark.parametrize("device", PLATFORMS)
def test_kernels_use_jaxs_buffers(device):
    """Zero-copy: the forward custom call receives the jitted function's own input buffers (the offsets too)
    and its result buffer is the array JAX returns (pointers compared); on a GPU, on XLA's stream."""
    q, k, v, _ = _packed(np.random.default_rng(0), "bfloat16", LENGTHS_Q, LENGTHS_K, device)
    cu_q, cu_k = _offsets(LENGTHS_Q, device), _offsets(LENGTHS_K, device)
    jax_targets.CALL_LOG = []
    try:
        out = jax.jit(lambda *a: cj.dot_product_attention_varlen(*a, 131, 131))(q, k, v, cu_q, cu_k)
        out.block_until_ready()
        log = list(jax_targets.CALL_LOG)
    finally:
        jax_targets.CALL_LOG = None
    (target, args, rets, stream), = log
    assert target == jax_targets.FORWARD_VARLEN
    assert args == [x.unsafe_buffer_pointer() for x in (q, k, v, cu_q, cu_k)]
    assert rets[0] == out.unsafe_buffer_pointer()
    if device.platform == "gpu":
        assert stream != 0   # XLA's own stream, not the legacy default stream


# ---------------------------------------------------------------------------
# GPU: the kernels against the float64 references


@requires_gpu
@requires_jax_gpu
@pytest.mark.parametrize("lse_grad", [False, True], ids=["dout", "dout_dlse"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_against_reference(dtype, causal, lse_grad):
    _check_against_reference(GPU, dtype, causal, LENGTHS_Q, LENGTHS_K, lse_grad=lse_grad)


@requires_gpu
@requires_jax_gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_seqused(dtype, causal):
    """seqused_q / seqused_k shorter than the packed lengths (and, causal, a sequence of more used queries
    than keys): out 0, lse -inf and zero gradients on the rows past them."""
    _check_against_reference(GPU, dtype, causal, [40, 7, 130, 5], [50, 9, 140, 1], lse_grad=True,
                             seqused=([33, 0, 130, 2], [50, 4, 77, 0]))


@requires_gpu
@requires_jax_gpu
def test_gpu_deterministic_grads_are_bitwise_repeatable():
    q, k, v, dout = _packed(np.random.default_rng(1), "bfloat16", LENGTHS_Q, LENGTHS_K, GPU)
    cu_q, cu_k = _offsets(LENGTHS_Q, GPU), _offsets(LENGTHS_K, GPU)
    grad = jax.jit(jax.grad(lambda q, k, v: (cj.dot_product_attention_varlen(
        q, k, v, cu_q, cu_k, 131, 131, causal=True, deterministic=True).astype(jnp.float32) * dout).sum(),
        argnums=(0, 1, 2)))
    first = [np.asarray(g) for g in grad(q, k, v)]
    for _ in range(3):
        for a, b in zip(first, grad(q, k, v)):
            np.testing.assert_array_equal(a, np.asarray(b))


@pytest.mark.parametrize("device", PLATFORMS)
@pytest.mark.parametrize("dqk,dv", [(192, 128), (64, 128)])
def test_value_head_dim_of_its_own(device, dqk, dv):
    """v with a head dim of its own: the output takes it; values and gradients against float64 under jit."""
    rng = np.random.default_rng(dqk + dv)
    dtype = "float32" if device.platform == "cpu" else "bfloat16"
    tq, tk = sum(LENGTHS_Q), sum(LENGTHS_K)
    dt = JNP_DTYPES[dtype]
    q, k, v, dout = (jax.device_put(jnp.asarray(rng.standard_normal(s).astype(np.float32)).astype(dt), device)
                     for s in ((tq, HQ, dqk), (tk, HKV, dqk), (tk, HKV, dv), (tq, HQ, dv)))
    cu_q, cu_k = _offsets(LENGTHS_Q, device), _offsets(LENGTHS_K, device)

    def loss(q, k, v):
        out = cj.dot_product_attention_varlen(q, k, v, cu_q, cu_k, 131, 131, causal=True)
        return (out.astype(jnp.float32) * dout.astype(jnp.float32)).sum(), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    assert out.shape == (tq, HQ, dv)
    cu_host = (np.asarray(cu_q), np.asarray(cu_k))
    ref_o, _ = attention_reference_varlen(_f64(q), _f64(k), _f64(v), *cu_host, causal=True)
    refs = attention_reference_varlen_backward(_f64(dout), _f64(q), _f64(k), _f64(v), *cu_host, causal=True)
    tol_o, tol_g = (FWD_TOL[dtype], BWD_TOL[dtype]) if device.platform != "cpu" else HOST_TOL
    assert rel_err(_f64(out), ref_o) <= tol_o
    for name, g, r in zip(("dq", "dk", "dv"), grads, refs):
        assert g.shape == r.shape and rel_err(_f64(g), r) <= tol_g, name
