"""cuflash's settings: one frozen ``Options`` object, read from the environment once.

Every setting that used to be an environment variable read somewhere in the package lives here. The
environment is read on first use (``current()``), not per call; tests and tools change settings with
``set`` / ``override`` (or change ``os.environ`` and call ``reload()``). Plans and recorded calls are
keyed on ``Options.token``, so a changed setting never reuses a plan made under another.

========================================  ==========================  ==========================================
Environment variable                      Field (type, default)       Meaning
========================================  ==========================  ==========================================
CUFLASH_FWD_BACKEND                       fwd_backend ("auto")        "auto": the Hopper kernels on cc 9.0 for
                                                                      fp16/bf16, the portable ones elsewhere;
                                                                      "sm80": the portable kernels; "sm90": the
                                                                      Hopper tuned table; "sm90_<kind>" one
                                                                      Hopper kernel kind forced (FWD_BACKENDS)
CUFLASH_BWD_BACKEND                       bwd_backend ("auto")        "auto" | "sm80" | "sm90", as above
CUFLASH_DECODE_BACKEND                    decode_backend ("auto")     forward_kvcache's kernel: "auto" | "sm80"
                                                                      (the cp.async ring, every GPU) | "sm90"
                                                                      (producer warps fill the ring, cc 9.0) |
                                                                      "sm90_tma" (TMA boxes, 16-bit caches)
CUFLASH_SM90_FWD_CLUSTER                  sm90_fwd_cluster ("auto")   the tuned table's cluster kernels: "auto"
                                                                      (both sequences >= 32k tokens), "1"
                                                                      (wherever they apply), "0" (never)
CUFLASH_SM90_FP8_PERSISTENT               sm90_fp8_persistent (None)  "1" / "0" force the fp8 forward's
                                                                      persistent kernel on / off
CUFLASH_SM90_BWD_SHORT                    sm90_bwd_short (None)       "1" / "0" force the Hopper backward's
                                                                      short-sequence tile on / off
CUFLASH_SM80_BWD_VARIANT                  sm80_bwd_variant (2)        1: the portable dK/dV kernel version 1
                                                                      where version 2 would apply
CUFLASH_SM80_FWD_TILES                    sm80_fwd_tiles (None)       "block_m,block_n,num_warps": a tile
CUFLASH_SIMT_FWD_TILES                    simt_fwd_tiles (None)       override for tuning runs, replacing the
CUFLASH_SM90_FWD_TILES                    sm90_fwd_tiles (None)       tuned table's tile of that kernel family
CUFLASH_SM90_FP8_TILES                    sm90_fp8_tiles (None)       (cuflash/heuristics.py)
CUFLASH_SM90_BWD_TILES                    sm90_bwd_tiles (None)
CUFLASH_SIMT_BWD_TILES                    simt_bwd_tiles (None)
CUFLASH_SM80_BWD_DKDV_TILES               sm80_bwd_dkdv_tiles (None)
CUFLASH_SM80_BWD_DQ_TILES                 sm80_bwd_dq_tiles (None)
CUFLASH_NVRTC_DEFINES                     nvrtc_defines (())          extra NVRTC options, space-separated (e.g.
                                                                      "-DCUFLASH_SM90_FWD_COUNT_FALLBACKS")
CUFLASH_LAUNCH                            launch ("packed")           "cupy": launch through CuPy's RawKernel
                                                                      call instead of the packed-argument path
CUFLASH_FA4_PATH                          fa4_path (())               where the benchmarks find FlashAttention-4
                                                                      (paths separated by os.pathsep)
CUFLASH_KERNEL_DIR                        kernel_dir (None)           compile the kernels from this copy of
                                                                      kernels_cu/ (dev/fault_injection.py's
                                                                      patched trees); part of the kernel cache
                                                                      key
CUFLASH_PLAN_CC                           plan_cc (None)              the compute capability (PLAN_CCS, e.g.
                                                                      80) whose tile tables and shared-memory
                                                                      limit the dispatcher plans for: 80 runs
                                                                      the A100's tables on an H100 within
                                                                      163 KB, 86 / 89 / 120 those of the 99 KB
                                                                      cards; the kernels are still built for
                                                                      the device. None: the device's own.
                                                                      Refused when a kernel is planned where
                                                                      the device cannot honour it: 90 on
                                                                      cc 9.0 only, values from 89 on cc >= 8.9
========================================  ==========================  ==========================================

An empty variable counts as unset. A value outside the allowed ones raises ValueError naming the variable.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Optional, Tuple

Tiles = Tuple[int, int, int]

# CUFLASH_FWD_BACKEND values: the portable kernels, the Hopper tuned table, or one Hopper kernel kind forced
# (heuristics.SM90_FWD_KINDS names them; a test checks the two lists agree).
FWD_BACKENDS = ("auto", "sm80", "sm90", "sm90_overlap", "sm90_simple_p", "sm90_overlap_p", "sm90_overlap_x2",
                "sm90_overlap_x2_p", "sm90_split")
BWD_BACKENDS = ("auto", "sm80", "sm90")
DECODE_BACKENDS = ("auto", "sm80", "sm90", "sm90_tma")
CLUSTER_MODES = ("auto", "0", "1")
SM80_BWD_VARIANTS = (1, 2)
LAUNCH_PATHS = ("packed", "cupy")
# CUFLASH_PLAN_CC values: the compute capabilities whose tables and opt-in shared memory the dispatcher knows
# (heuristics.SMEM_OPTIN has their limits; a test checks the two lists agree).
PLAN_CCS = (80, 86, 87, 89, 90, 100, 101, 103, 110, 120, 121)

# field -> environment variable
ENV = {
    "fwd_backend": "CUFLASH_FWD_BACKEND",
    "bwd_backend": "CUFLASH_BWD_BACKEND",
    "decode_backend": "CUFLASH_DECODE_BACKEND",
    "sm90_fwd_cluster": "CUFLASH_SM90_FWD_CLUSTER",
    "sm90_fp8_persistent": "CUFLASH_SM90_FP8_PERSISTENT",
    "sm90_bwd_short": "CUFLASH_SM90_BWD_SHORT",
    "sm80_bwd_variant": "CUFLASH_SM80_BWD_VARIANT",
    "sm80_fwd_tiles": "CUFLASH_SM80_FWD_TILES",
    "simt_fwd_tiles": "CUFLASH_SIMT_FWD_TILES",
    "sm90_fwd_tiles": "CUFLASH_SM90_FWD_TILES",
    "sm90_fp8_tiles": "CUFLASH_SM90_FP8_TILES",
    "sm90_bwd_tiles": "CUFLASH_SM90_BWD_TILES",
    "simt_bwd_tiles": "CUFLASH_SIMT_BWD_TILES",
    "sm80_bwd_dkdv_tiles": "CUFLASH_SM80_BWD_DKDV_TILES",
    "sm80_bwd_dq_tiles": "CUFLASH_SM80_BWD_DQ_TILES",
    "nvrtc_defines": "CUFLASH_NVRTC_DEFINES",
    "launch": "CUFLASH_LAUNCH",
    "fa4_path": "CUFLASH_FA4_PATH",
    "kernel_dir": "CUFLASH_KERNEL_DIR",
    "plan_cc": "CUFLASH_PLAN_CC",
}


def _name(field_name: str) -> str:
    return f"{ENV[field_name]} (Options.{field_name})"


def _check_choice(field_name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{_name(field_name)} must be one of {', '.join(map(repr, allowed))}; got {value!r}")


def _check_flag(field_name: str, value, optional: bool) -> None:
    if value is None and optional:
        return
    if not isinstance(value, bool):
        allowed = "True, False or None" if optional else "True or False"
        raise TypeError(f"{_name(field_name)} must be {allowed}; got {value!r}")


def _check_tiles(field_name: str, value) -> None:
    if value is None:
        return
    if (not isinstance(value, tuple) or len(value) != 3
            or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in value)):
        raise ValueError(f"{_name(field_name)} must be None or three positive ints (block_m, block_n, num_warps), "
                         f"in the environment \"block_m,block_n,num_warps\"; got {value!r}")


def _check_strings(field_name: str, value) -> None:
    if not isinstance(value, tuple) or not all(isinstance(x, str) for x in value):
        raise TypeError(f"{_name(field_name)} must be a tuple of strings; got {value!r}")


@dataclass(frozen=True)
class Options:
    """Every cuflash setting (the module docstring's table). Frozen: change settings with ``set`` /
    ``override``, which build a new object. ``token`` names the object among those published, for the
    plan and call caches' keys."""

    fwd_backend: str = "auto"
    bwd_backend: str = "auto"
    decode_backend: str = "auto"
    sm90_fwd_cluster: str = "auto"
    sm90_fp8_persistent: Optional[bool] = None
    sm90_bwd_short: Optional[bool] = None
    sm80_bwd_variant: int = 2
    sm80_fwd_tiles: Optional[Tiles] = None
    simt_fwd_tiles: Optional[Tiles] = None
    sm90_fwd_tiles: Optional[Tiles] = None
    sm90_fp8_tiles: Optional[Tiles] = None
    sm90_bwd_tiles: Optional[Tiles] = None
    simt_bwd_tiles: Optional[Tiles] = None
    sm80_bwd_dkdv_tiles: Optional[Tiles] = None
    sm80_bwd_dq_tiles: Optional[Tiles] = None
    nvrtc_defines: Tuple[str, ...] = ()
    launch: str = "packed"
    fa4_path: Tuple[str, ...] = ()
    kernel_dir: Optional[str] = None
    plan_cc: Optional[int] = None
    # Set when published (``_intern``): equal settings share one object and one token.
    token: int = field(default=0, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        _check_choice("fwd_backend", self.fwd_backend, FWD_BACKENDS)
        _check_choice("bwd_backend", self.bwd_backend, BWD_BACKENDS)
        _check_choice("decode_backend", self.decode_backend, DECODE_BACKENDS)
        _check_choice("sm90_fwd_cluster", self.sm90_fwd_cluster, CLUSTER_MODES)
        _check_flag("sm90_fp8_persistent", self.sm90_fp8_persistent, optional=True)
        _check_flag("sm90_bwd_short", self.sm90_bwd_short, optional=True)
        _check_choice("sm80_bwd_variant", self.sm80_bwd_variant, SM80_BWD_VARIANTS)
        for name in ("sm80_fwd_tiles", "simt_fwd_tiles", "sm90_fwd_tiles", "sm90_fp8_tiles", "sm90_bwd_tiles",
                     "simt_bwd_tiles", "sm80_bwd_dkdv_tiles", "sm80_bwd_dq_tiles"):
            _check_tiles(name, getattr(self, name))
        _check_strings("nvrtc_defines", self.nvrtc_defines)
        _check_choice("launch", self.launch, LAUNCH_PATHS)
        _check_strings("fa4_path", self.fa4_path)
        if self.kernel_dir is not None and not isinstance(self.kernel_dir, str):
            raise TypeError(f"{_name('kernel_dir')} must be None or a path (str); got {self.kernel_dir!r}")
        if self.plan_cc is not None and (type(self.plan_cc) is not int or self.plan_cc not in PLAN_CCS):
            raise ValueError(f"{_name('plan_cc')} must be None or a compute capability of "
                             f"{', '.join(map(str, PLAN_CCS))} (e.g. 80 for sm_80); got {self.plan_cc!r}")


def parse_tiles(field_name: str, text: str) -> Tiles:
    """A tile override as the environment writes it ("block_m,block_n,num_warps") for ``field_name``."""
    try:
        tiles = tuple(int(x) for x in text.strip().split(","))
    except ValueError:
        raise ValueError(f"{ENV[field_name]} must be \"block_m,block_n,num_warps\" (three ints); "
                         f"got {text!r}") from None
    _check_tiles(field_name, tiles)
    return tiles


def _parse(field_name: str, text: str):
    """One environment value (stripped, not empty) as the field's type."""
    var = ENV[field_name]
    if field_name.endswith("_tiles"):
        return parse_tiles(field_name, text)
    if field_name in ("sm90_fp8_persistent", "sm90_bwd_short"):
        if text not in ("0", "1"):
            raise ValueError(f"{var} must be 0 or 1; got {text!r}")
        return text == "1"
    if field_name == "sm80_bwd_variant":
        if text not in ("1", "2"):
            raise ValueError(f"{var} must be 1 or 2; got {text!r}")
        return int(text)
    if field_name == "nvrtc_defines":
        return tuple(text.split())
    if field_name == "fa4_path":
        return tuple(p for p in text.split(os.pathsep) if p)
    if field_name == "kernel_dir":
        return text   # a path: case kept
    if field_name == "plan_cc":
        try:
            return int(text)   # checked against PLAN_CCS by Options
        except ValueError:
            raise ValueError(f"{var} must be a compute capability as an int (e.g. 80 for sm_80); "
                             f"got {text!r}") from None
    return text.lower()


def from_environ(environ: Mapping[str, str] = os.environ) -> Options:
    """The settings that ``environ`` holds (defaults for what it leaves out or sets empty)."""
    values = {}
    for name, var in ENV.items():
        text = environ.get(var, "").strip()
        if text:
            values[name] = _parse(name, text)
    return Options(**values)


_lock = threading.Lock()
_interned: dict = {}        # Options -> the published object equal to it (keeps every token alive)
_current: Optional[Options] = None
_environ_seen: Optional[tuple] = None   # the variables' values when the environment was last read


def _intern(opts: Options) -> Options:
    """The published object equal to ``opts``, published now with a new token if there is none (the
    caller holds ``_lock``)."""
    found = _interned.get(opts)
    if found is None:
        object.__setattr__(opts, "token", len(_interned) + 1)
        found = _interned[opts] = opts
    return found


def _environ_values() -> tuple:
    return tuple(os.environ.get(var) for var in ENV.values())


def current() -> Options:
    """The settings in force (read from the environment on first use)."""
    opts = _current
    return opts if opts is not None else reload()


def reload() -> Options:
    """Reads the environment again and makes its settings the current ones; returns them."""
    global _current, _environ_seen
    with _lock:
        seen = _environ_values()
        opts = _intern(from_environ())
        _current, _environ_seen = opts, seen
    return opts


def refresh() -> Options:
    """``reload()`` if one of the variables changed since the environment was last read; else the current
    settings. Clearing a plan cache calls it (call_cache.Plans), so that a script which sets a variable and
    clears the plans, as tuning scripts did before Options, gets what it asked for."""
    if _current is None or _environ_values() != _environ_seen:
        return reload()
    return _current


def use(opts: Options) -> Options:
    """Makes ``opts`` the current settings; returns the published object (equal to ``opts``)."""
    global _current
    if not isinstance(opts, Options):
        raise TypeError(f"use() takes an Options, got {type(opts).__name__}")
    with _lock:
        if _current is None:
            _environ_seen_init()
        opts = _current = _intern(opts)
    return opts


def _environ_seen_init() -> None:
    """Notes the environment as read (``use`` / ``set`` before anything read it), so that ``refresh``
    does not undo them while the environment stays as it is."""
    global _environ_seen
    _environ_seen = _environ_values()


def set(**fields) -> Options:  # noqa: A001 - options.set reads as intended
    """Changes the named fields of the current settings (validated as the environment's values are);
    returns the new settings. E.g. ``options.set(fwd_backend="sm80", sm90_fwd_tiles=(128, 128, 12))``."""
    unknown = [k for k in fields if k not in ENV]
    if unknown:
        raise TypeError(f"unknown cuflash option(s) {unknown}; the options are {list(ENV)}")
    base = current()
    return use(dataclasses.replace(base, **fields))


@contextlib.contextmanager
def override(**fields) -> Iterator[Options]:
    """``with options.override(fwd_backend="sm80"):`` these settings inside, the previous ones after.

    The settings are process-wide (one module-level reference, swapped whole): other threads see the
    override too, and nested overrides must end in the reverse order of their start."""
    previous = current()
    try:
        yield set(**fields)
    finally:
        use(previous)
