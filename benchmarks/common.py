"""Helpers shared by the benchmark scripts."""

from __future__ import annotations

from pathlib import Path

from specjax.bench import machine  # noqa: F401  (re-exported for the scripts)
from specjax.prompts import read_prompt_file


def read_prompts(path: Path, limit: int, category: str | None = None) -> list[str]:
    """Up to `limit` prompts of a prompt file (`specjax.prompts`), spread over it (every
    category shows)."""
    texts = [r.text for r in read_prompt_file(path) if not category or r.category == category]
    step = max(1, len(texts) // limit)
    return texts[::step][:limit]
