"""The decode table (cuflash/bench_decode.py, issue #44's bar): on the CPU its rows and their selection, the bytes
counted, the memory limit, the bar, the pages and block tables, the float32 reference (NumPy standing in for CuPy),
the tables and JSON with fake results, and the command line of ``python -m cuflash --decode``; on a GPU the pages
read back against the contiguous cache and, once cuflash.forward_kvcache exists, one tiny run end to end."""
from __future__ import annotations

import json

import numpy as np
import pytest

from bench_checks import run_table
from conftest import requires_gpu
from cuflash import bench_decode as bd
from cuflash import bench_report
from cuflash.__main__ import parse_args, table_shapes
from cuflash.bench_decode import DecodeResult, DecodeRow


# ---------------------------------------------------------------------------
# Rows


def test_the_issues_rows():
    assert len(bd.DECODE_ROWS) == 18 and bd.DEFAULT_ROWS == bd.ROW_NAMES
    assert {(r.batch, r.cache_len, r.layout) for r in bd.DECODE_ROWS} == {
        (b, n, lay) for b in (1, 8, 64) for n in (4096, 32768, 131072) for lay in ("contiguous", "paged64")}
    for r in bd.DECODE_ROWS:
        assert (r.heads, r.heads_kv, r.head_dim, r.head_dim_v, r.dtype) == (32, 8, 128, 128, "bfloat16")
        assert not r.ragged and np.array_equal(r.lengths(), [r.cache_len] * r.batch)
        assert r.lengths().dtype == np.int32
    r = bd.rows_by_name(["b8-32k-paged64"])[0]
    assert r.paged and r.page_size == 64 and r.blocks_per_seq == 512 and r.name == "b8-32k-paged64"
    c = bd.rows_by_name(["b1-128k-contiguous"])[0]
    assert not c.paged and c.page_size is None and c.blocks_per_seq == 2048
    assert "B=8 N=32768 Hq=32 Hkv=8 D=128 bfloat16 paged64" == r.label()
    assert [x.name for x in bd.rows_by_name(bd.QUICK_ROWS)] == list(bd.QUICK_ROWS)
    assert len(bd.RAGGED_ROWS) == 18 and all(x.name.endswith("-ragged") for x in bd.RAGGED_ROWS)
    assert bd.len_label(4096) == "4k" and bd.len_label(131072) == "128k" and bd.len_label(1000) == "1000"


def test_rows_by_name_patterns_and_errors():
    names = [r.name for r in bd.rows_by_name(["b64-*"])]
    assert names == [f"b64-{n}-{lay}" for n in ("4k", "32k", "128k") for lay in ("contiguous", "paged64")]
    paged = bd.rows_by_name(["*-paged64"])   # the ragged rows end in -ragged: not matched
    assert len(paged) == 9 and all(r.paged and not r.ragged for r in paged)
    ragged = bd.rows_by_name(["*-ragged"])
    assert len(ragged) == 18 and all(r.ragged for r in ragged)
    assert [r.name for r in bd.rows_by_name(["default"])] == list(bd.ROW_NAMES)
    # the order given, each once
    got = [r.name for r in bd.rows_by_name(["b8-4k-contiguous", "b1-*", "b8-4k-contiguous", " "])]
    assert got[0] == "b8-4k-contiguous" and len(got) == 7 and len(set(got)) == 7
    for bad in (["nope"], ["b2-*"], ["b1-4k-contiguous", "b1-4k-paged32"]):
        with pytest.raises(ValueError, match="unknown decode row"):
            bd.rows_by_name(bad)


def test_row_validation():
    for kw in ({"layout": "paged"}, {"layout": "pages64"}, {"layout": "paged0"}, {"heads": 30},
               {"cache_len": 100, "layout": "paged64"}, {"batch": 0}, {"cache_len": 0}):
        args = {"batch": 2, "cache_len": 4096, **kw}
        with pytest.raises(ValueError):
            DecodeRow(**args)
    assert DecodeRow(2, 100).blocks_per_seq == 2          # contiguous: any length, read as pages of 64
    assert DecodeRow(2, 256, "paged128").page_size == 128


