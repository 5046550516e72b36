"""Grid, block and shared-memory sizing for each kernel family, and the launch."""
from __future__ import annotations

import numpy as np

from .config import KernelConfig


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _sm80_fwd_smem(c: KernelConfig) -> int:
    stride = _round_up(c.head_dim, 16) + 8  # FwdTile::kSmemStride
    return (c.block_m + 2 * c.block_n) * stride * 2


def _simt_fwd_smem(c: KernelConfig) -> int:
    stride = c.head_dim + 4      # SimtFwdTile::kStride: float Q/K/V rows, one 16-byte pad
    p_stride = c.block_n + 8     # SimtFwdTile::kPStride: float P rows
    return ((c.block_m + 2 * c.block_n) * stride + c.block_m * p_stride) * 4


SMEM_BYTES = {
    "sm80_fwd": _sm80_fwd_smem,
    "simt_fwd": _simt_fwd_smem,
}


def fwd_grid(c: KernelConfig, batch: int, heads_q: int, seqlen_q: int) -> tuple[int, int, int]:
    """One CTA per (query tile, head, batch)."""
    return ((seqlen_q + c.block_m - 1) // c.block_m, heads_q, batch)


def launch(kernel, config: KernelConfig, grid: tuple[int, int, int], params: np.ndarray, smem: int) -> None:
    """Launch on CuPy's current stream (of the current device)."""
    kernel(grid, (config.threads,), (params,), shared_mem=smem)
