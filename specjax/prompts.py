"""Prompts: the one reader of prompt files and the one way a prompt becomes token ids.

A prompt file is JSON Lines, one record per line, holding `turns` (a chat: the first turn is the
prompt), `prompt` (a chat prompt) or `text` (plain text, no chat template), and optionally
`category` and `id`. The CLI, `specjax bench`, training and the benchmark scripts all read
files through `read_prompt_file` and encode through `encode_prompt`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path


class PromptError(ValueError):
    """A prompt file or prompt that cannot be used (one-line message naming file and line)."""


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """One line of a prompt file: a chat prompt, or plain text (`is_text`)."""

    text: str
    category: str = "default"
    id: str = ""
    is_text: bool = False


def read_prompt_file(path, default_category: str = "default") -> list[PromptRecord]:
    """Records of a JSONL file with `turns` (first is the prompt), `prompt` or `text`.

    Empty files, invalid JSON and records without any of those fields raise PromptError naming
    the file and the line. Records without a `category` get `default_category`.
    """
    path = Path(path)
    if not path.exists():
        raise PromptError(f"prompt file not found: {path}")
    records = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise PromptError(f"{path}:{n}: expected a JSON object, got {type(rec).__name__}")
            cat = str(rec.get("category") or default_category)
            rid = str(rec.get("id", n))
            turns = rec.get("turns")
            if isinstance(turns, list) and turns and isinstance(turns[0], str) and turns[0]:
                records.append(PromptRecord(turns[0], cat, rid))
            elif isinstance(rec.get("prompt"), str) and rec["prompt"]:
                records.append(PromptRecord(rec["prompt"], cat, rid))
            elif isinstance(rec.get("text"), str) and rec["text"]:
                records.append(PromptRecord(rec["text"], cat, rid, is_text=True))
            else:
                raise PromptError(f"{path}:{n}: record has no non-empty 'turns', 'prompt' or 'text'")
    if not records:
        raise PromptError(f"{path}: no records (the file is empty)")
    return records


def encode_prompt(tokenizer, text: str, raw: bool = False) -> list[int]:
    """Token ids of a prompt: through the chat template (a user turn and the generation
    prompt), or with raw=True exactly as the tokenizer splits it."""
    if raw:
        return list(tokenizer(text).input_ids)
    return encode_chat(tokenizer, [{"role": "user", "content": text}])


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation ([{"role", "content"}, ...]) through the model's chat
    template, ending with the generation prompt of the assistant's turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError("the model's tokenizer has no chat template; pass --raw (or use 'text' records)")
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(rendered, add_special_tokens=False).input_ids)


def encode_record(tokenizer, rec: PromptRecord) -> list[int]:
    """Token ids of a record: chat prompts through the chat template, text records raw."""
    return encode_prompt(tokenizer, rec.text, raw=rec.is_text)
