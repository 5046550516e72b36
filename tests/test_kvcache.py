"""GPU: decoding over a KV cache, cuflash.forward_kvcache (issue #44, flash-attn 2's flash_attn_with_kvcache), and
the split-KV combination cuflash.combine, against the float64 references of cuflash.reference.

Batches mix cache lengths 0, 1, full and ragged ones; with and without appended tokens (1 and 3); rotary in both
styles, on the whole head dim and on part of it; contiguous caches (with and without cache_batch_idx) and paged
ones behind shuffled block tables (pages of 16, 64 and 256); GQA 8:1 and 1:1; 1, 4 and 16 queries; causal, windows,
softcap, ALiBi, sinks, chunks; head dims 64, 128, 72, 40 and (128, 64); fp16 and bf16; 0 (automatic), 1 and 3
splits. Every row of out is compared with a row-wise relative bound, lse with its own; the whole caches after
the call against the reference's (the appended slots, and bit for bit everything else); the arguments other
than the caches are left alone. Batch-invariant mode gives a sequence bit-identical rows whatever batch it is
in. Each test runs on each decode kernel (decode.cu everywhere, decode_sm90.cu's cp.async and TMA rings on Hopper). One 32k-key cache
against float64; keys past cache_seqlens (NaN there) are never read; bad arguments are
refused naming them, before the cache is touched.

Rotary: the reference rounds the rotated q and new k to the inputs' dtype (rotary_dtype), as flash-attn's
kernels store them (k in the cache, q before its products): the kernels' rotation in float32 can still differ
by one unit in the last place where the exact value lies near a rounding boundary, hence the cache's 1-ulp
bound on the rotated keys and a looser lse bound (ROTARY_LSE_RTOL) with rotary. The cos / sin tables are given in
q's dtype, as flash-attn takes them.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import FWD_TOL, LSE_RTOL, assert_close_on_every_row, assert_lse_matches, dtype_of, requires_gpu, to_host

pytestmark = [requires_gpu]


@pytest.fixture(params=["sm80", "sm90", "sm90_tma"], ids=["sm80", "sm90", "sm90-tma"], autouse=True)
def decode_backend(request):
    """Every test on each decode kernel: the portable cp.async ring and, on cc 9.0, the ring filled by producer warps
    with cp.async or with TMA boxes (Options.decode_backend); the test sees the backend's name."""
    from cuflash import options
    from cuflash.dispatch import device_info

    backend = request.param
    if backend.startswith("sm90") and device_info(0)[0] != 90:
        pytest.skip("the Hopper decode kernel (decode_sm90.cu) needs a compute capability 9.0 GPU")
    with options.override(decode_backend=backend):
        yield backend

# The spacing of the dtype's floats relative to their value, at most: the rotated keys in the cache within one
# unit in the last place of the reference's (which rounds the float64 rotation once), or 2e-6 absolute near 0
# (the kernels' float32 rotation of values up to ~5 has an error below 2^-21).
ULP = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23}
ROTARY_ATOL = 2e-6
# lse with rotary: a rotated q or k element one ulp away from the reference's moves a score by up to
# softmax_scale * ulp * |q_i k_i| (rare: about 2^-15 of the elements of float32 results straddle a boundary);
# a wrong angle, pair or position moves the scores by O(1). Whether the kernel rounds the rotated q to q's dtype
# (flash-attn) or keeps it in float32 is its own choice: for bf16 the two differ by ~3e-3 on rows with one key,
# so each row's lse may match either reference.
ROTARY_LSE_RTOL = 1e-3
SOFTCAP_LSE_RTOL = 5e-5   # as tests/test_varlen_fwd.py


def _host(rng, shape, dtype) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32).astype(dtype_of(dtype))


def _rand(rng, shape, dtype):
    import cupy

    return cupy.asarray(_host(rng, shape, dtype))


def _rotary_tables(seqlen_ro, rotary_dim, dtype):
    """cos / sin (seqlen_ro, rotary_dim // 2) of angles p * 100^(-2i / rotary_dim): pair 0 turns by one radian a
    position (an off-by-one position or a swapped pair shows), the last ones slowly, as in real models."""
    import cupy

    inv = 100.0 ** (-np.arange(0, rotary_dim, 2) / rotary_dim)
    angles = np.arange(seqlen_ro)[:, None] * inv[None, :]
    dt = dtype_of(dtype)
    return cupy.asarray(np.cos(angles).astype(dt)), cupy.asarray(np.sin(angles).astype(dt))


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a.view(np.uint32)


def _assert_same_bits(name, got, before):
    got = to_host(got)
    assert got.dtype == before.dtype and got.shape == before.shape, f"{name}: dtype or shape changed"
    assert np.array_equal(_bits(got), _bits(before)), f"{name} was modified"


