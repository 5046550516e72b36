"""``python -m cuflash``: environment report, kernel compilation, self-check, benchmark table."""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time

from . import __version__, bench, options


def _progress(i: int, n: int, cfg) -> None:
    width = 30
    done = int(width * i / max(n, 1))
    label = cfg.key() if cfg is not None else "done"
    sys.stdout.write(f"\r  compiling [{'#' * done}{'.' * (width - done)}] {i}/{n} {label:<60}")
    if cfg is None:
        sys.stdout.write("\n")
    sys.stdout.flush()


def _parse_shape(text: str):
    """B,H,N,D,dtype[,causal] -> Shape."""
    from .bench import Shape

    try:
        return Shape.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _build_table_kernels(what: str, configs: list, device_id: int) -> None:
    """Compiles a table's own kernels, saying which failed: such a kernel fails its rows, not the run."""
    from . import dispatch

    t0, bad = time.time(), []
    for i, cfg in enumerate(configs):
        _progress(i, len(configs), cfg)
        try:
            dispatch.get_kernel(cfg, device_id)
        except Exception as e:  # noqa: BLE001 - said below, and the rows that need it fail loudly
            bad.append(f"{cfg.key()}: {type(e).__name__}: {' '.join(str(e).split())[:200]}")
    _progress(len(configs), len(configs), None)
    print(f"  {len(configs) - len(bad)} of {len(configs)} {what} kernels ready in {time.time() - t0:.1f} s")
    for line in bad:
        print(f"  FAILED to build {line}")


def self_check(device_id: int) -> list[tuple[str, float, float]]:
    """Small cases against the float64 reference: (label, rel err, bound)."""
    import cupy
    import numpy as np

    from . import backward, forward
    from ._checks import BFLOAT16
    from .reference import attention_reference, attention_reference_backward, rel_err

    rng = np.random.default_rng()
    bounds = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-5}
    bwd_bounds = {"float16": 5e-3, "bfloat16": 3e-2, "float32": 5e-5}
    dts = {"float16": np.float16, "bfloat16": BFLOAT16, "float32": np.float32}
    rows = []
    # (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, head_dim_v, causal): odd lengths, GQA, and MLA's
    # training shape (192, 128)
    cases = [(2, 257, 257, 4, 2, 64, 64, True), (1, 100, 333, 2, 2, 128, 128, False),
             (1, 130, 197, 4, 2, 192, 128, True)]
    for dtype in ("float16", "bfloat16", "float32"):
        for (b, nq, nk, hq, hkv, d, dv, causal) in cases:
            q = cupy.asarray(rng.standard_normal((b, nq, hq, d)).astype(dts[dtype]))
            k = cupy.asarray(rng.standard_normal((b, nk, hkv, d)).astype(dts[dtype]))
            v = cupy.asarray(rng.standard_normal((b, nk, hkv, dv)).astype(dts[dtype]))
            out, lse = forward(q, k, v, causal=causal, return_lse=True)
            dims = f"{d}" if dv == d else f"{d}/{dv}"
            label = f"{dtype} Nq={nq} Nk={nk} Hq={hq} Hkv={hkv} D={dims}{' causal' if causal else ''}"
            rows.append((f"fwd {label}", rel_err(out, attention_reference(q, k, v, causal=causal)[0]),
                         bounds[dtype]))
            dout = cupy.asarray(rng.standard_normal(out.shape).astype(dts[dtype]))
            grads = backward(dout, q, k, v, out, lse, causal=causal)
            refs = attention_reference_backward(dout, q, k, v, causal=causal)
            err = max(rel_err(g, r) for g, r in zip(grads, refs))
            rows.append((f"bwd {label}", err, bwd_bounds[dtype]))
    from .dispatch import device_info

    if device_info(device_id)[0] == 90:  # fp8 forward: against float64 attention of the dequantised inputs
        import ml_dtypes

        from . import forward_fp8, quantize_fp8

        for (b, nq, nk, hq, hkv, d, causal) in [(2, 257, 257, 4, 2, 64, True), (1, 100, 333, 2, 2, 128, False)]:
            pairs = [quantize_fp8(cupy.asarray(rng.standard_normal(shape).astype(np.float32)))
                     for shape in ((b, nq, hq, d), (b, nk, hkv, d), (b, nk, hkv, d))]
            out = forward_fp8(*(x for x, _ in pairs), *(s for _, s in pairs), causal=causal)
            deq = [x.get().view(ml_dtypes.float8_e4m3fn).astype(np.float64) * float(s.get()[0]) for x, s in pairs]
            label = f"fp8 Nq={nq} Nk={nk} Hq={hq} Hkv={hkv} D={d}{' causal' if causal else ''}"
            rows.append((f"fwd {label}", rel_err(out, attention_reference(*deq, causal=causal)[0]), 4e-2))
    return rows


