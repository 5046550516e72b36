"""What the benchmark tables of ``python -m cuflash`` (bench_variants, bench_varlen, bench_shapes, bench_decode,
bench_programmable) share: the loop over rows and distributions that goes on past a failing case, and in their
reports the text table with aligned columns and the Markdown table, each followed by the rows' descriptions, the
notes and the conventions; the run's header (device, date, commit, versions) and what a run prints and writes at its
end."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Callable, Iterable, Sequence

from .bench import _short


def run_grid(rows, dists, case: Callable, failed: Callable, progress: Callable[[object, str, list], str],
             log: Callable[[str], None] = print, cleanup: Callable[[], None] = lambda: None) -> list:
    """The results of ``case(row, dist)`` (a list each) for every row x distribution, in that order, and a progress
    line per pair (``progress(row, dist, results)``). A case that raises (a harness bug, a dead context) gives
    ``failed(row, dist, reason)`` instead, is logged as FAILED, ``cleanup`` runs, and the grid goes on."""
    out = []
    for row in rows:
        for dist in dists:
            try:
                res = case(row, dist)
            except Exception as e:  # noqa: BLE001 - one case's failure is a line of the table, not the end of the run
                why = _short(e)
                res = failed(row, dist, why)
                log(f"  FAILED {row.name} [{dist}]: {why}")
                cleanup()
            out.extend(res)
            log(progress(row, dist, res))
            sys.stdout.flush()
    return out


def na_and_note_lines(results, with_dist: bool = True) -> list:
    """One line per (row, implementation) n/a reason and per note of ``results`` (objects with ``row``, ``dist``,
    ``na`` and ``notes``), deduplicated over distributions and passes; the notes name their distribution where
    ``with_dist``."""
    lines = {}
    for r in results:
        for impl, why in r.na.items():
            lines.setdefault(f"{r.row}: {impl} n/a: {why}", None)
        for note in r.notes:
            lines.setdefault(f"{r.row} [{r.dist}]: {note}" if with_dist else f"{r.row}: {note}", None)
    return list(lines)


def aligned_rows(head: Sequence[str], rows: Iterable[Sequence], left) -> list:
    """The lines of ``head`` and ``rows`` (lists of cells) as text columns two spaces apart, each as wide as its widest
    cell: the columns whose index is in ``left`` left-aligned, the others right-aligned."""
    rows = [list(head)] + [list(r) for r in rows]
    widths = [max(len(str(x[i])) for x in rows) for i in range(len(head))]
    return ["  ".join(str(c).ljust(w) if i in left else str(c).rjust(w) for i, (c, w) in enumerate(zip(x, widths)))
            for x in rows]


def markdown_rows(head: Sequence[str], rows: Iterable[Sequence]) -> list:
    """The lines of a Markdown table of ``head`` and ``rows`` (lists of cells)."""
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    return lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def text_report(head: Sequence[str], rows, left, descriptions: list, notes_title: str, notes: list,
                conventions: str) -> str:
    """The text table (:func:`aligned_rows`), then "rows:" and the ``descriptions``, ``notes_title`` and the ``notes``
    (where there are any), each indented, and the ``conventions`` after a blank line."""
    lines = aligned_rows(head, rows, left)
    lines += ["", "rows:"] + [f"  {x}" for x in descriptions]
    if notes:
        lines += [notes_title] + [f"  {x}" for x in notes]
    lines += ["", conventions]
    return "\n".join(lines)


def markdown_report(head: Sequence[str], rows, descriptions: list, notes_title: str, notes: list, conventions: str,
                    header: str = "") -> str:
    """``header`` (where given) and a blank line, the Markdown table, then the ``descriptions``, ``notes_title`` and
    the ``notes`` (where there are any) as lists, and the ``conventions``, each part after a blank line."""
    lines = [header, ""] if header else []
    lines += markdown_rows(head, rows)
    lines += [""] + [f"- {x}" for x in descriptions]
    if notes:
        lines += ["", notes_title, ""] + [f"- {x}" for x in notes]
    lines += ["", conventions]
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Run metadata


def git_commit() -> str:
    """The short commit of the checkout this cuflash runs from (``+dirty`` with uncommitted changes to tracked
    files), else "unknown (...)": a copy without .git (the device machine's), or an installed package."""
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)

    def git(*cmd):
        r = subprocess.run(["git", *cmd], cwd=root, capture_output=True, text=True, timeout=10)
        return r.stdout.strip() if r.returncode == 0 else None

    try:
        top = git("rev-parse", "--show-toplevel")
        if not top or os.path.realpath(top) != os.path.realpath(root):   # not this project's own checkout
            return "unknown (no git checkout here)"
        sha = git("rev-parse", "--short", "HEAD")
        if not sha:
            return "unknown (no commit)"
        return sha + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except Exception:  # noqa: BLE001 - no git here
        return "unknown (no git here)"


def fa4_version() -> str:
    """FlashAttention-4's part of a header: bench.fa4_status(), or what it raised."""
    from .bench import _short

    try:
        from .bench import fa4_status

        return fa4_status()
    except Exception as e:  # noqa: BLE001
        return f"FlashAttention-4: {_short(e)}"


def run_header(title: str, device: str, cc: int, parts: Sequence[str], warmup: int, repeats: int) -> str:
    """"<title>: <device> (sm_<cc>), <UTC date>, cuflash <version> commit <git_commit()>; <parts>; <warmup>
    warm-ups, <repeats> interleaved repeats (one run)", the parts (peers' versions ...) separated by "; "."""
    import datetime

    from . import __version__

    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return "; ".join([f"{title}: {device} (sm_{cc}), {date}, cuflash {__version__} commit {git_commit()}", *parts,
                      f"{warmup} warm-ups, {repeats} interleaved repeats (one run)"])


def print_results(args, text: str, markdown: Callable[[], str], doc: Callable[[], dict], bad: list) -> int:
    """The end of a table's run: prints ``text``, with ``args.markdown`` a blank line and ``markdown()``; with
    ``args.json`` writes ``doc()`` there; prints each line of ``bad`` (the failures) after "FAILED". 1 if there is
    any, else 0."""
    print(text)
    if args.markdown:
        print()
        print(markdown())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc(), f, indent=1)
    for line in bad:
        print(f"FAILED {line}")
    return 1 if bad else 0
