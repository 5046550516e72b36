"""Host side of the Hopper (sm90) kernel families: tensor maps and fallbacks."""
from __future__ import annotations

import functools

from . import heuristics, options, tile_counters, tma
from .config import KernelConfig
from .dispatch import get_kernel, smem_bytes
from .launch import PackedTail


def fwd_launch_args(kern, cfg: KernelConfig, smem: int, q, k, v, device_id: int, out):
    """(kernel, config, shared memory bytes, kernel arguments after the params struct, the array the
    kernel writes O into).

    For the sm90 fp16/bf16 forward families the extra arguments are the tensor maps of q, k and v
    (and, for the persistent kernels, which store O through TMA, of the output, then the device's
    tile-counter pool, from which each launch takes a slot: tile_counters.py); when TMA cannot
    address an input (base or strides not 16-byte multiples) the portable kernel is used instead.
    Where only ``out`` is the problem for a persistent kernel, the kernel
    writes a compact stand-in, which the caller copies into ``out``. That check runs only when the
    tensor-map cache misses. Other families pass through unchanged.
    """
    if not cfg.fam.sm90_fwd:
        return kern, cfg, smem, (), out
    if not cfg.fam.persistent:
        maps = fwd_tensor_maps(cfg, q, k, v)
        if maps is None:
            return (*_portable_fwd(cfg, device_id), (), out)
        return kern, cfg, smem, (maps,), out
    rows = (cfg.block_m, cfg.block_n, cfg.block_n, 64)   # O leaves in 64-row boxes, one per consumer warpgroup
    maps = _maps((q, k, v, out), cfg.dtype, rows)
    if maps is None and not tma.bshd_ok(out) and all(tma.bshd_ok(x) for x in (q, k, v)):
        import cupy

        out = cupy.empty(out.shape, dtype=out.dtype)
        maps = _maps((q, k, v, out), cfg.dtype, rows)
    if maps is None:
        return (*_portable_fwd(cfg, device_id), (), out)
    return kern, cfg, smem, (maps, tile_counters.for_device(device_id)), out


def fwd_tensor_maps(cfg: KernelConfig, q, k, v):
    """The tensor maps of q, k and v for a Hopper forward kernel that takes one CTA per tile (a ``PackedTail``),
    or None where TMA cannot address one of them."""
    return _maps((q, k, v), cfg.dtype, (cfg.block_m, cfg.block_n, cfg.block_n))


def _portable_fwd(cfg: KernelConfig, device_id: int):
    """(kernel, config, shared memory bytes) of the portable forward for this config's inputs."""
    cfg = heuristics.fwd_config(cfg.dtype, cfg.head_dim, cfg.causal, 90, backend="sm80", variant=cfg.variant,
                                head_dim_v=cfg.head_dim_v)
    return get_kernel(cfg, device_id), cfg, smem_bytes(cfg, device_id)


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


# Consumer warpgroups of the sm90 backward (Sm90BwdTile::kConsumerWGs): dQ slices per query tile.
BWD_CONSUMER_WARPGROUPS = 2


def padded_head_dim(head_dim: int) -> int:
    """Head dim rounded up to the 64-column swizzle atoms of the sm90 tiles (kHeadDimPad)."""
    return (head_dim + 63) // 64 * 64


def varlen_padded_rows(total_q: int, batch: int, tile_rows: int) -> int:
    """Rows of each head's stats and dQ tiles in the varlen backward: sequence b's tiles start at padded row
    (start // tile_rows + b) * tile_rows (kernels_cu/common/varlen.cuh: padded_row0) and end at most
    total_q + batch * tile_rows rows in, rounded up to a whole tile."""
    return -(-(total_q + batch * tile_rows) // tile_rows) * tile_rows


def bwd_tensor_maps(cfg: KernelConfig, q, k, v, dout):
    """The tensor maps of q, k, v and dout for the sm90 backward (a ``PackedTail``), or None when
    TMA cannot address one of them (the caller then runs the portable kernels)."""
    return _maps((q, k, v, dout), cfg.dtype, (cfg.block_m, cfg.block_n, cfg.block_n, cfg.block_m))


# Tests and dev tools set this to True for the negative control of the first-slice stores: a build that
# adds every slice (-DCUFLASH_SM90_BWD_FIRST_STORE=0 or -DCUFLASH_SM90_BWD_CLAIM_FIRST=0) run with a
# preprocess that still zeroes only what a store would not cover, which tests/test_bwd.py's
# test_workspace_poisoned must then catch.
_NEGATIVE_CONTROL_SKIP_ZEROING = False


def _defines(nvrtc_defines: tuple) -> dict:
    """NAME -> value ("1" where none is given) of the ``-D`` options among ``nvrtc_defines``."""
    out, tokens = {}, iter(nvrtc_defines)
    for t in tokens:
        if t == "-D":
            t = "-D" + next(tokens, "")
        if t.startswith("-D") and len(t) > 2:
            name, _, value = t[2:].partition("=")
            out[name] = value or "1"
    return out


@functools.lru_cache(maxsize=64)
def _first_slice_stores(nvrtc_defines: tuple) -> tuple:
    """(ordered mode stores its first slice, unordered mode claims it) in a build with these defines, as
    kernels_cu/sm90/bwd_scheduler.cuh sets its switches (the trace build cannot claim)."""
    d = _defines(nvrtc_defines)
    ordered = d.get("CUFLASH_SM90_BWD_FIRST_STORE", "1") != "0"
    claim = d.get("CUFLASH_SM90_BWD_CLAIM_FIRST", "0" if "CUFLASH_SM90_BWD_TRACE" in d else "1") != "0"
    return ordered, claim


def bwd_first_slice_stored(cfg: KernelConfig, opts: options.Options | None = None) -> bool:
    """Whether the sm90 tile-dQ backward kernel ``cfg`` stores the first slice that reaches each query tile of
    its float32 dQ sums instead of adding it (kernels_cu/sm90/bwd.cu: the ordered mode stores its first
    contribution, the unordered one claims it), so that the preprocess zeroes only the query tiles no key
    tile writes. Builds whose Options.nvrtc_defines turn that off (-DCUFLASH_SM90_BWD_FIRST_STORE=0,
    -DCUFLASH_SM90_BWD_CLAIM_FIRST=0, the trace build) get every sum zeroed."""
    if _NEGATIVE_CONTROL_SKIP_ZEROING:
        return True
    ordered, claim = _first_slice_stores((opts or options.current()).nvrtc_defines)
    return ordered if cfg.fam.dq_mode == "ordered" else claim
