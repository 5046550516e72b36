"""The score-distribution axis of the benchmarks: cuflash.distributions, the --dists option of
``python -m cuflash``, its table, and the FlashAttention-4 peer's import. CPU tests check the
parsing, the formulas and the formatting; GPU tests check what the inputs really give."""
from __future__ import annotations

import io
import math
import os
import sys
from contextlib import redirect_stdout

import numpy as np
import pytest
from conftest import requires_gpu

from cuflash import bench, options
from cuflash.__main__ import main, markdown_table, parse_args, print_table, table_shapes
from cuflash.bench import DIST_SHAPES, QUICK_SHAPES, STANDARD_SHAPES, Shape
from cuflash.dist_table import dist_summary, format_dist_table, markdown_dist_table
from cuflash.distributions import (DISTRIBUTIONS, OUTLIER_CHANNELS, make_inputs, outlier_channels, sampled_scores,
                                   score_std, target_score_std)

# --- the command line (CPU) ---


def test_no_dists_flag_keeps_the_standard_table():
    args = parse_args([])
    assert args.dists is None
    assert table_shapes(args) == STANDARD_SHAPES
    assert args.repeats == 30 and args.warmup == 5


def test_dists_flag_alone_means_all_five():
    args = parse_args(["--dists"])
    assert args.dists == DISTRIBUTIONS == ("normal", "outlier8", "outlier12", "sharp", "sink", "mixed")
    assert table_shapes(args) == DIST_SHAPES


def test_dists_flag_before_other_options():
    args = parse_args(["--dists", "--markdown", "--json", "x.json", "--repeats", "15", "--warmup", "3"])
    assert args.dists == DISTRIBUTIONS
    assert args.markdown and args.json == "x.json" and args.repeats == 15 and args.warmup == 3


@pytest.mark.parametrize("argv,expected", [
    (["--dists", "sink"], ("sink",)),
    (["--dists", "normal", "sharp"], ("normal", "sharp")),
    (["--dists", "outlier8,outlier12"], ("outlier8", "outlier12")),
    (["--dists", "sharp,normal", "sharp"], ("sharp", "normal")),  # order kept, repeats dropped
])
def test_dists_named(argv, expected):
    assert parse_args(argv).dists == expected


@pytest.mark.parametrize("bad", ["gauss", "normal,spiky", ""])
def test_dists_unknown_name_is_a_usage_error(bad, capsys):
    argv = ["--dists", bad]
    if bad == "":  # an empty name list is no name: all of them
        assert parse_args(argv).dists == DISTRIBUTIONS
        return
    with pytest.raises(SystemExit) as e:
        main(argv)  # fails in parsing, before CuPy or a GPU is touched
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown distribution" in err and "outlier12" in err


def test_shape_option_overrides_the_dist_shapes():
    args = parse_args(["--dists", "sharp", "--shape", "1,2,256,64,float16,causal", "--shape", "2,4,512,128,bfloat16"])
    assert table_shapes(args) == [Shape(1, 2, 256, 64, "float16", True), Shape(2, 4, 512, 128, "bfloat16", False)]
    assert table_shapes(parse_args(["--dists", "--quick"])) == QUICK_SHAPES


