"""pytest-benchmark setup: each benchmark stores event-timed TFLOP/s in extra_info, and the
session ends with one table of cuflash beside PyTorch SDPA (flash and cuDNN backends) and
FlashAttention-4 where it imports; the cases (shape, input distribution) are defined here."""
from __future__ import annotations

import pytest

from cuflash.bench import STANDARD_SHAPES, Shape

_ROWS: list[dict] = []
_VARIANT_ROWS: list = []   # bench_variants.CaseResult of benchmarks/bench_variants.py
_PROGRAMMABLE_ROWS: list = []   # bench_programmable.ProgResult of benchmarks/bench_programmable.py

# (shape, input distribution) cases: the standard shapes on normal inputs, and a few shapes on the
# distributions whose scores are large (cuflash.distributions), to keep the run short.
DIST_BENCH_SHAPES = [Shape(4, 16, 4096, 64, "float16", False), Shape(4, 16, 4096, 128, "bfloat16", False),
                     Shape(4, 16, 4096, 128, "bfloat16", True)]
BENCH_DISTS = ("outlier12", "sharp", "sink")
CASES = [(s, "normal") for s in STANDARD_SHAPES] + [(s, d) for s in DIST_BENCH_SHAPES for d in BENCH_DISTS]


def case_label(shape: Shape, dist: str) -> str:
    """The row label of a case in the final table: the shape, then the distribution unless normal."""
    return shape.label() if dist == "normal" else f"{shape.label()} [{dist}]"


def case_id(case) -> str:
    shape, dist = case
    return shape.label().replace(" ", "_") + ("" if dist == "normal" else f"-{dist}")


def peer(name: str):
    """(fn, sdpa_layout) of one peer ("sdpa_flash", "sdpa_cudnn", "fa4", see bench.peer_impls),
    or the test skips, saying why the peer is absent."""
    from cuflash.bench import fa4_status, peer_impls

    impls = peer_impls()
    if name in impls:
        return impls[name]
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - PyTorch is optional
        has_cuda = False
    if not has_cuda:
        pytest.skip("PyTorch with CUDA is not installed")
    if name == "fa4":
        pytest.skip(f"{fa4_status()}; install it (dev/device_run.sh fa4setup) and point $CUFLASH_FA4_PATH at it")
    pytest.skip(f"{name} is not available")


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


@pytest.fixture
def record_variant():
    """record_variant(case_result) -> adds a bench_variants.CaseResult to the variant table at the end."""
    return _VARIANT_ROWS.append


@pytest.fixture
def record_programmable():
    """record_programmable(result) -> adds a bench_programmable.ProgResult to the programmable table at the end."""
    return _PROGRAMMABLE_ROWS.append


def pytest_terminal_summary(terminalreporter):
    if _VARIANT_ROWS:
        from cuflash.bench_variants import format_table

        terminalreporter.write_sep("=", "attention variants (cuflash/bench_variants.py)")
        terminalreporter.write_line(format_table(_VARIANT_ROWS))
    if _PROGRAMMABLE_ROWS:
        from cuflash import bench_programmable

        terminalreporter.write_sep("=", "programmable attention (cuflash/bench_programmable.py)")
        terminalreporter.write_line(bench_programmable.format_table(_PROGRAMMABLE_ROWS))
    if not _ROWS:
        return
    from cuflash.__main__ import print_table

    terminalreporter.write_sep("=", "cuflash vs PyTorch SDPA and FlashAttention-4 "
                                    "(TFLOP/s, median of event-timed repeats)")
    for r in _ROWS:
        r.setdefault("cuflash", float("nan"))
    print_table(_ROWS)
