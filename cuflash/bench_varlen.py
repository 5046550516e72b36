"""The varlen table of ``python -m cuflash --varlen`` (issue #43's bar).

The bar: varlen forward and forward+backward on a batch of 64 sequences with lengths drawn uniformly between 128
and 8192 tokens (fixed seed :data:`SEED`; H=16 D=128 bf16, causal and not) within 10 % per useful FLOP of the dense
API on the same total tokens at the batch's mean length, beside FlashAttention-4's varlen path and cuDNN's ragged
layout where they run, at least 1.05x the faster.

Each row is one packed batch (:class:`VarlenRow`: lengths ``np.random.default_rng(seed).integers(lo, hi + 1,
batch)``, the same lengths for queries and keys), timed forward and forward+backward, on each score distribution
(default ``normal`` and ``sink``; cuflash.distributions, drawn sequence by sequence so that every sequence has
its own sink at its first key), with:

- ``cuflash``: ``cuflash.forward_varlen`` / ``backward_varlen`` on the packed CuPy arrays, ``check_offsets=False``
  (the offset check is a device-to-host copy and a wait; it is timed apart, once per row, as
  ``cuflash (checked)``, and its overhead reported);
- ``dense``: ``cuflash.forward`` / ``backward`` on a dense batch of as many sequences of the mean length
  (B = batch, N = round(mean)), so the same total tokens (to within batch / 2);
- ``fa4``: FlashAttention-4's ``flash_attn.cute.flash_attn_varlen_func`` on torch views of the same packed arrays
  (backward through torch autograd), where it imports ($CUFLASH_FA4_PATH, as bench_variants.fa4_adapter) and runs;
- ``cudnn``: cuDNN's SDPA on the ragged (THD) layout through cudnn-frontend's graph API (ragged offsets on Q, K, V,
  O, dO and the gradients, ``seq_len_q`` / ``seq_len_kv`` with ``use_padding_mask``; stats padded to
  (B, H, max_len, 1)), where ``import cudnn`` works and the graph builds.

A peer that does not import, does not build or raises gets "n/a" with the reason; it never stops the run.

FLOPs (useful, the FlashAttention convention): forward 4 x D x H x the visible (query, key) pairs summed over the
sequences (non-causal nq * nk; causal bottom-right aligned, n (n + 1) / 2 for nq == nk: bench_variants.
visible_pairs); forward+backward 3.5x the forward (bench.PASS_FLOPS). The dense batch's FLOPs are counted the same
way on its own shape, so "varlen / dense" is the ratio of TFLOP/s per useful FLOP.

Before timing, cuflash's varlen forward output is compared with FA4's and cuDNN's (relative Frobenius norm; a peer
above bench_variants.CHECK_BOUND is "differs", left out of the ratios, and the run fails) and, on a few sequences
(the first, the shortest, the longest), with cuflash's dense forward run on that sequence alone.

Timings: the implementations of one pass sample by sample in turn (bench.time_interleaved: L2 flushed before
each sample), the median of ``repeats`` samples after ``warmup`` calls of each.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import numpy as np

from .bench import PASS_FLOPS, Shape, free_memory
from .bench_report import fa4_version, markdown_report, print_results, run_grid, run_header, text_report
from .bench_variants import CHECK_BOUND, Variant, _ms, _ratio, _short, _tf, tflops, visible_pairs

SEED = 43                          # the lengths' seed (issue #43)
INPUT_SEED = 0                     # sequence b's inputs: make_inputs(..., seed=INPUT_SEED + b)
BATCH, MIN_LEN, MAX_LEN = 64, 128, 8192
HEADS, HEAD_DIM, DTYPE = 16, 128, "bfloat16"
VARLEN_PASSES = ("fwd", "fwd+bwd")
DEFAULT_DISTS = ("normal", "sink")
QUICK_DISTS = ("normal",)
DEFAULT_REPEATS, DEFAULT_WARMUP = 10, 2
PEERS = ("fa4", "cudnn")
BAR_DENSE = 0.90                   # varlen's TFLOP/s per useful FLOP at least 90 % of dense's
BAR_PEER = 1.05                    # and at least 1.05x the faster peer
IMPLS = ("cuflash", "dense") + PEERS


# ---------------------------------------------------------------------------
# Rows


def draw_lengths(batch: int = BATCH, lo: int = MIN_LEN, hi: int = MAX_LEN, seed: int = SEED) -> np.ndarray:
    """``batch`` sequence lengths drawn uniformly from [lo, hi] (both included), int64, a function of the seed
    alone: ``np.random.default_rng(seed).integers(lo, hi + 1, batch)``."""
    if batch < 1 or lo < 1 or hi < lo:
        raise ValueError(f"need batch >= 1 and 1 <= lo <= hi, got batch={batch} lo={lo} hi={hi}")
    return np.random.default_rng(seed).integers(lo, hi + 1, batch).astype(np.int64)


def offsets(lengths) -> np.ndarray:
    """int32 ``(batch + 1,)`` offsets of packed sequences of these lengths: 0, then the running sums."""
    lengths = np.asarray(lengths, dtype=np.int64)
    out = np.concatenate([[0], np.cumsum(lengths)])
    if out[-1] >= 2**31:
        raise ValueError(f"{out[-1]} tokens do not fit int32 offsets")
    return out.astype(np.int32)


@dataclass(frozen=True)
class VarlenRow:
    """One packed batch: ``batch`` sequences of lengths uniform in [min_len, max_len] (``seed``), the same for
    queries and keys, H heads (Hkv KV heads), head dim D."""

    name: str
    causal: bool
    batch: int = BATCH
    min_len: int = MIN_LEN
    max_len: int = MAX_LEN
    heads: int = HEADS
    heads_kv: int = HEADS
    head_dim: int = HEAD_DIM
    dtype: str = DTYPE
    seed: int = SEED

    def __post_init__(self):
        if self.heads < 1 or self.heads_kv < 1 or self.heads % self.heads_kv:
            raise ValueError(f"heads ({self.heads}) must be a positive multiple of heads_kv ({self.heads_kv})")
        draw_lengths(self.batch, self.min_len, self.max_len, self.seed)   # the ValueError for bad bounds

    def lengths(self) -> np.ndarray:
        return draw_lengths(self.batch, self.min_len, self.max_len, self.seed)

    def mean_len(self) -> int:
        """The dense batch's sequence length: the lengths' mean, rounded (at least 1)."""
        return max(1, int(round(float(self.lengths().mean()))))

    def dense_shape(self) -> Shape:
        """The dense call at the mean length: as many sequences, so the same total tokens (to within batch / 2)."""
        return Shape(self.batch, self.heads, self.mean_len(), self.head_dim, self.dtype, self.causal,
                     heads_kv=self.heads_kv if self.heads_kv != self.heads else None)

    def label(self) -> str:
        s = (f"B={self.batch} N~U[{self.min_len},{self.max_len}] H={self.heads} D={self.head_dim} {self.dtype}")
        if self.heads_kv != self.heads:
            s += f" Hkv={self.heads_kv}"
        return s + (" causal" if self.causal else "")


VARLEN_ROWS = (
    VarlenRow("varlen", False),
    VarlenRow("varlen-causal", True),
    VarlenRow("varlen-gqa", False, heads=16, heads_kv=4),
    VarlenRow("varlen-gqa-causal", True, heads=16, heads_kv=4),
)
ROW_NAMES = tuple(r.name for r in VARLEN_ROWS)
DEFAULT_ROWS = ("varlen", "varlen-causal")   # issue #43's bar


def rows_by_name(names) -> list:
    """The rows named (ValueError naming the unknown ones), in the order given, without repeats."""
    from .bench_variants import pick_rows

    return pick_rows(VARLEN_ROWS, names, "varlen")


_OVERRIDE_KEYS = {"b": "batch", "batch": "batch", "h": "heads", "heads": "heads", "hkv": "heads_kv",
                  "heads_kv": "heads_kv", "d": "head_dim", "head_dim": "head_dim", "seed": "seed", "dtype": "dtype",
                  "lens": "lens", "lengths": "lens"}


def parse_overrides(text: str) -> dict:
    """``"B=8,lens=128:1024,H=4,Hkv=2,D=64,seed=1,dtype=float16"`` -> VarlenRow fields (any subset; ``lens`` is
    ``LO:HI``); ValueError on anything else."""
    out = {}
    for part in (x.strip() for x in text.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        field_name = _OVERRIDE_KEYS.get(key.strip().lower())
        if not sep or field_name is None:
            raise ValueError(f"bad varlen shape item {part!r}: expected KEY=VALUE with KEY one of B, lens (LO:HI), "
                             "H, Hkv, D, seed, dtype")
        value = value.strip()
        try:
            if field_name == "lens":
                lo, hi = re.split(r"[:\-]", value)
                out["min_len"], out["max_len"] = int(lo), int(hi)
            elif field_name == "dtype":
                if value not in ("float16", "bfloat16"):
                    raise ValueError("dtype must be float16 or bfloat16")
                out["dtype"] = value
            else:
                out[field_name] = int(value)
        except ValueError as e:
            raise ValueError(f"bad varlen shape item {part!r}: {e}") from None
    return out


def apply_overrides(row: VarlenRow, overrides: dict) -> VarlenRow:
    """The row with these fields replaced; heads given without heads_kv keeps the row's heads ratio where the row
    is MHA (heads_kv follows heads), else its heads_kv. ValueError if the result is not a valid row."""
    kw = dict(overrides)
    if "heads" in kw and "heads_kv" not in kw and row.heads_kv == row.heads:
        kw["heads_kv"] = kw["heads"]
    return replace(row, **kw)


# ---------------------------------------------------------------------------
# FLOP accounting


def pairs_per_head(lengths_q, lengths_k, causal: bool) -> int:
    """Visible (query, key) pairs of one head summed over the sequences (bottom-right aligned under causal)."""
    var = Variant(causal=causal)
    return sum(visible_pairs(int(a), int(b), var) for a, b in zip(lengths_q, lengths_k))


@dataclass(frozen=True)
class Work:
    """Forward FLOPs of one row (multiply by PASS_FLOPS for forward+backward)."""

    pairs: int             # visible pairs per head, summed over the packed sequences
    dense_pairs: int       # the same, over the dense batch at the mean length
    useful_flops: float
    dense_flops: float


def work(row: VarlenRow) -> Work:
    lengths = row.lengths()
    pairs = pairs_per_head(lengths, lengths, row.causal)
    n = row.mean_len()
    dense_pairs = row.batch * visible_pairs(n, n, Variant(causal=row.causal))
    f = 4.0 * row.head_dim * row.heads
    return Work(pairs, dense_pairs, f * pairs, f * dense_pairs)


# ---------------------------------------------------------------------------
# Results


@dataclass
class VarlenResult:
    """One row x distribution x pass."""

    row: str
    label: str
    dist: str
    pass_name: str
    work: Work
    ms: dict = field(default_factory=dict)        # impl -> median ms (IMPLS; "cuflash_checked" for fwd)
    na: dict = field(default_factory=dict)        # impl -> reason
    check: dict = field(default_factory=dict)     # "fa4" / "cudnn" / "dense" -> relative difference from cuflash
    notes: list = field(default_factory=list)
    desc: str = ""                                # describe(row)

    @property
    def factor(self) -> float:
        return PASS_FLOPS[self.pass_name]

    def tflops(self, impl: str = "cuflash") -> Optional[float]:
        flops = self.work.dense_flops if impl == "dense" else self.work.useful_flops
        return tflops(self.factor * flops, self.ms.get(impl))

    def check_failed(self) -> list:
        return [p for p, x in self.check.items() if not x <= CHECK_BOUND]

    def vs_dense(self) -> Optional[float]:
        """cuflash varlen's TFLOP/s per useful FLOP / the dense call's (>= BAR_DENSE: the bar)."""
        a, b = self.tflops("cuflash"), self.tflops("dense")
        return a / b if a and b else None

    def vs(self, peer: str) -> Optional[float]:
        """The peer's time / cuflash's on the same call (> 1: cuflash faster); None if either is missing or the
        peer's output differs."""
        if peer in self.check_failed() or not self.ms.get(peer) or not self.ms.get("cuflash"):
            return None
        return self.ms[peer] / self.ms["cuflash"]

    def fastest_peer(self) -> Optional[str]:
        timed = [p for p in PEERS if self.vs(p) is not None]
        return min(timed, key=lambda p: self.ms[p]) if timed else None

    def vs_peer(self) -> Optional[float]:
        p = self.fastest_peer()
        return self.vs(p) if p else None

    def check_overhead(self) -> Optional[float]:
        """ms the offset check adds to a forward call (checked - unchecked, timed together apart from the rest)."""
        a, b = self.ms.get("cuflash_checked"), self.ms.get("cuflash_unchecked")
        return a - b if a is not None and b is not None else None

    def bar(self) -> str:
        """Issue #43's bar on this row, distribution and pass: "met", "NOT met (...)", or "-" (not measured)."""
        d = self.vs_dense()
        if d is None:
            return "-"
        missed = []
        if d < BAR_DENSE:
            missed.append(f"varlen/dense {d:.2f} < {BAR_DENSE:.2f}")
        p = self.vs_peer()
        if p is not None and p < BAR_PEER:
            missed.append(f"x {self.fastest_peer()} {p:.2f} < {BAR_PEER:.2f}")
        if missed:
            return "NOT met (" + "; ".join(missed) + ")"
        return "met" if p is not None else "met vs dense (no peer ran)"

    def to_json(self) -> dict:
        return {"row": self.row, "label": self.label, "dist": self.dist, "pass": self.pass_name,
                "pairs_per_head": self.work.pairs, "dense_pairs_per_head": self.work.dense_pairs,
                "useful_flops_fwd": self.work.useful_flops, "dense_flops_fwd": self.work.dense_flops,
                "ms": self.ms, "tflops": {i: self.tflops(i) for i in self.ms if i in IMPLS},
                "na": self.na, "check": self.check, "vs_dense": self.vs_dense(),
                "vs": {p: self.vs(p) for p in PEERS}, "fastest_peer": self.fastest_peer(),
                "vs_fastest_peer": self.vs_peer(), "check_offsets_overhead_ms": self.check_overhead(),
                "bar": self.bar(), "notes": self.notes, "desc": self.desc}


