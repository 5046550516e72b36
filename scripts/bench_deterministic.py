"""Backward time, default (atomic dQ) vs deterministic=True, for the README's cost table."""
from __future__ import annotations

import cupy

import cuflash
from cuflash.bench import Shape, random_inputs, tflops, time_cuda


def main() -> None:
    print("| head_dim | dtype | causal | default | deterministic |")
    print("| --- | --- | --- | --- | --- |")
    for d in (64, 128, 256):
        for causal in (False, True):
            shape = Shape(4, 16, 4096, d, "float16", causal)
            q, k, v = random_inputs(shape)
            dout = random_inputs(shape, seed=1)[0]
            out, lse = cuflash.forward(q, k, v, causal=causal, return_lse=True)
            grads = [cupy.empty_like(x) for x in (q, k, v)]
            cells = []
            for det in (False, True):
                ms = time_cuda(lambda: cuflash.backward(dout, q, k, v, out, lse, causal=causal, deterministic=det,
                                                        dq=grads[0], dk=grads[1], dv=grads[2]), repeats=20)
                cells.append(f"{ms:.2f} ms ({tflops(2.5 * shape.fwd_flops(), ms):.0f} TFLOP/s)")
            print(f"| {d} | fp16 | {'yes' if causal else 'no'} | {cells[0]} | {cells[1]} |", flush=True)
            del q, k, v, dout, out, lse, grads
            cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
