"""Random valid calls against float64 (GPU): at least 1000 configurations a run, drawn from one seed.

Each case draws a dtype, a head dim (8..256 in steps of 8), sequence lengths (1, primes, tile edges, 0 now
and then, Nq != Nk; about one case in 30 a few thousand tokens, and about one in 200 more than 65,536 keys,
with batch 1 and few heads so that they stay cheap), a GQA ratio, the mask, a scale near the default,
deterministic or not, and for every array a layout: contiguous, a slice of a larger buffer along the
sequence, the heads, the batch or the head dim, stored (batch, heads, seqlen, head_dim) and transposed, a
batch broadcast by stride 0 (inputs), or a size-1 batch with a stride TMA cannot take (the portable kernels,
or the forward's compact stand-in for an output); where Nq == Nk, now and then q, k and v are slices of one
packed (batch, seqlen, heads_q + 2 heads_kv, head_dim) buffer (with one K/V head per query head, the
(batch, seqlen, 3, heads, head_dim) packing), and dq, dk, dv slices of another. The forward is checked
against the float64 reference on every row (each row's relative error within ROW_TOL_FACTOR times the
dtype's bound, the whole output within it) and on every lse, the backward (dq, dk, dv) in relative norm,
with the bounds of the other tests; long cases take the reference by chunks of query rows
(cuflash.attention_reference_chunked). Output buffers are slices of NaN-filled buffers, and nothing
outside the slice may change. The run takes a minute or two once the kernels are compiled
(dev/precompile.py fwd bwd compiles every one of them; otherwise the cases' kernels are compiled first,
on as many threads as there are cores).

    CUFLASH_FUZZ_SEED=<seed>  the run's seed (printed; default: a new one)
    CUFLASH_FUZZ_CASES=<n>    how many cases (default 1000)
    CUFLASH_FUZZ_CASE=<i>     only case i of the seed's sequence (what a failure prints to reproduce it)
"""
from __future__ import annotations

import math
import os
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pytest

from conftest import (BWD_TOL, FWD_TOL, ROW_TOL_FACTOR, _errlog, assert_lse_matches, dtype_of, requires_gpu,
                      row_errors)

pytestmark = pytest.mark.fuzz

PRIMES = (2, 3, 5, 7, 11, 13, 17, 31, 61, 97, 127, 131, 193, 251, 257)
TILE_EDGES = (63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 256)
INPUT_LAYOUTS = ("contiguous", "seq_slice", "head_slice", "batch_slice", "bhsd", "padded_dim", "broadcast_batch",
                 "unit_batch_odd_stride")
OUTPUT_LAYOUTS = ("contiguous", "seq_slice", "head_slice", "batch_slice", "bhsd", "padded_dim",
                  "unit_batch_odd_stride")
PACKED = "packed"   # q, k, v (or dq, dk, dv) as slices of one (batch, seqlen, heads_q + 2 heads_kv, head_dim) buffer
LONG_P, HUGE_P = 1 / 30, 1 / 200   # the odds of a case with a few thousand tokens, and of one past 65,536 keys
HUGE_KEYS = (65_537, 66_000, 70_001)   # past 2^16 keys: 16-bit counts or grid dimensions would wrap
# Cases with more scores than this (batch * heads_q * Nq * Nk) take the reference by chunks of query rows.
CHUNKED_SCORES = 1 << 24


@dataclass(frozen=True)
class Case:
    index: int
    dtype: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_kv: int
    group: int
    head_dim: int
    causal: bool
    scale: float | None
    deterministic: bool
    layouts: tuple   # q, k, v, dout, then out, dq, dk, dv (None: the call allocates)
    variant: tuple = ()   # the variant arguments (name, value) pairs: draw_variant; alibi / sinks drawn per run

    @property
    def heads_q(self) -> int:
        return self.heads_kv * self.group

    def describe(self, seed: int) -> str:
        return (f"case {self.index}: {self.dtype} b={self.batch} nq={self.seqlen_q} nk={self.seqlen_k} "
                f"hq={self.heads_q} hkv={self.heads_kv} d={self.head_dim} causal={self.causal} scale={self.scale} "
                f"det={self.deterministic} layouts={self.layouts} variant={dict(self.variant)}; "
                f"reproduce: CUFLASH_FUZZ_SEED={seed} "
                f"CUFLASH_FUZZ_CASE={self.index} python -m pytest tests/test_fuzz.py")


