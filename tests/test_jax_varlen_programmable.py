"""cuflash.jax.dot_product_attention_varlen with programmable attention (issue #45): a bias with its gradient,
dropout from a seed (an int or a uint32 (4,) operand), block masks and modifiers, per sequence at batch index b,
through the programmable varlen custom calls (jax_targets.FORWARD_VARLEN_PROG / BACKWARD_VARLEN_PROG), under jit
and grad. Tests skip where JAX is not installed.

CPU: registration, lowering (the plain varlen calls unchanged without programmable arguments), argument errors
while tracing, the CUDA bodies' calls of ``cuflash.forward_varlen`` / ``backward_varlen`` on fake device buffers
(operand order, check_offsets=False), and the whole path run by XLA:CPU on the host targets, whose bodies are the
float64 varlen references. GPU (skip without a usable GPU and a CUDA JAX backend): out, lse and every gradient
against ``cuflash.forward_varlen`` / ``backward_varlen`` on the same inputs (the same kernels: equal up to the
float32 atomics' order in dbias and the tables' gradients), and against the float64 references.
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
from cuflash.philox import dropout_keep_mask  # noqa: E402
from cuflash.reference import attention_reference_varlen, attention_reference_varlen_backward, rel_err  # noqa: E402
from jax_platforms import CPU, GPU, requires_jax_gpu  # noqa: E402

# An empty query sequence, single tokens, queries without keys, keys of a sequence longer than its queries.
LENGTHS_Q = [0, 1, 13, 70, 7, 33]
LENGTHS_K = [3, 1, 0, 90, 19, 33]
B, HQ, HKV, D = len(LENGTHS_Q), 4, 2, 64
MQ, MK = max(LENGTHS_Q), max(LENGTHS_K)
BLOCK = (32, 16)

# name -> spec: bias (shape code over b, h, q, k, 1, and dtype), causal, dropout (p, int seed or seed words),
# block mask, seqused, sinks, return_lse (with an lse cotangent), alibi.
CASES = {
    "bias": dict(bias=("1hqk", "float32")),
    "keypad_causal": dict(bias=("b11k", "bfloat16"), causal=True),
    "bias_per_sequence": dict(bias=("bhqk", "float32"), causal=True),
    "dropout": dict(dropout=(0.2, 1234567890123)),
    "dropout_seed_words": dict(dropout=(0.1, (5, 7, 3, 0)), causal=True),
    "block_mask": dict(block_mask=True, causal=True),
    "seqused_bias": dict(bias=("1hqk", "float32"), seqused=True, causal=True),
    "lse_sinks_bias": dict(bias=("b1qk", "float32"), sinks=True, return_lse=True),
    "all": dict(bias=("bhqk", "bfloat16"), dropout=(0.1, 9), block_mask=True, alibi=True, causal=True),
    # float32 q, k, v (the exact kernels on a GPU)
    "float32_all": dict(dtype="float32", bias=("b1qk", "float32"), dropout=(0.1, 5), block_mask=True, causal=True),
}


def _f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _offsets(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _seed_pair(seed) -> tuple:
    """(seed, offset) ints of a dropout_seed argument (an int, or the four little-endian uint32 words)."""
    if isinstance(seed, int):
        return seed, 0
    return seed[0] | seed[1] << 32, seed[2] | seed[3] << 32


def _inputs(case: str, seed: int = 0) -> dict:
    """The case's host (NumPy) arrays and options: q, k, v, dout (bf16, or the case's dtype), the offsets and the
    programmable ones."""
    import ml_dtypes

    spec = CASES[case]
    rng = np.random.default_rng(seed)
    bf16 = ml_dtypes.bfloat16
    qkv = np.float32 if spec.get("dtype") == "float32" else bf16
    tq, tk = sum(LENGTHS_Q), sum(LENGTHS_K)
    x = dict(q=rng.standard_normal((tq, HQ, D)).astype(qkv), k=rng.standard_normal((tk, HKV, D)).astype(qkv),
             v=rng.standard_normal((tk, HKV, D)).astype(qkv), dout=rng.standard_normal((tq, HQ, D)).astype(qkv),
             cu_q=_offsets(LENGTHS_Q), cu_k=_offsets(LENGTHS_K), causal=spec.get("causal", False),
             return_lse=spec.get("return_lse", False))
    if "bias" in spec:
        code, dtype = spec["bias"]
        dims = {"b": B, "h": HQ, "q": MQ, "k": MK, "1": 1}
        x["bias"] = rng.normal(0, 1, tuple(dims[c] for c in code)).astype(np.float32).astype(
            bf16 if dtype == "bfloat16" else np.float32)
    if "dropout" in spec:
        x["dropout_p"], x["seed"] = spec["dropout"]
    if spec.get("block_mask"):
        mask = rng.random((B, 1, -(-MQ // BLOCK[0]), -(-MK // BLOCK[1]))) < 0.6
        mask[..., 0] = True
        x["block_mask"] = mask
    if spec.get("seqused"):
        x["seqused_q"] = np.array([0, 1, 9, 50, 7, 20], np.int32)
        x["seqused_k"] = np.array([2, 1, 0, 90, 4, 33], np.int32)
    if spec.get("sinks"):
        x["sinks"] = rng.normal(1.0, 1.0, HQ).astype(np.float32)
    if spec.get("alibi"):
        x["alibi_slopes"] = rng.uniform(0.05, 0.3, (B, HQ)).astype(np.float32)
    if x["return_lse"]:
        x["dlse"] = rng.standard_normal((HQ, tq)).astype(np.float32)
    return x


def _run_jax(x: dict, device):
    """out, lse (or None) and the gradients (dq, dk, dv[, dsinks][, dbias]) under jit(value_and_grad)."""
    put = lambda a: None if a is None else jax.device_put(jnp.asarray(a), device)   # noqa: E731
    q, k, v, dout, cu_q, cu_k = (put(x[n]) for n in ("q", "k", "v", "dout", "cu_q", "cu_k"))
    seed = x.get("seed")
    seed_arg = put(np.array(seed, np.uint32)) if isinstance(seed, tuple) else seed
    fixed = dict(causal=x["causal"], return_lse=x["return_lse"], dropout_p=x.get("dropout_p", 0.0),
                 dropout_seed=seed_arg, block_mask=put(x.get("block_mask")), block_size=BLOCK,
                 seqused_q=put(x.get("seqused_q")), seqused_k=put(x.get("seqused_k")),
                 alibi_slopes=put(x.get("alibi_slopes")))
    dlse = put(x.get("dlse"))
    diff = dict(q=q, k=k, v=v)
    for name in ("sinks", "bias"):
        if name in x:
            diff[name] = put(x[name])

    def loss(diff):
        res = cj.dot_product_attention_varlen(diff["q"], diff["k"], diff["v"], cu_q, cu_k, MQ, MK,
                                              sinks=diff.get("sinks"), bias=diff.get("bias"), **fixed)
        out, lse = res if x["return_lse"] else (res, None)
        value = (out.astype(jnp.float32) * dout.astype(jnp.float32)).sum()
        if lse is not None:   # rows that see no key have lse -inf: no cotangent there
            value = value + jnp.where(jnp.isfinite(lse), lse * dlse, 0.0).sum()
        return value, (out, lse)

    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(diff)
    names = ["q", "k", "v"] + [n for n in ("sinks", "bias") if n in diff]
    return out, lse, [grads[n] for n in names]


def _masked_dlse(x: dict, lse):
    """The lse cotangent the loss sends: 0 on rows whose lse is -inf."""
    return np.where(np.isfinite(np.asarray(lse)), x["dlse"], 0).astype(np.float32)


def _reference(x: dict, lse=None) -> tuple:
    """The float64 references' out, lse and gradients (dq, dk, dv[, dsinks][, dbias])."""
    host = dict(causal=x["causal"], block_size=BLOCK)
    for name in ("bias", "block_mask", "seqused_q", "seqused_k", "sinks", "alibi_slopes"):
        if name in x:
            host[name] = x[name]
    if "dropout_p" in x:
        s, off = _seed_pair(x["seed"])
        host.update(dropout_p=x["dropout_p"], dropout_mask=dropout_keep_mask(s, off, B, HQ, MQ, MK, x["dropout_p"]))
    f64 = [np.asarray(x[n], np.float64) for n in ("q", "k", "v")]
    ref_o, ref_lse = attention_reference_varlen(*f64, x["cu_q"], x["cu_k"], **host)
    dlse = _masked_dlse(x, ref_lse).astype(np.float64) if x["return_lse"] else None
    refs = attention_reference_varlen_backward(np.asarray(x["dout"], np.float64), *f64, x["cu_q"], x["cu_k"],
                                               dlse=dlse, **host)
    return ref_o, ref_lse, refs


