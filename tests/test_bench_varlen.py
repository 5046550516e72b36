"""The varlen table (cuflash/bench_varlen.py, issue #43's bar): on the CPU its lengths draw, FLOP accounting against
brute-force counts, ratios and the bar, the tables with fake results, how failures and missing peers are recorded,
the kernels it precompiles and the command line of ``python -m cuflash --varlen``; on a GPU one tiny run end to end
(cuflash varlen beside cuflash dense, with a stand-in peer and a failing one)."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from bench_checks import run_table
from conftest import requires_gpu
from cuflash import bench_report
from cuflash import bench_varlen as bvl
from cuflash.__main__ import parse_args, table_shapes
from cuflash.bench import PASS_FLOPS
from cuflash.bench_varlen import VarlenResult, VarlenRow


# ---------------------------------------------------------------------------
# Lengths and rows


def test_lengths_are_the_issues_draw():
    ls = bvl.draw_lengths()
    assert np.array_equal(ls, np.random.default_rng(bvl.SEED).integers(128, 8193, 64))
    assert np.array_equal(ls, bvl.draw_lengths()) and ls.dtype == np.int64 and ls.shape == (64,)
    assert ls.min() >= 128 and ls.max() <= 8192
    row = bvl.rows_by_name(["varlen"])[0]
    assert np.array_equal(row.lengths(), ls)
    assert not np.array_equal(bvl.draw_lengths(seed=bvl.SEED + 1), ls)
    assert np.array_equal(bvl.draw_lengths(5, 7, 7), [7] * 5)   # both bounds included
    for bad in ((0, 1, 2), (3, 0, 2), (3, 5, 4)):
        with pytest.raises(ValueError):
            bvl.draw_lengths(*bad)


def test_offsets():
    off = bvl.offsets([3, 1, 4])
    assert off.dtype == np.int32 and off.tolist() == [0, 3, 4, 8]
    assert bvl.offsets([]).tolist() == [0]
    with pytest.raises(ValueError):
        bvl.offsets([2**30, 2**30])


def test_rows():
    assert bvl.DEFAULT_ROWS == ("varlen", "varlen-causal")
    a, b = bvl.rows_by_name(bvl.DEFAULT_ROWS)
    assert not a.causal and b.causal
    for r in (a, b):
        assert (r.batch, r.min_len, r.max_len, r.heads, r.heads_kv, r.head_dim, r.dtype) == \
            (64, 128, 8192, 16, 16, 128, "bfloat16")
    g = bvl.rows_by_name(["varlen-gqa"])[0]
    assert g.heads % g.heads_kv == 0 and g.heads_kv < g.heads and "Hkv=" in g.label()
    with pytest.raises(ValueError, match="nope"):
        bvl.rows_by_name(["varlen", "nope"])
    with pytest.raises(ValueError):
        VarlenRow("x", False, heads=6, heads_kv=4)


def test_dense_shape_has_the_same_tokens_at_the_mean_length():
    for row in bvl.VARLEN_ROWS:
        s = row.dense_shape()
        ls = row.lengths()
        assert (s.batch, s.heads, s.hkv, s.head_dim, s.dtype, s.causal) == \
            (row.batch, row.heads, row.heads_kv, row.head_dim, row.dtype, row.causal)
        assert s.seqlen == round(ls.mean()) and abs(s.batch * s.seqlen - ls.sum()) <= row.batch / 2
    tiny = VarlenRow("t", True, batch=2, min_len=1, max_len=1)
    assert tiny.mean_len() == 1 and tiny.dense_shape().seqlen == 1


def test_overrides():
    over = bvl.parse_overrides("B=8, lens=100:300,H=4,Hkv=2,D=64,seed=7,dtype=float16")
    assert over == {"batch": 8, "min_len": 100, "max_len": 300, "heads": 4, "heads_kv": 2, "head_dim": 64,
                    "seed": 7, "dtype": "float16"}
    assert bvl.parse_overrides("lens=5-9") == {"min_len": 5, "max_len": 9}
    assert bvl.parse_overrides("") == {}
    for bad in ("B", "X=3", "B=two", "lens=5", "dtype=float32"):
        with pytest.raises(ValueError):
            bvl.parse_overrides(bad)
    base = bvl.rows_by_name(["varlen-causal"])[0]
    r = bvl.apply_overrides(base, bvl.parse_overrides("B=3,H=4"))
    assert (r.batch, r.heads, r.heads_kv, r.causal, r.name) == (3, 4, 4, True, "varlen-causal")   # MHA stays MHA
    g = bvl.apply_overrides(bvl.rows_by_name(["varlen-gqa"])[0], {"heads": 8})
    assert (g.heads, g.heads_kv) == (8, 4)
    with pytest.raises(ValueError):
        bvl.apply_overrides(base, {"min_len": 10, "max_len": 5})
    rows = bvl.rows_from_args(("varlen", "varlen-causal"), "B=2,lens=16:32")
    assert [(r.batch, r.max_len) for r in rows] == [(2, 32), (2, 32)]


# ---------------------------------------------------------------------------
# FLOPs


def _brute_pairs(nq: int, nk: int, causal: bool) -> int:
    """Element by element: query i sees key j unless causal and j > i + nk - nq (bottom-right alignment)."""
    return sum(1 for i in range(nq) for j in range(nk) if not causal or j <= i + nk - nq)


@pytest.mark.parametrize("causal", [False, True])
def test_pairs_against_brute_force(causal):
    rng = np.random.default_rng(1)
    lq = rng.integers(0, 40, 12)
    lk = rng.integers(0, 40, 12)
    assert bvl.pairs_per_head(lq, lk, causal) == sum(_brute_pairs(int(a), int(b), causal) for a, b in zip(lq, lk))
    ls = bvl.draw_lengths(7, 1, 60, seed=3)
    assert bvl.pairs_per_head(ls, ls, causal) == sum(_brute_pairs(int(n), int(n), causal) for n in ls)
    closed = sum(int(n) * (int(n) + 1) // 2 if causal else int(n) ** 2 for n in ls)
    assert bvl.pairs_per_head(ls, ls, causal) == closed


def test_work():
    for row in bvl.VARLEN_ROWS[:2]:
        w = bvl.work(row)
        ls = row.lengths()
        n = row.mean_len()
        per = (lambda x: x * (x + 1) // 2) if row.causal else (lambda x: x * x)
        assert w.pairs == sum(per(int(x)) for x in ls)
        assert w.dense_pairs == row.batch * per(n)
        assert w.useful_flops == 4.0 * 128 * 16 * w.pairs and w.dense_flops == 4.0 * 128 * 16 * w.dense_pairs
    # ~12.5 TFLOP per non-causal forward of the issue's batch, about half that causal
    assert 12e12 < bvl.work(bvl.VARLEN_ROWS[0]).useful_flops < 13e12
    assert 6e12 < bvl.work(bvl.VARLEN_ROWS[1]).useful_flops < 6.5e12
    assert PASS_FLOPS["fwd+bwd"] == 3.5


# ---------------------------------------------------------------------------
# Results, the bar, tables


def _result(pass_name="fwd", ms=None, **kw) -> VarlenResult:
    row = VarlenRow("small", False, batch=4, min_len=10, max_len=20)
    return VarlenResult(row.name, row.label(), "normal", pass_name, bvl.work(row), ms=dict(ms or {}),
                        desc=bvl.describe(row), **kw)


def test_ratios_and_bar():
    w = _result().work
    r = _result("fwd+bwd", {"cuflash": 2.0, "dense": 1.5, "fa4": 3.0, "cudnn": 2.5})
    assert r.tflops() == pytest.approx(3.5 * w.useful_flops / 2e-3 / 1e12)
    assert r.tflops("dense") == pytest.approx(3.5 * w.dense_flops / 1.5e-3 / 1e12)
    assert r.vs_dense() == pytest.approx((w.useful_flops / 2.0) / (w.dense_flops / 1.5))
    assert r.vs("fa4") == pytest.approx(1.5) and r.vs("cudnn") == pytest.approx(1.25)
    assert r.fastest_peer() == "cudnn" and r.vs_peer() == pytest.approx(1.25)

    def bar(cuflash, dense, peer=None):
        ms = {"cuflash": cuflash, "dense": dense}
        if peer:
            ms["fa4"] = peer
        x = _result("fwd", ms)
        x.work = bvl.Work(100, 100, 1.0, 1.0)   # the same FLOPs: varlen/dense = dense ms / cuflash ms
        return x.bar()

    assert bar(1.0, 0.95, 1.1) == "met"
    assert bar(1.0, 0.95) == "met vs dense (no peer ran)"
    assert bar(1.0, 0.85, 1.1).startswith("NOT met (varlen/dense 0.85")
    assert "x fa4 1.02 < 1.05" in bar(1.0, 1.0, 1.02)
    assert _result("fwd", {"cuflash": 1.0}).bar() == "-"
    # a peer whose output differs: out of the ratios, and a failure
    r.check = {"cudnn": 0.5, "fa4": 0.003, "dense": 0.001}
    assert r.vs("cudnn") is None and r.fastest_peer() == "fa4" and r.vs_peer() == pytest.approx(1.5)
    assert bvl.failures([r]) == ["small [normal]: cudnn's output differs from cuflash varlen's by 0.5"]
    r.na["cuflash"] = "FAILED RuntimeError: x"
    assert len(bvl.failures([r])) == 2
    f = _result("fwd", {"cuflash": 1.0, "cuflash_checked": 1.3, "cuflash_unchecked": 1.0})
    assert f.check_overhead() == pytest.approx(0.3)


def _fake_results():
    out = []
    for p, ms in (("fwd", 1.0), ("fwd+bwd", 3.0)):
        r = _result(p, {"cuflash": ms, "dense": ms * 0.9, "fa4": ms * 1.2})
        r.na["cudnn"] = "cuDNN ragged: not implemented"
        r.check = {"fa4": 4e-3, "dense": 1e-3}
        if p == "fwd":
            r.ms.update({"cuflash_checked": 1.25, "cuflash_unchecked": 1.0})
        out.append(r)
    return out


def test_tables_and_json():
    res = _fake_results()
    md = bvl.markdown_table(res, "varlen table (issue #43): H200 (sm_90), 2026-01-01, commit abc")
    lines = md.splitlines()
    assert lines[0].startswith("varlen table (issue #43)")
    assert lines[2].startswith("| row | dist | pass | cuflash ms | cuflash TF/s | dense ms")
    body = [x for x in lines if x.startswith("| small | normal |")]
    assert len(body) == 2 and "| n/a |" in body[0] and "| 1.20 |" in body[0]   # cudnn n/a, cuflash/fa4 1.20
    assert "cudnn n/a: cuDNN ragged: not implemented" in md
    assert "check_offsets=True forward 1.250 ms vs 1.000 ms unchecked: +0.250 ms (+25.0 %)" in md
    assert "fa4 4.00e-03" in md and "dense 1.00e-03" in md and "~U[10, 20] seed 43" in md
    text = bvl.format_table(res)
    assert "cuDNN ragged: not implemented" in text and "varlen/dense" in text
    assert len(text.splitlines()[0]) == len(text.splitlines()[1])   # aligned columns
    j = json.loads(json.dumps([r.to_json() for r in res]))
    assert j[1]["pass"] == "fwd+bwd" and j[1]["fastest_peer"] == "fa4" and j[0]["check_offsets_overhead_ms"] == 0.25
    assert j[0]["vs"]["cudnn"] is None and j[0]["na"]["cudnn"].startswith("cuDNN ragged")
    failed = _result("fwd", {"dense": 1.0})
    failed.na["cuflash"] = "FAILED RuntimeError: boom"
    assert "| FAILED |" in bvl.markdown_table([failed])


def test_header_names_device_date_commit(monkeypatch):
    monkeypatch.setattr(bench_report, "git_commit", lambda: "deadbee")
    h = bvl.header("NVIDIA H200", 90, 10, 2)
    assert h.startswith("varlen table (issue #43): NVIDIA H200 (sm_90), 20") and "commit deadbee" in h
    assert "10 interleaved repeats" in h
    monkeypatch.undo()
    c = bench_report.git_commit()   # a sha in a checkout, "unknown (...)" in a copy without .git
    assert c.startswith("unknown (") or len(c.split("+")[0]) >= 7


def test_rel_diff_in_chunks_and_bfloat16(monkeypatch):
    """rel_diff's arithmetic, with NumPy standing in for CuPy (the same calls): bfloat16 read from its bits, chunks
    of rows summed, torch tensors through DLPack."""
    import sys

    ml_dtypes = pytest.importorskip("ml_dtypes")
    try:
        import torch   # before CuPy is stood in for: importing torch may look for CuPy
    except ImportError:
        torch = None
    monkeypatch.setitem(sys.modules, "cupy", np)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((37, 3, 8)).astype(np.float32)
    b = a + 0.01 * rng.standard_normal(a.shape).astype(np.float32)
    want = np.linalg.norm((a - b).ravel().astype(np.float64)) / np.linalg.norm(b.ravel().astype(np.float64))
    assert bvl.rel_diff(a, b) == pytest.approx(want, rel=1e-6)
    assert bvl.rel_diff(a, b, rows=5) == pytest.approx(want, rel=1e-6)
    ab, bb = a.astype(ml_dtypes.bfloat16), b.astype(ml_dtypes.bfloat16)
    want16 = (np.linalg.norm((ab.astype(np.float64) - bb.astype(np.float64)).ravel())
              / np.linalg.norm(bb.astype(np.float64).ravel()))
    assert bvl.rel_diff(ab, bb, rows=4) == pytest.approx(want16, rel=1e-6)
    assert bvl.rel_diff(a, a) == 0.0 and bvl.rel_diff(a, b[:-1]) == float("inf")
    assert bvl.rel_diff(a[:0], b[:0]) == 0.0
    bad = a.copy()
    bad[3, 1, 2] = np.nan
    assert not bvl.rel_diff(bad, b) <= 1.0
    if torch is not None:
        assert bvl.rel_diff(torch.from_numpy(a).to(torch.bfloat16), bb, rows=7) == pytest.approx(
            bvl.rel_diff(ab, bb), rel=1e-6, abs=1e-9)


# ---------------------------------------------------------------------------
# Peers: missing or broken ones are recorded, never raised


def test_peer_adapters_record_why(monkeypatch):
    def broken():
        raise RuntimeError("DSL exploded")

    monkeypatch.setattr(bvl, "fa4_varlen_adapter", broken)
    monkeypatch.setattr(bvl, "cudnn_ragged_adapter", lambda: (None, "cuDNN ragged: not implemented"))
    ad = bvl.peer_adapters()
    assert ad["fa4"] == (None, "RuntimeError: DSL exploded")
    assert ad["cudnn"] == (None, "cuDNN ragged: not implemented")


def test_adapters_without_their_libraries():
    pytest.importorskip("cupy")
    for make in (bvl.fa4_varlen_adapter, bvl.cudnn_ragged_adapter):
        build, why = make()
        assert (build is None) != (why is None)
        if build is None:
            assert isinstance(why, str) and why


def _fake_device(monkeypatch, *, fail_timing=(), cuflash_raises=False):
    """benchmark_case's device work replaced by host stand-ins: numpy inputs, callables that count their calls,
    a timer that gives each implementation a fixed median (or raises for those in ``fail_timing``)."""
    from cuflash import bench, distributions

    calls = []
    medians = {"cuflash": 2.0, "dense": 1.8, "fa4": 2.4, "cudnn": 2.2, "cuflash_checked": 2.5,
               "cuflash_unchecked": 2.0}

    def packed(row, dist, seed=0):
        ls = row.lengths()
        off = bvl.offsets(ls)
        q = np.zeros((int(off[-1]), row.heads, row.head_dim), np.float32)
        return bvl.Packed(ls, off, off, int(ls.max()), q, q[:, :row.heads_kv], q[:, :row.heads_kv], q)

    def varlen_fns(p, causal, passes=bvl.VARLEN_PASSES, check_offsets=False):
        if cuflash_raises:
            raise RuntimeError("no kernel")
        fns = {ps: (lambda ps=ps: calls.append(("cuflash", ps, check_offsets))) for ps in passes}
        fns["_out"] = p.q
        return fns

    def timer(fns, warmup=0, repeats=0):
        for name, f in fns.items():
            if name in fail_timing:
                raise RuntimeError(f"{name} died")
            f()
        return {name: medians[name if isinstance(name, str) else name[0]] for name in fns}

    monkeypatch.setattr(bvl, "packed_inputs", packed)
    monkeypatch.setattr(bvl, "cuflash_varlen_fns", varlen_fns)
    monkeypatch.setattr(bvl, "_sync", lambda: None)
    monkeypatch.setattr(bvl, "free_memory", lambda: None)
    monkeypatch.setattr(bvl, "rel_diff", lambda a, b: 0.5 if isinstance(a, str) else 1e-3)
    monkeypatch.setattr(bvl, "dense_check", lambda p, out, causal: 2e-3)
    monkeypatch.setattr(distributions, "make_inputs", lambda shape, dist, seed=0: (None, None, None))
    monkeypatch.setattr(bench, "random_inputs", lambda shape, seed=0: (None,))
    monkeypatch.setattr(bench, "cuflash_pass_fns", lambda q, k, v, causal, dout, passes: {
        ps: (lambda ps=ps: calls.append(("dense", ps))) for ps in passes})
    monkeypatch.setattr(bench, "time_interleaved", timer)
    return calls


def _peers(fa4_out="same"):
    def fa4(row, p, passes):   # forward only; its backward "raised"
        return {"fwd": lambda: None, "_out": p.q if fa4_out == "same" else "other", "_why": {"fwd+bwd": "bwd: no"}}

    def cudnn(row, p, passes):
        raise RuntimeError("ragged layout refused")

    return {"fa4": (fa4, None), "cudnn": (cudnn, None)}


def test_case_records_peers_checks_and_overhead_on_the_host(monkeypatch):
    calls = _fake_device(monkeypatch)
    row = VarlenRow("small", True, batch=4, min_len=10, max_len=20)
    logs = []
    fwd, fb = bvl.benchmark_case(row, "sink", repeats=3, warmup=1, adapters=_peers(), log=logs.append)
    assert (fwd.pass_name, fb.pass_name, fwd.dist) == ("fwd", "fwd+bwd", "sink")
    assert fwd.ms == {"cuflash": 2.0, "dense": 1.8, "fa4": 2.4, "cuflash_checked": 2.5, "cuflash_unchecked": 2.0}
    assert fb.ms == {"cuflash": 2.0, "dense": 1.8}
    assert fwd.na == {"cudnn": "RuntimeError: ragged layout refused"}
    assert fb.na == {"cudnn": "RuntimeError: ragged layout refused", "fa4": "bwd: no"}
    assert fwd.check == fb.check == {"fa4": 1e-3, "dense": 2e-3}
    assert fwd.vs("fa4") == pytest.approx(1.2) and fwd.check_overhead() == pytest.approx(0.5)
    assert ("cuflash", "fwd", True) in calls and ("cuflash", "fwd+bwd", False) in calls and ("dense", "fwd") in calls
    assert bvl.failures([fwd, fb]) == [] and not any("MISMATCH" in x for x in logs)
    # a peer whose output differs: flagged, out of the ratios, and the run fails
    fwd, _ = bvl.benchmark_case(row, "normal", adapters=_peers(fa4_out="other"), log=logs.append)
    assert fwd.check["fa4"] == 0.5 and fwd.vs("fa4") is None and "(differs)" in bvl.markdown_table([fwd])
    assert any("MISMATCH small [normal]: fa4's forward" in x for x in logs) and bvl.failures([fwd])
    # forward only: no backward anywhere
    (only,) = bvl.benchmark_case(row, "normal", backward=False, adapters={}, log=logs.append)
    assert only.pass_name == "fwd" and only.na == {"fa4": "not run", "cudnn": "not run"}


def test_case_failures_never_stop_the_run(monkeypatch):
    _fake_device(monkeypatch, fail_timing=("fa4",))
    row = VarlenRow("small", False, batch=3, min_len=10, max_len=20)
    logs = []
    fwd, fb = bvl.benchmark_case(row, "normal", adapters=_peers(), log=logs.append)
    assert fwd.na["fa4"] == "while timed: RuntimeError: fa4 died" and "fa4" not in fwd.ms
    assert fwd.ms["cuflash"] == 2.0 and fwd.ms["dense"] == 1.8 and any("timing each alone" in x for x in logs)
    assert "not interleaved" in " ".join(fwd.notes)
    _fake_device(monkeypatch, cuflash_raises=True)
    res = bvl.benchmark_varlen([row], ["normal"], adapters=_peers(), log=logs.append)
    assert [r.na["cuflash"] for r in res] == ["FAILED RuntimeError: no kernel"] * 2
    assert all("cuflash" not in r.ms and r.ms["dense"] == 1.8 for r in res) and len(bvl.failures(res)) == 2
    assert "| FAILED |" in bvl.markdown_table(res)
    monkeypatch.setattr(bvl, "packed_inputs", lambda row, dist: 1 / 0)
    res = bvl.benchmark_varlen([row], ["normal", "sink"], adapters={}, log=logs.append)
    assert len(res) == 4
    assert all(r.na["cuflash"].startswith("FAILED to draw the inputs: ZeroDivisionError") for r in res)
    monkeypatch.setattr(bvl, "benchmark_case", lambda *a, **k: [][1])   # a harness bug: recorded, the run goes on
    res = bvl.benchmark_varlen([row], ["normal"], adapters={}, log=logs.append)
    assert [r.na["cuflash"][:26] for r in res] == ["FAILED (the case raised) I"] * 2


# ---------------------------------------------------------------------------
# Kernels and the command line


def test_kernel_configs_cover_varlen_and_dense():
    pytest.importorskip("cupy")
    assert bvl.varlen_bwd_backends()[0] is None
    cfgs = bvl.kernel_configs(90)
    keys = [c.key() for c in cfgs]
    assert len(keys) == len(set(keys))
    assert any(c.variant.varlen for c in cfgs) and any(not c.variant.varlen for c in cfgs)
    assert {c.causal for c in cfgs if c.variant.varlen and "fwd" in c.key()} == {False, True}
    if "sm80" in bvl.varlen_bwd_backends():
        assert any(c.key().startswith("sm80_bwd") and c.variant.varlen for c in cfgs)
    assert {c.key() for c in bvl.kernel_configs(80)} >= {c.key() for c in bvl.kernel_configs(80, bvl.VARLEN_ROWS[:1])}


def test_command_line():
    a = parse_args(["--varlen"])
    assert a.varlen and a.varlen_rows == bvl.DEFAULT_ROWS and a.varlen_dists == bvl.DEFAULT_DISTS
    assert (a.repeats, a.warmup) == (bvl.DEFAULT_REPEATS, bvl.DEFAULT_WARMUP)
    assert [s.seqlen for s in table_shapes(a)] == [bvl.VARLEN_ROWS[0].mean_len()] * 2
    assert [s.causal for s in table_shapes(a)] == [False, True]
    a = parse_args(["--varlen", "--quick"])
    assert a.varlen_dists == ("normal",)
    a = parse_args(["--varlen", "--varlen-rows", "varlen-causal", "--varlen-dists", "sink,outlier12", "--repeats",
                    "5", "--warmup=1", "--markdown", "--json", "v.json", "--forward-only",
                    "--varlen-shape", "B=4,lens=16:64"])
    assert a.varlen_rows == ("varlen-causal",) and a.varlen_dists == ("sink", "outlier12")
    assert (a.repeats, a.warmup, a.markdown, a.json, a.forward_only) == (5, 1, True, "v.json", True)
    assert [(s.batch, s.causal) for s in table_shapes(a)] == [(4, True)]
    a = parse_args(["--varlen", "--repe", "7"])   # an abbreviation argparse takes
    assert a.repeats == 7
    a = parse_args([])
    assert not a.varlen and a.repeats == 30 and a.warmup == 5 and a.varlen_rows is None
    for bad in (["--varlen-rows", "varlen"], ["--varlen-dists", "normal"], ["--varlen", "--variants"],
                ["--varlen", "--shape", "4,16,4096,128,bfloat16"], ["--varlen", "--dists", "normal"],
                ["--varlen", "--varlen-rows", "nope"], ["--varlen", "--varlen-shape", "B=0"],
                ["--varlen", "--varlen-shape", "Q=1"], ["--varlen", "--varlen-dists", "gauss"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_run_prints_the_tables_and_writes_json(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench_report, "git_commit", lambda: "abc1234")
    seen = {}

    def fake(rows, dists, **kw):
        seen.update(rows=rows, dists=dists, **kw)
        return _fake_results()

    monkeypatch.setattr(bvl, "benchmark_varlen", fake)
    monkeypatch.setattr(bvl, "peer_adapters", lambda: {"fa4": (None, "not here"), "cudnn": (None, "nor here")})
    out = tmp_path / "v.json"
    text = run_table(bvl, ["--varlen", "--markdown", "--json", str(out), "--varlen-shape", "B=2,lens=8:16",
                           "--varlen-dists", "normal"], capsys)
    assert "varlen table (issue #43): Fake GPU (sm_90)" in text and "commit abc1234" in text
    assert "fa4: not here" in text and "| row | dist | pass |" in text
    assert [r.batch for r in seen["rows"]] == [2, 2] and seen["dists"] == ("normal",)
    assert (seen["repeats"], seen["warmup"], seen["backward"]) == (bvl.DEFAULT_REPEATS, bvl.DEFAULT_WARMUP, True)
    j = json.loads(out.read_text())
    assert j["commit"] == "abc1234" and len(j["rows"][0]["lengths"]) == 2 and len(j["results"]) == 2
    monkeypatch.setattr(bvl, "benchmark_varlen", lambda rows, dists, **kw: [_result("fwd", {"dense": 1.0},
                                                                                    na={"cuflash": "FAILED x"})])
    assert "FAILED small [normal] fwd: cuflash FAILED x" in run_table(bvl, ["--varlen"], capsys, rc=1)


# ---------------------------------------------------------------------------
# GPU: one tiny run end to end


@requires_gpu
def test_tiny_run_on_the_gpu():
    import cupy

    from cuflash import forward_varlen

    row = VarlenRow("tiny", True, batch=3, min_len=16, max_len=300, heads=4, heads_kv=2, head_dim=64)
    row_nc = replace(row, name="tiny-nc", causal=False)

    def stand_in(r, p, passes):
        """A 'peer' that is cuflash's varlen forward again: same output, forward only."""
        out = cupy.empty_like(p.q)
        fn = lambda: forward_varlen(p.q, p.k, p.v, p.cu, p.cu, p.max_len, p.max_len, causal=r.causal,  # noqa: E731
                                    out=out, check_offsets=False)
        fn()
        return {"fwd": fn, "_out": out}

    def broken(r, p, passes):
        raise RuntimeError("ragged layout refused")

    adapters = {"fa4": (stand_in, None), "cudnn": (broken, None)}
    logs = []
    res = bvl.benchmark_varlen([row, row_nc], ["normal", "sink"], repeats=2, warmup=1, adapters=adapters,
                               log=logs.append)
    assert len(res) == 2 * 2 * 2
    for r in res:
        assert r.ms.get("cuflash") and r.ms.get("dense"), (r.row, r.dist, r.pass_name, r.na)
        assert "cuflash" not in r.na and r.check["dense"] <= bvl.CHECK_BOUND
        assert r.check["fa4"] == pytest.approx(0.0, abs=1e-6)
        assert r.na["cudnn"] == "RuntimeError: ragged layout refused"
        assert r.vs_dense() is not None
        if r.pass_name == "fwd":
            assert r.ms.get("fa4") and r.vs("fa4") is not None and r.check_overhead() is not None
        else:
            assert r.na["fa4"] == "this pass did not build" and r.vs("fa4") is None
    assert bvl.failures(res) == []
    md = bvl.markdown_table(res, bvl.header("test GPU", 0, 2, 1))
    assert md.count("| tiny |") == 4 and "ragged layout refused" in md
    json.dumps([r.to_json() for r in res])

    # the packed inputs: every sequence drawn alone, sink at its own first key
    p = bvl.packed_inputs(row, "sink")
    assert p.q.shape == (int(row.lengths().sum()), 4, 64) and p.k.shape[1] == 2 and p.total == p.q.shape[0]
    assert p.cu.dtype == np.int32 and p.cu.get().tolist() == p.offsets.tolist()
    norms = cupy.sqrt((p.k.astype(cupy.float32) ** 2).sum(axis=-1)).get()   # (total, Hkv): key 0 of each is 2 sqrt(D)
    for start in p.offsets[:-1]:
        assert (norms[start] > 1.5 * np.median(norms, axis=0)).all(), start
