"""CPU-only: without cuBLAS (the default install leaves it out) the benchmark's plain-CuPy column says
why and the rest of the table runs; with it, nothing is reported missing."""
from __future__ import annotations

import importlib.util

import pytest

from cuflash import bench


@pytest.fixture
def no_cublas(monkeypatch):
    """CuPy answering as it does where no cuBLAS library is installed (ImportError on first use)."""
    import cupy

    def missing():
        raise ImportError('Failure finding "libcublas.so.12": No such file')

    monkeypatch.setattr(bench, "_load_cublas", missing)
    monkeypatch.setattr(cupy.cuda.runtime, "runtimeGetVersion", lambda: 12090)


def test_cublas_missing_names_the_wheel_and_the_extra(no_cublas, monkeypatch):
    import cupy

    reason = bench.cublas_missing()
    assert reason is not None
    assert "cuBLAS is not installed" in reason and "pip install nvidia-cublas-cu12" in reason
    assert "bench-cuda12" in reason and "libcublas.so.12" in reason
    monkeypatch.setattr(cupy.cuda.runtime, "runtimeGetVersion", lambda: 13010)
    reason = bench.cublas_missing()
    assert "pip install nvidia-cublas," in reason and "bench-cuda13" in reason


@pytest.mark.skipif(importlib.util.find_spec("nvidia.cublas") is None, reason="nvidia-cublas-cu12 not installed here")
def test_cublas_found_when_installed():
    assert bench.cublas_missing() is None


def test_naive_baseline_raises_the_reason(no_cublas):
    with pytest.raises(RuntimeError, match="cuBLAS is not installed"):
        bench.cupy_naive_fwd(None, None, None, causal=False)   # before any array is touched


def test_table_runs_without_cublas(no_cublas, monkeypatch, capsys):
    """The standard table's loop with stand-ins for the inputs, the kernels and the clock: the cupy
    column is None (shown as "-"), the reason is printed once, cuflash is still timed."""
    import cupy

    from cuflash import __main__ as cli

    def naive(*args, **kwargs):
        raise AssertionError("the cuBLAS baseline ran")

    monkeypatch.setattr(bench, "fa4_fn", lambda: None)
    monkeypatch.setattr(bench, "random_inputs", lambda shape, seed=0: ("q", "k", "v"))
    monkeypatch.setattr(bench, "cupy_naive_fwd", naive)
    monkeypatch.setattr(bench, "cuflash_pass_fns", lambda q, k, v, causal, dout=None, passes=bench.PASSES:
                        {p: (lambda: None) for p in ("fwd", "bwd", "fwd+bwd")})
    monkeypatch.setattr(bench, "time_interleaved", lambda fns, warmup, repeats: {key: 1.0 for key in fns})
    monkeypatch.setattr(cli, "_torch_fns", lambda shape, backend, backward: {})

    class Pool:
        def free_all_blocks(self):
            pass

    monkeypatch.setattr(cupy, "get_default_memory_pool", lambda: Pool())
    shapes = [bench.Shape(1, 2, 256, 64, "float16", False), bench.Shape(1, 2, 512, 64, "float16", True)]
    rows = cli.benchmark(shapes, repeats=2, warmup=1)
    assert [r["pass"] for r in rows] == ["fwd", "bwd", "fwd+bwd"] * 2
    assert all(r["cupy"] is None for r in rows if r["pass"] == "fwd")
    assert all(r["cuflash"] > 0 for r in rows)
    out = capsys.readouterr().out
    assert out.count("cupy column skipped: cuBLAS is not installed") == 1
    assert "| - |" in cli.markdown_table(rows)
