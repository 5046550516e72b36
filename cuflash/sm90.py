"""Host side of the Hopper (sm90) kernel families: tensor maps and fallbacks."""
from __future__ import annotations

from . import heuristics, tma
from .config import KernelConfig
from .dispatch import get_kernel, smem_bytes


def fwd_launch_args(kern, cfg: KernelConfig, smem: int, q, k, v, device_id: int):
    """(kernel, config, shared memory bytes, kernel arguments after the params struct).

    For the sm90 forward families the extra arguments are the tensor maps of q, k and v; when
    TMA cannot address an input (base or strides not 16-byte multiples) the
    portable kernel is used instead. Other families pass through unchanged.
    """
    if not cfg.family.startswith("sm90_fwd"):
        return kern, cfg, smem, ()
    if not (tma.bshd_ok(q) and tma.bshd_ok(k) and tma.bshd_ok(v)):
        cfg = heuristics.fwd_config(cfg.dtype, cfg.head_dim, cfg.causal, 90, backend="sm80")
        return get_kernel(cfg, device_id), cfg, smem_bytes(cfg), ()
    maps = (tma.bshd_map(q, cfg.dtype, cfg.block_m), tma.bshd_map(k, cfg.dtype, cfg.block_n),
            tma.bshd_map(v, cfg.dtype, cfg.block_n))
    if cfg.family.endswith("_p"):  # persistent: the tile counter
        maps = maps + (tile_counter(device_id),)
    return kern, cfg, smem, maps


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


def bwd_launch_args(kern, cfg: KernelConfig, smem: int, q, k, v, dout, device_id: int):
    """(kernel, config, shared memory bytes, extra arguments) of the dK/dV launch.

    For the sm90 backward family the extra arguments are the tensor maps of q, k, v and dout;
    when TMA cannot address an input the sm80 dK/dV + atomic dQ kernel is used instead (same
    preprocess / postprocess). Other families pass through unchanged.
    """
    if not cfg.family.startswith("sm90_bwd"):
        return kern, cfg, smem, ()
    if not all(tma.bshd_ok(x) for x in (q, k, v, dout)):
        cfg = heuristics.bwd_configs(cfg.dtype, cfg.head_dim, cfg.causal, 90, False, backend="sm80").dkdv
        return get_kernel(cfg, device_id), cfg, smem_bytes(cfg), ()
    maps = (tma.bshd_map(q, cfg.dtype, cfg.block_m), tma.bshd_map(k, cfg.dtype, cfg.block_n),
            tma.bshd_map(v, cfg.dtype, cfg.block_n), tma.bshd_map(dout, cfg.dtype, cfg.block_m))
    return kern, cfg, smem, maps
