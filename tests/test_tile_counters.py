"""The persistent forward's tile-counter slots (cuflash/tile_counters.py) on the CPU: a stand-in for the
CUDA runtime plays launches on many streams finishing in any order, from many threads, and captures; no
slot may go to a launch while another kernel that was given it has not finished, and a captured slot
never comes back. The launch path (launch.py) writes each launch's slot into its own arguments."""
from __future__ import annotations

import contextlib
import ctypes
import random
import threading

import pytest

from cuflash import launch, options, tile_counters
from cuflash.config import KernelConfig
from cuflash.tile_counters import BLOCK_SLOTS, RESERVE_SLOTS, SLOT_BYTES, TileCounterPool


class _Block:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class CaptureViolation(RuntimeError):
    """What CUDA answers (cudaErrorStreamCaptureUnsupported) to a call that a global-mode capture forbids."""


class FakeCuda:
    """Events are ids whose completion the test decides; streams are ints; capture is per stream, in
    global mode: while any stream captures, a thread not switched to relaxed mode may not allocate or
    query events (cudaMalloc, cudaEventQuery, synchronizing the setup stream), as CUDA forbids."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.finished: set[int] = set()
        self.capturing: set[int] = set()
        self.next_event = 1
        self.next_block = 1 << 20
        self.blocks = 0
        self.last = threading.local()        # .event: the event this thread recorded last
        self.mode = threading.local()        # .relaxed: this thread's capture mode is relaxed
        self.relaxed_ok = True               # False: switching the mode fails (an old driver, say)

    def _unsafe_call(self, what: str) -> None:
        if self.capturing and not getattr(self.mode, "relaxed", False):
            raise CaptureViolation(f"{what} during a global-mode capture")

    @contextlib.contextmanager
    def relaxed_capture_mode(self):
        if not self.relaxed_ok:
            raise RuntimeError("cuThreadExchangeStreamCaptureMode failed")
        before = getattr(self.mode, "relaxed", False)
        self.mode.relaxed = True
        try:
            yield
        finally:
            self.mode.relaxed = before

    def is_capturing(self, stream_ptr):
        return stream_ptr in self.capturing

    def new_event(self, device_id):
        with self.lock:
            self.next_event += 1
            return self.next_event

    def record(self, event, stream_ptr):
        # On a capturing stream the record would be part of the graph, and its completion says nothing.
        assert stream_ptr not in self.capturing, "an event was recorded on a capturing stream"
        with self.lock:
            self.finished.discard(event)   # a spare event recorded again is pending again
        self.last.event = event

    def done(self, event):
        self._unsafe_call("cudaEventQuery")
        with self.lock:
            return event in self.finished

    def zeroed_block(self, device_id, nbytes):
        self._unsafe_call("cudaMalloc")
        with self.lock:
            self.blocks += 1
            ptr, self.next_block = self.next_block, self.next_block + nbytes + 4096
        return _Block(ptr)

    def finish(self, event):
        with self.lock:
            self.finished.add(event)


class Tracker:
    """Which launch holds each slot; the pool must never hand out a held one."""

    def __init__(self, pool: TileCounterPool, cuda: FakeCuda) -> None:
        self.pool, self.cuda = pool, cuda
        self.lock = threading.Lock()
        self.holder: dict[int, object] = {}
        self.pinned: set[int] = set()

    def launch(self, stream: int):
        """acquire + launched, as launch.py does; returns (slot, event or None if captured)."""
        ticket = self.pool.acquire(stream)
        slot = ticket[0]
        with self.lock:
            assert slot not in self.pinned, "a slot held by a captured graph was handed out again"
            assert slot not in self.holder, "a slot was handed out while its kernel had not finished"
            self.holder[slot] = stream
            if ticket[1]:
                self.pinned.add(slot)
        self.pool.launched(ticket, stream)
        return slot, (None if ticket[1] else self.cuda.last.event)

    def finish(self, slot, event):
        """The kernel finished: it reset the slot, then the event after it completed."""
        with self.lock:
            del self.holder[slot]
        self.cuda.finish(event)


def _pool():
    cuda = FakeCuda()
    pool = TileCounterPool(0, cuda)
    return pool, cuda, Tracker(pool, cuda)


def test_slots_are_distinct_sectors_of_zeroed_blocks():
    pool, cuda, tr = _pool()
    slots = [tr.launch(stream=7)[0] for _ in range(3 * BLOCK_SLOTS)]
    assert len(set(slots)) == len(slots)
    assert all(s % SLOT_BYTES == 0 for s in slots)
    assert pool.slots == cuda.blocks * BLOCK_SLOTS >= len(slots)


def test_one_stream_reuses_finished_slots_without_growing():
    """A loop on one stream whose kernels finish: the pool stays at one block, slots come back."""
    pool, cuda, tr = _pool()
    pending = []
    for i in range(2000):
        pending.append(tr.launch(stream=3))
        if len(pending) > 4:   # the host runs four launches ahead of the GPU
            tr.finish(*pending.pop(0))
    assert cuda.blocks == 1 and pool.slots == BLOCK_SLOTS


def test_per_thread_default_streams_share_a_pointer_but_never_a_slot():
    """Every per-thread default stream is pointer 2: launches on it from different threads run at
    once, and must all hold different slots while they run."""
    pool, cuda, tr = _pool()
    running = [tr.launch(stream=2) for _ in range(100)]
    assert len({slot for slot, _ in running}) == 100
    for r in running:
        tr.finish(*r)


def test_random_streams_finish_in_any_order():
    rng = random.Random(1)
    pool, cuda, tr = _pool()
    running = []
    for _ in range(5000):
        if running and rng.random() < 0.5:
            tr.finish(*running.pop(rng.randrange(len(running))))
        else:
            running.append(tr.launch(stream=rng.choice([0, 2, 0x5000, 0x6000])))
    # Growth follows the launches in flight, not the launches made.
    assert pool.slots <= BLOCK_SLOTS * (1 + (max(len(running), 1) + RESERVE_SLOTS + 16) // BLOCK_SLOTS + 2)


def test_a_long_kernel_does_not_hide_finished_ones():
    """One kernel that never finishes at the head of the queue: finished launches of other streams
    behind it still come back, so the pool does not grow with every launch."""
    pool, cuda, tr = _pool()
    tr.launch(stream=5)   # never finishes
    for _ in range(3000):
        tr.finish(*tr.launch(stream=6))
    assert cuda.blocks <= 2


def test_captured_slots_are_kept_and_captures_take_the_reserve():
    pool, cuda, tr = _pool()
    tr.finish(*tr.launch(stream=9))   # the first block exists
    blocks = cuda.blocks
    cuda.capturing.add(9)
    pinned = [tr.launch(stream=9) for _ in range(RESERVE_SLOTS)]
    assert all(event is None for _, event in pinned)
    assert cuda.blocks == blocks, "a capture grew the pool while free slots were left"
    assert pool.captured == RESERVE_SLOTS
    cuda.capturing.clear()
    for _ in range(4 * BLOCK_SLOTS):   # eager launches afterwards never get a captured slot (Tracker asserts)
        tr.finish(*tr.launch(stream=9))


def test_a_capture_with_no_free_slot_grows_the_pool():
    pool, cuda, tr = _pool()
    cuda.capturing.add(4)
    slots = [tr.launch(stream=4)[0] for _ in range(BLOCK_SLOTS + 1)]
    assert len(set(slots)) == len(slots) and cuda.blocks == 2


def test_growth_during_a_global_capture_switches_to_relaxed_mode():
    """The reserve spent inside a global-mode capture: the pool grows with this thread in relaxed mode
    (the fake raises otherwise), and the mode is put back after."""
    pool, cuda, tr = _pool()
    tr.finish(*tr.launch(stream=9))
    cuda.capturing.add(9)
    slots = [tr.launch(stream=9)[0] for _ in range(3 * BLOCK_SLOTS)]
    assert len(set(slots)) == len(slots) and cuda.blocks == 3   # the first, reclaimed, then two more
    assert not getattr(cuda.mode, "relaxed", False)
    with pytest.raises(CaptureViolation):   # the fake does forbid it outside relaxed mode
        cuda.zeroed_block(0, 64)


def test_a_capture_reclaims_finished_launches_before_growing():
    """The free list empty inside a capture: the slots of finished launches still in flight for the pool
    come back first (in relaxed mode), and the pool grows only once none has finished."""
    pool, cuda, tr = _pool()
    for _ in range(5):
        tr.finish(*tr.launch(stream=9))   # finished, but reclaimed only when the free list runs low
    assert pool.in_flight() == 5
    pool._free.clear()
    cuda.capturing.add(9)
    slots = [tr.launch(stream=9)[0] for _ in range(3)]
    # The first launch reclaimed all five at once (up to RECLAIM_SCAN), the next two took from them.
    assert cuda.blocks == 1 and pool.slots == BLOCK_SLOTS and pool.in_flight() == 0 and len(pool._free) == 2
    pool._free.clear()
    pool._in_flight.clear()   # nothing left to reclaim: the capture has to grow
    slots += [tr.launch(stream=9)[0] for _ in range(3)]
    assert cuda.blocks == 2 and pool.slots == 2 * BLOCK_SLOTS and len(pool._free) == BLOCK_SLOTS - 3
    assert len(set(slots)) == 6 and pool.captured == 6


def test_growth_that_cannot_happen_during_a_capture_says_to_reserve():
    pool, cuda, tr = _pool()
    cuda.relaxed_ok = False
    cuda.capturing.add(4)
    with pytest.raises(RuntimeError, match=r"during a CUDA graph capture.*tile_counters.reserve\(n, device_id=0\)"):
        pool.acquire(4)


def test_reserve_ahead_of_a_capture():
    """reserve(n) outside the capture: n captured launches then take no allocation and no event query."""
    pool, cuda, tr = _pool()
    pool.reserve(200)
    blocks = cuda.blocks
    cuda.relaxed_ok = False   # any growth during the capture would raise
    cuda.capturing.add(5)
    slots = [tr.launch(stream=5)[0] for _ in range(200)]
    assert len(set(slots)) == 200 and cuda.blocks == blocks


def test_unused_slot_comes_back_at_once():
    pool, cuda, tr = _pool()
    ticket = pool.acquire(1)
    pool.unused(ticket)
    assert pool.acquire(1)[0] == ticket[0]


def test_threads():
    """Eight threads launching and finishing at random: never two running kernels on one slot."""
    pool, cuda, tr = _pool()
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        mine = []
        try:
            for _ in range(1500):
                if mine and rng.random() < 0.45:
                    tr.finish(*mine.pop(rng.randrange(len(mine))))
                else:
                    mine.append(tr.launch(stream=rng.choice([2, 2, 0x7000 + seed])))
            for r in mine:
                tr.finish(*r)
        except AssertionError as e:   # noqa: PERF203
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_for_device_and_fixed():
    a = tile_counters.for_device(12345)
    assert tile_counters.for_device(12345) is a and isinstance(a, TileCounterPool)
    with tile_counters.fixed(12345, 0xABC00):
        fixed = tile_counters.for_device(12345)
        assert fixed.acquire(2) == (0xABC00, False)
    assert tile_counters.for_device(12345) is a


class _FakeKernel:
    class kernel:  # noqa: N801 - mimics RawKernel.kernel.ptr
        ptr = 0x1234


def _counter_value(pointers_ptr: int, index: int) -> int:
    """The 8 bytes that the launch's argument ``index`` points at."""
    arg = ctypes.cast(pointers_ptr, ctypes.POINTER(ctypes.c_void_p))[index]
    return ctypes.c_uint64.from_address(arg).value


