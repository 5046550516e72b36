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
