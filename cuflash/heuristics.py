"""The one tile table: (family, head dim, dtype, causal, arch) -> KernelConfig.

Head dims that are not tuned use the tiles of the next larger tuned head dim
(the kernel itself is still instantiated for the exact head dim).
"""
from __future__ import annotations

import os

from .config import KernelConfig

TUNED_HEAD_DIMS = (32, 64, 96, 128, 192, 256)
MAX_HEAD_DIM = 256

# sm80_fwd (mma.sync): head-dim bucket -> (block_m, block_n, num_warps).
_SM80_FWD = {
    32: (128, 64, 4),
    64: (128, 64, 4),
    96: (128, 64, 8),
    128: (128, 64, 8),
    192: (64, 64, 4),
    256: (64, 64, 4),
}

# simt_fwd (exact float32 on CUDA cores): head-dim bucket -> (block_m, block_n, num_warps).
_SIMT_FWD = {d: (32, 32, 4) for d in TUNED_HEAD_DIMS}


def head_dim_bucket(head_dim: int) -> int:
    for d in TUNED_HEAD_DIMS:
        if head_dim <= d:
            return d
    raise ValueError(f"head_dim {head_dim} is larger than {MAX_HEAD_DIM}")


def _override(name: str):
    """Tile override for tuning runs, e.g. CUFLASH_SM80_FWD_TILES="128,64,4"."""
    value = os.environ.get(name)
    return tuple(int(x) for x in value.split(",")) if value else None


def fwd_config(dtype: str, head_dim: int, causal: bool, cc: int) -> KernelConfig:
    """The forward kernel for these inputs on a device of compute capability ``cc`` (e.g. 90)."""
    bucket = head_dim_bucket(head_dim)
    if dtype == "float32":
        block_m, block_n, warps = _override("CUFLASH_SIMT_FWD_TILES") or _SIMT_FWD[bucket]
        return KernelConfig("simt_fwd", dtype, head_dim, causal, block_m, block_n, warps)
    block_m, block_n, warps = _override("CUFLASH_SM80_FWD_TILES") or _SM80_FWD[bucket]
    return KernelConfig("sm80_fwd", dtype, head_dim, causal, block_m, block_n, warps)


def all_fwd_configs(cc: int) -> list[KernelConfig]:
    """Every forward instantiation the dispatcher can choose (for the CPU compile test)."""
    out = []
    for dtype in ("float16", "bfloat16", "float32"):
        for d in range(8, MAX_HEAD_DIM + 1, 8):
            for causal in (False, True):
                out.append(fwd_config(dtype, d, causal, cc))
    return out