def _seqlen(rng) -> int:
    kind = rng.random()
    if kind < 0.02:
        return 0
    if kind < 0.15:
        return 1
    if kind < 0.4:
        return int(rng.choice(PRIMES))
    if kind < 0.6:
        return int(rng.choice(TILE_EDGES))
    return int(rng.integers(2, 301))


VARIANT_P = 0.3   # the odds of a case with attention variants (at head dims 64 and 128: few kernels to build)
# The sets of variant parts a case draws (each its own kernels): windows / chunks, softcap, ALiBi, sinks, the
# gpt-oss pair and all of them.
VARIANT_PARTS = (("local",), ("softcap",), ("alibi",), ("sinks",), ("local", "sinks"),
                 ("local", "softcap", "alibi", "sinks"))
WINDOW_SIDES = (-1, 0, 1, 3, 17, 63, 64, 65, 128, 300, 5000)


def draw_variant(rng, causal: bool) -> tuple:
    """Variant arguments as (name, value) pairs: a window (each side -1, 0, small, a tile edge or past the
    sequence; right -1 or 0 when causal) and / or chunks, a softcap, ALiBi slopes per head or per (batch, head),
    sinks."""
    parts = VARIANT_PARTS[int(rng.integers(len(VARIANT_PARTS)))]
    out = []
    if "local" in parts:
        left = int(rng.choice(WINDOW_SIDES))
        right = int(rng.choice((-1, 0))) if causal else int(rng.choice(WINDOW_SIDES))
        chunk = int(rng.choice((0, 0, 16, 64, 96, 128, 200)))
        if left < 0 and (right < 0 or causal) and not chunk:
            left = 7   # local after all
        out += [("window_size", (left, right)), ("attention_chunk", chunk)]
    if "softcap" in parts:
        out.append(("softcap", float(rng.choice((1.0, 5.0, 30.0)))))
    if "alibi" in parts:
        out.append(("alibi", str(rng.choice(("h", "bh")))))
    if "sinks" in parts:
        out.append(("sinks", True))
    return tuple(out)


def draw_case(seed: int, index: int) -> Case:
    """Case ``index`` of the sequence of ``seed`` (each drawn from its own generator: one replays alone)."""
    rng = np.random.default_rng([seed, index])
    dtype = str(rng.choice(["float16", "bfloat16", "float32"], p=[0.4, 0.4, 0.2]))
    size = rng.random()
    if size < HUGE_P:   # past 65,536 keys, against a few queries (or as many as the keys, rarely)
        batch = 1
        nk = int(rng.choice(HUGE_KEYS))
        nq = _seqlen(rng) if rng.random() < 0.8 else int(rng.integers(1000, 2500))
    elif size < HUGE_P + LONG_P:   # a few thousand tokens
        batch = 1
        nq = int(rng.integers(1000, 6001))
        nk = nq if rng.random() < 0.3 else int(rng.integers(1000, 6001))
    else:
        batch = int(rng.integers(1, 4))
        nq = _seqlen(rng)
        nk = nq if rng.random() < 0.3 else _seqlen(rng)
    long_case = size < HUGE_P + LONG_P
    d = 8 * int(rng.integers(1, 33))
    scale = None if rng.random() < 0.6 else float(rng.uniform(0.5, 2.0) / math.sqrt(d))

    def layout(options, allow_none: bool):
        if allow_none and rng.random() < 0.35:
            return None
        name = str(rng.choice(options))
        if name == "broadcast_batch" and batch == 1 or name == "unit_batch_odd_stride" and batch != 1:
            return "contiguous"
        return name

    layouts = list(layout(INPUT_LAYOUTS, False) for _ in range(4)) + list(
        layout(OUTPUT_LAYOUTS, True) for _ in range(4))
    if nq == nk and rng.random() < 0.25:   # packed q, k, v; and now and then packed dq, dk, dv
        layouts[:3] = [PACKED] * 3
        if rng.random() < 0.5:
            layouts[5:8] = [PACKED] * 3
    heads_kv, group = int(rng.integers(1, 4)), int(rng.choice([1, 2, 3, 4]))
    if long_case:   # few heads: a long case costs about as much as a thousand short ones otherwise
        heads_kv, group = 1, int(rng.choice([1, 2]))
    causal = bool(rng.random() < 0.5)
    deterministic = bool(rng.random() < 0.5)
    variant = ()
    if rng.random() < VARIANT_P:
        d = int(rng.choice((64, 128)))
        variant = draw_variant(rng, causal)
    return Case(index, dtype, batch, nq, nk, heads_kv, group, d, causal, scale, deterministic, tuple(layouts),
                variant)


