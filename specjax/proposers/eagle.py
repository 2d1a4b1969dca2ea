"""EAGLE drafting: a small draft network extrapolates the target's features.

The draft cache holds one entry per position t: the pair (target feature of token t, token t+1).
After each step `update` rewrites the accepted positions with the target's TRUE features (the
verify pass's hidden states along the accepted path), so drafting always starts from exact
features; the draft output of the last pair predicts the first drafted token of the next step.
While a budget runs plain decode steps (width 1), the update waits: `record` stores the target's
features per position in a paged pool beside the draft cache, and the next `propose` first runs
the recorded pairs through the network in wide passes (`_caught_up`, as `init` runs a prompt's),
so a plain step costs vanilla's decode step and the drafts are those of a token-by-token update.

Three ways to draft from that state, verified with the lossless `match` rule (the candidates are
the draft's top tokens, a deterministic function of the context); when sampling, EAGLE-2/3 under
the `recursive` rule draw their trees from the draft instead (`_propose_sampled`):
- `EagleChainProposer`: the draft's top-1 token, `max_draft_len` times.
- `EagleTreeProposer` (EAGLE-1): a static tree of top-k ranks (`eagle_choices`, Medusa's format),
  drafted depth by depth.
- `EagleDynamicProposer` (EAGLE-2, and EAGLE-3 with its network): each depth, the `top_k` nodes
  of highest cumulative draft log-probability are expanded by their `top_k` best tokens; at the end
  the `total_tokens - 1` best of all candidates form the tree (SafeAILab/EAGLE's topK_generate).

`min_prob` drops the nodes whose cumulative draft probability is below it: on a CPU a verify
pass costs more the more tokens it holds (docs/benchmarks.md, "What one verify pass costs"), so
a step whose drafts are unlikely to pass runs narrower (`verify_pruned`), down to a plain decode
step, like Hugging Face's `assistant_confidence_threshold`. EAGLE-2 orders its nodes best
first, so the kept ones are a prefix of the tree. The floor cuts top-k trees (greedy decoding,
`match`); trees drawn for `recursive` are verified whole, since cutting a drawn node by its
probability would make its presence depend on its token.

Tree nodes drafted over several calls sit in draft-cache scratch slots after the committed pairs;
each call attends to its ancestors there through a mask over those slots.
`net` is the draft network, chosen once: `EagleNet` (EAGLE-1/2: fc over [embedding; feature],
the target's lm_head, or its rows of frequent tokens with params["draft_ids"]) or `Eagle3Net`
(three fused target layers, own reduced-vocabulary lm_head).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.cache import PagedKVCache, init_pages, slot_address
from specjax.cpu.top_k import top_log_probs
from specjax.draft_tree import (
    DRAWN_RULES,
    TREE_RULES,
    DraftTree,
    chain,
    check_confidence_floor,
    check_recursive_tree,
    drawn_static_tree,
    on_vocabulary,
    reaches_floor,
    static_draft_tree,
    static_tree,
)
from specjax.model import causal_mask
from specjax.model_config import ModelConfig
from specjax.proposers.eagle3_net import Eagle3Net
from specjax.proposers.eagle_net import EagleNet
from specjax.sampling import gumbel_top_k, processed_logprobs
from specjax.spec_decode import ProposerBase

# SafeAILab/EAGLE's default static tree (eagle/model/choices.py, "mc_sim_7b_63"): 25 nodes, depth 5.
EAGLE_DEFAULT_TREE = (
    (0,),
    (1,),
    (2,),
    (3,),
    (0, 0),
    (0, 1),
    (0, 2),
    (1, 0),
    (1, 1),
    (2, 0),
    (2, 1),
    (3, 0),
    (0, 0, 0),
    (0, 0, 1),
    (0, 0, 2),
    (0, 1, 0),
    (0, 1, 1),
    (0, 2, 0),
    (0, 2, 1),
    (1, 0, 0),
    (0, 0, 0, 0),
    (0, 0, 0, 1),
    (0, 0, 0, 2),
    (0, 0, 0, 0, 0),
    (0, 0, 0, 0, 1),
)


@struct.dataclass
class EagleState:
    k_pages: list
    v_pages: list
    lengths: jax.Array  # the draft cache holds pairs for positions < lengths (<= length - 1)
    next_hidden: jax.Array  # [B, D] draft output of the last pair: predicts the first draft
    # [num_pages + 1, page_size, D], paged like the caches: the target's features (as the
    # network reads them) that plain decode steps recorded at positions >= lengths
    feature_pages: jax.Array

    def cache(self, block_tables) -> PagedKVCache:
        return PagedKVCache(self.k_pages, self.v_pages, block_tables, self.lengths)


@dataclasses.dataclass(frozen=True)
class _EagleBase(ProposerBase):
    """State keeping shared by the EAGLE proposers; params: {"net", "embed", "lm_head"}."""

    # update() rewrites the draft cache from the root's position whatever propose() wrote
    propose_may_be_skipped = True

    config: ModelConfig  # the draft network's (hidden size and heads of the target, few layers)
    net: EagleNet | Eagle3Net = EagleNet()  # the network, chosen once (EAGLE-1/2's or EAGLE-3's)
    rule: str = "match"
    rules = ("match",)  # the lossless rules its trees are drawn for
    needs_prompt_features: bool = True
    resumes_from_prefix_pairs: bool = True
    min_prob: float = 0.0  # top-k trees: verify only drafts of cumulative probability >= this
    # plain decode steps record the target's features (`record`); propose() first runs the
    # recorded pairs through the network, CATCH_UP positions per row per pass
    defers_update = True
    CATCH_UP = 16

    @property
    def feature_layers(self) -> tuple:
        return self.net.feature_layers

    @property
    def splits_draft_layers(self) -> bool:
        return self.net.splits_layers

    @property
    def likely_widths(self) -> tuple[int, ...]:
        """Under a confidence floor a tree keeps a prefix of any length, so every width is
        verified as it is (`verify_pruned`): a step pays only for the nodes it kept."""
        return tuple(range(2, self.tree_size)) if self.min_prob > 0 else ()

    def __post_init__(self):
        check_confidence_floor(self.min_prob)
        if self.rule not in self.rules:
            names = ", ".join(self.rules[:-1]) + " or " * (len(self.rules) > 1) + self.rules[-1]
            raise ValueError(f"this EAGLE proposer verifies with the {names} rule, not {self.rule!r}")

    def _forward(self, params, cache, tokens, features, positions, mask, valid, slots=None):
        return self.net.forward(params, self.config, tokens, features, positions, cache, mask, valid, slots=slots)

    def _target_features(self, params, features):
        """The target's features as the draft reads them (EAGLE-3 fuses its three layers)."""
        return self.net.fuse(params, features)

    def _top(self, params, hidden, k: int):
        """(log-probs, target token ids) of the draft's k best tokens after each hidden state."""
        rows = self.net.vocab_rows(params)
        if k > rows:
            raise ValueError(f"the tree asks for the draft's top {k} tokens but its vocabulary has {rows}")
        logp, ids = top_log_probs(self.net.logits(params, self.config, hidden), k)
        return logp, self.net.target_ids(params, ids).astype(jnp.int32)

    def _draft_logprobs(self, params, hidden, sampling):
        """(log q [.., R] over the draft's vocabulary after the request's temperature/top-k/
        top-p, the target ids of its R tokens): the distribution the `recursive` rule draws
        children from."""
        logits = self.net.logits(params, self.config, hidden)
        ids = self.net.target_ids(params, jnp.arange(logits.shape[-1]))
        return processed_logprobs(logits, sampling), ids.astype(jnp.int32)

    def make_pools(self, num_pages, page_size, dtype):
        k, v = init_pages(self.config, num_pages, page_size, dtype)
        return k, v, jnp.zeros((num_pages + 1, page_size, self.config.hidden_size), dtype)

    def _run_chain(self, params, cache, tokens, features, start, valid):
        b, t = tokens.shape
        positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        return self._forward(params, cache, tokens, features, positions, causal_mask(b, t), valid)

    def init(self, params, pools, ctx, prompt_chunk, prompt_len):
        b, w = prompt_chunk.shape
        start = jnp.zeros((b,), jnp.int32) if ctx.prompt_start is None else ctx.prompt_start
        rows = jnp.arange(b)[:, None]
        idx = jnp.arange(w)[None, :]
        nxt = ctx.tokens[rows, jnp.clip(start[:, None] + idx + 1, 0, ctx.tokens.shape[1] - 1)]  # t + 1
        count = prompt_len - start  # pairs to run; those before `start` are in shared pages
        valid = idx < count[:, None]
        cache = PagedKVCache(pools[0], pools[1], ctx.block_tables, start)
        feats = self._target_features(params, ctx.prompt_hidden)
        h, cache = self._run_chain(params, cache, nxt, feats, start, valid)
        last = jnp.take_along_axis(h, jnp.maximum(count - 1, 0)[:, None, None], axis=1)[:, 0]
        return EagleState(cache.k_pages, cache.v_pages, prompt_len, last, pools[2])

    def record(self, params, state: EagleState, block_tables, positions, features, active):
        """The features of a plain decode step's position, stored for `_caught_up` (inactive
        rows write to the sink page); the draft cache and `lengths` stay where they were."""
        page, slot = slot_address(block_tables, positions[:, None], state.feature_pages.shape[1])
        page = jnp.where(active[:, None], page, state.feature_pages.shape[0] - 1)
        feats = self._target_features(params, features[:, None]).astype(state.feature_pages.dtype)
        return state.replace(feature_pages=state.feature_pages.at[page, slot].set(feats))

    def _caught_up(self, params, state: EagleState, ctx):
        """The state with every pair up to the pending token in the draft cache: the pairs that
        plain decode steps recorded run through the network CATCH_UP positions per row per
        pass, as init() runs a prompt's (no pass at all when nothing was recorded)."""
        b, c = ctx.tokens.shape[0], self.CATCH_UP
        target = ctx.lengths - 1
        rows, idx = jnp.arange(b)[:, None], jnp.arange(c)[None, :]

        def run(st):
            count = jnp.clip(target - st.lengths, 0, c)
            pos = st.lengths[:, None] + idx
            page, slot = slot_address(ctx.block_tables, pos, st.feature_pages.shape[1])
            tok = ctx.tokens[rows, jnp.clip(pos + 1, 0, ctx.tokens.shape[1] - 1)]
            valid = idx < count[:, None]
            feats = st.feature_pages[page, slot]
            h, cache = self._run_chain(params, st.cache(ctx.block_tables), tok, feats, st.lengths, valid)
            last = jnp.take_along_axis(h, jnp.maximum(count - 1, 0)[:, None, None], axis=1)[:, 0]
            return st.replace(
                k_pages=cache.k_pages,
                v_pages=cache.v_pages,
                lengths=st.lengths + count,
                next_hidden=jnp.where((count > 0)[:, None], last, st.next_hidden),
            )

        return jax.lax.while_loop(lambda st: jnp.any(st.lengths < target), run, state)

    def propose(self, params, state: EagleState, ctx, keys, sampling):
        return self._propose(params, self._caught_up(params, state, ctx), ctx, keys, sampling)

    def update(self, params, state: EagleState, ctx, result, active):
        b, t = result.path.shape
        start = state.lengths  # = length at propose - 1: the root's position
        rows = jnp.arange(b)[:, None]
        d = jnp.arange(t)[None, :]
        tok = ctx.tokens[rows, jnp.clip(start[:, None] + 1 + d, 0, ctx.tokens.shape[1] - 1)]
        valid = (d <= result.n_accepted[:, None]) & active[:, None]
        cache = state.cache(ctx.block_tables)
        feats = self._target_features(params, ctx.path_hidden)
        h, cache = self._run_chain(params, cache, tok, feats, start, valid)
        last = jnp.take_along_axis(h, result.n_accepted[:, None, None], axis=1)[:, 0]
        return state.replace(
            k_pages=cache.k_pages,
            v_pages=cache.v_pages,
            lengths=jnp.where(active, start + result.n_accepted + 1, start),
            next_hidden=jnp.where(active[:, None], last, state.next_hidden),
        )

    def pools_of(self, state: EagleState):
        return (state.k_pages, state.v_pages, state.feature_pages)

    @staticmethod
    def _pending(ctx):
        b = ctx.tokens.shape[0]
        return ctx.tokens[jnp.arange(b), ctx.lengths - 1]


