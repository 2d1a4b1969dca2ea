"""The EAGLE-1/2 draft network: fc([embed(token); feature]) then Llama decoder layer(s).

The draft reads, at position t, the target's feature (final hidden state) of token t and the
embedding of token t + 1 (the target's shared embedding), so it predicts the feature of t + 1;
the target's `lm_head` turns that into token logits (no final norm). The first decoder layer has
no input norm (SafeAILab/EAGLE). It keeps its own paged KV cache, like any specjax model.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.cache import PagedKVCache
from specjax.cpu.matmul import take_rows
from specjax.model import decoder_layers, head_logits, linear
from specjax.model_config import ModelConfig


def eagle_forward(
    params,
    config: ModelConfig,
    embed,
    tokens,
    features,
    positions,
    cache: PagedKVCache,
    tree_mask,
    valid=None,
    slots=None,
):
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
    x, cache, _, _ = decoder_layers(params["layers"], config, x, positions, cache, tree_mask, valid, slots=slots)
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


@dataclasses.dataclass(frozen=True)
class EagleNet:
    """EAGLE-1/2's network as the EAGLE proposers draft through it (`Eagle3Net` has the same
    members). params: {"net", "embed": the target's embedding, "lm_head": the target's head,
    or its rows of frequent tokens with "draft_ids" their target ids}."""

    feature_layers: tuple = ()  # the features are the target's final hidden states
    splits_layers: bool = True  # its decoder layer splits over tensor-parallel devices

    def forward(self, params, config, tokens, features, positions, cache, mask, valid, slots=None):
        return eagle_forward(
            params["net"], config, params["embed"], tokens, features, positions, cache, mask, valid, slots=slots
        )

    def fuse(self, params, features):
        """The target's features as the network reads them (as they are)."""
        return features

    def logits(self, params, config, hidden):
        """Logits over the draft's vocabulary, float32."""
        return eagle_logits(hidden, params["lm_head"])

    def target_ids(self, params, ids):
        """The target token ids of draft-vocabulary indices."""
        return params["draft_ids"][ids] if "draft_ids" in params else ids

    def vocab_rows(self, params) -> int:
        return params["lm_head"].shape[0]


def cast_floats(tree, dtype):
    """`tree` with its floating arrays in `dtype` (integer maps keep their type)."""
    return jax.tree_util.tree_map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def prepared_net(net: dict, own: tuple[str, ...]) -> dict:
    """A loaded network's parameters as drafting runs them: the fc as `linear` takes it ([D, kD]
    from the trained [kD, D] kernel), and the network's `own` products in the draft weights
    type of the CPU kernel (`draft_weights`)."""
    from specjax.cpu.draft_weights import draft_weights

    net = {**net, "fc": {**{k: v for k, v in net["fc"].items() if k != "kernel"}, "weight": net["fc"]["kernel"].T}}
    return {**net, **draft_weights({k: v for k, v in net.items() if k in own})}


def load_eagle(heads, target, draft_vocab: int | None = None):
    """(EagleNet(), draft config, params) of an EAGLE head checkpoint for `target` (a loaded
    model): weights in the target's dtype, drafting from the `draft_vocab` most frequent tokens
    where given (or the order the heads store)."""
    from specjax.cpu.draft_weights import draft_weights
    from specjax.model import lm_head_weight

    config, net = load_eagle_heads(heads, target.config)
    dtype = target.params["embed"].dtype
    ids = net.pop("draft_ids", None)
    params = {
        "net": prepared_net(cast_floats(net, dtype), ("layers", "fc")),
        "embed": target.params["embed"],
        "lm_head": lm_head_weight(target.params),
    }
    if ids is not None or draft_vocab is not None:
        ids = jnp.arange(target.config.vocab_size) if ids is None else ids
        params["lm_head"], params["draft_ids"] = draft_vocabulary(params["lm_head"], ids, draft_vocab)
    params["lm_head"] = draft_weights(params["lm_head"])
    return EagleNet(), config, params