def _used_rows(x: dict) -> np.ndarray:
    """The packed query rows inside a sequence's used range (the others no kernel writes under seqused)."""
    used = x.get("seqused_q", np.array(LENGTHS_Q))
    return np.concatenate([np.arange(n) < u for n, u in zip(LENGTHS_Q, used)])


def _names(x: dict) -> list:
    return ["dq", "dk", "dv"] + [n for n in ("dsinks", "dbias") if n[1:] in x]


# ---------------------------------------------------------------------------
# CPU: registration, lowering, errors


def test_targets_are_registered_for_cuda_and_the_host():
    for target in (jax_targets.FORWARD_VARLEN_PROG, jax_targets.BACKWARD_VARLEN_PROG):
        assert {p for (t, p) in jax_targets.BODIES if t == target} == {"CUDA", "cpu"}
    assert jax_targets.BODIES[(jax_targets.FORWARD_VARLEN_PROG, "CUDA")] is jax_targets.cuda_forward_varlen_prog
    assert jax_targets.BODIES[(jax_targets.BACKWARD_VARLEN_PROG, "cpu")] is jax_targets.host_backward_varlen_prog
    cj.register_targets()   # XLA:CPU runs every target's metadata query here: a refused one raises
    assert len(cj._handlers) >= len(jax_targets.BODIES)


