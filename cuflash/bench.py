"""Timing helpers shared by ``python -m cuflash`` and ``benchmarks/``.

Times are device times from CUDA events around each call, median of many
repeats after a warm-up, on random inputs. FLOPs follow the FlashAttention
convention: forward 4*B*H*Nq*Nk*D (halved for causal with Nq == Nk), backward
2.5x forward, forward+backward 3.5x forward.
"""
from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import options
from .distributions import make_inputs


@dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    seqlen: int
    head_dim: int
    dtype: str
    causal: bool
    heads_kv: int | None = None
    seqlen_k: int | None = None

    @classmethod
    def parse(cls, text: str) -> "Shape":
        """``"B,H,N,D,dtype[,causal]"`` (causal: 1, true or causal) -> Shape; ValueError otherwise."""
        parts = [x.strip() for x in text.split(",")]
        if len(parts) not in (5, 6):
            raise ValueError(f"shape must be B,H,N,D,dtype[,causal], got {text!r}")
        b, h, n, d = (int(x) for x in parts[:4])
        return cls(b, h, n, d, parts[4], len(parts) == 6 and parts[5].lower() in ("1", "true", "causal"))

    @property
    def nk(self) -> int:
        return self.seqlen if self.seqlen_k is None else self.seqlen_k

    @property
    def hkv(self) -> int:
        return self.heads if self.heads_kv is None else self.heads_kv

    def label(self) -> str:
        s = f"B={self.batch} H={self.heads} N={self.seqlen} D={self.head_dim} {self.dtype}"
        if self.hkv != self.heads:
            s += f" Hkv={self.hkv}"
        if self.nk != self.seqlen:
            s += f" Nk={self.nk}"
        return s + (" causal" if self.causal else "")

    def fwd_flops(self) -> float:
        f = 4.0 * self.batch * self.heads * self.seqlen * self.nk * self.head_dim
        if self.causal:
            # visible fraction of the score matrix under bottom-right alignment
            nq, nk = self.seqlen, self.nk
            visible = sum(min(nk, max(0, i + 1 + nk - nq)) for i in range(0, nq, max(1, nq // 4096)))
            f *= visible / (len(range(0, nq, max(1, nq // 4096))) * nk)
        return f


# The standard table: the issues' benchmark rows.
STANDARD_SHAPES = [
    Shape(4, 16, 4096, 64, "float16", False), Shape(4, 16, 4096, 64, "float16", True),
    Shape(4, 16, 4096, 128, "float16", False), Shape(4, 16, 4096, 128, "float16", True),
    Shape(4, 16, 4096, 64, "bfloat16", False), Shape(4, 16, 4096, 64, "bfloat16", True),
    Shape(4, 16, 4096, 128, "bfloat16", False), Shape(4, 16, 4096, 128, "bfloat16", True),
    Shape(4, 16, 4096, 256, "bfloat16", False), Shape(4, 16, 4096, 256, "bfloat16", True),
    Shape(1, 16, 16384, 128, "bfloat16", True), Shape(16, 16, 1024, 64, "float16", False),
]
QUICK_SHAPES = [Shape(4, 16, 4096, 64, "float16", False), Shape(4, 16, 4096, 128, "bfloat16", True)]
# The score-distribution table (python -m cuflash --dists): each shape non-causal and causal.
# Every head dim the Hopper kernels are tuned for, in both 16-bit types, causal and not (issue #27's grid).
DIST_SHAPES = [Shape(4, 16, 4096, d, dt, c) for d in (64, 128, 256) for dt in ("float16", "bfloat16")
               for c in (False, True)]
# fp8 forward rows (Hopper): e4m3 inputs quantised from these bf16 shapes, bf16 output; peers run bf16.
FP8_SHAPES = [
    Shape(4, 16, 4096, 64, "bfloat16", False), Shape(4, 16, 4096, 64, "bfloat16", True),
    Shape(4, 16, 4096, 128, "bfloat16", False), Shape(4, 16, 4096, 128, "bfloat16", True),
    Shape(4, 16, 4096, 256, "bfloat16", False), Shape(4, 16, 4096, 256, "bfloat16", True),
    Shape(1, 16, 16384, 128, "bfloat16", True), Shape(16, 16, 1024, 64, "bfloat16", False),
]


def fp8_label(shape: Shape) -> str:
    return shape.label().replace("bfloat16", "fp8")


def fp8_inputs(shape: Shape, seed: int = 0):
    """(q8, k8, v8, descale_q, descale_k, descale_v): ``random_inputs`` quantised per tensor."""
    from . import quantize_fp8

    pairs = [quantize_fp8(x) for x in random_inputs(shape, seed)]
    return tuple(p[0] for p in pairs) + tuple(p[1] for p in pairs)


_l2_flush_buffer = None


def _flush_l2() -> None:
    import cupy

    global _l2_flush_buffer
    if _l2_flush_buffer is None:
        _l2_flush_buffer = cupy.empty(256 * 1024 * 1024, dtype=cupy.uint8)
    _l2_flush_buffer.fill(1)


def _samples(fn: Callable[[], object], n: int) -> list[float]:
    """``n`` device times of ``fn()`` in ms, each after an L2 flush."""
    import cupy

    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(n):
        _flush_l2()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return times


def time_cuda(fn: Callable[[], object], *, warmup: int = 5, repeats: int = 30) -> float:
    """Median device time of ``fn()`` in milliseconds (CuPy events on the current stream).

    As triton.testing.do_bench does, each repeat first overwrites a 256 MiB buffer: the L2
    cache starts cold, and the GPU is busy while the host enqueues ``fn`` so that Python's
    launch overhead is not counted as kernel time (host overhead is measured separately).
    """
    for _ in range(warmup):
        fn()
    return statistics.median(_samples(fn, repeats))


def time_interleaved(fns: dict, *, warmup: int = 5, repeats: int = 30) -> dict:
    """Median device time in ms of each of ``fns`` (name -> callable), as time_cuda, but with the
    samples interleaved (one of each in turn, ``repeats`` times), so that clock and temperature drift
    (an H100 at its 700 W limit clocks down from 1980 to ~1650 MHz) falls on all of them alike
    instead of on whichever runs first or after the heaviest."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name] += _samples(fn, 1)
    return {name: statistics.median(t) for name, t in times.items()}


def _short(e: BaseException) -> str:
    """An exception in one line for the tables: its type and the first 160 characters of its text."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:160]}"


def time_interleaved_or_alone(fns: dict, result, *, warmup: int, repeats: int, log: Callable[[str], None],
                              what: str, fatal=("cuflash",)) -> dict:
    """key -> median ms of ``fns`` (key -> callable), interleaved (time_interleaved). Where a call raises during
    the timing, ``log`` says so (``what``: the case timed) and each is timed alone instead: one that raises then is
    recorded in ``result.na`` (as FAILED for the keys in ``fatal``) and left out, and ``result.notes`` says the
    timing was not interleaved."""
    try:
        return time_interleaved(fns, warmup=warmup, repeats=repeats)
    except Exception as e:  # noqa: BLE001 - find which one
        log(f"  timing {what} raised ({_short(e)}): timing each alone")
    out = {}
    for key, f in fns.items():
        try:
            out.update(time_interleaved({key: f}, warmup=warmup, repeats=repeats))
        except Exception as e:  # noqa: BLE001
            result.na[key] = ("FAILED " if key in fatal else "") + f"while timed: {_short(e)}"
    result.notes.append("timed one implementation at a time (not interleaved): one raised")
    return out


def host_overhead_us(fn: Callable[[], object], *, repeats: int = 2000) -> float:
    """Median host (Python) time of one ``fn()`` call in microseconds, the device kept busy."""
    import time

    import cupy

    for _ in range(20):
        fn()
    cupy.cuda.get_current_stream().synchronize()
    samples = []
    for _ in range(repeats // 100):
        t0 = time.perf_counter()
        for _ in range(100):
            fn()
        samples.append((time.perf_counter() - t0) / 100 * 1e6)
        cupy.cuda.get_current_stream().synchronize()
    return statistics.median(samples)


def select_kernels(direction: str, backend: str, tiles: str | None = None) -> None:
    """For tuning and diagnosis scripts: the next ``direction`` ("fwd" or "bwd") calls use
    ``backend`` (Options.fwd_backend / bwd_backend) and, if given, the sm90 tile override ``tiles``
    ("bm,bn,w": Options.sm90_fwd_tiles / sm90_bwd_tiles, cleared otherwise). The plans and recorded
    calls are keyed on the options, so the next call picks again."""
    if direction not in ("fwd", "bwd"):
        raise ValueError(f"direction must be 'fwd' or 'bwd', got {direction!r}")
    parsed = options.parse_tiles(f"sm90_{direction}_tiles", tiles) if tiles else None
    options.set(**{f"{direction}_backend": backend.strip().lower(), f"sm90_{direction}_tiles": parsed})


def random_inputs(shape: Shape, seed: int = 0):
    """q ``(B, N, H, D)``, k, v ``(B, Nk, Hkv, D)`` CuPy arrays of random normal values in the shape's
    dtype: ``distributions.make_inputs(shape, "normal", seed)``."""
    return make_inputs(shape, "normal", seed)


def _load_cublas() -> None:
    """Loads cuBLAS as CuPy does on a matmul's first use; ImportError where it is not installed."""
    import cupy

    cupy.cuda.cublas  # noqa: B018 - CuPy finds and loads the library on this first access


def cublas_missing() -> str | None:
    """None if CuPy can load cuBLAS, else why not and what to install. Only the plain-CuPy baseline
    (``cupy_naive_fwd``: ``cupy.matmul``) needs it, so the default install leaves it out (~0.8 GB)."""
    import cupy

    try:
        _load_cublas()
    except (ImportError, OSError) as e:
        try:
            major = cupy.cuda.runtime.runtimeGetVersion() // 1000
        except Exception:  # noqa: BLE001 - only to name the right wheel
            major = None
        wheel = {12: "nvidia-cublas-cu12", 13: "nvidia-cublas"}.get(major, "nvidia-cublas-cu12 / nvidia-cublas")
        extra = f"bench-cuda{major}" if major in (12, 13) else "bench-cuda12 / bench-cuda13"
        return (f"cuBLAS is not installed (the plain-CuPy baseline's cupy.matmul needs it): "
                f"pip install {wheel}, or install cuflash with the {extra} extra ({str(e)[:120]})")
    return None


def cupy_naive_fwd(q, k, v, causal: bool):
    """Plain CuPy attention (cuBLAS matmuls, materialised scores) as a baseline. Raises RuntimeError
    (``cublas_missing``'s text) when cuBLAS is not installed."""
    import cupy

    missing = cublas_missing()
    if missing is not None:
        raise RuntimeError(missing)

    d = q.shape[-1]
    g = q.shape[2] // k.shape[2]
    qt = q.transpose(0, 2, 1, 3)
    kt = cupy.repeat(k.transpose(0, 2, 1, 3), g, axis=1) if g > 1 else k.transpose(0, 2, 1, 3)
    vt = cupy.repeat(v.transpose(0, 2, 1, 3), g, axis=1) if g > 1 else v.transpose(0, 2, 1, 3)
    s = cupy.matmul(qt, kt.transpose(0, 1, 3, 2)).astype(cupy.float32) * (1.0 / np.sqrt(d))
    if causal:
        nq, nk = s.shape[-2:]
        mask = cupy.arange(nk)[None, :] <= cupy.arange(nq)[:, None] + (nk - nq)
        s = cupy.where(mask, s, -cupy.inf)
    s = cupy.exp(s - s.max(axis=-1, keepdims=True))
    p = (s / s.sum(axis=-1, keepdims=True)).astype(q.dtype)
    return cupy.matmul(p, vt).transpose(0, 2, 1, 3)


def torch_sdpa(backend: str):
    """A function (q, k, v, causal) -> out running PyTorch SDPA with one backend, or None."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception:  # noqa: BLE001 - PyTorch is optional
        return None
    if not torch.cuda.is_available():
        return None
    be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

    def run(q, k, v, causal):
        with sdpa_kernel(be):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                    enable_gqa=q.shape[1] != k.shape[1])
    return run


def torch_cuda():
    """(torch, None) where PyTorch imports and has a CUDA device, else (None, why not)."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - PyTorch is optional
        return None, f"PyTorch not importable ({_short(e)})"
    if not torch.cuda.is_available():
        return None, "PyTorch has no CUDA device"
    return torch, None


def torch_inputs(shape: Shape, requires_grad: bool = False):
    """(B, H, N, D) torch tensors of random values, as SDPA takes them."""
    import torch

    dt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[shape.dtype]
    g = torch.Generator(device="cuda").manual_seed(0)

    def mk(n, h):
        x = torch.randn(shape.batch, n, h, shape.head_dim, device="cuda", dtype=dt, generator=g)
        return x.transpose(1, 2).requires_grad_(requires_grad)

    return mk(shape.seqlen, shape.heads), mk(shape.nk, shape.hkv), mk(shape.nk, shape.hkv)


def to_torch(x):
    """A CuPy array -> a torch tensor on the same memory (DLPack, no copy), same shape and strides."""
    import torch

    from ._checks import BFLOAT16

    try:
        return torch.from_dlpack(x)
    except (BufferError, TypeError, ValueError, RuntimeError):
        if x.dtype != BFLOAT16:
            raise
        # A CuPy whose DLPack export lacks bfloat16: hand over the same bytes as int16.
        return torch.from_dlpack(x.view(np.int16)).view(torch.bfloat16)


def torch_views(arrays, *, sdpa_layout: bool = False, requires_grad: bool = False) -> list:
    """CuPy ``(B, N, H, D)`` arrays -> torch tensors on the same memory (``to_torch``), so that peers
    time exactly cuflash's inputs. ``sdpa_layout``: transposed ``(B, H, N, D)`` views, as SDPA takes
    them (it accepts non-contiguous inputs); else ``(B, N, H, D)`` as FlashAttention takes them.
    ``requires_grad``: leaves for torch.autograd.grad (the arrays are only read)."""
    out = []
    for x in arrays:
        t = to_torch(x)
        if sdpa_layout:
            t = t.transpose(1, 2)
        out.append(t.requires_grad_(requires_grad))
    return out


FA4_PATH_ENV = "CUFLASH_FA4_PATH"


def _import_fa4():
    """(flash_attn.cute.flash_attn_func, None), or (None, why not). The paths of Options.fa4_path
    ($CUFLASH_FA4_PATH, os.pathsep-separated) go in front of sys.path first, in their order: an FA4 installed with
    ``pip --target`` needs the CUTLASS DSL's own ``cutlass`` package before any other."""
    paths = list(options.current().fa4_path)
    sys.path[:0] = [p for p in paths if p not in sys.path]
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as e:  # noqa: BLE001 - missing, or a broken install (DSL libraries, CUDA)
        return None, f"{type(e).__name__}: {e}"
    return flash_attn_func, None


def _first_output(fn: Callable) -> Callable:
    """(q, k, v, causal) -> out from a function that returns ``out`` or ``(out, lse)``."""
    def run(q, k, v, causal):
        res = fn(q, k, v, causal=causal)
        return res[0] if isinstance(res, (tuple, list)) else res
    return run


def free_memory() -> None:
    """Gives CuPy's (and, where imported, PyTorch's) cached device memory back between large benchmark rows."""
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    try:
        import torch

        torch.cuda.empty_cache()
    except ImportError:
        pass


def fa4_fn():
    """A function (q, k, v, causal) -> out running FlashAttention-4 (``flash_attn.cute``) on torch
    tensors ``(B, N, H, D)`` (differentiable through torch autograd), or None if PyTorch with CUDA
    or FA4 does not import. Each new shape compiles on its first call: warm up before timing."""
    try:
        import torch
    except Exception:  # noqa: BLE001 - PyTorch is optional
        return None
    if not torch.cuda.is_available():
        return None
    fn, _ = _import_fa4()
    return None if fn is None else _first_output(fn)


def fa4_torch():
    """(torch, None) where PyTorch has a CUDA device (torch_cuda) and FlashAttention-4 imports (_import_fa4:
    $CUFLASH_FA4_PATH), else (None, why not)."""
    torch, why = torch_cuda()
    if torch is None:
        return None, why
    fn, why = _import_fa4()
    if fn is None:
        return None, f"FlashAttention-4 not importable ({why}; $CUFLASH_FA4_PATH)"
    return torch, None


def fa4_status() -> str:
    """One line on FlashAttention-4 for the report: its version, or why it did not import."""
    fn, why = _import_fa4()
    if fn is None:
        return f"FlashAttention-4 not importable ({why})"
    try:
        from importlib.metadata import version

        return f"FlashAttention-4 {version('flash-attn-4')}"
    except Exception:  # noqa: BLE001 - installed without metadata
        return "FlashAttention-4 (version unknown)"


def cudnn_fp8_fn():
    """A builder ``(q8, k8, v8, descale_q, descale_k, descale_v, causal) -> zero-argument call`` running cuDNN's
    fp8 attention forward (cudnn-frontend's graph API, ``sdpa_fp8``; ``pip install nvidia-cudnn-frontend``) on
    cuflash's e4m3 inputs (uint8 CuPy arrays, (B, N, H, D); descales as ``quantize_fp8`` returns them), on
    CuPy's current stream; None where cudnn-frontend does not import. On Hopper cuDNN writes an e4m3 output
    (cuflash's is bf16) and takes P at scale 1. Not yet run on a GPU: a failure to build raises, and the
    fp8 table then leaves the column out for that row."""
    try:
        import cudnn
    except Exception:  # noqa: BLE001 - cudnn-frontend is optional
        return None

    def build(q8, k8, v8, descale_q, descale_k, descale_v, causal: bool):
        import cupy

        handle = cudnn.create_handle()
        cudnn.set_stream(handle=handle, stream=cupy.cuda.get_current_stream().ptr)
        e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32,
                              handle=handle)

        def bhnd(x):   # a (B, N, H, D) array as cuDNN's (B, H, N, D) dims and element strides
            b, n, h, d = x.shape
            st = [s // x.itemsize for s in x.strides]
            return [b, h, n, d], [st[0], st[2], st[1], st[3]]

        def fp8_tensor(name, x):
            dim, stride = bhnd(x)
            return graph.tensor(name=name, dim=dim, stride=stride, data_type=e4m3)

        def scalar(name):
            return graph.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)

        tq, tk, tv = fp8_tensor("q", q8), fp8_tensor("k", k8), fp8_tensor("v", v8)
        names = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
        scales = {n: scalar(n) for n in names}
        kwargs = dict(q=tq, k=tk, v=tv, **scales, attn_scale=1.0 / float(np.sqrt(q8.shape[-1])),
                      use_causal_mask=causal, name="sdpa_fp8")
        try:
            o, _, amax_s, amax_o = graph.sdpa_fp8(**kwargs, generate_stats=False)
        except TypeError:   # releases before generate_stats took is_inference
            o, _, amax_s, amax_o = graph.sdpa_fp8(**kwargs, is_inference=True)
        out = cupy.empty(q8.shape, dtype=np.uint8)
        dim, stride = bhnd(out)
        o.set_output(True).set_dim(dim).set_stride(stride).set_data_type(e4m3)
        amax = {}
        for name, t in (("amax_s", amax_s), ("amax_o", amax_o)):
            amax[name] = cupy.zeros(1, dtype=np.float32)
            t.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        one = cupy.ones(1, dtype=np.float32)
        values = {"descale_q": descale_q, "descale_k": descale_k, "descale_v": descale_v,
                  "descale_s": one, "scale_s": one, "scale_o": one}
        values = {n: (v if isinstance(v, cupy.ndarray) else cupy.full(1, v, dtype=np.float32))
                  for n, v in values.items()}
        pack = {tq: q8, tk: k8, tv: v8, o: out, amax_s: amax["amax_s"], amax_o: amax["amax_o"]}
        pack.update({scales[n]: values[n] for n in names})
        workspace = cupy.empty(max(1, graph.get_workspace_size()), dtype=np.uint8)
        keep = (pack, workspace, handle)   # alive as long as the call

        def run():
            graph.execute(keep[0], keep[1], handle=keep[2])
        return run

    return build


def peer_impls() -> dict:
    """name -> (fn, sdpa_layout) for every peer that runs here: ``sdpa_flash`` and ``sdpa_cudnn``
    take ``(B, H, N, D)`` tensors (sdpa_layout True), ``fa4`` ``(B, N, H, D)``; each fn is
    (q, k, v, causal) -> out on torch tensors."""
    impls = {}
    for backend in ("flash", "cudnn"):
        fn = torch_sdpa(backend)
        if fn is not None:
            impls[f"sdpa_{backend}"] = (fn, True)
    fn = fa4_fn()
    if fn is not None:
        impls["fa4"] = (fn, False)
    return impls


def peer_label(column: str) -> str:
    """"sdpa_cudnn" -> "cudnn", "fa4" -> "fa4", "sdpa_cudnn_bf16" -> "cudnn bf16": a peer's name in the tables'
    ratio headers."""
    return (column[5:] if column.startswith("sdpa_") else column).replace("_", " ")


PASSES = ("fwd", "bwd", "fwd+bwd")
PASS_FLOPS = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}  # FLOPs of each pass in forward FLOPs


def torch_pass_fns(fn: Callable, q, k, v, causal: bool, dout=None, passes=PASSES) -> dict:
    """pass -> zero-argument callable timing a torch attention ``fn`` (q, k, v, causal) -> out on
    these tensors: "fwd"; with ``dout`` (shaped like the output; q, k, v requiring grad) also
    "bwd" (autograd of one kept forward) and "fwd+bwd". Each is called once here, so that a peer
    that cannot run the shape raises now and a compiling one (FA4) compiles before the timing."""
    import torch

    fns = {"fwd": lambda: fn(q, k, v, causal)}
    if dout is not None:
        if "bwd" in passes:
            o = fn(q, k, v, causal)
            fns["bwd"] = lambda: torch.autograd.grad(o, (q, k, v), dout, retain_graph=True)
        fns["fwd+bwd"] = lambda: torch.autograd.grad(fn(q, k, v, causal), (q, k, v), dout)
    fns = {p: f for p, f in fns.items() if p in passes}
    for f in fns.values():
        f()
    return fns


def cuflash_pass_fns(q, k, v, causal: bool, dout=None, passes=PASSES) -> dict:
    """pass -> zero-argument callable timing cuflash on CuPy q ``(B, N, H, D)``, k, v
    ``(B, Nk, Hkv, D)``: "fwd" into a preallocated output; with ``dout`` (shaped like q) also "bwd"
    (on one kept forward's out and lse) and "fwd+bwd" (forward with lse, then backward), all
    gradients into preallocated buffers, as ``python -m cuflash`` has always timed them."""
    import cupy

    from . import backward, forward

    out = cupy.empty_like(q)
    fns = {"fwd": lambda: forward(q, k, v, causal=causal, out=out)}
    if dout is not None:
        grads = [cupy.empty_like(x) for x in (q, k, v)]
        if "bwd" in passes:
            o, lse = forward(q, k, v, causal=causal, return_lse=True)
            fns["bwd"] = lambda: backward(dout, q, k, v, o, lse, causal=causal, dq=grads[0], dk=grads[1], dv=grads[2])

        def fwd_bwd():
            o2, lse2 = forward(q, k, v, causal=causal, return_lse=True, out=out)
            backward(dout, q, k, v, o2, lse2, causal=causal, dq=grads[0], dk=grads[1], dv=grads[2])

        fns["fwd+bwd"] = fwd_bwd
    return {p: f for p, f in fns.items() if p in passes}


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12
