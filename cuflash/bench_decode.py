"""The decode table of ``python -m cuflash --decode`` (issue #44's bar).

The bar: decode (seqlen_q = 1, bf16, D = 128, 32 query heads, 8 KV heads) for batch 1, 8, 64 and cache lengths 4k,
32k, 128k, paged (page 64) and contiguous, as achieved bandwidth (bytes of K/V read / time) beside the measured copy
bandwidth, PyTorch SDPA, FlashInfer and FlashAttention-4 where they run: at least 85 % of the copy bandwidth at
batch >= 8 with 32k+ caches, at least 70 % at batch 1 with 128k, and ahead of every peer measured.

Each row (:class:`DecodeRow`) is one decode step: q ``(batch, 1, 32, 128)`` against a K/V cache of ``cache_len``
tokens per sequence, every sequence at the full length (``cache_seqlens = cache_len``), or, for the optional
``-ragged`` rows, lengths drawn uniformly in [cache_len / 2, cache_len] (``np.random.default_rng(SEED)``). Layouts:

- ``contiguous``: k_cache, v_cache ``(batch, cache_len, 8, 128)``;
- ``paged64``: k_cache, v_cache ``(batch * cache_len / 64, 64, 8, 128)`` pages with a ``block_table`` that is a
  random permutation of the pages (``np.random.default_rng(SEED).permutation``): page j of sequence b holds what
  the contiguous cache holds at tokens 64 j ... 64 j + 63 of sequence b.

Inputs per sequence b: ``cuflash.distributions.make_inputs`` of one sequence (seed ``INPUT_SEED + b``) on each score
distribution (default ``normal`` and ``mixed``: KV head j drawn as the j % 5-th of normal, outlier8, outlier12, sharp,
sink, the closest to a trained layer), so with ``sink`` every sequence has its own sink at its first key.

Implementations, each on the same device memory (DLPack views, no copies):

- ``cuflash``: ``cuflash.forward_kvcache(q, k_cache, v_cache, cache_seqlens=..., block_table=..., num_splits=0)``;
- ``sdpa``: PyTorch's ``scaled_dot_product_attention`` with each of its flash, cuDNN and memory-efficient backends
  (the math backend is left out: it would materialise the repeated K/V), each in two forms: GQA through
  ``enable_gqa=True`` (where the installed torch lacks it: the KV heads ``repeat_interleave``-d once outside the timing,
  and said so), and the 4 query heads of a KV head as 4 query rows of an MHA call over the 8 KV heads (exact for one
  query token, non-causal; reads the same bytes). The column gives the fastest that matches the reference; the notes
  say which. SDPA cannot read pages: on the paged rows it reads the contiguous cache of the same values, marked
  "(c)". On the ragged rows it takes a boolean mask over the full cache;
- ``flashinfer``: ``flashinfer.BatchDecodeWithPagedKVCacheWrapper`` (NHD, ``use_tensor_cores`` False and True, the
  faster shown) where ``import flashinfer`` works: the paged rows on the same pages and block table, the contiguous
  rows on the contiguous cache read as in-order pages of 64 (the same memory);
- ``fa4``: FlashAttention-4 (``flash_attn.cute``, $CUFLASH_FA4_PATH) where it imports: ``flash_attn_varlen_func`` with
  ``page_table`` and ``seqused_k`` on the paged rows, ``flash_attn_func`` (``flash_attn_varlen_func`` with ``seqused_k``
  when ragged) on the contiguous ones, ``num_splits=0`` (its own heuristic), else 1. Where it does not take pages
  (its sm90 path does not) it reads the contiguous cache, marked "(c)".

A peer that does not import, does not build or raises gets "n/a" with the reason; it never stops the run.

Bytes counted (:func:`decode_bytes`): the K and V bytes the call has to read, sum over the batch of cache_seqlens x
heads_kv x (D + Dv) x 2, plus q's and out's bytes; GB/s = those bytes / the median time (1 GB = 1e9 bytes), the same
bytes for every implementation. The copy bandwidth (:func:`copy_bandwidth`) is measured in the same process before the
rows: a device-to-device ``cudaMemcpyAsync`` and an elementwise CuPy copy of a 1 GiB buffer, bytes read + written /
the median time; the faster of the two is the reference of "% of copy".

Before timing, each row's output is compared on the first and the last sequence with a float32 CuPy computation of
attention over that sequence's cache (:func:`reference_decode`; for the paged rows read back through the block table):
cuflash above :data:`CHECK_BOUND` (relative Frobenius) is a failing row ("FAIL" in the check column, and the run
fails); a peer configuration above it is "differs" and left out of the ratios.

Rows whose K/V cache would take more than :data:`MEMORY_FRACTION` of the free device memory are skipped (said so in
the table): the paged rows keep the contiguous cache beside the pages for the peers and the reference, so a row takes
up to twice its cache.

Timings: the implementations of one row sample by sample in turn (bench.time_interleaved: the L2 cache flushed before
each sample), the median of ``repeats`` samples after ``warmup`` calls of each.
"""
from __future__ import annotations

import fnmatch
import math
import re
import sys
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from .bench import Shape, fa4_torch, free_memory, torch_cuda
from .bench_report import fa4_version, markdown_report, print_results, run_header, text_report
from .bench_variants import _ratio, _short

SEED = 44                          # block tables and ragged lengths (issue #44)
INPUT_SEED = 0                     # sequence b's inputs: make_inputs(..., seed=INPUT_SEED + b)
HEADS_Q, HEADS_KV, HEAD_DIM, DTYPE = 32, 8, 128, "bfloat16"
ITEMSIZE = 2                       # bytes per bf16 element
PAGE_SIZE = 64
BATCHES = (1, 8, 64)
CACHE_LENS = (4096, 32768, 131072)
LAYOUTS = ("contiguous", f"paged{PAGE_SIZE}")
DEFAULT_DISTS = ("normal", "mixed")
QUICK_DISTS = ("normal",)
DEFAULT_REPEATS, DEFAULT_WARMUP = 30, 5
MEMORY_FRACTION = 0.40             # skip a row whose K/V cache exceeds this share of the free device memory
COPY_BYTES = 1 << 30               # the copy-bandwidth buffer (read and written once per copy)
COPY_REPEATS = 20
CHECK_BOUND = 2e-2                 # relative Frobenius error against the float32 reference (bf16 output)
BAR_COPY_LARGE = 0.85              # batch >= 8, cache >= 32k: at least 85 % of the copy bandwidth
BAR_COPY_B1 = 0.70                 # batch 1, cache 128k: at least 70 %
BAR_PEER = 1.0                     # and ahead of every peer measured (peer time / cuflash time > 1)
PEERS = ("sdpa", "flashinfer", "fa4")
PEER_NAMES = {"sdpa": "SDPA", "flashinfer": "FlashInfer", "fa4": "FA4"}
FLASHINFER_WORKSPACE = 128 << 20


# ---------------------------------------------------------------------------
# Rows


