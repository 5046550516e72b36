"""CPU only: the KV-cache kernels (kernels_cu/decode/: decode, combine, append) compile for sm_80 and sm_90a (and the
Hopper decode kernel, decode_sm90.cu, for sm_90a) without register spills, over the tiles cuflash/kvcache.py picks (packed rows of 16 / 32 / 64, 64- and 32-key tiles), the
head-dim buckets, a value head dim of its own and the mask variants; and every bucket has a tile that fits a
99 KB-shared-memory device. Each distinct instantiation is compiled once."""
from __future__ import annotations

import dataclasses

import pytest

from cuflash import kvcache
from cuflash.config import KernelConfig
from cuflash.variants import MaskVariant

from compile_checks import assert_all_compile, smem_bytes_offline_many

pytest.importorskip("cupy")

VARIANTS = [MaskVariant(), MaskVariant(local=True, softcap=True, alibi=True, sink=True, chunk=True)]


def _layout(seqlen_q: int, heads_q: int, heads_kv: int, d: int, dv: int) -> kvcache.CacheLayout:
    return kvcache.CacheLayout(1, seqlen_q, heads_q, heads_kv, d, dv, 0, 4096, 1, 0, 0, tma_ok=True)


def decode_calls(kind: str = "16-bit") -> list:
    """(dtype, layout, causal, variant) of the decode calls whose kernels the compile tests build, for the caches of
    ``kind``: "16-bit" (the head-dim pairs, packed rows 8 / 32 / 64, causal and the variants at one pair),
    "float32" (the portable kernel's scalar products, every GPU) or "fp8" (e4m3, sm_89+: the head-dim buckets, tall
    tiles, the variants)."""
    if kind == "float32":
        return [("float32", _layout(*rows, d, dv), causal, variant)
                for d, dv, rows, causal, variant in ((128, 128, (1, 8, 1), True, VARIANTS[0]),
                                                     (64, 64, (4, 8, 1), False, VARIANTS[1]),
                                                     (256, 256, (1, 8, 1), False, VARIANTS[0]),
                                                     (128, 64, (16, 32, 8), True, VARIANTS[0]))]
    if kind == "fp8":
        return [(dtype, dataclasses.replace(_layout(*rows, d, dv), fp8=True), causal, variant)
                for d, dv, rows, dtype, causal, variant in ((64, 64, (1, 8, 1), "float16", False, VARIANTS[0]),
                                                            (128, 128, (1, 8, 1), "bfloat16", True, VARIANTS[1]),
                                                            (128, 128, (16, 32, 8), "bfloat16", False, VARIANTS[0]),
                                                            (256, 256, (1, 8, 1), "bfloat16", False, VARIANTS[0]),
                                                            (128, 64, (4, 8, 1), "float16", True, VARIANTS[0]))]
    out = []
    for d, dv in ((64, 64), (128, 128), (256, 256), (128, 64), (72, 40)):
        for rows in ((1, 8, 1), (4, 8, 1), (16, 32, 8)):   # packed rows 8, 32, 64
            for causal, variant in ((False, VARIANTS[0]), (True, VARIANTS[0]), (False, VARIANTS[1])):
                if variant is VARIANTS[1] and (d, rows) != (128, (1, 8, 1)):
                    continue
                out.append(("bfloat16", _layout(*rows, d, dv), causal, variant))
    return out + [("float16", _layout(1, 32, 8, 128, 128), False, VARIANTS[0])]


def aux_configs(fp8: bool = False) -> list:
    """The merge of split decoding (every dtype) and the appends (every cache dtype; ``fp8``: the e4m3 one too)."""
    out = [KernelConfig("combine", dtype, 0, False, 0, 0, kvcache.NUM_WARPS) for dtype in ("float16", "bfloat16", "float32")]
    out += [KernelConfig("kvcache_append", dtype, 0, False, 0, 0, kvcache.NUM_WARPS)
            for dtype in ("float32", "float16", "bfloat16")]
    if fp8:
        out += [KernelConfig("kvcache_append_fp8", dtype, 0, False, 0, 0, kvcache.NUM_WARPS)
                for dtype in ("float16", "bfloat16")]
    return out


