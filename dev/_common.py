"""Helpers shared by the development tools in dev/ (not a tool: no entry point).

Shapes are ``B,H,N,D,dtype[,causal]`` (cuflash.bench.Shape.parse). A *variant* is a string of
space-separated tokens that says how to build and call cuflash for one column of a comparison:

    -DNAME[=V]   an NVRTC define for every kernel ($CUFLASH_NVRTC_DEFINES)
    @NAME=VALUE  an environment variable for this variant only (backend, tiles, dQ mode ...:
                 @CUFLASH_FWD_BACKEND=sm80, @CUFLASH_SM90_FWD_TILES=128,176,12)
    src=PATH     the kernel sources of another tree (its kernels_cu/), e.g. an old checkout's
    det          the deterministic backward
    cudnn | flash | fa4   a peer instead of cuflash (PyTorch SDPA's cuDNN / FlashAttention-2
                 backend, FlashAttention-4 through $CUFLASH_FA4_PATH); other tokens are ignored
The empty string is the default build.
"""
from __future__ import annotations

import multiprocessing
import os
import sys
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PEERS = ("cudnn", "flash", "fa4")

# The shapes each forced Hopper forward schedule runs on under compute-sanitizer
# (b, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal); precompile.py sched compiles them.
SCHED_SHAPES = [(1, 70, 33, 2, 2, 128, True), (2, 300, 390, 4, 2, 64, False),
                (1, 150, 170, 2, 1, 256, True), (1, 257, 300, 2, 2, 128, False)]


def parse_shape(text: str):
    """``B,H,N,D,dtype[,causal]`` -> cuflash.bench.Shape (argparse type)."""
    from cuflash.bench import Shape

    return Shape.parse(text)


def shapes_arg(values, default):
    """The shapes given on the command line (strings), else ``default`` (strings or Shapes)."""
    return [parse_shape(s) if isinstance(s, str) else s for s in (values or default)]


def reset_plans() -> None:
    """Drop cuflash's cached launch plans and recorded calls, so that the next call picks and
    compiles again under the current environment (defines, backend, tiles)."""
    import importlib

    for mod, names in (("cuflash.api", ("_fwd_plans", "_bwd_plans", "_fwd_calls")), ("cuflash.fp8", ("_plans",))):
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        for name in names:
            cache = getattr(m, name, None)
            if cache is not None and hasattr(cache, "clear"):
                cache.clear()


_own_kernel_dir = None


def use_sources(path: str | None) -> None:
    """Compile from the kernel sources at ``path`` (None: this tree's) from now on."""
    global _own_kernel_dir
    from cuflash import compile as cf_compile

    if _own_kernel_dir is None:
        _own_kernel_dir = cf_compile.kernel_dir
    cf_compile.kernel_dir = (lambda: Path(path)) if path else _own_kernel_dir
    cf_compile.load_source.cache_clear()


@dataclass
class Variant:
    text: str
    defines: list = field(default_factory=list)
    env: dict = field(default_factory=dict)
    src: str | None = None
    det: bool = False
    peer: str | None = None

    @classmethod
    def parse(cls, text: str) -> "Variant":
        v = cls(text)
        for t in text.split():
            if t.startswith("@"):
                name, _, value = t[1:].partition("=")
                v.env[name] = value
            elif t.startswith("src="):
                v.src = t[4:]
            elif t == "det":
                v.det = True
            elif t in PEERS:
                v.peer = t
            else:
                v.defines.append(t)
        return v

    @property
    def label(self) -> str:
        return self.text or "default"

    def apply(self, all_env_names=()) -> None:
        """Set this variant's build and environment (unsetting the other variants' variables)."""
        for name in all_env_names:
            os.environ.pop(name, None)
        os.environ.update(self.env)
        use_sources(self.src)
        defines = list(self.defines)
        if self.src:   # the module cache keys on the source text too; the define keeps them apart in names
            defines.append(f"-DCUFLASH_AB_SOURCES={zlib.crc32(self.src.encode())}")
        os.environ["CUFLASH_NVRTC_DEFINES"] = " ".join(defines)
        reset_plans()


def apply_variants(variants):
    """A function that applies one of ``variants`` (clearing the env names any of them sets)."""
    names = {n for v in variants for n in v.env}
    return lambda v: v.apply(names)


