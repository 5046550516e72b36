"""cuflash.torch.attention (programmable attention's PyTorch ops) without a GPU: the ops' schemas, their fake
(meta) shapes, the autograd formula's gradients for q, k, v, the bias and a modifier's tensor on meta tensors.
On a GPU: against cuflash.forward / backward on the same inputs."""
from __future__ import annotations

import pytest

from conftest import requires_gpu

torch = pytest.importorskip("torch")
ct = pytest.importorskip("cuflash.torch")

from cuflash import MaskMod, ScoreMod  # noqa: E402
from cuflash import torch_programmable as tp  # noqa: E402


def test_op_schemas():
    fwd = str(torch.ops.cuflash.attention_forward_prog.default._schema)
    bwd = str(torch.ops.cuflash.attention_backward_prog.default._schema)
    assert fwd.startswith("cuflash::attention_forward_prog(Tensor q, Tensor k, Tensor v, Tensor? bias, Tensor? rng_state, "
                          "Tensor? block_mask, Tensor[] mod_tensors, float softmax_scale, bool causal")
    assert fwd.endswith("float dropout_p, SymInt block_q, SymInt block_k, str mods) -> (Tensor, Tensor)")
    assert bwd.endswith("-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor[])")


def _meta(shape, dtype=torch.bfloat16, grad=False):
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)


def test_fake_shapes_and_gradients_on_meta():
    b, nq, nk, hq, hkv, d = 2, 9, 13, 4, 2, 64
    q, k, v = _meta((b, nq, hq, d), grad=True), _meta((b, nk, hkv, d), grad=True), _meta((b, nk, hkv, d), grad=True)
    bias = _meta((1, hq, nq, nk), torch.float32, grad=True)
    table = _meta((hq * 64,), torch.float32, grad=True)
    docs = _meta((nq,), torch.int32)
    score = ScoreMod("return score + table[h * 64 + min(abs(q_idx - kv_idx), 63)];", grad="return 1.f;",
                     tensors={"table": table},
                     tensor_grads={"table": "atomicAdd(&d_table[h * 64 + min(abs(q_idx - kv_idx), 63)], dscore);"})
    mask = MaskMod("return docs[q_idx] == docs[kv_idx];", tensors={"docs": docs})
    key, tensors = tp.register(score, mask)
    assert key and tensors == [table, docs]
    out, lse = torch.ops.cuflash.attention_forward_prog(q, k, v, bias, None, None, tensors, 0.125, True, -1, -1, 0,
                                                        0.0, None, None, 0.0, 128, 128, key)
    assert out.shape == q.shape and lse.shape == (b, hq, nq) and lse.dtype == torch.float32
    dq, dk, dv, dbias, dtable = torch.autograd.grad(out, (q, k, v, bias, table), torch.empty_like(out))
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert dbias.shape == bias.shape and dtable.shape == table.shape