def test_ragged_lengths():
    ls = bd.draw_lengths(64, 32768, True)
    assert ls.dtype == np.int32 and ls.shape == (64,)
    assert ls.min() >= 16384 and ls.max() <= 32768 and len(set(ls.tolist())) > 32
    assert np.array_equal(ls, np.random.default_rng(bd.SEED).integers(16384, 32769, 64))
    assert np.array_equal(ls, bd.rows_by_name(["b64-32k-paged64-ragged"])[0].lengths())
    assert not np.array_equal(ls, bd.draw_lengths(64, 32768, True, seed=bd.SEED + 1))
    assert np.array_equal(bd.draw_lengths(3, 1, True), [1, 1, 1])
    assert np.array_equal(bd.draw_lengths(3, 7, False), [7, 7, 7])


# ---------------------------------------------------------------------------
# Bytes, bandwidth, memory, bar


def test_bytes():
    # K and V: 4096 tokens x 8 heads x (128 + 128) x 2 bytes; q and out: 32 heads x (128 + 128) x 2
    assert bd.decode_bytes([4096], 32, 8, 128) == 4096 * 8 * 256 * 2 + 32 * 256 * 2
    assert bd.decode_bytes([10, 20], 4, 2, 64, 32) == 30 * 2 * 96 * 2 + 2 * 4 * 96 * 2
    assert bd.decode_bytes([5], 2, 1, 8, seqlen_q=3, itemsize=4) == 5 * 16 * 4 + 3 * 2 * 16 * 4
    big = bd.rows_by_name(["b64-128k-paged64"])[0]
    assert big.kv_bytes() == 64 * 131072 * 8 * 256 * 2 == 34359738368
    assert big.bytes_read() == big.kv_bytes() + 64 * 32 * 256 * 2
    ragged = bd.rows_by_name(["b8-4k-contiguous-ragged"])[0]
    assert ragged.bytes_read() == int(ragged.lengths().sum()) * 8 * 256 * 2 + 8 * 32 * 256 * 2
    assert ragged.kv_bytes() == 8 * 4096 * 8 * 256 * 2 > ragged.bytes_read()   # capacity, not what is read
    assert bd.kv_cache_bytes(2, 10, 3, 4, 6, itemsize=1) == 2 * 10 * 3 * 10
    assert bd.gbps(2e9, 1000.0) == pytest.approx(2.0) and bd.gbps(3e9, 1.0) == pytest.approx(3000.0)
    assert bd.gbps(1, None) is None and bd.gbps(1, 0.0) is None


def test_memory_limit():
    assert bd.memory_skip(40, 100) is None and bd.memory_skip(41, 100) is not None
    assert bd.memory_skip(10**12, None) is None             # unknown free memory: run it
    assert bd.memory_skip(50, 100, fraction=0.5) is None
    why = bd.memory_skip(34359738368, 79 * 10**9)
    assert why.startswith("K/V cache 34.4 GB > 40 % of the 79.0 GB free")
    # an 80 GB H100 (79 GB free) skips only batch 64 at 128k; an H200 (~140 GB free) runs every row
    skipped = {r.name for r in bd.DECODE_ROWS if bd.memory_skip(r.kv_bytes(), 79 * 10**9)}
    assert skipped == {"b64-128k-contiguous", "b64-128k-paged64"}
    assert not [r for r in bd.DECODE_ROWS if bd.memory_skip(r.kv_bytes(), 140 * 10**9)]


def test_bar_fraction():
    assert bd.bar_copy_fraction(8, 32768) == bd.bar_copy_fraction(64, 131072) == 0.85
    assert bd.bar_copy_fraction(1, 131072) == 0.70
    for b, n in ((1, 4096), (1, 32768), (8, 4096), (64, 4096)):
        assert bd.bar_copy_fraction(b, n) is None
    assert bd.bar_copy_fraction(64, 131072, ragged=True) is None
    assert sum(r.bar_fraction() is not None for r in bd.DECODE_ROWS) == 10


# ---------------------------------------------------------------------------
# Pages and the reference, NumPy standing in for CuPy


