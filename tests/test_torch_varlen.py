"""cuflash.torch.flash_attn_varlen_func: flash-attn 2.x's varlen signature over the varlen custom ops.

CPU (skipped without torch): the ops' schemas, fake (meta) shapes and the autograd formula on meta tensors,
torch.compile(fullgraph=True) tracing on fake CUDA tensors with the offsets' host check off, and the argument
errors (dropout_p, block_table, the offsets' dtype...). GPU (skipped without a usable GPU or a CUDA torch):
out, lse and the gradients of q, k, v (with and without a gradient on lse) against the float64 NumPy varlen
references, on a packed batch with empty sequences, single tokens, queries without keys and keys without
queries; seqused; torch.compile on the device.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import BWD_TOL, FWD_TOL, assert_close_on_every_row, assert_lse_matches, rel_err_gpu, requires_gpu

torch = pytest.importorskip("torch")
ct = pytest.importorskip("cuflash.torch")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

requires_torch_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs PyTorch with CUDA")

# Sequence lengths of q and of k (one batch): an empty query sequence with keys, single tokens, a prime, a
# long one over several tiles, and queries without keys (out 0, lse -inf, dq 0).
LENGTHS_Q = [0, 1, 13, 131, 64]
LENGTHS_K = [3, 1, 17, 131, 0]
HQ, HKV, D = 4, 2, 64


def test_op_schemas():
    assert str(torch.ops.cuflash.attention_forward_varlen.default._schema) == (
        "cuflash::attention_forward_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
        "SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor? seqused_q, Tensor? seqused_k, float softmax_scale, "
        "bool causal, SymInt window_left, SymInt window_right, SymInt attention_chunk, float softcap, "
        "Tensor? alibi_slopes, bool deterministic, bool? check_offsets) -> (Tensor, Tensor)")
    assert str(torch.ops.cuflash.attention_backward_varlen.default._schema) == (
        "cuflash::attention_backward_varlen(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor? dlse, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, "
        "Tensor? seqused_q, Tensor? seqused_k, float softmax_scale, bool causal, SymInt window_left, "
        "SymInt window_right, SymInt attention_chunk, float softcap, Tensor? alibi_slopes, bool deterministic) "
        "-> (Tensor, Tensor, Tensor)")


def _meta(shape, dtype, requires_grad=False):
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=requires_grad)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_fake_shapes_and_autograd_on_meta(dtype):
    tq, tk = sum(LENGTHS_Q), sum(LENGTHS_K)
    q = _meta((tq, HQ, D), dtype, True)
    k, v = _meta((tk, HKV, D), dtype, True), _meta((tk, HKV, D), dtype, True)
    cu = _meta((len(LENGTHS_Q) + 1,), torch.int32)
    out, lse = torch.ops.cuflash.attention_forward_varlen(q, k, v, cu, cu, 131, 131, None, None, 0.125, True, -1, -1,
                                                          0, 0.0, None, False, None)
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    assert lse.shape == (HQ, tq) and lse.dtype == torch.float32
    assert out.requires_grad and lse.requires_grad
    grads = torch.autograd.grad((out, lse), (q, k, v), (torch.empty_like(out), torch.empty_like(lse)))
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype and g.device.type == "meta"


def _fake_inputs(dtype=torch.bfloat16, lengths_q=LENGTHS_Q, lengths_k=LENGTHS_K):
    """Fake CUDA tensors (metadata only; they exist on a machine without CUDA): q, k, v, cu_q, cu_k."""
    mode = FakeTensorMode()
    with mode:
        q = torch.empty((sum(lengths_q), HQ, D), dtype=dtype, device="cuda")
        k = torch.empty((sum(lengths_k), HKV, D), dtype=dtype, device="cuda")
        v = torch.empty((sum(lengths_k), HKV, D), dtype=dtype, device="cuda")
        cu_q = torch.empty((len(lengths_q) + 1,), dtype=torch.int32, device="cuda")
        cu_k = torch.empty((len(lengths_k) + 1,), dtype=torch.int32, device="cuda")
    return mode, (q, k, v, cu_q, cu_k)


def test_on_fake_cuda_tensors_and_return_attn_probs():
    mode, (q, k, v, cu_q, cu_k) = _fake_inputs()
    with mode:
        out = ct.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 131, 131, causal=True)
        out2, lse, probs = ct.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 131, 131, softmax_scale=0.3,
                                                     return_attn_probs=True)
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and out.device.type == "cuda"
    assert out2.shape == q.shape and lse.shape == (HQ, q.shape[0]) and lse.dtype == torch.float32
    assert probs is None


def test_eager_calls_check_the_offsets(monkeypatch):
    """Outside torch.compile the op gets check_offsets=None (cuflash.forward_varlen checks them unless capturing)."""
    seen = []
    real = ct.attention_forward_varlen

    def spy(*args):
        seen.append(args)
        return real(*args)

    monkeypatch.setattr(ct, "attention_forward_varlen", spy)
    mode, (q, k, v, cu_q, cu_k) = _fake_inputs()
    with mode:
        ct.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 131, 131, window_size=(None, 0), deterministic=True)
    (args,) = seen
    assert args[5:7] == (131, 131) and args[9:] == (0.125, False, -1, 0, 0, 0.0, None, True, None)


def test_compile_fullgraph_traces_one_op_without_offset_checks():
    """torch.compile(fullgraph=True): one cuflash::attention_forward_varlen node, no graph break, and
    check_offsets=False (no device-to-host copy in a compiled graph)."""
    import torch._dynamo

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    _, (q, k, v, cu_q, cu_k) = _fake_inputs(torch.float16)
    torch._dynamo.reset()
    try:
        f = torch.compile(lambda q, k, v, cu_q, cu_k: ct.flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, 131, 131, causal=True, return_attn_probs=True), fullgraph=True, backend=record)
        out, lse, probs = f(q, k, v, cu_q, cu_k)
    finally:
        torch._dynamo.reset()
    assert out.shape == q.shape and lse.shape == (HQ, q.shape[0]) and probs is None
    (gm,) = graphs
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function" and "cuflash" in str(n.target)]
    assert ops == [torch.ops.cuflash.attention_forward_varlen.default]
    (node,) = [n for n in gm.graph.nodes if n.target == torch.ops.cuflash.attention_forward_varlen.default]
    assert node.args[5:7] == (131, 131)
    assert node.args[9:] == (0.125, True, -1, -1, 0, 0.0, None, False, False)


def test_compile_joint_graph_holds_the_backward_op():
    """AOTAutograd traces the registered autograd formula: attention_backward_varlen in the backward graph."""
    import torch._dynamo
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    graphs = {"fw": [], "bw": []}

    def recorder(kind):
        def compile_fn(gm, example_inputs):
            graphs[kind].append(gm)
            return make_boxed_func(gm.forward)
        return compile_fn

    def loss(q, k, v, cu_q, cu_k):
        out, lse = torch.ops.cuflash.attention_forward_varlen(q, k, v, cu_q, cu_k, 131, 131, None, None, 0.125, True,
                                                              -1, -1, 0, 0.0, None, False, False)
        return (out.float() ** 2).sum() + lse.sum()

    tq, tk = sum(LENGTHS_Q), sum(LENGTHS_K)
    q = _meta((tq, HQ, D), torch.float16, True)
    k, v = _meta((tk, HKV, D), torch.float16, True), _meta((tk, HKV, D), torch.float16, True)
    cu = _meta((len(LENGTHS_Q) + 1,), torch.int32)
    torch._dynamo.reset()
    try:
        backend = aot_autograd(fw_compiler=recorder("fw"), bw_compiler=recorder("bw"))
        torch.compile(loss, fullgraph=True, backend=backend)(q, k, v, cu, cu).backward()
    finally:
        torch._dynamo.reset()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape

    def cuflash_ops(gm):
        return [n.target for n in gm.graph.nodes if n.op == "call_function" and "cuflash" in str(n.target)]

    assert cuflash_ops(graphs["fw"][0]) == [torch.ops.cuflash.attention_forward_varlen.default]
    assert cuflash_ops(graphs["bw"][0]) == [torch.ops.cuflash.attention_backward_varlen.default]


# ---- argument errors (metadata only) ----

def _errors():
    mode, (q, k, v, cu_q, cu_k) = _fake_inputs(torch.float16)
    with mode:
        cu64 = torch.empty((len(LENGTHS_Q) + 1,), dtype=torch.int64, device="cuda")
        cu_short = torch.empty((len(LENGTHS_Q),), dtype=torch.int32, device="cuda")
        q4 = torch.empty((1, q.shape[0], HQ, D), dtype=torch.float16, device="cuda")
        used = torch.empty((len(LENGTHS_Q) + 1,), dtype=torch.int32, device="cuda")
        table = torch.empty((len(LENGTHS_Q), 4), dtype=torch.int32, device="cuda")
    base = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=131, max_seqlen_k=131)
    return [
        (dict(dropout_p=1.5), ValueError, r"dropout_p must be a float in \[0, 1\)"),
        (dict(block_table=table), ValueError, "block_table must be None: .*paged KV"),
        (dict(cu_seqlens_q=cu64), TypeError, r"cu_seqlens_q must be int32, got torch.int64"),
        (dict(cu_seqlens_k=cu_short), ValueError, "cu_seqlens_k must have the length of cu_seqlens_q"),
        (dict(cu_seqlens_k=np.zeros(6, np.int32)), TypeError, "cu_seqlens_k must be a torch.Tensor"),
        (dict(seqused_k=used), ValueError, r"seqused_k must have shape \(batch,\)"),
        (dict(q=q4), ValueError, r"q must have 3 dimensions \(total, heads, head_dim\)"),
        (dict(max_seqlen_q=131.0), TypeError, "max_seqlen_q must be a Python int"),
        (dict(max_seqlen_k=-1), ValueError, "max_seqlen_k must be >= 0"),
        (dict(return_attn_probs=1), TypeError, "return_attn_probs must be a bool"),
        (dict(causal="yes"), TypeError, "causal must be a bool"),
    ], base, mode


@pytest.mark.parametrize("case", range(11))
def test_argument_errors(case):
    cases, base, mode = _errors()
    kwargs, exc, match = cases[case]
    with mode, pytest.raises(exc, match=match):
        ct.flash_attn_varlen_func(**{**base, **kwargs})


def test_cpu_tensors_are_refused_with_a_hint():
    q = torch.zeros(4, 2, 64, dtype=torch.float16)
    cu = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(TypeError, match=r"q must be on a CUDA device, got a tensor on cpu; move it with q\.cuda\(\)"):
        ct.flash_attn_varlen_func(q, q, q, cu, cu, 4, 4)


# ---- GPU: against the float64 NumPy references ----

def _offsets(lengths):
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device="cuda")


def _packed(dtype, lengths_q, lengths_k, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = getattr(torch, dtype)
    tq, tk = sum(lengths_q), sum(lengths_k)
    shapes = ((tq, HQ, D), (tk, HKV, D), (tk, HKV, D), (tq, HQ, D))
    q, k, v, dout = (torch.randn(s, device="cuda", dtype=dt, generator=g) for s in shapes)
    return q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True), dout


def _host64(x):
    return x.detach().double().cpu().numpy()


def _cp(x):
    """A torch CUDA tensor as a float64 CuPy array (conftest's GPU error measures take CuPy)."""
    import cupy

    return cupy.from_dlpack(x.detach().double().contiguous())


def _unseen(lengths_q, lengths_k, used_q, used_k, causal):
    """Masks (NumPy bool) of the packed query rows that see no key and of the key rows that no query sees
    (causal aligned bottom-right on the used rows, as the reference): their out and gradients are 0 exactly."""
    q_rows, k_rows = [], []
    for lq, lk, uq, uk in zip(lengths_q, lengths_k, used_q, used_k):
        i, j = np.arange(lq)[:, None], np.arange(lk)[None, :]
        sees = (i < uq) & (j < uk)
        if causal:
            sees &= j <= i + uk - uq
        q_rows.append(~sees.any(axis=1))
        k_rows.append(~sees.any(axis=0))
    return np.concatenate(q_rows), np.concatenate(k_rows)


def _check_against_reference(dtype, causal, lengths_q, lengths_k, *, lse_grad, seqused=None):
    import cupy
    from cuflash.reference import attention_reference_varlen, attention_reference_varlen_backward

    q, k, v, dout = _packed(dtype, lengths_q, lengths_k)
    cu_q, cu_k = _offsets(lengths_q), _offsets(lengths_k)
    used = {} if seqused is None else {name: torch.tensor(u, dtype=torch.int32, device="cuda")
                                       for name, u in zip(("seqused_q", "seqused_k"), seqused)}
    out, lse, probs = ct.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                                                return_attn_probs=True, **used)
    assert probs is None and out.dtype == q.dtype and out.shape == q.shape
    assert lse.shape == (HQ, q.shape[0]) and lse.dtype == torch.float32 and lse.requires_grad
    dlse = None
    if lse_grad:   # the rows that see no key have lse -inf: no gradient reaches them through the where
        g = torch.Generator(device="cuda").manual_seed(1)
        dlse = torch.randn(lse.shape, device="cuda", generator=g) * torch.isfinite(lse.detach())
        torch.autograd.backward([out, torch.where(torch.isfinite(lse), lse, 0.0)], [dout, dlse])
    else:
        out.backward(dout)

    host_used = {name: x.cpu().numpy() for name, x in used.items()}
    cu_host = (cu_q.cpu().numpy(), cu_k.cpu().numpy())
    ref_out, ref_lse = attention_reference_varlen(_host64(q), _host64(k), _host64(v), *cu_host, causal=causal,
                                                  **host_used)
    refs = attention_reference_varlen_backward(_host64(dout), _host64(q), _host64(k), _host64(v), *cu_host,
                                               causal=causal, dlse=None if dlse is None else _host64(dlse),
                                               **host_used)
    assert_close_on_every_row("out", _cp(out), cupy.asarray(ref_out), dtype, FWD_TOL)
    assert_lse_matches(lse.detach(), ref_lse, (HQ, q.shape[0]))
    unseen_q, unseen_k = _unseen(lengths_q, lengths_k, *(seqused or (lengths_q, lengths_k)), causal)
    unseen_q, unseen_k = torch.from_numpy(unseen_q).cuda(), torch.from_numpy(unseen_k).cuda()
    assert torch.all(out[unseen_q] == 0)
    # Whole-array norms for the gradients (not per row: a query that sees a single key has dq ~0, its row
    # rounding noise against 0), and 0 exactly on the rows that take part in no score.
    for name, x, ref, unseen in zip(("dq", "dk", "dv"), (q, k, v), refs, (unseen_q, unseen_k, unseen_k)):
        assert x.grad.dtype == x.dtype and x.grad.shape == x.shape
        err = rel_err_gpu(_cp(x.grad), cupy.asarray(ref))
        assert err <= BWD_TOL[dtype], f"{name} rel err {err:.3e} > {BWD_TOL[dtype]:.1e}"
        assert torch.all(x.grad[unseen] == 0), f"{name}: nonzero gradient on rows that take part in no score"
    return out, lse


