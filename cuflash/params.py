"""NumPy mirrors of the kernel parameter structs in kernels_cu/common/params.cuh.

A struct travels to a kernel by value as a one-element structured array;
CuPy copies exactly the parameter's size. ``align=True`` gives C layout rules,
and tests/test_compile.py checks every offset against the compiler's.
"""
from __future__ import annotations

import struct

import numpy as np

_P = np.uint64
_I64 = np.int64
_I32 = np.int32
_F32 = np.float32


def _struct(fields: list[tuple[str, type]]) -> np.dtype:
    return np.dtype(fields, align=True)


def _strides(prefix: str) -> list[tuple[str, type]]:
    return [(f"{prefix}_batch_stride", _I64), (f"{prefix}_row_stride", _I64), (f"{prefix}_head_stride", _I64)]


# The mask policy's run-time values (kernels_cu/common/mask.cuh), the same at the end of both structs.
_MASK_FIELDS = [("mask_diag", _I32), ("window_left", _I32), ("window_right", _I32), ("attention_chunk", _I32),
                ("key_offset", _I32), ("alibi_batch_stride", _I32), ("softcap_in", _F32), ("softcap_out", _F32),
                ("alibi_scale", _F32), ("alibi_slopes", _P), ("sinks", _P)]

# Packed (varlen) batches (kernels_cu/common/params.cuh, CUFLASH_VARLEN_PARAMS), the last fields of both.
_VARLEN_FIELDS = [("cu_seqlens_q", _P), ("cu_seqlens_k", _P), ("seqused_q", _P), ("seqused_k", _P),
                  ("total_q", _I32), ("total_k", _I32), ("tile_rows", _I32), ("offsets_bad", _P)]
# Their values for a dense call.
DENSE_VARLEN_VALUES = (0, 0, 0, 0, 0, 0, 0, 0)

FWD_PARAMS = _struct(
    [("q", _P), ("k", _P), ("v", _P), ("o", _P), ("lse", _P)]
    + _strides("q") + _strides("k") + _strides("v") + _strides("o")
    + [("batch", _I32), ("seqlen_q", _I32), ("seqlen_k", _I32), ("heads_q", _I32),
       ("heads_per_kv", _I32), ("head_dim", _I32), ("softmax_scale", _F32), ("scale_log2", _F32)]
    + _MASK_FIELDS + _VARLEN_FIELDS
)

BWD_PARAMS = _struct(
    [("q", _P), ("k", _P), ("v", _P), ("o", _P), ("dout", _P), ("lse", _P), ("delta", _P),
     ("dq_accum", _P), ("dq", _P), ("dk", _P), ("dv", _P), ("dq_semaphore", _P)]
    + _strides("q") + _strides("k") + _strides("v") + _strides("o") + _strides("do")
    + _strides("dq") + _strides("dk") + _strides("dv")
    + [("batch", _I32), ("seqlen_q", _I32), ("seqlen_k", _I32), ("heads_q", _I32),
       ("heads_per_kv", _I32), ("head_dim", _I32), ("softmax_scale", _F32), ("scale_log2", _F32),
       ("dq_accum_rows", _I32), ("dq_accum_cols", _I32), ("dq_zero_rows", _I32),
       ("dq_semaphores", _I32), ("stats", _P), ("stat_rows", _I32)]
    + _MASK_FIELDS + [("dlse", _P)] + _VARLEN_FIELDS
)

