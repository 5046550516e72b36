"""CPU-only: head dims above 256 (head_dims.py, issue #43): every instantiation the large head dims take compiles
without spills (the forward's Hopper split-V kernel and the backward's three kernels for sm_90a, the exact float32
forward for sm_80 and sm_90a), the split kernels' SASS issues each GEMM from one site per warpgroup and stores its
16-bit operand with stmatrix, their shared memory fits the H100 as the host computes it, and the dispatcher and the
head-dim rule choose and refuse as documented. The GPU checks are tests/test_large_head_dims.py."""
from __future__ import annotations

import pytest

import sass_tools as sass
from compile_checks import H100_SMEM_OPTIN, assert_all_compile, kernel_smem
from dataclasses import replace

from cuflash import head_dims, heuristics, options

LARGE = heuristics.large_fwd_configs()
BWD = heuristics.all_large_bwd_configs()
SPLIT = [c for c in LARGE if c.family == "sm90_fwd_split"]
SIMT = [c for c in LARGE if c.family == "simt_fwd"]
PORTABLE = [c for c in LARGE if c.family == "sm80_fwd"]
# The portable tile as fit_shared_memory narrows it: A100 (163 KB) and sm_86 / sm_89 (99 KB).
PORTABLE_NARROW = [replace(c, block_n=16) for c in PORTABLE] + [replace(c, block_m=32, block_n=16, num_warps=4)
                                                                 for c in PORTABLE] + \
    [replace(c, block_m=16, block_n=16, num_warps=2) for c in PORTABLE]


def test_configs():
    assert len(SPLIT) == 2 * 9 * 2 and len(SIMT) == 9 * 2 and len(PORTABLE) == 2 * 9 * 2
    assert len(LARGE) == len(SPLIT) + len(SIMT) + len(PORTABLE)
    assert all((c.block_m, c.block_n, c.num_warps) == (64, 32, 8) for c in PORTABLE)
    assert all((c.block_m, c.block_n, c.num_warps) == heuristics.SM90_SPLIT_TILE for c in SPLIT)


def test_split_kernels_compile_without_spills():
    assert_all_compile(SPLIT, "90a", no_warnings=True)


def test_portable_kernels_compile_without_spills():
    """Two warps per 16-row slice (O's columns split), and the narrower tiles of smaller shared memories."""
    assert_all_compile(PORTABLE + PORTABLE_NARROW, "80")
    assert_all_compile(PORTABLE[:4], "90a")


def test_portable_shared_memory_narrowing():
    """fit_shared_memory takes the portable tile to the A100's 163 KB and to 99 KB (sm_86, sm_89) at every pair."""
    for c in PORTABLE:
        for limit in (166912, 101376):
            fitted = heuristics.fit_shared_memory(c, limit, lambda x: kernel_smem([x], "80")[x])
            assert kernel_smem([fitted], "80")[fitted] <= limit
            assert fitted in PORTABLE_NARROW + PORTABLE, fitted.key()


def test_float32_kernels_compile_without_spills():
    assert_all_compile(SIMT, "80")
    assert_all_compile(SIMT, "90a")


def test_shared_memory_fits():
    """The split-V kernel's size as it reports it is heuristics.split_fwd_smem's (two K / V stages where they fit
    beside one P buffer, then two P buffers where they fit), within the H100's limit: one stage and two P buffers
    at 512, one P buffer at (576, 512); the float32 tiles fit 115 KB (within the opt-in limits of sm_80, sm_90 and
    sm_100)."""
    sizes = kernel_smem(LARGE, "90a")
    for c in SPLIT:
        size, stages, buffers = heuristics.split_fwd_smem(c.head_dim, c.head_dim_v or c.head_dim, c.block_n)
        assert sizes[c] == size <= H100_SMEM_OPTIN, (c.key(), sizes[c], size)
    assert heuristics.split_fwd_smem(512, 512, 64)[1:] == (1, 2)
    assert heuristics.split_fwd_smem(576, 512, 64)[1:] == (1, 1)
    assert heuristics.split_fwd_smem(320, 320, 64)[1] == 2
    assert max(sizes[c] for c in SIMT) <= 115 * 1024


def test_split_tile_override_leaves_other_kernels_alone():
    """A tile override of the split-V kernel's shape (64 rows, 12 warps) does not reach the other Hopper kernels,
    where a 64-row, 12-warp tile cannot build; the split kernel keeps its one tile under any override."""
    options.use(options.Options(sm90_fwd_tiles=heuristics.SM90_SPLIT_TILE))
    try:
        for d in (64, 128, 256):
            cfg = heuristics.fwd_config("bfloat16", d, False, 90)
            assert cfg.fam.schedule != "split" and (cfg.block_m, cfg.num_warps) != (64, 12), cfg.key()
        options.use(options.Options(sm90_fwd_tiles=(128, 128, 12)))
        cfg = heuristics.fwd_config("bfloat16", 512, False, 90)
        assert (cfg.block_m, cfg.block_n, cfg.num_warps) == heuristics.SM90_SPLIT_TILE
    finally:
        options.use(options.Options())


