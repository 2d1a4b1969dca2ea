"""What a wheel of specjax holds: one top-level package, `specjax`, with the top-level folders
kernels_pallas/, training/ and convert/ as its subpackages (pyproject.toml's package-dir), every
tracked module, the native kernels' sources and the embedded model's trained heads (so
`--method eagle2` works from a plain `pip install .`); installed, it imports and runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {
    "specjax": "specjax",
    "kernels_pallas": "specjax/kernels_pallas",
    "training": "specjax/training",
    "convert": "specjax/convert",
}


def tracked(folder: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", folder], cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        pytest.fail(f"git ls-files failed: {out.stderr.strip()}")
    return out.stdout.split()


def test_shipped_heads_live_inside_the_package():
    import specjax
    from specjax.methods import HEAD_KINDS, SHIPPED_HEADS

    package = Path(specjax.__file__).resolve().parent
    assert SHIPPED_HEADS.parent == package
    # The DFlash drafter trained here does not ship: it lost to EAGLE-2/3 (docs/benchmarks.md).
    for kind in set(HEAD_KINDS.values()) - {"dflash"}:
        assert (SHIPPED_HEADS / "smollm2-135m" / kind / "specjax.json").is_file(), kind


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    had_build = (ROOT / "build").exists()
    try:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "-q",
                "--no-deps",
                "--no-build-isolation",
                "-w",
                str(out),
                str(ROOT),
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:  # setuptools builds in ROOT/build (git ignores it); leave the tree as it was
        if not had_build:
            shutil.rmtree(ROOT / "build", ignore_errors=True)
    assert r.returncode == 0, r.stderr[-3000:]
    (path,) = out.glob("specjax-*.whl")
    return path


def test_the_wheel_has_one_top_level_package_holding_every_module(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"specjax"}, sorted(tops)
    top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["specjax"]
    missing = []
    for folder, dest in FOLDERS.items():
        files = [f for f in tracked(folder) if f.endswith((".py", ".cc", ".h")) or "/shipped_heads/" in f]
        assert files, folder
        missing += [f for f in files if dest + f[len(folder) :] not in names]
    assert not missing, missing
    for kind in ("eagle", "eagle3", "medusa", "redrafter"):
        for f in ("heads.safetensors", "specjax.json"):
            assert f"specjax/shipped_heads/smollm2-135m/{kind}/{f}" in names, (kind, f)
    assert "specjax/cpu/rows_matmul.cc" in names
    assert not any(n.startswith(("examples/", "tests/", "benchmarks/")) for n in names)


def test_the_installed_wheel_imports_and_runs_its_commands(wheel, tmp_path):
    site = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    installed = {p.name for p in site.iterdir() if not p.name.endswith(".dist-info")} - {"bin"}
    assert installed == {"specjax"}, sorted(installed)
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = (
        "import specjax, specjax.training.command, specjax.convert.gguf, specjax.kernels_pallas.paged_kv_write\n"
        "import specjax.attention\n"
        f"assert specjax.__file__.startswith({str(site)!r}), specjax.__file__\n"
        f"assert specjax.training.command.__file__.startswith({str(site)!r})\n"
        "import importlib.util\n"
        "assert all(importlib.util.find_spec(n) is None for n in ('training', 'convert', 'kernels_pallas'))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run(
        [sys.executable, "-m", "specjax.training", "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and "--method" in r.stdout, r.stderr[-3000:]
