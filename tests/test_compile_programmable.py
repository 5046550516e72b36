"""CPU-only: programmable attention's portable forward (sm80_fwd_prog) and Hopper forward (sm90_fwd_prog) compile
without register spills at every head-dim bucket, causal or not, for each programmable part and all of them at
once with the built-in variants, and the portable one's shared memory fits the 99 KB devices after
fit_shared_memory; the backward's likewise, and the float32 family's (simt_*_prog) on sm_80 and sm_90a."""
from __future__ import annotations

import numpy as np
import pytest

from compile_checks import assert_all_compile, kernel_smem
from cuflash import heuristics
from cuflash.modifiers import MaskMod, Modifiers, ScoreMod
from cuflash.variants import MaskVariant

HEAD_DIMS = (32, 64, 96, 128, 192, 256, 512)
_MODS = Modifiers(ScoreMod("return score + table[h * 64 + min(abs(q_idx - kv_idx), 63)];", grad="return 1.f;",
                           tensors={"table": np.zeros(8, np.float32)}),
                  MaskMod("return docs[q_idx] == docs[kv_idx];", tensors={"docs": np.zeros(8, np.int32)}))
VARIANTS = {
    "bias16": MaskVariant(bias="bfloat16"),
    "dropout": MaskVariant(dropout=True),
    "sparse_mods": MaskVariant(block_sparse=True, mods=_MODS.key),
    "all": MaskVariant(local=True, softcap=True, alibi=True, sink=True, chunk=True, bias="float32", dropout=True,
                       block_sparse=True, mods=_MODS.key),
}


def configs(cc: int = 80) -> list:
    out = []
    for name, var in VARIANTS.items():
        dtype = "float16" if name == "all" else "bfloat16"
        for d in HEAD_DIMS:
            for causal in (False, True):
                if name in ("dropout", "sparse_mods") and (causal or d in (32, 96, 192)):
                    continue   # one build per bucket family suffices for the parts alone
                out.append(heuristics.prog_fwd_config(dtype, d, causal, cc, var))
    return list({c.key(): c for c in out}.values())


def bwd_configs(cc: int = 80) -> list:
    """The backward's dK / dV and dQ kernels (sinks are the forward's alone) at every bucket up to 256."""
    from dataclasses import replace

    out = []
    for name, var in VARIANTS.items():
        var = replace(var, sink=False)
        for d in (32, 64, 96, 128, 192, 256):
            for causal in (False, True):
                if name in ("dropout", "sparse_mods") and (causal or d in (32, 96, 192)):
                    continue
                out += heuristics.prog_bwd_configs("float16" if name == "all" else "bfloat16", d, causal, cc,
                                                   var).all()[1:]
    return list({c.key(): c for c in out}.values())


def test_programmable_backward_compiles_without_spills():
    cfgs = bwd_configs()
    assert len(cfgs) >= 40 and {c.family for c in cfgs} == {"sm80_bwd_dkdv_prog", "sm80_bwd_dq_prog"}
    assert_all_compile(cfgs, "80")


def test_hopper_programmable_backward_compiles_without_spills():
    cfgs = [c for c in bwd_configs(90) if c.family == "sm90_bwd_dkdv_dqtile_prog"]
    assert len(cfgs) >= 20 and {(c.block_m, c.block_n) for c in cfgs} == {(64, 64), (64, 128)}
    assert_all_compile(cfgs, "90a")


def test_programmable_backward_tiles_fit_their_devices():
    """The portable backward's tables per shared-memory class: the A100's 163 KB and the 99 KB of sm_86 / sm_89."""
    from dataclasses import replace

    for cc, limit in ((80, 166912), (86, 101376)):
        for d in (64, 128, 256):
            cfgs = heuristics.prog_bwd_configs("bfloat16", d, True, cc, replace(VARIANTS["all"], sink=False)).all()[1:]
            for cfg, smem in kernel_smem(cfgs, "80").items():
                assert smem <= limit, (cfg.key(), smem)


def test_varlen_programmable_kernels_compile_without_spills():
    """Packed batches take the portable kernels on every GPU (Hopper too): the forward, dK / dV and dQ kernels
    with every programmable part and varlen on, at the head-dim buckets of the tuned tables."""
    from dataclasses import replace

    var = replace(VARIANTS["all"], varlen=True)
    cfgs = []
    for cc in (80, 90):
        for d in (64, 128, 256):
            fwd = heuristics.prog_fwd_config("float16", d, True, cc, var)
            assert fwd.family == "sm80_fwd_prog"
            cfgs += [fwd] + list(heuristics.prog_bwd_configs("float16", d, True, cc, replace(var, sink=False)).all()[1:])
    cfgs = list({c.key(): c for c in cfgs}.values())
    assert {c.family for c in cfgs} == {"sm80_fwd_prog", "sm80_bwd_dkdv_prog", "sm80_bwd_dq_prog"}
    assert_all_compile(cfgs, "80")


def test_programmable_forward_compiles_without_spills():
    cfgs = configs()
    assert len(cfgs) >= 30
    assert_all_compile(cfgs, "80")


