"""One speculative step as a pure function, and the jitted loop that repeats it.

spec_step: propose -> verify -> accept -> commit -> update, for a whole batch, each sequence
accepting its own number of tokens. Proposers (`specjax.proposers`: Draft-Target, Prompt-Lookup,
Medusa, EAGLE-1/2/3, ReDrafter, Lookahead, the prompt-lookup graft) implement `Proposer`; their
parameters travel as a separate pytree.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import struct

from specjax.accept import AcceptResult, accept, accept_draws
from specjax.attention import attention_mesh
from specjax.batching import DecodeState, append_until_stop
from specjax.commit import commit
from specjax.decoding import decode_step, decode_step_with_features
from specjax.draft_tree import DraftTree
from specjax.model_config import ModelConfig
from specjax.sampling import SamplingConfig, argmax_last
from specjax.sharding import pinning
from specjax.verify import verify_pruned_kv


@struct.dataclass
class SpecContext:
    """What a proposer may read each step."""

    tokens: jax.Array  # int32[B, S]: prompt and generated tokens
    lengths: jax.Array  # int32[B]: tokens so far; tokens[length - 1] is pending
    block_tables: jax.Array  # int32[B, pages_per_seq], shared with any draft cache
    # Target final hidden state [B, D] of the token that predicted the pending token (the
    # features Medusa, EAGLE and ReDrafter draft from).
    hidden: jax.Array | None = None
    # In update(): the target's hidden states [B, T, D] of the accepted path's nodes (by depth).
    path_hidden: jax.Array | None = None
    # In init(): the target's hidden states [B, W, D] of the prompt's positions prompt_start ..
    # prompt_start + W - 1 (prefix reuse is off for proposers that set `needs_prompt_features`,
    # unless they set `resumes_from_prefix_pairs`).
    prompt_hidden: jax.Array | None = None
    # In init(): int32[B], the first prompt position init() must process (None: 0); the ones
    # before it come from shared prefix pages (`resumes_from_prefix_pairs`).
    prompt_start: jax.Array | None = None
    # In update(): the target's greedy choice (argmax) int32[B, T] at every node of the verified
    # tree (Lookahead reads its Jacobi window's next iterate from it; 0 past verify's width and,
    # when sampling, outside the proposer's `argmax_nodes`).
    node_argmax: jax.Array | None = None


class Proposer(Protocol):
    """The protocol every drafting method implements (a hashable, static object). Its optional
    parts have defaults in `ProposerBase`, which every proposer derives from."""

    tree_size: int  # T, nodes per draft tree (root included)
    is_chain: bool  # trees are chains (commit needs no K/V moves)
    rule: str  # when sampling: "match", "residual", "recursive", "traversal" or "typical"

    def make_pools(self, num_pages: int, page_size: int, dtype) -> Any:
        """Device buffers the proposer keeps across calls (a draft KV pool), or None."""

    def init(self, params, pools, ctx: SpecContext, prompt_chunk, prompt_len) -> Any:
        """State after the target's prefill; prompt_chunk [B, W] holds tokens[:, :length-1]."""

    def propose(self, params, state, ctx: SpecContext, keys, sampling: SamplingConfig) -> tuple[DraftTree, Any]:
        """A draft tree per sequence (node 0 = pending token) and the new state."""

    def update(self, params, state, ctx: SpecContext, result: AcceptResult, active) -> Any:
        """State after acceptance; ctx already holds the accepted tokens."""

    def pools_of(self, state) -> Any:
        """The buffers of `make_pools`, handed back to the engine after the loop."""


