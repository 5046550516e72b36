"""The one tile table: (family, head dim, dtype, causal, arch) -> KernelConfig.

Head dims that are not tuned use the tiles of the next larger tuned head dim
(the kernel itself is still instantiated for the exact head dim).

The tables were tuned on an H100 (B=4 H=16 N=4096 unless said otherwise). The comments say why each
table is as it is; the measurements behind them are in BENCHMARKS.md and, per decision, in the git
history of this file (its comments before commit 7ff08ba quote the figures of every alternative).
"""
from __future__ import annotations

from . import head_dims, options
from .variants import PLAIN, MaskVariant
from .config import KernelConfig, find_family
from .options import Options

TUNED_HEAD_DIMS = (32, 64, 96, 128, 192, 256)
MAX_HEAD_DIM = head_dims.MAX_HEAD_DIM
SM90_SMEM_OPTIN = 232448   # opt-in shared memory per block on sm_90 (the split kernels' tiles are sized to it)

# sm80_fwd (mma.sync): head-dim bucket -> (block_m, block_n, num_warps).
_SM80_FWD = {  # dev/sweep.py tiles fwd --backend sm80 --env CUFLASH_SM80_FWD_TILES
    32: (128, 64, 4),
    64: (128, 64, 4),
    96: (128, 64, 4),
    128: (128, 32, 4),
    192: (64, 32, 4),
    256: (64, 32, 4),
}
# Causal takes the same tiles: since the fixed-step copies (128, 64, 4), once the causal d=128 tile, is 8 % slower
# there than (128, 32, 4) (BENCHMARKS.md, "Portable kernels against FlashAttention-2").
# Where a block may take >= 160 KB of shared memory (smem_class "large"), these buckets take a wider tile: at d=192
# (128, 64, 8), 150 KB, runs 1.12x (64, 32, 4) (BENCHMARKS.md, "Portable kernels against FlashAttention-2"; the
# 99 KB cards' fitting would narrow it to 16-key tiles). One K and one V buffer instead of the two-stage ring
# (FlashAttention-2's schedule, so that (128, 64, 8) fits 163 KB at d=256 too) ran no faster at d=192 / 256.
_SM80_FWD_LARGE_SMEM = {192: (128, 64, 8)}
# Above head dim 256 (head_dims.py): 8 warps on 64 rows, two per 16-row slice splitting O's columns
# (kernels_cu/sm80/fwd.cu: kColSplit); fit_shared_memory narrows it where 227 KB are not there (A100: 16 keys).
_SM80_FWD_LARGE = (64, 32, 8)

# sm90 forward (wgmma + TMA, warp-specialised): head-dim bucket -> (block_m, block_n, num_warps,
# kernel kind (SM90_FWD_KINDS) without / with the causal mask); num_warps = 4 * (1 producer + block_m / 64
# consumer warpgroups). D <= 64 take 192-row tiles (three consumer warpgroups; 128 rows: a fifth slower).
# The overlap schedule (the softmax of key tile i overlaps P V of tile i-1; a scheduling barrier keeps
# ptxas from hoisting the P V wait above the softmax) wins wherever its registers allow. Persistent
# kernels lead at head dims <= 128 at every length, once their consumers read the tile index through a
# lane-0 broadcast (from shared memory, ptxas kept every wgmma descriptor in ordinary registers: an R2UR
# per wgmma; docs/design.md, "Invariants a change must keep"); at D=192 / 256 one CTA per tile stays ahead. Causal D <= 64
# takes the simple schedule with 192-row tiles: the overlap schedule needs 128-row tiles under the mask
# there (3 x 160 consumer registers spill) and is slower with them.
_SM90_FWD = {
    32: (192, 128, 16, "overlap_p", "simple_p"),
    64: (192, 128, 16, "overlap_p", "simple_p"),
    96: (128, 128, 12, "overlap_p", "overlap_p"),
    128: (128, 128, 12, "overlap_p", "overlap_p"),
    192: (128, 96, 12, "overlap", "overlap"),
    256: (128, 64, 12, "overlap", "overlap"),
}
# Short sequences (seqlen_q <= 1024, seqlen_k <= 2048; fwd_short): where another kernel than the table's
# won. Head-dim bucket -> (block_m, block_n, num_warps, kernel kind) without / with the causal mask; None
# keeps the table's kernel. Causal D <= 64: the persistent overlap kernel with 128-row tiles (at N=1024
# 5 % over the table's kernel, a quarter over one CTA per tile). Causal D=192 / 256 lost their
# persistent short kernels once one CTA per tile wrote O through shared memory.
_SM90_FWD_SHORT = {
    32: (None, (128, 128, 12, "overlap_p")),
    64: (None, (128, 128, 12, "overlap_p")),
    96: (None, None),
    128: (None, None),
    192: (None, None),
    256: (None, None),
}
SM90_FWD_SHORT_SEQLEN_Q, SM90_FWD_SHORT_SEQLEN_K = 1024, 2048


def fwd_short(seqlen_q: int, seqlen_k: int) -> bool:
    """Whether fwd_config / fp8_fwd_config take these sequences as short (their ``short``)."""
    return seqlen_q <= SM90_FWD_SHORT_SEQLEN_Q and seqlen_k <= SM90_FWD_SHORT_SEQLEN_K


# The sm90 forward's kernels by the name a forced backend gives them (CUFLASH_FWD_BACKEND=sm90_<name>) and
# the tuned tables use: (consumer schedule, persistent, CTAs per cluster). Persistent kernels: one CTA per
# SM looping over tiles, longest causal tiles first; clusters of two: TMA multicast of K / V (fwd_cluster_ok).
SM90_FWD_KINDS = {"overlap": ("overlap", False, 1), "simple_p": ("simple", True, 1), "overlap_p": ("overlap", True, 1),
                  "overlap_x2": ("overlap", False, 2), "overlap_x2_p": ("overlap", True, 2),
                  "split": ("split", False, 1)}
# The split-V kernel's tile (head dims above 256; forced, any head dim whose V has two 64-column blocks): 64 query
# rows, 64 keys (one 128-byte row of P; one K / V stage at head dim 512), a producer and two consumer warpgroups
# (kernels_cu/sm90/fwd_split.cuh). 32-key tiles with two stages read 10-25 % slower at 512 and (576, 512)
# (BENCHMARKS.md, head dims above 256), so the tile is fixed.
SM90_SPLIT_TILE = (64, 64, 12)


