"""Prompts the base model writes itself: Magpie-style synthesis of user turns.

An instruction-tuned model given its chat template only up to the start of a user turn
continues with a plausible user request (Xu et al. 2024, "Magpie"). Those requests come from the
same distribution the model was aligned on, so answering them (self-distillation, `data.distill`)
gives draft heads more chat-like training data than a prompt file may hold. Requests that do not
end their turn within `max_tokens`, are too short, or repeat an earlier one are dropped.
The output is a prompt file (`turns`, `category`, `id`, `source`) that `specjax train --prompts`
reads; the file is appended to as requests are kept, so an interrupted run resumes.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

SOURCE = "magpie-style synthesis by the base model"
RECORD_START = b'{"id": "synth-'  # every record is written with `id` first


class SynthesisError(ValueError):
    """Settings or an output file that cannot be used (one-line message)."""


@dataclasses.dataclass(frozen=True)
class SynthesisConfig:
    """How user requests are sampled and which are kept."""

    temperature: float = 1.0
    top_p: float = 0.95
    max_tokens: int = 64  # a request still open after this many tokens is dropped
    min_tokens: int = 5
    seed: int = 0  # request k samples with seed + k
    batch_size: int = 16
    category: str = "chat"


def user_turn_prefix(tokenizer) -> list[int]:
    """Token ids of the chat template up to where the first user message's text begins
    (including the template's default system turn, if it adds one)."""
    if not getattr(tokenizer, "chat_template", None):
        raise SynthesisError("the base model's tokenizer has no chat template: nothing marks where a user turn begins")
    marker = "\x00user-text\x00"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    if marker not in rendered:
        raise SynthesisError("the chat template does not render the user's text verbatim")
    return list(tokenizer(rendered[: rendered.index(marker)], add_special_tokens=False).input_ids)


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def _is_ours(rec) -> bool:
    try:
        return isinstance(rec, dict) and int(rec["seed"]) >= 0 and bool(rec["turns"][0])
    except (KeyError, TypeError, IndexError, ValueError):
        return False


def _read_kept(path: Path) -> list[dict]:
    """Records already written (a torn last line is cut off); any other file is refused
    untouched."""
    from specjax.training.data import DataError, read_appended_jsonl

    if path.exists() and path.stat().st_size:
        with open(path, "rb") as f:
            ours = f.read(len(RECORD_START)) == RECORD_START
        try:
            if ours:
                return read_appended_jsonl(path, check=_is_ours)
        except DataError:
            pass
        raise SynthesisError(f"{path} holds records this command did not write; use another output file")
    return []


def synthesize_prompts(
    model,
    n: int,
    out,
    cfg: SynthesisConfig = SynthesisConfig(),
    *,
    max_attempts: int | None = None,
    progress: bool = True,
) -> list[dict]:
    """Write up to n user requests the base model makes up to the JSONL file `out`; returns the
    kept records (earlier ones of the file included). Deterministic: the same model, n and
    settings give the same file, whether or not the run was interrupted.

    max_attempts bounds the sampled requests (default 4n): a model that rarely ends its user
    turn stops with fewer than n records rather than running on.
    """
    from tqdm import tqdm

    from specjax.generate import Engine, bucket
    from specjax.sampling import SamplingConfig
    from specjax.training.data import end_of_turn_ids

    if n < 1:
        raise SynthesisError(f"the number of prompts must be >= 1, got {n}")
    if cfg.temperature <= 0:
        raise SynthesisError(f"temperature must be > 0 (greedy sampling repeats one request), got {cfg.temperature}")
    if not 0 < cfg.top_p <= 1:
        raise SynthesisError(f"top_p must be in (0, 1], got {cfg.top_p}")
    if not 1 <= cfg.min_tokens <= cfg.max_tokens:
        raise SynthesisError(f"need 1 <= min_tokens <= max_tokens, got {cfg.min_tokens} and {cfg.max_tokens}")
    out = Path(out)
    kept = _read_kept(out)
    seen = {_norm(r["turns"][0]) for r in kept}
    next_seed = max((int(r["seed"]) + 1 for r in kept), default=cfg.seed)
    attempts_left = (4 * n if max_attempts is None else max_attempts) - (next_seed - cfg.seed)
    if len(kept) >= n or attempts_left <= 0:
        return kept[:n]
    tok = model.tokenizer
    prefix = user_turn_prefix(tok)
    end_of_turn = end_of_turn_ids(model)
    bs = cfg.batch_size
    pages = -(-bucket(len(prefix) + cfg.max_tokens + 1) // 16)
    engine = Engine(model.params, model.config, num_pages=2 * bs * pages + 8, page_size=16)
    sampling = SamplingConfig(cfg.temperature, 0, cfg.top_p)
    bar = tqdm(total=n, initial=len(kept), disable=not progress, desc="synthesize", unit="prompt", dynamic_ncols=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a", encoding="utf-8") as f:
        while len(kept) < n and attempts_left > 0:
            # a round of requests; kept in seed order so that resuming gives the same file
            round_n = min(attempts_left, bs * 8)
            seeds = list(range(next_seed, next_seed + round_n))
            outs = sorted(
                engine.generate_continuous(
                    [prefix] * round_n,
                    cfg.max_tokens,
                    slots=bs,
                    sampling=sampling,
                    seeds=seeds,
                    eos_token_ids=end_of_turn,
                ),
                key=lambda o: o.index,
            )
            for o in outs:
                seed = seeds[o.index]
                ids = [t for t in o.token_ids if t not in end_of_turn]
                text = tok.decode(ids, skip_special_tokens=True).strip()
                if not o.finished_by_eos or len(ids) < cfg.min_tokens or not text or _norm(text) in seen:
                    continue
                seen.add(_norm(text))
                rec = {"id": f"synth-{seed}", "category": cfg.category, "source": SOURCE, "seed": seed, "turns": [text]}
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                kept.append(rec)
                bar.update(1)
                if len(kept) >= n:
                    break
            f.flush()
            os.fsync(f.fileno())
            next_seed += round_n
            attempts_left -= round_n
            bar.set_postfix(kept=f"{len(kept)}/{next_seed - cfg.seed}", refresh=False)
    bar.close()
    return kept[:n]
