"""Picks, compiles (once) and launches kernels.

Modules are built through ``cupy.RawModule`` with name expressions, so CuPy's
on-disk kernel cache (keyed by source text, options, arch and NVRTC version)
holds the cubins between processes; this module keeps the loaded kernels in
memory per (config, device).
"""
from __future__ import annotations

import threading
from typing import Callable, Iterable

import cupy

from . import options
from .compile import compile_options, load_source
from .config import KernelConfig

# Compiles hold the lock of their key only, so that threads asking for different kernels on a cold start
# compile them side by side (NVRTC runs without the GIL) and threads asking for the same one wait for it.
_lock = threading.Lock()          # guards _key_locks and the reads of _modules
_key_locks: dict[tuple, threading.Lock] = {}
_kernels: dict[tuple[str, int], "cupy.RawKernel"] = {}
_modules: dict[tuple, "cupy.RawModule"] = {}   # same keys: diagnostic builds read module globals
_device_info: dict[int, tuple[int, int]] = {}


def device_info(device_id: int) -> tuple[int, int]:
    """(compute capability as int, e.g. 90; opt-in shared memory per block in bytes)."""
    info = _device_info.get(device_id)
    if info is None:
        dev = cupy.cuda.Device(device_id)
        cc = int(dev.compute_capability)
        smem = dev.attributes.get("MaxSharedMemoryPerBlockOptin", 48 * 1024)
        info = _device_info[device_id] = (cc, smem)
    return info


def smem_bytes(config: KernelConfig) -> int:
    """Dynamic shared memory of one CTA."""
    from .launch import SMEM_BYTES  # family -> function(config)

    return SMEM_BYTES[config.family](config)


def get_kernel(config: KernelConfig, device_id: int, defines: tuple[str, ...] | None = None) -> "cupy.RawKernel":
    """The compiled kernel for ``config`` on ``device_id``, compiled on first use. ``defines``: extra
    NVRTC options (default: Options.nvrtc_defines, a tuning knob such as "-DBWD_KK_UNROLL=1"), part of
    the cache key."""
    extra = options.current().nvrtc_defines if defines is None else tuple(defines)
    key = (config.key(), device_id, extra)
    kern = _kernels.get(key)
    if kern is not None:
        return kern
    with _lock:
        key_lock = _key_locks.setdefault(key, threading.Lock())
    with key_lock:
        kern = _kernels.get(key)
        if kern is not None:
            return kern
        return _compile(config, device_id, key, extra)


def _compile(config: KernelConfig, device_id: int, key: tuple, extra: tuple) -> "cupy.RawKernel":
    """Compiles (or loads from CuPy's cache) and publishes one kernel; the caller holds its key's lock."""
    cc, smem_limit = device_info(device_id)
    fam = config.fam
    if cc < fam.min_cc:
        raise RuntimeError(f"cuflash kernel family {fam.name} needs compute capability "
                           f">= {fam.min_cc / 10:.1f}; this device has {cc / 10:.1f}")
    smem = smem_bytes(config)
    if smem > smem_limit:
        raise RuntimeError(f"{config.key()} needs {smem} bytes of shared memory; "
                           f"the device allows {smem_limit}")
    # CuPy appends -arch=sm_<cc> itself; name the arch only where the family
    # needs the arch-specific target (sm_90a: wgmma, setmaxnreg).
    options = compile_options(config, f"{cc}a" if fam.arch_specific else str(cc))
    if not fam.arch_specific:
        options = tuple(o for o in options if not o.startswith("-arch="))
    options += extra
    with cupy.cuda.Device(device_id):
        module = cupy.RawModule(code=load_source(config.source), options=options,
                                name_expressions=[config.name_expression()])
        kern = module.get_function(config.name_expression())
        if smem > 48 * 1024:
            kern.max_dynamic_shared_size_bytes = smem
    with _lock:
        _modules[key] = module
    _kernels[key] = kern   # last: a thread that finds it finds it ready
    return kern


def loaded_modules(define: str) -> list["cupy.RawModule"]:
    """The modules loaded so far whose NVRTC defines (Options.nvrtc_defines) included ``define`` (diagnostic builds,
    e.g. the forward's fallback counters read by the tests)."""
    with _lock:   # a compile on another thread may add one meanwhile
        return [m for key, m in _modules.items() if define in key[2]]


def precompile(configs: Iterable[KernelConfig], device_id: int,
               progress: Callable[[int, int, KernelConfig], None] | None = None) -> None:
    """Compile (or load from CuPy's cache) every config, calling ``progress(i, n, config)``."""
    configs = list(configs)
    for i, cfg in enumerate(configs):
        if progress:
            progress(i, len(configs), cfg)
        get_kernel(cfg, device_id)
    if progress:
        progress(len(configs), len(configs), None)
