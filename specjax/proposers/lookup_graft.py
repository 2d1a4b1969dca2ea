"""A prompt-lookup continuation grafted onto another proposer's draft tree.

A trained drafter (EAGLE, Medusa, ReDrafter) predicts the next few tokens well where the text is
new; prompt lookup proposes long runs where the text repeats what came before (a summary quoting
its source, code reusing names). `LookupGraftProposer` drafts both each step and verifies them
in one target pass: the lookup chain is merged into the tree where the tree already holds its
first tokens, and the rest hangs below as a chain, so acceptance follows whichever candidate the
target agrees with further (SAM-Decoding, Hu et al. 2024, pairs retrieval with EAGLE the same
way). Both drafters' candidates are deterministic, so the `match` rule keeps outputs exactly
those of the target, greedy or sampled.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from specjax.accept import acceptable_nodes
from specjax.draft_tree import DraftTree
from specjax.proposers.prompt_lookup import PromptLookupProposer


def graft_chain(tree: DraftTree, chain_tokens, count) -> DraftTree:
    """`tree` with the chain `chain_tokens` [B, K] (the first count[b] real) hung from its root.

    The chain's leading tokens that the tree already holds on one root path are shared; the
    remaining ones become new nodes appended after the tree's (K more slots, unused ones
    invalid), the first of them a child of the last shared node. No node gets a sibling with its
    own token, so the tree stays a trie.
    """
    b, t = tree.tokens.shape
    k = chain_tokens.shape[1]
    rows = jnp.arange(b)
    ok = acceptable_nodes(tree)
    cur = jnp.zeros((b,), jnp.int32)  # last shared node
    shared = jnp.zeros((b,), jnp.int32)
    alive = jnp.ones((b,), bool)
    for j in range(k):  # K is a small static number
        hit = ok & (tree.parent == cur[:, None]) & (tree.tokens == chain_tokens[:, j, None])
        alive = alive & (j < count) & jnp.any(hit, axis=1)
        cur = jnp.where(alive, jnp.argmax(hit, axis=1).astype(jnp.int32), cur)
        shared = shared + alive
    j = jnp.arange(k, dtype=jnp.int32)[None, :]
    src = jnp.minimum(shared[:, None] + j, k - 1)
    new_valid = j < (count - shared)[:, None]
    new_tokens = jnp.where(new_valid, chain_tokens[rows[:, None], src], 0)
    new_parent = jnp.where(j == 0, cur[:, None], t + j - 1)
    new_parent = jnp.where(new_valid, new_parent, -1)
    new_depth = jnp.where(new_valid, shared[:, None] + j + 1, 0)
    cat = lambda a, c: jnp.concatenate([a, c.astype(a.dtype)], axis=1)  # noqa: E731
    acceptable = None if tree.acceptable is None else cat(tree.acceptable,
                                                          jnp.ones((b, k), bool))
    return DraftTree(tokens=cat(tree.tokens, new_tokens), parent=cat(tree.parent, new_parent),
                     depth=cat(tree.depth, new_depth), valid=cat(tree.valid, new_valid),
                     acceptable=acceptable)


@dataclasses.dataclass(frozen=True)
class LookupGraftProposer:
    """`base`'s draft tree plus `lookup`'s prompt-lookup chain (see `graft_chain`).

    The base proposer keeps its own state, pools and update (its update sees the accepted path
    whichever drafter proposed it, with the target's features of every accepted node); prompt
    lookup reads only the token buffer. The tree grows by `lookup.prompt_lookup_num_tokens`
    nodes, verified only when the lookup finds a continuation the tree does not hold already
    (`verify_pruned` runs as wide as the last valid node, the base tree's width among its
    choices: `likely_widths`).
    """

    base: Any
    lookup: PromptLookupProposer = PromptLookupProposer(5, 3, 2)
    is_chain: bool = False

    def __post_init__(self):
        if self.base.rule != "match" or getattr(self.base, "rule_options", None):
            raise ValueError("a prompt-lookup graft needs a proposer verified with the lossless "
                             f"`match` rule, not {self.base.rule!r}")

    @property
    def rule(self) -> str:
        return "match"

    @property
    def tree_size(self) -> int:
        return self.base.tree_size + self.lookup.prompt_lookup_num_tokens

    @property
    def likely_widths(self) -> tuple[int, ...]:
        """Without a continuation of its own the lookup adds no node: the base tree alone."""
        return (self.base.tree_size, *getattr(self.base, "likely_widths", ()))

    def __getattr__(self, name):
        """The base's optional attributes (needs_prompt_features, feature_layers, draft_scratch,
        and config / variant for sharding its parameters)."""
        if name.startswith("__") or name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    def make_pools(self, num_pages, page_size, dtype):
        return self.base.make_pools(num_pages, page_size, dtype)

    def init(self, params, pools, ctx, prompt_chunk, prompt_len):
        return self.base.init(params, pools, ctx, prompt_chunk, prompt_len)

    def propose(self, params, state, ctx, keys, sampling):
        tree, state = self.base.propose(params, state, ctx, keys, sampling)
        found, _ = self.lookup.propose(None, (), ctx, keys, sampling)
        count = jnp.sum(found.valid[:, 1:], axis=1).astype(jnp.int32)
        return graft_chain(tree, found.tokens[:, 1:], count), state

    def update(self, params, state, ctx, result, active):
        return self.base.update(params, state, ctx, result, active)

    def pools_of(self, state):
        return self.base.pools_of(state)