class ProposerBase:
    """Defaults of the `Proposer` protocol's optional parts: a proposer overrides what it needs
    (as a dataclass field or a property), and the step reads each as a plain attribute."""

    @property
    def rule_options(self) -> dict:
        """Keyword arguments of the acceptance rule (Medusa's typical acceptance)."""
        return {}

    @property
    def rules(self) -> tuple[str, ...]:
        """The sampling rules this kind of proposer drafts for (its `rule` is one of them)."""
        return (self.rule,)

    # init() reads every prompt token's features (prefix reuse is then off)
    needs_prompt_features: bool = False
    # init() can start at ctx.prompt_start over a draft cache paged like the target's, whose
    # entry at position i depends on the tokens up to i + 1 alone (EAGLE's (feature_i,
    # token_i+1) pairs): a server may then share prefix pages keyed by token pairs
    # (`cache.token_pairs`), the draft entries in them included
    resumes_from_prefix_pairs: bool = False
    # target layers whose concatenated outputs replace the final hidden state as features
    feature_layers: tuple = ()
    # update() keeps the state right after a step whose propose() did not run (a tree of the
    # root alone verified): a server may then skip drafting when it verifies nothing drafted
    propose_may_be_skipped: bool = False
    # the proposer keeps no state and reads only the tokens (Prompt-Lookup, suffix decoding): a
    # step that drafts nothing may be vanilla's own decode step, ~4% cheaper than a spec step
    # verifying the root alone (16 rows on a 2-core CPU)
    plain_step_is_vanilla: bool = False
    # update() may wait while steps draft nothing: record() stores what it needs of a plain
    # decode step (EAGLE: the target's features at the decoded position) and propose() first
    # catches up on it in wide passes. A budget's width 1 is then vanilla's decode step plus
    # that store, not a spec step updating the drafter token by token (+8-10% at 16 rows)
    defers_update: bool = False
    # the step is vanilla's decode step plus record() (`recorded_decode_step`): a budget's
    # width 1 of a drafter that defers_update
    plain_decode: bool = False
    # the draft network's decoder config (None: none), and whether sharding may split its
    # layers over tensor-parallel devices like the target's (else they stay replicated)
    config = None
    splits_draft_layers: bool = True

    def record(self, params, state, block_tables, positions, features, active):
        """State after a plain decode step that read `positions` (int32[B]) and gave the target
        `features` [B, F] there (proposers that set `defers_update`)."""
        raise NotImplementedError(f"{type(self).__name__} does not defer its update")

    @property
    def draft_scratch(self) -> int:
        """Cache slots past the committed tokens the proposer writes, when more than tree_size."""
        return 0

    @property
    def likely_widths(self) -> tuple[int, ...]:
        """Numbers of leading nodes that are often the only valid ones, verified at exactly
        that width (`verify_pruned`)."""
        return ()

    @property
    def max_path_len(self) -> int:
        """Nodes on the longest root path any tree may have, root included: commit and update
        read only that many (a wrapper that lengthens paths must say its own)."""
        return self.tree_size

    @property
    def argmax_nodes(self) -> tuple[int, int] | None:
        """(lo, hi): the only nodes whose `SpecContext.node_argmax` update() reads, so sampled
        steps take the argmax of those rows alone (None: every node)."""
        return None


def contract_members() -> tuple[str, ...]:
    """Every member of the proposer contract: the `Proposer` protocol's and the optional parts
    `ProposerBase` gives defaults for."""
    protocol = [*Proposer.__annotations__, *(n for n in vars(Proposer) if not n.startswith("_"))]
    optional = [n for n in vars(ProposerBase) if not n.startswith("_")]
    return tuple(dict.fromkeys(protocol + optional))


class ProposerWrapper(ProposerBase):
    """A proposer around another one, its `base` (a dataclass field of the subclass): every
    contract member the wrapper does not define itself is the base's, so no member silently
    takes `ProposerBase`'s default, and a member added to the contract is forwarded too."""


def _forwarded(name: str) -> property:
    return property(lambda self: getattr(self.base, name), doc=f"The base proposer's `{name}`.")


for _name in contract_members():
    setattr(ProposerWrapper, _name, _forwarded(_name))


class StatelessProposer(ProposerBase):
    """The Proposer methods of a drafter that keeps no buffers and no state between steps
    (Prompt-Lookup, an oracle): subclasses write only `propose`."""

    propose_may_be_skipped = True
    plain_step_is_vanilla = True

    def make_pools(self, num_pages, page_size, dtype):
        return None

    def init(self, params, pools, ctx, prompt_chunk, prompt_len):
        return ()

    def update(self, params, state, ctx, result, active):
        return state

    def pools_of(self, state):
        return None


