"""CPU-only: every sm90_fwd instantiation compiles for sm_90a without spills, and its
SASS runs on the Hopper tensor cores (HGMMA) with no local-memory traffic (LDL/STL)."""
from __future__ import annotations

import pytest

from cuflash import heuristics, options
from cuflash.config import FAMILIES, find_family

family_of = FAMILIES.__getitem__

import sass_tools as sass
from compile_checks import H100_SMEM_OPTIN, TWO_CTA_SMEM, assert_all_compile, assert_static_checks, kernel_smem

SM90_CONFIGS = heuristics.all_sm90_fwd_configs()  # the tuned table (CUFLASH_FWD_BACKEND=sm90)
# One instantiation per distinct tile shape (padded head dim), both dtypes and masks.
SASS_HEAD_DIMS = (40, 64, 96, 128, 192, 256)
SASS_CONFIGS = [c for c in SM90_CONFIGS if c.head_dim in SASS_HEAD_DIMS]
# Each consumer schedule forced (CUFLASH_FWD_BACKEND=sm90_<schedule>): one instantiation per tile shape.
_tuned_keys = {c.key() for c in SM90_CONFIGS}
FORCED_CONFIGS = list({c.key(): c for b in heuristics.SM90_FWD_BACKENDS[1:]
                       for c in heuristics.all_sm90_fwd_configs(b)
                       if c.head_dim in SASS_HEAD_DIMS and c.key() not in _tuned_keys}.values())


def test_sm90_configs_cover_every_head_dim():
    # every head dim, dtype and mask, plus the short-sequence kernels where they differ from the
    # table's (causal head dims <= 64: 8) and the long-sequence cluster kernels (not causal, head dims
    # 72..128 and 200..256: 16), per dtype
    assert len(SM90_CONFIGS) == 2 * 32 * 2 + 2 * 8 + 2 * 16
    families = set(heuristics.SM90_FWD_FAMILIES.values())
    assert all(c.family in families and c.fam.arch_specific for c in SM90_CONFIGS + FORCED_CONFIGS)
    assert {c.family for c in FORCED_CONFIGS} | {c.family for c in SM90_CONFIGS} == families


def test_sm90_fwd_instantiations_compile_without_spills():
    assert_all_compile(SM90_CONFIGS + FORCED_CONFIGS, "90a", no_warnings=True)


@pytest.mark.skipif(sass.tools_available() is not None,
                    reason=f"SASS tools unavailable: {sass.tools_available()}")
