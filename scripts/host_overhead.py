"""Host (Python) time of one small forward call, and where it goes (cProfile)."""
from __future__ import annotations

import cProfile
import pstats

import cupy

import cuflash
from cuflash.bench import Shape, host_overhead_us, random_inputs

shape = Shape(1, 8, 128, 64, "float16", False)
q, k, v = random_inputs(shape)
out = cupy.empty_like(q)
print(f"forward B=1 H=8 N=128 D=64, out given: {host_overhead_us(lambda: cuflash.forward(q, k, v, out=out)):.1f} us/call")
print(f"forward, out allocated: {host_overhead_us(lambda: cuflash.forward(q, k, v)):.1f} us/call")
prof = cProfile.Profile()
prof.enable()
for _ in range(3000):
    cuflash.forward(q, k, v, out=out)
prof.disable()
cupy.cuda.runtime.deviceSynchronize()
pstats.Stats(prof).sort_stats("tottime").print_stats(14)