def split_fwd_smem(head_dim: int, head_dim_v: int, block_n: int) -> tuple:
    """(bytes, K / V stages, P buffers) of the split-V kernel (Sm90FwdTile: split_bytes, kStages, kPBuffers): two
    stages where they fit beside one P buffer, then two P buffers where they fit too."""
    pad_qk, pad_v = (head_dim + 63) // 64 * 64, (head_dim_v + 63) // 64 * 64

    def base(stages):
        return 1024 + 64 * pad_qk * 2 + stages * block_n * (pad_qk + pad_v) * 2 + 128 * 8 + 8 * (3 + 4 * stages)

    p_slot = 64 * 128 + 128 * 8
    stages = 2 if base(2) + p_slot <= SM90_SMEM_OPTIN else 1
    buffers = 2 if base(stages) + 2 * p_slot <= SM90_SMEM_OPTIN else 1
    return base(stages) + buffers * p_slot, stages, buffers


def sm90_fwd_family(schedule: str, persistent: bool, cluster: int = 1, fp8: bool = False) -> str:
    """The name of the sm90 forward family with these traits (config.find_family)."""
    return find_family(backend="sm90", direction="fwd", schedule=schedule, persistent=persistent, cluster=cluster,
                       fp8=fp8, prog=False).name


SM90_FWD_FAMILIES = {name: sm90_fwd_family(*kind) for name, kind in SM90_FWD_KINDS.items()}
# CUFLASH_FWD_BACKEND values that select the sm90 forward: "sm90" (tuned table) or one schedule.
SM90_FWD_BACKENDS = ("sm90",) + tuple(f"sm90_{kind}" for kind in SM90_FWD_KINDS)


def fwd_cluster_ok(dtype: str, head_dim: int, causal: bool) -> bool:
    """Whether the forward's cluster kernels (``overlap_x2``, kernels_cu/sm90/fwd.cu: kCluster) apply: two
    CTAs on adjacent query tiles visit the same key tiles (not causal) and split each K / V tile's 64-column
    blocks evenly (16-bit, an even number of them: head dims 65..128 and 193..256)."""
    return dtype in ("float16", "bfloat16") and not causal and (head_dim + 63) // 64 % 2 == 0


# Long sequences (both at least this many tokens): the tuned table's overlap schedules run in clusters of
# two where fwd_cluster_ok (a few percent faster at N=32768 and more; BENCHMARKS.md, "History"); below,
# level or slower: there all CTAs do not stream the same K / V at once, so the multicast saves little.
SM90_FWD_CLUSTER_SEQLEN = 32768


def fwd_long(seqlen_q: int, seqlen_k: int) -> bool:
    """Whether fwd_config takes these sequences as long (its ``long_seqs``): both at least
    SM90_FWD_CLUSTER_SEQLEN."""
    return min(seqlen_q, seqlen_k) >= SM90_FWD_CLUSTER_SEQLEN


def fwd_cluster_mode(opts: Options | None = None) -> str:
    """Options.sm90_fwd_cluster ($CUFLASH_SM90_FWD_CLUSTER): "1" the tuned table takes the cluster kernels
    of its overlap schedules wherever they apply (fwd_cluster_ok), "0" never, "auto" for long sequences only."""
    return (opts or options.current()).sm90_fwd_cluster


# sm90 fp8 (e4m3) forward, overlap schedule: head-dim bucket -> (block_m, block_n, num_warps, persistent
# without / with the causal mask). block_n is a whole 128-byte V^T row. The fp16 tiles where they fit,
# 128-key tiles throughout; persistent at head dims <= 128 as in fp16 (5 % faster there; level at D=192).
_SM90_FWD_FP8 = {
    32: (192, 128, 16, True, True),
    64: (192, 128, 16, True, True),
    96: (128, 128, 12, True, True),
    128: (128, 128, 12, True, True),
    192: (128, 128, 12, False, False),
    256: (128, 128, 12, False, False),
}


# Short sequences (as _SM90_FWD_SHORT): head-dim bucket -> persistent kernel tiles (block_m, block_n,
# num_warps) without / with the causal mask, None for the table's kernel. The persistent kernel wins there
# (7-17 % at N <= 1024; causal D <= 64 with 128-row tiles); non-causal D=256 keeps the table's kernel (it
# lost 9 %), and causal D=256 too: its persistent kernel spills above D=192.
_SM90_FWD_FP8_SHORT = {
    32: ((192, 128, 16), (128, 128, 12)),
    64: ((192, 128, 16), (128, 128, 12)),
    96: ((128, 128, 12), None),  # causal: persistent at every length already
    128: ((128, 128, 12), None),
    192: (None, (128, 128, 12)),
    256: (None, None),  # causal persistent was faster at N=1024 but spills 140 bytes above D=192
}


def fp8_fwd_config(head_dim: int, causal: bool, short: bool = False, opts: Options | None = None,
                   variant: MaskVariant = PLAIN) -> KernelConfig:
    """The fp8 forward kernel (Hopper only) for this head dim; ``short`` as in fwd_config. Tuning runs
    may force the tiles (Options.sm90_fp8_tiles) and whether the kernel is persistent
    (Options.sm90_fp8_persistent); ``opts`` defaults to options.current()."""
    opts = opts or options.current()
    bucket = head_dim_bucket(head_dim)
    block_m, block_n, warps, persistent, persistent_causal = _SM90_FWD_FP8[bucket]
    skips = causal or variant.local   # the causal tiles where key tiles are skipped
    persistent = persistent_causal if skips else persistent
    short_tile = _SM90_FWD_FP8_SHORT[bucket][skips] if short else None
    if short_tile is not None:
        (block_m, block_n, warps), persistent = short_tile, True
    if block_m == 192 and not variant.plain:
        block_m, warps = 128, 12   # as fwd_config: no registers for a variant's work at three consumer warpgroups
    block_m, block_n, warps = opts.sm90_fp8_tiles or (block_m, block_n, warps)
    persistent = persistent if opts.sm90_fp8_persistent is None else opts.sm90_fp8_persistent
    family = sm90_fwd_family("overlap", persistent, fp8=True)
    return KernelConfig(family, "float8_e4m3fn", head_dim, causal, block_m, block_n, warps, variant)


def all_fp8_fwd_configs() -> list[KernelConfig]:
    """Every fp8 forward instantiation, short sequences included (for the CPU compile test)."""
    out = [fp8_fwd_config(d, causal, short) for d in range(16, MAX_HEAD_DIM + 1, 16)
           for causal in (False, True) for short in (False, True)]
    return list({c.key(): c for c in out}.values())