@pytest.mark.parametrize("via", ["prepared", "launch"])
def test_launch_writes_each_launch_slot(monkeypatch, via):
    """The packed arguments carry the slot acquired for that launch (read back through the kernel
    parameter pointers, as the driver reads them), from several threads at once on one Prepared."""
    pytest.importorskip("cupy")
    pool, cuda, tr = _pool()
    cfg = KernelConfig("sm90_fwd_p", "float16", 64, False, 192, 128, 16)
    params = bytes(range(200)) + bytes(40)
    seen, errors = [], []
    current = threading.local()

    def fake_launch(fptr, gx, gy, gz, bx, by, bz, smem, stream, pointers, extra):
        slot = _counter_value(pointers, 2)   # params, the maps' run (one map here), then the counter
        head = ctypes.string_at(ctypes.cast(pointers, ctypes.POINTER(ctypes.c_void_p))[0], 240)
        if head != params or tr.holder.get(slot) is not threading.current_thread():
            errors.append((head == params, slot))
        seen.append(slot)
        current.slot = slot

    map_ = launch.PackedTail((__import__("numpy").zeros(1, "V128"),))
    monkeypatch.setattr(launch, "_cuda", (fake_launch, lambda: type("S", (), {"ptr": 2})()))
    options.set(launch="packed")   # conftest restores the options after the test
    real_acquire = pool.acquire

    def tracked_acquire(stream):   # register the holder before the fake launch reads it
        ticket = real_acquire(stream)
        with tr.lock:
            assert ticket[0] not in tr.holder
            tr.holder[ticket[0]] = threading.current_thread()
        return ticket

    monkeypatch.setattr(pool, "acquire", tracked_acquire)
    prepared = launch.Prepared(_FakeKernel(), cfg, (132, 1, 1), params, 0, (map_, pool))
    prepared._launch_kernel = fake_launch

    def worker():
        for i in range(300):
            if via == "prepared":
                prepared(2)
            else:
                launch.launch(_FakeKernel(), cfg, (132, 1, 1), params, 0, (map_, pool))
            if i % 3:   # some kernels still run when the next launch comes
                tr.finish(current.slot, cuda.last.event)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert len(seen) == 1200 and len(set(seen)) > 4