def _configs(backends=("sm80",)) -> list:
    out = {}
    calls = [(call, backend) for backend in backends for call in decode_calls()]
    if "sm80" in backends:
        calls += [(call, "sm80") for call in decode_calls("float32")]
    if "sm90" in backends:   # fp8 caches, both families
        calls += [(call, backend) for call in decode_calls("fp8") for backend in ("sm80", "sm90")]
    for call, backend in calls:
        out.update({c.key(): c for c in kvcache.decode_configs(*call, backend)})
    out.update({c.key(): c for c in aux_configs(fp8="sm90" in backends)})
    if "sm90" in backends:   # MLA
        for dtype, causal, variant in (("bfloat16", True, VARIANTS[0]), ("float16", False, VARIANTS[1])):
            lay = dataclasses.replace(_layout(1, 16, 1, *kvcache.MLA_HEAD_DIMS), latent=True)
            out.update({c.key(): c for c in kvcache.decode_configs(dtype, lay, causal, variant, "sm90")})
    return list(out.values())


@pytest.mark.parametrize("cc", ["80", "90a"])
def test_decode_kernels_compile_without_spills(cc):
    assert_all_compile(_configs(("sm80", "sm90", "sm90_tma") if cc == "90a" else ("sm80",)), cc)


@pytest.mark.parametrize("arch", ["80", "89"])
def test_portable_fp8_decode_compiles(arch):
    """The portable kernel over fp8 caches and the fp8 append compile without spills, at the head-dim buckets and row
    tiles, for sm_89 (L4, L40S: the first GPUs with the e4m3 instructions) and for sm_80 (the A100: the integer
    conversions of common/e4m3.cuh)."""
    configs = {}
    for d, dv in ((64, 64), (128, 128), (256, 256), (128, 64)):
        for rows in ((1, 8, 1), (16, 32, 8)):
            lay = dataclasses.replace(_layout(*rows, d, dv), fp8=True)
            configs.update({c.key(): c for c in kvcache.decode_configs("bfloat16", lay, False, VARIANTS[0], "sm80")})
    assert {c.family for c in configs.values()} == {"decode_fp8"}
    for dtype in ("float16", "bfloat16"):
        c = KernelConfig("kvcache_append_fp8", dtype, 0, False, 0, 0, kvcache.NUM_WARPS)
        configs[c.key()] = c
    assert_all_compile(list(configs.values()), arch)


def test_every_head_dim_bucket_fits_a_99kb_device():
    """decode_config's fallbacks: for each head-dim pair and packed-row count, some tile fits 99 KB."""
    for d, dv in ((64, 64), (128, 128), (256, 256), (256, 64)):
        for rows in ((1, 8, 1), (16, 32, 8)):
            configs = kvcache.decode_configs("bfloat16", _layout(*rows, d, dv), False, VARIANTS[0])
            sizes = smem_bytes_offline_many(configs, "80")
            assert min(sizes.values()) <= 99 * 1024, (d, dv, rows, sizes)
            # and the first, the H100's, fits two CTAs per SM at head dims up to 128 with one 16-row tile (decoding)
            if max(d, dv) <= 128 and rows == (1, 8, 1):
                assert sizes[configs[0]] <= 113 * 1024, (d, dv, rows, sizes[configs[0]])
            # float32 caches (every GPU)
            sizes = smem_bytes_offline_many(kvcache.decode_configs("float32", _layout(*rows, d, dv), False,
                                                                   VARIANTS[0]), "80")
            assert min(sizes.values()) <= 99 * 1024, (d, dv, rows, "float32", sizes)
            # fp8 caches on the portable kernel (L4, L40S: 99 KB)
            lay = dataclasses.replace(_layout(*rows, d, dv), fp8=True)
            sizes = smem_bytes_offline_many(kvcache.decode_configs("bfloat16", lay, False, VARIANTS[0]), "89")
            assert min(sizes.values()) <= 99 * 1024, (d, dv, rows, "fp8", sizes)


def test_sm90_decode_tiles():
    """The Hopper family takes the portable family's tiles with SM90_PRODUCER_WARPS more warps, and its first tile
    fits two CTAs on an H100's SM at head dims up to 128 (its shared memory: the portable kernel's and 128 bytes of
    barriers)."""
    for d, dv in ((64, 64), (128, 128), (256, 256), (128, 64)):
        for rows in ((1, 8, 1), (16, 32, 8)):
            lay = _layout(*rows, d, dv)
            portable = kvcache.decode_configs("bfloat16", lay, False, VARIANTS[0], "sm80")
            hopper = kvcache.decode_configs("bfloat16", lay, False, VARIANTS[0], "sm90")
            assert [(c.block_m, c.block_n, c.num_warps + kvcache.SM90_PRODUCER_WARPS) for c in portable] == \
                [(c.block_m, c.block_n, c.num_warps) for c in hopper]
            assert all(c.family == "decode_sm90" for c in hopper)
            if max(d, dv) <= 128 and rows == (1, 8, 1):
                (size,) = smem_bytes_offline_many(hopper[:1], "90a").values()
                assert size <= 113 * 1024 - 1024, (d, dv, size)


