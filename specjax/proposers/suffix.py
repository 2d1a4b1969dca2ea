"""Suffix decoding (SuffixDecoding, Oliaro et al. 2024): a draft tree of what followed earlier
occurrences of the text's last tokens, model-free.

Each step, for every match length m up to `max_match`, takes what followed the most recent
`max_occurrences` earlier occurrences of the sequence's last m tokens in its own prompt and
output, and counts them as a trie: a continuation prefix seen c times of N estimates the
probability c / N (the product of its tokens' count ratios along the path). The tree is the
prefixes of largest estimate, best first, down to `min_token_prob`, with at most
`max_spec_factor * m + max_spec_offset` drafted tokens (and `max_nodes - 1`), of depth at most
`max_tree_depth - m`: a longer match drafts more. Of these trees, one per m, the step drafts the
one expected to accept the most tokens (the sum of its nodes' estimates). A child's count never exceeds its parent's and
ties go to the shallower node, so the best-first set is always a tree. The tree is deterministic,
so the `match` rule verifies it exactly under sampling (a sibling is tried only if the target's
own draw equals it). Everything runs inside jit, vectorized over positions and occurrences.

With a `SuffixCache` as its parameters (what `make_proposer` gives), the continuations of the
most recent occurrences in earlier requests' outputs (`specjax.proposers.suffix_cache`) join the
request's own in the same counts: a continuation seen in both counts twice.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.draft_tree import DraftTree
from specjax.proposers.suffix_cache import cached_continuations
from specjax.spec_decode import StatelessProposer


def match_lengths(tokens, length, max_match: int):
    """int32[B, S]: how many of the sequence's last tokens (up to max_match) end at position j,
    for positions j whose next token is known (j + 1 < length - 1 excluded: the pending token's
    own position never matches itself), 0 elsewhere."""
    b, s = tokens.shape
    rows = jnp.arange(b)
    j = jnp.arange(s)[None, :]
    run = jnp.ones((b, s), bool)
    total = jnp.zeros((b, s), jnp.int32)
    for k in range(max_match):
        last = tokens[rows, jnp.maximum(length - 1 - k, 0)]  # the k-th token from the end
        earlier = jnp.roll(tokens, k, axis=1)  # position j holds tokens[j - k]
        run = run & (earlier == last[:, None]) & (j - k >= 0) & (length[:, None] - 1 - k >= 0)
        total = total + run
    return jnp.where(j < length[:, None] - 1, total, 0)


def suffix_tree(
    tokens,
    length,
    *,
    max_nodes: int,
    max_match: int,
    max_occurrences: int,
    max_tree_depth: int,
    max_spec_factor: float,
    max_spec_offset: float,
    min_token_prob: float,
    cache=None,
    cached_occurrences: int = 32,
    chain: bool = False,
    extra=None,
):
    """The draft trees [B, max_nodes] (root: the pending token) of the module's rule: one tree
    per match length 1..max_match, and of them the one of highest score (the sum of its nodes'
    estimated probabilities: the expected number of accepted tokens), the longer match on ties,
    as SuffixDecoding chooses. cache: a `SuffixIndex` whose `cached_occurrences` most recent
    occurrences per match length count too (None: the rows' own tokens alone); extra: such
    continuations found by other means, (cont, known) of shape [M, B, G, D]."""
    b = tokens.shape[0]
    lengths = match_lengths(tokens, length, max_match)
    depth = min(max_nodes - 1, max_tree_depth)
    if extra is None and cache is None:
        extra = (jnp.zeros((max_match, b, 0, depth), jnp.int32), jnp.zeros((max_match, b, 0, depth), bool))
    elif extra is None:
        extra = cached_continuations(cache, tokens, length, max_match=max_match, count=cached_occurrences, depth=depth)
    options = dict(
        chain=chain,
        max_nodes=max_nodes,
        max_occurrences=max_occurrences,
        max_tree_depth=max_tree_depth,
        max_spec_factor=max_spec_factor,
        max_spec_offset=max_spec_offset,
        min_token_prob=min_token_prob,
    )
    trees, scores = jax.vmap(lambda m, c, k: _tree_for_match(tokens, length, lengths, m, c, k, **options))(
        jnp.arange(1, max_match + 1), *extra
    )  # [M, B, ...], [M, B]
    best = max_match - 1 - jnp.argmax(jnp.flip(scores == jnp.max(scores, axis=0), axis=0), axis=0)  # [B]
    rows = jnp.arange(b)
    return jax.tree_util.tree_map(lambda x: x[best, rows], trees)


def _tree_for_match(
    tokens,
    length,
    lengths,
    m,
    extra_cont,
    extra_known,
    *,
    max_nodes,
    max_occurrences,
    max_tree_depth,
    max_spec_factor,
    max_spec_offset,
    min_token_prob,
    chain=False,
):
    """(the tree drafted from the occurrences of the last m tokens, its score); extra_cont and
    extra_known [B, G, D]: continuations of more occurrences (the global cache's). chain: only
    the path that takes the most frequent continuation at every depth."""
    b, s = tokens.shape
    own_n = min(max_occurrences, s)
    n, t = own_n + extra_cont.shape[1], max_nodes
    d_max = min(t - 1, max_tree_depth)  # the deepest continuation read
    rows = jnp.arange(b)
    # The most recent occurrences of the last m tokens.
    score = jnp.where(lengths >= m, jnp.arange(s)[None, :] + 1, 0)
    hits, ends = jax.lax.top_k(score, own_n)  # [B, N]
    found = hits > 0
    d = jnp.arange(d_max)
    at = ends[:, :, None] + 1 + d[None, None, :]  # [B, N, D] the continuations' positions
    cont = jnp.take_along_axis(tokens, jnp.clip(at, 0, s - 1).reshape(b, -1), axis=1)
    cont = jnp.concatenate([cont.reshape(b, own_n, d_max), extra_cont], axis=1)
    known = jnp.concatenate([found[:, :, None] & (at < length[:, None, None]), extra_known], axis=1)
    known = known & (d[None, None, :] < max_tree_depth - m)
    occurrences = jnp.maximum(jnp.sum(known[:, :, 0], axis=1), 1)
    # same[b, i, k, d]: occurrences i and k share their continuation's first d + 1 tokens,
    # compared as hashes of the prefixes (one comparison per pair and depth, no running product;
    # a collision could only draft a wrong token, which verification rejects)
    prefix = _prefix_hashes(cont)
    same = (prefix[:, :, None, :] == prefix[:, None, :, :]) & known[:, :, None, :] & known[:, None, :, :]
    count = jnp.sum(same, axis=2)  # [B, N, D]
    first = jnp.argmax(same, axis=2)  # the earliest occurrence with the same prefix
    own = known & (first == jnp.arange(n)[None, :, None])  # one candidate per distinct prefix
    prob = count / occurrences[:, None, None]
    budget = jnp.minimum(jnp.floor(max_spec_factor * m + max_spec_offset).astype(jnp.int32), t - 1)
    keep = own & (prob >= min_token_prob)
    if chain:
        keep = keep & _greedy_path(same, count, first, known)
    # Best first: higher count, then shallower (so a parent always precedes its children).
    key = jnp.where(keep, count * (d_max + 1) + (d_max - d)[None, None, :], -1).reshape(b, n * d_max)
    best, pick = jax.lax.top_k(key, t - 1)  # [B, T - 1]
    chosen = (best >= 0) & (jnp.arange(t - 1)[None, :] < budget)
    occ, dep = pick // d_max, pick % d_max
    node_tokens = cont.reshape(b, -1)[rows[:, None], pick]
    # A node's parent: the chosen node holding its prefix one shorter (the root at depth 0).
    parent_occ = first.reshape(b, -1)[rows[:, None], occ * d_max + jnp.maximum(dep - 1, 0)]
    is_parent = (occ[:, None, :] == parent_occ[:, :, None]) & (dep[:, None, :] == dep[:, :, None] - 1)
    is_parent = is_parent & chosen[:, None, :]
    parent = jnp.where(dep == 0, 0, jnp.argmax(is_parent, axis=2) + 1)
    valid = chosen & ((dep == 0) | jnp.any(is_parent, axis=2))
    node_prob = prob.reshape(b, -1)[rows[:, None], pick]
    pending = tokens[rows, length - 1]
    tree = DraftTree(
        tokens=jnp.concatenate([pending[:, None], jnp.where(valid, node_tokens, 0)], 1).astype(jnp.int32),
        parent=jnp.concatenate([jnp.full((b, 1), -1), jnp.where(valid, parent, 0)], 1).astype(jnp.int32),
        depth=jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jnp.where(valid, dep + 1, 0)], 1).astype(jnp.int32),
        valid=jnp.concatenate([jnp.ones((b, 1), bool), valid], 1),
    )
    return tree, jnp.sum(jnp.where(valid, node_prob, 0.0), axis=1)


def _prefix_hashes(cont):
    """uint32[B, N, D]: a hash of each continuation's first d + 1 tokens."""
    h = jnp.zeros(cont.shape[:2], jnp.uint32)
    out = []
    for d in range(cont.shape[2]):
        h = h * jnp.uint32(0x01000193) + cont[:, :, d].astype(jnp.uint32) + jnp.uint32(1)
        out.append(h)
    return jnp.stack(out, axis=2)


def _greedy_path(same, count, first, known):
    """bool[B, N, D]: the candidates (first occurrence of a prefix, depth) on the path that
    follows the most frequent continuation at each depth (the most recent occurrence on ties)."""
    b, n, d_max = count.shape
    rows = jnp.arange(b)
    alive = known[:, :, 0]
    path = jnp.zeros((b, n, d_max), bool)
    for j in range(d_max):
        c = jnp.where(alive & known[:, :, j], count[:, :, j], 0)
        r = jnp.argmax(c, axis=1)  # an occurrence on the path
        path = path.at[rows, first[rows, r, j], j].set(jnp.max(c, axis=1) > 0)
        alive = alive & same[rows[:, None], jnp.arange(n)[None, :], r[:, None], j]
    return path


@dataclasses.dataclass(frozen=True)
class SuffixProposer(StatelessProposer):
    """Suffix decoding over the request's own tokens and, when its parameters are a
    `SuffixCache`, earlier requests' outputs (ArcticInference / vLLM option names:
    suffix_decoding_max_tree_depth, _max_spec_factor, _min_token_prob; `max_nodes` is vLLM's
    num_speculative_tokens + 1)."""

    max_nodes: int = 16
    max_tree_depth: int = 24
    max_spec_factor: float = 1.0
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1
    max_match: int = 8
    max_occurrences: int = 32
    cached_occurrences: int = 32
    rule: str = "match"
    is_chain: bool = False

    def __post_init__(self):
        if self.max_nodes < 2 or self.max_match < 1 or self.max_occurrences < 1 or self.max_tree_depth < 1:
            raise ValueError("max_nodes must be >= 2; max_match, max_occurrences and max_tree_depth >= 1")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {self.min_token_prob}")
        if self.max_spec_factor < 0:
            raise ValueError(f"max_spec_factor must be >= 0, got {self.max_spec_factor}")

    @property
    def tree_size(self) -> int:
        return self.max_nodes

    def propose(self, params, state, ctx, keys, sampling):
        tree = suffix_tree(
            ctx.tokens,
            ctx.lengths,
            max_nodes=self.max_nodes,
            max_match=self.max_match,
            max_occurrences=self.max_occurrences,
            max_tree_depth=self.max_tree_depth,
            max_spec_factor=self.max_spec_factor,
            max_spec_offset=self.max_spec_offset,
            min_token_prob=self.min_token_prob,
            cache=params,
            cached_occurrences=self.cached_occurrences,
            chain=self.is_chain,
        )
        return tree, state