@pytest.mark.parametrize("cfg", SASS_CONFIGS + FORCED_CONFIGS, ids=[c.key() for c in SASS_CONFIGS + FORCED_CONFIGS])
def test_sm90_fwd_sass_uses_hgmma_without_local_memory(cfg):
    ops = sass.opcode_counts(sass.sass(cfg, "90a"))
    assert ops["HGMMA"] > 0, f"{cfg.key()}: no HGMMA in SASS"
    assert ops["UTMALDG"] > 0, f"{cfg.key()}: no TMA load in SASS"
    assert ops["LDL"] == 0 and ops["STL"] == 0, f"{cfg.key()}: local memory traffic"
    # Q as the register A operand of Q K^T (kernels_cu/sm90/fwd.cu: kQInRegs): one ldmatrix.x4 per k16
    # step of the padded head dim; besides, only the overlap schedule's rare recompute of a warp's S
    # (qk_warp, a loop: one ldmatrix of Q, one of K).
    pad = (cfg.head_dim + 63) // 64 * 64
    overlap = cfg.fam.schedule == "overlap"
    q_in_regs = (overlap and cfg.block_m == 128 and pad <= 128) or (cfg.fam.schedule == "simple" and pad <= 64)
    recompute = 2 if overlap else 0
    assert ops["LDSM"] == (pad // 16 if q_in_regs else 0) + recompute, f"{cfg.key()}: {ops['LDSM']} LDSM"
    # One issue site per GEMM and loop position: Q K^T (padded head dim / 16 k-steps) and P V (block_n / 16)
    # in the key loop, plus the overlap schedule's Q K^T of the first key tile and P V of the last; the split
    # schedule's P V once in each consumer warpgroup (P from registers and from shared memory). Every warp
    # of a warpgroup must issue a wgmma from the same instruction; a copy of the loop per warp state (the kept
    # max's) broke that silently in tests and only synccheck saw it.
    qk_steps, pv_steps = pad // 16, cfg.block_n // 16
    sites = 2 if overlap else 1
    pv_sites = 2 if cfg.fam.schedule == "split" else sites
    assert ops["HGMMA"] == sites * qk_steps + pv_sites * pv_steps, f"{cfg.key()}: {ops['HGMMA']} HGMMA"
    # The persistent kernels stage O at head dims <= 128 and store it with TMA (kTmaStoreO); the others
    # store it from registers or shared memory with ordinary stores.
    tma_store_o = cfg.fam.persistent and pad <= 128
    assert (ops["UTMASTG"] > 0) == tma_store_o, f"{cfg.key()}: {ops['UTMASTG']} UTMASTG"


UNIFORM_CONFIGS = [c for c in SASS_CONFIGS if c.head_dim <= 128]


@pytest.mark.skipif(sass.tools_available() is not None,
                    reason=f"SASS tools unavailable: {sass.tools_available()}")
@pytest.mark.parametrize("cfg", UNIFORM_CONFIGS, ids=[c.key() for c in UNIFORM_CONFIGS])
def test_sm90_fwd_wgmma_descriptors_stay_uniform(cfg):
    """No R2UR between the key loop's first and last wgmma: ptxas keeps the descriptors in uniform
    registers only while it can prove the tile, ring stage and Q buffer warp-uniform (the persistent
    kernels lost 10 % at long lengths when the tile index came straight from shared memory). The
    persistent kernels above head dim 128 (forced schedules only) are not clean yet."""
    span = sass.mma_span_counts(sass.sass(cfg, "90a"))
    assert span["HGMMA"] > 0, f"{cfg.key()}: no wgmma loop found"
    assert span["R2UR"] == 0, f"{cfg.key()}: {span['R2UR']} R2UR among the key loop's wgmma"


def test_backend_selection(monkeypatch):
    """Hopper kernels by default on cc 9.0 for fp16/bf16; CUFLASH_FWD_BACKEND=sm80 forces the
    portable ones; other GPUs and float32 always take the portable kernels."""
    options.use(options.Options())
    assert heuristics.fwd_config("bfloat16", 128, False, 90).fam.sm90_fwd
    assert heuristics.fwd_config("float16", 64, True, 90).fam.sm90_fwd
    assert heuristics.fwd_config("bfloat16", 128, False, 80).family == "sm80_fwd"
    assert heuristics.fwd_config("bfloat16", 128, False, 89).family == "sm80_fwd"
    assert heuristics.fwd_config("float32", 128, False, 90).family == "simt_fwd"
    options.set(fwd_backend="sm80")
    assert heuristics.fwd_config("bfloat16", 128, False, 90).family == "sm80_fwd"
    options.set(fwd_backend="sm90")
    assert heuristics.fwd_config("bfloat16", 128, False, 90).fam.sm90_fwd
    for schedule, family in heuristics.SM90_FWD_FAMILIES.items():
        options.set(fwd_backend=f"sm90_{schedule}")
        assert heuristics.fwd_config("bfloat16", 128, False, 90).family == family
        # the cluster kernels are not causal: forced, a causal call takes the plain schedule
        forced = heuristics.fwd_config("bfloat16", 128, True, 90).fam
        assert forced.cluster == 1 and (forced.schedule, forced.persistent) == (family_of(family).schedule,
                                                                             family_of(family).persistent)
    options.set(fwd_backend="sm90")
    assert heuristics.fwd_config("float32", 128, False, 90).family == "simt_fwd"
    assert heuristics.fwd_config("bfloat16", 128, False, 80).family == "sm80_fwd"


def test_short_sequence_schedule(monkeypatch):
    """The table runs persistent kernels at head dims <= 128 (overlap_p; causal <= 64 simple_p) and one
    CTA per tile above; short sequences take _SM90_FWD_SHORT's kernel where it has one (causal head
    dims <= 64: overlap_p with 128-row tiles); forced schedules keep the table's tiles."""
    options.use(options.Options())
    tiles = lambda c: (c.block_m, c.block_n, c.num_warps)  # noqa: E731
    for d in (32, 64, 96, 128):
        short = heuristics.fwd_config("float16", d, False, 90, short=True)
        assert short == heuristics.fwd_config("float16", d, False, 90) and short.family == "sm90_fwd_overlap_p"
    for d in (32, 64):
        short, long = (heuristics.fwd_config("bfloat16", d, True, 90, short=s) for s in (True, False))
        assert short.family == "sm90_fwd_overlap_p" and tiles(short) == (128, 128, 12)
        assert long.family == "sm90_fwd_p" and tiles(long) == (192, 128, 16)
    for d in (96, 128):
        short = heuristics.fwd_config("bfloat16", d, True, 90, short=True)
        assert short == heuristics.fwd_config("bfloat16", d, True, 90) and short.family == "sm90_fwd_overlap_p"
    for d in (192, 256):
        for causal in (False, True):
            short = heuristics.fwd_config("bfloat16", d, causal, 90, short=True)
            assert short == heuristics.fwd_config("bfloat16", d, causal, 90) and short.family == "sm90_fwd_overlap"
    assert heuristics.fwd_config("float16", 64, False, 80, short=True).family == "sm80_fwd"
    options.set(fwd_backend="sm90_simple_p")
    assert heuristics.fwd_config("float16", 64, False, 90, short=True).family == "sm90_fwd_p"
    assert heuristics.fwd_config("float16", 64, True, 90, short=True) == heuristics.fwd_config("float16", 64, True, 90)


def test_kernel_smem_sizes_and_persistent_q_buffers():
    """As each kernel reports it (<kernel>_smem_bytes): every tile fits the H100's opt-in shared memory;
    a persistent kernel takes a second Q buffer (Sm90FwdTile::kQBytes and its two mbarriers) over the
    one-CTA kernel of the same tile exactly where that still fits (fp16/bf16 and fp8), else the same size."""
    from dataclasses import replace

    from cuflash.compile import arch_option

    tags = {"float16": "f16_tag", "bfloat16": "bf16_tag", "float8_e4m3fn": "e4m3_tag"}
    configs = SM90_CONFIGS + FORCED_CONFIGS + heuristics.all_fp8_fwd_configs()
    configs += [c for b in ("sm90_simple_p", "sm90_overlap_p") for c in heuristics.all_sm90_fwd_configs(b)]
    configs = list({c.key(): c for c in configs if c.fam.sm90_fwd}.values())
    # The one-CTA kernel of each persistent one's tile (shared memory depends on the tile and persistence only).
    single = {c: replace(c, family=find_family(backend="sm90", direction="fwd", schedule="overlap",
                                                persistent=False, cluster=c.cluster, fp8=c.fam.fp8,
                                                prog=False).name)
              for c in configs if c.fam.persistent}
    sizes = kernel_smem(configs + list(single.values()), "90a")
    for c in configs:
        limit = TWO_CTA_SMEM if c.num_warps == 8 and not c.fam.persistent else H100_SMEM_OPTIN
        assert 1024 < sizes[c] <= limit, f"{c.key()} needs {sizes[c]} bytes (limit {limit})"
    checks, buffers = set(), set()
    for c, one in single.items():
        tile = f"Sm90FwdTile<{tags[c.dtype]}, {c.head_dim}, {c.block_m}, {c.block_n}, {c.num_warps}>"
        extra = sizes[c] - sizes[one]
        buffers.add(extra > 0)
        if extra:   # a second Q buffer and its full / empty barriers
            checks.add(f'static_assert({tile}::kQBytes + 16 == {extra}, "{c.key()}");')
        else:       # one Q buffer: a second would not have fit
            checks.add(f'static_assert({sizes[one]} + {tile}::kQBytes + 16 > {H100_SMEM_OPTIN}, "{c.key()}");')
    assert buffers == {False, True}, "both cases covered"
    assert_static_checks("sm90/fwd.cu", checks, [arch_option("90a"), "-std=c++17"])


def test_long_sequence_clusters(monkeypatch):
    """Both lengths >= SM90_FWD_CLUSTER_SEQLEN (fwd_long): the table's overlap kernels run in clusters of two
    where fwd_cluster_ok; $CUFLASH_SM90_FWD_CLUSTER=1 takes them at every length, 0 at none."""
    options.use(options.Options())
    n = heuristics.SM90_FWD_CLUSTER_SEQLEN
    assert heuristics.fwd_long(n, n) and not heuristics.fwd_long(n - 1, n) and not heuristics.fwd_long(n, 1)
    cfg = lambda d, causal=False, dtype="bfloat16", **kw: heuristics.fwd_config(dtype, d, causal, 90, **kw)  # noqa: E731
    assert cfg(128, long_seqs=True).family == "sm90_fwd_overlap_x2_p"
    assert cfg(96, dtype="float16", long_seqs=True).family == "sm90_fwd_overlap_x2_p"
    assert cfg(256, long_seqs=True).family == "sm90_fwd_overlap_x2"
    for d, causal in ((128, True), (64, False), (192, False)):   # causal, or an odd number of 64-column blocks
        assert cfg(d, causal, long_seqs=True) == cfg(d, causal)
    assert heuristics.fwd_config("float32", 128, False, 90, long_seqs=True).family == "simt_fwd"
    assert cfg(128).family == "sm90_fwd_overlap_p"
    options.set(sm90_fwd_cluster="0")
    assert cfg(128, long_seqs=True).family == "sm90_fwd_overlap_p"
    options.set(sm90_fwd_cluster="1")
    assert cfg(128).family == "sm90_fwd_overlap_x2_p"
    with pytest.raises(ValueError, match="CUFLASH_SM90_FWD_CLUSTER"):
        options.set(sm90_fwd_cluster="yes")
    monkeypatch.setenv("CUFLASH_SM90_FWD_CLUSTER", "yes")
    with pytest.raises(ValueError, match="CUFLASH_SM90_FWD_CLUSTER"):
        options.reload()


def test_forward_short_class():
    """api._launch_fwd and the fp8 forward classify sequences with heuristics.fwd_short."""
    assert heuristics.fwd_short(1024, 2048) and heuristics.fwd_short(1, 1)
    assert not heuristics.fwd_short(1025, 1025)
    assert not heuristics.fwd_short(1000, 2049)
    assert not heuristics.fwd_short(2049, 100)


def test_sm90_gemm_tiles_compile_from_the_tests_folder():
    """tests/cuda/sm90_gemm_tiles.cu (tests/test_sm90_primitives.py's kernels, kept out of the wheel)
    finds cuflash's sm90 headers from beside the tests and compiles for sm_90a."""
    from cupy.cuda import nvrtc

    from compile_checks import gemm_tiles_source

    names = [f"gemm_{kind}_kernel<{tag}, 128, 128>" for kind in ("ss", "rs") for tag in ("f16_tag", "bf16_tag")]
    prog = nvrtc.createProgram(gemm_tiles_source(), "sm90_gemm_tiles.cu", [], [])
    try:
        for name in names:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, ["-arch=sm_90a", "-std=c++17"])
        except nvrtc.NVRTCError as e:
            raise AssertionError(nvrtc.getProgramLog(prog)) from e
        assert all(nvrtc.getLoweredName(prog, name) for name in names)
    finally:
        nvrtc.destroyProgram(prog)
