"""The call caches of the forward and the backward: launches recorded per call signature and replayed as
they are.

A serving or training loop calls ``forward`` with the same arrays (or arrays of the same shapes at the
same addresses, which CuPy's memory pool hands back) again and again. The checked path validates the
arguments, looks up the plan and the tensor maps and packs the kernel arguments, several microseconds
of Python; a hit skips all of it and replays the recorded ``launch.Prepared``, so that a small call
costs little more than the driver's launch. The backward's replay does the same for its three launches,
and allocates its workspaces (the float32 dQ sums, the semaphores, the statistics rows) in the order the
recorded call did, which CuPy's pool answers with the same addresses.
"""
from __future__ import annotations

import numpy as np

from . import capture, options

CALLS_MAX = 256
_current_options = options.current   # bound once: the key is built on every call
# CuPy's array type and current-stream / current-device getters, bound on first use (CuPy is
# imported lazily): the key is built on every call, and a module lookup or an import statement there
# costs as much as a field.
_ndarray = _current_stream = _current_device = _empty = None
_CudaError: type = Exception   # CuPy's CUDARuntimeError once bound


def _bind_cupy():
    global _ndarray, _current_stream, _current_device, _empty, _CudaError
    import cupy
    from cupy.cuda import get_current_stream, runtime

    _current_stream, _current_device, _empty = get_current_stream, runtime.getDevice, cupy.empty
    _CudaError = runtime.CUDARuntimeError
    _ndarray = cupy.ndarray
    return _ndarray


def fwd_key(q, k, v, out, causal, softmax_scale, return_lse, variant_sig=()):
    """The key of a forward call, or None for a call the cache does not take (arrays that are not plain
    CuPy arrays, a scale that is not a float or int, flags that are not bools, no usable device).

    It holds everything the checks, the plan and the launch read: each array's address, shape, strides
    and dtype (the address fixes the device), the call's flags, its variant arguments (variants.call_signature),
    the current stream and device, and the
    token of the cuflash options in force (Options.token: every setting that picks a kernel, a tile or
    the launch path; tests and tuning runs switch them). An output the call allocates (``out`` None)
    is not in it: the recorded launch holds the address it wrote, and ``replay`` compares.

    Whether ``out`` overlaps q, k or v is a function of these addresses, shapes, strides and dtypes,
    and a call is recorded only after its checks passed, so a hit never stands in for an overlapping
    call; an output the call allocates cannot overlap the live inputs.
    """
    nd = _ndarray or _bind_cupy()
    if type(q) is not nd or type(k) is not nd or type(v) is not nd:
        return None
    if softmax_scale is not None and type(softmax_scale) not in (float, int):
        return None
    if type(causal) is not bool or type(return_lse) is not bool:
        return None   # the checked path accepts numpy.bool_ and rejects the rest
    if out is None:
        out_sig = None
    elif type(out) is nd:
        out_sig = (out.data.ptr, out.shape, out.strides, out.dtype)
    else:
        return None
    try:
        stream, device = _current_stream().ptr, _current_device()
    except _CudaError:
        # No usable driver or GPU: the checked path reports a bad argument as it would on a GPU, and
        # only then the device (a try costs nothing on the way through).
        return None
    return (q.data.ptr, q.shape, q.strides, q.dtype, k.data.ptr, k.shape, k.strides, k.dtype,
            v.data.ptr, v.shape, v.strides, v.dtype, out_sig, causal, softmax_scale, return_lse, variant_sig,
            stream, device, _current_options().token)


def _array_sig(x, nd):
    """(address, shape, strides, dtype) of a plain CuPy array, None for None; False for anything else."""
    if x is None:
        return None
    if type(x) is not nd:
        return False
    return (x.data.ptr, x.shape, x.strides, x.dtype)


def bwd_key(dout, q, k, v, out, lse, dlse, dq, dk, dv, causal, softmax_scale, deterministic, variant_sig=()):
    """The key of a backward call, or None for a call the cache does not take: as fwd_key, over every array
    the backward reads or writes (the gradients given, or None where the call allocates them), its flags
    and variant arguments. lse and dlse must be C-contiguous (the checked path copies them otherwise).

    Whether the gradient buffers overlap each other or the inputs is a function of these addresses, shapes,
    strides and dtypes, and a call is recorded only after its checks passed."""
    nd = _ndarray or _bind_cupy()
    if softmax_scale is not None and type(softmax_scale) not in (float, int):
        return None
    if type(causal) is not bool or type(deterministic) is not bool:
        return None
    sigs = tuple(_array_sig(x, nd) for x in (dout, q, k, v, out, lse, dlse, dq, dk, dv))
    if any(sig is False for sig in sigs[:7]) or None in sigs[:6] or False in sigs[7:]:
        return None
    if not lse.flags.c_contiguous or (dlse is not None and not dlse.flags.c_contiguous):
        return None
    try:
        stream, device = _current_stream().ptr, _current_device()
    except _CudaError:
        return None
    return (*sigs, causal, softmax_scale, deterministic, variant_sig, stream, device, _current_options().token)


