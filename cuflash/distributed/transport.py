"""How ring steps reach the neighbours: NCCL between processes, or device copies within one process.

The ring schedules (ring.py) are generators: they queue their kernels on the current stream and yield
an :class:`Exchange` (send these buffers to the next rank, receive those from the previous one; the
answer is a handle) or a :class:`Wait` (the compute stream must not go on before that exchange is done).
A transport runs them. :class:`NcclRing` runs one rank's schedule with NCCL on a side stream, so that
the transfers overlap the step's kernels; :func:`run_local` runs every rank's schedule in one process
on one GPU, in lockstep, with the transfers as device copies (tests, and checking a sharding).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Generator, Optional, Sequence


@dataclass
class Exchange:
    """Send ``sends`` to rank + 1 and receive ``recvs`` (same shapes, in order) from rank - 1.
    Every buffer is contiguous; the sends are not written and the receives not read until the
    matching :class:`Wait`."""

    sends: Sequence
    recvs: Sequence


@dataclass
class Wait:
    """The compute stream waits for the exchange of ``handle``."""

    handle: Any


Schedule = Generator[Any, Any, Any]


def nccl_module():
    """``cupy.cuda.nccl``, or RuntimeError saying what to install when CuPy cannot load NCCL."""
    from cupy.cuda import nccl

    if not nccl.available:
        raise RuntimeError("ring attention over several GPUs needs NCCL, which CuPy could not load: "
                           "pip install nvidia-nccl-cu12 (CUDA 12) or nvidia-nccl-cu13 (CUDA 13), or install "
                           "cuflash with the distributed-cuda12 / distributed-cuda13 extra")
    return nccl


def fingerprint(what: tuple) -> int:
    """A 64-bit digest of a call's shapes and options (the same on every rank for equal ones)."""
    return int.from_bytes(hashlib.blake2b(repr(what).encode(), digest_size=8).digest(), "little", signed=True)


def disagreement(fingerprints, rank: int, what: tuple) -> Optional[str]:
    """The error message when the ranks' fingerprints (index = rank) differ, else None."""
    mine = fingerprints[rank]
    differ = [r for r, f in enumerate(fingerprints) if f != mine]
    if not differ:
        return None
    return (f"the ranks of this ring disagree on the call: rank {rank} calls with {what!r}, ranks {differ} "
            f"with other shapes, dtype or options; every rank must make the same call (different sizes "
            f"would be exchanged, and the transfers would hang)")


