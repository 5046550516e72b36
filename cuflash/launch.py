"""Grid and block sizing for each kernel family, and the launch. (Each kernel's dynamic shared memory comes
from its compiled module: dispatch.smem_bytes.)"""
from __future__ import annotations

import ctypes
import threading

import numpy as np

from . import options, tile_counters
from .config import KernelConfig


_sm_counts: dict = {}


def sm_count() -> int:
    """Streaming multiprocessors of the current device (cached)."""
    import cupy
    dev = cupy.cuda.Device().id
    n = _sm_counts.get(dev)
    if n is None:
        n = _sm_counts[dev] = cupy.cuda.Device(dev).attributes["MultiProcessorCount"]
    return n


def fwd_grid(c: KernelConfig, batch: int, heads_q: int, seqlen_q: int) -> tuple[int, int, int]:
    """One CTA per (query tile, head, batch); persistent families: one per SM, at
    most one per tile (the kernel walks the tiles itself); the other sm90 families with uneven work per
    tile (causal, windows: KernelConfig.uneven): a 1-D
    grid of all tiles, walked longest first (kernels_cu/sm90/fwd.cu: grid_coords). Clusters (``c.cluster``
    CTAs on adjacent query tiles): query tiles counted in whole clusters, the grid a multiple of it."""
    tiles = -(-((seqlen_q + c.block_m - 1) // c.block_m) // c.cluster) * c.cluster
    if c.fam.persistent:
        return (max(c.cluster, min(tiles * heads_q * batch, sm_count()) // c.cluster * c.cluster), 1, 1)
    if c.uneven and c.fam.sm90_fwd:
        return (tiles * heads_q * batch, 1, 1)
    return (tiles, heads_q, batch)


def bwd_row_grid(c: KernelConfig, batch: int, heads_q: int, seqlen_q: int) -> tuple[int, int, int]:
    """Pre/postprocess and the dQ kernel: one CTA per (block_m query rows, head, batch)."""
    return ((seqlen_q + c.block_m - 1) // c.block_m, heads_q, batch)


# sm90 backward, not causal, not ordered: the 128-row query tiles (head dims <= 64) and the one-warpgroup
# short-sequence tiles (num_warps 8) take the sectioned 1-D grid, whose L2 reuse of Q and dO makes them faster;
# the 64-row tiles (D=96..256) are level or slower on it and keep the 3-D grid (BENCHMARKS.md, "History").
def bwd_dkdv_grid(c: KernelConfig, batch: int, heads_kv: int, seqlen_k: int) -> tuple[int, int, int]:
    """dK/dV kernel: one CTA per (key tile, kv head, batch); the causal or windowed (uneven work per key
    tile: Mask::kUnevenWork) and the ordered (deterministic) sm90 kernels, and the others with 128-row query
    tiles or one consumer warpgroup, take a 1-D grid and walk it key-tile-major
    in L2-sized sections of (kv head, batch) groups: heaviest key tiles first, or the ordered kernel's
    rank order (kernels_cu/sm90/bwd_scheduler.cuh: BwdTileScheduler::block)."""
    n_blocks = (seqlen_k + c.block_n - 1) // c.block_n
    if c.fam.sm90_bwd and (c.uneven or c.fam.dq_mode == "ordered" or c.block_m == 128
                           or c.num_warps == 8):
        return (n_blocks * heads_kv * batch, 1, 1)
    return (n_blocks, heads_kv, batch)


# Kernel arguments are packed into one per-thread buffer laid out as the kernel's parameter list
# (each argument at its C alignment; tests/test_launch_layout.py checks against the PTX), and
# cuLaunchKernel gets an array of pointers into it. CuPy's own launch path reads
# ``__array_interface__`` of every NumPy argument (about 1.5 us each, 20 us for a structured
# dtype); this path costs one memmove. Options.launch "cupy" ($CUFLASH_LAUNCH=cupy) selects CuPy's path.
TMA_DESC_ALIGN = 64      # alignas(64) struct TmaDesc, kernels_cu/sm90/tma.cuh
_PARAM_BUFFER_BYTES = 4096  # the CUDA limit on kernel parameters


class _ParamBuffer(threading.local):
    """A per-thread parameter buffer and, per argument layout, the array of pointers into it (the
    driver copies the parameters during cuLaunchKernel: the buffer is free when the call returns)."""

    def __init__(self) -> None:
        self.data = ctypes.create_string_buffer(_PARAM_BUFFER_BYTES)
        self.data_ptr = ctypes.addressof(self.data)
        self.words = memoryview(self.data).cast("B").cast("Q")   # 8-byte views: where a tile counter goes
        self.pointer_arrays: dict = {}

    def pointers(self, offsets: tuple) -> int:
        found = self.pointer_arrays.get(offsets)
        if found is None:
            array = (ctypes.c_void_p * len(offsets))(*[self.data_ptr + o for o in offsets])
            found = self.pointer_arrays[offsets] = (array, ctypes.addressof(array))
        return found[1]


_param_buffer = _ParamBuffer()
_function_ptrs: dict = {}
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


class PackedTail:
    """Kernel arguments packed once (e.g. cached tensor maps): their parameter bytes laid out from a
    ``TMA_DESC_ALIGN``-aligned offset, and each argument's offset within them."""

    __slots__ = ("args", "blob", "offsets")

    def __init__(self, args: tuple) -> None:
        self.args = tuple(args)
        self.blob, self.offsets = _pack(b"", (), args)


def _is_counter(a) -> bool:
    """A tile-counter pool (tile_counters.py) standing for the pointer argument it fills per launch."""
    return isinstance(a, tile_counters.COUNTER_TYPES)


def _pack(head: bytes, head_offsets: tuple, args, counters: list | None = None) -> tuple[bytes, tuple]:
    parts, offsets, size = [head], list(head_offsets), len(head)
    for a in args:
        if isinstance(a, PackedTail):
            align, blob = TMA_DESC_ALIGN, a.blob
        elif isinstance(a, np.ndarray):
            align, blob = (TMA_DESC_ALIGN if a.dtype.itemsize == 128 else 8), a.tobytes()
        elif _is_counter(a):   # a pointer written at launch time
            if counters is None:
                raise TypeError("a tile counter cannot be packed ahead of its launch (PackedTail)")
            align, blob = 8, bytes(8)
        else:  # a CuPy array: its device pointer
            align, blob = 8, a.data.ptr.to_bytes(8, "little")
        pad = -size % align
        if pad:
            parts.append(bytes(pad))
        size += pad
        if counters is not None and _is_counter(a):
            counters.append((a, size))
        offsets.extend([size + o for o in a.offsets] if isinstance(a, PackedTail) else [size])
        parts.append(blob)
        size += len(blob)
    return b"".join(parts), tuple(offsets)


def pack_arguments(params, extra_args: tuple = ()) -> tuple[bytes, tuple]:
    """The kernel parameter bytes of ``(params struct, *extra_args)`` and each argument's offset:
    the struct (bytes or a one-element array, at 0), then tensor maps (one-element ``V128``
    arrays, 64-byte aligned), ``PackedTail`` runs of them, device pointers (CuPy arrays), and tile
    counters (tile_counters.py: 8 zero bytes here, a slot's address at launch)."""
    return _pack_launch(params, extra_args)[:2]


def _pack_launch(params, extra_args: tuple) -> tuple[bytes, tuple, tuple]:
    """pack_arguments, and (tile-counter pool, byte offset) of the counter argument, or (None, 0)."""
    head = params if isinstance(params, bytes) else params.tobytes()
    counters: list = []
    blob, offsets = _pack(head, (0,), extra_args, counters)
    if len(counters) > 1:
        raise ValueError("a kernel takes at most one tile counter")
    return blob, offsets, (counters[0] if counters else (None, 0))


def _launch_counted(launch_kernel, fptr: int, grid: tuple, threads: int, smem: int, stream_ptr: int,
                    args, nbytes: int, offsets: tuple, counters, counter_offset: int) -> None:
    """Launches a kernel that takes a tile counter: its arguments (``args``: the packed bytes or their
    address) copied into this thread's buffer with a slot of ``counters`` written in, and the slot handed
    to the pool after the launch (the driver copies the parameters during cuLaunchKernel, so the buffer
    is free again when it returns)."""
    buf = _param_buffer
    ctypes.memmove(buf.data_ptr, args, nbytes)
    ticket = counters.acquire(stream_ptr)
    buf.words[counter_offset >> 3] = ticket[0]
    try:
        launch_kernel(fptr, grid[0], grid[1], grid[2], threads, 1, 1, smem, stream_ptr, buf.pointers(offsets), 0)
    except BaseException:
        counters.unused(ticket)
        raise
    counters.launched(ticket, stream_ptr)


def function_ptr(kernel, smem: int) -> int:
    """The CUfunction of a RawKernel, allowed ``smem`` bytes of dynamic shared memory (the
    attribute that CuPy's own launch path would apply)."""
    found = _function_ptrs.get(id(kernel))
    if found is None or found[0] is not kernel or found[2] < smem:
        from cupy.cuda import driver

        fptr = kernel.kernel.ptr
        if smem > 48 * 1024:
            driver.funcSetAttribute(fptr, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
        found = _function_ptrs[id(kernel)] = (kernel, fptr, max(smem, 48 * 1024))
    return found[1]


def launch(kernel, config: KernelConfig, grid: tuple[int, int, int], params, smem: int,
           extra_args: tuple = (), programmatic: bool = False) -> None:
    """Launch on CuPy's current stream (of the current device). ``params``: the parameter struct
    (bytes, or a one-element array); ``extra_args`` follow it (e.g. the sm90 tensor maps). ``programmatic``
    (cc 9.0): launched as a programmatic dependent of the stream's previous kernel (cuLaunchKernelEx with
    programmatic stream serialization: it may start before that kernel ends, and waits for it in
    ``grid_dependency_wait``, kernels_cu/common/launch_order.cuh)."""
    if programmatic:
        args, offsets, (counters, _) = _pack_launch(params, extra_args)
        if counters is not None:
            raise ValueError("a kernel with a tile counter cannot be launched programmatically")
        buf = _param_buffer
        ctypes.memmove(buf.data_ptr, args, len(args))
        _launch_programmatic(function_ptr(kernel, smem), grid, config.threads, smem,
                             (_cuda or _bind_cuda())[1]().ptr, buf.pointers(offsets))
        return
    if options.current().launch == "cupy":
        _launch_via_cupy(kernel, config, grid, params, smem, extra_args)
        return
    launch_kernel, current_stream = _cuda or _bind_cuda()
    args, offsets, (counters, counter_offset) = _pack_launch(params, extra_args)
    fptr, stream_ptr = function_ptr(kernel, smem), current_stream().ptr
    if counters is not None:
        _launch_counted(launch_kernel, fptr, grid, config.threads, smem, stream_ptr, args, len(args), offsets,
                        counters, counter_offset)
        return
    buf = _param_buffer
    ctypes.memmove(buf.data_ptr, args, len(args))
    launch_kernel(fptr, grid[0], grid[1], grid[2], config.threads, 1, 1, smem, stream_ptr, buf.pointers(offsets), 0)


class _LaunchAttributeValue(ctypes.Union):   # CUlaunchAttributeValue: a 64-byte union
    _fields_ = [("pad", ctypes.c_char * 64), ("flag", ctypes.c_int)]


class _LaunchAttribute(ctypes.Structure):    # CUlaunchAttribute
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttributeValue)]


class _LaunchConfig(ctypes.Structure):       # CUlaunchConfig
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_launch_ex = None


def _launch_programmatic(fptr: int, grid: tuple, threads: int, smem: int, stream_ptr: int, params_ptr: int) -> None:
    """cuLaunchKernelEx (CuPy does not bind it) with programmatic stream serialization allowed."""
    global _launch_ex
    if _launch_ex is None:
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        _launch_ex = fn
    attr = _LaunchAttribute(id=_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value.flag = 1
    config = _LaunchConfig(grid[0], grid[1], grid[2], threads, 1, 1, smem, stream_ptr,
                           ctypes.pointer(attr), 1)
    result = _launch_ex(ctypes.byref(config), fptr, params_ptr, None)
    if result != 0:
        raise RuntimeError(f"cuLaunchKernelEx (programmatic) failed (CUresult {result})")


# (cuLaunchKernel, CuPy's current-stream getter), bound on first use: an import statement on every
# launch costs ~0.4 us.
_cuda = None


def _bind_cuda():
    global _cuda
    from cupy.cuda import driver, get_current_stream

    _cuda = (driver.launchKernel, get_current_stream)
    return _cuda


class Prepared:
    """One launch with its arguments packed into a buffer of its own, ready to be replayed on any
    stream: the forward's call cache (api.py) keeps these for calls it has seen, so that a repeated
    call skips the checks, the plan and tensor-map lookups and the packing. The buffer is never
    written after construction (the driver copies the parameters during cuLaunchKernel), so threads
    may replay one concurrently. A kernel that takes a tile counter gets a slot of its pool per launch,
    written into a per-thread copy of the arguments (``_launch_counted``)."""

    __slots__ = ("kernel", "fptr", "grid", "threads", "smem", "_buffer", "_pointer_array", "pointers",
                 "_launch_kernel", "_offsets", "_counters", "_counter_offset")

    def __init__(self, kernel, config: KernelConfig, grid: tuple[int, int, int], params, smem: int,
                 extra_args: tuple = ()) -> None:
        args, offsets, (self._counters, self._counter_offset) = _pack_launch(params, extra_args)
        self.kernel = kernel   # keeps the module (and so fptr) alive
        self.fptr = function_ptr(kernel, smem)
        self.grid, self.threads, self.smem = grid, config.threads, smem
        self._buffer = ctypes.create_string_buffer(args, len(args))
        self._offsets = offsets
        base = ctypes.addressof(self._buffer)
        self._pointer_array = (ctypes.c_void_p * len(offsets))(*[base + o for o in offsets])
        self.pointers = ctypes.addressof(self._pointer_array)
        self._launch_kernel = (_cuda or _bind_cuda())[0]

    def __call__(self, stream_ptr: int) -> None:
        if self._counters is not None:
            _launch_counted(self._launch_kernel, self.fptr, self.grid, self.threads, self.smem, stream_ptr,
                            ctypes.addressof(self._buffer), len(self._buffer), self._offsets, self._counters,
                            self._counter_offset)
            return
        gx, gy, gz = self.grid
        self._launch_kernel(self.fptr, gx, gy, gz, self.threads, 1, 1, self.smem, stream_ptr, self.pointers, 0)

    def on_current_stream(self) -> None:
        """Launches on CuPy's current stream (of the current device)."""
        self(_cuda[1]().ptr)


def prepare(kernel, config: KernelConfig, grid: tuple[int, int, int], params, smem: int,
            extra_args: tuple = ()):
    """A ``Prepared`` launch (arguments as for ``launch``), or None where launches go through CuPy
    (Options.launch "cupy", $CUFLASH_LAUNCH=cupy)."""
    return None if options.current().launch == "cupy" else Prepared(kernel, config, grid, params, smem, extra_args)


def _launch_via_cupy(kernel, config: KernelConfig, grid, params, smem: int, extra_args: tuple) -> None:
    """CuPy's RawKernel call (one NumPy array per by-value argument)."""
    head = params if isinstance(params, bytes) else params.tobytes()
    values = [np.frombuffer(head, dtype=f"V{len(head)}")]
    counters = ticket = None
    for a in extra_args:
        if _is_counter(a):
            counters = a
            stream_ptr = (_cuda or _bind_cuda())[1]().ptr
            ticket = counters.acquire(stream_ptr)
            values.append(np.uint64(ticket[0]))   # the slot's address, passed by value as the pointer
        else:
            values.extend(a.args if isinstance(a, PackedTail) else [a])
    if counters is None:
        kernel(grid, (config.threads,), tuple(values), shared_mem=smem)
        return
    try:
        kernel(grid, (config.threads,), tuple(values), shared_mem=smem)
    except BaseException:
        counters.unused(ticket)
        raise
    counters.launched(ticket, stream_ptr)

