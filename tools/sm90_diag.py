"""GPU diagnostics of the sm90 primitives: saves each GEMM tile and its reference to
$OUT/sm90_diag.npz (for layout debugging off the device) and prints the errors."""
import os
from pathlib import Path

import cupy
import numpy as np

from cuflash import tma
from cuflash.compile import _inline

# test-only GEMM tiles, kept with the tests (the wheel carries only what the library runs)
GEMM_TILES = Path(__file__).resolve().parents[1] / "tests" / "cuda" / "sm90_gemm_tiles.cu"


def main():
    out = {}
    rng = np.random.default_rng(0)
    names, cases = [], []
    for kind, n, k in (("ss", 64, 64), ("ss", 128, 128), ("rs", 64, 64), ("rs", 128, 128)):
        nm = f"gemm_{kind}_kernel<bf16_tag, {n}, {k}>"
        names.append(nm)
        cases.append((kind, n, k, nm))
    mod = cupy.RawModule(code=_inline(GEMM_TILES, set()), options=("-arch=sm_90a", "-std=c++17"),
                         name_expressions=names)
    for kind, n, k, nm in cases:
        kern = mod.get_function(nm)
        kern.max_dynamic_shared_size_bytes = 100 * 1024
        # small integers: exact in bf16 and in f32 sums
        a = cupy.asarray(rng.integers(-3, 4, (64, k)).astype(np.float32)).astype(cupy.float32)
        import ml_dtypes
        a16 = cupy.asarray(a.get().astype(ml_dtypes.bfloat16))
        c = cupy.full((64, n), np.nan, dtype=np.float32)
        if kind == "ss":
            b = rng.integers(-3, 4, (n, k)).astype(np.float32)
            b16 = cupy.asarray(b.astype(ml_dtypes.bfloat16))
            ta = tma.encode_tiled(a16.data.ptr, "bfloat16", (k, 64), (k * 2,), (64, 64))
            tb = tma.encode_tiled(b16.data.ptr, "bfloat16", (k, n), (k * 2,), (64, n))
            kern((1,), (128,), (ta, tb, c), shared_mem=1024 + (64 + n) * k * 2 + 64)
            ref = a.get() @ b.T
        else:
            b = rng.integers(-3, 4, (k, n)).astype(np.float32)
            b16 = cupy.asarray(b.astype(ml_dtypes.bfloat16))
            tb = tma.encode_tiled(b16.data.ptr, "bfloat16", (n, k), (n * 2,), (64, k))
            kern((1,), (128,), (a16, tb, c), shared_mem=1024 + n * k * 2 + 64)
            ref = a.get() @ b
        got = c.get()
        key = f"{kind}_{n}_{k}"
        out[key + "_got"], out[key + "_ref"], out[key + "_a"], out[key + "_b"] = got, ref, a.get(), b
        print(key, "max abs err", float(np.nanmax(np.abs(got - ref))), "nan", int(np.isnan(got).sum()), flush=True)
    np.savez(os.path.join(os.environ.get("OUT", "."), "sm90_diag.npz"), **out)


if __name__ == "__main__":
    main()
