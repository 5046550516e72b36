"""Whether two CuPy arrays share memory, decided from their metadata alone (address, shape, strides,
itemsize), so that an output buffer overlapping an input is refused before the device is touched.

Separate allocations are told apart by their byte ranges, a few integer operations. Views of one
buffer (a packed ``qkv``, head or sequence slices) go to NumPy's exact solver over stand-in arrays of
the same geometry: interleaved views such as ``buf[:, :, 0]`` and ``buf[:, :, 3]`` share a byte range
but no element, and must pass.
"""
from __future__ import annotations

import numpy as np


def byte_range(x) -> tuple[int, int]:
    """``[first, end)`` device addresses spanned by the elements of a non-empty array ``x`` (strides
    may be negative: the address of element 0 is then not the lowest)."""
    lo = hi = x.data.ptr
    for n, s in zip(x.shape, x.strides):
        if s < 0:
            lo += (n - 1) * s
        else:
            hi += (n - 1) * s
    return lo, hi + x.itemsize


class _Geometry:
    """An object NumPy can view through ``__array_interface__``: x's address, shape and strides over
    an element of x's size. NumPy's overlap solver reads only these, never the memory."""

    __slots__ = ("__array_interface__",)

    def __init__(self, x) -> None:
        self.__array_interface__ = {"shape": tuple(x.shape), "strides": tuple(x.strides),
                                    "typestr": f"|V{x.itemsize}", "data": (x.data.ptr, True), "version": 3}


def extent(x) -> tuple[int, int, int] | None:
    """``(device, first, end)`` of a CuPy array's bytes, or None when it has no element: computed once per
    array, then compared pairwise with a few integer operations."""
    if x.size == 0:
        return None
    mem = x.data
    lo = hi = mem.ptr
    for n, s in zip(x.shape, x.strides):
        if s < 0:
            lo += (n - 1) * s
        else:
            hi += (n - 1) * s
    return mem.device_id, lo, hi + x.itemsize


def shares_memory(a, b, a_extent=None, b_extent=None) -> bool:
    """True if some element of CuPy array ``a`` and some element of ``b`` occupy a common byte (their
    ``extent`` may be given, when the caller compares one array with several)."""
    ea = extent(a) if a_extent is None else a_extent
    eb = extent(b) if b_extent is None else b_extent
    if ea is None or eb is None or ea[0] != eb[0]:
        return False
    if ea[2] <= eb[1] or eb[2] <= ea[1]:   # the usual case: separate buffers
        return False
    return bool(np.shares_memory(np.asarray(_Geometry(a)), np.asarray(_Geometry(b))))