def test_help_names_the_option(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "--dists" in out and "--warmup" in out


def test_dist_shapes():
    assert len(DIST_SHAPES) == 12
    assert all((s.batch, s.heads, s.seqlen) == (4, 16, 4096) for s in DIST_SHAPES)
    assert {(s.head_dim, s.dtype, s.causal) for s in DIST_SHAPES} == {
        (d, dt, c) for d in (64, 128, 256) for dt in ("float16", "bfloat16") for c in (False, True)}


# --- the distributions' definitions (CPU) ---


def test_target_score_std():
    for d in (64, 128, 256):
        assert target_score_std("normal", d) == 1.0
        assert target_score_std("sharp", d) == pytest.approx(8.0)
        assert target_score_std("sink", d) == 1.0
    assert target_score_std("outlier8", 128) == pytest.approx(11.36, abs=0.01)
    assert target_score_std("outlier12", 128) == pytest.approx(25.47, abs=0.01)
    assert target_score_std("outlier8", 64) == pytest.approx(16.03, abs=0.01)
    assert target_score_std("outlier12", 256) == pytest.approx(18.03, abs=0.01)
    # mixed: the pooled std of the kinds its KV heads take
    assert target_score_std("mixed", 128) == pytest.approx(((1 + 11.36 ** 2 + 25.47 ** 2 + 64 + 1) / 5) ** 0.5, abs=0.02)
    assert target_score_std("mixed", 128, heads_kv=2) == pytest.approx(((1 + 11.36 ** 2) / 2) ** 0.5, abs=0.01)
    with pytest.raises(ValueError, match="unknown distribution"):
        target_score_std("laplace", 128)


def test_outlier_channels_are_fixed_by_the_seed():
    a = outlier_channels(128, seed=0)
    assert len(a) == OUTLIER_CHANNELS == len(set(a.tolist()))
    assert all(0 <= c < 128 for c in a) and list(a) == sorted(a)
    assert np.array_equal(a, outlier_channels(128, seed=0))
    assert any(not np.array_equal(a, outlier_channels(128, seed=s)) for s in range(1, 5))


def test_make_inputs_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown distribution"):
        make_inputs(Shape(1, 1, 8, 8, "float16", False), "uniform")


# --- the tables (CPU) ---


def _dist_rows(with_fa4: bool) -> list[dict]:
    rows = []
    for dist, std in (("normal", 1.0), ("sharp", 7.9)):
        for shape, base in (("B=4 H=16 N=4096 D=64 float16", 400.0), ("B=4 H=16 N=4096 D=128 bfloat16 causal", 500.0)):
            for p in ("fwd", "fwd+bwd"):
                r = {"shape": shape, "dist": dist, "score_std": std, "pass": p, "cuflash": base,
                     "sdpa_cudnn": base / 1.25, "sdpa_flash": base / 2}
                if with_fa4:
                    r["fa4"] = base / 0.8
                rows.append(r)
    return rows


def test_dist_table_with_fa4():
    rows = _dist_rows(with_fa4=True)
    text = format_dist_table(rows)
    head = text.splitlines()[1].split()
    assert head == ["shape", "dist", "std", "pass", "cuflash", "sdpa_cudnn", "sdpa_flash", "fa4", "x", "cudnn",
                    "x", "fa4"]
    assert "sharp" in text and "7.90" in text and "1.25" in text and "0.80" in text
    md = markdown_dist_table(rows).splitlines()
    assert md[0] == ("| shape | dist | score std | pass | cuflash | sdpa_cudnn | sdpa_flash | fa4 | cuflash / cudnn "
                     "| cuflash / fa4 |")
    assert md[2] == ("| B=4 H=16 N=4096 D=64 float16 | normal | 1.00 | fwd | 400.0 | 320.0 | 200.0 | 500.0 "
                     "| 1.25 | 0.80 |")
    summary = dist_summary(rows)
    assert [(s["dist"], s["pass"]) for s in summary] == [("normal", "fwd"), ("normal", "fwd+bwd"), ("sharp", "fwd"),
                                                         ("sharp", "fwd+bwd")]
    assert all(s["sdpa_cudnn"] == pytest.approx(1.25) and s["fa4"] == pytest.approx(0.8) for s in summary)


def test_dist_table_without_fa4_has_no_fa4_column():
    rows = _dist_rows(with_fa4=False)
    rows[0]["sdpa_cudnn"] = None  # a peer that could not run a shape
    assert "fa4" not in format_dist_table(rows) and "fa4" not in markdown_dist_table(rows)
    assert markdown_dist_table(rows).splitlines()[2].endswith("| - |")
    assert "sdpa_cudnn" in dist_summary(rows)[0]  # the other shape still counts


def _std_rows() -> list[dict]:
    return [{"shape": "B=4 H=16 N=4096 D=64 float16", "pass": "fwd", "cuflash": 500.0, "cupy": 90.0,
             "sdpa_flash": 400.0, "sdpa_cudnn": 450.0},
            {"shape": "B=4 H=16 N=4096 D=64 float16", "pass": "fwd+bwd", "cuflash": 420.0, "sdpa_flash": 300.0,
             "sdpa_cudnn": 400.0}]


def test_standard_table_unchanged_without_fa4():
    buf = io.StringIO()
    with redirect_stdout(buf):
        print_table(_std_rows())
    lines = buf.getvalue().splitlines()
    assert lines[1].split() == ["shape", "pass", "cuflash", "cupy", "sdpa_flash", "sdpa_cudnn", "x", "flash", "x",
                                "cudnn"]
    assert markdown_table(_std_rows()).splitlines()[0] == (
        "| shape | pass | cuflash | cupy | sdpa_flash | sdpa_cudnn | cuflash / flash | cuflash / cudnn |")


def test_standard_table_fa4_column():
    rows = _std_rows()
    for r in rows:
        r["fa4"] = r["cuflash"] / 0.9
    buf = io.StringIO()
    with redirect_stdout(buf):
        print_table(rows)
    head = buf.getvalue().splitlines()[1]
    assert "fa4" in head and head.rstrip().endswith("x fa4")
    assert markdown_table(rows).splitlines()[2].endswith("| 0.90 |")


def test_fp8_rows_get_their_own_labelled_table():
    """The fp8 rows print below the standard ones, in a table whose columns say which peer ran in bf16
    and which (cuDNN through cudnn-frontend) in fp8, so that no ratio reads as one against cuDNN's fp8."""
    fp8 = [{"shape": "B=4 H=16 N=4096 D=128 fp8", "pass": "fwd fp8", "cuflash": 870.0, "cudnn_fp8": 900.0,
            "sdpa_flash_bf16": 360.0, "sdpa_cudnn_bf16": 670.0},
           {"shape": "B=4 H=16 N=4096 D=64 fp8", "pass": "fwd fp8", "cuflash": 600.0, "sdpa_flash_bf16": 300.0,
            "sdpa_cudnn_bf16": 480.0}]
    buf = io.StringIO()
    with redirect_stdout(buf):
        print_table(_std_rows() + fp8)
    lines = buf.getvalue().splitlines()
    assert lines[1].split()[:6] == ["shape", "pass", "cuflash", "cupy", "sdpa_flash", "sdpa_cudnn"]
    title = lines.index(next(x for x in lines if x.startswith("fp8 forward")))
    assert "cudnn_fp8" not in lines[1] and "cuDNN's fp8 forward" in lines[title]
    assert lines[title + 1].split()[2:] == ["cuflash", "cudnn_fp8", "sdpa_flash_bf16", "sdpa_cudnn_bf16", "x", "cudnn",
                                            "fp8", "x", "flash", "bf16", "x", "cudnn", "bf16"]
    assert lines[title + 2].split()[-3:] == ["0.97", "2.42", "1.30"]
    assert lines[title + 3].split()[-3] == "nan"   # no cuDNN fp8 for that row
    md = markdown_table(_std_rows() + fp8).splitlines()
    assert md[0].startswith("| shape | pass | cuflash | cupy |")
    head = next(x for x in md if x.startswith("| shape") and "cudnn_fp8" in x)
    assert head.endswith("| cuflash / cudnn fp8 | cuflash / flash bf16 | cuflash / cudnn bf16 |")
    assert md[-1].endswith("| - | 2.00 | 1.25 |")


def test_benchmark_dists_rows(monkeypatch, capsys):
    """The table's loop with stand-ins for the inputs, the kernels, the peers and the clock."""
    from cuflash import dist_table, distributions

    calls = []

    def fake_peer(name):
        def run(q, k, v, causal):
            calls.append(name)
            if name == "broken":
                raise RuntimeError("no kernel for this shape")
        return run

    monkeypatch.setattr(distributions, "make_inputs", lambda shape, dist, seed=0: (dist, "k", "v"))
    monkeypatch.setattr(distributions, "score_std", lambda q, k: {"normal": 1.0, "sharp": 8.0}[q])
    monkeypatch.setattr(bench, "random_inputs", lambda shape, seed=0: ("dout",))
    monkeypatch.setattr(bench, "cuflash_pass_fns", lambda q, k, v, causal, dout=None, passes=bench.PASSES:
                        {p: (lambda: None) for p in passes})
    monkeypatch.setattr(bench, "peer_impls", lambda: {"sdpa_cudnn": (fake_peer("sdpa_cudnn"), True),
                                                      "broken": (fake_peer("broken"), True),
                                                      "fa4": (fake_peer("fa4"), False)})
    monkeypatch.setattr(bench, "torch_views", lambda arrays, sdpa_layout=False, requires_grad=False: list(arrays))
    monkeypatch.setattr(bench, "torch_pass_fns", lambda fn, q, k, v, causal, dout=None, passes=bench.PASSES:
                        fn(q, k, v, causal) or {p: (lambda: None) for p in passes})
    ms = {"cuflash": 1.0, "sdpa_cudnn": 1.25, "fa4": 0.8}
    monkeypatch.setattr(bench, "time_interleaved",
                        lambda fns, warmup, repeats: {key: ms[key[0]] for key in fns})
    monkeypatch.setattr(dist_table, "free_memory", lambda: None)
    shape = Shape(1, 1, 1024, 64, "float16", False)
    rows = dist_table.benchmark_dists([shape], ("normal", "sharp"), repeats=2, warmup=1)
    assert [(r["dist"], r["pass"]) for r in rows] == [("normal", "fwd"), ("normal", "fwd+bwd"), ("sharp", "fwd"),
                                                      ("sharp", "fwd+bwd")]
    assert rows[2]["score_std"] == 8.0 and "broken" not in rows[0]
    assert rows[0]["cuflash"] == pytest.approx(bench.tflops(shape.fwd_flops(), 1.0))
    assert rows[1]["cuflash"] == pytest.approx(bench.tflops(3.5 * shape.fwd_flops(), 1.0))
    assert rows[1]["cuflash"] / rows[1]["sdpa_cudnn"] == pytest.approx(1.25)
    assert rows[1]["cuflash"] / rows[1]["fa4"] == pytest.approx(0.8)
    assert "broken skipped" in capsys.readouterr().out
    fwd_only = dist_table.benchmark_dists([shape], ("normal",), backward=False)
    assert [r["pass"] for r in fwd_only] == ["fwd"]


# --- the FlashAttention-4 import (CPU, a stand-in package) ---


@pytest.fixture
def fake_fa4(tmp_path, monkeypatch):
    """A stand-in ``flash_attn.cute`` in two path entries, named by $CUFLASH_FA4_PATH."""
    pkg = tmp_path / "site" / "flash_attn"
    (pkg / "cute").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "cute" / "__init__.py").write_text(
        "def flash_attn_func(q, k, v, softmax_scale=None, causal=False):\n"
        "    return ('out', q, causal), 'lse'\n")
    extra = tmp_path / "dsl"
    extra.mkdir()
    monkeypatch.setattr(sys, "path", list(sys.path))
    for mod in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setenv(bench.FA4_PATH_ENV, f"{extra}{os.pathsep}{tmp_path / 'site'}")
    options.reload()   # conftest restores the options after the test
    yield [str(extra), str(tmp_path / "site")]
    for mod in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        del sys.modules[mod]