@struct.dataclass
class SpecState(DecodeState):
    """Loop carry of speculative decoding: the vanilla loop's, plus what drafting reads."""

    features: jax.Array  # float[B, D]: see SpecContext.hidden
    proposer_state: Any
    accepted_hist: jax.Array  # int32[B, T]: steps that accepted exactly k drafted tokens


def scratch_slots(proposer) -> int:
    """Cache slots past each sequence's tokens a speculative step may write (1 for vanilla)."""
    if proposer is None:
        return 1
    return max(proposer.tree_size, proposer.draft_scratch)


def _step_keys(keys, lengths, salt: int):
    return jax.vmap(lambda k, n: jax.random.fold_in(jax.random.fold_in(k, n), salt))(keys, lengths)


def nodes_argmax(proposer, logits):
    """SpecContext.node_argmax from verify's logits [B, T, V]: the argmax of the nodes the
    proposer's update reads (`argmax_nodes`, default every node), 0 elsewhere."""
    lo, hi = proposer.argmax_nodes or (0, logits.shape[1])
    return jnp.zeros(logits.shape[:2], jnp.int32).at[:, lo:hi].set(argmax_last(logits[:, lo:hi]))


def appended_tokens(tree: DraftTree, result: AcceptResult):
    """int32[B, T]: the accepted drafted tokens then the next token (first n + 1 entries)."""
    t = tree.size
    d = jnp.arange(t)[None, :]
    follow = jnp.take_along_axis(result.path, jnp.minimum(d + 1, t - 1), axis=1)
    drafted = jnp.take_along_axis(tree.tokens, follow, axis=1)
    return jnp.where(d < result.n_accepted[:, None], drafted, result.next_token[:, None])


def spec_step(
    params,
    config: ModelConfig,
    proposer: Proposer,
    proposer_params,
    sampling: SamplingConfig,
    state: SpecState,
    max_new_tokens,
    eos_ids,
) -> SpecState:
    """One speculative step for every unfinished sequence."""
    if proposer.plain_decode:
        return recorded_decode_step(params, config, proposer, proposer_params, sampling, state, max_new_tokens, eos_ids)
    b = state.tokens.shape[0]
    active = ~state.done
    ctx = SpecContext(state.tokens, state.lengths, state.cache.block_tables, state.features)
    # The scopes name each phase's ops in profiles (benchmarks/profile_step.py).
    with jax.named_scope("propose"):
        tree, pstate = proposer.propose(
            proposer_params, state.proposer_state, ctx, _step_keys(state.keys, state.lengths, 1), sampling
        )
    with jax.named_scope("verify"):
        # greedy: each node's argmax, taken inside the verify pass over the nodes it verifies
        scores, hidden, cache, new_kv = verify_pruned_kv(
            params,
            config,
            state.cache,
            tree,
            proposer.feature_layers,
            proposer.likely_widths,
            greedy_draws=sampling.greedy,
        )
    with jax.named_scope("accept"):
        if sampling.greedy:
            result, node_argmax = accept_draws(tree, scores), scores
        else:
            result = accept(
                tree, scores, _step_keys(state.keys, state.lengths, 2), sampling, proposer.rule, **proposer.rule_options
            )
            node_argmax = nodes_argmax(proposer, scores)  # left out by XLA unless read
    # No accepted path runs deeper than the proposer's trees: the phases below read that many.
    path = result.path[:, : min(proposer.max_path_len, tree.size)]
    with jax.named_scope("commit"):
        cache = commit(cache, path, result.n_accepted, active, is_chain=proposer.is_chain, new_kv=new_kv)

    # Append up to n + 1 tokens, stopping after EOS and at max_new_tokens.
    new = appended_tokens(tree, result)
    tokens, lengths, done = append_until_stop(state, new, result.n_accepted + 1, max_new_tokens, eos_ids)

    # The deepest accepted node predicted the new pending token: its features drive the next draft.
    best = jnp.take_along_axis(result.path, result.n_accepted[:, None], axis=1)[:, 0]
    best_hidden = jnp.take_along_axis(hidden, best[:, None, None], axis=1)[:, 0]
    features = jnp.where(active[:, None], best_hidden.astype(state.features.dtype), state.features)
    path_hidden = jnp.take_along_axis(hidden, path[:, :, None], axis=1)
    new_ctx = SpecContext(tokens, lengths, cache.block_tables, features, path_hidden, node_argmax=node_argmax)
    with jax.named_scope("update"):
        pstate = proposer.update(proposer_params, pstate, new_ctx, result.replace(path=path), active)
    hist = state.accepted_hist.at[jnp.arange(b), result.n_accepted].add(active.astype(jnp.int32))
    return state.replace(
        tokens=tokens,
        lengths=lengths,
        done=done,
        steps=state.steps + active,
        cache=cache,
        features=features,
        proposer_state=pstate,
        accepted_hist=hist,
    )


