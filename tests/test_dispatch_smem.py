"""Each kernel's dynamic shared memory comes from the kernel (<kernel>_smem_bytes): read from the compiled module
by the dispatcher (GPU), or from the PTX of that variable alone before anything is compiled (CPU)."""
from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest

from conftest import requires_gpu

pytest.importorskip("cupy")


class _FakeModule:
    """Stands for cupy.RawModule: records the name expressions it was built with."""

    built: list = []

    def __init__(self, code, options, name_expressions):
        type(self).built.append(tuple(name_expressions))

    def get_function(self, name):
        return type("FakeKernel", (), {"name": name})()


@pytest.fixture
def fake_dispatch(monkeypatch):
    import cupy

    from cuflash import dispatch, options

    _FakeModule.built = []
    monkeypatch.setattr(cupy, "RawModule", _FakeModule)
    monkeypatch.setattr(cupy.cuda, "Device", lambda *a: contextlib.nullcontext())
    monkeypatch.setattr(dispatch, "real_device_info", lambda device_id: (90, 232448))
    for name in ("_kernels", "_modules", "_smem", "_key_locks"):
        monkeypatch.setattr(dispatch, name, {})
    options.set(nvrtc_defines=())   # conftest restores the options after the test
    return dispatch


def test_the_module_value_is_kept_beside_the_kernel(fake_dispatch, monkeypatch):
    """The module is built with the kernel's and the size's name expressions; the size read from it once
    (at compile time) is what smem_bytes returns for that device, and it sets the kernel's limit."""
    from cuflash import heuristics

    cfg = heuristics.fwd_config("float16", 128, False, 90)
    reads = []
    monkeypatch.setattr(fake_dispatch, "_module_int", lambda module, expr, device_id: reads.append(expr) or 123456)
    kern = fake_dispatch.get_kernel(cfg, 0)
    assert _FakeModule.built == [(cfg.name_expression(), cfg.smem_expression())]
    assert kern.max_dynamic_shared_size_bytes == 123456
    assert fake_dispatch.smem_bytes(cfg, 0) == 123456 and fake_dispatch.smem_bytes(cfg, 0, ()) == 123456
    fake_dispatch.get_kernel(cfg, 0)
    assert reads == [cfg.smem_expression()]   # once per module, not per call


def test_the_kernel_sources_are_part_of_the_key(fake_dispatch, monkeypatch, tmp_path):
    """A kernel compiled from another copy of kernels_cu/ (Options.kernel_dir) is another module, kept beside
    the package's own one."""
    import shutil

    from cuflash import heuristics, options
    from cuflash.compile import package_kernel_dir

    cfg = heuristics.fwd_config("float16", 128, False, 90)
    monkeypatch.setattr(fake_dispatch, "_module_int", lambda *a: 1024)
    own = fake_dispatch.get_kernel(cfg, 0)
    shutil.copytree(package_kernel_dir(), tmp_path / "kernels_cu")
    with options.override(kernel_dir=str(tmp_path / "kernels_cu")):
        other = fake_dispatch.get_kernel(cfg, 0)
        assert fake_dispatch.get_kernel(cfg, 0) is other
    assert other is not own and fake_dispatch.get_kernel(cfg, 0) is own and len(_FakeModule.built) == 2


def test_aux_kernels_have_no_shared_memory_variable(fake_dispatch, monkeypatch):
    from cuflash import heuristics

    pre = heuristics.bwd_configs("float16", 64, False, 90).preprocess
    monkeypatch.setattr(fake_dispatch, "_module_int", lambda *a: pytest.fail("no variable to read"))
    fake_dispatch.get_kernel(pre, 0)
    assert _FakeModule.built == [(pre.name_expression(),)]
    assert fake_dispatch.smem_bytes(pre, 0) == 0


def test_a_kernel_over_the_device_limit_is_refused(fake_dispatch, monkeypatch):
    from cuflash import heuristics

    cfg = heuristics.fwd_config("float16", 128, False, 90)
    monkeypatch.setattr(fake_dispatch, "_module_int", lambda *a: 232448 + 16)
    with pytest.raises(RuntimeError, match=r"needs 232464 bytes of shared memory; the device allows 232448"):
        fake_dispatch.get_kernel(cfg, 0)
    assert not fake_dispatch._kernels and not fake_dispatch._smem


def test_offline_value_before_the_kernel_is_built(fake_dispatch):
    """Not compiled for the device: the value from the PTX of the variable for the device's target, with the
    build's NVRTC defines (a define the kernel does not know leaves the value alone)."""
    from cuflash import heuristics
    from cuflash.compile import smem_bytes_offline

    cfg = heuristics.fwd_config("float16", 128, False, 90)
    value = smem_bytes_offline(cfg, "90a", ())
    assert 1024 < value <= 232448
    assert fake_dispatch.smem_bytes(cfg, 0) == value == fake_dispatch.smem_bytes(cfg)
    assert fake_dispatch.smem_bytes(cfg, 0, ("-DCUFLASH_UNUSED_DEFINE=1",)) == value
    with pytest.raises(RuntimeError, match="static assertion failed"):   # the tile's own checks run
        smem_bytes_offline(replace(cfg, num_warps=8), "90a")


def test_a_family_without_the_variable_is_named():
    from cuflash.compile import smem_bytes_offline
    from cuflash.config import Family, KernelConfig, register_family

    register_family(Family("test_no_smem_var", "sm80/fwd.cu", "fwd_kernel_without_size", 80, False,
                           direction="fwd", backend="sm80"))
    try:
        with pytest.raises(RuntimeError, match=r"defines no `fwd_kernel_without_size_smem_bytes`"):
            smem_bytes_offline(KernelConfig("test_no_smem_var", "float16", 64, False, 128, 64, 4), "80")
    finally:
        from cuflash.config import FAMILIES

        FAMILIES.pop("test_no_smem_var")


@requires_gpu
def test_the_loaded_module_holds_the_offline_value():
    """On a GPU: the size each kernel's module holds (read by the dispatcher) equals the PTX value, and the
    kernel is allowed that much dynamic shared memory."""
    import cupy

    from cuflash import dispatch, heuristics, options
    from cuflash.compile import smem_bytes_offline, target

    dev = cupy.cuda.Device().id
    cc, _ = dispatch.real_device_info(dev)   # the kernels' target, whatever Options.plan_cc plans
    defines = options.current().nvrtc_defines
    cfgs = [heuristics.fwd_config("float16", 64, False, cc), heuristics.fwd_config("bfloat16", 128, True, cc),
            heuristics.fwd_config("float16", 64, False, cc, backend="sm80")]
    cfgs += [c for c in heuristics.bwd_configs("float16", 128, False, cc).all() if c is not None]
    for cfg in cfgs:
        kern = dispatch.get_kernel(cfg, dev)
        assert (cfg.key(), dev, defines, options.current().kernel_dir) in dispatch._smem, cfg.key()
        value = dispatch.smem_bytes(cfg, dev)
        assert value == smem_bytes_offline(cfg, target(cfg, cc), defines), cfg.key()
        assert (value > 0) == cfg.fam.dynamic_smem, cfg.key()
        if value > 48 * 1024:
            assert kern.max_dynamic_shared_size_bytes == value, cfg.key()
