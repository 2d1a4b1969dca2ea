"""DFlash drafting: one forward of a block drafter gives every draft position at once.

Each step the drafter (`dflash_net`) reads the block [pending token, mask x (K - 1)] at the
positions from the pending token's on, with the context of the target's fused features of every
earlier token in its cache, and gives K - 1 distributions, one per position after the pending
token, all in one pass (z-lab/dflash's `spec_generate`). `update` then writes the features of the
tokens the step accepted (the pending token and the accepted drafts, the verify pass's hidden
states along the accepted path) into the draft context.

Two ways to turn the block into a draft:
- chain (default): the argmax of each position (greedy; `match` when sampling with
  acceptance="match"), or, when sampling, a draw from each position's distribution q_i after the
  request's temperature/top-k/top-p, verified by the `residual` rule (accept x_i with
  min(1, p_i(x_i) / q_i(x_i)), else draw from the normalized max(0, p_i - q_i)), the reference's
  `_rejection_sample`. That rule is exact when each draft is drawn from its q_i given everything
  before it; here q_i depends on the context alone, not on the drafts before it (the block is all
  mask tokens), so drawing the positions independently satisfies it as it stands.
- tree (`tree_budget` N nodes, DDTree, arXiv 2604.12989): the N - 1 most probable prefixes under
  the product of the positions' distributions, found best first: a node at depth d holds the
  r-th best token of position d; popping the best frontier entry adds it to the tree and pushes
  its next sibling (rank r + 1) and its first child (rank 0 at depth d + 1), so nodes come out in
  decreasing score, parents before children. The tree is a deterministic function of the
  context, so `match` (the target's own draw must equal a child) keeps output exact, greedy or
  sampled.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from specjax.cache import PagedKVCache, init_pages
from specjax.cpu.top_k import top_log_probs
from specjax.draft_tree import DraftTree, chain
from specjax.model_config import ModelConfig
from specjax.proposers.dflash_net import dflash_block, dflash_fuse, dflash_logits, write_context
from specjax.sampling import argmax_last, categorical, processed_logprobs
from specjax.spec_decode import ProposerBase


@struct.dataclass
class DFlashState:
    """The draft context's per-layer pools and how many positions they hold (= length - 1)."""

    k_pages: list
    v_pages: list
    lengths: jax.Array

    def cache(self, block_tables) -> PagedKVCache:
        return PagedKVCache(self.k_pages, self.v_pages, block_tables, self.lengths)


def best_first_tree(top_logp, top_ids, budget: int):
    """(tokens, parent, depth, valid) [budget] of the best-first tree over one sequence's
    per-position top-k (log-probs [D, k] best first, ids [D, k]); node 0 is the root (token 0)."""
    depths, k = top_logp.shape
    n, f = budget, 2 * budget
    neg = jnp.float32(-jnp.inf)
    tok = jnp.zeros((n,), jnp.int32)
    par = jnp.full((n,), -1, jnp.int32)
    dep = jnp.zeros((n,), jnp.int32)
    score = jnp.zeros((n,), jnp.float32)
    ok = jnp.zeros((n,), bool).at[0].set(True)
    # frontier: score, parent node, depth (1-based), rank of the candidate
    fs = jnp.full((f,), neg).at[0].set(top_logp[0, 0])
    fp = jnp.zeros((f,), jnp.int32)
    fd = jnp.ones((f,), jnp.int32)
    fr = jnp.zeros((f,), jnp.int32)

    def body(i, carry):
        tok, par, dep, score, ok, fs, fp, fd, fr = carry
        j = jnp.argmax(fs)
        s, p, d, r = fs[j], fp[j], fd[j], fr[j]
        real = s > neg
        tok = tok.at[i].set(jnp.where(real, top_ids[d - 1, r], 0))
        par = par.at[i].set(jnp.where(real, p, 0))
        dep = dep.at[i].set(jnp.where(real, d, 1))
        score = score.at[i].set(s)
        ok = ok.at[i].set(real)
        fs = fs.at[j].set(neg)
        sib = jnp.where(real & (r + 1 < k), score[p] + top_logp[d - 1, jnp.minimum(r + 1, k - 1)], neg)
        kid = jnp.where(real & (d < depths), s + top_logp[jnp.minimum(d, depths - 1), 0], neg)
        a, c = 2 * i - 1, 2 * i
        fs = fs.at[a].set(sib).at[c].set(kid)
        fp = fp.at[a].set(p).at[c].set(i)
        fd = fd.at[a].set(d).at[c].set(d + 1)
        fr = fr.at[a].set(r + 1).at[c].set(0)
        return tok, par, dep, score, ok, fs, fp, fd, fr

    tok, par, dep, _, ok, *_ = jax.lax.fori_loop(1, n, body, (tok, par, dep, score, ok, fs, fp, fd, fr))
    return tok, par, dep, ok


