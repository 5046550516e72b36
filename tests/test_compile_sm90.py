"""CPU-only: every sm90_fwd instantiation compiles for sm_90a without spills, and its
SASS runs on the Hopper tensor cores (HGMMA) with no local-memory traffic (LDL/STL)."""
from __future__ import annotations

import pytest

from cuflash import heuristics, sass
from cuflash.compile import compile_offline

from test_compile import assert_no_spills

SM90_CONFIGS = heuristics.all_sm90_fwd_configs()
# One instantiation per distinct tile shape (padded head dim), both dtypes and masks.
SASS_HEAD_DIMS = (40, 64, 96, 128, 192, 256)
SASS_CONFIGS = [c for c in SM90_CONFIGS if c.head_dim in SASS_HEAD_DIMS]
# The overlapped variant: one instantiation per tile shape (same tiles, same templates).
OVERLAP_CONFIGS = [c for c in heuristics.all_sm90_fwd_configs("sm90_overlap") if c.head_dim in SASS_HEAD_DIMS]


def test_sm90_configs_cover_every_head_dim():
    assert len(SM90_CONFIGS) == 2 * 32 * 2
    assert all(c.family == "sm90_fwd" and c.fam.arch_specific for c in SM90_CONFIGS)
    assert all(c.family == "sm90_fwd_overlap" and c.fam.arch_specific for c in OVERLAP_CONFIGS)


def test_sm90_fwd_instantiations_compile_without_spills():
    failures = []
    for cfg in SM90_CONFIGS + OVERLAP_CONFIGS:
        try:
            _, log = compile_offline(cfg, "90a")
            assert_no_spills(log, f"{cfg.key()} sm_90a")
            assert "warning" not in log.lower(), f"{cfg.key()}: ptxas warning:\n{log}"
        except (AssertionError, RuntimeError) as e:
            failures.append(str(e)[:2000])
    assert not failures, f"{len(failures)} of {len(SM90_CONFIGS)} failed:\n" + "\n\n".join(failures[:5])


@pytest.mark.skipif(sass.tools_available() is not None,
                    reason=f"SASS tools unavailable: {sass.tools_available()}")
@pytest.mark.parametrize("cfg", SASS_CONFIGS + OVERLAP_CONFIGS, ids=[c.key() for c in SASS_CONFIGS + OVERLAP_CONFIGS])
def test_sm90_fwd_sass_uses_hgmma_without_local_memory(cfg):
    ops = sass.opcode_counts(sass.sass(cfg, "90a"))
    assert ops["HGMMA"] > 0, f"{cfg.key()}: no HGMMA in SASS"
    assert ops["UTMALDG"] > 0, f"{cfg.key()}: no TMA load in SASS"
    assert ops["LDL"] == 0 and ops["STL"] == 0, f"{cfg.key()}: local memory traffic"


def test_sm90_is_opt_in(monkeypatch):
    monkeypatch.delenv("CUFLASH_FWD_BACKEND", raising=False)
    assert heuristics.fwd_config("bfloat16", 128, False, 90).family == "sm80_fwd"
    monkeypatch.setenv("CUFLASH_FWD_BACKEND", "sm90")
    assert heuristics.fwd_config("bfloat16", 128, False, 90).family == "sm90_fwd"
    monkeypatch.setenv("CUFLASH_FWD_BACKEND", "sm90_overlap")
    assert heuristics.fwd_config("bfloat16", 128, False, 90).family == "sm90_fwd_overlap"
    monkeypatch.setenv("CUFLASH_FWD_BACKEND", "sm90")
    assert heuristics.fwd_config("float32", 128, False, 90).family == "simt_fwd"
    assert heuristics.fwd_config("bfloat16", 128, False, 80).family == "sm80_fwd"
