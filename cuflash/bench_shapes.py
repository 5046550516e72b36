"""The head-dim table of ``python -m cuflash --head-dims`` (issue #43's bar for the shapes of current models).

The bar: D=512 and (Dqk, Dv) = (192, 128) forward and forward+backward beside cuDNN and FlashAttention-4 where they
run those shapes, at least 1.05x the faster; where no peer runs one, within 10 % per FLOP of cuflash's own speed at
D=256 (for 512) or D=128 (for (192, 128)) on the same batch, heads and length. MLA's absorbed (576, 512) is a row
too (forward only: no peer takes it here; its own reference is D=256).

Each row (:class:`HeadDimRow`) is timed on each score distribution (default ``normal`` and ``sharp``; drawn by
cuflash.distributions at q's head dim, v cut to its own), with:

- ``cuflash``: ``cuflash.forward`` / ``backward``;
- ``own``: cuflash on the row's reference head dim (``ref_dim`` for q, k and v alike), the same distribution;
- ``cudnn``: cuDNN's SDPA through cudnn-frontend's graph API (bench_variants.cudnn_adapter, which takes a v head dim
  of its own), where ``import cudnn`` works, else PyTorch SDPA's cuDNN backend, on torch views of cuflash's arrays,
  where it takes the shape;
- ``fa4``: FlashAttention-4's ``flash_attn_func`` on the same views, where it imports and takes the shape.

A peer that does not import or raises gets "n/a" with the reason. Before timing, each peer's forward output is
compared with cuflash's (relative Frobenius norm above bench_variants.CHECK_BOUND: "differs", left out of the
ratios, and the run fails).

FLOPs per (query, key) pair visible (bench_variants.visible_pairs) and head: forward 2 (Dqk + Dv), backward
2 (3 Dqk + 2 Dv) (S again, dP, dV, dK, dQ), so forward+backward 2 (4 Dqk + 3 Dv): 3.5x the forward at Dqk = Dv, as
bench.PASS_FLOPS. Timings: bench.time_interleaved (L2 flushed before each sample), the median of ``repeats``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from .bench import Shape, free_memory
from .bench_report import aligned_rows, markdown_rows, print_results, run_header
from .bench_variants import CHECK_BOUND, Variant, _ms, _ratio, _short, _tf, tflops, visible_pairs

SHAPE_PASSES = ("fwd", "fwd+bwd")
DEFAULT_DISTS = ("normal", "sharp")
QUICK_DISTS = ("normal",)
DEFAULT_REPEATS, DEFAULT_WARMUP = 20, 3
PEERS = ("cudnn", "fa4")
BAR_PEER = 1.05     # at least 1.05x the faster peer that runs the row
BAR_OWN = 0.90      # else at least 90 % of cuflash's TF/s at the reference head dim


@dataclass(frozen=True)
class HeadDimRow:
    name: str
    batch: int
    heads: int
    seqlen: int
    head_dim: int       # q's and k's
    head_dim_v: int     # v's and the output's
    causal: bool
    ref_dim: int        # cuflash's own reference head dim
    heads_kv: Optional[int] = None
    dtype: str = "bfloat16"
    passes: tuple = SHAPE_PASSES

    def shape(self, head_dim: Optional[int] = None) -> Shape:
        """The row as a bench Shape at ``head_dim`` (default q's): what make_inputs draws."""
        return Shape(self.batch, self.heads, self.seqlen, head_dim or self.head_dim, self.dtype, self.causal,
                     heads_kv=self.heads_kv)

    @property
    def large(self) -> bool:
        from .head_dims import is_large

        return is_large(self.head_dim, self.head_dim_v)

    def label(self) -> str:
        kv = f"/{self.heads_kv}" if self.heads_kv else ""
        return (f"B={self.batch} H={self.heads}{kv} N={self.seqlen} D={self.head_dim}/{self.head_dim_v} "
                f"{self.dtype}{' causal' if self.causal else ''}")


HEAD_DIM_ROWS = (
    HeadDimRow("mla192", 4, 16, 4096, 192, 128, False, 128),
    HeadDimRow("mla192-causal", 4, 16, 4096, 192, 128, True, 128),
    HeadDimRow("d512", 2, 16, 4096, 512, 512, False, 256),
    HeadDimRow("d512-causal", 2, 16, 4096, 512, 512, True, 256),
    HeadDimRow("mla576", 2, 128, 1024, 576, 512, True, 256, heads_kv=1, passes=("fwd",)),
)
ROW_NAMES = tuple(r.name for r in HEAD_DIM_ROWS)
QUICK_ROWS = ("mla192-causal", "d512-causal")


def rows_by_name(names) -> list:
    """The head-dim rows named (ValueError naming the unknown ones), in the order given."""
    from .bench_variants import pick_rows

    return pick_rows(HEAD_DIM_ROWS, names, "head-dim")


def pass_flops(row: HeadDimRow, pass_: str, head_dim: Optional[int] = None, head_dim_v: Optional[int] = None) -> float:
    """Useful FLOPs of one pass of the row (at other head dims: the reference's)."""
    dqk, dv = head_dim or row.head_dim, head_dim_v or row.head_dim_v
    pairs = visible_pairs(row.seqlen, row.seqlen, Variant(causal=row.causal)) * row.batch * row.heads
    per_pair = {"fwd": 2 * (dqk + dv), "fwd+bwd": 2 * (4 * dqk + 3 * dv)}[pass_]
    return float(pairs * per_pair)


@dataclass
class ShapeResult:
    """One row x distribution x pass."""

    row: str
    label: str
    dist: str
    pass_: str
    flops: float
    own_flops: float
    ms: dict = field(default_factory=dict)      # impl -> median ms (cuflash, own, cudnn, fa4)
    na: dict = field(default_factory=dict)      # impl -> why it has no time
    diffs: dict = field(default_factory=dict)   # peer -> relative difference of its forward output

    def tflops(self, impl: str) -> Optional[float]:
        return tflops(self.own_flops if impl == "own" else self.flops, self.ms.get(impl))

    def vs(self, impl: str) -> Optional[float]:
        a, b = self.tflops("cuflash"), self.tflops(impl)
        return None if a is None or b is None else a / b

    def peers_run(self) -> list:
        return [p for p in PEERS if self.ms.get(p) is not None and self.diffs.get(p, 0.0) <= CHECK_BOUND]

    def bar(self) -> str:
        """"met" / "NOT met" against the faster peer (>= BAR_PEER) or, where none runs, cuflash's own reference
        (>= BAR_OWN per FLOP); "n/a" without cuflash's time."""
        run = self.peers_run()
        if self.ms.get("cuflash") is None:
            return "n/a"
        if run:
            best = max(run, key=lambda p: self.tflops(p))
            ratio, bound, what = self.vs(best), BAR_PEER, best
        else:
            ratio, bound, what = self.vs("own"), BAR_OWN, "own"
        if ratio is None:
            return "n/a"
        return f"{'met' if ratio >= bound else 'NOT met'} ({ratio:.2f}x {what})"

    def to_json(self) -> dict:
        return {"row": self.row, "label": self.label, "dist": self.dist, "pass": self.pass_, "flops": self.flops,
                "own_flops": self.own_flops, "ms": self.ms, "na": self.na, "diffs": self.diffs,
                "tflops": {k: self.tflops(k) for k in self.ms}, "bar": self.bar()}


def failures(results) -> list:
    """What fails the run: cuflash's calls that raised, peers whose output differs from cuflash's."""
    out = []
    for r in results:
        if "cuflash" in r.na:
            out.append(f"{r.row} {r.dist} {r.pass_}: cuflash: {r.na['cuflash']}")
        out += [f"{r.row} {r.dist}: {p}'s output differs from cuflash's by {d:.2e}" for p, d in r.diffs.items()
                if d > CHECK_BOUND]
    return out


def row_inputs(row: HeadDimRow, dist: str, head_dim: Optional[int] = None, head_dim_v: Optional[int] = None,
               seed: int = 0):
    """(q, k, v, dout) CuPy arrays: q and k drawn by cuflash.distributions at q's head dim, v cut to its own
    (contiguous), dout N(0, 1) shaped like the output."""
    import cupy

    from .distributions import make_inputs

    dqk, dv = head_dim or row.head_dim, head_dim_v or row.head_dim_v
    q, k, v = make_inputs(row.shape(max(dqk, dv)), dist, seed=seed)
    if dqk < dv:
        q, k = (cupy.ascontiguousarray(x[..., :dqk]) for x in (q, k))
    v = cupy.ascontiguousarray(v[..., :dv])
    rs = cupy.random.RandomState(seed + 1)
    dout = rs.standard_normal(q.shape[:-1] + (dv,), dtype=cupy.float32).astype(q.dtype)
    return q, k, v, dout


def cuflash_fns(q, k, v, dout, causal: bool, passes) -> dict:
    """pass -> callable (and "_out": the forward's output) for cuflash on these arrays, outputs preallocated."""
    import cupy

    from . import backward, forward

    out = cupy.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype)
    grads = [cupy.empty_like(x) for x in (q, k, v)]
    fns = {"fwd": lambda: forward(q, k, v, causal=causal, out=out)}

    def fwd_bwd():
        o, lse = forward(q, k, v, causal=causal, return_lse=True, out=out)
        backward(dout, q, k, v, o, lse, causal=causal, dq=grads[0], dk=grads[1], dv=grads[2])

    if "fwd+bwd" in passes:
        fns["fwd+bwd"] = fwd_bwd
    for f in fns.values():
        f()
    fns["_out"] = out
    return fns


