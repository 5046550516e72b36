"""The programmable-attention table of ``python -m cuflash --programmable`` (issue #45's benchmark rows).

Each row is one call at B=4 H=16 N=4096 D=128 bf16, non-causal, with one programmable part:

- ``dropout``: dropout 0.1 (Philox, a fixed seed);
- ``bias``: a (1, H, N, N) bf16 bias, and its gradient dbias in the backward;
- ``keypad``: a key-padding bias (B, 1, 1, N): 0, and -inf past each sequence's length (drawn in [N/2, N]);
- ``sparse50``: a block mask of 128 x 128 blocks (1, H, 32, 32), exactly half of each block row on;
- ``relpos``: a relative-position score_mod, score + table[h, min(|q_idx - kv_idx|, 63)] (float32 (H, 64));
- ``docmask``: a document mask_mod: each sequence packs 8 documents (random boundaries), a query sees its own.

Non-causal throughout: the issue names no causal mask, plain non-causal attention is the fastest baseline to be
held against, and a causal mask on top of the sparse and document masks would mix two maskings in one figure.

Each row is timed forward and forward+backward on the inputs of ``cuflash.distributions`` (default ``normal`` and
``mixed``, the heads of every kind side by side) beside:

- ``plain``: plain cuflash on the same shape (no programmable part; the default kernels, on Hopper the sm90 ones);
- ``portable``: the same plain call on the portable kernels (``fwd_backend=bwd_backend="sm80"``) with the
  deterministic backward, the family programmable attention runs on: the row's cost over plain attention
  split into what its kernels' family costs and what the programmable part costs;
- ``cudnn``: cuDNN's SDPA through cudnn-frontend's graph API (dropout with seed / offset tensors, ``bias`` with
  ``dBias``, the key padding as ``use_padding_mask`` with ``seq_len_kv``; it has no block sparsity, mask
  modifier or table lookup);
- ``fa4``: FlashAttention-4 (``flash_attn.cute``: ``dropout_p`` where its signature has one, ``seqused_k`` for
  the key padding, ``block_sparse_tensors``, a ``score_mod`` / ``mask_mod`` written in the CuTe DSL reading
  ``aux_tensors``; no bias);
- ``flex``: FlexAttention (``torch.nn.attention.flex_attention`` under ``torch.compile``) on the mask and modifier
  rows (issue #45): ``create_block_mask`` of the same masks, the same table in a ``score_mod``.

A peer that lacks the feature gets "n/a" with the reason (:func:`static_na`), one that fails to import, build or
run gets "n/a" with its error; neither stops the run.

FLOPs: 4 x D per (query, key) pair, forward+backward 3.5x the forward (bench.PASS_FLOPS). The dropout, bias and
key-padding rows count every pair (*dense*: the kernels compute them all); the block-sparse, relative-position
and document rows count the visible pairs (*useful*: :func:`visible_pairs`). Plain attention's pairs are all
visible, so "x plain" (the row's TF/s over plain cuflash's) is the ratio of useful speeds that issue #45's goals
name: dropout and the biases within 25 % of plain attention (x plain >= 0.75), the masks and modifiers within
10 % (>= 0.90), and at least 1.05x the fastest peer that has the feature.

Before timing, each peer's forward output is compared with cuflash's on the same inputs (bench_variants.rel_diff,
bound bench_variants.CHECK_BOUND). Dropout draws other masks in each library, so there the outputs are compared
through what they share: each dropout output ``o`` (cuflash's too) against plain attention's ``r`` on the same
inputs, ``o = c r + e`` with ``c = <o, r> / <r, r>``: an unbiased dropout has ``c = 1`` (to about 1e-4 at these
sizes, the noise averaging out over 33 M elements) and its noise ``|e| / |r|`` set by ``p`` alone, so a peer must
have ``|c - 1| <= DROPOUT_BIAS_BOUND`` and noise within a factor DROPOUT_NOISE_FACTOR of cuflash's.

Timings: every implementation of one pass sample by sample in turn (bench.time_interleaved, the L2 cache flushed
before each sample), the median of ``repeats`` samples.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import numpy as np

from . import options
from .bench import PASS_FLOPS, Shape, free_memory
from .bench_report import markdown_report, na_and_note_lines, print_results, run_grid, run_header, text_report
from .bench_variants import CHECK_BOUND, _ms, _ratio, _short, _tf, pick_rows, rel_diff, tflops

PASSES = ("fwd", "fwd+bwd")
DEFAULT_DISTS = ("normal", "mixed")
QUICK_DISTS = ("normal",)
DEFAULT_REPEATS = 20
DEFAULT_WARMUP = 3
PEERS = ("cudnn", "fa4", "flex")

BLOCK = 128                 # the block masks' and the tile lists' blocks (FlexAttention's default, FA4's sm90 tiles)
DROPOUT_P = 0.1
DROPOUT_SEED = 20260045
DOCUMENTS = 8
SPARSE_DENSITY = 0.5
RELPOS_BUCKETS = 64         # distances 0 .. 63, the last one for every longer distance
OPERAND_SEED = 45           # the rows' operands (bias, lengths, blocks, table, documents)
TARGET_VS_PLAIN = {"bias": 0.75, "mask": 0.90}
TARGET_VS_PEER = 1.05
DROPOUT_BIAS_BOUND = 1e-2   # |c - 1| of a dropout output against plain attention's (module docstring)
DROPOUT_NOISE_FACTOR = 1.5  # a peer's dropout noise over cuflash's, either way


# ---------------------------------------------------------------------------
# Rows


ROW_KIND = {"dropout": "bias", "bias": "bias", "keypad": "bias", "sparse50": "mask", "relpos": "mask",
            "docmask": "mask"}
ROW_FEATURE = {
    "dropout": f"dropout {DROPOUT_P:g}",
    "bias": "(1, H, N, N) bias + dbias",
    "keypad": "key-padding bias (B, 1, 1, N), -inf past each sequence's length in [N/2, N]",
    "sparse50": f"{SPARSE_DENSITY * 100:g} % block-sparse mask ({BLOCK} x {BLOCK} blocks, per head)",
    "relpos": f"relative-position score_mod (float32 table (H, {RELPOS_BUCKETS}) by min(|q - k|, "
              f"{RELPOS_BUCKETS - 1}))",
    "docmask": f"document mask_mod ({DOCUMENTS} documents per sequence, random boundaries)",
}


@dataclass(frozen=True)
class ProgRow:
    """One row: its name (a key of ROW_KIND: which programmable part) and its shape."""

    name: str
    shape: Shape
    note: str = ""

    @property
    def kind(self) -> str:
        """"bias" (dropout and the biases: dense FLOPs, goal x plain >= 0.75) or "mask" (the masks and modifiers:
        useful FLOPs, goal >= 0.90)."""
        return ROW_KIND[self.name]

    @property
    def accounting(self) -> str:
        return "dense" if self.kind == "bias" else "useful"

    @property
    def target(self) -> float:
        return TARGET_VS_PLAIN[self.kind]

    def label(self) -> str:
        return f"{self.shape.label()}, {ROW_FEATURE[self.name]}"


SHAPE = Shape(4, 16, 4096, 128, "bfloat16", False)
PROG_ROWS = tuple(ProgRow(name, SHAPE, note) for name, note in (
    ("dropout", ""),
    ("bias", ""),
    ("keypad", "cuflash also computes the bias's gradient (it has no switch to skip it); cuDNN's padding mask "
               "and FA4's seqused_k have none to compute"),
    ("sparse50", ""),
    ("relpos", "no gradient of the table (FA4 and cuDNN return none for such tensors)"),
    ("docmask", ""),
))
ROW_NAMES = tuple(r.name for r in PROG_ROWS)
QUICK_ROWS = ("bias", "docmask")


def rows_by_name(names) -> list:
    """The rows named (ValueError naming the unknown ones), in the order given."""
    return pick_rows(PROG_ROWS, names, "programmable")


def replace_row(row: ProgRow, **kw) -> ProgRow:
    """A row with another shape (``batch=``, ``seqlen=`` ...): for quick runs and tests."""
    return replace(row, shape=replace(row.shape, **kw))


# ---------------------------------------------------------------------------
# The rows' operands on the host (pure functions of the shape and OPERAND_SEED)


def keypad_lengths(batch: int, seqlen_k: int, seed: int = OPERAND_SEED) -> np.ndarray:
    """Each sequence's unpadded key count, int64 (batch,), uniform in [max(1, N / 2), N]."""
    return np.random.default_rng(seed).integers(max(1, seqlen_k // 2), seqlen_k + 1, batch)


def block_grid(seqlen: int, block: int = BLOCK) -> np.ndarray:
    """The sizes of the blocks covering ``seqlen`` (the last one short where block does not divide it)."""
    starts = np.arange(0, seqlen, block)
    return np.minimum(block, seqlen - starts)


def sparse_blocks(heads: int, seqlen_q: int, seqlen_k: int, density: float = SPARSE_DENSITY, block: int = BLOCK,
                  seed: int = OPERAND_SEED) -> np.ndarray:
    """bool (1, heads, query blocks, key blocks): in each block row exactly round(density x key blocks) blocks on
    (at least one), drawn at random per head and row, shared by the batch (so every row does the same work)."""
    mb, nb = len(block_grid(seqlen_q, block)), len(block_grid(seqlen_k, block))
    keep = max(1, int(round(density * nb)))
    draws = np.random.default_rng(seed).random((heads, mb, nb))
    ranks = np.argsort(np.argsort(draws, axis=-1), axis=-1)
    return (ranks < keep)[None]


def document_ids(batch: int, seqlen: int, documents: int = DOCUMENTS, seed: int = OPERAND_SEED) -> np.ndarray:
    """int32 (batch, seqlen): each sequence packs ``documents`` documents one after another (ids 0 .., ascending),
    the boundaries drawn at random per sequence (distinct, so no document is empty)."""
    rng = np.random.default_rng(seed)
    docs = max(1, min(documents, seqlen))
    out = np.empty((batch, seqlen), dtype=np.int32)
    for b in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, seqlen), docs - 1, replace=False))
        out[b] = np.searchsorted(cuts, np.arange(seqlen), side="right")
    return out


