"""sm90 backward beside the portable kernels at the head dims of the split-D / padded tiles (GPU):
python scripts/bench_sm90_bwd_dims.py [D ...]. B=4 H=16 N=4096; backward TFLOP/s =
2.5 * 4 * B * H * N^2 * D (halved for causal) / time of cuflash.backward (pre/postprocess included).
Each row also gives the largest relative difference of the sm90 gradients from the sm80 ones."""
from __future__ import annotations

import os
import sys


def main() -> int:
    import cupy

    import cuflash
    from cuflash.bench import Shape, random_inputs, time_cuda

    dims = [int(a) for a in sys.argv[1:]] or [32, 96, 192, 256]
    dtypes = {32: "float16", 64: "float16"}
    print(f"{'shape':<28} {'sm90':>7} {'sm80':>7} {'x':>6} {'maxrel':>9}", flush=True)
    for d in dims:
        for causal in (False, True):
            s = Shape(4, 16, 4096, d, dtypes.get(d, "bfloat16"), causal)
            q, k, v = random_inputs(s)
            out, lse = cuflash.forward(q, k, v, causal=causal, return_lse=True)
            dout = random_inputs(s, seed=1)[0]
            flops = 2.5 * 4 * s.batch * s.heads * s.seqlen * s.seqlen * d / (2 if causal else 1)
            res, grads = {}, {}
            for be in ("sm90", "sm80"):
                os.environ["CUFLASH_BWD_BACKEND"] = be
                fn = lambda: cuflash.backward(dout, q, k, v, out, lse, causal=causal)  # noqa: E731
                grads[be] = [g.astype(cupy.float32) for g in fn()]
                res[be] = flops / (time_cuda(fn, repeats=10) * 1e-3) / 1e12
            rel = max(float(cupy.abs(a - b).max() / (cupy.abs(b).max() + 1e-6))
                      for a, b in zip(grads["sm90"], grads["sm80"]))
            label = f"D={d} {s.dtype}{' causal' if causal else ''}"
            print(f"{label:<28} {res['sm90']:7.1f} {res['sm80']:7.1f} {res['sm90'] / res['sm80']:6.2f} {rel:9.2e}",
                  flush=True)
            del q, k, v, out, lse, dout, grads
            cupy.get_default_memory_pool().free_all_blocks()
    os.environ.pop("CUFLASH_BWD_BACKEND", None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
