"""The attention variants (windows, chunks, softcap, ALiBi, sinks and their combinations) on the GPU, forward
and every gradient (dq, dk, dv, dsinks, with and without dlse) against the float64 reference, on every family:
the tuned choice (Hopper kernels on an H100), the portable kernels forced, and exact float32.

Outputs and the backward's float32 workspace are poisoned with NaN before each call; every row is compared;
lse to its own bound (-inf or the sink exactly where the reference has a row that sees no key).
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import (BWD_TOL, FWD_TOL, assert_close_on_every_row, assert_lse_matches, planned_cc, poisoned, randn,
                      requires_gpu)

pytestmark = requires_gpu

# name -> forward / backward keyword arguments (slopes and sinks drawn per case: "alibi", "alibi_b", "sinks").
VARIANTS = {
    "window": dict(window_size=(37, 11)),
    "window_causal": dict(causal=True, window_size=(50, 0)),
    "window_tiny": dict(window_size=(3, 2)),
    "window_00": dict(window_size=(0, 0)),
    "window_huge": dict(window_size=(5000, 4000)),
    "window_left": dict(window_size=(20, -1)),
    "window_right": dict(window_size=(-1, 7)),
    "chunk_causal": dict(causal=True, attention_chunk=96),
    "chunk": dict(attention_chunk=80),
    "chunk_window_causal": dict(causal=True, attention_chunk=128, window_size=(40, 0)),
    "softcap": dict(softcap=1.5),
    "softcap_causal": dict(causal=True, softcap=2.0),
    "gemma2": dict(causal=True, window_size=(64, 0), softcap=2.0),
    "alibi": dict(alibi="alibi"),
    "alibi_causal_b": dict(causal=True, alibi="alibi_b"),
    "sinks": dict(sinks=True),
    "gpt_oss": dict(causal=True, window_size=(16, 0), sinks=True),
    "everything": dict(causal=True, window_size=(70, 0), attention_chunk=200, softcap=3.0, alibi="alibi", sinks=True),
}

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim)
SHAPES = {
    "square": (2, 257, 257, 4, 2, 64),
    "kv_longer": (1, 131, 700, 4, 1, 128),   # MQA, bottom-right alignment, dQ key tiles far from 0
    "q_longer": (2, 300, 97, 2, 2, 128),     # rows that see no key under causal / windows
    "one_query": (2, 1, 513, 4, 4, 128),
    "wide": (1, 190, 333, 2, 1, 256),
}

# Head dims and dtypes shared across shapes (64 fp16, 128 bf16), so that each case's kernels serve several.
CASES_AUTO = [(v, s, "float16" if s == "square" else "bfloat16") for v in VARIANTS
              for s in ("square", "kv_longer", "q_longer")]
CASES_AUTO += [("gpt_oss", "one_query", "bfloat16"), ("everything", "wide", "float16"),
               ("window_causal", "wide", "bfloat16"), ("softcap", "one_query", "bfloat16")]
CASES_PORTABLE = [(v, s, "float16") for v in ("window", "window_causal", "chunk_causal", "softcap", "alibi",
                                             "gpt_oss", "everything", "window_00")
                  for s in ("square", "q_longer")] + [("gemma2", "kv_longer", "bfloat16")]
CASES_FP32 = [(v, "square", "float32") for v in ("window", "gpt_oss", "everything", "chunk", "softcap",
                                                  "alibi_causal_b")]


def kernel_configs(cc: int = 90) -> list:
    """The KernelConfigs this file's cases run (for dev/precompile.py's variant_tests group)."""
    from dataclasses import replace

    from cuflash import heuristics, variants

    def one(name, shape_name, dtype, backend=None, deterministic=False):
        kw = VARIANTS[name]
        var = variants.Variants(*kw.get("window_size", (-1, -1)), kw.get("attention_chunk", 0), kw.get("softcap", 0.0),
                                kw.get("causal", False), None if not kw.get("alibi") else True,
                                True if kw.get("sinks") else None).kernel
        causal = kw.get("causal", False)
        b, nq, nk, hq, hkv, d = SHAPES[shape_name]
        out = [heuristics.fwd_config(dtype, d, causal, cc, backend=backend, short=heuristics.fwd_short(nq, nk),
                                     long_seqs=heuristics.fwd_long(nq, nk), variant=var)]
        bwd_var = replace(var, sink=False)
        out += heuristics.bwd_configs(dtype, d, causal, cc, deterministic, backend=backend,
                                      short=heuristics.bwd_short(nk, causal), variant=bwd_var).all()
        return out

    cfgs = [c for case in CASES_AUTO for c in one(*case)]
    cfgs += [c for case in CASES_PORTABLE for c in one(*case, backend="sm80")]
    cfgs += [c for case in CASES_FP32 for c in one(*case)]
    cfgs += [c for name in ("gpt_oss", "window_causal", "everything") for c in one(name, "kv_longer", "bfloat16",
                                                                                  deterministic=True)]
    return list({c.key(): c for c in cfgs}.values())


def _arguments(rng, name: str, b: int, hq: int, dtype: str) -> dict:
    import cupy

    kwargs = dict(VARIANTS[name])
    if kwargs.get("alibi"):
        shape = (hq,) if kwargs["alibi"] == "alibi" else (b, hq)
        kwargs["alibi_slopes"] = cupy.asarray(rng.uniform(0.01, 0.5, shape).astype(np.float32))
    kwargs.pop("alibi", None)
    if kwargs.get("sinks"):   # float32, or q's dtype for fp16 (both are taken)
        sinks = cupy.asarray(rng.normal(1.0, 1.5, hq).astype(np.float32))
        kwargs["sinks"] = sinks.astype(np.float16) if dtype == "float16" else sinks
    else:
        kwargs.pop("sinks", None)
    return kwargs


def _assert_rows(name: str, x, ref, dtype: str, tol: dict, dout) -> None:
    """The whole array within tol[dtype] in relative norm, and every row (over head_dim) within ROW_TOL_FACTOR
    times it relative to the larger of its own norm and the rows' mean norm. A gradient can vanish (a query that
    sees one key has dq = 0 exactly; window (0, 0) makes all of dq 0), where a relative bound would read rounding
    as inf: norms are taken at least 1 % of the incoming gradient's, the scale the result would have otherwise."""
    import cupy
    from conftest import ROW_TOL_FACTOR

    x, ref = cupy.asarray(x, cupy.float64), cupy.asarray(ref, cupy.float64)
    assert bool(cupy.isfinite(x).all()), f"{name}: NaN or inf"
    floor = 1e-2 * float(cupy.linalg.norm(cupy.asarray(dout, cupy.float64)))
    err = float(cupy.linalg.norm(x - ref)) / max(float(cupy.linalg.norm(ref)), floor)
    assert err <= tol[dtype], f"{name} rel err {err:.3e} > {tol[dtype]:.1e}"
    row_norm = cupy.linalg.norm(ref, axis=-1)
    scale = cupy.maximum(cupy.maximum(row_norm, row_norm.mean()), floor / max(1.0, row_norm.size ** 0.5))
    rows = cupy.linalg.norm(x - ref, axis=-1) / scale
    bound = ROW_TOL_FACTOR * tol[dtype]
    bad = int((rows > bound).sum())
    assert bad == 0, f"{name}: {bad} rows with rel err > {bound:.1e} (worst {float(rows.max()):.3e})"