def document_blocks(ids: np.ndarray, block: int = BLOCK):
    """(any, all): bool (batch, 1, blocks, blocks) of the document mask of ``ids`` (document_ids: ascending per
    sequence): whether some / every (query, key) pair of a block is in one document."""
    sizes = block_grid(ids.shape[1], block)
    starts = np.arange(len(sizes)) * block
    lo, hi = ids[:, starts], ids[:, starts + sizes - 1]          # the documents a block spans: lo .. hi
    any_on = (lo[:, :, None] <= hi[:, None, :]) & (lo[:, None, :] <= hi[:, :, None])
    single = lo == hi
    all_on = single[:, :, None] & single[:, None, :] & (lo[:, :, None] == lo[:, None, :])
    return any_on[:, None], all_on[:, None]


def relpos_table(heads: int, buckets: int = RELPOS_BUCKETS, seed: int = OPERAND_SEED) -> np.ndarray:
    """float32 (heads * buckets,): the relative-position bias by head and clipped distance, N(0, 1) as a trained
    T5 bias is of order 1."""
    return np.random.default_rng(seed).standard_normal(heads * buckets).astype(np.float32)


def block_lists(on: np.ndarray):
    """(count int32 (..., rows), index int32 (..., rows, cols)): per block row the columns of its on blocks,
    ascending, then zeros: the (num_blocks, indices) form of FlexAttention's BlockMask and FA4's block-sparse
    tensors, from a bool (..., rows, cols)."""
    order = np.argsort(~on, axis=-1, kind="stable")     # on blocks first, each group in column order
    index = np.where(np.take_along_axis(on, order, axis=-1), order, 0)
    return on.sum(axis=-1).astype(np.int32), np.ascontiguousarray(index.astype(np.int32))


# ---------------------------------------------------------------------------
# FLOP accounting


def dense_pairs(shape: Shape) -> int:
    """Every (query, key) pair of the call, summed over batch and heads."""
    return shape.batch * shape.heads * shape.seqlen * shape.nk


def visible_pairs(row: ProgRow) -> int:
    """The (query, key) pairs the row's mask leaves visible, summed over batch and heads (dropout, a bias and a
    score modifier hide none; the key padding hides the padded keys, counted here though cuflash computes them)."""
    s = row.shape
    if row.name == "keypad":
        return s.heads * s.seqlen * int(keypad_lengths(s.batch, s.nk).sum())
    if row.name == "sparse50":
        on = sparse_blocks(s.heads, s.seqlen, s.nk)[0].astype(np.int64)
        rows, cols = block_grid(s.seqlen), block_grid(s.nk)
        return s.batch * int(np.einsum("m,hmn,n->", rows, on, cols))
    if row.name == "docmask":
        ids = document_ids(s.batch, s.seqlen)
        return s.heads * int(sum((np.bincount(x).astype(np.int64) ** 2).sum() for x in ids))
    return dense_pairs(s)