# simt_fwd at head dims above 256 (head_dims.py): 256 threads, so that each loads a float4 of every row of Q, K and V
# (576 columns: 144 of them), each query row over 16 threads; 16-row tiles fit in 115 KB of shared memory (sm_80,
# sm_90, sm_100); the 99 KB of sm_86 / sm_89 / sm_120 hold them up to head dim 504 (512 needs 100 KB).
_SIMT_FWD_LARGE = (16, 16, 8)

# simt_fwd (exact float32 on CUDA cores): head-dim bucket -> (block_m, block_n, num_warps).
_SIMT_FWD = {
    32: (64, 64, 4),
    64: (64, 64, 4),
    96: (64, 32, 4),
    128: (64, 32, 4),
    192: (64, 32, 8),
    256: (64, 32, 4),
}


def head_dim_bucket(head_dim: int) -> int:
    for d in TUNED_HEAD_DIMS:
        if head_dim <= d:
            return d
    raise ValueError(f"head_dim {head_dim} is larger than {MAX_HEAD_DIM}")


def fwd_backend(opts: Options | None = None) -> str:
    """Options.fwd_backend ($CUFLASH_FWD_BACKEND): "auto" (the Hopper kernels on compute capability 9.0
    for fp16/bf16, the portable ones elsewhere), "sm80" (force the portable mma.sync kernels), "sm90" or
    "sm90_<kind>" (Hopper, one kernel kind of SM90_FWD_KINDS forced)."""
    return (opts or options.current()).fwd_backend


def fwd_config(dtype: str, head_dim: int, causal: bool, cc: int, backend: str | None = None,
               short: bool = False, long_seqs: bool = False, opts: Options | None = None,
               variant: MaskVariant = PLAIN, head_dim_v: int = 0) -> KernelConfig:
    """The forward kernel for these inputs on a device of compute capability ``cc`` (e.g. 90).

    ``opts`` (default: options.current()) gives the tile overrides and the defaults of ``backend``
    (Options.fwd_backend) and of the cluster mode. ``backend`` "auto" and "sm90" pick the
    Hopper kernels where they apply (cc 9.0, fp16/bf16) with the tuned schedule,
    "sm90_<schedule>" (SM90_FWD_BACKENDS) force one schedule; "sm80" and
    anything else pick the portable kernels. ``short``: seqlen_q <= SM90_FWD_SHORT_SEQLEN_Q and
    seqlen_k <= SM90_FWD_SHORT_SEQLEN_K (the tuned table has its own kernels there, _SM90_FWD_SHORT;
    fwd_short decides). ``long_seqs``: both lengths at least SM90_FWD_CLUSTER_SEQLEN (fwd_long), where
    the table's overlap schedules run in clusters of two CTAs (fwd_cluster_mode). ``variant``: the
    parts of the pattern beyond causal (cuflash/variants.py); a window or chunks take the causal tiles
    (uneven work per query tile, tiles skipped) and no clusters. ``head_dim_v``: v's head dim where it
    differs from ``head_dim`` (0: the same); the tiles are those of the larger of the two, without clusters.
    """
    opts = opts or options.current()
    head_dim_v = 0 if head_dim_v == head_dim else head_dim_v
    backend = opts.fwd_backend if backend is None else backend
    if head_dims.is_large(head_dim, head_dim_v or head_dim):
        return _large_fwd_config(dtype, head_dim, causal, cc, backend, opts, variant, head_dim_v)
    bucket = head_dim_bucket(max(head_dim, head_dim_v))
    skips = causal or variant.local   # the mask policy's kSkipsTiles: the causal table's tiles and kinds
    if backend == "auto":
        backend = "sm90" if cc == 90 else "sm80"
    if backend in SM90_FWD_BACKENDS and cc == 90 and dtype in ("float16", "bfloat16"):
        block_m, block_n, warps, kind, kind_causal = _SM90_FWD[bucket]
        short_tile = _SM90_FWD_SHORT[bucket][skips] if backend == "sm90" and short else None
        if short_tile is not None:
            block_m, block_n, warps, kind = short_tile
            kind_causal = kind
        # An override of the split-V kernel's shape is ignored: 64 rows on 12 warps do not suit the other kernels.
        override = opts.sm90_fwd_tiles if opts.sm90_fwd_tiles != SM90_SPLIT_TILE else None
        block_m, block_n, warps = override or (block_m, block_n, warps)
        schedule, persistent, cluster = SM90_FWD_KINDS[kind_causal if skips else kind]
        if backend != "sm90":
            schedule, persistent, cluster = SM90_FWD_KINDS[backend[len("sm90_"):]]
            if cluster > 1 and (head_dim_v or not fwd_cluster_ok(dtype, head_dim, skips or variant.varlen)):
                cluster = 1   # the plain kernel where clusters do not apply
            if schedule == "overlap" and persistent and bucket == 256:
                persistent = False   # 232 consumer registers: the persistent kernel spills (fp16 causal)
            if schedule == "overlap" and persistent and block_m == 192 and (skips or variant.has_score_mod):
                block_m, warps = 128, 12   # 3 x 160 registers: spills under the mask
            if schedule == "split":   # V must give each consumer warpgroup a 64-column block: else the overlap kernel
                if (head_dim_v or head_dim) > 64:
                    block_m, block_n, warps = SM90_SPLIT_TILE
                else:
                    schedule = "overlap"
        elif schedule == "overlap" and not head_dim_v and fwd_cluster_ok(dtype, head_dim, skips or variant.varlen):
            mode = opts.sm90_fwd_cluster
            if mode == "1" or (mode == "auto" and long_seqs):
                cluster = 2
        if block_m == 192 and not variant.plain and not override:
            # Three consumer warpgroups at 160 registers have none to spare for a variant's per-element work
            # (window bounds, score modifiers, the sink spill there): two warpgroups of 128 rows instead.
            block_m, warps = 128, 12
            schedule, persistent = "overlap", True
        family = sm90_fwd_family(schedule, persistent, cluster)
        return KernelConfig(family, dtype, head_dim, causal, block_m, block_n, warps, variant, head_dim_v)
    if dtype == "float32":
        block_m, block_n, warps = opts.simt_fwd_tiles or _SIMT_FWD[bucket]
        return KernelConfig("simt_fwd", dtype, head_dim, causal, block_m, block_n, warps, variant, head_dim_v)
    block_m, block_n, warps = opts.sm80_fwd_tiles or (
        smem_class(cc) == "large" and _SM80_FWD_LARGE_SMEM.get(bucket)) or _SM80_FWD[bucket]
    return KernelConfig("sm80_fwd", dtype, head_dim, causal, block_m, block_n, warps, variant, head_dim_v)