def _torch_fns(shape, backend: str, backward: bool) -> dict:
    """pass -> callable running SDPA with one backend on this shape (empty if it cannot run it)."""
    from .bench import torch_inputs, torch_sdpa

    fn = torch_sdpa(backend)
    if fn is None:
        return {}
    import torch

    try:
        q, k, v = torch_inputs(shape, requires_grad=backward)
        fns = {"fwd": lambda: fn(q, k, v, shape.causal)}
        if backward:
            dout = torch.randn_like(q)
            o = fn(q, k, v, shape.causal)
            fns["bwd"] = lambda: torch.autograd.grad(o, (q, k, v), dout, retain_graph=True)
            fns["fwd+bwd"] = lambda: torch.autograd.grad(fn(q, k, v, shape.causal), (q, k, v), dout)
        for f in fns.values():  # fails here if the backend does not run this shape
            f()
    except RuntimeError:
        return {}
    return fns


PASS_FLOPS = bench.PASS_FLOPS


def _fa4_fns(fa4, shape, q, k, v, dout) -> dict:
    """pass -> callable running FlashAttention-4 on cuflash's own CuPy inputs (DLPack views, no
    copy); empty if it cannot run this shape."""
    from .bench import torch_pass_fns, torch_views

    try:
        tq, tk, tv = torch_views((q, k, v), requires_grad=dout is not None)
        tdout = None if dout is None else torch_views((dout,))[0]
        return torch_pass_fns(fa4, tq, tk, tv, shape.causal, tdout)
    except Exception as e:  # noqa: BLE001 - FA4 raises DSL / assertion errors for what it does not support
        print(f"  FA4 skipped for {shape.label()}: {type(e).__name__}: {str(e)[:120]}")
        return {}