@dataclass(frozen=True)
class Work:
    """A row's forward pairs and FLOPs (multiply by PASS_FLOPS for the others)."""

    pairs: int            # visible pairs, all batches and heads
    dense_pairs: int
    head_dim: int

    @property
    def useful_flops(self) -> float:
        return 4.0 * self.head_dim * self.pairs

    @property
    def dense_flops(self) -> float:
        return 4.0 * self.head_dim * self.dense_pairs

    def flops(self, accounting: str) -> float:
        return self.dense_flops if accounting == "dense" else self.useful_flops


def work(row: ProgRow) -> Work:
    return Work(visible_pairs(row), dense_pairs(row.shape), row.shape.head_dim)


# ---------------------------------------------------------------------------
# Which peer has which feature (before any call: the reasons for "n/a")


def static_na(peer: str, row: ProgRow) -> Optional[str]:
    """Why ``peer`` cannot run ``row`` as the same call, known without trying; None: try it (FA4's dropout is
    decided by its signature when the adapter builds)."""
    if peer == "cudnn":
        return {"sparse50": "cuDNN's SDPA has no block-sparse mask (causal, band and padding masks and a dense "
                            "bias only)",
                "relpos": "cuDNN's score_mod is a graph of pointwise operations: no gather from a table by "
                          "|q - k| (the same bias materialised as (1, H, N, N) is the bias row)",
                "docmask": "cuDNN's SDPA has no mask modifier: a document mask there is a dense -inf bias (the bias "
                           "row's cost) or packed sequences (issue #43's varlen table)"}.get(row.name)
    if peer == "fa4":
        if row.name == "bias":
            return ("FA4 has no attention bias (a score_mod may read one from aux_tensors, but FA4 returns no "
                    "gradient for them: no dbias)")
        return None
    if peer == "flex":
        if row.name == "dropout":
            return "FlexAttention has no dropout"
        if row.kind == "bias":
            return "FlexAttention is timed on the mask and modifier rows (issue #45)"
        return None
    raise ValueError(f"unknown peer {peer!r}")


# ---------------------------------------------------------------------------
# The rows' operands on the device and cuflash's calls


@dataclass
class CaseInputs:
    """One case's device arrays: q, k, v, dout (CuPy, cuflash's layout) and the row's operands (name -> CuPy array:
    "bias", "lengths", "blocks", "table", "doc_ids"), which the peers read through DLPack views."""

    q: object
    k: object
    v: object
    dout: object
    ops: dict


def row_operands(row: ProgRow) -> dict:
    """name -> CuPy array of the row's operands (CaseInputs.ops), drawn from OPERAND_SEED."""
    import cupy

    from ._checks import BFLOAT16

    s = row.shape
    io = {"bfloat16": BFLOAT16, "float16": np.float16}[s.dtype]
    if row.name == "bias":
        rs = cupy.random.RandomState(OPERAND_SEED)
        return {"bias": rs.standard_normal((1, s.heads, s.seqlen, s.nk), dtype=np.float32).astype(io)}
    if row.name == "keypad":
        lengths = keypad_lengths(s.batch, s.nk)
        host = np.where(np.arange(s.nk)[None, :] < lengths[:, None], 0.0, -np.inf).astype(np.float32)
        return {"bias": cupy.asarray(host.reshape(s.batch, 1, 1, s.nk)).astype(io),
                "lengths": cupy.asarray(lengths.astype(np.int32))}
    if row.name == "sparse50":
        return {"blocks": cupy.asarray(sparse_blocks(s.heads, s.seqlen, s.nk))}
    if row.name == "relpos":
        return {"table": cupy.asarray(relpos_table(s.heads))}
    if row.name == "docmask":
        return {"doc_ids": cupy.asarray(document_ids(s.batch, s.seqlen))}
    return {}


def cuflash_kwargs(row: ProgRow, ops: dict) -> dict:
    """cuflash.forward / backward keyword arguments of the row's programmable part."""
    from .modifiers import MaskMod, ScoreMod

    if row.name == "dropout":
        return {"dropout_p": DROPOUT_P, "seed": DROPOUT_SEED}
    if row.name in ("bias", "keypad"):
        return {"bias": ops["bias"]}
    if row.name == "sparse50":
        return {"block_mask": ops["blocks"], "block_size": BLOCK}
    if row.name == "relpos":
        last = RELPOS_BUCKETS - 1
        return {"score_mod": ScoreMod(f"return score + table[h * {RELPOS_BUCKETS} + min(abs(q_idx - kv_idx), "
                                      f"{last})];", grad="return 1.f;", tensors={"table": ops["table"]})}
    if row.name == "docmask":
        n = row.shape.seqlen
        return {"mask_mod": MaskMod(f"const int* d = doc + b * {n}; return d[q_idx] == d[kv_idx];",
                                    tensors={"doc": ops["doc_ids"]}, per_head=False)}
    return {}


def cuflash_fns(inputs: CaseInputs, kwargs: dict, passes=PASSES, *, portable: bool = False) -> dict:
    """pass -> zero-argument callable running cuflash with ``kwargs`` into preallocated outputs ("fwd"; "fwd+bwd":
    forward with lse, then backward), "_out": the forward's output (filled by the first call). ``portable``: the
    portable kernels and the deterministic backward (the programmable kernels' family), options set per call."""
    import contextlib

    import cupy

    from . import backward, forward

    q, k, v, dout = inputs.q, inputs.k, inputs.v, inputs.dout
    out = cupy.empty_like(q)
    dq, dk, dv = (cupy.empty_like(x) for x in (q, k, v))

    def family():
        return options.override(fwd_backend="sm80", bwd_backend="sm80") if portable else contextlib.nullcontext()

    def fwd():
        with family():
            forward(q, k, v, out=out, **kwargs)

    def fwd_bwd():
        with family():
            o, lse = forward(q, k, v, return_lse=True, out=out, **kwargs)
            backward(dout, q, k, v, o, lse, dq=dq, dk=dk, dv=dv, deterministic=portable, **kwargs)

    fns = {p: f for p, f in (("fwd", fwd), ("fwd+bwd", fwd_bwd)) if p in passes}
    fns["_out"] = out
    return fns


# ---------------------------------------------------------------------------
# Peer adapters: each returns (builder, None), or (None, why not). A builder
# ``build(row, inputs, passes) -> {pass: fn, "_out": forward output (B, N, H, D)}`` raises where the peer cannot
# run the row; "_note": a line for the table's notes.


