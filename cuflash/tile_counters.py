"""Tile counters of the persistent sm90 forward kernels: one slot per launch in flight.

A persistent kernel (kernels_cu/sm90/fwd.cu, ``tile_counter``) hands out its tiles from two int32s in
device memory that must be zero at launch; the last CTA to run out of tiles sets them back to zero. Two
kernels running at once on one slot take each other's tiles, which gives wrong output silently. The
old key, (device, stream pointer), was not enough: every per-thread default stream has pointer 2, a
destroyed stream's handle can come back for a new stream while the old kernel still runs, and a CUDA
graph can be replayed on any stream. So no stream identity is trusted here. Each launch takes a slot
from its device's pool and gives it back through an event recorded after it, and the slot is reused
only once that event has completed, that is, once the kernel has finished and reset it. A launch
captured into a graph keeps its slot for good: every replay uses the same address, and launches of one
graph exec run one after another (cudaGraphLaunch orders them), so no other launch may take it.

Cost per launch: one capture query, one event record and, amortised, one event query (no allocation
once the pool has as many slots as launches in flight). The pool grows by blocks that are zeroed on a
setup stream (capture.setup_stream) and synchronized before use; a few slots are kept in reserve so
that a capture, where growing needs cudaMalloc and a synchronize, rarely has to. When it has to (a
graph with more persistent launches than the reserve), this thread's capture mode is switched to
relaxed around the growth (cuThreadExchangeStreamCaptureMode, as PyTorch's allocator does), which a
global or thread-local capture requires for cudaMalloc and synchronizing another stream; neither call
is captured. Where that fails, the launch raises a RuntimeError that says to call ``reserve`` before
capturing. ``reserve(n)`` makes sure ``n`` slots are free ahead of a capture.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import threading

SLOT_BYTES = 32        # two int32 counters, each slot in its own 32-byte L2 sector
BLOCK_SLOTS = 64       # slots per allocation
RESERVE_SLOTS = 8      # free slots kept for captures, which must not allocate
RECLAIM_SCAN = 16      # events looked at when the free list runs low


class CudaCalls:
    """The runtime calls the pool makes (tests give the pool a stand-in). Bound once: an import on
    every launch would cost as much as the call."""

    def __init__(self) -> None:
        from cupy.cuda import runtime

        self._runtime = runtime

    def is_capturing(self, stream_ptr: int) -> bool:
        # CuPy raises for a capture an error invalidated, and for the legacy stream while another
        # stream captures in global mode: the launch would fail there the same way.
        return bool(self._runtime.streamIsCapturing(stream_ptr))

    def new_event(self, device_id: int) -> int:
        import cupy

        with cupy.cuda.Device(device_id):
            return self._runtime.eventCreateWithFlags(self._runtime.eventDisableTiming)

    def record(self, event: int, stream_ptr: int) -> None:
        self._runtime.eventRecord(event, stream_ptr)

    def done(self, event: int) -> bool:
        return self._runtime.eventQuery(event) == 0   # cudaSuccess; cudaErrorNotReady while the work runs

    @contextlib.contextmanager
    def relaxed_capture_mode(self):
        """This thread's stream capture mode set to relaxed for the block, then put back: a capture in
        global or thread-local mode forbids the calls that growing the pool makes (cudaMalloc, event
        queries, synchronizing the setup stream), relaxed allows them (they are not stream work, so
        nothing of them lands in the graph)."""
        exchange = _capture_mode_exchange()
        mode = ctypes.c_int(_CU_STREAM_CAPTURE_MODE_RELAXED)
        _check_cu(exchange(ctypes.byref(mode)), "cuThreadExchangeStreamCaptureMode")
        try:
            yield
        finally:
            _check_cu(exchange(ctypes.byref(mode)), "cuThreadExchangeStreamCaptureMode")

    def zeroed_block(self, device_id: int, nbytes: int):
        """Device memory of ``nbytes`` zero bytes, kept by the caller for good: allocated from CuPy's
        pool (which frees cached blocks and retries when the device is full) and zeroed on the setup
        stream, waited for, so that a kernel on any stream sees the zeros."""
        import cupy
        from cupy.cuda import runtime

        from .capture import setup_stream

        stream = setup_stream(device_id)
        with cupy.cuda.Device(device_id), stream:
            mem = cupy.cuda.alloc(nbytes)
            runtime.memsetAsync(mem.ptr, 0, nbytes, stream.ptr)
            stream.synchronize()
        return mem


_CU_STREAM_CAPTURE_MODE_RELAXED = 2   # CUstreamCaptureMode
_exchange_fn = None


def _capture_mode_exchange():
    """The driver's cuThreadExchangeStreamCaptureMode (CuPy does not bind it), loaded once."""
    global _exchange_fn
    if _exchange_fn is None:
        fn = ctypes.CDLL("libcuda.so.1").cuThreadExchangeStreamCaptureMode
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(ctypes.c_int)]
        _exchange_fn = fn
    return _exchange_fn


