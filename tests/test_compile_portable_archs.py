"""CPU only: every kernel that the dispatcher can choose on the 99 KB cards of sm_89 (RTX 40xx, L4, L40S) and sm_120
(RTX 50xx) (portable_configs: the forward fitted to their shared memory, the backward's small table, the decode
kernels decode_config picks, the helpers) builds for their arch without register spills or a stack frame, within
their 101376 bytes of shared memory, and disassembles: each kernel in the SASS, no local memory, tensor-core MMAs
(HMMA) in the 16-bit kernels and none in the exact float32 ones. The other compile tests build the portable kernels
for sm_80 (and sm_90a); sm_89 stands for sm_86 (RTX 30xx) too: the same tables and register file, and
sm_86's instructions (sm_89 adds the fp8 conversions).

An arch that this NVRTC cannot target skips, saying so. The configs are compiled in NVRTC programs of CHUNK kernels
of one source on a thread pool of os.cpu_count() workers (NVRTC runs without the GIL)."""
from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from cuflash import heuristics
from cuflash.config import KernelConfig

from compile_checks import build_and_disassemble, kernel_smem
import portable_configs as portable

pytest.importorskip("cupy")

ARCHS = ("89", "120")
portable_configs = functools.lru_cache(maxsize=None)(portable.portable_configs)   # the gap tests' lookups
CHUNK = 16   # kernels per NVRTC program: one parse of the source and one disassembly for the lot

# What the dispatcher chooses on these cards that does not build, fit or keep its registers there yet, by arch
# (None: both) and config key, with why. Expected to fail (test_known_gaps, strict: a fix makes it say to drop the
# entry); test_portable_kernels_build_for_the_99kb_cards passes over them. Issue #46.
_NO_SIMT_LARGE_BWD = ("the exact float32 backward above head dim 256 has one tile, 16 rows in 151 KB of shared "
                      "memory: no smaller tile of its kernels fits 99 KB")
_NO_SIMT_LARGE_FWD = ("the exact float32 forward's 16-row tile needs over 99 KB from head dim 512 on, and "
                      "fit_shared_memory's next one, 8 rows on 4 warps, has fewer threads than a row has float4 "
                      "columns above head dim 512 (kernels_cu/simt/fwd.cu: \"need at least head_dim / 4 threads\")")
# sm_120's ptxas (NVRTC 12.9) allocates more registers than sm_89's for the same code (e.g. 255 against 133 in the
# float32 dQ kernel at head dim 576); these tiles spill there and not on sm_89 / sm_80.
_SM120_REGISTER_BOUND = ("sm_120 spills this tile at 255 registers (none on sm_89): a narrower tile for sm_120, "
                         "or fewer values per thread in the kernel")
_SM120_PTXAS_SPILLS = ("sm_120's ptxas spills a few bytes well below the register limit (40-80 registers; none on "
                       "sm_89): no register pressure of the tile, the kernel's code needs a look for sm_120")
KNOWN_GAPS = {
    **{(None, f"simt_bwd_{k}:float32:d576:{mask}:m16n16w{w}"): _NO_SIMT_LARGE_BWD
       for k, w in (("dkdv", 8), ("dq", 4)) for mask in ("full", "causal")},
    **{(None, f"simt_fwd:float32:d576v{dv}:{mask}:m8n16w4"): _NO_SIMT_LARGE_FWD
       for dv in (128, 512) for mask in ("full", "causal")},
    **{("120", key): _SM120_REGISTER_BOUND
       for key in ("sm80_fwd:bfloat16:d128:full:V:m128n32w4", "sm80_fwd:float16:d96:causal:LCSAK:m128n64w4",
                   "sm80_fwd:float16:d128:causal:LCSAK:m128n32w4", "sm80_bwd_dq:float16:d96:causal:LCSAK:m64n64w4",
                   "decode:float32:d128:causal:m16n32w2", "decode:float32:d64:full:LCSAK:m32n32w4",
                   "decode:float32:d256:full:m16n16w1", "decode:float32:d128v64:causal:m64n32w8")},
    **{("120", key): _SM120_PTXAS_SPILLS
       for key in ("simt_fwd:float32:d16:full:m64n64w4", "simt_fwd:float32:d16:causal:m64n64w4",
                   "simt_bwd_dkdv:float32:d32:causal:m32n32w8", "simt_bwd_dq:float32:d256:full:m16n16w8",
                   "simt_bwd_dq:float32:d256:causal:m16n16w8")},
}