def failures(results) -> list:
    """Lines saying what went wrong: cuflash failing a call, an output that differs from cuflash's varlen one."""
    lines = []
    for r in results:
        if "cuflash" in r.na:
            lines.append(f"{r.row} [{r.dist}] {r.pass_name}: cuflash {r.na['cuflash']}")
        for p in r.check_failed():
            lines.append(f"{r.row} [{r.dist}]: {p}'s output differs from cuflash varlen's by {r.check[p]:.3g}")
    return list(dict.fromkeys(lines))


# ---------------------------------------------------------------------------
# Inputs


@dataclass
class Packed:
    """One row's packed inputs on the device: q (total, H, D), k, v (total, Hkv, D), dout like q; offsets on the
    device (int32 CuPy) and on the host."""

    lengths: np.ndarray
    offsets: np.ndarray
    cu: object
    max_len: int
    q: object
    k: object
    v: object
    dout: object

    @property
    def total(self) -> int:
        return int(self.offsets[-1])


def packed_inputs(row: VarlenRow, dist: str, seed: int = INPUT_SEED) -> Packed:
    """The row's packed inputs on ``dist``: sequence b drawn alone by ``make_inputs`` (one sequence of its length,
    seed ``seed + b``: with "sink" each sequence has its own sink at its first key), then packed; dout N(0, 1)."""
    import cupy

    from .distributions import make_inputs

    lengths = row.lengths()
    offs = offsets(lengths)
    total = int(offs[-1])
    q = k = v = None
    for b, n in enumerate(lengths):
        shape = Shape(1, row.heads, int(n), row.head_dim, row.dtype, False,
                      heads_kv=row.heads_kv if row.heads_kv != row.heads else None)
        qb, kb, vb = make_inputs(shape, dist, seed + b)
        if q is None:
            q = cupy.empty((total, row.heads, row.head_dim), dtype=qb.dtype)
            k = cupy.empty((total, row.heads_kv, row.head_dim), dtype=qb.dtype)
            v = cupy.empty_like(k)
        s, e = int(offs[b]), int(offs[b + 1])
        q[s:e], k[s:e], v[s:e] = qb[0], kb[0], vb[0]
        del qb, kb, vb
    dout = cupy.random.RandomState(seed + 10**6).standard_normal(q.shape, dtype=np.float32).astype(q.dtype)
    return Packed(lengths, offs, cupy.asarray(offs), int(lengths.max()), q, k, v, dout)