def _shapes(dtype=jnp.bfloat16):
    tq, tk = sum(LENGTHS_Q), sum(LENGTHS_K)
    return (jax.ShapeDtypeStruct((tq, HQ, D), dtype), jax.ShapeDtypeStruct((tk, HKV, D), dtype),
            jax.ShapeDtypeStruct((tk, HKV, D), dtype), jax.ShapeDtypeStruct((B + 1,), jnp.int32),
            jax.ShapeDtypeStruct((B + 1,), jnp.int32))


def test_lowers_to_the_programmable_varlen_calls():
    args = _shapes()
    bias = jax.ShapeDtypeStruct((B, 1, 1, MK), jnp.float32)
    words = jax.ShapeDtypeStruct((4,), jnp.uint32)

    def f(q, k, v, cu_q, cu_k, bias, words):
        return cj.dot_product_attention_varlen(q, k, v, cu_q, cu_k, MQ, MK, causal=True, bias=bias, dropout_p=0.25,
                                               dropout_seed=words, return_lse=True)

    fwd = jax.jit(f).lower(*args, bias, words).as_text()
    assert "stablehlo.custom_call @cuflash_attention_varlen_prog_fwd" in fwd
    for attr in (f"max_seqlen_q = {MQ} : i64", f"max_seqlen_k = {MK} : i64", "has_bias = true",
                 "has_block_mask = false", "has_rng = true", "dropout_p = 2.500000e-01 : f32", "causal = true",
                 "has_seqused_q = false"):
        assert attr in fwd, attr

    def loss(q, k, v, cu_q, cu_k, bias, words):
        out, lse = f(q, k, v, cu_q, cu_k, bias, words)
        return out.astype(jnp.float32).sum() + lse.sum()

    bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 5))).lower(*args, bias, words).as_text()
    assert "@cuflash_attention_varlen_prog_fwd" in bwd and "@cuflash_attention_varlen_prog_bwd" in bwd
    assert "has_dlse = true" in bwd and "dot_general" not in bwd

    # Without programmable arguments (a seed alone asks for nothing): the plain varlen calls, as before.
    def plain(q, k, v, cu_q, cu_k):
        return cj.dot_product_attention_varlen(q, k, v, cu_q, cu_k, MQ, MK, dropout_seed=3, block_size=64)

    text = jax.jit(plain).lower(*args).as_text()
    assert "@cuflash_attention_varlen_fwd" in text and "prog" not in text


