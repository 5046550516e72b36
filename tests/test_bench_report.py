"""bench_report's shared loop and notes (no GPU): a failing case becomes its failed rows and the grid goes on."""
from types import SimpleNamespace

from cuflash.bench_report import na_and_note_lines, run_grid


def test_run_grid_goes_on_past_a_failing_case():
    rows = [SimpleNamespace(name="a"), SimpleNamespace(name="b")]
    logged, cleaned = [], []

    def case(row, dist):
        if row.name == "a" and dist == "sharp":
            raise RuntimeError("dead context\nsecond line")
        return [(row.name, dist, "ok")]

    def failed(row, dist, why):
        return [(row.name, dist, why)]

    out = run_grid(rows, ["normal", "sharp"], case, failed, lambda row, dist, res: f"{row.name} {dist} {len(res)}",
                   logged.append, lambda: cleaned.append(1))
    assert [x[:2] for x in out] == [("a", "normal"), ("a", "sharp"), ("b", "normal"), ("b", "sharp")]
    assert out[1][2] == "RuntimeError: dead context second line"
    assert [x[2] for x in out if x != out[1]] == ["ok"] * 3
    assert cleaned == [1]
    assert logged[1].startswith("  FAILED a [sharp]: RuntimeError") and logged[-1] == "b sharp 1"


def test_na_and_note_lines_are_deduplicated_over_passes_and_distributions():
    def r(dist, na, notes):
        return SimpleNamespace(row="x", dist=dist, na=na, notes=notes)

    results = [r("normal", {"fa4": "no wheel"}, ["n1"]), r("normal", {"fa4": "no wheel"}, ["n1"]),
               r("sharp", {"fa4": "no wheel"}, ["n1"])]
    assert na_and_note_lines(results) == ["x: fa4 n/a: no wheel", "x [normal]: n1", "x [sharp]: n1"]
    assert na_and_note_lines(results, with_dist=False) == ["x: fa4 n/a: no wheel", "x: n1"]