# ---------------------------------------------------------------------------
# cuflash


def cuflash_varlen_fns(p: Packed, causal: bool, passes=VARLEN_PASSES, check_offsets: bool = False) -> dict:
    """pass -> zero-argument callable running cuflash's varlen API into preallocated outputs ("fwd"; "fwd+bwd":
    forward with lse, then backward); "_out": the forward's output buffer."""
    import cupy

    from . import backward_varlen, forward_varlen

    out = cupy.empty_like(p.q)
    grads = [cupy.empty_like(x) for x in (p.q, p.k, p.v)] if "fwd+bwd" in passes else None
    lay = (p.cu, p.cu, p.max_len, p.max_len)
    fns = {"fwd": lambda: forward_varlen(p.q, p.k, p.v, *lay, causal=causal, out=out, check_offsets=check_offsets)}

    def fwd_bwd():
        o, lse = forward_varlen(p.q, p.k, p.v, *lay, causal=causal, return_lse=True, out=out,
                                check_offsets=check_offsets)
        backward_varlen(p.dout, p.q, p.k, p.v, o, lse, *lay, causal=causal, dq=grads[0], dk=grads[1], dv=grads[2],
                        check_offsets=check_offsets)

    fns["fwd+bwd"] = fwd_bwd
    fns = {k: f for k, f in fns.items() if k in passes}
    fns["_out"] = out
    return fns