def len_label(n: int) -> str:
    """4096 -> "4k", 131072 -> "128k"; other lengths as they are."""
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def page_size_of(layout: str) -> Optional[int]:
    """"paged64" -> 64, "contiguous" -> None; ValueError for anything else."""
    if layout == "contiguous":
        return None
    m = re.fullmatch(r"paged(\d+)", layout)
    if not m or int(m.group(1)) < 1:
        raise ValueError(f"layout must be 'contiguous' or 'paged<N>', got {layout!r}")
    return int(m.group(1))


def draw_lengths(batch: int, cache_len: int, ragged: bool, seed: int = SEED) -> np.ndarray:
    """int32 ``(batch,)`` cache_seqlens: all ``cache_len``, or (ragged) uniform in [cache_len // 2, cache_len], both
    included, a function of the seed alone (``np.random.default_rng(seed).integers``)."""
    if batch < 1 or cache_len < 1:
        raise ValueError(f"need batch >= 1 and cache_len >= 1, got batch={batch} cache_len={cache_len}")
    if not ragged:
        return np.full(batch, cache_len, dtype=np.int32)
    lo = max(1, cache_len // 2)
    return np.random.default_rng(seed).integers(lo, cache_len + 1, batch).astype(np.int32)


@dataclass(frozen=True)
class DecodeRow:
    """One decode step: ``batch`` sequences, one query token each, against a cache of ``cache_len`` tokens."""

    batch: int
    cache_len: int
    layout: str = "contiguous"
    ragged: bool = False
    heads: int = HEADS_Q
    heads_kv: int = HEADS_KV
    head_dim: int = HEAD_DIM
    dtype: str = DTYPE
    seed: int = SEED

    def __post_init__(self):
        p = page_size_of(self.layout)
        if self.heads < 1 or self.heads_kv < 1 or self.heads % self.heads_kv:
            raise ValueError(f"heads ({self.heads}) must be a positive multiple of heads_kv ({self.heads_kv})")
        if p is not None and self.cache_len % p:
            raise ValueError(f"a paged cache length must be a multiple of the page size: {self.cache_len} % {p}")
        draw_lengths(self.batch, self.cache_len, self.ragged, self.seed)   # the ValueError for bad sizes

    @property
    def name(self) -> str:
        return f"b{self.batch}-{len_label(self.cache_len)}-{self.layout}" + ("-ragged" if self.ragged else "")

    @property
    def page_size(self) -> Optional[int]:
        return page_size_of(self.layout)

    @property
    def paged(self) -> bool:
        return self.page_size is not None

    @property
    def head_dim_v(self) -> int:
        return self.head_dim

    @property
    def blocks_per_seq(self) -> int:
        """Pages per sequence (the block table's width); the contiguous cache read as pages of PAGE_SIZE."""
        p = self.page_size or PAGE_SIZE
        return -(-self.cache_len // p)

    def lengths(self) -> np.ndarray:
        return draw_lengths(self.batch, self.cache_len, self.ragged, self.seed)

    def kv_bytes(self) -> int:
        """Bytes of the K/V cache as allocated (every sequence's full capacity, K and V)."""
        return kv_cache_bytes(self.batch, self.cache_len, self.heads_kv, self.head_dim, self.head_dim_v)

    def bytes_read(self) -> int:
        return decode_bytes(self.lengths(), self.heads, self.heads_kv, self.head_dim, self.head_dim_v)

    def bar_fraction(self) -> Optional[float]:
        return bar_copy_fraction(self.batch, self.cache_len, self.ragged)

    def label(self) -> str:
        lens = f"N~U[{self.cache_len // 2},{self.cache_len}]" if self.ragged else f"N={self.cache_len}"
        return (f"B={self.batch} {lens} Hq={self.heads} Hkv={self.heads_kv} D={self.head_dim} {self.dtype} "
                f"{self.layout}")


DECODE_ROWS = tuple(DecodeRow(b, n, layout) for b in BATCHES for n in CACHE_LENS for layout in LAYOUTS)
RAGGED_ROWS = tuple(DecodeRow(b, n, layout, ragged=True) for b in BATCHES for n in CACHE_LENS for layout in LAYOUTS)
ALL_ROWS = DECODE_ROWS + RAGGED_ROWS
ROW_NAMES = tuple(r.name for r in DECODE_ROWS)      # the default: issue #44's 18 rows
ALL_ROW_NAMES = tuple(r.name for r in ALL_ROWS)
DEFAULT_ROWS = ROW_NAMES
QUICK_ROWS = ("b1-128k-contiguous", "b1-128k-paged64", "b8-32k-paged64", "b64-32k-paged64")


def rows_by_name(names) -> list:
    """The rows named, in the order given, each once. A name may be a row's name, a shell pattern over the rows' names
    (``b64-*``, ``*-paged64``; a pattern matches the ragged rows only where it says "ragged": ``*-ragged``,
    ``b8-*-ragged``), or ``default`` (issue #44's 18 rows). ValueError naming what matches no row."""
    table = {r.name: r for r in ALL_ROWS}
    out, bad = [], []
    for name in (str(x).strip() for x in names):
        if not name:
            continue
        if name == "default":
            found = [table[n] for n in DEFAULT_ROWS]
        elif name in table:
            found = [table[name]]
        elif any(c in name for c in "*?["):   # a pattern reaches the ragged rows only where it says "ragged"
            pool = ALL_ROWS if "ragged" in name else DECODE_ROWS
            found = [r for r in pool if fnmatch.fnmatchcase(r.name, name)]
        else:
            found = []
        if not found:
            bad.append(name)
        out += found
    if bad:
        raise ValueError(f"unknown decode row(s) {', '.join(bad)}; choose from {', '.join(ALL_ROW_NAMES)} (or a "
                         "pattern such as b64-*, *-paged64, *-ragged, or default)")
    return list(dict.fromkeys(out))


# ---------------------------------------------------------------------------
# Bytes, bandwidth, memory, bars


def kv_cache_bytes(batch: int, cache_len: int, heads_kv: int, head_dim: int, head_dim_v: Optional[int] = None,
                   itemsize: int = ITEMSIZE) -> int:
    """Bytes of a K/V cache of ``batch`` x ``cache_len`` tokens (K and V together)."""
    dv = head_dim if head_dim_v is None else head_dim_v
    return int(batch) * int(cache_len) * int(heads_kv) * (int(head_dim) + int(dv)) * int(itemsize)


def decode_bytes(lengths, heads_q: int, heads_kv: int, head_dim: int, head_dim_v: Optional[int] = None,
                 seqlen_q: int = 1, itemsize: int = ITEMSIZE) -> int:
    """The bytes a decode call has to move: K and V read (sum over the batch of cache_seqlens x heads_kv x (D + Dv)
    x itemsize) plus q read and out written (batch x seqlen_q x heads_q x D, resp. Dv, x itemsize)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    dv = head_dim if head_dim_v is None else head_dim_v
    kv = int(lengths.sum()) * heads_kv * (head_dim + dv) * itemsize
    qo = len(lengths) * seqlen_q * heads_q * (head_dim + dv) * itemsize
    return int(kv + qo)


def gbps(nbytes: float, ms: Optional[float]) -> Optional[float]:
    """GB/s (1e9 bytes per second) of ``nbytes`` in ``ms`` milliseconds; None without a time."""
    if ms is None or not ms > 0:
        return None
    return nbytes / (ms * 1e-3) / 1e9


def memory_skip(kv_bytes: int, free_bytes: Optional[int], fraction: float = MEMORY_FRACTION) -> Optional[str]:
    """Why a row with a K/V cache of ``kv_bytes`` is skipped on a device with ``free_bytes`` free (more than
    ``fraction`` of it), or None (also when the free memory is unknown)."""
    if free_bytes is None or kv_bytes <= fraction * free_bytes:
        return None
    return (f"K/V cache {kv_bytes / 1e9:.1f} GB > {100 * fraction:.0f} % of the {free_bytes / 1e9:.1f} GB free "
            f"(a paged row keeps the contiguous cache beside its pages)")


def bar_copy_fraction(batch: int, cache_len: int, ragged: bool = False) -> Optional[float]:
    """The share of the copy bandwidth issue #44 asks of a row: 0.85 at batch >= 8 with 32k+ caches, 0.70 at batch 1
    with 128k+, None elsewhere (and on the ragged rows, which the bar does not name)."""
    if ragged:
        return None
    if batch >= 8 and cache_len >= 32768:
        return BAR_COPY_LARGE
    if batch == 1 and cache_len >= 131072:
        return BAR_COPY_B1
    return None


# ---------------------------------------------------------------------------
# Pages and the reference (NumPy or CuPy arrays alike)


def _xp(x):
    if isinstance(x, np.ndarray):
        return np
    import cupy

    return cupy


def page_table(batch: int, blocks_per_seq: int, seed: int = SEED) -> np.ndarray:
    """int32 ``(batch, blocks_per_seq)``: a random permutation of the ``batch * blocks_per_seq`` pages
    (``np.random.default_rng(seed)``), row b listing sequence b's pages in order."""
    perm = np.random.default_rng(seed).permutation(batch * blocks_per_seq)
    return perm.reshape(batch, blocks_per_seq).astype(np.int32)


def in_order_table(batch: int, blocks_per_seq: int) -> np.ndarray:
    """The block table of a contiguous cache read as pages: sequence b's pages b * blocks ... in order."""
    return np.arange(batch * blocks_per_seq, dtype=np.int32).reshape(batch, blocks_per_seq)


def scatter_pages(x, table, page_size: int):
    """A contiguous cache ``x`` ``(batch, N, H, D)`` (N = blocks x page_size) -> pages ``(batch * blocks, page_size,
    H, D)`` with ``pages[table[b, j]] = x[b, j * page_size:(j + 1) * page_size]``. ``table`` a NumPy array (copied to
    the device for CuPy); x a NumPy or CuPy array of a dtype that fancy indexing takes (bfloat16 as its uint16
    view)."""
    xp = _xp(x)
    b, n, h, d = x.shape
    table = np.asarray(table)
    blocks = table.shape[1]
    if table.shape[0] != b or blocks * page_size != n:
        raise ValueError(f"table {table.shape} and page size {page_size} do not cover a cache of shape {x.shape}")
    if sorted(table.reshape(-1).tolist()) != list(range(b * blocks)):
        raise ValueError("the block table must be a permutation of the pages")
    pages = xp.empty((b * blocks, page_size, h, d), dtype=x.dtype)
    idx = xp.asarray(table.reshape(-1).astype(np.int64))
    pages[idx] = x.reshape(b * blocks, page_size, h, d)
    return pages


def gather_pages(pages, table_row, length: int):
    """Sequence ``length`` tokens back from ``pages`` through one block-table row: ``(length, H, D)``."""
    xp = _xp(pages)
    p = pages.shape[1]
    n = -(-int(length) // p)
    idx = xp.asarray(np.asarray(table_row)[:n].astype(np.int64))
    return pages[idx].reshape(n * p, *pages.shape[2:])[:length]


def flashinfer_pages(lengths, table, page_size: int):
    """FlashInfer's page layout of these sequences: (indptr (batch + 1,), indices (sum of pages,), last_page_len
    (batch,)), int32 NumPy: sequence b's ceil(len / page_size) pages are the first entries of ``table[b]``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    table = np.asarray(table)
    counts = -(-lengths // page_size)
    if (counts > table.shape[1]).any() or (lengths < 1).any():
        raise ValueError("every length must be >= 1 and fit its block-table row")
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    indices = np.concatenate([table[b, :c] for b, c in enumerate(counts)]).astype(np.int32)
    last = (lengths - (counts - 1) * page_size).astype(np.int32)
    return indptr, indices, last


def reference_decode(q, k, v, softmax_scale: Optional[float] = None, chunk: int = 16384):
    """Attention of one sequence's query token over its cache, in float32: q ``(Hq, D)``, k ``(L, Hkv, D)``,
    v ``(L, Hkv, Dv)`` float32 (NumPy or CuPy) -> ``(Hq, Dv)``; query head h reads KV head h // (Hq / Hkv). Products
    and sums by broadcasting, ``chunk`` keys at a time (no matmul: CuPy's would need cuBLAS)."""
    xp = _xp(q)
    hq, d = q.shape
    length, hkv, dv = v.shape
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    out = xp.empty((hq, dv), dtype=np.float32)
    for j in range(hkv):
        qg = q[j * g:(j + 1) * g].astype(np.float32) * np.float32(scale)
        s = xp.concatenate([(qg[:, None, :] * k[i:i + chunk, j][None]).sum(-1)
                            for i in range(0, length, chunk)], axis=1)
        p = xp.exp(s - s.max(axis=1, keepdims=True))
        acc = xp.zeros((g, dv), dtype=np.float32)
        for i in range(0, length, chunk):
            acc += (p[:, i:i + chunk, None] * v[i:i + chunk, j][None]).sum(1)
        out[j * g:(j + 1) * g] = acc / p.sum(axis=1, keepdims=True)
    return out


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| (Frobenius, float64 sums) of two float32 arrays of one shape; inf where the shapes differ."""
    if tuple(a.shape) != tuple(b.shape):
        return float("inf")
    num = float(((a - b) * (a - b)).sum(dtype=np.float64))
    den = float((b * b).sum(dtype=np.float64))
    return math.sqrt(num) / max(math.sqrt(den), 1e-30)


def check_sequences(batch: int) -> list:
    """The sequences checked against the reference: the first and the last."""
    return list(dict.fromkeys([0, batch - 1]))


# ---------------------------------------------------------------------------
# Results


@dataclass
class DecodeResult:
    """One row on one distribution."""

    row: str
    batch: int
    cache_len: int
    layout: str
    ragged: bool
    dist: str
    bytes: int
    copy_gbps: Optional[float] = None
    lengths: dict = field(default_factory=dict)    # min, mean, max, total of cache_seqlens
    ms: dict = field(default_factory=dict)         # "cuflash" / "<peer>[:<config>]" -> median ms
    na: dict = field(default_factory=dict)         # impl, peer or config -> why it has no time
    check: dict = field(default_factory=dict)      # "cuflash" / config -> relative error against the reference
    labels: dict = field(default_factory=dict)     # config -> how it ran
    contiguous: list = field(default_factory=list)  # configs that read the contiguous cache on a paged row
    notes: list = field(default_factory=list)
    skipped: Optional[str] = None

    @property
    def bar_fraction(self) -> Optional[float]:
        return bar_copy_fraction(self.batch, self.cache_len, self.ragged)

    def gbps(self, key: str = "cuflash") -> Optional[float]:
        return gbps(self.bytes, self.ms.get(key))

    def copy_fraction(self) -> Optional[float]:
        g = self.gbps()
        return g / self.copy_gbps if g and self.copy_gbps else None

    def check_failed(self) -> list:
        return [k for k, x in self.check.items() if not x <= CHECK_BOUND]

    def cuflash_failed(self) -> bool:
        return "cuflash" in self.check_failed() or str(self.na.get("cuflash", "")).startswith("FAILED")

    def configs(self, peer: str) -> list:
        return [k for k in self.ms if k == peer or k.startswith(peer + ":")]

    def best(self, peer: str) -> Optional[str]:
        """The fastest configuration of ``peer`` that was timed and matches the reference."""
        ok = [k for k in self.configs(peer) if k not in self.check_failed() and self.ms.get(k)]
        return min(ok, key=lambda k: self.ms[k]) if ok else None

    def peer_gbps(self, peer: str) -> Optional[float]:
        k = self.best(peer)
        return self.gbps(k) if k else None

    def vs(self, peer: str) -> Optional[float]:
        """The peer's best time / cuflash's (> 1: cuflash faster); None if either is missing."""
        k = self.best(peer)
        if k is None or not self.ms.get("cuflash") or self.cuflash_failed():
            return None
        return self.ms[k] / self.ms["cuflash"]

    def peer_differs(self, peer: str) -> bool:
        """Every configuration of the peer that ran gave a different output."""
        ran = [k for k in self.check if k == peer or k.startswith(peer + ":")]
        return bool(ran) and all(k in self.check_failed() for k in ran)

    def bar(self) -> str:
        """Issue #44's bar on this row: "met", "NOT met (...)", "FAILED (...)", "skipped" or "-"."""
        if self.skipped:
            return "skipped"
        if self.cuflash_failed():
            why = (f"check {self.check['cuflash']:.1e}" if "cuflash" in self.check_failed()
                   else "cuflash failed")
            return f"FAILED ({why})"
        if not self.ms.get("cuflash"):
            return "-"
        missed = []
        frac, need = self.copy_fraction(), self.bar_fraction
        if need is not None and frac is not None and frac < need:
            missed.append(f"{100 * frac:.0f} % < {100 * need:.0f} % of copy")
        timed = [p for p in PEERS if self.vs(p) is not None]
        for p in timed:
            if not self.vs(p) > BAR_PEER:
                missed.append(f"x {p} {self.vs(p):.2f}")
        if missed:
            return "NOT met (" + "; ".join(missed) + ")"
        if need is None or frac is None:
            return "met (peers)" if timed else "-"
        return "met" if timed else "met (copy; no peer ran)"

    def to_json(self) -> dict:
        return {"row": self.row, "batch": self.batch, "cache_len": self.cache_len, "layout": self.layout,
                "ragged": self.ragged, "dist": self.dist, "bytes": self.bytes, "lengths": self.lengths,
                "copy_gbps": self.copy_gbps, "ms": self.ms, "gbps": {k: self.gbps(k) for k in self.ms},
                "copy_fraction": self.copy_fraction(), "bar_fraction": self.bar_fraction,
                "best": {p: self.best(p) for p in PEERS}, "vs": {p: self.vs(p) for p in PEERS},
                "na": self.na, "check": self.check, "labels": self.labels, "contiguous": self.contiguous,
                "notes": self.notes, "skipped": self.skipped, "bar": self.bar()}


def new_result(row: DecodeRow, dist: str, copy_gbps: Optional[float] = None) -> DecodeResult:
    ls = row.lengths()
    return DecodeResult(row.name, row.batch, row.cache_len, row.layout, row.ragged, dist, row.bytes_read(),
                        copy_gbps=copy_gbps, lengths={"min": int(ls.min()), "mean": float(ls.mean()),
                                                      "max": int(ls.max()), "total": int(ls.sum())})


def failures(results) -> list:
    """What fails the run: cuflash failing a call or its check, a peer whose every output differs."""
    out = []
    for r in results:
        if r.skipped:
            continue
        if str(r.na.get("cuflash", "")).startswith("FAILED"):
            out.append(f"{r.row} [{r.dist}]: cuflash {r.na['cuflash']}")
        if "cuflash" in r.check_failed():
            out.append(f"{r.row} [{r.dist}]: cuflash's output differs from the float32 reference by "
                       f"{r.check['cuflash']:.3g} (bound {CHECK_BOUND})")
        for p in PEERS:
            if r.peer_differs(p):
                worst = min(v for k, v in r.check.items() if k == p or k.startswith(p + ":"))
                out.append(f"{r.row} [{r.dist}]: {p}'s output differs from the float32 reference by {worst:.3g}")
    return list(dict.fromkeys(out))


# ---------------------------------------------------------------------------
# Tables


TABLE_HEAD = ("batch", "cache len", "layout", "dist", "cuflash us", "cuflash GB/s", "% of copy", "copy GB/s",
              "SDPA GB/s", "cuflash/SDPA", "FlashInfer GB/s", "cuflash/FlashInfer", "FA4 GB/s", "cuflash/FA4",
              "check", "bar")


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _cells(r: DecodeResult) -> list:
    layout = r.layout + (" ragged" if r.ragged else "")
    head = [str(r.batch), len_label(r.cache_len), layout, r.dist]
    copy = _num(r.copy_gbps, ".0f")
    if r.skipped:
        return head + ["skipped", "-", "-", copy] + ["-"] * 6 + ["-", "skipped"]

    def peer(p):
        k = r.best(p)
        if k is not None:
            mark = " (c)" if k in r.contiguous else ""
            return [_num(r.gbps(k), ".0f") + mark, _ratio(r.vs(p))]
        if r.peer_differs(p):
            return ["differs", "-"]
        if p in r.na or any(k.startswith(p + ":") for k in r.na):
            return ["n/a", "-"]
        return ["-", "-"]

    if "cuflash" in r.ms:
        us = _num(r.ms["cuflash"] * 1e3, ".1f")
    else:
        us = "FAILED" if str(r.na.get("cuflash", "")).startswith("FAILED") else "-"
    frac = r.copy_fraction()
    err = r.check.get("cuflash")
    check = "-" if err is None else (f"{err:.1e}" if err <= CHECK_BOUND else f"FAIL {err:.1e}")
    return (head + [us, _num(r.gbps(), ".0f"), _num(None if frac is None else 100 * frac, ".1f"), copy]
            + peer("sdpa") + peer("flashinfer") + peer("fa4") + [check, r.bar()])


CONVENTIONS = ("GB/s: the bytes the call has to move (K and V over every sequence's cache_seqlens, plus q and out) "
               "per second, 1 GB = 1e9 bytes, the same bytes for every implementation; % of copy: cuflash's GB/s / "
               "the copy bandwidth measured in this process (the faster of a 1 GiB device-to-device cudaMemcpyAsync "
               "and a CuPy elementwise copy, bytes read + written / time); cuflash/peer: the peer's time / cuflash's "
               "(> 1: cuflash faster), the peer's fastest configuration that matches the reference. (c): the peer read "
               "the contiguous cache of the same values (it cannot read pages). check: cuflash's relative error "
               "against a float32 computation over the first and last sequence's cache (bound "
               f"{CHECK_BOUND}). bar (issue #44): >= {100 * BAR_COPY_LARGE:.0f} % of copy at batch >= 8 with 32k+ "
               f"caches, >= {100 * BAR_COPY_B1:.0f} % at batch 1 with 128k, and ahead of every peer. Medians of "
               "interleaved, L2-flushed samples; cuflash with num_splits=0 (automatic).")


def _notes(results) -> list:
    """One line per reason (a peer's configuration that ran fastest, an n/a, a skip, a check that failed, a note),
    with the rows it applies to: "every row", or the rows named (the first 3 and a count past 4)."""
    grouped = {}

    def add(text, tag):
        grouped.setdefault(text, []).append(tag)

    for r in results:
        tag = f"{r.row} [{r.dist}]"
        if r.skipped:
            add(f"skipped: {r.skipped}", r.row)
            continue
        for key, why in r.na.items():
            add(f"{key} n/a: {why}", r.row)
        for p in PEERS:
            k = r.best(p)
            if k is not None:
                add(f"{p}: fastest was {r.labels.get(k, k)}", r.row)
        bad = [k for k in r.check_failed() if k != "cuflash"]
        if bad:
            add("differs from the reference (left out): " + ", ".join(f"{k} {r.check[k]:.2e}" for k in bad), tag)
        for n in r.notes:
            add(n, tag)
    every = {r.row for r in results}
    lines = []
    for text, tags in grouped.items():
        tags = list(dict.fromkeys(tags))
        if len(every) > 1 and set(tags) == every:
            where = "every row"
        elif len(tags) > 4:
            where = ", ".join(tags[:3]) + f" and {len(tags) - 3} more"
        else:
            where = ", ".join(tags)
        lines.append(f"{where}: {text}")
    return lines


def _descriptions(results) -> list:
    seen = {}
    for r in results:
        if r.row not in seen:
            ls = r.lengths
            seen[r.row] = (f"{r.row}: B={r.batch}, cache_seqlens min {ls.get('min')} mean {ls.get('mean', 0):.0f} "
                           f"max {ls.get('max')}, {r.layout}; {r.bytes / 1e9:.3f} GB moved per call")
    return list(seen.values())


def format_table(results) -> str:
    return text_report(TABLE_HEAD, [_cells(r) for r in results], {2, 3, len(TABLE_HEAD) - 1}, _descriptions(results),
                       "peers, checks, skips and n/a:", _notes(results), CONVENTIONS)


def markdown_table(results, header: str = "") -> str:
    return markdown_report(TABLE_HEAD, [_cells(r) for r in results], _descriptions(results),
                           "Peers, checks, skips and n/a:", _notes(results), CONVENTIONS, header)


# ---------------------------------------------------------------------------
# Device side: copy bandwidth, inputs


def free_bytes() -> Optional[int]:
    """Free device memory in bytes after giving cached blocks back (None where it cannot be read)."""
    try:
        import cupy

        free_memory()
        return int(cupy.cuda.runtime.memGetInfo()[0])
    except Exception:  # noqa: BLE001
        return None


def copy_bandwidth(nbytes: int = COPY_BYTES, repeats: int = COPY_REPEATS, warmup: int = 3) -> dict:
    """The device's copy bandwidth in this process: a ``cudaMemcpyAsync`` device to device and a CuPy elementwise
    copy (``cupy.copyto``, 16-byte elements) of ``nbytes``, timed as the rows are (bench.time_interleaved), GB/s of
    bytes read + written (2 x nbytes) / the median time. {"bytes", "ms", "gbps": {method: GB/s}, "copy_gbps": the
    faster}."""
    import cupy

    from .bench import time_interleaved

    n = nbytes // 16 * 16
    src = cupy.empty(n // 16, dtype=cupy.complex128)
    src.view(cupy.uint8).fill(1)
    dst = cupy.empty_like(src)
    rt = cupy.cuda.runtime
    kind = getattr(rt, "memcpyDeviceToDevice", 3)

    def memcpy():
        rt.memcpyAsync(dst.data.ptr, src.data.ptr, n, kind, cupy.cuda.get_current_stream().ptr)

    def elementwise():
        cupy.copyto(dst, src)

    try:
        ms = time_interleaved({"memcpy": memcpy, "elementwise": elementwise}, warmup=warmup, repeats=repeats)
    finally:
        del src, dst
        free_memory()
    rates = {k: gbps(2 * n, v) for k, v in ms.items()}
    return {"bytes": n, "ms": ms, "gbps": rates, "copy_gbps": max(rates.values())}


@dataclass
class Contiguous:
    """One row group's contiguous inputs on the device: q (B, 1, Hq, D), k, v (B, N, Hkv, D)."""

    q: object
    k: object
    v: object


def draw_inputs(row: DecodeRow, dist: str, seed: int = INPUT_SEED) -> Contiguous:
    """q, k, v of the row on ``dist``: sequence b drawn alone by ``make_inputs`` (one query token against
    ``cache_len`` keys, seed ``seed + b``), so float32 temporaries stay one sequence large."""
    import cupy

    from .distributions import make_inputs

    shape = Shape(1, row.heads, 1, row.head_dim, row.dtype, False,
                  heads_kv=row.heads_kv if row.heads_kv != row.heads else None, seqlen_k=row.cache_len)
    q = k = v = None
    for b in range(row.batch):
        qb, kb, vb = make_inputs(shape, dist, seed + b)
        if q is None:
            q = cupy.empty((row.batch,) + qb.shape[1:], dtype=qb.dtype)
            k = cupy.empty((row.batch,) + kb.shape[1:], dtype=kb.dtype)
            v = cupy.empty((row.batch,) + vb.shape[1:], dtype=vb.dtype)
        q[b], k[b], v[b] = qb[0], kb[0], vb[0]
        del qb, kb, vb
    return Contiguous(q, k, v)


@dataclass
class Prepared:
    """What one row's calls read: the contiguous inputs, cache_seqlens, and (paged rows) the pages and table."""

    row: DecodeRow
    q: object
    k: object
    v: object
    lengths: np.ndarray
    lens_dev: object
    table: Optional[np.ndarray] = None
    table_dev: object = None
    k_pages: object = None
    v_pages: object = None

    def cache(self):
        """The (k_cache, v_cache) cuflash reads: the pages for a paged row, else the contiguous cache."""
        return (self.k_pages, self.v_pages) if self.row.paged else (self.k, self.v)


def _u16(x):
    import cupy

    return x.view(cupy.uint16)


def prepare(row: DecodeRow, inputs: Contiguous) -> Prepared:
    """The row's calls' inputs: cache_seqlens on the device, and for a paged row the pages scattered through a random
    block table (page_table)."""
    import cupy

    lengths = row.lengths()
    p = Prepared(row, inputs.q, inputs.k, inputs.v, lengths, cupy.asarray(lengths))
    if row.paged:
        p.table = page_table(row.batch, row.blocks_per_seq, row.seed)
        p.table_dev = cupy.asarray(p.table)
        dt = inputs.k.dtype
        p.k_pages = scatter_pages(_u16(inputs.k), p.table, row.page_size).view(dt)
        p.v_pages = scatter_pages(_u16(inputs.v), p.table, row.page_size).view(dt)
    return p


def to_f32(x):
    """A CuPy array (bfloat16 included) or torch tensor -> a float32 CuPy array."""
    import cupy

    if not isinstance(x, cupy.ndarray):   # a torch tensor
        return cupy.from_dlpack(x.detach().float().contiguous())
    if x.dtype == np.float32:
        return x
    if x.dtype.itemsize == 2 and x.dtype.kind not in "fiu":   # bfloat16 (ml_dtypes): float32's top 16 bits
        return (cupy.ascontiguousarray(x).view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32)
    return x.astype(cupy.float32)


def references(p: Prepared) -> dict:
    """b -> the float32 reference output (Hq, Dv) of sequence b (check_sequences), computed from what the row's
    cuflash call reads (for a paged row: the pages, through the block table)."""
    out = {}
    for b in check_sequences(p.row.batch):
        n = int(p.lengths[b])
        if p.row.paged:
            kb = gather_pages(_u16(p.k_pages), p.table[b], n).view(p.k.dtype)
            vb = gather_pages(_u16(p.v_pages), p.table[b], n).view(p.v.dtype)
        else:
            kb, vb = p.k[b, :n], p.v[b, :n]
        out[b] = reference_decode(to_f32(p.q[b, 0]), to_f32(kb), to_f32(vb))
    return out


def output_error(out, refs: dict) -> float:
    """The largest relative error of an output (B, 1, Hq, Dv) (CuPy or torch) on the checked sequences."""
    return max(rel_err(to_f32(out[b, 0]), ref) for b, ref in refs.items())


# ---------------------------------------------------------------------------
# cuflash and the peers. A builder ``build(prepared, torch_views) -> {config: (fn, label, reads_contiguous)}``
# raises where the peer cannot run the row at all; a config that raises on its first call is recorded n/a.


def cuflash_call(p: Prepared, num_splits: int = 0) -> Callable:
    """A zero-argument call of cuflash.forward_kvcache on the row (num_splits=0: automatic)."""
    import cuflash

    k, v = p.cache()
    kw = {"cache_seqlens": p.lens_dev, "num_splits": num_splits}
    if p.row.paged:
        kw["block_table"] = p.table_dev
    fn = cuflash.forward_kvcache

    def call():
        res = fn(p.q, k, v, **kw)
        return res[0] if isinstance(res, (tuple, list)) else res
    return call


def torch_views(p: Prepared) -> dict:
    """DLPack views of the row's arrays as torch tensors (no copies)."""
    from .bench import to_torch

    t = {"q": to_torch(p.q), "k": to_torch(p.k), "v": to_torch(p.v), "lens": to_torch(p.lens_dev)}
    if p.row.paged:
        t.update(k_pages=to_torch(p.k_pages), v_pages=to_torch(p.v_pages), table=to_torch(p.table_dev))
    return t


def _sdpa_has_gqa(torch) -> bool:
    try:
        x = torch.zeros(1, 2, 1, 8, device="cuda")
        torch.nn.functional.scaled_dot_product_attention(x, x[:, :1], x[:, :1], enable_gqa=True)
        return True
    except TypeError:   # a torch before 2.5: no enable_gqa
        return False
    except Exception:  # noqa: BLE001 - another failure: the configurations say theirs
        return True


def sdpa_adapter():
    """PyTorch SDPA with its flash, cuDNN and memory-efficient backends, each in the GQA form (enable_gqa, or the KV
    heads repeated where torch lacks it) and the query-rows form (MHA over the KV heads, a KV head's query heads as
    query rows); on the contiguous cache (marked on the paged rows)."""
    torch, why = torch_cuda()
    if torch is None:
        return None, why
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception as e:  # noqa: BLE001 - a torch before 2.3
        return None, f"torch.nn.attention.sdpa_kernel not importable ({_short(e)})"
    F = torch.nn.functional
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    has_gqa = _sdpa_has_gqa(torch)

    def build(p: Prepared, t: dict) -> dict:
        row = p.row
        q4, ks, vs = t["q"], t["k"].transpose(1, 2), t["v"].transpose(1, 2)   # (B, 1, Hq, D), (B, Hkv, N, D)
        b, _, hq, d = q4.shape
        hkv, n = ks.shape[1], ks.shape[2]
        g = hq // hkv
        mask = None
        if row.ragged:
            pos = torch.arange(n, device=q4.device)
            mask = (pos[None, :] < t["lens"].long()[:, None]).view(b, 1, 1, n)
        where = "contiguous cache" if row.paged else "the cache"
        forms = {}
        qs = q4.transpose(1, 2)   # (B, Hq, 1, D)
        if has_gqa:
            forms["gqa"] = (lambda: F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask,
                                                                    enable_gqa=True).transpose(1, 2),
                            "enable_gqa=True")
        else:
            need = g * row.kv_bytes()
            free = torch.cuda.mem_get_info()[0]
            if need < 0.5 * free:
                kr, vr = ks.repeat_interleave(g, dim=1), vs.repeat_interleave(g, dim=1)
                forms["repeat"] = (lambda: F.scaled_dot_product_attention(qs, kr, vr, attn_mask=mask).transpose(1, 2),
                                   "KV heads repeat_interleave-d outside the timing (this torch has no enable_gqa)")
        qr = q4.reshape(b, hkv, g, d)
        forms["rows"] = (lambda: F.scaled_dot_product_attention(qr, ks, vs, attn_mask=mask).reshape(b, 1, hq, d),
                         f"the {g} query heads of a KV head as {g} query rows (MHA over {hkv} heads)")
        out = {}
        for be_name, be in backends.items():
            for form, (f, what) in forms.items():
                def fn(f=f, be=be):
                    with sdpa_kernel(be):
                        return f()
                mask_note = ", boolean mask over the full cache" if row.ragged else ""
                out[f"sdpa:{be_name}:{form}"] = (fn, f"SDPA {be_name} backend, {what}{mask_note}, on {where}",
                                                 row.paged)
        return out

    return build, None


def flashinfer_adapter():
    """FlashInfer's BatchDecodeWithPagedKVCacheWrapper (NHD), with and without tensor cores."""
    torch, why = torch_cuda()
    if torch is None:
        return None, why
    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001 - optional
        return None, f"flashinfer not importable ({_short(e)})"

    def build(p: Prepared, t: dict) -> dict:
        row = p.row
        dev = t["q"].device
        ps = row.page_size or PAGE_SIZE
        if row.paged:
            kp, vp, table, where = t["k_pages"], t["v_pages"], p.table, "the pages"
        else:
            shape = (row.batch * row.blocks_per_seq, ps, row.heads_kv, row.head_dim)
            kp, vp = t["k"].reshape(shape), t["v"].reshape(shape)
            table, where = in_order_table(row.batch, row.blocks_per_seq), f"the contiguous cache as pages of {ps}"
        indptr, indices, last = (torch.from_numpy(x).to(dev) for x in flashinfer_pages(p.lengths, table, ps))
        q3 = t["q"].reshape(row.batch, row.heads, row.head_dim)
        dt = t["q"].dtype
        out = {}
        for tc in (False, True):
            ws = torch.empty(FLASHINFER_WORKSPACE, dtype=torch.uint8, device=dev)
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
            args = (indptr, indices, last, row.heads, row.heads_kv, row.head_dim, ps)
            if hasattr(w, "plan"):
                try:
                    w.plan(*args, pos_encoding_mode="NONE", q_data_type=dt, kv_data_type=dt)
                except TypeError:   # releases with one data_type
                    w.plan(*args, pos_encoding_mode="NONE", data_type=dt)
                run = w.run
            else:                   # releases before plan / run
                w.begin_forward(*args, pos_encoding_mode="NONE", data_type=dt)
                run = w.forward

            def fn(run=run, keep=(w, ws)):
                return run(q3, (kp, vp)).reshape(row.batch, 1, row.heads, row.head_dim)
            name = "tc" if tc else "cc"
            out[f"flashinfer:{name}"] = (fn, f"FlashInfer batch decode, use_tensor_cores={tc}, on {where}", False)
        return out

    return build, None


def fa4_adapter():
    """FlashAttention-4 (flash_attn.cute, through bench._import_fa4: $CUFLASH_FA4_PATH)."""
    torch, why = fa4_torch()
    if torch is None:
        return None, why
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001
        return None, f"flash_attn.cute.flash_attn_varlen_func not importable ({_short(e)})"

    def first(res):
        return res[0] if isinstance(res, (tuple, list)) else res

    def with_splits(call, what):
        """(fn, label) of the first of num_splits 0 (FA4's heuristic), 1, none that runs; raises the last error."""
        err = None
        for kw in ({"num_splits": 0}, {"num_splits": 1}, {}):
            def fn(kw=kw):
                with torch.no_grad():
                    return first(call(**kw))
            try:
                fn()
                torch.cuda.synchronize()
                return fn, f"{what}{', num_splits=' + str(kw['num_splits']) if kw else ''}"
            except Exception as e:  # noqa: BLE001 - try the next
                err = e
        raise err

    def build(p: Prepared, t: dict) -> dict:
        row = p.row
        q, lens = t["q"], t["lens"]

        def contiguous():
            if row.ragged:
                return lambda **kw: flash_attn_varlen_func(q, t["k"], t["v"], seqused_k=lens, **kw)
            return lambda **kw: flash_attn_func(q, t["k"], t["v"], **kw)

        if row.paged:
            try:
                call = lambda **kw: flash_attn_varlen_func(q, t["k_pages"], t["v_pages"], seqused_k=lens,  # noqa: E731
                                                           page_table=t["table"], **kw)
                fn, label = with_splits(call, "flash_attn_varlen_func with page_table, on the pages")
                return {"fa4": (fn, label, False)}
            except Exception as e:  # noqa: BLE001 - its sm90 path takes no pages: the contiguous cache then
                paged_why = _short(e)
            fn, label = with_splits(contiguous(), "on the contiguous cache")
            return {"fa4": (fn, f"{label} (with page_table: {paged_why})", True)}
        fn, label = with_splits(contiguous(), "flash_attn_varlen_func with seqused_k" if row.ragged
                                else "flash_attn_func")
        return {"fa4": (fn, label, False)}

    return build, None


def peer_adapters() -> dict:
    """peer -> (builder or None, why not)."""
    out = {}
    for name, make in (("sdpa", sdpa_adapter), ("flashinfer", flashinfer_adapter), ("fa4", fa4_adapter)):
        try:
            out[name] = make()
        except Exception as e:  # noqa: BLE001 - a broken install must not stop the run
            out[name] = (None, _short(e))
    return out


# ---------------------------------------------------------------------------
# The benchmark


def _sync() -> None:
    import cupy

    cupy.cuda.get_current_stream().synchronize()


def _time_all(fns: dict, result: DecodeResult, warmup: int, repeats: int, log) -> dict:
    """key -> median ms, interleaved (bench.time_interleaved_or_alone: where a call raises during the timing, each
    is timed alone and the one that raises recorded in ``result.na``, FAILED for cuflash)."""
    from .bench import time_interleaved_or_alone

    return time_interleaved_or_alone(fns, result, warmup=warmup, repeats=repeats, log=log,
                                     what=f"{result.row} [{result.dist}]")


def benchmark_case(row: DecodeRow, dist: str, prepared: Optional[Prepared] = None, *,
                   copy_gbps: Optional[float] = None, repeats: int = DEFAULT_REPEATS, warmup: int = DEFAULT_WARMUP,
                   adapters: Optional[dict] = None, log: Callable[[str], None] = print) -> DecodeResult:
    """One row on one distribution: the check against the float32 reference, then cuflash and every peer
    configuration that runs, interleaved. ``prepared``: the row's inputs (drawn here if None)."""
    if adapters is None:
        adapters = peer_adapters()
    res = new_result(row, dist, copy_gbps)
    try:
        p = prepared if prepared is not None else prepare(row, draw_inputs(row, dist))
    except Exception as e:  # noqa: BLE001 - no inputs (out of memory, say): the row fails, the run goes on
        res.na["cuflash"] = f"FAILED to draw the inputs: {_short(e)}"
        free_memory()
        return res
    fns = {}
    try:
        refs = references(p)
    except Exception as e:  # noqa: BLE001 - reported; the row is then unchecked
        refs = None
        res.notes.append(f"the float32 reference failed: {_short(e)}")
    try:
        call = cuflash_call(p)
        out = call()          # compiles on the first call
        _sync()               # an asynchronous launch failure shows here, not in the timing
        if refs is not None:
            res.check["cuflash"] = output_error(out, refs)
        fns["cuflash"] = call
        del out
    except Exception as e:  # noqa: BLE001 - reported, and the run fails
        res.na["cuflash"] = f"FAILED {_short(e)}"
        log(f"  FAILED cuflash {row.name} [{dist}]: {_short(e)}")
    views = None
    for peer in PEERS:
        build, why = adapters.get(peer, (None, "not run"))
        if build is None:
            res.na[peer] = why
            continue
        try:
            if views is None:
                views = torch_views(p)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                configs = build(p, views)
        except Exception as e:  # noqa: BLE001 - cannot run this row at all
            res.na[peer] = _short(e)
            continue
        for key, (fn, label, contiguous) in configs.items():
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    out = fn()    # raises here if this configuration cannot run the row (and compiles)
                    _sync()
                if refs is not None:
                    res.check[key] = output_error(out, refs)
                del out
            except Exception as e:  # noqa: BLE001 - SDPA "no available kernel", FA4 DSL errors, out of memory
                res.na[key] = _short(e)
                continue
            fns[key] = fn
            res.labels[key] = label
            if contiguous:
                res.contiguous.append(key)
    if fns:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res.ms.update(_time_all(fns, res, warmup, repeats, log))
    del fns, views
    if prepared is None:
        del p
    free_memory()
    return res


def skipped_result(row: DecodeRow, dist: str, why: str, copy_gbps: Optional[float] = None) -> DecodeResult:
    res = new_result(row, dist, copy_gbps)
    res.skipped = why
    return res


def _progress(r: DecodeResult) -> str:
    if r.skipped:
        return f"  {r.row:<24} {r.dist:<8} skipped: {r.skipped}"
    frac = r.copy_fraction()
    parts = [f"cuflash {_num(r.ms['cuflash'] * 1e3 if 'cuflash' in r.ms else None, '.1f')} us "
             f"{_num(r.gbps(), '.0f')} GB/s ({_num(None if frac is None else 100 * frac, '.1f')} % of copy)"]
    parts += [f"{p} {_num(r.peer_gbps(p), '.0f')} GB/s x {_ratio(r.vs(p))}" for p in PEERS]
    parts.append(f"check {_num(r.check.get('cuflash'), '.1e')}")
    return f"  {r.row:<24} {r.dist:<8} | " + " | ".join(parts) + f" | {r.bar()}"


def benchmark_decode(rows, dists, *, copy_gbps: Optional[float] = None, repeats: int = DEFAULT_REPEATS,
                     warmup: int = DEFAULT_WARMUP, adapters: Optional[dict] = None,
                     fraction: float = MEMORY_FRACTION, log: Callable[[str], None] = print) -> list:
    """DecodeResults for every row x distribution, in that order. The rows of one batch, cache length and raggedness
    share one draw of the contiguous inputs (the paged row scatters it into pages); a group whose K/V cache exceeds
    ``fraction`` of the free memory is skipped."""
    if adapters is None:
        adapters = peer_adapters()
    rows, dists = list(rows), list(dists)
    groups = {}
    for row in rows:
        groups.setdefault((row.batch, row.cache_len, row.ragged, row.heads, row.heads_kv, row.head_dim, row.dtype,
                           row.seed), []).append(row)
    out = []
    for group in groups.values():
        for dist in dists:
            why = memory_skip(group[0].kv_bytes(), free_bytes(), fraction)
            if why:
                for row in group:
                    out.append(skipped_result(row, dist, why, copy_gbps))
                    log(_progress(out[-1]))
                continue
            try:
                inputs = draw_inputs(group[0], dist)
            except Exception as e:  # noqa: BLE001 - out of memory, say: these rows fail, the run goes on
                for row in group:
                    r = new_result(row, dist, copy_gbps)
                    r.na["cuflash"] = f"FAILED to draw the inputs: {_short(e)}"
                    out.append(r)
                    log(f"  FAILED inputs {row.name} [{dist}]: {_short(e)}")
                free_memory()
                continue
            for row in group:
                try:
                    p = prepare(row, inputs)
                    r = benchmark_case(row, dist, p, copy_gbps=copy_gbps, repeats=repeats, warmup=warmup,
                                       adapters=adapters, log=log)
                    del p
                except Exception as e:  # noqa: BLE001 - a harness bug or a dead context: say so, go on
                    r = new_result(row, dist, copy_gbps)
                    r.na["cuflash"] = f"FAILED (the case raised) {_short(e)}"
                free_memory()
                out.append(r)
                log(_progress(r))
                sys.stdout.flush()
            del inputs
            free_memory()
    order = {(r.name, d): i for i, (r, d) in enumerate((r, d) for r in rows for d in dists)}
    return sorted(out, key=lambda r: order.get((r.row, r.dist), len(order)))


# ---------------------------------------------------------------------------
# python -m cuflash --decode


def peer_versions(adapters: dict) -> str:
    parts = []
    try:
        import torch

        parts.append(f"PyTorch {torch.__version__}")
    except Exception:  # noqa: BLE001
        parts.append("PyTorch not importable")
    try:
        import flashinfer

        parts.append(f"FlashInfer {getattr(flashinfer, '__version__', '?')}")
    except Exception:  # noqa: BLE001
        parts.append("FlashInfer not importable")
    parts.append(fa4_version())
    return "; ".join(parts)


def header(device: str, cc: int, repeats: int, warmup: int, copy: Optional[dict], adapters: dict) -> str:
    if copy:
        rates = ", ".join(f"{k} {v:.0f}" for k, v in copy["gbps"].items())
        cp = (f"copy bandwidth {copy['copy_gbps']:.0f} GB/s ({rates} GB/s; {copy['bytes'] / 2**30:.0f} GiB, read + "
              f"written, median of {COPY_REPEATS})")
    else:
        cp = "copy bandwidth not measured"
    return run_header("decode table (issue #44)", device, cc, [peer_versions(adapters), cp], warmup, repeats)


def run(args, device: str, cc: int) -> int:
    """The decode table: printed (and as Markdown, JSON); 1 if cuflash failed a call or its check, or a peer's
    output differs from the reference."""
    from .bench_report import git_commit

    rows = rows_by_name(args.decode_rows)
    try:
        copy = copy_bandwidth()
    except Exception as e:  # noqa: BLE001 - the table still runs, without "% of copy"
        copy = None
        print(f"copy bandwidth: FAILED {_short(e)}")
    adapters = peer_adapters()
    head = header(device, cc, args.repeats, args.warmup, copy, adapters)
    print(head)
    print(f"rows: {', '.join(r.name for r in rows)} x {', '.join(args.decode_dists)}")
    for name, (build, why) in adapters.items():
        print(f"  {name}: {'found' if build else why}")
    results = benchmark_decode(rows, args.decode_dists, copy_gbps=copy["copy_gbps"] if copy else None,
                               repeats=args.repeats, warmup=args.warmup, adapters=adapters)

    def doc():
        return {"header": head, "device": device, "cc": cc, "commit": git_commit(), "copy": copy,
                "rows": [{"name": r.name, "label": r.label(), "lengths": r.lengths().tolist(),
                          "kv_bytes": r.kv_bytes(), "bytes": r.bytes_read()} for r in rows],
                "dists": list(args.decode_dists), "results": [r.to_json() for r in results]}

    return print_results(args, format_table(results), lambda: markdown_table(results, head), doc, failures(results))
