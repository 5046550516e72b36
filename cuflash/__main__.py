"""``python -m cuflash``: environment report, kernel compilation, self-check, benchmark table."""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time

from . import __version__


def _progress(i: int, n: int, cfg) -> None:
    width = 30
    done = int(width * i / max(n, 1))
    label = cfg.key() if cfg is not None else "done"
    sys.stdout.write(f"\r  compiling [{'#' * done}{'.' * (width - done)}] {i}/{n} {label:<60}")
    if cfg is None:
        sys.stdout.write("\n")
    sys.stdout.flush()


def _parse_shape(text: str):
    """B,H,N,D,dtype[,causal] -> Shape."""
    from .bench import Shape

    parts = text.split(",")
    if len(parts) not in (5, 6):
        raise argparse.ArgumentTypeError(f"shape must be B,H,N,D,dtype[,causal], got {text!r}")
    b, h, n, d = (int(x) for x in parts[:4])
    causal = len(parts) == 6 and parts[5].lower() in ("1", "true", "causal")
    return Shape(b, h, n, d, parts[4], causal)


def self_check(device_id: int) -> list[tuple[str, float, float]]:
    """Small cases against the float64 reference: (label, rel err, bound)."""
    import cupy
    import numpy as np

    from . import forward
    from ._checks import BFLOAT16
    from .reference import attention_reference, rel_err

    rng = np.random.default_rng()
    bounds = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-5}
    dts = {"float16": np.float16, "bfloat16": BFLOAT16, "float32": np.float32}
    rows = []
    for dtype in ("float16", "bfloat16", "float32"):
        for (b, nq, nk, hq, hkv, d, causal) in [(2, 257, 257, 4, 2, 64, True), (1, 100, 333, 2, 2, 128, False)]:
            q = cupy.asarray(rng.standard_normal((b, nq, hq, d)).astype(dts[dtype]))
            k = cupy.asarray(rng.standard_normal((b, nk, hkv, d)).astype(dts[dtype]))
            v = cupy.asarray(rng.standard_normal((b, nk, hkv, d)).astype(dts[dtype]))
            out = forward(q, k, v, causal=causal)
            err = rel_err(out, attention_reference(q, k, v, causal=causal)[0])
            rows.append((f"fwd {dtype} Nq={nq} Nk={nk} Hq={hq} Hkv={hkv} D={d}{' causal' if causal else ''}",
                         err, bounds[dtype]))
    return rows


