"""KernelConfig: everything that selects one compiled kernel instantiation."""
from __future__ import annotations

from dataclasses import dataclass

from .variants import PLAIN, MaskVariant

# dtype name -> element tag of kernels_cu/common/numeric.cuh (fp32 kernels take `float`).
DTYPE_TAGS = {"float16": "f16_tag", "bfloat16": "bf16_tag", "float32": "float", "float8_e4m3fn": "e4m3_tag"}


DIRECTIONS = ("fwd", "bwd", "decode", "aux")
BACKENDS = ("sm80", "simt", "sm90", "aux")
SCHEDULES = ("simple", "overlap", "split")
DQ_MODES = ("atomic", "kernel", "tile", "ordered")
# The dQ modes whose float32 sums are laid out in query tiles (bwd_postprocess_tiled converts them).
TILED_DQ_MODES = ("tile", "ordered")


@dataclass(frozen=True)
class Family:
    """One kernel family: a source file, a kernel template in it, and what kind of kernel it is.

    The typed fields below say what the dispatcher and the launch need to know about a family (grid,
    shared memory, extra arguments); nothing reads them out of the family's name.
    """

    name: str
    source: str          # path under kernels_cu/
    kernel: str          # template name
    min_cc: int          # lowest compute capability (e.g. 80)
    arch_specific: bool  # needs the "a" target (sm_90a): wgmma, setmaxnreg
    # KernelConfig fields passed as template arguments, in order ("tag" is the dtype's tag, "mask" the
    # MaskVariant type built from causal and variant: kernels_cu/common/mask.cuh).
    template: tuple = ("tag", "head_dim", "block_m", "block_n", "num_warps", "mask")
    direction: str = "aux"        # "fwd" | "bwd" | "decode" (KV cache) | "aux" (helpers: pre/postprocess, fp8, ring)
    backend: str = "aux"          # "sm80" (mma.sync) | "simt" (float32) | "sm90" (wgmma, TMA) | "aux"
    schedule: str | None = None   # sm90 forward consumer schedule: "simple" | "overlap" | "split"
    persistent: bool = False      # one CTA per SM walking the tiles (grid = min(tiles, SMs))
    cluster: int = 1              # CTAs per thread-block cluster (TMA multicast of K / V)
    # How a dK/dV kernel's dQ reaches memory: "atomic" (float32 atomics into dq_accum), "kernel" (dQ by
    # its own kernel), "tile" (sm90: bulk reduces into a tiled dq_accum), "ordered" (the same, in a fixed
    # order: deterministic); None for other kernels.
    dq_mode: str | None = None
    fp8: bool = False             # e4m3 inputs, V transposed (cuflash/fp8.py)
    # Whether the kernel takes dynamic shared memory: its source then exports the size as
    # ``<kernel>_smem_bytes<same template arguments>`` (KernelConfig.smem_expression), which the dispatcher
    # reads from the compiled module (dispatch.smem_bytes); False: none (the aux kernels).
    dynamic_smem: bool = True
    # Whether the kernel takes programmable attention's parameters (ProgParams, issue #45) after its others.
    prog: bool = False
    # Constant template arguments after the ones from KernelConfig fields: what sets a family apart from another
    # of the same kernel template (e.g. dK/dV version 2 with dO in one stage).
    template_consts: tuple = ()

    def __post_init__(self) -> None:
        for field, value, allowed in (("direction", self.direction, DIRECTIONS), ("backend", self.backend, BACKENDS),
                                      ("schedule", self.schedule, (None,) + SCHEDULES),
                                      ("dq_mode", self.dq_mode, (None,) + DQ_MODES)):
            if value not in allowed:
                raise ValueError(f"Family {self.name!r}: {field} must be one of {allowed}, got {value!r}")
        for field in ("persistent", "fp8", "arch_specific", "dynamic_smem", "prog"):
            if not isinstance(getattr(self, field), bool):
                raise TypeError(f"Family {self.name!r}: {field} must be a bool, got {getattr(self, field)!r}")
        if not isinstance(self.template_consts, tuple) or not all(
                type(c) is int for c in self.template_consts):
            raise TypeError(f"Family {self.name!r}: template_consts must be a tuple of ints, got {self.template_consts!r}")
        if isinstance(self.cluster, bool) or not isinstance(self.cluster, int) or self.cluster < 1:
            raise ValueError(f"Family {self.name!r}: cluster must be a positive int, got {self.cluster!r}")

    @property
    def sm90_fwd(self) -> bool:
        """A Hopper forward kernel (fp16/bf16 or fp8): TMA loads, the 1-D causal grid."""
        return self.backend == "sm90" and self.direction == "fwd"

    @property
    def sm90_bwd(self) -> bool:
        """A Hopper dK/dV kernel."""
        return self.backend == "sm90" and self.direction == "bwd"