@dataclasses.dataclass(frozen=True)
class EagleChainProposer(_EagleBase):
    """EAGLE with chain drafts of `max_draft_len` top-1 tokens."""

    max_draft_len: int = 4
    is_chain: bool = True

    @property
    def tree_size(self) -> int:
        return self.max_draft_len + 1

    def _propose(self, params, state: EagleState, ctx, keys, sampling):
        b = ctx.tokens.shape[0]
        logp0, first = (x[:, 0] for x in self._top(params, state.next_hidden, 1))
        one = jnp.ones((b, 1), bool)

        def step(carry, _):
            cache, h, tok = carry
            out, cache = self._run_chain(params, cache, tok[:, None], h[:, None], cache.lengths, one)
            cache = cache.replace(lengths=cache.lengths + 1)
            logp, nxt = (x[:, 0] for x in self._top(params, out[:, 0], 1))
            return (cache, out[:, 0], nxt), (nxt, logp)

        (cache, _, _), (rest, rest_logp) = jax.lax.scan(
            step, (state.cache(ctx.block_tables), state.next_hidden, first), None, length=self.max_draft_len - 1
        )
        drafts = jnp.concatenate([first[:, None], jnp.moveaxis(rest, 0, 1)], axis=1)
        num = jnp.full((b,), self.max_draft_len, jnp.int32)
        if self.min_prob > 0:  # the chain's prefix whose cumulative probability reaches it
            score = jnp.cumsum(jnp.concatenate([logp0[:, None], jnp.moveaxis(rest_logp, 0, 1)], axis=1), axis=1)
            num = jnp.sum(reaches_floor(score, self.min_prob), axis=1).astype(jnp.int32)
        tree = chain(self._pending(ctx), drafts, num)
        # The scratch pairs past `lengths` are rewritten by update(); lengths stay.
        return tree, state.replace(k_pages=cache.k_pages, v_pages=cache.v_pages)


