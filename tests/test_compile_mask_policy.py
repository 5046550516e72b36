"""The mask / score-modifier policy's hooks (kernels_cu/common/mask.cuh), CPU only.

Every kernel family takes a ``MaskVariant`` (KernelConfig.variant) and asks the policy about the attention
pattern; the score modifier (and, in the backward, its derivative) is in a kernel's code only where the variant
has one. This test builds every family's kernels with a softcap variant, to PTX (no ptxas: fast), and checks
that the modifier is there (16-bit families: tanh.approx; float32: its exact tanhf makes the code differ from the
plain build's). Spills and the other variants are each family's tests/test_compile_variants_<family>.py.

A family whose template takes no variant yet (Family.template without "mask": the bool "causal") is skipped,
and runs here once it is converted.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from cuflash import compile as cf_compile, heuristics
from cuflash.variants import MaskVariant

pytest.importorskip("cupy")

SOFTCAP = MaskVariant(softcap=True)


def _configs() -> list:
    h = heuristics
    cfgs = [h.fwd_config("float16", 64, True, 80, backend="sm80"), h.fwd_config("float32", 64, True, 80),
            h.fwd_config("bfloat16", 128, True, 90), h.fwd_config("float16", 64, False, 90),
            h.fwd_config("bfloat16", 128, False, 90, long_seqs=True), h.fp8_fwd_config(128, True)]
    for dtype, d, causal, cc, det, backend in (("float16", 64, True, 80, False, None), ("float16", 64, True, 80, True, None),
                                               ("float16", 128, False, 90, False, "sm80"), ("float32", 64, True, 80, False, None),
                                               ("bfloat16", 128, True, 90, False, None), ("float16", 64, False, 90, True, None)):
        cfgs += h.bwd_configs(dtype, d, causal, cc, deterministic=det, backend=backend).all()
    return list({c.key(): c for c in cfgs if c.fam.dynamic_smem}.values())


def _ptx(cfg) -> str:
    ptx, _ = cf_compile.compile_offline(cfg, "90a" if cfg.fam.arch_specific else "80", verbose_ptxas=False, ptx=True)
    return ptx.decode() if isinstance(ptx, bytes) else ptx


@pytest.mark.parametrize("cfg", _configs(), ids=lambda c: c.key())
def test_every_family_compiles_with_a_score_modifier(cfg):
    if "mask" not in cfg.fam.template:
        pytest.skip(f"{cfg.family} takes no MaskVariant yet (template {cfg.fam.template}): switched when converted")
    modified = replace(cfg, variant=SOFTCAP)
    ptx = _ptx(modified)
    if cfg.dtype == "float32":
        assert ptx != _ptx(cfg), "the softcap variant's code is the plain kernel's: the hook is not called"
    else:
        assert "tanh.approx.f32" in ptx, "no tanh in the softcap variant: the hook is not called"
