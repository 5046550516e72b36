"""CPU: which "cannot run here" message a machine gets (cuflash/device_check.py), with CuPy's runtime
calls stood in for, and that ``python -m cuflash`` and the library's own errors carry it."""
from __future__ import annotations

import io

import numpy as np
import pytest
from cupy.cuda.runtime import CUDARuntimeError

import cuflash
from cuflash import __main__ as cli
from cuflash import api, device_check
from conftest import fake_cupy_array


class FakeRuntime:
    """The few ``cupy.cuda.runtime`` calls diagnose makes, answering as the machine described."""

    CUDARuntimeError = CUDARuntimeError

    def __init__(self, driver=12080, runtime=12090, count=1, cc=(9, 0), count_error=None):
        self.driver, self.runtime, self.count, self.cc, self.count_error = driver, runtime, count, cc, count_error

    def driverGetVersion(self):
        return self.driver

    def runtimeGetVersion(self):
        return self.runtime

    def getDeviceCount(self):
        if self.count_error is not None:
            raise CUDARuntimeError(self.count_error)
        return self.count

    def getDevice(self):
        return 0

    def getDeviceProperties(self, device):
        return {"major": self.cc[0], "minor": self.cc[1], "name": b"Tesla V100"}


_diagnose = device_check.diagnose


def _diagnosed(machine):
    """diagnose() as it answers on ``machine``, whatever the caller passes."""
    return lambda runtime=None: _diagnose(machine)


@pytest.mark.parametrize("machine,case", [
    (FakeRuntime(driver=0), "no NVIDIA driver"),
    (FakeRuntime(driver=11040), "driver older than the CUDA runtime (needs >= R525)"),
    (FakeRuntime(driver=12080, runtime=13000), "driver older than the CUDA runtime (needs >= R580)"),
    (FakeRuntime(count_error=35), "driver older than the CUDA runtime (needs >= R525)"),
    (FakeRuntime(count=0), "no GPU"),
    (FakeRuntime(count_error=100), "no GPU"),   # cudaErrorNoDevice
    (FakeRuntime(cc=(7, 0)), "GPU older than sm_80"),
])
def test_diagnosis(machine, case):
    problem = device_check.diagnose(machine)
    assert problem is not None and problem.case.startswith(case)
    text = problem.message()
    assert "argument checks" in text and "python -m pytest tests" in text


@pytest.mark.parametrize("cc", [(8, 0), (8, 6), (9, 0), (10, 0)])
def test_usable_gpu_has_no_problem(cc):
    assert device_check.diagnose(FakeRuntime(cc=cc)) is None


def test_old_driver_message_names_both_versions():
    text = device_check.diagnose(FakeRuntime(driver=11040, runtime=12090)).message()
    assert "CUDA 11.4" in text and "CUDA 12.9" in text and "R525" in text


def test_cli_reports_on_stderr_and_exits_nonzero(monkeypatch, capsys):
    monkeypatch.setattr(device_check, "diagnose", _diagnosed(FakeRuntime(count=0)))
    assert cli.main(["--no-bench"]) != 0
    captured = capsys.readouterr()
    assert "no GPU" in captured.err and "argument checks" in captured.err
    assert captured.out == ""


def test_library_error_carries_the_diagnosis(monkeypatch):
    """A call with good arguments on a machine without a GPU: CuPy's bare CUDA error becomes a
    DeviceUnavailableError (a RuntimeError) with the same text as ``python -m cuflash``."""
    import cupy

    def no_driver(*args, **kwargs):
        raise CUDARuntimeError(35)

    monkeypatch.setattr(device_check, "diagnose", _diagnosed(FakeRuntime(driver=0)))
    monkeypatch.setattr(cupy, "empty", no_driver)   # the first thing the forward does on the device
    monkeypatch.setattr(cupy, "full", no_driver)    # forward_fp8: a float descale goes to the device
    monkeypatch.setattr(cupy.cuda, "Device", lambda *a: _NullDevice())
    x = fake_cupy_array((1, 4, 2, 64))
    monkeypatch.setattr(api.call_cache, "_current_stream", no_driver)
    for call in (lambda: cuflash.forward(x, x, x),
                 lambda: cuflash.backward(x, x, x, x, x, fake_cupy_array((1, 2, 4), np.float32)),
                 lambda: cuflash.forward_fp8(*(fake_cupy_array((1, 4, 2, 64), np.uint8) for _ in range(3)),
                                             1.0, 1.0, 1.0)):
        with pytest.raises(device_check.DeviceUnavailableError, match="no NVIDIA driver") as info:
            call()
        assert isinstance(info.value.__cause__, CUDARuntimeError)


def test_other_runtime_errors_pass_through(monkeypatch):
    monkeypatch.setattr(device_check, "diagnose", lambda runtime=None: None)
    err = RuntimeError("the fp8 forward needs a Hopper GPU")
    device_check.reraise_explained(err)   # returns: the caller re-raises it as it is


class _NullDevice:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