def test_abstract_evaluation_of_the_gradients():
    q, k, v, cu_q, cu_k = _shapes(jnp.float16)
    bias = jax.ShapeDtypeStruct((1, HQ, MQ, MK), jnp.float16)
    sinks = jax.ShapeDtypeStruct((HQ,), jnp.float32)

    def pull(q, k, v, cu_q, cu_k, bias, sinks):
        def f(q, k, v, bias, sinks):
            return cj.dot_product_attention_varlen(q, k, v, cu_q, cu_k, MQ, MK, bias=bias, sinks=sinks)
        out, pullback = jax.vjp(f, q, k, v, bias, sinks)
        return pullback(jnp.ones_like(out))

    grads = jax.eval_shape(pull, q, k, v, cu_q, cu_k, bias, sinks)
    assert [(g.shape, g.dtype) for g in grads] == [(x.shape, x.dtype) for x in (q, k, v, bias, sinks)]


def _error_cases():
    import cuflash

    tk = sum(LENGTHS_K)
    nqb, nkb = -(-MQ // 128), -(-MK // 128)
    return [
        (dict(bias=jnp.zeros((3, MK))), ValueError,
         r"bias must broadcast to \(batch, heads_q, max_seqlen_q, max_seqlen_k\) = \(6, 4, 70, 90\)"),
        (dict(bias=jnp.zeros((B, HQ, 13, MK))), ValueError, "bias must broadcast to"),
        (dict(bias=jnp.zeros((1, 1, 1, 1, MK))), ValueError, "bias must broadcast to"),
        (dict(bias=jnp.zeros((MQ, MK), jnp.float16)), TypeError, "bias must be float32 or q's dtype"),
        (dict(dropout_p=0.1), ValueError, "needs a dropout_seed"),
        (dict(dropout_p=0.1, dropout_seed=jnp.zeros((2,), jnp.uint32)), ValueError, "dropout_seed must be"),
        (dict(dropout_p=0.1, dropout_seed=-1), ValueError, "dropout_seed"),
        (dict(dropout_p=1.0, dropout_seed=1), ValueError, r"dropout_p must be in \[0, 1\)"),
        (dict(dropout_p="0.1", dropout_seed=1), TypeError, "dropout_p must be a float"),
        (dict(block_mask=jnp.ones((B, 1, 2, 2), bool)), ValueError,
         rf"block_mask must have shape \(6 or 1, 4 or 1, {nqb}, {nkb}\)"),
        (dict(block_mask=jnp.ones((1, 1, nqb, nkb), jnp.int32)), TypeError, "block_mask must have dtype bool"),
        (dict(block_mask=jnp.ones((1, 1, nqb, nkb), bool), block_size=0), ValueError, "block_size must be"),
        (dict(dtype="float32", bias=jnp.zeros((MQ, MK), jnp.bfloat16)), TypeError, "bias must be float32 or q's dtype"),
        (dict(score_mod="return score;"), TypeError, "score_mod must be a cuflash.ScoreMod"),
        (dict(mask_mod=cuflash.MaskMod("return docs[kv_idx] >= 0;", tensors={"docs": np.zeros(tk, np.int32)})),
         TypeError, "must be a JAX array"),
    ]


@pytest.mark.parametrize("case", range(len(_error_cases())))
def test_argument_errors_raise_while_tracing(case):
    kwargs, exc, match = _error_cases()[case]
    kwargs = dict(kwargs)
    dtype = kwargs.pop("dtype", "bfloat16")
    q, k, v = (jnp.zeros(s.shape, dtype) for s in _shapes()[:3])
    cu_q, cu_k = jnp.asarray(_offsets(LENGTHS_Q)), jnp.asarray(_offsets(LENGTHS_K))
    with pytest.raises(exc, match=match):
        jax.jit(lambda q, k, v, cq, ck: cj.dot_product_attention_varlen(q, k, v, cq, ck, MQ, MK, **kwargs))(
            q, k, v, cu_q, cu_k)


def test_backward_limits_raise_while_tracing_the_gradient():
    """What the programmable varlen backward does not take (cuflash.backward_varlen's limits) raises while the
    gradient is traced; the forward alone is fine."""
    import cuflash

    q, k, _, cu_q, cu_k = _shapes()
    v32 = jax.ShapeDtypeStruct((k.shape[0], HKV, 32), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((MQ, MK), jnp.float32)

    def f(q, k, v, bias):
        return cj.dot_product_attention_varlen(q, k, v, jnp.asarray(_offsets(LENGTHS_Q)),
                                               jnp.asarray(_offsets(LENGTHS_K)), MQ, MK, bias=bias)

    jax.jit(f).lower(q, k, v32, bias)
    loss = lambda *a: f(*a).astype(jnp.float32).sum()  # noqa: E731
    with pytest.raises(ValueError, match="v's head dim equal to q's"):
        jax.jit(jax.grad(loss, argnums=(0, 3))).lower(q, k, v32, bias)

    score = cuflash.ScoreMod("return score * 0.5f;")   # no grad
    offsets = jnp.asarray(_offsets(LENGTHS_Q)), jnp.asarray(_offsets(LENGTHS_K))
    g = lambda q, k, v: cj.dot_product_attention_varlen(q, k, v, *offsets, MQ, MK, score_mod=score)  # noqa: E731
    jax.jit(g).lower(q, k, k)
    with pytest.raises(ValueError, match="needs its grad"):
        jax.jit(jax.grad(lambda *a: g(*a).astype(jnp.float32).sum())).lower(q, k, k)


def test_modifiers_are_refused_on_the_cpu_backend():
    import cuflash

    x = _inputs("bias")
    put = lambda a: jax.device_put(jnp.asarray(a), CPU)   # noqa: E731
    table = put(np.zeros(HQ * 64, np.float32))
    score = cuflash.ScoreMod("return score + table[h * 64 + min(abs(q_idx - kv_idx), 63)];", grad="return 1.f;",
                             tensors={"table": table})
    with pytest.raises(Exception, match="run on a GPU only"):
        cj.dot_product_attention_varlen(put(x["q"]), put(x["k"]), put(x["v"]), put(x["cu_q"]), put(x["cu_k"]), MQ,
                                        MK, score_mod=score).block_until_ready()


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
              has_alibi=False, has_sinks=True, alibi_per_batch=False, max_seqlen_q=MQ, max_seqlen_k=MK,
              has_seqused_q=False, has_seqused_k=True, dropout_p=0.25, block_q=32, block_k=16, has_bias=True,
              has_block_mask=True, has_rng=True, mods="")


def test_cuda_forward_body_reads_xlas_buffers(monkeypatch):
    """cuda_forward_varlen_prog hands XLA's buffers to ``cuflash.forward_varlen`` in the operand order (offsets,
    seqused_k, sinks, bias, block mask, the seed words as the uint64 (2,) device seed), ``out=`` / ``lse=`` XLA's
    results, ``check_offsets=False`` (no host sync under jit) and the attributes."""
    pytest.importorskip("cupy")
    from cuflash import api

    tq, tk = sum(LENGTHS_Q), sum(LENGTHS_K)
    call = _fake_call([((tq, HQ, D), "bfloat16"), ((tk, HKV, D), "bfloat16"), ((tk, HKV, D), "bfloat16"),
                       ((B + 1,), "int32"), ((B + 1,), "int32"), ((B,), "int32"), ((HQ,), "float32"),
                       ((B, 1, 1, MK), "float32"), ((1, HQ, 3, 6), "bool"), ((4,), "uint32")],
                      [((tq, HQ, D), "bfloat16"), ((HQ, tq), "float32")], dict(_ATTRS))
    monkeypatch.setattr(jax_targets, "_on_xla_device", _fake_device)
    seen = {}

    def forward_varlen(q, k, v, **kwargs):
        seen.update(args=(q, k, v), kwargs=kwargs)
        return kwargs["out"], kwargs["lse"]

    monkeypatch.setattr(api, "forward_varlen", forward_varlen)
    jax_targets.cuda_forward_varlen_prog(call)
    assert [x.data.ptr for x in seen["args"]] == [b.ptr for b in call.args[:3]]
    kw = seen["kwargs"]
    assert [kw[n].data.ptr for n in ("out", "lse")] == [b.ptr for b in call.rets]
    ptrs = [kw[n].data.ptr for n in ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "sinks", "bias", "block_mask",
                                     "seed")]
    assert ptrs == [b.ptr for b in call.args[3:]]
    assert kw["seed"].dtype == np.uint64 and kw["seed"].shape == (2,)
    assert kw["seqused_q"] is None and kw["alibi_slopes"] is None
    assert kw["check_offsets"] is False and kw["return_lse"] is True
    assert (kw["max_seqlen_q"], kw["max_seqlen_k"], kw["causal"], kw["softmax_scale"]) == (MQ, MK, True, 0.125)
    assert (kw["dropout_p"], kw["block_size"]) == (0.25, (32, 16))
    assert "score_mod" not in kw and "mask_mod" not in kw   # no modifiers: mods ""