def variant_arguments(case: Case, rng, xp=np) -> dict:
    """The case's variant keyword arguments with its slopes and sinks drawn (float32 arrays of ``xp``)."""
    kwargs = {}
    for name, value in case.variant:
        if name == "alibi":
            shape = (case.heads_q,) if value == "h" else (case.batch, case.heads_q)
            kwargs["alibi_slopes"] = xp.asarray(rng.uniform(0.01, 0.5, shape).astype(np.float32))
        elif name == "sinks":
            kwargs["sinks"] = xp.asarray(rng.normal(0.5, 1.5, case.heads_q).astype(np.float32))
        else:
            kwargs[name] = value
    return kwargs


def _host_variant(kwargs: dict) -> dict:
    return {k: (v.get() if hasattr(v, "get") else v) for k, v in kwargs.items()}


def _view(layout: str, host: np.ndarray, *, fill_nan: bool = False, xp=None):
    """(view of ``host``'s shape in this layout holding its values (or NaN), the buffer under it, and a
    bool mask of the buffer's elements outside the view, or None where the view covers the buffer).
    ``xp``: the array module, CuPy unless told (the CPU test checks the layouts with NumPy)."""
    if xp is None:
        import cupy as xp
    b, n, h, d = host.shape
    values = _nan(xp, host.shape, host.dtype) if fill_nan else xp.asarray(host)
    if layout == "bhsd":
        base = xp.ascontiguousarray(values.transpose(0, 2, 1, 3))
        return base.transpose(0, 2, 1, 3), base, None
    if layout == "broadcast_batch":   # host is (1, n, h, d) broadcast: every batch the same memory
        base = xp.ascontiguousarray(values[:1])
        return xp.broadcast_to(base, (b, n, h, d)), base, None
    if layout == "unit_batch_odd_stride":   # b == 1: the batch stride is never used, and TMA refuses it
        base = xp.ascontiguousarray(values)
        view = xp.lib.stride_tricks.as_strided(base, base.shape, (base.itemsize,) + base.strides[1:])
        return view, base, None
    if layout == "contiguous":
        base = xp.ascontiguousarray(values)
        return base, base, None
    big_shape, index = {
        "seq_slice": ((b, n + 5, h, d), np.s_[:, 3:3 + n]),
        "head_slice": ((b, n, 2 * h, d), np.s_[:, :, 1::2]),
        "batch_slice": ((2 * b, n, h, d), np.s_[::2]),
        "padded_dim": ((b, n, h, d + 8), np.s_[..., :d]),
    }[layout]
    base = _nan(xp, big_shape, host.dtype)
    base[index] = values
    outside = xp.ones(big_shape, dtype=bool)
    outside[index] = False
    return base[index], base, outside


