"""The attention variants on the host: their arguments checked once, the kernels' MaskVariant, and the
mask policy's run-time parameters (kernels_cu/common/mask.cuh).

A call's variant arguments (``window_size``, ``attention_chunk``, ``softcap``, ``alibi_slopes``, ``sinks``)
become one :class:`Variants`; its :attr:`Variants.kernel` (a :class:`MaskVariant`: which parts are on) is
part of the kernel's configuration and cache key, and :meth:`Variants.param_values` fills the fields that
FwdParams and BwdParams end with (params._MASK_FIELDS).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np


# MaskVariant.bias -> the C++ BiasT of a ProgVariant.
BIAS_TYPES = {"": "void", "float32": "float", "float16": "f16_tag", "bfloat16": "bf16_tag"}


@dataclass(frozen=True)
class MaskVariant:
    """Which parts of the attention pattern a kernel is built with (the C++ ``MaskVariant``'s flags but
    causal, which KernelConfig carries): each part that is off is not in the kernel's code."""

    local: bool = False     # a sliding window and / or chunked attention (run-time bounds)
    softcap: bool = False   # s -> softcap * tanh(s / softcap)
    alibi: bool = False     # s -> s - slope * |i + seqlen_k - seqlen_q - j|
    sink: bool = False      # a learned logit per head in each row's softmax denominator
    chunk: bool = False     # with local: chunks are on (their divisions are in the code only then)
    varlen: bool = False    # packed sequences of their own lengths (common/varlen.cuh): not a part of the pattern
                            # (``plain`` ignores it), but of the kernel's code and cache key
    # Programmable attention (issue #45; kernels_cu/common/programmable.cuh): kernels of their own families
    # (the *_prog kernels, a second parameter ProgParams), whose C++ variant is a ProgVariant over this one.
    bias: str = ""            # the bias's dtype ("float32", "float16", "bfloat16"); "" none
    dropout: bool = False
    block_sparse: bool = False   # tile lists (a block mask's, a mask modifier's)
    mods: str = ""            # cuflash.modifiers.Modifiers.key of the user's modifiers; "" none

    def __post_init__(self) -> None:
        if self.bias not in BIAS_TYPES:
            raise ValueError(f"MaskVariant.bias must be one of {sorted(BIAS_TYPES)}, got {self.bias!r}")

    def template_arg(self, causal: bool) -> str:
        """The C++ type: ``MaskVariant<causal, local, softcap, alibi, sink, chunk[, varlen]>`` (varlen only
        when on, so that the dense kernels keep their names); programmable: ``ProgVariant<that, bias type,
        dropout, block_sparse, modifiers>``."""
        flags = (causal, self.local, self.softcap, self.alibi, self.sink, self.local and self.chunk) + (
            (True,) if self.varlen else ())
        base = "MaskVariant<" + ", ".join("true" if f else "false" for f in flags) + ">"
        if not self.programmable:
            return base
        from .modifiers import struct_name

        mods = struct_name(self.mods) if self.mods else "NoMods"
        return (f"ProgVariant<{base}, {BIAS_TYPES[self.bias]}, {'true' if self.dropout else 'false'}, "
                f"{'true' if self.block_sparse else 'false'}, {mods}>")

    @property
    def programmable(self) -> bool:
        """Whether the kernel is a programmable one (a *_prog family)."""
        return bool(self.bias or self.dropout or self.block_sparse or self.mods)

    @property
    def plain(self) -> bool:
        """No part of the pattern beyond causal (varlen or not)."""
        return not (self.local or self.softcap or self.alibi or self.sink or self.programmable)

    def tag(self) -> str:
        """A short name for cache keys and kernel names ("" when plain and dense)."""
        base = "".join(name for name, on in (("L", self.local), ("C", self.local and self.chunk),
                                             ("S", self.softcap), ("A", self.alibi), ("K", self.sink),
                                             ("V", self.varlen)) if on)
        prog = "".join(name for name, on in ((f"B{self.bias}", self.bias), ("D", self.dropout),
                                             ("X", self.block_sparse), (f"M{self.mods}", self.mods)) if on)
        return base + (f"+{prog}" if prog else "")

    @property
    def has_score_mod(self) -> bool:
        return self.softcap or self.alibi


