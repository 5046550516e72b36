"""CPU only: Options.plan_cc ($CUFLASH_PLAN_CC) makes the dispatcher plan as on another GPU. The device query is
faked (an H100, an A100, an RTX 4090, a B200), so that what the dispatcher plans, and what it compiles for, can be
read without one: the planned compute capability and shared-memory limit, the refusals, the tables the plans take
(the A100's, the 99 KB cards', the B200's), and a B200 taking the portable kernels by default."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

from cuflash import api, dispatch, fp8, heuristics, kvcache, options
from cuflash.options import Options

pytest.importorskip("cupy")

H100, A100, RTX4090, RTX5090, B200 = (90, 232448), (80, 166912), (89, 101376), (120, 101376), (100, 232448)


@pytest.mark.parametrize("real,plan_cc,planned", [
    (H100, None, H100), (H100, 90, H100), (H100, 80, (80, 166912)), (H100, 86, (86, 101376)),
    (H100, 89, (89, 101376)), (H100, 120, (120, 101376)), (H100, 100, (100, 232448)),
    (RTX4090, 80, (80, 101376)),    # the A100's tables within the card's own 99 KB
    (A100, 86, (86, 101376)), (A100, 87, (87, 166912)), (B200, 120, (120, 101376)), (RTX5090, 100, (100, 101376))])
def test_planned_device(real, plan_cc, planned):
    assert dispatch.planned_device(real, plan_cc) == planned


@pytest.mark.parametrize("real,plan_cc,allowed", [
    (A100, 90, "80, 86, 87"), (A100, 89, "80, 86, 87"), (A100, 100, "80, 86, 87"), (A100, 120, "80, 86, 87"),
    ((86, 101376), 89, "80, 86, 87"), (B200, 90, "80, 86, 87, 89, 100, 101, 103, 110, 120, 121"),
    (RTX5090, 90, "80, 86, 87, 89, 100, 101, 103, 110, 120, 121")])
def test_refusals_name_the_variable_and_what_the_device_allows(real, plan_cc, allowed):
    with pytest.raises(ValueError) as e:
        dispatch.planned_device(real, plan_cc, device_id=3)
    message = str(e.value)
    assert message.startswith(f"CUFLASH_PLAN_CC (Options.plan_cc) = {plan_cc} cannot be honoured on device 3 "
                              f"(compute capability {real[0] // 10}.{real[0] % 10})"), message
    assert message.endswith(f"there it may be one of {allowed}, or unset"), message
    assert ("sm_90a" in message) == (plan_cc == 90), message


def test_every_device_may_plan_as_itself():
    for cc in options.PLAN_CCS:
        assert cc in dispatch.plan_ccs(cc)
        assert dispatch.planned_device((cc, heuristics.SMEM_OPTIN[cc]), cc) == (cc, heuristics.SMEM_OPTIN[cc])


class _FakeModule:
    """Stands for cupy.RawModule: records the options of each compile."""

    options: list = []

    def __init__(self, code, options, name_expressions):
        type(self).options.append(tuple(options))

    def get_function(self, name):
        return type("FakeKernel", (), {"name": name})()


@pytest.fixture
def fake_gpu(monkeypatch):
    """``fake_gpu(cc, smem)`` makes device 0 a GPU of that compute capability and opt-in shared memory, as CuPy's
    device query reports it, with compiles faked (_FakeModule) and fresh kernel, plan and device caches."""
    import cupy

    def use(real: tuple) -> None:
        cc, smem = real

        class FakeDevice(contextlib.nullcontext):
            def __init__(self, device_id=0):
                super().__init__()
                self.id, self.compute_capability = device_id, str(cc)
                self.attributes = {"MaxSharedMemoryPerBlockOptin": smem}

        monkeypatch.setattr(cupy.cuda, "Device", FakeDevice)
        for name in ("_device_info", "_kernels", "_modules", "_smem", "_key_locks"):
            monkeypatch.setattr(dispatch, name, {})
        for module, name in ((api, "_fwd_plans"), (api, "_bwd_plans"), (fp8, "_plans"), (kvcache, "_plans")):
            monkeypatch.setattr(module, name, {})

    _FakeModule.options = []
    monkeypatch.setattr(cupy, "RawModule", _FakeModule)
    monkeypatch.setattr(dispatch, "_module_int", lambda module, expr, device_id: 1024)   # no module to read
    options.use(Options())   # conftest restores the options after the test
    return use


def test_device_info_plans_while_the_compiles_keep_the_device(fake_gpu):
    """device_info applies Options.plan_cc (the current options, or those given); real_device_info and its cache
    keep the device's own, which the compiles read."""
    fake_gpu(H100)
    assert dispatch.device_info(0) == H100
    with options.override(plan_cc=80):
        assert dispatch.device_info(0) == (80, 166912)
        assert dispatch.real_device_info(0) == H100
        assert dispatch.device_info(0, Options()) == H100
    assert dispatch.device_info(0, Options(plan_cc=86)) == (86, 101376) and dispatch.device_info(0) == H100
    assert dispatch._device_info == {0: H100}
    fake_gpu(A100)
    with options.override(plan_cc=90), pytest.raises(ValueError, match=r"CUFLASH_PLAN_CC .* = 90"):
        api._fwd_plan(np.float16, 128, False, 0)
    with options.override(plan_cc=89), pytest.raises(ValueError, match=r"CUFLASH_PLAN_CC .* = 89"):
        api._bwd_plan(np.float16, 128, False, False, 0)