def _dtype_name(x) -> str:
    from ._checks import dtype_name

    return dtype_name(x.dtype)


def peer_fns(peer: str, q, k, v, dout, causal: bool, passes) -> dict:
    """pass -> callable (and "_out") for a peer on torch views of cuflash's arrays; raises where it cannot run."""
    from .bench import fa4_fn, torch_pass_fns, torch_sdpa, torch_views

    if peer == "cudnn":
        from .bench_variants import VariantRow, cudnn_adapter

        build = cudnn_adapter()
        if build is not None:   # cudnn-frontend: takes Dv != Dqk
            row = VariantRow("head-dims", Shape(q.shape[0], q.shape[2], q.shape[1], q.shape[3], _dtype_name(q), causal,
                                                heads_kv=k.shape[2]), Variant(causal=causal))
            return build(row, q, k, v, dout, passes=tuple(passes))
        fn = torch_sdpa("cudnn")
        layout = True
    else:
        fn = fa4_fn()
        layout = False
    if fn is None:
        raise ImportError(f"{peer} does not import here")
    tq, tk, tv = torch_views((q, k, v), sdpa_layout=layout, requires_grad=True)
    tdout = torch_views((dout,), sdpa_layout=layout)[0]
    fns = torch_pass_fns(fn, tq, tk, tv, causal, tdout if "fwd+bwd" in passes else None, passes=tuple(passes))
    out = fn(tq, tk, tv, causal)
    fns["_out"] = out.transpose(1, 2) if layout else out
    return fns


