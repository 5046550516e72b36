"""CPU-only: every sm90 backward instantiation (CUFLASH_BWD_BACKEND=sm90) compiles for sm_90a
without spills, and its SASS runs on the Hopper tensor cores (HGMMA) with TMA loads, vector
float32 reductions for dQ and no local-memory traffic (LDL/STL); the backend stays opt-in."""
from __future__ import annotations

import pytest

from cuflash import heuristics, launch, sass

from compile_checks import assert_all_compile

SM90_BWD_CONFIGS = heuristics.all_sm90_bwd_configs()
H100_SMEM_OPTIN = 232448


def test_sm90_bwd_configs():
    assert {c.head_dim for c in SM90_BWD_CONFIGS} == {32, 64, 96, 128, 192, 256}
    assert len(SM90_BWD_CONFIGS) == 6 * 2 * 2
    for c in SM90_BWD_CONFIGS:
        assert c.family == "sm90_bwd_dkdv_dq" and c.fam.arch_specific
        assert launch.SMEM_BYTES[c.family](c) <= H100_SMEM_OPTIN


def test_sm90_bwd_instantiations_compile_without_spills():
    assert_all_compile(SM90_BWD_CONFIGS, "90a", no_warnings=True)


@pytest.mark.skipif(sass.tools_available() is not None,
                    reason=f"SASS tools unavailable: {sass.tools_available()}")
@pytest.mark.parametrize("cfg", SM90_BWD_CONFIGS, ids=[c.key() for c in SM90_BWD_CONFIGS])
def test_sm90_bwd_sass_uses_hgmma_without_local_memory(cfg):
    ops = sass.opcode_counts(sass.sass(cfg, "90a"))
    pad = (cfg.head_dim + 63) // 64 * 64
    # Per query tile and consumer warpgroup: S^T, dP^T (pad / 16 k-steps each), dV, dK
    # (block_m / 16 each) and dQ (block_n / 16), times the wgmma pieces of a column slice (split-D
    # tiles, block_n = 64: half of the head dim per warpgroup, in 32-column pieces at d=192).
    kv_cols = pad // 2 if cfg.block_n == 64 else pad
    dq_cols = pad // 2 if cfg.block_m == 64 else pad
    kv_pieces = 1 if kv_cols % 64 == 0 else kv_cols // 32
    dq_pieces = 1 if dq_cols % 64 == 0 or dq_cols < 64 else dq_cols // 32
    per_step = 2 * (pad // 16) + 2 * (cfg.block_m // 16) * kv_pieces + cfg.block_n // 16 * dq_pieces
    assert ops["HGMMA"] == per_step, f"{cfg.key()}: {ops['HGMMA']} HGMMA, expected {per_step}"
    assert ops["UTMALDG"] > 0, f"{cfg.key()}: no TMA load in SASS"
    assert ops["REDG"] > 0, f"{cfg.key()}: no global reduction (atomic dQ) in SASS"
    assert ops["LDL"] == 0 and ops["STL"] == 0, f"{cfg.key()}: local memory traffic"


def test_sm90_bwd_backend_selection(monkeypatch):
    """Default on cc 9.0 where it applies; CUFLASH_BWD_BACKEND=sm80 forces the portable kernels."""
    def portable(cfgs):
        return not any(c.fam.arch_specific for c in cfgs.all())

    monkeypatch.delenv("CUFLASH_BWD_BACKEND", raising=False)
    assert not portable(heuristics.bwd_configs("bfloat16", 128, False, 90))
    assert not portable(heuristics.bwd_configs("bfloat16", 256, True, 90))
    assert portable(heuristics.bwd_configs("bfloat16", 128, False, 80))
    assert portable(heuristics.bwd_configs("bfloat16", 128, False, 90, deterministic=True))
    assert portable(heuristics.bwd_configs("float32", 128, False, 90))
    assert not any(c.fam.arch_specific for c in heuristics.all_bwd_configs(90))
    monkeypatch.setenv("CUFLASH_BWD_BACKEND", "sm80")
    assert portable(heuristics.bwd_configs("bfloat16", 128, False, 90))
    monkeypatch.setenv("CUFLASH_BWD_BACKEND", "sm90")
    cfgs = heuristics.bwd_configs("bfloat16", 128, False, 90)
    tuned = "sm90_bwd_dkdv_dq"
    assert cfgs.dkdv.family == tuned and cfgs.postprocess is not None and cfgs.dq is None
    assert heuristics.bwd_configs("float16", 40, True, 90).dkdv.family == tuned
    # Other dtypes, GPUs, head-dim buckets and the deterministic mode keep the portable kernels.
    assert portable(heuristics.bwd_configs("float32", 128, False, 90))
    assert portable(heuristics.bwd_configs("bfloat16", 128, False, 80))
    assert heuristics.bwd_configs("bfloat16", 256, False, 90).dkdv.block_n == 64
    assert heuristics.bwd_configs("bfloat16", 136, True, 90).dkdv.block_n == 64
    assert heuristics.bwd_configs("float16", 8, False, 90).dkdv.family == tuned
    assert heuristics.bwd_configs("float16", 72, True, 90).dkdv.family == tuned
    assert portable(heuristics.bwd_configs("bfloat16", 128, False, 90, deterministic=True))
    assert heuristics.bwd_configs("float16", 64, False, 90).dkdv.block_m == 128
    assert heuristics.bwd_configs("float16", 64, True, 90).dkdv.block_m == 64
