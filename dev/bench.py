"""Benchmark tables beside ``python -m cuflash`` (the standard table and the distribution table) (GPU).

    python3 dev/bench.py deterministic [--head-dims 64,128,256] [--repeats 20]
    python3 dev/bench.py fp8 [D[c]:N:B ...]        e.g. 128:4096:4 128c:4096:4

``deterministic``: backward time, default (atomic dQ) against ``deterministic=True``, B=4 H=16 N=4096 fp16, causal
and not: the README's cost table (``dev/device_run.sh bench`` runs it after the standard table).
``fp8``: the fp8 forward (inputs quantised per tensor) beside the bf16 forward and SDPA cuDNN (bf16), TFLOP/s;
the kernel alone (without the V^T pass) and the V^T pass in us; the fp8 output's relative difference from bf16.
Tile override for tuning: CUFLASH_SM90_FP8_TILES="bm,bn,w" (or ``dev/sweep.py tiles``).
"""
from __future__ import annotations

import argparse
import sys

FP8_DEFAULT = ["64:4096:4", "64c:4096:4", "128:4096:4", "128c:4096:4", "256:4096:4", "256c:4096:4",
               "128c:16384:1", "64:1024:16"]


def deterministic(head_dims, repeats: int) -> None:
    """Backward time, default (atomic dQ) against deterministic=True, B=4 H=16 N=4096 fp16 (Markdown)."""
    import cupy

    import cuflash
    from cuflash.bench import Shape, random_inputs, tflops, time_cuda

    print("| head_dim | dtype | causal | default | deterministic |")
    print("| --- | --- | --- | --- | --- |")
    for d in head_dims:
        for causal in (False, True):
            shape = Shape(4, 16, 4096, d, "float16", causal)
            q, k, v = random_inputs(shape)
            dout = random_inputs(shape, seed=1)[0]
            out, lse = cuflash.forward(q, k, v, causal=causal, return_lse=True)
            grads = [cupy.empty_like(x) for x in (q, k, v)]
            cells = []
            for det in (False, True):
                ms = time_cuda(lambda: cuflash.backward(dout, q, k, v, out, lse, causal=causal, deterministic=det,
                                                        dq=grads[0], dk=grads[1], dv=grads[2]), repeats=repeats)
                cells.append(f"{ms:.2f} ms ({tflops(2.5 * shape.fwd_flops(), ms):.0f} TFLOP/s)")
            print(f"| {d} | fp16 | {'yes' if causal else 'no'} | {cells[0]} | {cells[1]} |", flush=True)
            q = k = v = dout = out = lse = grads = None   # the buffers go before the next shape
            cupy.get_default_memory_pool().free_all_blocks()


def fp8(specs: list[str]) -> None:
    """fp8 forward beside the bf16 forward and SDPA cuDNN (bf16), and the V^T pass alone (Markdown)."""
    import numpy as np

    import cupy

    import cuflash
    from cuflash import fp8 as cf_fp8
    from cuflash.bench import Shape, random_inputs, tflops, time_cuda, torch_inputs, torch_sdpa

    cudnn = torch_sdpa("cudnn")
    print("| shape | fp8 TFLOP/s | fp8 kernel only | V^T pass us | bf16 cuflash | cuDNN bf16 | fp8 / cuDNN |")
    print("|---|---|---|---|---|---|---|")
    for spec in specs:
        d, n, b = spec.split(":")
        causal = d.endswith("c")
        d, n, b = int(d.rstrip("c")), int(n), int(b)
        shape = Shape(b, 16, n, d, "bfloat16", causal)
        q, k, v = random_inputs(shape)
        (q8, dq), (k8, dk), (v8, dv) = (cuflash.quantize_fp8(x) for x in (q, k, v))
        out = cupy.empty(q.shape, dtype=q.dtype)
        ms_fp8 = time_cuda(lambda: cuflash.forward_fp8(q8, k8, v8, dq, dk, dv, causal=causal, out=out), repeats=30)
        nk_pad = -(-n // 32) * 32
        ms_vt = time_cuda(lambda: cf_fp8.transpose_v(v8, nk_pad), repeats=30)
        ms_bf16 = time_cuda(lambda: cuflash.forward(q, k, v, causal=causal, out=out), repeats=30)
        ref = cuflash.forward(q, k, v, causal=causal)
        o8 = cuflash.forward_fp8(q8, k8, v8, dq, dk, dv, causal=causal)
        diff = float(cupy.linalg.norm((o8.astype(np.float32) - ref.astype(np.float32)).ravel())
                     / cupy.linalg.norm(ref.astype(np.float32).ravel()))
        c = "-"
        if cudnn is not None:
            tq, tk, tv = torch_inputs(shape)
            ms_c = time_cuda(lambda: cudnn(tq, tk, tv, causal), repeats=30)
            c = f"{tflops(shape.fwd_flops(), ms_c):.0f}"
        f = shape.fwd_flops()
        ratio = f"{ms_c / ms_fp8:.2f}" if cudnn is not None else "-"
        print(f"| {shape.label().replace('bfloat16', 'fp8')} | {tflops(f, ms_fp8):.0f} | "
              f"{tflops(f, ms_fp8 - ms_vt):.0f} | {ms_vt * 1e3:.0f} | {tflops(f, ms_bf16):.0f} | {c} | {ratio} |"
              f" (fp8 vs bf16 rel diff {diff:.3f})", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("deterministic", help="backward: default against deterministic (Markdown)")
    p.add_argument("--head-dims", default="64,128,256")
    p.add_argument("--repeats", type=int, default=20)
    p = sub.add_parser("fp8", help="the fp8 forward beside bf16 and cuDNN (Markdown)")
    p.add_argument("specs", nargs="*", metavar="D[c]:N:B", help="default: " + " ".join(FP8_DEFAULT))
    args = ap.parse_args(argv)
    if args.cmd == "deterministic":
        deterministic([int(d) for d in args.head_dims.split(",")], args.repeats)
    else:
        fp8(args.specs or FP8_DEFAULT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
