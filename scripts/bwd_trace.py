"""Per-CTA phase timing of the sm90 backward's dK/dV kernel (a -DCUFLASH_SM90_BWD_TRACE build): clock64
stamps at CTA start, K/V ready, first S^T/dP^T done, main loop done, dK/dV stored and the last dQ
reduce read, and the idle gap on each SM between one CTA's end and the next one's start.

    python3 scripts/bwd_trace.py [B,H,N,D,dtype,causal ...]
"""
from __future__ import annotations

import os
import sys

import numpy as np

os.environ["CUFLASH_NVRTC_DEFINES"] = (os.environ.get("CUFLASH_NVRTC_DEFINES", "") + " -DCUFLASH_SM90_BWD_TRACE").strip()

import cupy  # noqa: E402

import cuflash  # noqa: E402
from cuflash import launch, params  # noqa: E402
from cuflash.bench import Shape, random_inputs  # noqa: E402

_SEM_OFFSET = params.BWD_PARAMS.fields["dq_semaphore"][1]


def trace(shape: Shape) -> None:
    q, k, v = random_inputs(shape)
    dout = random_inputs(shape, seed=1)[0]
    o, lse = cuflash.forward(q, k, v, causal=shape.causal, return_lse=True)
    real_launch = launch.launch
    captured = {}

    def traced_launch(kernel, config, grid, p, smem, extra_args=()):
        if config.family == "sm90_bwd_dkdv_dqtile":
            ctas = grid[0] * grid[1] * grid[2]
            buf = captured["buf"] = cupy.zeros((ctas, 16), dtype=cupy.uint64)
            captured["cfg"] = config
            p = bytearray(p)
            p[_SEM_OFFSET:_SEM_OFFSET + 8] = buf.data.ptr.to_bytes(8, "little")
            p = bytes(p)
        real_launch(kernel, config, grid, p, smem, extra_args)

    for rep in range(4):  # the last run's stamps count (warm caches and clocks)
        launch.launch = traced_launch
        try:
            cuflash.backward(dout, q, k, v, o, lse, causal=shape.causal)
        finally:
            launch.launch = real_launch
    cupy.cuda.Device().synchronize()
    t = captured["buf"].get().astype(np.int64)
    cfg = captured["cfg"]
    sm, t0, kv, first, loop, epi, dq, n_iter = (t[:, i] for i in range(8))
    entry = t[:, 15]
    end = np.maximum(epi, dq)
    med = lambda x: float(np.median(x))  # noqa: E731
    steps = np.maximum(n_iter - 1, 1)
    print(f"{shape.label()} tile m{cfg.block_m} n{cfg.block_n} w{cfg.num_warps}: {len(t)} CTAs, "
          f"{med(n_iter):.0f} steps; median cycles: K/V ready {med(kv - t0):.0f}, first S/dP done "
          f"{med(first - kv):.0f}, loop {med(loop - kv):.0f} ({med((loop - first) / steps):.0f}/step after the "
          f"first), epilogue {med(epi - loop):.0f}, last dQ read after loop {med(dq - loop):.0f}, CTA "
          f"{med(end - t0):.0f}")
    n_steps = int(min(7, n_iter.min()))
    if n_steps > 1:
        ends = t[:, 8:8 + n_steps]
        per_step = np.diff(np.concatenate([kv[:, None], ends], axis=1), axis=1)
        print("  step durations (median cycles, from K/V ready): "
              + " ".join(f"{np.median(per_step[:, j]):.0f}" for j in range(n_steps)))
    gaps, entry_gaps, spans, busy = [], [], [], []
    for s in np.unique(sm):
        idx = np.where(sm == s)[0]
        order = idx[np.argsort(t0[idx])]
        # CTAs that overlap (two per SM) make a negative gap; count the idle time between them only.
        for a, b in zip(order[:-1], order[1:]):
            gaps.append(t0[b] - end[a])
            entry_gaps.append(entry[b] - end[a])
        spans.append(end[order].max() - t0[order].min())
        busy.append(np.sum(end[order] - t0[order]))
    gaps = np.array(gaps)
    print(f"  per SM: {med([len(np.where(sm == s)[0]) for s in np.unique(sm)]):.0f} CTAs, span {med(spans):.0f} "
          f"(max {max(spans):.0f}), CTA-time / span {med(np.array(busy) / np.array(spans)):.2f}; gap to the next "
          f"CTA median {med(gaps):.0f}, p90 {float(np.percentile(gaps, 90)):.0f}; of which before the kernel's entry "
          f"{med(entry_gaps):.0f} and from the entry to the CTA's start (its coordinates, barrier set-up) {med(t0 - entry):.0f}")


def main() -> int:
    specs = sys.argv[1:] or ["16,16,1024,64,float16,0", "4,16,4096,64,float16,0", "16,16,1024,128,bfloat16,0",
                             "4,16,4096,128,bfloat16,0"]
    for spec in specs:
        trace(Shape.parse(spec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