def benchmark(shapes, repeats: int) -> list[dict]:
    import cupy

    from . import forward
    from .bench import cupy_naive_fwd, random_inputs, tflops, time_cuda, torch_inputs, torch_sdpa

    results = []
    for shape in shapes:
        row = {"shape": shape.label(), "pass": "fwd"}
        q, k, v = random_inputs(shape)
        out = cupy.empty_like(q)
        flops = shape.fwd_flops()
        ms = time_cuda(lambda: forward(q, k, v, causal=shape.causal, out=out), repeats=repeats)
        row["cuflash"] = tflops(flops, ms)
        try:
            ms = time_cuda(lambda: cupy_naive_fwd(q, k, v, shape.causal), repeats=max(3, repeats // 5))
            row["cupy"] = tflops(flops, ms)
        except cupy.cuda.memory.OutOfMemoryError:
            row["cupy"] = None
        del q, k, v, out
        for backend in ("flash", "cudnn"):
            fn = torch_sdpa(backend)
            if fn is None:
                continue
            try:
                tq, tk, tv = torch_inputs(shape)
                ms = time_cuda(lambda: fn(tq, tk, tv, shape.causal), repeats=repeats)
                row[f"sdpa_{backend}"] = tflops(flops, ms)
            except RuntimeError as e:  # backend does not support this shape
                row[f"sdpa_{backend}"] = None
                row[f"sdpa_{backend}_error"] = str(e).splitlines()[0][:120]
        results.append(row)
        cupy.get_default_memory_pool().free_all_blocks()
    return results


def _fmt(x) -> str:
    return "-" if x is None else f"{x:7.1f}"


def print_table(results: list[dict]) -> None:
    cols = [c for c in ("cuflash", "cupy", "sdpa_flash", "sdpa_cudnn") if any(c in r for r in results)]
    head = f"{'shape':<44}{'pass':<9}" + "".join(f"{c:>12}" for c in cols)
    ratios = [c for c in ("sdpa_flash", "sdpa_cudnn") if c in cols]
    head += "".join(f"{'x ' + c[5:]:>10}" for c in ratios)
    print("TFLOP/s (median of repeats); ratios are cuflash / peer")
    print(head)
    for r in results:
        line = f"{r['shape']:<44}{r['pass']:<9}" + "".join(f"{_fmt(r.get(c)):>12}" for c in cols)
        for c in ratios:
            peer = r.get(c)
            line += f"{(r['cuflash'] / peer if peer else float('nan')):>10.2f}"
        print(line)


def markdown_table(results: list[dict]) -> str:
    """The results as a Markdown table (for BENCHMARKS.md)."""
    cols = [c for c in ("cuflash", "cupy", "sdpa_flash", "sdpa_cudnn") if any(c in r for r in results)]
    ratios = [c for c in ("sdpa_flash", "sdpa_cudnn") if c in cols]
    lines = ["| shape | pass | " + " | ".join(cols) + "".join(f" | cuflash / {c[5:]}" for c in ratios) + " |",
             "|" + " --- |" * (2 + len(cols) + len(ratios))]
    for r in results:
        cells = [r["shape"], r["pass"]] + [_fmt(r.get(c)).strip() for c in cols]
        cells += [f"{r['cuflash'] / r[c]:.2f}" if r.get(c) else "-" for c in ratios]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cuflash", description=__doc__)
    ap.add_argument("--shape", action="append", type=_parse_shape,
                    help="benchmark shape B,H,N,D,dtype[,causal] (repeatable); default: the standard table")
    ap.add_argument("--quick", action="store_true", help="two shapes only")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--no-bench", action="store_true", help="self-check only")
    ap.add_argument("--markdown", action="store_true", help="also print the table as Markdown")
    args = ap.parse_args(argv)

    import cupy
    import numpy as np

    from cupy.cuda import nvrtc

    from . import dispatch, heuristics
    from .bench import QUICK_SHAPES, STANDARD_SHAPES

    try:
        dev = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    except cupy.cuda.runtime.CUDARuntimeError as e:
        print(f"cuflash {__version__}: no usable CUDA device ({e})")
        return 1
    cc, smem = dispatch.device_info(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    print(f"cuflash {__version__} | {name} (sm_{cc}, {props['multiProcessorCount']} SMs) | "
          f"CuPy {cupy.__version__} | CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()} | "
          f"NVRTC {'.'.join(map(str, nvrtc.getVersion()))} | NumPy {np.__version__} | "
          f"Python {platform.python_version()}")
    try:
        import torch

        print(f"PyTorch {torch.__version__} found: SDPA columns included")
    except ImportError:
        print("PyTorch not installed: SDPA columns omitted")

    shapes = args.shape or (QUICK_SHAPES if args.quick else STANDARD_SHAPES)
    needed = {heuristics.fwd_config(s.dtype, s.head_dim, s.causal, cc) for s in shapes}
    needed |= {heuristics.fwd_config(dt, d, c, cc) for dt in ("float16", "bfloat16", "float32")
               for d in (64, 128) for c in (False, True)}
    t0 = time.time()
    dispatch.precompile(sorted(needed, key=lambda c: c.key()), dev.id, _progress)
    print(f"  {len(needed)} kernels ready in {time.time() - t0:.1f} s (CuPy's kernel cache keeps them)")

    print("self-check against the float64 reference:")
    ok = True
    for label, err, bound in self_check(dev.id):
        good = err <= bound
        ok &= good
        print(f"  {'ok  ' if good else 'FAIL'} {label:<58} rel err {err:.2e} (bound {bound:.0e})")
    if not ok:
        print("self-check FAILED")
        return 1
    if args.no_bench:
        return 0
    results = benchmark(shapes, args.repeats)
    print_table(results)
    if args.markdown:
        print(markdown_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "cc": cc, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
