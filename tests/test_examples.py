"""Every example in examples/ runs to completion in its reduced mode (SPECJAX_EXAMPLES_SMOKE=1),
prints sane numbers, and custom_loop.py's tokens equal `specjax generate`'s."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
POEM = "Write a short poem about the sea."
SMOKE_TOKENS = 24  # custom_loop.py's reduced-mode budget


def run(*cmd, env=None, timeout=900) -> str:
    """stdout of a command run from the repository root in reduced mode (fails on exit != 0)."""
    full = {**os.environ, "SPECJAX_EXAMPLES_SMOKE": "1", "JAX_PLATFORMS": "cpu", **(env or {})}
    full.pop("XLA_FLAGS", None)  # sharded.py sets its own device count
    p = subprocess.run([str(c) for c in cmd], cwd=ROOT, env=full, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{cmd} failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    return p.stdout


def fields(line: str) -> dict:
    """key=value pairs of a printed summary line (numbers as floats, True/False as bools)."""
    out = {}
    for k, v in re.findall(r"(\w+)=(\S+)", line):
        out[k] = v == "True" if v in ("True", "False") else float(v) if re.fullmatch(r"-?[\d.]+", v) else v
    return out


def summary_lines(stdout: str, key: str) -> list[dict]:
    return [fields(l) for l in stdout.splitlines() if re.search(rf"\b{key}=", l)]


@pytest.fixture(scope="module")
def cli_eagle2():
    """`specjax generate --method eagle2` on the poem prompt: the reference of two examples."""
    out = run(
        sys.executable,
        "-m",
        "specjax.cli",
        "generate",
        "--method",
        "eagle2",
        "--prompt",
        POEM,
        "--max-new-tokens",
        SMOKE_TOKENS,
        "--json",
    )
    return json.loads(out.splitlines()[0])


@pytest.fixture(scope="module")
def newline_ids():
    """Token ids whose text holds a newline (custom_loop.py's stop rule), and EOS ids."""
    from specjax.checkpoint import read_json
    from specjax.loading import load_tokenizer, resolve_model_path
    from specjax.model_config import ModelConfig

    path = resolve_model_path("smollm2-135m")
    tok = load_tokenizer(path)
    config = ModelConfig.from_hf(read_json(path / "config.json"))
    pieces = tok.batch_decode([[i] for i in range(config.vocab_size)])
    return {i for i, s in enumerate(pieces) if "\n" in s} | set(config.eos_token_ids)


def test_custom_loop_equals_specjax_generate(cli_eagle2, newline_ids):
    out = run(sys.executable, EXAMPLES / "custom_loop.py", "--json", "--prompt", POEM)
    rec = json.loads(out.splitlines()[0])
    ref = cli_eagle2["token_ids"]
    # The custom stop rule: the CLI's greedy tokens, cut after the first newline (or EOS).
    cut = next((i + 1 for i, t in enumerate(ref) if t in newline_ids), len(ref))
    assert rec["token_ids"] == ref[:cut]
    assert 0 < cut < len(ref), "the prompt is chosen so that the newline stop rule fires"
    assert rec["text"].strip() and cli_eagle2["text"].startswith(rec["text"])
    # The metric carried through the loop: one histogram entry per target pass.
    hist = rec["accepted_hist"]
    assert sum(hist) == rec["steps"] > 0
    assert sum((k + 1) * c for k, c in enumerate(hist)) >= rec["new_tokens"] >= rec["steps"]
    assert rec["mean_accepted"] == pytest.approx(rec["new_tokens"] / rec["steps"])
    assert rec["tokens_per_s"] > 0  # acceptance: tests/test_real_model.py (shipped heads)


@pytest.mark.slow  # test_speculative and test_sharding prove what it runs
def test_generate_example_runs_every_smoke_method():
    out = run(sys.executable, EXAMPLES / "generate.py")
    text = next(l for l in out.splitlines() if l.startswith("text="))
    assert len(text) > len("text=''")
    rows = summary_lines(out, "method")
    assert [r["method"] for r in rows] == ["vanilla", "pld", "eagle2"]
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["speedup"] > 0
        assert r["same_as_vanilla"] is True, r  # lossless: greedy text equals vanilla's
    assert rows[0]["mean_accepted"] == 1.0


def test_convert_hf_example(tmp_path):
    out = run(sys.executable, EXAMPLES / "convert_hf.py", "--out", tmp_path)
    for name, kind in (("model", "model"), ("eagle", "eagle"), ("medusa", "medusa")):
        meta = json.loads((tmp_path / name / "specjax.json").read_text())
        assert meta["kind"] == kind
    assert next(l for l in out.splitlines() if l.startswith("text=")) != "text=''"
    rows = summary_lines(out, "method")
    assert [r["method"] for r in rows] == ["vanilla", "eagle2", "medusa"]
    for r in rows:
        assert r["tokens_per_s"] > 0
        assert r["same_as_vanilla"] is True, r


@pytest.mark.slow  # test_speculative and test_sharding prove what it runs
def test_sharded_example(cli_eagle2):
    out = run(sys.executable, EXAMPLES / "sharded.py")
    assert "devices=8 mesh={'data': 2, 'model': 3}" in out
    assert "P('model', None), (192, 576) per device" in out  # q rows (outputs) split 3 ways
    answers = dict(
        tuple(map(ast.literal_eval, l[len("[mesh] ") :].split(" -> ", 1)))
        for l in out.splitlines()
        if l.startswith("[mesh] ") and " -> " in l
    )
    assert len(answers) == 2 and all(a.strip() for a in answers.values())
    # Greedy and lossless on the mesh too: a prefix of the one-device CLI answer.
    poem = answers[POEM]
    assert len(poem) > 10 and cli_eagle2["text"].startswith(poem)
    rows = summary_lines(out, "mean_accepted")
    assert len(rows) == 2 and all(r["tokens_per_s"] > 0 for r in rows)


@pytest.mark.slow
def test_train_heads_example(tmp_path):
    out = run("bash", EXAMPLES / "train_heads.sh", tmp_path / "run")
    meta = json.loads((tmp_path / "run" / "heads" / "specjax.json").read_text())
    assert meta["kind"] == "eagle" and meta["trained_steps"] == 6
    rec = json.loads((tmp_path / "run" / "generate.jsonl").read_text().splitlines()[0])
    assert rec["text"].strip() and rec["new_tokens"] > 0
    (row,) = summary_lines(out, "mean_accepted")
    assert row["mean_accepted"] == pytest.approx(rec["mean_accepted"], abs=0.01)
    assert row["tokens_per_s"] > 0
