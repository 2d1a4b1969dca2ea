"""Helpers shared by the benchmark scripts."""

from __future__ import annotations

import argparse
from pathlib import Path

from specjax.bench import machine  # noqa: F401  (re-exported for the scripts)
from specjax.prompts import read_prompt_file


def read_prompts(path: Path, limit: int, category: str | None = None) -> list[str]:
    """Up to `limit` prompts of a prompt file (`specjax.prompts`), spread over it (every
    category shows)."""
    texts = [r.text for r in read_prompt_file(path) if not category or r.category == category]
    step = max(1, len(texts) // limit)
    return texts[::step][:limit]


def add_sampled_decoding_args(ap: argparse.ArgumentParser) -> None:
    """The options of the scripts that decode the dev prompts per category while sampling:
    --prompts, --limit (prompts per category), --max-new-tokens, --temperature, --top-k, --top-p."""
    ap.add_argument("--prompts", default=str(Path(__file__).resolve().parents[2] / "shared/data/dev_prompts.jsonl"))
    ap.add_argument("--limit", type=int, default=5, help="prompts per category")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