@dataclasses.dataclass(frozen=True)
class EagleTreeProposer(_EagleBase):
    """EAGLE-1: a static tree; node i at depth d holds the rank[i]-th best draft token after its
    parent. `eagle_choices` lists the nodes as paths of ranks (SafeAILab's / Medusa's format)."""

    eagle_choices: tuple = EAGLE_DEFAULT_TREE
    is_chain: bool = False
    rules = TREE_RULES  # recursive, traversal: trees drawn from q when sampling

    def __post_init__(self):
        super().__post_init__()
        from specjax.proposers.medusa import expand_choices

        object.__setattr__(self, "eagle_choices", expand_choices(self.eagle_choices))
        if self.rule in DRAWN_RULES:
            check_recursive_tree(self.eagle_choices)

    @property
    def tree_size(self) -> int:
        return len(self.eagle_choices) + 1

    @property
    def max_path_len(self) -> int:
        """Nodes on the longest root path (the root included)."""
        return max(len(c) for c in self.eagle_choices) + 1

    def _topology(self):
        parent, depth, rank = static_tree(self.eagle_choices)
        t = len(parent)
        anc = np.eye(t, dtype=bool)
        for i in range(1, t):
            anc[i] |= anc[parent[i]]
        return parent, depth, rank, anc

    def _propose(self, params, state: EagleState, ctx, keys, sampling):
        """Under the `recursive` rule when sampling, rank r is the r-th draw without replacement
        from the draft's (processed) q after the parent, each parent with its own key."""
        parent, depth, rank, anc = self._topology()
        drawn = self.rule in DRAWN_RULES and not sampling.greedy
        b, t = ctx.tokens.shape[0], self.tree_size
        max_rank = int(rank.max()) + 1
        cache = state.cache(ctx.block_tables)
        tokens = jnp.zeros((b, t), jnp.int32).at[:, 0].set(self._pending(ctx))
        hidden = jnp.zeros((b, t) + state.next_hidden.shape[1:], state.next_hidden.dtype)
        hidden = hidden.at[:, 0].set(state.next_hidden)  # root: the draft output predicting it
        score = jnp.zeros((b, t), jnp.float32)  # cumulative draft log-prob of each node's path
        real, logq = [], []  # drawn trees, depth by depth: real draws, the q each was drawn from
        # Node i (i >= 1) is drafted into scratch slot lengths + i - 1; depth d's nodes run once
        # their tokens are known, so their children can be read off their outputs.
        for d in range(1, int(depth.max()) + 1):
            nodes = np.flatnonzero(depth == d)
            parents, at = np.unique(parent[nodes], return_inverse=True)
            pick = (slice(None), at, rank[nodes])
            if drawn:
                lq, to_target = self._draft_logprobs(params, hidden[:, parents], sampling)
                ids, g = gumbel_top_k(
                    jax.vmap(lambda k, d=d, n=len(parents): jax.random.split(jax.random.fold_in(k, d), n))(keys),
                    lq,
                    max_rank,
                )  # [B, parents, R]
                tokens = tokens.at[:, nodes].set(to_target[ids[pick]])
                real.append(g[pick] > -jnp.inf)
                logq.append(on_vocabulary(lq, to_target, params["embed"].shape[0])[:, at])
            else:
                logp, top = self._top(params, hidden[:, parents], max_rank)  # [B, parents, R]
                tokens = tokens.at[:, nodes].set(top[pick])
                score = score.at[:, nodes].set(score[:, parent[nodes]] + logp[pick])
            if not np.isin(nodes, parent).any():
                continue  # leaves: no children to draft from them
            slots = cache.lengths[:, None] + jnp.asarray(nodes - 1, jnp.int32)[None, :]
            mask = jnp.broadcast_to(jnp.asarray(anc[nodes][:, 1:]), (b, len(nodes), t - 1))
            positions = jnp.broadcast_to(cache.lengths[:, None] + d - 1, (b, len(nodes)))
            h, cache = self._forward(
                params,
                cache,
                tokens[:, nodes],
                hidden[:, parent[nodes]],
                positions,
                mask,
                jnp.ones((b, len(nodes)), bool),
                slots,
            )
            hidden = hidden.at[:, nodes].set(h)
        state = state.replace(k_pages=cache.k_pages, v_pages=cache.v_pages)
        if drawn:  # depths are runs of consecutive nodes, in order
            return drawn_static_tree(
                tokens[:, 0], parent, depth, tokens[:, 1:], jnp.concatenate(real, 1), jnp.concatenate(logq, 1)
            ), state
        # A child never scores above its parent, so the kept nodes' paths are kept too.
        valid = jnp.ones((b, t), bool)
        if self.min_prob > 0:
            valid = reaches_floor(score, self.min_prob)
        return static_draft_tree(tokens, parent, depth, valid), state