def test_cuda_backward_body_reads_xlas_buffers(monkeypatch):
    """cuda_backward_varlen_prog calls ``cuflash.backward_varlen`` on XLA's buffers: dlse after the variants'
    operands and before the programmable ones, dq, dk, dv its results, check_offsets=False; dsinks and dbias go
    to the results after them."""
    pytest.importorskip("cupy")
    from cuflash import api

    tq, tk = sum(LENGTHS_Q), sum(LENGTHS_K)
    qs, ks = ((tq, HQ, D), "float16"), ((tk, HKV, D), "float16")
    bias = ((1, HQ, MQ, MK), "float16")
    call = _fake_call([qs, qs, ks, ks, qs, ((HQ, tq), "float32"), ((B + 1,), "int32"), ((B + 1,), "int32"),
                       ((B,), "int32"), ((HQ,), "float32"), ((HQ, tq), "float32"), bias],
                      [qs, ks, ks, ((HQ,), "float32"), bias],
                      dict(_ATTRS, has_block_mask=False, has_rng=False, dropout_p=0.0, deterministic=True,
                           has_dlse=True))
    monkeypatch.setattr(jax_targets, "_on_xla_device", _fake_device)
    seen = {}

    def backward_varlen(*args, **kwargs):
        seen.update(args=args, kwargs=kwargs)
        return kwargs["dq"], kwargs["dk"], kwargs["dv"], "dsinks", "dbias"

    monkeypatch.setattr(api, "backward_varlen", backward_varlen)
    monkeypatch.setattr(jax_targets, "_store_prog_grads", lambda bufs, grads, prog: seen.update(stored=(bufs, grads)))
    jax_targets.cuda_backward_varlen_prog(call)
    assert [x.data.ptr for x in seen["args"]] == [b.ptr for b in call.args[:6]]
    kw = seen["kwargs"]
    assert [kw[n].data.ptr for n in ("dq", "dk", "dv")] == [b.ptr for b in call.rets[:3]]
    ptrs = [kw[n].data.ptr for n in ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "sinks", "dlse", "bias")]
    assert ptrs == [b.ptr for b in call.args[6:]]
    assert kw["block_mask"] is None and "seed" not in kw and kw["dropout_p"] == 0.0
    assert kw["check_offsets"] is False and kw["deterministic"] is True
    bufs, grads = seen["stored"]
    assert [b.data.ptr for b in bufs] == [b.ptr for b in call.rets[3:]] and list(grads) == ["dsinks", "dbias"]


