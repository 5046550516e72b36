"""CPU-only: every forward kernel instantiation compiles with NVRTC for sm_80 and sm_90a,
without register spills (the tiles narrowed to 99 KB of shared memory for sm_89 and sm_120:
test_compile_portable_archs.py), and the parameter structs match their NumPy mirrors."""
from __future__ import annotations

import re

import numpy as np

import pytest

from cuflash import heuristics, params
from cuflash.compile import load_source
from compile_checks import assert_all_compile, kernel_smem

from cupy.cuda import nvrtc  # noqa: E402  (CPU-only: NVRTC needs no GPU)

ARCHS = ["80", "90a"]


def _ids(configs):
    return [c.key() for c in configs]


@pytest.mark.parametrize("cc", ARCHS)
def test_fwd_instantiations_compile_without_spills(cc):
    configs = heuristics.all_fwd_configs(cc=90 if cc.startswith("90") else int(cc))
    assert len(configs) >= 3 * 32 * 2
    assert_all_compile(configs, cc)


def _ptx(src: str) -> str:
    prog = nvrtc.createProgram(src, "layout.cu", [], [])
    try:
        nvrtc.compileProgram(prog, ["-arch=compute_80", "-std=c++17"])
        return nvrtc.getPTX(prog).decode()
    except nvrtc.NVRTCError as e:
        raise AssertionError(nvrtc.getProgramLog(prog)) from e
    finally:
        nvrtc.destroyProgram(prog)


@pytest.mark.parametrize("struct", sorted(params.STRUCTS))
def test_param_struct_layout_matches_numpy(struct):
    """The C struct and its NumPy mirror agree on size, alignment and every field offset.

    NVRTC has no constant offsetof, so each field gets a probe kernel that reads it from the
    by-value parameter; the PTX shows the parameter's size and alignment and the load offset.
    """
    dt = params.STRUCTS[struct]
    probes = "\n".join(
        f'extern "C" __global__ void probe_{name}({struct} p, double* out) {{ *out = (double)(long long)p.{name}; }}'
        if dt.fields[name][0].kind != "f" else
        f'extern "C" __global__ void probe_{name}({struct} p, double* out) {{ *out = (double)p.{name}; }}'
        for name in dt.names)
    ptx = _ptx(load_source("common/params.cuh") + "\n" + probes + "\n")
    for name, (fdt, off) in dt.fields.items():
        body = ptx[ptx.index(f".entry probe_{name}("):]
        body = body[:body.index("ret;")]
        decl = re.search(r"\.param \.align (\d+) \.b8 probe_\w+_param_0\[(\d+)\]", body)
        assert decl, body
        assert int(decl.group(2)) == dt.itemsize, f"sizeof({struct}) {decl.group(2)} != {dt.itemsize}"
        assert int(decl.group(1)) == dt.alignment, f"alignof({struct}) {decl.group(1)} != {dt.alignment}"
        # The compiler may widen the read into a vector load (ld.param.v2.u32 {%r1, %r2}): the field is the
        # element whose register the probe then uses.
        loads = re.findall(r"ld\.param(?:\.v[24])?\.([usbf])(\d+)\s+(%\w+|\{[^}]*\}), "
                           r"\[probe_\w+_param_0(?:\+(\d+))?\]", body)
        assert len(loads) == 1, f"{name}: {loads}"
        kind, bits, regs, c_off = loads[0]
        regs = [r.strip() for r in regs.strip("{}").split(",")]
        rest = body[body.index(regs[-1]) + len(regs[-1]):]
        used = [i for i, r in enumerate(regs) if re.search(re.escape(r) + r"\b", rest)]
        c_off = int(c_off or 0) + (used[0] if used else 0) * int(bits) // 8
        assert c_off == off, f"{struct}.{name}: C offset {c_off}, NumPy offset {off}"
        assert int(bits) == 8 * fdt.itemsize, f"{struct}.{name}: C size {bits} bits, NumPy {fdt.itemsize} bytes"


def test_name_expressions_are_unique():
    configs = heuristics.all_fwd_configs(cc=90)
    names = {c.name_expression() for c in configs}
    assert len(names) == len({c.key() for c in configs})


@pytest.mark.parametrize("struct", sorted(params.STRUCTS))
def test_fast_packing_matches_numpy_field_assignment(struct):
    dt = params.STRUCTS[struct]
    values = {name: (i + 1) * (3 if dt.fields[name][0].kind == "f" else 7) for i, name in enumerate(dt.names)}
    ref = np.zeros(1, dtype=dt)
    for name, value in values.items():
        ref[name] = value
    assert params.pack(dt, **values).tobytes() == ref.tobytes()
    assert params.pack_values(dt, [values[n] for n in dt.names]).tobytes() == ref.tobytes()


# Opt-in shared memory per block: sm_86 / sm_89 / sm_120 (99 KB) and A100 (163 KB).
SMALL_SMEM_LIMITS = [99 * 1024, 163 * 1024]


def test_fit_shared_memory_shrinks_until_the_kernel_fits():
    """fit_shared_memory on the sizes the kernels report (dispatch.smem_bytes without a GPU: the PTX of each
    <kernel>_smem_bytes): a tuned portable tile over a smaller device's opt-in limit shrinks, its kernel's
    size falling at every step, to the first tile within the limit; the tiles within it stay."""
    from cuflash.dispatch import smem_bytes

    configs = heuristics.all_fwd_configs(cc=90)
    assert not any(c.fam.arch_specific for c in configs)   # the only tiles the forward ever fits
    tuned = kernel_smem(configs, "80")
    steps = []

    def smem_of(c):
        steps.append(c)
        return tuned[c] if c in tuned else smem_bytes(c)

    shrunk = 0
    for cfg in configs:
        for limit in SMALL_SMEM_LIMITS:
            steps.clear()
            fitted = heuristics.fit_shared_memory(cfg, limit, smem_of)
            chain = list(dict.fromkeys(steps))
            sizes = [smem_of(c) for c in chain]
            assert chain[0] == cfg and chain[-1] == fitted, cfg.key()
            assert sizes[-1] <= limit and all(s > limit for s in sizes[:-1]), (cfg.key(), limit, sizes)
            assert all(a > b for a, b in zip(sizes, sizes[1:])), (cfg.key(), sizes)
            assert fitted.family == cfg.family and fitted.head_dim == cfg.head_dim
            shrunk += fitted != cfg
    assert shrunk, "some tuned tile exceeds a small limit"