@requires_torch_cuda
@requires_gpu
@pytest.mark.parametrize("lse_grad", [False, True], ids=["dout", "dout_dlse"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_against_reference(dtype, causal, lse_grad):
    _check_against_reference(dtype, causal, LENGTHS_Q, LENGTHS_K, lse_grad=lse_grad)


@requires_torch_cuda
@requires_gpu
@pytest.mark.parametrize("causal", [False, True])
def test_seqused(causal):
    """seqused_q / seqused_k shorter than the packed lengths (and, causal, a sequence of more used queries
    than keys): out 0 and zero gradients on the rows past them."""
    _check_against_reference("bfloat16", causal, [40, 7, 130, 5], [50, 9, 140, 1], lse_grad=True,
                             seqused=([33, 0, 130, 2], [50, 4, 77, 0]))


@requires_torch_cuda
@requires_gpu
def test_deterministic_backward_is_bitwise_repeatable():
    grads = []
    for _ in range(2):
        q, k, v, dout = _packed("float16", LENGTHS_Q, LENGTHS_K)
        out = ct.flash_attn_varlen_func(q, k, v, _offsets(LENGTHS_Q), _offsets(LENGTHS_K), 131, 131, causal=True,
                                        deterministic=True)
        out.backward(dout)
        grads.append([x.grad for x in (q, k, v)])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@requires_torch_cuda
@requires_gpu
def test_compile_on_gpu():
    """torch.compile(fullgraph=True, aot_eager) of a step around flash_attn_varlen_func (offsets unchecked):
    the values and gradients of the eager calls."""
    import torch._dynamo

    cu_q, cu_k = _offsets(LENGTHS_Q), _offsets(LENGTHS_K)

    def loss(q, k, v, cu_q, cu_k):
        out = ct.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 131, 131, causal=True, deterministic=True)
        return (out.float() ** 2).mean()

    inputs = _packed("bfloat16", LENGTHS_Q, LENGTHS_K)[:3]
    eager = loss(*inputs, cu_q, cu_k)
    eager_grads = torch.autograd.grad(eager, inputs)
    torch._dynamo.reset()
    try:
        got = torch.compile(loss, fullgraph=True, backend="aot_eager")(*inputs, cu_q, cu_k)
        got_grads = torch.autograd.grad(got, inputs)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got, eager, rtol=1e-3, atol=1e-6)
    for g, e in zip(got_grads, eager_grads):
        torch.testing.assert_close(g, e, rtol=2e-2, atol=1e-4)


