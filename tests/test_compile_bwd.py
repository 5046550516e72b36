"""CPU-only: every backward kernel instantiation compiles with NVRTC for sm_80 and sm_90a without register
spills (the small-shared-memory table's tiles for sm_89 and sm_120: test_compile_portable_archs.py), and the
shared memory that each kernel reports fits the devices of its table."""
from __future__ import annotations

import pytest

from cuflash import heuristics, options
from compile_checks import H100_SMEM_OPTIN, assert_all_compile, kernel_smem

SMEM_LIMIT = {"large": 166912, "small": 101376}  # opt-in bytes per block: sm_80 (A100), sm_86/89


def _configs(cc: str) -> list:
    """Both dK/dV kernel versions' (CUFLASH_SM80_BWD_VARIANT=1 keeps version 1) of the tables of sm_<cc>."""
    out = {c.key(): c for c in heuristics.all_bwd_configs(int(cc[:2]))}
    with options.override(sm80_bwd_variant=1):
        out.update({c.key(): c for c in heuristics.all_bwd_configs(int(cc[:2]))})
    return list(out.values())


GROUPS = ["sm80_bwd_dkdv_dq", "sm80_bwd_dkdv", "sm80_bwd_dkdv2_dq", "sm80_bwd_dkdv2", "sm80_bwd_dkdv2_dq_do1",
          "sm80_bwd_dkdv2_do1", "sm80_bwd_dq", "simt_bwd", "bwd_pre_post"]


def _in_group(cfg, group: str) -> bool:
    if group == "bwd_pre_post":
        return cfg.family in ("bwd_preprocess", "bwd_postprocess")
    if group == "simt_bwd":
        return cfg.fam.backend == "simt" and cfg.fam.direction == "bwd"
    return cfg.family == group


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("cc", ["80", "90a"])
def test_bwd_instantiations_compile_without_spills(cc, group):
    configs = [c for c in _configs(cc) if _in_group(c, group)]
    if not configs and "dkdv2" in group:
        pytest.skip(f"{group} is not chosen for sm_{cc} here (CUFLASH_SM80_BWD_VARIANT)")
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


@pytest.mark.parametrize("cc", ["80", "86", "90"])
def test_kernel_smem_sizes_fit_their_tables(cc):
    """Every backward tile of a table fits the opt-in shared memory of the devices that table is for, as
    its kernel reports it (<kernel>_smem_bytes, the value the dispatcher reads from the module); the dK/dV
    and dQ kernels report some, the pre/postprocess none."""
    limit = {"80": SMEM_LIMIT["large"], "86": SMEM_LIMIT["small"], "90": H100_SMEM_OPTIN}[cc]
    configs = _configs(cc) if cc == "90" else heuristics.all_bwd_configs(int(cc))
    sizes = kernel_smem(configs, "80")
    for cfg in configs:
        assert (sizes[cfg] > 0) == (cfg.fam.direction == "bwd"), cfg.key()
        assert sizes[cfg] <= limit, f"{cfg.key()} needs {sizes[cfg]} bytes (sm_{cc} table, limit {limit})"