def rel_diff(a, b, rows: int = 1 << 15) -> float:
    """||a - b|| / ||b|| (Frobenius; float32 values, float64 sums) of two device arrays of one shape: CuPy arrays
    (bfloat16 included) or torch tensors; inf where the shapes differ, nan where a value is. ``rows`` first-axis
    rows at a time (float32 copies of a whole packed batch would take gigabytes); no cuBLAS needed."""
    import cupy

    def f32(x):
        if not isinstance(x, cupy.ndarray):   # a torch tensor
            return cupy.from_dlpack(x.detach().float().contiguous())
        if x.dtype.itemsize == 2 and x.dtype.kind not in "fiu":   # bfloat16 (ml_dtypes): float32's top 16 bits
            return (cupy.ascontiguousarray(x).view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32)
        return x.astype(cupy.float32)

    if tuple(a.shape) != tuple(b.shape):
        return float("inf")
    num = den = 0.0
    for i in range(0, max(int(a.shape[0]) if a.ndim else 1, 1), rows):
        x, y = (f32(t[i:i + rows] if t.ndim else t) for t in (a, b))
        num += float(((x - y) * (x - y)).sum(dtype=cupy.float64))
        den += float((y * y).sum(dtype=cupy.float64))
    return math.sqrt(num) / max(math.sqrt(den), 1e-30)


def check_sequences(lengths) -> list:
    """The sequences compared with the dense API: the first, the shortest and the longest."""
    lengths = np.asarray(lengths)
    return list(dict.fromkeys([0, int(lengths.argmin()), int(lengths.argmax())]))


def dense_check(p: Packed, out, causal: bool) -> float:
    """The largest relative difference between cuflash's varlen output and its dense forward run on each of
    check_sequences alone."""
    from . import forward

    worst = 0.0
    for b in check_sequences(p.lengths):
        s, e = int(p.offsets[b]), int(p.offsets[b + 1])
        ref = forward(p.q[s:e][None], p.k[s:e][None], p.v[s:e][None], causal=causal)
        worst = max(worst, rel_diff(out[s:e], ref[0]))
    return worst


# ---------------------------------------------------------------------------
# Peers: each adapter returns (builder, None) or (None, why not); a builder
# ``build(row, packed, passes) -> {pass: fn, "_out": output}`` raises when the peer cannot run the row.