@dataclasses.dataclass(frozen=True)
class EagleDynamicProposer(_EagleBase):
    """EAGLE-2 dynamic trees (SafeAILab's names and defaults): `depth` expansion passes after the
    first, so paths hold up to depth + 1 drafted tokens; `top_k` children per expanded node and
    `top_k` expanded nodes per depth; the `total_tokens - 1` best candidates are verified."""

    total_tokens: int = 63
    depth: int = 5
    top_k: int = 8
    is_chain: bool = False
    rules = TREE_RULES  # recursive, traversal: trees drawn from q when sampling

    def __post_init__(self):
        super().__post_init__()
        if self.top_k < 1 or self.depth < 0 or self.total_tokens < 2:
            raise ValueError("EAGLE-2 needs top_k >= 1, depth >= 0 and total_tokens >= 2")
        if self.rule == "traversal" and not self.traversal_fits(self.total_tokens, self.top_k):
            raise ValueError(
                "traversal acceptance needs drawn trees whose shape is fixed: total_tokens - 1 "
                f"<= top_k + 1 = {self.top_k + 1}, or top_k = 1 (wider beams past depth 1 "
                "make one subtree's shape depend on another's draws)"
            )
        if self.rule in DRAWN_RULES and not self.recursive_fits(self.total_tokens, self.depth, self.top_k):
            raise ValueError(
                "recursive acceptance verifies beams of top_k nodes per depth: it needs "
                f"total_tokens - 1 <= top_k * (depth + 1) = "
                f"{self.top_k * (self.depth + 1)}"
            )
        if self.total_tokens - 1 > self.num_candidates:
            raise ValueError(
                f"total_tokens={self.total_tokens} exceeds the {self.num_candidates} candidates "
                f"that depth={self.depth} and top_k={self.top_k} draft (plus the root)"
            )

    @property
    def tree_size(self) -> int:
        return self.total_tokens

    @property
    def max_path_len(self) -> int:
        """Nodes on the longest root path: the root and up to depth + 1 drafted tokens."""
        return min(self.depth + 2, self.total_tokens)

    @property
    def num_candidates(self) -> int:
        return self.top_k + self.depth * self.top_k**2

    @property
    def draft_scratch(self) -> int:
        """Draft-cache slots past the committed pairs that one proposal writes."""
        return max(self.depth * self.top_k, 1)

    @staticmethod
    def recursive_fits(total_tokens: int, depth: int, top_k: int) -> bool:
        """Whether such a tree can be drawn for the `recursive` rule: its nodes fit beams of
        top_k per depth."""
        return total_tokens - 1 <= top_k * (depth + 1)

    @staticmethod
    def traversal_fits(total_tokens: int, top_k: int) -> bool:
        """Whether the drawn tree's shape is fixed, as the `traversal` rule needs: past the
        first depth's beam only the best node's first draw is kept (its value is the beam's
        best), or the beams are single nodes (a chain)."""
        return top_k == 1 or total_tokens - 1 <= top_k + 1

    @property
    def levels(self) -> int:
        """Depths of drafted nodes under the `recursive` rule: beams of top_k nodes each."""
        return -(-(self.total_tokens - 1) // self.top_k)

    def _run_beam(self, params, cache, beam, i):
        """The draft over depth i's beam (`top_k` nodes: tokens, their parents' outputs, their
        ancestors among the scratch slots), written into scratch slots i * top_k and on: the
        nodes' outputs, the cache and the nodes' ancestor masks (themselves included)."""
        b, k, j_all = beam["anc"].shape
        col = i * k + jnp.arange(k)
        mask = beam["anc"] | jnp.zeros((k, j_all), bool).at[jnp.arange(k), col].set(True)[None]
        slots = cache.lengths[:, None] + col[None, :]
        positions = jnp.broadcast_to((cache.lengths + i)[:, None], (b, k))
        h, cache = self._forward(
            params, cache, beam["tok"], beam["feat"], positions, mask, jnp.ones((b, k), bool), slots
        )
        return h, cache, mask

    def _propose(self, params, state: EagleState, ctx, keys, sampling):
        if self.rule in DRAWN_RULES and not sampling.greedy:
            return self._propose_sampled(params, state, ctx, keys, sampling)
        b, k = ctx.tokens.shape[0], self.top_k
        j_all = max(self.depth * k, 1)
        cache = state.cache(ctx.block_tables)
        rows = jnp.arange(b)[:, None]
        score0, tok0 = self._top(params, state.next_hidden, k)  # [B, K]
        frontier = dict(
            tok=tok0, score=score0, cand=jnp.broadcast_to(jnp.arange(k), (b, k)), **_first_beam(state, k, j_all)
        )

        def expand(carry, i):
            cache, f = carry
            h, cache, mask = self._run_beam(params, cache, f, i)
            logp, tok = self._top(params, h, k)  # [B, K, K]
            cs = (f["score"][:, :, None] + logp).reshape(b, k * k)
            tok = tok.reshape(b, k * k)
            par = jnp.broadcast_to(f["cand"][:, :, None], (b, k, k)).reshape(b, k * k)
            best = jax.lax.top_k(cs, k)[1]  # the next frontier
            src = best // k
            nf = dict(
                tok=tok[rows, best],
                score=cs[rows, best],
                cand=k + i * k * k + best,
                feat=h[rows, src],
                anc=mask[rows, src],
            )
            return (cache, nf), (tok, cs, par)

        (cache, _), (tok_l, cs_l, par_l) = jax.lax.scan(expand, (cache, frontier), jnp.arange(self.depth))
        # Candidates in layer order, so every parent precedes its children.
        flat = lambda x: jnp.moveaxis(x, 0, 1).reshape(b, -1)
        c_tok = jnp.concatenate([tok0, flat(tok_l)], axis=1)
        c_score = jnp.concatenate([score0, flat(cs_l)], axis=1)
        c_par = jnp.concatenate([jnp.full((b, k), -1, jnp.int32), flat(par_l)], axis=1)
        layer = np.concatenate([np.ones(k, np.int32)] + [np.full(k * k, i + 2, np.int32) for i in range(self.depth)])
        tree = _select(
            c_tok, c_score, c_par, jnp.asarray(layer), self.total_tokens - 1, self._pending(ctx), self.min_prob
        )
        return tree, state.replace(k_pages=cache.k_pages, v_pages=cache.v_pages)

    def _propose_sampled(self, params, state: EagleState, ctx, keys, sampling):
        """A tree for the `recursive` rule: each beam node's `top_k` children are drawn without
        replacement from the draft's (processed) distribution q (Gumbel-top-k), and each depth
        keeps the `top_k` children of highest perturbed path log-probability (stochastic beam
        search's Gumbel values, Kool et al. 2019, in place of EAGLE-2's cumulative q). The
        tree is the beams depth by depth, cut to `total_tokens - 1` nodes.

        Why this shape is lossless: the rule needs a node's children to be draws in order whose
        presence in the tree never depends on which token was drawn. A child's perturbed value
        is independent of its token given the draws before it (the Gumbel-max property), so
        choosing by those values (and cutting whole depths) keeps that; choosing by q of the
        drawn tokens, or a global choice across depths, would not."""
        b, k = ctx.tokens.shape[0], self.top_k
        passes = self.levels - 1
        j_all = max(passes * k, 1)
        cache = state.cache(ctx.block_tables)
        rows = jnp.arange(b)[:, None]
        level_keys = jax.vmap(lambda key: jax.random.split(key, self.levels))(keys)

        def children(key, logq, phi, g):
            """Gumbel-top-k children of n nodes (logq [B, n, R], their path log-prob phi and
            value g [B, n]): draft-vocabulary ids, path log-probs and values [B, n, k]."""
            ids, top = gumbel_top_k(key, logq, k)
            top = phi[..., None] + top  # perturbed path log-probs, the largest first
            return (
                ids,
                phi[..., None] + jnp.take_along_axis(logq, ids, -1),
                _truncated_gumbel(g[..., None], top, top[..., :1]),
            )

        logq0, to_target = self._draft_logprobs(params, state.next_hidden[:, None], sampling)
        vocab = params["embed"].shape[0]
        zero = jnp.zeros((b, 1), jnp.float32)
        ids, phi, g = (x[:, 0] for x in children(level_keys[:, 0], logq0, zero, zero))
        tok = to_target[ids]
        first = dict(
            tok=tok, phi=phi, g=g, node=1 + jnp.broadcast_to(jnp.arange(k), (b, k)), **_first_beam(state, k, j_all)
        )
        level = dict(
            tok=tok,
            parent=jnp.zeros((b, k), jnp.int32),
            g=g,
            logq=jnp.broadcast_to(on_vocabulary(logq0, to_target, vocab), (b, k, vocab)),
        )

        def expand(carry, i):
            cache, f = carry
            h, cache, mask = self._run_beam(params, cache, f, i)
            logq = self._draft_logprobs(params, h, sampling)[0]  # [B, K, R]
            ids, phi, g = (x.reshape(b, k * k) for x in children(level_keys[:, i + 1], logq, f["phi"], f["g"]))
            tok = to_target[ids]
            best = jax.lax.top_k(g, k)[1]  # the next beam, siblings in their draw order
            src = best // k
            nf = dict(
                tok=tok[rows, best],
                phi=phi[rows, best],
                g=g[rows, best],
                node=1 + (i + 1) * k + jnp.broadcast_to(jnp.arange(k), (b, k)),
                feat=h[rows, src],
                anc=mask[rows, src],
            )
            out = dict(
                tok=nf["tok"],
                parent=f["node"][rows, src],
                g=nf["g"],
                logq=on_vocabulary(logq[rows, src], to_target, vocab),
            )
            return (cache, nf), out

        (cache, _), deeper = jax.lax.scan(expand, (cache, first), jnp.arange(passes))
        n = self.total_tokens - 1
        flat = lambda x, y: jnp.concatenate([x, jnp.moveaxis(y, 0, 1).reshape((b, -1) + x.shape[2:])], axis=1)[:, :n]
        tok, parent, g, logq = (flat(level[key], deeper[key]) for key in ("tok", "parent", "g", "logq"))
        depth = np.repeat(np.arange(1, self.levels + 1, dtype=np.int32), k)[:n]
        valid = jnp.concatenate([jnp.ones((b, 1), bool), g > -jnp.inf], axis=1)
        tree = DraftTree(
            tokens=jnp.concatenate([self._pending(ctx)[:, None], jnp.where(g > -jnp.inf, tok, 0)], axis=1),
            parent=jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), parent], axis=1),
            depth=jnp.broadcast_to(jnp.asarray(np.concatenate([[0], depth])), (b, n + 1)),
            valid=valid,
            draft_logprobs=jnp.concatenate([jnp.zeros_like(logq[:, :1]), logq], axis=1),
        )
        return tree, state.replace(k_pages=cache.k_pages, v_pages=cache.v_pages)