def _large_fwd_config(dtype: str, head_dim: int, causal: bool, cc: int, backend: str, opts: Options,
                      variant: MaskVariant, head_dim_v: int) -> KernelConfig:
    """fwd_config above head dim 256 (head_dims.py): the split-V kernel on Hopper (fp16 / bf16), the portable
    kernel's column split elsewhere (and with backend "sm80"), the exact float32 kernel anywhere."""
    if dtype == "float32":
        block_m, block_n, warps = opts.simt_fwd_tiles or _SIMT_FWD_LARGE
        return KernelConfig("simt_fwd", dtype, head_dim, causal, block_m, block_n, warps, variant, head_dim_v)
    if cc == 90 and (backend == "auto" or backend in SM90_FWD_BACKENDS):
        return KernelConfig(sm90_fwd_family("split", False), dtype, head_dim, causal, *SM90_SPLIT_TILE, variant,
                            head_dim_v)
    block_m, block_n, warps = opts.sm80_fwd_tiles or _SM80_FWD_LARGE
    return KernelConfig("sm80_fwd", dtype, head_dim, causal, block_m, block_n, warps, variant, head_dim_v)


# The large head dims the CPU compile tests build: 512, MLA's (576, 512), uneven column-block splits (320, 448), a
# narrow V, a V wider than q, a q / k of one column block (dK / dQ in one warpgroup's columns), and head dims that
# are no whole number of 16-column pairs per warp of the portable column split (272, v 80) ((q / k, v), 0: v's is
# q's).
LARGE_TEST_PAIRS = ((512, 0), (576, 512), (320, 0), (448, 0), (576, 128), (128, 512), (64, 512), (272, 0), (512, 80))


def large_fwd_configs(cc: int = 90) -> list[KernelConfig]:
    """The large head dims' forward instantiations the CPU compile tests build for a device of compute capability
    ``cc``: LARGE_TEST_PAIRS, both dtypes and masks, the Hopper kernel (cc 9.0), the portable one (its table tile)
    and float32."""
    out = [fwd_config(dtype, d, causal, cc, head_dim_v=dv, backend=backend) for dtype in ("float16", "bfloat16", "float32")
           for d, dv in LARGE_TEST_PAIRS for causal in (False, True) for backend in ("auto", "sm80")]
    return list({c.key(): c for c in out}.values())


def all_sm90_fwd_configs(backend: str = "sm90") -> list[KernelConfig]:
    """Every instantiation of one sm90 forward family or of the tuned table, short and long sequences
    included (for the CPU compile test and the precompile script)."""
    out = [fwd_config(dtype, d, causal, 90, backend=backend, short=short, long_seqs=long_seqs)
           for short, long_seqs in ((False, False), (True, False), (False, True))
           for dtype in ("float16", "bfloat16") for d in range(8, MAX_HEAD_DIM + 1, 8) for causal in (False, True)]
    return list({c.key(): c for c in out}.values())


# Programmable attention's portable forward (issue #45, family sm80_fwd_prog): the portable table's tile with at
# most 32 keys a tile (S one 32-key sub-tile) and one warp per 16 query rows (O's accumulators halved where a warp
# held two row slices): the bias, dropout's Philox rounds and the tile lists take the registers that the plain
# kernels give to 64-key sub-tiles and 32-row warps (both spilled at d64 / d128, tests/test_compile_programmable.py).
PROG_FWD_MAX_BLOCK_N = 32
# The Hopper one (sm90_fwd_prog): at most 64 keys a tile, 32 at head dim 256 (128, or 64 at 256, spilled with the
# bias's loads, Philox's rounds, the lists' partial bits or a modifier's registers beside S, P and O).
PROG_SM90_FWD_MAX_BLOCK_N = 64


