"""Draft trees: the candidate continuations one speculative step verifies.

Node 0 is the pending token (the root); every other node holds a drafted token whose parent is an
earlier node (parent[i] < i), so one pass in index order visits parents before children. A chain
(Draft-Target, Prompt-Lookup) is the tree with parent[i] = i - 1. Shapes are static: T nodes per
sequence, unused nodes marked invalid.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class DraftTree:
    """A batch of draft trees of T nodes each."""

    tokens: jax.Array  # int32[B, T]
    parent: jax.Array  # int32[B, T], parent[:, 0] = -1
    depth: jax.Array  # int32[B, T], depth[:, 0] = 0
    valid: jax.Array  # bool[B, T], valid[:, 0] = True
    # log q(.) of the distribution node i was sampled from (at its parent), float32[B, T, V];
    # only for lossless sampling of chains drafted stochastically (use_logits=True).
    draft_logprobs: jax.Array | None = None
    # bool[B, T]: nodes acceptance may follow; None means every valid node. A node marked False
    # is still verified (attends, is attended by its descendants, gets logits) but is never
    # accepted and so never committed: Lookahead's Jacobi window rides in the same forward.
    acceptable: jax.Array | None = None

    @property
    def size(self) -> int:
        return self.tokens.shape[1]


def check_confidence_floor(min_prob: float, name: str = "min_prob") -> None:
    """Refuse a draft-confidence floor (the EAGLE and Medusa proposers' min_prob) outside [0, 1]."""
    if not 0.0 <= min_prob <= 1.0:
        raise ValueError(f"{name} (the draft-confidence floor) must be in [0, 1], got {min_prob}")


def reaches_floor(log_prob, min_prob: float):
    """Which cumulative draft log-probabilities reach the floor min_prob (> 0)."""
    return log_prob >= jnp.log(jnp.float32(min_prob))


def skipped_draw(paths: Sequence[Sequence[int]]) -> tuple | None:
    """The first path of a static tree (paths of ranks) whose elder sibling is missing, or None
    when every node's children are ranks 0, 1, .. with none skipped: the trees that can be drawn
    for the `recursive` rule, rank r standing for a node's r-th draw."""
    listed = {tuple(p) for p in paths}
    return next((p for p in sorted(listed) if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in listed), None)


# Rules that verify trees drawn from the draft's q (a node's children: its first draws).
DRAWN_RULES = ("recursive", "traversal")
# The lossless tree rules: `match` (top-k children, the target's sample must equal one) and these.
TREE_RULES = ("match", *DRAWN_RULES)


def one_parent_per_depth(paths: Sequence[Sequence[int]]) -> bool:
    """Whether the nodes of each depth of a static tree (paths of ranks) share one parent: then
    draws shared by a depth's parents (Medusa's heads) fall in one subtree only, as the
    `traversal` rule needs."""
    parents = {}
    for p in paths:
        parents.setdefault(len(p), set()).add(tuple(p[:-1]))
    return all(len(s) == 1 for s in parents.values())


def check_recursive_tree(paths: Sequence[Sequence[int]]) -> None:
    """Refuse a static tree the `recursive` rule cannot verify when its nodes are drawn."""
    p = skipped_draw(paths)
    if p is not None:
        raise ValueError(
            f"recursive acceptance tries a node's children in draw order: tree "
            f"path {list(p)} needs {list(p[:-1] + (p[-1] - 1,))} too"
        )


def on_vocabulary(logq, ids, vocab: int):
    """log q [..., vocab] over the target's vocabulary from log q [..., R] over a draft
    vocabulary whose tokens are the target ids `ids` [R] (-inf on the others)."""
    full = jnp.full(logq.shape[:-1] + (vocab,), -jnp.inf, jnp.float32)
    return full.at[..., ids].set(logq)


def static_draft_tree(tokens, parent, depth, valid, draft_logprobs=None) -> DraftTree:
    """Trees of one static shape (host arrays `parent`, `depth` of `static_tree`) over tokens
    and valid [B, T]; invalid nodes hold token 0."""
    b, t = tokens.shape
    return DraftTree(
        tokens=jnp.where(valid, tokens, 0).astype(jnp.int32),
        parent=jnp.broadcast_to(jnp.asarray(parent), (b, t)),
        depth=jnp.broadcast_to(jnp.asarray(depth), (b, t)),
        valid=valid,
        draft_logprobs=draft_logprobs,
    )


def drawn_static_tree(pending, parent, depth, tokens, drawn, draft_logprobs) -> DraftTree:
    """A static tree (host arrays `parent`, `depth` of `static_tree`) whose nodes were drawn for
    the `recursive` rule: tokens [B, T - 1] of nodes 1.., `drawn` [B, T - 1] whether each is a
    real draw (a node under one that is not is dropped too), draft_logprobs [B, T - 1, V] the q
    each was drawn from."""
    b = pending.shape[0]
    valid = jnp.concatenate([jnp.ones((b, 1), bool), drawn], axis=1)
    for d in range(2, int(depth.max()) + 1):  # parents first: whole root paths only
        nodes = np.flatnonzero(depth == d)
        valid = valid.at[:, nodes].set(valid[:, nodes] & valid[:, parent[nodes]])
    return static_draft_tree(
        jnp.concatenate([pending[:, None], tokens], axis=1),
        parent,
        depth,
        valid,
        jnp.concatenate([jnp.zeros_like(draft_logprobs[:, :1]), draft_logprobs], axis=1),
    )


def chain(pending, drafts, num_valid, draft_logprobs=None) -> DraftTree:
    """A chain tree: the pending token [B] followed by drafts [B, K], of which the first
    num_valid[b] are real."""
    b, k = drafts.shape
    t = k + 1
    idx = jnp.arange(t, dtype=jnp.int32)
    tokens = jnp.concatenate([pending[:, None], drafts], axis=1).astype(jnp.int32)
    valid = idx[None, :] <= num_valid[:, None]
    tokens = jnp.where(valid, tokens, 0)
    if draft_logprobs is not None:  # node 0 was not drafted: give it a dummy row
        draft_logprobs = jnp.concatenate([jnp.zeros_like(draft_logprobs[:, :1]), draft_logprobs], 1)
    return DraftTree(
        tokens=tokens,
        parent=jnp.broadcast_to(idx - 1, (b, t)),
        depth=jnp.broadcast_to(idx, (b, t)),
        valid=valid,
        draft_logprobs=draft_logprobs,
    )


def ancestor_mask(tree: DraftTree):
    """bool[B, T, T]: mask[b, i, j] iff node j is node i or one of its ancestors.

    Invalid nodes see only themselves, so their (unused) outputs stay finite.
    """
    b, t = tree.tokens.shape
    eye = jnp.broadcast_to(jnp.eye(t, dtype=bool), (b, t, t))
    parent = jnp.clip(tree.parent, 0, t - 1)
    has_parent = (tree.parent >= 0) & tree.valid

    # Nodes come after their parents: row i = {i} | row(parent[i]), filled in index order.
    def fill(i, mask):
        row = mask[jnp.arange(b), parent[:, i]]  # [B, T]
        row = jnp.where(has_parent[:, i, None], row, False)
        return mask.at[:, i].set(mask[:, i] | row)

    return jax.lax.fori_loop(1, t, fill, eye)


def tree_positions(tree: DraftTree, start):
    """RoPE positions of the nodes: start[b] + depth."""
    return start[:, None] + tree.depth


def static_tree(paths: Sequence[Sequence[int]]):
    """Host-side topology of a static tree from its root-to-node paths of child ranks.

    `paths` lists nodes as tuples of child indices (Medusa's `medusa_choices` form, e.g.
    (0,), (1,), (0, 0)); every prefix of a path must be listed too. Returns numpy arrays
    (parent, depth, rank) of length len(paths) + 1, node 0 being the root, with nodes sorted by
    depth then path, so parents precede children.
    """
    ordered = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
    index = {(): 0}
    for i, p in enumerate(ordered, 1):
        index[p] = i
    parent, depth, rank = [-1], [0], [0]
    for p in ordered:
        if p[:-1] not in index:
            raise ValueError(f"tree path {list(p)} listed without its prefix {list(p[:-1])}")
        parent.append(index[p[:-1]])
        depth.append(len(p))
        rank.append(p[-1])
    return np.asarray(parent, np.int32), np.asarray(depth, np.int32), np.asarray(rank, np.int32)
