"""CPU tests of the programmable-attention table (cuflash/bench_programmable.py, issue #45): the rows, their
operands and FLOP accounting against brute-force counts over the whole score matrix (half of a block mask's
blocks, eight documents, the key padding), the block lists the peers take, which peer has which feature, the
dropout check, a case on a fake device, the tables and the command line of ``python -m cuflash
--programmable``; one GPU smoke test."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from bench_checks import run_table
from conftest import requires_gpu
from cuflash import bench_programmable as bp
from cuflash.__main__ import parse_args, table_shapes
from cuflash.bench import Shape


def _small(name: str, n: int = 300, batch: int = 3, heads: int = 2) -> bp.ProgRow:
    return bp.replace_row(bp.rows_by_name([name])[0], batch=batch, heads=heads, seqlen=n)


# ---------------------------------------------------------------------------
# Rows and operands


def test_rows():
    assert bp.ROW_NAMES == ("dropout", "bias", "keypad", "sparse50", "relpos", "docmask")
    for row in bp.PROG_ROWS:
        assert row.shape == Shape(4, 16, 4096, 128, "bfloat16", False)
        assert row.label().startswith("B=4 H=16 N=4096 D=128 bfloat16, ")
    kinds = {r.name: (r.kind, r.accounting, r.target) for r in bp.PROG_ROWS}
    assert kinds["dropout"] == kinds["bias"] == kinds["keypad"] == ("bias", "dense", 0.75)
    assert kinds["sparse50"] == kinds["relpos"] == kinds["docmask"] == ("mask", "useful", 0.90)
    assert [r.name for r in bp.rows_by_name(["docmask", "bias", "docmask"])] == ["docmask", "bias"]
    with pytest.raises(ValueError, match="nope"):
        bp.rows_by_name(["bias", "nope"])
    assert set(bp.QUICK_ROWS) <= set(bp.ROW_NAMES)


def test_operands_are_deterministic_and_well_formed():
    lengths = bp.keypad_lengths(64, 4096)
    assert np.array_equal(lengths, bp.keypad_lengths(64, 4096))
    assert lengths.min() >= 2048 and lengths.max() <= 4096
    assert bp.keypad_lengths(5, 1).tolist() == [1] * 5
    ids = bp.document_ids(4, 4096)
    assert ids.dtype == np.int32 and ids.shape == (4, 4096)
    for x in ids:
        assert x[0] == 0 and np.all(np.diff(x) >= 0) and np.array_equal(np.unique(x), np.arange(bp.DOCUMENTS))
    assert not np.array_equal(ids[0], ids[1])   # each sequence its own boundaries
    assert bp.document_ids(2, 3).max() == 2     # fewer tokens than documents: one document per token
    table = bp.relpos_table(16)
    assert table.dtype == np.float32 and table.shape == (16 * bp.RELPOS_BUCKETS,)
    assert bp.block_grid(300, 128).tolist() == [128, 128, 44] and bp.block_grid(256, 128).tolist() == [128, 128]


@pytest.mark.parametrize("nq,nk", [(4096, 4096), (300, 300), (300, 520), (128, 1)])
def test_half_of_each_block_row(nq, nk):
    on = bp.sparse_blocks(16, nq, nk)
    nb = -(-nk // 128)
    assert on.shape == (1, 16, -(-nq // 128), nb) and on.dtype == bool
    assert np.all(on.sum(axis=-1) == max(1, round(nb / 2)))
    assert nb == 1 or not np.array_equal(on[0, 0], on[0, 1])   # drawn per head
    assert np.array_equal(on, bp.sparse_blocks(16, nq, nk))


def _brute_visible(row: bp.ProgRow) -> np.ndarray:
    """bool (batch, heads, N, N) from the operands' definitions, element by element where it is cheap."""
    s = row.shape
    vis = np.ones((s.batch, s.heads, s.seqlen, s.nk), bool)
    if row.name == "keypad":
        for b, n in enumerate(bp.keypad_lengths(s.batch, s.nk)):
            vis[b, :, :, n:] = False
    elif row.name == "sparse50":
        on = bp.sparse_blocks(s.heads, s.seqlen, s.nk)[0]
        for i in range(s.seqlen):
            for j in range(s.nk):
                vis[:, :, i, j] = on[:, i // 128, j // 128]
    elif row.name == "docmask":
        ids = bp.document_ids(s.batch, s.seqlen)
        vis[:] = (ids[:, :, None] == ids[:, None, :])[:, None]
    return vis


@pytest.mark.parametrize("name", bp.ROW_NAMES)
@pytest.mark.parametrize("n", [300, 384])
def test_visible_pairs_match_brute_force(name, n):
    row = _small(name, n)
    vis = _brute_visible(row)
    assert bp.visible_pairs(row) == int(vis.sum())
    assert bp.dense_pairs(row.shape) == vis.size


def test_useful_pairs_at_the_table_size():
    n = 4096
    rows = {r.name: r for r in bp.PROG_ROWS}
    assert bp.visible_pairs(rows["sparse50"]) == 4 * 16 * n * n // 2          # exactly half of every block row
    ids = bp.document_ids(4, n)
    docs = sum(int((np.bincount(x).astype(np.int64) ** 2).sum()) for x in ids)
    assert bp.visible_pairs(rows["docmask"]) == 16 * docs < 4 * 16 * n * n // 2
    assert bp.visible_pairs(rows["keypad"]) == 16 * n * int(bp.keypad_lengths(4, n).sum())
    for name in ("dropout", "bias", "relpos"):
        assert bp.visible_pairs(rows[name]) == 4 * 16 * n * n
    w = bp.work(rows["sparse50"])
    assert w.useful_flops == 4.0 * 128 * w.pairs and w.dense_flops == 2 * w.useful_flops
    assert w.flops("useful") == w.useful_flops and w.flops("dense") == w.dense_flops


@pytest.mark.parametrize("n", [300, 512, 1000])
def test_document_blocks_match_brute_force(n):
    ids = bp.document_ids(3, n, seed=7)
    any_on, all_on = bp.document_blocks(ids)
    vis = ids[:, :, None] == ids[:, None, :]
    nb = -(-n // 128)
    assert any_on.shape == all_on.shape == (3, 1, nb, nb)
    for b in range(3):
        for m in range(nb):
            for j in range(nb):
                tile = vis[b, m * 128:(m + 1) * 128, j * 128:(j + 1) * 128]
                assert any_on[b, 0, m, j] == tile.any() and all_on[b, 0, m, j] == tile.all(), (b, m, j)
    from cuflash.block_sparse import block_mask_from_document_ids

    assert np.array_equal(block_mask_from_document_ids(ids, block_size=128), any_on)   # cuflash's own helper


def test_block_lists():
    on = np.array([[[True, False, True, False], [False] * 4, [True] * 4]])
    count, index = bp.block_lists(on)
    assert count.tolist() == [[2, 0, 4]] and count.dtype == index.dtype == np.int32
    assert index.tolist() == [[[0, 2, 0, 0], [0, 0, 0, 0], [0, 1, 2, 3]]]
    rng = np.random.default_rng(0)
    big = rng.random((2, 3, 8, 9)) < 0.4
    count, index = bp.block_lists(big)
    for x, c, i in zip(big.reshape(-1, 9), count.reshape(-1), index.reshape(-1, 9)):
        assert i[:c].tolist() == np.flatnonzero(x).tolist() and not i[c:].any()


def test_which_peer_has_which_feature():
    rows = {r.name: r for r in bp.PROG_ROWS}
    have = {p: [n for n, r in rows.items() if bp.static_na(p, r) is None] for p in bp.PEERS}
    assert have["cudnn"] == ["dropout", "bias", "keypad"]
    assert have["fa4"] == ["dropout", "keypad", "sparse50", "relpos", "docmask"]   # dropout: by its signature
    assert have["flex"] == ["sparse50", "relpos", "docmask"]
    assert "dbias" in bp.static_na("fa4", rows["bias"]) and "dropout" in bp.static_na("flex", rows["dropout"])
    assert "gather" in bp.static_na("cudnn", rows["relpos"])
    with pytest.raises(ValueError):
        bp.static_na("xformers", rows["bias"])


def test_peer_adapters_say_why_not():
    for name, (build, why) in bp.peer_adapters().items():
        assert name in bp.PEERS and (build is None) != (why is None)
        if build is None:
            assert isinstance(why, str) and why


def test_cuflash_kwargs_build_checked_modifiers():
    pytest.importorskip("cupy")
    from cuflash.modifiers import MaskMod, Modifiers, ScoreMod

    ops = {"bias": np.zeros((1, 2, 4, 4), np.float32), "blocks": np.ones((1, 2, 1, 1), bool),
           "table": bp.relpos_table(2), "doc_ids": bp.document_ids(3, 300)}
    rows = {r.name: _small(r.name) for r in bp.PROG_ROWS}
    assert bp.cuflash_kwargs(rows["dropout"], ops) == {"dropout_p": 0.1, "seed": bp.DROPOUT_SEED}
    assert bp.cuflash_kwargs(rows["bias"], ops)["bias"] is ops["bias"]
    assert bp.cuflash_kwargs(rows["sparse50"], ops) == {"block_mask": ops["blocks"], "block_size": 128}
    sm = bp.cuflash_kwargs(rows["relpos"], ops)["score_mod"]
    mm = bp.cuflash_kwargs(rows["docmask"], ops)["mask_mod"]
    assert isinstance(sm, ScoreMod) and sm.grad and sm.tensors["table"] is ops["table"] and not sm.tensor_grads
    assert isinstance(mm, MaskMod) and not mm.per_head and mm.per_batch and "b * 300" in mm.source
    Modifiers(sm, mm).check_compiles()   # the CUDA C of both rows compiles (NVRTC, no GPU needed)


# ---------------------------------------------------------------------------
# Checks and results


def test_dropout_projection():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal(200_000)
    keep = rng.random(ref.size) >= 0.1
    out = ref * keep / 0.9                       # an unbiased dropout of ref (with v = identity)
    c, noise = bp.projection(float(out @ ref), float(ref @ ref), float(out @ out))
    assert abs(c - 1) < 5e-3 and noise == pytest.approx(math.sqrt(0.1 / 0.9), rel=0.05)
    c, _ = bp.projection(float(0.9 * out @ ref), float(ref @ ref), float(0.81 * out @ out))   # no rescale: biased
    assert abs(c - 1) > bp.DROPOUT_BIAS_BOUND
    assert bp.projection(1.0, 1.0, 1.0) == (1.0, 0.0) and math.isnan(bp.projection(1.0, 0.0, 1.0)[0])


def test_dropout_checks(monkeypatch):
    stats = {"cuflash": (1.0002, 0.33), "cudnn": (0.9999, 0.34), "fa4": (0.9, 0.3), "flex": (1.0, 0.9)}
    monkeypatch.setattr(bp, "dropout_stats", lambda out, ref: stats[out])
    values, bounds, notes = bp.dropout_checks({n: n for n in stats}, "plain")
    assert values["cuflash"] == pytest.approx(2e-4) and bounds["cuflash"] == bp.DROPOUT_BIAS_BOUND
    assert "cuflash:noise" not in values and values["cudnn:noise"] == pytest.approx(math.log(0.34 / 0.33))
    r = bp.ProgResult("dropout", "x", "normal", "fwd", bp.work(_small("dropout")), "dense", 0.75, check=values,
                      bounds=bounds, ms={"cuflash": 1.0, "cudnn": 1.1, "fa4": 0.5, "flex": 0.4})
    assert r.check_failed() == ["fa4", "flex"]   # fa4 biased, flex another dropout rate
    assert r.fastest_peer() == "cudnn" and r.vs_peer() == pytest.approx(1.1)
    assert len(notes) == 4 and len(bp.failures([r])) == 2


def _result(name="sparse50", pass_name="fwd+bwd", **ms):
    row = bp.rows_by_name([name])[0]
    return bp.ProgResult(row.name, row.label(), "normal", pass_name, bp.work(row), row.accounting, row.target,
                         ms=dict(ms))


def test_ratios_goals_and_verdicts():
    r = _result(cuflash=2.0, plain=1.2, portable=1.5, cudnn=None, fa4=2.2, flex=3.0)
    w = r.work
    assert r.tflops() == pytest.approx(3.5 * w.useful_flops / 2e-3 / 1e12)
    assert r.tflops("plain") == pytest.approx(3.5 * w.dense_flops / 1.2e-3 / 1e12)
    assert r.vs_plain() == pytest.approx(0.5 * 1.2 / 2.0) and r.vs_portable() == pytest.approx(0.5 * 1.5 / 2.0)
    assert r.fastest_peer() == "fa4" and r.vs_peer() == pytest.approx(1.1)
    assert r.verdict() == "no: plain"                          # half the pairs in 1.67x the time: 0.3 < 0.90
    r.ms["cuflash"] = 0.6
    assert r.verdict() == "yes" and r.vs_plain() == pytest.approx(1.0)
    r.ms["fa4"] = 0.61
    assert r.verdict() == "no: peer" and r.vs_peer() == pytest.approx(0.61 / 0.6)
    r.check = {"fa4": 0.5}                                      # fa4 not the same call: left out
    assert r.fastest_peer() == "flex" and r.verdict() == "yes"
    dense = _result("bias", cuflash=1.3, plain=1.0)
    assert dense.vs_plain() == pytest.approx(1 / 1.3) and dense.verdict() == "yes (no peer)"
    assert _result("bias", plain=1.0).verdict() == "-"


def _fake_results():
    out = []
    for name, peers in (("bias", {"cudnn": 2.6}), ("docmask", {"fa4": 0.5, "flex": 0.7})):
        for p, scale in (("fwd", 1.0), ("fwd+bwd", 3.0)):
            r = _result(name, p, cuflash=0.8 * scale, plain=1.0 * scale, portable=1.2 * scale,
                        **{k: v * scale for k, v in peers.items()})
            row = bp.rows_by_name([name])[0]
            r.na = {peer: bp.static_na(peer, row) for peer in bp.PEERS if bp.static_na(peer, row)}
            out.append(r)
    out[-1].check = {"fa4": 0.3, "flex": 1e-3}
    return out


def test_tables_and_json():
    res = _fake_results()
    text = bp.format_table(res)
    assert "n/a" in text and "no dbias" in text and "counted useful" in text and "counted dense" in text
    assert "(differs)" in text and "bias: cudnn" not in text
    md = bp.markdown_table(res, "header line")
    lines = md.splitlines()
    assert lines[0] == "header line" and lines[2].startswith("| row | dist | pass | cuflash ms | TF/s |")
    assert md.count("| docmask | normal |") == 2 and "| >= 0.90 |" in md and "| >= 0.75 |" in md
    j = json.loads(json.dumps([r.to_json() for r in res]))
    assert j[1]["pass"] == "fwd+bwd" and j[1]["accounting"] == "dense" and j[1]["vs_fastest_peer"] == pytest.approx(
        2.6 / 0.8)
    assert j[3]["fastest_peer"] == "flex" and j[3]["check"]["fa4"] == 0.3 and j[3]["target_vs_plain"] == 0.9
    assert bp.failures(res) == ["docmask [normal]: check fa4 = 0.3 above its bound 0.025"]


# ---------------------------------------------------------------------------
# A case on a fake device


def _fake_device(monkeypatch, cuflash_raises=False):
    """The device work of benchmark_case replaced by host stand-ins; returns the calls made."""
    from cuflash import bench, distributions

    calls = []
    medians = {"cuflash": 2.0, "plain": 1.8, "portable": 2.5, "cudnn": 2.2, "fa4": 2.4, "flex": 3.0}

    def fns(inputs, kwargs, passes=bp.PASSES, *, portable=False):
        impl = "portable" if portable else ("cuflash" if kwargs else "plain")
        if cuflash_raises and impl == "cuflash":
            raise RuntimeError("no kernel")
        out = {p: (lambda p=p: calls.append((impl, p))) for p in passes}
        out["_out"] = impl
        return out

    def timer(fns, warmup=0, repeats=0):
        for f in fns.values():
            f()
        return {name: medians[name] for name in fns}

    monkeypatch.setattr(bp, "row_operands", lambda row: {"blocks": "blocks"})
    monkeypatch.setattr(bp, "cuflash_kwargs", lambda row, ops: {"block_mask": ops["blocks"]})
    monkeypatch.setattr(bp, "cuflash_fns", fns)
    monkeypatch.setattr(bp, "_sync", lambda: None)
    monkeypatch.setattr(bp, "free_memory", lambda: None)
    monkeypatch.setattr(bp, "rel_diff", lambda a, b: 0.5 if a == "other" else 1e-3)
    monkeypatch.setattr(bp, "dropout_stats", lambda out, ref: {"cudnn": (0.9, 0.3)}.get(out, (1.0, 0.3)))
    monkeypatch.setattr(distributions, "make_inputs", lambda shape, dist, seed=0: (None, None, None))
    monkeypatch.setattr(bench, "random_inputs", lambda shape, seed=0: (None,))
    monkeypatch.setattr(bench, "time_interleaved", timer)
    return calls


def _peers(fa4_out="fa4"):
    def peer(name, out=None):
        def build(row, inputs, passes):
            assert inputs.ops == {"blocks": "blocks"}
            built = {p: (lambda: None) for p in passes}
            built["_out"] = out or name
            return built
        return build, None

    def cudnn_fails(row, inputs, passes):
        raise RuntimeError("graph not supported")

    return {"cudnn": (cudnn_fails, None), "fa4": peer("fa4", fa4_out), "flex": peer("flex")}


def test_case_on_a_fake_device(monkeypatch):
    calls = _fake_device(monkeypatch)
    logs = []
    fwd, fb = bp.benchmark_case(bp.rows_by_name(["sparse50"])[0], "mixed", adapters=_peers(), log=logs.append)
    assert (fwd.pass_name, fb.pass_name, fb.dist) == ("fwd", "fwd+bwd", "mixed")
    assert fb.ms == {"cuflash": 2.0, "plain": 1.8, "portable": 2.5, "fa4": 2.4, "flex": 3.0}
    assert fb.na == {"cudnn": bp.static_na("cudnn", bp.rows_by_name(["sparse50"])[0])}   # static: not built
    assert fb.check == {"fa4": 1e-3, "flex": 1e-3} and bp.failures([fwd, fb]) == []
    assert ("cuflash", "fwd+bwd") in calls and ("portable", "fwd") in calls and ("plain", "fwd+bwd") in calls
    assert fb.vs_plain() == pytest.approx(0.5 * 1.8 / 2.0) and fb.vs_peer() == pytest.approx(1.2)
    # a peer whose output differs, a peer that raises: flagged / n/a, the run goes on
    (only,) = bp.benchmark_case(bp.rows_by_name(["bias"])[0], "normal", backward=False,
                                adapters=_peers(fa4_out="other"), log=logs.append)
    assert only.pass_name == "fwd" and only.na["cudnn"] == "RuntimeError: graph not supported"
    assert "fa4" in only.na and "flex" in only.na   # FA4 has no bias, flex is not timed on the bias rows
    # dropout: the unbiasedness check against plain attention's output
    fwd, _ = bp.benchmark_case(bp.rows_by_name(["dropout"])[0], "normal", adapters=_peers(), log=logs.append)
    assert fwd.check == {"cuflash": 0.0, "fa4": 0.0, "fa4:noise": 0.0}   # cudnn raised; flex has no dropout
    res = bp.benchmark_case(bp.rows_by_name(["dropout"])[0], "normal", log=logs.append,
                            adapters={"cudnn": (lambda row, inputs, passes: {"fwd": lambda: None, "_out": "cudnn"},
                                                None)})
    assert res[0].check["cudnn"] == pytest.approx(0.1) and res[0].check_failed() == ["cudnn"]
    assert any("MISMATCH dropout [normal]: cudnn" in x for x in logs) and bp.failures(res)
    assert res[1].na == {"fa4": "not run", "flex": "FlexAttention has no dropout"} and "cudnn" not in res[1].ms


def test_cuflash_failure_is_a_failure(monkeypatch):
    _fake_device(monkeypatch, cuflash_raises=True)
    logs = []
    res = bp.benchmark_programmable(bp.rows_by_name(["relpos"]), ["normal"], adapters={}, log=logs.append)
    assert [r.na["cuflash"] for r in res] == ["FAILED RuntimeError: no kernel"] * 2
    assert all(r.ms["plain"] == 1.8 and r.verdict() == "-" for r in res) and len(bp.failures(res)) == 2
    assert "| FAILED |" in bp.markdown_table(res)
    monkeypatch.setattr(bp, "benchmark_case", lambda *a, **k: [][1])   # a harness bug: recorded, the run goes on
    res = bp.benchmark_programmable(bp.rows_by_name(["relpos", "bias"]), ["normal"], adapters={}, log=logs.append)
    assert len(res) == 4 and all(r.na["cuflash"].startswith("FAILED (the case raised) IndexError") for r in res)


# ---------------------------------------------------------------------------
# The command line


def test_command_line():
    a = parse_args(["--programmable"])
    assert a.programmable and a.rows == bp.ROW_NAMES and a.dists == bp.DEFAULT_DISTS
    assert (a.repeats, a.warmup) == (bp.DEFAULT_REPEATS, bp.DEFAULT_WARMUP)
    a = parse_args(["--programmable", "--quick"])
    assert a.rows == bp.QUICK_ROWS and a.dists == bp.QUICK_DISTS
    a = parse_args(["--programmable", "--rows", "docmask, bias", "--dists", "sink", "--repeats", "7", "--warmup",
                    "1", "--markdown", "--json", "x.json", "--forward-only"])
    assert a.rows == ("docmask", "bias") and a.dists == ("sink",) and (a.repeats, a.warmup) == (7, 1)
    assert a.markdown and a.json == "x.json" and a.forward_only
    assert table_shapes(a) == [bp.SHAPE]
    assert not parse_args([]).programmable
    assert parse_args(["--variants", "--rows", "alibi"]).rows == ("alibi",)   # --rows still serves --variants
    for bad in (["--programmable", "--rows", "bias,nope"], ["--programmable", "--rows", "alibi"],
                ["--variants", "--rows", "bias"], ["--rows", "bias"], ["--programmable", "--variants"],
                ["--programmable", "--shape", "4,16,4096,128,bfloat16"], ["--programmable", "--varlen"],
                ["--programmable", "--dists", "gauss"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_run_prints_the_table_and_fails_on_failures(monkeypatch, capsys, tmp_path):
    seen = {}

    def fake(rows, dists, **kw):
        seen.update(rows=[r.name for r in rows], dists=dists, **kw)
        return _fake_results()

    monkeypatch.setattr(bp, "benchmark_programmable", fake)
    path = tmp_path / "prog.json"
    out = run_table(bp, ["--programmable", "--rows", "bias,docmask", "--markdown", "--json", str(path)], capsys,
                    rc=1)
    assert seen["rows"] == ["bias", "docmask"] and seen["dists"] == bp.DEFAULT_DISTS and seen["backward"]
    assert "programmable-attention table (issue #45): Fake GPU (sm_90)" in out
    assert "| row | dist | pass |" in out and "FAILED docmask [normal]: check fa4" in out
    doc = json.loads(path.read_text())
    assert doc["cc"] == 90 and [r["name"] for r in doc["rows"]] == ["bias", "docmask"] and len(doc["results"]) == 4


# ---------------------------------------------------------------------------
# On a GPU


@requires_gpu
def test_small_case_on_the_gpu():
    """A small docmask row: cuflash, plain and portable run and time (peers where they import)."""
    row = _small("docmask", n=512, batch=2, heads=2)
    res = bp.benchmark_case(row, "normal", repeats=2, warmup=1, log=lambda _: None)
    assert [r.pass_name for r in res] == ["fwd", "fwd+bwd"]
    assert bp.failures(res) == [] and all(r.ms.get("cuflash") and r.ms.get("plain") for r in res)
