"""The score-distribution table of ``python -m cuflash --dists``.

For each shape and input distribution (``cuflash.distributions``): the measured standard
deviation of the scaled scores, and the forward and forward+backward TFLOP/s of cuflash beside
PyTorch SDPA (cuDNN and FlashAttention-2 backends) and FlashAttention-4 where it imports. Every
peer reads cuflash's own CuPy arrays through DLPack (no copy), so all see the same values, and the
implementations of one pass are timed sample by sample in turn (``bench.time_interleaved``).
"""
from __future__ import annotations

import math

from .bench import free_memory, peer_label

DIST_PASSES = ("fwd", "fwd+bwd")
DIST_COLUMNS = ("cuflash", "sdpa_cudnn", "sdpa_flash", "fa4")
DIST_RATIOS = ("sdpa_cudnn", "fa4")  # cuflash / peer


def benchmark_dists(shapes, dists, *, repeats: int = 15, warmup: int = 3, backward: bool = True,
                    seed: int = 0) -> list[dict]:
    """Rows {shape, dist, score_std, pass, cuflash, sdpa_cudnn, sdpa_flash[, fa4]} (TFLOP/s; a peer
    that cannot run a shape is left out of its rows), for every shape (``bench.Shape``) x
    distribution name x pass ("fwd", and "fwd+bwd" if ``backward``). q, k, v come from
    ``make_inputs(shape, dist, seed)``; the output gradient is ``random_inputs(shape, 1)[0]`` for
    every distribution, as in the standard table. Progress goes to stdout, one line per cell."""
    from .bench import (PASS_FLOPS, cuflash_pass_fns, peer_impls, random_inputs, tflops, time_interleaved,
                        torch_pass_fns, torch_views)
    from .distributions import make_inputs, score_std

    peers = peer_impls()
    passes = DIST_PASSES if backward else ("fwd",)
    rows = []
    for shape in shapes:
        flops = shape.fwd_flops()
        dout = random_inputs(shape, seed=1)[0] if backward else None
        for dist in dists:
            q, k, v = make_inputs(shape, dist, seed)
            std = score_std(q, k)
            fns = {("cuflash", p): fn for p, fn in cuflash_pass_fns(q, k, v, shape.causal, dout, passes).items()}
            for name, (fn, sdpa_layout) in peers.items():
                try:
                    tq, tk, tv = torch_views((q, k, v), sdpa_layout=sdpa_layout, requires_grad=backward)
                    tdout = torch_views((dout,), sdpa_layout=sdpa_layout)[0] if backward else None
                    # called once inside: raises here if the peer cannot run the shape; FA4 compiles here
                    fns.update({(name, p): f for p, f in
                                torch_pass_fns(fn, tq, tk, tv, shape.causal, tdout, passes).items()})
                except Exception as e:  # noqa: BLE001 - SDPA RuntimeError, FA4 DSL / assertion errors
                    print(f"  {name} skipped for {shape.label()}: {type(e).__name__}: {str(e)[:120]}")
            cells = []
            for p in passes:
                timed = time_interleaved({key: f for key, f in fns.items() if key[1] == p},
                                         warmup=warmup, repeats=repeats)
                row = {"shape": shape.label(), "dist": dist, "score_std": std, "pass": p}
                row.update({impl: tflops(PASS_FLOPS[p] * flops, ms) for (impl, _), ms in timed.items()})
                rows.append(row)
                cells.append(f"{p} {row['cuflash']:.0f}" + "".join(
                    f" x{peer_label(c)} {row['cuflash'] / row[c]:.2f}" for c in DIST_RATIOS if row.get(c)))
            print(f"  {shape.label():<44} {dist:<10} std {std:6.2f} | " + " | ".join(cells), flush=True)
            del fns, q, k, v
            tq = tk = tv = tdout = None  # the DLPack views keep the arrays alive
            free_memory()
        del dout
        free_memory()
    return rows


def dist_summary(rows: list[dict]) -> list[dict]:
    """Per (dist, pass), the geometric mean over shapes of cuflash / peer for each of
    ``DIST_RATIOS`` present: rows {dist, pass, sdpa_cudnn, fa4} (ratios; a peer absent -> missing)."""
    out = []
    keys = list(dict.fromkeys((r["dist"], r["pass"]) for r in rows))
    for dist, p in keys:
        group = [r for r in rows if r["dist"] == dist and r["pass"] == p]
        s = {"dist": dist, "pass": p}
        for c in DIST_RATIOS:
            ratios = [r["cuflash"] / r[c] for r in group if r.get(c) and r.get("cuflash")]
            if ratios:
                s[c] = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        out.append(s)
    return out


def _columns(rows: list[dict]) -> tuple[list[str], list[str]]:
    cols = [c for c in DIST_COLUMNS if any(c in r for r in rows)]
    return cols, [c for c in DIST_RATIOS if c in cols]


def _num(x, fmt: str = "7.1f") -> str:
    return "-" if x is None else format(x, fmt)


def _ratio(r: dict, c: str) -> str:
    return f"{r['cuflash'] / r[c]:.2f}" if r.get(c) and r.get("cuflash") else "-"


def format_dist_table(rows: list[dict]) -> str:
    """The rows as a fixed-width text table, then the geometric means per distribution."""
    cols, ratios = _columns(rows)
    lines = ["TFLOP/s (median of interleaved repeats); std: measured std of the scaled scores; "
             "ratios are cuflash / peer",
             f"{'shape':<44}{'dist':<11}{'std':>6}  {'pass':<9}" + "".join(f"{c:>12}" for c in cols)
             + "".join(f"{'x ' + peer_label(c):>10}" for c in ratios)]
    for r in rows:
        lines.append(f"{r['shape']:<44}{r['dist']:<11}{r['score_std']:>6.2f}  {r['pass']:<9}"
                     + "".join(f"{_num(r.get(c)):>12}" for c in cols)
                     + "".join(f"{_ratio(r, c):>10}" for c in ratios))
    if ratios:
        lines.append("geometric mean over shapes of cuflash / peer:")
        for s in dist_summary(rows):
            lines.append(f"  {s['dist']:<11}{s['pass']:<9}" + "".join(
                f"  x {peer_label(c)} {_num(s.get(c), '.3f')}" for c in ratios))
    return "\n".join(lines)


def markdown_dist_table(rows: list[dict]) -> str:
    """The rows as a Markdown table (for BENCHMARKS.md), then the geometric means per distribution."""
    cols, ratios = _columns(rows)
    lines = ["| shape | dist | score std | pass | " + " | ".join(cols)
             + "".join(f" | cuflash / {peer_label(c)}" for c in ratios) + " |",
             "|" + " --- |" * (4 + len(cols) + len(ratios))]
    for r in rows:
        cells = [r["shape"], r["dist"], f"{r['score_std']:.2f}", r["pass"]]
        cells += [_num(r.get(c)).strip() for c in cols] + [_ratio(r, c) for c in ratios]
        lines.append("| " + " | ".join(cells) + " |")
    if ratios:
        lines += ["", "| dist | pass | " + " | ".join(f"cuflash / {peer_label(c)} (geomean)" for c in ratios) + " |",
                  "|" + " --- |" * (2 + len(ratios))]
        for s in dist_summary(rows):
            lines.append("| " + " | ".join([s["dist"], s["pass"]] + [_num(s.get(c), ".3f") for c in ratios]) + " |")
    return "\n".join(lines)
