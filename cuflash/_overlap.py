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


def shares_memory(a, b) -> bool:
    """True if some element of CuPy array ``a`` and some element of ``b`` occupy a common byte."""
    if a.size == 0 or b.size == 0:
        return False
    if a.data.device_id != b.data.device_id:
        return False
    a_lo, a_hi = byte_range(a)
    b_lo, b_hi = byte_range(b)
    if a_hi <= b_lo or b_hi <= a_lo:   # the usual case: separate buffers
        return False
    return bool(np.shares_memory(np.asarray(_Geometry(a)), np.asarray(_Geometry(b))))
