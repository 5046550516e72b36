"""The Hopper forward (kernels_cu/sm90/fwd.cu, fp16/bf16 and fp8) built with attention variants compiles
without register spills, CPU only.

Each variant part alone (window / chunks, softcap, ALiBi, sink) and all of them together, causal and not, at the
tiles the dispatcher picks: few instantiations, each compiled once (ptxas takes seconds per kernel). Where the
plain kernel's tile has no registers to spare for a variant (the 192-row tiles of head dims <= 64, three
consumer warpgroups at 160 registers each: a score modifier spills there), the dispatcher takes the persistent
overlap kernel with 128-row tiles, as it does under the causal mask; _config says so until
heuristics.fwd_config takes the variant itself. Clusters of two CTAs need both query tiles to visit the same
key tiles, so a window runs without them (the kernel's static_assert).
"""
from __future__ import annotations

import inspect
from dataclasses import replace

import pytest

from cuflash import heuristics
from cuflash.variants import MaskVariant

pytest.importorskip("cupy")

from compile_checks import assert_all_compile  # noqa: E402

HEAVY = MaskVariant(local=True, softcap=True, alibi=True, sink=True, chunk=True)
PARTS = (MaskVariant(local=True), MaskVariant(softcap=True), MaskVariant(alibi=True), MaskVariant(sink=True))


def _config(dtype: str, head_dim: int, causal: bool, variant: MaskVariant, **kw):
    """The kernel the dispatcher runs for this variant."""
    if dtype == "float8_e4m3fn":
        cfg = replace(heuristics.fp8_fwd_config(head_dim, causal, **kw), variant=variant)
        if variant.has_score_mod and cfg.block_m == 192:
            cfg = replace(cfg, block_m=128, num_warps=12)
        return cfg
    if "variant" in inspect.signature(heuristics.fwd_config).parameters:
        return heuristics.fwd_config(dtype, head_dim, causal, 90, variant=variant, **kw)
    cfg = replace(heuristics.fwd_config(dtype, head_dim, causal, 90, **kw), variant=variant)
    if variant.has_score_mod and cfg.block_m == 192:
        cfg = replace(cfg, family=heuristics.sm90_fwd_family("overlap", True), block_m=128, num_warps=12)
    if variant.local and cfg.cluster > 1:
        cfg = replace(cfg, family=heuristics.sm90_fwd_family(cfg.fam.schedule, cfg.fam.persistent))
    return cfg


def _configs() -> list:
    cfgs = [_config(dtype, d, causal, HEAVY) for d in (64, 128, 256) for causal in (False, True)
            for dtype in ("bfloat16",)]
    cfgs += [_config("float16", 64, True, HEAVY), _config("float16", 128, False, HEAVY, long_seqs=True)]
    cfgs += [_config("bfloat16", d, causal, v) for d in (64, 128) for causal in (False, True) for v in PARTS]
    # Clusters (not causal, long sequences) with every part that keeps them.
    cfgs.append(_config("bfloat16", 128, False, replace(HEAVY, local=False), long_seqs=True))
    cfgs += [_config("float8_e4m3fn", d, True, HEAVY) for d in (64, 128)]
    return list({c.key(): c for c in cfgs}.values())


# Instantiations that still spill a few bytes (ptxas keeps the persistent tile order's values in local memory,
# loaded once per query tile rather than in the key loop): to be fixed or moved to other tiles, then removed
# from here (the strict xfail says when they compile clean).
KNOWN_SPILLS = {"sm90_fwd_overlap_p:bfloat16:d128:causal:S:m128n128w12",
                "sm90_fwd_overlap_x2_p:bfloat16:d128:full:SAK:m128n128w12"}


def test_sm90_fwd_variants_compile_without_spills():
    configs = _configs()
    assert any(c.cluster > 1 for c in configs) and any(c.fam.fp8 for c in configs)
    assert_all_compile([c for c in configs if c.key() not in KNOWN_SPILLS], "90a")


@pytest.mark.xfail(strict=True, reason="known spills (KNOWN_SPILLS)")
def test_sm90_fwd_variants_known_spills():
    assert_all_compile([c for c in _configs() if c.key() in KNOWN_SPILLS], "90a")
