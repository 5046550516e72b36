"""Offline SASS of cuflash's kernels (no GPU: NVRTC cubin -> cuobjdump), and fingerprints that prove a
refactor left the generated code identical.

    python3 dev/sass.py show -k KEY[,KEY...] [--counts] [--src KERNELS_DIR]
    python3 dev/sass.py list [-o list.json] [--all-head-dims]
    python3 dev/sass.py hash LIST.json KERNELS_DIR -o OUT.json [-j N] [-k KEY,...] [--rename OLD=NEW ...]
                             [--dump DIR] [-D NAME[=V] ...]
    python3 dev/sass.py diff A.json B.json

``list`` writes the instantiations of the Hopper (sm_90a) kernels the dispatcher can pick at the tuned head
dims (forward, fp8 forward, backward): key, source file, name expression, NVRTC options, from this tree's
cuflash.heuristics. ``hash`` compiles each of them from a kernels_cu tree (KERNELS_DIR, e.g. an old checkout's
or the refactored one) and prints / writes a hash of its normalised SASS (the instructions, without addresses
and encodings) and its instruction count; ``--rename`` maps a template's old name to its new one in the name
expressions (a kernel renamed by the refactor), ``--dump`` writes each normalised SASS for a diff. ``diff``
lists the instantiations whose hashes differ (exit status 1 if any). Typical use:

    python3 dev/sass.py list -o /tmp/fp/list.json
    python3 dev/sass.py hash /tmp/fp/list.json /tmp/old/kernels_cu -o /tmp/fp/old.json
    python3 dev/sass.py hash /tmp/fp/list.json kernels_cu -o /tmp/fp/new.json
    python3 dev/sass.py diff /tmp/fp/old.json /tmp/fp/new.json

``show``: the SASS of the listed instantiations whose key holds every KEY substring (e.g.
``-k sm90_fwd,bfloat16,d128``), or with ``--counts`` their opcode counts and those of the key-tile loop's
MMA span. Needs cuobjdump and nvdisasm (the ``test`` extra: nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm).
The SASS reader itself is tests/sass_tools.py, shared with the SASS tests.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ROOT, add_tests_to_path  # noqa: E402

add_tests_to_path()
import sass_tools  # noqa: E402

_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(.*)$")


def instantiations(all_head_dims: bool = False) -> list[dict]:
    """The sm_90a instantiations of the forward, fp8 forward and backward tables (see the module doc)."""
    from cuflash import heuristics as h
    from cuflash.compile import compile_options

    cfgs = {}
    for c in h.all_sm90_fwd_configs() + h.all_fp8_fwd_configs() + h.all_sm90_bwd_configs():
        if all_head_dims or c.head_dim in h.TUNED_HEAD_DIMS or c.head_dim == 0:
            cfgs[c.key()] = c
    return [{"key": k, "source": c.source, "expr": c.name_expression(),
             "opts": list(compile_options(c, "90a")) + ["-ftz=true"]}
            for k, c in sorted(cfgs.items()) if c.fam.arch_specific]


def normalise(sass_text: str) -> list[str]:
    """The instructions of a cuobjdump listing, without addresses, encodings and comments."""
    out = []
    for line in sass_text.splitlines():
        m = _INSTRUCTION.match(line)
        if m:
            out.append(re.sub(r"\s*/\*.*?\*/\s*$", "", m.group(1)).strip())
    return out


def compile_sass(row: dict, root: str, renames=(), defines=()) -> tuple[str | None, str]:
    """(SASS text, "") of one instantiation compiled from ``root``/row["source"] (its includes found
    beside it), or (None, NVRTC's log)."""
    from cupy.cuda import nvrtc

    expr = row["expr"]
    for old, new in renames:
        expr = expr.replace(old, new)
    src_path = os.path.join(root, row["source"])
    opts = [o for o in row["opts"] if not o.startswith("-I")] + ["-I" + os.path.dirname(src_path), *defines]
    prog = nvrtc.createProgram(Path(src_path).read_text(), src_path, [], [])
    try:
        nvrtc.addNameExpression(prog, expr)
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError:
            return None, nvrtc.getProgramLog(prog)[-3000:]
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        Path(path).write_bytes(sass_tools.whole_elf(cubin))
        env = dict(os.environ)
        env["PATH"] = os.path.dirname(sass_tools._find_tool("nvdisasm")) + os.pathsep + env.get("PATH", "")
        res = subprocess.run([sass_tools._find_tool("cuobjdump"), "-sass", path], capture_output=True, text=True,
                             env=env, check=True)
    return res.stdout, ""


def _select(rows: list[dict], keys: str | None) -> list[dict]:
    if not keys:
        return rows
    subs = keys.split(",")
    return [r for r in rows if all(s in r["key"] for s in subs)]


def cmd_list(args) -> int:
    rows = instantiations(args.all_head_dims)
    text = json.dumps(rows, indent=1)
    if args.output:
        Path(args.output).write_text(text)
        print(len(rows), "instantiations ->", args.output)
    else:
        print(text)
    return 0


def cmd_hash(args) -> int:
    rows = _select(json.loads(Path(args.list).read_text()), args.keys)
    renames = [tuple(r.split("=", 1)) for r in args.rename]
    defines = [f"-D{d}" for d in args.defines]

    def one(row):
        text, log = compile_sass(row, args.root, renames, defines)
        return row["key"], text, log

    result, failed = {}, 0
    with ThreadPoolExecutor(args.jobs) as ex:
        for key, text, log in ex.map(one, rows):
            if text is None:
                print("FAIL", key, log, flush=True)
                result[key] = None
                failed += 1
                continue
            ins = normalise(text)
            digest = hashlib.sha1("\n".join(ins).encode()).hexdigest()[:16]
            result[key] = [digest, len(ins)]
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                Path(args.dump, key.replace(":", "_") + ".sass").write_text("\n".join(ins) + "\n")
            print(key, digest, len(ins), flush=True)
    Path(args.output).write_text(json.dumps(result, indent=1))
    print(f"{len(rows)} instantiations, {failed} failed -> {args.output}")
    return 1 if failed else 0


def cmd_diff(args) -> int:
    a, b = (json.loads(Path(p).read_text()) for p in (args.a, args.b))
    differ = 0
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            differ += 1
            print(f"{key}: {a.get(key, 'missing')} -> {b.get(key, 'missing')}")
    print(f"{len(set(a) | set(b))} instantiations, {differ} differ")
    return 1 if differ else 0


def cmd_show(args) -> int:
    rows = _select(instantiations(all_head_dims=True), args.keys)
    if not rows:
        print("no instantiation matches", args.keys)
        return 1
    for row in rows:
        text, log = compile_sass(row, args.src or str(ROOT / "kernels_cu"))
        print(f"== {row['key']} ({row['expr']})")
        if text is None:
            print(log)
        elif args.counts:
            ops = sass_tools.opcode_counts(text)
            span = sass_tools.mma_span_counts(text)
            print("  opcodes:", " ".join(f"{o}={n}" for o, n in ops.most_common()))
            print("  key-tile loop, first to last MMA:", " ".join(f"{o}={n}" for o, n in span.most_common()))
        else:
            print(text)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("show", help="SASS (or opcode counts) of some instantiations")
    p.add_argument("-k", "--keys", required=True, help="substrings every selected key holds, comma-separated")
    p.add_argument("--counts", action="store_true", help="opcode counts instead of the listing")
    p.add_argument("--src", help="the kernels_cu tree to compile (default: this checkout's)")
    p = sub.add_parser("list", help="the instantiations to fingerprint, as JSON")
    p.add_argument("-o", "--output", help="file to write (default: stdout)")
    p.add_argument("--all-head-dims", action="store_true", help="every head dim, not only the tuned ones")
    p = sub.add_parser("hash", help="SASS hashes of the listed instantiations, compiled from a tree")
    p.add_argument("list", help="a file written by list")
    p.add_argument("root", help="the kernels_cu directory to compile")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("-j", "--jobs", type=int, default=2, help="compiles at once (default 2)")
    p.add_argument("-k", "--keys", help="only keys holding these substrings, comma-separated")
    p.add_argument("--rename", action="append", default=[], metavar="OLD=NEW", help="in the name expressions")
    p.add_argument("--dump", metavar="DIR", help="write each normalised SASS there")
    p.add_argument("-D", dest="defines", action="append", default=[], metavar="NAME[=V]", help="an extra define")
    p = sub.add_parser("diff", help="instantiations whose hashes differ between two hash files")
    p.add_argument("a")
    p.add_argument("b")
    args = ap.parse_args(argv)
    missing = sass_tools.tools_available() if args.cmd in ("show", "hash") else None
    if missing:
        print(f"SASS tools unavailable: {missing}")
        return 2
    return {"show": cmd_show, "list": cmd_list, "hash": cmd_hash, "diff": cmd_diff}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
