"""Disassembly of kernel instantiations on a machine without a GPU (NVRTC cubin -> cuobjdump), for the
SASS tests (imported as ``sass_tools``: pytest puts tests/ on the path) and ``dev/sass.py``. Not part of the
installed package.

The cubin is NVRTC's own, compiled as the dispatcher compiles it, so the SASS read is the SASS that
runs. Needs ``cuobjdump`` + ``nvdisasm`` (the ``test`` extra's wheels nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm, a CUDA toolkit, or PATH); they read the cubins of NVRTC 12 and 13 alike.
"""
from __future__ import annotations

import collections
import os
import re
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

from cuflash.compile import compile_offline
from cuflash.config import KernelConfig

_OPCODE = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9]*)", re.M)


def _find_tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    try:
        import nvidia

        for base in nvidia.__path__:
            for cand in Path(base).glob(f"*/bin/{name}"):
                return str(cand)
    except ImportError:
        pass
    for cand in (f"/usr/local/cuda/bin/{name}",):
        if os.path.exists(cand):
            return cand
    return None


def tools_available() -> str | None:
    """None if cuobjdump and nvdisasm are both found, else a reason."""
    missing = [t for t in ("cuobjdump", "nvdisasm") if _find_tool(t) is None]
    return f"missing {', '.join(missing)}" if missing else None


def whole_elf(cubin: bytes) -> bytes:
    """The cubin as NVRTC wrote it: CuPy's ``nvrtc.getCUBIN`` drops the last byte, taking it for a
    string's NUL, and the disassemblers reject the cut file. Pads back to the end of the ELF's header
    tables (the last byte is the high byte of an alignment or entry size: zero)."""
    phoff, shoff = struct.unpack_from("<QQ", cubin, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", cubin, 0x36)
    end = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    return cubin + bytes(max(0, end - len(cubin)))


def sass(config: KernelConfig, cc: str) -> str:
    """SASS text of one instantiation for sm_<cc> (e.g. "80", "90a"): from the build of the compile tests where one
    made it this session (compile_checks.built_sass), else compiled here."""
    from compile_checks import built_sass

    text = built_sass(config, cc)
    if text is not None:
        return text
    cubin, _ = compile_offline(config, cc, verbose_ptxas=False)
    return disassemble(cubin)


def disassemble(cubin: bytes) -> str:
    """cuobjdump's SASS of a cubin of NVRTC's (every kernel in it: functions() splits them)."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin_path = Path(tmp) / "k.cubin"
        cubin_path.write_bytes(whole_elf(cubin))
        env = dict(os.environ)
        env["PATH"] = os.path.dirname(_find_tool("nvdisasm")) + os.pathsep + env.get("PATH", "")
        res = subprocess.run([_find_tool("cuobjdump"), "-sass", str(cubin_path)], check=True,
                             capture_output=True, text=True, env=env)
    return res.stdout


_FUNCTION = re.compile(r"^\s*Function : (\S+)\s*$", re.M)


def functions(sass_text: str) -> dict[str, str]:
    """{lowered kernel name: its SASS} of a disassembled cubin holding several kernels."""
    starts = list(_FUNCTION.finditer(sass_text))
    ends = [m.start() for m in starts[1:]] + [len(sass_text)]
    return {m.group(1): sass_text[m.end():end] for m, end in zip(starts, ends)}


def opcode_counts(sass_text: str) -> collections.Counter:
    """Opcode (without modifiers) -> count, e.g. {"HMMA": 256, "LDSM": 64, ...}."""
    return collections.Counter(_OPCODE.findall(sass_text))


_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)[^;]*;")
_BRANCH_TARGET = re.compile(r"\bBRA\b(?:\.\S+)?\s+(?:\S+,\s*)?0x([0-9a-f]+)")
_MMA_OPCODES = ("HGMMA", "QGMMA")   # warpgroup MMA: 16-bit and fp8


def innermost_mma_loop(sass_text: str) -> list[str]:
    """Opcodes, in address order, of the shortest loop (a backward branch and the instructions it
    spans) that holds a warpgroup MMA (HGMMA, or QGMMA for fp8): a kernel's key-tile loop, possibly
    with other code laid out inside its span. Empty if there is none."""
    instructions = [(int(addr, 16), op, line) for line in sass_text.splitlines()
                    for addr, op in _INSTRUCTION.findall(line)]
    best: list[str] = []
    for addr, op, line in instructions:
        target = _BRANCH_TARGET.search(line) if op == "BRA" else None
        if target is None or int(target.group(1), 16) >= addr:
            continue
        body = [o for a, o, _ in instructions if int(target.group(1), 16) <= a <= addr]
        if any(o in _MMA_OPCODES for o in body) and (not best or len(body) < len(best)):
            best = body
    return best


def mma_span_counts(sass_text: str) -> collections.Counter:
    """Opcode counts from the first to the last warpgroup MMA of the key-tile loop
    (innermost_mma_loop): what the tensor-core issue waits on."""
    body = innermost_mma_loop(sass_text)
    mma = [i for i, o in enumerate(body) if o in _MMA_OPCODES]
    return collections.Counter(body[mma[0]:mma[-1] + 1] if mma else [])
