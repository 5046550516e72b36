"""Interleaved A/B timing of forward_kvcache builds on the decode table's rows (GPU).

    python3 dev/decode_ab.py [--rows b8-32k-paged64,b1-128k-*] [--dist normal] [--repeats 10] [VARIANT ...]

Each VARIANT is a string of tokens as in dev/ab.py: NVRTC defines (``-DNAME=V``) and option environment variables
(``@CUFLASH_DECODE_BACKEND=sm90``), and ``splits=N`` for the call's num_splits (default 0: automatic); default
variants: the two decode backends. Every variant's output is checked
against the row's float32 reference first (the largest relative error printed), then the variants are timed in
turn sample by sample (cuflash.bench.time_interleaved, L2 flushed before each); each line gives the median
microseconds and GB/s of K/V read per variant, and the copy bandwidth of the same process.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_VARIANTS = ("@CUFLASH_DECODE_BACKEND=sm80", "@CUFLASH_DECODE_BACKEND=sm90")


def _options_of(variant: str) -> dict:
    from cuflash import options

    fields, defines = {}, []
    names = {var: field for field, var in options.ENV.items()}
    for tok in variant.split():
        if tok.startswith("@"):
            var, _, value = tok[1:].partition("=")
            field = names[var]
            fields[field] = options._parse(field, value)
        elif tok.startswith("-D"):
            defines.append(tok)
        elif tok.startswith("splits="):
            fields["num_splits"] = int(tok.partition("=")[2])
        else:
            raise SystemExit(f"unknown variant token {tok!r}")
    if defines:
        fields["nvrtc_defines"] = tuple(defines)
    return fields


def _fp8_call(p, k8, v8, k_descale, v_descale):
    """forward_kvcache on the row over e4m3 caches (the pages of a paged row, quantised as they are)."""
    import cuflash

    kw = {"cache_seqlens": p.lens_dev, "num_splits": 0, "k_descale": k_descale, "v_descale": v_descale}
    if p.row.paged:
        kw["block_table"] = p.table_dev
    return lambda: cuflash.forward_kvcache(p.q, k8, v8, **kw)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variants", nargs="*", default=list(DEFAULT_VARIANTS))
    ap.add_argument("--rows", default="b1-4k-*,b1-128k-*,b8-32k-*,b64-32k-*")
    ap.add_argument("--dist", default="normal")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--fp8", action="store_true",
                    help="also time each variant over the row's caches quantised to e4m3 (quantize_fp8, per tensor): "
                         "GB/s then counts the fp8 bytes, error against the 16-bit reference")
    args = ap.parse_args()

    from cuflash import bench_decode as bd
    from cuflash import options
    from cuflash.bench import time_interleaved

    copy = bd.copy_bandwidth()
    print(f"copy bandwidth: {copy}")
    per_variant = [(v or "default", _options_of(v)) for v in args.variants]
    rows = bd.rows_by_name(tuple(args.rows.split(",")))
    names = [n for n, _ in per_variant] + ([n + " fp8" for n, _ in per_variant] if args.fp8 else [])
    print("row | " + " | ".join(f"{name} us / GB/s / err" for name in names))
    for row in rows:
        for dist in args.dist.split(","):
            prepared = bd.prepare(row, bd.draw_inputs(row, dist))
            refs = bd.references(prepared)
            fns, errs = {}, {}
            caches = [("", None)]
            if args.fp8:
                import cuflash

                k, v = prepared.cache()
                (k8, kd), (v8, vd) = cuflash.quantize_fp8(k), cuflash.quantize_fp8(v)
                caches.append((" fp8", (k8, v8, kd, vd)))
            for (name, fields), (suffix, quantised) in [(pv, c) for c in caches for pv in per_variant]:
                name = name + suffix
                fields = dict(fields)
                splits = fields.pop("num_splits", 0)
                call = bd.cuflash_call(prepared, splits) if quantised is None else _fp8_call(prepared, *quantised)

                def fn(call=call, fields=fields):
                    with options.override(**fields):
                        return call()
                errs[name] = bd.output_error(fn(), refs)
                fns[name] = fn
            ms = time_interleaved(fns, warmup=args.warmup, repeats=args.repeats)
            cells = []
            for name in fns:
                nbytes = row.bytes_read() // (2 if name.endswith(" fp8") else 1)   # (K and V dominate)
                gb = bd.gbps(nbytes, ms[name])
                cells.append(f"{ms[name] * 1e3:8.1f} / {gb:6.0f} / {errs[name]:.1e}")
            print(f"{row.name}-{dist} | " + " | ".join(cells), flush=True)
            del prepared, refs, fns
    return 0


if __name__ == "__main__":
    sys.exit(main())
