"""Prompt-Lookup decoding: draft the tokens that followed the last n-gram's earlier occurrence.

Matches the last `max_matching_ngram_size` tokens (falling back to shorter n-grams, down to
`min_matching_ngram_size`, vLLM's prompt_lookup_min) against the prompt and the generated text,
earliest occurrence first as in Hugging Face's `prompt_lookup_num_tokens`, and proposes up to
`prompt_lookup_num_tokens` tokens as a chain. Steps without a match verify only the pending token
(see `verify_pruned`), so they cost what a vanilla step costs.
Everything runs inside jit: no host round trip per step.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from specjax.draft_tree import chain
from specjax.spec_decode import StatelessProposer


def find_continuation(tokens, length, ngram: int, num_tokens: int):
    """(start, count) per sequence: where the tokens after the earliest earlier occurrence of
    the last `ngram` tokens begin, and how many of them to propose (0 when there is none)."""
    b, s = tokens.shape
    rows = jnp.arange(b)
    suffix = jnp.stack([tokens[rows, jnp.maximum(length - ngram + k, 0)] for k in range(ngram)], 1)
    j = jnp.arange(s - ngram + 1)
    windows = jnp.stack([tokens[:, k : k + s - ngram + 1] for k in range(ngram)], axis=2)  # [B, J, n]
    hit = jnp.all(windows == suffix[:, None, :], axis=2)
    # The continuation must hold at least one known token: j + ngram < length.
    hit = hit & (j[None, :] + ngram < length[:, None]) & (length[:, None] >= ngram)
    first = jnp.argmax(hit, axis=1)
    found = jnp.any(hit, axis=1)
    start = first + ngram
    count = jnp.where(found, jnp.minimum(num_tokens, length - start), 0)
    return start, count


@dataclasses.dataclass(frozen=True)
class PromptLookupProposer(StatelessProposer):
    """Prompt-Lookup drafting (HF names: prompt_lookup_num_tokens, max_matching_ngram_size)."""

    prompt_lookup_num_tokens: int = 10
    max_matching_ngram_size: int = 3
    min_matching_ngram_size: int = 1
    rule: str = "match"
    is_chain: bool = True

    def __post_init__(self):
        if self.prompt_lookup_num_tokens < 1:
            raise ValueError(f"prompt_lookup_num_tokens must be >= 1, got {self.prompt_lookup_num_tokens}")
        if not 1 <= self.min_matching_ngram_size <= self.max_matching_ngram_size:
            raise ValueError(
                f"n-gram sizes must satisfy 1 <= min ({self.min_matching_ngram_size}) <= max "
                f"({self.max_matching_ngram_size})"
            )

    @property
    def tree_size(self) -> int:
        return self.prompt_lookup_num_tokens + 1

    def propose(self, params, state, ctx, keys, sampling):
        k = self.prompt_lookup_num_tokens
        b = ctx.tokens.shape[0]
        start = jnp.zeros((b,), jnp.int32)
        count = jnp.zeros((b,), jnp.int32)
        for n in range(self.max_matching_ngram_size, self.min_matching_ngram_size - 1, -1):
            s_n, c_n = find_continuation(ctx.tokens, ctx.lengths, n, k)
            take = (count == 0) & (c_n > 0)
            start = jnp.where(take, s_n, start)
            count = jnp.where(take, c_n, count)
        idx = jnp.clip(start[:, None] + jnp.arange(k)[None, :], 0, ctx.tokens.shape[1] - 1)
        drafts = jnp.take_along_axis(ctx.tokens, idx, axis=1)
        pending = ctx.tokens[jnp.arange(b), ctx.lengths - 1]
        return chain(pending, drafts, count), state
