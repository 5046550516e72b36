"""Per-tile phase timing of the persistent sm90 forward (a -DCUFLASH_SM90_FWD_TRACE build): clock64
stamps per CTA, consumer warpgroup and tile at the tile's start, Q landed, first K landed, key loop
done and epilogue done (the first 16 tiles of each CTA), and when the producer issued the tile's first K.

    python3 scripts/fwd_trace.py [B,H,N,D,dtype,causal ...]
"""
from __future__ import annotations

import os
import sys

import numpy as np

os.environ["CUFLASH_NVRTC_DEFINES"] = (os.environ.get("CUFLASH_NVRTC_DEFINES", "") + " -DCUFLASH_SM90_FWD_TRACE").strip()

import cupy  # noqa: E402

import cuflash  # noqa: E402
from cuflash import api, tile_counters  # noqa: E402
from cuflash.bench import Shape, random_inputs  # noqa: E402

SLOTS, TILES, WGS = 8, 16, 3


def trace(shape: Shape) -> None:
    q, k, v = random_inputs(shape)
    ctas = 256  # >= the persistent grid (one CTA per SM)
    buf = cupy.zeros(64 // 2 + ctas * WGS * TILES * SLOTS, dtype=cupy.uint64)   # 64 ints, then the stamps
    api._fwd_plans.clear()   # recorded calls keep the counter they were made with
    with tile_counters.fixed(q.device.id, buf.data.ptr):
        for _ in range(4):  # the last run's stamps count
            buf[32:] = 0
            cuflash.forward(q, k, v, causal=shape.causal)
        cupy.cuda.Device().synchronize()
    api._fwd_plans.clear()
    t = buf[32:].get().astype(np.int64).reshape(ctas, WGS, TILES, SLOTS)
    start, q_in, k_in, loop, epi, smid, nk = (t[..., i] for i in range(7))
    used = (start > 0) & (epi > 0) & (k_in > 0)
    med = lambda x: float(np.median(x[used[..., :x.shape[-1]] if x.ndim == 3 else used]))  # noqa: E731
    keys = nk[used]
    loop_per_key = (loop - k_in)[used] / np.maximum(nk[used] - 1, 1)
    # gap: this tile's start minus the same warpgroup's previous epilogue end
    gap = start[..., 1:] - epi[..., :-1]
    gap_used = used[..., 1:] & used[..., :-1]
    print(f"{shape.label()}: {int(used.sum())} (cta, warpgroup, tile) records, key tiles per tile {np.median(keys):.0f}")
    print(f"  median cycles: wait for Q {np.median((q_in - start)[used]):.0f}, then first K {np.median((k_in - q_in)[used]):.0f}, "
          f"key loop {np.median((loop - k_in)[used]):.0f} ({np.median(loop_per_key):.0f} per key tile after the first), "
          f"epilogue {np.median((epi - loop)[used]):.0f}, gap to the next tile {np.median(gap[gap_used]):.0f}")
    for name, x in (("wait for Q", (q_in - start)[used]), ("first K", (k_in - q_in)[used]), ("epilogue", (epi - loop)[used])):
        print(f"  {name}: p10 {np.percentile(x, 10):.0f} p50 {np.percentile(x, 50):.0f} p90 {np.percentile(x, 90):.0f}")
    # first tile of each CTA vs the rest
    first = used[:, :, 0]
    print(f"  first tile of a CTA: wait for Q {np.median((q_in - start)[:, :, 0][first]):.0f}, first K "
          f"{np.median((k_in - q_in)[:, :, 0][first]):.0f}")
    # slot 7 (warpgroup 0 only): when the producer issued the tile's first K load
    k_issue = t[:, 0, :, 7]
    ok = used[:, 0, :] & (k_issue > 0)
    if ok.any():
        print(f"  first K load issued: {np.median((k_issue - start[:, 0, :])[ok]):.0f} cycles after the tile's start "
              f"(negative: before), landed {np.median((k_in[:, 0, :] - k_issue)[ok]):.0f} after its issue; "
              f"Q landed {np.median((q_in[:, 0, :] - k_issue)[ok]):.0f} after it")
    tile_time = (epi - start)[used]
    print(f"  tile (start to epilogue end) median {np.median(tile_time):.0f}; per key tile {np.median(tile_time / keys):.0f}")
    if len(np.unique(keys)) > 1:   # causal: the phases by the tile's count of key tiles
        for n in np.unique(keys)[:8]:
            sel = used & (nk == n)
            print(f"  {n} key tiles ({int(sel.sum())} records): Q {np.median((q_in - start)[sel]):.0f}, first K "
                  f"{np.median((k_in - q_in)[sel]):.0f}, key loop {np.median((loop - k_in)[sel]):.0f}, epilogue "
                  f"{np.median((epi - loop)[sel]):.0f}, tile {np.median((epi - start)[sel]):.0f}")


# Short and long sequences at the two head dims of the persistent overlap kernel's tiles.
DEFAULT_SHAPES = ("16,16,1024,64,float16", "4,16,4096,64,float16", "32,16,512,128,bfloat16",
                  "16,16,1024,128,bfloat16", "4,16,4096,128,bfloat16")


def main() -> int:
    for spec in sys.argv[1:] or DEFAULT_SHAPES:
        trace(Shape.parse(spec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
