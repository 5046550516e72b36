"""CPU-only: a built wheel carries the CUDA sources and finds them once installed."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # From a copy without build outputs: setuptools reuses ./build/lib, where a file since removed or
    # excluded would linger and reach the wheel.
    src = tmp_path_factory.mktemp("src") / "cuflash"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache"))
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(src)]
    # Offline first (the build backend is usually installed); else let pip fetch it.
    if subprocess.run(cmd[:5] + ["--no-build-isolation"] + cmd[5:]).returncode != 0:
        subprocess.run(cmd, check=True)
    (whl,) = out.glob("cuflash-*.whl")
    return whl


def test_wheel_contains_every_kernel_source(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p.relative_to(ROOT / "kernels_cu") for p in (ROOT / "kernels_cu").rglob("*.cu*"))
    assert sources
    missing = [str(s) for s in sources if f"cuflash/kernels_cu/{s.as_posix()}" not in names]
    assert not missing, f"kernel sources missing from the wheel: {missing}"


def test_wheel_holds_only_the_library(wheel):
    """No tests (their kernels and the SASS reader included), development tools, examples or benchmarks; the
    license is in the metadata."""
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.split("/")[0] in ("tests", "dev", "examples", "scripts", "tools", "benchmarks",
                                                        "docs")]
    assert not [n for n in names if n.split("/")[-1] in ("sass.py", "sass_tools.py", "gen_wgmma.py")], names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names


_LINK = re.compile(r"\]\(([^)\s]+)")   # the target of a Markdown link or image


def test_package_description_links_are_absolute(wheel):
    """The description an index renders (docs/package_description.md, in the wheel's METADATA) has
    no relative link: there is no repository beside it."""
    meta = next(zipfile.ZipFile(wheel).read(n).decode() for n in zipfile.ZipFile(wheel).namelist()
                if n.endswith(".dist-info/METADATA"))
    head, _, body = meta.partition("\n\n")
    assert "Description-Content-Type: text/markdown" in head
    assert "pip install" in body and "## Requirements" in body
    targets = _LINK.findall(body)
    assert targets and all(t.startswith("https://") for t in targets), targets


def test_readme_relative_links_resolve():
    """README.md is the repository's page: its relative links name files of the checkout."""
    targets = [t.split("#")[0] for t in _LINK.findall((ROOT / "README.md").read_text())]
    missing = [t for t in targets if t and not t.startswith("https://") and not (ROOT / t).exists()]
    assert not missing, missing


def test_one_version(wheel):
    """The wheel's version is cuflash.__version__ (pyproject reads it from there)."""
    import cuflash

    assert wheel.name.startswith(f"cuflash-{cuflash.__version__}-")


def test_installed_wheel_finds_its_sources(wheel, tmp_path):
    zipfile.ZipFile(wheel).extractall(tmp_path)
    code = (
        "import cuflash, cuflash.compile as c, cuflash.heuristics as h\n"
        "d = c.kernel_dir(); print(d)\n"
        "srcs = {cfg.source for cfg in h.all_fwd_configs(90)}\n"
        "assert all(len(c.load_source(s)) > 1000 for s in srcs), srcs\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr
    assert Path(res.stdout.strip()).is_relative_to(tmp_path), res.stdout
