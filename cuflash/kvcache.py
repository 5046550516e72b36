"""Decoding over a KV cache: the checks, plan and launches behind :func:`cuflash.forward_kvcache` and
:func:`cuflash.combine` (kernels in kernels_cu/decode/).

A call runs up to three kernels on the current stream:

1. ``kvcache_append`` (only with new ``k`` / ``v`` or a rotary table): the new keys and values into the cache at
   ``cache_seqlens[b] + i``, the new keys and the queries rotated on the way (the queries into a workspace);
2. ``decode``: the attention, a CTA per (key split, KV head and packed query-row tile, sequence);
3. ``combine`` (with more than one split, or ``batch_invariant``): the splits' float32 results merged through
   their lse.

Split-KV. The key range of every sequence is cut into splits of ``keys_per_split`` keys (a multiple of the
64-key tile). ``num_splits=0`` picks the count from the work (split_plan): whole waves of CTAs over the GPU's
slots (one CTA per SM for the TMA-fed kernel, the resident CTAs for the cp.async rings), each split at least 512 keys
of the cache's capacity.
The host never reads ``cache_seqlens`` (no sync): splits are cut from the capacity, and a split past a shorter
sequence's keys costs one empty CTA. ``batch_invariant=True`` fixes ``keys_per_split`` (BATCH_INVARIANT_KEYS) and
always merges through ``combine``, so a row's result depends on its own sequence only, bitwise.

What is checked without a device sync, before any kernel: every shape, dtype, device and stride (appends refuse a
broadcast cache and one array given as both caches, whose slots several tokens would race for). What is not
(documented, never unsafe): ``cache_seqlens[b]`` beyond the cache's capacity (the keys are clamped to the
capacity, appended tokens past it are dropped), ``cache_leftpad[b]`` outside [0, capacity] (clamped), and
block-table entries out of range (a read takes the nearest page that exists, an append skips the token): no read
or write leaves the cache.

fp8 caches (uint8 arrays of e4m3 bytes; the e4m3 instructions from compute capability 8.9, common/e4m3.cuh's integer
code before: ``decode_fp8``, Hopper's ``decode_sm90_fp8``,
``kvcache_append_fp8``): a stored element's value is its e4m3 value times its KV head's descale (``Descales``: a
float, one element, ``(heads_kv,)`` or ``(batch, heads_kv)``). The kernel folds K's descale into the score scale (and
the score modifiers' conversions) and V's into the output, so the dequantisation itself is a type conversion; appends
store ``e4m3(x * (1 / descale))``.

``v_cache=None`` (MLA's latent cache, ``decode_sm90_mla``): head dim 576, V the first 512 columns of the K rows; the
host passes views of those columns as v_cache (and of k as the new v), so the checks and the append run unchanged,
and the kernel reads V from the K stage.

``cache_leftpad`` (flash-attn's meaning, contiguous caches): sequence b's keys start at cache position
``cache_leftpad[b]``; it has ``cache_seqlens[b] + seqlen_new - cache_leftpad[b]`` keys, and positions (rotary, causal
alignment, windows, ALiBi) count from there; appends still land at cache position ``cache_seqlens[b]``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from . import _checks, launch, options, params, tma, variants
from .config import KernelConfig
from .dispatch import get_kernel, smem_bytes

LOG2E = 1.4426950408889634
BLOCK_N = 64                 # keys per tile of the decode kernel (kernels_cu/decode/decode.cu)
NUM_WARPS = 4
SM90_PRODUCER_WARPS = 4      # the Hopper decode kernel's producer warps (decode_sm90.cu kProducerWarps)
SM90_TMA_PRODUCER_WARPS = 1  # the same filled by TMA (one thread issues the boxes)
MIN_KEYS_PER_SPLIT = 512     # the automatic split count keeps at least this many keys of capacity per split
SPLIT_OVERHEAD_KEYS = 256    # a CTA's fixed cost in keys' worth of time (split_plan's estimate)
MAX_SPLITS = 128
MAX_GRID_SPLITS = 65535      # the launch grid's y dimension
BATCH_INVARIANT_KEYS = 2048  # keys per split in batch-invariant mode
MAX_HEAD_DIM = 256
MLA_HEAD_DIMS = (576, 512)   # v_cache=None: MLA's latent cache (FlashMLA's shape), V its first 512 columns


def _bucket(d: int) -> int:
    """The kernel's head-dim bucket: d rounded up to 64 columns (loads zero-fill the columns past d)."""
    return -(-d // 64) * 64


def block_m_for(rows: int) -> int:
    """Packed query rows (seqlen_q * heads_per_kv) per CTA: the smallest of 16, 32, 64 that holds them (64 at most,
    more rows take more tiles)."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


def split_plan(capacity: int, ctas: int, slots: int, num_splits: int, batch_invariant: bool) -> tuple[int, int]:
    """``(splits, keys_per_split)`` for a cache of ``capacity`` keys per sequence, ``ctas`` CTAs per split and
    ``slots`` CTAs the GPU runs side by side at full speed (_decode_plan). Automatic (``num_splits=0``): the count
    with the least estimated time, whole waves of CTAs times the keys each reads (plus SPLIT_OVERHEAD_KEYS for its
    prologue, epilogue and share of the merge), each split at least MIN_KEYS_PER_SPLIT keys."""
    if capacity <= 0:
        return 1, BLOCK_N

    def rounded(kps: int) -> tuple[int, int]:
        kps = -(-kps // BLOCK_N) * BLOCK_N
        return -(-capacity // kps), kps

    if batch_invariant:
        return rounded(BATCH_INVARIANT_KEYS)
    if num_splits > 0:   # (at most MAX_GRID_SPLITS: the grid's y dimension)
        return rounded(-(-capacity // min(num_splits, MAX_GRID_SPLITS)))
    best = None
    for want in range(1, max(1, min(capacity // MIN_KEYS_PER_SPLIT, MAX_SPLITS)) + 1):
        splits, kps = rounded(-(-capacity // want))
        cost = -(-ctas * splits // max(slots, 1)) * (kps + SPLIT_OVERHEAD_KEYS)
        if best is None or cost < best[0]:
            best = (cost, splits, kps)
    return best[1], best[2]


@dataclass(frozen=True)
class CacheLayout:
    """A checked call's shapes. q ``(batch, seqlen_q, heads_q, head_dim)``; the cache contiguous ``(cache_rows,
    capacity, heads_kv, D)`` or paged ``(cache_rows = num_pages, page_size, heads_kv, D)`` with ``capacity =
    max_blocks * page_size``."""

    batch: int
    seqlen_q: int
    heads_q: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    seqlen_new: int
    capacity: int
    cache_rows: int
    page_size: int       # 0: contiguous
    device_id: int
    fp8: bool = False    # e4m3 caches (uint8 arrays of e4m3fn bytes), dequantised in the kernel
    latent: bool = False  # v_cache=None: V is the first MLA_HEAD_DIMS[1] columns of the K cache (576 wide)
    tma_ok: bool = False  # 16-bit caches TMA can address (tma_strides): decode_sm90_tma may read them


def _int_array(name: str, x, shape: tuple, device_id: int, what: str):
    import cupy

    if not isinstance(x, cupy.ndarray):
        raise TypeError(f"{name} must be a cupy.ndarray of int32 {what}, got {type(x).__name__}")
    if x.dtype != np.int32:
        raise TypeError(f"{name} must be int32 {what}, got {x.dtype}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} {what}, got {tuple(x.shape)}")
    if x.data.device_id != device_id:
        raise ValueError(f"{name} is on device {x.data.device_id}, q on device {device_id}")
    if x.size and x.strides[-1] != 4:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {x.strides}")
    return x


def latent_views(q, k_cache, k, v, rotary_cos):
    """``v_cache=None`` (MLA's latent cache): ``(v_cache, v)`` as views of the first 512 columns of ``k_cache`` and
    ``k`` (the append then writes V's columns twice, the same values), after the checks that only this form has."""
    import cupy

    for name, x in (("q", q), ("k_cache", k_cache)):
        if isinstance(x, cupy.ndarray) and x.ndim == 4 and x.shape[3] != MLA_HEAD_DIMS[0]:
            raise ValueError(f"v_cache=None (MLA's latent cache, V its first {MLA_HEAD_DIMS[1]} columns) needs "
                             f"{name}'s head_dim {MLA_HEAD_DIMS[0]}, got {x.shape[3]}")
    if v is not None:
        raise ValueError("with v_cache=None, v must be None too: the new values are the first "
                         f"{MLA_HEAD_DIMS[1]} columns of k")
    if rotary_cos is not None:
        raise ValueError("rotary embedding with v_cache=None (MLA) is not supported: it would rotate V's columns")
    if not isinstance(k_cache, cupy.ndarray) or k_cache.ndim != 4:
        return None, None   # check() names the problem
    dv = MLA_HEAD_DIMS[1]
    return k_cache[..., :dv], (k[..., :dv] if isinstance(k, cupy.ndarray) and k.ndim == 4 else k)


def check(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, rotary_cos, rotary_sin,
          cache_leftpad=None, latent: bool = False):
    """The checks of :func:`cuflash.forward_kvcache` (TypeError / ValueError naming the argument); returns
    ``(layout, cache_seqlens)`` (a Python int becomes an int32 array)."""
    import cupy

    from . import fp8 as fp8_mod

    _checks.check_array("q", q)
    fp8 = isinstance(k_cache, cupy.ndarray) and k_cache.dtype in fp8_mod.FP8_DTYPES
    f32_caches = q.dtype == np.float32 and not fp8 and not latent   # (the portable kernel)
    if not f32_caches and q.dtype not in (np.float16, _checks.BFLOAT16):
        raise TypeError(f"q must be float16 or bfloat16 (or float32 over float32 caches), got {q.dtype}")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if fp8:   # e4m3 bytes, both caches
            if isinstance(x, cupy.ndarray) and x.dtype not in fp8_mod.FP8_DTYPES:
                raise TypeError(f"v_cache must hold fp8 e4m3 bytes (uint8) as k_cache does, got {x.dtype}")
            fp8_mod.check_fp8_array(name, x)
            _checks.check_aligned(name, x)
            if x.device.id != q.device.id:
                raise ValueError(f"{name} is on device {x.device.id} but q is on device {q.device.id}")
        else:
            _checks.check_array(name, x)
            _checks.check_same(name, x, "q", q)
    b, nq, hq, d = q.shape
    rows, cap, hkv, dk = k_cache.shape
    dv = v_cache.shape[3]
    if dk != d:
        raise ValueError(f"k_cache's head_dim must be q's ({d}), got {dk}")
    if tuple(v_cache.shape[:3]) != (rows, cap, hkv):
        raise ValueError(f"v_cache must have the shape of k_cache but for its head_dim: {(rows, cap, hkv, '*')}, "
                         f"got {tuple(v_cache.shape)}")
    if latent:
        if fp8:
            raise ValueError("an fp8 latent cache (v_cache=None) is not supported yet")
    else:
        for name, value in (("head_dim", d), ("v_cache's head_dim", dv)):
            if value % 8 or not 8 <= value <= MAX_HEAD_DIM:
                raise ValueError(f"{name} must be a multiple of 8 from 8 to {MAX_HEAD_DIM} in forward_kvcache, got "
                                 f"{value} (or {MLA_HEAD_DIMS} with v_cache=None, MLA)")
    if b > 65535:
        raise ValueError(f"q's batch must be at most 65535 in forward_kvcache (the launch grid), got {b}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"q's heads ({hq}) must be a multiple of the cache's heads ({hkv})")
    dev = q.data.device_id
    page_size = 0
    if block_table is not None:
        max_blocks = block_table.shape[1] if getattr(block_table, "ndim", 0) == 2 else -1
        _int_array("block_table", block_table, (b, max_blocks), dev, "(batch, max_blocks)")
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be combined with block_table (a paged cache maps each "
                             "sequence through its block-table row)")
        page_size = cap
        if page_size % 16 or page_size == 0:
            raise ValueError(f"the page size (k_cache.shape[1] with block_table) must be a multiple of 16, "
                             f"got {page_size}")
        capacity = max_blocks * page_size
    else:
        capacity = cap
    if cache_batch_idx is not None:
        _int_array("cache_batch_idx", cache_batch_idx, (b,), dev, "(batch,)")
    if cache_leftpad is not None:
        if block_table is not None:
            raise ValueError("cache_leftpad cannot be combined with block_table (as flash-attn: a paged cache starts "
                             "each sequence at its first page)")
        _int_array("cache_leftpad", cache_leftpad, (b,), dev, "(batch,)")
    elif block_table is None and rows < b:
        raise ValueError(f"k_cache has {rows} rows for a batch of {b}: pass cache_batch_idx to map them")
    if isinstance(cache_seqlens, (int, np.integer)) and not isinstance(cache_seqlens, bool):
        if cache_seqlens < 0:
            raise ValueError(f"cache_seqlens must be >= 0, got {cache_seqlens}")
        with cupy.cuda.Device(dev):
            cache_seqlens = cupy.full((b,), int(cache_seqlens), dtype=np.int32)
    else:
        _int_array("cache_seqlens", cache_seqlens, (b,), dev, "(batch,)")
    seqlen_new = 0
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new keys and their values), or neither")
    if k is not None:
        _checks.check_array("k", k)
        _checks.check_array("v", v)
        _checks.check_same("k", k, "q", q)
        _checks.check_same("v", v, "q", q)
        seqlen_new = k.shape[1]
        if tuple(k.shape) != (b, seqlen_new, hkv, d):
            raise ValueError(f"k must have shape (batch, seqlen_new, heads_kv, head_dim) = {(b, seqlen_new, hkv, d)}, "
                             f"got {tuple(k.shape)}")
        if tuple(v.shape) != (b, seqlen_new, hkv, dv):
            raise ValueError(f"v must have shape {(b, seqlen_new, hkv, dv)}, got {tuple(v.shape)}")
        # Appends write in place: each slot must be one cache's own (a broadcast view, or one array given as both
        # caches, would have several tokens race for it; K and V interleaved in one buffer are fine). MLA's V is K's
        # own columns by design.
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
            if any(st == 0 and n > 1 for st, n in zip(x.strides, x.shape)):
                raise ValueError(f"{name} has a dimension of stride 0 (a broadcast view, strides {x.strides}): "
                                 f"appending k / v would write one slot for several sequences; pass a cache of its own")
        if not latent and k_cache.data.ptr == v_cache.data.ptr and k_cache.strides[:3] == v_cache.strides[:3]:
            raise ValueError("k_cache and v_cache are the same memory: appending k / v would write both into the same "
                             "slots")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        for name, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if not isinstance(x, cupy.ndarray) or x.ndim != 2:
                raise TypeError(f"{name} must be a 2-D cupy.ndarray (seqlen_ro, rotary_dim // 2)")
            if x.dtype not in (np.float16, _checks.BFLOAT16, np.float32):
                raise TypeError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
            if x.data.device_id != dev:
                raise ValueError(f"{name} is on device {x.data.device_id}, q on device {dev}")
        if rotary_cos.shape != rotary_sin.shape:
            raise ValueError(f"rotary_cos and rotary_sin must have one shape, got {rotary_cos.shape} and "
                             f"{rotary_sin.shape}")
        if not 0 < 2 * rotary_cos.shape[1] <= d or rotary_cos.shape[0] == 0:
            raise ValueError(f"rotary_cos must be (seqlen_ro >= 1, rotary_dim // 2) with 0 < rotary_dim <= head_dim "
                             f"({d}), got {rotary_cos.shape}")
    tma_ok = not fp8 and not latent and all(tma_strides(x) is not None for x in (k_cache, v_cache))
    layout = CacheLayout(b, nq, hq, hkv, d, dv, seqlen_new, capacity, rows, page_size, dev, fp8, latent, tma_ok)
    return layout, cache_seqlens


@dataclass(frozen=True)
class Descales:
    """The fp8 caches' scales as the kernels take them: device pointers (0: the values) and the strides of a (batch,
    heads_kv) / (heads_kv,) / one-element array; 1 and no arrays for 16-bit caches."""

    k_ptr: int = 0
    v_ptr: int = 0
    batch_stride: int = 0
    head_stride: int = 0
    k_value: float = 1.0
    v_value: float = 1.0
    keep: tuple = ()


def check_descales(k_descale, v_descale, lay: CacheLayout) -> Descales:
    """The checks of forward_kvcache's ``k_descale`` / ``v_descale``: fp8 caches only; each a positive float or a
    float32 array of one element, ``(heads_kv,)`` or ``(batch, heads_kv)``, both of one kind and shape. Values in
    arrays are not read (no device sync)."""
    import cupy

    from . import fp8 as fp8_mod

    given = {name: x for name, x in (("k_descale", k_descale), ("v_descale", v_descale)) if x is not None}
    if not lay.fp8:
        if given:
            raise ValueError(f"{', '.join(given)} apply to fp8 caches only (k_cache is 16-bit here)")
        return Descales()
    arrays = {name: isinstance(x, cupy.ndarray) for name, x in given.items()}
    if len(set(arrays.values())) > 1 or (any(arrays.values()) and len(given) < 2):
        raise ValueError("k_descale and v_descale must be both arrays of one shape, or both floats (or left out)")
    if not any(arrays.values()):
        for name, x in given.items():
            fp8_mod.check_descale(name, x, lay.device_id)
        return Descales(k_value=float(k_descale) if k_descale is not None else 1.0,
                        v_value=float(v_descale) if v_descale is not None else 1.0)
    shapes = {(lay.heads_kv,): (0, 1), (lay.batch, lay.heads_kv): (lay.heads_kv, 1)}
    if k_descale.shape != v_descale.shape:
        raise ValueError(f"k_descale and v_descale must have one shape, got {k_descale.shape} and {v_descale.shape}")
    for name, x in given.items():
        if x.dtype != np.float32:
            raise TypeError(f"{name} must be float32, got {x.dtype}")
        if x.device.id != lay.device_id:
            raise ValueError(f"{name} is on device {x.device.id} but q is on device {lay.device_id}")
        if x.size != 1 and tuple(x.shape) not in shapes:
            raise ValueError(f"{name} must have one element, or shape (heads_kv,) = {(lay.heads_kv,)} or (batch, "
                             f"heads_kv) = {(lay.batch, lay.heads_kv)}, got {tuple(x.shape)}")
    k_arr, v_arr = cupy.ascontiguousarray(k_descale), cupy.ascontiguousarray(v_descale)
    strides = (0, 0) if k_arr.size == 1 else shapes[tuple(k_arr.shape)]
    return Descales(k_arr.data.ptr, v_arr.data.ptr, *strides, keep=(k_arr, v_arr))


@functools.lru_cache(maxsize=None)
def _sm_count(device_id: int) -> int:
    import cupy

    return cupy.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"]


def _page_shift(page_size: int) -> int:
    """log2(page_size) where it is a power of two (the kernel shifts), else -1 (it divides); 0 pages: -1."""
    return page_size.bit_length() - 1 if page_size > 0 and page_size & (page_size - 1) == 0 else -1


def _resident_ctas(device_id: int, kern, cfg: KernelConfig, smem: int) -> int:
    """Decode CTAs resident on the GPU at once: the driver's occupancy for the kernel's threads, registers and
    shared memory, times the SMs."""
    import cupy
    from cupy.cuda import driver

    with cupy.cuda.Device(device_id):
        fptr = launch.function_ptr(kern, smem)   # (with its dynamic shared memory allowed)
        per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(fptr, cfg.threads, smem)
    return _sm_count(device_id) * max(1, per_sm)


def _strides(x) -> tuple:
    return params.element_strides(x)


# (config, device, options token) -> (kernel, shared memory bytes); (dtype, head dims, packed rows, causal, variant,
# device, token) -> the decode plan: chosen once, read on every call after.
_kernels: dict = {}
_plans: dict = {}


def _kernel(cfg: KernelConfig, device_id: int, opts: options.Options):
    key = (cfg, device_id, opts.token)
    found = _kernels.get(key)
    if found is None:
        found = _kernels[key] = (get_kernel(cfg, device_id, opts.nvrtc_defines),
                                 smem_bytes(cfg, device_id, opts.nvrtc_defines))
    return found


def _decode_plan(dtype: str, lay: "CacheLayout", var: variants.Variants, opts: options.Options) -> tuple:
    """``(config, kernel, shared memory, CTA slots for split_plan)`` of the decode kernel for a call, cached."""
    key = (dtype, lay.head_dim, lay.head_dim_v, lay.seqlen_q * (lay.heads_q // lay.heads_kv), var.causal,
           var.kernel, lay.fp8, lay.latent, lay.tma_ok, lay.device_id, opts.token)
    plan = _plans.get(key)
    if plan is None:
        cfg = decode_config(dtype, lay, var.causal, var.kernel, opts)
        kern, smem = _kernel(cfg, lay.device_id, opts)
        # A CTA fed by TMA keeps its SM's share of the bandwidth busy alone, and the CTAs that share an SM share it:
        # the splits fill the SMs once (more, shorter splits only add their prologues and merges: BENCHMARKS.md).
        # The cp.async rings need two CTAs an SM to keep enough bytes in flight: their waves count resident CTAs.
        slots = (_sm_count(lay.device_id) if cfg.family == "decode_sm90_tma"
                 else _resident_ctas(lay.device_id, kern, cfg, smem))
        plan = _plans[key] = (cfg, kern, smem, slots)
    return plan


def decode_backend(device_id: int, opts: options.Options) -> str:
    """The decode kernel family's backend for a device: "sm90_tma" (kernels_cu/decode/decode_sm90.cu, its ring filled
    by TMA boxes where decode_configs allows, else by producer warps' cp.async) on cc 9.0, else "sm80" (the cp.async
    ring); Options.decode_backend forces one (ValueError for "sm90*" elsewhere)."""
    from .dispatch import device_info

    cc = device_info(device_id, opts)[0]
    choice = opts.decode_backend
    if choice == "auto":
        return "sm90_tma" if cc == 90 else "sm80"
    if choice.startswith("sm90") and cc != 90:
        raise ValueError(f"CUFLASH_DECODE_BACKEND={choice} needs a compute capability 9.0 GPU, device {device_id} has "
                         f"{cc // 10}.{cc % 10}")
    return choice


def decode_configs(dtype: str, lay: CacheLayout, causal: bool, variant: variants.MaskVariant,
                   backend: str = "sm80") -> list:
    """The decode kernels for a call, best first: block_m from the packed rows, 64-column head-dim buckets, 64-key
    tiles over 4 warps (32-key tiles for 32- and 64-row tiles above 128 columns); then, for devices with less shared
    memory than the first needs, 32-key tiles (a warp per 16 keys) and shorter row tiles. ``backend`` "sm90": the
    same tiles in the Hopper family, whose num_warps counts its SM90_PRODUCER_WARPS producer warps too; "sm90_tma":
    those filled by TMA (SM90_TMA_PRODUCER_WARPS) where the caches allow it and the tile's registers leave room."""
    d, dv = _bucket(lay.head_dim), _bucket(lay.head_dim_v)
    if lay.latent:   # 16 rows a CTA, 32-key tiles, four warps on O's columns (decode_sm90.cu, DecodeTile's kLatent)
        if not backend.startswith("sm90"):
            raise ValueError("MLA decoding (v_cache=None) needs the Hopper decode kernel (compute capability 9.0) in "
                             "this version")
        return [KernelConfig("decode_sm90_mla", dtype, d, causal, 16, 32, 4 + SM90_PRODUCER_WARPS, variant, dv)]
    rows = lay.seqlen_q * (lay.heads_q // lay.heads_kv)
    bm = block_m_for(rows)
    if dtype == "float32":   # the portable kernel's float rows (two stages of 32 keys, or 16 on small devices)
        tiles = [(bm, 32, max(2, 2 * bm // 16)), (16, 16, 1)]
        return [KernelConfig("decode", dtype, d, causal, m, n, w, variant, 0 if dv == d else dv) for m, n, w in tiles]
    tiles = [(bm, BLOCK_N, NUM_WARPS), (bm, 32, 2 * bm // 16)]
    if max(d, dv) > 128 and bm > 16:   # taller tiles of wide rows: 32-key steps keep S and O in registers
        tiles = tiles[1:]
    if bm > 32:
        tiles.append((32, 32, 4))
    if bm > 16:
        tiles.append((16, 32, 2))
    def family(m: int) -> tuple:
        if not backend.startswith("sm90"):
            return ("decode_fp8" if lay.fp8 else "decode"), 0
        if lay.fp8:
            return "decode_sm90_fp8", SM90_PRODUCER_WARPS
        # TMA: caches it can address; up to 128 columns past 16-row tiles (the wide ones' registers do not leave its
        # producer room)
        if backend == "sm90_tma" and lay.tma_ok and (m == 16 or max(d, dv) <= 128):
            return "decode_sm90_tma", SM90_TMA_PRODUCER_WARPS
        return "decode_sm90", SM90_PRODUCER_WARPS

    out = []
    for m, n, w in tiles:
        name, producers = family(m)
        out.append(KernelConfig(name, dtype, d, causal, m, n, w + producers, variant, 0 if dv == d else dv))
    return out


def first_fitting(configs: list, limit: int, smem_of: Callable[[KernelConfig], int]) -> Optional[KernelConfig]:
    """The first of ``configs`` (decode_configs, best first) whose shared memory, ``smem_of(config)``, fits ``limit``;
    None where none does."""
    return next((cfg for cfg in configs if smem_of(cfg) <= limit), None)


def decode_config(dtype: str, lay: CacheLayout, causal: bool, variant: variants.MaskVariant,
                  opts: Optional[options.Options] = None) -> KernelConfig:
    """The first of decode_configs whose shared memory fits the device (first_fitting)."""
    from .dispatch import device_info

    opts = opts or options.current()
    limit = device_info(lay.device_id, opts)[1]
    configs = decode_configs(dtype, lay, causal, variant, decode_backend(lay.device_id, opts))
    cfg = first_fitting(configs, limit, lambda c: smem_bytes(c, lay.device_id, opts.nvrtc_defines))
    if cfg is not None:
        return cfg
    raise ValueError(f"no decode kernel fits this device's {limit} bytes of shared memory at head dims "
                     f"({lay.head_dim}, {lay.head_dim_v})")


def run(q, k_cache, v_cache, k, v, cache_seqlens, lay: CacheLayout, *, rotary_cos, rotary_sin,
        rotary_interleaved: bool, cache_batch_idx, block_table, var: variants.Variants, scale: float,
        num_splits: int, batch_invariant: bool, return_lse: bool, cache_leftpad=None,
        descales: Optional[Descales] = None):
    """Launches the append (if any), the decode kernel and the merge; returns ``(out, lse or None)``."""
    import cupy

    from . import capture

    opts = options.current()
    dtype = _checks.dtype_name(q.dtype)
    dev = lay.device_id
    b, nq, hq, hkv = lay.batch, lay.seqlen_q, lay.heads_q, lay.heads_kv
    out = cupy.empty((b, nq, hq, lay.head_dim_v), dtype=q.dtype)
    lse = cupy.empty((b, hq, nq), dtype=np.float32) if return_lse else None
    if b == 0 or (nq == 0 and (k is None or lay.seqlen_new == 0)):
        return out, lse
    bt_stride = block_table.strides[0] // 4 if block_table is not None else 0
    # The decode kernel first: a configuration no kernel serves fails before the append.
    plan = _decode_plan(dtype, lay, var, opts) if nq else None
    ds = descales or Descales()
    keep = list(ds.keep)
    scale_fields = (ds.batch_stride, ds.head_stride, ds.k_value, ds.v_value)
    # 1. The new tokens into the cache, and the rotary embedding.
    rotary = rotary_cos is not None
    if k is not None or rotary:
        cos = sin = None
        if rotary:
            cos = cupy.ascontiguousarray(rotary_cos, dtype=np.float32)
            sin = cupy.ascontiguousarray(rotary_sin, dtype=np.float32)
            keep += [cos, sin]
        q_rot = cupy.empty(q.shape, dtype=q.dtype) if rotary else None
        k_new = k if k is not None else None
        append_cfg = KernelConfig("kvcache_append_fp8" if lay.fp8 else "kvcache_append", dtype, 0, False, 0, 0,
                                  NUM_WARPS)
        kern, smem = _kernel(append_cfg, dev, opts)
        p = params.pack_bytes(params.APPEND_PARAMS, (
            k_new.data.ptr if k_new is not None else 0, v.data.ptr if v is not None else 0,
            k_cache.data.ptr, v_cache.data.ptr, q.data.ptr if rotary else 0, q_rot.data.ptr if rotary else 0,
            cos.data.ptr if rotary else 0, sin.data.ptr if rotary else 0, cache_seqlens.data.ptr,
            cache_batch_idx.data.ptr if cache_batch_idx is not None else 0,
            block_table.data.ptr if block_table is not None else 0,
            cache_leftpad.data.ptr if cache_leftpad is not None else 0, ds.k_ptr, ds.v_ptr,
            *(_strides(k_new) if k_new is not None else (0, 0, 0)), *(_strides(v) if v is not None else (0, 0, 0)),
            *_strides(k_cache), *_strides(v_cache), *_strides(q), bt_stride,
            b, lay.seqlen_new, nq, hkv, hq, lay.head_dim, lay.head_dim_v, 2 * cos.shape[1] if rotary else 0,
            int(bool(rotary_interleaved)), cos.shape[0] if rotary else 0,
            int(var.causal or var.local), lay.capacity, lay.cache_rows, lay.page_size, *scale_fields))
        warps = (b * lay.seqlen_new * hkv if k is not None else 0) + (b * nq * hq if rotary else 0)
        if warps >= 2**31:   # the kernel counts rows in 32 bits (unreachable: k alone would pass 256 GB)
            raise ValueError(f"at most 2^31 - 1 rows of new keys and rotated queries in one call, got {warps}")
        if warps:   # (no new token and no query to rotate: nothing to launch)
            launch.launch(kern, append_cfg, (-(-warps // NUM_WARPS), 1, 1), p, smem)
        if rotary:
            q = q_rot
            keep.append(q_rot)
    if nq == 0:   # the append alone
        capture.keep_if_capturing(*keep)
        return out, lse
    # 2. The attention, split over the keys.
    cfg, kern, smem, slots = plan
    m_tiles = -(-(nq * (hq // hkv)) // cfg.block_m)
    splits, kps = split_plan(lay.capacity, b * hkv * m_tiles, slots, num_splits, batch_invariant)
    merged = splits > 1 or batch_invariant
    o_part = lse_part = None
    if merged:
        o_part = cupy.empty((splits, b, nq, hq, lay.head_dim_v), dtype=np.float32)
        lse_part = cupy.empty((splits, b, hq, nq), dtype=np.float32)
        keep += [o_part, lse_part]
    mask_values = var.param_values(nq, nq + lay.capacity, scale, diag=0)
    p = params.pack_bytes(params.DECODE_PARAMS, (
        q.data.ptr, k_cache.data.ptr, v_cache.data.ptr, out.data.ptr,
        lse.data.ptr if lse is not None else 0, o_part.data.ptr if merged else 0,
        lse_part.data.ptr if merged else 0, cache_seqlens.data.ptr,
        cache_batch_idx.data.ptr if cache_batch_idx is not None else 0,
        block_table.data.ptr if block_table is not None else 0,
        cache_leftpad.data.ptr if cache_leftpad is not None else 0, ds.k_ptr, ds.v_ptr,
        *_strides(q), *_strides(k_cache), *_strides(v_cache), *_strides(out), bt_stride,
        b, nq, 0, hq, hq // hkv, lay.head_dim, lay.head_dim_v, lay.seqlen_new, lay.capacity, lay.cache_rows,
        lay.page_size, _page_shift(lay.page_size), kps, splits, *scale_fields, scale, scale * LOG2E, *mask_values))
    extra = (_tma_maps(k_cache, v_cache, lay, cfg),) if cfg.family == "decode_sm90_tma" else ()
    # Heads fastest: the CTAs reading one key range of every KV head start together, and a key's rows of all heads
    # (adjacent in memory) are read at about the same time.
    launch.launch(kern, cfg, (m_tiles * hkv, splits, b), p, smem, extra)
    # 3. The splits merged; on Hopper launched while the decode kernel runs, waiting for it on the device, which
    # hides the merge's launch (batch 1's split-KV regime: BENCHMARKS.md).
    if merged:
        combine_into(o_part, lse_part, out, lse, opts=opts,
                     programmatic=decode_backend(dev, opts).startswith("sm90"))
    capture.keep_if_capturing(*keep)
    return out, lse


def _tma_maps(k_cache, v_cache, lay: CacheLayout, cfg: KernelConfig):
    """The tensor maps of decode_sm90_tma: over (head dim, heads, keys, cache rows) of a contiguous cache, or (head
    dim, heads, page rows, pages) of a paged one; boxes of 64 columns by a tile's keys (paged: the largest power of two
    that divides the page size, up to the tile: kernels_cu/decode/decode_sm90.cu tma_box_rows), 128-byte swizzled.
    The caches are ones TMA can address (CacheLayout.tma_ok)."""
    rows = min(cfg.block_n, lay.page_size & -lay.page_size) if lay.page_size else cfg.block_n
    dtype = _checks.dtype_name(k_cache.dtype)
    maps = []
    for x in (k_cache, v_cache):
        n, s, h, d = x.shape
        maps.append(tma.encode_tiled(x.data.ptr, dtype, (d, h, s, n), tma_strides(x), (64, 1, rows, 1)))
    return launch.PackedTail(tuple(maps))


def tma_strides(x) -> Optional[tuple]:
    """A cache's byte strides as its tensor map takes them (heads, keys, rows), or None where TMA cannot address it
    (a broadcast dimension, strides not multiples of 16 bytes). A dimension of one element is never stepped over: its
    stride is taken as if the cache were packed there."""
    out, packed = [], x.shape[3] * x.itemsize
    for axis in (2, 1, 0):
        packed = -(-packed // 16) * 16
        out.append(x.strides[axis] if x.shape[axis] > 1 else packed)
        packed = out[-1] * x.shape[axis]
    return tuple(out) if tma.strides_ok(x.data.ptr, out) else None


def combine_into(outs, lses, out, lse, *, opts: Optional[options.Options] = None,
                 programmatic: bool = False) -> None:
    """Launches the merge of ``outs`` (num_splits, batch, seqlen, heads, head_dim) (float32 or out's dtype,
    contiguous) and ``lses`` (num_splits, batch, heads, seqlen) float32 into ``out`` (batch, seqlen, heads,
    head_dim) and ``lse`` (batch, heads, seqlen) or None; ``programmatic``: as a programmatic dependent of the
    kernel before it on the stream (launch.launch)."""
    opts = opts or options.current()
    s, b, n, h, d = outs.shape
    cfg = KernelConfig("combine", _checks.dtype_name(out.dtype), 0, False, 0, 0, NUM_WARPS)
    kern, smem = _kernel(cfg, out.data.device_id, opts)
    p = params.pack_bytes(params.COMBINE_PARAMS, (
        outs.data.ptr, lses.data.ptr, out.data.ptr, lse.data.ptr if lse is not None else 0, *_strides(out),
        s, b, n, h, d, int(outs.dtype == np.float32)))
    rows = b * n * h
    if rows:
        launch.launch(kern, cfg, (-(-rows // NUM_WARPS), 1, 1), p, smem, programmatic=programmatic)


def check_combine(outs, lses):
    """The checks of :func:`cuflash.combine`; returns ``(outs, lses)`` contiguous."""
    import cupy

    for name, x in (("outs", outs), ("lses", lses)):
        if not isinstance(x, cupy.ndarray):
            raise TypeError(f"{name} must be a cupy.ndarray, got {type(x).__name__}")
    if outs.ndim != 5:
        raise ValueError(f"outs must have 5 dimensions (num_splits, batch, seqlen, heads, head_dim), got shape "
                         f"{tuple(outs.shape)}")
    if outs.dtype not in (np.float32, np.float16, _checks.BFLOAT16):
        raise TypeError(f"outs must be float32, float16 or bfloat16, got {outs.dtype}")
    s, b, n, h, d = outs.shape
    if lses.dtype != np.float32:
        raise TypeError(f"lses must be float32, got {lses.dtype}")
    if tuple(lses.shape) != (s, b, h, n):
        raise ValueError(f"lses must have shape (num_splits, batch, heads, seqlen) = {(s, b, h, n)}, got "
                         f"{tuple(lses.shape)}")
    if d % 4:
        raise ValueError(f"outs' head_dim must be a multiple of 4, got {d}")
    if lses.data.device_id != outs.data.device_id:
        raise ValueError(f"lses is on device {lses.data.device_id}, outs on device {outs.data.device_id}")
    return cupy.ascontiguousarray(outs), cupy.ascontiguousarray(lses)
