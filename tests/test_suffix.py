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
from specjax.proposers.suffix_cache import SuffixCache, cached_continuations

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
    assert isinstance(pparams, SuffixCache) and pparams.capacity == 1 << 18 and pparams.max_match == 8
    assert proposer.tree_size == 6 and proposer.max_spec_factor == 2.0
    assert make_proposer("suffix", model, suffix_decoding_max_cached_tokens=0)[1] is None
    with pytest.raises(MethodError, match="--suffix-decoding-max-cached-tokens must be 0"):
        make_proposer("suffix", model, suffix_decoding_max_cached_tokens=1)
    with pytest.raises(MethodError, match="--suffix-decoding-min-token-prob must be in \\[0, 1\\]"):
        make_proposer("suffix", model, suffix_decoding_min_token_prob=1.5)


def cached(texts, query, count=4, depth=3, max_match=3, capacity=64):
    """{m: [continuation, ...]} the cache finds for the query's last m tokens (known tokens only)."""
    cache = SuffixCache(max_match, capacity)
    for t in texts:
        cache.add(t)
    tokens = jnp.asarray([query + [0] * 4], jnp.int32)
    cont, known = cached_continuations(
        cache.index, tokens, jnp.asarray([len(query)]), max_match=max_match, count=count, depth=depth
    )
    out = {}
    for m in range(1, max_match + 1):
        found = [[int(t) for t, k in zip(c, kn) if k] for c, kn in zip(cont[m - 1, 0], known[m - 1, 0])]
        out[m] = [f for f in found if f]
    return out


def test_the_cache_finds_the_most_recent_continuations_of_each_match_length():
    found = cached([[5, 6, 7, 8, 9, 10], [1, 2, 7, 8, 11, 12], [3, 8, 13]], [4, 7, 8], count=2)
    assert found[1] == [[11, 12], [13]]  # "8": the two most recent, oldest first; a text ends
    assert found[2] == [[9, 10], [11, 12]]  # "7 8"
    assert found[3] == []  # "4 7 8" never seen
    assert cached([[5, 6, 7, 8, 9, 10]], [8], count=2)[2] == []  # longer than the text: no match


def test_the_cache_evicts_its_oldest_texts_first():
    texts = [[1, 2, 3]] + [[10 + i, 20 + i] for i in range(30)]  # 4 + 90 tokens through a ring of 64
    assert cached(texts, [1, 2])[2] == []
    assert cached(texts[:1] + texts[-20:], [1, 2])[2] == [[3]]
    assert cached(texts, [39])[1] == [[49]]
    cache = SuffixCache(3, 64)
    for t in texts:
        cache.add(t)
    assert cache.tokens == 64 and cache.written == 94
    cache.reset()
    assert cache.tokens == 0 and int(cache.index.written) == 0


@given(
    st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=8),
    st.lists(st.integers(0, 3), min_size=1, max_size=4),
)
@settings(max_examples=60, deadline=None)
def test_the_cache_agrees_with_a_scan_of_its_texts(texts, query):
    """What the index finds equals a brute-force scan of the cached texts: per match length,
    the continuations of the most recent occurrences (no hash collision drafts)."""
    found = cached(texts, query, count=3, depth=2, max_match=3, capacity=256)
    for m in range(1, 4):
        expected = []
        if m <= len(query):
            for t in texts:
                for j in range(m - 1, len(t)):
                    if t[j - m + 1 : j + 1] == query[-m:] and j + 1 < len(t):
                        expected.append(t[j + 1 : j + 3])
        assert found[m] == expected[-3:], (m, texts, query)


def test_a_hash_collision_never_drafts():
    cache = SuffixCache(2, 64)
    cache.add([1, 2, 3])
    index = cache.index
    tampered = index.replace(text=index.text.at[2].set(9))  # the indexed "1 2" now reads "1 9"
    tokens = jnp.asarray([[1, 2, 0]], jnp.int32)
    _, known = cached_continuations(index, tokens, jnp.asarray([2]), max_match=2, count=2, depth=1)
    assert bool(known[1].any())  # control: the window is found as it was indexed
    _, known = cached_continuations(tampered, tokens, jnp.asarray([2]), max_match=2, count=2, depth=1)
    assert not bool(known[1].any())


def test_the_cache_learns_across_calls_and_stays_lossless(tiny_model):
    """A second run of the same prompts drafts from the first run's outputs: greedy output equals
    vanilla's both times, with fewer target passes the second time."""
    params, cfg = tiny_model
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 5, 3, 2, 7, 8]]
    eng = Engine(params, cfg, num_pages=64, page_size=8)
    vanilla = eng.generate(prompts, 32, eos_token_ids=())
    proposer, cache = SuffixProposer(), SuffixCache(8, 4096)
    kw = dict(eos_token_ids=(), proposer=proposer, proposer_params=cache, fixed_speculation=True)
    eng.generate(prompts, 32, warmup=True, **kw)
    assert cache.tokens == 0  # a warm-up teaches nothing
    cold = eng.generate(prompts, 32, **kw)
    assert cache.tokens == 2 * 33
    warm = eng.generate(prompts, 32, **kw)
    assert cold.token_ids == warm.token_ids == vanilla.token_ids
    assert sum(warm.steps) < sum(cold.steps)
    assert sum(warm.steps) <= sum(map(len, warm.token_ids)) / 3  # drafted from the cached answers


def test_the_serving_scheduler_fills_the_cache(tiny_model):
    params, cfg = tiny_model
    eng = Engine(params, cfg, num_pages=64, page_size=8)
    cache = SuffixCache(8, 4096)
    answers = list(
        eng.generate_continuous(
            [[3, 1, 4, 1], [2, 7, 1, 8]], 16, proposer=SuffixProposer(), proposer_params=cache, eos_token_ids=()
        )
    )
    assert len(answers) == 2 and cache.tokens == 2 * 17


def test_chain_mode_follows_the_most_frequent_continuation():
    # "1 2" -> 9 (twice) then 7 or 3 (once each: the most recent, 3, on the tie); 8 is dropped
    assert tree_of(TEXT, chain=True) == [(2, -1, 0), (9, 0, 1), (3, 1, 2)]
    text = [5, 1, 2, 9, 7, 1, 2, 8, 6, 1, 2, 9, 3, 1, 2, 8, 6, 1, 2]  # the tree is a chain already
    assert tree_of(text, chain=True, max_spec_factor=3) == tree_of(text, max_spec_factor=3)


def test_the_graft_option_takes_suffix_chains(tiny_model):
    from specjax.loading import Model
    from specjax.method_configs import MethodError, method_config

    params, cfg = tiny_model
    model = Model(params, cfg, None, cfg.to_hf())
    assert method_config("eagle2", lookup_tokens=5, lookup_method="suffix").lookup_method == "suffix"
    with pytest.raises(MethodError, match="`lookup_method` is pld or suffix, not 'ngram'"):
        method_config("eagle2", lookup_tokens=5, lookup_method="ngram")
    with pytest.raises(MethodError, match="--lookup-method applies with --lookup-tokens"):
        make_proposer("eagle2", model, lookup_method="suffix")