def _lse_rtol(kwargs: dict) -> float:
    """The 16-bit kernels' softcap takes tanh on the SFU (tanh.approx, 2^-11 relative, as FlashAttention), which
    moves a score near the cap by up to cap * 2^-11: lse within 5e-5 relative there (1e-5 otherwise). Still far
    below the 16-bit inputs' own rounding of the scores (2^-8 of a bf16 score)."""
    from conftest import LSE_RTOL

    return 5e-5 if kwargs.get("softcap") else LSE_RTOL


def _host(kwargs: dict) -> dict:
    return {k: (v.get().astype(np.float64) if hasattr(v, "get") else v) for k, v in kwargs.items()}


def _run(rng, name, shape_name, dtype, with_dlse=True, deterministic=False):
    import cupy
    import cuflash
    from cuflash import api
    from cuflash.reference import attention_reference, attention_reference_backward

    b, nq, nk, hq, hkv, d = SHAPES[shape_name]
    q = randn(rng, (b, nq, hq, d), dtype)
    k = randn(rng, (b, nk, hkv, d), dtype)
    v = randn(rng, (b, nk, hkv, d), dtype)
    dout = randn(rng, (b, nq, hq, d), dtype)
    kwargs = _arguments(rng, name, b, hq, dtype)
    out = poisoned(q.shape, dtype)
    o, lse = cuflash.forward(q, k, v, return_lse=True, out=out, **kwargs)
    cupy.cuda.get_current_stream().synchronize()
    host = _host(kwargs)
    ref_o, ref_lse = attention_reference(q, k, v, **host)
    assert_close_on_every_row("out", o, cupy.asarray(ref_o), dtype, FWD_TOL)
    assert_lse_matches(lse, ref_lse, (b, hq, nq), rtol=_lse_rtol(kwargs))

    dlse = cupy.asarray(rng.standard_normal((b, hq, nq)).astype(np.float32)) if with_dlse else None
    bufs = [poisoned(x.shape, dtype) for x in (q, k, v)]
    api._POISON_WORKSPACE = True
    try:
        grads = cuflash.backward(dout, q, k, v, o, lse, dlse=dlse, deterministic=deterministic,
                                 dq=bufs[0], dk=bufs[1], dv=bufs[2], **kwargs)
    finally:
        api._POISON_WORKSPACE = False
    cupy.cuda.get_current_stream().synchronize()
    ref = attention_reference_backward(dout, q, k, v, dlse=None if dlse is None else dlse.get(), **host)
    assert len(grads) == len(ref) == (4 if "sinks" in kwargs else 3)
    for gname, g, r in zip(("dq", "dk", "dv"), grads, ref):
        _assert_rows(gname, g, r, dtype, BWD_TOL, dout)
    if "sinks" in kwargs:
        dsinks, ref_ds = grads[3], ref[3]
        assert dsinks.dtype == kwargs["sinks"].dtype and dsinks.shape == (hq,)
        err = np.abs(dsinks.get().astype(np.float64) - ref_ds)
        bound = BWD_TOL[dtype] * max(1.0, float(np.linalg.norm(ref_ds)))
        assert np.all(err <= bound), f"dsinks err {err.max():.3e} > {bound:.3e}"
    return grads


