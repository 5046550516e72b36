"""KernelConfig: everything that selects one compiled kernel instantiation."""
from __future__ import annotations

from dataclasses import dataclass

# dtype name -> element tag of kernels_cu/common/numeric.cuh (fp32 kernels take `float`).
DTYPE_TAGS = {"float16": "f16_tag", "bfloat16": "bf16_tag", "float32": "float"}


@dataclass(frozen=True)
class Family:
    """One kernel family: a source file and a kernel template in it."""

    name: str
    source: str          # path under kernels_cu/
    kernel: str          # template name
    min_cc: int          # lowest compute capability (e.g. 80)
    arch_specific: bool  # needs the "a" target (sm_90a): wgmma, setmaxnreg


FAMILIES: dict[str, Family] = {
    "sm80_fwd": Family("sm80_fwd", "sm80/fwd.cu", "fwd_kernel", 80, False),
    "simt_fwd": Family("simt_fwd", "simt/fwd.cu", "fwd_kernel", 80, False),
}


def register_family(family: Family) -> None:
    FAMILIES[family.name] = family


@dataclass(frozen=True)
class KernelConfig:
    """A frozen description of one instantiation; ``key()`` names its cache entry."""

    family: str
    dtype: str           # "float16" | "bfloat16" | "float32"
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
    def threads(self) -> int:
        return 32 * self.num_warps

    def template_args(self) -> tuple:
        return (DTYPE_TAGS[self.dtype], self.head_dim, self.block_m, self.block_n, self.num_warps,
                "true" if self.causal else "false")

    def name_expression(self) -> str:
        return f"{self.fam.kernel}<{', '.join(str(a) for a in self.template_args())}>"

    def key(self) -> str:
        return (f"{self.family}:{self.dtype}:d{self.head_dim}:{'causal' if self.causal else 'full'}:"
                f"m{self.block_m}n{self.block_n}w{self.num_warps}")