PLAIN = MaskVariant()


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def check_window(window_size: Any) -> Tuple[int, int]:
    """``window_size`` as ``(left, right)`` ints >= -1 (-1: unbounded); TypeError / ValueError otherwise."""
    if window_size is None:
        return (-1, -1)
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right) of ints >= -1, got {window_size!r}")
    left = _check_int("window_size[0]", window_size[0])
    right = _check_int("window_size[1]", window_size[1])
    for name, v in (("window_size[0]", left), ("window_size[1]", right)):
        if v < -1:
            raise ValueError(f"{name} must be >= -1 (-1: unbounded), got {v}")
    return left, right


def check_chunk(attention_chunk: Any) -> int:
    chunk = _check_int("attention_chunk", 0 if attention_chunk is None else attention_chunk)
    if chunk < 0:
        raise ValueError(f"attention_chunk must be >= 0 (0: off), got {chunk}")
    return chunk


def check_softcap(softcap: Any) -> float:
    if softcap is None:
        return 0.0
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, (int, float, np.integer, np.floating)):
        raise TypeError(f"softcap must be a float >= 0 (0: off), got {type(softcap).__name__} {softcap!r}")
    value = float(softcap)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"softcap must be a finite float >= 0 (0: off), got {softcap!r}")
    if value and not np.isfinite(np.float32(1.0 / value)):
        raise ValueError(f"softcap {softcap!r} is too small for float32")
    return value


@dataclass(frozen=True)
class Variants:
    """A call's variant arguments after their checks."""

    window_left: int = -1     # -1: unbounded
    window_right: int = -1
    attention_chunk: int = 0
    softcap: float = 0.0
    causal: bool = False
    alibi_slopes: Any = None  # float32 device array, (heads_q,) or (batch, heads_q)
    sinks: Any = None         # float32 device array (heads_q,)

    @property
    def local(self) -> bool:
        """Whether a window or chunks bound the keys a row sees (beyond causal)."""
        return self.window_left >= 0 or (self.window_right >= 0 and not self.causal) or self.attention_chunk > 0

    @functools.cached_property
    def kernel(self) -> MaskVariant:
        """The kernels' MaskVariant (computed once per call's Variants: it is on every launch's path)."""
        return MaskVariant(local=self.local, softcap=self.softcap > 0, alibi=self.alibi_slopes is not None,
                           sink=self.sinks is not None, chunk=self.attention_chunk > 0)

    @property
    def plain(self) -> bool:
        return self.kernel.plain

    def cache_key(self) -> tuple:
        """What a call cache keys on besides the arrays (the arrays' addresses where there are any)."""
        if self.plain:
            return ()
        return (self.window_left, self.window_right, self.attention_chunk, self.softcap,
                _address(self.alibi_slopes), _address(self.sinks))

    def param_values(self, seqlen_q: int, seqlen_k: int, softmax_scale: float, diag: Optional[int] = None,
                     key_offset: int = 0) -> tuple:
        """The values of params._MASK_FIELDS, in order. ``diag``: query row i's diagonal key position is
        i + diag (default seqlen_k - seqlen_q; ring attention passes the shards' offsets); ``key_offset``: the
        absolute position of key 0 (chunks are counted from absolute 0)."""
        if diag is None:
            diag = seqlen_k - seqlen_q
        # Unbounded: a distance no row reaches, small enough that pos +- it stays an int32.
        unbounded = seqlen_q + seqlen_k + abs(diag) + 1
        left = unbounded if self.window_left < 0 else min(self.window_left, unbounded)
        right = 0 if self.causal else (unbounded if self.window_right < 0 else min(self.window_right, unbounded))
        softcap_in = softmax_scale / self.softcap if self.softcap else 0.0
        softcap_out = self.softcap / softmax_scale if self.softcap else 0.0
        slopes = self.alibi_slopes
        alibi_stride = 0 if slopes is None or slopes.ndim == 1 else slopes.shape[1]
        return (diag, left, right, self.attention_chunk, key_offset, alibi_stride, softcap_in, softcap_out,
                1.0 / softmax_scale, _address(slopes), _address(self.sinks))


def _address(x) -> int:
    return 0 if x is None else x.data.ptr


