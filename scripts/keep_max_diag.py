"""Kept-max forward diagnostics: error against float64 and how often each fallback ran, per distribution.

    python3 scripts/keep_max_diag.py [src=OLD_KERNELS_DIR]
    python3 scripts/keep_max_diag.py counts   (the benchmark's shapes: kept / re-base / recompute shares)
Prints rel err of the default build, of -DCUFLASH_SM90_FWD_KEEP_MAX=0 (and of older sources if given), and
the counting build's re-base / recompute counts as a fraction of warp key-tile steps.
"""
from __future__ import annotations

import os
import sys

import cupy

sys.path.insert(0, os.path.dirname(__file__))
import ab_defines  # noqa: E402  (its source switch)

import cuflash  # noqa: E402
from cuflash import api, dispatch  # noqa: E402
from cuflash.bench import Shape  # noqa: E402
from cuflash.distributions import MIXED_CYCLE, make_inputs  # noqa: E402
from cuflash.reference import attention_reference, rel_err  # noqa: E402


def build(defines: str, src: str | None = None) -> None:
    defines = (os.environ.get("KMD_DEFINES", "") + " " + defines).strip()   # $KMD_DEFINES: in every build
    ab_defines._use_sources(src)
    if src:
        defines += " -DCUFLASH_AB_SOURCES=1"
    os.environ["CUFLASH_NVRTC_DEFINES"] = defines
    api._fwd_plans.clear()


def counts(shape, q, k, v):
    build("-DCUFLASH_SM90_FWD_COUNT_FALLBACKS")
    cuflash.forward(q, k, v, causal=shape.causal)
    mods = dispatch.loaded_modules("-DCUFLASH_SM90_FWD_COUNT_FALLBACKS")
    for m in mods:
        cupy.ndarray((3,), cupy.uint64, memptr=m.get_global("cuflash_fwd_fallbacks")).fill(0)
    cuflash.forward(q, k, v, causal=shape.causal)
    c = sum(cupy.ndarray((3,), cupy.uint64, memptr=m.get_global("cuflash_fwd_fallbacks")).get() for m in mods)
    steps = shape.fwd_flops() / (4 * shape.head_dim * 16 * 128)   # warp key-tile steps of 16 x 128 (approx.)
    return c[0] / steps, c[1] / steps, c[2] / steps


def main_counts() -> None:
    """The benchmark's shapes: per distribution, the share of warp key-tile steps in the kept-max state and
    the re-bases and recomputes, each a fraction of all steps."""
    for d, dtype, causal in ((64, "float16", False), (64, "bfloat16", False), (128, "float16", False),
                             (128, "bfloat16", True)):
        for dist in MIXED_CYCLE:
            shape = Shape(4, 16, 4096, d, dtype, causal)
            q, k, v = make_inputs(shape, dist)
            reb, rec, kept = counts(shape, q, k, v)
            print(f"{shape.label():40s} {dist:9s} kept={kept:.3f} rebase={reb:.4f} recompute={rec:.5f}", flush=True)


def main(src: str | None) -> None:
    variants = [("default", "", None), ("keep_max=0", "-DCUFLASH_SM90_FWD_KEEP_MAX=0", None)]
    if src:
        variants.append(("old", "", src))
    # $KMD_DTYPES / $KMD_DIMS / $KMD_DISTS: a part of the grid
    for dtype in os.environ.get("KMD_DTYPES", "float16,bfloat16").split(","):
        for d in map(int, os.environ.get("KMD_DIMS", "64,128,256").split(",")):
            for causal in (False, True):
                for dist in os.environ.get("KMD_DISTS", "outlier8,outlier12,sharp").split(","):
                    shape = Shape(1, 4, int(os.environ.get("KMD_N", "1031")), d, dtype, causal, heads_kv=2)
                    q, k, v = make_inputs(shape, dist, seed=7)
                    ref, _ = attention_reference(q, k, v, causal=causal)
                    errs = []
                    for _, defines, s in variants:
                        build(defines, s)
                        errs.append(rel_err(cuflash.forward(q, k, v, causal=causal), ref))
                    reb, rec, _ = counts(shape, q, k, v)
                    print(f"{shape.label():40s} {dist:9s} " + " ".join(f"{n}={e:.2e}" for (n, _, _), e in
                                                                   zip(variants, errs))
                          + f" rebase={reb:.3f} recompute={rec:.4f}", flush=True)
    for causal in (False, True) if not os.environ.get("KMD_DTYPES") else ():
        for dist in MIXED_CYCLE:
            shape = Shape(4, 16, 4096, 128, "bfloat16", causal)
            q, k, v = make_inputs(shape, dist)
            reb, rec, _ = counts(shape, q, k, v)
            print(f"{shape.label():40s} {dist:9s} rebase={reb:.3f} recompute={rec:.4f}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["counts"]:
        main_counts()
    else:
        main(sys.argv[1][4:] if len(sys.argv) > 1 else None)
