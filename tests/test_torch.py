"""cuflash.torch: flash_attn_func as torch.library custom ops.

CPU: `import cuflash` does not import torch; the ops' schemas, fake (meta) shapes and dtypes, the
autograd formula on meta tensors, torch.compile(fullgraph=True) tracing on fake CUDA tensors, and the
argument errors. GPU: values, lse and gradients against float64 SDPA, outputs written in place,
torch.compile on the device, CUDA graph capture of forward and backward, torch.library.opcheck.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import BWD_TOL, FWD_TOL, GPU_SKIP_REASON, assert_lse_matches

torch = pytest.importorskip("torch")
ct = pytest.importorskip("cuflash.torch")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402


def test_op_schemas():
    assert str(torch.ops.cuflash.attention_forward.default._schema) == (
        "cuflash::attention_forward(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, "
        "SymInt window_left, SymInt window_right, SymInt attention_chunk, float softcap, Tensor? alibi_slopes, "
        "Tensor? sinks, bool deterministic) -> (Tensor, Tensor)")
    assert str(torch.ops.cuflash.attention_backward.default._schema) == (
        "cuflash::attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor? dlse, float softmax_scale, bool causal, SymInt window_left, SymInt window_right, "
        "SymInt attention_chunk, float softcap, Tensor? alibi_slopes, Tensor? sinks, bool deterministic) "
        "-> (Tensor, Tensor, Tensor, Tensor)")


SHAPES = [  # (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim)
    (2, 5, 7, 4, 2, 64),
    (1, 1, 1, 1, 1, 8),
    (3, 33, 17, 6, 1, 256),
]


def _meta(shape, dtype, requires_grad=False):
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=requires_grad)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b,nq,nk,hq,hkv,d", SHAPES)
def test_fake_shapes_and_autograd_on_meta(dtype, b, nq, nk, hq, hkv, d):
    q = _meta((b, nq, hq, d), dtype, True)
    k, v = _meta((b, nk, hkv, d), dtype, True), _meta((b, nk, hkv, d), dtype, True)
    out, lse = torch.ops.cuflash.attention_forward(q, k, v, 0.5, True, -1, -1, 0, 0.0, None, None, False)
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    assert lse.shape == (b, hq, nq) and lse.dtype == torch.float32
    assert out.requires_grad and lse.requires_grad   # lse is differentiable (FA4's test_flash_attn_lse_grad)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.empty_like(out))
    for g, x in ((dq, q), (dk, k), (dv, v)):
        assert g.shape == x.shape and g.dtype == x.dtype and g.device.type == "meta"


def test_backward_fake_shapes():
    q, k = _meta((2, 9, 4, 128), torch.bfloat16), _meta((2, 3, 2, 128), torch.bfloat16)
    lse = _meta((2, 4, 9), torch.float32)
    dq, dk, dv, dsinks = torch.ops.cuflash.attention_backward(q, q, k, k, q, lse, None, 0.1, False, -1, -1, 0, 0.0,
                                                              None, None, True)
    assert (dq.shape, dk.shape, dv.shape, dsinks.shape) == (q.shape, k.shape, k.shape, (0,))
    assert dq.dtype == dk.dtype == dv.dtype == torch.bfloat16


def _fake_cuda(*shapes, dtype=torch.float16):
    """Fake CUDA tensors (metadata only): they exist on a machine without CUDA. Never with
    requires_grad on a CPU-only torch: its autograd engine aborts the process on a CUDA device."""
    mode = FakeTensorMode()
    with mode:
        return mode, [torch.empty(s, dtype=dtype, device="cuda") for s in shapes]


def test_flash_attn_func_on_fake_cuda_tensors():
    mode, (q, k, v) = _fake_cuda((2, 5, 4, 64), (2, 7, 2, 64), (2, 7, 2, 64), dtype=torch.bfloat16)
    with mode:
        out = ct.flash_attn_func(q, k, v, causal=True)
        out2, lse = ct.flash_attn_func(q, k, v, softmax_scale=0.3, return_lse=True)
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and out.device.type == "cuda"
    assert out2.shape == q.shape and lse.shape == (2, 4, 5) and lse.dtype == torch.float32


def test_compile_fullgraph_traces_one_op():
    """torch.compile(fullgraph=True) over flash_attn_func: one cuflash::attention_forward node, the
    checks and the default scale resolved at trace time, no graph break (fullgraph raises on one)."""
    import torch._dynamo

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    _, (q, k, v) = _fake_cuda((2, 5, 4, 64), (2, 7, 2, 64), (2, 7, 2, 64))
    torch._dynamo.reset()
    try:
        f = torch.compile(lambda q, k, v: ct.flash_attn_func(q, k, v, causal=True, return_lse=True),
                          fullgraph=True, backend=record)
        out, lse = f(q, k, v)
    finally:
        torch._dynamo.reset()
    assert out.shape == q.shape and lse.shape == (2, 4, 5)
    (gm,) = graphs
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function" and "cuflash" in str(n.target)]
    assert ops == [torch.ops.cuflash.attention_forward.default]
    (node,) = [n for n in gm.graph.nodes if n.target == torch.ops.cuflash.attention_forward.default]
    assert node.args[3:] == (0.125, True, -1, -1, 0, 0.0, None, None, False)


def test_compile_joint_graph_holds_the_backward_op():
    """AOTAutograd (what torch.compile's default backend runs) traces the registered autograd formula:
    the forward graph holds attention_forward, the backward graph attention_backward (meta tensors,
    which the CPU-only autograd engine takes)."""
    import torch._dynamo
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    graphs = {"fw": [], "bw": []}

    def recorder(kind):
        def compile_fn(gm, example_inputs):
            graphs[kind].append(gm)
            return make_boxed_func(gm.forward)
        return compile_fn

    def loss(q, k, v):
        out, _ = torch.ops.cuflash.attention_forward(q, k, v, 0.125, True, -1, -1, 0, 0.0, None, None, False)
        return (out.float() ** 2).sum()

    q = _meta((2, 5, 4, 64), torch.float16, True)
    k, v = _meta((2, 7, 2, 64), torch.float16, True), _meta((2, 7, 2, 64), torch.float16, True)
    torch._dynamo.reset()
    try:
        backend = aot_autograd(fw_compiler=recorder("fw"), bw_compiler=recorder("bw"))
        torch.compile(loss, fullgraph=True, backend=backend)(q, k, v).backward()
    finally:
        torch._dynamo.reset()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape

    def cuflash_ops(gm):
        return [n.target for n in gm.graph.nodes if n.op == "call_function" and "cuflash" in str(n.target)]

    assert cuflash_ops(graphs["fw"][0]) == [torch.ops.cuflash.attention_forward.default]
    assert cuflash_ops(graphs["bw"][0]) == [torch.ops.cuflash.attention_backward.default]


# ---- argument errors (metadata only) ----

def test_cpu_tensors_are_refused_with_a_hint():
    q = torch.zeros(1, 4, 2, 64, dtype=torch.float16)
    with pytest.raises(TypeError, match=r"q must be on a CUDA device, got a tensor on cpu; move it with q\.cuda\(\)"):
        ct.flash_attn_func(q, q, q)


def test_cpu_tensors_reaching_the_op_are_refused():
    """Called directly (not through flash_attn_func), the op's CuPy conversion refuses them."""
    q = torch.zeros(1, 4, 2, 64, dtype=torch.float16)
    with pytest.raises(TypeError, match=r"q must be a cupy.ndarray or a CUDA array.*q\.cuda\(\)"):
        torch.ops.cuflash.attention_forward(q, q, q, 0.125, False, -1, -1, 0, 0.0, None, None, False)


def test_non_tensors_are_refused():
    with pytest.raises(TypeError, match=r"q must be a torch.Tensor, got numpy.ndarray"):
        ct.flash_attn_func(np.zeros((1, 4, 2, 64), np.float16), None, None)


def _errors():
    mode = FakeTensorMode()
    with mode:
        def fake(shape, dtype=torch.float16):
            return torch.empty(shape, dtype=dtype, device="cuda")

        q, k = fake((1, 4, 2, 64)), fake((1, 6, 1, 64))
        q3, q60, k3h = fake((1, 4, 64)), fake((1, 4, 2, 60)), fake((1, 6, 3, 64))
        q64, k32 = fake((1, 4, 2, 64), torch.float64), fake((1, 6, 1, 64), torch.float32)
    return [
        (dict(q=q64, k=q64, v=q64), TypeError, "q must be float16, bfloat16 or float32, got torch.float64"),
        (dict(q=q, k=k32, v=k32), TypeError, r"k must have the dtype of q \(torch.float16\)"),
        (dict(q=q3, k=k, v=k), ValueError, "q must have 4 dimensions"),
        (dict(q=q60, k=q60, v=q60), ValueError, "head_dim must be a multiple of 8"),
        (dict(q=q, k=k3h, v=k3h), ValueError, "multiple of heads_kv"),
        (dict(q=q, k=k, v=q), ValueError, "k and v must have the same shape"),
        (dict(q=q, k=k, v=k, dropout_p=1.0), ValueError, r"dropout_p must be a float in \[0, 1\)"),
        (dict(q=q, k=k, v=k, causal="yes"), TypeError, "causal must be a bool"),
        (dict(q=q, k=k, v=k, deterministic=1), TypeError, "deterministic must be a bool"),
        (dict(q=q, k=k, v=k, return_lse=None), TypeError, "return_lse must be a bool"),
        (dict(q=q, k=k, v=k, softmax_scale=-1.0), ValueError, "softmax_scale"),
        (dict(q=q, k=k, v=k, softmax_scale="0.1"), TypeError, "softmax_scale"),
    ]


@pytest.mark.parametrize("case", range(12))
def test_argument_errors(case):
    kwargs, exc, match = _errors()[case]
    with pytest.raises(exc, match=match):
        ct.flash_attn_func(**kwargs)


def test_inputs_on_different_devices():
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("fake cuda:1 tensors need a second GPU where CUDA is real")   # torch checks the ordinal
    mode = FakeTensorMode()
    with mode:
        q = torch.empty((1, 4, 2, 64), dtype=torch.float16, device="cuda:0")
        k = torch.empty((1, 4, 2, 64), dtype=torch.float16, device="cuda:1")
    with pytest.raises(ValueError, match="k is on cuda:1 but q is on cuda:0"):
        ct.flash_attn_func(q, k, q)


# ---- GPU ----

def _need_cuda():
    if GPU_SKIP_REASON is not None:
        pytest.skip(f"needs an NVIDIA GPU: {GPU_SKIP_REASON}")
    if not torch.cuda.is_available():
        pytest.skip("needs PyTorch with CUDA")


def _inputs(dtype, b, nq, nk, hq, hkv, d, seed=0, requires_grad=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = getattr(torch, dtype)
    shapes = ((b, nq, hq, d), (b, nk, hkv, d), (b, nk, hkv, d), (b, nq, hq, d))
    q, k, v, dout = (torch.randn(s, device="cuda", dtype=dt, generator=g) for s in shapes)
    return q.requires_grad_(requires_grad), k.requires_grad_(requires_grad), v.requires_grad_(requires_grad), dout


def _sdpa_float64(q, k, v, dout, causal, scale):
    """out, lse, (dq, dk, dv) in float64 on the GPU: SDPA over the inputs' exact values, K/V heads repeated
    for GQA (so their gradients sum over the query heads that share them), causal bottom-right aligned."""
    import torch.nn.functional as F

    _, nq, hq, _ = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    q64, k64, v64 = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    kr, vr = (x.repeat_interleave(hq // hkv, dim=2) for x in (k64, v64))
    mask = None
    if causal:
        rows = torch.arange(nq, device="cuda")[:, None]
        mask = torch.arange(nk, device="cuda")[None, :] <= rows + (nk - nq)
    out = F.scaled_dot_product_attention(q64.transpose(1, 2), kr.transpose(1, 2), vr.transpose(1, 2),
                                         attn_mask=mask, scale=scale).transpose(1, 2)
    grads = torch.autograd.grad(out, (q64, k64, v64), dout.double())
    scores = torch.einsum("bqhd,bkhd->bhqk", q64.detach(), kr.detach()) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return out.detach(), torch.logsumexp(scores, dim=-1), grads


def _rel_err(x, ref, floor: float = 0.0) -> float:
    """||x - ref|| / max(||ref||, floor), inf where x is not finite. The floor (a tenth of the largest
    gradient's norm, as tests/test_bwd.py takes it) keeps the measure meaningful where the exact
    gradient is ~0: dq and dk of a query that sees a single key are rounding noise against 0."""
    x = x.double()
    if not torch.isfinite(x).all():
        return float("inf")
    return float((x - ref).norm() / max(float(ref.norm()), floor, 1e-300))


def _grad_floor(ref_grads) -> float:
    return 0.1 * max(float(r.norm()) for r in ref_grads)


# Every query row sees a key (causal needs seqlen_q <= seqlen_k, else SDPA gives NaN rows; that case is
# below). Head dims 64 and 128 only: the kernels of every head dim are tested through CuPy (test_fwd.py,
# test_bwd.py), and each one more here is more compiles on a cold kernel cache.
GPU_CASES = [
    (2, 128, 128, 4, 4, 64),
    (1, 1, 1, 2, 2, 64),
    (2, 77, 133, 6, 2, 128),    # GQA, odd lengths, Nq < Nk
    (1, 1, 257, 8, 1, 128),     # MQA, one query
    (2, 191, 191, 2, 1, 64),
]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("b,nq,nk,hq,hkv,d", GPU_CASES)
def test_against_sdpa_float64(dtype, causal, b, nq, nk, hq, hkv, d):
    _need_cuda()
    q, k, v, dout = _inputs(dtype, b, nq, nk, hq, hkv, d)
    out, lse = ct.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    out.backward(dout)
    scale = d ** -0.5
    ref_out, ref_lse, ref_grads = _sdpa_float64(q, k, v, dout, causal, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert _rel_err(out, ref_out) <= FWD_TOL[dtype]
    assert_lse_matches(lse, ref_lse, (b, hq, nq))
    floor = _grad_floor(ref_grads)
    for name, x, ref in zip(("dq", "dk", "dv"), (q, k, v), ref_grads):
        assert x.grad.dtype == x.dtype and x.grad.shape == x.shape
        err = _rel_err(x.grad, ref, floor)
        assert err <= BWD_TOL[dtype], f"{name} rel err {err:.3e}"


@pytest.mark.parametrize("causal", [False, True])
def test_seqlen_q_above_seqlen_k_and_views(causal):
    """Nq > Nk (causal: the first Nq - Nk rows see no key: output and dq 0), inputs as views into packed
    buffers (read in place), and the stride-0 gradient that out.sum() hands the backward."""
    _need_cuda()
    nq, nk = 133, 77
    g = torch.Generator(device="cuda").manual_seed(1)
    packed_q = torch.randn(2, nq, 3, 4, 64, device="cuda", dtype=torch.float16, generator=g)
    packed_kv = torch.randn(2, nk, 2, 4, 64, device="cuda", dtype=torch.float16, generator=g)
    views = (packed_q[:, :, 0], packed_kv[:, :, 0], packed_kv[:, :, 1])
    q, k, v = (x.clone().requires_grad_(True) for x in views)
    out = ct.flash_attn_func(q, k, v, causal=causal)
    assert torch.equal(ct.flash_attn_func(*views, causal=causal), out)
    out.sum().backward()
    ones = torch.ones_like(out)
    first = nq - nk if causal else 0   # causal: row first + i sees keys j <= i, the square problem's rows
    if causal:
        assert torch.all(out[:, :first] == 0) and torch.all(q.grad[:, :first] == 0)
    ref_out, _, ref_grads = _sdpa_float64(q[:, first:], k, v, ones[:, first:], causal, 64 ** -0.5)
    assert _rel_err(out[:, first:], ref_out) <= FWD_TOL["float16"]
    floor = _grad_floor(ref_grads)
    for x, ref in zip((q.grad[:, first:], k.grad, v.grad), ref_grads):
        assert _rel_err(x, ref, floor) <= BWD_TOL["float16"]


def test_outputs_are_written_in_place(monkeypatch):
    """Zero-copy: the kernels read the torch inputs and write the torch-allocated outputs at their own
    addresses (the CuPy views cuflash receives have the torch tensors' pointers)."""
    import cupy

    from cuflash import api

    _need_cuda()
    seen = {"forward": [], "backward": []}
    for name in seen:
        real = getattr(api, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            result = _real(*args, **kwargs)
            seen[_name].append((kwargs, result))
            return result

        monkeypatch.setattr(api, name, spy)
    q, k, v, dout = _inputs("bfloat16", 2, 64, 80, 4, 2, 64)
    out, lse = ct.flash_attn_func(q, k, v, return_lse=True)
    out.backward(dout)
    # The ops call api.* on torch tensors (out / dq, dk, dv given by keyword); interop.call calls them
    # again on the CuPy views, all by keyword.
    fwd = next(kw for kw, _ in seen["forward"] if isinstance(kw.get("q"), cupy.ndarray))
    assert [fwd[n].data.ptr for n in ("q", "k", "v", "out")] == [x.data_ptr() for x in (q, k, v, out)]
    bwd = next(kw for kw, _ in seen["backward"] if isinstance(kw.get("q"), cupy.ndarray))
    assert [bwd[n].data.ptr for n in ("dout", "lse")] == [dout.data_ptr(), lse.data_ptr()]
    grads = next(result for kw, result in seen["backward"] if isinstance(kw.get("dq"), torch.Tensor))
    assert [bwd[n].data.ptr for n in ("dq", "dk", "dv")] == [x.data_ptr() for x in grads]


def test_deterministic_backward_is_bitwise_repeatable():
    _need_cuda()
    grads = []
    for _ in range(2):
        q, k, v, dout = _inputs("float16", 2, 300, 300, 4, 1, 128)
        ct.flash_attn_func(q, k, v, causal=True, deterministic=True).backward(dout)
        grads.append([x.grad for x in (q, k, v)])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_opcheck():
    _need_cuda()
    q, k, v, dout = _inputs("float16", 2, 33, 47, 4, 2, 64)
    # deterministic: opcheck compares runs (eager, AOT) of the forward and of the gradients
    torch.library.opcheck(torch.ops.cuflash.attention_forward.default,
                          (q, k, v, 0.125, True, -1, -1, 0, 0.0, None, None, True))
    out, lse = torch.ops.cuflash.attention_forward(q, k, v, 0.125, True, -1, -1, 0, 0.0, None, None, True)
    args = (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), None, 0.125, True, -1, -1, 0, 0.0,
            None, None, True)
    torch.library.opcheck(torch.ops.cuflash.attention_backward.default, args)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_on_gpu(backend):
    """torch.compile(fullgraph=True) of a step around flash_attn_func: same values and gradients as eager."""
    import torch._dynamo

    _need_cuda()
    if backend == "inductor":
        pytest.importorskip("triton")

    def loss(q, k, v, w):
        out = ct.flash_attn_func(q * w, k, v, causal=True, deterministic=True)
        return (out.float() ** 2).mean()

    inputs = _inputs("bfloat16", 2, 129, 200, 4, 2, 64)[:3]
    w = torch.tensor(0.7, device="cuda", dtype=torch.bfloat16)
    eager = loss(*inputs, w)
    eager_grads = torch.autograd.grad(eager, inputs)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(loss, fullgraph=True, backend=backend)
        got = compiled(*inputs, w)
        got_grads = torch.autograd.grad(got, inputs)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got, eager, rtol=1e-3, atol=1e-6)
    for g, e in zip(got_grads, eager_grads):
        torch.testing.assert_close(g, e, rtol=2e-2, atol=1e-4)


def test_cuda_graph_capture_of_forward_and_backward():
    """Forward and backward captured in one CUDA graph (torch's recipe: warm up on a side stream, then
    capture) and replayed on new inputs: every allocation of the call comes from torch's allocator (the
    graph's pool), nothing from CuPy's pool, and the replay matches eager calls on the same inputs.
    Limits (cuflash/torch.py): kernels compile on the warm-up, not in capture."""
    import cupy

    _need_cuda()
    q, k, v, dout = _inputs("float16", 2, 256, 256, 4, 2, 64)

    def step():
        out = ct.flash_attn_func(q, k, v, causal=True, deterministic=True)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    pool_used = cupy.get_default_memory_pool().used_bytes()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    assert cupy.get_default_memory_pool().used_bytes() == pool_used
    for seed in (5, 6):
        fresh = _inputs("float16", 2, 256, 256, 4, 2, 64, seed=seed, requires_grad=False)
        with torch.no_grad():
            for x, new in zip((q, k, v, dout), fresh):
                x.copy_(new)
        graph.replay()
        expected = step()
        torch.cuda.synchronize()
        for got, want in zip(captured, expected):
            assert torch.equal(got, want)


@pytest.mark.parametrize("kwargs", [dict(causal=True, window_size=(24, 0), learnable_sink=True),
                                    dict(softcap=3.0, alibi_slopes=True),
                                    dict(causal=True, attention_chunk=32, window_size=(None, 0))],
                         ids=["gpt_oss", "softcap_alibi", "chunk"])
def test_variants_and_lse_gradients(kwargs):
    """flash_attn_func with the variants (FA4's names: learnable_sink, window None), differentiable with respect to
    q, k, v, the sinks and lse (FA4's test_flash_attn_lse_grad), against float64."""
    _need_cuda()
    from cuflash.reference import attention_reference_backward, rel_err

    q, k, v, dout = _inputs("bfloat16", 2, 77, 95, 4, 2, 64)
    g = torch.Generator(device="cuda").manual_seed(1)
    kw = dict(kwargs)
    if kw.get("learnable_sink"):
        kw["learnable_sink"] = torch.randn(4, device="cuda", generator=g).requires_grad_(True)
    if kw.get("alibi_slopes"):
        kw["alibi_slopes"] = torch.rand(4, device="cuda", generator=g) * 0.3
    dlse = torch.randn(2, 4, 77, device="cuda", generator=g)
    out, lse = ct.flash_attn_func(q, k, v, return_lse=True, **kw)
    assert lse.requires_grad
    ((out.float() * dout.float()).sum() + (torch.where(torch.isfinite(lse), lse, 0) * dlse).sum()).backward()
    host = {"causal": kw.get("causal", False), "softcap": kw.get("softcap", 0.0),
            "attention_chunk": kw.get("attention_chunk", 0),
            "window_size": tuple(-1 if w is None else w for w in kw.get("window_size", (-1, -1)))}
    if "alibi_slopes" in kw:
        host["alibi_slopes"] = kw["alibi_slopes"].cpu().numpy()
    if "learnable_sink" in kw:
        host["sinks"] = kw["learnable_sink"].detach().cpu().numpy()
    f64 = [x.detach().double().cpu().numpy() for x in (dout, q, k, v)]
    refs = attention_reference_backward(*f64, dlse=dlse.double().cpu().numpy(), **host)
    grads = [q.grad, k.grad, v.grad] + ([kw["learnable_sink"].grad] if "learnable_sink" in kw else [])
    for name, got, ref in zip(("dq", "dk", "dv", "dsinks"), grads, refs):
        err = rel_err(got.double().cpu().numpy(), ref)
        assert err <= 2e-2, f"{name} rel err {err:.3e}"


def test_cuda_graph_capture_of_a_decode_step():
    """flash_attn_with_kvcache captured in a CUDA graph after a warm-up (one new token appended, attention over the
    cache split over the keys and merged) and replayed as a serving loop does, cache_seqlens advanced in place
    between replays: nothing comes from CuPy's pool in capture, and each replay writes the caches and returns the
    output of an eager call on copies of the same caches, bit for bit."""
    import cupy

    _need_cuda()
    b, cap, hq, hkv, d = 2, 4096, 8, 2, 128
    g = torch.Generator(device="cuda").manual_seed(3)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = mk(b, 1, hq, d), mk(b, 1, hkv, d), mk(b, 1, hkv, d)
    k_cache, v_cache = mk(b, cap, hkv, d), mk(b, cap, hkv, d)
    lens = torch.tensor([2900, 1200], dtype=torch.int32, device="cuda")

    def step(kc, vc):
        return ct.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, causal=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(k_cache.clone(), v_cache.clone())
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    pool_used = cupy.get_default_memory_pool().used_bytes()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(k_cache, v_cache)
    assert cupy.get_default_memory_pool().used_bytes() == pool_used
    for _ in range(3):
        with torch.no_grad():
            for x in (q, k, v):
                x.copy_(mk(*x.shape))
            lens.add_(1)
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        graph.replay()
        expected = step(k_ref, v_ref)
        torch.cuda.synchronize()
        assert torch.equal(captured, expected)
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
        assert torch.equal(k_cache[torch.arange(b), lens.long()], k[:, 0])   # the new token at its position


def test_kvcache_op_schema_and_fake_shapes():
    """cuflash::attention_kvcache declares the caches it writes; its fake gives out (B, Nq, Hq, Dv) and lse (Dv 512
    without v_cache: MLA's latent cache); the wrapper traces as one node under torch.compile(fullgraph=True), cache_seqlens given as an int too."""
    import torch._dynamo

    schema = str(torch.ops.cuflash.attention_kvcache.default._schema)
    assert schema.startswith("cuflash::attention_kvcache(Tensor q, Tensor(a1!) k_cache, Tensor(a2!)? v_cache, Tensor? k,")

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    mode, (q, kc, vc, kn, vn) = _fake_cuda((2, 1, 8, 64), (2, 128, 2, 64), (2, 128, 2, 32), (2, 1, 2, 64),
                                           (2, 1, 2, 32), dtype=torch.bfloat16)
    with mode:
        out, lse = ct.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=5, causal=True, return_softmax_lse=True)
    assert out.shape == (2, 1, 8, 32) and out.dtype == torch.bfloat16 and lse.shape == (2, 8, 1)
    mode_mla, (q5, kc5, kn5) = _fake_cuda((2, 1, 16, 576), (2, 128, 1, 576), (2, 1, 1, 576), dtype=torch.bfloat16)
    with mode_mla:   # v_cache=None: MLA's latent cache, out 512 wide
        out = ct.flash_attn_with_kvcache(q5, kc5, None, kn5, None, cache_seqlens=5)
    assert out.shape == (2, 1, 16, 512)
    torch._dynamo.reset()
    try:
        f = torch.compile(lambda q, kc, vc, n: ct.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=n),
                          fullgraph=True, backend=record)
        with mode:
            n = torch.empty((2,), dtype=torch.int32, device="cuda")
        f(q, kc, vc, n)
    finally:
        torch._dynamo.reset()
    (gm,) = graphs
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function" and "cuflash" in str(n.target)]
    assert ops == [torch.ops.cuflash.attention_kvcache.default]