def _first(res):
    return res[0] if isinstance(res, (tuple, list)) else res


def _grad_fn(torch, call: Callable, inputs: tuple, dout) -> Callable:
    """forward+backward of a torch ``call`` through autograd, called once here (a peer that cannot run its
    backward raises now, and a compiling one compiles before the timing)."""
    def fwd_bwd():
        return torch.autograd.grad(call(), inputs, dout)
    fwd_bwd()
    return fwd_bwd


def cudnn_adapter():
    """cuDNN's SDPA through cudnn-frontend's graph API (``pip install nvidia-cudnn-frontend``; it loads the cuDNN
    that PyTorch loads) on torch views of cuflash's arrays."""
    from .bench import torch_cuda

    torch, why = torch_cuda()
    if torch is None:
        return None, why
    try:
        import cudnn
    except Exception as e:  # noqa: BLE001 - optional
        return None, f"cudnn-frontend not importable ({_short(e)}; pip install nvidia-cudnn-frontend)"

    def build(row: ProgRow, inputs: CaseInputs, passes=PASSES) -> dict:
        import cupy

        from .bench import to_torch, torch_views

        why = static_na("cudnn", row)
        if why:
            raise NotImplementedError(why)
        io = {"bfloat16": cudnn.data_type.BFLOAT16, "float16": cudnn.data_type.HALF}[row.shape.dtype]
        f32 = cudnn.data_type.FLOAT
        types = {torch.float32: f32, torch.int32: cudnn.data_type.INT32, torch.int64: cudnn.data_type.INT64,
                 torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float16: cudnn.data_type.HALF}
        tq, tk, tv, tdo = torch_views((inputs.q, inputs.k, inputs.v, inputs.dout), sdpa_layout=True)
        b, hq, nq, d = tq.shape
        out = torch.empty((b, nq, hq, d), dtype=tq.dtype, device=tq.device).transpose(1, 2)
        stats = torch.empty(b, hq, nq, 1, dtype=torch.float32, device=tq.device)
        grads = [torch.empty_like(x.transpose(1, 2)).transpose(1, 2) for x in (tq, tk, tv)]
        handle = cudnn.create_handle()
        cudnn.set_stream(handle=handle, stream=cupy.cuda.get_current_stream().ptr)
        # The row's part: torch tensors by role, each graph makes its own cuDNN tensors of them.
        extra = {}
        if row.name == "dropout":
            extra["seed"] = torch.full((1, 1, 1, 1), DROPOUT_SEED, dtype=torch.int64, device=tq.device)
            extra["offset"] = torch.zeros((1, 1, 1, 1), dtype=torch.int64, device=tq.device)
        elif row.name == "bias":
            extra["bias"] = to_torch(inputs.ops["bias"])
            extra["dbias"] = torch.empty_like(extra["bias"])
        elif row.name == "keypad":
            extra["seq_q"] = torch.full((b, 1, 1, 1), nq, dtype=torch.int32, device=tq.device)
            extra["seq_kv"] = to_torch(inputs.ops["lengths"]).reshape(b, 1, 1, 1)

        def graph():
            return cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=handle)

        def tensor(g, pack, name, t):
            ct = g.tensor(name=name, dim=list(t.shape), stride=list(t.stride()), data_type=types[t.dtype])
            pack[ct] = t
            return ct

        def row_kwargs(g, pack, backward: bool) -> dict:
            kw = {}
            if row.name == "dropout":
                kw["dropout"] = (DROPOUT_P, tensor(g, pack, "seed", extra["seed"]),
                                 tensor(g, pack, "offset", extra["offset"]))
            elif row.name == "bias":
                kw["bias"] = tensor(g, pack, "bias", extra["bias"])
                if backward:
                    kw["dBias"] = tensor(g, pack, "dbias", extra["dbias"])
            elif row.name == "keypad":
                kw.update(use_padding_mask=True, seq_len_q=tensor(g, pack, "seq_q", extra["seq_q"]),
                          seq_len_kv=tensor(g, pack, "seq_kv", extra["seq_kv"]))
            return kw

        def output(pack, ct, t, dtype):
            ct.set_output(True).set_dim(list(t.shape)).set_stride(list(t.stride())).set_data_type(dtype)
            pack[ct] = t

        def finish(g, pack):
            g.validate()
            g.build_operation_graph()
            g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            g.check_support()
            g.build_plans()
            ws = torch.empty(max(1, g.get_workspace_size()), dtype=torch.uint8, device=tq.device)
            return lambda: g.execute(pack, ws, handle=handle)

        def forward_graph(training: bool):
            g, pack = graph(), {}
            kw = dict(name="sdpa", q=tensor(g, pack, "q", tq), k=tensor(g, pack, "k", tk),
                      v=tensor(g, pack, "v", tv), attn_scale=1.0 / math.sqrt(d), **row_kwargs(g, pack, False))
            try:
                o, st = g.sdpa(**kw, generate_stats=training)
            except TypeError:   # releases before generate_stats took is_inference
                o, st = g.sdpa(**kw, is_inference=not training)
            output(pack, o, out, io)
            if training:
                output(pack, st, stats, f32)
            return finish(g, pack)

        def backward_graph():
            g, pack = graph(), {}
            kw = dict(name="sdpa_backward", q=tensor(g, pack, "q", tq), k=tensor(g, pack, "k", tk),
                      v=tensor(g, pack, "v", tv), o=tensor(g, pack, "o", out), dO=tensor(g, pack, "dO", tdo),
                      stats=tensor(g, pack, "stats", stats), attn_scale=1.0 / math.sqrt(d),
                      **row_kwargs(g, pack, True))
            for ct, t in zip(g.sdpa_backward(**kw), grads):
                output(pack, ct, t, io)
            return finish(g, pack)

        fns = {"_out": out.transpose(1, 2)}
        try:
            infer = forward_graph(False)
        except Exception as e:  # noqa: BLE001 - e.g. dropout refused at inference: time the training forward
            infer = forward_graph(True)
            fns["_note"] = f"forward timed with its stats (the inference graph was refused: {_short(e)})"
        infer()
        fns["fwd"] = infer
        if "fwd+bwd" in passes:
            train, bwd = forward_graph(True), backward_graph()

            def fwd_bwd():
                train()
                bwd()
            fwd_bwd()
            fns["fwd+bwd"] = fwd_bwd
        return fns

    return build, None


