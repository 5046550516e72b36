"""Every kernel configuration that the dispatcher can choose on a GPU that takes the portable kernels (every compute
capability but 9.0: the A100, the 99 KB cards of sm_86 / sm_89 / sm_120, the B200 until it has kernels of its own),
gathered from the enumerations of the CPU compile tests and fitted to that GPU's shared memory as the dispatcher fits
them. test_compile_portable_archs.py compiles the set for the archs that CI compiles nothing else for."""
from __future__ import annotations

from cuflash import fp8, heuristics, kvcache
from cuflash.compile import smem_bytes_offline_many
from cuflash.config import KernelConfig
from cuflash.distributed import partials

import test_compile_decode as decode_tests
import test_compile_varlen as varlen_tests
from portable_variants import both_bwd_versions, table_configs, variant_builds


# The fp8 forward's helpers (the V transpose, the quantisation) take the e4m3 instructions of sm_89; fp8 KV caches
# run everywhere (common/e4m3.cuh's integer conversions before sm_89).
FP8_HELPERS_MIN_CC = 89


class SmemSizes:
    """A config's dynamic shared memory built for NVRTC ``arch`` (its kernel's <kernel>_smem_bytes, read from the
    PTX), each config's read once: ``sizes(config)``; ``prefetch(configs)`` reads many in one program per source."""

    def __init__(self, arch: str) -> None:
        self.arch, self.known = arch, {}

    def __call__(self, cfg: KernelConfig) -> int:
        if cfg not in self.known:
            self.prefetch([cfg])
        return self.known[cfg]

    def prefetch(self, cfgs) -> None:
        self.known.update(smem_bytes_offline_many([c for c in cfgs if c not in self.known], self.arch))


def _forward_and_backward(cc: int) -> list:
    """The attention kernels of the tables of ``cc`` as planned, before the forward's fitting: every dtype, head
    dim and mask of the forward; both backward modes and both dK/dV versions at every bucket; the large head dims
    (the portable forward, the float32 backward); a value head dim of its own; varlen; the mask variants
    (portable_variants)."""
    out = heuristics.all_fwd_configs(cc) + both_bwd_versions(cc) + heuristics.large_fwd_configs(cc)
    out += [c for causal in (False, True) for c in heuristics.bwd_configs("float32", 512, causal, cc).all()]
    out += varlen_tests.dv_portable(cc) + varlen_tests.varlen_portable(cc)
    for backend, dtype in (("sm80", "float16"), ("simt", "float32")):
        out += variant_builds(table_configs(cc, backend, dtype), set())
    return out


def _decode(cc: int, smem_of: SmemSizes) -> list:
    """The decode kernels that decode_config picks (kvcache.first_fitting) for the compile tests' calls on a device
    of ``cc`` (the portable backend: kvcache.decode_backend's choice off Hopper; the last tile where none fits, so
    that the size check fails it), the fp8 caches' included; the merge, the appends."""
    kinds = ("16-bit", "float32", "fp8")
    candidates = [kvcache.decode_configs(*call, "sm80") for kind in kinds for call in decode_tests.decode_calls(kind)]
    smem_of.prefetch([c for cfgs in candidates for c in cfgs])
    limit = heuristics.SMEM_OPTIN[cc]
    return [kvcache.first_fitting(cfgs, limit, smem_of) or cfgs[-1] for cfgs in candidates] + \
        decode_tests.aux_configs(fp8=True)


def portable_configs(cc: int, arch: str | None = None) -> list[KernelConfig]:
    """Every kernel the dispatcher can choose on a device of compute capability ``cc`` (not 9.0: the Hopper kernels
    have their own tests) within that compute capability's opt-in shared memory (heuristics.SMEM_OPTIN), as the
    compile tests enumerate them: the forward (fitted as dispatch.fit_to_device fits it), the backward (as its
    tables give it), the decode kernels (as decode_config picks them; where no tile fits, the last, which then fails
    the size check), and the helpers (the backward's pre- / postprocess, ring attention's, the fp8 ones from sm_89).
    Shared-memory sizes are read as built for NVRTC ``arch`` (default: sm_<cc>). Deduplicated by config key."""
    if cc == 90:
        raise ValueError("compute capability 9.0 takes the Hopper kernels: their own compile tests build them")
    smem_of = SmemSizes(arch or str(cc))
    limit = heuristics.SMEM_OPTIN[cc]
    kernels = _forward_and_backward(cc)
    smem_of.prefetch([c for c in kernels if c.fam.direction == "fwd"])
    out = [heuristics.fit_shared_memory(c, limit, smem_of) if c.fam.direction == "fwd" else c for c in kernels]
    out += _decode(cc, smem_of) + partials.configs() + (fp8.aux_configs() if cc >= FP8_HELPERS_MIN_CC else [])
    assert not any(c.fam.arch_specific or c.fam.min_cc > cc for c in out), "a kernel this device cannot build"
    return list({c.key(): c for c in out}.values())
