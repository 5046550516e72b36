"""CPU only: the varlen kernels (MaskVariant::kVarlen) and the forwards with a value head dim of their own
(kHeadDimV) compile without register spills: the Hopper forward and backward (both dQ modes, 128- and 64-row query
tiles, split-D), the portable forward, dK/dV and dQ kernels, the float32 kernels, causal and not. (A window,
softcap or ALiBi on top of varlen spills a few bytes in the Hopper backward's 128-row tiles, as the dense
kernels with them do there; those are left out.) Each distinct instantiation is compiled once."""
from __future__ import annotations

import pytest

from cuflash import heuristics
from cuflash.variants import MaskVariant

from compile_checks import assert_all_compile

pytest.importorskip("cupy")

VARLEN = MaskVariant(varlen=True)


def _unique(cfgs) -> list:
    return list({c.key(): c for c in cfgs}.values())


def _varlen_sm90() -> list:
    out = []
    for causal in (False, True):
        for d in (64, 128, 256):
            for short in (False, True):
                out.append(heuristics.fwd_config("bfloat16", d, causal, 90, short=short, variant=VARLEN))
            for det in (False, True):
                out.append(heuristics.bwd_configs("bfloat16", d, causal, 90, det, backend="sm90", variant=VARLEN).dkdv)
    return _unique(out)


def varlen_portable(cc: int = 80) -> list:
    """The portable varlen kernels of a device of compute capability ``cc``'s tables (forward, dK/dV, dQ)."""
    out = []
    for causal in (False, True):
        for dtype, d in (("float16", 64), ("bfloat16", 128), ("float32", 64), ("float32", 128)):
            out.append(heuristics.fwd_config(dtype, d, causal, cc, backend="sm80", variant=VARLEN))
            for det in (False, True):
                c = heuristics.bwd_configs(dtype, d, causal, cc, det, backend="sm80", variant=VARLEN)
                out += [x for x in (c.dkdv, c.dq) if x is not None]
    return _unique(out)


DV_PAIRS = ((192, 128), (64, 128), (128, 64))   # (q / k, v) head dims


def dv_portable(cc: int = 80) -> list:
    """The portable forwards with a value head dim of its own (16-bit and float32) on a device of ``cc``."""
    return _unique(heuristics.fwd_config(dtype, dqk, causal, cc, backend="sm80", head_dim_v=dv)
                   for causal in (False, True) for dqk, dv in DV_PAIRS for dtype in ("float16", "float32"))


def _dv() -> list:
    out = []
    for causal in (False, True):
        for dqk, dv in DV_PAIRS:
            out.append(heuristics.fwd_config("bfloat16", dqk, causal, 90, head_dim_v=dv))
            out.append(heuristics.fwd_config("bfloat16", dqk, causal, 90, variant=VARLEN, head_dim_v=dv))
    return _unique(out + dv_portable())


def test_varlen_hopper_kernels_compile_without_spills():
    assert_all_compile(_varlen_sm90(), "90a")


def test_varlen_portable_kernels_compile_without_spills():
    assert_all_compile(varlen_portable(), "80")


def test_value_head_dim_forwards_compile_without_spills():
    cfgs = _dv()
    assert_all_compile([c for c in cfgs if c.fam.arch_specific], "90a")
    assert_all_compile([c for c in cfgs if not c.fam.arch_specific], "80")


def test_aux_kernels_with_the_varlen_branch_compile_without_spills():
    # The pre/postprocess take varlen as a run-time branch: every dtype's instantiation.
    cfgs = []
    for dtype in ("float16", "bfloat16", "float32"):
        c = heuristics.bwd_configs(dtype, 64, False, 80, backend="sm80", variant=VARLEN)
        cfgs += [x for x in (c.preprocess, c.postprocess) if x is not None]
    for d in (64, 128):
        cfgs.append(heuristics.bwd_configs("bfloat16", d, False, 90, backend="sm90", variant=VARLEN).postprocess)
    assert_all_compile(_unique(cfgs), "80")
