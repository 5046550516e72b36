"""CPU-only: every sm90 backward instantiation (CUFLASH_BWD_BACKEND=sm90, deterministic or not)
compiles for sm_90a without spills, and its SASS runs on the Hopper tensor cores (HGMMA) with TMA
loads, float32 bulk reduces for dQ and no
local-memory traffic (LDL/STL); the shared memory each kernel reports fits an H100."""
from __future__ import annotations

import pytest

from dataclasses import replace

from cuflash import dispatch, heuristics, launch, options
from cuflash.config import KernelConfig
from cuflash.variants import MaskVariant

import sass_tools as sass

from compile_checks import H100_SMEM_OPTIN, TWO_CTA_SMEM, assert_all_compile, kernel_smem

ALL_CONFIGS = heuristics.all_sm90_bwd_configs()
SM90_BWD_CONFIGS = [c for c in ALL_CONFIGS if c.fam.arch_specific]
POSTPROCESS_CONFIGS = [c for c in ALL_CONFIGS if not c.fam.arch_specific]
DQ_MODE = {"sm90_bwd_dkdv_dqtile": "kDqTile", "sm90_bwd_dkdv_dqtile_ordered": "kDqTileOrdered"}


def test_sm90_bwd_configs():
    assert {c.head_dim for c in SM90_BWD_CONFIGS} == {32, 64, 96, 128, 192, 256}
    by_family = {f: [c for c in SM90_BWD_CONFIGS if c.family == f] for f in DQ_MODE}
    # Every bucket, dtype and mask in each dQ mode, and the short-sequence tiles (one consumer
    # warpgroup, heuristics._SM90_BWD_SHORT) of its buckets.
    short = len(heuristics._SM90_BWD_SHORT)
    assert [len(by_family[f]) for f in DQ_MODE] == [(6 + short) * 2 * 2] * 2
    assert {(c.block_m, c.block_n, c.num_warps) for c in SM90_BWD_CONFIGS if c.num_warps == 8} \
        == set(heuristics._SM90_BWD_SHORT.values())
    assert {c.family for c in POSTPROCESS_CONFIGS} == {"bwd_postprocess_tiled"}


def test_sm90_bwd_instantiations_compile_without_spills():
    assert_all_compile(SM90_BWD_CONFIGS, "90a", no_warnings=True)


@pytest.mark.parametrize("cc", ["80", "90a"])
def test_tiled_postprocess_compiles(cc):
    assert_all_compile(POSTPROCESS_CONFIGS, cc, no_warnings=True)


def test_kernel_smem_sizes_fit_an_h100():
    """As each kernel reports it (<kernel>_smem_bytes: Sm90BwdTile::kSmemBytes and 1 KB of alignment slack),
    every tile fits the H100's opt-in shared memory, and the one-consumer-warpgroup tiles (built for two CTAs
    per SM: kCtasPerSm, __launch_bounds__) fit twice in an SM. The ordered (deterministic) mode needs no
    more than the tile mode of the same tile."""
    sizes = kernel_smem(SM90_BWD_CONFIGS, "90a")
    for c in SM90_BWD_CONFIGS:
        limit = TWO_CTA_SMEM if c.num_warps == 8 else H100_SMEM_OPTIN
        assert 1024 < sizes[c] <= limit, f"{c.key()} needs {sizes[c]} bytes (limit {limit})"
        if c.family == "sm90_bwd_dkdv_dqtile_ordered":
            assert sizes[c] == sizes[replace(c, family="sm90_bwd_dkdv_dqtile")], c.key()
    assert kernel_smem(POSTPROCESS_CONFIGS, "90a") == {c: 0 for c in POSTPROCESS_CONFIGS}


@pytest.mark.skipif(sass.tools_available() is not None,
                    reason=f"SASS tools unavailable: {sass.tools_available()}")