def test_page_table_is_a_fixed_permutation():
    t = bd.page_table(4, 8)
    assert t.dtype == np.int32 and t.shape == (4, 8)
    assert sorted(t.reshape(-1).tolist()) == list(range(32))
    assert np.array_equal(t, bd.page_table(4, 8)) and not np.array_equal(t, bd.page_table(4, 8, seed=1))
    assert not np.array_equal(t, bd.in_order_table(4, 8))
    assert bd.in_order_table(2, 3).tolist() == [[0, 1, 2], [3, 4, 5]]


def test_scatter_and_gather_pages():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 256, 2, 4)).astype(np.float32)
    t = bd.page_table(3, 4)
    pages = bd.scatter_pages(x, t, 64)
    assert pages.shape == (12, 64, 2, 4)
    for b in range(3):
        for j in range(4):
            assert np.array_equal(pages[t[b, j]], x[b, 64 * j:64 * (j + 1)])
        for n in (1, 64, 65, 200, 256):
            assert np.array_equal(bd.gather_pages(pages, t[b], n), x[b, :n])
    with pytest.raises(ValueError):
        bd.scatter_pages(x, t[:, :3], 64)
    with pytest.raises(ValueError):
        bd.scatter_pages(x, np.zeros((3, 4), dtype=np.int32), 64)   # not a permutation


def test_flashinfer_pages():
    t = np.array([[7, 2, 5], [0, 1, 3]], dtype=np.int32)
    indptr, indices, last = bd.flashinfer_pages([130, 64], t, 64)
    assert indptr.tolist() == [0, 3, 4] and indices.tolist() == [7, 2, 5, 0] and last.tolist() == [2, 64]
    assert all(a.dtype == np.int32 for a in (indptr, indices, last))
    row = bd.rows_by_name(["b8-32k-paged64-ragged"])[0]
    ip, ix, lp = bd.flashinfer_pages(row.lengths(), bd.page_table(8, row.blocks_per_seq), 64)
    assert ((ip[1:] - ip[:-1] - 1) * 64 + lp == row.lengths()).all() and ((lp >= 1) & (lp <= 64)).all()
    with pytest.raises(ValueError):
        bd.flashinfer_pages([200], t[:1], 64)


