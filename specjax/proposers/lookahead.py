"""Lookahead decoding (Fu et al. 2024): a Jacobi window and an n-gram pool, one target forward.

Each step verifies one tree with two branches under the pending token (the root):

- The lookahead branch: a 2-D window of W columns by N - 1 levels. Level 0 of column j
  (j >= 1) sits at RoPE position pending + j and the level-0 cells form a chain from the root;
  level k of column j sits at pending + j + k and hangs below level k - 1 of the same column
  (column 0's level 0 is the root itself). So cell (k, j) attends to the root, level 0 of
  columns 1..j and levels 1..k of column j: the attention of hao-ai-lab/LookaheadDecoding and
  TensorRT-LLM's `lookaheadAlgorithm.cpp`, and a tree, so `ancestor_mask` draws it. After the
  forward the top level's predictions become the new top level and every level moves down one
  (the window advances one position per step whatever was accepted), and each column yields
  an n-gram: its level 0 (the root for column 0) as the key, then levels 1..N-2 and the new
  prediction. The window starts filled with tokens drawn from the prompt (both references draw
  random prompt tokens); its n-grams enter the pool once every level holds the target's own
  predictions (after N - 2 updates).
- The verification branch: the pool's n-grams keyed by the pending token (at most G), merged
  into a prefix tree (TensorRT-LLM merges shared prefixes too) and packed after the window.

Acceptance follows only verification nodes (`DraftTree.acceptable`), so the window's K/V is
never committed; the window reads its next iterate from the step's argmax (`SpecContext.node_argmax`).
`accept_window=True` (off by default, not in the references) also lets acceptance follow the
window's two chains from the root, column 0's levels and level 0's columns: each cell there
attends to exactly the chain above it at its true position, so an accepted cell is an ordinary
verified draft (Jacobi decoding's own acceptance) and its K/V is committed like any other.
It adds what the window guessed right to what the pool offered (training prompts, (1,3,1):
1.37 -> 1.41 tokens per step on code, 1.42 -> 1.46 on summarization).

The pool also takes every n-gram of the prompt at init and of the accepted text each step
(TensorRT-LLM's `LookaheadPoolManager::accept`). It keeps at most G n-grams (N - 1 tokens
after the key) per key, re-inserting an n-gram makes it the newest, and the oldest is evicted
first. Layout, for vocabularies of 10^5 tokens and batches: a hashed table
[B, pool_buckets, G] of (key, n-gram, insertion stamp), bucket = multiplicative hash of the key
token (4096 buckets x G=7 x N=5: 0.7 MB per sequence where a table over a 49152-token vocabulary
would take 6.9 MB). Keys that share a bucket share its G slots (a collision can evict another
key's n-gram early; outputs never change, only how often drafts hit). With pool_buckets >=
the vocabulary and no collisions it is exactly the per-key pool.

Lossless: greedy output equals vanilla greedy decoding. With sampling the `match` rule applies:
every drafted token (window and pool) is a function of the state before the step, independent of
the step's target draws, so following the child that equals the target's draw at each node
samples exactly the target's distribution. The window is updated with argmax predictions (as
hao-ai-lab's sampling mode, TEMP_FOR_GUESS=0), whatever the temperature.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.draft_tree import DraftTree
from specjax.spec_decode import ProposerBase

_HASH = np.uint32(2654435761)  # Knuth's multiplicative hash constant (2^32 / golden ratio)


@struct.dataclass
class NgramPool:
    """Per-sequence n-gram pool: hashed buckets of G (key, n-gram, stamp) slots."""

    keys: jax.Array  # int32[B, H, G], -1 when empty
    ngrams: jax.Array  # int32[B, H, G, N-1]: the tokens after the key
    stamp: jax.Array  # int32[B, H, G]: insertion time, -1 when empty
    clock: jax.Array  # int32[B]: next stamp


@struct.dataclass
class LookaheadState:
    window: jax.Array  # int32[B, N-1, W]: window[k, j] at position pending + j + k
    pool: NgramPool
    updates: jax.Array  # int32[B]: window updates so far
    root: jax.Array  # int32[B]: the pending token of the last propose
    start: jax.Array  # int32[B]: the length at the last propose


def bucket_of(tokens, num_buckets: int):
    """Bucket of each key token: the top log2(num_buckets) bits of token * 2654435761 mod 2^32."""
    bits = int(num_buckets).bit_length() - 1
    if bits == 0:
        return jnp.zeros_like(tokens, dtype=jnp.int32)
    h = tokens.astype(jnp.uint32) * _HASH
    return (h >> np.uint32(32 - bits)).astype(jnp.int32)


def empty_pool(batch: int, num_buckets: int, g: int, ngram_len: int) -> NgramPool:
    return NgramPool(
        keys=jnp.full((batch, num_buckets, g), -1, jnp.int32),
        ngrams=jnp.zeros((batch, num_buckets, g, ngram_len), jnp.int32),
        stamp=jnp.full((batch, num_buckets, g), -1, jnp.int32),
        clock=jnp.zeros((batch,), jnp.int32),
    )


def pool_insert(pool: NgramPool, key, ngram, ok) -> NgramPool:
    """Insert one n-gram per sequence (key [B], ngram [B, N-1]) where ok [B].

    An n-gram already in the pool becomes the newest; otherwise it takes an empty slot of its
    bucket or evicts the oldest.
    """
    b, h, g = pool.keys.shape
    rows = jnp.arange(b)
    bk = bucket_of(key, h)
    keys, grams, stamp = pool.keys[rows, bk], pool.ngrams[rows, bk], pool.stamp[rows, bk]
    same = (keys == key[:, None]) & jnp.all(grams == ngram[:, None, :], axis=-1) & (stamp >= 0)
    slot = jnp.where(jnp.any(same, axis=1), jnp.argmax(same, axis=1), jnp.argmin(stamp, axis=1))
    slot = jnp.where(ok, slot, g)  # g: out of range, dropped
    return NgramPool(
        keys=pool.keys.at[rows, bk, slot].set(key, mode="drop"),
        ngrams=pool.ngrams.at[rows, bk, slot].set(ngram, mode="drop"),
        stamp=pool.stamp.at[rows, bk, slot].set(pool.clock, mode="drop"),
        clock=pool.clock + ok.astype(jnp.int32),
    )


def pool_insert_many(pool: NgramPool, keys, ngrams, ok) -> NgramPool:
    """Insert keys [B, K], ngrams [B, K, N-1] (where ok [B, K]) in order k = 0, 1, ..."""

    def body(i, p):
        return pool_insert(p, keys[:, i], ngrams[:, i], ok[:, i])

    return jax.lax.fori_loop(0, keys.shape[1], body, pool)


def text_ngrams(tokens, end, n: int):
    """(key [B], n-gram [B, n-1]) of the n tokens ending at position end [B] (clipped)."""
    s = tokens.shape[1]
    idx = jnp.clip(end[:, None] - n + 1 + jnp.arange(n)[None, :], 0, s - 1)
    gram = jnp.take_along_axis(tokens, idx, axis=1)
    return gram[:, 0], gram[:, 1:]


def pool_lookup(pool: NgramPool, key):
    """The pool's n-grams for key [B], oldest first: (int32[B, G, N-1], valid bool[B, G])."""
    b, h, g = pool.keys.shape
    rows = jnp.arange(b)
    bk = bucket_of(key, h)
    stamp = pool.stamp[rows, bk]
    hit = (pool.keys[rows, bk] == key[:, None]) & (stamp >= 0)
    order = jnp.argsort(jnp.where(hit, stamp, jnp.iinfo(jnp.int32).max), axis=1)
    grams = jnp.take_along_axis(pool.ngrams[rows, bk], order[:, :, None], axis=1)
    return grams, jnp.take_along_axis(hit, order, axis=1)


