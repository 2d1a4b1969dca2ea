"""Training data: prompt files, and self-distillation (the base model answers the prompts).

Heads learn to predict the base model's OWN continuations, so the answers come from the base
model itself (its chat template, batched generation with `specjax.generate.Engine`). Answers are
appended to `distill.jsonl` one batch at a time: an interrupted run resumes where it stopped.
Plain-text records (`text`) are not answered: the text itself is the training sequence.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from specjax import prompts
from specjax.prompts import PromptRecord

DISTILL_FILE = "distill.jsonl"
DISTILL_META = "distill.json"


class DataError(ValueError):
    """A prompt file or a data folder that cannot be used (one-line message)."""


def read_prompt_file(path) -> list[PromptRecord]:
    """`specjax.prompts.read_prompt_file`, its errors as DataError."""
    try:
        return prompts.read_prompt_file(path)
    except prompts.PromptError as e:
        raise DataError(str(e)) from None


def spread_over_categories(records: Sequence[PromptRecord], n: int | None, keep=None) -> list[int]:
    """Indices of up to n records taken round-robin over categories, each in file order.

    `keep(i)` may veto a record (e.g. a prompt too long); the order is deterministic, so the
    same file and n always give the same selection.
    """
    by_cat: dict[str, list[int]] = {}
    for i, r in enumerate(records):
        by_cat.setdefault(r.category, []).append(i)
    queues = [list(reversed(v)) for v in by_cat.values()]
    out: list[int] = []
    limit = len(records) if n is None else n
    while len(out) < limit and any(queues):
        for q in queues:
            while q:
                i = q.pop()
                if keep is None or keep(i):
                    out.append(i)
                    break
            if len(out) >= limit:
                break
    return out


def encode_record(tokenizer, rec: PromptRecord) -> list[int]:
    """`specjax.prompts.encode_record`, its errors as DataError."""
    try:
        return prompts.encode_record(tokenizer, rec)
    except prompts.PromptError as e:
        raise DataError(str(e)) from None


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """Settings of self-distillation; a data folder only ever holds one."""

    max_new_tokens: int = 160
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    batch_size: int = 16


DISTILL_WINDOW_BATCHES = 8


def length_sorted_windows(items: list, window: int) -> list:
    """items (index, prompt ids) sorted by prompt length within consecutive windows.

    Similar lengths share a batch (less padding), while a run stopped early has answered about
    a prefix of the selection, so its partial data keeps the selection's category balance.
    """
    out = []
    for s in range(0, len(items), window):
        out.extend(sorted(items[s : s + window], key=lambda t: len(t[1])))
    return out


def distilled_indices(folder) -> set[int]:
    """Record indices already answered in a data folder."""
    return set(_read_done(Path(folder) / DISTILL_FILE))


def read_appended_jsonl(path: Path, check=None) -> list[dict]:
    """Records of a JSONL file this package appends to; a torn last line (the writer killed
    mid-line) is cut off the file, any other unreadable line (or one `check(record)` rejects)
    is an error naming it, raised before anything is cut."""
    rows: list[dict] = []
    if not path.exists():
        return rows
    good = 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.endswith(b"\n"):
                break
            try:
                rec = json.loads(raw)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if check is not None and not check(rec):
                raise DataError(f"{path}:{n}: not a record of this kind")
            rows.append(rec)
            good += len(raw)
    if good != path.stat().st_size:
        with open(path, "r+b") as f:
            f.truncate(good)
    return rows


def _read_done(path: Path) -> dict[int, dict]:
    """Finished records of a distill file, by index."""
    return {int(rec["index"]): rec for rec in read_appended_jsonl(path)}


def _check_meta(folder: Path, meta: dict) -> None:
    path = folder / DISTILL_META
    if path.exists():
        old = json.loads(path.read_text())
        diff = [k for k in meta if k in old and old[k] != meta[k]]
        if diff:
            k = diff[0]
            raise DataError(f"data folder {folder} was made with {k}={old[k]!r}, not {meta[k]!r}: use another folder")
    else:
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(meta, indent=2))


def end_of_turn_ids(model) -> list[int]:
    """Tokens that end a generated turn: the model's EOS ids and its tokenizer's."""
    eos = set(model.config.eos_token_ids)
    if getattr(model.tokenizer, "eos_token_id", None) is not None:
        eos.add(int(model.tokenizer.eos_token_id))
    return sorted(eos)


def distill(
    model,
    records: Sequence[PromptRecord],
    indices: Sequence[int],
    folder,
    cfg: DistillConfig = DistillConfig(),
    *,
    max_prompt_tokens: int = 512,
    progress: bool = True,
) -> list[dict]:
    """The base model's answers to records[indices], resumable; returns them in `indices` order.

    Each line of folder/distill.jsonl: {"index", "id", "category", "prompt_ids", "answer_ids",
    "finished"} (index into `records`). Prompts longer than max_prompt_tokens are cut to their
    last tokens; text records are stored with an empty prompt (the whole text is the answer).
    Sampling seeds are per record (seed + index), so results do not depend on batching.
    """
    from tqdm import tqdm

    from specjax.generate import Engine, bucket
    from specjax.sampling import SamplingConfig

    folder = Path(folder)
    meta = {
        "base_model": str(model.path),
        "vocab_size": model.config.vocab_size,
        "max_prompt_tokens": max_prompt_tokens,
        **dataclasses.asdict(cfg),
    }
    meta.pop("batch_size")
    _check_meta(folder, meta)
    out_path = folder / DISTILL_FILE
    done = _read_done(out_path)
    tok = model.tokenizer
    todo = []
    with open(out_path, "a", encoding="utf-8") as f:
        for i in indices:
            if i in done:
                continue
            rec = records[i]
            ids = encode_record(tok, rec)
            if rec.is_text:  # nothing to answer: the text is the training sequence
                row = {
                    "index": i,
                    "id": rec.id,
                    "category": rec.category,
                    "prompt_ids": [],
                    "answer_ids": ids,
                    "finished": True,
                }
                f.write(json.dumps(row) + "\n")
                done[i] = row
            else:
                todo.append((i, ids[-max_prompt_tokens:]))
    if todo:
        eos = end_of_turn_ids(model)
        bs = cfg.batch_size
        todo = length_sorted_windows(todo, bs * DISTILL_WINDOW_BATCHES)
        per_seq = -(-bucket(max(len(p) for _, p in todo) + cfg.max_new_tokens + 1) // 16)
        engine = Engine(model.params, model.config, num_pages=2 * bs * per_seq + 8, page_size=16)
        sampling = SamplingConfig(cfg.temperature, cfg.top_k, cfg.top_p)
        bar = tqdm(
            total=len(indices),
            initial=len(indices) - len(todo),
            disable=not progress,
            desc="distill",
            unit="prompt",
            dynamic_ncols=True,
        )
        t0, new_tokens = time.perf_counter(), 0
        with open(out_path, "a", encoding="utf-8") as f:
            # continuous batching: a slot whose answer ended takes the next prompt at once
            answers = engine.generate_continuous(
                [p for _, p in todo],
                cfg.max_new_tokens,
                slots=bs,
                sampling=sampling,
                seeds=[cfg.seed + i for i, _ in todo],
                eos_token_ids=eos,
            )
            for n, out in enumerate(answers, 1):
                i, p = todo[out.index]
                row = {
                    "index": i,
                    "id": records[i].id,
                    "category": records[i].category,
                    "prompt_ids": p,
                    "answer_ids": out.token_ids,
                    "finished": out.finished_by_eos,
                }
                f.write(json.dumps(row) + "\n")
                done[i] = row
                if n % bs == 0 or n == len(todo):
                    f.flush()
                    os.fsync(f.fileno())
                new_tokens += len(out.token_ids)
                bar.update(1)
                bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - t0):.0f}", refresh=False)
        bar.close()
    return [done[i] for i in indices]


def sequences_of(rows: Sequence[dict], max_len: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(tokens int32[n], answer mask bool[n]) per distilled row, cut to max_len tokens."""
    out = []
    for r in rows:
        tokens = np.asarray(list(r["prompt_ids"]) + list(r["answer_ids"]), np.int32)[:max_len]
        mask = np.zeros(len(tokens), bool)
        mask[len(r["prompt_ids"]) :] = True
        out.append((tokens, mask))
    return out
