"""The JAX devices that the cuflash.jax tests run on: the CPU (XLA:CPU, the host targets) and the first GPU of a
CUDA JAX backend, where there is one. Import it after ``pytest.importorskip("jax")``, so that a test module skips
where JAX is not installed."""
from __future__ import annotations

import jax
import pytest

from conftest import requires_gpu


def _jax_gpu():
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return None
    return gpus[0] if gpus else None


GPU = _jax_gpu()
requires_jax_gpu = pytest.mark.skipif(GPU is None, reason="needs a CUDA JAX backend (jax.devices('gpu'))")
CPU = jax.devices("cpu")[0]
# The device parameter of the tests that run on both (the GPU one skips without a usable GPU and a CUDA JAX backend).
PLATFORMS = [pytest.param(CPU, id="cpu"), pytest.param(GPU, id="gpu", marks=[requires_gpu, requires_jax_gpu])]