def window_topology(w: int, n: int):
    """numpy (parent, depth) of the window's W * (N-1) cells, cell (k, j) at index k * W + j;
    index 0 (level 0 of column 0) is the root."""
    idx = np.arange(w * (n - 1))
    k, j = idx // w, idx % w
    parent = np.where(k == 0, j - 1, (k - 1) * w + j)
    parent[0] = -1
    return parent.astype(np.int32), (k + j).astype(np.int32)


def merge_ngrams(cand, valid):
    """Candidate n-grams [B, G, M] as one packed prefix tree of G * M nodes.

    Returns tokens, parent (-1: the root, else an index into these nodes), depth (1 for an
    n-gram's first token) and valid, each [B, G * M]. Nodes are ordered by depth, then n-gram:
    a node whose prefix an earlier n-gram shares is merged into that n-gram's node.
    """
    b, g, m = cand.shape
    eq = cand[:, :, None, :] == cand[:, None, :, :]  # [B, G, G', M]
    same_prefix = (jnp.cumprod(eq.astype(jnp.int32), axis=-1) > 0) & valid[:, None, :, None]
    rep = jnp.argmax(same_prefix, axis=2)  # [B, G, M]: first n-gram with the same prefix
    keep = valid[:, :, None] & (rep == jnp.arange(g)[None, :, None])
    keep_q = jnp.swapaxes(keep, 1, 2).reshape(b, m * g)  # q = d * G + gram
    pos = jnp.cumsum(keep_q, axis=1) - 1
    rep_q = jnp.swapaxes(rep, 1, 2).reshape(b, m * g)
    d = jnp.repeat(jnp.arange(m), g)[None, :]
    parent_q = jnp.where(d > 0, (d - 1) * g + jnp.roll(rep_q, g, axis=1), 0)
    parent = jnp.where(d > 0, jnp.take_along_axis(pos, parent_q, axis=1), -1)
    dest = jnp.where(keep_q, pos, m * g)
    rows = jnp.arange(b)[:, None]
    tokens_q = jnp.swapaxes(cand, 1, 2).reshape(b, m * g)

    def pack(x, fill):
        return jnp.full((b, m * g), fill, jnp.int32).at[rows, dest].set(x, mode="drop")

    count = jnp.sum(keep_q, axis=1)
    return (
        pack(tokens_q, 0),
        pack(parent, -1),
        pack(jnp.broadcast_to(d + 1, (b, m * g)), 0),
        jnp.arange(m * g)[None, :] < count[:, None],
    )