class NcclRing:
    """One rank's place in a ring of ``world`` GPUs, one process each, over an NCCL communicator.

    Args:
        comm: a ``cupy.cuda.nccl.NcclCommunicator`` of ``world`` ranks on the current device (its own
            rank and size must be ``rank`` and ``world``: ValueError otherwise).
        rank, world: this rank and the ring's size (as given to the communicator).
        time_waits: record CUDA events around each wait, so that :meth:`wait_ms` can tell how long the
            kernels waited for the transfers (costs two events per wait).

    :meth:`close` (or leaving a ``with`` block) destroys the communicator; the ring cannot run after.
    """

    def __init__(self, comm, rank: int, world: int, *, time_waits: bool = False):
        import cupy

        if not isinstance(rank, int) or not isinstance(world, int) or not 0 <= rank < world:
            raise ValueError(f"rank and world must be ints with 0 <= rank < world, got rank={rank!r}, "
                             f"world={world!r}")
        _check_communicator(comm, rank, world)
        self.comm, self.rank, self.world = comm, rank, world
        self._agreed: set = set()
        self._closed = False
        self.device_id = cupy.cuda.Device().id
        self.stream = cupy.cuda.Stream(non_blocking=True)   # the transfers' own stream
        self.time_waits = time_waits
        self._wait_events: list = []

    @classmethod
    def from_unique_id(cls, unique_id, rank: int, world: int, **kw) -> "NcclRing":
        """Joins the ring whose id the launcher made with ``cupy.cuda.nccl.get_unique_id()`` (on the
        current device; every rank calls this with the same id)."""
        nccl = nccl_module()
        return cls(nccl.NcclCommunicator(world, unique_id, rank), rank, world, **kw)

    def __enter__(self) -> "NcclRing":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Destroys the communicator (after the transfers queued on it); later calls raise. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.stream.synchronize()
        finally:
            destroy = getattr(self.comm, "destroy", None)
            if destroy is not None:
                destroy()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this NcclRing was closed: its communicator is destroyed")

    def agree(self, what: tuple) -> None:
        """Checks, the first time this rank makes a call described by ``what`` (shapes, dtype, options),
        that every rank makes the same: an all-gather of a 64-bit fingerprint, then a host wait. ValueError
        on every rank if not. (A rank that already checked a call does not check it again: ranks that
        first agree and later diverge are not caught.)"""
        self._check_open()
        if self.world == 1 or what in self._agreed:
            return
        import cupy
        import numpy as np
        from cupy.cuda import nccl

        # The copy of the fingerprint to the device goes on the transfers' own (non-blocking) stream: on the
        # current stream, the all-gather could read the buffer before it lands (a recycled block's old value).
        with cupy.cuda.Device(self.device_id), self.stream:
            send = cupy.asarray(np.array([fingerprint(what)], dtype=np.int64))
            recv = cupy.empty(self.world, dtype=np.int64)
            self.comm.allGather(send.data.ptr, recv.data.ptr, 1, nccl.NCCL_INT64, self.stream.ptr)
            self.stream.synchronize()
            got = recv.get().tolist()
        message = disagreement(got, self.rank, what)
        if message is not None:
            raise ValueError(message)
        if len(self._agreed) >= 256:
            self._agreed.clear()
        self._agreed.add(what)

    def run(self, schedule: Schedule):
        """Runs one rank's schedule; returns what it returns. Nothing is synchronised with the host."""
        import cupy
        from cupy.cuda import nccl

        self._check_open()
        if cupy.cuda.Device().id != self.device_id:
            raise ValueError(f"the ring runs on device {self.device_id} (its communicator's), but the current "
                             f"device is {cupy.cuda.Device().id}")
        compute = cupy.cuda.get_current_stream()
        nxt, prv = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        answer = None
        while True:
            try:
                request = schedule.send(answer)
            except StopIteration as stop:
                return stop.value
            if isinstance(request, Exchange):
                # The transfers start once the kernels queued so far are done: they wrote the sends, and
                # were the last to read the receive buffers.
                self.stream.wait_event(compute.record())
                nccl.groupStart()
                try:
                    for buf in request.sends:
                        self.comm.send(buf.data.ptr, buf.nbytes, nccl.NCCL_UINT8, nxt, self.stream.ptr)
                    for buf in request.recvs:
                        self.comm.recv(buf.data.ptr, buf.nbytes, nccl.NCCL_UINT8, prv, self.stream.ptr)
                finally:
                    nccl.groupEnd()
                answer = self.stream.record()
            elif isinstance(request, Wait):
                if self.time_waits:
                    before = cupy.cuda.Event()
                    before.record(compute)
                compute.wait_event(request.handle)
                if self.time_waits:
                    after = cupy.cuda.Event()
                    after.record(compute)
                    self._wait_events.append((before, after))
                answer = None
            else:  # pragma: no cover - a schedule's bug
                raise TypeError(f"a ring schedule yielded {request!r}")

    def wait_ms(self) -> float:
        """Milliseconds the compute stream stood waiting for transfers since the last call (needs
        ``time_waits``; synchronises)."""
        import cupy

        total = 0.0
        for before, after in self._wait_events:
            after.synchronize()
            total += cupy.cuda.get_elapsed_time(before, after)
        self._wait_events.clear()
        return total


def _check_communicator(comm, rank: int, world: int) -> None:
    """The communicator's own rank and size (where it tells them) are the ones given."""
    rank_of, size_of = getattr(comm, "rank_id", None), getattr(comm, "size", None)
    if callable(rank_of) and callable(size_of):
        comm_rank, comm_size = rank_of(), size_of()
        if (comm_rank, comm_size) != (rank, world):
            raise ValueError(f"the communicator is rank {comm_rank} of {comm_size}, but NcclRing was given rank "
                             f"{rank} of {world}")


def _device_copy(src, dst) -> None:
    if src.nbytes != dst.nbytes:
        raise RuntimeError(f"ring exchange of {src.nbytes} bytes into a buffer of {dst.nbytes}")
    dst.data.copy_from_device_async(src.data, src.nbytes)


def run_local(schedules: Sequence[Schedule], copy: Callable = _device_copy) -> list:
    """Runs the schedules of every rank (index = rank) in one process, in lockstep, on the current
    stream: an exchange is a copy (``copy(src, dst)``, on the device by default) from each rank's sends
    to the next rank's receives. Returns what each schedule returns."""
    world = len(schedules)
    answers = [None] * world
    results: list = [None] * world
    running = list(range(world))
    while running:
        requests = {}
        for r in running:
            try:
                requests[r] = schedules[r].send(answers[r])
            except StopIteration as stop:
                results[r] = stop.value
        finished = [r for r in running if r not in requests]
        if finished and len(finished) != len(running):
            raise RuntimeError(f"ring schedules out of step: ranks {finished} finished, the others did not")
        running = [r for r in running if r in requests]
        if not running:
            break
        kinds = {type(requests[r]) for r in running}
        if len(kinds) != 1:
            raise RuntimeError(f"ring schedules out of step: {sorted(k.__name__ for k in kinds)} at one step")
        if kinds == {Exchange}:
            for r in running:   # receive buffers are never another rank's send buffers: copies in any order
                sends = requests[(r - 1) % world].sends
                recvs = requests[r].recvs
                for src, dst in zip(sends, recvs):
                    copy(src, dst)
        # The copies are queued on the one stream already: an exchange's handle only has to be distinct.
        answers = [object() if kinds == {Exchange} else None for _ in range(world)]
    return results