def _fwd(dtype, head_dim: int, causal: bool) -> str:
    return api._fwd_plan(np.dtype(dtype), head_dim, causal, 0)[1].key()


def _bwd(head_dim: int, deterministic: bool) -> list:
    return [None if p is None else p[1].key() for p in api._bwd_plan(np.float16, head_dim, True, deterministic, 0)]


# What an H100 plans under each CUFLASH_PLAN_CC: (forward fp16 D=128 causal, forward float32 D=192, forward bf16
# D=512, the backward's dK/dV kernel of fp16 D=128 causal in the atomic and the deterministic mode).
PLANS = {
    None: ("sm90_fwd_overlap_p:float16:d128:causal:m128n128w12", "simt_fwd:float32:d192:full:m64n32w8",
           "sm90_fwd_split:bfloat16:d512:full:m64n64w12", "sm90_bwd_dkdv_dqtile:float16:d128:causal:m64n128w12",
           "sm90_bwd_dkdv_dqtile_ordered:float16:d128:causal:m64n128w12"),
    # The A100's: the large tables, dK/dV version 2 at its 163 KB tile for d=128, the tiles within 163 KB (the
    # large head dims' 16-key tiles).
    80: ("sm80_fwd:float16:d128:causal:m128n32w4", "simt_fwd:float32:d192:full:m64n32w8",
         "sm80_fwd:bfloat16:d512:full:m64n16w8", "sm80_bwd_dkdv2_dq:float16:d128:causal:m64n128w8",
         "sm80_bwd_dkdv2:float16:d128:causal:m64n128w8"),
    # The 99 KB cards': the small backward table (dK/dV version 2 with one dO stage at d=128), the forward's tiles
    # narrowed to 101376 bytes.
    86: ("sm80_fwd:float16:d128:causal:m128n32w4", "simt_fwd:float32:d192:full:m64n16w8",
         "sm80_fwd:bfloat16:d512:full:m32n16w4", "sm80_bwd_dkdv2_dq_do1:float16:d128:causal:m64n64w8",
         "sm80_bwd_dkdv2_do1:float16:d128:causal:m64n64w8"),
    # The B200's: the portable kernels at the H100's shared memory, dK/dV version 2.
    100: ("sm80_fwd:float16:d128:causal:m128n32w4", "simt_fwd:float32:d192:full:m64n32w8",
          "sm80_fwd:bfloat16:d512:full:m64n32w8", "sm80_bwd_dkdv2_dq:float16:d128:causal:m64n128w8",
          "sm80_bwd_dkdv2:float16:d128:causal:m64n128w8"),
}
PLANS[89] = PLANS[120] = PLANS[86]


