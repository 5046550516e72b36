"""CPU-only: the portable fp16/bf16 forward kernels use tensor cores (HMMA) and never touch local memory."""
from __future__ import annotations

import pytest

from cuflash import heuristics
from sass_tools import opcode_counts, sass, tools_available

_missing = tools_available()
pytestmark = pytest.mark.skipif(_missing is not None, reason=f"SASS tools not found ({_missing})")


def _tuned_configs():
    """The portable (mma.sync) forward at every tuned head dim; the Hopper kernels' SASS
    (HGMMA) is checked in test_compile_sm90.py."""
    return [heuristics.fwd_config(dt, d, causal, 90, backend="sm80") for dt in ("float16", "bfloat16")
            for d in heuristics.TUNED_HEAD_DIMS for causal in (False, True)]


@pytest.mark.parametrize("cc", ["80", "90a"])
@pytest.mark.parametrize("config", _tuned_configs(), ids=lambda c: c.key())
def test_fwd_sass_uses_hmma_and_no_local_memory(config, cc):
    ops = opcode_counts(sass(config, cc))
    assert ops["HMMA"] > 0, f"no HMMA in {config.key()}: {ops.most_common(10)}"
    assert ops["LDL"] == 0 and ops["STL"] == 0, f"local memory traffic in {config.key()}"