def prog_fwd_config(dtype: str, head_dim: int, causal: bool, cc: int, variant: MaskVariant,
                    head_dim_v: int = 0, opts: Options | None = None) -> KernelConfig:
    """The programmable forward's instantiation (variant: with its programmable parts) for a device of ``cc``
    (the caller fits it to the device's shared memory): on Hopper, 16-bit, head dims up to 256, dense, the
    overlap schedule's kernel (sm90_fwd_prog) with the table's tile (two consumer warpgroups), unless
    Options.fwd_backend asks for the portable kernels; elsewhere the portable one (sm80_fwd_prog)."""
    from dataclasses import replace

    if dtype == "float32":
        return prog_simt_fwd_config(head_dim, causal, cc, variant, head_dim_v=head_dim_v, opts=opts)
    opts = opts or options.current()
    if (cc == 90 and dtype in ("float16", "bfloat16") and opts.fwd_backend in ("auto",) + SM90_FWD_BACKENDS
            and not variant.varlen and not head_dims.is_large(head_dim, head_dim_v or head_dim)):
        block_m, block_n, warps, _, _ = _SM90_FWD[head_dim_bucket(max(head_dim, head_dim_v))]
        if block_m == 192:
            block_m, warps = 128, 12   # three warpgroups have no registers to spare for the per-element parts
        block_n = min(block_n, PROG_SM90_FWD_MAX_BLOCK_N if head_dim_bucket(max(head_dim, head_dim_v)) < 256 else 32)
        if opts.sm90_fwd_tiles is not None and opts.sm90_fwd_tiles != SM90_SPLIT_TILE:   # (tuning)
            block_m, block_n, warps = opts.sm90_fwd_tiles
        return KernelConfig("sm90_fwd_prog", dtype, head_dim, causal, block_m, block_n, warps, variant,
                            0 if head_dim_v == head_dim else head_dim_v)
    base = fwd_config(dtype, head_dim, causal, cc, backend="sm80", variant=variant, head_dim_v=head_dim_v)
    return replace(base, family="sm80_fwd_prog", block_n=min(base.block_n, PROG_FWD_MAX_BLOCK_N),
                   num_warps=max(base.num_warps, base.block_m // 16))


def prog_simt_fwd_config(head_dim: int, causal: bool, cc: int, variant: MaskVariant, head_dim_v: int = 0,
                         opts: Options | None = None) -> KernelConfig:
    """The programmable forward in float32 (simt_fwd_prog, any GPU): the plain float32 kernel's tile (its table,
    Options.simt_fwd_tiles), which the bias's loads, Philox's rounds, the lists and a modifier leave without spills
    (tests/test_compile_programmable.py); head dims up to MAX_HEAD_DIM (above, the plain kernel's 16-row tile
    narrows to 8 rows on GPUs of 99 KB, less than dropout's 16 x 16 blocks)."""
    from dataclasses import replace

    if head_dims.is_large(head_dim, head_dim_v or head_dim):
        raise ValueError(f"bias, dropout, block masks and modifiers take head dims up to {MAX_HEAD_DIM} in float32 so "
                         f"far, got {head_dim} (v {head_dim_v or head_dim})")
    base = fwd_config("float32", head_dim, causal, cc, variant=variant, head_dim_v=head_dim_v, opts=opts)
    return replace(base, family="simt_fwd_prog")


def all_fwd_configs(cc: int, backend: str = "sm80") -> list[KernelConfig]:
    """Every forward instantiation of a backend (default: the portable kernels, which every GPU
    may run; the Hopper ones are all_sm90_fwd_configs) for the CPU compile tests."""
    out = []
    for dtype in ("float16", "bfloat16", "float32"):
        for d in range(8, MAX_HEAD_DIM + 1, 8):
            for causal in (False, True):
                out.append(fwd_config(dtype, d, causal, cc, backend=backend))
    return out


# ---------------------------------------------------------------------------
# Backward. Kernels are instantiated per head-dim bucket (the run-time head_dim
# masks columns), so untuned head dims reuse the bucket's compiled kernels.
# Tiles are (block_m, block_n, num_warps); tables for devices with >= 160 KB of
# shared memory per block (sm_80, sm_87, sm_90, sm_100) and for ~99 KB (sm_86,
# sm_89, sm_120).

# dK/dV kernel (block_n keys held per CTA, block_m query rows streamed), deterministic mode
# (dQ by its own kernel).
_SM80_BWD_DKDV = {
    "large": {32: (64, 128, 8), 64: (64, 128, 8), 96: (64, 128, 8), 128: (64, 64, 8),
              192: (64, 64, 8), 256: (64, 64, 8)},
    "small": {32: (64, 128, 8), 64: (64, 128, 8), 96: (64, 64, 8), 128: (64, 64, 8),
              192: (32, 64, 8), 256: (32, 32, 4)},
}
# dK/dV kernel with atomic dQ (the default mode). d=128 takes (32,128,8): (64,128,8) is faster on an
# H100 but spills on sm_80; d=64 (64,128,8) is the best tile without spills.
_SM80_BWD_DKDV_DQ = {
    "large": {32: (64, 128, 8), 64: (64, 128, 8), 96: (64, 128, 8), 128: (32, 128, 8),
              192: (64, 64, 8), 256: (64, 64, 8)},
    "small": {32: (64, 128, 8), 64: (64, 128, 8), 96: (64, 64, 8), 128: (64, 64, 8),
              192: (32, 64, 8), 256: (32, 32, 4)},
}
# Head-dim buckets where the dQ kernel beats the atomic dQ even when determinism is not asked
# for (d=256: a quarter less time): both modes run the same kernels.
_BWD_DQ_KERNEL_ALWAYS = (192, 256)
# dQ kernel of the deterministic mode (block_m query rows per CTA, block_n keys streamed).
_SM80_BWD_DQ = {
    "large": {32: (64, 128, 4), 64: (64, 128, 4), 96: (64, 64, 4), 128: (64, 64, 4),
              192: (64, 32, 4), 256: (64, 32, 4)},
    "small": {32: (64, 128, 4), 64: (64, 128, 4), 96: (64, 64, 4), 128: (64, 64, 4),
              192: (64, 32, 4), 256: (32, 32, 2)},
}
# dK/dV kernel version 2 (Q/dO ring, two barriers per step, 2-D warp grids, swizzled rows at d=64 / 128;
# kernels_cu/sm80/bwd.cu bwd_dkdv2_*), the default where its table has the head-dim bucket, per shared-memory budget:
# "h100" for devices with >= 200 KB per block (sm_90, sm_100), the A100's 163 KB ("large"), the 99 KB cards' ("small":
# sm_86 / sm_89 / sm_120); d=192 / 256 keep version 1 (with the dQ kernel). Measured with dev/ab.py run bwd (version
# 1 by @CUFLASH_SM80_BWD_VARIANT=1; BENCHMARKS.md, "Portable kernels against FlashAttention-2"): backward alone
# 1.25-1.35x version 1 at d=32 / 64 / 96 / 128 on both tables ((128,128,8) would be faster still but spills 8
# bytes). Unpadded (swizzled) rows let the A100 keep two dO stages at d=128 with (64, 128, 8) (1.05x one stage) and
# the 99 KB cards take (64, 128, 8) at d=64 and (64, 64, 8) with one dO stage at d=128 (97 KB; padded, 104 KB).
_SM80_BWD_DKDV2 = {
    "h100": {32: (64, 128, 8), 64: (64, 128, 8), 96: (64, 128, 8), 128: (64, 128, 8)},
    "large": {32: (64, 128, 8), 64: (64, 128, 8), 96: (64, 128, 8), 128: (64, 128, 8)},
    "small": {32: (64, 128, 8), 64: (64, 128, 8), 96: (64, 64, 8), 128: (64, 64, 8)},
}
# Where version 2 keeps dO in one stage (the *_do1 families): two would not fit the budget.
_SM80_BWD_DKDV2_ONE_DO_STAGE = {"small": (128,)}
DKDV2_H100_SMEM = 200 * 1024   # the least opt-in shared memory of the "h100" table


def _dkdv2_table_name(cc: int) -> str:
    """The name of version 2's table for a device of compute capability ``cc`` (its shared-memory budget's)."""
    return "h100" if SMEM_OPTIN.get(cc, 0) >= DKDV2_H100_SMEM else smem_class(cc)


def _dkdv2_table(cc: int) -> dict:
    """Version 2's tiles for a device of compute capability ``cc``."""
    return _SM80_BWD_DKDV2[_dkdv2_table_name(cc)]


def bwd_variant(cc: int, bucket: int, opts: Options | None = None) -> int:
    """dK/dV kernel version: 2 where its table has the bucket, unless Options.sm80_bwd_variant is 1."""
    if bucket not in _dkdv2_table(cc):
        return 1
    return (opts or options.current()).sm80_bwd_variant


# float32 (CUDA cores): one tile shape for the dK/dV and the dQ kernel.
_SIMT_BWD = {
    "large": {d: (32, 32, 8) for d in TUNED_HEAD_DIMS},
    "small": {32: (32, 32, 8), 64: (32, 32, 8), 96: (32, 32, 8), 128: (32, 32, 8),
              192: (16, 16, 8), 256: (16, 16, 8)},
}
# Above head dim 256 (float32 only: 16-bit takes large_bwd_configs), one instantiation for every head dim (the
# run-time head dim zero-fills the rest): 16-row tiles in 151 KB of shared memory (sm_80, sm_90, sm_100); the dK / dV
# kernel on 8 warps, whose dK and dV rows (144 float4 chunks each) spilled on 4, the dQ kernel on 4 (8 spilled).
LARGE_BWD_BUCKET = 576
_SIMT_BWD_LARGE = ((16, 16, 8), (16, 16, 4))   # dK / dV, dQ
# sm90 dK/dV with tiled dQ (wgmma, TMA; the default on cc 9.0 for fp16/bf16): head-dim bucket ->
# (block_m, block_n, num_warps); one producer and two consumer warpgroups: block_n = 128, 64 keys
# each, or block_n = 64 (split-D, head dims 192 / 256): both compute S^T / dP^T of the same 64 keys
# and each owns half of the head dim of dK, dV and dQ (one dS copy per warpgroup). Buckets 32 / 96 run
# on head dims padded to 64 / 128 (TMA zero fill). 128-row query tiles at d <= 64, causal too: they
# spilled under the mask until the warpgroup index was made warp-uniform, and are faster since. 1.1-1.6x
# the portable kernels at every bucket. Float32 and other GPUs keep the sm80 / simt kernels.
_SM90_BWD = {32: (128, 128, 12), 64: (128, 128, 12), 96: (64, 128, 12), 128: (64, 128, 12),
             192: (64, 64, 12), 256: (64, 64, 12)}
# The sm90 backward's dQ slices reach global memory through shared memory and one bulk reduce per slice
# into a tiled dq_accum (the deterministic mode: the same, in a fixed order), which replaced the slower
# red.global.add per element pair (the atomic mode, deleted; docs/experiments.md).

# CUFLASH_BWD_BACKEND values that select the sm90 backward.
SM90_BWD_BACKENDS = ("sm90",)
# Pre/postprocess: 8 threads per query row, 4 * num_warps rows per CTA.
BWD_AUX_WARPS = 8


# Opt-in shared memory per block (bytes) of the compute capabilities the tables know (options.PLAN_CCS, the values
# CUFLASH_PLAN_CC takes): 163 KB on sm_80 / sm_87, 227 KB on sm_90 and the datacenter Blackwells (sm_100 / 101 /
# 103 / 110), 99 KB on sm_86 / sm_89 and the consumer Blackwells (sm_120 / 121).
SMEM_OPTIN = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: SM90_SMEM_OPTIN, 100: SM90_SMEM_OPTIN,
              101: SM90_SMEM_OPTIN, 103: SM90_SMEM_OPTIN, 110: SM90_SMEM_OPTIN, 120: 101376, 121: 101376}
LARGE_SMEM_CLASS = 160 * 1024   # the least opt-in shared memory of the 'large' tables


def smem_class(cc: int) -> str:
    """'large' where a block may use >= 160 KB of shared memory (SMEM_OPTIN), else 'small' (~99 KB; a compute
    capability the tables do not know takes these too)."""
    return "large" if SMEM_OPTIN.get(cc, 0) >= LARGE_SMEM_CLASS else "small"


class BwdConfigs:
    """The kernels of one backward call: preprocess, dkdv, then dq (its own dQ kernel: the portable
    deterministic mode, float32) or postprocess (converting the float32 dQ sums); the unused one is None."""

    __slots__ = ("preprocess", "dkdv", "dq", "postprocess")

    def __init__(self, preprocess, dkdv, dq, postprocess):
        self.preprocess, self.dkdv, self.dq, self.postprocess = preprocess, dkdv, dq, postprocess

    def all(self) -> list[KernelConfig]:
        return [c for c in (self.preprocess, self.dkdv, self.dq, self.postprocess) if c is not None]


def _aux_config(family: str, dtype: str) -> KernelConfig:
    return KernelConfig(family, dtype, 0, False, 4 * BWD_AUX_WARPS, 0, BWD_AUX_WARPS)


# sm90 backward on short key sequences (bwd_short), head dims <= 64: one consumer warpgroup of 64
# keys per CTA stepping over 64-row query tiles, two CTAs per SM (kernels_cu/sm90/bwd.cu,
# Sm90BwdTile): one CTA's start and end overlap the other's steps, at the price of m64n64 GEMMs. It wins
# by 3-7 % up to 512 keys (1024 causal) and loses beyond (N=4096: 13 %).
_SM90_BWD_SHORT = {32: (64, 64, 8), 64: (64, 64, 8)}
SM90_BWD_SHORT_SEQLEN_K = 512
SM90_BWD_SHORT_SEQLEN_K_CAUSAL = 1024


def bwd_short(seqlen_k: int, causal: bool, opts: Options | None = None) -> bool:
    """Whether bwd_configs takes these inputs as short (its ``short``); Options.sm90_bwd_short
    ($CUFLASH_SM90_BWD_SHORT) True / False forces it on / off."""
    forced = (opts or options.current()).sm90_bwd_short
    if forced is not None:
        return forced
    return seqlen_k <= (SM90_BWD_SHORT_SEQLEN_K_CAUSAL if causal else SM90_BWD_SHORT_SEQLEN_K)


def bwd_configs(dtype: str, head_dim: int, causal: bool, cc: int, deterministic: bool = False,
                backend: str | None = None, short: bool = False, opts: Options | None = None,
                variant: MaskVariant = PLAIN) -> BwdConfigs:
    """The backward kernels for these inputs on a device of compute capability ``cc``.

    ``opts`` (default: options.current()) gives the tile overrides, the dK/dV kernel version and the
    default of ``backend`` (Options.bwd_backend). ``backend`` "sm90" picks the Hopper dK/dV + dQ kernel
    where it applies (cc 9.0, fp16/bf16, head-dim buckets of _SM90_BWD; the deterministic mode adds the
    dQ slices in a fixed order), ``short`` (bwd_short) the tiles of _SM90_BWD_SHORT where it has the
    head dim.
    """
    pre = _aux_config("bwd_preprocess", dtype)
    if head_dim > MAX_HEAD_DIM:   # the large head dims (head_dims.py): float32 here, 16-bit in large_bwd_configs
        if dtype != "float32":
            raise ValueError(f"bwd_configs: head dim {head_dim} in {dtype} takes large_bwd_configs")
        forced = (opts or options.current()).simt_bwd_tiles
        dkdv, dq = (forced, forced) if forced else _SIMT_BWD_LARGE
        return BwdConfigs(pre, KernelConfig("simt_bwd_dkdv", dtype, LARGE_BWD_BUCKET, causal, *dkdv, variant),
                          KernelConfig("simt_bwd_dq", dtype, LARGE_BWD_BUCKET, causal, *dq, variant), None)
    bucket = head_dim_bucket(head_dim)
    size = smem_class(cc)
    opts = opts or options.current()
    backend = opts.bwd_backend if backend is None else backend
    if backend == "auto":
        backend = "sm90" if cc == 90 else "sm80"
    if backend in SM90_BWD_BACKENDS and cc == 90 and dtype in ("float16", "bfloat16") and bucket in _SM90_BWD:
        bm, bn, w = opts.sm90_bwd_tiles or (short and _SM90_BWD_SHORT.get(bucket)) or _SM90_BWD[bucket]
        if (bm == 128 and causal and variant.has_score_mod and not variant.local and bucket <= 64
                and not opts.sm90_bwd_tiles):
            bm = 64   # a score modifier's per-element work spills 128-row causal query steps there
        family = "sm90_bwd_dkdv_dqtile_ordered" if deterministic else "sm90_bwd_dkdv_dqtile"
        post = KernelConfig("bwd_postprocess_tiled", dtype, bucket, False, bm, 0, BWD_AUX_WARPS)
        return BwdConfigs(pre, KernelConfig(family, dtype, bucket, causal, bm, bn, w, variant), None, post)
    if dtype == "float32":
        bm, bn, w = opts.simt_bwd_tiles or _SIMT_BWD[size][bucket]
        return BwdConfigs(pre, KernelConfig("simt_bwd_dkdv", dtype, bucket, causal, bm, bn, w, variant),
                          KernelConfig("simt_bwd_dq", dtype, bucket, causal, bm, bn, w, variant), None)
    v2 = bwd_variant(cc, bucket, opts) == 2
    do1 = "_do1" if v2 and bucket in _SM80_BWD_DKDV2_ONE_DO_STAGE.get(_dkdv2_table_name(cc), ()) else ""
    if deterministic or bucket in _BWD_DQ_KERNEL_ALWAYS:
        bm, bn, w = opts.sm80_bwd_dkdv_tiles or (_dkdv2_table(cc)[bucket] if v2 else _SM80_BWD_DKDV[size][bucket])
        dkdv = KernelConfig("sm80_bwd_dkdv2" + do1 if v2 else "sm80_bwd_dkdv", dtype, bucket, causal, bm, bn, w,
                            variant)
        qm, qn, qw = opts.sm80_bwd_dq_tiles or _SM80_BWD_DQ[size][bucket]
        return BwdConfigs(pre, dkdv, KernelConfig("sm80_bwd_dq", dtype, bucket, causal, qm, qn, qw, variant), None)
    bm, bn, w = opts.sm80_bwd_dkdv_tiles or (_dkdv2_table(cc)[bucket] if v2 else _SM80_BWD_DKDV_DQ[size][bucket])
    dkdv = KernelConfig("sm80_bwd_dkdv2_dq" + do1 if v2 else "sm80_bwd_dkdv_dq", dtype, bucket, causal, bm, bn, w,
                        variant)
    return BwdConfigs(pre, dkdv, None, _aux_config("bwd_postprocess", dtype))


def prog_bwd_configs(dtype: str, head_dim: int, causal: bool, cc: int, variant: MaskVariant,
                     deterministic: bool = False, opts: Options | None = None,
                     bias_per_query: bool = True) -> BwdConfigs:
    """Programmable attention's backward (issue #45). On Hopper (16-bit, the Hopper backward's head dims, not
    deterministic, unless Options.bwd_backend asks for the portable kernels): the preprocess, the Hopper dK / dV
    kernel with dQ in tiles (sm90_bwd_dkdv_dqtile_prog) and the tiled postprocess, as the plain backward's.
    Elsewhere: the preprocess, the portable dK / dV kernel version 1 and the dQ kernel, as the deterministic
    mode's (dbias and the modifiers' tensor gradients come from the dK / dV pass alone), in their programmable
    families; head dims up to MAX_HEAD_DIM. ``bias_per_query``: the bias has rows per query (not broadcast over
    them, as key padding is), whose reads the split-D tiles load ahead."""
    if dtype == "float32":
        return prog_simt_bwd_configs(head_dim, causal, cc, variant, opts=opts)
    opts = opts or options.current()
    if (cc == 90 and not deterministic and opts.bwd_backend in ("auto",) + SM90_BWD_BACKENDS
            and dtype in ("float16", "bfloat16") and head_dim <= MAX_HEAD_DIM and not variant.varlen):
        plain = bwd_configs(dtype, head_dim, causal, 90, backend="sm90", opts=opts, variant=variant)
        if plain.dkdv.fam.sm90_bwd:
            from dataclasses import replace

            bm, bn, w = plain.dkdv.block_m, plain.dkdv.block_n, plain.dkdv.num_warps
            bucket = head_dim_bucket(head_dim)
            if not opts.sm90_bwd_tiles:
                # 64-row query steps: the per-element parts beside 128 rows spilled (dropout at d64); with
                # dropout's rounds, a modifier or a bias with rows per query at 65..128, split-D tiles (two
                # warpgroups on the same 64 keys; the bias's reads then go ahead of the step's GEMMs, 1.3x on a
                # (1, H, N, N) bias; a key-padding bias's reads are warp broadcasts, 64 x 128 stays faster).
                bm = 64
                if bucket in (96, 128) and (variant.dropout or variant.mods or (variant.bias and bias_per_query)):
                    bn, w = 64, 12
            post = replace(plain.postprocess, block_m=bm)
            return BwdConfigs(plain.preprocess, KernelConfig("sm90_bwd_dkdv_dqtile_prog", dtype, bucket, causal, bm, bn,
                                                             w, variant), None, post)
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"bias, dropout, block masks and modifiers take head dims up to {MAX_HEAD_DIM} in the "
                         f"backward so far, got {head_dim}")
    bucket = head_dim_bucket(head_dim)
    size = smem_class(cc)
    dkdv = KernelConfig("sm80_bwd_dkdv_prog", dtype, bucket, causal, *_SM80_BWD_DKDV[size][bucket], variant)
    qm, qn, qw = _SM80_BWD_DQ[size][bucket]
    # At most 64 keys a step: S of 128 keys beside the bias's reads spilled (d32).
    dq = KernelConfig("sm80_bwd_dq_prog", dtype, bucket, causal, qm, min(qn, 64), qw, variant)
    return BwdConfigs(_aux_config("bwd_preprocess", dtype), dkdv, dq, None)