@pytest.mark.skipif(sass.tools_available() is not None,
                    reason=f"SASS tools unavailable: {sass.tools_available()}")
@pytest.mark.parametrize("cfg", [c for c in SPLIT if c.dtype == "bfloat16"], ids=lambda c: c.key())
def test_split_sass(cfg):
    """Q K^T over the padded head dim from warpgroup 0, P V once per warpgroup (every wgmma of a warpgroup from one
    instruction, as the other schedules), P out through one stmatrix per k16 step, no local memory."""
    ops = sass.opcode_counts(sass.sass(cfg, "90a"))
    pad = (cfg.head_dim + 63) // 64 * 64
    pv_steps = cfg.block_n // 16
    assert ops["HGMMA"] == pad // 16 + 2 * pv_steps, f"{cfg.key()}: {ops['HGMMA']} HGMMA"
    assert ops["STSM"] == pv_steps, f"{cfg.key()}: {ops['STSM']} STSM"
    assert ops["LDL"] == 0 and ops["STL"] == 0, f"{cfg.key()}: local memory traffic"
    assert ops["UTMALDG"] > 0


def test_selection():
    options.use(options.Options())
    cfg = heuristics.fwd_config
    assert cfg("bfloat16", 512, False, 90).family == "sm90_fwd_split"
    assert cfg("float16", 576, True, 90, head_dim_v=512).key() == "sm90_fwd_split:float16:d576v512:causal:m64n64w12"
    assert cfg("bfloat16", 128, False, 90, head_dim_v=320).family == "sm90_fwd_split"
    assert cfg("float32", 512, False, 80).family == "simt_fwd"
    assert cfg("float32", 512, False, 90).family == "simt_fwd"
    for cc, backend in ((80, None), (89, None), (100, None), (90, "sm80")):
        assert cfg("bfloat16", 512, False, cc, backend=backend).key() == "sm80_fwd:bfloat16:d512:full:m64n32w8"
    # Forced at ordinary head dims: wherever V has two 64-column blocks; else the overlap kernel.
    options.set(fwd_backend="sm90_split")
    assert cfg("bfloat16", 128, True, 90).key() == "sm90_fwd_split:bfloat16:d128:causal:m64n64w12"
    assert cfg("float16", 192, False, 90, head_dim_v=128).family == "sm90_fwd_split"
    assert cfg("bfloat16", 64, False, 90).family == "sm90_fwd_overlap"
    assert cfg("bfloat16", 128, False, 90, head_dim_v=64).family == "sm90_fwd_overlap"
    options.use(options.Options())


@pytest.mark.parametrize("dqk,dv", [(256, 256), (512, 512), (576, 512), (64, 512), (128, 512), (272, 80), (64, 64)])
def test_head_dim_rule_accepts(dqk, dv):
    head_dims.check(dqk, dv)


@pytest.mark.parametrize("dqk,dv,message", [
    (584, 512, "head_dim must be a multiple of 8 from 8 to 576, got 584"),
    (640, 128, "head_dim must be a multiple of 8 from 8 to 576, got 640"),
    (512, 520, "v's head_dim must be a multiple of 8 from 8 to 512, got 520"),
    (576, 576, "v's head_dim must be a multiple of 8 from 8 to 512, got 576"),
    (516, 512, "head_dim must be a multiple of 8 from 8 to 576, got 516"),
    (512, 516, "v's head_dim must be a multiple of 8 from 8 to 512, got 516"),
    (512, 64, "v's head_dim must be above 64 where q's is above 256 (got q / k 512, v 64)")])
def test_head_dim_rule_refuses(dqk, dv, message):
    with pytest.raises(ValueError) as e:
        head_dims.check(dqk, dv)
    assert str(e.value).startswith(message)


def test_backward_kernels_compile_without_spills():
    assert len(BWD) == 2 * 9 * 2 * 3
    assert_all_compile(BWD, "90a", no_warnings=True)