DECODE_PARAMS = _struct(
    [("q", _P), ("k", _P), ("v", _P), ("o", _P), ("lse", _P), ("o_partial", _P), ("lse_partial", _P),
     ("cache_seqlens", _P), ("cache_batch_idx", _P), ("block_table", _P), ("cache_leftpad", _P), ("k_scale", _P),
     ("v_scale", _P)]
    + _strides("q") + _strides("k") + _strides("v") + _strides("o")
    + [("block_table_batch_stride", _I64), ("batch", _I32), ("seqlen_q", _I32), ("seqlen_k", _I32),
       ("heads_q", _I32), ("heads_per_kv", _I32), ("head_dim", _I32), ("head_dim_v", _I32), ("seqlen_new", _I32),
       ("cache_capacity", _I32), ("cache_rows", _I32), ("page_size", _I32), ("page_shift", _I32),
       ("keys_per_split", _I32), ("num_splits", _I32), ("scale_batch_stride", _I32), ("scale_head_stride", _I32), ("k_scale_value", _F32),
       ("v_scale_value", _F32), ("softmax_scale", _F32), ("scale_log2", _F32)]
    + _MASK_FIELDS
)

COMBINE_PARAMS = _struct(
    [("outs", _P), ("lses", _P), ("out", _P), ("lse", _P)] + _strides("out")
    + [("num_splits", _I32), ("batch", _I32), ("seqlen", _I32), ("heads", _I32), ("head_dim", _I32),
       ("outs_float32", _I32)]
)

APPEND_PARAMS = _struct(
    [("k_new", _P), ("v_new", _P), ("k_cache", _P), ("v_cache", _P), ("q", _P), ("q_rot", _P), ("rotary_cos", _P),
     ("rotary_sin", _P), ("cache_seqlens", _P), ("cache_batch_idx", _P), ("block_table", _P), ("cache_leftpad", _P),
     ("k_scale", _P), ("v_scale", _P)]
    + _strides("k_new") + _strides("v_new") + _strides("k") + _strides("v") + _strides("q")
    + [("block_table_batch_stride", _I64), ("batch", _I32), ("seqlen_new", _I32), ("seqlen_q", _I32),
       ("heads_kv", _I32), ("heads_q", _I32), ("head_dim", _I32), ("head_dim_v", _I32), ("rotary_dim", _I32),
       ("rotary_interleaved", _I32), ("seqlen_ro", _I32), ("q_positions_step", _I32), ("cache_capacity", _I32),
       ("cache_rows", _I32), ("page_size", _I32), ("scale_batch_stride", _I32), ("scale_head_stride", _I32),
       ("k_scale_value", _F32), ("v_scale_value", _F32)]
)

# Programmable attention's second kernel parameter (issue #45).
MOD_TENSOR_SLOTS = 8
_U32 = np.uint32
PROG_PARAMS = _struct(
    [("bias", _P), ("dbias_accum", _P)]
    + [(f"bias_{d}_stride", _I64) for d in ("batch", "head", "row", "col")]
    + [(f"dbias_{d}_stride", _I64) for d in ("batch", "head", "row", "col")]
    + [("rng_state", _P), ("seed", _P), ("offset", _P), ("dropout_threshold", _U32), ("dropout_scale", _F32),
       ("kv_tile_count", _P), ("kv_tile_index", _P), ("kv_tiles_batch_stride", _I64),
       ("kv_tiles_head_stride", _I64), ("q_tiles", _I32), ("kv_tiles", _I32), ("block_mask", _P),
       ("block_mask_batch_stride", _I64), ("block_mask_head_stride", _I64), ("block_mask_row_stride", _I64),
       ("block_q", _I32), ("block_k", _I32), ("tile_state", _P), ("tile_state_batch_stride", _I64),
       ("tile_state_head_stride", _I64)]
    + [(f"mod_tensor{i}", _P) for i in range(MOD_TENSOR_SLOTS)]
    + [(f"mod_grad{i}", _P) for i in range(MOD_TENSOR_SLOTS)]
)

MASK_TILES_PARAMS = _struct([("state", _P), ("seqlen_q", _I32), ("seqlen_k", _I32), ("heads", _I32), ("m_tiles", _I32),
                             ("n_tiles", _I32)])

BLOCK_LISTS_PARAMS = _struct([("block_mask", _P), ("mask_batch_stride", _I64), ("mask_head_stride", _I64),
                              ("mask_row_stride", _I64), ("state", _P), ("state_batch_stride", _I64),
                              ("state_head_stride", _I64), ("count", _P), ("index", _P), ("heads", _I32),
                              ("seqlen_q", _I32), ("seqlen_k", _I32), ("block_q", _I32), ("block_k", _I32),
                              ("block_m", _I32), ("block_n", _I32), ("m_tiles", _I32), ("n_tiles", _I32)])

