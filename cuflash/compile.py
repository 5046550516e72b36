"""Kernel sources, compiler options and the compiled-module cache.

Sources live in ``kernels_cu/`` (shipped inside the wheel as
``cuflash/kernels_cu``). Local ``#include "..."`` lines are inlined here, each
file prefixed with ``#line 1 "<path>"``, so that (a) compiler errors point at
the real file and (b) CuPy's on-disk kernel cache, keyed by the source text,
sees every header's content.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path

from . import options
from .config import KernelConfig

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


def kernel_dir() -> Path:
    """Directory holding the ``.cu`` / ``.cuh`` sources: Options.kernel_dir ($CUFLASH_KERNEL_DIR) where set,
    else the package's own (``package_kernel_dir``)."""
    given = options.current().kernel_dir
    if given is None:
        return package_kernel_dir()
    path = Path(given).resolve()
    if not (path / "common" / "numeric.cuh").is_file():
        raise FileNotFoundError(f"CUFLASH_KERNEL_DIR (Options.kernel_dir) = {given!r} is not a copy of kernels_cu/ "
                                f"(no common/numeric.cuh there)")
    return path


@functools.lru_cache(maxsize=None)
def package_kernel_dir() -> Path:
    """The package's own ``.cu`` / ``.cuh`` sources.

    An installed wheel carries them as the package ``cuflash.kernels_cu``; a
    source checkout (or an editable install) has them beside the package.
    """
    here = Path(__file__).resolve().parent
    for cand in (here / "kernels_cu", here.parent / "kernels_cu"):
        if (cand / "common" / "numeric.cuh").is_file():
            return cand
    try:  # an editable install may map the package elsewhere
        import importlib.resources as resources

        cand = Path(str(resources.files("cuflash.kernels_cu")))
        if (cand / "common" / "numeric.cuh").is_file():
            return cand
    except (ImportError, ModuleNotFoundError, TypeError):
        pass
    raise FileNotFoundError(
        "cuflash could not find its CUDA sources (kernels_cu/); the installation is incomplete")


def _inline(path: Path, seen: set[Path]) -> str:
    path = path.resolve()
    if path in seen:  # every header is #pragma once
        return ""
    seen.add(path)
    text = path.read_text()
    out = [f'#line 1 "{path}"']
    for lineno, line in enumerate(text.splitlines(), start=1):
        m = _INCLUDE_RE.match(line)
        if m:
            out.append(_inline(path.parent / m.group(1), seen))
            out.append(f'#line {lineno + 1} "{path}"')
        elif line.strip() == "#pragma once":
            out.append("")
        else:
            out.append(line)
    return "\n".join(out)


def load_source(relpath: str) -> str:
    """The source of ``kernels_cu/<relpath>`` (in ``kernel_dir()``) with its local includes inlined."""
    return _load_source(kernel_dir(), relpath)


@functools.lru_cache(maxsize=None)
def _load_source(root: Path, relpath: str) -> str:
    return _inline(root / relpath, set()) + "\n"


load_source.cache_clear = _load_source.cache_clear   # what tools that swap kernel_dir() call


def config_source(config: KernelConfig) -> str:
    """The source a config is compiled from: its kernel file with its includes inlined, and for a variant with
    user modifiers (MaskVariant.mods) their generated struct after it (the kernel templates name it only as a
    template argument, resolved where the name expression instantiates them, at the end)."""
    src = load_source(config.source)
    if config.variant.mods:
        from .modifiers import source_of

        src += "\n" + source_of(config.variant.mods)
    return src


def arch_option(cc: str) -> str:
    """NVRTC ``-arch`` for compute capability ``cc`` (e.g. "90" -> "sm_90a" for Hopper kernels)."""
    return f"-arch=sm_{cc}"


def target(config: KernelConfig, cc: int) -> str:
    """The compute capability that ``config`` is built for on a device of ``cc`` (e.g. 90): "90a" for the
    families that need the arch-specific target (wgmma, setmaxnreg), else "90"."""
    return f"{cc}a" if config.fam.arch_specific else str(cc)


def compile_options(config: KernelConfig, cc: str) -> tuple[str, ...]:
    """NVRTC options for one kernel family on compute capability ``cc`` ("80", "90a", ...). The kernel,
    its template arguments included, is chosen by its name expression, so no define names it."""
    return (arch_option(cc), "-std=c++17")


def compile_offline(config: KernelConfig, cc: str, *, verbose_ptxas: bool = True,
                    ptx: bool = False) -> tuple[bytes, str]:
    """Compile one instantiation with NVRTC, without a GPU: returns (cubin or PTX, log).

    Used by the CPU tests (every instantiation must build for sm_80 and sm_90a
    without register spills) and, disassembled, to read SASS (tests/sass_tools.py). Options
    match what the dispatcher passes, plus the ``-ftz=true`` that CuPy adds.
    """
    out, log, _ = _compile_program([config], cc, verbose_ptxas, ptx)
    return out, log


def compile_offline_many(configs, cc: str) -> tuple[bytes, str, dict[KernelConfig, str]]:
    """Compile instantiations of one kernel source in one NVRTC program for sm_<cc>, as compile_offline does each:
    returns (cubin, ptxas's -v log, {config: its kernel's lowered name}); the log's report and the SASS of each
    kernel go by that name. One program shares the source's parsing and leaves one cubin to disassemble."""
    return _compile_program(list(configs), cc, True, False)


