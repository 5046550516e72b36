"""Where the time of a forward+backward call goes: forward and backward timed inside one
fwd+bwd sequence (events between them) against each timed alone, with and without the L2 flush.

    python3 scripts/fwd_bwd_split.py [B,H,N,D,dtype,causal ...]

Prints medians in ms and the GPU clock (pynvml-free: nvidia-smi) before and after.
"""
from __future__ import annotations

import statistics
import subprocess
import sys

import cupy

import cuflash
from cuflash.bench import Shape, random_inputs


def clocks() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                               "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "?"


def main() -> int:
    specs = sys.argv[1:] or ["1,16,16384,128,bfloat16,1", "4,16,4096,128,bfloat16,1"]
    flush = cupy.empty(256 * 1024 * 1024, dtype=cupy.uint8)
    for spec in specs:
        b, h, n, d, dtype, causal = spec.split(",")
        shape = Shape(int(b), int(h), int(n), int(d), dtype, bool(int(causal)))
        q, k, v = random_inputs(shape)
        dout = random_inputs(shape, seed=1)[0]
        out = cupy.empty_like(q)
        grads = [cupy.empty_like(x) for x in (q, k, v)]
        o, lse = cuflash.forward(q, k, v, causal=shape.causal, return_lse=True)

        def fwd():
            return cuflash.forward(q, k, v, causal=shape.causal, return_lse=True, out=out)

        def bwd(o_, lse_):
            cuflash.backward(dout, q, k, v, o_, lse_, causal=shape.causal, dq=grads[0], dk=grads[1], dv=grads[2])

        ev = [cupy.cuda.Event() for _ in range(3)]
        res = {"fwd alone": [], "bwd alone": [], "fwd in pair": [], "bwd in pair": [], "pair": [],
               "pair no flush": [], "bwd alone no flush": []}
        print(f"{shape.label()}: clocks before {clocks()}")
        for rep in range(35):
            flush.fill(1); ev[0].record(); fwd(); ev[1].record(); ev[1].synchronize()
            t_f = cupy.cuda.get_elapsed_time(ev[0], ev[1])
            flush.fill(1); ev[0].record(); bwd(o, lse); ev[1].record(); ev[1].synchronize()
            t_b = cupy.cuda.get_elapsed_time(ev[0], ev[1])
            flush.fill(1); ev[0].record(); o2, lse2 = fwd(); ev[1].record(); bwd(o2, lse2); ev[2].record()
            ev[2].synchronize()
            t_pf, t_pb = cupy.cuda.get_elapsed_time(ev[0], ev[1]), cupy.cuda.get_elapsed_time(ev[1], ev[2])
            ev[0].record(); o2, lse2 = fwd(); bwd(o2, lse2); ev[1].record(); ev[1].synchronize()
            t_pn = cupy.cuda.get_elapsed_time(ev[0], ev[1])
            ev[0].record(); bwd(o, lse); ev[1].record(); ev[1].synchronize()
            t_bn = cupy.cuda.get_elapsed_time(ev[0], ev[1])
            if rep >= 5:
                for key, t in zip(res, (t_f, t_b, t_pf, t_pb, t_pf + t_pb, t_pn, t_bn)):
                    res[key].append(t)
        print(f"  clocks after {clocks()}")
        for key, ts in res.items():
            print(f"  {key:20s} {statistics.median(ts):8.3f} ms  (min {min(ts):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
