"""CPU tests of the attention-variant table (cuflash/bench_variants.py): its FLOP accounting (visible pairs,
visited 128 x 128 tiles) against brute-force counts over the whole score matrix for every kind of variant, the
rows' figures, which peer has which variant, the tables, and the command line of ``python -m cuflash --variants``."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cuflash import bench_variants as bv
from cuflash.__main__ import parse_args, table_shapes
from cuflash.bench import Shape
from cuflash.bench_variants import Variant


def _brute_visible(nq, nk, var: Variant) -> np.ndarray:
    """Element by element, from the definitions (flash-attn's bottom-right alignment)."""
    out = np.zeros((nq, nk), bool)
    left, right = var.window
    if var.causal:
        right = 0
    for i in range(nq):
        p = i + nk - nq
        for j in range(nk):
            ok = (right < 0 or j <= p + right) and (left < 0 or j >= p - left)
            if var.chunk:
                ok &= math.floor(j / var.chunk) == math.floor(p / var.chunk)
            out[i, j] = ok
    return out


def _brute_tiles(vis: np.ndarray, bm: int, bn: int) -> int:
    """Per query tile, the span from the first to the last key tile with a visible pair (0 if none)."""
    nq, nk = vis.shape
    total = 0
    for m in range(-(-nq // bm)):
        seen = [n for n in range(-(-nk // bn)) if vis[m * bm:(m + 1) * bm, n * bn:(n + 1) * bn].any()]
        if seen:
            total += seen[-1] - seen[0] + 1
    return total


VARIANTS = [
    Variant(), Variant(causal=True), Variant(causal=True, window=(5, 0)), Variant(causal=True, window=(0, 0)),
    Variant(window=(3, 2)), Variant(window=(-1, 4)), Variant(window=(6, -1)), Variant(window=(0, 0)),
    Variant(causal=True, window=(100, 0)), Variant(causal=True, chunk=8), Variant(chunk=5),
    Variant(causal=True, window=(3, 0), chunk=8), Variant(window=(2, 3), chunk=6), Variant(causal=True, chunk=64),
    Variant(causal=True, softcap=30.0), Variant(causal=True, alibi=True),
    Variant(causal=True, window=(4, 0), sinks=True),
]


@pytest.mark.parametrize("nq,nk", [(37, 37), (20, 45), (45, 20), (1, 30), (30, 1), (64, 64), (33, 32)])
@pytest.mark.parametrize("var", VARIANTS, ids=lambda v: v.label().replace(" ", ""))
def test_accounting_matches_brute_force(nq, nk, var):
    vis = _brute_visible(nq, nk, var)
    assert bv.visible_pairs(nq, nk, var) == int(vis.sum())
    for bm, bn in ((4, 4), (8, 8), (16, 4), (4, 16), (128, 128), (3, 5)):
        assert bv.visited_tiles(nq, nk, var, bm, bn) == _brute_tiles(vis, bm, bn), (bm, bn)


@pytest.mark.parametrize("nq,nk", [(300, 300), (300, 700), (700, 300), (129, 257)])
@pytest.mark.parametrize("var", [Variant(causal=True), Variant(causal=True, window=(64, 0)),
                                 Variant(causal=True, chunk=128), Variant(causal=True, window=(40, 0), chunk=96),
                                 Variant(window=(100, 30)), Variant(chunk=200)], ids=lambda v: v.label())
def test_accounting_at_128_tiles(nq, nk, var):
    from cuflash.reference import visible_mask

    vis = visible_mask(nq, nk, var.causal, var.window, var.chunk)
    assert np.array_equal(vis, _brute_visible(nq, nk, var)) if nq * nk <= 90000 else True
    assert bv.visible_pairs(nq, nk, var) == int(vis.sum())
    assert bv.visited_tiles(nq, nk, var) == _brute_tiles(vis, 128, 128)


def test_visited_tiles_are_those_with_a_visible_pair_here():
    """The visible keys of a query tile are contiguous, so the policy's span is every tile with a visible pair."""
    for var in VARIANTS:
        vis = _brute_visible(50, 70, var)
        tiles = sum(vis[m * 8:(m + 1) * 8, n * 8:(n + 1) * 8].any() for m in range(7) for n in range(9))
        assert bv.visited_tiles(50, 70, var, 8, 8) == tiles, var


def test_closed_forms_at_the_table_sizes():
    n = 8192
    t = n // 128
    assert bv.visible_pairs(n, n, Variant(causal=True)) == n * (n + 1) // 2
    assert bv.visited_tiles(n, n, Variant(causal=True)) == t * (t + 1) // 2 == 2080
    assert bv.visited_tiles(n, n, Variant()) == t * t
    assert bv.visible_pairs(n, n, Variant()) == n * n
    w = Variant(causal=True, window=(1024, 0))
    assert bv.visible_pairs(n, n, w) == sum(min(i + 1, 1025) for i in range(n))
    assert bv.visited_tiles(n, n, w) == sum(min(m + 1, 9) for m in range(t)) == 540
    g = Variant(causal=True, window=(128, 0), sinks=True)
    assert bv.visited_tiles(n, n, g) == 1 + 2 * (t - 1)
    c = Variant(causal=True, chunk=8192)
    n4 = 32768
    assert bv.visible_pairs(n4, n4, c) == 4 * 8192 * 8193 // 2
    assert bv.visited_tiles(n4, n4, c) == 4 * 2080
    # nothing visible: tiles and pairs 0
    assert bv.visible_pairs(4, 100, Variant(causal=True, window=(0, 0), chunk=1)) == 4
    assert bv.visited_tiles(10, 5, Variant(causal=True)) == 1
    assert bv.visible_pairs(0, 5, Variant()) == 0 and bv.visited_tiles(5, 0, Variant()) == 0


def test_work_and_flops():
    s = Shape(4, 16, 8192, 128, "bfloat16", True)
    w = bv.work(s, Variant(causal=True, window=(1024, 0)))
    assert w.tile_flops == 4.0 * 128 * 4 * 16 * 540 * 128 * 128
    assert w.useful_flops == 4.0 * 128 * 4 * 16 * w.pairs
    r = bv.CaseResult("x", "s", "v", "normal", "fwd+bwd", w, bv.work(s, Variant(causal=True)),
                      ms={"cuflash": 2.0, "cuflash_plain": 4.0, "fa4": 3.0, "cudnn": 2.5})
    assert r.tile_tflops() == pytest.approx(3.5 * w.tile_flops / 2e-3 / 1e12)
    assert r.useful_tflops() == pytest.approx(3.5 * w.useful_flops / 2e-3 / 1e12)
    assert r.fastest_peer() == "cudnn" and r.vs_peer() == pytest.approx(1.25)
    assert r.vs_plain() == pytest.approx((540 / 2.0) / (2080 / 4.0))
    r.check = {"cudnn": 0.5, "fa4": 0.004}   # cuDNN's output differs: left out of the comparison, and a failure
    assert r.fastest_peer() == "fa4" and r.vs_peer() == pytest.approx(1.5)
    assert bv.failures([r]) == ["x [normal] fwd+bwd: cudnn's output differs from cuflash's by 0.5"]
    r.na["cuflash"] = "FAILED RuntimeError: x"
    assert len(bv.failures([r])) == 2


def test_rows():
    assert bv.ROW_NAMES == ("window8k", "window16k", "softcap-causal", "softcap", "alibi", "gpt-oss", "gpt-oss-gqa",
                            "chunk")
    for row in bv.VARIANT_ROWS:
        assert (row.shape.head_dim, row.shape.dtype) == (128, "bfloat16")
        assert row.shape.causal == row.variant.causal
        assert not row.variant.is_plain and row.variant.plain.is_plain
    gqa = bv.rows_by_name(["gpt-oss-gqa"])[0]
    assert (gqa.shape.heads, gqa.shape.hkv) == (64, 8)
    chunk = bv.rows_by_name(["chunk"])[0]
    assert (chunk.shape.batch, chunk.shape.seqlen, chunk.variant.chunk) == (2, 32768, 8192)
    with pytest.raises(ValueError, match="nope"):
        bv.rows_by_name(["window8k", "nope"])
    assert "causal" not in bv.VARIANT_ROWS[0].label().split(",")[0]


def test_which_peer_has_which_variant():
    assert bv.static_na("fa4", Variant(causal=True, window=(1024, 0))) is None
    assert bv.static_na("fa4", Variant(causal=True, softcap=30.0)) is None
    assert bv.static_na("fa4", Variant(causal=True, window=(128, 0), sinks=True)) is None
    assert "alibi" in bv.static_na("fa4", Variant(causal=True, alibi=True))
    assert "chunk" in bv.static_na("fa4", Variant(causal=True, chunk=8192))
    assert bv.static_na("cudnn", Variant(causal=True, window=(1024, 0))) is None
    assert bv.static_na("cudnn", Variant(causal=True, alibi=True)) is None
    assert bv.static_na("cudnn", Variant(softcap=30.0)) is None
    assert "score_mod" in bv.static_na("cudnn", Variant(causal=True, softcap=30.0))
    assert "chunk" in bv.static_na("cudnn", Variant(causal=True, chunk=8192))
    assert bv.static_na("sdpa_cudnn", Variant(causal=True)) is None
    assert bv.static_na("sdpa_cudnn", Variant(causal=True, alibi=True))
    with pytest.raises(ValueError):
        bv.static_na("xformers", Variant())


def test_adapters_are_none_without_their_libraries():
    pytest.importorskip("cupy")
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        has_cuda = False
    if not has_cuda:
        assert bv.fa4_adapter() is None and bv.cudnn_adapter() is None


def test_operands():
    s = bv.alibi_slopes_host(16)
    assert s.dtype == np.float32 and s.shape == (16,)
    assert np.allclose(s, [2.0 ** (-8 * (h + 1) / 16) for h in range(16)])
    assert bv.alibi_slopes_host(12).shape == (12,)
    sinks = bv.sinks_host(64)
    from cuflash._checks import BFLOAT16

    assert np.array_equal(sinks, sinks.astype(BFLOAT16).astype(np.float32))   # exact in bf16, as FA4 takes them
    assert bv.mask_variant(Variant(causal=True)).plain
    mv = bv.mask_variant(Variant(causal=True, window=(128, 0), sinks=True))
    assert mv.local and mv.sink and not mv.softcap and not mv.alibi
    assert bv.mask_variant(Variant(causal=True, window=(-1, 0))).plain   # causal's own right bound
    assert bv.mask_variant(Variant(softcap=30.0)).softcap


def _fake_results():
    s = Shape(4, 16, 8192, 128, "bfloat16", True)
    var = Variant(causal=True, chunk=8192)
    out = []
    for p, ms in (("fwd", 1.0), ("fwd+bwd", 3.0)):
        r = bv.CaseResult("chunk", "B=4 H=16 N=8192 D=128 bfloat16", var.label(), "normal", p, bv.work(s, var),
                          bv.work(s, var.plain), ms={"cuflash": ms, "cuflash_plain": ms, "sdpa_cudnn": ms * 1.2})
        r.na = {"fa4": bv.static_na("fa4", var), "cudnn": bv.static_na("cudnn", var)}
        out.append(r)
    return out


def test_tables_and_json():
    import json

    res = _fake_results()
    text = bv.format_table(res)
    assert "n/a" in text and "FA4's flash_attn_func has no attention_chunk" in text and "128x128" in text
    md = bv.markdown_table(res)
    assert md.splitlines()[0].startswith("| row | dist | pass | cuflash ms")
    assert md.count("| chunk | normal |") == 2
    j = json.loads(json.dumps([r.to_json() for r in res]))
    assert j[1]["pass"] == "fwd+bwd" and j[1]["tiles_per_head"] == 2080 and j[1]["fastest_peer"] is None
    assert j[0]["vs_plain_tiles"] == pytest.approx(1.0)


def test_command_line():
    a = parse_args(["--variants"])
    assert a.rows == bv.ROW_NAMES and a.dists == bv.DEFAULT_DISTS
    a = parse_args(["--variants", "--quick"])
    assert a.rows == bv.QUICK_ROWS and a.dists == ("normal",)
    a = parse_args(["--variants", "--rows", "alibi, chunk", "--dists", "sharp,sink", "--repeats", "7", "--markdown",
                    "--json", "x.json", "--forward-only"])
    assert a.rows == ("alibi", "chunk") and a.dists == ("sharp", "sink") and a.repeats == 7
    assert a.markdown and a.json == "x.json" and a.forward_only
    assert [s.seqlen for s in table_shapes(a)] == [8192, 32768]
    a = parse_args([])
    assert not a.variants and a.rows is None and a.dists is None
    for bad in (["--variants", "--rows", "window8k,nope"], ["--rows", "alibi"],
                ["--variants", "--shape", "4,16,4096,128,bfloat16"], ["--variants", "--dists", "gauss"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_kernel_configs_cover_variant_and_plain():
    pytest.importorskip("cupy")
    cfgs = bv.kernel_configs(90, bv.rows_by_name(["window8k"]))
    keys = [c.key() for c in cfgs]
    assert len(keys) == len(set(keys)) and len(cfgs) >= 2
    assert any(c.variant.local for c in cfgs) and any(c.variant.plain for c in cfgs)
