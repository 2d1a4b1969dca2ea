"""Magpie-style prompt synthesis: the template prefix, which requests are kept, resuming."""

from __future__ import annotations

import json

import jax.numpy as jnp
import pytest

from specjax.generate import Engine
from specjax.loading import load_model
from specjax.sampling import SamplingConfig
from specjax.training.synthesize import SynthesisConfig, SynthesisError, synthesize_prompts, user_turn_prefix

CFG = SynthesisConfig(temperature=1.0, top_p=1.0, max_tokens=24, min_tokens=2, seed=7, batch_size=4)


@pytest.fixture(scope="module")
def model(tiny_llama):
    return load_model(str(tiny_llama[0]), dtype=jnp.float32)


def test_user_turn_prefix_ends_where_the_user_text_begins(model):
    tok = model.tokenizer
    prefix = user_turn_prefix(tok)
    rendered = tok.apply_chat_template([{"role": "user", "content": "hello there"}], tokenize=False)
    head = tok.decode(prefix)
    assert rendered.startswith(head) and rendered[len(head) :].startswith("hello there")
    assert prefix == list(tok(head, add_special_tokens=False).input_ids)


def expected_requests(model, attempts: int) -> list[str]:
    """What synthesis should keep, computed apart: one batched sampling call over all seeds."""
    tok = model.tokenizer
    eos = list(model.config.eos_token_ids)
    engine = Engine(model.params, model.config, num_pages=4 * attempts + 8, page_size=16)
    out = engine.generate(
        [user_turn_prefix(tok)] * attempts,
        CFG.max_tokens,
        sampling=SamplingConfig(CFG.temperature, 0, CFG.top_p),
        seeds=[CFG.seed + k for k in range(attempts)],
        eos_token_ids=eos,
    )
    kept, seen = [], set()
    for ids, fin in zip(out.token_ids, out.finished_by_eos):
        ids = [t for t in ids if t not in eos]
        text = tok.decode(ids, skip_special_tokens=True).strip()
        key = " ".join(text.lower().split())
        if fin and len(ids) >= CFG.min_tokens and text and key not in seen:
            seen.add(key)
            kept.append(text)
    return kept


def test_kept_requests_and_resume(model, tmp_path):
    attempts = 48
    want = expected_requests(model, attempts)
    assert 2 <= len(want) < attempts  # the tiny model both ends turns and runs past the limit
    n = len(want) + 5  # more than the attempts can give: stops at max_attempts
    straight = synthesize_prompts(model, n, tmp_path / "a.jsonl", CFG, max_attempts=attempts, progress=False)
    assert [r["turns"][0] for r in straight] == want
    rows = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert rows == straight
    assert all(r["category"] == "chat" and r["id"] == f"synth-{r['seed']}" for r in rows)

    # stopped early (and killed mid-line), then resumed: the same file
    part = tmp_path / "b.jsonl"
    first = synthesize_prompts(model, 1, part, CFG, max_attempts=attempts, progress=False)
    assert [r["turns"][0] for r in first] == want[:1]
    with open(part, "a") as f:
        f.write('{"id": "synth-99", "categ')
    resumed = synthesize_prompts(model, n, part, CFG, max_attempts=attempts, progress=False)
    assert [r["turns"][0] for r in resumed] == want
    assert part.read_text() == (tmp_path / "a.jsonl").read_text()


def test_bad_settings_and_foreign_files(model, tmp_path):
    with pytest.raises(SynthesisError, match="temperature must be > 0"):
        synthesize_prompts(model, 3, tmp_path / "x.jsonl", SynthesisConfig(temperature=0))
    with pytest.raises(SynthesisError, match="must be >= 1"):
        synthesize_prompts(model, 0, tmp_path / "x.jsonl")
    other = tmp_path / "prompts.jsonl"
    other.write_text('{"id": "p0", "category": "chat", "turns": ["hi"]}\n')
    with pytest.raises(SynthesisError, match="did not write"):
        synthesize_prompts(model, 3, other, CFG)
    assert other.read_text() == '{"id": "p0", "category": "chat", "turns": ["hi"]}\n'
    notes = tmp_path / "notes.txt"
    notes.write_text("not a prompt file")  # one line without a newline: not cut as torn
    with pytest.raises(SynthesisError, match="did not write"):
        synthesize_prompts(model, 3, notes, CFG)
    assert notes.read_text() == "not a prompt file"


def test_cli(tiny_llama, tmp_path, capsys):
    from specjax.cli import main

    out = tmp_path / "p.jsonl"
    assert (
        main(
            [
                "synthesize-prompts",
                "--base",
                str(tiny_llama[0]),
                "--n",
                "2",
                "--out",
                str(out),
                "--max-tokens",
                "24",
                "--min-tokens",
                "2",
                "--max-attempts",
                "32",
                "--no-progress",
            ]
        )
        == 0
    )
    assert f"{out}:" in capsys.readouterr().err
    from specjax.training.data import read_prompt_file

    assert all(r.category == "chat" for r in read_prompt_file(out))
    assert (
        main(["synthesize-prompts", "--base", str(tiny_llama[0]), "--n", "2", "--out", str(out), "--top-p", "0"]) == 1
    )
    assert "top_p must be in (0, 1]" in capsys.readouterr().err
