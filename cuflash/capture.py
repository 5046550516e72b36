"""CUDA graph capture and one-time setup work, as a call sees them.

A call captured into a CUDA graph (``cupy.cuda.Stream.begin_capture``) runs again on every replay with
the addresses it had at capture time. So the temporaries such a call allocates must outlive it (CuPy's
pool would otherwise hand their memory to other arrays while the graph still reads and writes it), and
one-time setup (zeroing a new block of tile counters, filling a cached device scalar) must neither land
in the graph nor wait on the caller's stream: it runs on a stream of its own and is waited for there.
"""
from __future__ import annotations

import threading

_lock = threading.Lock()
# Temporaries of captured calls, kept for the life of the process: nothing says when a graph made from
# them is destroyed, and a replay may come at any time. Costs their memory once per captured call.
_kept: list = []
_setup_streams: dict = {}


def stream_is_capturing(stream_ptr: int) -> bool:
    """Whether work on this stream is being captured into a graph (CuPy raises for a capture that an
    error invalidated, and for the legacy stream while another stream captures in global mode: a launch
    there would fail the same way)."""
    from cupy.cuda import runtime

    return bool(runtime.streamIsCapturing(stream_ptr))


def keep_if_capturing(*arrays) -> None:
    """Keeps ``arrays`` (None entries ignored) alive for good if the current stream is capturing."""
    from cupy.cuda import get_current_stream

    if stream_is_capturing(get_current_stream().ptr):
        with _lock:
            _kept.extend(a for a in arrays if a is not None)


def kept_count() -> int:
    """How many temporaries captured calls have left alive (tests)."""
    return len(_kept)


def setup_stream(device_id: int):
    """A non-blocking stream of ``device_id`` for one-time setup work (never captured, ordered after
    nothing of the caller's); the caller synchronizes it before publishing what it made."""
    stream = _setup_streams.get(device_id)
    if stream is None:
        import cupy
        from cupy.cuda import runtime

        with _lock:
            stream = _setup_streams.get(device_id)
            if stream is None:
                # Made with the runtime and kept for the process (CuPy's Stream would destroy it when
                # collected, and leaves a half-built object behind when there is no driver).
                with cupy.cuda.Device(device_id):
                    ptr = runtime.streamCreateWithFlags(runtime.streamNonBlocking)
                stream = _setup_streams[device_id] = external_stream(ptr, device_id)
    return stream


class _StreamHandle:
    """A raw stream pointer in the CUDA stream protocol, which ``cupy.cuda.Stream.from_external`` reads."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self):
        return 0, self.ptr


def external_stream(ptr: int, device_id: int):
    """A CuPy stream object over a stream made elsewhere (``ptr`` a cudaStream_t of ``device_id``); CuPy
    never destroys it. ``Stream.from_external`` where CuPy has it (14 deprecates ExternalStream)."""
    import cupy

    if hasattr(cupy.cuda.Stream, "from_external"):
        return cupy.cuda.Stream.from_external(_StreamHandle(ptr))
    return cupy.cuda.ExternalStream(ptr, device_id)