@pytest.mark.parametrize("plan_cc", sorted(PLANS, key=str))
def test_an_h100_plans_the_tables_of_the_planned_gpu(fake_gpu, plan_cc):
    """The forward and backward plans take the planned GPU's tables and shared memory, and each kernel is compiled
    for the H100 itself: the portable ones without an -arch of their own (CuPy appends the device's), the Hopper
    ones for sm_90a. Plans made under one setting are not reused under another."""
    fake_gpu(H100)
    options.set(plan_cc=plan_cc)
    got = (_fwd("float16", 128, True), _fwd("float32", 192, False), _fwd("bfloat16", 512, False),
           _bwd(128, False)[1], _bwd(128, True)[1])
    assert got == PLANS[plan_cc]
    archs = {o for opts in _FakeModule.options for o in opts if o.startswith("-arch=")}
    assert archs == ({"-arch=sm_90a"} if plan_cc is None else set()), archs
    options.set(plan_cc=None if plan_cc else 86)
    assert _fwd("float16", 128, True) == PLANS[None if plan_cc else 86][0]


def test_99kb_cards_get_the_small_table_fitted():
    """Every plan of the 99 KB table fits 101376 bytes: the backward's small table as it is, each forward tile
    narrowed by fit_shared_memory (here, where the PTX gives the kernels' sizes, as on the device)."""
    from compile_checks import kernel_smem

    limit = dispatch.planned_device(H100, 86)[1]
    assert limit == 101376
    bwd = [c for c in heuristics.all_bwd_configs(86) if c.fam.dynamic_smem]
    assert {c.key() for c in bwd} != {c.key() for c in heuristics.all_bwd_configs(80) if c.fam.dynamic_smem}
    sizes = kernel_smem(bwd, "90")
    assert max(sizes.values()) <= limit
    tuned = heuristics.all_fwd_configs(86)
    fitted = {heuristics.fit_shared_memory(c, limit, lambda x: kernel_smem([x], "90")[x]) for c in tuned
              if c.head_dim in (128, 192, 256)}
    assert max(kernel_smem(fitted, "90").values()) <= limit
    assert fitted - set(tuned), "some tuned forward tile is narrowed"


def test_b200_takes_the_portable_kernels(fake_gpu):
    """sm_100 (B200) runs the portable kernels until it has its own: the forward, the backward (dK/dV version 2 on
    its 227 KB), the decode ring; a forced Hopper decode kernel and the fp8 forward are refused there."""
    fake_gpu(B200)
    assert dispatch.device_info(0) == B200
    assert _fwd("bfloat16", 128, False).startswith("sm80_fwd:") and _fwd("float32", 64, True).startswith("simt_fwd:")
    assert _bwd(128, False)[1] == PLANS[100][3]
    assert heuristics.fwd_config("float16", 64, False, 100).family == "sm80_fwd"
    assert heuristics.bwd_configs("bfloat16", 64, False, 100).dkdv.family == "sm80_bwd_dkdv2_dq"
    assert kvcache.decode_backend(0, options.current()) == "sm80"
    with pytest.raises(ValueError, match="CUFLASH_DECODE_BACKEND=sm90"):
        kvcache.decode_backend(0, Options(decode_backend="sm90"))
    with pytest.raises(RuntimeError, match="Hopper"):
        fp8._plan(128, False, 0)
    assert set(_FakeModule.options) and not any(o.startswith("-arch=") for opts in _FakeModule.options for o in opts)


def test_planned_a100_keeps_the_hopper_only_paths_off(fake_gpu):
    """An H100 planned as an A100 takes what an A100 takes: the portable decode ring, no fp8 forward."""
    fake_gpu(H100)
    assert kvcache.decode_backend(0, Options()) == "sm90_tma"
    assert kvcache.decode_backend(0, Options(plan_cc=80)) == "sm80"
    options.set(plan_cc=80)
    with pytest.raises(RuntimeError, match="Hopper"):
        fp8._plan(128, False, 0)