def test_fa4_path_goes_first_in_order(fake_fa4):
    fn, why = bench._import_fa4()
    assert why is None and fn is not None
    assert sys.path[:2] == fake_fa4
    bench._import_fa4()  # a second import adds nothing
    assert sys.path.count(fake_fa4[0]) == 1


def test_fa4_output_tuple_is_unwrapped(fake_fa4):
    fn, _ = bench._import_fa4()
    assert bench._first_output(fn)("q", "k", "v", True) == ("out", "q", True)
    assert bench._first_output(lambda q, k, v, causal: "o")("q", "k", "v", False) == "o"


def test_fa4_absent(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "path", list(sys.path))
    options.set(fa4_path=(str(tmp_path),))
    if any(m == "flash_attn" for m in sys.modules):
        pytest.skip("a flash_attn package is already imported")
    try:
        import flash_attn.cute  # noqa: F401
        pytest.skip("FlashAttention-4 is installed here")
    except Exception:  # noqa: BLE001
        pass
    fn, why = bench._import_fa4()
    assert fn is None and why
    assert "not importable" in bench.fa4_status()


# --- what the inputs give (GPU) ---

GPU_SHAPES = [Shape(1, 4, 1024, 128, "bfloat16", False), Shape(1, 4, 512, 64, "float16", False, heads_kv=2),
              Shape(2, 2, 256, 256, "bfloat16", True)]