@functools.lru_cache(maxsize=None)
def _fa4_modifiers() -> dict:
    """FA4's relative-position score_mod (and its score_mod_bwd) and document mask_mod in the CuTe DSL, reading
    ``aux_tensors`` one element per call (FA4 calls them with vectors of one where aux tensors are given), made once
    so that FA4's compile cache (keyed on the function) holds across cases."""
    import operator

    import cutlass
    import cutlass.cute as cute
    from cutlass._mlir.dialects import math as mlir_math

    rmem = getattr(cute, "make_rmem_tensor", None) or cute.make_fragment   # older CuTe DSLs: make_fragment
    last = RELPOS_BUCKETS - 1

    @cute.jit
    def relpos(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        table = aux_tensors[0]                            # float32 (H * RELPOS_BUCKETS,)
        diff = q_idx - kv_idx
        dist = cute.TensorSSA(mlir_math.absi(diff), diff.shape, diff.dtype)
        dist = cute.where(operator.le(dist, cute.full_like(dist, last)), dist, cute.full_like(dist, last))
        at = rmem(1, cutlass.Int32)
        at.store(h_idx * cute.full_like(h_idx, RELPOS_BUCKETS) + dist)
        val = rmem(1, table.element_type)
        val[0] = table[at[0]]
        return score + val.load().to(cutlass.Float32)

    @cute.jit
    def relpos_bwd(grad, score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return grad                                       # d(score + table[...]) / d(score) = 1

    @cute.jit
    def same_document(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
        doc = aux_tensors[0]                              # int32 (B, N)
        m_doc, n_doc = rmem(1, cutlass.Int32), rmem(1, cutlass.Int32)
        m_doc[0] = doc[batch[0], m_idx[0]]
        n_doc[0] = doc[batch[0], n_idx[0]]
        return m_doc.load() == n_doc.load()

    return {"relpos": relpos, "relpos_bwd": relpos_bwd, "docmask": same_document}


def _fa4_block_sparse(torch, any_on: np.ndarray, all_on: np.ndarray, batch: int, heads: int, device):
    """FA4's BlockSparseTensorsTorch for the forward (per query block its key blocks: partial ones as "mask"
    blocks, whole ones as "full") and for the backward (the transpose), at BLOCK x BLOCK, (batch, heads) each."""
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    def tensors(any_b, all_b):
        shape = (batch, heads) + any_b.shape[2:]
        part_cnt, part_idx = block_lists(np.broadcast_to(any_b & ~all_b, shape))
        full_cnt, full_idx = block_lists(np.broadcast_to(all_b, shape))
        names = ("mask_block_cnt", "mask_block_idx", "full_block_cnt", "full_block_idx")
        parts = {n: torch.from_numpy(x).to(device) for n, x in zip(names, (part_cnt, part_idx, full_cnt, full_idx))}
        try:
            return BlockSparseTensorsTorch(**parts, block_size=(BLOCK, BLOCK))
        except TypeError:   # releases without block_size: their sm90 blocks are 128 x 128
            return BlockSparseTensorsTorch(**parts)

    return tensors(any_on, all_on), tensors(np.swapaxes(any_on, -1, -2), np.swapaxes(all_on, -1, -2))


def fa4_adapter():
    """FlashAttention-4 (``flash_attn.cute``, $CUFLASH_FA4_PATH: see bench._import_fa4) on torch views of cuflash's
    arrays, backward through torch autograd."""
    from .bench import _import_fa4, fa4_torch

    torch, why = fa4_torch()
    if torch is None:
        return None, why
    fn, _ = _import_fa4()

    def build(row: ProgRow, inputs: CaseInputs, passes=PASSES) -> dict:
        import inspect

        from .bench import to_torch, torch_views

        why = static_na("fa4", row)
        if why:
            raise NotImplementedError(why)
        s = row.shape
        tq, tk, tv = torch_views((inputs.q, inputs.k, inputs.v), requires_grad=True)
        tdout = torch_views((inputs.dout,))[0]
        call_fn, kw = fn, {}
        if row.name == "dropout":
            if "dropout_p" not in inspect.signature(fn).parameters:
                raise NotImplementedError("FA4's flash_attn_func takes no dropout_p (this release has no dropout)")
            kw["dropout_p"] = DROPOUT_P
        elif row.name == "keypad":
            from flash_attn.cute import flash_attn_varlen_func

            call_fn = flash_attn_varlen_func
            kw["seqused_k"] = to_torch(inputs.ops["lengths"])
        elif row.name == "sparse50":
            on = inputs.ops["blocks"].get()
            kw["block_sparse_tensors"], kw["block_sparse_tensors_bwd"] = _fa4_block_sparse(
                torch, on, on, s.batch, s.heads, tq.device)
        elif row.name == "relpos":
            mods = _fa4_modifiers()
            kw.update(score_mod=mods["relpos"], score_mod_bwd=mods["relpos_bwd"],
                      aux_tensors=[to_torch(inputs.ops["table"])])
        elif row.name == "docmask":
            any_on, all_on = document_blocks(inputs.ops["doc_ids"].get())
            kw["block_sparse_tensors"], kw["block_sparse_tensors_bwd"] = _fa4_block_sparse(
                torch, any_on, all_on, s.batch, s.heads, tq.device)
            kw.update(mask_mod=_fa4_modifiers()["docmask"], aux_tensors=[to_torch(inputs.ops["doc_ids"])])

        def call():
            return _first(call_fn(tq, tk, tv, **kw))

        out = call()   # raises here if FA4 cannot run it (and compiles)
        fns = {"fwd": call, "_out": out}
        if "fwd+bwd" in passes:
            fns["fwd+bwd"] = _grad_fn(torch, call, (tq, tk, tv), tdout)
        return fns

    return build, None


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    """flex_attention under torch.compile, made once (its compiled graphs are cached per score_mod and mask)."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex_relpos(table):
    """FlexAttention's score_mod of the relpos row (``table``: the torch float32 (H * RELPOS_BUCKETS,))."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h * RELPOS_BUCKETS + (q_idx - kv_idx).abs().clamp(max=RELPOS_BUCKETS - 1)]
    return score_mod


def _flex_blocks(blocks):
    """FlexAttention's mask_mod of the sparse50 row (``blocks``: the torch bool (H, query blocks, key blocks))."""
    def mask_mod(b, h, q_idx, kv_idx):
        return blocks[h, q_idx // BLOCK, kv_idx // BLOCK]
    return mask_mod


def _flex_documents(doc_ids):
    """FlexAttention's mask_mod of the docmask row (``doc_ids``: the torch int32 (B, N))."""
    def mask_mod(b, h, q_idx, kv_idx):
        return doc_ids[b, q_idx] == doc_ids[b, kv_idx]
    return mask_mod


def flex_adapter():
    """FlexAttention (``torch.nn.attention.flex_attention`` compiled with torch.compile) on torch views of cuflash's
    arrays ((B, H, N, D) views, as it takes them), backward through torch autograd."""
    from .bench import torch_cuda

    torch, why = torch_cuda()
    if torch is None:
        return None, why
    try:
        from torch.nn.attention.flex_attention import create_block_mask
    except Exception as e:  # noqa: BLE001 - PyTorch before 2.5
        return None, f"FlexAttention not importable ({_short(e)})"

    def build(row: ProgRow, inputs: CaseInputs, passes=PASSES) -> dict:
        from .bench import to_torch, torch_views

        why = static_na("flex", row)
        if why:
            raise NotImplementedError(why)
        s = row.shape
        tq, tk, tv = torch_views((inputs.q, inputs.k, inputs.v), sdpa_layout=True, requires_grad=True)
        tdout = torch_views((inputs.dout,), sdpa_layout=True)[0]
        score_mod = block_mask = None
        if row.name == "sparse50":
            blocks = torch.from_numpy(inputs.ops["blocks"].get()[0]).to(tq.device)   # bool: no DLPack needed
            block_mask = create_block_mask(_flex_blocks(blocks), None, s.heads, s.seqlen, s.nk, device=tq.device,
                                           BLOCK_SIZE=BLOCK)
        elif row.name == "relpos":
            score_mod = _flex_relpos(to_torch(inputs.ops["table"]))
        elif row.name == "docmask":
            block_mask = create_block_mask(_flex_documents(to_torch(inputs.ops["doc_ids"])), s.batch, None, s.seqlen,
                                           s.nk, device=tq.device, BLOCK_SIZE=BLOCK)
        flex = _compiled_flex()

        def call():
            return flex(tq, tk, tv, score_mod=score_mod, block_mask=block_mask)

        out = call()   # compiles, or raises
        fns = {"fwd": call, "_out": out.transpose(1, 2)}
        if "fwd+bwd" in passes:
            fns["fwd+bwd"] = _grad_fn(torch, call, (tq, tk, tv), tdout)
        return fns

    return build, None


def peer_adapters() -> dict:
    """name -> (builder or None, why not)."""
    out = {}
    for name, make in (("cudnn", cudnn_adapter), ("fa4", fa4_adapter), ("flex", flex_adapter)):
        try:
            out[name] = make()
        except Exception as e:  # noqa: BLE001 - a broken install must not stop the run
            out[name] = (None, _short(e))
    return out


# ---------------------------------------------------------------------------
# Checks: is each peer's call the same call?


def projection(xy: float, yy: float, xx: float):
    """(c, noise) of x against y from their dot products: x = c y + e with e orthogonal to y, c = <x, y> / <y, y>,
    noise = |e| / |y| (0 where y is 0)."""
    if yy <= 0:
        return math.nan, math.nan
    c = xy / yy
    return c, math.sqrt(max(xx - c * xy, 0.0) / yy)


def dropout_stats(out, ref):
    """(c, noise) of a dropout forward output against plain attention's on the same inputs (:func:`projection`, in
    float64): CuPy arrays or torch tensors on the GPU."""
    import torch

    from .bench import to_torch

    x, y = (t if isinstance(t, torch.Tensor) else to_torch(t) for t in (out, ref))
    x, y = x.detach().double().flatten(), y.detach().double().flatten()
    return projection(float(x @ y), float(y @ y), float(x @ x))


def dropout_checks(outs: dict, ref) -> tuple:
    """The dropout row's checks from ``outs`` (impl -> dropout forward output, "cuflash" among them) and plain
    attention's ``ref``: ({key: value}, {key: bound}, notes). "cuflash" and each peer: |c - 1| (an unbiased
    dropout); "<peer>:noise": |ln(the peer's noise / cuflash's)| (the same dropout rate)."""
    stats = {name: dropout_stats(o, ref) for name, o in outs.items()}
    values, bounds, notes = {}, {}, []
    for name, (c, noise) in stats.items():
        values[name], bounds[name] = abs(c - 1.0), DROPOUT_BIAS_BOUND
        notes.append(f"dropout: {name}'s output = {c:.5f} x plain attention's + noise {noise:.4f} of its norm")
        if name != "cuflash" and "cuflash" in stats:
            ratio = noise / stats["cuflash"][1] if stats["cuflash"][1] else math.nan
            values[f"{name}:noise"] = abs(math.log(ratio)) if ratio > 0 else math.inf
            bounds[f"{name}:noise"] = math.log(DROPOUT_NOISE_FACTOR)
    return values, bounds, notes


# ---------------------------------------------------------------------------
# Results


@dataclass
class ProgResult:
    """One row x distribution x pass."""

    row: str
    label: str
    dist: str
    pass_name: str
    work: Work
    accounting: str      # "dense" or "useful": the row's FLOPs (the peers' too); plain's are dense
    target: float        # the goal for x plain
    ms: dict = field(default_factory=dict)       # impl -> median ms ("cuflash", "plain", "portable", peers)
    na: dict = field(default_factory=dict)       # impl -> reason
    check: dict = field(default_factory=dict)    # key ("<impl>" or "<impl>:<what>") -> value
    bounds: dict = field(default_factory=dict)   # key -> bound (default CHECK_BOUND)
    notes: list = field(default_factory=list)

    @property
    def factor(self) -> float:
        return PASS_FLOPS[self.pass_name]

    def tflops(self, impl: str = "cuflash") -> Optional[float]:
        """TF/s of ``impl``: the row's FLOPs for cuflash and the peers, the dense call's for plain and portable."""
        flops = self.work.dense_flops if impl in ("plain", "portable") else self.work.flops(self.accounting)
        return tflops(self.factor * flops, self.ms.get(impl))

    def check_failed(self) -> list:
        """The implementations with a check above its bound (NaN fails)."""
        bad = [key.split(":")[0] for key, x in self.check.items() if not x <= self.bounds.get(key, CHECK_BOUND)]
        return list(dict.fromkeys(bad))

    def fastest_peer(self) -> Optional[str]:
        failed = self.check_failed()
        timed = [p for p in PEERS if self.ms.get(p) and p not in failed]
        return min(timed, key=lambda p: self.ms[p]) if timed else None

    def vs_peer(self) -> Optional[float]:
        """The fastest peer's time / cuflash's (> 1: cuflash faster)."""
        p = self.fastest_peer()
        return self.ms[p] / self.ms["cuflash"] if p and self.ms.get("cuflash") else None

    def _vs(self, base: str) -> Optional[float]:
        a, b = self.tflops("cuflash"), self.tflops(base)
        return a / b if a and b else None

    def vs_plain(self) -> Optional[float]:
        """cuflash's TF/s over plain cuflash's (the issue's goal: >= target)."""
        return self._vs("plain")

    def vs_portable(self) -> Optional[float]:
        """cuflash's TF/s over plain attention's on the same (portable) kernel family."""
        return self._vs("portable")

    def verdict(self) -> str:
        """"yes" where both goals are met; else which is missed; "-" where cuflash has no time."""
        plain, peer = self.vs_plain(), self.vs_peer()
        if plain is None:
            return "-"
        missed = (["plain"] if plain < self.target else []) + (["peer"] if peer is not None and
                                                                peer < TARGET_VS_PEER else [])
        text = "no: " + ", ".join(missed) if missed else "yes"
        return text + (" (no peer)" if peer is None else "")

    def to_json(self) -> dict:
        return {"row": self.row, "label": self.label, "dist": self.dist, "pass": self.pass_name,
                "accounting": self.accounting, "pairs": self.work.pairs, "dense_pairs": self.work.dense_pairs,
                "ms": self.ms, "tflops": {i: self.tflops(i) for i in self.ms}, "na": self.na, "check": self.check,
                "bounds": self.bounds, "vs_plain": self.vs_plain(), "target_vs_plain": self.target,
                "vs_portable": self.vs_portable(), "vs_fastest_peer": self.vs_peer(),
                "fastest_peer": self.fastest_peer(), "target_vs_peer": TARGET_VS_PEER, "verdict": self.verdict(),
                "notes": self.notes}


# ---------------------------------------------------------------------------
# The benchmark


def benchmark_case(row: ProgRow, dist: str, *, repeats: int = DEFAULT_REPEATS, warmup: int = DEFAULT_WARMUP,
                   backward: bool = True, adapters: Optional[dict] = None,
                   log: Callable[[str], None] = print) -> list:
    """The ProgResults (one per pass) of one row on one distribution: cuflash with the row's part, plain cuflash,
    plain on the portable kernels and the peers of ``adapters`` (name -> (builder, why not); default:
    peer_adapters()), all on the same CuPy inputs, interleaved sample by sample within each pass."""
    if adapters is None:
        adapters = peer_adapters()
    return _case(row, dist, repeats, warmup, PASSES if backward else ("fwd",), adapters, log)


def _sync() -> None:
    import cupy

    cupy.cuda.get_current_stream().synchronize()


def _case(row: ProgRow, dist: str, repeats: int, warmup: int, passes: tuple, adapters: dict, log) -> list:
    from .bench import random_inputs, time_interleaved_or_alone
    from .distributions import make_inputs

    w = work(row)
    results = {p: ProgResult(row.name, row.label(), dist, p, w, row.accounting, row.target) for p in passes}

    def na(impl, reason):
        for r in results.values():
            r.na[impl] = reason

    q, k, v = make_inputs(row.shape, dist, 0)
    inputs = CaseInputs(q, k, v, random_inputs(row.shape, seed=1)[0], row_operands(row))
    fns, outs = {}, {}

    def add(impl, built):
        outs[impl] = built.pop("_out")
        fns.update({(impl, p): f for p, f in built.items() if p in passes})

    try:
        built = cuflash_fns(inputs, cuflash_kwargs(row, inputs.ops), passes)
        for p in passes:
            built[p]()
        _sync()   # an asynchronous launch failure shows here, not in the timing
        add("cuflash", built)
    except Exception as e:  # noqa: BLE001 - reported, and the run fails
        na("cuflash", f"FAILED {_short(e)}")
        log(f"  FAILED cuflash {row.name} [{dist}]: {_short(e)}")
    for impl, portable in (("plain", False), ("portable", True)):
        try:
            built = cuflash_fns(inputs, {}, passes, portable=portable)
            for p in passes:
                built[p]()
            add(impl, built)
        except Exception as e:  # noqa: BLE001 - no baseline: its ratio is left out
            na(impl, f"FAILED {_short(e)}")
    for name in PEERS:
        build, why = adapters.get(name, (None, "not run"))
        why = static_na(name, row) or (why if build is None else None)   # lacking the feature says more
        if why:
            na(name, why)
            continue
        try:
            built = build(row, inputs, passes)
        except Exception as e:  # noqa: BLE001 - FA4 DSL / assertion errors, cuDNN not-supported, compile errors
            na(name, _short(e))
            log(f"  {name} n/a on {row.name} [{dist}]: {_short(e)}")
            continue
        note = built.pop("_note", None)
        if note:
            for r in results.values():
                r.notes.append(f"{name}: {note}")
        add(name, built)
    _check(row, dist, results, outs, log)
    outs.clear()
    for p in passes:
        results[p].ms.update(time_interleaved_or_alone(
            {impl: f for (impl, pp), f in fns.items() if pp == p}, results[p], warmup=warmup, repeats=repeats,
            log=log, what=f"{row.name} [{dist}] {p}"))
    fns.clear()   # the closures hold the case's arrays
    del inputs
    free_memory()
    return list(results.values())


def _check(row: ProgRow, dist: str, results: dict, outs: dict, log) -> None:
    """Each peer's forward output against cuflash's (dropout: dropout_checks against plain attention's), into
    ``results``; a mismatch is logged."""
    if "cuflash" not in outs:
        return
    values, bounds, notes = {}, {}, []
    try:
        if row.name == "dropout":
            if "plain" in outs:
                values, bounds, notes = dropout_checks({n: o for n, o in outs.items()
                                                        if n not in ("plain", "portable")}, outs["plain"])
        else:
            values = {n: rel_diff(o, outs["cuflash"]) for n, o in outs.items() if n in PEERS}
    except Exception as e:  # noqa: BLE001 - no torch: nothing to compare with
        notes.append(f"outputs not compared: {_short(e)}")
    for r in results.values():
        r.check.update(values)
        r.bounds.update(bounds)
        r.notes.extend(notes)
    for key, x in values.items():
        bound = bounds.get(key, CHECK_BOUND)
        if not x <= bound:
            log(f"  MISMATCH {row.name} [{dist}]: {key} {x:.3g} (bound {bound:.3g}): not the same call, or one of "
                f"them is wrong")


def benchmark_programmable(rows, dists, *, repeats: int = DEFAULT_REPEATS, warmup: int = DEFAULT_WARMUP,
                           backward: bool = True, adapters: Optional[dict] = None,
                           log: Callable[[str], None] = print) -> list:
    """ProgResults for every row x distribution x pass, a progress line per row and distribution."""
    if adapters is None:
        adapters = peer_adapters()

    def case(row, dist):
        return benchmark_case(row, dist, repeats=repeats, warmup=warmup, backward=backward, adapters=adapters,
                              log=log)

    def failed(row, dist, why):
        return [ProgResult(row.name, row.label(), dist, p, work(row), row.accounting, row.target,
                           na={"cuflash": f"FAILED (the case raised) {why}"})
                for p in (PASSES if backward else ("fwd",))]

    def progress(row, dist, res):
        return f"  {row.name:<9} {dist:<8} | " + " | ".join(
            f"{r.pass_name} {_ms(r.ms.get('cuflash'))} ms {_tf(r.tflops())} TF/s x plain {_ratio(r.vs_plain())} "
            f"x peer {_ratio(r.vs_peer())}" for r in res)

    return run_grid(rows, dists, case, failed, progress, log, free_memory)


def failures(results) -> list:
    """Lines saying what went wrong: cuflash failing a call, an output that is not the same call (cuflash's own
    dropout included). Goals missed are not failures: the table says them."""
    lines = []
    for r in results:
        if "cuflash" in r.na:
            lines.append(f"{r.row} [{r.dist}] {r.pass_name}: cuflash {r.na['cuflash']}")
        for key, x in r.check.items():
            bound = r.bounds.get(key, CHECK_BOUND)
            if not x <= bound:
                lines.append(f"{r.row} [{r.dist}]: check {key} = {x:.3g} above its bound {bound:.3g}")
    return list(dict.fromkeys(lines))


# ---------------------------------------------------------------------------
# Tables


TABLE_HEAD = ("row", "dist", "pass", "cuflash ms", "TF/s", "plain ms", "x plain", "goal", "portable ms",
              "x portable", "cudnn ms", "fa4 ms", "flex ms", "x fastest peer", "met")


def _cells(r: ProgResult) -> list:
    failed = r.check_failed()

    def impl(name):
        if r.ms.get(name):
            return _ms(r.ms[name]) + (" (differs)" if name in failed else "")
        return "n/a" if name in r.na else "-"

    fastest = r.fastest_peer()
    return [r.row, r.dist, r.pass_name, "FAILED" if "cuflash" in r.na else impl("cuflash"), _tf(r.tflops()),
            impl("plain"), _ratio(r.vs_plain()), f">= {r.target:.2f}", impl("portable"), _ratio(r.vs_portable()),
            impl("cudnn"), impl("fa4"), impl("flex"), f"{_ratio(r.vs_peer())} ({fastest})" if fastest else "n/a",
            r.verdict()]


CONVENTIONS = ("TF/s: 4 x D per (query, key) pair, forward+backward 3.5x forward; dense pairs (all of them) on the "
               "dropout, bias and keypad rows, useful pairs (those the mask leaves visible) on the sparse50, relpos "
               "and docmask rows; plain and portable: the same shape without the programmable part (dense). "
               "x plain: cuflash's TF/s / plain cuflash's (default kernels), goal >= 0.75 (dropout, biases) or "
               f">= 0.90 (masks, modifiers); x portable: the same against plain attention on the portable kernels "
               f"with the deterministic backward (the programmable kernels' family). x fastest peer: the fastest "
               f"peer's time for the same call / cuflash's, goal >= {TARGET_VS_PEER}; peers whose output is not the "
               "same call are marked (differs) and left out of it. met: yes, or which goal is missed. Medians of "
               "interleaved, L2-flushed samples.")


def _row_descriptions(results) -> list:
    out = {}
    for r in results:
        if r.row not in out:
            pct = 100.0 * r.work.pairs / r.work.dense_pairs if r.work.dense_pairs else 0.0
            note = next((x.note for x in PROG_ROWS if x.name == r.row and x.note), "")
            out[r.row] = (f"{r.row}: {r.label}; counted {r.accounting}: {r.work.pairs} of {r.work.dense_pairs} pairs "
                          f"visible ({pct:.1f} %)" + (f"; {note}" if note else ""))
    return list(out.values())


def format_table(results) -> str:
    return text_report(TABLE_HEAD, [_cells(r) for r in results], range(3), _row_descriptions(results),
                       "n/a and notes:", na_and_note_lines(results), CONVENTIONS)


def markdown_table(results, header: str = "") -> str:
    return markdown_report(TABLE_HEAD, [_cells(r) for r in results], _row_descriptions(results), "n/a and notes:",
                           na_and_note_lines(results), CONVENTIONS, header)


def peer_versions() -> str:
    """PyTorch's (FlexAttention's), FA4's and cudnn-frontend's versions, or why not, for the header."""
    from .bench_varlen import peer_versions as fa4_and_cudnn

    try:
        import torch

        flex = f"PyTorch {torch.__version__} (FlexAttention)"
    except Exception as e:  # noqa: BLE001
        flex = f"PyTorch not importable ({_short(e)})"
    return f"{flex}; {fa4_and_cudnn()}"


def run(args, device: str, cc: int) -> int:
    """The programmable table: printed (and as Markdown, JSON); 1 if cuflash failed a call or a check failed."""
    from .bench_report import git_commit

    rows = rows_by_name(args.rows)
    head = (run_header("programmable-attention table (issue #45)", device, cc, [peer_versions()], args.warmup,
                       args.repeats) + f"; rows {', '.join(args.rows)} x {', '.join(args.dists)}")
    print(head)
    adapters = peer_adapters()
    for name, (build, why) in adapters.items():
        print(f"  {name}: {'found' if build else why}")
    results = benchmark_programmable(rows, args.dists, repeats=args.repeats, warmup=args.warmup,
                                     backward=not args.forward_only, adapters=adapters)

    def doc():
        return {"header": head, "device": device, "cc": cc, "commit": git_commit(),
                "rows": [{"name": r.name, "label": r.label(), "accounting": r.accounting,
                          "target_vs_plain": r.target} for r in rows],
                "dists": list(args.dists), "results": [r.to_json() for r in results]}

    return print_results(args, format_table(results), lambda: markdown_table(results, head), doc, failures(results))