def test_store_prog_grads_orders_the_tensors_gradients_by_slot():
    import cuflash

    table, scale = np.zeros(8, np.float32), np.zeros(2, np.float32)
    score = cuflash.ScoreMod("return score * scale[0] + table[h];", grad="return scale[0];",
                             tensors={"table": table, "scale": scale},
                             tensor_grads={"scale": "atomicAdd(&d_scale[0], dscore * score);",
                                           "table": "atomicAdd(&d_table[h], dscore);"})
    from cuflash.modifiers import Modifiers

    slots = list(Modifiers(score, None).slots)
    bufs = [np.zeros(3), np.zeros(8), np.zeros(2)]   # dbias, then the gradients in slot order
    grads = (np.full(3, 1.0), {"table": np.full(8, 2.0), "scale": np.full(2, 3.0)})
    jax_targets._store_prog_grads(bufs, grads, dict(score_mod=score, mask_mod=None))
    assert np.all(bufs[0] == 1)
    want = {"table": 2.0, "scale": 3.0}
    for buf, name in zip(bufs[1:], slots):
        assert np.all(buf == want[name]), name


# ---------------------------------------------------------------------------
# CPU: the host targets (float64 references) under jit and grad


@pytest.mark.parametrize("case", sorted(CASES))
def test_host_path_matches_the_reference(case):
    """The plumbing on XLA:CPU (operand order, attributes, the seed's words, dbias, dsinks, the lse cotangent):
    the host targets' results (the float64 references rounded to bf16) against the references."""
    x = _inputs(case)
    out, lse, grads = _run_jax(x, CPU)
    ref_o, ref_lse, refs = _reference(x)
    rows = _used_rows(x)
    assert out.shape == x["q"].shape and out.dtype == x["q"].dtype
    assert rel_err(_f64(out)[rows], ref_o[rows]) <= 4e-3
    if lse is not None:
        assert_lse_matches(np.asarray(lse)[:, rows], ref_lse[:, rows], (HQ, int(rows.sum())))
    for name, g, r in zip(_names(x), grads, refs):
        assert g.shape == r.shape, name
        err = rel_err(_f64(g), r)
        assert err <= 4e-3, f"{name} rel err {err:.3e}"


