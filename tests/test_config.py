"""CPU-only: kernel families carry their variant as typed fields, and nothing in cuflash/ reads a variant
out of a family's name."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from cuflash import heuristics, launch
from cuflash.config import FAMILIES, Family, KernelConfig, find_family


def test_shared_memory_comes_from_the_kernels():
    """The fwd / bwd / decode kernels name their shared-memory variable (read from the module by dispatch.smem_bytes);
    the aux kernels take none; nothing in launch.py sizes shared memory by hand any more."""
    for fam in FAMILIES.values():
        assert fam.dynamic_smem == (fam.direction != "aux"), fam.name
    cfg = KernelConfig("sm90_fwd_overlap_p", "bfloat16", 128, True, 128, 128, 12)
    assert cfg.smem_expression() == ("&fwd_overlap_persistent_kernel_smem_bytes<bf16_tag, 128, 128, 128, 12, "
                                     "MaskVariant<true, false, false, false, false, false>>")
    assert KernelConfig("bwd_preprocess", "float16", 0, False, 32, 0, 8).smem_expression() is None
    assert not hasattr(launch, "SMEM_BYTES") and not hasattr(launch, "sm90_fwd_q_buffers")
    with pytest.raises(TypeError):
        Family("x", "sm80/fwd.cu", "fwd_kernel", 80, False, dynamic_smem=1)


def test_typed_fields():
    fam = FAMILIES["sm90_fwd_overlap_x2_p"]
    assert (fam.direction, fam.backend, fam.schedule, fam.persistent, fam.cluster, fam.fp8) == \
        ("fwd", "sm90", "overlap", True, 2, False)
    assert FAMILIES["sm90_fwd_fp8_p"].fp8 and FAMILIES["sm90_fwd_fp8_p"].persistent
    assert FAMILIES["sm90_bwd_dkdv_dqtile_ordered"].dq_mode == "ordered"
    assert FAMILIES["sm80_bwd_dkdv_dq"].dq_mode == "atomic" and FAMILIES["sm80_bwd_dkdv"].dq_mode == "kernel"
    assert KernelConfig("sm90_fwd_overlap_x2", "float16", 128, False, 128, 128, 12).cluster == 2
    assert KernelConfig("sm90_fwd_overlap_p", "float16", 128, False, 128, 128, 12).cluster == 1
    assert find_family(backend="sm90", direction="fwd", schedule="simple", persistent=True).name == "sm90_fwd_p"
    for name, (schedule, persistent, cluster) in heuristics.SM90_FWD_KINDS.items():
        fam = FAMILIES[heuristics.SM90_FWD_FAMILIES[name]]
        assert (fam.schedule, fam.persistent, fam.cluster, fam.fp8) == (schedule, persistent, cluster, False)


def test_bad_family_fields():
    with pytest.raises(ValueError, match="schedule"):
        Family("x", "sm90/fwd.cu", "k", 90, True, schedule="pingpong")
    with pytest.raises(ValueError, match="direction"):
        Family("x", "sm90/fwd.cu", "k", 90, True, direction="sideways")
    with pytest.raises(TypeError, match="persistent"):
        Family("x", "sm90/fwd.cu", "k", 90, True, persistent=1)
    with pytest.raises(ValueError, match="cluster"):
        Family("x", "sm90/fwd.cu", "k", 90, True, cluster=0)
    with pytest.raises(TypeError, match="unknown"):
        find_family(colour="red")
    with pytest.raises(LookupError):
        find_family(backend="sm90", direction="fwd", schedule="simple", persistent=False)


# A variant read out of a family name: a substring test or a prefix / suffix test on a name.
_NAME_PARSING = re.compile(r"family\.(endswith|startswith|removeprefix|removesuffix|split|replace)\("
                           r"|\"[a-z0-9_]+\" in [a-z_.]*family\b|\"_x2\"|\"_p\"\)")


def test_no_family_name_parsing():
    root = Path(__file__).resolve().parent.parent / "cuflash"
    found = [f"{path.name}:{i}: {line.strip()}" for path in sorted(root.rglob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1) if _NAME_PARSING.search(line)]
    assert not found, "read Family's typed fields instead:\n" + "\n".join(found)
