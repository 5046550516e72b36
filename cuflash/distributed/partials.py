"""Float32 sums of the ring steps' partial results (kernels in kernels_cu/aux/ring.cu).

Every array here is contiguous (batch, seqlen, heads, head_dim); a step's part covers the rows
``row0:row0 + rows`` of every batch.
"""
from __future__ import annotations

import numpy as np

from .. import _checks, launch, options
from ..config import KernelConfig
from ..dispatch import get_kernel

_WARPS = 8
_FAMILIES = ("ring_merge", "ring_accumulate", "ring_convert")
_kernels: dict = {}


def configs() -> list[KernelConfig]:
    """Every instantiation of the ring helpers (one per family and input dtype)."""
    return [KernelConfig(f, dt, 0, False, 0, 0, _WARPS) for f in _FAMILIES
            for dt in _checks.SUPPORTED_DTYPES.values()]


def _kernel(family: str, dtype, device_id: int):
    """A ring helper's kernel, looked up once per (family, dtype, device, NVRTC defines)."""
    defines = options.current().nvrtc_defines
    key = (family, dtype, device_id, defines)
    kern = _kernels.get(key)
    if kern is None:
        cfg = KernelConfig(family, _checks.dtype_name(dtype), 0, False, 0, 0, _WARPS)
        kern = _kernels[key] = get_kernel(cfg, device_id, defines)
    return kern


def _blocks(n_threads: int) -> int:
    return max(1, min(-(-n_threads // (32 * _WARPS)), 8 * launch.sm_count()))


def merge(out_acc, lse_acc, part, part_lse, row0: int) -> None:
    """Merges ``part`` (attention of the rows ``row0:row0 + part_lse.shape[2]``, in ``part``'s own rows
    at the same offsets) and ``part_lse`` ``(batch, heads, rows)`` into the float32 ``out_acc`` and
    ``lse_acc`` ``(batch, heads, seqlen)``. Rows where ``lse_acc`` is -inf take ``part`` as it is."""
    b, n, h, d = out_acc.shape
    rows = part_lse.shape[2]
    kern = _kernel("ring_merge", part.dtype, out_acc.device.id)
    warps = b * rows * h
    kern((-(-warps // _WARPS),), (32 * _WARPS,),
         (out_acc, lse_acc, part, part_lse, np.int32(b), np.int32(rows), np.int32(row0), np.int32(n),
          np.int32(h), np.int32(d)))


def accumulate(acc, part, row0: int, rows: int, *, assign: bool) -> None:
    """``acc[:, row0:row0 + rows] (+)= part[:, row0:row0 + rows]``: ``acc`` float32, ``part`` of the
    inputs' dtype, both of the same shape; ``assign`` for the first contribution."""
    b, n, h, d = acc.shape
    kern = _kernel("ring_accumulate", part.dtype, acc.device.id)
    kern((_blocks(b * rows * h * d // 2),), (32 * _WARPS,),
         (acc, part, np.int32(b), np.int32(rows), np.int32(row0), np.int32(n), np.int32(h * d),
          np.int32(1 if assign else 0)))


def convert(x, dtype):
    """``x`` (float32) as a new contiguous array of ``dtype``, rounded to nearest."""
    import cupy

    y = cupy.empty(x.shape, dtype=dtype)
    kern = _kernel("ring_convert", dtype, x.device.id)
    kern((_blocks(x.size // 2),), (32 * _WARPS,), (x, y, np.int64(x.size)))
    return y