def _check_cu(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed (CUresult {result})")


class TileCounterPool:
    """The tile-counter slots of one device. ``acquire`` before a launch, then ``launched`` after it
    (or ``unused`` if the launch raised)."""

    def __init__(self, device_id: int, cuda: CudaCalls | None = None) -> None:
        self.device_id = device_id
        self._cuda = cuda or CudaCalls()
        self._lock = threading.Lock()
        self._free: list[int] = []                   # slot addresses whose last kernel has finished
        self._in_flight = collections.deque()        # (event, address) of launched, unfinished kernels
        self._spare_events: list[int] = []
        self._blocks: list = []                      # the device memory, never freed
        self.slots = 0
        self.captured = 0                            # slots held by captured launches

    def acquire(self, stream_ptr: int) -> tuple[int, bool]:
        """(slot address, whether ``stream_ptr`` is capturing) for a launch about to go on that stream."""
        capturing = self._cuda.is_capturing(stream_ptr)
        with self._lock:
            if capturing:
                # From the reserve: no event query or allocation inside a capture while a slot is left.
                if not self._free:
                    self._grow_while_capturing()
            elif len(self._free) <= RESERVE_SLOTS:
                self._reclaim()
                if len(self._free) <= RESERVE_SLOTS:
                    self._grow()
            return self._free.pop(), capturing

    def launched(self, ticket: tuple[int, bool], stream_ptr: int) -> None:
        """The kernel given ``ticket`` was launched on ``stream_ptr``: its slot comes back once the
        kernel has finished, or never if the launch was captured into a graph."""
        address, capturing = ticket
        with self._lock:
            if capturing:
                self.captured += 1
                return
            event = self._spare_events.pop() if self._spare_events else None
        if event is None:
            event = self._cuda.new_event(self.device_id)
        # If recording fails, the slot is not put back: its kernel may be running.
        self._cuda.record(event, stream_ptr)
        with self._lock:
            self._in_flight.append((event, address))

    def unused(self, ticket: tuple[int, bool]) -> None:
        """The launch given ``ticket`` raised: no kernel holds its slot."""
        with self._lock:
            self._free.append(ticket[0])

    def in_flight(self) -> int:
        return len(self._in_flight)

    def _reclaim(self) -> None:
        """Frees the slots of finished launches among the oldest few; unfinished ones go to the back,
        so that one long kernel does not hide the finished launches of other streams behind it."""
        for _ in range(min(RECLAIM_SCAN, len(self._in_flight))):
            event, address = self._in_flight.popleft()
            if self._cuda.done(event):
                self._free.append(address)
                self._spare_events.append(event)
            else:
                self._in_flight.append((event, address))

    def _grow_while_capturing(self) -> None:
        """The reserve is spent inside a capture: reclaim and grow in relaxed capture mode (see above)."""
        try:
            with self._cuda.relaxed_capture_mode():
                self._reclaim()
                if not self._free:
                    self._grow()
        except Exception as e:
            raise RuntimeError(
                f"cuflash could not add tile-counter slots for a persistent kernel launched during a CUDA graph "
                f"capture ({type(e).__name__}: {e}); all {self.slots} slots were in use ({self.captured} held by "
                f"captured graphs). Call cuflash.tile_counters.reserve(n, device_id={self.device_id}) before capturing a graph of "
                f"more than that many persistent launches, or capture in relaxed mode") from e

    def reserve(self, n: int) -> None:
        """At least ``n`` free slots, added now (outside any capture)."""
        with self._lock:
            if len(self._free) < n:
                self._reclaim()
            while len(self._free) < n:
                self._grow()

    def _grow(self) -> None:
        block = self._cuda.zeroed_block(self.device_id, BLOCK_SLOTS * SLOT_BYTES)
        self._blocks.append(block)
        base = int(block.ptr)
        self._free.extend(base + i * SLOT_BYTES for i in reversed(range(BLOCK_SLOTS)))
        self.slots += BLOCK_SLOTS


class FixedCounter:
    """One caller-given buffer as every launch's counter: for diagnostic builds that need a larger one
    (dev/trace.py fwd: -DCUFLASH_SM90_FWD_TRACE stamps after the two ints), one stream only."""

    def __init__(self, device_id: int, address: int) -> None:
        self.device_id, self.address = device_id, address

    def acquire(self, stream_ptr: int) -> tuple[int, bool]:
        return self.address, False

    def launched(self, ticket, stream_ptr: int) -> None:
        pass

    def unused(self, ticket) -> None:
        pass


COUNTER_TYPES = (TileCounterPool, FixedCounter)   # what launch.py packs as a counter argument
_pools: dict[int, TileCounterPool] = {}
_fixed: dict[int, FixedCounter] = {}
_pools_lock = threading.Lock()


def for_device(device_id: int):
    """The device's pool (made on first use; it touches the device only when a launch takes a slot)."""
    fixed = _fixed.get(device_id) if _fixed else None
    if fixed is not None:
        return fixed
    pool = _pools.get(device_id)
    if pool is None:
        with _pools_lock:
            pool = _pools.setdefault(device_id, TileCounterPool(device_id))
    return pool


def reserve(n: int, device_id: int | None = None) -> None:
    """Makes sure ``n`` tile-counter slots are free on ``device_id`` (default: the current device),
    allocating now: call it before capturing a CUDA graph with more persistent forward launches than
    the pool keeps in reserve, where growing the pool would otherwise happen during the capture."""
    if device_id is None:
        import cupy

        device_id = cupy.cuda.Device().id
    pool = for_device(device_id)
    if isinstance(pool, TileCounterPool):
        pool.reserve(n)


@contextlib.contextmanager
def fixed(device_id: int, address: int):
    """Launches on ``device_id`` that go through the plans and tensor-map lookups inside the block use
    the buffer at ``address`` as their counter (recorded calls keep the counter they were made with:
    clear ``api._fwd_plans`` around the block)."""
    _fixed[device_id] = FixedCounter(device_id, address)
    try:
        yield
    finally:
        del _fixed[device_id]
