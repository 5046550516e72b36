"""NumPy mirrors of the kernel parameter structs in kernels_cu/common/params.cuh.

A struct travels to a kernel by value as a one-element structured array;
CuPy copies exactly the parameter's size. ``align=True`` gives C layout rules,
and tests/test_compile.py checks every offset against the compiler's.
"""
from __future__ import annotations

import numpy as np

_P = np.uint64
_I64 = np.int64
_I32 = np.int32
_F32 = np.float32


def _struct(fields: list[tuple[str, type]]) -> np.dtype:
    return np.dtype(fields, align=True)


def _strides(prefix: str) -> list[tuple[str, type]]:
    return [(f"{prefix}_batch_stride", _I64), (f"{prefix}_row_stride", _I64), (f"{prefix}_head_stride", _I64)]


FWD_PARAMS = _struct(
    [("q", _P), ("k", _P), ("v", _P), ("o", _P), ("lse", _P)]
    + _strides("q") + _strides("k") + _strides("v") + _strides("o")
    + [("batch", _I32), ("seqlen_q", _I32), ("seqlen_k", _I32), ("heads_q", _I32),
       ("heads_per_kv", _I32), ("head_dim", _I32), ("softmax_scale", _F32), ("scale_log2", _F32)]
)

BWD_PARAMS = _struct(
    [("q", _P), ("k", _P), ("v", _P), ("o", _P), ("dout", _P), ("lse", _P), ("delta", _P),
     ("dq_accum", _P), ("dq", _P), ("dk", _P), ("dv", _P)]
    + _strides("q") + _strides("k") + _strides("v") + _strides("o") + _strides("do")
    + _strides("dq") + _strides("dk") + _strides("dv")
    + [("batch", _I32), ("seqlen_q", _I32), ("seqlen_k", _I32), ("seqlen_q_rounded", _I32),
       ("heads_q", _I32), ("heads_per_kv", _I32), ("head_dim", _I32), ("dkv_heads", _I32),
       ("softmax_scale", _F32), ("scale_log2", _F32)]
)

STRUCTS = {"FwdParams": FWD_PARAMS, "BwdParams": BWD_PARAMS}


def pack(dtype: np.dtype, **values) -> np.ndarray:
    """A one-element array of ``dtype`` with the given fields set (others zero)."""
    rec = np.zeros(1, dtype=dtype)
    for name, value in values.items():
        rec[name] = value
    return rec


def tensor_strides(prefix: str, x) -> dict:
    """Element strides (batch, row, head) of a (batch, seqlen, heads, head_dim) array."""
    item = x.itemsize
    sb, ss, sh, _ = (s // item for s in x.strides)
    return {f"{prefix}_batch_stride": sb, f"{prefix}_row_stride": ss, f"{prefix}_head_stride": sh}
