"""CPU-only: cuflash.options, the one place settings come from."""
from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest

from cuflash import heuristics, options
from cuflash.options import Options


def test_defaults_and_environment_parsing():
    assert options.from_environ({}) == Options()
    env = {"CUFLASH_FWD_BACKEND": " SM80 ", "CUFLASH_SM90_FWD_TILES": "128,64,12", "CUFLASH_SM90_BWD_SHORT": "0",
           "CUFLASH_NVRTC_DEFINES": "-DA=1  -DB", "CUFLASH_SM80_BWD_VARIANT": "1", "CUFLASH_LAUNCH": "cupy",
           "CUFLASH_SM90_FP8_PERSISTENT": "1", "CUFLASH_BWD_BACKEND": ""}
    opts = options.from_environ(env)
    assert opts == Options(fwd_backend="sm80", sm90_fwd_tiles=(128, 64, 12), sm90_bwd_short=False,
                           nvrtc_defines=("-DA=1", "-DB"), sm80_bwd_variant=1, launch="cupy",
                           sm90_fp8_persistent=True)


@pytest.mark.parametrize("var,value", [("CUFLASH_FWD_BACKEND", "sm90_pingpong"), ("CUFLASH_FWD_BACKEND", "sm90_simple"),
                                       ("CUFLASH_BWD_BACKEND", "sm100"), ("CUFLASH_SM90_FWD_CLUSTER", "yes"),
                                       ("CUFLASH_SM90_BWD_SHORT", "true"),
                                       ("CUFLASH_SM90_FWD_TILES", "128,64"), ("CUFLASH_SM80_FWD_TILES", "a,b,c"),
                                       ("CUFLASH_SM80_BWD_VARIANT", "3"), ("CUFLASH_LAUNCH", "driver")])
def test_bad_environment_values_name_the_variable(var, value):
    with pytest.raises(ValueError, match=var):
        options.from_environ({var: value})


def test_first_slice_stores_follow_the_build():
    """The Hopper backward's preprocess zeroes every dQ sum exactly when the build's defines turn the
    first-slice stores off (kernels_cu/sm90/bwd_scheduler.cuh), with no option of its own."""
    from cuflash import sm90
    from cuflash.config import KernelConfig

    ordered = [c for c in heuristics.all_sm90_bwd_configs() if c.fam.dq_mode == "ordered"][0]
    tile = [c for c in heuristics.all_sm90_bwd_configs() if c.fam.dq_mode == "tile"][0]
    assert isinstance(ordered, KernelConfig)
    cases = {(): (True, True), ("-DA=1",): (True, True),
             ("-DCUFLASH_SM90_BWD_FIRST_STORE=0",): (False, True),
             ("-D", "CUFLASH_SM90_BWD_FIRST_STORE=0"): (False, True),
             ("-DCUFLASH_SM90_BWD_CLAIM_FIRST=0",): (True, False),
             ("-DCUFLASH_SM90_BWD_TRACE",): (True, False),
             ("-DCUFLASH_SM90_BWD_TRACE", "-DCUFLASH_SM90_BWD_CLAIM_FIRST=1"): (True, True),
             ("-DCUFLASH_SM90_BWD_FIRST_STORE=1",): (True, True)}
    for defines, (stored_ordered, stored_tile) in cases.items():
        opts = Options(nvrtc_defines=defines)
        assert sm90.bwd_first_slice_stored(ordered, opts) is stored_ordered, defines
        assert sm90.bwd_first_slice_stored(tile, opts) is stored_tile, defines


def test_bad_fields():
    with pytest.raises(ValueError, match="CUFLASH_FWD_BACKEND"):
        Options(fwd_backend="nonsense")
    with pytest.raises(ValueError, match="CUFLASH_SM90_BWD_TILES"):
        Options(sm90_bwd_tiles=(64, 0, 12))
    with pytest.raises(TypeError, match="CUFLASH_SM90_BWD_SHORT"):
        Options(sm90_bwd_short="1")
    with pytest.raises(TypeError, match="CUFLASH_NVRTC_DEFINES"):
        Options(nvrtc_defines="-DA")
    with pytest.raises(TypeError, match="unknown cuflash option"):
        options.set(fwd_backends="sm80")
    with pytest.raises(TypeError):
        options.use({"fwd_backend": "sm80"})


def test_plan_cc_parses_and_validates():
    """CUFLASH_PLAN_CC: a known compute capability as an int (Options.plan_cc), None unset; anything else refused
    naming the variable and the allowed values (what a device can honour is dispatch.device_info's check)."""
    assert Options().plan_cc is None and options.from_environ({"CUFLASH_PLAN_CC": ""}).plan_cc is None
    assert options.from_environ({"CUFLASH_PLAN_CC": " 86 "}).plan_cc == 86
    assert Options(plan_cc=120).plan_cc == 120
    for text in ("8.6", "sm_80", "85", "75", "0"):
        with pytest.raises(ValueError, match="CUFLASH_PLAN_CC"):
            options.from_environ({"CUFLASH_PLAN_CC": text})
    for value in (85, 75, True, "80", 80.0):
        with pytest.raises(ValueError, match=r"CUFLASH_PLAN_CC \(Options.plan_cc\) must be None or .*80, 86"):
            Options(plan_cc=value)
    assert options.set(plan_cc=89).plan_cc == 89 and options.set(plan_cc=None).plan_cc is None


