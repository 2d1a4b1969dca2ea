"""Suffix decoding: the trees it drafts (counts, best first, budgets, one tree per match length)
and, end to end, greedy output equal to vanilla decoding's."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax.generate import Engine
from specjax.methods import make_proposer
from specjax.model import init_params
from specjax.model_config import ModelConfig
from specjax.proposers.suffix import SuffixProposer, match_lengths, suffix_tree

CFG = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=256,
)

# "1 2" is followed by 9 twice and by 8 once; the text ends in "1 2" (pending 2).
TEXT = [5, 1, 2, 9, 7, 6, 1, 2, 8, 7, 4, 1, 2, 9, 3, 3, 1, 2]


def tree_of(text, width=24, **options):
    options = {
        "max_nodes": 8,
        "max_match": 8,
        "max_occurrences": 8,
        "max_tree_depth": 24,
        "max_spec_factor": 1.0,
        "max_spec_offset": 0.0,
        "min_token_prob": 0.1,
        **options,
    }
    tokens = jnp.asarray([text + [0] * (width - len(text))], jnp.int32)
    tree = suffix_tree(tokens, jnp.asarray([len(text)]), **options)
    valid = np.asarray(tree.valid[0])
    return [
        (int(tok), int(par), int(dep))
        for tok, par, dep, ok in zip(tree.tokens[0], tree.parent[0], tree.depth[0], valid)
        if ok
    ]


@pytest.fixture(scope="module")
def tiny_model():
    import jax

    return init_params(CFG, jax.random.PRNGKey(0)), CFG


def test_match_lengths_count_the_last_tokens_ending_at_each_position():
    got = np.asarray(match_lengths(jnp.asarray([TEXT]), jnp.asarray([len(TEXT)]), 4))[0]
    want = np.zeros(len(TEXT), int)
    want[[2, 7, 12]] = 2  # "1 2" ends there ("3 1 2" nowhere before the end)
    assert got.tolist() == want.tolist()  # the pending token's own position counts nothing


def test_the_tree_holds_the_most_frequent_continuations_best_first():
    # match "1 2" (3 occurrences): 9 (2 of 3), 8 (1 of 3); under 9: 7 and 3; under 8: 7
    assert tree_of(TEXT, max_spec_factor=1.0) == [(2, -1, 0), (9, 0, 1), (8, 0, 1)]  # 2 nodes for m = 2
    four = tree_of(TEXT, max_spec_factor=2.0)
    assert four[:3] == [(2, -1, 0), (9, 0, 1), (8, 0, 1)] and len(four) == 5
    assert all(dep == 2 and par in (1, 2) for _, par, dep in four[3:])
    assert tree_of(TEXT, max_spec_factor=0.0, max_spec_offset=1.0) == [(2, -1, 0), (9, 0, 1)]
    assert tree_of(TEXT, max_spec_factor=3.0, min_token_prob=0.5) == [(2, -1, 0), (9, 0, 1)]  # 8: 1/3
    # depth 3 leaves m = 2 one token deep (score 2/3 + 1/3) and m = 1 two (one more node): m = 1 wins
    shallow = tree_of(TEXT, max_spec_factor=3.0, max_tree_depth=3)
    assert shallow[:3] == [(2, -1, 0), (9, 0, 1), (8, 0, 1)] and len(shallow) == 4 and shallow[3][2] == 2


def test_a_longer_match_drafts_more_and_is_chosen_when_it_scores_as_well():
    text = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4, 1, 2, 3]  # "4 1 2 3" once, then 5 1 2 3 4 ...
    tree = tree_of(text, max_spec_factor=1.0)
    assert [tok for tok, _, _ in tree] == [3, 5, 1, 2, 3, 4, 1, 2]  # m = 7: a chain of 7
    assert [par for _, par, _ in tree] == list(range(-1, 7))
    assert tree_of([7, 8, 9], max_spec_factor=4.0) == [(9, -1, 0)]  # nothing matched: the root alone


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=2, max_size=40), st.floats(0.0, 3.0), st.sampled_from([0.0, 0.2]))
def test_every_tree_is_a_tree_of_continuations_seen_in_the_text(text, factor, floor):
    tree = tree_of(text, width=48, max_spec_factor=factor, min_token_prob=floor)
    assert tree[0] == (text[-1], -1, 0)
    paths = {0: [text[-1]]}
    for i, (tok, par, dep) in enumerate(tree[1:], 1):
        assert 0 <= par < i and dep == len(paths[par])  # parents first, depth = parent's + 1
        paths[i] = paths[par] + [tok]
    for i in list(paths)[1:]:  # each drafted path (pending token first) occurs starting earlier
        p = paths[i]
        assert any(text[j : j + len(p)] == p for j in range(min(len(text) - len(p) + 1, len(text) - 1))), (text, p)
    siblings = [(par, tok) for tok, par, _ in tree[1:]]
    assert len(siblings) == len(set(siblings))  # no token twice under one parent


def test_greedy_output_equals_vanilla_with_fewer_target_passes(tiny_model):
    params, cfg = tiny_model
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 1, 5, 3, 1, 4, 1, 5], [7, 7, 7, 7, 7, 7], [5, 6, 8, 2, 5, 6, 8]]
    eng = Engine(params, cfg, num_pages=64, page_size=8)
    vanilla = eng.generate(prompts, 24, eos_token_ids=())
    for proposer in (SuffixProposer(), SuffixProposer(max_nodes=12, max_spec_factor=3.0, min_token_prob=0.0)):
        out = eng.generate(prompts, 24, eos_token_ids=(), proposer=proposer)
        assert out.token_ids == vanilla.token_ids
    assert sum(out.steps) < sum(map(len, out.token_ids))  # drafts were accepted


def test_the_method_and_its_options(tiny_model):
    from specjax.loading import Model
    from specjax.method_configs import MethodError

    params, cfg = tiny_model
    model = Model(params, cfg, None, cfg.to_hf())
    proposer, pparams = make_proposer("suffix", model, suffix_max_draft_tokens=5, suffix_decoding_max_spec_factor=2)
    assert pparams is None and proposer.tree_size == 6 and proposer.max_spec_factor == 2.0
    with pytest.raises(MethodError, match="--suffix-decoding-min-token-prob must be in \\[0, 1\\]"):
        make_proposer("suffix", model, suffix_decoding_min_token_prob=1.5)
