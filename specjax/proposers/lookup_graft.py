"""A prompt-lookup continuation grafted onto another proposer's draft tree.

A trained drafter (EAGLE, Medusa, ReDrafter) predicts the next few tokens well where the text is
new; prompt lookup proposes long runs where the text repeats what came before (a summary quoting
its source, code reusing names). `LookupGraftProposer` drafts both each step and verifies them
in one target pass: the lookup chain is merged into the tree where the tree already holds its
first tokens, and the rest hangs below as a chain, so acceptance follows whichever candidate the
target agrees with further (SAM-Decoding, Hu et al. 2024, pairs retrieval with EAGLE the same
way). Both drafters' candidates are deterministic, so the `match` rule keeps outputs exactly
those of the target, greedy or sampled. Under the `recursive` rule (Medusa and EAGLE trees drawn
from the draft) the chain's nodes carry a one-hot q: each is a group of one certain draw, tried
after the drafted siblings against the residual they leave, which keeps the rule exact.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from specjax.accept import acceptable_nodes
from specjax.draft_tree import DRAWN_RULES, TREE_RULES, DraftTree
from specjax.proposers.prompt_lookup import PromptLookupProposer
from specjax.spec_decode import ProposerWrapper


def graft_chain(tree: DraftTree, chain_tokens, count, width: int | None = None) -> DraftTree:
    """`tree` with the chain `chain_tokens` [B, K] (the first count[b] real) hung from its root.

    The chain's leading tokens that the tree already holds on one root path are shared; the
    remaining ones become new nodes placed after the tree's kept nodes, the first of them a
    child of the last shared node. The tree keeps its nodes up to its last valid one (a tail a
    confidence floor dropped is not verified); with `width`, only as many of its leading nodes as
    leave room for the new ones within `width` (never fewer than the shared path), so a verify
    pass stays that wide. The result has K more slots than `tree`, the unused ones invalid. No
    node gets a sibling with its own token, so the tree stays a trie.
    Leading nodes are the ones kept because every tree lists parents before children (an EAGLE-2
    tree lists its nodes best first).
    """
    b, t = tree.tokens.shape
    k = chain_tokens.shape[1]
    rows = jnp.arange(b)[:, None]
    ok = acceptable_nodes(tree)
    cur = jnp.zeros((b,), jnp.int32)  # last shared node
    shared = jnp.zeros((b,), jnp.int32)
    alive = jnp.ones((b,), bool)
    for j in range(k):  # K is a small static number
        hit = ok & (tree.parent == cur[:, None]) & (tree.tokens == chain_tokens[:, j, None])
        alive = alive & (j < count) & jnp.any(hit, axis=1)
        cur = jnp.where(alive, jnp.argmax(hit, axis=1).astype(jnp.int32), cur)
        shared = shared + alive
    new = jnp.maximum(count - shared, 0)
    # past the tree's last valid node (a confidence floor drops a tail) nothing needs keeping
    keep = jnp.max(jnp.where(tree.valid, jnp.arange(1, t + 1, dtype=jnp.int32), 1), axis=1)
    if width is not None:
        keep = jnp.minimum(keep, width - new)
    keep = jnp.where(new > 0, jnp.clip(keep, cur + 1, t), t)
    p = jnp.arange(t + k, dtype=jnp.int32)[None, :]
    base = p < keep[:, None]
    j = p - keep[:, None]  # position in the chain's new nodes
    in_chain = (j >= 0) & (j < new[:, None])
    # kept nodes stay where they are (keep <= t), so the tree's own fields, padded by K, hold them
    pick = lambda a, chain, other: jnp.where(
        base, jnp.pad(a, ((0, 0), (0, k))), jnp.where(in_chain, chain, other).astype(a.dtype)
    )
    src = jnp.clip(shared[:, None] + j, 0, k - 1)
    acceptable = None if tree.acceptable is None else pick(tree.acceptable, True, False)
    tokens = pick(tree.tokens, chain_tokens[rows, src], 0)
    logq = tree.draft_logprobs
    if logq is not None:  # the chain's nodes are certain: q is one-hot at their token
        one_hot = jnp.where(jnp.arange(logq.shape[-1]) == tokens[..., None], 0.0, -jnp.inf)
        logq = jnp.where(base[..., None], jnp.pad(logq, ((0, 0), (0, k), (0, 0))), one_hot.astype(logq.dtype))
    return DraftTree(
        tokens=tokens,
        parent=pick(tree.parent, jnp.where(j == 0, cur[:, None], p - 1), -1),
        depth=pick(tree.depth, shared[:, None] + j + 1, 0),
        valid=pick(tree.valid, True, False),
        draft_logprobs=logq,
        acceptable=acceptable,
    )


@dataclasses.dataclass(frozen=True)
class LookupGraftProposer(ProposerWrapper):
    """`base`'s draft tree plus `lookup`'s prompt-lookup chain (see `graft_chain`).

    The base proposer keeps its own state, pools and update (its update sees the accepted path
    whichever drafter proposed it, with the target's features of every accepted node); prompt
    lookup reads only the token buffer. The tree grows by the lookup's `tree_size - 1`
    nodes, verified only when the lookup finds a continuation the tree does not hold already
    (`verify_pruned` runs as wide as the last valid node, the base tree's width among its
    choices: `likely_widths`). `width`: the widest a step with a lookup continuation verifies;
    the base tree's last (for EAGLE-2, lowest-ranked) nodes give way to the continuation's. On a
    CPU, where each verified row past ~8 costs compute, that keeps a larger tree affordable.
    Under a rule that draws its trees (`recursive`, `traversal`) the width applies to greedy
    steps only: a sampled step's drawn tree is verified whole, since cutting a drawn node by
    what the chain drafted would make its presence depend on its token.
    """

    base: Any
    lookup: Any = PromptLookupProposer(5, 3, 2)  # a stateless chain drafter (or SuffixProposer chains)
    is_chain: bool = False
    width: int | None = None
    # params are {"base": the base's, "lookup": the lookup's (a suffix cache)}; else the base's
    lookup_params: bool = False

    def __post_init__(self):
        if self.base.rule not in TREE_RULES or self.base.rule_options:
            raise ValueError(
                "a prompt-lookup graft needs a proposer verified with the lossless "
                f"`match`, `recursive` or `traversal` rule, not {self.base.rule!r}"
            )
        if self.width is not None and self.width < 2:
            raise ValueError(
                f"the graft's width must be at least 2 (the pending token and one drafted), got {self.width}"
            )

    @property
    def tree_size(self) -> int:
        return self.base.tree_size + self.lookup.tree_size - 1

    @property
    def max_path_len(self) -> int:
        """The base's longest root path, or the continuation's (it shares a prefix with the
        tree and ends at most `lookup.tree_size - 1` deep)."""
        return max(self.base.max_path_len, self.lookup.tree_size)

    @property
    def likely_widths(self) -> tuple[int, ...]:
        """Without a continuation of its own the lookup adds no node: the base tree alone."""
        widths = (self.base.tree_size, *self.base.likely_widths)
        return widths if self.width is None else (*widths, self.width)

    def _split(self, params):
        return (params["base"], params["lookup"]) if self.lookup_params else (params, None)

    def init(self, params, pools, ctx, prompt_chunk, prompt_len):
        return self.base.init(self._split(params)[0], pools, ctx, prompt_chunk, prompt_len)

    def update(self, params, state, ctx, result, active):
        return self.base.update(self._split(params)[0], state, ctx, result, active)

    def record(self, params, state, block_tables, positions, features, active):
        return self.base.record(self._split(params)[0], state, block_tables, positions, features, active)

    def propose(self, params, state, ctx, keys, sampling):
        base_params, lookup_params = self._split(params)
        tree, state = self.base.propose(base_params, state, ctx, keys, sampling)
        found, _ = self.lookup.propose(lookup_params, (), ctx, keys, sampling)
        count = jnp.sum(found.valid[:, 1:], axis=1).astype(jnp.int32)
        drawn = self.base.rule in DRAWN_RULES and not sampling.greedy
        return graft_chain(tree, found.tokens[:, 1:], count, None if drawn else self.width), state
