"""Hopper tensor-map descriptors (CUtensorMap) built with ``cuTensorMapEncodeTiled``.

The driver entry point is called through ctypes on ``libcuda.so.1`` (no new
dependency). A descriptor is 128 opaque bytes; kernels take it by value as a
``const __grid_constant__ TmaDesc`` parameter, which CuPy passes from a
one-element NumPy array of dtype ``V128``. Encoding costs host time, so
descriptors are cached per (pointer, shape, strides, box, dtype, swizzle).
"""
from __future__ import annotations

import ctypes
import functools
import threading

import numpy as np

# CUtensorMapDataType
DTYPE_CODES = {"float16": 6, "bfloat16": 9, "float8_e4m3fn": 0}  # fp8: as UINT8 bytes
# CUtensorMapSwizzle
SWIZZLE_NONE, SWIZZLE_32B, SWIZZLE_64B, SWIZZLE_128B = 0, 1, 2, 3
_L2_PROMOTION_128B = 2
_OOB_FILL_ZERO = 0

_CACHE_MAX = 512
_cache: dict[tuple, np.ndarray] = {}
_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _encode_fn():
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                   ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                   ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return fn


def strides_ok(ptr: int, byte_strides) -> bool:
    """Whether TMA can address this tensor: 16-byte aligned base, non-zero strides
    (in bytes, beyond the contiguous innermost dimension) that are multiples of 16."""
    return ptr % 16 == 0 and all(s > 0 and s % 16 == 0 and s < (1 << 40) for s in byte_strides)


def encode_tiled(ptr: int, dtype: str, dims, byte_strides, box, swizzle: int = SWIZZLE_128B) -> np.ndarray:
    """A tensor map as a one-element ``V128`` array.

    ``dims`` and ``box`` list the dimensions innermost first (the innermost is
    contiguous); ``byte_strides`` has one entry per dimension after the first.
    """
    key = (ptr, dtype, tuple(dims), tuple(byte_strides), tuple(box), swizzle)
    desc = _cache.get(key)
    if desc is not None:
        return desc
    rank = len(dims)
    if len(byte_strides) != rank - 1 or len(box) != rank:
        raise ValueError("tensor map: need rank-1 strides and rank box dims")
    if not strides_ok(ptr, byte_strides):
        raise ValueError(f"tensor map: base {ptr:#x} or strides {byte_strides} not 16-byte multiples")
    buf = np.zeros(1, dtype="V128")
    holder = (ctypes.c_uint64 * 32)()  # 256 bytes, a 128-byte aligned window inside
    base = ctypes.addressof(holder)
    aligned = (base + 127) // 128 * 128
    res = _encode_fn()(
        ctypes.c_void_p(aligned), DTYPE_CODES[dtype], rank, ctypes.c_void_p(ptr),
        (ctypes.c_uint64 * rank)(*dims), (ctypes.c_uint64 * (rank - 1))(*byte_strides),
        (ctypes.c_uint32 * rank)(*box), (ctypes.c_uint32 * rank)(*([1] * rank)),
        0, swizzle, _L2_PROMOTION_128B, _OOB_FILL_ZERO)
    if res != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed ({res}) for dims={dims} strides={byte_strides} "
                           f"box={box} dtype={dtype}")
    buf.view(np.uint8)[:] = np.frombuffer(ctypes.string_at(aligned, 128), dtype=np.uint8)
    with _lock:
        if len(_cache) >= _CACHE_MAX:
            _cache.clear()
        _cache[key] = buf
    return buf


def _bshd_strides(x) -> list[int]:
    """Byte strides of a (batch, seqlen, heads, head_dim) array's seqlen, heads and batch dims for a tensor map.
    A dim of extent 1 is never stepped along, so its stride is free: such a dim (``x[None]``'s batch, of stride
    0, which TMA cannot take) gets the extent of the whole array instead."""
    span = max(16, -(-max(n * s for n, s in zip(x.shape, x.strides)) // 16) * 16)
    return [s if n != 1 else span for n, s in ((x.shape[1], x.strides[1]), (x.shape[2], x.strides[2]),
                                                (x.shape[0], x.strides[0]))]


def bshd_ok(x) -> bool:
    """Whether a (batch, seqlen, heads, head_dim) array with a contiguous last dim can be TMA-loaded."""
    if x.strides[3] != x.itemsize:
        return False
    return strides_ok(x.data.ptr, _bshd_strides(x))


def bshd_map(x, dtype: str, box_rows: int, box_cols: int = 64, swizzle: int = SWIZZLE_128B) -> np.ndarray:
    """Rank-4 map over (head_dim, seqlen, heads, batch) of a (batch, seqlen, heads, head_dim) array,
    box (box_cols, box_rows, 1, 1); box_cols * itemsize is the swizzle span (128 bytes: 64 fp16 or 128
    fp8 columns; 64 with SWIZZLE_64B)."""
    b, s, h, d = x.shape
    return encode_tiled(x.data.ptr, dtype, (d, s, h, b), _bshd_strides(x), (box_cols, box_rows, 1, 1), swizzle)
