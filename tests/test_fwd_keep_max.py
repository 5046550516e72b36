"""The Hopper forward's kept running max (kernels_cu/sm90/fwd.cu, kKeepMax) on score distributions of
trained models (cuflash/distributions.py) against the float64 reference, with a counting build that
shows which of its paths ran: a warp whose rows' max moved re-bases them from their probabilities, and
one whose scores passed a settled max by more than 2^120 computes S again (GPU, compute capability 9.0)."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from conftest import FWD_TOL, assert_close_on_every_row, assert_lse_matches, planned_cc, poisoned, requires_gpu

pytestmark = requires_gpu

COUNT_DEFINE = "-DCUFLASH_SM90_FWD_COUNT_FALLBACKS"


@pytest.fixture(autouse=True)
def hopper():
    if planned_cc() != 90:
        pytest.skip("needs compute capability 9.0 (sm_90a)")


@pytest.fixture
def counting(monkeypatch):
    """Builds the forward with its fallback counters; yields a function that zeroes them and one that
    reads (rebased, recomputed) summed over the loaded counting modules."""
    import cupy
    from cuflash import dispatch, options

    options.set(nvrtc_defines=(COUNT_DEFINE,), fwd_backend="auto")   # conftest restores the options after

    def counters():
        for m in dispatch.loaded_modules(COUNT_DEFINE):
            ptr = m.get_global("cuflash_fwd_fallbacks")
            yield cupy.ndarray((2,), dtype=cupy.uint64, memptr=ptr)

    def reset():
        for c in counters():
            c.fill(0)

    def read():
        cupy.cuda.get_current_stream().synchronize()
        return tuple(int(x) for x in sum((c.get() for c in counters()), np.zeros(2, np.uint64)))

    yield reset, read


def _uses_keep_max(dtype: str, d: int, causal: bool, nq: int, nk: int) -> bool:
    """Whether the kernel that cuflash.forward picks for these inputs (the tuned table's, or the forced
    backend's) has the overlap schedule (the kept max). Asked as the api asks, with the sequences' ``short``
    and ``long_seqs``: short sequences take another family at causal D <= 64."""
    from cuflash import heuristics

    return heuristics.fwd_config(dtype, d, causal, 90, short=heuristics.fwd_short(nq, nk),
                                 long_seqs=heuristics.fwd_long(nq, nk)).fam.schedule == "overlap"


def _run(q, k, v, causal, scale=None):
    """The forward against float64 on every row (each row's relative error over head_dim within
    ROW_TOL_FACTOR times the dtype's bound, and the whole output within it) and every lse."""
    import cupy
    import cuflash
    from cuflash.reference import attention_reference

    dtype = {np.dtype(np.float16): "float16"}.get(np.dtype(q.dtype), "bfloat16")
    out = poisoned(q.shape, dtype)
    o, lse = cuflash.forward(q, k, v, causal=causal, softmax_scale=scale, return_lse=True, out=out)
    cupy.cuda.get_current_stream().synchronize()
    ref_o, ref_lse = attention_reference(q, k, v, causal=causal, softmax_scale=scale)
    assert_close_on_every_row("out", o, cupy.asarray(ref_o), dtype, FWD_TOL)
    b, nq, h, _ = q.shape
    assert_lse_matches(lse, ref_lse, (b, h, nq))


@pytest.mark.parametrize("dist", ["normal", "outlier8", "outlier12", "sharp", "sink"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_distributions(counting, dist, dtype, d, causal):
    """Every row against float64 on each distribution (odd lengths, Nq != Nk, GQA); on the sharp ones the
    re-base path must have run wherever the kernel keeps its max."""
    from cuflash.bench import Shape
    from cuflash.distributions import make_inputs

    reset, read = counting
    seed = zlib.crc32(f"{dist} {dtype} {d} {causal}".encode())
    for nq, nk in [(1031, 1031), (333, 1400)]:
        shape = Shape(1, 4, nq, d, dtype, causal, heads_kv=2, seqlen_k=nk)
        q, k, v = make_inputs(shape, dist, seed=seed)
        reset()
        _run(q, k, v, causal)
        rebased, recomputed = read()
        # fp16's bound is 2^14 (bf16's 2^48: test_max_jump covers it)
        if dist in ("outlier12", "sharp") and dtype == "float16" and _uses_keep_max(dtype, d, causal, nq, nk):
            assert rebased > 0, "the re-base path never ran on sharp scores"


@pytest.mark.parametrize("path,gap", [("rebase", 12.5), ("recompute", 40.0)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_max_jump(counting, rng, path, gap, dtype, d, causal):
    """Scores near 0 settle every row's max over the first key tiles (visited last to first); key 0, in the
    last one, then scores 4 * gap for every other query row: 50 (72 in log2, past both dtypes' bounds), which
    the warps re-base from their probabilities, or 160 (230 in log2, past exp2's range), for which they
    compute S again; the other rows keep their max. All against float64."""
    _max_jump(counting, rng, path, gap, dtype, d, causal)


@pytest.mark.parametrize("path,gap", [("rebase", 12.5), ("recompute", 40.0)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_max_jump_causal_d64_overlap(counting, rng, monkeypatch, path, gap, dtype):
    """Causal D=64 with the persistent overlap schedule forced (128-row tiles under the mask): past the short
    sequences the tuned table takes the simple schedule there, which keeps no max, so both fallback paths are
    checked on this kernel too."""
    from cuflash import options

    options.set(fwd_backend="sm90_overlap_p")
    assert _uses_keep_max(dtype, 64, True, *_JUMP_LENGTHS)
    _max_jump(counting, rng, path, gap, dtype, 64, True)


_JUMP_LENGTHS = (700, 900)   # (seqlen_q, seqlen_k): short sequences (heuristics.fwd_short)


def _max_jump(counting, rng, path, gap, dtype, d, causal):
    import cupy
    from conftest import randn

    reset, read = counting
    b, h = 1, 2
    nq, nk = _JUMP_LENGTHS
    u = cupy.asarray(rng.standard_normal(d), dtype=cupy.float32)
    u /= cupy.linalg.norm(u)
    q = randn(rng, (b, nq, h, d), "float32") * 0.3
    q[:, ::2] += 4.0 * u
    k = randn(rng, (b, nk, h, d), "float32") * 0.1
    k[:, 0] = gap * u
    v = randn(rng, (b, nk, h, d), dtype)
    q, k = q.astype(v.dtype), k.astype(v.dtype)
    reset()
    _run(q, k, v, causal, scale=1.0)
    rebased, recomputed = read()
    if _uses_keep_max(dtype, d, causal, nq, nk):
        ran = rebased if path == "rebase" else recomputed
        assert ran > 0, f"the {path} path never ran (rebased {rebased}, recomputed {recomputed})"


def test_first_rows_without_keys(counting, rng):
    """Causal with Nq > Nk: the first key tile leaves rows with no visible key (no max yet); the warps
    holding them take the full step until they have one."""
    from conftest import randn

    q = randn(rng, (2, 517, 2, 128), "bfloat16")
    k, v = (randn(rng, (2, 389, 2, 128), "bfloat16") for _ in range(2))
    _run(q, k * 3, v, causal=True)
