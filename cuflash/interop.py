"""Arrays from other frameworks in, results in the caller's framework out (DLPack, zero-copy).

The public entry points take CuPy arrays on their fast path. Any other argument that speaks DLPack
(a PyTorch CUDA tensor, a JAX array on a GPU, another library's CUDA array) comes here: it is
viewed as a CuPy array with ``cupy.from_dlpack`` (no copy), the entry point runs on the views, and
its results go back to the framework of the inputs. Rules:

- All array arguments of one call come from one framework (mixing is a TypeError naming them).
- Arrays in host memory (NumPy, a CPU torch tensor) are a TypeError with a hint, raised from
  metadata alone, before the device is touched.
- torch's bfloat16 crosses DLPack as int16 (a CuPy without bfloat16 DLPack support reads it too)
  and its float8_e4m3fn as uint8, both as views of the same memory.
- PyTorch: the call runs on torch's current stream of the inputs' device (so it is ordered with the
  torch work before and after it, with no synchronisation), and every allocation cuflash makes
  during the call (outputs not given, the log-sum-exp, the backward's workspaces) comes from
  torch's caching allocator: torch accounts for the memory, and under CUDA graph capture it comes
  from the graph's private pool. Results are torch tensors; a buffer passed as ``out=`` (or
  ``dq=``...) is returned as the very tensor given. Inputs are read through ``detach()``: cuflash's
  own functions are not differentiable in torch, ``cuflash.torch`` is.
- PyTorch output buffers (``out=``, ``dq=``...) are written behind autograd's back, so their version
  counter is bumped after the call (``torch.autograd.graph.increment_version``): a buffer that autograd
  saved for a backward then raises there, as after any in-place write. A buffer that requires grad is
  refused while grad mode is on (torch refuses in-place writes into leaves that require grad).
- JAX: results are JAX arrays; JAX arrays are immutable, so they are refused as output buffers. The
  inputs are read on CuPy's current stream after JAX's pending work on them (the DLPack stream handshake:
  ``__dlpack__(stream=...)`` makes that stream wait for the arrays), and they are kept alive until the
  kernels reading them have finished (an event recorded after the call), so that JAX cannot free and
  reuse their memory while the kernels still read it. The same holds for other DLPack producers.
- Other DLPack producers on CUDA: results stay CuPy arrays (there is no general way back).
"""
from __future__ import annotations

import collections
import contextlib
import sys
import threading
from typing import Any, Callable, Optional

import numpy as np

from ._checks import BFLOAT16
from .capture import external_stream

# DLPack device types (dlpack.h) that CuPy reads in place.
_DL_CUDA, _DL_CUDA_MANAGED = 2, 13
_ACCEPTED = ("must be a cupy.ndarray or a CUDA array with __dlpack__ (a torch tensor on a CUDA device, a JAX "
             "array on a GPU)")

_ndarray: Optional[type] = None   # cupy.ndarray, bound on first use (CuPy is imported lazily)


def _bind_cupy() -> type:
    global _ndarray
    import cupy

    _ndarray = cupy.ndarray
    return _ndarray


def needs_conversion(*arrays: Any) -> bool:
    """Whether any argument is an array of another framework (it has ``__dlpack__``, is not a CuPy
    or NumPy array): only then does a call come here. The CuPy path pays a few type comparisons;
    NumPy arrays and non-arrays go on to the entry point's own checks, whose TypeErrors say what to do."""
    nd = _ndarray or _bind_cupy()
    for x in arrays:
        if (x is not None and type(x) is not nd and not isinstance(x, (nd, np.ndarray))
                and hasattr(x, "__dlpack__")):
            return True
    return False