def _packed(hosts, *, fill_nan: bool = False, xp=None):
    """q, k, v (or dq, dk, dv) as slices along the heads of one (batch, seqlen, heads_q + 2 heads_kv,
    head_dim) buffer holding ``hosts``' values (or NaN): the views and the buffer (which they cover)."""
    if xp is None:
        import cupy as xp
    b, n, hq, d = hosts[0].shape
    hkv = hosts[1].shape[2]
    base = _nan(xp, (b, n, hq + 2 * hkv, d), hosts[0].dtype)
    bounds = (0, hq, hq + hkv, hq + 2 * hkv)
    views = [base[:, :, lo:hi] for lo, hi in zip(bounds, bounds[1:])]
    if not fill_nan:
        for view, host in zip(views, hosts):
            view[...] = xp.asarray(host)
    return views, base


def _nan(xp, shape, dtype):
    x = xp.empty(shape, dtype=dtype)
    x.fill(np.nan)
    return x


def _host_inputs(case: Case, rng):
    dt = dtype_of(case.dtype)
    b, nq, nk, hq, hkv, d = case.batch, case.seqlen_q, case.seqlen_k, case.heads_q, case.heads_kv, case.head_dim
    arrays = []
    for layout, shape in zip(case.layouts[:4], ((b, nq, hq, d), (b, nk, hkv, d), (b, nk, hkv, d), (b, nq, hq, d))):
        rows = 1 if layout == "broadcast_batch" else shape[0]
        x = rng.standard_normal((rows, *shape[1:])).astype(np.float32).astype(dt)
        arrays.append(np.broadcast_to(x, shape))
    return arrays


def _untouched(base, outside) -> bool:
    import cupy

    return outside is None or bool(cupy.isnan(base[outside].astype(cupy.float32)).all())


def _grad_errors(grads, ref) -> list[float]:
    """Relative norm errors of dq, dk, dv with test_bwd's floor (a tenth of the gradients' natural size)
    where the exact gradient is about 0."""
    from test_bwd import grad_err

    sizes = [np.linalg.norm(r.ravel()) * math.sqrt(x.size / r.size) for r, x in zip(ref, grads) if r.size]
    floor = 0.1 * max(sizes, default=0.0)
    return [grad_err(x, r, floor) for x, r in zip(grads, ref)]


def _row_problems(name: str, x, ref, dtype: str) -> list[str]:
    """``x`` (CuPy) against the float64 ``ref`` (NumPy or CuPy): the whole array within the dtype's bound in
    relative norm and every row (over head_dim) within ROW_TOL_FACTOR times it (conftest.row_errors)."""
    import cupy

    from conftest import rel_err_gpu

    ref = cupy.asarray(ref)
    err = rel_err_gpu(x, ref)
    problems = [] if err <= FWD_TOL[dtype] else [f"{name} rel err {err:.3e} > {FWD_TOL[dtype]:.1e}"]
    rows = row_errors(x, ref)
    bound = ROW_TOL_FACTOR * FWD_TOL[dtype]
    bad = int((rows > bound).sum())
    if bad:
        worst = cupy.unravel_index(cupy.argmax(rows), rows.shape)
        problems.append(f"{name}: {bad} rows with rel err > {bound:.1e} (worst {float(rows.max()):.3e} at "
                        f"(batch, row, head) {tuple(int(i) for i in worst)})")
    return problems


