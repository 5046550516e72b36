"""Shared checks of the benchmark tables' command lines (cuflash/bench_decode.py, bench_varlen.py)."""
from __future__ import annotations

from cuflash.__main__ import parse_args


def run_table(module, argv, capsys, rc: int = 0) -> str:
    """``module.run`` (a table's ``python -m cuflash`` entry) on the command line ``argv`` for a "Fake GPU" (sm_90):
    asserts that it returns ``rc``; what it printed."""
    assert module.run(parse_args(argv), "Fake GPU", 90) == rc
    return capsys.readouterr().out