def _first_beam(state: EagleState, k: int, j_all: int) -> dict:
    """What the first beam's k nodes share: the root's draft output, no scratch ancestors."""
    b = state.next_hidden.shape[0]
    return dict(
        feat=jnp.broadcast_to(state.next_hidden[:, None], (b, k) + state.next_hidden.shape[1:]),
        anc=jnp.zeros((b, k, j_all), bool),
    )


def _truncated_gumbel(g_parent, perturbed, z):
    """Stochastic beam search's child values: Gumbels of location phi_child conditioned on
    their maximum being the parent's value g_parent (Kool et al. 2019, appendix B, in its
    numerically stable form); `perturbed` = phi_child + Gumbel noise, z = its maximum."""
    drawn = perturbed > -jnp.inf  # else a token of no probability (or under such a parent)
    x = jnp.where(drawn, perturbed - z, -1.0)  # <= 0
    log1mexp = jnp.where(x > -0.693, jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))
    v = jnp.where(drawn, g_parent - perturbed + log1mexp, 0.0)
    return jnp.where(drawn, g_parent - jax.nn.relu(v) - jnp.log1p(jnp.exp(-jnp.abs(v))), -jnp.inf)


def _select(c_tok, c_score, c_par, c_depth, n: int, pending, min_prob: float = 0.0) -> DraftTree:
    """The tree of the n best candidates (by cumulative log-prob) under the pending token, best
    first; with min_prob > 0 only those of probability >= min_prob are valid (a prefix).

    Candidates come in layer order (parents first); a child never scores above its parent, and
    top_k prefers lower indices on ties, so a chosen node's parent is chosen too and comes before
    it: nodes whose parent is missing are nonetheless marked invalid rather than trusted.
    """
    b, c = c_tok.shape
    rows = jnp.arange(b)[:, None]
    best, chosen = jax.lax.top_k(c_score, n)  # [B, n] candidate ids, best first
    node_of = jnp.full((b, c), -1, jnp.int32).at[rows, chosen].set(jnp.arange(1, n + 1, dtype=jnp.int32))
    par_cand = c_par[rows, chosen]
    par_node = jnp.where(par_cand < 0, 0, node_of[rows, jnp.maximum(par_cand, 0)])
    ok = par_node >= 0
    if min_prob > 0:
        ok &= reaches_floor(best, min_prob)
    valid = jnp.concatenate([jnp.ones((b, 1), bool), ok], axis=1)
    parent = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), jnp.maximum(par_node, 0)], axis=1)

    def walk(i, ok):  # a node is valid only when its whole root path is
        return ok.at[:, i].set(ok[:, i] & ok[jnp.arange(b), parent[:, i]])

    valid = jax.lax.fori_loop(1, n + 1, walk, valid)
    tokens = jnp.concatenate([pending[:, None], c_tok[rows, chosen]], axis=1).astype(jnp.int32)
    depth = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jnp.broadcast_to(c_depth, (b, c))[rows, chosen]], axis=1)
    return DraftTree(
        tokens=jnp.where(valid, tokens, 0),
        parent=jnp.where(valid, parent, -1).at[:, 0].set(-1),
        depth=depth,
        valid=valid,
    )
