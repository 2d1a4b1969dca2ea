"""Under CI=true a skip not on conftest.py's CI_ALLOWED_SKIPS fails the run (and says which)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_pytest(tmp_path, ci: str):
    (tmp_path / "test_some.py").write_text(
        "import pytest\n\ndef test_skipped():\n    pytest.skip('nothing here')\n\n"
        "def test_passes():\n    pass\n")
    env = {**os.environ, "CI": ci}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                           "tests.conftest", str(tmp_path / "test_some.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_an_unlisted_skip_fails_in_ci(tmp_path):
    r = run_pytest(tmp_path, "true")
    assert r.returncode == 1, r.stdout[-2000:]
    assert "test_some.py::test_skipped: Skipped: nothing here" in r.stdout


def test_skips_pass_outside_ci(tmp_path):
    r = run_pytest(tmp_path, "")
    assert r.returncode == 0, r.stdout[-2000:]
    assert "1 passed, 1 skipped" in r.stdout