def test_host_path_under_vmap():
    """jax.vmap over stacked packed batches: one call per element (vmap_method="sequential"), each its bias row."""
    x = _inputs("keypad_causal")
    q = jnp.stack([jnp.asarray(x["q"]), -jnp.asarray(x["q"])])
    bias = jnp.stack([jnp.asarray(x["bias"]), jnp.zeros_like(jnp.asarray(x["bias"]))])
    cu_q, cu_k = jnp.asarray(x["cu_q"]), jnp.asarray(x["cu_k"])

    def f(q, bias):
        return cj.dot_product_attention_varlen(q, jnp.asarray(x["k"]), jnp.asarray(x["v"]), cu_q, cu_k, MQ, MK,
                                               causal=True, bias=bias)

    out = jax.jit(jax.vmap(f))(q, bias)
    for i in range(2):
        ref_o, _ = attention_reference_varlen(_f64(q[i]), _f64(x["k"]), _f64(x["v"]), x["cu_q"], x["cu_k"],
                                              causal=True, bias=_f64(bias[i]))
        assert rel_err(_f64(out[i]), ref_o) <= 4e-3


# ---------------------------------------------------------------------------
# GPU: the kernels on XLA's buffers and stream, against cuflash.forward_varlen / backward_varlen


def _run_cupy(x: dict) -> tuple:
    """cuflash.forward_varlen / backward_varlen on the same inputs: out, lse and the gradients."""
    import cupy
    import cuflash

    dev = {n: cupy.asarray(a) for n, a in x.items() if isinstance(a, np.ndarray)}
    kw = dict(causal=x["causal"], block_size=BLOCK, block_mask=dev.get("block_mask"), bias=dev.get("bias"),
              seqused_q=dev.get("seqused_q"), seqused_k=dev.get("seqused_k"), sinks=dev.get("sinks"),
              alibi_slopes=dev.get("alibi_slopes"))
    if "dropout_p" in x:
        s, off = _seed_pair(x["seed"])
        kw.update(dropout_p=x["dropout_p"], seed=s, offset=off)
    args = (dev["cu_q"], dev["cu_k"], MQ, MK)
    out, lse = cuflash.forward_varlen(dev["q"], dev["k"], dev["v"], *args, return_lse=True, **kw)
    dlse = cupy.asarray(_masked_dlse(x, lse.get())) if x["return_lse"] else None
    grads = cuflash.backward_varlen(dev["dout"], dev["q"], dev["k"], dev["v"], out, lse, *args, dlse=dlse, **kw)
    cupy.cuda.get_current_stream().synchronize()
    return out.get(), lse.get(), [g.get() for g in grads]


# Tight: the same kernels on the same inputs (dq, dk, dv and out deterministic; dbias and the tables' gradients
# float32 atomics, in any order).
SAME_TOL = 1e-3