def _sm90_fwd(name: str, kernel: str, schedule: str, persistent: bool = False, cluster: int = 1,
              fp8: bool = False, prog: bool = False) -> Family:
    return Family(name, "sm90/fwd.cu", kernel, 90, True, ("tag", "head_dim", "block_m", "block_n", "num_warps", "mask"),
                  direction="fwd", backend="sm90", schedule=schedule, persistent=persistent, cluster=cluster, fp8=fp8,
                  prog=prog)


def _bwd(name: str, source: str, kernel: str, backend: str, dq_mode: str | None, min_cc: int = 80,
         prog: bool = False, template_consts: tuple = ()) -> Family:
    return Family(name, source, kernel, min_cc, backend == "sm90", direction="bwd", backend=backend, dq_mode=dq_mode,
                  prog=prog, template_consts=template_consts)


def _aux(name: str, source: str, kernel: str, min_cc: int, template: tuple) -> Family:
    return Family(name, source, kernel, min_cc, False, template, dynamic_smem=False)


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("sm80_fwd", "sm80/fwd.cu", "fwd_kernel", 80, False, direction="fwd", backend="sm80"),
    Family("simt_fwd", "simt/fwd.cu", "fwd_kernel", 80, False, direction="fwd", backend="simt"),
    # Programmable attention (issue #45: bias, dropout, block sparsity, user modifiers; the variant's
    # programmable parts): the same kernels with ProgParams as a second parameter.
    Family("sm80_fwd_prog", "sm80/fwd.cu", "fwd_prog_kernel", 80, False, direction="fwd", backend="sm80", prog=True),
    Family("simt_fwd_prog", "simt/fwd.cu", "fwd_prog_kernel", 80, False, direction="fwd", backend="simt", prog=True),
    # Hopper only (wgmma, TMA, setmaxnreg). Schedules: "simple" (each consumer warpgroup on its own),
    # "overlap" (the softmax of key tile i overlaps P V of tile i-1).
    _sm90_fwd("sm90_fwd_overlap", "fwd_overlap_kernel", "overlap"),
    # Persistent kernels (grid = min(tiles, SMs); launch.fwd_grid).
    _sm90_fwd("sm90_fwd_p", "fwd_persistent_kernel", "simple", persistent=True),
    _sm90_fwd("sm90_fwd_overlap_p", "fwd_overlap_persistent_kernel", "overlap", persistent=True),
    # The overlap schedule in clusters of two CTAs sharing K / V loads (TMA multicast), one CTA per tile
    # or persistent: not causal, 16-bit, head dims 65..128 and 193..256 (heuristics.fwd_cluster_ok).
    _sm90_fwd("sm90_fwd_overlap_x2", "fwd_overlap_x2_kernel", "overlap", cluster=2),
    # Head dims above 256: 64-row tiles whose O columns are split over two consumer warpgroups, one of which
    # computes S and the softmax for both (kernels_cu/sm90/fwd_split.cuh); one CTA per tile.
    _sm90_fwd("sm90_fwd_split", "fwd_split_kernel", "split"),
    _sm90_fwd("sm90_fwd_overlap_x2_p", "fwd_overlap_x2_persistent_kernel", "overlap", persistent=True, cluster=2),
    # Programmable attention (issue #45) on the overlap schedule, one CTA per tile, ProgParams after the maps.
    _sm90_fwd("sm90_fwd_prog", "fwd_prog_overlap_kernel", "overlap", prog=True),
    # fp8 (e4m3) inputs with V transposed (cuflash/fp8.py), the overlap schedule; one CTA per tile or
    # persistent.
    _sm90_fwd("sm90_fwd_fp8", "fwd_fp8_kernel", "overlap", fp8=True),
    _sm90_fwd("sm90_fwd_fp8_p", "fwd_fp8_persistent_kernel", "overlap", persistent=True, fp8=True),
    # fp8 helpers: V -> V^T in the P-fragment key order, and per-tensor quantisation (tag: the input's).
    _aux("fp8_transpose_v", "aux/fp8.cu", "fp8_transpose_v_kernel", 89, ("num_warps",)),
    _aux("fp8_amax", "aux/fp8.cu", "fp8_amax_kernel", 89, ("tag", "num_warps")),
    _aux("fp8_quantize", "aux/fp8.cu", "fp8_quantize_kernel", 89, ("tag", "num_warps")),
    # Ring attention (cuflash/distributed): merging the steps' partial results in float32 (tag: the inputs').
    _aux("ring_merge", "aux/ring.cu", "ring_merge_kernel", 80, ("tag", "num_warps")),
    _aux("ring_accumulate", "aux/ring.cu", "ring_accumulate_kernel", 80, ("tag", "num_warps")),
    _aux("ring_convert", "aux/ring.cu", "ring_convert_kernel", 80, ("tag", "num_warps")),
    # Decoding over a KV cache (cuflash/kvcache.py): split-KV, paged, GQA packed (block_m: packed query rows
    # per CTA; head_dim / head_dim_v: 64-column buckets), and the merge of split results (tag: the output's).
    Family("decode", "decode/decode.cu", "decode_kernel", 80, False, direction="decode"),
    # The same over fp8 (e4m3) caches (dtype: q's), converted by each warp (the e4m3 instructions from sm_89, integer
    # code before: common/e4m3.cuh).
    Family("decode_fp8", "decode/decode.cu", "decode_fp8_kernel", 80, False, direction="decode", fp8=True),
    # The same on Hopper, its keys streamed by producer warps (num_warps: the consumers and the producers).
    Family("decode_sm90", "decode/decode_sm90.cu", "decode_sm90_kernel", 90, True, direction="decode",
           backend="sm90"),
    # The same over fp8 (e4m3) caches (dtype: q's), dequantised in shared memory by the consumer warps.
    Family("decode_sm90_fp8", "decode/decode_sm90.cu", "decode_sm90_fp8_kernel", 90, True, direction="decode",
           backend="sm90", fp8=True),
    # MLA's latent cache (v_cache=None: V is the first 512 of K's 576 columns), the warps splitting O's columns.
    Family("decode_sm90_mla", "decode/decode_sm90.cu", "decode_sm90_mla_kernel", 90, True, direction="decode",
           backend="sm90"),
    # The same over 16-bit caches by TMA boxes (tensor maps as extra arguments): Hopper's default where TMA can
    # address the caches.
    Family("decode_sm90_tma", "decode/decode_sm90.cu", "decode_sm90_tma_kernel", 90, True, direction="decode",
           backend="sm90"),
    _aux("combine", "decode/combine.cu", "combine_kernel", 80, ("tag", "num_warps")),
    # A user mask modifier over the attention kernel's tiles (block_m x block_n; mask: its variant's modifiers).
    _aux("mask_tiles", "aux/mask_tiles.cu", "mask_tiles_kernel", 80, ("block_m", "block_n", "num_warps", "mask")),
    # The block-sparse key-tile lists of a programmable call in one launch (cuflash/block_sparse.py: device_key_tile_lists).
    _aux("block_lists", "aux/block_lists.cu", "block_lists_kernel", 80, ("num_warps",)),
    _aux("kvcache_append", "decode/append.cu", "kvcache_append_kernel", 80, ("tag", "num_warps")),
    _aux("kvcache_append_fp8", "decode/append.cu", "kvcache_append_fp8_kernel", 80, ("tag", "num_warps")),
    # Backward (kernels instantiated per head-dim bucket; head_dim is the bucket).
    _aux("bwd_preprocess", "aux/bwd_preprocess.cu", "bwd_preprocess_kernel", 80, ("tag", "num_warps")),
    _aux("bwd_postprocess", "aux/bwd_postprocess.cu", "bwd_postprocess_kernel", 80, ("tag", "num_warps")),
    _bwd("sm80_bwd_dkdv", "sm80/bwd.cu", "bwd_dkdv_kernel", "sm80", "kernel"),
    _bwd("sm80_bwd_dkdv_dq", "sm80/bwd.cu", "bwd_dkdv_dq_kernel", "sm80", "atomic"),
    # Version 2 of the dK/dV kernels (Q/dO ring, two barriers per step, 2-D warp grids).
    _bwd("sm80_bwd_dkdv2", "sm80/bwd.cu", "bwd_dkdv2_kernel", "sm80", "kernel"),
    _bwd("sm80_bwd_dkdv2_dq", "sm80/bwd.cu", "bwd_dkdv2_dq_kernel", "sm80", "atomic"),
    # The same with dO in one stage (where two do not fit: the A100 at d=128 with (64, 128, 8)).
    _bwd("sm80_bwd_dkdv2_do1", "sm80/bwd.cu", "bwd_dkdv2_kernel", "sm80", "kernel", template_consts=(1,)),
    _bwd("sm80_bwd_dkdv2_dq_do1", "sm80/bwd.cu", "bwd_dkdv2_dq_kernel", "sm80", "atomic", template_consts=(1,)),
    _bwd("sm80_bwd_dq", "sm80/bwd.cu", "bwd_dq_kernel", "sm80", None),
    # Programmable attention (issue #45): version 1 of dK / dV and the dQ kernel with ProgParams.
    _bwd("sm80_bwd_dkdv_prog", "sm80/bwd.cu", "bwd_dkdv_prog_kernel", "sm80", "kernel", prog=True),
    _bwd("sm80_bwd_dq_prog", "sm80/bwd.cu", "bwd_dq_prog_kernel", "sm80", None, prog=True),
    _bwd("simt_bwd_dkdv", "simt/bwd.cu", "bwd_dkdv_kernel", "simt", "kernel"),
    _bwd("simt_bwd_dq", "simt/bwd.cu", "bwd_dq_kernel", "simt", None),
    # Programmable attention (issue #45) in float32: the same pair with ProgParams.
    _bwd("simt_bwd_dkdv_prog", "simt/bwd.cu", "bwd_dkdv_prog_kernel", "simt", "kernel", prog=True),
    _bwd("simt_bwd_dq_prog", "simt/bwd.cu", "bwd_dq_prog_kernel", "simt", None, prog=True),
    # Hopper backward (wgmma, TMA): dQ slices through shared memory and one bulk reduce each into a tiled
    # dq_accum (128-key tiles), and the same with the key tiles' slices added in a fixed order (deterministic).
    _bwd("sm90_bwd_dkdv_dqtile", "sm90/bwd.cu", "bwd_dkdv_dqtile_kernel", "sm90", "tile", 90),
    _bwd("sm90_bwd_dkdv_dqtile_ordered", "sm90/bwd.cu", "bwd_dkdv_dqtile_ordered_kernel", "sm90", "ordered", 90),
    # Programmable attention (issue #45): the tiled dQ kernel with ProgParams after the maps.
    _bwd("sm90_bwd_dkdv_dqtile_prog", "sm90/bwd.cu", "bwd_dkdv_dqtile_prog_kernel", "sm90", "tile", 90, prog=True),
    # Head dims above 256 (head_dims.py): one kernel per gradient, its 64 rows' float32 sums split by columns over
    # two consumer warpgroups, no atomics (block_m: the rows, block_n: the other side's rows per step).
    _bwd("sm90_bwd_split_dv", "sm90/bwd_split.cu", "bwd_split_dv_kernel", "sm90", None, 90),
    _bwd("sm90_bwd_split_dk", "sm90/bwd_split.cu", "bwd_split_dk_kernel", "sm90", None, 90),
    _bwd("sm90_bwd_split_dq", "sm90/bwd_split.cu", "bwd_split_dq_kernel", "sm90", None, 90),
    # Converts the tiled dq_accum of the two families above (block_m: their query tile).
    _aux("bwd_postprocess_tiled", "aux/bwd_postprocess.cu", "bwd_postprocess_tiled_kernel", 80,
         ("tag", "head_dim", "block_m", "num_warps")),
)}