def _written_mask(shape2, lens, nnew, rows=None, table=None, page=None):
    """bool (cache.shape[0], cache.shape[1]): the cache slots the append writes."""
    mask = np.zeros(shape2, bool)
    for b, n in enumerate(lens):
        j = np.arange(n, n + nnew)
        if table is None:
            mask[b if rows is None else rows[b], j] = True
        else:
            mask[table[b, j // page], j % page] = True
    return mask


def _assert_cache(name, got, before, ref_after, written, dtype, rotated):
    """The cache after the call: bit for bit its old contents outside the appended slots; there, the reference's
    values (exactly, or within one ulp for rotated keys)."""
    got_h = to_host(got)
    keep = ~written
    changed = int((_bits(got_h)[keep] != _bits(before)[keep]).any(axis=(-2, -1)).sum())
    assert changed == 0, f"{name}: {changed} slots changed outside the appended positions"
    g, r = got_h[written].astype(np.float64), ref_after[written]
    assert np.all(np.isfinite(g)), f"{name}: non-finite values written"
    if rotated:
        err = np.abs(g - r) - (ULP[dtype] * np.abs(r) + ROTARY_ATOL)
        assert not np.any(err > 0), f"{name}: rotated keys off by up to {float(np.abs(g - r).max()):.3e}"
    else:
        wrong = int((g != r).any(axis=(-2, -1)).sum())
        assert wrong == 0, f"{name}: {wrong} appended slots differ from the new values"


def _assert_lse_matches_either(lse, ref_a, ref_b, shape, rtol):
    """assert_lse_matches, each row within rtol * max(1, |ref|) of either reference (rotated q rounded or not)."""
    lse_h = to_host(lse)
    assert lse_h.dtype == np.float32 and lse_h.shape == tuple(shape)
    fin = np.isfinite(ref_a)
    assert np.array_equal(np.isneginf(lse_h), ~fin), "lse must be -inf exactly for rows that see no key"
    got = lse_h[fin].astype(np.float64)
    err = np.minimum(np.abs(got - ref_a[fin]), np.abs(got - ref_b[fin]))
    ratio = err / (rtol * np.maximum(1.0, np.abs(ref_a[fin])))
    if ratio.size:
        worst = int(np.argmax(ratio))   # the first NaN if there is one
        assert ratio[worst] <= 1.0, (f"lse err {err[worst]:.3e} at lse {ref_a[fin][worst]:.6g} > {rtol:.0e} * "
                                     f"max(1, |lse|) against both references")


def _build(rng, *, dtype="float16", batch=5, capacity=512, lens=None, int_seqlens=None, nq=1, nnew=0, hq=16, hkv=2,
           d=128, dv=None, page=None, rotary=None, rotary_dim=None, batch_idx=False, alibi=None, sinks=False,
           table_name="block_table", fill=None, **kw):
    """The arguments of a forward_kvcache call (device) and of its reference (host copies taken now, before
    the call changes the caches in place)."""
    import cupy

    dv = dv or d
    if int_seqlens is not None:
        lens = [int_seqlens] * batch
    elif lens is None:   # empty, one key, full after the append, and two ragged lengths
        lens = [0, 1, capacity - nnew, (capacity * 3) // 5 + 1, 77][:batch]
    lens = np.asarray(lens, np.int32)
    batch = len(lens)
    q = _rand(rng, (batch, nq, hq, d), dtype)
    rows = table = None
    if page is None:
        bc = batch + 2 if batch_idx else batch
        kc, vc = _host(rng, (bc, capacity, hkv, d), dtype), _host(rng, (bc, capacity, hkv, dv), dtype)
        if batch_idx:
            rows = rng.permutation(bc)[:batch].astype(np.int32)
    else:
        per = capacity // page
        nblocks = batch * per + 3   # three blocks that no sequence names
        kc, vc = _host(rng, (nblocks, page, hkv, d), dtype), _host(rng, (nblocks, page, hkv, dv), dtype)
        table = rng.permutation(nblocks)[:batch * per].reshape(batch, per).astype(np.int32)
    if fill is not None:   # everything past each sequence's keys replaced (the stale-cache test)
        fill(kc, vc, lens, rows, table, page)
    kc, vc = cupy.asarray(kc), cupy.asarray(vc)
    k = _rand(rng, (batch, nnew, hkv, d), dtype) if nnew else None
    v = _rand(rng, (batch, nnew, hkv, dv), dtype) if nnew else None
    args = dict(kw)
    if rotary:
        args["rotary_cos"], args["rotary_sin"] = _rotary_tables(capacity + nq, rotary_dim or d, dtype)
        args["rotary_interleaved"] = rotary == "interleaved"
    if alibi:
        shape = (batch, hq) if alibi == "batch" else (hq,)
        args["alibi_slopes"] = cupy.asarray(rng.uniform(0.01, 0.5, shape).astype(np.float32))
    if sinks:
        args["sinks"] = cupy.asarray(rng.standard_normal(hq).astype(np.float32))
    dev = dict(args, q=q, k_cache=kc, v_cache=vc, k=k, v=v,
               cache_seqlens=int(lens[0]) if int_seqlens is not None else cupy.asarray(lens))
    ref = dict(args, q=to_host(q).copy(), k_cache=to_host(kc).copy(), v_cache=to_host(vc).copy(),
               k=None if k is None else to_host(k).copy(), v=None if v is None else to_host(v).copy(),
               cache_seqlens=lens.copy())
    if rows is not None:
        dev["cache_batch_idx"], ref["cache_batch_idx"] = cupy.asarray(rows), rows.copy()
    if table is not None:
        dev[table_name], ref["block_table"] = cupy.asarray(table), table.copy()
    if rotary:
        ref["rotary_dtype"] = dtype_of(dtype)
    meta = dict(dtype=dtype, lens=lens, nnew=nnew, rows=rows, table=table, page=page, hq=hq, nq=nq, dv=dv,
                rotary=bool(rotary), softcap=bool(kw.get("softcap")))
    return dev, ref, meta


def _check(dev, ref, meta, num_splits=0, **call_kw):
    """One forward_kvcache call against the reference: out on every row, lse, the caches, the other arguments
    untouched. Returns (out, lse)."""
    import cupy
    import cuflash
    from cuflash.reference import attention_reference_kvcache

    ref_out, ref_lse, ref_k, ref_v = attention_reference_kvcache(**ref)
    before = {name: to_host(x).copy() for name, x in dev.items()
              if name not in ("k_cache", "v_cache") and isinstance(x, cupy.ndarray)}
    out, lse = cuflash.forward_kvcache(**dev, num_splits=num_splits, return_lse=True, **call_kw)
    batch, dtype = len(meta["lens"]), meta["dtype"]
    assert isinstance(out, cupy.ndarray) and out.shape == (batch, meta["nq"], meta["hq"], meta["dv"])
    assert out.dtype == dev["q"].dtype
    assert_close_on_every_row("out", out, cupy.asarray(ref_out), dtype, FWD_TOL)
    if meta["rotary"]:
        _, exact_q_lse, _, _ = attention_reference_kvcache(**ref, round_rotated_q=False)
        _assert_lse_matches_either(lse, ref_lse, exact_q_lse, (batch, meta["hq"], meta["nq"]), ROTARY_LSE_RTOL)
    else:
        rtol = SOFTCAP_LSE_RTOL if meta["softcap"] else LSE_RTOL
        assert_lse_matches(lse, ref_lse, (batch, meta["hq"], meta["nq"]), rtol=rtol)
    written = _written_mask(dev["k_cache"].shape[:2], meta["lens"], meta["nnew"], meta["rows"], meta["table"],
                            meta["page"])
    _assert_cache("k_cache", dev["k_cache"], ref["k_cache"], ref_k, written, dtype, meta["rotary"])
    _assert_cache("v_cache", dev["v_cache"], ref["v_cache"], ref_v, written, dtype, False)
    for name, host in before.items():   # q, k, v, cache_seqlens, block_table, rotary tables, slopes, sinks
        _assert_same_bits(name, dev[name], host)
    return out, lse


# Each case is a point of the space, not a cross product: every item of issue #44 appears in a few of them.
# Defaults: fp16, batch 5 with cache lengths (0, 1, full, ragged, 77) of 512, 16 query heads on 2 KV heads (8:1),
# head dim 128, one query, no append, contiguous cache, automatic splits.
CASES = {
    "contig-fp16-decode": dict(),
    "contig-bf16-append1-rotary-gptj-causal": dict(dtype="bfloat16", nnew=1, rotary="interleaved", causal=True),
    "paged16-fp16-mha-d64-q4-append3-rotary-neox-half": dict(page=16, hq=4, hkv=4, d=64, nq=4, nnew=3, causal=True,
                                                             rotary="neox", rotary_dim=32),
    "paged64-bf16-q16-window": dict(dtype="bfloat16", page=64, nq=16, causal=True, window_size=(64, 0)),
    "paged256-fp16-append1-softcap-rotary-gptj-half": dict(page=256, nnew=1, softcap=30.0, rotary="interleaved",
                                                           rotary_dim=64),
    "contig-bf16-d72-q4-append3-rotary-neox": dict(dtype="bfloat16", d=72, hq=4, nq=4, nnew=3, causal=True,
                                                   rotary="neox"),
    "contig-fp16-dv64-append1": dict(dv=64, nnew=1),
    "paged64-bf16-dv64-q4-causal": dict(dtype="bfloat16", page=64, dv=64, nq=4, causal=True),
    "contig-fp16-alibi-batch-q4-append1-causal": dict(alibi="batch", nq=4, nnew=1, causal=True),
    "paged16-bf16-alibi-heads": dict(dtype="bfloat16", page=16, alibi="heads"),
    "contig-bf16-sinks-append1": dict(dtype="bfloat16", sinks=True, nnew=1),
    "paged64-fp16-sinks-window-q16-append3": dict(page=64, sinks=True, causal=True, window_size=(64, 0), nq=16,
                                                  nnew=3),
    "contig-fp16-batch-idx-append1": dict(batch_idx=True, nnew=1),
    "contig-bf16-batch-idx-rotary-q4-append3": dict(dtype="bfloat16", batch_idx=True, rotary="interleaved",
                                                    causal=True, nq=4, nnew=3),
    "contig-fp16-splits1": dict(num_splits=1, capacity=2048),
    "paged16-bf16-splits3-q4-append1-causal": dict(dtype="bfloat16", page=16, num_splits=3, nq=4, nnew=1,
                                                   causal=True),
    "contig-fp16-splits3-sinks-window-rotary": dict(num_splits=3, sinks=True, window_size=(100, 0), nq=4, nnew=1,
                                                    rotary="neox"),
    "paged64-fp16-chunk-q4-append1": dict(page=64, causal=True, attention_chunk=128, nq=4, nnew=1),
    "contig-bf16-int-seqlens-append1": dict(dtype="bfloat16", int_seqlens=300, nnew=1),
    "paged16-fp16-d40-q16-append3-rotary-noncausal": dict(page=16, d=40, hq=2, hkv=1, nq=16, nnew=3,
                                                          rotary="interleaved"),
    "paged256-bf16-page-table-q16-append3-causal": dict(dtype="bfloat16", page=256, nq=16, nnew=3, causal=True,
                                                        table_name="page_table"),
    "contig-bf16-mha-4k": dict(dtype="bfloat16", hq=2, hkv=2, capacity=4096, nnew=1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kvcache(rng, name):
    case = dict(CASES[name])
    num_splits = case.pop("num_splits", 0)
    dev, ref, meta = _build(rng, **case)
    _check(dev, ref, meta, num_splits=num_splits)


@pytest.mark.parametrize("paged", [False, True])
def test_long_cache(rng, paged):
    """One sequence of 32k keys against float64 (automatic splits)."""
    cap = 32768
    if paged:
        case = dict(dtype="float16", page=64, nq=4, nnew=3, causal=True, rotary="neox")
    else:
        case = dict(dtype="bfloat16", nnew=1)
    dev, ref, meta = _build(rng, batch=1, lens=[cap - case["nnew"]], capacity=cap, hq=2, hkv=1, **case)
    _check(dev, ref, meta)


def test_return_lse_false_and_a_repeated_call(rng):
    """Without return_lse the output alone; the same call again rewrites the same slots with the same values (the
    caller's cache_seqlens did not move) and gives the same output, bit for bit."""
    import cupy
    import cuflash

    dev, ref, meta = _build(rng, nq=4, nnew=1, causal=True, rotary="interleaved", page=16)
    out, _ = _check(dev, ref, meta)
    k_after, v_after = dev["k_cache"].copy(), dev["v_cache"].copy()
    again = cuflash.forward_kvcache(**dev)
    assert isinstance(again, cupy.ndarray)
    assert np.array_equal(_bits(to_host(again)), _bits(to_host(out)))
    assert np.array_equal(_bits(to_host(dev["k_cache"])), _bits(to_host(k_after)))
    assert np.array_equal(_bits(to_host(dev["v_cache"])), _bits(to_host(v_after)))


def _stale_nan(kc, vc, lens, rows, table, page):
    """NaN in every slot of the host caches past the sequences' keys (appended slots included: the append
    overwrites them)."""
    live = np.zeros(kc.shape[:2], bool)
    for b, n in enumerate(lens):
        j = np.arange(n)
        if table is None:
            live[b if rows is None else rows[b], j] = True
        else:
            live[table[b, j // page], j % page] = True
    kc[~live] = np.nan
    vc[~live] = np.nan


@pytest.mark.parametrize("paged,num_splits", [(False, 0), (True, 3)])
def test_cache_past_the_keys_is_never_read(rng, paged, num_splits):
    """Whatever lies past a sequence's keys (stale or uninitialized memory; NaN here) must not reach its output:
    loads past cache_seqlens + seqlen_new are predicated off (or their scores masked with their values zeroed)."""
    lens = [0, 1, 33, 130, 257]
    dev, ref, meta = _build(rng, lens=lens, capacity=512, nq=4, nnew=1, causal=True, page=64 if paged else None,
                            hq=4, hkv=1, fill=_stale_nan)
    _check(dev, ref, meta, num_splits=num_splits)


def _embed(rng, dtype, x, batch_lens, slot, paged, capacity, page, hq, hkv, d, nq, nnew):
    """A batch of random companions with the sequence ``x`` (its q, cache contents, new k / v) at index ``slot``."""
    import cupy

    def host(shape):
        return _host(rng, shape, dtype)

    batch = len(batch_lens)
    q, k, v = host((batch, nq, hq, d)), host((batch, nnew, hkv, d)), host((batch, nnew, hkv, d))
    q[slot], k[slot], v[slot] = x["q"], x["k"], x["v"]
    lens = np.asarray(batch_lens, np.int32)
    lens[slot] = x["len"]
    args = {}
    if paged:
        per = capacity // page
        nblocks = batch * per + 1
        kc, vc = host((nblocks, page, hkv, d)), host((nblocks, page, hkv, d))
        table = rng.permutation(nblocks)[:batch * per].reshape(batch, per).astype(np.int32)
        for i in range(per):
            kc[table[slot, i]] = x["kc"][i * page:(i + 1) * page]
            vc[table[slot, i]] = x["vc"][i * page:(i + 1) * page]
        args["block_table"] = cupy.asarray(table)
    else:
        kc, vc = host((batch, capacity, hkv, d)), host((batch, capacity, hkv, d))
        kc[slot], vc[slot] = x["kc"], x["vc"]
    return dict(args, q=cupy.asarray(q), k_cache=cupy.asarray(kc), v_cache=cupy.asarray(vc), k=cupy.asarray(k),
                v=cupy.asarray(v), cache_seqlens=cupy.asarray(lens))


@pytest.mark.parametrize("paged,nq,causal", [(False, 1, False), (True, 4, True)])
def test_batch_invariant(rng, paged, nq, causal):
    """batch_invariant=True: one sequence alone, with one short companion, and third among four others (long, empty,
    one key) gives bit-identical out rows and lse, each also right against float64."""
    import cupy
    import cuflash
    from cuflash.reference import attention_reference_kvcache

    dtype, capacity, page, hq, hkv, d, nnew = "bfloat16", 4096, 64, 8, 2, 128, 1
    def host(shape):
        return _host(rng, shape, dtype)

    x = dict(q=host((nq, hq, d)), k=host((nnew, hkv, d)), v=host((nnew, hkv, d)), kc=host((capacity, hkv, d)),
             vc=host((capacity, hkv, d)), len=2500)
    layouts = [([0], 0), ([0, 37], 0), ([4000, 0, 0, 1, 3000], 2)]
    results = []
    for batch_lens, slot in layouts:
        dev = _embed(rng, dtype, x, batch_lens, slot, paged, capacity, page, hq, hkv, d, nq, nnew)
        ref = {name: to_host(val).copy() for name, val in dev.items()}
        out, lse = cuflash.forward_kvcache(**dev, causal=causal, batch_invariant=True, return_lse=True)
        ref_out, ref_lse, _, _ = attention_reference_kvcache(**ref, causal=causal)
        assert_close_on_every_row("out", out, cupy.asarray(ref_out), dtype, FWD_TOL)
        assert_lse_matches(lse, ref_lse, (len(batch_lens), hq, nq))
        results.append((to_host(out[slot]), to_host(lse[slot])))
    (o0, l0) = results[0]
    assert np.all(np.isfinite(l0))
    for i, (o, l_) in enumerate(results[1:], 1):
        assert np.array_equal(_bits(o), _bits(o0)), f"out of the sequence differs in batch layout {i}"
        assert np.array_equal(_bits(l_), _bits(l0)), f"lse of the sequence differs in batch layout {i}"


def test_bad_arguments_are_refused_before_the_cache_changes(rng):
    import cupy
    import cuflash

    dtype, b, hq, hkv, d, cap = "float16", 2, 4, 2, 64, 64
    q = _rand(rng, (b, 1, hq, d), dtype)
    kc, vc = _rand(rng, (b, cap, hkv, d), dtype), _rand(rng, (b, cap, hkv, d), dtype)
    k, v = _rand(rng, (b, 1, hkv, d), dtype), _rand(rng, (b, 1, hkv, d), dtype)
    lens = cupy.asarray(np.array([3, 10], np.int32))
    kp, vp = _rand(rng, (4, 16, hkv, d), dtype), _rand(rng, (4, 16, hkv, d), dtype)
    table = cupy.asarray(np.array([[0, 1], [2, 3]], np.int32))
    snapshot = [to_host(x).copy() for x in (kc, vc, kp, vp)]
    cuflash.forward_kvcache(q, kc.copy(), vc.copy(), k, v, cache_seqlens=lens)   # the good call runs

    def refused(errors, match, *args, **kw):
        with pytest.raises(errors, match=match):
            cuflash.forward_kvcache(*args, **kw)

    either = (TypeError, ValueError)
    refused(either, "cache_seqlens", q, kc, vc, k, v, cache_seqlens=lens.astype(cupy.int64))
    refused(ValueError, "cache_seqlens", q, kc, vc, k, v, cache_seqlens=cupy.zeros(3, cupy.int32))
    refused(either, "block_table", q, kp, vp, k, v, cache_seqlens=lens, block_table=table.astype(cupy.int64))
    kp24, vp24 = _rand(rng, (4, 24, hkv, d), dtype), _rand(rng, (4, 24, hkv, d), dtype)
    refused(ValueError, "(?i)page|block|k_cache", q, kp24, vp24, k, v, cache_seqlens=lens, block_table=table)
    refused(ValueError, "(?i)head", _rand(rng, (b, 1, 3, d), dtype), kc, vc, k, v, cache_seqlens=lens)
    refused(either, r"\bv\b", q, kc, vc, k, None, cache_seqlens=lens)
    refused(either, r"\bk\b", q, kc, vc, _rand(rng, (b, 1, hkv, d + 8), dtype), v, cache_seqlens=lens)
    refused(either, "k_cache|v_cache", q, _rand(rng, (b, cap, hkv, d), "bfloat16"), vc, cache_seqlens=lens)
    refused(ValueError, "cache_batch_idx|block_table", q, kp, vp, cache_seqlens=lens, block_table=table,
            cache_batch_idx=cupy.asarray(np.array([0, 1], np.int32)))
    cos, _ = _rotary_tables(cap + 1, d, dtype)
    refused(either, "rotary", q, kc, vc, k, v, cache_seqlens=lens, rotary_cos=cos)
    refused(either, "num_splits", q, kc, vc, k, v, cache_seqlens=lens, num_splits=-1)
    # appends into memory that is not one slot's own: a broadcast cache, K and V over the same array
    refused(ValueError, "stride 0", q, cupy.broadcast_to(kc[:1], kc.shape), vc, k, v, cache_seqlens=lens)
    refused(ValueError, "same memory", q, kc, kc, k, v, cache_seqlens=lens)
    for x, before in zip((kc, vc, kp, vp), snapshot):
        _assert_same_bits("a cache given with a bad argument", x, before)


def test_a_broadcast_cache_is_read_where_tma_cannot_address_it(rng, decode_backend):
    """A cache shared by the batch as a broadcast view (stride 0 over its rows: TMA cannot address it, so Hopper's
    default takes the cp.async ring) decodes as the reference says, and one K / V array given as both caches too;
    neither may take appends (test_bad_arguments_are_refused_before_the_cache_changes)."""
    import cupy
    import cuflash
    from cuflash.reference import attention_reference_kvcache

    dtype, b, hq, hkv, d, cap = "bfloat16", 3, 8, 2, 128, 200
    q = _rand(rng, (b, 1, hq, d), dtype)
    one_k, one_v = _rand(rng, (1, cap, hkv, d), dtype), _rand(rng, (1, cap, hkv, d), dtype)
    kc, vc = cupy.broadcast_to(one_k, (b, cap, hkv, d)), cupy.broadcast_to(one_v, (b, cap, hkv, d))
    lens = np.array([1, 97, cap], np.int32)
    for k_cache, v_cache in ((kc, vc), (kc, kc)):
        out, lse = cuflash.forward_kvcache(q, k_cache, v_cache, cache_seqlens=cupy.asarray(lens), return_lse=True)
        ref_out, ref_lse, _, _ = attention_reference_kvcache(
            to_host(q), np.ascontiguousarray(to_host(k_cache)), np.ascontiguousarray(to_host(v_cache)),
            cache_seqlens=lens)
        assert_close_on_every_row("out", out, cupy.asarray(ref_out), dtype, FWD_TOL)
        assert_lse_matches(lse, ref_lse, (b, hq, 1))


def test_caches_interleaved_in_one_buffer(rng, decode_backend):
    """K and V as the two halves of one buffer (rows, capacity, 2, heads_kv, head_dim), FlashInfer's combined layout:
    the keys' stride is not the heads' extent (tensor maps and cp.async address it), appends land in each cache's
    own slots; output, lse and both caches bit for bit those of contiguous copies."""
    import cupy
    import cuflash

    dtype, b, hq, hkv, d, cap = "float16", 3, 16, 2, 128, 300
    q = _rand(rng, (b, 2, hq, d), dtype)
    buf = _rand(rng, (b, cap, 2, hkv, d), dtype)
    k_new, v_new = _rand(rng, (b, 2, hkv, d), dtype), _rand(rng, (b, 2, hkv, d), dtype)
    lens = cupy.asarray(np.array([0, 150, cap - 2], np.int32))
    kc, vc = buf[:, :, 0], buf[:, :, 1]
    kc2, vc2 = kc.copy(), vc.copy()
    got = cuflash.forward_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=lens, causal=True, return_lse=True)
    want = cuflash.forward_kvcache(q, kc2, vc2, k_new, v_new, cache_seqlens=lens, causal=True, return_lse=True)
    for name, a, b_ in (("out", got[0], want[0]), ("lse", got[1], want[1]), ("k_cache", kc, kc2), ("v_cache", vc, vc2)):
        assert np.array_equal(_bits(to_host(a)), _bits(to_host(b_))), name


# ---------------------------------------------------------------------------
# cuflash.combine


@pytest.mark.parametrize("dtype,splits", [("float32", 5), ("float32", 1), ("bfloat16", 4), ("float16", 3)])
def test_combine(rng, dtype, splits):
    """Random partial results with lse up to +-80 (exp overflows float32 there), splits that saw no key in
    whole or in part (lse -inf, their outs NaN), and a row that no split saw (out 0, lse -inf)."""
    import cupy
    import cuflash
    from cuflash.reference import combine_reference

    b, nq, h, d = 3, 4, 8, 128
    outs = _host(rng, (splits, b, nq, h, d), dtype)
    lses = rng.normal(0.0, 4.0, (splits, b, h, nq))
    lses[:, 0] += 80.0
    lses[:, 1, :4] -= 80.0
    lses = lses.astype(np.float32)
    if splits > 1:
        lses[1] = -np.inf
        outs[1] = np.nan
    lses[-1, 0, 2, :] = -np.inf
    outs[-1, 0, :, 2] = np.nan
    lses[:, 2, 5, 1] = -np.inf   # no split saw row 1 of head 5 in batch 2
    outs[:, 2, 1, 5] = np.nan
    ref_out, ref_lse = combine_reference(outs, lses)
    out, lse = cuflash.combine(cupy.asarray(outs), cupy.asarray(lses))
    assert out.shape == (b, nq, h, d) and out.dtype == outs.dtype
    assert_close_on_every_row("combine out", out, cupy.asarray(ref_out), dtype, FWD_TOL)
    assert_lse_matches(lse, ref_lse, (b, h, nq))


def test_combine_refuses_bad_shapes(rng):
    import cupy
    import cuflash

    outs = cupy.zeros((2, 1, 3, 4, 64), cupy.float32)
    with pytest.raises(ValueError, match="lses"):
        cuflash.combine(outs, cupy.zeros((2, 1, 3, 4), cupy.float32))   # (splits, batch, seqlen_q, heads)
    with pytest.raises(ValueError, match="lses"):
        cuflash.combine(outs, cupy.zeros((3, 1, 4, 3), cupy.float32))
    with pytest.raises((TypeError, ValueError), match="outs"):
        cuflash.combine(outs[0], cupy.zeros((1, 4, 3), cupy.float32))


@requires_gpu
def test_torch_flash_attn_with_kvcache_appends_in_place(rng):
    """cuflash.torch.flash_attn_with_kvcache (flash-attn 2's signature) on torch tensors: the same result as
    cuflash.forward_kvcache on the same data, the caches written in place, lse returned on request."""
    torch = pytest.importorskip("torch")
    import cupy
    import cuflash
    from cuflash.torch import flash_attn_with_kvcache

    b, cap, hq, hkv, d = 2, 192, 8, 2, 64
    dev = torch.device("cuda", cupy.cuda.Device().id)
    gen = torch.Generator(device=dev).manual_seed(7)
    mk = lambda *s: torch.randn(*s, generator=gen, device=dev, dtype=torch.bfloat16)
    q, k_cache, v_cache = mk(b, 2, hq, d), mk(b, cap, hkv, d), mk(b, cap, hkv, d)
    k, v = mk(b, 2, hkv, d), mk(b, 2, hkv, d)
    lens = torch.tensor([5, 150], dtype=torch.int32, device=dev)
    k0, v0 = k_cache.clone(), v_cache.clone()
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True,
                                       return_softmax_lse=True)
    for i, n in enumerate((5, 150)):
        assert torch.equal(k_cache[i, n:n + 2], k[i]) and torch.equal(v_cache[i, n:n + 2], v[i])
        assert torch.equal(k_cache[i, :n], k0[i, :n]) and torch.equal(k_cache[i, n + 2:], k0[i, n + 2:])
        assert torch.equal(v_cache[i, :n], v0[i, :n]) and torch.equal(v_cache[i, n + 2:], v0[i, n + 2:])
    ref_out, ref_lse = cuflash.forward_kvcache(cupy.from_dlpack(q), cupy.from_dlpack(k_cache),
                                               cupy.from_dlpack(v_cache), causal=True, return_lse=True,
                                               cache_seqlens=cupy.asarray([7, 152], dtype=np.int32))
    assert torch.equal(out, torch.from_dlpack(ref_out)) and torch.equal(lse, torch.from_dlpack(ref_lse))
    assert out.shape == (b, 2, hq, d) and lse.shape == (b, hq, 2)


@requires_gpu
def test_torch_flash_attn_with_kvcache_fp8(rng, decode_backend):
    """cuflash.torch.flash_attn_with_kvcache over torch.float8_e4m3fn caches with (batch, heads_kv) descales
    (FlashAttention-3's): the new tokens quantised into the caches in place, and the same output as
    cuflash.forward_kvcache on the caches' bytes after the append."""
    torch = pytest.importorskip("torch")
    import cupy
    import cuflash
    from cuflash.torch import flash_attn_with_kvcache

    if decode_backend == "sm90_tma":
        pytest.skip("fp8 caches take the cp.async ring whatever the backend: run under sm90")
    b, cap, hq, hkv, d = 2, 256, 8, 2, 128
    dev = torch.device("cuda", cupy.cuda.Device().id)
    gen = torch.Generator(device=dev).manual_seed(11)
    mk = lambda *s: torch.randn(*s, generator=gen, device=dev, dtype=torch.bfloat16)
    k_ds = torch.rand(b, hkv, generator=gen, device=dev) * 0.1 + 0.03
    v_ds = torch.rand(b, hkv, generator=gen, device=dev) * 0.1 + 0.03
    k_cache = (mk(b, cap, hkv, d).float() / k_ds[:, None, :, None]).to(torch.float8_e4m3fn)
    v_cache = (mk(b, cap, hkv, d).float() / v_ds[:, None, :, None]).to(torch.float8_e4m3fn)
    q, k, v = mk(b, 1, hq, d), mk(b, 1, hkv, d), mk(b, 1, hkv, d)
    lens = torch.tensor([100, 201], dtype=torch.int32, device=dev)
    k0 = k_cache.clone()
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True, k_descale=k_ds,
                                  v_descale=v_ds)
    for i, n in enumerate((100, 201)):
        want = (k[i, 0].float() * (1 / k_ds[i])[:, None]).to(torch.float8_e4m3fn)
        assert torch.equal(k_cache[i, n].view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(k_cache[i, :n].view(torch.uint8), k0[i, :n].view(torch.uint8))
    ref = cuflash.forward_kvcache(cupy.from_dlpack(q), cupy.from_dlpack(k_cache.view(torch.uint8)),
                                  cupy.from_dlpack(v_cache.view(torch.uint8)), causal=True,
                                  cache_seqlens=cupy.asarray([101, 202], dtype=np.int32),
                                  k_descale=cupy.from_dlpack(k_ds), v_descale=cupy.from_dlpack(v_ds))
    assert torch.equal(out, torch.from_dlpack(ref)) and out.shape == (b, 1, hq, d)


@pytest.mark.parametrize("name", ["contig-fp16-splits3-sinks-window-rotary", "paged16-bf16-splits3-q4-append1-causal"])
def test_split_merge_as_programmatic_dependent(rng, decode_backend, name):
    """On Hopper the split merge is launched while the decode kernel runs and waits for it on the device
    (griddepcontrol): the output and lse against the float64 reference, and a captured CUDA graph's replay bit for
    bit the eager call's."""
    import cupy
    import cuflash

    if decode_backend == "sm80":
        pytest.skip("programmatic dependent launch: Hopper's decode kernels")
    case = dict(CASES[name])
    num_splits = case.pop("num_splits")
    dev, ref, meta = _build(rng, **case)
    fresh = lambda: {k: (x.copy() if k in ("k_cache", "v_cache") else x) for k, x in dev.items()}
    _check(fresh(), ref, meta, num_splits)
    want_out, want_lse = cuflash.forward_kvcache(**fresh(), num_splits=num_splits, return_lse=True)
    graph_args = fresh()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        cuflash.forward_kvcache(**graph_args, num_splits=num_splits, return_lse=True)   # (warm-up: compiled)
        graph_args = fresh()
        stream.begin_capture()
        try:
            g_out, g_lse = cuflash.forward_kvcache(**graph_args, num_splits=num_splits, return_lse=True)
        finally:
            graph = stream.end_capture()
        graph.launch(stream)
    stream.synchronize()
    assert np.array_equal(_bits(to_host(g_out)), _bits(to_host(want_out)))
    assert np.array_equal(_bits(to_host(g_lse)), _bits(to_host(want_lse)))


@requires_gpu
def test_torch_flash_attn_with_kvcache_mla(rng, decode_backend):
    """cuflash.torch.flash_attn_with_kvcache with v_cache=None (MLA's latent cache, paged): the new latent rows
    appended in place, and the same output and lse as cuflash.forward_kvcache on the cache after the append."""
    torch = pytest.importorskip("torch")
    import cupy
    import cuflash
    from cuflash.torch import flash_attn_with_kvcache

    if decode_backend != "sm90":
        pytest.skip("one Hopper kernel serves the latent cache whatever the backend: run under sm90")
    b, page, pages, hq = 2, 64, 8, 16
    dev = torch.device("cuda", cupy.cuda.Device().id)
    gen = torch.Generator(device=dev).manual_seed(13)
    mk = lambda *s: torch.randn(*s, generator=gen, device=dev, dtype=torch.bfloat16)
    k_pages, q, k = mk(2 * pages, page, 1, 576), mk(b, 2, hq, 576), mk(b, 2, 1, 576)
    table = torch.randperm(2 * pages, generator=gen, device=dev).to(torch.int32).view(b, pages)
    lens = torch.tensor([70, 300], dtype=torch.int32, device=dev)
    before = k_pages.clone()
    out, lse = flash_attn_with_kvcache(q, k_pages, None, k, None, cache_seqlens=lens, block_table=table, causal=True,
                                       return_softmax_lse=True)
    for i, n in enumerate((70, 300)):
        for j in range(2):
            pg, slot = table[i, (n + j) // page], (n + j) % page
            assert torch.equal(k_pages[pg, slot], k[i, j])
            before[pg, slot] = k[i, j]
    assert torch.equal(k_pages, before)   # nothing else written
    ref_out, ref_lse = cuflash.forward_kvcache(cupy.from_dlpack(q), cupy.from_dlpack(k_pages), None, causal=True,
                                               cache_seqlens=cupy.asarray([72, 302], dtype=np.int32),
                                               block_table=cupy.from_dlpack(table), return_lse=True)
    assert out.shape == (b, 2, hq, 512)
    assert torch.equal(out, torch.from_dlpack(ref_out)) and torch.equal(lse, torch.from_dlpack(ref_lse))


@pytest.mark.parametrize("num_splits", [0, 3])
def test_cache_leftpad(rng, num_splits):
    """cache_leftpad (contiguous caches): each sequence's keys start at its pad (positions, rotary and the causal
    diagonal count from there), appends land at cache_seqlens; against the float64 reference, every row, and the
    caches after; refused with a block table."""
    import cupy
    import cuflash
    from cuflash.reference import attention_reference_kvcache

    b, cap, hq, hkv, d, nnew, nq = 3, 256, 8, 2, 64, 2, 3
    mk = lambda *s: cupy.asarray(rng.standard_normal(s).astype(np.float32)).astype(dtype_of("bfloat16"))
    q, kn, vn = mk(b, nq, hq, d), mk(b, nnew, hkv, d), mk(b, nnew, hkv, d)
    lens = np.array([40, 200, 7], np.int32)
    pads = np.array([13, 0, 7], np.int32)   # the last sequence: no cached key left, only the new ones
    ang = np.arange(cap + nq)[:, None] * 0.02 * np.arange(1, d // 2 + 1)[None]
    cos, sin = (cupy.asarray(f(ang).astype(np.float32)) for f in (np.cos, np.sin))
    kc, vc = mk(b, cap, hkv, d), mk(b, cap, hkv, d)
    k0, v0 = to_host(kc).astype(np.float64), to_host(vc).astype(np.float64)
    out, lse = cuflash.forward_kvcache(q, kc, vc, kn, vn, cache_seqlens=cupy.asarray(lens),
                                       cache_leftpad=cupy.asarray(pads), rotary_cos=cos, rotary_sin=sin,
                                       rotary_interleaved=False, causal=True, num_splits=num_splits, return_lse=True)
    ro, rl, rk, rv = attention_reference_kvcache(
        to_host(q), k0, v0, to_host(kn), to_host(vn), cache_seqlens=lens, cache_leftpad=pads,
        rotary_cos=to_host(cos), rotary_sin=to_host(sin), rotary_interleaved=False, causal=True,
        rotary_dtype=dtype_of("bfloat16"))
    assert_close_on_every_row("out", out, cupy.asarray(ro), "bfloat16", FWD_TOL)
    assert_lse_matches(lse, rl, (b, hq, nq), rtol=1e-3)
    np.testing.assert_array_equal(to_host(vc).astype(np.float64), rv)
    k_err = np.abs(to_host(kc).astype(np.float64) - rk)
    assert np.max(k_err) <= 2 ** -6 * max(1.0, float(np.max(np.abs(rk))))   # rotated keys: one bf16 ulp
    with pytest.raises(ValueError, match="cache_leftpad"):   # with a block table: refused, as flash-attn does
        cuflash.forward_kvcache(q, kc.reshape(-1, 64, hkv, d), vc.reshape(-1, 64, hkv, d),
                                cache_seqlens=cupy.asarray(lens), cache_leftpad=cupy.asarray(pads),
                                block_table=cupy.arange(b * cap // 64, dtype=np.int32).reshape(b, -1))


def test_empty_appends_and_queries(rng):
    """k / v with no new token append nothing; no query token still appends (and returns empty arrays)."""
    import cupy
    import cuflash

    mk = lambda *s: cupy.asarray(rng.standard_normal(s).astype(np.float32)).astype(dtype_of("float16"))
    kc, vc = mk(2, 64, 2, 64), mk(2, 64, 2, 64)
    k0 = kc.copy()
    lens = cupy.asarray(np.array([3, 10], np.int32))
    out = cuflash.forward_kvcache(mk(2, 1, 4, 64), kc, vc, mk(2, 0, 2, 64), mk(2, 0, 2, 64), cache_seqlens=lens)
    assert out.shape == (2, 1, 4, 64) and bool(cupy.isfinite(out).all()) and bool((kc == k0).all())
    kn, vn = mk(2, 2, 2, 64), mk(2, 2, 2, 64)
    out, lse = cuflash.forward_kvcache(mk(2, 0, 4, 64), kc, vc, kn, vn, cache_seqlens=lens, return_lse=True)
    assert out.shape == (2, 0, 4, 64) and lse.shape == (2, 4, 0)
    assert bool((kc[0, 3:5] == kn[0]).all()) and bool((vc[1, 10:12] == vn[1]).all())
    assert bool((kc[0, :3] == k0[0, :3]).all()) and bool((kc[0, 5:] == k0[0, 5:]).all())


# fp8 (e4m3) caches: the descales' four forms, paged and contiguous, appends, the variants whose score conversions
# take K's scale (softcap, ALiBi), split-KV; defaults as CASES'. Rotary with an fp8 cache is not in these cases.
FP8_CASES = {
    "contig-bf16-float-append1-causal": dict(dtype="bfloat16", nnew=1, causal=True, descale="float"),
    "paged64-fp16-heads-q4-append3-softcap": dict(page=64, nq=4, nnew=3, causal=True, softcap=30.0, descale="heads"),
    "paged16-bf16-one-element-alibi-window": dict(dtype="bfloat16", page=16, alibi="heads", causal=True,
                                                  window_size=(100, 0), descale="one"),
    "contig-bf16-batch-heads-d64-splits3-sinks-append1": dict(dtype="bfloat16", d=64, sinks=True, nnew=1,
                                                              num_splits=3, descale="batch_heads"),
    "contig-fp16-heads-dv64-q16-append3-causal": dict(dv=64, nq=16, nnew=3, causal=True, descale="heads"),
    "paged256-bf16-heads-d256-append1": dict(dtype="bfloat16", page=256, d=256, hq=4, nnew=1, descale="heads"),
}


SOFTWARE_E4M3_CASES = ("contig-bf16-float-append1-causal", "paged64-fp16-heads-q4-append3-softcap")


@pytest.fixture(params=[False, True], ids=["e4m3-instructions", "e4m3-software"])
def software(request):
    """The e4m3 conversions as instructions (sm_89+) or as common/e4m3.cuh's integer code (before sm_89; forced on
    newer GPUs by -DCUFLASH_SOFTWARE_E4M3); the latter for two cases (its code is the same for all)."""
    if request.param:
        from cuflash import options

        with options.override(nvrtc_defines=("-DCUFLASH_SOFTWARE_E4M3",)):
            yield True
    else:
        yield False


@pytest.mark.parametrize("name", list(FP8_CASES))
def test_fp8_cache(rng, decode_backend, name, software):
    """forward_kvcache over uint8 caches of e4m3 bytes with k_descale / v_descale: the appended keys and values
    stored as e4m3(x / descale) (bit for bit, nothing else in the caches changed), out and lse against the float64
    reference over the dequantised caches (each byte's e4m3 value times its KV head's descale; bf16 queries take
    fp16 products, each query row rescaled by a power of two); on the portable kernel too (the e4m3 instructions from
    compute capability 8.9, integer code before: ``software`` forces the latter on any GPU)."""
    if decode_backend == "sm90_tma":
        pytest.skip("fp8 caches take the cp.async ring whatever the backend: run under sm90")
    if software and name not in SOFTWARE_E4M3_CASES:
        pytest.skip("the software conversions run two cases")
    import cupy
    import cuflash
    import ml_dtypes
    from cuflash.reference import attention_reference_kvcache

    fp8 = ml_dtypes.float8_e4m3fn
    case = dict(FP8_CASES[name])
    kind, num_splits = case.pop("descale"), case.pop("num_splits", 0)
    dev, ref, meta = _build(rng, **case)
    lens, nnew, table, dtype = meta["lens"], meta["nnew"], meta["table"], meta["dtype"]
    batch, hkv = len(lens), dev["k_cache"].shape[2]
    # The descales as the call takes them, and per (sequence, KV head) as the host dequantises with them.
    if kind == "float":
        k_ds, v_ds = 0.06, 0.09
        k_bh, v_bh = np.full((batch, hkv), k_ds, np.float32), np.full((batch, hkv), v_ds, np.float32)
    elif kind == "one":
        k_bh, v_bh = np.full((batch, hkv), 0.07, np.float32), np.full((batch, hkv), 0.11, np.float32)
        k_ds, v_ds = cupy.asarray([0.07], np.float32), cupy.asarray([0.11], np.float32)
    elif kind == "heads":
        kh, vh = rng.uniform(0.03, 0.12, hkv).astype(np.float32), rng.uniform(0.03, 0.12, hkv).astype(np.float32)
        k_bh, v_bh = np.broadcast_to(kh, (batch, hkv)), np.broadcast_to(vh, (batch, hkv))
        k_ds, v_ds = cupy.asarray(kh), cupy.asarray(vh)
    else:   # (batch, heads_kv): contiguous caches, row b is sequence b
        k_bh, v_bh = (rng.uniform(0.03, 0.12, (batch, hkv)).astype(np.float32) for _ in range(2))
        k_ds, v_ds = cupy.asarray(k_bh), cupy.asarray(v_bh)
    # Each cache row's (page's) descales: a contiguous row is its sequence's, a page takes the per-head ones.
    k_rows = k_bh if table is None else np.broadcast_to(k_bh[0], (ref["k_cache"].shape[0], hkv))
    v_rows = v_bh if table is None else np.broadcast_to(v_bh[0], (ref["v_cache"].shape[0], hkv))
    k8 = (ref["k_cache"].astype(np.float32) / k_rows[:, None, :, None]).astype(fp8)
    v8 = (ref["v_cache"].astype(np.float32) / v_rows[:, None, :, None]).astype(fp8)
    dev.update(k_cache=cupy.asarray(k8.view(np.uint8)), v_cache=cupy.asarray(v8.view(np.uint8)))
    # What the append must store: e4m3(x * (1 / descale)) of the new tokens (float32, as the kernel computes it).
    written = _written_mask(dev["k_cache"].shape[:2], lens, nnew, meta["rows"], table, meta["page"])
    k8_after, v8_after = k8.copy(), v8.copy()
    for b in range(batch):
        for i in range(nnew):
            j = lens[b] + i
            r, s = (b, j) if table is None else (table[b, j // meta["page"]], j % meta["page"])
            inv_k, inv_v = np.float32(1) / k_bh[b], np.float32(1) / v_bh[b]
            k8_after[r, s] = (ref["k"][b, i].astype(np.float32) * inv_k[:, None]).astype(fp8)
            v8_after[r, s] = (ref["v"][b, i].astype(np.float32) * inv_v[:, None]).astype(fp8)
    out, lse = cuflash.forward_kvcache(**dev, k_descale=k_ds, v_descale=v_ds, num_splits=num_splits,
                                       return_lse=True)
    for cache_name, got, want in (("k_cache", dev["k_cache"], k8_after), ("v_cache", dev["v_cache"], v8_after)):
        got = to_host(got)
        assert got.dtype == np.uint8
        wrong = int((got != want.view(np.uint8)).any(axis=(-2, -1)).sum())
        assert wrong == 0, f"{cache_name}: {wrong} slots differ ({int(written.sum())} appended)"
    deq = dict(ref, k=None, v=None, cache_seqlens=lens + nnew,
               k_cache=k8_after.astype(np.float64) * k_rows[:, None, :, None],
               v_cache=v8_after.astype(np.float64) * v_rows[:, None, :, None])
    ref_out, ref_lse, _, _ = attention_reference_kvcache(**deq)
    assert out.shape == (batch, meta["nq"], meta["hq"], meta["dv"]) and out.dtype == dev["q"].dtype
    assert_close_on_every_row("out", out, cupy.asarray(ref_out), dtype, FWD_TOL)
    assert_lse_matches(lse, ref_lse, (batch, meta["hq"], meta["nq"]),
                       rtol=SOFTCAP_LSE_RTOL if meta["softcap"] else LSE_RTOL)


def test_fp8_cache_arguments_are_checked(rng, decode_backend):
    """Descales with a 16-bit cache, mixed forms, wrong shapes or dtypes, and an fp8 cache beside a 16-bit one are
    refused with errors naming them."""
    import cupy
    import cuflash

    if decode_backend != "sm90":
        pytest.skip("the checks run before the kernel choice: once is enough")
    q = _rand(rng, (2, 1, 8, 64), "bfloat16")
    k16 = _rand(rng, (2, 32, 2, 64), "bfloat16")
    k8 = cupy.zeros((2, 32, 2, 64), np.uint8)
    with pytest.raises(ValueError, match="k_descale apply to fp8 caches only"):
        cuflash.forward_kvcache(q, k16, k16, cache_seqlens=5, k_descale=0.5)
    with pytest.raises(TypeError, match="v_cache must hold fp8"):
        cuflash.forward_kvcache(q, k8, k16, cache_seqlens=5)
    with pytest.raises(ValueError, match="both arrays of one shape, or both floats"):
        cuflash.forward_kvcache(q, k8, k8, cache_seqlens=5, k_descale=0.5, v_descale=cupy.ones(2, np.float32))
    with pytest.raises(ValueError, match=r"k_descale must have one element, or shape \(heads_kv,\)"):
        cuflash.forward_kvcache(q, k8, k8, cache_seqlens=5, k_descale=cupy.ones(3, np.float32),
                                v_descale=cupy.ones(3, np.float32))
    with pytest.raises(TypeError, match="k_descale must be float32"):
        cuflash.forward_kvcache(q, k8, k8, cache_seqlens=5, k_descale=cupy.ones(2, np.float16),
                                v_descale=cupy.ones(2, np.float16))
    with pytest.raises(ValueError, match="v_descale must be positive"):
        cuflash.forward_kvcache(q, k8, k8, cache_seqlens=5, k_descale=0.5, v_descale=-1.0)


# float32 caches (the portable kernel's scalar products): every item once, against float64 at float32's bounds.
F32_CASES = {
    "contig-append1-causal": dict(dtype="float32", nnew=1, causal=True),
    "paged16-q4-append3-window-alibi": dict(dtype="float32", page=16, nq=4, nnew=3, causal=True, window_size=(40, 0),
                                            alibi="heads"),
    "contig-d64-splits3-sinks-softcap": dict(dtype="float32", d=64, num_splits=3, sinks=True, softcap=20.0, nnew=1),
    "paged64-dv64-q16-append2-rotary-neox": dict(dtype="float32", page=64, dv=64, nq=16, nnew=2, causal=True,
                                                 rotary="neox"),
    "contig-d256-batch-idx": dict(dtype="float32", d=256, hq=4, batch_idx=True, nnew=1),
}


@pytest.mark.parametrize("name", list(F32_CASES))
def test_float32_caches(rng, decode_backend, name):
    """float32 q and caches (the portable kernel on every GPU): out, lse and the caches after the append against the
    float64 reference at float32's bounds."""
    import cuflash
    from cuflash import options

    if decode_backend != "sm80":
        pytest.skip("float32 caches take the portable kernel whatever the backend: run under sm80")
    case = dict(F32_CASES[name])
    num_splits = case.pop("num_splits", 0)
    dev, ref, meta = _build(rng, **case)
    _check(dev, ref, meta, num_splits)


# MLA's latent cache (v_cache=None): head dim 576, V the first 512 columns of each K row, one KV head.
MLA_CASES = {
    "contig-bf16-q1-append1": dict(dtype="bfloat16", nnew=1),
    "paged64-fp16-q2-append2-causal": dict(page=64, nq=2, nnew=2, causal=True),
    "contig-bf16-splits3-window-sinks": dict(dtype="bfloat16", num_splits=3, causal=True, window_size=(200, 0),
                                             sinks=True),
    "paged16-bf16-q4-softcap": dict(dtype="bfloat16", page=16, nq=4, causal=True, softcap=20.0),
}


@pytest.mark.parametrize("name", list(MLA_CASES))
def test_mla_latent_cache(rng, decode_backend, name):
    """forward_kvcache(q, k_cache, None, k): 16 query heads over one 576-wide latent KV head, V the first 512 columns of
    the K rows (FlashMLA's layout): out (.., 512) and lse against the float64 reference given V as those columns, the
    new keys appended (their first 512 columns being the new values), nothing else in the cache changed. The
    portable kernel refuses it."""
    import cupy
    import cuflash
    from cuflash.reference import attention_reference_kvcache

    case = dict(MLA_CASES[name])
    num_splits = case.pop("num_splits", 0)
    dev, ref, meta = _build(rng, d=576, dv=512, hq=16, hkv=1, capacity=384, **case)
    dev = dict(dev, v_cache=None, v=None)
    if decode_backend == "sm80":
        with pytest.raises(ValueError, match="MLA"):
            cuflash.forward_kvcache(**dev)
        return
    if decode_backend != "sm90":
        pytest.skip("one Hopper kernel serves the latent cache whatever the backend: run under sm90")
    ref = dict(ref, v_cache=ref["k_cache"][..., :512].copy(), v=None if ref["k"] is None else ref["k"][..., :512].copy())
    ref_out, ref_lse, ref_k, _ = attention_reference_kvcache(**ref)
    k_before = to_host(dev["k_cache"]).copy()
    out, lse = cuflash.forward_kvcache(**dev, num_splits=num_splits, return_lse=True)
    batch = len(meta["lens"])
    assert out.shape == (batch, meta["nq"], 16, 512) and out.dtype == dev["q"].dtype
    assert_close_on_every_row("out", out, cupy.asarray(ref_out), meta["dtype"], FWD_TOL)
    assert_lse_matches(lse, ref_lse, (batch, 16, meta["nq"]),
                       rtol=SOFTCAP_LSE_RTOL if meta["softcap"] else LSE_RTOL)
    written = _written_mask(dev["k_cache"].shape[:2], meta["lens"], meta["nnew"], meta["rows"], meta["table"],
                            meta["page"])
    _assert_cache("k_cache", dev["k_cache"], k_before, ref_k, written, meta["dtype"], False)