# Positions in fwd_key's and bwd_key's tuples.
_STREAM, _DEVICE, OPTIONS_TOKEN = -3, -2, -1


class RecordedCall:
    """A recorded forward launch, the output / lse addresses its arguments hold and the output's shape (q's
    with v's head dim: not q's where v has a head dim of its own)."""

    __slots__ = ("launch", "out_ptr", "out_shape", "lse_ptr", "lse_shape")

    def __init__(self, launch, out_ptr: int, out_shape: tuple, lse_ptr: int, lse_shape) -> None:
        self.launch, self.out_ptr, self.out_shape = launch, out_ptr, out_shape
        self.lse_ptr, self.lse_shape = lse_ptr, lse_shape

    def replay(self, key: tuple, q, out, return_lse: bool):
        """``(launched, out, lse)``: allocates what the caller did not give (``lse`` None unless
        ``return_lse``) and launches again on the key's stream, unless an allocation landed at another
        address than the recorded one (``launched`` False: the checked path then runs on these arrays
        and records anew)."""
        # The current device (in the key) is q's: a call is recorded only then. (A key exists, so CuPy is bound.)
        if out is None:
            out = _empty(self.out_shape, dtype=q.dtype)
        lse = _empty(self.lse_shape, dtype=np.float32) if return_lse else None
        if out.data.ptr != self.out_ptr or (lse is not None and lse.data.ptr != self.lse_ptr):
            return False, out, lse
        self.launch(key[_STREAM])
        return True, out, lse


class RecordedBackward:
    """A recorded backward: its launches (preprocess, dK / dV, then dQ or the postprocess), its workspaces
    as (size, dtype, address) in allocation order, and the addresses of the gradients it allocated (0 where
    the caller gave them)."""

    __slots__ = ("launches", "workspaces", "grad_ptrs")

    def __init__(self, launches, workspaces, grad_ptrs) -> None:
        self.launches, self.workspaces, self.grad_ptrs = launches, workspaces, grad_ptrs

    def replay(self, key: tuple, q, k, v, dq, dk, dv):
        """``(dq, dk, dv)`` after launching again on the key's stream, or None when an allocation (a
        gradient the caller did not give, a workspace) landed at another address than the recorded one:
        the checked path then runs and records anew."""
        grads = [dq, dk, dv]
        for i, ref in enumerate((q, k, v)):
            if grads[i] is None:
                grads[i] = _empty(ref.shape, dtype=ref.dtype)
                if grads[i].data.ptr != self.grad_ptrs[i]:
                    return None
        work = []
        for size, dtype, ptr in self.workspaces:
            w = _empty(size, dtype=dtype)
            if w.data.ptr != ptr:
                return None
            work.append(w)
        stream = key[_STREAM]
        for launch in self.launches:
            launch(stream)
        if capture.stream_is_capturing(stream):   # a captured graph reads and writes them on every replay
            capture.keep_if_capturing(*work)
        return tuple(grads)


class CallCache(dict):
    """fwd_key -> RecordedCall, bounded."""

    def record(self, key: tuple, launch, out, lse, device_id: int) -> None:
        """Records a launch just made with these output and lse arrays (on the key's stream), if the
        current device was the arrays' one (allocations on a replay then land on the right device)."""
        if key[_DEVICE] != device_id:
            return
        if len(self) >= CALLS_MAX:
            self.clear()
        self[key] = RecordedCall(launch, out.data.ptr, out.shape, *((lse.data.ptr, lse.shape) if lse is not None
                                                                    else (0, None)))


class BackwardCallCache(dict):
    """bwd_key -> RecordedBackward, bounded."""

    def record(self, key: tuple, recorded: RecordedBackward, device_id: int) -> None:
        if key[_DEVICE] != device_id:
            return
        if len(self) >= CALLS_MAX:
            self.clear()
        self[key] = recorded


class Plans(dict):
    """A plan cache whose ``clear()`` also drops the calls recorded from its plans.

    Plans are keyed on the options' token, so a changed setting never finds a stale plan. ``clear()``
    also re-reads the environment if a cuflash variable changed there since it was last read
    (options.refresh): tuning scripts that set a variable and clear the plans keep working."""

    def __init__(self, *dependents: dict) -> None:
        super().__init__()
        self._dependents = dependents

    def clear(self) -> None:
        super().clear()
        for d in self._dependents:
            d.clear()
        options.refresh()
