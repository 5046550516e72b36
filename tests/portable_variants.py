"""The variant builds of the portable kernel families (sm80, simt) that their CPU compile tests
(test_compile_variants_portable.py) checks for spills."""
from __future__ import annotations

from dataclasses import replace

from cuflash import heuristics, options
from cuflash.config import FAMILIES
from cuflash.variants import MaskVariant

ALL_PARTS = MaskVariant(local=True, softcap=True, alibi=True, sink=True, chunk=True)
# Each part alone, as (variant, causal): the window causal and not (the loops' ranges differ with both); the
# score modifiers and the sink do not depend on causal (ALL_PARTS has them with it). Sinks are the forward's.
PARTS = [(MaskVariant(local=True), False), (MaskVariant(local=True), True), (MaskVariant(softcap=True), False),
         (MaskVariant(alibi=True), False), (MaskVariant(sink=True), False)]
PARTS_HEAD_DIM = 128


# The devices whose tables these builds are compiled for here (compute capability, NVRTC arch): the A100's, the
# 99 KB cards' (for sm_86 here; for sm_89 and sm_120 test_compile_portable_archs.py builds them with the rest of
# their kernels) and the H100's.
TABLE_ARCHS = ((80, "80"), (86, "86"), (90, "90a"))


def both_bwd_versions(cc: int, backend: str = "sm80") -> list:
    """heuristics.all_bwd_configs of ``cc`` with dK/dV version 2 where it is the default and with version 1
    (CUFLASH_SM80_BWD_VARIANT=1), which a user may still select."""
    out = heuristics.all_bwd_configs(cc, backend)
    with options.override(sm80_bwd_variant=1):
        return out + heuristics.all_bwd_configs(cc, backend)


def table_configs(cc: int, backend: str, dtype: str) -> list:
    """The backend's configs of the tables of a device of compute capability ``cc``, at the tuned head dims, with
    both dK/dV kernel versions (CUFLASH_SM80_BWD_VARIANT=1 keeps version 1 where version 2 is the default)."""
    cfgs = list({c.key(): c for c in heuristics.all_fwd_configs(cc, backend) + both_bwd_versions(cc, backend)}.values())
    return [c for c in cfgs if c.fam.backend == backend and c.dtype == dtype and c.head_dim in heuristics.TUNED_HEAD_DIMS]


def _parts(family: str) -> list:
    return [(v, causal) for v, causal in PARTS if not (v.sink and FAMILIES[family].direction == "bwd")]


def variant_builds(cfgs, parts_done: set) -> list:
    """The variant builds of table configs: ALL_PARTS causal at each causal one, PARTS at the first of each family
    at PARTS_HEAD_DIM whose family is not in ``parts_done`` (which records it)."""
    out = []
    for c in cfgs:
        builds = [(ALL_PARTS, True)] if c.causal else []
        if c.head_dim == PARTS_HEAD_DIM and c.family not in parts_done:
            parts_done.add(c.family)
            builds += _parts(c.family)
        out += [replace(c, variant=v, causal=causal) for v, causal in builds]
    return out


def instantiations(backend: str, dtype: str) -> dict:
    """{family: [(arch, config)]}: ALL_PARTS causal at every tile of the tables of TABLE_ARCHS, PARTS at one config
    of each family at PARTS_HEAD_DIM (or the nearest head dim its tables have); each distinct instantiation once, for the first arch whose table picks it."""
    seen: dict = {}
    parts_done: set = set()
    tables = [(arch, table_configs(cc, backend, dtype)) for cc, arch in TABLE_ARCHS]
    for arch, cfgs in tables:
        for cv in variant_builds(cfgs, parts_done):
            seen.setdefault(cv.key(), (arch, cv))
    # A family no table picks at PARTS_HEAD_DIM (dK/dV version 1 where version 2 took d=128) gets its PARTS at its
    # config of the nearest head dim.
    nearest: dict = {}
    for arch, cfgs in tables:
        for c in cfgs:
            if c.family not in parts_done:
                best = nearest.get(c.family)
                if best is None or abs(c.head_dim - PARTS_HEAD_DIM) < abs(best[1].head_dim - PARTS_HEAD_DIM):
                    nearest[c.family] = (arch, c)
    for arch, c in nearest.values():
        for v, causal in _parts(c.family):
            cv = replace(c, variant=v, causal=causal)
            seen.setdefault(cv.key(), (arch, cv))
    out: dict = {}
    for arch, cv in seen.values():
        out.setdefault(cv.family, []).append((arch, cv))
    return out


def check_coverage(backend: str, builds: dict) -> None:
    """Every family of the backend is built with ALL_PARTS causal and with each of its PARTS (the programmable
    families, whose variants carry programmable parts too, have their own: tests/test_compile_programmable.py)."""
    fams = {f.name for f in FAMILIES.values() if f.backend == backend and f.dynamic_smem
            and not f.kernel.endswith("_prog_kernel")}
    assert set(builds) == fams, sorted(fams ^ set(builds))
    for family, items in builds.items():
        got = {(cfg.variant, cfg.causal) for _, cfg in items}
        for want in [(ALL_PARTS, True)] + _parts(family):
            assert want in got, (family, want)