@pytest.mark.parametrize("name,shape_name,dtype", CASES_AUTO)
def test_variant_tuned_kernels(rng, name, shape_name, dtype):
    _run(rng, name, shape_name, dtype, with_dlse=len(name) % 2 == 0)


@pytest.mark.parametrize("name,shape_name,dtype", CASES_PORTABLE)
def test_variant_portable_kernels(rng, name, shape_name, dtype):
    from cuflash import options

    options.set(fwd_backend="sm80", bwd_backend="sm80")
    _run(rng, name, shape_name, dtype)


@pytest.mark.parametrize("name,shape_name,dtype", CASES_FP32)
def test_variant_float32(rng, name, shape_name, dtype):
    _run(rng, name, shape_name, dtype)


@pytest.mark.parametrize("name", ["gpt_oss", "window_causal", "everything"])
def test_variant_deterministic_backward_is_bitwise_repeatable(rng, name):
    import cupy

    first = _run(np.random.default_rng(7), name, "kv_longer", "bfloat16", deterministic=True)
    again = _run(np.random.default_rng(7), name, "kv_longer", "bfloat16", deterministic=True)
    for a, b in zip(first, again):
        assert bool(cupy.array_equal(a.view(cupy.uint8), b.view(cupy.uint8)))


@pytest.mark.parametrize("dist", ["outlier12", "sharp", "sink"])
@pytest.mark.parametrize("kwargs", [dict(causal=True, window_size=(300, 0)), dict(causal=True, softcap=30.0),
                                    dict(causal=True, window_size=(128, 0), sinks=True)])