def test_growth_inside_a_real_global_mode_capture():
    """On the GPU: every slot of the pool set aside (free, and finished but not yet reclaimed), three
    persistent forwards captured in a graph in global mode (which forbids cudaMalloc and synchronizing):
    the pool grows by one block during the capture without breaking it, the captured launches hold slots
    of that block, and the replayed graph writes what the eager call gives."""
    from conftest import GPU_SKIP_REASON, randn

    if GPU_SKIP_REASON is not None:
        pytest.skip(f"needs an NVIDIA GPU: {GPU_SKIP_REASON}")
    import cupy
    import numpy as np

    import cuflash
    from cuflash import api, heuristics

    rng = np.random.default_rng(7)
    q, k, v = (randn(rng, (1, 1024, 4, 64), "float16") for _ in range(3))
    expected = cuflash.forward(q, k, v)   # compiles, and makes the pool if the kernel is persistent
    dev = q.data.device_id
    cfg = api._fwd_plan(q.dtype, 64, False, dev, heuristics.fwd_short(1024, 1024), heuristics.fwd_long(1024, 1024))[1]
    if not cfg.fam.persistent:
        pytest.skip(f"the forward here ({cfg.family}) is not a persistent kernel (those run on Hopper)")
    pool = tile_counters.for_device(dev)
    cupy.cuda.Device().synchronize()
    # Every slot set aside: the free ones, and those of launches that have finished but are still in flight
    # for the pool (the eager call above, earlier tests' launches), which a capture with no free slot
    # reclaims before it grows (test_a_capture_reclaims_finished_launches_before_growing). With only the
    # free list emptied the capture needs no new block.
    with pool._lock:
        saved_free, pool._free[:] = list(pool._free), []
        saved_in_flight = list(pool._in_flight)
        pool._in_flight.clear()
        slots, captured = pool.slots, pool.captured
    outs = [cupy.full(q.shape, np.nan, dtype=q.dtype) for _ in range(3)]
    stream = cupy.cuda.Stream(non_blocking=True)
    try:
        with stream:
            stream.begin_capture(mode=cupy.cuda.runtime.streamCaptureModeGlobal)
            try:
                for o in outs:
                    cuflash.forward(q, k, v, out=o)
            finally:
                graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
    finally:
        with pool._lock:
            free_after, in_flight_after = len(pool._free), len(pool._in_flight)
            pool._free.extend(saved_free)
            pool._in_flight.extend(saved_in_flight)
    # One block added during the capture, and the three captured launches took their slots from it.
    assert (pool.slots - slots, pool.captured - captured) == (BLOCK_SLOTS, 3)
    assert (free_after, in_flight_after) == (BLOCK_SLOTS - 3, 0)
    for o in outs:
        assert bool(cupy.array_equal(o, expected))
