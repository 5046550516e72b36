"""sm90 primitives on tiny single-warpgroup GEMM tiles (GPU, compute capability 9.0):
TMA 2-D loads with 128-byte swizzle completing on an mbarrier, wgmma with A from a
shared-memory descriptor (K-major B) and from registers (MN-major, transposed B)."""
from __future__ import annotations

import numpy as np
import pytest

from compile_checks import gemm_tiles_source
from conftest import GPU_SKIP_REASON, dtype_of


def _cc_reason():
    if GPU_SKIP_REASON is not None:
        return f"needs an NVIDIA GPU: {GPU_SKIP_REASON}"
    import cupy

    cc = int(cupy.cuda.Device().compute_capability)
    return None if cc == 90 else f"needs compute capability 9.0 (sm_90a), device has {cc}"


pytestmark = pytest.mark.skipif(_cc_reason() is not None, reason=str(_cc_reason()))

TAGS = {"float16": "f16_tag", "bfloat16": "bf16_tag"}


def _kernel(name: str):
    import cupy

    mod = cupy.RawModule(code=gemm_tiles_source(), options=("-arch=sm_90a", "-std=c++17"),
                         name_expressions=[name])
    kern = mod.get_function(name)
    kern.max_dynamic_shared_size_bytes = 100 * 1024
    return kern


def _rand(rng, shape, dtype):
    import cupy

    return cupy.asarray(rng.standard_normal(shape).astype(np.float32).astype(dtype_of(dtype)))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("n,k", [(64, 64), (128, 128), (256, 64), (96, 192)])
def test_wgmma_ss_tma(rng, dtype, n, k):
    import cupy
    from cuflash import tma

    a = _rand(rng, (64, k), dtype)
    b = _rand(rng, (n, k), dtype)
    c = cupy.full((64, n), np.nan, dtype=np.float32)
    ta = tma.encode_tiled(a.data.ptr, dtype, (k, 64), (k * 2,), (64, 64))
    tb = tma.encode_tiled(b.data.ptr, dtype, (k, n), (k * 2,), (64, n))
    kern = _kernel(f"gemm_ss_kernel<{TAGS[dtype]}, {n}, {k}>")
    kern((1,), (128,), (ta, tb, c), shared_mem=1024 + (64 + n) * k * 2 + 64)
    ref = a.get().astype(np.float64) @ b.get().astype(np.float64).T
    np.testing.assert_allclose(c.get(), ref, rtol=1e-3, atol=1e-3 * np.sqrt(k))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("n,k", [(64, 64), (128, 128), (256, 64), (192, 96)])
def test_wgmma_rs_transposed_b_tma(rng, dtype, n, k):
    import cupy
    from cuflash import tma

    a = _rand(rng, (64, k), dtype)
    b = _rand(rng, (k, n), dtype)  # row-major K x N: an MN-major B operand
    c = cupy.full((64, n), np.nan, dtype=np.float32)
    tb = tma.encode_tiled(b.data.ptr, dtype, (n, k), (n * 2,), (64, k))
    kern = _kernel(f"gemm_rs_kernel<{TAGS[dtype]}, {n}, {k}>")
    kern((1,), (128,), (a, tb, c), shared_mem=1024 + n * k * 2 + 64)
    ref = a.get().astype(np.float64) @ b.get().astype(np.float64)
    np.testing.assert_allclose(c.get(), ref, rtol=1e-3, atol=1e-3 * np.sqrt(k))
