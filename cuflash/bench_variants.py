"""The attention-variant table of ``python -m cuflash --variants`` (issue #41's benchmark rows).

Each row is one call (a shape and a variant: sliding window, chunked attention, softcap, ALiBi, sinks) at
B=4 H=16 D=128 bf16 unless it says otherwise, timed forward and forward+backward beside:

- plain cuflash on the same shape with the same ``causal`` and nothing else (the baseline that the variant's
  speed over the tiles it visits is held against);
- FlashAttention-4 (``flash_attn.cute.flash_attn_func``: window_size, softcap, learnable_sink) where it imports;
- cuDNN through cudnn-frontend's graph API (``sdpa`` / ``sdpa_backward``: diagonal band masks for windows,
  ``use_alibi_mask``, ``sink_token``, softcap as a ``score_mod``) where ``import cudnn`` works;
- PyTorch SDPA's cuDNN backend on the plain call (it has no variant but causal).

A peer that lacks a variant, or raises on the call, gets "n/a" with the reason.

FLOP accounting (:func:`visible_pairs`, :func:`visited_tiles`; pure functions, O(seqlen) memory):

- *tiles*: the key tiles the mask policy visits, counted on 128 x 128 tiles whatever tiles each kernel really
  uses (a convention: cuflash's tiles differ per kernel and pass): each visited tile costs 128 x 128 x 4 x D
  forward FLOPs per (batch, head). A variant as fast as plain attention over the tiles it visits reads the
  same TFLOP/s of tiles as plain attention.
- *useful*: the (query, key) pairs actually visible x 4 x D (the FlashAttention convention).
- forward+backward counts 3.5x the forward (cuflash.bench.PASS_FLOPS), as the rest of the harness does.

Timings: every implementation of one pass sample by sample in turn (bench.time_interleaved), the L2 cache
flushed before each sample, the median of ``repeats`` samples; each row on N(0, 1) inputs and on the score
distributions of ``cuflash.distributions`` (default: outlier12 and sink besides normal).

Before timing, each peer's forward output is compared with cuflash's on the same inputs: a peer that computes
something else (a window off by one, other ALiBi slopes) is reported as a mismatch, and the run fails.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import numpy as np

from .bench import PASS_FLOPS, Shape, _short, free_memory
from .bench_report import markdown_report, na_and_note_lines, run_grid, text_report

TILE = 128                       # the accounting convention: 128 x 128 tiles
VARIANT_PASSES = ("fwd", "fwd+bwd")
DEFAULT_DISTS = ("normal", "outlier12", "sink")
QUICK_DISTS = ("normal",)
SOFTCAP = 30.0
CHECK_BOUND = 2.5e-2             # |peer - cuflash| / |cuflash| (Frobenius) above which a peer is "not the same call"
PEERS = ("fa4", "cudnn")         # the peers with variants; sdpa_cudnn runs the plain call only


# ---------------------------------------------------------------------------
# Variants and rows


@dataclass(frozen=True)
class Variant:
    """The variant arguments of one call (cuflash.forward's names and conventions)."""

    causal: bool = False
    window: tuple = (-1, -1)     # (left, right), -1 unbounded; bottom-right aligned
    chunk: int = 0               # attention_chunk, 0 off
    softcap: float = 0.0
    alibi: bool = False          # the standard slopes 2^(-8 (h + 1) / H) (cuDNN's use_alibi_mask computes them)
    sinks: bool = False          # one learned logit per query head

    def label(self) -> str:
        parts = []
        if self.window != (-1, -1):
            parts.append(f"window ({self.window[0]}, {self.window[1]})")
        if self.chunk:
            parts.append(f"chunk {self.chunk}")
        if self.softcap:
            parts.append(f"softcap {self.softcap:g}")
        if self.alibi:
            parts.append("alibi")
        if self.sinks:
            parts.append("sinks")
        if self.causal:
            parts.append("causal")
        return " + ".join(parts) if parts else "plain"

    @property
    def plain(self) -> "Variant":
        """The same call without the variant: plain attention with the same ``causal``."""
        return Variant(causal=self.causal)

    @property
    def is_plain(self) -> bool:
        return self == self.plain

    @property
    def right(self) -> int:
        """The effective right bound (-1 unbounded): 0 under causal."""
        return 0 if self.causal else self.window[1]


@dataclass(frozen=True)
class VariantRow:
    name: str
    shape: Shape
    variant: Variant
    note: str = ""

    def label(self) -> str:
        """The shape (without "causal", which the variant says) and the variant."""
        return f"{replace(self.shape, causal=False).label()}, {self.variant.label()}"


def _shape(n: int, causal: bool, batch: int = 4, heads: int = 16, heads_kv: Optional[int] = None) -> Shape:
    return Shape(batch, heads, n, 128, "bfloat16", causal, heads_kv=heads_kv)


# Issue #41's rows. B=4 H=16 D=128 bf16 except where named.
VARIANT_ROWS = (
    VariantRow("window8k", _shape(8192, True), Variant(causal=True, window=(1024, 0))),
    VariantRow("window16k", _shape(16384, True), Variant(causal=True, window=(1024, 0))),
    VariantRow("softcap-causal", _shape(8192, True), Variant(causal=True, softcap=SOFTCAP)),
    VariantRow("softcap", _shape(8192, False), Variant(softcap=SOFTCAP)),
    VariantRow("alibi", _shape(8192, True), Variant(causal=True, alibi=True)),
    VariantRow("gpt-oss", _shape(8192, True), Variant(causal=True, window=(128, 0), sinks=True)),
    VariantRow("gpt-oss-gqa", _shape(8192, True, heads=64, heads_kv=8),
               Variant(causal=True, window=(128, 0), sinks=True), "H=64 Hkv=8 as gpt-oss"),
    VariantRow("chunk", _shape(32768, True, batch=2), Variant(causal=True, chunk=8192),
               "B=2 to keep memory and time sane"),
)
ROW_NAMES = tuple(r.name for r in VARIANT_ROWS)
QUICK_ROWS = ("window8k", "softcap-causal")


def pick_rows(rows, names, what: str) -> list:
    """The ``rows`` (objects with a ``name``) named, in the order given, each once; ValueError naming the unknown
    ones (``what``: the table's kind of row)."""
    table = {r.name: r for r in rows}
    bad = [n for n in names if n not in table]
    if bad:
        raise ValueError(f"unknown {what} row(s) {', '.join(bad)}; choose from {', '.join(table)}")
    return [table[n] for n in dict.fromkeys(names)]


def rows_by_name(names) -> list:
    """The variant rows named (ValueError naming the unknown ones), in the order given."""
    return pick_rows(VARIANT_ROWS, names, "variant")


# ---------------------------------------------------------------------------
# FLOP accounting (no N x N array anywhere)


def key_bounds(seqlen_q: int, seqlen_k: int, variant: Variant, rows=None):
    """(lo, hi) int64 arrays: query row i sees keys lo[i] <= j <= hi[i] (lo > hi: none). Query i sits at key
    position p = i + seqlen_k - seqlen_q (bottom-right alignment); it sees p - left <= j <= p + right (-1:
    unbounded; causal: right 0) and, with a chunk c, only keys of its own chunk, j // c == p // c
    (reference.visible_mask's definition, one row at a time)."""
    i = np.arange(seqlen_q, dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64)
    pos = i + (seqlen_k - seqlen_q)
    lo = np.zeros_like(pos)
    hi = np.full_like(pos, seqlen_k - 1)
    left, right = variant.window[0], variant.right
    if right >= 0:
        hi = np.minimum(hi, pos + right)
    if left >= 0:
        lo = np.maximum(lo, pos - left)
    if variant.chunk:
        start = np.floor_divide(pos, variant.chunk) * variant.chunk
        lo = np.maximum(lo, start)
        hi = np.minimum(hi, start + variant.chunk - 1)
    return lo, hi


def visible_pairs(seqlen_q: int, seqlen_k: int, variant: Variant) -> int:
    """Visible (query, key) pairs of one (batch, head)."""
    if seqlen_q <= 0 or seqlen_k <= 0:
        return 0
    lo, hi = key_bounds(seqlen_q, seqlen_k, variant)
    return int(np.maximum(hi - lo + 1, 0).sum())


def visited_tiles(seqlen_q: int, seqlen_k: int, variant: Variant, block_m: int = TILE, block_n: int = TILE) -> int:
    """Key tiles visited over all query tiles of one (batch, head), tiles ``block_m`` x ``block_n``: for each
    query tile, the span from the first to the last key tile that one of its rows sees (the mask policy's
    contiguous [n_block_min, n_block_max)); a query tile whose rows see no key visits none."""
    if seqlen_q <= 0 or seqlen_k <= 0:
        return 0
    lo, hi = key_bounds(seqlen_q, seqlen_k, variant)
    seen = hi >= lo
    m_tiles = -(-seqlen_q // block_m)
    pad = m_tiles * block_m - seqlen_q
    big = np.iinfo(np.int64).max
    lo = np.pad(np.where(seen, lo, big), (0, pad), constant_values=big).reshape(m_tiles, block_m)
    hi = np.pad(np.where(seen, hi, -1), (0, pad), constant_values=-1).reshape(m_tiles, block_m)
    first, last = lo.min(axis=1), hi.max(axis=1)
    any_seen = last >= 0
    return int(np.where(any_seen, last // block_n - np.minimum(first, last) // block_n + 1, 0).sum())


@dataclass(frozen=True)
class Work:
    """FLOPs of one row's forward pass (multiply by PASS_FLOPS for the others)."""

    pairs: int          # visible pairs, one (batch, head)
    tiles: int          # visited 128 x 128 tiles, one (batch, head)
    useful_flops: float
    tile_flops: float


def work(shape: Shape, variant: Variant) -> Work:
    bh = shape.batch * shape.heads
    pairs = visible_pairs(shape.seqlen, shape.nk, variant)
    tiles = visited_tiles(shape.seqlen, shape.nk, variant)
    return Work(pairs, tiles, 4.0 * shape.head_dim * bh * pairs, 4.0 * shape.head_dim * bh * tiles * TILE * TILE)


def tflops(flops: float, ms: Optional[float]) -> Optional[float]:
    return None if not ms else flops / (ms * 1e-3) / 1e12


# ---------------------------------------------------------------------------
# Which peer has which variant (before any call: the reasons for "n/a")


def static_na(peer: str, variant: Variant) -> Optional[str]:
    """Why ``peer`` cannot run ``variant`` as the same call, known without trying; None: try it."""
    if peer == "fa4":
        if variant.chunk:
            return "FA4's flash_attn_func has no attention_chunk"
        if variant.alibi:
            return "FA4's flash_attn_func has no alibi_slopes"
        return None
    if peer == "cudnn":
        if variant.chunk:
            return "cudnn-frontend's sdpa has no chunked mask"
        if variant.softcap and (variant.causal or variant.window != (-1, -1) or variant.alibi):
            return ("cudnn-frontend takes softcap only as a score_mod, which it refuses beside its causal, band "
                    "and ALiBi masks (a mask inside the score_mod would visit every tile: not the same call)")
        return None
    if peer == "sdpa_cudnn":
        return None if variant.is_plain else "PyTorch SDPA's cuDNN backend has no variant but causal"
    raise ValueError(f"unknown peer {peer!r}")


# ---------------------------------------------------------------------------
# The variant's extra operands


def alibi_slopes_host(heads: int) -> np.ndarray:
    """ALiBi's standard slopes (Press et al.; what cuDNN's use_alibi_mask uses): 2^(-8 (h + 1) / H) for H a power
    of two, else the closest power of two's slopes and every other slope of twice that many."""
    def pow2(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (h + 1) for h in range(n)]
    if heads & (heads - 1) == 0:
        s = pow2(heads)
    else:
        p = 2 ** int(math.floor(math.log2(heads)))
        s = pow2(p) + pow2(2 * p)[0::2][:heads - p]
    return np.asarray(s, dtype=np.float32)


def sinks_host(heads: int, seed: int = 0) -> np.ndarray:
    """Learned sink logits: values exactly representable in bfloat16 (FA4 takes them in bf16), around 0-3
    as trained gpt-oss sinks are."""
    from ._checks import BFLOAT16

    x = np.random.default_rng(seed).uniform(0.0, 3.0, heads).astype(np.float32)
    return x.astype(BFLOAT16).astype(np.float32)


def cuflash_kwargs(variant: Variant, heads: int):
    """cuflash.forward / backward keyword arguments of the variant (device arrays on the current device)."""
    import cupy

    kw = {}
    if variant.window != (-1, -1):
        kw["window_size"] = tuple(variant.window)
    if variant.chunk:
        kw["attention_chunk"] = variant.chunk
    if variant.softcap:
        kw["softcap"] = variant.softcap
    if variant.alibi:
        kw["alibi_slopes"] = cupy.asarray(alibi_slopes_host(heads))
    if variant.sinks:
        kw["sinks"] = cupy.asarray(sinks_host(heads))
    return kw


def cuflash_fns(q, k, v, dout, variant: Variant, passes=VARIANT_PASSES) -> dict:
    """pass -> zero-argument callable running cuflash with the variant into preallocated outputs: "fwd";
    "fwd+bwd" (forward with lse, then backward: dq, dk, dv, and dsinks with sinks)."""
    import cupy

    from . import backward, forward

    kw = cuflash_kwargs(variant, q.shape[2])
    out = cupy.empty_like(q)
    grads = [cupy.empty_like(x) for x in (q, k, v)]
    fns = {"fwd": lambda: forward(q, k, v, causal=variant.causal, out=out, **kw)}

    def fwd_bwd():
        o, lse = forward(q, k, v, causal=variant.causal, return_lse=True, out=out, **kw)
        backward(dout, q, k, v, o, lse, causal=variant.causal, dq=grads[0], dk=grads[1], dv=grads[2], **kw)

    fns["fwd+bwd"] = fwd_bwd
    fns = {p: f for p, f in fns.items() if p in passes}
    fns["_out"] = out   # the forward's output (for the peers' check), filled by the first call
    return fns


# ---------------------------------------------------------------------------
# Peer adapters: each returns None where the peer does not import, else a builder
# ``build(row, q, k, v, dout, passes) -> {pass: fn, "_out": output}`` that raises when the peer cannot run it.


def fa4_adapter():
    """A builder for FlashAttention-4 (flash_attn.cute.flash_attn_func, on torch views of cuflash's arrays), or
    None where PyTorch with CUDA or FA4 does not import ($CUFLASH_FA4_PATH: see bench._import_fa4)."""
    try:
        import torch
    except Exception:  # noqa: BLE001 - PyTorch is optional
        return None
    if not torch.cuda.is_available():
        return None
    from .bench import _import_fa4

    fn, _ = _import_fa4()
    if fn is None:
        return None

    def build(row: VariantRow, q, k, v, dout, passes=VARIANT_PASSES) -> dict:
        from .bench import torch_views

        var = row.variant
        why = static_na("fa4", var)
        if why:
            raise NotImplementedError(why)
        tq, tk, tv = torch_views((q, k, v), requires_grad=True)
        tdout = torch_views((dout,))[0]
        kw = {"causal": var.causal}
        if var.window != (-1, -1):
            kw["window_size"] = tuple(None if w < 0 else w for w in (var.window[0], var.right))
        if var.softcap:
            kw["softcap"] = var.softcap
        sink = None
        if var.sinks:
            sink = torch.tensor(sinks_host(row.shape.heads), device=tq.device).to(torch.bfloat16)
            kw["learnable_sink"] = sink

        def call():
            res = fn(tq, tk, tv, **kw)
            return res[0] if isinstance(res, (tuple, list)) else res

        out = call()   # raises here if FA4 cannot run it (and compiles)
        fns = {"fwd": call, "_out": out}
        if "fwd+bwd" in passes:
            inputs = (tq, tk, tv)
            if sink is not None:   # dsinks as cuflash computes them, where FA4's backward does
                sink.requires_grad_(True)
                try:
                    torch.autograd.grad(call(), inputs + (sink,), tdout)
                    inputs = inputs + (sink,)
                except Exception as e:  # noqa: BLE001
                    sink.requires_grad_(False)
                    fns["_note"] = f"fwd+bwd without dsinks ({type(e).__name__}: {str(e)[:80]})"
            fns["fwd+bwd"] = lambda: torch.autograd.grad(call(), inputs, tdout)
            fns["fwd+bwd"]()
        return {p: f for p, f in fns.items() if p in passes or p.startswith("_")}

    return build


def cudnn_adapter():
    """A builder for cuDNN's attention through cudnn-frontend's graph API (``pip install nvidia-cudnn-frontend``;
    it loads the cuDNN that PyTorch loads), on torch views of cuflash's arrays, or None where it does not import.
    Windows are diagonal bands (left bound = left + 1: cuDNN counts the diagonal), ALiBi its ``use_alibi_mask``
    (standard slopes, causal only), sinks its ``sink_token`` (cuDNN >= 9.13), softcap a ``score_mod``
    (c * tanh(s / c) after the scale) with its derivative as ``score_mod_bprop``."""
    try:
        import torch
        import cudnn
    except Exception:  # noqa: BLE001 - both optional
        return None
    if not torch.cuda.is_available():
        return None

    def build(row: VariantRow, q, k, v, dout, passes=VARIANT_PASSES) -> dict:
        import cupy

        from .bench import torch_views

        var = row.variant
        why = static_na("cudnn", var)
        if why:
            raise NotImplementedError(why)
        b, nq, hq, d = q.shape
        nk = k.shape[1]
        io = {"bfloat16": cudnn.data_type.BFLOAT16, "float16": cudnn.data_type.HALF}[str(row.shape.dtype)]
        f32 = cudnn.data_type.FLOAT
        tq, tk, tv, tdo = torch_views((q, k, v, dout), sdpa_layout=True)      # (B, H, N, D) views
        # cuflash's layout (q's with v's head dim), as a BHND view
        to = torch.empty((b, nq, hq, v.shape[3]), dtype=tq.dtype, device=tq.device).transpose(1, 2)
        stats = torch.empty(b, hq, nq, 1, dtype=torch.float32, device=tq.device)
        grads = [torch.empty_like(torch_views((x,))[0]).transpose(1, 2) for x in (q, k, v)]
        sink = dsink = None
        if var.sinks:
            sink = torch.tensor(sinks_host(hq), device=tq.device).reshape(1, hq, 1, 1)
            dsink = torch.empty_like(sink)
        handle = cudnn.create_handle()
        cudnn.set_stream(handle=handle, stream=cupy.cuda.get_current_stream().ptr)
        scale = 1.0 / math.sqrt(d)

        def tensor(g, name, t, dtype=io):
            return g.tensor(name=name, dim=list(t.shape), stride=list(t.stride()), data_type=dtype)

        def masking():
            kw = {}
            if var.causal or var.window != (-1, -1) or var.alibi:
                # ALiBi needs the top-left causal mask (its bottom-right one refuses ALiBi): the same when nq == nk
                top_left = nq == nk
                kw["diagonal_alignment"] = (cudnn.diagonal_alignment.TOP_LEFT if top_left
                                            else cudnn.diagonal_alignment.BOTTOM_RIGHT)
                if var.right >= 0:
                    kw["diagonal_band_right_bound"] = var.right
                if var.window[0] >= 0:
                    kw["diagonal_band_left_bound"] = var.window[0] + 1
            if var.alibi:
                kw["use_alibi_mask"] = True
            return kw

        def softcap_mods(g, pack):
            """score_mod / score_mod_bprop of the softcap; the bprop reuses the forward's tanh (same graph)."""
            cap = g.tensor(name="softcap", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32,
                           is_pass_by_value=True)
            one = g.tensor(name="one", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32, is_pass_by_value=True)
            pack[cap] = torch.full((1, 1, 1, 1), var.softcap, dtype=torch.float32)
            pack[one] = torch.full((1, 1, 1, 1), 1.0, dtype=torch.float32)
            saved = {}

            def fwd(graph, s):
                saved["t"] = graph.tanh(input=graph.div(a=s, b=cap))
                return graph.mul(a=saved["t"], b=cap)

            def bprop(graph, ds):   # d(c tanh(s / c)) / ds = 1 - tanh^2
                t = saved["t"]
                return graph.mul(a=ds, b=graph.sub(a=one, b=graph.mul(a=t, b=t)))
            return fwd, bprop

        def plan(g):
            g.validate()
            g.build_operation_graph()
            g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            g.check_support()
            g.build_plans()
            return torch.empty(max(1, g.get_workspace_size()), dtype=torch.uint8, device=tq.device)

        # forward (stats generated when the backward follows)
        training = "fwd+bwd" in passes

        def forward_graph(gen_stats):
            g = cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
            cq, ck, cv = tensor(g, "q", tq), tensor(g, "k", tk), tensor(g, "v", tv)
            pack = {cq: tq, ck: tk, cv: tv}
            kw = dict(name="sdpa", q=cq, k=ck, v=cv, attn_scale=scale, **masking())
            if var.softcap:
                kw["score_mod"] = softcap_mods(g, pack)[0]
            if sink is not None:
                cs = tensor(g, "sink", sink, f32)
                kw["sink_token"] = cs
                pack[cs] = sink
            try:
                o, st = g.sdpa(**kw, generate_stats=gen_stats)
            except TypeError:   # releases before generate_stats took is_inference
                o, st = g.sdpa(**kw, is_inference=not gen_stats)
            o.set_output(True).set_dim(list(to.shape)).set_stride(list(to.stride())).set_data_type(io)
            pack[o] = to
            if gen_stats:
                st.set_output(True).set_dim(list(stats.shape)).set_stride(list(stats.stride())).set_data_type(f32)
                pack[st] = stats
            ws = plan(g)
            return lambda: g.execute(pack, ws, handle=handle)

        fwd_infer = forward_graph(False)
        fwd_infer()
        fns = {"fwd": fwd_infer, "_out": to.transpose(1, 2)}
        if training:
            fwd_train = forward_graph(True)
            g = cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
            cq, ck, cv = tensor(g, "q", tq), tensor(g, "k", tk), tensor(g, "v", tv)
            co, cdo, cst = tensor(g, "o", to), tensor(g, "dO", tdo), tensor(g, "stats", stats, f32)
            pack = {cq: tq, ck: tk, cv: tv, co: to, cdo: tdo, cst: stats}
            kw = dict(name="sdpa_backward", q=cq, k=ck, v=cv, o=co, dO=cdo, stats=cst, attn_scale=scale,
                      **masking())
            if var.softcap:
                kw["score_mod"], kw["score_mod_bprop"] = softcap_mods(g, pack)
            if sink is not None:
                cs, cds = tensor(g, "sink", sink, f32), tensor(g, "dsink", dsink, f32)
                kw["sink_token"], kw["dSink_token"] = cs, cds
                pack[cs], pack[cds] = sink, dsink
            dq, dk, dv = g.sdpa_backward(**kw)
            for t, buf in zip((dq, dk, dv), grads):
                t.set_output(True).set_dim(list(buf.shape)).set_stride(list(buf.stride())).set_data_type(io)
                pack[t] = buf
            if sink is not None:
                cds.set_output(True)
            ws = plan(g)

            def fwd_bwd():
                fwd_train()
                g.execute(pack, ws, handle=handle)
            fwd_bwd()
            fns["fwd+bwd"] = fwd_bwd
        return fns

    return build


def sdpa_cudnn_plain_fns(q, k, v, dout, causal: bool, passes=VARIANT_PASSES) -> dict:
    """PyTorch SDPA's cuDNN backend on the plain call (torch views of cuflash's arrays); {} where it cannot run."""
    from .bench import torch_pass_fns, torch_sdpa, torch_views

    fn = torch_sdpa("cudnn")
    if fn is None:
        return {}
    tq, tk, tv = torch_views((q, k, v), sdpa_layout=True, requires_grad=True)
    tdout = torch_views((dout,), sdpa_layout=True)[0]
    fns = torch_pass_fns(fn, tq, tk, tv, causal, tdout, passes=tuple(passes))
    fns["_out"] = fn(tq, tk, tv, causal).transpose(1, 2)
    return fns


# ---------------------------------------------------------------------------
# The benchmark


def rel_diff(a, b) -> float:
    """||a - b|| / ||b|| (Frobenius, in float32) of two arrays of one shape on the GPU: CuPy arrays (read as
    torch tensors through DLPack, bfloat16 included) or torch tensors; inf where the shapes differ."""
    import torch

    from .bench import to_torch

    x, y = (t if isinstance(t, torch.Tensor) else to_torch(t) for t in (a, b))
    if tuple(x.shape) != tuple(y.shape):
        return float("inf")
    x, y = x.detach().float(), y.detach().float()
    den = float(torch.linalg.vector_norm(y))
    return float(torch.linalg.vector_norm(x - y)) / max(den, 1e-30)


@dataclass
class CaseResult:
    """One row x distribution x pass."""

    row: str
    shape: str
    variant: str
    dist: str
    pass_name: str
    work: Work
    plain_work: Work
    ms: dict = field(default_factory=dict)        # impl -> median ms ("cuflash", "cuflash_plain", peers)
    na: dict = field(default_factory=dict)        # impl -> reason
    check: dict = field(default_factory=dict)     # peer -> relative difference from cuflash's output
    notes: list = field(default_factory=list)

    @property
    def factor(self) -> float:
        return PASS_FLOPS[self.pass_name]

    def tile_tflops(self, impl: str = "cuflash") -> Optional[float]:
        w = self.plain_work if impl in ("cuflash_plain", "sdpa_cudnn") else self.work
        return tflops(self.factor * w.tile_flops, self.ms.get(impl))

    def useful_tflops(self, impl: str = "cuflash") -> Optional[float]:
        w = self.plain_work if impl in ("cuflash_plain", "sdpa_cudnn") else self.work
        return tflops(self.factor * w.useful_flops, self.ms.get(impl))

    def fastest_peer(self) -> Optional[str]:
        timed = [p for p in PEERS if self.ms.get(p) and p not in self.check_failed()]
        return min(timed, key=lambda p: self.ms[p]) if timed else None

    def check_failed(self) -> list:
        return [p for p, x in self.check.items() if not x <= CHECK_BOUND]

    def vs_peer(self) -> Optional[float]:
        """Fastest peer's time / cuflash's (> 1: cuflash faster)."""
        p = self.fastest_peer()
        return self.ms[p] / self.ms["cuflash"] if p and self.ms.get("cuflash") else None

    def vs_plain(self) -> Optional[float]:
        """cuflash's TFLOP/s over visited tiles / plain cuflash's over its own visited tiles."""
        a, b = self.tile_tflops("cuflash"), self.tile_tflops("cuflash_plain")
        return a / b if a and b else None

    def to_json(self) -> dict:
        return {"row": self.row, "shape": self.shape, "variant": self.variant, "dist": self.dist,
                "pass": self.pass_name, "pairs_per_head": self.work.pairs, "tiles_per_head": self.work.tiles,
                "plain_pairs_per_head": self.plain_work.pairs, "plain_tiles_per_head": self.plain_work.tiles,
                "ms": self.ms, "tflops_tiles": {i: self.tile_tflops(i) for i in self.ms},
                "tflops_useful": {i: self.useful_tflops(i) for i in self.ms}, "na": self.na, "check": self.check,
                "vs_fastest_peer": self.vs_peer(), "fastest_peer": self.fastest_peer(),
                "vs_plain_tiles": self.vs_plain(), "notes": self.notes}


def benchmark_case(row: VariantRow, dist: str, *, repeats: int = 20, warmup: int = 3, backward: bool = True,
                   adapters: Optional[dict] = None, log: Callable[[str], None] = print) -> list:
    """The CaseResults (one per pass) of one row on one input distribution: cuflash with the variant, plain
    cuflash, SDPA cuDNN on the plain call, and the peers of ``adapters`` (name -> builder; default: those that
    import), all on the same CuPy inputs, interleaved sample by sample within each pass."""
    import cupy

    from .bench import random_inputs, time_interleaved
    from .distributions import make_inputs

    if adapters is None:
        adapters = {"fa4": fa4_adapter(), "cudnn": cudnn_adapter()}
    passes = VARIANT_PASSES if backward else ("fwd",)
    shape, var = row.shape, row.variant
    results = {p: CaseResult(row.name, replace(shape, causal=False).label(), var.label(), dist, p, work(shape, var),
                             work(shape, var.plain))
               for p in passes}

    def na(impl, reason):
        for r in results.values():
            r.na[impl] = reason

    q, k, v = make_inputs(shape, dist, 0)
    dout = random_inputs(shape, seed=1)[0]
    fns, outs = {}, {}
    try:
        built = cuflash_fns(q, k, v, dout, var, passes)
        for p in passes:
            built[p]()
        cupy.cuda.get_current_stream().synchronize()
        outs["cuflash"] = built.pop("_out")
        fns.update({("cuflash", p): f for p, f in built.items()})
    except Exception as e:  # noqa: BLE001 - reported, and the run fails
        na("cuflash", f"FAILED {_short(e)}")
        log(f"  FAILED cuflash {row.name} [{dist}]: {_short(e)}")
    built = cuflash_fns(q, k, v, dout, var.plain, passes)
    built.pop("_out")
    fns.update({("cuflash_plain", p): f for p, f in built.items()})
    try:
        built = sdpa_cudnn_plain_fns(q, k, v, dout, var.causal, passes)
        built.pop("_out", None)
        fns.update({("sdpa_cudnn", p): f for p, f in built.items()})
        if not built:
            na("sdpa_cudnn", "PyTorch with CUDA (SDPA's cuDNN backend) not available")
    except Exception as e:  # noqa: BLE001 - a peer that cannot run it is n/a
        na("sdpa_cudnn", _short(e))
    for name in PEERS:
        build = adapters.get(name)
        if build is None:
            na(name, {"fa4": "FlashAttention-4 not importable (bench.fa4_status; $CUFLASH_FA4_PATH)",
                      "cudnn": "cudnn-frontend not importable (pip install nvidia-cudnn-frontend)"}[name])
            continue
        why = static_na(name, var)
        if why:
            na(name, why)
            continue
        try:
            built = build(row, q, k, v, dout, passes)
        except Exception as e:  # noqa: BLE001 - FA4 DSL / assertion errors, cuDNN not-supported errors
            na(name, _short(e))
            continue
        outs[name] = built.pop("_out")
        note = built.pop("_note", None)
        if note:
            for r in results.values():
                r.notes.append(f"{name}: {note}")
        fns.update({(name, p): f for p, f in built.items()})
        for p in passes:
            if (name, p) not in fns:
                results[p].na[name] = "this pass did not build"
    if "cuflash" in outs:   # is each peer's call the same call? (its forward output against cuflash's)
        for name in list(outs):
            if name == "cuflash":
                continue
            diff = rel_diff(outs[name], outs["cuflash"])
            for r in results.values():
                r.check[name] = diff
            if not diff <= CHECK_BOUND:
                log(f"  MISMATCH {row.name} [{dist}]: {name}'s forward differs from cuflash's by {diff:.3g} "
                    f"(bound {CHECK_BOUND}): not the same call, or one of them is wrong")
    outs.clear()
    for p in passes:
        timed = time_interleaved({key: f for key, f in fns.items() if key[1] == p}, warmup=warmup, repeats=repeats)
        results[p].ms.update({impl: ms for (impl, _), ms in timed.items()})
    del fns
    free_memory()
    return list(results.values())


def benchmark_variants(rows, dists, *, repeats: int = 20, warmup: int = 3, backward: bool = True,
                       log: Callable[[str], None] = print) -> list:
    """CaseResults for every row x distribution x pass, with one progress line per row and distribution."""
    adapters = {"fa4": fa4_adapter(), "cudnn": cudnn_adapter()}

    def case(row, dist):
        return benchmark_case(row, dist, repeats=repeats, warmup=warmup, backward=backward, adapters=adapters,
                              log=log)

    def failed(row, dist, why):
        shape, var = row.shape, row.variant
        return [CaseResult(row.name, replace(shape, causal=False).label(), var.label(), dist, p, work(shape, var),
                           work(shape, var.plain), na={"cuflash": f"FAILED (the case raised) {why}"})
                for p in (VARIANT_PASSES if backward else ("fwd",))]

    def progress(row, dist, res):
        return f"  {row.name:<15} {dist:<10} | " + " | ".join(
            f"{r.pass_name} {_ms(r.ms.get('cuflash'))} ms x plain {_ratio(r.vs_plain())} x peer {_ratio(r.vs_peer())}"
            for r in res)

    return run_grid(rows, dists, case, failed, progress, log, free_memory)


def failures(results) -> list:
    """Lines saying what went wrong: cuflash failing a call, a peer's output not matching cuflash's."""
    lines = []
    for r in results:
        if "cuflash" in r.na:
            lines.append(f"{r.row} [{r.dist}] {r.pass_name}: cuflash {r.na['cuflash']}")
        for p in r.check_failed():
            lines.append(f"{r.row} [{r.dist}] {r.pass_name}: {p}'s output differs from cuflash's by {r.check[p]:.3g}")
    return list(dict.fromkeys(lines))


# ---------------------------------------------------------------------------
# Tables


def _ms(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _tf(x) -> str:
    return "-" if x is None else f"{x:.0f}"


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.2f}"


TABLE_HEAD = ("row", "dist", "pass", "cuflash ms", "TF/s tiles", "TF/s useful", "plain ms", "plain TF/s tiles",
              "x plain (tiles)", "fa4 ms", "cudnn ms", "sdpa cudnn plain ms", "x fastest peer")


def _cells(r: CaseResult) -> list:
    def peer(name):
        if r.ms.get(name):
            bad = name in r.check_failed()
            return _ms(r.ms[name]) + (" (differs)" if bad else "")
        return "n/a" if name in r.na else "-"
    cuflash = "FAILED" if "cuflash" in r.na else _ms(r.ms.get("cuflash"))
    fastest = r.fastest_peer()
    return [r.row, r.dist, r.pass_name, cuflash, _tf(r.tile_tflops()), _tf(r.useful_tflops()),
            _ms(r.ms.get("cuflash_plain")), _tf(r.tile_tflops("cuflash_plain")), _ratio(r.vs_plain()),
            peer("fa4"), peer("cudnn"), peer("sdpa_cudnn"),
            f"{_ratio(r.vs_peer())} ({fastest})" if fastest else "n/a"]


CONVENTIONS = (f"TF/s tiles: the key tiles the mask policy visits, counted as {TILE}x{TILE} tiles (the convention; "
               f"each kernel's own tiles differ) x {TILE * TILE} x 4 x D; TF/s useful: visible pairs x 4 x D; "
               "forward+backward 3.5x forward. x plain (tiles): the variant's TF/s over its tiles / plain cuflash's "
               "(same shape and causal, nothing else) over its own. x fastest peer: the fastest peer's time for "
               "the same call / cuflash's (> 1: cuflash faster); peers whose output differs from cuflash's are left "
               "out of it. Medians of interleaved, L2-flushed samples.")


def _row_descriptions(results) -> list:
    table = {row.name: row for row in VARIANT_ROWS}
    seen = []
    for r in results:
        if r.row not in seen:
            seen.append(r.row)
    out = []
    for name in seen:
        r = next(x for x in results if x.row == name)
        note = table[name].note if name in table else ""
        out.append(f"{name}: {r.shape}, {r.variant}; {r.work.tiles} tiles and {r.work.pairs} pairs per head "
                   f"(plain: {r.plain_work.tiles} tiles){'; ' + note if note else ''}")
    return out


def format_table(results) -> str:
    return text_report(TABLE_HEAD, [_cells(r) for r in results], range(3), _row_descriptions(results),
                       "n/a and notes:", na_and_note_lines(results, with_dist=False), CONVENTIONS)


def markdown_table(results) -> str:
    return markdown_report(TABLE_HEAD, [_cells(r) for r in results], _row_descriptions(results), "n/a and notes:",
                           na_and_note_lines(results, with_dist=False), CONVENTIONS)


# ---------------------------------------------------------------------------
# Kernels to compile ahead (dev/precompile.py variants)


def kernel_configs(cc: int, rows=VARIANT_ROWS) -> list:
    """The KernelConfigs the rows' variant and plain calls may take (both length classes and cluster modes of
    the forward, both of the backward), deduplicated."""
    from . import heuristics
    from .variants import MaskVariant

    out = {}
    for row in rows:
        var = row.variant
        mv = mask_variant(var)
        for m in {mv, MaskVariant()}:
            for short in (False, True):
                for long_seqs in (False, True):
                    cfg = heuristics.fwd_config(row.shape.dtype, row.shape.head_dim, var.causal, cc, short=short,
                                                long_seqs=long_seqs, variant=m)
                    out[cfg.key()] = cfg
                for cfg in heuristics.bwd_configs(row.shape.dtype, row.shape.head_dim, var.causal, cc, short=short,
                                                  variant=m).all():
                    out[cfg.key()] = cfg
    return list(out.values())


def mask_variant(var: Variant):
    """The kernels' MaskVariant of a variant (cuflash.variants.Variants.kernel; placeholders for the arrays)."""
    from .variants import Variants

    return Variants(var.window[0], var.window[1], var.chunk, var.softcap, var.causal,
                    True if var.alibi else None, True if var.sinks else None).kernel


def replace_row(row: VariantRow, **kw) -> VariantRow:
    """A row with another shape (``batch=``, ``seqlen=`` ...): for quick runs and tests."""
    return replace(row, shape=replace(row.shape, **kw))