@dataclasses.dataclass(frozen=True)
class DFlashProposer(ProposerBase):
    """DFlash over a drafter `config` reading `target_layers`; params {"net", "embed", "lm_head"}."""

    config: ModelConfig  # the drafter's (its layers; hidden size and vocabulary of the target)
    target_layers: tuple = ()
    mask_token_id: int = 0
    block_size: int = 16  # K: the pending token and K - 1 drafted positions
    tree_budget: int | None = None  # None: a chain of K - 1 drafts; else a best-first tree of N nodes
    top_k: int = 8  # tree: candidates per position
    acceptance: str | None = None  # when sampling: residual (chains of drawn drafts; the chains'
    # default) or match (argmax chains; trees)
    needs_prompt_features: bool = True
    # update() writes the context from the root's position whatever propose() wrote
    propose_may_be_skipped = True
    splits_draft_layers = False

    def __post_init__(self):
        if self.block_size < 2:
            raise ValueError(
                f"the DFlash block holds the pending token and drafts: block_size >= 2, got {self.block_size}"
            )
        if not self.target_layers:
            raise ValueError("DFlash reads at least one target layer")
        if self.tree_budget is not None:
            if self.tree_budget < 2:
                raise ValueError(f"a DFlash tree holds the root and drafts: tree_budget >= 2, got {self.tree_budget}")
            if self.top_k < 1:
                raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.rule not in self.rules:
            kind = "chains" if self.is_chain else "trees"
            raise ValueError(f"DFlash {kind} verify with the {' or '.join(self.rules)} rule, not {self.rule!r}")

    @property
    def is_chain(self) -> bool:
        return self.tree_budget is None

    @property
    def rules(self) -> tuple[str, ...]:
        return ("residual", "match") if self.is_chain else ("match",)

    @property
    def rule(self) -> str:
        return self.acceptance or self.rules[0]

    @property
    def feature_layers(self) -> tuple:
        return tuple(self.target_layers)

    @property
    def tree_size(self) -> int:
        return self.block_size if self.is_chain else self.tree_budget

    @property
    def max_path_len(self) -> int:
        return self.block_size if self.is_chain else min(self.block_size, self.tree_budget)

    @property
    def draft_scratch(self) -> int:
        """The block's keys sit at the K slots from the pending token's position."""
        return self.block_size

    def make_pools(self, num_pages, page_size, dtype):
        return init_pages(self.config, num_pages, page_size, dtype)

    def init(self, params, pools, ctx, prompt_chunk, prompt_len):
        b, w = prompt_chunk.shape
        cache = PagedKVCache(pools[0], pools[1], ctx.block_tables, jnp.zeros((b,), jnp.int32))
        positions = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))
        context = dflash_fuse(params["net"], self.config, ctx.prompt_hidden)
        cache = write_context(params["net"], self.config, cache, context, positions, positions < prompt_len[:, None])
        return DFlashState(cache.k_pages, cache.v_pages, prompt_len)

    def block_logits(self, params, state: DFlashState, ctx):
        """(logits [B, K - 1, V] of the drafted positions, the pools with the block's keys)."""
        b = ctx.tokens.shape[0]
        pending = ctx.tokens[jnp.arange(b), ctx.lengths - 1]
        masks = jnp.full((b, self.block_size - 1), self.mask_token_id, jnp.int32)
        block = jnp.concatenate([pending[:, None], masks], axis=1)
        positions = (ctx.lengths - 1)[:, None] + jnp.arange(self.block_size, dtype=jnp.int32)[None, :]
        hidden, cache = dflash_block(
            params["net"], self.config, params["embed"], state.cache(ctx.block_tables), block, positions
        )
        return dflash_logits(params["lm_head"], hidden[:, 1:]), state.replace(
            k_pages=cache.k_pages, v_pages=cache.v_pages
        )

    def propose(self, params, state: DFlashState, ctx, keys, sampling):
        b = ctx.tokens.shape[0]
        pending = ctx.tokens[jnp.arange(b), ctx.lengths - 1]
        logits, state = self.block_logits(params, state, ctx)
        k = self.block_size - 1
        if not self.is_chain:
            logp, ids = top_log_probs(logits, min(self.top_k, logits.shape[-1]))
            tok, par, dep, ok = jax.vmap(lambda lp, i: best_first_tree(lp, i, self.tree_budget))(logp, ids)
            tok = tok.at[:, 0].set(pending)
            return DraftTree(tokens=tok, parent=par, depth=dep, valid=ok), state
        num = jnp.full((b,), k, jnp.int32)
        if sampling.greedy or self.rule == "match":
            return chain(pending, argmax_last(logits), num), state
        logq = processed_logprobs(logits, sampling)
        step_keys = jax.vmap(lambda key: jax.random.split(key, k))(keys)
        drafts = jax.vmap(jax.vmap(categorical))(step_keys, logq)
        return chain(pending, drafts, num, logq), state

    def update(self, params, state: DFlashState, ctx, result, active):
        t = result.path.shape[1]
        start = state.lengths  # the root's position
        d = jnp.arange(t, dtype=jnp.int32)[None, :]
        valid = (d <= result.n_accepted[:, None]) & active[:, None]
        context = dflash_fuse(params["net"], self.config, ctx.path_hidden)
        cache = write_context(
            params["net"], self.config, state.cache(ctx.block_tables), context, start[:, None] + d, valid
        )
        lengths = jnp.where(active, start + result.n_accepted + 1, start)
        return DFlashState(cache.k_pages, cache.v_pages, lengths)

    def pools_of(self, state: DFlashState):
        return (state.k_pages, state.v_pages)
