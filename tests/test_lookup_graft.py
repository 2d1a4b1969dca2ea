"""Prompt lookup grafted onto a drafter's tree: the merged trie, and greedy output = vanilla."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_eagle2

from specjax import Engine, ModelConfig, init_params
from specjax.draft_tree import DraftTree
from specjax.proposers import PromptLookupProposer
from specjax.proposers.lookup_graft import LookupGraftProposer, graft_chain
from specjax.proposers.suffix import SuffixProposer
from specjax.spec_decode import ProposerBase

CFG = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=512,
)


def _tree(batch, acceptable=None):
    """root 5 -> 7 (node 1), 8 (node 2); 7 -> 9 (node 3)."""
    rep = lambda x: jnp.asarray([x] * batch)
    return DraftTree(
        tokens=rep([5, 7, 8, 9]),
        parent=rep([-1, 0, 0, 1]),
        depth=rep([0, 1, 1, 2]),
        valid=jnp.ones((batch, 4), bool),
        acceptable=None if acceptable is None else rep(acceptable),
    )


def test_graft_shares_the_tree_prefix_and_hangs_the_rest():
    chain = jnp.asarray([[7, 9, 4, 6], [7, 3, 1, 1], [2, 2, 2, 2], [8, 1, 0, 0], [7, 9, 4, 6]])
    g = graft_chain(_tree(5), chain, jnp.asarray([4, 2, 0, 1, 2]))
    np.testing.assert_array_equal(g.tokens[:, 4:6], [[4, 6], [3, 0], [0, 0], [0, 0], [0, 0]])
    np.testing.assert_array_equal(g.parent[:, 4:6], [[3, 4], [1, -1], [-1, -1], [-1, -1], [-1, -1]])
    np.testing.assert_array_equal(g.depth[:, 4:6], [[3, 4], [2, 0], [0, 0], [0, 0], [0, 0]])
    np.testing.assert_array_equal(
        g.valid[:, 4:], [[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    )
    assert g.tokens.shape == (5, 8) and g.acceptable is None
    np.testing.assert_array_equal(g.tokens[:, :4], _tree(5).tokens)  # the tree is unchanged


def test_graft_width_gives_the_trees_last_nodes_way_to_the_continuation():
    """Within `width` the chain's new nodes displace the tree's last ones, never the shared
    path; steps without a continuation keep the whole tree."""
    chain = jnp.asarray([[2, 3, 4, 1], [7, 9, 4, 6], [7, 3, 1, 1], [2, 2, 2, 2]])
    g = graft_chain(_tree(4), chain, jnp.asarray([3, 4, 2, 0]), width=5)
    np.testing.assert_array_equal(g.tokens[0, :5], [5, 7, 2, 3, 4])  # nodes 2, 3 gave way
    np.testing.assert_array_equal(g.parent[0, :5], [-1, 0, 0, 2, 3])
    np.testing.assert_array_equal(g.depth[0, :5], [0, 1, 1, 2, 3])
    np.testing.assert_array_equal(g.valid[0], [1, 1, 1, 1, 1, 0, 0, 0])
    # shares 7 -> 9 (node 3): the tree up to it stays, the two new nodes go past the width
    np.testing.assert_array_equal(g.tokens[1, :6], [5, 7, 8, 9, 4, 6])
    np.testing.assert_array_equal(g.parent[1, :6], [-1, 0, 0, 1, 3, 4])
    np.testing.assert_array_equal(g.valid[1], [1, 1, 1, 1, 1, 1, 0, 0])
    # shares 7 (node 1), one new node: fits beside the whole tree
    np.testing.assert_array_equal(g.tokens[2, :5], [5, 7, 8, 9, 3])
    np.testing.assert_array_equal(g.parent[2, :5], [-1, 0, 0, 1, 1])
    np.testing.assert_array_equal(g.valid[2], [1, 1, 1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(g.tokens[3, :4], _tree(1).tokens[0])  # no continuation
    np.testing.assert_array_equal(g.valid[3], [1, 1, 1, 1, 0, 0, 0, 0])


def test_graft_hangs_the_continuation_after_the_trees_last_valid_node():
    """A tail a confidence floor dropped is not kept: the continuation follows the last valid
    node, so the verify pass is narrower (with or without a width)."""
    tree = dataclasses.replace(_tree(2), valid=jnp.asarray([[1, 1, 0, 0], [1, 1, 1, 0]], bool))
    chain = jnp.asarray([[2, 3, 4, 0], [7, 9, 4, 0]])
    for width in (None, 8):
        g = graft_chain(tree, chain, jnp.asarray([3, 3]), width=width)
        np.testing.assert_array_equal(g.tokens[0, :5], [5, 7, 2, 3, 4])
        np.testing.assert_array_equal(g.parent[0, :5], [-1, 0, 0, 2, 3])
        np.testing.assert_array_equal(g.valid[0], [1, 1, 1, 1, 1, 0, 0, 0])
        # 7 is shared; 9 (node 3) was dropped, so the chain's 9 and 4 hang from 7 after node 2
        np.testing.assert_array_equal(g.tokens[1, :5], [5, 7, 8, 9, 4])
        np.testing.assert_array_equal(g.parent[1, :5], [-1, 0, 0, 1, 3])
        np.testing.assert_array_equal(g.valid[1], [1, 1, 1, 1, 1, 0, 0, 0])


def test_grafted_paths_are_no_longer_than_max_path_len():
    """commit and update read max_path_len path nodes: no grafted node may sit deeper, whatever
    the chain shares with the tree (random chains over the tree's tokens, with and without a
    width)."""

    class Base(ProposerBase):  # the tree of `_tree`: its longest root path is 5 -> 7 -> 9
        tree_size, max_path_len, rule = 4, 3, "match"

    rng = np.random.default_rng(0)
    for k in (1, 2, 4, 6):
        graft = LookupGraftProposer(Base(), PromptLookupProposer(k, 3, 1))
        assert graft.max_path_len == max(3, k + 1)
        chain = jnp.asarray(rng.choice([7, 8, 9, 3], size=(64, k)))
        count = jnp.asarray(rng.integers(0, k + 1, size=64))
        for width in (None, 4):
            g = graft_chain(_tree(64), chain, count, width=width)
            deepest = np.where(np.asarray(g.valid), np.asarray(g.depth), 0).max()
            assert deepest + 1 <= graft.max_path_len
        assert deepest + 1 == graft.max_path_len  # the bound is reached


def test_a_graft_width_cuts_greedy_trees_and_never_drawn_ones():
    """Under a rule that draws its trees when sampling, the width cuts the tree's last nodes in
    greedy steps only; a sampled step verifies the drawn tree whole plus the chain."""
    from specjax.sampling import SamplingConfig
    from specjax.spec_decode import SpecContext

    @dataclasses.dataclass(frozen=True)
    class Base(ProposerBase):  # the tree of `_tree`, whatever the sampling
        tree_size: int = 4
        max_path_len: int = 3
        rule: str = "recursive"
        rules: tuple = ("match", "recursive")

        def propose(self, params, state, ctx, keys, sampling):
            return _tree(ctx.tokens.shape[0]), state

    tokens = jnp.asarray([[20, 21, 22, 23, 24, 20, 21, 0, 0, 0, 0, 0]])  # "20 21" again: 22 23 24 follow
    ctx = SpecContext(tokens, jnp.asarray([7]), jnp.zeros((1, 4), jnp.int32))
    graft = LookupGraftProposer(Base(), PromptLookupProposer(3, 2, 2), width=5)
    kept = {}
    for greedy in (True, False):
        sampling = SamplingConfig() if greedy else SamplingConfig(temperature=1.0)
        tree, _ = graft.propose(None, (), ctx, jnp.zeros((1, 2), jnp.uint32), sampling)
        kept[greedy] = np.asarray(tree.tokens[0])[np.asarray(tree.valid[0])].tolist()
    assert kept[True] == [5, 7, 22, 23, 24]  # two tree nodes give way: 5 wide
    assert kept[False] == [5, 7, 8, 9, 22, 23, 24]  # the drawn tree whole


def test_graft_never_shares_nodes_acceptance_may_not_follow():
    """A node acceptance skips (Lookahead's window) is not a prefix of the grafted chain."""
    g = graft_chain(_tree(1, acceptable=[True, False, True, True]), jnp.asarray([[7, 9]]), jnp.asarray([2]))
    np.testing.assert_array_equal(g.parent[0, 4:], [0, 4])
    np.testing.assert_array_equal(g.acceptable[0], [1, 0, 1, 1, 1, 1])


@pytest.fixture(scope="module")
def target():
    return init_params(CFG, jax.random.PRNGKey(0), scale=0.5)


def test_grafted_eagle2_greedy_equals_vanilla_and_accepts_more(target):
    prompts = [[3, 9, 27, 17, 3, 9, 27, 17, 3, 9], [5, 6, 7, 8, 5, 6], [1, 2]]
    base, params = random_eagle2(CFG, target)
    eng = Engine(target, CFG, num_pages=256, page_size=4)
    vanilla = eng.generate(prompts, 40, eos_token_ids=())
    alone = eng.generate(prompts, 40, eos_token_ids=(), proposer=base, proposer_params=params, fixed_speculation=True)
    graft = LookupGraftProposer(base, PromptLookupProposer(6, 3, 1))
    assert graft.tree_size == 11 and graft.draft_scratch == base.draft_scratch
    assert graft.likely_widths == (base.tree_size,)  # no continuation: the tree's own width
    # commit and update read only this many path nodes: the continuation's depth, not the tree's
    assert base.max_path_len == 4 and graft.max_path_len == 7
    both = eng.generate(prompts, 40, eos_token_ids=(), proposer=graft, proposer_params=params, fixed_speculation=True)
    assert both.token_ids == vanilla.token_ids == alone.token_ids
    # the random target falls into loops that lookup finds and the random draft does not
    assert sum(both.steps) < sum(alone.steps)
    narrow = LookupGraftProposer(base, PromptLookupProposer(6, 3, 1), width=6)
    assert narrow.likely_widths == (base.tree_size, 6)
    within = eng.generate(
        prompts, 40, eos_token_ids=(), proposer=narrow, proposer_params=params, fixed_speculation=True
    )
    assert within.token_ids == vanilla.token_ids and sum(within.steps) < sum(alone.steps)
    # suffix decoding's most frequent continuation as the grafted chain
    chain = LookupGraftProposer(base, SuffixProposer(max_nodes=7, is_chain=True))
    assert chain.tree_size == 11 and chain.max_path_len == 7
    both = eng.generate(prompts, 40, eos_token_ids=(), proposer=chain, proposer_params=params, fixed_speculation=True)
    assert both.token_ids == vanilla.token_ids and sum(both.steps) < sum(alone.steps)
    # with a cache of earlier outputs: a second run of the same prompts drafts from the first's
    from specjax.proposers.suffix_cache import SuffixCache

    cached = dataclasses.replace(chain, lookup_params=True)
    kw = dict(eos_token_ids=(), proposer=cached, fixed_speculation=True)
    kw["proposer_params"] = {"base": params, "lookup": SuffixCache(8, 4096)}
    cold, warm = (eng.generate(prompts, 40, **kw) for _ in range(2))
    assert cold.token_ids == warm.token_ids == vanilla.token_ids and sum(warm.steps) < sum(cold.steps)


def test_graft_refuses_lossy_rules_and_bad_options(target):
    from specjax.loading import Model
    from specjax.methods import MethodError, make_proposer
    from specjax.proposers.medusa import MedusaProposer

    base, _ = random_eagle2(CFG, target)
    with pytest.raises(ValueError, match="`match`, `recursive` or `traversal` rule, not 'typical'"):
        LookupGraftProposer(MedusaProposer(vocab_size=CFG.vocab_size, posterior_threshold=0.09))
    with pytest.raises(ValueError, match="match, recursive or traversal rule, not 'residual'"):
        dataclasses.replace(base, rule="residual")
    with pytest.raises(ValueError, match="width must be at least 2"):
        LookupGraftProposer(base, width=1)
    model = Model(params=target, config=CFG, path=None, hf_config={})
    with pytest.raises(MethodError, match="not pld"):
        make_proposer("pld", model, lookup_tokens=4)
    with pytest.raises(MethodError, match="--lookup-tokens must be >= 1, got 0"):
        make_proposer("eagle2", model, lookup_tokens=0, heads="unused")
    with pytest.raises(MethodError, match="--lookup-width applies with --lookup-tokens"):
        make_proposer("eagle2", model, lookup_width=8, heads="unused")
