"""Attention-variant benchmarks (issue #41's rows, cuflash/bench_variants.py): each row x input distribution,
forward and forward+backward of cuflash with the variant beside plain cuflash, SDPA cuDNN on the plain call,
FlashAttention-4 and cuDNN through cudnn-frontend where they import (n/a with the reason where a peer lacks the
variant), timed interleaved as ``python -m cuflash --variants`` does; the session ends with the variant table
(benchmarks/conftest.py). Every case fails if cuflash fails its call or a peer's output differs from cuflash's.

    python -m pytest benchmarks/bench_variants.py --benchmark-only -q
    CUFLASH_VARIANT_ROWS=window8k,alibi CUFLASH_VARIANT_DISTS=normal python -m pytest benchmarks/bench_variants.py ...
"""
from __future__ import annotations

import os

import pytest

from cuflash import bench_variants as bv

REPEATS = 20
ROWS = bv.rows_by_name([x for x in os.environ.get("CUFLASH_VARIANT_ROWS", ",".join(bv.ROW_NAMES)).split(",") if x])
DISTS = tuple(x for x in os.environ.get("CUFLASH_VARIANT_DISTS", ",".join(bv.DEFAULT_DISTS)).split(",") if x)
CASES = [(row, dist) for row in ROWS for dist in DISTS]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].name}-{c[1]}")
def test_variant(benchmark, record_variant, case):
    import cupy

    from cuflash.bench import random_inputs
    from cuflash.distributions import make_inputs

    row, dist = case
    results = bv.benchmark_case(row, dist, repeats=REPEATS)
    for r in results:
        record_variant(r)
    by_pass = {r.pass_name: r for r in results}
    fb = by_pass["fwd+bwd"]
    benchmark.extra_info.update({
        "row": row.name, "dist": dist, "tiles_per_head": fb.work.tiles, "pairs_per_head": fb.work.pairs,
        **{f"{p}_{impl}_ms": ms for p, r in by_pass.items() for impl, ms in r.ms.items()},
        **{f"{p}_tflops_tiles": r.tile_tflops() for p, r in by_pass.items()},
        **{f"{p}_tflops_useful": r.useful_tflops() for p, r in by_pass.items()},
        **{f"{p}_vs_plain_tiles": r.vs_plain() for p, r in by_pass.items()},
        **{f"{p}_vs_fastest_peer": r.vs_peer() for p, r in by_pass.items()},
        "na": fb.na, "check": fb.check})
    bad = bv.failures(results)
    assert not bad, "\n".join(bad)
    # pytest-benchmark's own rounds: cuflash's forward+backward with the variant
    q, k, v = make_inputs(row.shape, dist)
    fns = bv.cuflash_fns(q, k, v, random_inputs(row.shape, seed=1)[0], row.variant)
    benchmark.pedantic(lambda: (fns["fwd+bwd"](), cupy.cuda.get_current_stream().synchronize()), rounds=5,
                       iterations=1)