def benchmark_row(row: HeadDimRow, dist: str, *, repeats: int = DEFAULT_REPEATS, warmup: int = DEFAULT_WARMUP,
                  backward: bool = True, peers=PEERS) -> list:
    """The row's ShapeResults (one per pass) on one distribution."""
    from .bench import time_interleaved
    from .bench_variants import rel_diff

    passes = tuple(p for p in row.passes if backward or p == "fwd")
    results = {p: ShapeResult(row.name, row.label(), dist, p, pass_flops(row, p),
                              pass_flops(row, p, row.ref_dim, row.ref_dim)) for p in passes}
    fns, outs = {}, {}

    def na(impl, why):
        for r in results.values():
            r.na[impl] = why

    q, k, v, dout = row_inputs(row, dist)
    try:
        fns["cuflash"] = cuflash_fns(q, k, v, dout, row.causal, passes)
        outs["cuflash"] = fns["cuflash"].pop("_out")
    except Exception as e:  # noqa: BLE001 - reported in the table, fails the run
        na("cuflash", _short(e))
    ref = row_inputs(row, dist, row.ref_dim, row.ref_dim)
    try:
        fns["own"] = cuflash_fns(*ref, row.causal, passes)
        fns["own"].pop("_out")
    except Exception as e:  # noqa: BLE001
        na("own", _short(e))
    for peer in peers:
        try:
            fns[peer] = peer_fns(peer, q, k, v, dout, row.causal, passes)
            outs[peer] = fns[peer].pop("_out")
        except Exception as e:  # noqa: BLE001 - a peer that cannot run the shape
            na(peer, _short(e))
    for peer in peers:
        if peer in outs and "cuflash" in outs:
            d = rel_diff(outs[peer], outs["cuflash"])
            for r in results.values():
                r.diffs[peer] = d
    for p, r in results.items():
        timed = {impl: f[p] for impl, f in fns.items() if p in f}
        if timed:
            for impl, ms in time_interleaved(timed, warmup=warmup, repeats=repeats).items():
                r.ms[impl] = ms
    del fns, outs, q, k, v, dout, ref
    free_memory()
    return list(results.values())


