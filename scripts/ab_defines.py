"""A/B timing of NVRTC define sets (CUFLASH_NVRTC_DEFINES) on the same inputs, interleaved.

    python3 scripts/ab_defines.py bwd "" "-DCUFLASH_SM90_BWD_NO_EARLY_DV"
    AB_SHAPES="4,16,4096,64,float16,0;16,16,1024,64,float16,0" python3 scripts/ab_defines.py bwd ...
    python3 scripts/ab_defines.py fp8 "" "@CUFLASH_SM90_FP8_PERSISTENT=1"   (bfloat16 shapes)
    AB_DETERMINISTIC=1 python3 scripts/ab_defines.py bwd ...   (the deterministic backward)
    AB_ROUNDS=6 ...   (alternating rounds, 3 by default)
    AB_DISTS="normal,outlier12,sharp" ...   (input distributions, cuflash/distributions.py; normal by default)
    python3 scripts/ab_defines.py fwd "src=/tmp/old/kernels_cu" ""   (another checkout's kernel sources)
Prints, per shape, the median time of each define set over alternating rounds (TFLOP/s).
"""
from __future__ import annotations

import os
import statistics
import sys

import cupy

import cuflash
from cuflash import api, compile as cf_compile, fp8
from cuflash.bench import Shape, random_inputs, time_cuda
from cuflash.distributions import make_inputs

_own_kernel_dir = cf_compile.kernel_dir


def _use_sources(path: str | None) -> None:
    """Compile from the kernel sources at ``path`` (None: this checkout's) from now on."""
    from pathlib import Path

    cf_compile.kernel_dir = (lambda: Path(path)) if path else _own_kernel_dir
    cf_compile.load_source.cache_clear()

SHAPES = [Shape(4, 16, 4096, 64, "float16", True), Shape(4, 16, 4096, 128, "bfloat16", False),
          Shape(4, 16, 4096, 128, "bfloat16", True), Shape(4, 16, 4096, 96, "bfloat16", False),
          Shape(1, 16, 16384, 128, "bfloat16", True), Shape(4, 16, 4096, 192, "bfloat16", False)]


def _shapes() -> list[Shape]:
    """$AB_SHAPES ("B,H,N,D,dtype,causal;...") or the default list."""
    spec = os.environ.get("AB_SHAPES")
    if not spec:
        return SHAPES
    out = []
    for item in spec.split(";"):
        b, h, n, d, dtype, causal = item.split(",")
        out.append(Shape(int(b), int(h), int(n), int(d), dtype, causal.strip() in ("1", "True", "true")))
    return out


def main(direction: str, variants: list[str]) -> None:
    env_names = {t[1:].partition("=")[0] for v in variants for t in v.split() if t.startswith("@")}
    dists = os.environ.get("AB_DISTS", "normal").split(",")
    for shape, dist in [(s, d) for s in _shapes() for d in dists]:
        q, k, v = make_inputs(shape, dist)
        dout = random_inputs(shape, seed=1)[0]
        out, lse = cuflash.forward(q, k, v, causal=shape.causal, return_lse=True)
        grads = [cupy.empty_like(x) for x in (q, k, v)]
        if direction == "bwd":
            det = os.environ.get("AB_DETERMINISTIC", "0") == "1"
            run = lambda: cuflash.backward(dout, q, k, v, out, lse, causal=shape.causal,  # noqa: E731
                                           deterministic=det, dq=grads[0], dk=grads[1], dv=grads[2])
            flops = 2.5 * shape.fwd_flops()
        elif direction == "fp8":   # forward_fp8 on the inputs quantised per tensor (bf16 shapes)
            (q8, sq), (k8, sk), (v8, sv) = (cuflash.quantize_fp8(x) for x in (q, k, v))
            run = lambda: cuflash.forward_fp8(q8, k8, v8, sq, sk, sv, causal=shape.causal, out=out)  # noqa: E731
            flops = shape.fwd_flops()
        else:
            run = lambda: cuflash.forward(q, k, v, causal=shape.causal, out=out)  # noqa: E731
            flops = shape.fwd_flops()
        times = {v: [] for v in variants}
        for _ in range(int(os.environ.get("AB_ROUNDS", "3"))):
            for var in variants:
                # "@NAME=VALUE" tokens set environment variables for this variant only.
                tokens = var.split()
                for t in env_names:
                    os.environ.pop(t, None)
                for t in tokens:
                    if t.startswith("@"):
                        name, _, value = t[1:].partition("=")
                        os.environ[name] = value
                # "src=PATH": that tree's kernels (a define names it: the module cache keeps them apart).
                src = [t[4:] for t in tokens if t.startswith("src=")]
                _use_sources(src[0] if src else None)
                defines = [t for t in tokens if not t.startswith(("@", "src="))]
                if src:
                    defines.append("-DCUFLASH_AB_SOURCES=" + str(abs(hash(src[0]))))
                os.environ["CUFLASH_NVRTC_DEFINES"] = " ".join(defines)
                api._bwd_plans.clear()
                api._fwd_plans.clear()
                fp8._plans.clear()
                times[var].append(time_cuda(run, repeats=20))
        cells = [f"{flops / statistics.median(t) / 1e9:.0f}" for t in times.values()]
        label = f"{shape.label()} {dist}"
        print(f"{label:55s} " + " | ".join(f"{v or 'default'}: {c}" for v, c in zip(variants, cells)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
