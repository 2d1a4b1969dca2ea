"""Helpers shared by the benchmark scripts."""

from __future__ import annotations

import json
from pathlib import Path

from specjax.bench import machine  # noqa: F401  (re-exported for the scripts)


def read_prompts(path: Path, limit: int, category: str | None = None) -> list[str]:
    """Up to `limit` prompts of a DESIGN.md JSONL file, spread over it (every category shows)."""
    prompts = []
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        if category and rec.get("category") != category:
            continue
        prompts.append(rec["turns"][0] if "turns" in rec else rec["prompt"])
    step = max(1, len(prompts) // limit)
    return prompts[::step][:limit]
