"""Why the kernels cannot run here, in words a newcomer can act on.

``python -m cuflash`` prints it, and the library raises it (``DeviceUnavailableError``) in place of
CuPy's bare ``cudaErrorInsufficientDriver`` / ``cudaErrorNoDevice`` when a call reaches the device.
Only the error paths call into this module: the hot path never pays for it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

MIN_CC = 80   # the portable kernels are sm_80 code (cp.async, bf16 mma)
# Oldest driver branch of each CUDA major version (minor-version compatibility: any 12.x runtime
# runs on an R525 driver, any 13.x on R580).
MIN_DRIVER = {11: "R450", 12: "R525", 13: "R580"}
_STILL_WORKS = ("Without a GPU, cuflash still installs, compiles its kernels and runs its argument checks and "
                "its float64 reference (cuflash.attention_reference); the tests of those run too: install the "
                "test extra (pip install 'cuflash[cuda12,test]', or [cuda13,test]), then python -m pytest tests.")


class DeviceUnavailableError(RuntimeError):
    """No usable NVIDIA GPU for the kernels: no driver, no GPU, a driver older than CuPy's CUDA
    runtime, or a GPU older than compute capability 8.0. A RuntimeError, as CuPy's CUDA errors are."""


@dataclass(frozen=True)
class DeviceProblem:
    """One reason the kernels cannot run: ``case`` names it, ``advice`` says what to do."""

    case: str
    advice: str

    def message(self) -> str:
        return f"cuflash cannot run its kernels here: {self.case}.\n{self.advice}\n{_STILL_WORKS}"


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def diagnose(runtime=None) -> Optional[DeviceProblem]:
    """The problem with this machine's CUDA setup, or None when a GPU of compute capability >= 8.0 is
    usable. ``runtime`` defaults to ``cupy.cuda.runtime`` (tests pass a stand-in)."""
    if runtime is None:
        try:
            from cupy.cuda import runtime
        except ImportError:
            return DeviceProblem("CuPy is not installed",
                                 "Install it with the CUDA extra: pip install 'cuflash[cuda12]' (or [cuda13]).")
    error = runtime.CUDARuntimeError
    try:
        driver = runtime.driverGetVersion()   # 0 when no driver is loaded
    except error:
        driver = 0
    rt = runtime.runtimeGetVersion()
    major = rt // 1000
    if driver == 0:
        return DeviceProblem(
            "no NVIDIA driver",
            "Install the NVIDIA driver (and, in a container, run it with the GPU passed through, e.g. "
            f"docker run --gpus all). CuPy's CUDA {_cuda_version(rt)} runtime needs driver "
            f">= {MIN_DRIVER.get(major, f'one for CUDA {major}.0')}.")
    if driver < major * 1000:
        return _old_driver(driver, rt)
    try:
        count = runtime.getDeviceCount()
    except error as e:
        if getattr(e, "status", None) == 35:   # cudaErrorInsufficientDriver
            return _old_driver(driver, rt)
        return DeviceProblem(f"no GPU ({e})", _NO_GPU_ADVICE)
    if count == 0:
        return DeviceProblem("no GPU", _NO_GPU_ADVICE)
    props = runtime.getDeviceProperties(runtime.getDevice())
    cc = 10 * int(props["major"]) + int(props["minor"])
    if cc < MIN_CC:
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        return DeviceProblem(f"GPU older than sm_80 ({name}, sm_{cc})",
                             "cuflash needs compute capability >= 8.0 (A100, RTX 30xx or newer; Hopper for "
                             "the sm90 kernels and fp8). Select another GPU with CUDA_VISIBLE_DEVICES.")
    return None


_NO_GPU_ADVICE = ("No NVIDIA GPU is visible: check nvidia-smi, CUDA_VISIBLE_DEVICES and, in a container, "
                  "that the GPU is passed through (docker run --gpus all).")


def _old_driver(driver: int, rt: int) -> DeviceProblem:
    major = rt // 1000
    need = MIN_DRIVER.get(major, f"one for CUDA {major}.0")
    return DeviceProblem(
        f"driver older than the CUDA runtime (needs >= {need})",
        f"The driver supports CUDA {_cuda_version(driver)}, CuPy's runtime is CUDA {_cuda_version(rt)}: "
        f"update the driver to {need} or newer, or install the extra of an older CUDA "
        f"(pip install 'cuflash[cuda12]' needs R525).")


def reraise_explained(error: BaseException) -> None:
    """Called in an ``except RuntimeError`` around device work: raises ``DeviceUnavailableError``
    with the diagnosis, chained to ``error``, when the machine has a problem; returns otherwise (the
    caller re-raises ``error`` as it is)."""
    if isinstance(error, DeviceUnavailableError):
        return
    try:
        problem = diagnose()
    except Exception:  # noqa: BLE001 - a failing diagnosis must not hide the original error
        return
    if problem is not None:
        raise DeviceUnavailableError(problem.message()) from error
