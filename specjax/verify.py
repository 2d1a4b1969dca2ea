"""Verification: one target forward over every sequence's draft tree."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from kernels_pallas import attention_backend
from specjax.cache import PagedKVCache
from specjax.config import ModelConfig
from specjax.draft_tree import DraftTree, ancestor_mask, tree_positions
from specjax.model import ForwardOutput, forward, write_new_kv


def verify(params, config: ModelConfig, cache: PagedKVCache, tree: DraftTree, *,
           hidden_layers: Sequence[int] = (), defer_kv_write: bool = False) -> ForwardOutput:
    """Target logits [B, T, V] at every node of the trees, in one pass.

    Node i's K/V goes to the scratch slot cache.lengths + i (after the committed prefix), its RoPE
    position is cache.lengths + depth[i], and it attends to the prefix, its ancestors and itself.
    The cache's lengths are unchanged: `commit` keeps the accepted nodes. defer_kv_write: see
    `model.forward`.
    """
    return forward(params, config, tree.tokens, tree_positions(tree, cache.lengths), cache,
                   ancestor_mask(tree), hidden_layers=hidden_layers, defer_kv_write=defer_kv_write)


def verify_widths(tree_size: int) -> tuple[int, ...]:
    """The static widths a tree of `tree_size` nodes may be verified at (see verify_pruned)."""
    return tuple(sorted({1, tree_size} | {w for w in (4, 8, 16, 64) if w < tree_size}))


def _prefix(tree: DraftTree, w: int) -> DraftTree:
    logq = None if tree.draft_logprobs is None else tree.draft_logprobs[:, :w]
    ok = None if tree.acceptable is None else tree.acceptable[:, :w]
    return DraftTree(tree.tokens[:, :w], tree.parent[:, :w], tree.depth[:, :w], tree.valid[:, :w],
                     logq, ok)


def verify_pruned(params, config: ModelConfig, cache: PagedKVCache, tree: DraftTree,
                  feature_layers: Sequence[int] = ()):
    """`verify`, run only as wide as the batch's last valid node needs.

    A verify of T tokens costs up to ~2x a single-token pass on a CPU (small matrix products
    turn compute-bound), so when no sequence drafted anything (Prompt-Lookup without a match)
    the step costs what vanilla decoding costs. Nodes past the chosen width are invalid; their
    logits and hidden states come back as zeros. Returns (logits [B, T, V], hidden [B, T, D],
    cache); with `feature_layers` the hidden states are those layers' outputs concatenated
    (EAGLE-3's features) instead of the final normed state.
    """
    t = tree.size
    widths = verify_widths(t)
    node = jnp.arange(t, dtype=jnp.int32)
    needed = jnp.max(jnp.where(tree.valid, node[None, :] + 1, 1))
    branch = jnp.searchsorted(jnp.asarray(widths), needed)
    # XLA copies every pool into and out of a switch branch that writes it (~2 x the whole cache
    # per step): with XLA attention the branches return their K/V, written after the switch.
    defer = attention_backend() == "xla"

    def run(w):
        def f(cache):
            out = verify(params, config, cache, _prefix(tree, w), hidden_layers=feature_layers,
                         defer_kv_write=defer)
            hidden = jnp.concatenate(out.layer_hiddens, -1) if feature_layers else out.hidden
            pad = ((0, 0), (0, t - w), (0, 0))
            padded = (jnp.pad(out.logits, pad), jnp.pad(hidden, pad))
            if not defer:
                return padded + (out.cache,)
            kv_pad = ((0, 0), (0, t - w), (0, 0), (0, 0))
            new_kv = jax.tree_util.tree_map(lambda a: jnp.pad(a, kv_pad), out.new_kv)
            return padded + (new_kv,)
        return f

    logits, hidden, out = jax.lax.switch(branch, [run(w) for w in widths], cache)
    if not defer:
        return logits, hidden, out
    slots = cache.lengths[:, None] + node[None, :]
    written = node[None, :] < jnp.asarray(widths)[branch]
    return logits, hidden, write_new_kv(cache, out, slots, jnp.broadcast_to(written, slots.shape))