def register_family(family: Family) -> None:
    """Adds (or replaces) a kernel family, e.g. an experimental kernel in a tuning script."""
    if not isinstance(family, Family):
        raise TypeError(f"register_family takes a Family, got {type(family).__name__}")
    FAMILIES[family.name] = family


def find_family(**traits) -> Family:
    """The one family whose typed fields equal ``traits`` (e.g. ``backend="sm90", direction="fwd",
    schedule="overlap", persistent=True, cluster=1, fp8=False``); LookupError if none or several match."""
    unknown = set(traits) - set(Family.__dataclass_fields__)
    if unknown:
        raise TypeError(f"find_family: unknown Family fields {sorted(unknown)}")
    found = [f for f in FAMILIES.values() if all(getattr(f, k) == v for k, v in traits.items())]
    if len(found) != 1:
        raise LookupError(f"{len(found)} kernel families match {traits}: {[f.name for f in found]}")
    return found[0]


@dataclass(frozen=True)
class KernelConfig:
    """A frozen description of one instantiation; ``key()`` names its cache entry."""

    family: str
    dtype: str           # "float16" | "bfloat16" | "float32" | "float8_e4m3fn"
    head_dim: int
    causal: bool
    block_m: int
    block_n: int
    num_warps: int
    variant: MaskVariant = PLAIN   # the parts of the pattern beyond causal (cuflash/variants.py)
    # v's (and the output's) head dim where it differs from head_dim (q's and k's); 0: the same. A template
    # argument after the family's own, only when non-zero (so that the other kernels keep their names).
    head_dim_v: int = 0

    @property
    def fam(self) -> Family:
        return FAMILIES[self.family]

    @property
    def source(self) -> str:
        return self.fam.source

    @property
    def cluster(self) -> int:
        """CTAs per thread-block cluster (Family.cluster)."""
        return self.fam.cluster

    @property
    def uneven(self) -> bool:
        """The mask policy's kUnevenWork / kSkipsTiles (common/mask.cuh): causal or a window / chunks, which
        the kernels' tile orders (and so the launch grids) follow."""
        return self.causal or self.variant.local

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    def template_args(self) -> tuple:
        values = {"tag": DTYPE_TAGS[self.dtype], "head_dim": self.head_dim, "block_m": self.block_m,
                  "block_n": self.block_n, "num_warps": self.num_warps,
                  "mask": self.variant.template_arg(self.causal)}
        return (tuple(values[name] for name in self.fam.template) + self.fam.template_consts
                + ((self.head_dim_v,) if self.head_dim_v else ()))

    def name_expression(self) -> str:
        return f"{self.fam.kernel}<{', '.join(str(a) for a in self.template_args())}>"

    def smem_expression(self) -> str | None:
        """NVRTC name expression of the kernel's dynamic shared-memory size, ``&<kernel>_smem_bytes<template
        arguments>`` (a ``__device__ const int`` variable template beside the kernel), or None where the
        family takes none (Family.dynamic_smem)."""
        if not self.fam.dynamic_smem:
            return None
        return f"&{self.fam.kernel}_smem_bytes<{', '.join(str(a) for a in self.template_args())}>"

    def key(self) -> str:
        variant = f":{self.variant.tag()}" if self.variant.tag() else ""
        dv = f"v{self.head_dim_v}" if self.head_dim_v else ""
        return (f"{self.family}:{self.dtype}:d{self.head_dim}{dv}:{'causal' if self.causal else 'full'}{variant}:"
                f"m{self.block_m}n{self.block_n}w{self.num_warps}")
