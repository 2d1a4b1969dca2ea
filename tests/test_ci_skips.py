"""Under CI=true a skip not on conftest.py's CI_ALLOWED_SKIPS fails the run (and says which),
run in-process and across pytest-xdist workers (pyproject's addopts), whose reports reach the
controller."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_pytest(tmp_path, ci: str, workers: str):
    (tmp_path / "test_some.py").write_text(
        "import pytest\n\ndef test_skipped():\n    pytest.skip('nothing here')\n\ndef test_passes():\n    pass\n"
    )
    (tmp_path / "test_skipped_module.py").write_text(
        "import pytest\n\npytest.skip('no module here', allow_module_level=True)\n"
    )
    env = {**os.environ, "CI": ci}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-n",
            workers,
            "-p",
            "no:cacheprovider",
            "-p",
            "tests.conftest",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("workers", ["0", "2"])
def test_an_unlisted_skip_fails_in_ci(tmp_path, workers):
    r = run_pytest(tmp_path, "true", workers)
    assert r.returncode == 1, r.stdout[-2000:]
    assert "test_some.py::test_skipped: Skipped: nothing here" in r.stdout
    assert "test_skipped_module.py: Skipped: no module here" in r.stdout


@pytest.mark.parametrize("workers", ["0", "2"])
def test_skips_pass_outside_ci(tmp_path, workers):
    r = run_pytest(tmp_path, "", workers)
    assert r.returncode == 0, r.stdout[-2000:]
    assert "1 passed, 2 skipped" in r.stdout