def test_plan_ccs_are_the_known_tables():
    """The values CUFLASH_PLAN_CC takes are the compute capabilities whose opt-in shared memory the tables know,
    and the 'large' class (>= 160 KB) is theirs that have it."""
    assert options.PLAN_CCS == tuple(sorted(heuristics.SMEM_OPTIN))
    for cc, limit in heuristics.SMEM_OPTIN.items():
        assert (heuristics.smem_class(cc) == "large") == (limit >= 160 * 1024), cc
    assert [cc for cc in options.PLAN_CCS if heuristics.smem_class(cc) == "small"] == [86, 89, 120, 121]


def test_forced_backends_match_the_heuristics():
    assert options.FWD_BACKENDS == ("auto", "sm80") + heuristics.SM90_FWD_BACKENDS
    assert options.BWD_BACKENDS == ("auto", "sm80") + heuristics.SM90_BWD_BACKENDS


def test_reload_reads_the_environment_again(monkeypatch):
    monkeypatch.delenv("CUFLASH_FWD_BACKEND", raising=False)
    options.reload()
    monkeypatch.setenv("CUFLASH_FWD_BACKEND", "sm80")
    assert options.current().fwd_backend == "auto"   # read once, not per call
    assert options.reload().fwd_backend == "sm80" and options.current().fwd_backend == "sm80"
    assert heuristics.fwd_config("bfloat16", 128, False, 90).family == "sm80_fwd"


def test_override_restores_and_is_seen_by_the_heuristics():
    before = options.current()
    with options.override(fwd_backend="sm80", sm80_fwd_tiles=(64, 64, 4)) as opts:
        assert options.current() is opts
        cfg = heuristics.fwd_config("bfloat16", 128, False, 90)
        assert (cfg.family, cfg.block_m, cfg.block_n, cfg.num_warps) == ("sm80_fwd", 64, 64, 4)
    assert options.current() is before
    with pytest.raises(RuntimeError):
        with options.override(bwd_backend="sm80"):
            raise RuntimeError
    assert options.current() is before


def test_set_from_threads_publishes_whole_objects():
    """Threads switching settings see one published object or another, never a mix; equal settings
    share one token."""
    errors = []

    def worker(i):
        for _ in range(200):
            opts = options.set(sm90_fwd_tiles=(64 * (1 + i % 2), 128, 12))
            cur = options.current()
            if cur.sm90_fwd_tiles not in ((64, 128, 12), (128, 128, 12)) or opts.token == 0:
                errors.append(cur)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert options.set(sm90_fwd_tiles=(64, 128, 12)) is options.set(sm90_fwd_tiles=(64, 128, 12))


def test_only_options_reads_the_environment():
    """Every cuflash setting comes through options.current(); the rest of the package does not read
    os.environ (distributed/launch.py sets NCCL's variables for the processes it starts)."""
    root = Path(__file__).resolve().parent.parent / "cuflash"
    allowed = {"options.py", "sass.py"}
    reads = re.compile(r"os\.environ(\.get|\[|\b(?!\.setdefault))|os\.getenv")
    found = [f"{p.relative_to(root)}:{i}" for p in sorted(root.rglob("*.py")) if p.name not in allowed
             for i, line in enumerate(p.read_text().splitlines(), 1) if reads.search(line)]
    assert not found, found


def test_readme_documents_every_variable():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    doc = options.__doc__
    for var in options.ENV.values():
        assert var in doc, var
        assert var in readme, var


def test_kernel_dir_option_selects_the_sources(tmp_path):
    """CUFLASH_KERNEL_DIR (a path, case kept) points the compiles at another copy of kernels_cu/: load_source
    reads that copy's text, and the smem and module caches keep the trees apart; a folder that is no copy is
    refused by name."""
    import shutil

    from cuflash import compile as cf_compile

    assert options.from_environ({"CUFLASH_KERNEL_DIR": " /Some/Path "}).kernel_dir == "/Some/Path"
    with pytest.raises(TypeError, match="CUFLASH_KERNEL_DIR"):
        Options(kernel_dir=Path("/x"))
    own = cf_compile.kernel_dir()
    assert own == cf_compile.package_kernel_dir()
    copy = tmp_path / "kernels_cu"
    shutil.copytree(own, copy)
    source = "sm80/fwd.cu"
    (copy / source).write_text((copy / source).read_text() + "\n// patched copy\n")
    original = cf_compile.load_source(source)
    with options.override(kernel_dir=str(copy)):
        assert cf_compile.kernel_dir() == copy.resolve()
        assert cf_compile.load_source(source).endswith("// patched copy\n")
    assert cf_compile.load_source(source) == original
    with options.override(kernel_dir=str(tmp_path)):
        with pytest.raises(FileNotFoundError, match="CUFLASH_KERNEL_DIR"):
            cf_compile.load_source(source)
