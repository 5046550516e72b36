"""Decode benchmarks (issue #44's rows, cuflash/bench_decode.py): cuflash.forward_kvcache at seqlen_q=1, bf16, D=128,
32 query / 8 KV heads, contiguous and paged (page 64) caches, as GB/s of the bytes the call moves, beside the copy
bandwidth measured in this process and PyTorch SDPA, FlashInfer and FlashAttention-4 where they run (n/a with the reason
where not), timed interleaved as ``python -m cuflash --decode`` does; the module ends with the decode table. A case
fails if cuflash fails its call or its check against the float32 reference, or a peer's output differs from it; a row
whose K/V cache exceeds 40 % of the free device memory skips.

    python -m pytest benchmarks/bench_decode.py --benchmark-only -q
    CUFLASH_DECODE_ROWS='b8-*,b1-128k-paged64' CUFLASH_DECODE_DISTS=normal \
        python -m pytest benchmarks/bench_decode.py --benchmark-only -q
"""
from __future__ import annotations

import os

import pytest

from cuflash import bench_decode as bd

REPEATS = 20
ROWS = bd.rows_by_name([x for x in os.environ.get("CUFLASH_DECODE_ROWS", ",".join(bd.DEFAULT_ROWS)).split(",") if x])
DISTS = tuple(x for x in os.environ.get("CUFLASH_DECODE_DISTS", ",".join(bd.DEFAULT_DISTS)).split(",") if x)
CASES = [(row, dist) for row in ROWS for dist in DISTS]

_RESULTS: list = []


@pytest.fixture(scope="module")
def copy_gbps():
    """The device's copy bandwidth (bench_decode.copy_bandwidth), measured once for the module; None if it fails."""
    try:
        return bd.copy_bandwidth()["copy_gbps"]
    except Exception:  # noqa: BLE001 - the cases still run, without "% of copy"
        return None


@pytest.fixture(scope="module")
def adapters():
    return bd.peer_adapters()


@pytest.fixture(scope="module", autouse=True)
def decode_table(request):
    """Writes the decode table of the module's cases at its end."""
    yield
    if not _RESULTS:
        return
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_sep("=", "decode (cuflash/bench_decode.py, issue #44)")
        reporter.write_line(bd.format_table(_RESULTS))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].name}-{c[1]}")
def test_decode(benchmark, case, copy_gbps, adapters):
    import cupy
    import cuflash

    row, dist = case
    if not hasattr(cuflash, "forward_kvcache"):
        pytest.skip("this cuflash has no forward_kvcache")
    why = bd.memory_skip(row.kv_bytes(), bd.free_bytes())
    if why:
        _RESULTS.append(bd.skipped_result(row, dist, why, copy_gbps))
        pytest.skip(why)
    prepared = bd.prepare(row, bd.draw_inputs(row, dist))
    r = bd.benchmark_case(row, dist, prepared, copy_gbps=copy_gbps, repeats=REPEATS, adapters=adapters)
    _RESULTS.append(r)
    benchmark.extra_info.update({
        "row": row.name, "dist": dist, "bytes": r.bytes, "copy_gbps": copy_gbps,
        **{f"{k}_ms": ms for k, ms in r.ms.items()}, **{f"{k}_gbps": r.gbps(k) for k in r.ms},
        "copy_fraction": r.copy_fraction(), **{f"vs_{p}": r.vs(p) for p in bd.PEERS},
        "best": {p: r.best(p) for p in bd.PEERS}, "na": r.na, "check": r.check, "bar": r.bar()})
    bad = bd.failures([r])
    assert not bad, "\n".join(bad)
    # pytest-benchmark's own rounds: cuflash's decode call
    call = bd.cuflash_call(prepared)
    benchmark.pedantic(lambda: (call(), cupy.cuda.get_current_stream().synchronize()), rounds=10, iterations=1)
    del call, prepared
    bd.free_memory()
