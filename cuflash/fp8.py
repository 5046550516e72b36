"""Host side of the fp8 (e4m3) forward on Hopper: checks, per-tensor quantisation, V^T, launch.

fp8 arrays are CuPy ``uint8`` arrays holding e4m3fn bit patterns (CuPy has no float8 dtype;
``x8.get().view(ml_dtypes.float8_e4m3fn)`` reads them on the host). A tensor ``x`` is
represented as ``x8 * descale`` with ``descale`` a float32 scalar on the device.
"""
from __future__ import annotations

import threading

import numpy as np

from . import _checks, call_cache, capture, heuristics, launch, options, params, tile_counters, tma, variants
from .config import KernelConfig
from .dispatch import device_info, get_kernel, smem_bytes

FP8_HEAD_DIMS = range(16, heuristics.MAX_HEAD_DIM + 1, 16)
_UINT8 = np.dtype(np.uint8)
try:
    import ml_dtypes

    _E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
except (ImportError, AttributeError):  # pragma: no cover - ml_dtypes is a dependency
    _E4M3 = None
FP8_DTYPES = tuple(d for d in (_UINT8, _E4M3) if d is not None)
_QUANTIZE_INPUTS = {np.dtype(np.float16): "float16", np.dtype(np.float32): "float32"}
if _checks.BFLOAT16 is not None:
    _QUANTIZE_INPUTS[_checks.BFLOAT16] = "bfloat16"
_AUX_WARPS = 8


def v_rows(head_dim: int) -> int:
    """Rows of the kernel's V^T tile: the head dim rounded up to a tuned head dim (kernels_cu/sm90/fwd_tile.cuh fp8_v_rows)."""
    return heuristics.head_dim_bucket(head_dim)


def check_fp8_array(name: str, x) -> None:
    cupy = _checks._cupy()
    if not isinstance(x, cupy.ndarray):
        raise TypeError(f"{name} must be a cupy.ndarray of e4m3 bytes (uint8), got "
                        f"{type(x).__module__}.{type(x).__name__}; make one with cuflash.quantize_fp8")
    if x.dtype not in FP8_DTYPES:
        raise TypeError(f"{name} must hold fp8 e4m3 bytes (dtype uint8, as cuflash.quantize_fp8 returns), "
                        f"got {x.dtype}")
    if x.ndim != 4:
        raise ValueError(f"{name} must have 4 dimensions (batch, seqlen, heads, head_dim), got shape {tuple(x.shape)}")
    _checks.check_strides_nonnegative(name, x)
    if x.size and x.shape[-1] > 1 and x.strides[-1] != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {x.strides}")