def test_value_head_dim_fake_shapes_on_meta():
    """A head dim of v's own: the ops' outputs take it (dense and packed), the gradients keep each input's shape."""
    q, k, v = _meta((2, 9, HQ, 192), torch.bfloat16, True), _meta((2, 11, HKV, 192), torch.bfloat16, True), \
        _meta((2, 11, HKV, 128), torch.bfloat16, True)
    out, lse = torch.ops.cuflash.attention_forward(q, k, v, 0.1, True, -1, -1, 0, 0.0, None, None, False)
    assert out.shape == (2, 9, HQ, 128) and lse.shape == (2, HQ, 9)
    grads = torch.autograd.grad(out, (q, k, v), torch.empty_like(out))
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    cu = _meta((3,), torch.int32)
    out, lse = torch.ops.cuflash.attention_forward_varlen(q[0], k[0], v[0], cu, cu, 9, 11, None, None, 0.1, False, -1,
                                                          -1, 0, 0.0, None, False, None)
    assert out.shape == (9, HQ, 128) and lse.shape == (HQ, 9)


@requires_torch_cuda
@requires_gpu
@pytest.mark.parametrize("dqk,dv", [(192, 128), (64, 128)])
def test_value_head_dim_against_reference(dqk, dv):
    """flash_attn_func and flash_attn_varlen_func with v's own head dim: out and the gradients against float64."""
    import cupy
    from cuflash.reference import attention_reference_backward, attention_reference_varlen_backward

    gen = torch.Generator(device="cuda").manual_seed(dqk + dv)
    q = torch.randn(2, 67, HQ, dqk, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
    k = torch.randn(2, 93, HKV, dqk, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
    v = torch.randn(2, 93, HKV, dv, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
    out = ct.flash_attn_func(q, k, v, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref = attention_reference_backward(*(cupy.asarray(x.detach().float()) for x in (dout, q, k, v)), causal=True)
    for g, r in zip((q.grad, k.grad, v.grad), ref):
        assert rel_err_gpu(cupy.asarray(g.float()), cupy.asarray(r)) <= BWD_TOL["bfloat16"]
    cu = torch.tensor([0, 67, 134], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 93, 186], dtype=torch.int32, device="cuda")
    qp, kp, vp = (x.detach().reshape(-1, *x.shape[2:]).requires_grad_() for x in (q, k, v))
    outp = ct.flash_attn_varlen_func(qp, kp, vp, cu, cu_k, 67, 93, causal=True)
    outp.backward(dout.reshape(outp.shape))
    refp = attention_reference_varlen_backward(*(cupy.asarray(x.detach().float()) for x in (dout.reshape(outp.shape),
                                                                                           qp, kp, vp)),
                                               cupy.asarray(cu), cupy.asarray(cu_k), causal=True)
    for g, r in zip((qp.grad, kp.grad, vp.grad), refp):
        assert rel_err_gpu(cupy.asarray(g.float()), cupy.asarray(r)) <= BWD_TOL["bfloat16"]