def known_gaps(arch: str) -> dict:
    """{config key: why} of KNOWN_GAPS for sm_<arch>."""
    return {key: why for (only, key), why in KNOWN_GAPS.items() if only in (None, arch)}


def _tensor_core_kernel(cfg: KernelConfig) -> bool:
    """Whether the kernel's products run on mma.sync (HMMA): the 16-bit attention and decode kernels."""
    return cfg.fam.backend == "sm80" or (cfg.family in ("decode", "decode_fp8") and cfg.dtype != "float32")


def _supported(arch: str) -> None:
    from cupy.cuda import nvrtc

    archs = nvrtc.getSupportedArchs()
    if int(arch) not in archs:
        pytest.skip(f"NVRTC {'.'.join(map(str, nvrtc.getVersion()))} cannot target sm_{arch} "
                    f"(it targets sm_{', sm_'.join(map(str, archs))})")


def _chunks(configs: list) -> list:
    by_source: dict = {}
    for c in configs:
        by_source.setdefault(c.source, []).append(c)
    return [group[i:i + CHUNK] for group in by_source.values() for i in range(0, len(group), CHUNK)]


def problems(configs: list, arch: str) -> dict:
    """{config key: what is wrong with it built for sm_<arch>} over ``configs``, built on a thread pool."""
    limit = heuristics.SMEM_OPTIN[int(arch)]
    out = {c.key(): f"{c.key()} sm_{arch}: {size} bytes of shared memory, over the card's {limit}"
           for c, size in kernel_smem(configs, arch).items() if size > limit}
    chunks = _chunks(configs)
    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        built = {k: v for part in pool.map(build_and_disassemble, chunks, [arch] * len(chunks))
                 for k, v in part.items()}
    for cfg in configs:
        problem, ops = built[cfg.key()]
        if problem is None and ops["LDL"] + ops["STL"]:
            problem = f"{cfg.key()} sm_{arch}: local memory ({ops['LDL']} LDL, {ops['STL']} STL)"
        if problem is None and (ops["HMMA"] > 0) != _tensor_core_kernel(cfg):
            problem = f"{cfg.key()} sm_{arch}: {ops['HMMA']} HMMA in its SASS"
        if problem is not None:
            out[cfg.key()] = "\n".join(filter(None, (out.get(cfg.key()), problem)))
    return out


@functools.lru_cache(maxsize=None)
def _found(arch: str) -> dict:
    """problems() of every portable config of sm_<arch>, built once for the tests of this module."""
    return problems(portable_configs(int(arch)), arch)


@pytest.mark.parametrize("arch", ARCHS)
def test_portable_kernels_build_for_the_99kb_cards(arch):
    _supported(arch)
    configs = portable_configs(int(arch))
    assert len(configs) > 400 and {c.family for c in configs} >= {
        "sm80_fwd", "simt_fwd", "sm80_bwd_dkdv_dq", "sm80_bwd_dkdv2_dq", "sm80_bwd_dkdv2_dq_do1",
        "sm80_bwd_dq", "decode_fp8", "kvcache_append_fp8"}
    failures = [p for key, p in _found(arch).items() if key not in known_gaps(arch)]
    assert not failures, f"{len(failures)} of {len(configs)} failed:\n" + "\n\n".join(f[:2000] for f in failures[:5])


@pytest.mark.parametrize("arch,key", [(arch, key) for arch in ARCHS for key in sorted(known_gaps(arch))])
def test_known_gaps(arch, key):
    """Each known gap is still chosen there and still fails (read from the build of every config)."""
    _supported(arch)
    assert key in {c.key() for c in portable_configs(int(arch))}, f"{key} is no longer chosen on sm_{arch}"
    found = _found(arch)
    if key in found:
        lines = found[key].splitlines()
        said = [ln.strip() for ln in lines if "error:" in ln or "bytes" in ln] or lines[:1]
        pytest.xfail(f"{known_gaps(arch)[key]} ({'; '.join(said)[:300]})")
    pytest.fail(f"{key} builds and fits on sm_{arch} now: drop it from KNOWN_GAPS")