def _compile_program(configs: list, cc: str, verbose_ptxas: bool, ptx: bool) -> tuple[bytes, str, dict]:
    from cupy.cuda import nvrtc

    sources = {(c.source, c.variant.mods) for c in configs}
    if len(sources) != 1:
        raise ValueError(f"one NVRTC program compiles one kernel source (and one set of user modifiers); got "
                         f"{sorted(sources)}")
    config = configs[0]
    src = config_source(config)
    # Options.nvrtc_defines as in dispatch.get_kernel, so that a tuning variant's SASS can be read too
    opts = list(compile_options(config, cc)) + ["-ftz=true"] + list(options.current().nvrtc_defines)
    if ptx:
        opts[0] = f"-arch=compute_{cc}"
    elif verbose_ptxas:
        opts.append("--ptxas-options=-v")
    exprs = list(dict.fromkeys(c.name_expression() for c in configs))
    prog = nvrtc.createProgram(src, config.source, [], [])
    try:
        for e in exprs:
            nvrtc.addNameExpression(prog, e)
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC failed for {', '.join(exprs)} on sm_{cc}:\n"
                               f"{nvrtc.getProgramLog(prog)}") from e
        log = nvrtc.getProgramLog(prog)
        lowered = {c: nvrtc.getLoweredName(prog, c.name_expression()) for c in configs}
        return (nvrtc.getPTX(prog) if ptx else nvrtc.getCUBIN(prog)), log, lowered
    finally:
        nvrtc.destroyProgram(prog)


# A compiled module holds `.global .align 4 .u32 <lowered name> = <value>;` for each variable it was asked for.
_PTX_INT_RE = r"\s*=\s*(-?\d+)\s*;"


def missing_smem_variable(config: KernelConfig, log: str) -> str | None:
    """The message for a compile whose ``log`` says that the kernel source lacks the variable of
    ``config.smem_expression()``, else None."""
    name = f"{config.fam.kernel}_smem_bytes"
    if not re.search(rf'identifier "{name}" is undefined', log):
        return None
    return (f"kernels_cu/{config.source} defines no `{name}`: a kernel family with dynamic shared memory "
            f"(Family.dynamic_smem) exports its size as `__device__ const int {name}<the kernel's template "
            f"parameters>`, which the dispatcher reads from the compiled module")


def smem_bytes_offline_many(configs, cc: str, defines: tuple[str, ...] = ()) -> dict[KernelConfig, int]:
    """Dynamic shared memory of each config, as its kernel source computes it (``<kernel>_smem_bytes``), without
    a GPU: the variables alone are compiled to PTX (one NVRTC program per source; each takes ~0.1 s) for
    compute capability ``cc`` ("80", "90a", ...) with the NVRTC ``defines`` (Options.nvrtc_defines) of the
    build. Configs whose family has none (Family.dynamic_smem) get 0."""
    from cupy.cuda import nvrtc

    out: dict[KernelConfig, int] = {}
    groups: dict[tuple, list[KernelConfig]] = {}   # one program per source and options (as the dispatcher's)
    for c in configs:
        if c.smem_expression() is None:
            out[c] = 0
        else:
            groups.setdefault((c.source, c.variant.mods, compile_options(c, cc)), []).append(c)
    for (source, _, family_opts), group in groups.items():
        opts = [f"-arch=compute_{cc}"] + list(family_opts[1:]) + list(defines)   # PTX: no ptxas, no GPU
        exprs = sorted({c.smem_expression() for c in group})
        prog = nvrtc.createProgram(config_source(group[0]), source, [], [])
        try:
            for e in exprs:
                nvrtc.addNameExpression(prog, e)
            try:
                nvrtc.compileProgram(prog, opts)
            except nvrtc.NVRTCError as e:
                log = nvrtc.getProgramLog(prog)
                for message in filter(None, (missing_smem_variable(c, log) for c in group)):
                    raise RuntimeError(message) from e
                raise RuntimeError(f"NVRTC failed for the shared-memory sizes of kernels_cu/{source} on "
                                   f"compute_{cc}:\n{log}") from e
            ptx = nvrtc.getPTX(prog)
            ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
            values = {}
            for e in exprs:
                m = re.search(re.escape(nvrtc.getLoweredName(prog, e)) + _PTX_INT_RE, ptx)
                if m is None:
                    raise RuntimeError(f"the PTX of kernels_cu/{source} holds no value for {e}")
                values[e] = int(m.group(1))
        finally:
            nvrtc.destroyProgram(prog)
        out.update({c: values[c.smem_expression()] for c in group})
    return out


def smem_bytes_offline(config: KernelConfig, cc: str, defines: tuple[str, ...] = ()) -> int:
    """Dynamic shared memory of one CTA of ``config`` built for ``cc`` ("80", "90a", ...) with ``defines``,
    read from its kernel source (in ``kernel_dir()``) without a GPU (smem_bytes_offline_many); 0 where the
    family has none."""
    return _smem_bytes_offline(config, cc, tuple(defines), kernel_dir())


@functools.lru_cache(maxsize=None)
def _smem_bytes_offline(config: KernelConfig, cc: str, defines: tuple[str, ...], root: Path) -> int:
    return smem_bytes_offline_many([config], cc, defines)[config]


smem_bytes_offline.cache_clear = _smem_bytes_offline.cache_clear
