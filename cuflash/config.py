"""KernelConfig: everything that selects one compiled kernel instantiation."""
from __future__ import annotations

from dataclasses import dataclass

# dtype name -> element tag of kernels_cu/common/numeric.cuh (fp32 kernels take `float`).
DTYPE_TAGS = {"float16": "f16_tag", "bfloat16": "bf16_tag", "float32": "float", "float8_e4m3fn": "e4m3_tag"}


@dataclass(frozen=True)
class Family:
    """One kernel family: a source file and a kernel template in it."""

    name: str
    source: str          # path under kernels_cu/
    kernel: str          # template name
    min_cc: int          # lowest compute capability (e.g. 80)
    arch_specific: bool  # needs the "a" target (sm_90a): wgmma, setmaxnreg
    # KernelConfig fields passed as template arguments, in order ("tag" is the dtype's tag).
    template: tuple = ("tag", "head_dim", "block_m", "block_n", "num_warps", "causal")


FAMILIES: dict[str, Family] = {
    "sm80_fwd": Family("sm80_fwd", "sm80/fwd.cu", "fwd_kernel", 80, False),
    "simt_fwd": Family("simt_fwd", "simt/fwd.cu", "fwd_kernel", 80, False),
    # Hopper only (wgmma, TMA, setmaxnreg).
    "sm90_fwd_overlap": Family("sm90_fwd_overlap", "sm90/fwd.cu", "fwd_overlap_kernel", 90, True),
    # The same schedules as persistent kernels (grid = min(tiles, SMs); launch.fwd_grid).
    "sm90_fwd_p": Family("sm90_fwd_p", "sm90/fwd.cu", "fwd_persistent_kernel", 90, True),
    "sm90_fwd_overlap_p": Family("sm90_fwd_overlap_p", "sm90/fwd.cu", "fwd_overlap_persistent_kernel", 90, True),
    # The overlap schedule in clusters of two CTAs sharing K / V loads (TMA multicast), one CTA per tile
    # or persistent: not causal, 16-bit, head dims 65..128 and 193..256 (heuristics.fwd_cluster_ok).
    "sm90_fwd_overlap_x2": Family("sm90_fwd_overlap_x2", "sm90/fwd.cu", "fwd_overlap_x2_kernel", 90, True),
    "sm90_fwd_overlap_x2_p": Family("sm90_fwd_overlap_x2_p", "sm90/fwd.cu", "fwd_overlap_x2_persistent_kernel", 90,
                                    True),
    # fp8 (e4m3) inputs with V transposed (cuflash/fp8.py), the overlap schedule; one CTA per tile or
    # persistent.
    "sm90_fwd_fp8": Family("sm90_fwd_fp8", "sm90/fwd.cu", "fwd_fp8_kernel", 90, True),
    "sm90_fwd_fp8_p": Family("sm90_fwd_fp8_p", "sm90/fwd.cu", "fwd_fp8_persistent_kernel", 90, True),
    # fp8 helpers: V -> V^T in the P-fragment key order, and per-tensor quantisation (tag: the input's).
    "fp8_transpose_v": Family("fp8_transpose_v", "aux/fp8.cu", "fp8_transpose_v_kernel", 89, False,
                              ("num_warps",)),
    "fp8_amax": Family("fp8_amax", "aux/fp8.cu", "fp8_amax_kernel", 89, False, ("tag", "num_warps")),
    "fp8_quantize": Family("fp8_quantize", "aux/fp8.cu", "fp8_quantize_kernel", 89, False, ("tag", "num_warps")),
    # Ring attention (cuflash/distributed): merging the steps' partial results in float32 (tag: the inputs').
    "ring_merge": Family("ring_merge", "aux/ring.cu", "ring_merge_kernel", 80, False, ("tag", "num_warps")),
    "ring_accumulate": Family("ring_accumulate", "aux/ring.cu", "ring_accumulate_kernel", 80, False,
                             ("tag", "num_warps")),
    "ring_convert": Family("ring_convert", "aux/ring.cu", "ring_convert_kernel", 80, False, ("tag", "num_warps")),
    # Backward (kernels instantiated per head-dim bucket; head_dim is the bucket).
    "bwd_preprocess": Family("bwd_preprocess", "aux/bwd_preprocess.cu", "bwd_preprocess_kernel", 80, False,
                             ("tag", "num_warps")),
    "bwd_postprocess": Family("bwd_postprocess", "aux/bwd_postprocess.cu", "bwd_postprocess_kernel", 80, False,
                              ("tag", "num_warps")),
    "sm80_bwd_dkdv": Family("sm80_bwd_dkdv", "sm80/bwd.cu", "bwd_dkdv_kernel", 80, False),
    "sm80_bwd_dkdv_dq": Family("sm80_bwd_dkdv_dq", "sm80/bwd.cu", "bwd_dkdv_dq_kernel", 80, False),
    # Version 2 of the dK/dV kernels (Q/dO ring, two barriers per step, 2-D warp grids).
    "sm80_bwd_dkdv2": Family("sm80_bwd_dkdv2", "sm80/bwd.cu", "bwd_dkdv2_kernel", 80, False),
    "sm80_bwd_dkdv2_dq": Family("sm80_bwd_dkdv2_dq", "sm80/bwd.cu", "bwd_dkdv2_dq_kernel", 80, False),
    "sm80_bwd_dq": Family("sm80_bwd_dq", "sm80/bwd.cu", "bwd_dq_kernel", 80, False),
    "simt_bwd_dkdv": Family("simt_bwd_dkdv", "simt/bwd.cu", "bwd_dkdv_kernel", 80, False),
    "simt_bwd_dq": Family("simt_bwd_dq", "simt/bwd.cu", "bwd_dq_kernel", 80, False),
    # Hopper backward (wgmma, TMA): dQ slices through shared memory and one bulk reduce each into a tiled dq_accum (128-key tiles),
    # and the same with the key tiles' slices added in a fixed order (deterministic).
    "sm90_bwd_dkdv_dqtile": Family("sm90_bwd_dkdv_dqtile", "sm90/bwd.cu", "bwd_dkdv_dqtile_kernel", 90, True),
    "sm90_bwd_dkdv_dqtile_ordered": Family("sm90_bwd_dkdv_dqtile_ordered", "sm90/bwd.cu",
                                           "bwd_dkdv_dqtile_ordered_kernel", 90, True),
    # Converts the tiled dq_accum of the two families above (block_m: their query tile).
    "bwd_postprocess_tiled": Family("bwd_postprocess_tiled", "aux/bwd_postprocess.cu", "bwd_postprocess_tiled_kernel",
                                    80, False, ("tag", "head_dim", "block_m", "num_warps")),
}


def register_family(family: Family) -> None:
    FAMILIES[family.name] = family


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

    @property
    def fam(self) -> Family:
        return FAMILIES[self.family]

    @property
    def source(self) -> str:
        return self.fam.source

    @property
    def cluster(self) -> int:
        """CTAs per thread-block cluster (the sm90 forward's ``_x2`` families: 2)."""
        return 2 if "_x2" in self.family else 1

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    def template_args(self) -> tuple:
        values = {"tag": DTYPE_TAGS[self.dtype], "head_dim": self.head_dim, "block_m": self.block_m,
                  "block_n": self.block_n, "num_warps": self.num_warps,
                  "causal": "true" if self.causal else "false"}
        return tuple(values[name] for name in self.fam.template)

    def name_expression(self) -> str:
        return f"{self.fam.kernel}<{', '.join(str(a) for a in self.template_args())}>"

    def key(self) -> str:
        return (f"{self.family}:{self.dtype}:d{self.head_dim}:{'causal' if self.causal else 'full'}:"
                f"m{self.block_m}n{self.block_n}w{self.num_warps}")