def test_variants_on_score_distributions(dist, kwargs):
    """The realistic score distributions of cuflash.distributions, against float64 on every row."""
    import cupy
    import cuflash
    from cuflash.bench import Shape
    from cuflash.distributions import make_inputs
    from cuflash.reference import attention_reference

    shape = Shape(1, 4, 1000, 128, "bfloat16", True)
    q, k, v = make_inputs(shape, dist, seed=3)
    kw = {key: val for key, val in kwargs.items() if key != "sinks"}
    if kwargs.get("sinks"):
        kw["sinks"] = cupy.asarray(np.array([0.5, 2.0, -1.0, 4.0], np.float32))
    o, lse = cuflash.forward(q, k, v, return_lse=True, **kw)
    ref_o, ref_lse = attention_reference(q, k, v, **_host(kw))
    assert_close_on_every_row("out", o, cupy.asarray(ref_o), "bfloat16", FWD_TOL)
    assert_lse_matches(lse, ref_lse, lse.shape, rtol=_lse_rtol(kw))


def test_window_visits_only_its_tiles():
    """Keys before a window are never read: they hold NaN here, and rows whose query tiles' windows start past
    them (for any query tile up to 192 rows) must come out finite and right."""
    import cupy
    import cuflash
    from cuflash.reference import attention_reference

    rng = np.random.default_rng(11)
    b, n, h, d, left = 1, 4096, 2, 128, 300
    q, k, v = (randn(rng, (b, n, h, d), "bfloat16") for _ in range(3))
    k[:, :2048] = np.nan
    v[:, :2048] = np.nan
    o = cuflash.forward(q, k, v, causal=True, window_size=(left, 0))
    first = 2048 + left + 192
    assert bool(cupy.isfinite(o[:, first:]).all())
    r0 = 2048 + left   # the sub-problem's rows r0.. and keys r0 - left.. (no NaN): the same windows, bottom-right aligned
    ref, _ = attention_reference(q[:, r0:], k[:, r0 - left:], v[:, r0 - left:], causal=True, window_size=(left, 0))
    assert_close_on_every_row("out", o[:, first:], cupy.asarray(ref[:, first - r0:]), "bfloat16", FWD_TOL)


@pytest.mark.parametrize("name", ["gpt_oss", "gemma2", "alibi_causal_b", "chunk_causal", "window"])
def test_variant_fp8_forward(rng, name):
    """The fp8 forward (Hopper) with the variants, against float64 attention of the dequantised inputs."""
    import cupy
    import cuflash
    from conftest import LSE_RTOL_FP8
    from cuflash.reference import attention_reference
    from test_fp8 import FP8_TOL, _rand_fp8

    if planned_cc() != 90:
        pytest.skip("the fp8 forward needs compute capability 9.0")
    b, nq, nk, hq, hkv, d = SHAPES["kv_longer"]
    q8, dq, qf = _rand_fp8(rng, (b, nq, hq, d))
    k8, dk, kf = _rand_fp8(rng, (b, nk, hkv, d))
    v8, dv, vf = _rand_fp8(rng, (b, nk, hkv, d))
    kwargs = _arguments(rng, name, b, hq, "bfloat16")
    o, lse = cuflash.forward_fp8(q8, k8, v8, dq, dk, dv, return_lse=True, **kwargs)
    ref_o, ref_lse = attention_reference(qf, kf, vf, **_host(kwargs))
    assert_close_on_every_row("out", o, cupy.asarray(ref_o), "fp8", {"fp8": FP8_TOL})
    assert_lse_matches(lse, ref_lse, (b, hq, nq), rtol=LSE_RTOL_FP8)
