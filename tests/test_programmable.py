"""Programmable attention's forward (issue #45) on the GPU against the float64 reference: biases of every
broadcast shape and dtype, dropout (exactly, given the generator's mask, and its determinism), block masks,
user score and mask modifiers, and the built-in variants written as modifiers; odd sizes, GQA, causal. The
float32 family (test_float32_*: the exact kernels, programmable_simt.py) to float32's bounds, forward and every
gradient.

Outputs are poisoned with NaN before each call; every row is compared; lse to its own bound.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import FWD_TOL, assert_close_on_every_row, assert_lse_matches, poisoned, randn, requires_gpu

pytestmark = requires_gpu

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim)
SHAPES = {
    "square": (2, 257, 257, 4, 2, 64),
    "kv_longer": (1, 131, 700, 4, 1, 128),
    "q_longer": (2, 300, 97, 2, 2, 128),
    "one_query": (2, 1, 513, 4, 4, 128),
    "wide": (1, 190, 333, 2, 1, 256),
}


def pytest_generate_tests(metafunc):
    """Every test runs on each family a GPU has: Hopper's own kernels, then the portable ones forced; the float32
    tests on the one float32 family."""
    if "family" in metafunc.fixturenames:
        float32 = metafunc.function.__name__.startswith("test_float32")
        metafunc.parametrize("family", ["float32"] if float32 else ["default", "portable"])


@pytest.fixture(autouse=True)
def _programmable_on(family):
    """Programmable attention on, on the kernel family asked for; on Hopper, the default family's tests check that
    its Hopper kernels ran (the portable ones take over only where TMA cannot address the inputs)."""
    import cupy
    from cuflash import options, programmable, programmable_simt

    programmable._plans.clear()
    programmable_simt._plans.clear()
    backend = "sm80" if family == "portable" else "auto"
    with options.override(fwd_backend=backend, bwd_backend=backend):
        yield
    families = set()
    for plan in (*programmable._plans.values(), *programmable_simt._plans.values()):
        # forward plans: (kernel, config, smem); backward: three of them
        families.update(x[1].family for x in plan) if isinstance(plan[0], tuple) else families.add(plan[1].family)
    if family == "float32":   # the exact kernels alone, on every GPU
        assert families <= {"simt_fwd_prog", "bwd_preprocess", "simt_bwd_dkdv_prog", "simt_bwd_dq_prog"}, families
        return
    hopper = cupy.cuda.Device().compute_capability == "90" and options.current().plan_cc in (None, 0, 90)
    if hopper and any(f.endswith("fwd_prog") for f in families):
        want = "sm80_fwd_prog" if family == "portable" else "sm90_fwd_prog"
        assert want in families, f"the {family} forward family did not run: {sorted(families)}"
    if hopper and any("bwd" in f for f in families):
        want = "sm80_bwd_dkdv_prog" if family == "portable" else "sm90_bwd_dkdv_dqtile_prog"
        assert want in families, f"the {family} backward family did not run: {sorted(families)}"


def _inputs(rng, shape_name: str, dtype: str):
    b, nq, nk, hq, hkv, d = SHAPES[shape_name]
    return (randn(rng, (b, nq, hq, d), dtype), randn(rng, (b, nk, hkv, d), dtype), randn(rng, (b, nk, hkv, d), dtype))


def _check(q, k, v, dtype: str, ref_kwargs: dict, lse_rtol: float = 1e-5, **kwargs):
    """cuflash.forward(**kwargs) against attention_reference(**ref_kwargs), every row, lse to its bound."""
    import cupy
    import cuflash
    from cuflash.reference import attention_reference

    b, nq, hq = q.shape[0], q.shape[1], q.shape[2]
    out = poisoned(q.shape[:3] + (v.shape[3],), dtype)
    o, lse = cuflash.forward(q, k, v, return_lse=True, out=out, **kwargs)
    cupy.cuda.get_current_stream().synchronize()
    ref_o, ref_lse = attention_reference(q, k, v, **ref_kwargs)
    assert_close_on_every_row("out", o, cupy.asarray(ref_o), dtype, FWD_TOL)
    assert_lse_matches(lse, ref_lse, (b, hq, nq), rtol=lse_rtol)
    return o, lse


@pytest.mark.parametrize("bias_shape", ["1hqk", "b11k", "bhqk", "hqk", "bh1k", "bhq1"])
@pytest.mark.parametrize("shape_name,dtype,bias_dtype", [("square", "float16", "float32"),
                                                         ("kv_longer", "bfloat16", "bfloat16"),
                                                         ("q_longer", "bfloat16", "float32"),
                                                         ("one_query", "float16", "float16"),
                                                         ("wide", "bfloat16", "float32")])
@pytest.mark.parametrize("causal", [False, True])
def test_bias(rng, bias_shape, shape_name, dtype, bias_dtype, causal):
    import cupy
    from conftest import dtype_of

    q, k, v = _inputs(rng, shape_name, dtype)
    b, nq, nk, hq = q.shape[0], q.shape[1], k.shape[1], q.shape[2]
    dims = {"b": b, "h": hq, "q": nq, "k": nk, "1": 1}
    shape = tuple(dims[c] for c in bias_shape)
    bias = cupy.asarray(rng.normal(0, 2, shape).astype(np.float32).astype(dtype_of(bias_dtype)))
    _check(q, k, v, dtype, dict(bias=bias.get().astype(np.float64), causal=causal), bias=bias, causal=causal)


def test_bias_with_softcap_alibi_window_and_sinks(rng):
    """The bias after softcap and ALiBi, before the masks (the kernel adds it after the SFU's tanh)."""
    import cupy

    q, k, v = _inputs(rng, "kv_longer", "bfloat16")
    b, nq, nk, hq = q.shape[0], q.shape[1], k.shape[1], q.shape[2]
    bias = cupy.asarray(rng.normal(0, 1, (b, hq, nq, nk)).astype(np.float32))
    slopes = cupy.asarray(rng.uniform(0.01, 0.3, hq).astype(np.float32))
    sinks = cupy.asarray(rng.normal(1, 1, hq).astype(np.float32))
    kw = dict(causal=True, window_size=(90, 0), softcap=2.5)
    _check(q, k, v, "bfloat16", dict(bias=bias.get(), alibi_slopes=slopes.get(), sinks=sinks.get(), **kw),
           lse_rtol=5e-5, bias=bias, alibi_slopes=slopes, sinks=sinks, **kw)


@pytest.mark.parametrize("shape_name,dtype", [("square", "float16"), ("q_longer", "bfloat16"), ("wide", "float16")])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_matches_the_reference_given_the_generators_mask(rng, shape_name, dtype, p):
    import cuflash

    q, k, v = _inputs(rng, shape_name, dtype)
    b, nq, nk, hq = q.shape[0], q.shape[1], k.shape[1], q.shape[2]
    seed, offset = int(rng.integers(0, 2**63)), int(rng.integers(0, 2**40))
    keep = cuflash.dropout_keep_mask(seed, offset, b, hq, nq, nk, p)
    for causal in (False, True):
        _check(q, k, v, dtype, dict(dropout_p=p, dropout_mask=keep, causal=causal), dropout_p=p, seed=seed,
               offset=offset, causal=causal)


def test_dropout_is_deterministic_and_reads_a_device_seed(rng):
    import cupy
    import cuflash

    q, k, v = _inputs(rng, "square", "bfloat16")
    a = cuflash.forward(q, k, v, dropout_p=0.2, seed=7, offset=3)
    assert bool((a == cuflash.forward(q, k, v, dropout_p=0.2, seed=7, offset=3)).all())
    assert not bool((a == cuflash.forward(q, k, v, dropout_p=0.2, seed=8, offset=3)).all())
    state = cupy.asarray(np.array([7, 3], np.uint64))
    assert bool((a == cuflash.forward(q, k, v, dropout_p=0.2, seed=state)).all())


def test_dropout_mean_tends_to_the_undropped_output(rng):
    """Averaged over seeds, dropout's output tends to the plain one (each kept p scaled by 1 / (1 - p))."""
    import cupy
    import cuflash

    q, k, v = _inputs(rng, "one_query", "float16")
    plain = cuflash.forward(q, k, v).astype(cupy.float64)
    mean = sum(cuflash.forward(q, k, v, dropout_p=0.3, seed=s).astype(cupy.float64) for s in range(64)) / 64
    err = float(cupy.linalg.norm(mean - plain) / cupy.linalg.norm(plain))
    single = float(cupy.linalg.norm(cuflash.forward(q, k, v, dropout_p=0.3, seed=99).astype(cupy.float64) - plain)
                   / cupy.linalg.norm(plain))
    assert err < single / 4   # 64 draws: the error of the mean about 1/8 of one draw's


@pytest.mark.parametrize("shape_name,dtype,block_size", [("square", "float16", 64), ("kv_longer", "bfloat16", (32, 96)),
                                                        ("q_longer", "bfloat16", 128), ("wide", "float16", (48, 16))])
@pytest.mark.parametrize("causal", [False, True])
def test_block_mask(rng, shape_name, dtype, block_size, causal):
    import cupy
    from cuflash.block_sparse import block_grid

    q, k, v = _inputs(rng, shape_name, dtype)
    b, nq, nk, hq = q.shape[0], q.shape[1], k.shape[1], q.shape[2]
    nqb, nkb = block_grid(nq, nk, block_size)
    blocks = rng.random((b, hq, nqb, nkb)) < 0.5
    blocks[..., 0, :] = False   # rows that see nothing
    _check(q, k, v, dtype, dict(block_mask=blocks, block_size=block_size, causal=causal),
           block_mask=cupy.asarray(blocks), block_size=block_size, causal=causal)
    per_head = blocks[:1]   # broadcast over the batch
    _check(q, k, v, dtype, dict(block_mask=per_head, block_size=block_size, causal=causal),
           block_mask=cupy.asarray(per_head), block_size=block_size, causal=causal)


def test_relative_position_score_mod(rng):
    import cupy
    import cuflash

    q, k, v = _inputs(rng, "kv_longer", "bfloat16")
    hq = q.shape[2]
    table = rng.normal(0, 1, (hq, 64)).astype(np.float32)
    mod = cuflash.ScoreMod("return score + table[h * 64 + min(abs(q_idx - kv_idx), 63)];", grad="return 1.f;",
                           tensors={"table": cupy.asarray(table)})

    def ref(s, b, h, qi, ki):
        return s + table[h][np.minimum(np.abs(qi - ki), 63)]

    _check(q, k, v, "bfloat16", dict(score_mod=ref, causal=True), score_mod=mod, causal=True)


def test_document_mask_mod(rng):
    import cupy
    import cuflash

    q, k, v = _inputs(rng, "square", "float16")
    nq = q.shape[1]
    docs = np.sort(rng.integers(0, 8, nq)).astype(np.int32)
    mod = cuflash.MaskMod("return docs[q_idx] == docs[kv_idx];", tensors={"docs": cupy.asarray(docs)})

    def ref(b, h, qi, ki):
        return docs[qi] == docs[ki]

    _check(q, k, v, "float16", dict(mask_mod=ref, causal=True), mask_mod=mod, causal=True)


def test_prefix_lm_mask_mod(rng):
    """A prefix-LM mask (a per-sequence prefix seen whole, causal after it), forward and backward: the mask depends
    on the batch and not on the head."""
    import cupy
    import cuflash

    q, k, v = _inputs(rng, "square", "bfloat16")
    b, nq = q.shape[0], q.shape[1]
    prefix = rng.integers(1, nq, b).astype(np.int32)
    mod = cuflash.MaskMod("return kv_idx <= q_idx || kv_idx < prefix[b];", tensors={"prefix": cupy.asarray(prefix)},
                          per_head=False)

    def ref(bb, h, qi, ki):
        return (ki <= qi) | (ki < prefix[bb])

    _check(q, k, v, "bfloat16", dict(mask_mod=ref), mask_mod=mod)
    _check_backward(rng, q, k, v, "bfloat16", dict(mask_mod=ref), mask_mod=mod)


def test_built_in_variants_as_modifiers_match_the_built_ins(rng):
    """softcap, ALiBi and a window written as modifiers give the built-ins' results."""
    import cupy
    import cuflash

    q, k, v = _inputs(rng, "kv_longer", "bfloat16")
    hq, nq, nk = q.shape[2], q.shape[1], k.shape[1]
    slopes = rng.uniform(0.01, 0.3, hq).astype(np.float32)
    score = cuflash.ScoreMod(f"float t = tanhf(score / 2.5f);\nreturn 2.5f * t - slopes[h] * abs(q_idx + {nk - nq} - kv_idx);",
                             grad="float t = tanhf(score / 2.5f);\nreturn 1.f - t * t;",
                             tensors={"slopes": cupy.asarray(slopes)})
    window = cuflash.MaskMod(f"int pos = q_idx + {nk - nq};\nreturn kv_idx <= pos && kv_idx >= pos - 90;")
    built_in = cuflash.forward(q, k, v, causal=True, window_size=(90, 0), softcap=2.5,
                               alibi_slopes=cupy.asarray(slopes), return_lse=True)
    mods = cuflash.forward(q, k, v, score_mod=score, mask_mod=window, return_lse=True)
    from conftest import assert_close_on_every_row as close

    close("out", mods[0], built_in[0].astype(cupy.float64), "bfloat16", FWD_TOL)
    assert_lse_matches(mods[1], built_in[1].get(), built_in[1].shape, rtol=5e-5)


@pytest.mark.parametrize("shape_name", ["wide", "kv_longer"])
def test_everything_at_once(rng, shape_name):
    import cupy
    import cuflash
    from cuflash.block_sparse import block_grid

    q, k, v = _inputs(rng, shape_name, "float16")
    b, nq, nk, hq = q.shape[0], q.shape[1], k.shape[1], q.shape[2]
    bias = cupy.asarray(rng.normal(0, 1, (b, 1, 1, nk)).astype(np.float16))
    blocks = rng.random((1, hq) + block_grid(nq, nk, 64)) < 0.7
    table = rng.normal(0, 0.5, (hq, 16)).astype(np.float32)
    score = cuflash.ScoreMod("return score + table[h * 16 + (kv_idx & 15)];", tensors={"table": cupy.asarray(table)})
    mask = cuflash.MaskMod("return (q_idx + kv_idx) % 7 != 0;")
    keep = cuflash.dropout_keep_mask(5, 0, b, hq, nq, nk, 0.25)
    _check(q, k, v, "float16",
           dict(bias=bias.get().astype(np.float64), block_mask=blocks, block_size=64, dropout_p=0.25, dropout_mask=keep,
                score_mod=lambda s, bb, h, qi, ki: s + table[h][ki & 15],
                mask_mod=lambda bb, h, qi, ki: (qi + ki) % 7 != 0, causal=True),
           bias=bias, block_mask=cupy.asarray(blocks), block_size=64, dropout_p=0.25, seed=5, score_mod=score,
           mask_mod=mask, causal=True)


@pytest.mark.parametrize("per_head", [True, False])
def test_mask_modifier_tile_states_match_the_host(rng, per_head):
    """Each tile's state (some / every element shown) as evaluated on the device, against NumPy over the same rule."""
    import cupy
    import cuflash
    from cuflash import options, programmable
    from cuflash.modifiers import Modifiers

    b, h, nq, nk, bm, bn = 2, 3, 150, 230, 64, 32
    docs = np.sort(rng.integers(0, 5, (b, nk))).astype(np.int32)
    src = "return docs[b * 230 + q_idx] == docs[b * 230 + kv_idx]" + (" && (h + kv_idx) % 3 != 0;" if per_head else ";")
    mods = Modifiers(None, cuflash.MaskMod(src, tensors={"docs": cupy.asarray(docs)}, per_head=per_head))
    any_on, all_on = programmable.mask_mod_coverage(mods, batch=b, heads=h, seqlen_q=nq, seqlen_k=nk, block_m=bm,
                                                    block_n=bn, device_id=0, opts=options.current())
    assert any_on.shape == (b, h if per_head else 1, 3, 8)
    for bi in range(b):
        for hi in range(any_on.shape[1]):
            i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
            vis = docs[bi][i] == docs[bi][j]
            if per_head:
                vis = vis & ((hi + j) % 3 != 0)
            for m in range(3):
                for n in range(8):
                    tile = vis[m * bm:(m + 1) * bm, n * bn:(n + 1) * bn]
                    assert bool(any_on[bi, hi, m, n]) == bool(tile.any()) and bool(all_on[bi, hi, m, n]) == bool(tile.all())


def _check_backward(rng, q, k, v, dtype: str, ref_kwargs: dict, *, dbias_of=None, tensor_refs=None,
                    per_row: bool = True, **kwargs):
    """cuflash.backward with programmable ``kwargs`` against attention_reference_backward(**ref_kwargs): dq, dk,
    dv, dbias (dbias_of: the bias, whose gradient comes back in its shape and dtype) and the modifiers' tensor
    gradients (tensor_refs: name -> the reference's accumulated array, filled by its dscore_hook). ``per_row``
    False: the gradients as wholes (dropout: a row that keeps a few probabilities of a few keys has a dq that the
    16-bit rounding of dS moves past the row bound, on both families)."""
    import cupy
    import cuflash
    from conftest import assert_programmable_grads_close
    from cuflash.reference import attention_reference_backward

    o, lse = cuflash.forward(q, k, v, return_lse=True, **kwargs)
    dout = randn(rng, o.shape, dtype)
    bufs = [poisoned(x.shape, dtype) for x in (q, k, v)]
    grads = cuflash.backward(dout, q, k, v, o, lse, dq=bufs[0], dk=bufs[1], dv=bufs[2], **kwargs)
    cupy.cuda.get_current_stream().synchronize()
    refs = attention_reference_backward(dout, q, k, v, **ref_kwargs)
    assert_programmable_grads_close(grads, refs, dtype, dbias_of=dbias_of, tensor_refs=tensor_refs, per_row=per_row)


@pytest.mark.parametrize("bias_shape", ["1hqk", "b11k", "bhqk", "bh1k"])
@pytest.mark.parametrize("shape_name,dtype,bias_dtype", [("square", "float16", "float32"),
                                                         ("kv_longer", "bfloat16", "bfloat16"),
                                                         ("q_longer", "bfloat16", "float32")])
def test_bias_backward(rng, bias_shape, shape_name, dtype, bias_dtype):
    import cupy
    from conftest import dtype_of

    q, k, v = _inputs(rng, shape_name, dtype)
    b, nq, nk, hq = q.shape[0], q.shape[1], k.shape[1], q.shape[2]
    dims = {"b": b, "h": hq, "q": nq, "k": nk, "1": 1}
    shape = tuple(dims[c] for c in bias_shape)
    bias = cupy.asarray(rng.normal(0, 2, shape).astype(np.float32).astype(dtype_of(bias_dtype)))
    for causal in (False, True):
        _check_backward(rng, q, k, v, dtype, dict(bias=bias.get().astype(np.float64), causal=causal), dbias_of=bias,
                        bias=bias, causal=causal)


@pytest.mark.parametrize("shape_name,dtype", [("square", "float16"), ("q_longer", "bfloat16")])
def test_dropout_backward(rng, shape_name, dtype):
    import cuflash

    q, k, v = _inputs(rng, shape_name, dtype)
    b, nq, nk, hq = q.shape[0], q.shape[1], k.shape[1], q.shape[2]
    keep = cuflash.dropout_keep_mask(17, 4, b, hq, nq, nk, 0.2)
    for causal in (False, True):
        _check_backward(rng, q, k, v, dtype, dict(dropout_p=0.2, dropout_mask=keep, causal=causal), dropout_p=0.2,
                        seed=17, offset=4, causal=causal, per_row=False)


def test_block_mask_backward(rng):
    import cupy
    from cuflash.block_sparse import block_grid

    q, k, v = _inputs(rng, "kv_longer", "bfloat16")
    b, nq, nk, hq = q.shape[0], q.shape[1], k.shape[1], q.shape[2]
    blocks = rng.random((b, hq) + block_grid(nq, nk, (32, 48))) < 0.5
    _check_backward(rng, q, k, v, "bfloat16", dict(block_mask=blocks, block_size=(32, 48), causal=True),
                    block_mask=cupy.asarray(blocks), block_size=(32, 48), causal=True)


def test_modifiers_backward_with_the_tables_gradient(rng):
    import cupy
    import cuflash

    q, k, v = _inputs(rng, "square", "float16")
    hq, nq = q.shape[2], q.shape[1]
    table = rng.normal(0, 1, (hq, 64)).astype(np.float32)
    docs = np.sort(rng.integers(0, 6, nq)).astype(np.int32)
    score = cuflash.ScoreMod("return score + table[h * 64 + min(abs(q_idx - kv_idx), 63)];", grad="return 1.f;",
                             tensors={"table": cupy.asarray(table)},
                             tensor_grads={"table": "atomicAdd(&d_table[h * 64 + min(abs(q_idx - kv_idx), 63)], dscore);"})
    mask = cuflash.MaskMod("return docs[q_idx] == docs[kv_idx];", tensors={"docs": cupy.asarray(docs)}, per_batch=False,
                           per_head=False)
    dtable = np.zeros_like(table, dtype=np.float64)

    def hook(ds, b, h, qi, ki):
        np.add.at(dtable[h], np.broadcast_to(np.minimum(np.abs(qi - ki), 63), ds.shape), ds)

    ref = dict(score_mod=lambda s, b, h, qi, ki: s + table[h][np.minimum(np.abs(qi - ki), 63)],
               score_mod_grad=lambda s, *a: np.ones_like(s), dscore_hook=hook,
               mask_mod=lambda b, h, qi, ki: docs[qi] == docs[ki], causal=True)
    _check_backward(rng, q, k, v, "float16", ref, tensor_refs={"table": dtable}, score_mod=score, mask_mod=mask,
                    causal=True)


def test_softcap_as_a_score_modifier_backward(rng):
    """A nonlinear modifier's derivative (grad) through the backward, against the built-in softcap's reference."""
    import cuflash

    q, k, v = _inputs(rng, "q_longer", "bfloat16")
    mod = cuflash.ScoreMod("return 3.f * tanhf(score / 3.f);", grad="float t = tanhf(score / 3.f);\nreturn 1.f - t * t;")
    _check_backward(rng, q, k, v, "bfloat16", dict(softcap=3.0, causal=True), score_mod=mod, causal=True)


def test_everything_backward(rng):
    import cupy
    import cuflash
    from cuflash.block_sparse import block_grid

    q, k, v = _inputs(rng, "square", "bfloat16")
    b, nq, nk, hq = q.shape[0], q.shape[1], k.shape[1], q.shape[2]
    bias = cupy.asarray(rng.normal(0, 1, (1, hq, nq, nk)).astype(np.float32))
    blocks = rng.random((1, hq) + block_grid(nq, nk, 64)) < 0.7
    keep = cuflash.dropout_keep_mask(9, 1, b, hq, nq, nk, 0.15)
    slopes = cupy.asarray(rng.uniform(0.01, 0.2, hq).astype(np.float32))
    kw = dict(causal=True, window_size=(100, 0), softcap=4.0)
    _check_backward(rng, q, k, v, "bfloat16",
                    dict(bias=bias.get(), block_mask=blocks, block_size=64, dropout_p=0.15, dropout_mask=keep,
                         alibi_slopes=slopes.get(), **kw),
                    dbias_of=bias, bias=bias, block_mask=cupy.asarray(blocks), block_size=64, dropout_p=0.15, seed=9,
                    offset=1, alibi_slopes=slopes, **kw)


def test_vjp_carries_the_programmable_arguments(rng):
    import cupy
    import cuflash

    q, k, v = _inputs(rng, "square", "bfloat16")
    b, nk = q.shape[0], k.shape[1]
    bias = cupy.asarray(rng.normal(0, 1, (b, 1, 1, nk)).astype(np.float32))
    out, pullback = cuflash.vjp(q, k, v, causal=True, bias=bias, dropout_p=0.1, seed=3)
    dout = randn(rng, out.shape, "bfloat16")
    via_vjp = pullback(dout)
    o, lse = cuflash.forward(q, k, v, causal=True, bias=bias, dropout_p=0.1, seed=3, return_lse=True)
    direct = cuflash.backward(dout, q, k, v, o, lse, causal=True, bias=bias, dropout_p=0.1, seed=3)
    assert len(via_vjp) == len(direct) == 4
    for x, y in zip(via_vjp[:3], direct[:3]):   # dq, dk, dv: no atomics, bitwise
        assert bool((x == y).all())
    err = float(cupy.linalg.norm(via_vjp[3] - direct[3]) / cupy.linalg.norm(direct[3]))
    assert err < 1e-5   # dbias: float32 atomics in any order


@pytest.mark.parametrize("tile", [(128, 64), (64, 32), (128, 128)])
@pytest.mark.parametrize("with_mask_mod", [False, True])
def test_block_lists_kernel_matches_the_array_lists(rng, tile, with_mask_mod):
    """aux/block_lists.cu (the device's lists) against the array operations' lists: the counts, and every
    entry up to each count (the kernel leaves the rest unwritten)."""
    import cupy
    from cuflash import options, programmable
    from cuflash.block_sparse import block_grid

    nq, nk, hq = 700, 1300, 3
    bm, bn = tile
    blocks = cupy.asarray(rng.random((2, hq) + block_grid(nq, nk, (96, 80))) < 0.5)
    prog = programmable.ProgArgs(block_mask=blocks, block_size=(96, 80))
    coverage = None
    if with_mask_mod:
        mt, nt = -(-nq // bm), -(-nk // bn)
        any_on = cupy.asarray(rng.random((1, hq, mt, nt)) < 0.8)
        coverage = (any_on, any_on & cupy.asarray(rng.random((1, hq, mt, nt)) < 0.5))
    want = programmable._tile_lists(prog, nq, nk, bm, bn, coverage)
    got = programmable._device_tile_lists(prog, nq, nk, bm, bn, coverage, 0, options.current())
    cupy.testing.assert_array_equal(got[0], want[0])
    counts, want_index, got_index = want[0].get(), want[1].get(), got[1].get()
    for at in np.ndindex(counts.shape):
        np.testing.assert_array_equal(got_index[at][:counts[at]], want_index[at][:counts[at]])


def test_block_mask_forward_with_more_keys_than_queries(rng, family):
    import cupy
    from cuflash.block_sparse import block_grid

    q, k, v = _inputs(rng, "kv_longer", "bfloat16")
    b, nq, nk, hq = q.shape[0], q.shape[1], k.shape[1], q.shape[2]
    blocks = rng.random((b, hq) + block_grid(nq, nk, 64)) < 0.5
    blocks[..., 0] = True
    _check(q, k, v, "bfloat16", dict(block_mask=blocks, block_size=64), block_mask=cupy.asarray(blocks), block_size=64)


# float32 (the exact kernels, on every GPU): forward and every gradient to float32's bounds (conftest's FWD_TOL /
# BWD_TOL, every row), on odd sizes and GQA.
F32_SHAPES = ("square", "kv_longer", "q_longer", "wide")


def _check_float32(rng, q, k, v, ref_kwargs: dict, *, backward: bool = True, dbias_of=None, tensor_refs=None,
                   **kwargs):
    """The forward (out and lse) and, with ``backward``, dq, dk, dv, dbias and the tensor gradients (_check_backward)
    of a float32 call against the float64 reference."""
    _check(q, k, v, "float32", ref_kwargs, **kwargs)
    if backward:
        _check_backward(rng, q, k, v, "float32", ref_kwargs, dbias_of=dbias_of, tensor_refs=tensor_refs, **kwargs)


@pytest.mark.parametrize("bias_shape", ["1hqk", "b11k"])
@pytest.mark.parametrize("shape_name", F32_SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_float32_bias(rng, bias_shape, shape_name, causal):
    """A bias with rows per query (dbias per element) and a key-padding bias (dbias summed over the queries and
    heads, per key row of a tile first)."""
    import cupy

    q, k, v = _inputs(rng, shape_name, "float32")
    b, nq, nk, hq = q.shape[0], q.shape[1], k.shape[1], q.shape[2]
    dims = {"b": b, "h": hq, "q": nq, "k": nk, "1": 1}
    bias = cupy.asarray(rng.normal(0, 2, tuple(dims[c] for c in bias_shape)).astype(np.float32))
    _check_float32(rng, q, k, v, dict(bias=bias.get().astype(np.float64), causal=causal), dbias_of=bias, bias=bias,
                   causal=causal)


@pytest.mark.parametrize("shape_name", ["square", "q_longer", "wide"])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_float32_dropout_matches_the_reference_given_the_generators_mask(rng, shape_name, p):
    """The 16-bit kernels' keep mask (cuflash.dropout_keep_mask) exactly: the forward's output and lse (that of the
    undropped probabilities), and the gradients through the same mask."""
    import cuflash

    q, k, v = _inputs(rng, shape_name, "float32")
    b, nq, nk, hq = q.shape[0], q.shape[1], k.shape[1], q.shape[2]
    seed, offset = int(rng.integers(0, 2**63)), int(rng.integers(0, 2**40))
    keep = cuflash.dropout_keep_mask(seed, offset, b, hq, nq, nk, p)
    for causal in (False, True):
        _check_float32(rng, q, k, v, dict(dropout_p=p, dropout_mask=keep, causal=causal), dropout_p=p, seed=seed,
                       offset=offset, causal=causal)


def test_float32_dropout_is_deterministic_and_reads_a_device_seed(rng):
    import cupy
    import cuflash

    q, k, v = _inputs(rng, "square", "float32")
    a = cuflash.forward(q, k, v, dropout_p=0.2, seed=7, offset=3)
    assert bool((a == cuflash.forward(q, k, v, dropout_p=0.2, seed=7, offset=3)).all())
    assert not bool((a == cuflash.forward(q, k, v, dropout_p=0.2, seed=8, offset=3)).all())
    state = cupy.asarray(np.array([7, 3], np.uint64))
    assert bool((a == cuflash.forward(q, k, v, dropout_p=0.2, seed=state)).all())


@pytest.mark.parametrize("shape_name,block_size", [("square", 64), ("kv_longer", (32, 96)), ("q_longer", 128),
                                                   ("wide", (48, 16))])
def test_float32_block_mask_with_causal(rng, shape_name, block_size):
    """A random block mask (rows that see nothing included) under causal: tiles skipped, partial tiles tested, in
    the forward's and dQ's lists and dK / dV's tile states."""
    import cupy
    from cuflash.block_sparse import block_grid

    q, k, v = _inputs(rng, shape_name, "float32")
    b, nq, nk, hq = q.shape[0], q.shape[1], k.shape[1], q.shape[2]
    blocks = rng.random((b, hq) + block_grid(nq, nk, block_size)) < 0.5
    blocks[..., 0, :] = False
    _check_float32(rng, q, k, v, dict(block_mask=blocks, block_size=block_size, causal=True),
                   block_mask=cupy.asarray(blocks), block_size=block_size, causal=True)


def test_float32_relative_position_score_mod_with_the_tables_gradient(rng):
    import cupy
    import cuflash

    q, k, v = _inputs(rng, "kv_longer", "float32")
    hq = q.shape[2]
    table = rng.normal(0, 1, (hq, 64)).astype(np.float32)
    mod = cuflash.ScoreMod("return score + table[h * 64 + min(abs(q_idx - kv_idx), 63)];", grad="return 1.f;",
                           tensors={"table": cupy.asarray(table)},
                           tensor_grads={"table": "atomicAdd(&d_table[h * 64 + min(abs(q_idx - kv_idx), 63)], dscore);"})
    dtable = np.zeros_like(table, dtype=np.float64)

    def hook(ds, b, h, qi, ki):
        np.add.at(dtable[h], np.broadcast_to(np.minimum(np.abs(qi - ki), 63), ds.shape), ds)

    ref = dict(score_mod=lambda s, b, h, qi, ki: s + table[h][np.minimum(np.abs(qi - ki), 63)],
               score_mod_grad=lambda s, *a: np.ones_like(s), causal=True)
    _check(q, k, v, "float32", ref, score_mod=mod, causal=True)
    _check_backward(rng, q, k, v, "float32", dict(ref, dscore_hook=hook), tensor_refs={"table": dtable},
                    score_mod=mod, causal=True)


@pytest.mark.parametrize("shape_name", ["square", "q_longer"])
def test_float32_document_mask_mod(rng, shape_name):
    import cupy
    import cuflash

    q, k, v = _inputs(rng, shape_name, "float32")
    nq, nk = q.shape[1], k.shape[1]
    docs = np.sort(rng.integers(0, 8, max(nq, nk))).astype(np.int32)
    mod = cuflash.MaskMod("return docs[q_idx] == docs[kv_idx];", tensors={"docs": cupy.asarray(docs)},
                          per_batch=False, per_head=False)

    def ref(bb, h, qi, ki):
        return docs[qi] == docs[ki]

    _check_float32(rng, q, k, v, dict(mask_mod=ref, causal=True), mask_mod=mod, causal=True)


def test_float32_everything_at_once(rng):
    """Bias, dropout, a block mask, both modifiers and the built-in variants together."""
    import cupy
    import cuflash
    from cuflash.block_sparse import block_grid

    q, k, v = _inputs(rng, "square", "float32")
    b, nq, nk, hq = q.shape[0], q.shape[1], k.shape[1], q.shape[2]
    bias = cupy.asarray(rng.normal(0, 1, (1, hq, nq, nk)).astype(np.float32))
    blocks = rng.random((1, hq) + block_grid(nq, nk, 64)) < 0.7
    keep = cuflash.dropout_keep_mask(9, 1, b, hq, nq, nk, 0.15)
    slopes = cupy.asarray(rng.uniform(0.01, 0.2, hq).astype(np.float32))
    table = rng.normal(0, 0.5, (hq, 16)).astype(np.float32)
    score = cuflash.ScoreMod("return score + table[h * 16 + (kv_idx & 15)];", grad="return 1.f;",
                             tensors={"table": cupy.asarray(table)})
    mask = cuflash.MaskMod("return (q_idx + kv_idx) % 7 != 0;")
    kw = dict(causal=True, window_size=(100, 0), softcap=4.0)
    ref = dict(bias=bias.get(), block_mask=blocks, block_size=64, dropout_p=0.15, dropout_mask=keep,
               alibi_slopes=slopes.get(), score_mod=lambda s, bb, h, qi, ki: s + table[h][ki & 15],
               score_mod_grad=lambda s, *a: np.ones_like(s), mask_mod=lambda bb, h, qi, ki: (qi + ki) % 7 != 0, **kw)
    _check_float32(rng, q, k, v, ref, dbias_of=bias, bias=bias, block_mask=cupy.asarray(blocks), block_size=64,
                   dropout_p=0.15, seed=9, offset=1, alibi_slopes=slopes, score_mod=score, mask_mod=mask, **kw)


def test_float32_vjp_carries_the_programmable_arguments(rng):
    import cupy
    import cuflash

    q, k, v = _inputs(rng, "square", "float32")
    b, nk = q.shape[0], k.shape[1]
    bias = cupy.asarray(rng.normal(0, 1, (b, 1, 1, nk)).astype(np.float32))
    out, pullback = cuflash.vjp(q, k, v, causal=True, bias=bias, dropout_p=0.1, seed=3)
    dout = randn(rng, out.shape, "float32")
    via_vjp = pullback(dout)
    o, lse = cuflash.forward(q, k, v, causal=True, bias=bias, dropout_p=0.1, seed=3, return_lse=True)
    assert bool((o == out).all())
    direct = cuflash.backward(dout, q, k, v, o, lse, causal=True, bias=bias, dropout_p=0.1, seed=3)
    assert len(via_vjp) == len(direct) == 4 and direct[3].dtype == np.float32 and direct[3].shape == bias.shape
    for x, y in zip(via_vjp[:3], direct[:3]):   # dq, dk, dv: no atomics, bitwise
        assert bool((x == y).all())
    err = float(cupy.linalg.norm(via_vjp[3] - direct[3]) / cupy.linalg.norm(direct[3]))
    assert err < 1e-6   # dbias: float32 atomics in any order
