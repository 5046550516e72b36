"""Programmable-attention benchmarks (issue #45's rows, cuflash/bench_programmable.py): each row x input
distribution, forward and forward+backward of cuflash with dropout, a bias, key padding, a block mask or a CUDA C
modifier beside plain cuflash (default and portable kernels), cuDNN through cudnn-frontend, FlashAttention-4 and
FlexAttention where they import (n/a with the reason where a peer lacks the feature), timed interleaved as
``python -m cuflash --programmable`` does; the session ends with the table (benchmarks/conftest.py). Every case
fails if cuflash fails its call or an output is not the same call.

    python -m pytest benchmarks/bench_programmable.py --benchmark-only -q
    CUFLASH_PROG_ROWS=bias,docmask CUFLASH_PROG_DISTS=normal python -m pytest benchmarks/bench_programmable.py ...
"""
from __future__ import annotations

import os

import pytest

from cuflash import bench_programmable as bp

REPEATS = 20
ROWS = bp.rows_by_name([x for x in os.environ.get("CUFLASH_PROG_ROWS", ",".join(bp.ROW_NAMES)).split(",") if x])
DISTS = tuple(x for x in os.environ.get("CUFLASH_PROG_DISTS", ",".join(bp.DEFAULT_DISTS)).split(",") if x)
CASES = [(row, dist) for row in ROWS for dist in DISTS]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].name}-{c[1]}")
def test_programmable(benchmark, record_programmable, case):
    import cupy

    from cuflash.bench import random_inputs
    from cuflash.distributions import make_inputs

    row, dist = case
    results = bp.benchmark_case(row, dist, repeats=REPEATS)
    for r in results:
        record_programmable(r)
    by_pass = {r.pass_name: r for r in results}
    fb = by_pass["fwd+bwd"]
    benchmark.extra_info.update({
        "row": row.name, "dist": dist, "accounting": row.accounting, "pairs": fb.work.pairs,
        **{f"{p}_{impl}_ms": ms for p, r in by_pass.items() for impl, ms in r.ms.items()},
        **{f"{p}_tflops": r.tflops() for p, r in by_pass.items()},
        **{f"{p}_vs_plain": r.vs_plain() for p, r in by_pass.items()},
        **{f"{p}_vs_fastest_peer": r.vs_peer() for p, r in by_pass.items()},
        "na": fb.na, "check": fb.check})
    bad = bp.failures(results)
    assert not bad, "\n".join(bad)
    # pytest-benchmark's own rounds: cuflash's forward+backward with the row's programmable part
    q, k, v = make_inputs(row.shape, dist)
    inputs = bp.CaseInputs(q, k, v, random_inputs(row.shape, seed=1)[0], bp.row_operands(row))
    fns = bp.cuflash_fns(inputs, bp.cuflash_kwargs(row, inputs.ops))

    def fwd_bwd():
        fns["fwd+bwd"]()
        cupy.cuda.get_current_stream().synchronize()

    benchmark.pedantic(fwd_bwd, rounds=5, iterations=1)
