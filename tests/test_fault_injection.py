"""CPU: every fault of dev/fault_injection.py still applies to the kernel sources (each edit's text is found
exactly as often as it says), so that the GPU fault-injection run (docs/testing.md) breaks what it claims to.
A failure here means a kernel source changed under a fault: update that fault's edit."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "fault_injection", Path(__file__).resolve().parent.parent / "dev" / "fault_injection.py")
fault_injection = sys.modules.setdefault("fault_injection", importlib.util.module_from_spec(_SPEC))
_SPEC.loader.exec_module(fault_injection)   # registered first: its dataclasses look their module up


@pytest.mark.parametrize("name", sorted(fault_injection.FAULTS))
def test_fault_applies_to_the_sources(tmp_path, name):
    from cuflash import options
    from cuflash.compile import load_source, package_kernel_dir

    fault = fault_injection.FAULTS[name]
    copy = fault_injection.patched_copy(fault, tmp_path / "kernels_cu")
    changed = {e.path for e in fault.edits}
    for path in changed:
        assert (copy / path).read_text() != (package_kernel_dir() / path).read_text()
    with options.override(kernel_dir=str(copy)):   # the edits reach the inlined sources the compiles read
        assert any("FAULT" in load_source(src) for src in ("sm80/fwd.cu", "sm80/bwd.cu", "sm90/fwd.cu",
                                                            "sm90/bwd_split.cu"))


def test_a_stale_edit_is_refused(tmp_path):
    stale = fault_injection.Fault("stale", "x", (fault_injection.Edit("common/mask.cuh", "no such text", "y"),))
    with pytest.raises(ValueError, match="stale.*0 times"):
        fault_injection.patched_copy(stale, tmp_path / "kernels_cu")
