"""Shared CPU compile checks: NVRTC-compile kernel instantiations and read ptxas's report."""
from __future__ import annotations

import itertools
import os
import re
import subprocess
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cuflash.compile import _inline, compile_offline_many, load_source, smem_bytes_offline_many

# Shared memory of an H100 (sm_90): opt-in bytes per block, and per SM (each resident block also takes 1 KB
# of it for the system), so that two blocks of a tile built for two per SM fit in TWO_CTA_SMEM bytes each.
H100_SMEM_OPTIN = 232448
H100_SMEM_PER_SM = 233472
TWO_CTA_SMEM = H100_SMEM_PER_SM // 2 - 1024

# Test-only kernels (tests/test_sm90_primitives.py) live beside the tests, so that the wheel carries
# only what the library runs; they include cuflash's sm90 headers by relative path.
GEMM_TILES = Path(__file__).resolve().parent / "cuda" / "sm90_gemm_tiles.cu"


def assert_no_spills(log: str, what: str) -> None:
    """ptxas -v reported 0 bytes of stack frame and of spill stores/loads."""
    frames = [int(x) for x in re.findall(r"(\d+) bytes stack frame", log)]
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    assert frames and spills, f"{what}: no ptxas report in the log:\n{log}"
    assert max(frames) == 0 and max(spills) == 0, f"{what}: register spills / stack frame:\n{log}"


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")


def ptxas_reports(log: str) -> dict[str, str]:
    """{lowered kernel name: its part of ptxas's -v report} of a program that compiled several kernels."""
    starts = list(_ENTRY.finditer(log))
    ends = [m.start() for m in starts[1:]] + [len(log)]
    return {m.group(1): log[m.start():end] for m, end in zip(starts, ends)}


# The SASS opcodes build_and_disassemble counts: tensor-core MMAs, local-memory loads and stores.
SASS_OPCODES = ("HMMA", "LDL", "STL")


def build_and_disassemble(configs, cc: str) -> dict[str, tuple]:
    """Compiles configs of one kernel source for sm_<cc> in one NVRTC program (compile_offline_many) and
    disassembles its cubin: {config key: (problem, {opcode: count} of SASS_OPCODES in its SASS)}, the problem
    None, or what failed: NVRTC, register spills or a stack frame (assert_no_spills), a kernel missing from the
    SASS. A program that fails is built again a config at a time, so that each failure names its own config."""
    import sass_tools

    configs = list(configs)
    try:
        cubin, log, lowered = compile_offline_many(configs, cc)
        sass = sass_tools.functions(sass_tools.disassemble(cubin))
    except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
        if len(configs) > 1:
            return {k: v for c in configs for k, v in build_and_disassemble([c], cc).items()}
        return {configs[0].key(): (str(e), {})}
    reports = ptxas_reports(log)
    out = {}
    for cfg, name in lowered.items():
        problem = None
        try:
            assert_no_spills(reports.get(name, ""), f"{cfg.key()} sm_{cc}")
        except AssertionError as e:
            problem = str(e)
        if name not in sass:
            problem = problem or f"{cfg.key()} sm_{cc}: {name} is not in the disassembly"
        ops = sass_tools.opcode_counts(sass.get(name, ""))
        out[cfg.key()] = (problem, {op: ops[op] for op in SASS_OPCODES})
    return out


# Kernels per NVRTC program of assert_all_compile: one parse of the source for the lot; the programs build on a
# thread pool of os.cpu_count() workers (NVRTC runs without the GIL).
CHUNK = 8
# (cc, config, NVRTC defines, no_warnings) -> the problem of its build (None: none), so that an instantiation that
# several tests check for one arch is compiled once per test session.
_BUILT: dict = {}
_SERIALIZED = "wgmma.mma_async instructions are serialized"
# (cc, config, NVRTC defines) -> (program number, lowered name), and program number -> its cubin (zlib) or, once a
# SASS test read it, {lowered name: SASS}: the SASS tests disassemble what the compile tests built (built_sass).
_CUBINS: dict = {}
_PROGRAMS: dict = {}
_PROGRAM_NUMBERS = itertools.count()   # next() is atomic: the pool's threads number their programs apart


def _log_problem(cfg, cc: str, report: str, program_log: str, no_warnings: bool) -> str | None:
    """What is wrong with one kernel's ptxas ``report`` (and, for warnings, the NVRTC part of its program's log):
    spills or a stack frame, a ptxas warning (``no_warnings``), or a serialised wgmma pipeline."""
    try:
        assert_no_spills(report, f"{cfg.key()} sm_{cc}")
        if no_warnings:
            assert "warning" not in (program_log + report).lower(), f"{cfg.key()}: ptxas warning:\n{report}"
        # ptxas reports this as "info", not a warning: every wgmma then waits for the previous one.
        assert _SERIALIZED not in report, f"{cfg.key()} sm_{cc}: ptxas serialised the wgmma pipeline:\n{report}"
    except AssertionError as e:
        return str(e)[:2000]
    return None