def prog_simt_bwd_configs(head_dim: int, causal: bool, cc: int, variant: MaskVariant,
                          opts: Options | None = None) -> BwdConfigs:
    """The programmable backward in float32 (any GPU, deterministic anyway): the preprocess, then the plain float32
    pair's tiles (their table per shared-memory class, Options.simt_bwd_tiles) in their programmable families,
    simt_bwd_dkdv_prog (dK / dV, dbias, the modifiers' tensor gradients) and simt_bwd_dq_prog; head dims up to
    MAX_HEAD_DIM."""
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"bias, dropout, block masks and modifiers take head dims up to {MAX_HEAD_DIM} in the "
                         f"backward so far, got {head_dim}")
    from dataclasses import replace

    plain = bwd_configs("float32", head_dim, causal, cc, deterministic=True, opts=opts, variant=variant)
    return BwdConfigs(plain.preprocess, replace(plain.dkdv, family="simt_bwd_dkdv_prog"),
                      replace(plain.dq, family="simt_bwd_dq_prog"), None)


# The Hopper backward of the large head dims (kernels_cu/sm90/bwd_split.cu): one kernel per gradient, 64 rows.
SPLIT_BWD_PRODUCTS = ("dv", "dk", "dq")


def split_bwd_smem(product: str, head_dim: int, head_dim_v: int, block_n: int) -> int:
    """BwdSplitTile::kSmemBytes: the 1024-byte alignment slack, the rows' tiles (dV: K alone; dK, dQ: two), the
    step's two tiles of block_n rows, the weights (64 x 64 16-bit), P in float32 (dK, dQ) and five mbarriers."""
    pad_qk, pad_v = (head_dim + 63) // 64 * 64, (head_dim_v + 63) // 64 * 64
    has_dp = product != "dv"
    return (1024 + 64 * pad_qk * 2 + (64 * pad_v * 2 if has_dp else 0) + block_n * (pad_qk + pad_v) * 2
            + 64 * 64 * 2 + (64 * block_n * 4 if has_dp else 0) + 8 * 5)


