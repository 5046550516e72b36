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

from . import heuristics, options
from .compile import compile_options, config_source, missing_smem_variable, smem_bytes_offline, target
from .config import KernelConfig

# Compiles hold the lock of their key only, so that threads asking for different kernels on a cold start
# compile them side by side (NVRTC runs without the GIL) and threads asking for the same one wait for it.
_lock = threading.Lock()          # guards _key_locks and the reads of _modules
_key_locks: dict[tuple, threading.Lock] = {}
_kernels: dict[tuple[str, int], "cupy.RawKernel"] = {}
_modules: dict[tuple, "cupy.RawModule"] = {}   # same keys: diagnostic builds read module globals
_smem: dict[tuple, int] = {}   # same keys: the kernel's dynamic shared memory, read from its module
_device_info: dict[int, tuple[int, int]] = {}   # real_device_info's: the devices' own, never a planned cc


def real_device_info(device_id: int) -> tuple[int, int]:
    """The device's own (compute capability as int, e.g. 90; opt-in shared memory per block in bytes): what its
    kernels are compiled for and may use. Planning reads device_info, which Options.plan_cc may change."""
    info = _device_info.get(device_id)
    if info is None:
        dev = cupy.cuda.Device(device_id)
        cc = int(dev.compute_capability)
        smem = dev.attributes.get("MaxSharedMemoryPerBlockOptin", 48 * 1024)
        info = _device_info[device_id] = (cc, smem)
    return info


def device_info(device_id: int, opts: options.Options | None = None) -> tuple[int, int]:
    """(compute capability, opt-in shared memory per block in bytes) that the dispatcher plans for on ``device_id``:
    the device's own (real_device_info), or as Options.plan_cc of ``opts`` (default: options.current()) says
    (planned_device; ValueError where the device cannot honour it). Plan time only: a plan is keyed on the options
    it was made under, so that one planned for another compute capability is never reused."""
    return planned_device(real_device_info(device_id), (opts or options.current()).plan_cc, device_id)


def plan_ccs(cc: int) -> tuple[int, ...]:
    """The Options.plan_cc values that a device of compute capability ``cc`` can honour: 90 on cc 9.0 alone (the
    Hopper kernels are built for sm_90a), values from 89 up on cc >= 8.9 only (their tables take kernels with the
    fp8 conversions, e.g. the fp8 KV-cache decode), the others anywhere."""
    return tuple(p for p in options.PLAN_CCS if (p != 90 or cc == 90) and (p < 89 or cc >= 89))


def planned_device(real: tuple[int, int], plan_cc: int | None, device_id: int = 0) -> tuple[int, int]:
    """(compute capability, shared-memory limit) to plan for on a device whose own are ``real``: ``real`` where
    ``plan_cc`` is None, else ``plan_cc`` within the lesser of the device's limit and that compute capability's
    (heuristics.SMEM_OPTIN). ValueError where the device cannot honour ``plan_cc`` (plan_ccs)."""
    if plan_cc is None:
        return real
    cc, smem = real
    allowed = plan_ccs(cc)
    if plan_cc not in allowed:
        why = ("90 plans the Hopper kernels, built for sm_90a: a compute capability 9.0 device only" if plan_cc == 90
               else "the tables from 8.9 up take kernels with the fp8 conversions, which need such a device")
        raise ValueError(f"{options.ENV['plan_cc']} (Options.plan_cc) = {plan_cc} cannot be honoured on device "
                         f"{device_id} (compute capability {cc // 10}.{cc % 10}): {why}; there it may be one of "
                         f"{', '.join(map(str, allowed))}, or unset")
    return plan_cc, min(smem, heuristics.SMEM_OPTIN[plan_cc])


def smem_bytes(config: KernelConfig, device_id: int | None = None, defines: tuple[str, ...] | None = None) -> int:
    """Dynamic shared memory of one CTA, as the kernel's source computes it (``<kernel>_smem_bytes``, Family.
    dynamic_smem): read from the module where the kernel is compiled for ``device_id`` with ``defines``
    (default: Options.nvrtc_defines), else from the source without a GPU (compile.smem_bytes_offline, ~0.1 s
    once per config; for device_id None, built for the family's own target: sm_80, or sm_90a). Plan time
    only: nothing on the per-call path calls this."""
    if not config.fam.dynamic_smem:
        return 0
    extra = options.current().nvrtc_defines if defines is None else tuple(defines)
    if device_id is None:
        return smem_bytes_offline(config, target(config, max(config.fam.min_cc, 80)), extra)
    found = _smem.get((config.key(), device_id, extra, options.current().kernel_dir))
    if found is not None:
        return found
    return smem_bytes_offline(config, target(config, real_device_info(device_id)[0]), extra)


