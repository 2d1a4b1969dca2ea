"""The EAGLE-1/2 draft network: fc([embed(token); feature]) then Llama decoder layer(s).

The draft reads, at position t, the target's feature (final hidden state) of token t and the
embedding of token t + 1 (the target's shared embedding), so it predicts the feature of t + 1;
the target's `lm_head` turns that into token logits (no final norm). The first decoder layer has
no input norm (SafeAILab/EAGLE). It keeps its own paged KV cache, like any specjax model.
"""

from __future__ import annotations

import jax.numpy as jnp

from specjax.cache import PagedKVCache
from specjax.config import ModelConfig
from specjax.cpu.matmul import take_rows
from specjax.model import decoder_layers, head_logits, linear


def eagle_forward(params, config: ModelConfig, embed, tokens, features, positions,
                  cache: PagedKVCache, tree_mask, valid=None, slots=None):
    """Draft hidden states [B, T, D] and the cache with the new K/V written.

    params: {"fc": {"kernel": [2D, D], "bias": [D]}, "layers": [...]}; embed: the target's
    [V, D] embedding; tokens [B, T] (token t + 1), features [B, T, D] (feature of token t).
    slots / tree_mask [B, T, J]: see `model.decoder_layers` (tree drafting over several calls).
    """
    b, t = tokens.shape
    if valid is None:
        valid = jnp.ones((b, t), bool)
    x = jnp.concatenate([take_rows(embed, tokens), features.astype(embed.dtype)], axis=-1)
    fc = params["fc"]  # "kernel" [2D, D] as trained, or "weight" [D, 2D] as `linear` takes it
    x = linear(x, fc["weight"]) if "weight" in fc else x @ fc["kernel"]
    if "bias" in fc:
        x = x + fc["bias"]
    x, cache, _, _ = decoder_layers(params["layers"], config, x, positions, cache, tree_mask,
                                    valid, slots=slots)
    return x, cache


def eagle_logits(hidden, lm_head):
    """Token logits of draft hidden states through the target's [V, D] head (float32)."""
    return head_logits(hidden, lm_head)


def load_eagle_heads(path, target_config: ModelConfig | None = None) -> tuple[ModelConfig, dict]:
    """(draft config, params) of a specjax EAGLE head checkpoint; with `target_config`, heads
    made for another hidden size or vocabulary are refused."""
    from specjax.heads import check_compatible, load_heads

    meta, variables = load_heads(path, "eagle")
    if target_config is not None:
        check_compatible(meta, target_config, path)
    config = ModelConfig.from_hf(meta["config"])
    layers = [variables["layers"][str(i)] for i in range(config.num_layers)]
    params = {"fc": variables["fc"], "layers": layers}
    if "draft_ids" in variables:  # target ids by training-data frequency (see draft_vocabulary)
        params["draft_ids"] = variables["draft_ids"].astype(jnp.int32)
    return config, params


def draft_vocabulary(lm_head, draft_ids, size: int | None):
    """(lm_head rows, their target ids) of the `size` most frequent tokens, for drafting.

    Scoring only frequent tokens (FR-Spec, Zhao et al. 2025) cuts the draft's vocabulary
    projection, the largest cost of a small-model EAGLE draft step, by V / size; the target
    still verifies every token, so output is unchanged, only rare tokens are never drafted.
    """
    ids = jnp.asarray(draft_ids, jnp.int32)
    if size is not None:
        if not 1 <= size <= ids.shape[0]:
            raise ValueError(f"draft vocabulary size must be in [1, {ids.shape[0]}], got {size}")
        ids = ids[:size]
    return take_rows(lm_head, ids), ids
