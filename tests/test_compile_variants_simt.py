"""CPU only: the float32 simt kernels (forward, dK/dV, dQ) built with the mask policy's variants
(kernels_cu/common/mask.cuh, exact math) compile without register spills.

Every part at once (local + softcap + ALiBi + sink, causal: the most registers) at each tile the tables pick
for the tuned head dims; each part alone at one head dim (the window causal and not: the loops' ranges
differ). Each distinct instantiation is compiled once, for the first compute capability whose table picks it.
"""
from __future__ import annotations

import pytest

from portable_variants import check_coverage, instantiations
from compile_checks import assert_all_compile

pytest.importorskip("cupy")

INSTANTIATIONS = instantiations("simt", "float32")


@pytest.mark.parametrize("family", sorted(INSTANTIATIONS))
def test_variants_compile_without_spills(family):
    by_arch: dict = {}
    for arch, cfg in INSTANTIATIONS[family]:
        by_arch.setdefault(arch, []).append(cfg)
    for arch, cfgs in sorted(by_arch.items()):
        assert_all_compile(cfgs, arch)


def test_every_family_and_part_is_built():
    check_coverage("simt", INSTANTIATIONS)
