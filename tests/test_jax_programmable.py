"""cuflash.jax with programmable attention (issue #45): a bias with its gradient, dropout from a seed operand and
block masks through the programmable custom calls, under jit and grad, against the float64 reference. On the CPU
backend the calls run the reference (the plumbing: operands, attributes, dbias, the seed's words); on a GPU the
kernels. Tests skip where JAX is not installed."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import BWD_TOL, FWD_TOL

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import cuflash.jax as cj  # noqa: E402
from cuflash.philox import dropout_keep_mask  # noqa: E402
from cuflash.reference import attention_reference, attention_reference_backward, rel_err  # noqa: E402
from test_jax import CPU, GPU  # noqa: E402

B, NQ, NK, HQ, HKV, D = 2, 70, 90, 4, 2, 64
CASES = {
    "bias": dict(bias=(1, HQ, NQ, NK)),
    "keypad_causal": dict(bias=(B, 1, 1, NK), causal=True),
    "dropout": dict(dropout_p=0.2, seed=1234567890123),
    "dropout_seed_array": dict(dropout_p=0.1, seed_words=(5, 7, 3, 0)),
    "block_mask": dict(block_mask=True, causal=True),
    "all": dict(bias=(B, HQ, NQ, NK), dropout_p=0.1, seed=9, block_mask=True),
    # float32 q, k, v (the exact kernels on a GPU)
    "float32_all": dict(dtype="float32", bias=(B, 1, NQ, NK), dropout_p=0.1, seed=21, block_mask=True, causal=True),
}


def _f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_programmable_under_jit_and_grad(case, platform):
    device = CPU if platform == "cpu" else GPU
    if device is None:
        pytest.skip("needs a CUDA JAX backend and a CuPy device")
    rng = np.random.default_rng(11)
    spec = dict(CASES[case])
    put = lambda x: jax.device_put(jnp.asarray(x), device)   # noqa: E731
    dtype = spec.pop("dtype", "bfloat16")
    q, k, v = (put(rng.standard_normal(s).astype(np.float32)).astype(dtype)
               for s in ((B, NQ, HQ, D), (B, NK, HKV, D), (B, NK, HKV, D)))
    dout = put(rng.standard_normal((B, NQ, HQ, D)).astype(np.float32))
    bias = put(rng.standard_normal(spec.pop("bias")).astype(np.float32)) if "bias" in spec else None
    block_mask = None
    if spec.pop("block_mask", False):
        mask = rng.random((B, 1, -(-NQ // 32), -(-NK // 16))) < 0.6
        mask[..., 0] = True   # every row sees a key
        block_mask = put(mask)
    p = spec.pop("dropout_p", 0.0)
    seed = spec.pop("seed", None)
    words = spec.pop("seed_words", None)
    seed_arg = put(np.array(words, np.uint32)) if words is not None else seed
    causal = spec.pop("causal", False)

    def loss(q, k, v, bias):
        out = cj.dot_product_attention(q, k, v, causal=causal, bias=bias, dropout_p=p, dropout_seed=seed_arg,
                                       block_mask=block_mask, block_size=(32, 16))
        return (out.astype(jnp.float32) * dout).sum(), out

    argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(q, k, v, bias)
    host = dict(causal=causal, bias=None if bias is None else np.asarray(bias),
                block_mask=None if block_mask is None else np.asarray(block_mask), block_size=(32, 16))
    if p:
        s, off = (seed, 0) if words is None else (words[0] | words[1] << 32, words[2] | words[3] << 32)
        host.update(dropout_p=p, dropout_mask=dropout_keep_mask(s, off, B, HQ, NQ, NK, p))
    ref_o, _ = attention_reference(_f64(q), _f64(k), _f64(v), **host)
    refs = attention_reference_backward(np.asarray(dout, np.float64), _f64(q), _f64(k), _f64(v), **host)
    assert out.dtype == dtype and rel_err(_f64(out), ref_o) <= FWD_TOL[dtype]
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, refs):
        assert g.shape == r.shape, name
        err = rel_err(_f64(g), r)
        assert err <= BWD_TOL[dtype], f"{name} rel err {err:.3e}"


def test_programmable_argument_errors():
    q = jnp.zeros((B, NQ, HQ, D), jnp.bfloat16)
    k = v = jnp.zeros((B, NK, HKV, D), jnp.bfloat16)
    with pytest.raises(ValueError, match="bias must broadcast"):
        cj.dot_product_attention(q, k, v, bias=jnp.zeros((3, NK)))
    with pytest.raises(TypeError, match="bias must be float32"):
        cj.dot_product_attention(q, k, v, bias=jnp.zeros((NQ, NK), jnp.float16))
    with pytest.raises(ValueError, match="needs a dropout_seed"):
        cj.dot_product_attention(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="dropout_seed must be"):
        cj.dot_product_attention(q, k, v, dropout_p=0.1, dropout_seed=jnp.zeros((2,), jnp.uint32))
    with pytest.raises(ValueError, match="block_mask must have shape"):
        cj.dot_product_attention(q, k, v, block_mask=jnp.ones((1, 1, 2, 2), bool))
    with pytest.raises(TypeError, match="bias must be float32 or q's dtype"):
        cj.dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                                 bias=jnp.zeros((NQ, NK), jnp.bfloat16))
    assert cj.dropout_seed(jax.random.PRNGKey(0)).shape == (4,)


def _relpos_mod(table):
    import cuflash

    return cuflash.ScoreMod("return score + table[h * 64 + min(abs(q_idx - kv_idx), 63)];", grad="return 1.f;",
                            tensors={"table": table},
                            tensor_grads={"table": "atomicAdd(&d_table[h * 64 + min(abs(q_idx - kv_idx), 63)], "
                                                   "dscore);"})


def _table(device):
    return jax.device_put(jnp.asarray(np.random.default_rng(5).normal(0, 0.5, HQ * 64).astype(np.float32)), device)


def test_modifiers_are_checked_and_refused_on_the_cpu_backend():
    import cuflash

    q = jax.device_put(jnp.zeros((B, NQ, HQ, D), jnp.bfloat16), CPU)
    k = v = jax.device_put(jnp.zeros((B, NK, HKV, D), jnp.bfloat16), CPU)
    with pytest.raises(TypeError, match="must be a JAX array"):
        cj.dot_product_attention(q, k, v, mask_mod=cuflash.MaskMod("return docs[q_idx] == docs[kv_idx];",
                                                                   tensors={"docs": np.zeros(NK, np.int32)}))
    with pytest.raises(Exception, match="run on a GPU only"):
        cj.dot_product_attention(q, k, v, score_mod=_relpos_mod(_table(CPU))).block_until_ready()


def test_modifiers_on_the_gpu_with_the_tables_gradient():
    """A relative-position score modifier and a document mask through the custom calls, under jit and grad: the
    output, dq, dk, dv and the table's gradient against float64 (the reference's dscore hook)."""
    import cuflash

    if GPU is None:
        pytest.skip("needs a CUDA JAX backend and a CuPy device")
    rng = np.random.default_rng(13)
    put = lambda x: jax.device_put(jnp.asarray(x), GPU)   # noqa: E731
    q, k, v = (put(rng.standard_normal(s).astype(np.float32)).astype(jnp.bfloat16)
               for s in ((B, NQ, HQ, D), (B, NK, HKV, D), (B, NK, HKV, D)))
    dout = put(rng.standard_normal((B, NQ, HQ, D)).astype(np.float32))
    docs = np.sort(rng.integers(0, 4, max(NQ, NK))).astype(np.int32)
    mask = cuflash.MaskMod("return docs[q_idx] == docs[kv_idx];", tensors={"docs": put(docs)})

    def loss(q, k, v, table):
        out = cj.dot_product_attention(q, k, v, causal=True, score_mod=_relpos_mod(table), mask_mod=mask)
        return (out.astype(jnp.float32) * dout).sum(), out

    table0 = _table(GPU)
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, table0)
    t = np.asarray(table0, np.float64).reshape(HQ, 64)
    dtable = np.zeros_like(t)

    def hook(dscore, bb, h, qi, ki):
        np.add.at(dtable[h], np.minimum(np.abs(qi - ki), 63), dscore)

    host = dict(causal=True, score_mod=lambda s, bb, h, qi, ki: s + t[h][np.minimum(np.abs(qi - ki), 63)],
                score_mod_grad=lambda s, bb, h, qi, ki: np.ones_like(s),
                mask_mod=lambda bb, h, qi, ki: docs[qi] == docs[ki])
    ref_o, _ = attention_reference(_f64(q), _f64(k), _f64(v), **host)
    refs = attention_reference_backward(np.asarray(dout, np.float64), _f64(q), _f64(k), _f64(v), dscore_hook=hook,
                                        **host)
    assert rel_err(_f64(out), ref_o) <= FWD_TOL["bfloat16"]
    for name, g, r in zip(("dq", "dk", "dv", "dtable"), grads, list(refs[:3]) + [dtable.reshape(-1)]):
        err = rel_err(_f64(g), r)
        assert err <= BWD_TOL["bfloat16"], f"{name} rel err {err:.3e}"