def _references(case: Case, hosts, variant: dict):
    """(out, lse, dq, dk, dv[, dsinks]) in float64 for the case's inputs: NumPy's whole reference for small
    cases, the reference by chunks of query rows (CuPy arrays) past CHUNKED_SCORES scores."""
    from cuflash.reference import attention_reference, attention_reference_backward, attention_reference_chunked

    hq_, hk_, hv_, hdo = hosts
    opts = dict(causal=case.causal, softmax_scale=case.scale, **_host_variant(variant))
    if case.batch * case.heads_q * case.seqlen_q * case.seqlen_k > CHUNKED_SCORES:
        import cupy

        out, lse, *grads = attention_reference_chunked(*(cupy.asarray(x) for x in hosts[:3]), cupy.asarray(hdo),
                                                       **opts)
        return (out, lse, *(g.get() for g in grads))   # the gradients are compared on the host (test_bwd)
    return (*attention_reference(hq_, hk_, hv_, **opts), *attention_reference_backward(hdo, hq_, hk_, hv_, **opts))


def run_case(case: Case, seed: int) -> list[str]:
    """The case's problems (empty when it passes)."""
    import cupy

    import cuflash

    rng = np.random.default_rng([seed, case.index, 1])
    hq_, hk_, hv_, hdo = _host_inputs(case, rng)
    if case.layouts[0] == PACKED:
        (q, k, v), _ = _packed((hq_, hk_, hv_))
        dout = _view(case.layouts[3], hdo)[0]
    else:
        q, k, v, dout = (_view(layout, x)[0] for layout, x in zip(case.layouts[:4], (hq_, hk_, hv_, hdo)))
    outs = [None if layout is None or layout == PACKED else _view(layout, np.empty(x.shape, x.dtype), fill_nan=True)
            for layout, x in zip(case.layouts[4:], (hq_, hq_, hk_, hv_))]   # out, dq, dk, dv
    if case.layouts[5] == PACKED:   # the gradients' buffer is covered by their three views: nothing outside
        views, base = _packed((hq_, hk_, hv_), fill_nan=True)
        outs[1:] = [(view, base, None) for view in views]
    out_buf = outs[0][0] if outs[0] else None
    grad_bufs = [o[0] if o else None for o in outs[1:]]
    problems = []
    variant = variant_arguments(case, rng, cupy)
    o, lse = cuflash.forward(q, k, v, causal=case.causal, softmax_scale=case.scale, return_lse=True, out=out_buf,
                             **variant)
    dq, dk, dv, *dsinks = cuflash.backward(dout, q, k, v, o, lse, causal=case.causal, softmax_scale=case.scale,
                                           deterministic=case.deterministic, dq=grad_bufs[0], dk=grad_bufs[1],
                                           dv=grad_bufs[2], **variant)
    cupy.cuda.get_current_stream().synchronize()
    for name, got, buf in zip(("out", "dq", "dk", "dv"), (o, dq, dk, dv), [out_buf, *grad_bufs]):
        if buf is not None and got is not buf:
            problems.append(f"{name}: the given buffer was not returned")
    for name, view in zip(("out", "dq", "dk", "dv"), outs):
        if view is not None and not _untouched(view[1], view[2]):
            problems.append(f"{name}: written outside its view")
    ref_o, ref_lse, *ref_grads = _references(case, (hq_, hk_, hv_, hdo), variant)
    problems += _row_problems("out", o, ref_o, case.dtype)
    try:
        # softcap's SFU tanh (2^-11) in the 16-bit kernels: tests/test_variants.py _lse_rtol
        rtol = 5e-5 if variant.get("softcap") and case.dtype != "float32" else 1e-5
        assert_lse_matches(lse, ref_lse, (case.batch, case.heads_q, case.seqlen_q), rtol=rtol)
    except AssertionError as e:
        problems.append(f"lse: {e}")
    for name, e in zip(("dq", "dk", "dv"), _grad_errors((dq, dk, dv), ref_grads[:3])):
        if not e <= BWD_TOL[case.dtype]:
            problems.append(f"{name} rel err {e:.3e} > {BWD_TOL[case.dtype]:.1e}")
    if dsinks:
        ref_ds = ref_grads[3]
        err = float(np.abs(dsinks[0].get().astype(np.float64) - ref_ds).max())
        if not err <= BWD_TOL[case.dtype] * max(1.0, float(np.linalg.norm(ref_ds))):
            problems.append(f"dsinks err {err:.3e}")
    return problems