def fa4_varlen_adapter():
    """FlashAttention-4's ``flash_attn_varlen_func`` (imported through bench._import_fa4, the path of
    bench_variants.fa4_adapter: $CUFLASH_FA4_PATH), on torch views of the packed arrays."""
    from .bench import fa4_torch

    torch, why = fa4_torch()
    if torch is None:
        return None, why
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001 - an FA4 without the varlen entry point
        return None, f"flash_attn.cute.flash_attn_varlen_func not importable ({_short(e)})"

    def build(row: VarlenRow, p: Packed, passes=VARLEN_PASSES) -> dict:
        from .bench import to_torch, torch_views

        tq, tk, tv = torch_views((p.q, p.k, p.v), requires_grad=True)
        tdout = to_torch(p.dout)
        tcu = to_torch(p.cu)
        kw = dict(cu_seqlens_q=tcu, cu_seqlens_k=tcu, max_seqlen_q=p.max_len, max_seqlen_k=p.max_len,
                  causal=row.causal)

        def call():
            res = flash_attn_varlen_func(tq, tk, tv, **kw)
            return res[0] if isinstance(res, (tuple, list)) else res

        def fwd():
            with torch.no_grad():
                return call()

        out = fwd()   # raises here if FA4 cannot run it (and compiles)
        fns = {"fwd": fwd, "_out": out}
        if "fwd+bwd" in passes:
            def fwd_bwd():
                return torch.autograd.grad(call(), (tq, tk, tv), tdout)
            try:
                fwd_bwd()
                fns["fwd+bwd"] = fwd_bwd
            except Exception as e:  # noqa: BLE001 - the forward still counts
                fns["_why"] = {"fwd+bwd": _short(e)}
        return fns

    return build, None


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def cudnn_ragged_adapter():
    """cuDNN's SDPA on the ragged (THD) layout through cudnn-frontend's graph API (``pip install
    nvidia-cudnn-frontend``; the cuDNN that PyTorch loads), on torch views of the packed arrays, on CuPy's
    current stream. As cudnn-frontend's own tests (test/python/test_mhas.py, ragged) build it: Q, K, V, O (and
    dO, dQ, dK, dV) declared (B, H, max_len, D) with BSHD strides and a ragged offset tensor (B + 1, 1, 1, 1) of
    element offsets (sequence starts x H x D; int64 from cuDNN 9.6, int32 before); ``seq_len_q`` / ``seq_len_kv``
    int32 (B, 1, 1, 1) with ``use_padding_mask=True``; the softmax stats padded, (B, H, max_len, 1) float32;
    the backward's ``max_total_seq_len_q/kv`` the totals rounded up to 64. Causal: the top-left diagonal band
    with right bound 0, the same as bottom-right here (every sequence has as many queries as keys)."""
    try:
        import torch
        import cudnn
    except Exception as e:  # noqa: BLE001 - both optional
        return None, f"cudnn-frontend not importable ({_short(e)}; pip install nvidia-cudnn-frontend)"
    if not torch.cuda.is_available():
        return None, "PyTorch has no CUDA device"

    def build(row: VarlenRow, p: Packed, passes=VARLEN_PASSES) -> dict:
        import cupy

        from .bench import to_torch

        b, hq, hkv, d, s = len(p.lengths), row.heads, row.heads_kv, row.head_dim, p.max_len
        io = {"bfloat16": cudnn.data_type.BFLOAT16, "float16": cudnn.data_type.HALF}[row.dtype]
        f32, i32 = cudnn.data_type.FLOAT, cudnn.data_type.INT32
        wide = int(cudnn.backend_version()) >= 90600
        off_type, off_torch = (cudnn.data_type.INT64, torch.int64) if wide else (i32, torch.int32)
        tq, tk, tv, tdo = (to_torch(x) for x in (p.q, p.k, p.v, p.dout))
        dev = tq.device
        to = torch.empty_like(tq)
        grads = [torch.empty_like(t) for t in (tq, tk, tv)]
        stats = torch.empty(b, hq, s, 1, dtype=torch.float32, device=dev)
        starts = p.offsets.astype(np.int64)
        off_q = torch.tensor(starts * hq * d, dtype=off_torch, device=dev).reshape(b + 1, 1, 1, 1)
        off_kv = torch.tensor(starts * hkv * d, dtype=off_torch, device=dev).reshape(b + 1, 1, 1, 1)
        lens = torch.tensor(p.lengths.astype(np.int32), dtype=torch.int32, device=dev).reshape(b, 1, 1, 1)
        handle = cudnn.create_handle()
        cudnn.set_stream(handle=handle, stream=cupy.cuda.get_current_stream().ptr)
        scale = 1.0 / math.sqrt(d)
        mask = {}
        if row.causal:
            mask = {"diagonal_alignment": cudnn.diagonal_alignment.TOP_LEFT, "diagonal_band_right_bound": 0}

        def new_graph():
            return cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=handle)

        def small(g, name, n, dtype, value, pack):
            t = g.tensor(name=name, dim=[n, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dtype)
            pack[t] = value
            return t

        def ragged(g, name, h, offset, value, pack):
            """A packed (total, h, d) array as cuDNN's (B, h, max_len, d) with BSHD strides and ragged offsets."""
            t = g.tensor(name=name, dim=[b, h, s, d], stride=[s * h * d, d, h * d, 1], data_type=io)
            t.set_ragged_offset(offset)
            pack[t] = value
            return t

        def ragged_output(t, h, offset, value, pack):
            t.set_output(True).set_dim([b, h, s, d]).set_stride([s * h * d, d, h * d, 1]).set_data_type(io)
            t.set_ragged_offset(offset)
            pack[t] = value

        def lengths(g, pack):
            return {"use_padding_mask": True, "seq_len_q": small(g, "seq_len_q", b, i32, lens, pack),
                    "seq_len_kv": small(g, "seq_len_kv", b, i32, lens, pack)}

        def plan(g):
            g.validate()
            g.build_operation_graph()
            g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            g.check_support()
            g.build_plans()
            return torch.empty(max(1, g.get_workspace_size()), dtype=torch.uint8, device=dev)

        def inputs(g, pack):
            """The ragged offsets (o, q, k, v) and the q, k, v tensors of a new graph."""
            rq = small(g, "ragged_q", b + 1, off_type, off_q, pack)
            rk = small(g, "ragged_k", b + 1, off_type, off_kv, pack)
            rv = small(g, "ragged_v", b + 1, off_type, off_kv, pack)
            ro = small(g, "ragged_o", b + 1, off_type, off_q, pack)
            return (ro, rq, rk, rv), (ragged(g, "q", hq, rq, tq, pack), ragged(g, "k", hkv, rk, tk, pack),
                                      ragged(g, "v", hkv, rv, tv, pack))

        def forward_graph(gen_stats):
            g, pack = new_graph(), {}
            (ro, _, _, _), (cq, ck, cv) = inputs(g, pack)
            kw = dict(name="sdpa", q=cq, k=ck, v=cv, attn_scale=scale, **lengths(g, pack), **mask)
            try:
                o, st = g.sdpa(**kw, generate_stats=gen_stats)
            except TypeError:   # releases before generate_stats took is_inference
                o, st = g.sdpa(**kw, is_inference=not gen_stats)
            ragged_output(o, hq, ro, to, pack)
            if gen_stats:
                st.set_output(True).set_dim([b, hq, s, 1]).set_stride([hq * s, s, 1, 1]).set_data_type(f32)
                pack[st] = stats
            ws = plan(g)
            return lambda: g.execute(pack, ws, handle=handle)

        def training():
            """The training forward (stats) and the backward, as one call."""
            fwd_train = forward_graph(True)
            g, pack = new_graph(), {}
            (ro, rq, rk, rv), (cq, ck, cv) = inputs(g, pack)
            co, cdo = ragged(g, "o", hq, ro, to, pack), ragged(g, "dO", hq, ro, tdo, pack)
            cst = g.tensor(name="stats", dim=[b, hq, s, 1], stride=[hq * s, s, 1, 1], data_type=f32)
            pack[cst] = stats
            kw = dict(name="sdpa_backward", q=cq, k=ck, v=cv, o=co, dO=cdo, stats=cst, attn_scale=scale,
                      **lengths(g, pack), **mask)
            total = p.total
            try:
                dq, dk, dv = g.sdpa_backward(**kw, max_total_seq_len_q=round_up(total, 64),
                                             max_total_seq_len_kv=round_up(total, 64))
            except TypeError:   # releases without the workspace bounds
                dq, dk, dv = g.sdpa_backward(**kw)
            for t, h, r, buf in ((dq, hq, rq, grads[0]), (dk, hkv, rk, grads[1]), (dv, hkv, rv, grads[2])):
                ragged_output(t, h, r, buf, pack)
            ws = plan(g)

            def fwd_bwd():
                fwd_train()
                g.execute(pack, ws, handle=handle)
            fwd_bwd()
            return fwd_bwd

        fwd_infer = forward_graph(False)
        fwd_infer()
        fns = {"fwd": fwd_infer, "_out": to}
        if "fwd+bwd" in passes:
            try:
                fns["fwd+bwd"] = training()
            except Exception as e:  # noqa: BLE001 - the forward still counts
                fns["_why"] = {"fwd+bwd": _short(e)}
        return fns

    return build, None


def peer_adapters() -> dict:
    """name -> (builder or None, why not)."""
    out = {}
    for name, make in (("fa4", fa4_varlen_adapter), ("cudnn", cudnn_ragged_adapter)):
        try:
            out[name] = make()
        except Exception as e:  # noqa: BLE001 - a broken install must not stop the run
            out[name] = (None, _short(e))
    return out


# ---------------------------------------------------------------------------
# The benchmark


def benchmark_case(row: VarlenRow, dist: str, *, repeats: int = DEFAULT_REPEATS, warmup: int = DEFAULT_WARMUP,
                   backward: bool = True, adapters: Optional[dict] = None,
                   log: Callable[[str], None] = print) -> list:
    """The VarlenResults (one per pass) of one row on one distribution: cuflash varlen, cuflash dense at the mean
    length, and the peers of ``adapters`` (name -> (builder, why not); default: peer_adapters()), each pass's
    implementations interleaved sample by sample; then the offset check's overhead on the forward."""
    from .bench import cuflash_pass_fns, random_inputs
    from .distributions import make_inputs

    if adapters is None:
        adapters = peer_adapters()
    passes = VARLEN_PASSES if backward else ("fwd",)
    w = work(row)
    desc = describe(row)
    results = {ps: VarlenResult(row.name, row.label(), dist, ps, w, desc=desc) for ps in passes}

    def na(impl, reason):
        for r in results.values():
            r.na[impl] = reason

    def note(text):
        for r in results.values():
            r.notes.append(text)

    fns, outs = {}, {}
    try:
        p = packed_inputs(row, dist)
    except Exception as e:  # noqa: BLE001 - no inputs (out of memory, say): the row fails, the run goes on
        na("cuflash", f"FAILED to draw the inputs: {_short(e)}")
        log(f"  FAILED inputs {row.name} [{dist}]: {_short(e)}")
        free_memory()
        return list(results.values())
    try:
        built = cuflash_varlen_fns(p, row.causal, passes)
        for ps in passes:
            built[ps]()
        _sync()   # an asynchronous launch failure shows here, not in the timing
        outs["cuflash"] = built.pop("_out")
        fns.update({("cuflash", ps): f for ps, f in built.items()})
    except Exception as e:  # noqa: BLE001 - reported, and the run fails
        na("cuflash", f"FAILED {_short(e)}")
        log(f"  FAILED cuflash varlen {row.name} [{dist}]: {_short(e)}")
    dshape = row.dense_shape()
    try:
        dq, dk, dv = make_inputs(dshape, dist, INPUT_SEED)
        ddout = random_inputs(dshape, seed=1)[0]
        built = cuflash_pass_fns(dq, dk, dv, row.causal, ddout, passes=passes)
        for f in built.values():
            f()
        fns.update({("dense", ps): f for ps, f in built.items()})
    except Exception as e:  # noqa: BLE001 - reported (no ratio to dense then)
        na("dense", f"FAILED {_short(e)}")
        log(f"  FAILED cuflash dense {dshape.label()} [{dist}]: {_short(e)}")
    for name in PEERS:
        build, why = adapters.get(name, (None, "not run"))
        if build is None:
            na(name, why)
            continue
        try:
            built = build(row, p, passes)
        except Exception as e:  # noqa: BLE001 - FA4 DSL / assertion errors, cuDNN not-supported errors
            na(name, _short(e))
            log(f"  {name} n/a on {row.name} [{dist}]: {_short(e)}")
            continue
        outs[name] = built.pop("_out")
        why = built.pop("_why", {})
        fns.update({(name, ps): f for ps, f in built.items() if ps in passes})
        for ps in passes:
            if (name, ps) not in fns:
                results[ps].na[name] = why.get(ps, "this pass did not build")
    if "cuflash" in outs:   # the same call? (the peers' forward outputs, and the dense API on a few sequences)
        checks = {}
        for name in outs:
            if name != "cuflash":
                try:
                    checks[name] = rel_diff(outs[name], outs["cuflash"])
                except Exception as e:  # noqa: BLE001
                    note(f"{name}'s output could not be compared: {_short(e)}")
        try:
            checks["dense"] = dense_check(p, outs["cuflash"], row.causal)
        except Exception as e:  # noqa: BLE001
            note(f"dense per-sequence check failed to run: {_short(e)}")
        for r in results.values():
            r.check.update(checks)
        for name, diff in checks.items():
            if not diff <= CHECK_BOUND:
                log(f"  MISMATCH {row.name} [{dist}]: {name}'s forward differs from cuflash varlen's by {diff:.3g} "
                    f"(bound {CHECK_BOUND})")
    outs.clear()
    for ps in passes:
        results[ps].ms.update(_time_pass({impl: f for (impl, pp), f in fns.items() if pp == ps}, results[ps],
                                         warmup, repeats, log))
    if ("cuflash", "fwd") in fns and "cuflash" in results["fwd"].ms:
        # the offset check (a device-to-host copy and a wait for the queue), timed apart from the rest
        from .bench import time_interleaved

        try:
            checked = cuflash_varlen_fns(p, row.causal, ("fwd",), check_offsets=True)
            checked.pop("_out")
            results["fwd"].ms.update(time_interleaved(
                {"cuflash_unchecked": fns[("cuflash", "fwd")], "cuflash_checked": checked["fwd"]},
                warmup=1, repeats=max(3, repeats // 2)))
        except Exception as e:  # noqa: BLE001 - not the bar's figure: noted, not failed
            results["fwd"].na["cuflash_checked"] = f"timing failed: {_short(e)}"
    del fns, p
    free_memory()
    return list(results.values())


def _sync() -> None:
    import cupy

    cupy.cuda.get_current_stream().synchronize()


def _time_pass(fns: dict, result: VarlenResult, warmup: int, repeats: int, log) -> dict:
    """impl -> median ms of ``fns`` (impl -> callable), interleaved (bench.time_interleaved_or_alone: where a call
    raises during the timing, each implementation is timed alone instead and the one that raises is recorded in
    ``result.na``, FAILED for cuflash and dense)."""
    from .bench import time_interleaved_or_alone

    return time_interleaved_or_alone(fns, result, warmup=warmup, repeats=repeats, log=log,
                                     what=f"{result.row} [{result.dist}] {result.pass_name}",
                                     fatal=("cuflash", "dense"))


def benchmark_varlen(rows, dists, *, repeats: int = DEFAULT_REPEATS, warmup: int = DEFAULT_WARMUP,
                     backward: bool = True, adapters: Optional[dict] = None,
                     log: Callable[[str], None] = print) -> list:
    """VarlenResults for every row x distribution x pass, a progress line per row and distribution."""
    if adapters is None:
        adapters = peer_adapters()

    def case(row, dist):
        return benchmark_case(row, dist, repeats=repeats, warmup=warmup, backward=backward, adapters=adapters,
                              log=log)

    def failed(row, dist, why):
        return [VarlenResult(row.name, row.label(), dist, ps, work(row), desc=describe(row),
                             na={"cuflash": f"FAILED (the case raised) {why}"})
                for ps in (VARLEN_PASSES if backward else ("fwd",))]

    def progress(row, dist, res):
        return f"  {row.name:<18} {dist:<10} | " + " | ".join(
            f"{r.pass_name} {_ms(r.ms.get('cuflash'))} ms {_tf(r.tflops())} TF/s x dense {_ratio(r.vs_dense())} "
            f"x peer {_ratio(r.vs_peer())}" for r in res)

    return run_grid(rows, dists, case, failed, progress, log, free_memory)


# ---------------------------------------------------------------------------
# Tables


TABLE_HEAD = ("row", "dist", "pass", "cuflash ms", "cuflash TF/s", "dense ms", "dense TF/s", "varlen/dense",
              "fa4 ms", "fa4 TF/s", "cuflash/fa4", "cudnn ms", "cudnn TF/s", "cuflash/cudnn", "bar")


def _cells(r: VarlenResult) -> list:
    def timed(impl):
        if r.ms.get(impl):
            return _ms(r.ms[impl]) + (" (differs)" if impl in r.check_failed() else "")
        return "FAILED" if str(r.na.get(impl, "")).startswith("FAILED") else ("n/a" if impl in r.na else "-")

    return [r.row, r.dist, r.pass_name, timed("cuflash"), _tf(r.tflops("cuflash")), timed("dense"),
            _tf(r.tflops("dense")), _ratio(r.vs_dense()), timed("fa4"), _tf(r.tflops("fa4")), _ratio(r.vs("fa4")),
            timed("cudnn"), _tf(r.tflops("cudnn")), _ratio(r.vs("cudnn")), r.bar()]


CONVENTIONS = ("TF/s: useful FLOPs (4 x D x H x the visible query-key pairs summed over the sequences; causal "
               "bottom-right aligned, n (n + 1) / 2 pairs per sequence; forward+backward 3.5x forward) per second; "
               "the dense call's over its own pairs. varlen/dense: cuflash varlen's TF/s / cuflash dense's "
               f"(bar >= {BAR_DENSE:.2f}); cuflash/fa4, cuflash/cudnn: the peer's time / cuflash varlen's on the "
               f"same packed inputs (> 1: cuflash faster; bar >= {BAR_PEER:.2f} against the faster). Medians of "
               "interleaved, L2-flushed samples; cuflash varlen with check_offsets=False (its overhead below).")


def describe(row: VarlenRow) -> str:
    """The row's shape, lengths and dense call, in a line."""
    ls = row.lengths()
    return (f"{row.label()}; {len(ls)} lengths ~U[{row.min_len}, {row.max_len}] seed {row.seed}: min {ls.min()}, "
            f"mean {ls.mean():.1f}, max {ls.max()}, {ls.sum()} tokens; dense {row.dense_shape().label()} "
            f"({row.batch * row.mean_len()} tokens)")


def _descriptions(results) -> list:
    """One line per row: its lengths, the dense call and the FLOPs."""
    table = {}
    for r in results:
        table.setdefault(r.row, r)
    return [f"{name}: {r.desc or r.label}; pairs per head {r.work.pairs} (dense {r.work.dense_pairs}); forward "
            f"{r.work.useful_flops / 1e12:.3f} TFLOP (dense {r.work.dense_flops / 1e12:.3f})"
            for name, r in table.items()]


def _checks_and_notes(results) -> list:
    lines = {}
    passes_of = {}   # row -> the passes it ran
    why_passes = {}  # (row, impl, why) -> the passes it was given for
    for r in results:
        passes_of.setdefault(r.row, set()).add(r.pass_name)
        for impl, why in r.na.items():
            why_passes.setdefault((r.row, impl, why), set()).add(r.pass_name)
    for (row, impl, why), ps in why_passes.items():
        which = "" if ps == passes_of[row] else f" ({', '.join(sorted(ps))})"
        lines.setdefault(f"{row}: {impl} n/a{which}: {why}", None)
    for r in results:
        if r.check:
            parts = ", ".join(f"{k} {v:.2e}{' DIFFERS' if not v <= CHECK_BOUND else ''}" for k, v in r.check.items())
            lines.setdefault(f"{r.row} [{r.dist}]: forward vs cuflash varlen (rel. Frobenius, bound {CHECK_BOUND}): "
                             f"{parts}", None)
        ov = r.check_overhead()
        if ov is not None:
            base = r.ms["cuflash_unchecked"]
            lines.setdefault(f"{r.row} [{r.dist}]: check_offsets=True forward {_ms(r.ms['cuflash_checked'])} ms vs "
                             f"{_ms(base)} ms unchecked: {ov:+.3f} ms ({100 * ov / base:+.1f} %)", None)
        for n in r.notes:
            lines.setdefault(f"{r.row} [{r.dist}]: {n}", None)
    return list(lines)


def format_table(results) -> str:
    return text_report(TABLE_HEAD, [_cells(r) for r in results], {0, 1, 2, len(TABLE_HEAD) - 1},
                       _descriptions(results), "checks, overheads and n/a:", _checks_and_notes(results), CONVENTIONS)


def markdown_table(results, header: str = "") -> str:
    return markdown_report(TABLE_HEAD, [_cells(r) for r in results], _descriptions(results),
                           "Checks, overheads and n/a:", _checks_and_notes(results), CONVENTIONS, header)


# ---------------------------------------------------------------------------
# Run metadata


def peer_versions() -> str:
    """FA4's and cudnn-frontend's versions (or why not), for the header."""
    parts = [fa4_version()]
    try:
        import cudnn

        parts.append(f"cudnn-frontend {getattr(cudnn, '__version__', '?')} (cuDNN {cudnn.backend_version()})")
    except Exception as e:  # noqa: BLE001
        parts.append(f"cudnn-frontend not importable ({_short(e)})")
    return "; ".join(parts)


def header(device: str, cc: int, repeats: int, warmup: int) -> str:
    return run_header("varlen table (issue #43)", device, cc, [peer_versions()], warmup, repeats)


# ---------------------------------------------------------------------------
# Kernels to compile ahead (dev/precompile.py varlen_bench)


def varlen_bwd_backends() -> tuple:
    """The backends the varlen backward's plan may take: the default (None) and every backend that
    cuflash.api._launch_bwd_varlen names (read from its source: "sm80", forced or as the fallback where the Hopper
    kernel cannot address the inputs); "sm80" where the source cannot be read."""
    try:
        import inspect

        from . import api

        found = re.findall(r"""["'](sm\d+\w*)["']""", inspect.getsource(api._launch_bwd_varlen))
    except Exception:  # noqa: BLE001 - no source (a frozen install) or a renamed function
        found = ["sm80"]
    return tuple(dict.fromkeys([None] + found))


def kernel_configs(cc: int, rows=None) -> list:
    """The KernelConfigs the rows may take: the varlen forward (MaskVariant(varlen=True)) and backward (on
    varlen_bwd_backends), the dense forward and backward at the mean length; both length classes of each,
    deduplicated."""
    from . import heuristics
    from .variants import MaskVariant

    rows = rows_by_name(DEFAULT_ROWS) if rows is None else rows
    out = {}
    for row in rows:
        for mv, backends in ((MaskVariant(varlen=True), varlen_bwd_backends()), (MaskVariant(), (None,))):
            for short in (False, True):
                for long_seqs in (False, True):
                    cfg = heuristics.fwd_config(row.dtype, row.head_dim, row.causal, cc, short=short,
                                                long_seqs=long_seqs, variant=mv)
                    out[cfg.key()] = cfg
                for backend in backends:
                    for cfg in heuristics.bwd_configs(row.dtype, row.head_dim, row.causal, cc, backend=backend,
                                                      short=short, variant=mv).all():
                        out[cfg.key()] = cfg
    return list(out.values())


# ---------------------------------------------------------------------------
# python -m cuflash --varlen


def rows_from_args(names, shape: Optional[str]) -> list:
    """The rows named, with the ``--varlen-shape`` overrides applied (ValueError on a bad name or shape)."""
    rows = rows_by_name(names)
    if shape:
        over = parse_overrides(shape)
        rows = [apply_overrides(r, over) for r in rows]
    return rows


def run(args, device: str, cc: int) -> int:
    """The varlen table: printed (and as Markdown, JSON); 1 if cuflash failed a call or an output differs."""
    from .bench_report import git_commit

    rows = rows_from_args(args.varlen_rows, args.varlen_shape)
    head = header(device, cc, args.repeats, args.warmup)
    print(head)
    print(f"rows: {', '.join(r.name + ' (' + r.label() + ')' for r in rows)} x {', '.join(args.varlen_dists)}")
    adapters = peer_adapters()
    for name, (build, why) in adapters.items():
        print(f"  {name}: {'found' if build else why}")
    results = benchmark_varlen(rows, args.varlen_dists, repeats=args.repeats, warmup=args.warmup,
                               backward=not args.forward_only, adapters=adapters)

    def doc():
        return {"header": head, "device": device, "cc": cc, "commit": git_commit(),
                "rows": [{"name": r.name, "label": r.label(), "lengths": r.lengths().tolist(),
                          "dense": r.dense_shape().label()} for r in rows],
                "dists": list(args.varlen_dists), "results": [r.to_json() for r in results]}

    return print_results(args, format_table(results), lambda: markdown_table(results, head), doc, failures(results))