@requires_gpu
@requires_jax_gpu
@pytest.mark.parametrize("case", sorted(CASES))
def test_gpu_matches_the_cupy_api(case):
    x = _inputs(case, seed=1)
    out, lse, grads = _run_jax(x, GPU)
    c_out, c_lse, c_grads = _run_cupy(x)
    rows = _used_rows(x)
    assert rel_err(_f64(out)[rows], _f64(c_out)[rows]) <= SAME_TOL
    if lse is not None:
        got, want = np.asarray(lse)[:, rows], c_lse[:, rows]
        assert np.array_equal(np.isinf(got), np.isinf(want))
        assert np.allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=1e-5, atol=1e-5)
    assert len(grads) == len(c_grads) == len(_names(x))
    for name, g, c in zip(_names(x), grads, c_grads):
        assert g.shape == c.shape and g.dtype == c.dtype, name
        err = rel_err(_f64(g), _f64(c))
        assert err <= SAME_TOL, f"{name}: JAX vs cuflash.backward_varlen rel err {err:.3e}"
    # And both against float64 (the CuPy API's own tests check it on every row; here the whole arrays).
    ref_o, ref_lse, refs = _reference(x)
    assert rel_err(_f64(out)[rows], ref_o[rows]) <= FWD_TOL["bfloat16"]
    for name, g, r in zip(_names(x), grads, refs):
        err = rel_err(_f64(g), r)
        assert err <= BWD_TOL["bfloat16"], f"{name} rel err {err:.3e} against float64"


@requires_gpu
@requires_jax_gpu
def test_gpu_modifiers_with_the_tables_gradient_match_the_cupy_api():
    """A relative-position ScoreMod with its table's gradient (tensor_grads) and a document MaskMod read per
    sequence (b), under jit and grad, against cuflash.forward_varlen / backward_varlen on the same tensors."""
    import cupy
    import cuflash

    x = _inputs("bias", seed=2)
    rng = np.random.default_rng(7)
    n = max(MQ, MK)
    table = rng.normal(0, 0.5, HQ * 64).astype(np.float32)
    docs = np.sort(rng.integers(0, 4, (B, n)), axis=1).astype(np.int32)
    src = "return score + table[h * 64 + min(abs(q_idx - kv_idx), 63)];"
    tgrad = {"table": "atomicAdd(&d_table[h * 64 + min(abs(q_idx - kv_idx), 63)], dscore);"}
    mask_src = f"return docs[b * {n} + q_idx] == docs[b * {n} + kv_idx];"

    put = lambda a: jax.device_put(jnp.asarray(a), GPU)   # noqa: E731
    q, k, v, dout, cu_q, cu_k = (put(x[n_]) for n_ in ("q", "k", "v", "dout", "cu_q", "cu_k"))
    mask = cuflash.MaskMod(mask_src, tensors={"docs": put(docs)}, per_head=False)

    def loss(q, k, v, t):
        score = cuflash.ScoreMod(src, grad="return 1.f;", tensors={"table": t}, tensor_grads=tgrad)
        out = cj.dot_product_attention_varlen(q, k, v, cu_q, cu_k, MQ, MK, causal=True, score_mod=score,
                                              mask_mod=mask)
        return (out.astype(jnp.float32) * dout.astype(jnp.float32)).sum(), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, put(table))

    dev = {n_: cupy.asarray(x[n_]) for n_ in ("q", "k", "v", "dout", "cu_q", "cu_k")}
    c_score = cuflash.ScoreMod(src, grad="return 1.f;", tensors={"table": cupy.asarray(table)}, tensor_grads=tgrad)
    c_mask = cuflash.MaskMod(mask_src, tensors={"docs": cupy.asarray(docs)}, per_head=False)
    kw = dict(causal=True, score_mod=c_score, mask_mod=c_mask)
    c_out, c_lse = cuflash.forward_varlen(dev["q"], dev["k"], dev["v"], dev["cu_q"], dev["cu_k"], MQ, MK,
                                          return_lse=True, **kw)
    dq, dk, dv, tgrads = cuflash.backward_varlen(dev["dout"], dev["q"], dev["k"], dev["v"], c_out, c_lse,
                                                 dev["cu_q"], dev["cu_k"], MQ, MK, **kw)
    assert rel_err(_f64(out), _f64(c_out.get())) <= SAME_TOL
    assert grads[3].shape == table.shape and grads[3].dtype == jnp.float32
    for name, g, c in zip(("dq", "dk", "dv", "dtable"), grads, (dq, dk, dv, tgrads["table"])):
        err = rel_err(_f64(g), _f64(c.get()))
        assert err <= SAME_TOL, f"{name}: JAX vs cuflash.backward_varlen rel err {err:.3e}"