@requires_gpu
@pytest.mark.parametrize("dist", DISTRIBUTIONS)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: s.label().replace(" ", "_"))
def test_measured_score_std(shape, dist):
    q, k, v = make_inputs(shape, dist)
    assert q.shape == (shape.batch, shape.seqlen, shape.heads, shape.head_dim)
    assert k.shape == v.shape == (shape.batch, shape.nk, shape.hkv, shape.head_dim)
    assert q.dtype.name == k.dtype.name == v.dtype.name == shape.dtype
    for x in (q, k, v):
        assert bool(np.isfinite(x.astype(np.float32).get()).all())
    target = target_score_std(dist, shape.head_dim, heads_kv=shape.hkv)
    measured = score_std(q, k)
    assert target / 1.5 <= measured <= target * 1.5, f"{dist}: score std {measured:.2f}, target {target:.2f}"


@requires_gpu
@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_same_draws_as_random_inputs(dist):
    shape = GPU_SHAPES[1]
    q, k, v = make_inputs(shape, dist, seed=3)
    q0, k0, v0 = bench.random_inputs(shape, seed=3)
    assert (v == v0).all()  # v is never reshaped
    if dist == "normal":
        assert (q == q0).all() and (k == k0).all()
    q2, k2, _ = make_inputs(shape, dist, seed=3)
    assert (q == q2).all() and (k == k2).all()  # a function of the seed
    q3, _, _ = make_inputs(shape, dist, seed=4)
    assert not (q == q3).all()


