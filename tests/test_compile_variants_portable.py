"""CPU only: the portable kernels built with the mask policy's variants (kernels_cu/common/mask.cuh) compile
without register spills: sm80 (forward; dK/dV versions 1 and 2, with and without atomic dQ; dQ) in fp16 (bf16
differs only in conversions) and the float32 simt kernels (forward, dK/dV, dQ; exact math).

Every part at once (local + chunks + softcap + ALiBi + sink, causal: the most registers) at each tile the tables
pick for the tuned head dims; each part alone at one head dim (the window causal and not: the loops' ranges
differ). Each distinct instantiation is compiled once, for the first compute capability whose table picks it.
"""
from __future__ import annotations

import pytest

from portable_variants import check_coverage, instantiations
from compile_checks import assert_all_compile

pytest.importorskip("cupy")

BACKENDS = {"sm80": "float16", "simt": "float32"}
INSTANTIATIONS = {backend: instantiations(backend, dtype) for backend, dtype in BACKENDS.items()}


@pytest.mark.parametrize("backend,family", [(b, f) for b in BACKENDS for f in sorted(INSTANTIATIONS[b])])
def test_variants_compile_without_spills(backend, family):
    by_arch: dict = {}
    for arch, cfg in INSTANTIATIONS[backend][family]:
        by_arch.setdefault(arch, []).append(cfg)
    for arch, cfgs in sorted(by_arch.items()):
        assert_all_compile(cfgs, arch)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_every_family_and_part_is_built(backend):
    check_coverage(backend, INSTANTIATIONS[backend])