def benchmark(shapes, repeats: int, backward: bool = True, warmup: int = 5) -> list[dict]:
    """Rows {shape, pass, cuflash, cupy, sdpa_flash, sdpa_cudnn[, fa4]} of TFLOP/s. For each pass,
    cuflash and the peers are timed sample by sample in turn (bench.time_interleaved). The fa4
    column (FlashAttention-4 on cuflash's inputs) appears when it imports (bench.fa4_fn); the cupy
    column is None where cuBLAS is not installed (bench.cublas_missing, printed once)."""
    import cupy

    from .bench import (cublas_missing, cuflash_pass_fns, cupy_naive_fwd, fa4_fn, random_inputs, tflops, time_cuda,
                        time_interleaved)

    fa4 = fa4_fn()
    no_cublas = cublas_missing()
    if no_cublas is not None:  # the default install: the column shows "-" and this says why
        print(f"  cupy column skipped: {no_cublas}")
    results = []
    for shape in shapes:
        flops = shape.fwd_flops()
        passes = ("fwd", "bwd", "fwd+bwd") if backward else ("fwd",)
        rows = {p: {"shape": shape.label(), "pass": p} for p in passes}
        q, k, v = random_inputs(shape)
        rows["fwd"]["cupy"] = None
        if no_cublas is None:
            try:
                rows["fwd"]["cupy"] = tflops(flops, time_cuda(
                    lambda: cupy_naive_fwd(q, k, v, shape.causal), repeats=max(3, repeats // 5)))
            except (cupy.cuda.memory.OutOfMemoryError, TypeError):  # too large, or no bf16 matmul in CuPy
                pass
        cupy.get_default_memory_pool().free_all_blocks()
        dout = random_inputs(shape, seed=1)[0] if backward else None
        fns = {("cuflash", p): fn for p, fn in cuflash_pass_fns(q, k, v, shape.causal, dout).items()}
        for backend in ("flash", "cudnn"):
            for p, fn in _torch_fns(shape, backend, backward).items():
                fns[(f"sdpa_{backend}", p)] = fn
        if fa4 is not None:
            for p, fn in _fa4_fns(fa4, shape, q, k, v, dout).items():
                fns[("fa4", p)] = fn
        for p in passes:  # the implementations of one pass sample by sample in turn
            timed = time_interleaved({key: fn for key, fn in fns.items() if key[1] == p},
                                     warmup=warmup, repeats=repeats)
            for (impl, _), ms in timed.items():
                rows[p][impl] = tflops(PASS_FLOPS[p] * flops, ms)
        del fns
        results.extend(rows.values())
        cupy.get_default_memory_pool().free_all_blocks()
        try:
            import torch

            torch.cuda.empty_cache()
        except ImportError:
            pass
    return results


def benchmark_fp8(shapes, repeats: int) -> list[dict]:
    """fp8 forward rows {shape, pass "fwd fp8", cuflash, cudnn_fp8, sdpa_flash_bf16, sdpa_cudnn_bf16}: cuflash on
    e4m3 inputs (bf16 output, the V^T pass included) beside cuDNN's fp8 forward on the same inputs (where
    cudnn-frontend is installed: bench.cudnn_fp8_fn) and SDPA's bf16 forward on the bf16 inputs they came
    from, timed sample by sample in turn."""
    import cupy

    from . import forward_fp8
    from ._checks import BFLOAT16
    from .bench import cudnn_fp8_fn, fp8_inputs, fp8_label, tflops, time_interleaved

    cudnn_fp8 = cudnn_fp8_fn()
    results = []
    for shape in shapes:
        q8, k8, v8, dq, dk, dv = fp8_inputs(shape)
        out = cupy.empty(q8.shape, dtype=BFLOAT16)
        fns = {"cuflash": lambda: forward_fp8(q8, k8, v8, dq, dk, dv, causal=shape.causal, out=out)}
        if cudnn_fp8 is not None:
            try:
                fns["cudnn_fp8"] = cudnn_fp8(q8, k8, v8, dq, dk, dv, shape.causal)
            except Exception as e:  # noqa: BLE001 - a peer that cannot run a shape leaves its cell empty
                print(f"cuDNN fp8 attention ({fp8_label(shape)}): {type(e).__name__}: {e}", file=sys.stderr)
        for backend in ("flash", "cudnn"):
            fn = _torch_fns(shape, backend, backward=False).get("fwd")
            if fn is not None:
                fns[f"sdpa_{backend}_bf16"] = fn
        row = {"shape": fp8_label(shape), "pass": "fwd fp8"}
        row.update({impl: tflops(shape.fwd_flops(), ms) for impl, ms in time_interleaved(fns, repeats=repeats).items()})
        results.append(row)
        del fns, q8, k8, v8, out
        cupy.get_default_memory_pool().free_all_blocks()
    return results


def _fmt(x) -> str:
    return "-" if x is None else f"{x:7.1f}"


# Columns of the standard table; fa4 only when some row has it (FlashAttention-4 imported).
TABLE_COLUMNS = ("cuflash", "cupy", "sdpa_flash", "sdpa_cudnn", "fa4")
RATIO_PEERS = ("sdpa_flash", "sdpa_cudnn", "fa4")
# The fp8 rows' own table: cuDNN's fp8 forward where cudnn-frontend runs, and the peers' bf16 forward, named
# as such so that no ratio reads as one against an fp8 kernel that it is not.
FP8_TABLE_COLUMNS = ("cuflash", "cudnn_fp8", "sdpa_flash_bf16", "sdpa_cudnn_bf16")
FP8_RATIO_PEERS = ("cudnn_fp8", "sdpa_flash_bf16", "sdpa_cudnn_bf16")
FP8_TITLE = ("fp8 forward (e4m3 in; cuflash bf16 out): cudnn_fp8 is cuDNN's fp8 forward (e4m3 out; cudnn-frontend), "
             "the *_bf16 columns the peers' bf16 forward on the inputs before quantisation")


peer_label = bench.peer_label


def _tables(results: list[dict]):
    """(rows, columns, ratio peers, title) of each table: the standard rows, then the fp8 rows."""
    std = [r for r in results if r["pass"] != "fwd fp8"]
    fp8 = [r for r in results if r["pass"] == "fwd fp8"]
    for rows, columns, peers, title in ((std, TABLE_COLUMNS, RATIO_PEERS, None),
                                        (fp8, FP8_TABLE_COLUMNS, FP8_RATIO_PEERS, FP8_TITLE)):
        if rows:
            cols = [c for c in columns if any(c in r for r in rows)]
            yield rows, cols, [c for c in peers if c in cols], title


def print_table(results: list[dict]) -> None:
    print("TFLOP/s (median of repeats); ratios are cuflash / peer")
    for i, (rows, cols, ratios, title) in enumerate(_tables(results)):
        if title:
            print(("\n" if i else "") + title)
        width = max([12] + [len(c) + 2 for c in cols])
        rwidth = max([10] + [len(peer_label(c)) + 4 for c in ratios])
        head = f"{'shape':<44}{'pass':<9}" + "".join(f"{c:>{width}}" for c in cols)
        head += "".join(f"{'x ' + peer_label(c):>{rwidth}}" for c in ratios)
        print(head)
        for r in rows:
            line = f"{r['shape']:<44}{r['pass']:<9}" + "".join(f"{_fmt(r.get(c)):>{width}}" for c in cols)
            for c in ratios:
                peer = r.get(c)
                line += f"{(r['cuflash'] / peer if peer else float('nan')):>{rwidth}.2f}"
            print(line)


def markdown_table(results: list[dict]) -> str:
    """The results as Markdown tables (for BENCHMARKS.md): the standard rows, then the fp8 rows."""
    lines = []
    for rows, cols, ratios, title in _tables(results):
        if lines:
            lines.append("")
        if title:
            lines += [title, ""]
        lines += ["| shape | pass | " + " | ".join(cols) + "".join(f" | cuflash / {peer_label(c)}" for c in ratios)
                  + " |", "|" + " --- |" * (2 + len(cols) + len(ratios))]
        for r in rows:
            cells = [r["shape"], r["pass"]] + [_fmt(r.get(c)).strip() for c in cols]
            cells += [f"{r['cuflash'] / r[c]:.2f}" if r.get(c) else "-" for c in ratios]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _parse_dist_names(text: str) -> list[str]:
    """"outlier8,sharp" -> ["outlier8", "sharp"]; unknown names are an argparse error."""
    from .distributions import DISTRIBUTIONS

    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in DISTRIBUTIONS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown distribution(s) {', '.join(bad)}; "
                                         f"choose from {', '.join(DISTRIBUTIONS)}")
    return names


def _row_names(text: str, rows_by_name) -> tuple:
    """"a,b" -> ("a", "b"), each a row ``rows_by_name`` knows; an unknown name is an argparse error."""
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    try:
        rows_by_name(names)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return names


def _parse_names(text: str) -> tuple:
    """"a, b" -> ("a", "b"): --rows, checked against the table it serves in parse_args."""
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _parse_varlen_rows(text: str) -> tuple:
    """"varlen,varlen-causal" -> ("varlen", "varlen-causal") (the varlen table's rows)."""
    from .bench_varlen import rows_by_name

    return _row_names(text, rows_by_name)


def _parse_varlen_shape(text: str) -> str:
    """"B=8,lens=128:1024,H=4,D=64" (bench_varlen.parse_overrides); a bad item is an argparse error."""
    from .bench_varlen import parse_overrides

    try:
        parse_overrides(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _parse_head_dim_rows(text: str) -> tuple:
    """"d512,mla192" -> ("d512", "mla192") (the head-dim table's rows)."""
    from .bench_shapes import rows_by_name

    return _row_names(text, rows_by_name)


def _parse_decode_rows(text: str) -> tuple:
    """"b8-32k-paged64,b64-*" -> ("b8-32k-paged64", "b64-*") (the decode table's rows: names or patterns)."""
    from .bench_decode import rows_by_name

    return _row_names(text, rows_by_name)


def _given(argv, option: str) -> bool:
    """Whether ``option`` (or an abbreviation argparse took for it) is on the command line."""
    return any(len(t.split("=")[0]) > 3 and option.startswith(t.split("=")[0]) for t in argv if t.startswith("--"))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m cuflash", description=__doc__)
    ap.add_argument("--shape", action="append", type=_parse_shape,
                    help="benchmark shape B,H,N,D,dtype[,causal] (repeatable); default: the standard table "
                         "(with --dists: bench.DIST_SHAPES)")
    ap.add_argument("--quick", action="store_true", help="two shapes only")
    ap.add_argument("--repeats", type=int, default=30,
                    help="timed calls of each implementation, interleaved; the table gives their median "
                         "(default 30)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed calls of each implementation first (default 5)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--no-bench", action="store_true", help="self-check only")
    ap.add_argument("--markdown", action="store_true", help="also print the table as Markdown")
    ap.add_argument("--forward-only", action="store_true", help="skip the backward and forward+backward rows")
    ap.add_argument("--no-fp8", action="store_true", help="skip the fp8 forward rows (Hopper only)")
    from .distributions import DISTRIBUTIONS

    ap.add_argument("--dists", nargs="*", type=_parse_dist_names, metavar="NAME",
                    help="instead of the standard table, the score-distribution table: each shape x input "
                         f"distribution ({', '.join(DISTRIBUTIONS)}; space- or comma-separated; "
                         "all of them when none are named), forward and forward+backward of cuflash beside "
                         "SDPA cuDNN, SDPA FlashAttention-2 and FlashAttention-4 on the same inputs; with "
                         "--variants: the input distributions of the variant table")
    ap.add_argument("--variants", action="store_true",
                    help="instead of the standard table, the attention-variant table (cuflash/bench_variants.py: "
                         "window, chunk, softcap, ALiBi, sinks beside plain cuflash, FlashAttention-4 and cuDNN; "
                         "default distributions normal, outlier12, sink; --quick: two rows on normal inputs)")
    ap.add_argument("--programmable", action="store_true",
                    help="instead of the standard table, the programmable-attention table (cuflash/"
                         "bench_programmable.py, issue #45): dropout, bias + dbias, key padding, 50 %% block "
                         "sparsity, a relative-position score_mod and a document mask_mod at B=4 H=16 N=4096 D=128 "
                         "bf16 beside plain cuflash, cuDNN, FlashAttention-4 and FlexAttention; default "
                         "distributions normal, mixed, 20 repeats, 3 warm-ups; --quick: two rows on normal inputs")
    ap.add_argument("--rows", type=_parse_names, metavar="NAME[,NAME...]",
                    help="with --variants: only these rows (window8k, window16k, softcap-causal, softcap, alibi, "
                         "gpt-oss, gpt-oss-gqa, chunk); with --programmable: these rows (dropout, bias, keypad, "
                         "sparse50, relpos, docmask)")
    ap.add_argument("--varlen", action="store_true",
                    help="instead of the standard table, the varlen table (cuflash/bench_varlen.py, issue #43): "
                         "forward_varlen / backward_varlen on 64 sequences of 128-8192 tokens beside the dense API "
                         "at the mean length, FlashAttention-4's varlen path and cuDNN's ragged layout; default "
                         "10 repeats, 2 warm-ups")
    ap.add_argument("--varlen-rows", type=_parse_varlen_rows, metavar="NAME[,NAME...]",
                    help="with --varlen: these rows (varlen, varlen-causal, varlen-gqa, varlen-gqa-causal; default "
                         "varlen,varlen-causal)")
    ap.add_argument("--varlen-shape", type=_parse_varlen_shape, metavar="K=V[,K=V...]",
                    help="with --varlen: override every row's batch, e.g. B=8,lens=128:1024,H=4,Hkv=2,D=64,seed=1 "
                         "(quick runs)")
    ap.add_argument("--varlen-dists", type=_parse_dist_names, metavar="NAME[,NAME...]",
                    help="with --varlen: the input distributions (default normal,sink; --quick: normal)")
    ap.add_argument("--head-dims", action="store_true",
                    help="instead of the standard table, the head-dim table (cuflash/bench_shapes.py, issue #43): "
                         "(192, 128), 512 and MLA's (576, 512) beside cuDNN, FlashAttention-4 and cuflash's own "
                         "D=128 / 256; default distributions normal, sharp")
    ap.add_argument("--head-dim-rows", type=_parse_head_dim_rows, metavar="NAME[,NAME...]",
                    help="with --head-dims: these rows (mla192, mla192-causal, d512, d512-causal, mla576)")
    ap.add_argument("--head-dim-dists", type=_parse_dist_names, metavar="NAME[,NAME...]",
                    help="with --head-dims: the input distributions (default normal,sharp; --quick: normal)")
    ap.add_argument("--decode", action="store_true",
                    help="instead of the standard table, the decode table (cuflash/bench_decode.py, issue #44): "
                         "forward_kvcache at seqlen_q=1, bf16, D=128, 32/8 heads, batch 1, 8, 64 x cache 4k, 32k, "
                         "128k x contiguous and paged (page 64), as GB/s beside the measured copy bandwidth, PyTorch "
                         "SDPA, FlashInfer and FlashAttention-4 where they run; default distributions normal, mixed")
    ap.add_argument("--decode-rows", type=_parse_decode_rows, metavar="NAME[,NAME...]",
                    help="with --decode: these rows, by name (b8-32k-paged64, b1-128k-contiguous, ...) or shell "
                         "pattern (b64-*, *-paged64; the ragged rows, lengths ~U[N/2, N]: *-ragged), or default "
                         "(the 18 rows; --quick: four)")
    ap.add_argument("--decode-dists", type=_parse_dist_names, metavar="NAME[,NAME...]",
                    help="with --decode: the input distributions (default normal,mixed; --quick: normal)")
    return ap


def _checked_rows(parser: argparse.ArgumentParser, names: tuple, rows_by_name) -> tuple:
    """``names`` where ``rows_by_name`` knows each; else the parser's error naming the unknown ones."""
    try:
        rows_by_name(names)
    except ValueError as e:
        parser.error(f"--rows: {e}")
    return tuple(names)


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; ``dists`` becomes None (no --dists) or a tuple of distribution names."""
    from .distributions import DISTRIBUTIONS

    parser = build_parser()
    args = parser.parse_args(argv)
    argv_list = list(sys.argv[1:] if argv is None else argv)
    if args.dists is not None:
        named = [x for group in args.dists for x in group]
        args.dists = tuple(dict.fromkeys(named)) or DISTRIBUTIONS
    if args.rows is not None and not (args.variants or args.programmable):
        parser.error("--rows applies to --variants and --programmable only")
    if not args.varlen and (args.varlen_rows or args.varlen_shape or args.varlen_dists):
        parser.error("--varlen-rows, --varlen-shape and --varlen-dists apply to --varlen only")
    if args.varlen:   # rows, distributions, repeats of the varlen table (bench_varlen)
        from . import bench_varlen as bvl

        if args.variants or args.shape or args.dists is not None:
            parser.error("--varlen does not combine with --variants, --shape or --dists (use --varlen-rows, "
                         "--varlen-shape, --varlen-dists)")
        if args.varlen_rows is None:
            args.varlen_rows = bvl.DEFAULT_ROWS
        args.varlen_dists = tuple(dict.fromkeys(args.varlen_dists or
                                                (bvl.QUICK_DISTS if args.quick else bvl.DEFAULT_DISTS)))
        try:
            bvl.rows_from_args(args.varlen_rows, args.varlen_shape)
        except ValueError as e:
            parser.error(f"--varlen-shape: {e}")
        if not _given(argv_list, "--repeats"):
            args.repeats = bvl.DEFAULT_REPEATS
        if not _given(argv_list, "--warmup"):
            args.warmup = bvl.DEFAULT_WARMUP
    if not args.head_dims and (args.head_dim_rows or args.head_dim_dists):
        parser.error("--head-dim-rows and --head-dim-dists apply to --head-dims only")
    if args.head_dims:   # rows, distributions, repeats of the head-dim table (bench_shapes)
        from . import bench_shapes as bsh

        if args.variants or args.varlen or args.shape or args.dists is not None:
            parser.error("--head-dims does not combine with --variants, --varlen, --shape or --dists")
        args.head_dim_rows = args.head_dim_rows or (bsh.QUICK_ROWS if args.quick else bsh.ROW_NAMES)
        args.head_dim_dists = tuple(dict.fromkeys(args.head_dim_dists or
                                                  (bsh.QUICK_DISTS if args.quick else bsh.DEFAULT_DISTS)))
        if not _given(argv_list, "--repeats"):
            args.repeats = bsh.DEFAULT_REPEATS
        if not _given(argv_list, "--warmup"):
            args.warmup = bsh.DEFAULT_WARMUP
    if not args.decode and (args.decode_rows or args.decode_dists):
        parser.error("--decode-rows and --decode-dists apply to --decode only")
    if args.decode:   # rows, distributions, repeats of the decode table (bench_decode)
        from . import bench_decode as bdc

        if args.variants or args.varlen or args.head_dims or args.shape or args.dists is not None:
            parser.error("--decode does not combine with --variants, --varlen, --head-dims, --shape or --dists "
                         "(use --decode-rows, --decode-dists)")
        args.decode_rows = args.decode_rows or (bdc.QUICK_ROWS if args.quick else bdc.DEFAULT_ROWS)
        args.decode_dists = tuple(dict.fromkeys(args.decode_dists or
                                                (bdc.QUICK_DISTS if args.quick else bdc.DEFAULT_DISTS)))
        if not _given(argv_list, "--repeats"):
            args.repeats = bdc.DEFAULT_REPEATS
        if not _given(argv_list, "--warmup"):
            args.warmup = bdc.DEFAULT_WARMUP
    if args.programmable:   # rows, distributions, repeats of the programmable table (bench_programmable)
        from . import bench_programmable as bp

        if args.variants or args.varlen or args.head_dims or args.decode or args.shape:
            parser.error("--programmable does not combine with --variants, --varlen, --head-dims, --decode or --shape "
                         "(name rows with --rows)")
        args.rows = _checked_rows(parser, args.rows or (bp.QUICK_ROWS if args.quick else bp.ROW_NAMES),
                                  bp.rows_by_name)
        if args.dists is None:
            args.dists = bp.QUICK_DISTS if args.quick else bp.DEFAULT_DISTS
        if not _given(argv_list, "--repeats"):
            args.repeats = bp.DEFAULT_REPEATS
        if not _given(argv_list, "--warmup"):
            args.warmup = bp.DEFAULT_WARMUP
    if args.variants:   # rows and distributions of the variant table (bench_variants)
        from . import bench_variants as bv

        if args.shape:
            parser.error("--shape does not apply to --variants: name rows with --rows")
        args.rows = _checked_rows(parser, args.rows or (bv.QUICK_ROWS if args.quick else bv.ROW_NAMES),
                                  bv.rows_by_name)
        if args.dists is None:
            args.dists = bv.QUICK_DISTS if args.quick else bv.DEFAULT_DISTS
    return args


def table_shapes(args: argparse.Namespace) -> list:
    """The shapes to benchmark: --shape if given, else the quick pair with --quick, else the
    distribution table's shapes with --dists and the standard table's without."""
    from .bench import DIST_SHAPES, QUICK_SHAPES, STANDARD_SHAPES

    if getattr(args, "decode", False):   # no dense shapes: forward_kvcache compiles on each row's first (untimed) call
        return []
    if getattr(args, "varlen", False):   # the dense calls at the rows' mean lengths
        from .bench_varlen import rows_from_args

        return list(dict.fromkeys(r.dense_shape() for r in rows_from_args(args.varlen_rows, args.varlen_shape)))
    if getattr(args, "variants", False):
        from .bench_variants import rows_by_name

        return list(dict.fromkeys(r.shape for r in rows_by_name(args.rows)))
    if getattr(args, "programmable", False):   # the plain calls' kernels (the programmable ones build on first use)
        from .bench_programmable import rows_by_name as programmable_rows

        return list(dict.fromkeys(r.shape for r in programmable_rows(args.rows)))
    if getattr(args, "head_dims", False):   # the reference head dims' shapes (the large ones build below)
        from .bench_shapes import rows_by_name as head_dim_rows

        return list(dict.fromkeys(r.shape(r.ref_dim) for r in head_dim_rows(args.head_dim_rows)))
    if args.shape:
        return list(args.shape)
    if args.quick:
        return list(QUICK_SHAPES)
    return list(DIST_SHAPES if args.dists is not None else STANDARD_SHAPES)


def _run_variants(args: argparse.Namespace, device: str, cc: int) -> int:
    """The variant table (bench_variants): printed, optionally as Markdown and JSON; 1 if cuflash failed a call
    or a peer's output differs from cuflash's (bench_variants.failures), else 0."""
    from . import bench_variants as bv

    rows = bv.rows_by_name(args.rows)
    print(f"variant table: {', '.join(args.rows)} x {', '.join(args.dists)}; {args.warmup} warm-ups, "
          f"{args.repeats} interleaved repeats; FA4 {'found' if bv.fa4_adapter() else 'not importable'}, "
          f"cudnn-frontend {'found' if bv.cudnn_adapter() else 'not importable'}")
    results = bv.benchmark_variants(rows, args.dists, repeats=args.repeats, warmup=args.warmup,
                                    backward=not args.forward_only)
    print(bv.format_table(results))
    if args.markdown:
        print(bv.markdown_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "cc": cc, "version": __version__, "rows": list(args.rows),
                       "dists": list(args.dists), "results": [r.to_json() for r in results]}, f, indent=1)
    bad = bv.failures(results)
    for line in bad:
        print(f"FAILED {line}")
    return 1 if bad else 0


def device_ready(stderr=None) -> bool:
    """True when the kernels can run here; else says on stderr which problem it is (no driver, no GPU,
    an old driver or GPU), what to do, and what works without a GPU."""
    from .device_check import diagnose

    problem = diagnose()
    if problem is None:
        return True
    print(f"{problem.message()}\n(cuflash {__version__})", file=stderr or sys.stderr)
    return False


def main(argv=None) -> int:
    args = parse_args(argv)

    import cupy
    import numpy as np

    from cupy.cuda import nvrtc

    from . import dispatch, heuristics
    from .bench import FA4_PATH_ENV, FP8_SHAPES, fa4_fn, fa4_status

    if not device_ready():
        return 1
    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    cc = dispatch.device_info(dev.id)[0]
    real_cc = dispatch.real_device_info(dev.id)[0]
    planned = f" planned as sm_{cc} (CUFLASH_PLAN_CC)," if cc != real_cc else ""
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    print(f"cuflash {__version__} | {name} (sm_{real_cc},{planned} {props['multiProcessorCount']} SMs) | "
          f"CuPy {cupy.__version__} | CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()} | "
          f"NVRTC {'.'.join(map(str, nvrtc.getVersion()))} | NumPy {np.__version__} | "
          f"Python {platform.python_version()}")
    try:
        import torch

        print(f"PyTorch {torch.__version__} found: SDPA columns included")
        # Nothing is said of FA4 unless it imports or was pointed at, so that the default report stays as it was.
        if fa4_fn() is not None:
            print(f"{fa4_status()} found: fa4 column included")
        elif options.current().fa4_path:
            print(f"${FA4_PATH_ENV} is set but {fa4_status()}: fa4 column omitted")
    except ImportError:
        print("PyTorch not installed: SDPA columns omitted")

    shapes = table_shapes(args)
    needed = {heuristics.fwd_config(s.dtype, s.head_dim, s.causal, cc, short=short) for s in shapes
              for short in (False, True)}
    needed |= {heuristics.fwd_config(dt, d, c, cc) for dt in ("float16", "bfloat16", "float32")
               for d in (64, 128) for c in (False, True)}
    # The forward's tiles as the dispatcher narrows them to the device's shared memory (99 KB cards).
    needed = {dispatch.fit_to_device(c, dev.id) for c in needed}
    # The backward's kernels for both length classes (heuristics.bwd_short), as the forward's above.
    if not args.forward_only:
        needed |= {cfg for s in shapes for short in (False, True)
                   for cfg in heuristics.bwd_configs(s.dtype, s.head_dim, s.causal, cc, short=short).all()}
    needed |= {cfg for dt in ("float16", "bfloat16", "float32") for d in (64, 128) for c in (False, True)
               for short in (False, True) for cfg in heuristics.bwd_configs(dt, d, c, cc, short=short).all()}
    if cc == 90:  # the fp8 forward and its helpers
        from . import fp8

        needed |= {heuristics.fp8_fwd_config(d, c, short) for d in (64, 128, 256) for c in (False, True)
                   for short in (False, True)}
        needed |= set(fp8.aux_configs())
    t0 = time.time()
    dispatch.precompile(sorted(needed, key=lambda c: c.key()), dev.id, _progress)
    print(f"  {len(needed)} kernels ready in {time.time() - t0:.1f} s (CuPy's kernel cache keeps them)")
    if args.variants:   # the variants' kernels: one that does not build fails its rows, not the run
        from .bench_variants import kernel_configs, rows_by_name

        _build_table_kernels("variant", [c for c in kernel_configs(cc, rows_by_name(args.rows)) if c not in needed],
                             dev.id)
    if args.head_dims:   # the head-dim table's kernels: the same
        from .bench_shapes import kernel_configs as head_dim_configs
        from .bench_shapes import rows_by_name as head_dim_rows

        _build_table_kernels("head-dim", [c for c in head_dim_configs(cc, head_dim_rows(args.head_dim_rows))
                                          if c not in needed], dev.id)
    if args.varlen:   # the varlen kernels: the same
        from .bench_varlen import kernel_configs, rows_from_args

        _build_table_kernels("varlen", [c for c in kernel_configs(cc, rows_from_args(args.varlen_rows,
                                                                                      args.varlen_shape))
                                        if c not in needed], dev.id)

    print("self-check against the float64 reference:")
    ok = True
    for label, err, bound in self_check(dev.id):
        good = err <= bound
        ok &= good
        print(f"  {'ok  ' if good else 'FAIL'} {label:<58} rel err {err:.2e} (bound {bound:.0e})", flush=True)
    if not ok:
        print("self-check FAILED")
        return 1
    if args.no_bench:
        return 0
    if args.variants:
        return _run_variants(args, name, cc)
    if args.programmable:
        from . import bench_programmable

        return bench_programmable.run(args, name, cc)
    if args.varlen:
        from . import bench_varlen

        return bench_varlen.run(args, name, cc)
    if args.decode:
        from . import bench_decode

        return bench_decode.run(args, name, cc)
    if args.head_dims:
        from . import bench_shapes

        return bench_shapes.run(args, name, cc)
    if args.dists is not None:
        from .dist_table import benchmark_dists, format_dist_table, markdown_dist_table

        print(f"score-distribution table: {len(shapes)} shapes x {', '.join(args.dists)}; "
              f"{args.warmup} warm-ups, {args.repeats} interleaved repeats")
        results = benchmark_dists(shapes, args.dists, repeats=args.repeats, warmup=args.warmup,
                                  backward=not args.forward_only)
        print(format_dist_table(results))
        if args.markdown:
            print(markdown_dist_table(results))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": name, "cc": cc, "dists": list(args.dists), "results": results}, f, indent=1)
        return 0
    results = benchmark(shapes, args.repeats, backward=not args.forward_only, warmup=args.warmup)
    if cc == 90 and not args.shape and not args.quick and not args.no_fp8:
        results += benchmark_fp8(FP8_SHAPES, args.repeats)
    print_table(results)
    if args.markdown:
        print(markdown_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "cc": cc, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
