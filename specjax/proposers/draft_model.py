"""Draft-Target-Model: a smaller model with the target's vocabulary drafts a chain.

The draft keeps its own paged KV cache (its own pool, the target's block tables). Each step it
first catches up on the tokens its cache lacks (at most two: the last accepted draft it never fed,
and the pending token), then drafts `max_draft_len` tokens autoregressively. After acceptance its
cache is rolled back to the accepted prefix by setting its lengths. `use_logits=True` samples the
drafts from q and accepts by min(1, p/q) with residual resampling; `use_logits=False` drafts
greedily and accepts by matching the target's own draws.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from specjax.cache import PagedKVCache, init_pages
from specjax.draft_tree import chain
from specjax.model import causal_mask, forward
from specjax.model_config import ModelConfig
from specjax.sampling import SamplingConfig, argmax_last, categorical, processed_logprobs
from specjax.spec_decode import ProposerBase


@struct.dataclass
class DraftModelState:
    """The draft's KV pools (read through the target's block tables) and its cached length."""

    k_pages: list
    v_pages: list
    lengths: jax.Array  # the draft cache holds tokens[:, :lengths]

    def cache(self, block_tables) -> PagedKVCache:
        return PagedKVCache(self.k_pages, self.v_pages, block_tables, self.lengths)

    @classmethod
    def of(cls, cache: PagedKVCache) -> "DraftModelState":
        return cls(cache.k_pages, cache.v_pages, cache.lengths)


def self_draft_params(target_params: dict, num_layers: int) -> dict:
    """A self-draft: the target's first `num_layers` layers with its final norm and head."""
    if not 1 <= num_layers <= len(target_params["layers"]):
        raise ValueError(f"draft layers must be in [1, {len(target_params['layers'])}], got {num_layers}")
    return {**target_params, "layers": list(target_params["layers"][:num_layers])}


def self_draft_config(config: ModelConfig, num_layers: int) -> ModelConfig:
    return dataclasses.replace(config, num_layers=num_layers)


@dataclasses.dataclass(frozen=True)
class DraftModelProposer(ProposerBase):
    """Draft-Target-Model drafting (TensorRT-LLM names: max_draft_len, use_logits)."""

    config: ModelConfig  # the draft model's config
    max_draft_len: int = 4
    use_logits: bool = False
    is_chain: bool = True

    def __post_init__(self):
        if self.max_draft_len < 1:
            raise ValueError(f"max_draft_len must be >= 1, got {self.max_draft_len}")

    @property
    def tree_size(self) -> int:
        return self.max_draft_len + 1

    @property
    def rule(self) -> str:
        return "residual" if self.use_logits else "match"

    def make_pools(self, num_pages, page_size, dtype):
        return init_pages(self.config, num_pages, page_size, dtype)

    def init(self, params, pools, ctx, prompt_chunk, prompt_len):
        b, w = prompt_chunk.shape
        cache = PagedKVCache(pools[0], pools[1], ctx.block_tables, jnp.zeros((b,), jnp.int32))
        valid = jnp.arange(w)[None, :] < prompt_len[:, None]
        out = forward(
            params,
            self.config,
            prompt_chunk,
            jnp.broadcast_to(jnp.arange(w), (b, w)),
            cache,
            causal_mask(b, w),
            valid=valid,
            logits_at=jnp.zeros((b, 0), jnp.int32),
        )
        return DraftModelState(out.cache.k_pages, out.cache.v_pages, prompt_len)

    def _draw(self, logits, keys, sampling: SamplingConfig):
        """Next draft token and log q of the distribution it came from."""
        if self.use_logits and not sampling.greedy:
            logq = processed_logprobs(logits, sampling)
            return jax.vmap(categorical)(keys, logq), logq
        return argmax_last(logits), None

    def propose(self, params, state: DraftModelState, ctx, keys, sampling):
        b, s = ctx.tokens.shape
        rows = jnp.arange(b)
        cache = state.cache(ctx.block_tables)
        dl, length = cache.lengths, ctx.lengths
        # Catch up: feed tokens[dl], tokens[dl + 1] (the second only if dl + 1 <= length - 1).
        idx = dl[:, None] + jnp.arange(2)[None, :]
        chunk = ctx.tokens[rows[:, None], jnp.clip(idx, 0, s - 1)]
        valid = idx <= (length - 1)[:, None]
        out = forward(
            params, self.config, chunk, idx, cache, causal_mask(b, 2), valid=valid, logits_at=(length - 1 - dl)[:, None]
        )
        cache = out.cache.replace(lengths=length)
        step_keys = jax.vmap(lambda k: jax.random.split(k, self.max_draft_len))(keys)
        tok, logq = self._draw(out.logits[:, 0], step_keys[:, 0], sampling)
        one = jnp.ones((b, 1, 1), bool)

        def step(carry, key_j):
            cache, tok = carry
            o = forward(
                params,
                self.config,
                tok[:, None],
                cache.lengths[:, None],
                cache,
                one,
                logits_at=jnp.zeros((b, 1), jnp.int32),
            )
            nxt, lq = self._draw(o.logits[:, 0], key_j, sampling)
            return (o.cache.replace(lengths=cache.lengths + 1), nxt), (nxt, lq)

        (cache, _), (rest, rest_logq) = jax.lax.scan(step, (cache, tok), jnp.moveaxis(step_keys[:, 1:], 1, 0))
        drafts = jnp.concatenate([tok[:, None], jnp.moveaxis(rest, 0, 1)], axis=1)
        draft_logq = None
        if logq is not None:
            draft_logq = jnp.concatenate([logq[:, None], jnp.moveaxis(rest_logq, 0, 1)], axis=1)
        pending = ctx.tokens[rows, length - 1]
        tree = chain(pending, drafts, jnp.full((b,), self.max_draft_len, jnp.int32), draft_logq)
        return tree, DraftModelState.of(cache)

    def update(self, params, state: DraftModelState, ctx, result, active):
        # The draft fed the pending token and drafts 1..K-1; keep what the target accepted.
        before = state.lengths - (self.max_draft_len - 1)  # the target's length at propose
        kept = before + jnp.minimum(result.n_accepted, self.max_draft_len - 1)
        return state.replace(lengths=jnp.where(active, kept, before - 1))

    def pools_of(self, state: DraftModelState):
        return (state.k_pages, state.v_pages)
