"""GPU: programmable attention on packed (varlen) batches (issue #45) against the float64 varlen reference:
biases of several broadcast shapes with dbias, dropout given the generator's mask, block masks, a relative-position
score modifier with its table's gradient, a per-sequence document mask modifier; mixed lengths (empty
sequences, single tokens, keys without queries), causal, GQA, seqused. Sequence b sees batch index b of every
programmable argument at its own positions (as if the batch were padded to the longest sequence).

Outputs and gradients are poisoned before each call; every row is compared; lse to its own bound.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import (BWD_TOL, FWD_TOL, assert_close_on_every_row, assert_grads_close_on_every_row,
                      assert_lse_matches, assert_programmable_grads_close, dtype_of, poisoned, requires_gpu)

pytestmark = requires_gpu

LENGTHS_Q = [0, 1, 13, 131, 257, 7, 64]
LENGTHS_K = [3, 1, 0, 200, 257, 19, 64]


def _offsets(lengths):
    import cupy

    return cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))


def _packed(rng, dtype, hq=4, hkv=2, d=64, lengths_q=LENGTHS_Q, lengths_k=LENGTHS_K):
    import cupy

    dt = dtype_of(dtype)
    tq, tk = sum(lengths_q), sum(lengths_k)
    q, k, v = (cupy.asarray(rng.standard_normal((n, h, d)).astype(np.float32).astype(dt))
               for n, h in ((tq, hq), (tk, hkv), (tk, hkv)))
    return q, k, v, _offsets(lengths_q), _offsets(lengths_k)


def _forward(q, k, v, cu_q, cu_k, dtype, ref_kwargs: dict, **kwargs):
    """forward_varlen(**kwargs) into a poisoned buffer against attention_reference_varlen(**ref_kwargs)."""
    import cupy
    import cuflash
    from cuflash.reference import attention_reference_varlen

    out = poisoned(q.shape, dtype)
    o, lse = cuflash.forward_varlen(q, k, v, cu_q, cu_k, max(LENGTHS_Q), max(LENGTHS_K), return_lse=True, out=out,
                                    **kwargs)
    cupy.cuda.get_current_stream().synchronize()
    ref_o, ref_lse = attention_reference_varlen(q, k, v, cu_q, cu_k, **ref_kwargs)
    assert_close_on_every_row("out", o, cupy.asarray(ref_o), dtype, FWD_TOL)
    assert_lse_matches(lse, ref_lse, ref_lse.shape)
    return o, lse


def _backward(rng, q, k, v, cu_q, cu_k, dtype, ref_kwargs: dict, *, dbias_of=None, tensor_refs=None,
              per_row: bool = True, **kwargs):
    """backward_varlen(**kwargs) into poisoned buffers against attention_reference_varlen_backward: dq, dk, dv,
    dbias (dbias_of: the bias) and the modifiers' tensor gradients (tensor_refs: name -> the reference's
    accumulated array)."""
    import cupy
    import cuflash
    from cuflash.reference import attention_reference_varlen_backward

    mq, mk = max(LENGTHS_Q), max(LENGTHS_K)
    o, lse = cuflash.forward_varlen(q, k, v, cu_q, cu_k, mq, mk, return_lse=True, **kwargs)
    dout = cupy.asarray(rng.standard_normal(o.shape).astype(np.float32).astype(dtype_of(dtype)))
    bufs = [poisoned(x.shape, dtype) for x in (q, k, v)]
    grads = cuflash.backward_varlen(dout, q, k, v, o, lse, cu_q, cu_k, mq, mk, dq=bufs[0], dk=bufs[1], dv=bufs[2],
                                    **kwargs)
    cupy.cuda.get_current_stream().synchronize()
    refs = attention_reference_varlen_backward(dout, q, k, v, cu_q, cu_k, **ref_kwargs)
    assert_programmable_grads_close(grads, refs, dtype, dbias_of=dbias_of, tensor_refs=tensor_refs, per_row=per_row)


def _bias(rng, shape_code: str, dtype):
    import cupy

    dims = {"b": len(LENGTHS_Q), "h": 4, "q": max(LENGTHS_Q), "k": max(LENGTHS_K), "1": 1}
    shape = tuple(dims[c] for c in shape_code)
    return cupy.asarray(rng.normal(0, 2, shape).astype(np.float32).astype(dtype_of(dtype)))


@pytest.mark.parametrize("bias_shape", ["1hqk", "b11k", "bhqk", "bh1k"])
@pytest.mark.parametrize("dtype,bias_dtype", [("float16", "float32"), ("bfloat16", "bfloat16"), ("float32", "float32")])
@pytest.mark.parametrize("causal", [False, True])
def test_bias(rng, bias_shape, dtype, bias_dtype, causal):
    q, k, v, cu_q, cu_k = _packed(rng, dtype)
    bias = _bias(rng, bias_shape, bias_dtype)
    _forward(q, k, v, cu_q, cu_k, dtype, dict(bias=bias.get().astype(np.float64), causal=causal), bias=bias,
             causal=causal)
    # bf16: a bias of std 2 makes some rows' probabilities near one-hot, whose dq the rounding of dS moves past
    # the row bound (one row in ~600, as on the dense kernels: conftest.assert_grads_close_on_every_row).
    _backward(rng, q, k, v, cu_q, cu_k, dtype, dict(bias=bias.get().astype(np.float64), causal=causal),
              dbias_of=bias, bias=bias, causal=causal, per_row=dtype != "bfloat16")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_dropout(rng, dtype):
    import cuflash

    q, k, v, cu_q, cu_k = _packed(rng, dtype)
    p, seed, offset = 0.2, int(rng.integers(0, 2**63)), int(rng.integers(0, 2**40))
    keep = cuflash.dropout_keep_mask(seed, offset, len(LENGTHS_Q), 4, max(LENGTHS_Q), max(LENGTHS_K), p)
    for causal in (False, True):
        ref = dict(dropout_p=p, dropout_mask=keep, causal=causal)
        _forward(q, k, v, cu_q, cu_k, dtype, ref, dropout_p=p, seed=seed, offset=offset, causal=causal)
        _backward(rng, q, k, v, cu_q, cu_k, dtype, ref, dropout_p=p, seed=seed, offset=offset, causal=causal,
                  per_row=False)


@pytest.mark.parametrize("block_size", [64, (32, 48)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_block_mask(rng, block_size, dtype):
    import cupy
    from cuflash.block_sparse import block_grid

    q, k, v, cu_q, cu_k = _packed(rng, dtype)
    blocks = rng.random((len(LENGTHS_Q), 4) + block_grid(max(LENGTHS_Q), max(LENGTHS_K), block_size)) < 0.6
    for causal in (False, True):
        ref = dict(block_mask=blocks, block_size=block_size, causal=causal)
        kw = dict(block_mask=cupy.asarray(blocks), block_size=block_size, causal=causal)
        _forward(q, k, v, cu_q, cu_k, dtype, ref, **kw)
        _backward(rng, q, k, v, cu_q, cu_k, dtype, ref, **kw)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_modifiers_with_the_tables_gradient_and_per_sequence_documents(rng, dtype):
    """A relative-position score modifier with its table's gradient and a document mask read per sequence (b),
    at positions within each sequence."""
    import cupy
    import cuflash

    q, k, v, cu_q, cu_k = _packed(rng, dtype)
    hq, mq, mk = 4, max(LENGTHS_Q), max(LENGTHS_K)
    n = max(mq, mk)
    table = rng.normal(0, 1, (hq, 64)).astype(np.float32)
    docs = np.sort(rng.integers(0, 5, (len(LENGTHS_Q), n)), axis=1).astype(np.int32)
    score = cuflash.ScoreMod("return score + table[h * 64 + min(abs(q_idx - kv_idx), 63)];", grad="return 1.f;",
                             tensors={"table": cupy.asarray(table)},
                             tensor_grads={"table": "atomicAdd(&d_table[h * 64 + min(abs(q_idx - kv_idx), 63)], dscore);"})
    mask = cuflash.MaskMod(f"return docs[b * {n} + q_idx] == docs[b * {n} + kv_idx];",
                           tensors={"docs": cupy.asarray(docs)}, per_head=False)
    dtable = np.zeros_like(table, dtype=np.float64)

    def hook(ds, b, h, qi, ki):
        np.add.at(dtable[h], np.broadcast_to(np.minimum(np.abs(qi - ki), 63), ds.shape), ds)

    ref = dict(score_mod=lambda s, b, h, qi, ki: s + table[h][np.minimum(np.abs(qi - ki), 63)],
               score_mod_grad=lambda s, *a: np.ones_like(s),
               mask_mod=lambda b, h, qi, ki: docs[b][qi] == docs[b][ki], causal=True)
    _forward(q, k, v, cu_q, cu_k, dtype, ref, score_mod=score, mask_mod=mask, causal=True)
    _backward(rng, q, k, v, cu_q, cu_k, dtype, dict(ref, dscore_hook=hook), tensor_refs={"table": dtable},
              score_mod=score, mask_mod=mask, causal=True)


def test_seqused_with_a_bias(rng):
    """Rows and keys past seqused: outputs and gradients 0 (dbias there too), the rest as the reference."""
    import cupy
    import cuflash
    from cuflash.reference import attention_reference_varlen, attention_reference_varlen_backward

    q, k, v, cu_q, cu_k = _packed(rng, "bfloat16")
    used_q = cupy.asarray(np.array([0, 1, 9, 100, 257, 3, 64], dtype=np.int32))
    used_k = cupy.asarray(np.array([2, 1, 0, 150, 200, 19, 10], dtype=np.int32))
    bias = _bias(rng, "1hqk", "float32")
    kw = dict(seqused_q=used_q, seqused_k=used_k, bias=bias, causal=True)
    mq, mk = max(LENGTHS_Q), max(LENGTHS_K)
    o, lse = cuflash.forward_varlen(q, k, v, cu_q, cu_k, mq, mk, return_lse=True, out=poisoned(q.shape, "bfloat16"),
                                    **kw)
    ref_kw = dict(kw, bias=bias.get())
    ref_o, ref_lse = attention_reference_varlen(q, k, v, cu_q, cu_k, **ref_kw)
    assert_close_on_every_row("out", o, cupy.asarray(ref_o), "bfloat16", FWD_TOL)
    assert_lse_matches(lse, ref_lse, ref_lse.shape)
    dout = cupy.asarray(rng.standard_normal(o.shape).astype(np.float32)).astype(o.dtype)
    bufs = [poisoned(x.shape, "bfloat16") for x in (q, k, v)]
    dq, dk, dv, dbias = cuflash.backward_varlen(dout, q, k, v, o, lse, cu_q, cu_k, mq, mk, dq=bufs[0], dk=bufs[1],
                                                dv=bufs[2], **kw)
    refs = attention_reference_varlen_backward(dout, q, k, v, cu_q, cu_k, **ref_kw)
    assert_grads_close_on_every_row(("dq", "dk", "dv", "dbias"), [dq, dk, dv, dbias.astype(cupy.float64)],
                                    refs, "bfloat16", BWD_TOL, per_row=False)


def test_equals_the_dense_api_on_equal_lengths(rng):
    """Sequences of one length: forward_varlen with every programmable argument equals cuflash.forward on the
    same batch as a dense array (the portable kernels, which both then run; their tiles may differ by the table
    the device's class picks, hence a bound rather than bitwise equality)."""
    import cupy
    import cuflash
    from cuflash.block_sparse import block_grid

    b, n, hq, d = 3, 200, 4, 64
    q, k, v = (cupy.asarray(rng.standard_normal((b, n, h, d)).astype(np.float32)).astype(cupy.float16)
               for h in (hq, 2, 2))
    bias = cupy.asarray(rng.normal(0, 1, (b, hq, n, n)).astype(np.float32))
    blocks = cupy.asarray(rng.random((b, 1) + block_grid(n, n, 64)) < 0.7)
    kw = dict(bias=bias, dropout_p=0.1, seed=5, offset=2, block_mask=blocks, block_size=64, causal=True)
    cu = _offsets([n] * b)
    with cuflash.options.override(fwd_backend="sm80"):
        dense = cuflash.forward(q, k, v, **kw)
    packed = cuflash.forward_varlen(q.reshape(b * n, hq, d), k.reshape(b * n, 2, d), v.reshape(b * n, 2, d), cu, cu,
                                    n, n, **kw)
    assert_close_on_every_row("out", packed.reshape(dense.shape), dense.astype(cupy.float64), "float16", FWD_TOL)
