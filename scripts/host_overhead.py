"""Host (Python) time of one small forward call, step by step, and where it goes (cProfile).

    python3 scripts/host_overhead.py
"""
from __future__ import annotations

import cProfile
import pstats
import timeit

import cupy
import numpy as np

import cuflash
from cuflash import _checks, api, call_cache, launch, params, sm90
from cuflash.bench import Shape, host_overhead_us, random_inputs


def per_call_us(fn, number: int = 5000) -> float:
    fn()
    return min(timeit.repeat(fn, number=number, repeat=3)) / number * 1e6


def main() -> None:
    shape = Shape(1, 8, 128, 64, "float16", False)
    q, k, v = random_inputs(shape)
    out = cupy.empty_like(q)
    total = host_overhead_us(lambda: cuflash.forward(q, k, v, out=out))
    print(f"forward B=1 H=8 N=128 D=64 fp16, out given: {total:.1f} us/call")
    print(f"forward, out allocated: {host_overhead_us(lambda: cuflash.forward(q, k, v)):.1f} us/call")
    print(f"forward, out allocated, lse returned: "
          f"{host_overhead_us(lambda: cuflash.forward(q, k, v, return_lse=True)):.1f} us/call")
    # A NumPy scalar scale is not a key the call cache takes: every call runs the checked path.
    scale = np.float64(0.125)
    print(f"checked path (call cache bypassed), out given: "
          f"{host_overhead_us(lambda: cuflash.forward(q, k, v, out=out, softmax_scale=scale)):.1f} us/call")
    o, lse = cuflash.forward(q, k, v, return_lse=True)
    grads = [cupy.empty_like(x) for x in (q, k, v)]
    print(f"backward, gradients given: "
          f"{host_overhead_us(lambda: cuflash.backward(o, q, k, v, o, lse, dq=grads[0], dk=grads[1], dv=grads[2])):.1f}"
          f" us/call (three launches)")
    key = call_cache.fwd_key(q, k, v, out, False, None, False)
    call = api._fwd_calls[key]
    stream = cupy.cuda.get_current_stream().ptr
    print(f"  of a hit: call_cache.fwd_key {per_call_us(lambda: call_cache.fwd_key(q, k, v, out, False, None, False)):.2f} us, "
          f"replayed launch {per_call_us(lambda: call.launch(stream)):.2f} us")

    kern, cfg, smem = api._fwd_plan(q.dtype, 64, False, 0)
    kern2, cfg2, smem2, extra, _ = sm90.fwd_launch_args(kern, cfg, smem, q, k, v, 0, out)
    p = params.pack_bytes(params.FWD_PARAMS, (
        q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, 0, *params.element_strides(q),
        *params.element_strides(k), *params.element_strides(v), *params.element_strides(out),
        1, 128, 128, 8, 1, 64, 0.125, 0.18))
    grid = launch.fwd_grid(cfg2, 1, 8, 128)
    steps = {
        "check_qkv_cached": lambda: _checks.check_qkv_cached(q, k, v, api.HEAD_DIMS),
        "check_out_cached": lambda: _checks.check_out_cached("out", out, q.shape, q.dtype, 0),
        "with Device(0)": lambda: cupy.cuda.Device(0).__enter__().__exit__(None, None, None),
        "_fwd_plan": lambda: api._fwd_plan(q.dtype, 64, False, 0),
        "sm90.fwd_launch_args": lambda: sm90.fwd_launch_args(kern, cfg, smem, q, k, v, 0, out),
        "pack_bytes + strides": lambda: params.pack_bytes(params.FWD_PARAMS, (
            q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, 0, *params.element_strides(q),
            *params.element_strides(k), *params.element_strides(v), *params.element_strides(out),
            1, 128, 128, 8, 1, 64, 0.125, 0.18)),
        "launch.launch": lambda: launch.launch(kern2, cfg2, grid, p, smem2, extra),
        "cupy.empty(q.shape)": lambda: cupy.empty(q.shape, dtype=q.dtype),
    }
    for name, fn in steps.items():
        print(f"  {name:24s} {per_call_us(fn):6.2f} us")
        cupy.cuda.runtime.deviceSynchronize()

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3000):
        cuflash.forward(q, k, v, out=out, softmax_scale=scale)
    prof.disable()
    cupy.cuda.runtime.deviceSynchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