def large_bwd_configs(dtype: str, head_dim: int, head_dim_v: int, causal: bool, cc: int,
                      variant: MaskVariant = PLAIN) -> tuple[KernelConfig, ...]:
    """The backward at head dims above 256 (head_dims.py): (preprocess, dV, dK, dQ) kernels, Hopper and fp16 /
    bf16 only (ValueError elsewhere). Each step takes 64 rows of the other side where they fit, else 32."""
    if cc != 90 or dtype not in ("float16", "bfloat16"):
        raise ValueError(f"the {dtype} backward at head dims above {MAX_HEAD_DIM} (q / k {head_dim}, v {head_dim_v}) "
                         f"runs on Hopper GPUs (compute capability 9.0) only, for now; this is compute capability "
                         f"{cc // 10}.{cc % 10}: float32 inputs take the exact kernels on every GPU")
    dv = 0 if head_dim_v == head_dim else head_dim_v
    out = [_aux_config("bwd_preprocess", dtype)]
    for product in SPLIT_BWD_PRODUCTS:
        block_n = 64 if split_bwd_smem(product, head_dim, head_dim_v, 64) <= SM90_SMEM_OPTIN else 32
        out.append(KernelConfig(f"sm90_bwd_split_{product}", dtype, head_dim, causal, 64, block_n, 12, variant, dv))
    return tuple(out)


