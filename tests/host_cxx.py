"""Device headers built as host C++ (their functions are __host__ __device__): the CPU tests run them against
their NumPy twins and reference libraries, bit for bit."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from cuflash.compile import load_source


def run_header(tmp_path, header: str, body: str, stdin: str = "", prelude: str = "") -> str:
    """Builds kernels_cu/``header`` as host C++ with ``body`` as main's (with <cstdio> and <cmath>; ``prelude``:
    code between the header and main) and returns what it prints (``stdin`` its input); skips where no host C++
    compiler exists."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip(f"needs a host C++ compiler (g++) to build kernels_cu/{header} for the CPU")
    src = tmp_path / "host.cpp"
    src.write_text("#define CUFLASH_HD inline\n#include <cstdio>\n#include <cmath>\n" + load_source(header)
                   + "\n" + prelude + "\nint main() {\n" + body + "\n return 0;\n}\n")
    exe = tmp_path / "host"
    subprocess.run([cxx, "-O1", "-std=c++17", "-o", str(exe), str(src)], check=True, capture_output=True)
    return subprocess.run([str(exe)], input=stdin, check=True, capture_output=True, text=True).stdout