def test_tma_family_only_for_caches_tma_can_address():
    """Under "sm90_tma" (Hopper's default) a call takes the TMA-filled ring only where its caches allow tensor maps
    (CacheLayout.tma_ok) and the tile leaves the registers (16-row tiles, or up to 128 columns); the cp.async ring
    otherwise, and the fp8 family for e4m3 caches."""
    lay = _layout(1, 8, 1, 128, 128)
    assert kvcache.decode_configs("bfloat16", lay, False, VARIANTS[0], "sm90_tma")[0].family == "decode_sm90_tma"
    for other in (dataclasses.replace(lay, tma_ok=False), _layout(16, 32, 8, 256, 256)):
        assert kvcache.decode_configs("bfloat16", other, False, VARIANTS[0], "sm90_tma")[0].family == "decode_sm90"
    fp8 = dataclasses.replace(lay, fp8=True, tma_ok=False)
    assert kvcache.decode_configs("bfloat16", fp8, False, VARIANTS[0], "sm90_tma")[0].family == "decode_sm90_fp8"


class _FakeCache:
    """What kvcache.tma_strides reads of a cupy array: shape, byte strides, itemsize and data.ptr."""

    def __init__(self, shape, strides, ptr=1 << 20, itemsize=2):
        self.shape, self.strides, self.itemsize = shape, strides, itemsize
        self.data = type("Memory", (), {"ptr": ptr})()


def test_tma_strides():
    """A cache's tensor-map strides (heads, keys, rows): its own where a dimension has more than one element, the
    packed ones (rounded to 16 bytes) where it has one (any stride is valid there), None where TMA cannot address it
    (a broadcast dimension, a stride or pointer off 16 bytes)."""
    assert kvcache.tma_strides(_FakeCache((4, 512, 2, 128), (262144, 512, 256, 2))) == (256, 512, 262144)
    assert kvcache.tma_strides(_FakeCache((1, 512, 1, 72), (7, 144, 3, 2))) == (144, 144, 73728)
    assert kvcache.tma_strides(_FakeCache((4, 512, 2, 40), (81920, 160, 80, 2))) == (80, 160, 81920)
    assert kvcache.tma_strides(_FakeCache((4, 512, 2, 64), (0, 256, 128, 2))) is None          # broadcast rows
    assert kvcache.tma_strides(_FakeCache((4, 512, 2, 64), (262152, 512, 256, 2))) is None     # 8-byte row stride
    assert kvcache.tma_strides(_FakeCache((4, 512, 2, 64), (262144, 512, 256, 2), ptr=8)) is None


def test_split_plan():
    # Automatic: whole waves of resident CTAs (264: two per SM on 132 SMs), splits of at least MIN_KEYS_PER_SPLIT.
    assert kvcache.split_plan(32768, 512, 264, 0, False) == (1, 32768)         # two full waves already
    splits, kps = kvcache.split_plan(131072, 8, 264, 0, False)                  # batch 1: one wave of 8 * 33 CTAs
    assert (splits, kps) == (33, 3972 // 64 * 64 + 64)
    assert kvcache.split_plan(32768, 64, 264, 0, False)[0] == 4                 # 256 of 264 slots, not 320 of 528
    assert kvcache.split_plan(1000, 8, 264, 0, False)[0] == 1                   # under two splits' worth of keys
    # One slot per SM (the TMA-fed kernel, 132 SMs): batch 1 / 8 fill the SMs once, batch 64's 512 CTAs take the
    # count that evens out the last wave.
    assert kvcache.split_plan(32768, 8, 132, 0, False) == (16, 2048)
    assert kvcache.split_plan(4096, 64, 132, 0, False) == (2, 2048)
    assert kvcache.split_plan(131072, 512, 132, 0, False)[0] == 9
    for capacity, ctas in ((4096, 64), (131072, 8), (32768, 512), (7777, 3)):
        splits, kps = kvcache.split_plan(capacity, ctas, 264, 0, False)
        assert kps % kvcache.BLOCK_N == 0 and (splits - 1) * kps < capacity <= splits * kps
    # As asked: an explicit count, batch-invariant mode's fixed split.
    assert kvcache.split_plan(4096, 8, 264, 3, False) == (3, 1408)
    assert kvcache.split_plan(5000, 1, 264, 0, True) == (3, kvcache.BATCH_INVARIANT_KEYS)
    assert kvcache.split_plan(5000, 999, 264, 0, True) == (3, kvcache.BATCH_INVARIANT_KEYS)
    assert kvcache.split_plan(0, 8, 264, 0, False) == (1, kvcache.BLOCK_N)