def all_large_bwd_configs() -> list[KernelConfig]:
    """The large head dims' backward kernels the CPU compile tests build (the pairs of large_fwd_configs, both
    dtypes and masks; the preprocess is the ordinary one)."""
    out = [c for dtype in ("float16", "bfloat16") for d, dv in LARGE_TEST_PAIRS for causal in (False, True)
           for c in large_bwd_configs(dtype, d, dv or d, causal, 90)[1:]]
    return list({c.key(): c for c in out}.values())


def all_bwd_configs(cc: int, backend: str = "sm80") -> list[KernelConfig]:
    """Every backward instantiation of a backend (default: the portable kernels; the Hopper ones
    are all_sm90_bwd_configs) for the CPU compile tests."""
    seen: dict[str, KernelConfig] = {}
    for dtype in ("float16", "bfloat16", "float32"):
        for d in TUNED_HEAD_DIMS:
            for causal in (False, True):
                for det in (False, True):
                    for cfg in bwd_configs(dtype, d, causal, cc, det, backend=backend).all():
                        seen.setdefault(cfg.key(), cfg)
    return list(seen.values())


def all_sm90_bwd_configs() -> list[KernelConfig]:
    """Every sm90 backward instantiation (CUFLASH_BWD_BACKEND=sm90, deterministic or not, short
    sequences included) and their tiled postprocess, for the CPU compile tests."""
    seen: dict[str, KernelConfig] = {}
    for dtype in ("float16", "bfloat16"):
        for d in TUNED_HEAD_DIMS:
            for causal in (False, True):
                for det in (False, True):
                    for short in (False, True):
                        for cfg in bwd_configs(dtype, d, causal, 90, det, backend="sm90", short=short).all():
                            if cfg.fam.arch_specific or cfg.family == "bwd_postprocess_tiled":
                                seen.setdefault(cfg.key(), cfg)
    return list(seen.values())


def fit_shared_memory(config: KernelConfig, smem_limit: int, smem_of) -> KernelConfig:
    """``config``, or a smaller tile of the same family whose shared memory fits ``smem_limit``.

    The tables are tuned for the H100 (227 KB per block); GPUs with 99 KB (sm_86, sm_89, sm_120)
    or 163 KB (A100) get narrower key tiles first, then fewer query rows.
    """
    from dataclasses import replace

    cfg = config
    while smem_of(cfg) > smem_limit:
        if cfg.block_n > 16:
            cfg = replace(cfg, block_n=cfg.block_n // 2)
        elif cfg.block_m > 16 * cfg.num_warps:
            cfg = replace(cfg, block_m=cfg.block_m // 2)
        elif cfg.num_warps > 1:
            cfg = replace(cfg, block_m=cfg.block_m // 2, num_warps=cfg.num_warps // 2)
        else:
            raise RuntimeError(f"{config.key()} cannot fit in {smem_limit} bytes of shared memory")
    return cfg