def recorded_decode_step(
    params, config: ModelConfig, proposer, proposer_params, sampling: SamplingConfig, state: SpecState, limits, eos_ids
) -> SpecState:
    """A step that drafts nothing, for a drafter that `defers_update`: vanilla's decode step,
    its features at the pending token handed to `record` (the drafter catches up when it
    drafts again), the step counted as one that accepted no drafted token."""
    active = ~state.done
    new, hidden = decode_step_with_features(params, config, sampling, state, limits, eos_ids, proposer.feature_layers)
    features = jnp.where(active[:, None], hidden.astype(state.features.dtype), state.features)
    pstate = proposer.record(
        proposer_params, state.proposer_state, state.cache.block_tables, state.lengths - 1, features, active
    )
    hist = state.accepted_hist.at[:, 0].add(active.astype(jnp.int32))
    return new.replace(features=features, proposer_state=pstate, accepted_hist=hist)


@functools.partial(jax.jit, static_argnames=("config", "proposer", "mesh"), donate_argnames=("state",))
def spec_loop(
    params,
    config: ModelConfig,
    proposer: Proposer,
    proposer_params,
    sampling: SamplingConfig,
    state: SpecState,
    max_new_tokens,
    eos_ids,
    mesh=None,
) -> SpecState:
    """spec_step until every sequence hit EOS or max_new_tokens, in one `lax.while_loop`; with
    a `mesh` the carry (cache, proposer state) stays pinned to its shardings."""
    pin = pinning(mesh, state.tokens.shape[0])
    with attention_mesh(mesh):
        return pin(
            jax.lax.while_loop(
                lambda st: jnp.any(~st.done),
                lambda st: pin(
                    spec_step(params, config, proposer, proposer_params, sampling, st, max_new_tokens, eos_ids)
                ),
                pin(state),
            )
        )


@functools.partial(jax.jit, static_argnames=("config", "proposer", "mesh"), donate_argnames=("state",))
def advance(params, config, proposer, proposer_params, sampling, state, limits, eos_ids, refill, max_steps, mesh=None):
    """Up to `max_steps` (int32, traced: every bound shares one program) steps of every
    unfinished slot, stopping after the step in which the `refill`-th slot (int32) finished.
    limits: int32[B], each slot's max_new_tokens. With a `mesh` the state stays pinned to its
    shardings, as in the engine's loops."""
    pin = pinning(mesh, state.tokens.shape[0])
    done_before = jnp.sum(state.done)

    def go_on(carry):
        i, st = carry
        return (i < max_steps) & jnp.any(~st.done) & (jnp.sum(st.done) - done_before < refill)

    def step(carry):
        i, st = carry
        if proposer is None:
            return i + 1, pin(decode_step(params, config, sampling, st, limits, eos_ids))
        return i + 1, pin(spec_step(params, config, proposer, proposer_params, sampling, st, limits, eos_ids))

    with attention_mesh(mesh):
        return pin(jax.lax.while_loop(go_on, step, (jnp.int32(0), pin(state)))[1])


@functools.partial(jax.jit, static_argnames=("proposer", "mesh"), donate_argnames=("pools",))
def init_proposer(proposer: Proposer, proposer_params, pools, ctx: SpecContext, prompt_chunk, prompt_len, mesh=None):
    """The proposer's state after prefill (jitted once per shape)."""
    pin = pinning(mesh, prompt_chunk.shape[0])
    with attention_mesh(mesh):
        return pin(proposer.init(proposer_params, pools, pin(ctx), prompt_chunk, prompt_len))