def _plans_of(case: Case, device_id: int) -> None:
    """Compiles (or loads) the kernels the case's calls take, the portable ones too where a layout sends
    the calls there."""
    from cuflash import api, heuristics, sm90

    from dataclasses import replace

    from cuflash import variants

    dt = np.dtype(dtype_of(case.dtype))
    nq, nk = case.seqlen_q, case.seqlen_k
    kw = variant_arguments(case, np.random.default_rng(0))
    var = variants.Variants(*kw.get("window_size", (-1, -1)), kw.get("attention_chunk", 0), kw.get("softcap", 0.0),
                            case.causal, kw.get("alibi_slopes"), kw.get("sinks")).kernel
    bwd_var = replace(var, sink=False)
    _, cfg, _ = api._fwd_plan(dt, case.head_dim, case.causal, device_id, heuristics.fwd_short(nq, nk),
                              heuristics.fwd_long(nq, nk), variant=var)
    api._bwd_plan(dt, case.head_dim, case.causal, case.deterministic, device_id,
                  short=heuristics.bwd_short(case.seqlen_k, case.causal), variant=bwd_var)
    if {"broadcast_batch", "unit_batch_odd_stride"} & set(case.layouts[:4]) and cfg.fam.arch_specific:
        sm90._portable_fwd(cfg, device_id)
        api._bwd_plan(dt, case.head_dim, case.causal, case.deterministic, device_id, backend="sm80", variant=bwd_var)


def _seed() -> int:
    value = os.environ.get("CUFLASH_FUZZ_SEED")
    return int(value) if value else secrets.randbits(32)


@requires_gpu
def test_random_valid_calls_against_float64():
    import cupy

    seed = _seed()
    only = os.environ.get("CUFLASH_FUZZ_CASE")
    n = int(os.environ.get("CUFLASH_FUZZ_CASES", "1000"))
    cases = [draw_case(seed, int(only))] if only else [draw_case(seed, i) for i in range(n)]
    print(f"\ncuflash fuzz: seed {seed}, {len(cases)} cases (CUFLASH_FUZZ_SEED={seed} repeats them)")
    _errlog(f"fuzz seed {seed}: {len(cases)} cases")
    device_id = cupy.cuda.Device().id
    with ThreadPoolExecutor(os.cpu_count() or 4) as pool:   # cold kernels compile side by side
        list(pool.map(lambda c: _plans_of(c, device_id), cases))
    failures = []
    for case in cases:
        try:
            problems = run_case(case, seed)
        except Exception as e:  # noqa: BLE001 - an error in one case is reported with the others
            problems = [f"raised {type(e).__name__}: {e}"]
        if problems:
            failures.append(f"{case.describe(seed)}\n    " + "\n    ".join(problems))
    assert not failures, (f"fuzz seed {seed}: {len(failures)} of {len(cases)} cases failed:\n"
                          + "\n".join(failures[:15]))