def lookahead_tree(window, pending, cand, cand_valid, accept_window: bool = False) -> DraftTree:
    """The step's tree: the root and the window's cells (indices < W * (N-1)) then the merged
    verification n-grams. Only the root and the verification branch may be accepted, and with
    accept_window also the window's two chains from the root (column 0's levels and level 0's
    columns), each unless a verification n-gram starts with its first token (that one reaches
    deeper, and of equal siblings acceptance follows the first)."""
    b, levels, w = window.shape
    n = levels + 1
    parent_w, depth_w = window_topology(w, n)
    cells = window.reshape(b, levels * w).at[:, 0].set(pending)
    v_tok, v_par, v_dep, v_ok = merge_ngrams(cand, cand_valid)
    lw = levels * w
    tokens = jnp.concatenate([cells, jnp.where(v_ok, v_tok, 0)], axis=1)
    parent = jnp.concatenate(
        [jnp.broadcast_to(jnp.asarray(parent_w), (b, lw)), jnp.where(v_ok, jnp.where(v_par < 0, 0, v_par + lw), -1)],
        axis=1,
    )
    depth = jnp.concatenate([jnp.broadcast_to(jnp.asarray(depth_w), (b, lw)), v_dep], axis=1)
    valid = jnp.concatenate([jnp.ones((b, lw), bool), v_ok], axis=1)
    win_ok = jnp.zeros((b, lw), bool).at[:, 0].set(True)
    if accept_window:
        idx = np.arange(lw)
        chains = [(idx % w == 0, w)] if levels > 1 else []  # column 0: first cell (1, 0)
        chains += [(idx < w, 1)] if w > 1 else []  # level 0: first cell (0, 1)
        for on, first in chains:
            shared = jnp.any(v_ok & (v_dep == 1) & (v_tok == cells[:, first : first + 1]), axis=1)
            win_ok = win_ok | (jnp.asarray(on)[None, :] & ~shared[:, None])
    acceptable = jnp.concatenate([win_ok, jnp.ones_like(v_ok)], axis=1)
    return DraftTree(
        tokens=tokens.astype(jnp.int32),
        parent=parent.astype(jnp.int32),
        depth=depth.astype(jnp.int32),
        valid=valid,
        acceptable=acceptable,
    )