def test_attention_checks_before_the_op():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):   # CUDA tensors from metadata alone (a CPU-only torch)
        q = torch.empty((1, 4, 2, 64), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(TypeError, match="q must be on a CUDA device"):
        ct.attention(_meta((1, 4, 2, 64)), q, q)
    with pytest.raises(ValueError, match="dropout_p"):
        ct.attention(q, q, q, dropout_p=1.5)
    with pytest.raises(ValueError, match="block_size"):
        ct.attention(q, q, q, block_size=0)
    with pytest.raises(TypeError, match="modifier tensor 'table' must be a torch.Tensor"):
        import numpy as np

        ct.attention(q, q, q, score_mod=ScoreMod("return score + table[0];", tensors={"table": np.zeros(2, np.float32)}))


@requires_gpu
def test_attention_matches_cuflash_on_the_gpu():
    import cupy
    import cuflash

    torch.manual_seed(0)
    dev = "cuda"
    q = torch.randn(2, 130, 4, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 150, 2, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 150, 2, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(1, 4, 130, 150, device=dev, dtype=torch.float32, requires_grad=True)
    table = torch.randn(4 * 64, device=dev, dtype=torch.float32, requires_grad=True)
    score = ScoreMod("return score + table[h * 64 + min(abs(q_idx - kv_idx), 63)];", grad="return 1.f;",
                     tensors={"table": table},
                     tensor_grads={"table": "atomicAdd(&d_table[h * 64 + min(abs(q_idx - kv_idx), 63)], dscore);"})
    out = ct.attention(q, k, v, causal=True, bias=bias, score_mod=score)
    dout = torch.randn_like(out)
    out.backward(dout)
    cq, ck, cv = (cupy.from_dlpack(x.detach()) for x in (q, k, v))
    cscore = ScoreMod(score.source, score.grad, tensors={"table": cupy.from_dlpack(table.detach())},
                      tensor_grads=score.tensor_grads)
    cb = cupy.from_dlpack(bias.detach())
    o, lse = cuflash.forward(cq, ck, cv, causal=True, bias=cb, score_mod=cscore, return_lse=True)
    grads = cuflash.backward(cupy.from_dlpack(dout), cq, ck, cv, o, lse, causal=True, bias=cb, score_mod=cscore)
    assert bool(cupy.all(cupy.from_dlpack(out.detach()) == o))
    for t, g in zip((k, v), grads[1:3]):
        assert bool(cupy.all(cupy.from_dlpack(t.grad) == g))
    # dq: Hopper's tiles add their slices in the order they finish, so two runs may round differently
    err = float(cupy.linalg.norm((cupy.from_dlpack(q.grad) - grads[0]).astype(cupy.float32))
                / cupy.linalg.norm(grads[0].astype(cupy.float32)))
    assert err < 2e-3
    for t, g in ((bias, grads[3]), (table, grads[4]["table"])):
        err = float(cupy.linalg.norm(cupy.from_dlpack(t.grad) - g) / cupy.linalg.norm(g))
        assert err < 1e-5   # float32 atomics in any order


def test_varlen_fake_shapes_and_gradients_on_meta():
    """The varlen ops' fake shapes, and the autograd formula's gradients for q, k, v, the bias, the sinks and a
    modifier's table, in the forward op's input order."""
    total_q, total_k, hq, hkv, d, batch = 21, 30, 4, 2, 64, 3
    q, k, v = (_meta((n, h, d), grad=True) for n, h in ((total_q, hq), (total_k, hkv), (total_k, hkv)))
    cu_q, cu_k = _meta((batch + 1,), torch.int32), _meta((batch + 1,), torch.int32)
    bias = _meta((batch, hq, 11, 12), torch.float32, grad=True)
    sinks = _meta((hq,), torch.float32, grad=True)
    table = _meta((hq * 64,), torch.float32, grad=True)
    score = ScoreMod("return score + table[h * 64 + min(abs(q_idx - kv_idx), 63)];", grad="return 1.f;",
                     tensors={"table": table},
                     tensor_grads={"table": "atomicAdd(&d_table[h * 64 + min(abs(q_idx - kv_idx), 63)], dscore);"})
    key, tensors = tp.register(score, None)
    out, lse = torch.ops.cuflash.attention_varlen_forward_prog(q, k, v, cu_q, cu_k, 11, 12, None, None, bias, None,
                                                               None, tensors, 0.125, True, -1, -1, 0, 0.0, None,
                                                               sinks, 0.0, 128, 128, key, False)
    assert out.shape == q.shape and lse.shape == (hq, total_q) and lse.dtype == torch.float32
    grads = torch.autograd.grad(out, (q, k, v, bias, sinks, table), torch.empty_like(out))
    assert [g.shape for g in grads] == [x.shape for x in (q, k, v, bias, sinks, table)]


@requires_gpu
def test_attention_varlen_matches_cuflash_on_the_gpu():
    """cuflash.torch.attention_varlen (and flash_attn_varlen_func with dropout) against cuflash.forward_varlen /
    backward_varlen on the same inputs: bitwise (the portable pair is deterministic), dbias within float32
    atomics' order."""
    import cupy
    import cuflash

    torch.manual_seed(0)
    lengths = [5, 130, 1, 77]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device="cuda")
    total, hq, hkv, d = sum(lengths), 4, 2, 64
    q = torch.randn(total, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(total, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(total, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(len(lengths), 1, 130, 130, device="cuda", dtype=torch.float32, requires_grad=True)
    out, lse = ct.attention_varlen(q, k, v, cu, cu, 130, 130, causal=True, bias=bias, dropout_p=0.1,
                                   return_lse=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    cq, ck, cv, ccu, cb = (cupy.from_dlpack(x.detach()) for x in (q, k, v, cu, bias))
    lse_c = cupy.from_dlpack(lse.detach())
    assert lse_c.shape == (hq, total)
    # lse is that of the undropped probabilities: the forward without dropout gives the same lse
    _, lse_plain = cuflash.forward_varlen(cq, ck, cv, ccu, ccu, 130, 130, causal=True, bias=cb, return_lse=True)
    assert float(cupy.abs(lse_c - lse_plain).max()) < 1e-4
    assert q.grad is not None and k.grad is not None and v.grad is not None and bias.grad is not None
    assert bool(torch.isfinite(q.grad).all()) and bool(torch.isfinite(bias.grad).all())
    # Without dropout the op equals cuflash bitwise, gradients included.
    for x in (q, k, v, bias):
        x.grad = None
    out2 = ct.attention_varlen(q, k, v, cu, cu, 130, 130, causal=True, bias=bias)
    out2.backward(dout)
    o, lse2 = cuflash.forward_varlen(cq, ck, cv, ccu, ccu, 130, 130, causal=True, bias=cb, return_lse=True)
    grads = cuflash.backward_varlen(cupy.from_dlpack(dout), cq, ck, cv, o, lse2, ccu, ccu, 130, 130, causal=True,
                                    bias=cb)
    assert bool(cupy.all(cupy.from_dlpack(out2.detach()) == o))
    for t, g in zip((q, k, v), grads[:3]):
        assert bool(cupy.all(cupy.from_dlpack(t.grad) == g))
    err = float(cupy.linalg.norm(cupy.from_dlpack(bias.grad) - grads[3]) / cupy.linalg.norm(grads[3]))
    assert err < 1e-5   # float32 atomics in any order
    # flash_attn_varlen_func with dropout goes through the same op
    o3, lse3, none = ct.flash_attn_varlen_func(q, k, v, cu, cu, 130, 130, dropout_p=0.2, causal=True,
                                               return_attn_probs=True)
    assert none is None and o3.shape == q.shape and lse3.shape == (hq, total)
    o3.sum().backward()
