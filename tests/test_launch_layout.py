"""The launch path packs kernel arguments into one buffer (cuflash/launch.py: pack_arguments);
its offsets must be the kernel's parameter offsets. The PTX entry lists every parameter with its
alignment and size, so this is checked on the CPU for one kernel of each signature."""
from __future__ import annotations

import re

import numpy as np
import pytest

from cuflash import heuristics, launch, params
from cuflash.compile import compile_offline
from cuflash.config import KernelConfig

pytest.importorskip("cupy")

_PARAM = re.compile(r"\.param\s+(?:\.align\s+(\d+)\s+)?\.(b8|u64|b64|u32|s32|f32)\s+\w+(?:\[(\d+)\])?")
_SCALAR_BYTES = {"u64": 8, "b64": 8, "u32": 4, "s32": 4, "f32": 4}


def _ptx_offsets(ptx: str) -> tuple[list[int], int]:
    """(offset of each parameter, total bytes) of the PTX's single entry."""
    entry = ptx[ptx.index(".entry"):]
    decl = entry[entry.index("(") + 1:entry.index(")")]
    offsets, pos = [], 0
    for align, kind, count in _PARAM.findall(decl):
        size = int(count) if count else _SCALAR_BYTES[kind]
        align = int(align) if align else size
        pos = -(-pos // align) * align
        offsets.append(pos)
        pos += size
    return offsets, pos


class _FakeDeviceArray:
    """Stands for a CuPy array argument (pack_arguments passes its address)."""

    class data:  # noqa: N801 - mimics ndarray.data.ptr
        ptr = 0x7F00_0000_1000


def _packed_offsets(struct, n_maps: int, n_ptrs: int) -> tuple[list[int], int]:
    p = params.pack_values(struct, [0] * len(struct.names))
    args = [np.zeros(1, "V128") for _ in range(n_maps)] + [_FakeDeviceArray() for _ in range(n_ptrs)]
    offsets, pos = [0], p.dtype.itemsize
    for a in args:
        align = launch.TMA_DESC_ALIGN if isinstance(a, np.ndarray) else 8
        pos = -(-pos // align) * align
        offsets.append(pos)
        pos += a.dtype.itemsize if isinstance(a, np.ndarray) else 8
    blob, packed_offsets = launch.pack_arguments(p, tuple(args))
    assert len(blob) == pos and list(packed_offsets) == offsets
    return offsets, pos


CASES = [  # (config, parameter struct, tensor maps, device pointers after the maps)
    (heuristics.fwd_config("float16", 64, False, 90, backend="sm80"), params.FWD_PARAMS, 0, 0),
    (KernelConfig("sm90_fwd_overlap", "bfloat16", 128, False, 128, 128, 12), params.FWD_PARAMS, 3, 0),
    # persistent: q, k, v, out (O leaves through TMA stores), then the tile counter
    (KernelConfig("sm90_fwd_p", "float16", 64, True, 192, 128, 16), params.FWD_PARAMS, 4, 1),
    # fp8: the three descale pointers after the maps (and after the tile counter when persistent)
    (KernelConfig("sm90_fwd_fp8", "float8_e4m3fn", 128, False, 128, 128, 12), params.FWD_PARAMS, 3, 3),
    (KernelConfig("sm90_fwd_fp8_p", "float8_e4m3fn", 128, True, 128, 128, 12), params.FWD_PARAMS, 3, 4),
    (heuristics.bwd_configs("float16", 64, False, 90, backend="sm90").dkdv, params.BWD_PARAMS, 4, 0),
    (heuristics.bwd_configs("float16", 64, False, 90, backend="sm80").dkdv, params.BWD_PARAMS, 0, 0),
]


@pytest.mark.parametrize("cfg,struct,n_maps,n_ptrs", CASES, ids=[c[0].family for c in CASES])
def test_packed_arguments_match_ptx_parameter_offsets(cfg, struct, n_maps, n_ptrs):
    ptx, _ = compile_offline(cfg, "90a" if cfg.fam.arch_specific else "90", ptx=True)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    want_offsets, want_size = _ptx_offsets(ptx)
    got_offsets, got_size = _packed_offsets(struct, n_maps, n_ptrs)
    assert got_offsets == want_offsets and got_size == want_size, (cfg.key(), got_offsets, want_offsets)


def test_packed_tail_lays_out_like_separate_arguments():
    """Cached runs of tensor maps (launch.PackedTail) give the same bytes and offsets as the maps
    passed one by one."""
    p = params.pack_bytes(params.BWD_PARAMS, list(range(len(params.BWD_PARAMS.names))))
    maps = [np.frombuffer(bytes([i]) * 128, dtype="V128") for i in range(1, 4)]
    flat = launch.pack_arguments(p, (*maps, _FakeDeviceArray()))
    packed = launch.pack_arguments(p, (launch.PackedTail(tuple(maps)), _FakeDeviceArray()))
    assert flat == packed


def test_programmatic_launch_structs_match_the_driver_abi():
    """The ctypes mirrors of CUlaunchConfig / CUlaunchAttribute that launch._launch_programmatic hands to
    cuLaunchKernelEx have cuda.h's sizes and offsets (checked against CUDA 13.0's header: 56 / 72 bytes, the
    stream at 32, the attributes at 40, their count at 48, an attribute's value at 8, a 64-byte union), and the
    programmatic stream serialization attribute's id is cuda.h's 6."""
    import ctypes

    from cuflash import launch

    assert ctypes.sizeof(launch._LaunchConfig) == 56 and ctypes.sizeof(launch._LaunchAttribute) == 72
    assert ctypes.sizeof(launch._LaunchAttributeValue) == 64
    assert (launch._LaunchConfig.stream.offset, launch._LaunchConfig.attrs.offset,
            launch._LaunchConfig.num_attrs.offset) == (32, 40, 48)
    assert launch._LaunchAttribute.value.offset == 8
    assert launch._CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION == 6
