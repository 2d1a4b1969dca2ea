"""Verification: one target forward over every sequence's draft tree.

Three entry points, one pass: `verify` runs the whole tree (the reference the others are tested
against); `verify_pruned` runs it only as wide as the valid nodes need and writes their K/V (the
step piece a custom loop calls); `verify_pruned_kv` is the same pass returning the K/V unwritten,
so that `commit` writes only the accepted path's (what `spec_step` calls)."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

from specjax.attention import on_cpu_path
from specjax.cache import PagedKVCache
from specjax.cpu.matmul import kernel_in_use
from specjax.draft_tree import DraftTree, ancestor_mask, tree_positions
from specjax.model import ForwardOutput, forward, write_new_kv
from specjax.model_config import ModelConfig
from specjax.sampling import argmax_last


class NodeKV(NamedTuple):
    """The verified nodes' K/V, unwritten: every layer's stacked, [L, B, T, KVH, D] (one array
    padded to the tree's width, not one per layer); `written` [B, T] marks the nodes inside the
    verified width (past it the rows are zeros)."""

    keys: jax.Array
    values: jax.Array
    written: jax.Array


def verify(
    params,
    config: ModelConfig,
    cache: PagedKVCache,
    tree: DraftTree,
    *,
    hidden_layers: Sequence[int] = (),
    defer_kv_write: bool = False,
    written=None,
) -> ForwardOutput:
    """Target logits [B, T, V] at every node of the trees, in one pass.

    Node i's K/V goes to the scratch slot cache.lengths + i (after the committed prefix), its RoPE
    position is cache.lengths + depth[i], and it attends to the prefix, its ancestors and itself.
    The cache's lengths are unchanged: `commit` keeps the accepted nodes. defer_kv_write: see
    `model.forward`. written (bool[B, T], default all): nodes whose K/V is stored; the others
    are padding that no node sees.
    """
    return forward(
        params,
        config,
        tree.tokens,
        tree_positions(tree, cache.lengths),
        cache,
        ancestor_mask(tree),
        valid=written,
        hidden_layers=hidden_layers,
        defer_kv_write=defer_kv_write,
    )


def padded_width(tree_size: int) -> int:
    """The width a whole tree is verified at: with XLA's matrix products 5-7 nodes as 8 and 9-15
    as 16, because XLA:CPU's products over such row counts cost more than over 8 or 16 rows
    (measured at 5-7, 9, 10 and 12, timings not kept in docs/; the rule: docs/design.md,
    "Kernel dispatch"; padding costs little on a GPU). The CPU kernel of `specjax.cpu.matmul`
    has no such steps: trees run as they are."""
    if kernel_in_use():
        return tree_size
    return 8 if 4 < tree_size < 8 else 16 if 8 < tree_size < 16 else tree_size


def verify_widths(tree_size: int, likely: Sequence[int] = ()) -> tuple[int, ...]:
    """The static widths a tree of `tree_size` nodes may be verified at (see verify_pruned),
    with the `likely` ones (numbers of leading nodes the tree often has valid) among them."""
    return tuple(
        sorted(
            {1, padded_width(tree_size)}
            | {w for w in (4, 8, 16, 64) if w < tree_size}
            | {padded_width(w) for w in likely if 1 <= w < tree_size}
        )
    )


def _to_width(x, w: int, value=0, axis: int = 1):
    """x [B, T, ...] cut or padded with `value` along `axis` (T's) to w entries."""
    t = x.shape[axis]
    if w <= t:
        return jax.lax.slice_in_dim(x, 0, w, axis=axis)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, w - t)
    return jnp.pad(x, pad, constant_values=value)


def _stacked_to_width(layers, w: int):
    """Per-layer [B, T, ...] arrays stacked [L, B, w, ...]: one pad instead of one per layer
    (~3 us each, 60 a verify pass of SmolLM2)."""
    return _to_width(jnp.stack(layers), w, axis=2)


def _resize(tree: DraftTree, w: int) -> DraftTree:
    """The trees' first w nodes, or the trees padded with invalid nodes to w."""
    fit = lambda x, value=0: None if x is None else _to_width(x, w, value)
    return DraftTree(
        fit(tree.tokens),
        fit(tree.parent, -1),
        fit(tree.depth),
        fit(tree.valid, False),
        fit(tree.draft_logprobs),
        fit(tree.acceptable, False),
    )


def verify_pruned(
    params,
    config: ModelConfig,
    cache: PagedKVCache,
    tree: DraftTree,
    feature_layers: Sequence[int] = (),
    likely_widths: Sequence[int] = (),
    defer_writes: bool = True,
):
    """`verify`, run only as wide as the batch's last valid node needs; (logits, hidden, cache)
    with every verified node's K/V in the cache's scratch slots (see `verify_pruned_kv`)."""
    logits, hidden, cache, new_kv = verify_pruned_kv(
        params, config, cache, tree, feature_layers, likely_widths, defer_writes=defer_writes
    )
    if new_kv is not None:
        node = jnp.arange(tree.size, dtype=jnp.int32)
        cache = write_new_kv(
            cache, (new_kv.keys, new_kv.values), cache.lengths[:, None] + node[None, :], new_kv.written
        )
    return logits, hidden, cache


def verify_pruned_kv(
    params,
    config: ModelConfig,
    cache: PagedKVCache,
    tree: DraftTree,
    feature_layers: Sequence[int] = (),
    likely_widths: Sequence[int] = (),
    greedy_draws: bool = False,
    defer_writes: bool = True,
):
    """`verify`, run only as wide as the batch's last valid node needs.

    A verify of T tokens costs more than a single-token pass on a CPU (small matrix products
    turn compute-bound; docs/benchmarks.md, "What one verify pass costs"), so when no sequence
    drafted anything (Prompt-Lookup without a match) the step costs what vanilla decoding costs.
    Nodes past the chosen width are invalid; their logits and hidden states come back as zeros.
    Returns (logits [B, T, V], hidden [B, T, D], cache, new_kv): the nodes' K/V are not written
    but returned (a `NodeKV`), so that `commit` writes only the accepted path's (with
    defer_writes=False they are in the cache's scratch slots and new_kv is None).
    With `feature_layers` the hidden states are those layers' outputs concatenated (EAGLE-3's
    features) instead of the final normed state. `likely_widths`: numbers of leading
    nodes that are often all the valid ones (a proposer's `likely_widths`, e.g. the learned tree
    without the prompt-lookup graft), verified at exactly that width when they are.
    `greedy_draws`: instead of the logits, each node's argmax int32[B, T] (0 past the width),
    taken over the verified nodes' rows only, and no [B, T, V] array is padded or returned.
    defer_writes=False writes the nodes' K/V inside the pass instead (tests compare the two).
    """
    b, t = tree.tokens.shape
    # Narrower widths pay where a pass's cost grows with its rows (a CPU); a GPU's pass over 64
    # rows costs about what one row's does, so there the tree is verified whole (no switch).
    widths = verify_widths(t, likely_widths) if on_cpu_path() else (t,)
    node = jnp.arange(t, dtype=jnp.int32)
    needed = jnp.max(jnp.where(tree.valid, node[None, :] + 1, 1))
    branch = jnp.searchsorted(jnp.asarray(widths), needed)
    # XLA copies every pool into and out of a switch branch that writes it (~2 x the whole cache
    # per step): the branches return their K/V, written after the switch (on every backend: the
    # Pallas kernel reads the unwritten rows as its tree keys).
    defer = defer_writes

    def run(w):
        def f(cache):
            written = None if w <= t else jnp.broadcast_to(jnp.arange(w) < t, (b, w))
            out = verify(
                params,
                config,
                cache,
                _resize(tree, w),
                hidden_layers=feature_layers,
                defer_kv_write=defer,
                written=written,
            )
            hidden = jnp.concatenate(out.layer_hiddens, -1) if feature_layers else out.hidden
            scores = argmax_last(out.logits) if greedy_draws else out.logits
            outs = (_to_width(scores, t), _to_width(hidden, t))
            if not defer:
                return outs + (out.cache,)
            return outs + (tuple(_stacked_to_width(kv, t) for kv in out.new_kv),)

        return f

    logits, hidden, out = jax.lax.switch(branch, [run(w) for w in widths], cache)
    if not defer:
        return logits, hidden, out, None
    written = node[None, :] < jnp.asarray(widths)[branch]
    return logits, hidden, cache, NodeKV(*out, jnp.broadcast_to(written, (b, t)))
