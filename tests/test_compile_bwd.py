"""CPU-only: every backward kernel instantiation compiles with NVRTC for sm_80 and sm_90a
(and the small-shared-memory tiles for sm_86) without register spills, and the Python
shared-memory sizes agree with the kernels' own."""
from __future__ import annotations

import pytest

from cuflash import heuristics, launch, options
from compile_checks import assert_all_compile, assert_static_checks

SMEM_LIMIT = {"large": 166912, "small": 101376}  # opt-in bytes per block: sm_80 (A100), sm_86/89


def _configs(cc: str) -> list:
    if cc == "86":  # only the tiles the small-shared-memory table adds
        large = {c.key() for c in heuristics.all_bwd_configs(80)}
        return [c for c in heuristics.all_bwd_configs(86) if c.key() not in large]
    if cc.startswith("90"):  # both dK/dV kernel versions (CUFLASH_SM80_BWD_VARIANT=1 keeps version 1)
        out = {c.key(): c for c in heuristics.all_bwd_configs(90)}
        with options.override(sm80_bwd_variant=1):
            out.update({c.key(): c for c in heuristics.all_bwd_configs(90)})
        return list(out.values())
    return heuristics.all_bwd_configs(int(cc))


GROUPS = ["sm80_bwd_dkdv_dq", "sm80_bwd_dkdv", "sm80_bwd_dkdv2_dq", "sm80_bwd_dkdv2", "sm80_bwd_dq", "simt_bwd", "bwd_pre_post"]


def _in_group(cfg, group: str) -> bool:
    if group == "bwd_pre_post":
        return cfg.family in ("bwd_preprocess", "bwd_postprocess")
    if group == "simt_bwd":
        return cfg.fam.backend == "simt" and cfg.fam.direction == "bwd"
    return cfg.family == group


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("cc", ["80", "90a", "86"])
def test_bwd_instantiations_compile_without_spills(cc, group):
    configs = [c for c in _configs(cc) if _in_group(c, group)]
    if not configs and "dkdv2" in group:
        pytest.skip(f"{group} is not chosen for sm_{cc} here (CUFLASH_SM80_BWD_VARIANT)")
    if cc != "86":
        assert configs, f"no {group} configs"
    assert_all_compile(configs, cc)


def test_every_head_dim_maps_to_a_compiled_bucket():
    # The sm90 backward is the default on cc 9.0 where it applies (tests/test_compile_sm90_bwd.py).
    compiled = {c.key() for c in heuristics.all_bwd_configs(90) + heuristics.all_sm90_bwd_configs()}
    for dtype in ("float16", "bfloat16", "float32"):
        for d in range(8, heuristics.MAX_HEAD_DIM + 1, 8):
            for causal in (False, True):
                for det in (False, True):
                    for cfg in heuristics.bwd_configs(dtype, d, causal, 90, det).all():
                        assert cfg.key() in compiled, cfg.key()


def test_name_expressions_are_unique():
    configs = heuristics.all_bwd_configs(90) + heuristics.all_bwd_configs(86)
    by_key = {c.key(): c.name_expression() for c in configs}
    assert len(set(by_key.values())) == len(by_key)


def test_deterministic_mode_uses_no_atomic_kernel():
    """Deterministic: a separate dQ kernel, or (sm90, 128-key tiles) dQ slices added in a fixed order."""
    for cc in (80, 90):
        for dtype in ("float16", "bfloat16", "float32"):
            for d in heuristics.TUNED_HEAD_DIMS:
                cfgs = heuristics.bwd_configs(dtype, d, True, cc, deterministic=True)
                if cfgs.dkdv.fam.sm90_bwd:
                    assert cfgs.dkdv.family == "sm90_bwd_dkdv_dqtile_ordered", cfgs.dkdv.key()
                else:
                    assert cfgs.postprocess is None and cfgs.dq is not None, cfgs.dkdv.key()
                    assert cfgs.dkdv.fam.dq_mode == "kernel", cfgs.dkdv.key()


def _tile_expr(cfg) -> str | None:
    d, bm, bn, w = cfg.head_dim, cfg.block_m, cfg.block_n, cfg.num_warps
    return {
        "sm80_bwd_dkdv": f"BwdDkdvTile<{d}, {bm}, {bn}, {w}>::kSmemBytes",
        "sm80_bwd_dkdv_dq": f"BwdDkdvTile<{d}, {bm}, {bn}, {w}>::kSmemBytes",
        "sm80_bwd_dkdv2": f"BwdDkdvTile2<{d}, {bm}, {bn}, {w}>::kSmemBytes",
        "sm80_bwd_dkdv2_dq": f"BwdDkdvTile2<{d}, {bm}, {bn}, {w}>::kSmemBytes",
        "sm80_bwd_dq": f"BwdDqTile<{d}, {bm}, {bn}, {w}>::kSmemBytes",
        "simt_bwd_dkdv": f"SimtBwdTile<{d}, {bn}, {bm}, {w}>::kSmemBytesDkdv",
        "simt_bwd_dq": f"SimtBwdTile<{d}, {bm}, {bn}, {w}>::kSmemBytesDq",
    }.get(cfg.family)


@pytest.mark.parametrize("source", ["sm80/bwd.cu", "simt/bwd.cu"])
def test_python_smem_sizes_match_the_kernels(source):
    """launch.SMEM_BYTES mirrors each tile's shared-memory size (static_asserts, one compile),
    and every tile fits the opt-in limit of the devices its table is for."""
    checks = []
    for size, cc in (("large", 80), ("small", 86)):
        for cfg in heuristics.all_bwd_configs(cc):
            expr = _tile_expr(cfg)
            if expr is None or cfg.source != source:
                continue
            nbytes = launch.SMEM_BYTES[cfg.family](cfg)
            assert nbytes <= SMEM_LIMIT[size], f"{cfg.key()} needs {nbytes} bytes ({size} table)"
            checks.append(f'static_assert({expr} == {nbytes}, "{cfg.key()}");')
    assert checks
    assert_static_checks(source, checks, ["-arch=compute_80", "-std=c++17"])