def call(fn: Callable, arrays: dict, *, buffers: tuple = (), **options: Any):
    """``fn(**arrays, **options)`` on CuPy views of ``arrays`` (name -> array or None), with the
    results in the arrays' framework.

    ``buffers`` names the output buffers among ``arrays``: they must be writable, and a result that
    is one of them is returned as the object the caller gave. Raises TypeError, before the device is
    touched, for an argument that is not an array, an array in host memory, arrays of several
    frameworks, or an immutable output buffer.
    """
    given = {name: x for name, x in arrays.items() if x is not None}
    framework = _common_framework(given)
    for name in buffers:
        if name in given and not framework.writable:
            raise TypeError(f"{name}: {framework.label} arrays are immutable and cannot be written into; "
                            f"leave {name} unset and use the returned array")
    written = [given[name] for name in buffers if name in given]
    framework.check_buffers(written, [name for name in buffers if name in given])
    first = next(iter(given.values()))
    with framework.running(framework.device_id(first)):
        views = {name: (framework.to_cupy(name, x) if x is not None else None) for name, x in arrays.items()}
        result = fn(**views, **options)
        framework.after_call(views, written)
        originals = {id(views[name]): x for name, x in given.items()}
        if isinstance(result, tuple):
            return tuple(_back(framework, r, originals) for r in result)
        return _back(framework, result, originals)


def _back(framework, result, originals: dict):
    """One result in the caller's framework: a buffer the caller gave is returned as given."""
    original = originals.get(id(result))
    if original is not None:
        return original
    if isinstance(result, dict):   # e.g. the backward's {tensor name: gradient} of a score modifier
        return {name: _back(framework, r, originals) for name, r in result.items()}
    return framework.from_cupy(result) if isinstance(result, _ndarray) else result


# ---------------------------------------------------------------------------
# Frameworks


class _Framework:
    """How arrays of one framework become CuPy views, where they live, and how results go back."""

    name = label = ""
    writable = True

    def device_id(self, x) -> int:
        return x.__dlpack_device__()[1]

    def to_cupy(self, name: str, x):
        import cupy

        try:
            return cupy.from_dlpack(x)
        except (BufferError, TypeError, ValueError) as e:
            raise TypeError(f"{name}: CuPy cannot read this {self.label} array through DLPack ({e})") from e

    def from_cupy(self, a):
        return a

    def running(self, device_id: int):
        import cupy

        return cupy.cuda.Device(device_id)

    def check_buffers(self, buffers: list, names: list) -> None:
        """Output buffers this framework cannot have written behind its back (metadata only)."""

    def after_call(self, views: dict, written: list) -> None:
        """After the kernels are queued: the views of memory this framework owns (and may free or reuse
        once they are gone) are kept alive until the current stream has passed this point."""
        keep_until_done([v for v in views.values() if v is not None])


class _CuPy(_Framework):
    name = label = "cupy"

    def device_id(self, x) -> int:
        return x.data.device_id

    def to_cupy(self, name: str, x):
        return x

    def after_call(self, views: dict, written: list) -> None:
        pass