def check_fp8_qkv(q, k, v):
    """Validate fp8 q (B, Nq, Hq, D), k/v (B, Nk, Hkv, D). Returns (B, Nq, Nk, Hq, Hkv, D)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_fp8_array(name, x)
    for name, x in (("k", k), ("v", v)):
        if x.device.id != q.device.id:
            raise ValueError(f"{name} is on device {x.device.id} but q is on device {q.device.id}")
    b, nq, nk, hq, hkv, d = _checks.check_qkv_shapes(q, k, v)
    if d not in FP8_HEAD_DIMS:
        raise ValueError(f"fp8 head_dim must be a multiple of 16 from 16 to 256, got {d}")
    for name, x in (("q", q), ("k", k)):  # loaded by TMA (v goes through transpose_v)
        if x.size and not tma.bshd_ok(x):
            raise ValueError(f"{name} must start on a 16-byte boundary with strides that are multiples of 16 "
                             f"bytes (got strides {x.strides}); pass a contiguous copy")
    return b, nq, nk, hq, hkv, d


def check_descale(name: str, x, device_id: int) -> None:
    """A descale is a positive finite float, normal and finite as float32, or a float32 CuPy array of
    one element on ``device_id`` (reads metadata only: no device access, so an array's value, NaN,
    negative or 0, is not checked)."""
    cupy = _checks._cupy()
    if isinstance(x, cupy.ndarray):
        if x.dtype != np.float32 or x.size != 1:
            raise TypeError(f"{name} must be a float32 cupy array of one element or a float, got "
                            f"{x.dtype} of shape {tuple(x.shape)}")
        if x.device.id != device_id:
            raise ValueError(f"{name} is on device {x.device.id} but q is on device {device_id}")
        return
    if isinstance(x, bool) or not isinstance(x, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name} must be a positive float or a float32 cupy array of one element, "
                        f"got {type(x).__name__}")
    if not (np.isfinite(float(x)) and float(x) > 0):
        raise ValueError(f"{name} must be positive and finite, got {x}")
    _check_float32_descale(name, x)


# The kernels read a descale as float32 and are compiled with -ftz=true: a subnormal float32 is 0 there.
_DESCALE_MIN = float(np.finfo(np.float32).tiny)


def _check_float32_descale(name: str, x) -> None:
    """A float descale that becomes 0 (or subnormal, which -ftz flushes to 0) or inf as float32 is refused."""
    with np.errstate(over="ignore", under="ignore"):
        f32 = np.float32(float(x))
    if not np.isfinite(f32):
        raise ValueError(f"{name} = {x} overflows float32 (max {float(np.finfo(np.float32).max):.4g}): the kernels "
                         f"read descales as float32")
    if float(f32) < _DESCALE_MIN:
        raise ValueError(f"{name} = {x} is below float32's smallest normal value ({_DESCALE_MIN:.4g}): the kernels "
                         f"read descales as float32 and flush subnormals to 0")


def descale_array(name: str, x, device_id: int):
    """A descale as a float32 device scalar: a positive finite float, or a float32 CuPy array of one
    element on the device (as returned by quantize_fp8; read by the kernel, no host sync)."""
    cupy = _checks._cupy()
    check_descale(name, x, device_id)
    if isinstance(x, cupy.ndarray):
        if x.flags.c_contiguous:
            return x
        x = cupy.ascontiguousarray(x)
        capture.keep_if_capturing(x)
        return x
    value = float(x)
    # One device scalar per (value, device), reused: no allocation and fill per call for a fixed scale.
    # Kernels on any stream read it, so it is filled on the setup stream and waited for before anyone
    # can find it, and it is never freed (a kernel may still read it). Past the cap, a scalar per call,
    # filled on the caller's stream, which orders its reuse after the kernel.
    key = (value, device_id)
    found = _float_descales.get(key)
    if found is None:
        with cupy.cuda.Device(device_id):
            if len(_float_descales) >= _FLOAT_DESCALES_MAX:
                found = cupy.full((1,), value, dtype=np.float32)
                capture.keep_if_capturing(found)
                return found
            stream = capture.setup_stream(device_id)
            with stream:
                made = cupy.full((1,), value, dtype=np.float32)
            stream.synchronize()
        with _float_descales_lock:
            found = _float_descales.setdefault(key, made)
    return found


_float_descales: dict = {}
_float_descales_lock = threading.Lock()
_FLOAT_DESCALES_MAX = 256


def _aux_config(family: str, dtype: str) -> KernelConfig:
    return KernelConfig(family, dtype, 0, False, 0, 0, _AUX_WARPS)


def aux_configs() -> list[KernelConfig]:
    """Every instantiation of the fp8 helpers (V^T pass; amax and quantisation per input dtype)."""
    return [_aux_config("fp8_transpose_v", "float8_e4m3fn")] + [
        _aux_config(f, dt) for f in ("fp8_amax", "fp8_quantize") for dt in _QUANTIZE_INPUTS.values()]


_aux_kernels: dict = {}


def _aux_kernel(family: str, dtype: str, device_id: int):
    """(kernel, config) of an fp8 helper, looked up once per (family, dtype, device, NVRTC defines)."""
    defines = options.current().nvrtc_defines
    key = (family, dtype, device_id, defines)
    found = _aux_kernels.get(key)
    if found is None:
        cfg = _aux_config(family, dtype)
        found = _aux_kernels[key] = (get_kernel(cfg, device_id, defines), cfg)
    return found


def quantize(x):
    """(x8, descale): e4m3 bytes of ``x / descale`` (round to nearest even, saturated) with
    descale = max|x| / 448 as a float32 device array of shape (1,) (1 when x is all zeros)."""
    cupy = _checks._cupy()
    if not isinstance(x, cupy.ndarray):
        raise TypeError(f"x must be a cupy.ndarray, got {type(x).__module__}.{type(x).__name__}")
    if x.dtype not in _QUANTIZE_INPUTS:
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    dtype = _QUANTIZE_INPUTS[x.dtype]
    dev = x.device.id
    with cupy.cuda.Device(dev):
        contiguous = cupy.ascontiguousarray(x)
        x8 = cupy.empty(x.shape, dtype=np.uint8)
        descale = cupy.empty((1,), dtype=np.float32)
        amax = cupy.zeros((1,), dtype=np.uint32)
        # Temporaries a captured graph reads and writes on every replay.
        capture.keep_if_capturing(amax, contiguous if contiguous is not x else None)
        x = contiguous
        n = x.size
        threads = 32 * _AUX_WARPS
        blocks = max(1, min(-(-n // (4 * threads)), 4 * launch.sm_count()))
        kern, cfg = _aux_kernel("fp8_amax", dtype, dev)
        kern((blocks,), (threads,), (x, np.int64(n), amax))
        kern, cfg = _aux_kernel("fp8_quantize", dtype, dev)
        kern((blocks,), (threads,), (x, np.int64(n), amax, x8, descale))
    return x8, descale


def transpose_v(v, seqlen_k_pad: int):
    """V (B, Nk, Hkv, D) e4m3 bytes -> V^T (B, Hkv, D, seqlen_k_pad), keys of every 32-key step in
    the order of the kernel's P fragment (aux/fp8.cu), keys >= Nk zero."""
    cupy = _checks._cupy()
    b, nk, hkv, d = v.shape
    copied = None
    if v.data.ptr % 16 or any(s % 16 for s in v.strides[:3]):   # the kernel reads 16-byte chunks
        v = copied = cupy.ascontiguousarray(v)
    vt = cupy.empty((b, hkv, d, seqlen_k_pad), dtype=np.uint8)
    capture.keep_if_capturing(vt, copied)   # temporaries a captured graph reads on every replay
    kern, cfg = _aux_kernel("fp8_transpose_v", "float8_e4m3fn", v.device.id)
    kern((-(-seqlen_k_pad // 128), hkv, b), (cfg.threads,),
         (v.view(np.uint8), vt, np.int64(v.strides[0]), np.int64(v.strides[1]), np.int64(v.strides[2]),
          np.int32(nk), np.int32(seqlen_k_pad), np.int32(hkv), np.int32(d)))
    return vt


# (head dim, causal, device, short, options token) -> (kernel, config, shared memory bytes)
_plans = call_cache.Plans()


def _plan(head_dim: int, causal: bool, device_id: int, short: bool = False,
          variant: variants.MaskVariant = variants.PLAIN):
    opts = options.current()
    key = (head_dim, causal, device_id, short, opts.token, variant)
    plan = _plans.get(key)
    if plan is None:
        cc, _ = device_info(device_id, opts)
        if cc != 90:
            raise RuntimeError(f"the fp8 forward needs a Hopper GPU (compute capability 9.0), this one is "
                               f"{cc / 10:.1f}")
        cfg = heuristics.fp8_fwd_config(head_dim, causal, short, opts, variant)
        plan = _plans[key] = (get_kernel(cfg, device_id, opts.nvrtc_defines), cfg,
                              smem_bytes(cfg, device_id, opts.nvrtc_defines))
    return plan


def launch_forward(q, k, v, out, lse, descales, *, causal: bool, scale: float, dims, device_id: int,
                   var: variants.Variants = variants.NONE) -> None:
    """Transposes V and launches the fp8 forward kernel (arguments already checked)."""
    b, nq, nk, hq, hkv, d = dims
    short = heuristics.fwd_short(nq, nk)
    kern, cfg, smem = _plan(d, causal, device_id, short, var.kernel)
    nk_pad = -(-nk // 32) * 32
    vt = transpose_v(v, nk_pad)
    rows = v_rows(d)
    # Q and K rows: 128-byte swizzled blocks, or one 64-byte swizzled block at head dims <= 64
    cols, swizzle = (64, tma.SWIZZLE_64B) if d <= 64 else (128, tma.SWIZZLE_128B)
    maps = launch.PackedTail((
        tma.bshd_map(q, "float8_e4m3fn", cfg.block_m, cols, swizzle),
        tma.bshd_map(k, "float8_e4m3fn", cfg.block_n, cols, swizzle),
        tma.encode_tiled(vt.data.ptr, "float8_e4m3fn", (nk_pad, d, hkv, b),
                         (nk_pad, d * nk_pad, hkv * d * nk_pad), (128, rows, 1, 1), tma.SWIZZLE_128B)))
    extra = (maps, tile_counters.for_device(device_id)) if cfg.fam.persistent else (maps,)
    p = params.pack_bytes(params.FWD_PARAMS, (
        q.data.ptr, k.data.ptr, vt.data.ptr, out.data.ptr, lse.data.ptr if lse is not None else 0,
        *params.element_strides(q), *params.element_strides(k), 0, 0, 0,
        *params.element_strides(out),
        b, nq, nk, hq, hq // hkv, d, scale, scale * 1.4426950408889634,
        *var.param_values(nq, nk, scale), *params.DENSE_VARLEN_VALUES))
    launch.launch(kern, cfg, launch.fwd_grid(cfg, b, hq, nq), p, smem, extra + tuple(descales))