def test_backward_varlen_and_variants_compile_without_spills():
    """The varlen build (the sequence's params and rows) and the mask policy's variants (window, softcap, ALiBi)."""
    from cuflash.variants import MaskVariant

    variants = (MaskVariant(varlen=True), MaskVariant(varlen=True, local=True, softcap=True, alibi=True),
                MaskVariant(local=True, chunk=True, softcap=True, alibi=True))
    cfgs = [replace(c, variant=v) for c in BWD if c.dtype == "bfloat16" and c.head_dim in (576, 64)
            for v in variants]
    assert_all_compile(cfgs, "90a", no_warnings=True)


def test_backward_shared_memory():
    """Each kernel's size as it reports it is heuristics.split_bwd_smem's, within the H100's limit; 64-row steps
    where they fit, else 32 (dK and dQ at 512 and 576)."""
    sizes = kernel_smem(BWD, "90a")
    for c in BWD:
        product = c.family.rsplit("_", 1)[1]
        assert sizes[c] == heuristics.split_bwd_smem(product, c.head_dim, c.head_dim_v or c.head_dim, c.block_n)
        assert sizes[c] <= H100_SMEM_OPTIN, c.key()
        wider = heuristics.split_bwd_smem(product, c.head_dim, c.head_dim_v or c.head_dim, 64)
        assert c.block_n == (64 if wider <= H100_SMEM_OPTIN else 32), c.key()
    assert {c.block_n for c in BWD if (c.head_dim, c.head_dim_v) == (512, 0) and c.family.endswith(("_dk", "_dq"))} \
        == {32}


@pytest.mark.skipif(sass.tools_available() is not None,
                    reason=f"SASS tools unavailable: {sass.tools_available()}")
@pytest.mark.parametrize("cfg", [c for c in BWD if c.dtype == "bfloat16" and c.causal], ids=lambda c: c.key())
def test_backward_sass(cfg):
    """S (and dP) from shared memory over the padded head dims, the accumulating product in each warpgroup's
    pieces, the weights out through one stmatrix per k16 step, no local memory."""
    ops = sass.opcode_counts(sass.sass(cfg, "90a"))
    pad = lambda d: (d + 63) // 64 * 64   # noqa: E731
    product = cfg.family.rsplit("_", 1)[1]
    dv = cfg.head_dim_v or cfg.head_dim
    k_steps = cfg.block_n // 16
    acc = pad(dv) if product == "dv" else pad(cfg.head_dim)
    half0 = (acc // 64 + 1) // 2 * 64
    pieces = (2 if half0 > 256 else 1) + (1 if acc > half0 else 0)
    scores = pad(cfg.head_dim) // 16 + (0 if product == "dv" else pad(dv) // 16)
    assert ops["HGMMA"] == scores + pieces * k_steps, f"{cfg.key()}: {ops['HGMMA']} HGMMA"
    assert ops["STSM"] == k_steps, f"{cfg.key()}: {ops['STSM']} STSM"   # one warpgroup writes the weights
    assert ops["LDL"] == 0 and ops["STL"] == 0, f"{cfg.key()}: local memory traffic"
    assert ops["UTMALDG"] > 0


def test_backward_selection():
    for d, dv in ((512, 512), (576, 512), (128, 512)):
        pre, *grads = heuristics.large_bwd_configs("bfloat16", d, dv, True, 90)
        assert pre.family == "bwd_preprocess"
        assert [c.family for c in grads] == ["sm90_bwd_split_dv", "sm90_bwd_split_dk", "sm90_bwd_split_dq"]
        assert all(c.head_dim == d and (c.head_dim_v or d) == dv for c in grads)
    for dtype, cc in (("float32", 90), ("bfloat16", 80), ("float16", 100)):
        with pytest.raises(ValueError, match="Hopper"):
            heuristics.large_bwd_configs(dtype, 512, 512, False, cc)


def test_float32_backward():
    """float32 takes the exact kernels' one large bucket at every head dim above 256 (q's, or v's, the two padded
    to one), in 16-row tiles that compile without spills and fit 151 KB of shared memory."""
    cfgs = heuristics.bwd_configs("float32", 512, True, 80).all()
    assert [c.family for c in cfgs] == ["bwd_preprocess", "simt_bwd_dkdv", "simt_bwd_dq"]
    assert cfgs == heuristics.bwd_configs("float32", 264, True, 80).all()
    assert all(c.head_dim == heuristics.LARGE_BWD_BUCKET for c in cfgs[1:])
    kernels = [c for causal in (False, True) for c in heuristics.bwd_configs("float32", 576, causal, 90).all()[1:]]
    assert_all_compile(kernels, "80")
    assert_all_compile(kernels, "90a")
    assert max(kernel_smem(kernels, "80").values()) <= 151 * 1024
    with pytest.raises(ValueError, match="large_bwd_configs"):
        heuristics.bwd_configs("bfloat16", 512, True, 90)