class _Torch(_Framework):
    name = label = "torch"

    def device_id(self, x) -> int:
        return x.device.index

    def to_cupy(self, name: str, x):
        torch = sys.modules["torch"]
        t = x.detach()   # torch refuses to export a tensor that requires grad
        if t.dtype == torch.bfloat16:
            return super().to_cupy(name, t.view(torch.int16)).view(BFLOAT16)
        if t.dtype == getattr(torch, "float8_e4m3fn", None):
            return super().to_cupy(name, t.view(torch.uint8))
        return super().to_cupy(name, t)

    def from_cupy(self, a):
        torch = sys.modules["torch"]
        block = getattr(a.data.mem, "_owner", None)
        dtype = getattr(torch, _TORCH_DTYPE_NAMES.get(a.dtype, ""), None)
        if isinstance(block, torch.Tensor) and dtype is not None:
            # Memory from _torch_allocator: a tensor on that block's own storage, so that torch (its
            # allocator, CUDA graph pools) sees an ordinary tensor rather than a DLPack import.
            size = a.itemsize
            offset, rest = divmod(a.data.ptr - block.data_ptr(), size)
            if not rest:
                return torch.empty(0, dtype=dtype, device=block.device).set_(
                    block.untyped_storage(), offset, a.shape, tuple(s // size for s in a.strides))
        if a.dtype == BFLOAT16:
            return torch.from_dlpack(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_dlpack(a)

    def running(self, device_id: int):
        return _on_torch_stream(device_id)

    def check_buffers(self, buffers: list, names: list) -> None:
        torch = sys.modules["torch"]
        if not torch.is_grad_enabled():
            return
        for name, t in zip(names, buffers):
            if t.requires_grad:
                raise TypeError(f"{name} requires grad: cuflash writes it outside autograd, which cannot record "
                                f"that; pass a buffer that does not require grad (or write under torch.no_grad()), "
                                f"or use cuflash.torch.flash_attn_func for a differentiable call")

    def after_call(self, views: dict, written: list) -> None:
        # torch's allocator orders the reuse of these tensors' memory on torch's current stream, on which the
        # call ran: nothing to keep alive. The written buffers' version counters are bumped.
        if written:
            bump = getattr(getattr(sys.modules["torch"].autograd, "graph", None), "increment_version", None)
            for t in written:
                if not t.is_inference():   # inference tensors have no version counter
                    if bump is not None:
                        bump(t)
                    else:   # torch < 2.1
                        sys.modules["torch"]._C._increment_version(t)


class _Jax(_Framework):
    name, label = "jax", "JAX"
    writable = False

    def device_id(self, x) -> int:
        return next(iter(x.devices())).id

    def to_cupy(self, name: str, x):
        """A CuPy view read on CuPy's current stream once JAX's work on ``x`` is done: the stream is handed
        to ``__dlpack__`` (the DLPack handshake: JAX makes it wait for the array's definition event). Where
        this JAX takes no stream, the host waits for the array instead."""
        import cupy

        stream = _dlpack_stream_argument(cupy.cuda.get_current_stream())
        try:
            capsule = x.__dlpack__(stream=stream)
        except TypeError:   # no stream argument here: wait on the host
            x.block_until_ready()
            return super().to_cupy(name, x)
        try:
            return cupy.from_dlpack(capsule)
        except (BufferError, TypeError, ValueError) as e:
            raise TypeError(f"{name}: CuPy cannot read this {self.label} array through DLPack ({e})") from e

    def from_cupy(self, a):
        import jax.dlpack

        return jax.dlpack.from_dlpack(a)


class _OtherDlpack(_Framework):
    """A DLPack producer cuflash does not know: its arrays are read in place, results are CuPy arrays."""

    def __init__(self, module: str) -> None:
        self.name = self.label = module


_CUPY, _TORCH, _JAX = _CuPy(), _Torch(), _Jax()
# The dtypes of cuflash's results, by torch's name for them.
_TORCH_DTYPE_NAMES = {np.dtype(np.float16): "float16", np.dtype(np.float32): "float32", np.dtype(np.uint8): "uint8",
                      np.dtype(np.int32): "int32"}
if BFLOAT16 is not None:
    _TORCH_DTYPE_NAMES[BFLOAT16] = "bfloat16"


def _framework_of(name: str, x) -> _Framework:
    """The framework of one argument, after checking that it is an array on a CUDA device (metadata only)."""
    if isinstance(x, _ndarray or _bind_cupy()):
        return _CUPY
    kind = f"{type(x).__module__}.{type(x).__name__}"
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        if x.device.type != "cuda":
            raise TypeError(f"{name} {_ACCEPTED}, got a torch tensor on {x.device}; move it with {name}.cuda()")
        return _TORCH
    if isinstance(x, np.ndarray):
        raise TypeError(f"{name} {_ACCEPTED}, got {kind} (host memory); convert with cupy.asarray({name})")
    module = type(x).__module__.partition(".")[0]
    if module in ("jax", "jaxlib"):
        devices = x.devices()
        platforms = sorted({d.platform for d in devices})
        if platforms not in (["gpu"], ["cuda"]):
            raise TypeError(f"{name} {_ACCEPTED}, got a JAX array on {platforms}; put it on a GPU with "
                            f"jax.device_put({name}, jax.devices('gpu')[0])")
        if len(devices) != 1:
            raise TypeError(f"{name} is a JAX array over {len(devices)} devices; cuflash takes one device's array")
        return _JAX
    if not hasattr(x, "__dlpack__") or not hasattr(x, "__dlpack_device__"):
        raise TypeError(f"{name} {_ACCEPTED}, got {kind}")
    device_type = x.__dlpack_device__()[0]
    if device_type not in (_DL_CUDA, _DL_CUDA_MANAGED):
        raise TypeError(f"{name} {_ACCEPTED}, got {kind} on DLPack device type {int(device_type)}, not CUDA")
    return _OtherDlpack(module)


def _common_framework(given: dict) -> _Framework:
    """The one framework of all the given arrays; TypeError naming two that differ."""
    first_name = first = None
    for name, x in given.items():
        framework = _framework_of(name, x)
        if first is None:
            first_name, first = name, framework
        elif framework.name != first.name:
            raise TypeError(f"{first_name} is a {first.label} array but {name} is a {framework.label} array: pass "
                            f"every array of one call from one framework (torch.from_dlpack / cupy.from_dlpack "
                            f"convert without a copy)")
    return first


# ---------------------------------------------------------------------------
# Memory of other frameworks kept alive until the kernels reading it are done


def _dlpack_stream_argument(stream) -> int:
    """The ``stream`` argument of ``__dlpack__`` for a CuPy stream: its pointer (2 for the per-thread
    default stream), or the DLPack spec's 1 for the legacy default stream (0 is not allowed for CUDA)."""
    return stream.ptr or 1


# (event, objects) in the order recorded: the objects are dropped once the event has completed.
_kept_alive: collections.deque = collections.deque()
_kept_lock = threading.Lock()


def keep_until_done(objects: list) -> None:
    """Keeps ``objects`` referenced until the work queued so far on CuPy's current stream has finished
    (an event recorded now); entries whose event completed are dropped here, oldest first. No host wait."""
    import cupy

    if not objects:
        return
    from .capture import stream_is_capturing

    stream = cupy.cuda.get_current_stream()
    if stream_is_capturing(stream.ptr):   # a graph rereads them on every replay: kept for good
        from . import capture

        capture.keep_if_capturing(*objects)
        return
    event = stream.record()
    with _kept_lock:
        while _kept_alive and _kept_alive[0][0].done:
            _kept_alive.popleft()
        _kept_alive.append((event, objects))


def kept_alive_count() -> int:
    """How many calls' inputs are still held (tests)."""
    with _kept_lock:
        return len(_kept_alive)


# ---------------------------------------------------------------------------
# PyTorch: torch's stream and caching allocator for the call


# (stream pointer, device) -> the CuPy stream object over it: one per torch stream, not one per call.
_cupy_streams: dict = {}
# device -> the CuPy allocator drawing from torch's caching allocator.
_torch_allocators: dict = {}


def _cupy_stream(ptr: int, device_id: int):
    key = (ptr, device_id)
    stream = _cupy_streams.get(key)
    if stream is None:
        if len(_cupy_streams) >= 256:
            _cupy_streams.clear()
        stream = external_stream(ptr, device_id)
        _cupy_streams[key] = stream
    return stream


def _torch_allocator(device_id: int):
    """A CuPy allocator whose memory is a torch uint8 tensor on ``device_id``: freed to torch's cache
    (on the stream it was allocated on) when the last CuPy array over it goes."""
    allocate = _torch_allocators.get(device_id)
    if allocate is None:
        import cupy

        torch = sys.modules["torch"]
        device = torch.device("cuda", device_id)

        def allocate(nbytes: int):
            block = torch.empty(nbytes, dtype=torch.uint8, device=device)
            return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(block.data_ptr(), nbytes, block, device_id), 0)

        _torch_allocators[device_id] = allocate
    return allocate


@contextlib.contextmanager
def _on_torch_stream(device_id: int):
    """CuPy's current device, stream and allocator for a call on torch tensors: torch's current
    stream of ``device_id`` and torch's caching allocator."""
    import cupy

    torch = sys.modules["torch"]
    stream = _cupy_stream(torch.cuda.current_stream(device_id).cuda_stream, device_id)
    with cupy.cuda.Device(device_id), stream, cupy.cuda.using_allocator(_torch_allocator(device_id)):
        yield
