"""Host side of the Hopper (sm90) kernel families: tensor maps and fallbacks."""
from __future__ import annotations

from . import heuristics, tma
from .config import KernelConfig
from .dispatch import get_kernel, smem_bytes
from .launch import PackedTail


def fwd_launch_args(kern, cfg: KernelConfig, smem: int, q, k, v, device_id: int, out=None):
    """(kernel, config, shared memory bytes, kernel arguments after the params struct).

    For the sm90 forward families the extra arguments are the tensor maps of q, k and v (and, for
    the persistent kernels, of ``out``, which they store through TMA, then the tile counter); when
    TMA cannot address an input (base or strides not 16-byte multiples) the portable kernel is used
    instead. ``out`` must then be TMA-addressable (``fwd_out_addressable``; the caller passes a
    stand-in otherwise). Other families pass through unchanged.
    """
    if not cfg.family.startswith("sm90_fwd"):
        return kern, cfg, smem, ()
    persistent = cfg.family.endswith("_p")
    if persistent:  # O leaves in 64-row boxes, one per consumer warpgroup
        maps = _maps((q, k, v, out), cfg.dtype, (cfg.block_m, cfg.block_n, cfg.block_n, 64))
    else:
        maps = _maps((q, k, v), cfg.dtype, (cfg.block_m, cfg.block_n, cfg.block_n))
    if maps is None:
        cfg = heuristics.fwd_config(cfg.dtype, cfg.head_dim, cfg.causal, 90, backend="sm80")
        return get_kernel(cfg, device_id), cfg, smem_bytes(cfg), ()
    if persistent:
        return kern, cfg, smem, (maps, tile_counter(device_id))
    return kern, cfg, smem, (maps,)


def fwd_stores_through_tma(cfg: KernelConfig) -> bool:
    """Whether this forward kernel writes O with TMA stores (the persistent sm90 fp16/bf16 kernels)."""
    return cfg.family.startswith("sm90_fwd") and cfg.family.endswith("_p") and "fp8" not in cfg.family


def fwd_out_addressable(out) -> bool:
    """Whether TMA can store into ``out`` (a (batch, seqlen, heads, head_dim) array)."""
    return tma.bshd_ok(out)


# (dtype, box rows, then pointer, shape and strides of each array) -> the arrays' tensor maps, or
# None where TMA cannot address one of them: one lookup per launch instead of a check and a
# descriptor-cache lookup per array.
_map_sets: dict = {}
_MAP_SETS_MAX = 512


def _maps(arrays: tuple, dtype: str, box_rows: tuple):
    key = (dtype, box_rows) + tuple((x.data.ptr, x.shape, x.strides) for x in arrays)
    found = _map_sets.get(key, False)
    if found is False:
        found = None
        if all(tma.bshd_ok(x) for x in arrays):
            found = PackedTail(tuple(tma.bshd_map(x, dtype, rows) for x, rows in zip(arrays, box_rows)))
        if len(_map_sets) >= _MAP_SETS_MAX:
            _map_sets.clear()
        _map_sets[key] = found
    return found


# (device, stream) -> two int32 zeros: the persistent forward's tile counter, which the kernel
# resets when it finishes (launches on one stream run one after the other).
_tile_counters: dict = {}


def tile_counter(device_id: int):
    import cupy

    key = (device_id, cupy.cuda.get_current_stream().ptr)
    c = _tile_counters.get(key)
    if c is None:
        with cupy.cuda.Device(device_id):
            c = _tile_counters[key] = cupy.zeros(2, dtype=cupy.int32)
    return c


# Consumer warpgroups of the sm90 backward (Sm90BwdTile::kConsumerWGs): dQ slices per query tile.
BWD_CONSUMER_WARPGROUPS = 2


def padded_head_dim(head_dim: int) -> int:
    """Head dim rounded up to the 64-column swizzle atoms of the sm90 tiles (kHeadDimPad)."""
    return (head_dim + 63) // 64 * 64


def bwd_tensor_maps(cfg: KernelConfig, q, k, v, dout):
    """The tensor maps of q, k, v and dout for the sm90 backward (a ``PackedTail``), or None when
    TMA cannot address one of them (the caller then runs the portable kernels)."""
    return _maps((q, k, v, dout), cfg.dtype, (cfg.block_m, cfg.block_n, cfg.block_n, cfg.block_m))