@requires_gpu
@pytest.mark.parametrize("shape", GPU_SHAPES[:2], ids=lambda s: s.label().replace(" ", "_"))
def test_outliers_sit_in_the_fixed_channels(shape):
    q, k, _ = make_inputs(shape, "outlier12")
    ch = outlier_channels(shape.head_dim, 0)
    for x in (q, k):
        rms = np.sqrt((x.astype(np.float32).get() ** 2).reshape(-1, shape.head_dim).mean(0))
        assert np.all(rms[ch] > 8) and np.median(rms) < 1.5


@requires_gpu
@pytest.mark.parametrize("shape", [Shape(1, 4, 2048, 128, "bfloat16", False), GPU_SHAPES[1]],
                         ids=lambda s: s.label().replace(" ", "_"))
def test_sink_takes_most_of_the_weight(shape):
    import cupy

    q, k, _ = make_inputs(shape, "sink")
    s = sampled_scores(q, k)
    p = cupy.exp(s - s.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    w0 = float(p[:, 0].mean())
    assert w0 > 0.5, f"key 0 takes {w0:.2f} of the weight on average"
    gap = float(s[:, 0].mean() - s[:, 1:].mean())
    assert 8 <= gap <= 12, gap
    others = float(s[:, 1:].std())
    assert others == pytest.approx(1.0, abs=0.15)  # the other keys do not see the shift of q
    qn, kn, _ = make_inputs(shape, "normal")
    sn = sampled_scores(qn, kn)
    pn = cupy.exp(sn - sn.max(axis=1, keepdims=True))
    assert float((pn[:, 0] / pn.sum(axis=1)).mean()) < 10 / shape.nk


@requires_gpu
def test_sampled_scores_match_a_full_product():
    shape = Shape(1, 2, 64, 32, "float16", False)
    q, k, _ = make_inputs(shape, "sharp")
    s = sampled_scores(q, k, softmax_scale=0.3, samples=128)  # 2 pairs x all 64 rows
    assert s.shape == (128, 64)
    qf, kf = q.astype(np.float32).get(), k.astype(np.float32).get()
    full = np.concatenate([qf[0, :, h] @ kf[0, :, h].T * 0.3 for h in range(2)])
    got = np.sort(s.get(), axis=None)
    assert np.allclose(got, np.sort(full, axis=None), rtol=1e-4, atol=1e-3)
    assert math.isclose(score_std(q, k, 0.3, samples=128), float(full.std()), rel_tol=1e-3)


@requires_gpu
def test_torch_views_share_memory():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    for dtype in ("float16", "bfloat16"):
        shape = Shape(1, 2, 16, 64, dtype, False)
        q, k, v = make_inputs(shape, "outlier8")
        tq, tk, tv = bench.torch_views((q, k, v), sdpa_layout=True, requires_grad=True)
        assert tq.shape == (1, 2, 16, 64) and tq.requires_grad
        assert tq.data_ptr() == q.data.ptr and tv.data_ptr() == v.data.ptr
        assert np.array_equal(tq.detach().float().cpu().numpy(), q.astype(np.float32).get().transpose(0, 2, 1, 3))
        (fq,) = bench.torch_views((q,))
        assert fq.shape == q.shape and fq.is_contiguous()