def _build_problems(configs: list, cc: str, no_warnings: bool, defines: tuple = ()) -> dict:
    """{config: problem or None} of configs of one source built in one NVRTC program for sm_<cc>; a program that
    fails, or whose log holds what cannot be told apart per kernel (NVRTC's own warnings, a serialised wgmma
    named outside a kernel's report), is built again a config at a time."""
    try:
        cubin, log, lowered = compile_offline_many(configs, cc)
    except RuntimeError as e:
        if len(configs) > 1:
            return {k: v for c in configs for k, v in _build_problems([c], cc, no_warnings, defines).items()}
        return {configs[0]: str(e)[:2000]}
    program = next(_PROGRAM_NUMBERS)
    _PROGRAMS[program] = zlib.compress(cubin, 1)
    _CUBINS.update({(cc, cfg, defines): (program, name) for cfg, name in lowered.items()})
    reports = ptxas_reports(log)
    first = _ENTRY.search(log)
    program_log = log[:first.start()] if first else log
    out = {cfg: _log_problem(cfg, cc, reports.get(name, ""), program_log, no_warnings)
           for cfg, name in lowered.items()}
    ambiguous = _SERIALIZED in log and not any(_SERIALIZED in r for r in reports.values())
    if len(configs) > 1 and ((no_warnings and "warning" in program_log.lower()) or ambiguous):
        return {k: v for c in configs for k, v in _build_problems([c], cc, no_warnings, defines).items()}
    return out


def assert_all_compile(configs, cc: str, *, no_warnings: bool = False) -> None:
    """Every config compiles for sm_<cc> without spills (and, optionally, without ptxas warnings) and without a
    serialised wgmma pipeline; failures are collected so that one run lists them all. Programs of CHUNK kernels
    of one source, built side by side; each instantiation once per test session (_BUILT)."""
    from cuflash import options

    configs = list(dict.fromkeys(configs))
    defines = tuple(options.current().nvrtc_defines)
    todo = [c for c in configs if (cc, c, defines, no_warnings) not in _BUILT]
    groups: dict = {}
    for c in todo:
        groups.setdefault((c.source, c.variant.mods), []).append(c)
    chunks = [g[i:i + CHUNK] for g in groups.values() for i in range(0, len(g), CHUNK)]
    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        for part in pool.map(_build_problems, chunks, [cc] * len(chunks), [no_warnings] * len(chunks),
                             [defines] * len(chunks)):
            _BUILT.update({(cc, c, defines, no_warnings): problem for c, problem in part.items()})
    failures = [p for c in configs if (p := _BUILT[(cc, c, defines, no_warnings)]) is not None]
    assert not failures, f"{len(failures)} of {len(configs)} failed:\n" + "\n\n".join(failures[:5])


def built_sass(config, cc: str) -> str | None:
    """The SASS of ``config`` for sm_<cc> from the program assert_all_compile built it in (this session, under the
    same NVRTC defines), or None where none did."""
    from cuflash import options

    import sass_tools

    hit = _CUBINS.get((cc, config, tuple(options.current().nvrtc_defines)))
    if hit is None:
        return None
    program, name = hit
    if isinstance(_PROGRAMS[program], bytes):
        _PROGRAMS[program] = sass_tools.functions(sass_tools.disassemble(zlib.decompress(_PROGRAMS[program])))
    return _PROGRAMS[program].get(name)


def kernel_smem(configs, cc: str) -> dict:
    """{config: dynamic shared memory as its kernel reports it (<kernel>_smem_bytes)}, read from the PTX of
    those variables alone (one NVRTC program per source: ~0.1 s)."""
    return smem_bytes_offline_many(list(configs), cc)


def assert_static_checks(source: str, checks, options) -> None:
    """Compile a kernel source (its templates uninstantiated) followed by ``checks`` (C++ lines,
    typically static_asserts that Python mirrors of tile constants equal the kernel's) with NVRTC."""
    from cupy.cuda import nvrtc

    src = load_source(source) + "\n" + "\n".join(sorted(set(checks))) + "\n"
    prog = nvrtc.createProgram(src, "static_checks.cu", [], [])
    try:
        nvrtc.compileProgram(prog, list(options))
    except nvrtc.NVRTCError as e:
        raise AssertionError(nvrtc.getProgramLog(prog)) from e
    finally:
        nvrtc.destroyProgram(prog)


def gemm_tiles_source() -> str:
    """tests/cuda/sm90_gemm_tiles.cu with its includes (cuflash's sm90 headers) inlined."""
    return _inline(GEMM_TILES, set()) + "\n"
