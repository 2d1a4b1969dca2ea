"""What a wheel of specjax holds: the embedded model's trained heads (so `--method eagle2` works
from a plain `pip install .`, not only from a checkout) and the native kernels' sources."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_heads_live_inside_the_package():
    import specjax
    from specjax.methods import HEAD_KINDS, SHIPPED_HEADS

    package = Path(specjax.__file__).resolve().parent
    assert SHIPPED_HEADS.parent == package
    for kind in set(HEAD_KINDS.values()):
        assert (SHIPPED_HEADS / "smollm2-135m" / kind / "specjax.json").is_file(), kind


def test_wheel_holds_the_heads_and_kernel_sources(tmp_path):
    had_build = (ROOT / "build").exists()
    try:
        _check_wheel(tmp_path)
    finally:  # setuptools builds in ROOT/build (git ignores it); leave the tree as it was
        if not had_build:
            shutil.rmtree(ROOT / "build", ignore_errors=True)


def _check_wheel(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "-q", "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = tmp_path.glob("specjax-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for kind in ("eagle", "eagle3", "medusa", "redrafter"):
        for f in ("heads.safetensors", "specjax.json"):
            assert f"specjax/shipped_heads/smollm2-135m/{kind}/{f}" in names, (kind, f)
    assert "specjax/cpu/rows_matmul.cc" in names
    assert not any(n.startswith("examples/") for n in names)
