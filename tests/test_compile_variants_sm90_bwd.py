"""CPU only: the sm90 backward (both dQ modes) built with the mask policy's variants (kernels_cu/common/mask.cuh)
compiles for sm_90a without register spills.

Every part at once (local + softcap + ALiBi + sink), causal and not, at each tile heuristics.bwd_configs picks
for head dims 64 (long and short sequences), 128 and 256, in both dQ modes (the ordered mode's dQ writer computes
a window's order in a 24-register warp); each part alone at head dim 128, causal and not (the window in both
modes). fp16 only (bf16 differs in conversions); each distinct instantiation is compiled once.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from cuflash import heuristics
from cuflash.variants import MaskVariant

from compile_checks import assert_all_compile

pytest.importorskip("cupy")

HEAVY = MaskVariant(local=True, softcap=True, alibi=True, sink=True, chunk=True)
PARTS = (MaskVariant(local=True), MaskVariant(softcap=True), MaskVariant(alibi=True), MaskVariant(sink=True))


def _dkdv(d: int, causal: bool, deterministic: bool, short: bool):
    return heuristics.bwd_configs("float16", d, causal, 90, deterministic, backend="sm90", short=short).dkdv


def _heavy() -> list:
    cfgs = {}
    for d in (64, 128, 256):
        for causal in (False, True):
            for det in (False, True):
                for short in (False, True):
                    c = replace(_dkdv(d, causal, det, short), variant=HEAVY)
                    cfgs.setdefault(c.key(), c)
    return list(cfgs.values())


def _parts() -> list:
    cfgs = {}
    for causal in (False, True):
        for part in PARTS:
            for det in ((False, True) if part.local else (False,)):
                c = replace(_dkdv(128, causal, det, False), variant=part)
                cfgs.setdefault(c.key(), c)
    return list(cfgs.values())


def test_every_part_at_once_compiles_without_spills():
    cfgs = _heavy()
    assert {c.family for c in cfgs} == {"sm90_bwd_dkdv_dqtile", "sm90_bwd_dkdv_dqtile_ordered"}
    assert {(c.head_dim, c.block_m) for c in cfgs} == {(64, 128), (64, 64), (128, 64), (256, 64)}
    assert_all_compile(cfgs, "90a", no_warnings=True)


def test_each_part_compiles_without_spills():
    assert_all_compile(_parts(), "90a", no_warnings=True)
