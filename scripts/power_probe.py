"""Clock and power while cuflash and cuDNN (PyTorch SDPA) run one shape in alternating rounds.

    python3 scripts/power_probe.py [B,H,N,D,dtype,causal] [fwd|bwd]

nvidia-smi samples SM clock and board power every 20 ms in the background; each round prints the
median time of its samples and the mean clock / power over the round, so that a kernel's speed can
be read against the clock it ran at (an H100 at its 700 W limit clocks down).
"""
from __future__ import annotations

import statistics
import subprocess
import sys
import time

import cupy

import cuflash
from cuflash.bench import Shape, _samples, random_inputs, torch_inputs, torch_sdpa


def main() -> int:
    spec = sys.argv[1] if len(sys.argv) > 1 else "1,16,16384,128,bfloat16,1"
    direction = sys.argv[2] if len(sys.argv) > 2 else "fwd"
    b, h, n, d, dtype, causal = spec.split(",")
    shape = Shape(int(b), int(h), int(n), int(d), dtype, bool(int(causal)))
    q, k, v = random_inputs(shape)
    out = cupy.empty_like(q)
    tq, tk, tv = torch_inputs(shape, requires_grad=direction == "bwd")
    cudnn = torch_sdpa("cudnn")
    if direction == "fwd":
        fns = {"cuflash": lambda: cuflash.forward(q, k, v, causal=shape.causal, out=out),
               "cudnn": lambda: cudnn(tq, tk, tv, shape.causal)}
        flops = shape.fwd_flops()
    else:
        import torch

        o, lse = cuflash.forward(q, k, v, causal=shape.causal, return_lse=True)
        dout = random_inputs(shape, seed=1)[0]
        grads = [cupy.empty_like(x) for x in (q, k, v)]
        tdo = torch.randn_like(tq)
        to = cudnn(tq, tk, tv, shape.causal)
        fns = {"cuflash": lambda: cuflash.backward(dout, q, k, v, o, lse, causal=shape.causal,
                                                   dq=grads[0], dk=grads[1], dv=grads[2]),
               "cudnn": lambda: torch.autograd.grad(to, (tq, tk, tv), tdo, retain_graph=True)}
        flops = 2.5 * shape.fwd_flops()
    for fn in fns.values():
        for _ in range(3):
            fn()
    cupy.cuda.runtime.deviceSynchronize()
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "20"], stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    marks = []
    for rnd in range(6):
        for name, fn in fns.items():
            t0 = time.time()
            ts = _samples(fn, 15)
            marks.append((rnd, name, t0, time.time(), statistics.median(ts)))
    time.sleep(0.2)
    smi.terminate()
    lines = smi.communicate()[0].strip().splitlines()
    samples = []
    for line in lines:
        try:
            stamp, clk, pw = [x.strip() for x in line.split(",")]
            t = time.mktime(time.strptime(stamp.split(".")[0], "%Y/%m/%d %H:%M:%S")) + float("0." + stamp.split(".")[1])
            samples.append((t, float(clk), float(pw)))
        except (ValueError, IndexError):
            continue
    print(f"{shape.label()} {direction}: {len(samples)} nvidia-smi samples")
    for rnd, name, t0, t1, ms in marks:
        inside = [(c, p) for t, c, p in samples if t0 <= t <= t1]
        clk = statistics.mean(c for c, _ in inside) if inside else float("nan")
        pw = statistics.mean(p for _, p in inside) if inside else float("nan")
        print(f"  round {rnd} {name:8s} {ms:7.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s  {clk:6.0f} MHz {pw:5.0f} W")
    return 0


if __name__ == "__main__":
    sys.exit(main())
