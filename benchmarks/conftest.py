"""pytest-benchmark setup: each benchmark stores event-timed TFLOP/s in extra_info, and the
session ends with one table of cuflash beside PyTorch SDPA (flash and cuDNN backends)."""
from __future__ import annotations

import pytest

_ROWS: list[dict] = []


def _gpu_reason():
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return None
        return "no CUDA device"
    except Exception as e:  # noqa: BLE001
        return f"no usable CUDA device ({type(e).__name__})"


def pytest_collection_modifyitems(config, items):
    reason = _gpu_reason()
    if reason:
        for item in items:
            item.add_marker(pytest.mark.skip(reason=f"benchmarks need an NVIDIA GPU: {reason}"))


@pytest.fixture
def record():
    """record(shape_label, pass_name, impl, tflops) -> adds a cell to the final table."""
    def add(shape: str, pass_name: str, impl: str, value):
        for row in _ROWS:
            if row["shape"] == shape and row["pass"] == pass_name:
                row[impl] = value
                return
        _ROWS.append({"shape": shape, "pass": pass_name, impl: value})
    return add


def pytest_terminal_summary(terminalreporter):
    if not _ROWS:
        return
    from cuflash.__main__ import print_table

    terminalreporter.write_sep("=", "cuflash vs PyTorch SDPA (TFLOP/s, median of event-timed repeats)")
    for r in _ROWS:
        r.setdefault("cuflash", float("nan"))
    print_table(_ROWS)