def fit_to_device(config: KernelConfig, device_id: int, opts: options.Options | None = None) -> KernelConfig:
    """``config`` as the dispatcher runs a forward's on ``device_id``: a portable tile narrowed until its shared
    memory fits the planned limit (device_info, heuristics.fit_shared_memory; the tables are tuned for the H100's
    227 KB); the Hopper kernels' tiles as they are (sized for the H100)."""
    if config.fam.arch_specific:
        return config
    opts = opts or options.current()
    return heuristics.fit_shared_memory(config, device_info(device_id, opts)[1],
                                        lambda c: smem_bytes(c, device_id, opts.nvrtc_defines))


def _module_int(module: "cupy.RawModule", expr: str, device_id: int) -> int:
    """The int32 that the variable of name expression ``expr`` holds in a loaded module: a 4-byte copy on the
    setup stream (capture.setup_stream), so that nothing lands in a graph being captured."""
    import numpy as np
    from cupy.cuda import runtime

    from .capture import setup_stream

    lowered = module.module.mapping[expr]
    ptr = module.get_global(lowered)
    host = np.zeros(1, np.int32)
    stream = setup_stream(device_id)
    runtime.memcpyAsync(host.ctypes.data, ptr.ptr, 4, runtime.memcpyDeviceToHost, stream.ptr)
    stream.synchronize()
    return int(host[0])


def get_kernel(config: KernelConfig, device_id: int, defines: tuple[str, ...] | None = None) -> "cupy.RawKernel":
    """The compiled kernel for ``config`` on ``device_id``, compiled on first use. ``defines``: extra
    NVRTC options (default: Options.nvrtc_defines, e.g. a diagnostic build's
    "-DCUFLASH_SM90_FWD_COUNT_FALLBACKS"), part of the cache key, as is the source tree (Options.kernel_dir)."""
    opts = options.current()
    extra = opts.nvrtc_defines if defines is None else tuple(defines)
    key = (config.key(), device_id, extra, opts.kernel_dir)
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
    """Compiles (or loads from CuPy's cache) and publishes one kernel; the caller holds its key's lock. The
    module holds the kernel and its shared-memory size (``config.smem_expression()``), read once here."""
    cc, smem_limit = real_device_info(device_id)   # the device's own: the kernel runs there whatever was planned
    fam = config.fam
    if cc < fam.min_cc:
        raise RuntimeError(f"cuflash kernel family {fam.name} needs compute capability "
                           f">= {fam.min_cc / 10:.1f}; this device has {cc / 10:.1f}")
    # CuPy appends -arch=sm_<cc> itself; name the arch only where the family
    # needs the arch-specific target (sm_90a: wgmma, setmaxnreg).
    options = compile_options(config, target(config, cc))
    if not fam.arch_specific:
        options = tuple(o for o in options if not o.startswith("-arch="))
    options += extra
    smem_expr = config.smem_expression()
    names = [config.name_expression()] + ([smem_expr] if smem_expr else [])
    with cupy.cuda.Device(device_id):
        module = cupy.RawModule(code=config_source(config), options=options, name_expressions=names)
        try:
            kern = module.get_function(config.name_expression())
        except cupy.cuda.compiler.CompileException as e:
            message = smem_expr and missing_smem_variable(config, str(e))
            if message:
                raise RuntimeError(message) from e
            raise
        smem = _module_int(module, smem_expr, device_id) if smem_expr else 0
        if smem > smem_limit:
            raise RuntimeError(f"{config.key()} needs {smem} bytes of shared memory; "
                               f"the device allows {smem_limit}")
        if smem > 48 * 1024:
            kern.max_dynamic_shared_size_bytes = smem
    with _lock:
        _modules[key] = module
    _smem[key] = smem
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