NONE = Variants()


DEFAULT_WINDOW = (-1, -1)


def call_signature(window_size, attention_chunk, softcap, alibi_slopes, sinks) -> Optional[tuple]:
    """What a call cache keys on for the variant arguments: () when every one is off, a tuple when the
    arguments are plain values and float32 CuPy arrays used in place, None when the call should take the
    checked path (anything else: it converts, or it raises)."""
    if (alibi_slopes is None and sinks is None and not attention_chunk and not softcap
            and (window_size is None or window_size == DEFAULT_WINDOW)):
        if type(attention_chunk) is not int or type(softcap) not in (int, float):
            return None
        return ()
    if type(window_size) is not tuple or len(window_size) != 2 or any(type(w) is not int for w in window_size):
        return None
    if type(attention_chunk) is not int or type(softcap) not in (int, float):
        return None
    arrays = []
    for x in (alibi_slopes, sinks):
        if x is None:
            arrays.append(None)
            continue
        if type(x).__module__.split(".")[0] != "cupy" or x.dtype != np.float32 or not x.flags.c_contiguous:
            return None
        arrays.append((x.data.ptr, x.shape, x.strides))
    return (window_size, attention_chunk, softcap, *arrays)


def from_arguments(window_size, attention_chunk, softcap, alibi_slopes, sinks, *, causal: bool, batch: int,
                   heads_q: int, device_id: Optional[int], q_dtype=None) -> Variants:
    """The checked variant arguments of a call (TypeError / ValueError naming the argument otherwise).
    ``alibi_slopes`` (float32, (heads_q,) or (batch, heads_q)) and ``sinks`` ((heads_q,), float32 or q's
    dtype) must be CuPy arrays on ``device_id``; sinks in another dtype and non-contiguous arrays are
    copied to contiguous float32 (``device_id`` None: the checks without a device, copies skipped)."""
    left, right = check_window(window_size)
    chunk = check_chunk(attention_chunk)
    cap = check_softcap(softcap)
    slopes = _check_device_array("alibi_slopes", alibi_slopes, ((heads_q,), (batch, heads_q)),
                                 (np.dtype(np.float32),), device_id)
    sink_dtypes = (np.dtype(np.float32),) + ((np.dtype(q_dtype),) if q_dtype is not None else ())
    sinks_ = _check_device_array("sinks", sinks, ((heads_q,),), sink_dtypes, device_id)
    if causal and right > 0:
        raise ValueError(f"window_size[1] must be -1 or 0 with causal=True (causal hides every key after the "
                         f"diagonal), got {right}")
    return Variants(left, right, chunk, cap, bool(causal), slopes, sinks_)


def _check_device_array(name: str, x, shapes: tuple, dtypes: tuple, device_id: Optional[int]):
    if x is None:
        return None
    import cupy

    if not isinstance(x, cupy.ndarray):
        raise TypeError(f"{name} must be a CuPy array (or a CUDA array of the framework of q), "
                        f"got {type(x).__name__}")
    if tuple(x.shape) not in shapes:
        want = " or ".join(str(s) for s in shapes)
        raise ValueError(f"{name} must have shape {want}, got {tuple(x.shape)}")
    if np.dtype(x.dtype) not in dtypes:
        raise TypeError(f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {x.dtype}")
    if device_id is not None and x.data.device_id != device_id:
        raise ValueError(f"{name} is on device {x.data.device_id}, q on device {device_id}")
    if device_id is not None and (x.dtype != np.float32 or not x.flags.c_contiguous):
        from . import capture

        with cupy.cuda.Device(device_id):
            x = cupy.ascontiguousarray(x, dtype=np.float32)
        capture.keep_if_capturing(x)
    return x


def first_seen_row(seqlen_q: int, seqlen_k: int, var: Variants) -> int:
    """The first query row that sees a key (rows before it see none: output 0, zero gradients), with the
    bottom-right alignment; every row from it on sees one."""
    diag = seqlen_k - seqlen_q
    first = 0
    if var.causal:
        first = max(first, -diag)
    if var.window_right >= 0 and not var.causal:
        first = max(first, -diag - var.window_right)
    if var.attention_chunk:
        first = max(first, -diag)
    return min(first, seqlen_q)
