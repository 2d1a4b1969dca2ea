"""Evaluation of trained heads: mean accepted tokens per target step, per prompt category.

Method-agnostic: it takes any (proposer, proposer_params) pair that `Engine.generate` accepts
(Medusa from `specjax.methods.make_proposer`, EAGLE chains or trees, ...). Greedy decoding, so
the output is the base model's own and only the step count depends on the heads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from specjax.training.data import PromptRecord, encode_record


def evaluate(
    model,
    proposer,
    proposer_params,
    records: Sequence[PromptRecord],
    *,
    max_new_tokens: int = 64,
    batch_size: int = 1,
    progress: bool = True,
) -> dict:
    """{"categories": {cat: {...}}, "all": {...}}; each with prompts, new_tokens, steps and
    mean_accepted = new_tokens / steps (token-weighted over the category's prompts)."""
    from tqdm import tqdm

    from specjax.generate import Engine, bucket
    from specjax.spec_decode import scratch_slots

    prompts = [encode_record(model.tokenizer, r) for r in records]
    if not prompts:
        raise ValueError("no held-out prompts to evaluate on")
    longest = max(len(p) for p in prompts) + max_new_tokens + scratch_slots(proposer)
    pages = 2 * batch_size * (-(-bucket(longest) // 16)) + 8
    engine = Engine(model.params, model.config, num_pages=pages, page_size=16)
    stats: dict[str, dict] = {}
    bar = tqdm(total=len(prompts), disable=not progress, desc="evaluate", unit="prompt", dynamic_ncols=True)
    for s in range(0, len(prompts), batch_size):
        out = engine.generate(
            prompts[s : s + batch_size], max_new_tokens, proposer=proposer, proposer_params=proposer_params
        )
        for rec, ids, steps in zip(records[s : s + batch_size], out.token_ids, out.steps):
            for cat in (rec.category, "all"):
                st = stats.setdefault(cat, {"prompts": 0, "new_tokens": 0, "steps": 0})
                st["prompts"] += 1
                st["new_tokens"] += len(ids)
                st["steps"] += steps
        bar.update(len(out.token_ids))
        a = stats["all"]
        bar.set_postfix(mean_accepted=f"{a['new_tokens'] / max(a['steps'], 1):.2f}")
    bar.close()
    for st in stats.values():
        st["mean_accepted"] = st["new_tokens"] / st["steps"] if st["steps"] else 0.0
    overall = stats.pop("all")
    return {"categories": dict(sorted(stats.items())), "all": overall, "max_new_tokens": max_new_tokens}


def write_report(path, report: dict, **extra) -> Path:
    path = Path(path)
    path.write_text(json.dumps({**extra, **report}, indent=2))
    return path