def benchmark_shapes(rows, dists, *, repeats: int = DEFAULT_REPEATS, warmup: int = DEFAULT_WARMUP,
                     backward: bool = True, peers=PEERS) -> list:
    out = []
    for row in rows:
        for dist in dists:
            out += benchmark_row(row, dist, repeats=repeats, warmup=warmup, backward=backward, peers=peers)
    return out


TABLE_HEAD = ("row", "dist", "pass", "cuflash ms", "TF/s", "own TF/s", "vs own", "cudnn TF/s", "vs cudnn",
              "fa4 TF/s", "vs fa4", "bar")


def _cells(r: ShapeResult) -> list:
    def peer(p):
        if p in r.na:
            return ["n/a", ""]
        if r.diffs.get(p, 0.0) > CHECK_BOUND:
            return ["differs", ""]
        return [_tf(r.tflops(p)), _ratio(r.vs(p))]

    return [r.row, r.dist, r.pass_, _ms(r.ms.get("cuflash")), _tf(r.tflops("cuflash")), _tf(r.tflops("own")),
            _ratio(r.vs("own")), *peer("cudnn"), *peer("fa4"), r.bar()]


def _notes(results) -> list:
    seen, out = set(), []
    for r in results:
        for impl, why in r.na.items():
            if (impl, why) not in seen:
                seen.add((impl, why))
                out.append(f"{impl} n/a on {r.row}: {why}")
    return out


def format_table(results) -> str:
    lines = aligned_rows(TABLE_HEAD, [_cells(r) for r in results], range(len(TABLE_HEAD)))
    descriptions = {r.row: r.label for r in results}
    lines += [f"{name}: {label}" for name, label in descriptions.items()] + _notes(results)
    return "\n".join(lines)


def markdown_table(results, header: str = "") -> str:
    lines = [header] if header else []
    lines += markdown_rows(TABLE_HEAD, [_cells(r) for r in results])
    return "\n".join(lines)


def kernel_configs(cc: int, rows=HEAD_DIM_ROWS) -> list:
    """The kernels the rows run (for the precompile step): the forward and backward at each row's head dims and
    at its reference head dim."""
    from . import heuristics

    out = set()
    for r in rows:
        out.add(heuristics.fwd_config(r.dtype, r.head_dim, r.causal, cc, head_dim_v=r.head_dim_v))
        out.add(heuristics.fwd_config(r.dtype, r.ref_dim, r.causal, cc))
        out |= set(heuristics.bwd_configs(r.dtype, r.ref_dim, r.causal, cc).all())
        if "fwd+bwd" in r.passes:
            if r.large:
                out |= set(heuristics.large_bwd_configs(r.dtype, r.head_dim, r.head_dim_v, r.causal, cc))
            else:
                out |= set(heuristics.bwd_configs(r.dtype, max(r.head_dim, r.head_dim_v), r.causal, cc).all())
    return sorted(out, key=lambda c: c.key())


def replace_row(row: HeadDimRow, **kw) -> HeadDimRow:
    return replace(row, **kw)


def run(args, device: str, cc: int) -> int:
    """The head-dim table: printed (and as Markdown, JSON); 1 if cuflash failed a call or an output differs."""
    from .bench_varlen import peer_versions

    rows = rows_by_name(args.head_dim_rows)
    head = (run_header("head-dim table (issue #43)", device, cc, [peer_versions()], args.warmup, args.repeats)
            + f"; rows {', '.join(args.head_dim_rows)} x {', '.join(args.head_dim_dists)}")
    print(head)
    results = benchmark_shapes(rows, args.head_dim_dists, repeats=args.repeats, warmup=args.warmup,
                               backward=not args.forward_only)
    return print_results(args, format_table(results), lambda: markdown_table(results, head),
                         lambda: {"header": head, "device": device, "cc": cc,
                                  "results": [r.to_json() for r in results]},
                         failures(results))
