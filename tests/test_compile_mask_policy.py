"""The mask / score-modifier policy's hooks (kernels_cu/common/mask.cuh), CPU only.

Every kernel family asks the policy about the attention pattern; the score modifier (and, in the backward, its
derivative) appears in code only where a policy sets ``kHasScoreMod``, which no shipped policy does yet. So
that those code paths stay buildable until the first variant (softcap, ALiBi) uses them, this test builds every
family with ``CausalMask`` turned into a softcap policy, from a copy of the kernel sources.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from cuflash import compile as cf_compile, heuristics

pytest.importorskip("cupy")

SOFTCAP = {
    "static constexpr bool kHasScoreMod = false;": "static constexpr bool kHasScoreMod = true;",
    "float modify_score(float s, int /*row*/, int /*col*/) const { return s; }":
        "float modify_score(float s, int /*row*/, int /*col*/) const { return 30.f * tanhf(s / 30.f); }",
    "float score_derivative(float /*s*/, int /*row*/, int /*col*/) const { return 1.f; }":
        "float score_derivative(float s, int /*row*/, int /*col*/) const {\n"
        "        const float t = tanhf(s / 30.f);\n        return 1.f - t * t;\n    }",
}


def _configs() -> list:
    h = heuristics
    cfgs = [h.fwd_config("float16", 64, True, 80, backend="sm80"), h.fwd_config("float32", 64, True, 80),
            h.fwd_config("bfloat16", 128, True, 90), h.fwd_config("float16", 64, False, 90),
            h.fwd_config("bfloat16", 128, False, 90, long_seqs=True), h.fp8_fwd_config(128, True)]
    for dtype, d, causal, cc, det, backend in (("float16", 64, True, 80, False, None), ("float16", 64, True, 80, True, None),
                                               ("float16", 128, False, 90, False, "sm80"), ("float32", 64, True, 80, False, None),
                                               ("bfloat16", 128, True, 90, False, None), ("float16", 64, False, 90, True, None)):
        cfgs += h.bwd_configs(dtype, d, causal, cc, deterministic=det, backend=backend).all()
    return list({c.key(): c for c in cfgs if c.fam.dynamic_smem}.values())


@pytest.fixture(scope="module")
def softcap_sources(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("softcap") / "kernels_cu"
    shutil.copytree(cf_compile.kernel_dir(), root)
    mask = root / "common" / "mask.cuh"
    text = mask.read_text()
    for old, new in SOFTCAP.items():
        assert old in text, f"mask.cuh changed: update this test's softcap policy ({old!r})"
        text = text.replace(old, new)
    mask.write_text(text)
    return root


@pytest.mark.parametrize("cfg", _configs(), ids=lambda c: c.key())
def test_every_family_compiles_with_a_score_modifier(cfg, softcap_sources, monkeypatch):
    monkeypatch.setattr(cf_compile, "kernel_dir", lambda: softcap_sources)
    cf_compile.load_source.cache_clear()
    try:
        ptx, _ = cf_compile.compile_offline(cfg, "90a" if cfg.fam.arch_specific else "80", verbose_ptxas=False, ptx=True)
    finally:
        cf_compile.load_source.cache_clear()
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    assert "0f41F00000" in ptx   # the modifier's cap (30.0f) is in the code: the hook is called