STRUCTS = {"FwdParams": FWD_PARAMS, "BwdParams": BWD_PARAMS, "DecodeParams": DECODE_PARAMS,
           "CombineParams": COMBINE_PARAMS, "AppendParams": APPEND_PARAMS, "ProgParams": PROG_PARAMS,
           "MaskTilesParams": MASK_TILES_PARAMS, "BlockListsParams": BLOCK_LISTS_PARAMS}

_STRUCT_CODES = {np.dtype(np.uint64): "Q", np.dtype(np.int64): "q", np.dtype(np.int32): "i",
                 np.dtype(np.uint32): "I", np.dtype(np.float32): "f"}


_packers: dict[int, tuple[struct.Struct, tuple[str, ...]]] = {}


def _packer(dtype: np.dtype) -> tuple[struct.Struct, tuple[str, ...]]:
    found = _packers.get(id(dtype))
    if found is None:
        found = _packers[id(dtype)] = _make_packer(dtype)
    return found


def _make_packer(dtype: np.dtype) -> tuple[struct.Struct, tuple[str, ...]]:
    """A struct.Struct with the exact byte layout of ``dtype`` (padding included)."""
    fmt, pos = "<", 0
    fields = sorted(dtype.fields.items(), key=lambda kv: kv[1][1])
    for _, (fdt, off) in fields:
        fmt += "x" * (off - pos) + _STRUCT_CODES[fdt]
        pos = off + fdt.itemsize
    fmt += "x" * (dtype.itemsize - pos)
    return struct.Struct(fmt), tuple(name for name, _ in fields)


def pack(dtype: np.dtype, **values) -> np.ndarray:
    """A one-element array of ``dtype`` with the given fields set (others zero).

    Built through ``struct`` in one call: this sits on every launch's hot path.
    """
    packer, names = _packer(dtype)
    return np.frombuffer(packer.pack(*[values.get(n, 0) for n in names]), dtype=dtype)


_void_dtypes: dict[int, np.dtype] = {}


def pack_values(dtype: np.dtype, values) -> np.ndarray:
    """Like ``pack`` with every field given positionally, in declaration order (the fast path).

    The result has the struct's bytes but an unstructured ``V<size>`` dtype: NumPy builds the
    array interface of a structured dtype in Python, field by field (about 20 us a call), and a
    launch may read it.
    """
    void = _void_dtypes.get(id(dtype))
    if void is None:
        void = _void_dtypes[id(dtype)] = np.dtype(f"V{dtype.itemsize}")
    return np.frombuffer(_packer(dtype)[0].pack(*values), dtype=void)


def replaced(dtype: np.dtype, values: tuple, **changes) -> tuple:
    """``values`` (every field of ``dtype``, in declaration order) with the named fields changed."""
    names = tuple(dtype.names)
    out = list(values)
    for name, value in changes.items():
        out[names.index(name)] = value
    return tuple(out)


def pack_bytes(dtype: np.dtype, values) -> bytes:
    """The struct's bytes, every field given positionally (the launch path takes them as they are)."""
    return _packer(dtype)[0].pack(*values)


def tensor_strides(prefix: str, x) -> dict:
    """Element strides (batch, row, head) of a (batch, seqlen, heads, head_dim) array, as fields."""
    sb, ss, sh = element_strides(x)
    return {f"{prefix}_batch_stride": sb, f"{prefix}_row_stride": ss, f"{prefix}_head_stride": sh}


def element_strides(x) -> tuple[int, int, int]:
    """(batch, row, head) strides in elements of a (batch, seqlen, heads, head_dim) array."""
    st, item = x.strides, x.itemsize
    return st[0] // item, st[1] // item, st[2] // item