@pytest.mark.parametrize("cfg", SM90_BWD_CONFIGS, ids=[c.key() for c in SM90_BWD_CONFIGS])
def test_sm90_bwd_sass_uses_hgmma_without_local_memory(cfg):
    ops = sass.opcode_counts(sass.sass(cfg, "90a"))
    pad = (cfg.head_dim + 63) // 64 * 64
    # Per query tile and consumer warpgroup: S^T, dP^T (pad / 16 k-steps each), dV, dK
    # (block_m / 16 each) and dQ (block_n / 16), times the wgmma pieces of a column slice (split-D
    # tiles, block_n = 64 and two consumer warpgroups: half of the head dim per warpgroup; at d=192 dK / dV
    # in an n64 and an n32 piece, dQ in three n32 ones).
    consumer_wgs = cfg.num_warps // 4 - 1
    split_d = cfg.block_n == 64 and consumer_wgs == 2
    kv_cols = pad // 2 if split_d else pad
    dq_cols = pad // consumer_wgs if cfg.block_m == 64 else pad
    kv_pieces = 1 if kv_cols % 64 == 0 else kv_cols // 64 + 1
    dq_pieces = 1 if dq_cols % 64 == 0 or dq_cols < 64 else dq_cols // 32
    per_step = 2 * (pad // 16) + 2 * (cfg.block_m // 16) * kv_pieces + cfg.block_n // 16 * dq_pieces
    assert ops["HGMMA"] == per_step, f"{cfg.key()}: {ops['HGMMA']} HGMMA, expected {per_step}"
    assert ops["UTMALDG"] > 0, f"{cfg.key()}: no TMA load in SASS"
    # One bulk reduce per slice, or a bulk store for the first; the only atomics are the semaphore's.
    assert ops["UBLKRED"] == 1, f"{cfg.key()}: {ops['UBLKRED']} bulk reduces"
    # The first slice's store, the release after it (ordered: after every slice) and the unordered mode's
    # claim of a slice (cuflash/sm90.py: bwd_first_slice_stored).
    ordered = cfg.fam.dq_mode == "ordered"
    # Bulk copies: the first slice's store, and the lse2 / delta rows that come with each Q / dO tile.
    assert ops["UBLKCP"] == 3, f"{cfg.key()}: {ops['UBLKCP']} bulk copies (first slice's store, lse2, delta)"
    assert ops["REDG"] == 1, f"{cfg.key()}: {ops['REDG']} REDG"
    assert ops["ATOMG"] == int(not ordered), f"{cfg.key()}: {ops['ATOMG']} ATOMG"
    # dS (split-D: and its P^T half) goes to shared memory by stmatrix, one per 16 query rows of the step;
    # causal 128-row tiles keep two-byte stores, which measured faster there (docs/design.md: dS staging).
    stsm = 0 if cfg.block_m == 128 and cfg.causal else cfg.block_m // 16
    assert ops["STSM"] == stsm, f"{cfg.key()}: {ops['STSM']} STSM, expected {stsm}"
    assert ops["LDL"] == 0 and ops["STL"] == 0, f"{cfg.key()}: local memory traffic"


def test_sm90_bwd_backend_selection():
    """Default on cc 9.0 where it applies; CUFLASH_BWD_BACKEND=sm80 forces the portable kernels."""
    def portable(cfgs):
        return not any(c.fam.arch_specific for c in cfgs.all())

    options.use(options.Options())
    assert not portable(heuristics.bwd_configs("bfloat16", 128, False, 90))
    assert not portable(heuristics.bwd_configs("bfloat16", 256, True, 90))
    assert portable(heuristics.bwd_configs("bfloat16", 128, False, 80))
    assert portable(heuristics.bwd_configs("float32", 128, False, 90))
    assert not any(c.fam.arch_specific for c in heuristics.all_bwd_configs(90))
    options.set(bwd_backend="sm80")
    assert portable(heuristics.bwd_configs("bfloat16", 128, False, 90))
    assert portable(heuristics.bwd_configs("bfloat16", 128, False, 90, deterministic=True))
    for backend in ("auto", "sm90"):
        options.set(bwd_backend=backend)
        # Default dQ mode "tile": bulk-reduced dQ, and its ordered variant for the deterministic mode
        # (split-D tiles at 192 / 256 included).
        cfgs = heuristics.bwd_configs("bfloat16", 128, False, 90)
        assert cfgs.dkdv.family == "sm90_bwd_dkdv_dqtile" and cfgs.dq is None
        assert cfgs.postprocess.family == "bwd_postprocess_tiled" and cfgs.postprocess.block_m == cfgs.dkdv.block_m
        for d in (8, 40, 72, 128, 136, 256):
            for causal in (False, True):
                assert heuristics.bwd_configs("float16", d, causal, 90).dkdv.family == "sm90_bwd_dkdv_dqtile"
                assert heuristics.bwd_configs("float16", d, causal, 90, deterministic=True).dkdv.family == \
                    "sm90_bwd_dkdv_dqtile_ordered"
        assert heuristics.bwd_configs("bfloat16", 256, False, 90).dkdv.block_n == 64
        assert heuristics.bwd_configs("bfloat16", 136, True, 90).dkdv.block_n == 64
        assert portable(heuristics.bwd_configs("float32", 128, False, 90))
        assert portable(heuristics.bwd_configs("bfloat16", 128, False, 80))
        assert heuristics.bwd_configs("float16", 64, False, 90).dkdv.block_m == 128
        assert heuristics.bwd_configs("float16", 64, True, 90).dkdv.block_m == 128
        assert heuristics.bwd_configs("float16", 128, True, 90).dkdv.block_m == 64


def test_sm90_bwd_grid_order():
    """Causal, windowed and ordered kernels, and the others with 128-row query tiles, take the sectioned 1-D
    grid (BwdTileScheduler::block reads a grid with gridDim.y == gridDim.z == 1 that way); the rest the (key tile,
    kv head, batch) grid, and the portable kernels always the 3-D one."""
    def grid(family, causal, nk, block_m=128):
        return launch.bwd_dkdv_grid(KernelConfig(family, "float16", 64, causal, block_m, 128, 12), 4, 8, nk)

    assert grid("sm90_bwd_dkdv_dqtile", False, 2048) == (16 * 32, 1, 1)
    assert grid("sm90_bwd_dkdv_dqtile", False, 4097) == (33 * 32, 1, 1)
    assert grid("sm90_bwd_dkdv_dqtile", False, 1024, block_m=64) == (8, 8, 4)
    assert grid("sm90_bwd_dkdv_dqtile", True, 4096, block_m=64) == (32 * 32, 1, 1)
    # A window makes the work per key tile uneven too (Mask::kUnevenWork): the 1-D grid, as causal.
    local = KernelConfig("sm90_bwd_dkdv_dqtile", "float16", 64, False, 64, 128, 12, variant=MaskVariant(local=True))
    assert launch.bwd_dkdv_grid(local, 4, 8, 4096) == (32 * 32, 1, 1)
    softcap = replace(local, variant=MaskVariant(softcap=True))
    assert launch.bwd_dkdv_grid(softcap, 4, 8, 1024) == (8, 8, 4)
    assert grid("sm90_bwd_dkdv_dqtile_ordered", False, 4096) == (32 * 32, 1, 1)
    assert grid("sm80_bwd_dkdv", False, 512) == (4, 8, 4)


def test_sm90_bwd_short_sequences(monkeypatch):
    """Short key sequences at head dims <= 64 take the one-consumer-warpgroup tile (two CTAs per SM,
    64 keys, 64-row query steps) on the sectioned 1-D grid; longer ones and larger head dims do not;
    $CUFLASH_SM90_BWD_SHORT forces the choice."""
    options.use(options.Options())
    assert heuristics.bwd_short(512, False) and not heuristics.bwd_short(513, False)
    assert heuristics.bwd_short(1024, True) and not heuristics.bwd_short(1025, True)
    for d in (32, 64):
        for det in (False, True):
            tile = heuristics.bwd_configs("float16", d, False, 90, det, short=True).dkdv
            assert (tile.block_m, tile.block_n, tile.num_warps) == (64, 64, 8)
            assert launch.bwd_dkdv_grid(tile, 2, 3, 1000) == (16 * 3 * 2, 1, 1)
            assert dispatch.smem_bytes(tile) <= TWO_CTA_SMEM  # two CTAs per SM
    assert heuristics.bwd_configs("float16", 64, False, 90, short=False).dkdv.num_warps == 12
    assert heuristics.bwd_configs("float16", 128, False, 90, short=True).dkdv.num_warps == 12
    options.set(sm90_bwd_short=True)
    assert heuristics.bwd_short(1 << 20, False)
    options.set(sm90_bwd_short=False)
    assert not heuristics.bwd_short(16, True)