@dataclasses.dataclass(frozen=True)
class LookaheadProposer(ProposerBase):
    """Lookahead decoding with TensorRT-LLM's (W, N, G): max_window_size, max_ngram_size,
    max_verification_set_size (defaults 7, 5, 7). Needs no parameters (proposer_params=None)."""

    max_window_size: int = 7
    max_ngram_size: int = 5
    max_verification_set_size: int = 7
    pool_buckets: int = 4096
    accept_window: bool = False
    rule: str = "match"
    is_chain: bool = False

    def __post_init__(self):
        w, n, g = self.max_window_size, self.max_ngram_size, self.max_verification_set_size
        if w < 1:
            raise ValueError(f"lookahead window size W must be >= 1, got {w}")
        if n < 2:
            raise ValueError(f"lookahead n-gram size N must be >= 2, got {n}")
        if g < 1:
            raise ValueError(f"lookahead verification set size G must be >= 1, got {g}")
        if self.pool_buckets < 1 or self.pool_buckets & (self.pool_buckets - 1):
            raise ValueError(f"pool_buckets must be a power of two, got {self.pool_buckets}")
        if self.rule != "match":
            raise ValueError("lookahead drafts deterministic candidates: its rule is 'match'")

    @property
    def tree_size(self) -> int:
        """(W + G) * (N - 1): TensorRT-LLM's max_draft_len plus the root."""
        return (self.max_window_size + self.max_verification_set_size) * (self.max_ngram_size - 1)

    @property
    def top_level_nodes(self) -> tuple[int, int]:
        """(first, past-the-last) node of the window's top level, whose argmaxes are the
        window's next iterate."""
        n, w = self.max_ngram_size, self.max_window_size
        return (n - 2) * w, (n - 1) * w

    @property
    def argmax_nodes(self) -> tuple[int, int]:
        """The only nodes whose argmax update() reads (see Proposer)."""
        return self.top_level_nodes

    @property
    def span(self) -> int:
        """Positions past the pending token's that the tree reaches, plus one."""
        return max(self.max_window_size + self.max_ngram_size - 2, self.max_ngram_size)

    def make_pools(self, num_pages, page_size, dtype):
        return None

    def init(self, params, pools, ctx, prompt_chunk, prompt_len):
        b = ctx.tokens.shape[0]
        n, w = self.max_ngram_size, self.max_window_size
        u = jax.random.uniform(jax.random.PRNGKey(0), (b, n - 1, w))
        pick = jnp.floor(u * ctx.lengths[:, None, None]).astype(jnp.int32).reshape(b, -1)
        window = jnp.take_along_axis(ctx.tokens, pick, axis=1).reshape(b, n - 1, w)
        pool = empty_pool(b, self.pool_buckets, self.max_verification_set_size, n - 1)

        def add(p, pool):  # every n-gram of the prompt, in text order
            key, gram = text_ngrams(ctx.tokens, jnp.full((b,), p), n)
            return pool_insert(pool, key, gram, p < ctx.lengths)

        pool = jax.lax.fori_loop(n - 1, jnp.max(ctx.lengths), add, pool)
        zeros = jnp.zeros((b,), jnp.int32)
        return LookaheadState(window, pool, zeros, zeros, ctx.lengths)

    def propose(self, params, state, ctx, keys, sampling):
        rows = jnp.arange(ctx.tokens.shape[0])
        pending = ctx.tokens[rows, ctx.lengths - 1]
        cand, cand_valid = pool_lookup(state.pool, pending)
        tree = lookahead_tree(state.window, pending, cand, cand_valid, self.accept_window)
        return tree, state.replace(root=pending, start=ctx.lengths)

    def update(self, params, state, ctx, result, active):
        b = ctx.tokens.shape[0]
        n, w = self.max_ngram_size, self.max_window_size
        # The target's next iterate at the window's top level.
        lo, hi = self.top_level_nodes
        top = ctx.node_argmax[:, lo:hi]  # [B, W]
        old = state.window.at[:, 0, 0].set(state.root)
        # Column j's n-gram: level 0 (the key), levels 1..N-2, then the new prediction.
        win_keys = old[:, 0, :]
        win_grams = jnp.swapaxes(jnp.concatenate([old[:, 1:], top[:, None]], axis=1), 1, 2)
        win_ok = jnp.broadcast_to((active & (state.updates >= n - 2))[:, None], (b, w))
        # The n-grams ending at each token this step appended (at most N of them).
        ends = state.start[:, None] + jnp.arange(n)[None, :]
        txt = [text_ngrams(ctx.tokens, ends[:, i], n) for i in range(n)]
        txt_keys = jnp.stack([k for k, _ in txt], axis=1)
        txt_grams = jnp.stack([g for _, g in txt], axis=1)
        txt_ok = active[:, None] & (ends < ctx.lengths[:, None]) & (ends >= n - 1)
        pool = pool_insert_many(
            state.pool,
            jnp.concatenate([win_keys, txt_keys], axis=1),
            jnp.concatenate([win_grams, txt_grams], axis=1),
            jnp.concatenate([win_ok, txt_ok], axis=1),
        )
        shifted = jnp.concatenate([state.window[:, 1:], top[:, None]], axis=1)
        window = jnp.where(active[:, None, None], shifted, state.window)
        return state.replace(window=window, pool=pool, updates=state.updates + active)

    def pools_of(self, state):
        return None