def test_cases_replay_from_the_seed():
    """A case drawn again from its seed and index is the same case (what CUFLASH_FUZZ_CASE relies on), and a
    run's cases cover what the fuzz promises (CPU)."""
    cases = [draw_case(12345, i) for i in range(1000)]
    assert draw_case(12345, 417) == cases[417]
    assert {c.dtype for c in cases} == {"float16", "bfloat16", "float32"}
    assert {c.head_dim for c in cases} == set(range(8, 257, 8))
    lengths = {c.seqlen_q for c in cases} | {c.seqlen_k for c in cases}
    assert {0, 1}.issubset(lengths) and len(set(PRIMES) & lengths) >= 10
    assert any(c.seqlen_q != c.seqlen_k for c in cases) and {c.group for c in cases} == {1, 2, 3, 4}
    assert {c.causal for c in cases} == {False, True} and {c.deterministic for c in cases} == {False, True}
    used = {layout for c in cases for layout in c.layouts}
    assert set(INPUT_LAYOUTS) | set(OUTPUT_LAYOUTS) | {PACKED, None} == used
    packed = [c for c in cases if c.layouts[0] == PACKED]
    assert all(c.seqlen_q == c.seqlen_k and c.layouts[:3] == (PACKED,) * 3 for c in packed)
    assert any(c.layouts[5:] == (PACKED,) * 3 for c in packed) and any(c.group == 1 for c in packed)
    long_cases = [c for c in cases if max(c.seqlen_q, c.seqlen_k) >= 1000]
    assert any(c.seqlen_k > 65_536 for c in long_cases) and sum(c.seqlen_q >= 1000 for c in long_cases) >= 15
    # cheap: batch 1 and at most two query heads, so that they add about as much as the short cases
    assert all(c.batch == 1 and c.heads_q <= 2 for c in long_cases)
    scores = sum(c.batch * c.heads_q * c.seqlen_q * c.seqlen_k for c in cases)
    assert scores < 2e10, f"{scores:.2e} scores a run"


def test_packed_views():
    """q, k, v (or dq, dk, dv) packed in one buffer (built here with NumPy): each view holds its values, the
    three views cover the buffer without overlapping, and their strides are the packed buffer's, which the
    argument checks and TMA take (CPU)."""
    from cuflash import _checks, tma

    rng = np.random.default_rng(3)
    for hq, hkv in ((4, 4), (6, 2)):
        hosts = [rng.standard_normal((2, 9, h, 32)).astype(np.float16) for h in (hq, hkv, hkv)]
        views, base = _packed(hosts, xp=np)
        assert base.shape == (2, 9, hq + 2 * hkv, 32)
        for view, host in zip(views, hosts):
            assert view.shape == host.shape and np.array_equal(view, host)
            assert view.strides == base.strides and np.shares_memory(view, base)
            _checks.check_distinct_elements("dq", view)
            assert tma.strides_ok(0, [view.strides[1], view.strides[2], view.strides[0]])
        assert sum(v.size for v in views) == base.size
        nan_views, nan_base = _packed(hosts, fill_nan=True, xp=np)
        assert bool(np.isnan(nan_base.astype(np.float32)).all())


@pytest.mark.parametrize("layout", sorted(set(INPUT_LAYOUTS) | set(OUTPUT_LAYOUTS)))
def test_layouts(layout):
    """Each layout (built here with NumPy) holds the values it was given in a view that the argument checks
    take: strides of 16-byte multiples on every dimension longer than 1, and, for outputs, distinct
    elements; the mask of what lies outside the view covers the rest of the buffer; TMA can address all but
    the two layouts meant for the portable kernels (CPU)."""
    from cuflash import _checks, tma

    rng = np.random.default_rng(7)
    for dtype in ("float16", "bfloat16", "float32"):
        b = 1 if layout == "unit_batch_odd_stride" else 3
        rows = 1 if layout == "broadcast_batch" else b
        host = np.broadcast_to(rng.standard_normal((rows, 7, 3, 24)).astype(dtype_of(dtype)), (b, 7, 3, 24))
        view, base, outside = _view(layout, host, xp=np)
        assert view.shape == host.shape and np.array_equal(view.astype(np.float32), host.astype(np.float32))
        assert all(st % 16 == 0 for st, n in zip(view.strides[:-1], view.shape[:-1]) if n > 1)
        assert view.strides[-1] == view.itemsize
        if layout in OUTPUT_LAYOUTS:
            _checks.check_distinct_elements("out", view)
        if outside is not None:
            assert int((~outside).sum()) == view.size
            assert bool(np.isnan(base[outside].astype(np.float32)).all())
        tma_ok = tma.strides_ok(0, [view.strides[1], view.strides[2], view.strides[0]])
        assert tma_ok == (layout not in ("broadcast_batch", "unit_batch_odd_stride")), (layout, view.strides)