def _direct(q, k, v, scale):
    hq, hkv = q.shape[0], k.shape[1]
    g = hq // hkv
    out = []
    for h in range(hq):
        s = (k[:, h // g].astype(np.float64) @ q[h].astype(np.float64)) * scale
        p = np.exp(s - s.max())
        out.append(p @ v[:, h // g].astype(np.float64) / p.sum())
    return np.array(out)


@pytest.mark.parametrize("length,chunk", [(1, 16384), (300, 64), (1000, 16384), (129, 128)])
def test_reference_decode(length, chunk):
    rng = np.random.default_rng(length)
    q = rng.standard_normal((8, 16)).astype(np.float32) * 3
    k = rng.standard_normal((length, 2, 16)).astype(np.float32)
    v = rng.standard_normal((length, 2, 8)).astype(np.float32)
    ref = bd.reference_decode(q, k, v, chunk=chunk)
    assert ref.shape == (8, 8) and ref.dtype == np.float32
    assert np.allclose(ref, _direct(q, k, v, 1 / 4), rtol=1e-4, atol=1e-5)
    assert np.allclose(bd.reference_decode(q, k, v, softmax_scale=0.1), _direct(q, k, v, 0.1), rtol=1e-4, atol=1e-5)
    assert bd.rel_err(ref, ref) == 0.0 and bd.rel_err(ref, ref[:4]) == float("inf")
    assert bd.rel_err(ref * 1.01, ref) == pytest.approx(0.01, rel=1e-3)
    assert bd.check_sequences(1) == [0] and bd.check_sequences(64) == [0, 63]


# ---------------------------------------------------------------------------
# Results, bar, tables


def _result(name="b8-32k-paged64", dist="normal", ms=None, copy=3000.0, **kw) -> DecodeResult:
    r = bd.new_result(bd.rows_by_name([name])[0], dist, copy)
    r.ms.update(ms or {})
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_ratios_and_bar():
    r = _result(ms={"cuflash": 0.5, "sdpa:flash:gqa": 1.0, "sdpa:cudnn:rows": 0.75, "flashinfer:tc": 0.6,
                    "flashinfer:cc": 0.55, "fa4": 0.65})
    nbytes = r.bytes
    assert nbytes == 8 * 32768 * 8 * 256 * 2 + 8 * 32 * 256 * 2 and r.lengths["total"] == 8 * 32768
    assert r.gbps() == pytest.approx(nbytes / 0.5e-3 / 1e9) and r.copy_fraction() == pytest.approx(r.gbps() / 3000)
    assert r.best("sdpa") == "sdpa:cudnn:rows" and r.vs("sdpa") == pytest.approx(1.5)
    assert r.best("flashinfer") == "flashinfer:cc" and r.vs("flashinfer") == pytest.approx(1.1)
    assert r.peer_gbps("fa4") == pytest.approx(nbytes / 0.65e-3 / 1e9)
    assert r.bar_fraction == 0.85
    # ~2.15 TB/s of 3 TB/s: 72 % < 85 %; of 2.4 TB/s: 89 %
    assert r.bar() == "NOT met (72 % < 85 % of copy)"
    r.copy_gbps = 2400.0
    assert r.bar() == "met"
    r.ms["fa4"] = 0.45
    assert r.bar() == "NOT met (x fa4 0.90)"
    # a configuration that differs from the reference is out of the ratios; all of a peer's: the peer differs
    r.check = {"cuflash": 3e-3, "fa4": 0.4, "sdpa:cudnn:rows": 0.3, "sdpa:flash:gqa": 2e-3}
    assert r.best("fa4") is None and r.vs("fa4") is None and r.peer_differs("fa4")
    assert r.best("sdpa") == "sdpa:flash:gqa" and r.vs("sdpa") == pytest.approx(2.0) and not r.peer_differs("sdpa")
    assert r.bar() == "met"
    assert bd.failures([r]) == ["b8-32k-paged64 [normal]: fa4's output differs from the float32 reference by 0.4"]
    # a failing check fails the row, and the ratios go
    r.check["cuflash"] = 0.2
    assert r.bar() == "FAILED (check 2.0e-01)" and r.vs("sdpa") is None
    assert any("cuflash's output differs" in x for x in bd.failures([r]))
    # rows the copy bar does not name: peers only
    s = _result("b1-4k-contiguous", ms={"cuflash": 0.01, "sdpa:flash:gqa": 0.02})
    assert s.bar_fraction is None and s.bar() == "met (peers)"
    assert _result("b1-4k-contiguous", ms={"cuflash": 0.01}).bar() == "-"
    assert _result("b1-128k-contiguous", ms={"cuflash": 0.01}).bar() == "met (copy; no peer ran)"
    assert _result("b1-4k-contiguous").bar() == "-"
    f = _result(na={"cuflash": "FAILED RuntimeError: boom"})
    assert f.bar() == "FAILED (cuflash failed)" and bd.failures([f]) == [
        "b8-32k-paged64 [normal]: cuflash FAILED RuntimeError: boom"]
    sk = bd.skipped_result(bd.rows_by_name(["b64-128k-paged64"])[0], "normal", "too big")
    assert sk.bar() == "skipped" and bd.failures([sk]) == []


def _fake_results():
    a = _result(ms={"cuflash": 1.0, "sdpa:flash:gqa": 2.0, "flashinfer:cc": 1.25, "fa4": 1.6},
                check={"cuflash": 4e-3, "sdpa:flash:gqa": 3e-3, "flashinfer:cc": 2e-3, "fa4": 3e-3},
                labels={"sdpa:flash:gqa": "SDPA flash backend, enable_gqa=True, on contiguous cache",
                        "flashinfer:cc": "FlashInfer batch decode, use_tensor_cores=False, on the pages",
                        "fa4": "on the contiguous cache, num_splits=1"},
                contiguous=["sdpa:flash:gqa", "fa4"], copy=2400.0)
    a.na["sdpa:efficient:gqa"] = "RuntimeError: No available kernel"
    b = _result(dist="mixed", ms={"cuflash": 1.1, "sdpa:flash:gqa": 2.0}, check={"cuflash": 0.5},
                labels={"sdpa:flash:gqa": "SDPA flash backend, enable_gqa=True, on contiguous cache"},
                contiguous=["sdpa:flash:gqa"], copy=2400.0)
    b.na.update({"flashinfer": "flashinfer not importable (ModuleNotFoundError)", "sdpa:efficient:gqa":
                 "RuntimeError: No available kernel"})
    c = bd.skipped_result(bd.rows_by_name(["b64-128k-paged64"])[0], "normal", "K/V cache 34.4 GB > 40 %", 2400.0)
    return [a, b, c]


def test_tables_and_json():
    res = _fake_results()
    md = bd.markdown_table(res, "decode table (issue #44): H200 (sm_90)")
    lines = md.splitlines()
    assert lines[0].startswith("decode table (issue #44)")
    assert lines[2] == ("| batch | cache len | layout | dist | cuflash us | cuflash GB/s | % of copy | copy GB/s | "
                        "SDPA GB/s | cuflash/SDPA | FlashInfer GB/s | cuflash/FlashInfer | FA4 GB/s | cuflash/FA4 | "
                        "check | bar |")
    assert lines[3] == "|" + " --- |" * len(bd.TABLE_HEAD)
    body = [x for x in lines if x.startswith("| 8 | 32k | paged64 |") or x.startswith("| 64 |")]
    assert len(body) == 3 and all(x.count("|") == len(bd.TABLE_HEAD) + 1 for x in body)
    first = [c.strip() for c in body[0].strip("|").split("|")]
    g = res[0].gbps()
    assert first[:8] == ["8", "32k", "paged64", "normal", "1000.0", f"{g:.0f}", f"{100 * g / 2400:.1f}", "2400"]
    assert first[8] == f"{g / 2:.0f} (c)" and first[9] == "2.00"       # SDPA on the contiguous cache, marked
    assert first[10] == f"{g / 1.25:.0f}" and first[11] == "1.25"      # FlashInfer on the pages: no mark
    assert first[12] == f"{g / 1.6:.0f} (c)" and first[13] == "1.60"
    assert first[14] == "4.0e-03" and first[15].startswith("NOT met (")
    second = [c.strip() for c in body[1].strip("|").split("|")]
    assert second[3] == "mixed" and second[10] == "n/a" and second[12] == "-"
    assert second[14] == "FAIL 5.0e-01" and second[15] == "FAILED (check 5.0e-01)"
    third = [c.strip() for c in body[2].strip("|").split("|")]
    assert third[:5] == ["64", "128k", "paged64", "normal", "skipped"] and third[-1] == "skipped"
    assert "b64-128k-paged64: skipped: K/V cache 34.4 GB > 40 %" in md
    assert "b8-32k-paged64: flashinfer n/a: flashinfer not importable" in md
    assert "b8-32k-paged64: sdpa:efficient:gqa n/a: RuntimeError: No available kernel" in md   # one line for both
    assert md.count("sdpa:efficient:gqa n/a") == 1
    assert "sdpa: fastest was SDPA flash backend, enable_gqa=True, on contiguous cache" in md
    assert "(c): the peer read the contiguous cache" in md and "bound 0.02" in md
    text = bd.format_table(res)
    head, first_row = text.splitlines()[:2]
    assert len(head) == len(first_row) and head.split()[0] == "batch"   # aligned columns
    assert "FAIL 5.0e-01" in text and "skipped" in text
    j = json.loads(json.dumps([r.to_json() for r in res]))
    assert j[0]["best"] == {"sdpa": "sdpa:flash:gqa", "flashinfer": "flashinfer:cc", "fa4": "fa4"}
    assert j[0]["vs"]["sdpa"] == pytest.approx(2.0) and j[0]["bytes"] == res[0].bytes
    assert j[0]["gbps"]["cuflash"] == pytest.approx(g) and j[0]["bar_fraction"] == 0.85
    assert j[2]["skipped"].startswith("K/V cache") and j[2]["bar"] == "skipped" and j[1]["vs"]["sdpa"] is None
    failed = _result(na={"cuflash": "FAILED RuntimeError: boom"})
    assert "| FAILED |" in bd.markdown_table([failed])


def test_notes_group_rows():
    res = [_result(name, ms={"cuflash": 1.0}, na={"flashinfer": "not importable"})
           for name in ("b1-4k-contiguous", "b1-4k-paged64", "b8-4k-contiguous", "b8-4k-paged64", "b64-4k-paged64")]
    notes = bd._notes(res)
    assert notes == ["every row: flashinfer n/a: not importable"]
    res[0].na["flashinfer"] = "other"
    assert ("b1-4k-paged64, b8-4k-contiguous, b8-4k-paged64, b64-4k-paged64: flashinfer n/a: not importable"
            in bd._notes(res))
    res += [_result(name, ms={"cuflash": 1.0}, na={"flashinfer": "not importable"}) for name in ("b64-4k-contiguous",)]
    res[0].na["flashinfer"] = "other"
    assert "b1-4k-paged64, b8-4k-contiguous, b8-4k-paged64 and 2 more: flashinfer n/a: not importable" in bd._notes(res)


# ---------------------------------------------------------------------------
# The loop on the host: groups, the memory limit, order, failures


def test_benchmark_decode_groups_skips_and_orders(monkeypatch):
    drawn, cased = [], []
    monkeypatch.setattr(bd, "free_bytes", lambda: 79 * 10**9)
    monkeypatch.setattr(bd, "free_memory", lambda: None)
    monkeypatch.setattr(bd, "draw_inputs", lambda row, dist: drawn.append((row.name, dist)) or "inputs")
    monkeypatch.setattr(bd, "prepare", lambda row, inputs: (row, inputs))

    def case(row, dist, p, **kw):
        cased.append((row.name, dist, p[1], kw["copy_gbps"], kw["repeats"]))
        if row.name == "b8-4k-paged64" and dist == "mixed":
            raise RuntimeError("context died")
        return _result(row.name, dist, {"cuflash": 1.0}, copy=kw["copy_gbps"])

    monkeypatch.setattr(bd, "benchmark_case", case)
    rows = bd.rows_by_name(["b64-128k-paged64", "b8-4k-paged64", "b64-128k-contiguous", "b8-4k-contiguous"])
    logs = []
    res = bd.benchmark_decode(rows, ["normal", "mixed"], copy_gbps=2500.0, repeats=7, adapters={}, log=logs.append)
    # one draw per (batch, length) group and distribution: the paged row scatters the contiguous draw
    assert drawn == [("b8-4k-paged64", "normal"), ("b8-4k-paged64", "mixed")]
    assert [(c[0], c[1]) for c in cased] == [("b8-4k-paged64", "normal"), ("b8-4k-contiguous", "normal"),
                                              ("b8-4k-paged64", "mixed"), ("b8-4k-contiguous", "mixed")]
    assert all(c[2:] == ("inputs", 2500.0, 7) for c in cased)
    assert [(r.row, r.dist) for r in res] == [(r.name, d) for r in rows for d in ("normal", "mixed")]
    big = [r for r in res if r.row.startswith("b64-128k")]
    assert len(big) == 4 and all(r.skipped and r.skipped.startswith("K/V cache 34.4 GB") for r in big)
    died = [r for r in res if r.row == "b8-4k-paged64" and r.dist == "mixed"][0]
    assert died.na["cuflash"].startswith("FAILED (the case raised) RuntimeError: context died")
    assert len(bd.failures(res)) == 1 and len(logs) == 8
    # inputs that cannot be drawn fail the group's rows, and the run goes on
    monkeypatch.setattr(bd, "draw_inputs", lambda row, dist: (_ for _ in ()).throw(MemoryError("oom")))
    res = bd.benchmark_decode(rows[1:2], ["normal"], adapters={}, log=logs.append)
    assert res[0].na["cuflash"].startswith("FAILED to draw the inputs: MemoryError")


def test_adapters_without_their_libraries():
    try:
        import torch  # noqa: F401
        pytest.skip("PyTorch is installed here")
    except ImportError:
        pass
    ad = bd.peer_adapters()
    assert set(ad) == {"sdpa", "flashinfer", "fa4"}
    for build, why in ad.values():
        assert build is None and "PyTorch not importable" in why


def test_case_records_peers_na_and_checks_on_the_host(monkeypatch):
    """benchmark_case with stand-ins for the device parts: a peer that cannot build, a configuration that raises,
    one that differs, and the check of cuflash against the reference."""
    row = bd.rows_by_name(["b1-4k-paged64"])[0]
    monkeypatch.setattr(bd, "references", lambda p: {0: np.ones((2, 2), dtype=np.float32)})
    monkeypatch.setattr(bd, "output_error", lambda out, refs: out)
    monkeypatch.setattr(bd, "cuflash_call", lambda p: lambda: 1e-3)
    monkeypatch.setattr(bd, "torch_views", lambda p: {})
    monkeypatch.setattr(bd, "_sync", lambda: None)
    monkeypatch.setattr(bd, "free_memory", lambda: None)
    timed = {}

    def fake_time(fns, res, warmup, repeats, log):
        timed.update(fns)
        return {k: 1.0 + i for i, k in enumerate(fns)}

    monkeypatch.setattr(bd, "_time_all", fake_time)

    def sdpa_build(p, t):
        def boom():
            raise RuntimeError("No available kernel")
        return {"sdpa:flash:gqa": (lambda: 2e-3, "flash", True), "sdpa:cudnn:gqa": (boom, "cudnn", True),
                "sdpa:efficient:rows": (lambda: 0.5, "efficient", True)}

    def fa4_build(p, t):
        raise AssertionError("paged KV not supported on SM 9.0")

    adapters = {"sdpa": (sdpa_build, None), "flashinfer": (None, "flashinfer not importable"), "fa4": (fa4_build,
                                                                                                      None)}
    r = bd.benchmark_case(row, "normal", prepared="p", copy_gbps=3000.0, adapters=adapters, log=lambda s: None)
    assert set(timed) == {"cuflash", "sdpa:flash:gqa", "sdpa:efficient:rows"}
    assert r.check == {"cuflash": 1e-3, "sdpa:flash:gqa": 2e-3, "sdpa:efficient:rows": 0.5}
    assert r.na == {"sdpa:cudnn:gqa": "RuntimeError: No available kernel", "flashinfer": "flashinfer not importable",
                    "fa4": "AssertionError: paged KV not supported on SM 9.0"}
    assert r.best("sdpa") == "sdpa:flash:gqa" and r.contiguous == ["sdpa:flash:gqa", "sdpa:efficient:rows"]
    assert r.ms["cuflash"] == 1.0 and not bd.failures([r])
    cells = bd._cells(r)
    assert cells[8].endswith("(c)") and cells[10] == "n/a" and cells[12] == "n/a"


# ---------------------------------------------------------------------------
# Command line


def test_command_line():
    a = parse_args(["--decode"])
    assert a.decode and a.decode_rows == bd.DEFAULT_ROWS and a.decode_dists == bd.DEFAULT_DISTS
    assert (a.repeats, a.warmup) == (bd.DEFAULT_REPEATS, bd.DEFAULT_WARMUP) and table_shapes(a) == []
    a = parse_args(["--decode", "--quick"])
    assert a.decode_rows == bd.QUICK_ROWS and a.decode_dists == bd.QUICK_DISTS
    a = parse_args(["--decode", "--decode-rows", "b64-*,b1-128k-paged64", "--decode-dists", "sink,normal,sink",
                    "--repeats", "9", "--warmup=2", "--markdown", "--json", "d.json"])
    assert a.decode_rows == ("b64-*", "b1-128k-paged64") and a.decode_dists == ("sink", "normal")
    assert (a.repeats, a.warmup, a.markdown, a.json) == (9, 2, True, "d.json")
    assert len(bd.rows_by_name(a.decode_rows)) == 7
    a = parse_args([])
    assert not a.decode and a.decode_rows is None and a.decode_dists is None
    for bad in (["--decode-rows", "b1-*"], ["--decode-dists", "normal"], ["--decode", "--varlen"],
                ["--decode", "--variants"], ["--decode", "--head-dims"], ["--decode", "--dists", "normal"],
                ["--decode", "--shape", "4,16,4096,128,bfloat16"], ["--decode", "--decode-rows", "nope"],
                ["--decode", "--decode-dists", "gauss"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_run_prints_the_tables_and_writes_json(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench_report, "git_commit", lambda: "abc1234")
    monkeypatch.setattr(bd, "copy_bandwidth", lambda: {"bytes": 1 << 30, "ms": {"memcpy": 1.0},
                                                      "gbps": {"memcpy": 2400.0, "elementwise": 2300.0},
                                                      "copy_gbps": 2400.0})
    monkeypatch.setattr(bd, "peer_adapters", lambda: {"sdpa": (None, "no torch"), "flashinfer": (None, "nope"),
                                                      "fa4": (None, "nope")})
    seen = {}

    def fake(rows, dists, **kw):
        seen.update(rows=rows, dists=dists, **kw)
        return _fake_results()[:1]

    monkeypatch.setattr(bd, "benchmark_decode", fake)
    out = tmp_path / "d.json"
    text = run_table(bd, ["--decode", "--markdown", "--json", str(out), "--decode-rows", "b8-32k-*",
                          "--decode-dists", "normal"], capsys)
    assert "decode table (issue #44): Fake GPU (sm_90)" in text and "commit abc1234" in text
    assert "copy bandwidth 2400 GB/s (memcpy 2400, elementwise 2300 GB/s; 1 GiB" in text
    assert "sdpa: no torch" in text and "| batch | cache len |" in text
    assert [r.name for r in seen["rows"]] == ["b8-32k-contiguous", "b8-32k-paged64"] and seen["dists"] == ("normal",)
    assert (seen["copy_gbps"], seen["repeats"], seen["warmup"]) == (2400.0, bd.DEFAULT_REPEATS, bd.DEFAULT_WARMUP)
    j = json.loads(out.read_text())
    assert j["commit"] == "abc1234" and j["copy"]["copy_gbps"] == 2400.0 and len(j["rows"]) == 2
    assert j["rows"][1]["bytes"] == bd.rows_by_name(["b8-32k-paged64"])[0].bytes_read()
    monkeypatch.setattr(bd, "benchmark_decode", lambda rows, dists, **kw: _fake_results()[1:])
    assert "FAILED b8-32k-paged64 [mixed]: cuflash's output differs" in run_table(bd, ["--decode"], capsys, rc=1)


# ---------------------------------------------------------------------------
# GPU


@requires_gpu
def test_pages_and_reference_on_the_gpu():
    import cupy

    row = DecodeRow(3, 256, "paged64", ragged=True, heads=4, heads_kv=2, head_dim=64)
    inputs = bd.draw_inputs(row, "sink")
    p = bd.prepare(row, inputs)
    assert p.k_pages.shape == (12, 64, 2, 64) and p.k_pages.dtype == inputs.k.dtype
    for b in range(3):
        n = int(p.lengths[b])
        back = bd.gather_pages(bd._u16(p.k_pages), p.table[b], n)
        assert bool(cupy.all(back == inputs.k[b, :n].view(cupy.uint16)))
    refs = bd.references(p)
    contiguous = bd.references(bd.prepare(DecodeRow(3, 256, "contiguous", ragged=True, heads=4, heads_kv=2,
                                                    head_dim=64), inputs))
    assert set(refs) == {0, 2} and all(bd.rel_err(refs[b], contiguous[b]) == 0.0 for b in refs)


@requires_gpu
def test_tiny_run_on_the_gpu():
    import cuflash

    if not hasattr(cuflash, "forward_kvcache"):
        pytest.skip("cuflash.forward_kvcache is not there yet")
    rows = [DecodeRow(2, 512, layout, ragged=rg, heads=8, heads_kv=2) for layout in ("contiguous", "paged64")
            for rg in (False, True)]
    logs = []
    res = bd.benchmark_decode(rows, ["normal", "mixed"], copy_gbps=1000.0, repeats=2, warmup=1, log=logs.append)
    assert len(res) == 8
    for r in res:
        assert r.ms.get("cuflash") and r.check["cuflash"] <= bd.CHECK_BOUND, (r.row, r.dist, r.na, r.check)
    assert not bd.failures(res), bd.failures(res)
