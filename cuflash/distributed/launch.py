"""Starts one process per GPU, joins them in an NCCL ring and runs a function on each rank.

Used by the benchmark (bench.py), the multi-GPU check (check.py) and the tests; a user's own launcher
(torchrun, mpirun, a job scheduler) only has to hand every rank the same ``nccl.get_unique_id()``.
"""
from __future__ import annotations

import multiprocessing
import os
import queue as queue_module
import traceback
from typing import Any, Callable, Sequence


def gpu_count() -> int:
    """GPUs visible to this process (0 without CuPy, a driver or a GPU)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - any failure means no usable GPU here
        return 0


def _rank_main(fn, rank: int, world: int, unique_id, args, results, time_waits: bool) -> None:
    try:
        # NVLink multicast (NVLS) off: the ring only sends point to point, and some hosts cannot set it up.
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        import cupy

        from .transport import NcclRing

        cupy.cuda.Device(rank).use()
        group = NcclRing.from_unique_id(unique_id, rank, world, time_waits=time_waits)
        results.put((rank, True, fn(group, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable, world: int, args: Sequence = (), *, time_waits: bool = False,
              timeout_s: float = 1800.0) -> list:
    """Runs ``fn(group, *args)`` on ranks 0..world-1, rank r on GPU r, each in its own process
    (spawned: CUDA state is never forked); returns the results in rank order. ``fn`` and its results
    must pickle. A rank that raises stops the others, and its traceback is raised here."""
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be an int >= 1, got {world!r}")
    available = gpu_count()
    if world > available:
        raise ValueError(f"world={world} needs {world} GPUs, {available} visible")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    from .transport import nccl_module

    unique_id = nccl_module().get_unique_id()
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, unique_id, tuple(args), results, time_waits),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out: list[Any] = [None] * world
    try:
        for _ in range(world):
            try:
                rank, ok, value = results.get(timeout=timeout_s)
            except queue_module.Empty:
                raise TimeoutError(f"the ranks did not finish within {timeout_s:.0f} s") from None
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    return out