def test_hopper_programmable_forward_compiles_without_spills():
    cfgs = [c for c in configs(90) if c.family == "sm90_fwd_prog"]
    assert len(cfgs) >= 20 and {c.block_n for c in cfgs} == {32, 64}
    assert_all_compile(cfgs, "90a")


@pytest.mark.parametrize("limit", [101376, 166912])
def test_programmable_forward_fits_smaller_shared_memories(limit):
    sizes = kernel_smem(configs(), "80")
    for cfg, smem in sizes.items():
        fitted = heuristics.fit_shared_memory(cfg, limit, lambda c: kernel_smem([c], "80")[c])
        assert fitted.block_m >= 16 and kernel_smem([fitted], "80")[fitted] <= limit, cfg.key()


def test_mask_tiles_kernel_compiles():
    """The mask modifier's tile evaluation, at the programmable forward's tiles."""
    from cuflash.config import KernelConfig

    tiles = {(c.block_m, c.block_n) for c in configs()}
    cfgs = [KernelConfig("mask_tiles", "float16", 0, False, bm, bn, 4, MaskVariant(mods=_MODS.key)) for bm, bn in tiles]
    assert_all_compile(cfgs, "80")


def test_block_lists_kernel_compiles():
    """The block-sparse key-tile lists' kernel (kernels_cu/aux/block_lists.cu)."""
    from cuflash import programmable
    from cuflash.config import KernelConfig

    assert_all_compile([KernelConfig("block_lists", "float16", 0, False, 0, 0, programmable.BLOCK_LISTS_WARPS)], "80")


# The float32 family (simt_fwd_prog; simt_bwd_dkdv_prog / simt_bwd_dq_prog, every GPU): the bias in q's dtype, and
# a score modifier with a tensor gradient (the dK / dV pass's atomics).
_MODS_GRADS = Modifiers(ScoreMod(_MODS.score_mod.source, grad="return 1.f;", tensors={"table": np.zeros(8, np.float32)},
                                 tensor_grads={"table": "atomicAdd(&d_table[h * 64 + min(abs(q_idx - kv_idx), 63)], "
                                                        "dscore);"}),
                        _MODS.mask_mod)
FLOAT32_VARIANTS = {
    "bias": MaskVariant(bias="float32"),
    "dropout": MaskVariant(dropout=True),
    "sparse_mods": MaskVariant(block_sparse=True, mods=_MODS_GRADS.key),
    "all": MaskVariant(local=True, softcap=True, alibi=True, sink=True, chunk=True, bias="float32", dropout=True,
                       block_sparse=True, mods=_MODS_GRADS.key),
}


def float32_configs(cc: int = 80, backward: bool = False) -> list:
    """The float32 programmable kernels at every head-dim bucket up to 256, causal or not, for each part and all of
    them at once (the backward's dK / dV and dQ kernels, without sinks)."""
    from dataclasses import replace

    out = []
    for name, var in FLOAT32_VARIANTS.items():
        for d in (32, 64, 96, 128, 192, 256):
            for causal in (False, True):
                if name in ("dropout", "sparse_mods") and (causal or d in (32, 96, 192)):
                    continue   # one build per bucket family suffices for the parts alone
                if backward:
                    out += heuristics.prog_bwd_configs("float32", d, causal, cc, replace(var, sink=False)).all()[1:]
                else:
                    out.append(heuristics.prog_fwd_config("float32", d, causal, cc, var))
    return list({c.key(): c for c in out}.values())


@pytest.mark.parametrize("cc", ["80", "90a"])
def test_float32_programmable_forward_compiles_without_spills(cc):
    cfgs = float32_configs(int(cc[:2]))
    assert len(cfgs) >= 30 and {c.family for c in cfgs} == {"simt_fwd_prog"}
    assert_all_compile(cfgs, cc)


@pytest.mark.parametrize("cc", ["80", "90a"])
def test_float32_programmable_backward_compiles_without_spills(cc):
    cfgs = float32_configs(int(cc[:2]), backward=True)
    assert len(cfgs) >= 60 and {c.family for c in cfgs} == {"simt_bwd_dkdv_prog", "simt_bwd_dq_prog"}
    assert_all_compile(cfgs, cc)


def test_float32_programmable_kernels_fit_their_devices():
    """The forward's tiles after fit_shared_memory and the backward's table per shared-memory class, dropout's
    flags included: the A100's 163 KB and the 99 KB of sm_86 / sm_89; the narrowed forward tiles with every part
    on compile without spills too."""
    narrowed = {}
    for cc, limit in ((80, 166912), (86, 101376)):
        for cfg, smem in kernel_smem(float32_configs(cc), "80").items():
            fitted = heuristics.fit_shared_memory(cfg, limit, lambda c: kernel_smem([c], "80")[c])
            assert fitted.block_m >= 16 and kernel_smem([fitted], "80")[fitted] <= limit, cfg.key()
            if fitted != cfg and cfg.variant == FLOAT32_VARIANTS["all"]:
                narrowed[fitted.key()] = fitted
        for cfg, smem in kernel_smem(float32_configs(cc, backward=True), "80").items():
            assert smem <= limit, (cfg.key(), smem)
    assert narrowed
    assert_all_compile(list(narrowed.values()), "80")
