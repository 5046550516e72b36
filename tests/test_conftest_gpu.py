"""CPU: the suite's own GPU bookkeeping (tests/conftest.py): the skip reason in cuflash.device_check's words,
the "GPU tests: N ran" summary line, and --require-gpu turning a machine without a usable GPU into a failure."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import GPU_REASON_PREFIX, GPU_SKIP_REASON

ROOT = Path(__file__).resolve().parent.parent


def _pytest(*args):
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    return r.returncode, r.stdout + r.stderr


def test_summary_counts_the_gpu_tests():
    rc, out = _pytest("tests/test_fwd.py", "tests/test_options.py", "--collect-only")
    assert rc == 0, out
    line = next(x for x in out.splitlines() if x.startswith("GPU tests: "))
    selected = int(line.split(" of ")[1].split()[0])
    assert selected > 100 and "0 ran" in line   # test_fwd.py's, not test_options.py's


def test_skip_reason_is_the_device_check_diagnosis():
    if GPU_SKIP_REASON is None:
        pytest.skip("a usable GPU is here")
    from cuflash.device_check import diagnose

    problem = diagnose()
    assert problem is not None and GPU_SKIP_REASON == f"cuflash cannot run its kernels here: {problem.case}"
    rc, out = _pytest("tests/test_fwd.py", "-k", "test_seqlens")
    assert rc == 0 and f"{GPU_REASON_PREFIX}: {GPU_SKIP_REASON}" in out, out


def test_require_gpu_fails_without_a_gpu():
    if GPU_SKIP_REASON is None:
        pytest.skip("a usable GPU is here")
    rc, out = _pytest("tests/test_fwd.py", "--require-gpu")
    assert rc != 0 and f"--require-gpu: {GPU_SKIP_REASON}" in out, out
