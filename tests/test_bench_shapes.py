"""CPU: the head-dim table (cuflash/bench_shapes.py, python -m cuflash --head-dims): its rows, FLOP counts, bar,
table and command line, on made-up timings (the timings themselves need a GPU)."""
from __future__ import annotations

import pytest

from cuflash import bench_shapes as bs
from cuflash.__main__ import parse_args


def test_rows():
    assert bs.ROW_NAMES == ("mla192", "mla192-causal", "d512", "d512-causal", "mla576")
    by = {r.name: r for r in bs.HEAD_DIM_ROWS}
    assert (by["mla192"].head_dim, by["mla192"].head_dim_v, by["mla192"].ref_dim) == (192, 128, 128)
    assert (by["d512"].head_dim, by["d512"].ref_dim) == (512, 256) and by["d512"].large
    assert not by["mla192"].large and by["mla576"].passes == ("fwd",)
    with pytest.raises(ValueError, match="unknown head-dim row"):
        bs.rows_by_name(["d1024"])


def test_flops():
    row = bs.HeadDimRow("x", 1, 1, 4, 192, 128, False, 128)
    assert bs.pass_flops(row, "fwd") == 16 * 2 * (192 + 128)
    assert bs.pass_flops(row, "fwd+bwd") == 16 * 2 * (4 * 192 + 3 * 128)
    assert bs.pass_flops(row, "fwd", 128, 128) == 16 * 4 * 128
    # Equal head dims: forward+backward is 3.5x the forward (bench.PASS_FLOPS).
    assert bs.pass_flops(row, "fwd+bwd", 128, 128) == 3.5 * bs.pass_flops(row, "fwd", 128, 128)
    causal = bs.HeadDimRow("x", 2, 3, 4, 128, 128, True, 128)
    assert bs.pass_flops(causal, "fwd") == 2 * 3 * 10 * 4 * 128


def _result(ms, diffs=None, na=None):
    r = bs.ShapeResult("d512", "label", "normal", "fwd", 1e12, 0.5e12)
    r.ms.update(ms)
    r.diffs.update(diffs or {})
    r.na.update(na or {})
    return r


def test_bar():
    # A peer runs: against the faster one.
    r = _result({"cuflash": 1.0, "own": 0.5, "cudnn": 1.2, "fa4": 1.1})
    assert r.vs("fa4") == pytest.approx(1.1) and r.bar() == "met (1.10x fa4)"
    assert _result({"cuflash": 1.0, "own": 0.5, "fa4": 1.04}).bar().startswith("NOT met")
    # No peer (or one whose output differs): cuflash's own reference per FLOP (own does half the FLOPs here).
    r = _result({"cuflash": 1.0, "own": 0.5, "cudnn": 2.0}, diffs={"cudnn": 1.0}, na={"fa4": "ImportError"})
    assert r.peers_run() == [] and r.bar() == "met (1.00x own)"
    assert _result({"cuflash": 1.0, "own": 0.4}).bar() == "NOT met (0.80x own)"
    assert _result({"own": 0.5}, na={"cuflash": "ValueError"}).bar() == "n/a"


def test_failures_and_table():
    rs = [_result({"cuflash": 1.0, "own": 0.5, "cudnn": 1.2}, diffs={"cudnn": 0.5}, na={"fa4": "no fa4"}),
          _result({"own": 0.5}, na={"cuflash": "ValueError: x"})]
    bad = bs.failures(rs)
    assert any("cudnn's output differs" in b for b in bad) and any("cuflash: ValueError" in b for b in bad)
    text = bs.format_table(rs)
    assert "differs" in text and "fa4 n/a on d512: no fa4" in text
    md = bs.markdown_table(rs, "head")
    assert md.splitlines()[0] == "head" and md.count("\n| d512 |") == 2
    assert rs[0].to_json()["bar"] == rs[0].bar()


def test_kernel_configs():
    cfgs = bs.kernel_configs(90)
    families = {c.family for c in cfgs}
    assert {"sm90_fwd_split", "sm90_bwd_split_dv", "sm90_bwd_split_dk", "sm90_bwd_split_dq"} <= families
    assert any(c.head_dim == 192 and c.head_dim_v == 128 for c in cfgs)


def test_command_line():
    args = parse_args(["--head-dims"])
    assert args.head_dim_rows == bs.ROW_NAMES and args.head_dim_dists == bs.DEFAULT_DISTS
    assert (args.repeats, args.warmup) == (bs.DEFAULT_REPEATS, bs.DEFAULT_WARMUP)
    args = parse_args(["--head-dims", "--quick", "--repeats", "7"])
    assert args.head_dim_rows == bs.QUICK_ROWS and args.head_dim_dists == bs.QUICK_DISTS and args.repeats == 7
    args = parse_args(["--head-dims", "--head-dim-rows", "d512", "--head-dim-dists", "sink"])
    assert args.head_dim_rows == ("d512",) and args.head_dim_dists == ("sink",)
    for bad in (["--head-dim-rows", "d512"], ["--head-dims", "--varlen"], ["--head-dims", "--head-dim-rows", "x"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