def peer_fn(name: str):
    """(fn, sdpa_layout) of a peer (cudnn, flash, fa4) or (None, None) where it does not run."""
    from cuflash.bench import fa4_fn, torch_sdpa

    if name == "fa4":
        fn = fa4_fn()
        return (fn, False) if fn is not None else (None, None)
    fn = torch_sdpa(name)
    return (fn, True) if fn is not None else (None, None)


def free_memory() -> None:
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    try:
        import torch

        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - PyTorch is optional
        pass


# ----------------------------------------------------------------------------------- calls
def cuflash_call(pas: str, var: Variant, shape, q, k, v, dout):
    """A zero-argument call of cuflash for one pass (fwd, bwd, fwd+bwd, fp8) on these CuPy inputs, and a
    function giving its result arrays (the output, or dq, dk, dv)."""
    import cupy

    import cuflash

    c = shape.causal
    out = cupy.empty_like(q)
    grads = [cupy.empty_like(x) for x in (q, k, v)]
    if pas == "fwd":
        return (lambda: cuflash.forward(q, k, v, causal=c, out=out)), lambda: [out]
    if pas == "fp8":
        (q8, sq), (k8, sk), (v8, sv) = (cuflash.quantize_fp8(x) for x in (q, k, v))
        return (lambda: cuflash.forward_fp8(q8, k8, v8, sq, sk, sv, causal=c, out=out)), lambda: [out]
    o, lse = cuflash.forward(q, k, v, causal=c, return_lse=True)
    if pas == "bwd":
        return (lambda: cuflash.backward(dout, q, k, v, o, lse, causal=c, deterministic=var.det,
                                         dq=grads[0], dk=grads[1], dv=grads[2])), lambda: grads

    def fwd_bwd():
        o2, lse2 = cuflash.forward(q, k, v, causal=c, return_lse=True, out=out)
        cuflash.backward(dout, q, k, v, o2, lse2, causal=c, deterministic=var.det, dq=grads[0], dk=grads[1],
                         dv=grads[2])
    return fwd_bwd, lambda: grads


def peer_call(pas: str, name: str, shape, q, k, v, dout):
    """As cuflash_call for a peer (cudnn, flash, fa4); (None, None) where it does not run. The result
    function is given for the forward only."""
    from cuflash.bench import torch_pass_fns, torch_views

    fn, sdpa_layout = peer_fn(name)
    if fn is None or pas == "fp8":
        return None, None
    tq, tk, tv = torch_views((q, k, v), sdpa_layout=sdpa_layout, requires_grad=pas != "fwd")
    tdo = torch_views((dout,), sdpa_layout=sdpa_layout)[0] if pas != "fwd" else None
    res = {}
    if pas == "fwd":
        def run():
            res["out"] = fn(tq, tk, tv, shape.causal)
        view = lambda t: t.transpose(1, 2) if sdpa_layout else t  # noqa: E731

        def result():
            import cupy

            return [cupy.from_dlpack(view(res["out"]).contiguous())]
        return run, result
    return torch_pass_fns(fn, tq, tk, tv, shape.causal, dout=tdo, passes=(pas,))[pas], None


# ----------------------------------------------------------------------------------- precompile
def _compile(cfgs, env=None):
    if env:
        os.environ.update(env)
    from cuflash.dispatch import get_kernel

    failed = []
    for cfg in cfgs:
        try:
            get_kernel(cfg, 0)
        except Exception as e:  # noqa: BLE001
            failed.append(f"{cfg.key()}: {type(e).__name__}: {str(e)[:500]}")
    return failed


def precompile_parallel(cfgs, jobs: int | None = None, env: dict | None = None) -> list[str]:
    """Compile ``cfgs`` (KernelConfigs) into CuPy's disk cache in ``jobs`` fresh (spawned) processes,
    with ``env`` set there (e.g. $CUFLASH_NVRTC_DEFINES); returns the failures."""
    cfgs = list(cfgs)
    if not cfgs:
        return []
    jobs = min(jobs or os.cpu_count() or 4, len(cfgs))
    chunks = [cfgs[i::jobs] for i in range(jobs)]
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
        return [f for part in ex.map(_compile, chunks, [env] * jobs) for f in part]


def add_tests_to_path() -> None:
    """tests/ on sys.path (its sass_tools module, shared with the SASS tests)."""
    tests = str(ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
