"""EAGLE chain drafting: lossless, and its draft cache tracks the target's true features."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest

from specjax import Engine, ModelConfig, init_params
from specjax.model import lm_head_weight
from specjax.proposers.eagle import EagleChainProposer, EagleDynamicProposer, EagleTreeProposer
from specjax.proposers.eagle3_net import Eagle3Net

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
PROMPTS = [[3, 9, 27, 17, 51, 25, 11, 33, 35, 41], [5, 5, 5, 6], [1, 2]]


def random_eagle(key, scale=0.3, layers=1):
    draft_cfg = dataclasses.replace(CFG, num_layers=layers)
    stack = init_params(draft_cfg, key, scale=scale)["layers"]
    del stack[0]["attn_norm"]  # EAGLE's first layer has no input norm
    k1, k2 = jax.random.split(key)
    fc = {
        "kernel": scale * jax.random.normal(k1, (2 * CFG.hidden_size, CFG.hidden_size)),
        "bias": scale * jax.random.normal(k2, (CFG.hidden_size,)),
    }
    return draft_cfg, {"fc": fc, "layers": stack}


@pytest.fixture(scope="module")
def target():
    return init_params(CFG, jax.random.PRNGKey(0), scale=0.5)


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_equals_vanilla(target, k):
    draft_cfg, net = random_eagle(jax.random.PRNGKey(3))
    proposer = EagleChainProposer(draft_cfg, max_draft_len=k)
    pparams = {"net": net, "embed": target["embed"], "lm_head": lm_head_weight(target)}
    eng = Engine(target, CFG, num_pages=256, page_size=4)
    vanilla = eng.generate(PROMPTS, 20, eos_token_ids=())
    spec = eng.generate(PROMPTS, 20, eos_token_ids=(), proposer=proposer, proposer_params=pparams)
    assert spec.token_ids == vanilla.token_ids
    # Sampling stays seeded and runs through the same path.
    from specjax import SamplingConfig

    s = SamplingConfig(temperature=0.8, top_k=20)
    a = eng.generate(
        PROMPTS, 12, sampling=s, seeds=[1, 2, 3], proposer=proposer, proposer_params=pparams, fixed_speculation=True
    )
    b = eng.generate(
        PROMPTS, 12, sampling=s, seeds=[1, 2, 3], proposer=proposer, proposer_params=pparams, fixed_speculation=True
    )
    assert a.token_ids == b.token_ids


def test_update_rebuilds_pairs_with_true_features(target):
    """init over a prompt, then update with an accepted path, equals init over the longer prompt:
    same draft length, same next prediction, same K/V at every committed draft slot."""
    import numpy as np

    from specjax import PagedKVCache
    from specjax.accept import AcceptResult
    from specjax.cache import init_pages
    from specjax.generate import prefill
    from specjax.spec_decode import SpecContext

    draft_cfg, net = random_eagle(jax.random.PRNGKey(5))
    proposer = EagleChainProposer(draft_cfg, max_draft_len=3)
    pparams = {"net": net, "embed": target["embed"], "lm_head": lm_head_weight(target)}
    full = [3, 9, 27, 17, 51, 25, 11, 33, 35, 41, 7, 8, 2]  # prompt (10) + 3 more tokens
    n_acc = 2  # the root (pending 41) and two drafted tokens (7, 8) accepted; 2 is the next

    def start(tokens_list):
        L = len(tokens_list)
        k, v = init_pages(CFG, 16, 4)
        table = jnp.arange(8, dtype=jnp.int32)[None]
        cache = PagedKVCache(k, v, table, jnp.zeros(1, jnp.int32))
        chunk = jnp.zeros((1, 16), jnp.int32).at[0, : L - 1].set(jnp.asarray(tokens_list[:-1]))
        cache, last, hidden = prefill(target, CFG, cache, chunk, jnp.asarray([L - 1]))
        buf = jnp.zeros((1, 33), jnp.int32).at[0, : len(full)].set(jnp.asarray(full))
        ctx = SpecContext(buf, jnp.asarray([L]), cache.block_tables, last, prompt_hidden=hidden)
        pools = proposer.make_pools(16, 4, jnp.float32)
        state = jax.jit(proposer.init)(pparams, pools, ctx, chunk, jnp.asarray([L - 1]))
        return state, cache, ctx

    short, cache, ctx = start(full[:10])
    tree, state = _propose(proposer, pparams, short, ctx)
    # The target's true hidden states along the accepted path: a teacher-forced pass.
    from specjax.draft_tree import chain

    path_tree = chain(jnp.asarray([41]), jnp.asarray([[7, 8, 2]]), jnp.asarray([3]))
    from specjax.verify import verify

    out = verify(target, CFG, cache, path_tree)
    res = AcceptResult(
        path=jnp.arange(4, dtype=jnp.int32)[None], n_accepted=jnp.asarray([n_acc]), next_token=jnp.asarray([2])
    )
    new_ctx = SpecContext(ctx.tokens, jnp.asarray([13]), ctx.block_tables, None, path_hidden=out.hidden)
    updated = proposer.update(pparams, state, new_ctx, res, jnp.asarray([True]))
    long, _, _ = start(full)
    assert int(updated.lengths[0]) == int(long.lengths[0]) == 12
    np.testing.assert_allclose(np.asarray(updated.next_hidden), np.asarray(long.next_hidden), rtol=1e-4, atol=1e-5)
    for a, b in zip(updated.k_pages, long.k_pages):  # slots 0..11 live in pages 0..2
        np.testing.assert_allclose(np.asarray(a[:, :3]), np.asarray(b[:, :3]), rtol=1e-4, atol=1e-5)


def test_recorded_plain_steps_catch_up_to_the_token_by_token_state(target):
    """Three plain decode steps recorded (`record`), then caught up two positions per pass,
    equal init over the longer text: same draft length, next prediction and committed K/V."""
    import numpy as np

    from specjax.draft_tree import chain
    from specjax.verify import verify

    draft_cfg, net = random_eagle(jax.random.PRNGKey(5))
    proposer = EagleChainProposer(draft_cfg, max_draft_len=3)
    object.__setattr__(proposer, "CATCH_UP", 2)  # the 3 recorded pairs take two passes
    pparams = {"net": net, "embed": target["embed"], "lm_head": lm_head_weight(target)}
    full = [3, 9, 27, 17, 51, 25, 11, 33, 35, 41, 7, 8, 2]
    short, ctx = _draft_state(target, proposer, pparams, full[:10])
    # the target's features at positions 9, 10, 11 (pending 41, then 7 and 8 decoded plainly)
    cache = _prefilled_cache(target, full[:10])
    hidden = verify(target, CFG, cache, chain(jnp.asarray([41]), jnp.asarray([[7, 8]]), jnp.asarray([2]))).hidden
    state = short
    for i in range(3):
        at, on = jnp.asarray([9 + i]), jnp.asarray([True])
        state = proposer.record(pparams, state, ctx.block_tables, at, hidden[:, i], on)
    assert int(state.lengths[0]) == 9  # recording runs no draft pass
    buf = jnp.zeros_like(ctx.tokens).at[0, :13].set(jnp.asarray(full))
    caught = jax.jit(proposer._caught_up)(pparams, state, ctx.replace(tokens=buf, lengths=jnp.asarray([13])))
    long, _ = _draft_state(target, proposer, pparams, full)
    assert int(caught.lengths[0]) == int(long.lengths[0]) == 12
    np.testing.assert_allclose(np.asarray(caught.next_hidden), np.asarray(long.next_hidden), rtol=1e-4, atol=1e-5)
    for a, b in zip(caught.k_pages, long.k_pages):  # slots 0..11 live in pages 0..2
        np.testing.assert_allclose(np.asarray(a[:, :3]), np.asarray(b[:, :3]), rtol=1e-4, atol=1e-5)
    again = jax.jit(proposer._caught_up)(pparams, caught, ctx.replace(tokens=buf, lengths=jnp.asarray([13])))
    assert int(again.lengths[0]) == 12  # nothing left to catch up on: no pass


@pytest.mark.parametrize("kind", ["eagle2", "eagle3"])
def test_plain_segments_then_drafting_draft_as_if_updated_token_by_token(target, kind, monkeypatch):
    """With the budget forced to alternate plain and drafting segments of 3 steps, an EAGLE
    drafter that records plain steps and catches up drafts the very trees of one updated on
    every token, and both decode vanilla's tokens."""
    import numpy as np

    import specjax.generate
    from specjax.serving.budget import SpeculationBudget

    if kind == "eagle3":
        draft_cfg, pparams, layers = random_eagle3(target, jax.random.PRNGKey(4))
        options = {"net": Eagle3Net(layers)}
    else:
        draft_cfg, net = random_eagle(jax.random.PRNGKey(3))
        pparams, options = {"net": net, "embed": target["embed"], "lm_head": lm_head_weight(target)}, {}
    trees = {True: [], False: []}

    @dataclasses.dataclass(frozen=True)
    class Seen(EagleDynamicProposer):
        def _propose(self, params, state, ctx, keys, sampling):
            tree, state = super()._propose(params, state, ctx, keys, sampling)
            jax.debug.callback(lambda t, d=self.defers_update: trees[d].append(np.asarray(t)), tree.tokens)
            return tree, state

    @dataclasses.dataclass(frozen=True)
    class TokenByToken(Seen):
        defers_update = False

    calls = iter(range(10**6))
    monkeypatch.setattr(SpeculationBudget, "segment", lambda self, rows, start, max_gain: (next(calls) % 2 or 8, False))
    monkeypatch.setattr(specjax.generate, "SEGMENT_STEPS", 3)
    eng = Engine(target, CFG, num_pages=256, page_size=4)
    vanilla = eng.generate(PROMPTS, 30, eos_token_ids=())
    for cls in (Seen, TokenByToken):
        out = eng.generate(
            PROMPTS,
            30,
            eos_token_ids=(),
            proposer=cls(draft_cfg, total_tokens=8, depth=3, top_k=3, **options),
            proposer_params=pparams,
        )
        assert out.token_ids == vanilla.token_ids
    assert len(trees[True]) == len(trees[False]) >= 12  # 5 drafting segments of 3 steps, the warm-up
    for a, b in zip(trees[True], trees[False]):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------------------------
# Trees: EAGLE-1 (static) and EAGLE-2 (dynamic)

TREE_PROPOSERS = {
    "eagle1-default": lambda cfg: EagleTreeProposer(cfg),
    "eagle1-small": lambda cfg: EagleTreeProposer(cfg, eagle_choices=((0, 0, 0), (1, 0), (2,))),
    "eagle2-small": lambda cfg: EagleDynamicProposer(cfg, total_tokens=12, depth=3, top_k=3),
    "eagle2-default": lambda cfg: EagleDynamicProposer(cfg),
    "eagle2-two-layers": lambda cfg: EagleDynamicProposer(cfg, total_tokens=6, depth=3, top_k=2),
}


@pytest.mark.parametrize("name", sorted(TREE_PROPOSERS))
def test_tree_greedy_equals_vanilla(target, name):
    draft_cfg, net = random_eagle(jax.random.PRNGKey(3), layers=2 if "two" in name else 1)
    proposer = TREE_PROPOSERS[name](draft_cfg)
    pparams = {"net": net, "embed": target["embed"], "lm_head": lm_head_weight(target)}
    eng = Engine(target, CFG, num_pages=256, page_size=4)
    vanilla = eng.generate(PROMPTS, 24, eos_token_ids=())
    spec = eng.generate(PROMPTS, 24, eos_token_ids=(), proposer=proposer, proposer_params=pparams)
    assert spec.token_ids == vanilla.token_ids


def _prefilled_cache(target, prompt):
    """The target's cache after prefilling `prompt` (batch 1, the pending token not written)."""
    from specjax import PagedKVCache
    from specjax.cache import init_pages
    from specjax.generate import prefill

    n = len(prompt)
    k, v = init_pages(CFG, 32, 4)
    cache = PagedKVCache(k, v, jnp.arange(24, dtype=jnp.int32)[None], jnp.zeros(1, jnp.int32))
    chunk = jnp.zeros((1, 16), jnp.int32).at[0, : n - 1].set(jnp.asarray(prompt[:-1]))
    return prefill(target, CFG, cache, chunk, jnp.asarray([n - 1]))[0]


def _draft_state(target, proposer, pparams, prompt, feature_layers=()):
    """Proposer state and context after prefilling `prompt` (batch 1)."""
    from specjax import PagedKVCache
    from specjax.cache import init_pages
    from specjax.generate import prefill
    from specjax.spec_decode import SpecContext

    n = len(prompt)
    k, v = init_pages(CFG, 32, 4)
    table = jnp.arange(24, dtype=jnp.int32)[None]
    cache = PagedKVCache(k, v, table, jnp.zeros(1, jnp.int32))
    chunk = jnp.zeros((1, 16), jnp.int32).at[0, : n - 1].set(jnp.asarray(prompt[:-1]))
    cache, last, hidden = prefill(target, CFG, cache, chunk, jnp.asarray([n - 1]), tuple(feature_layers))
    buf = jnp.zeros((1, 96), jnp.int32).at[0, :n].set(jnp.asarray(prompt))
    ctx = SpecContext(buf, jnp.asarray([n]), cache.block_tables, last, prompt_hidden=hidden)
    state = jax.jit(proposer.init)(pparams, proposer.make_pools(32, 4, jnp.float32), ctx, chunk, jnp.asarray([n - 1]))
    return state, ctx


@functools.lru_cache(maxsize=None)
def _compiled(proposer):
    """The proposer's propose, one-token chain step and top-k, jitted once per proposer: op by op
    an EAGLE-1 tree took ~15 s to draft, and `_chain_top` calls the step once per node."""
    return (
        jax.jit(proposer.propose, static_argnums=(3, 4)),
        jax.jit(proposer._run_chain),
        jax.jit(proposer._top, static_argnums=2),
    )


def _propose(proposer, pparams, state, ctx):
    """One `propose` of a proposer (jitted)."""
    return _compiled(proposer)[0](pparams, state, ctx, None, None)


def _chain_top(proposer, pparams, state, ctx, path, k):
    """The draft's k best tokens after the drafted tokens `path`, drafted one by one (a chain,
    no tree attention): what tree drafting must reproduce at every node."""
    _, run_chain, top = _compiled(proposer)
    cache = state.cache(ctx.block_tables)
    h = state.next_hidden
    for tok in path:
        out, cache = run_chain(pparams, cache, jnp.asarray([[tok]]), h[:, None], cache.lengths, jnp.ones((1, 1), bool))
        cache = cache.replace(lengths=cache.lengths + 1)
        h = out[:, 0]
    logp, ids = top(pparams, h, k)
    return [int(i) for i in ids[0]], [float(x) for x in logp[0]]


def _paths(tree):
    import numpy as np

    parent, tokens, valid = (np.asarray(a[0]) for a in (tree.parent, tree.tokens, tree.valid))
    paths = {0: []}
    for i in range(1, len(parent)):
        if valid[i]:
            paths[i] = paths[int(parent[i])] + [int(tokens[i])]
    return paths


def test_static_tree_nodes_are_the_drafts_ranked_tokens(target):
    """Node i of an EAGLE-1 tree holds the rank[i]-th best draft token after its root path."""
    from specjax.draft_tree import static_tree

    draft_cfg, net = random_eagle(jax.random.PRNGKey(7), scale=0.5)
    proposer = EagleTreeProposer(draft_cfg)
    pparams = {"net": net, "embed": target["embed"], "lm_head": lm_head_weight(target)}
    state, ctx = _draft_state(target, proposer, pparams, PROMPTS[0])
    tree, _ = _propose(proposer, pparams, state, ctx)
    _, depth, rank = static_tree(proposer.eagle_choices)
    for i, path in _paths(tree).items():
        if i:
            ids, _ = _chain_top(proposer, pparams, state, ctx, path[:-1], 4)
            assert path[-1] == ids[rank[i]], (i, path)
    assert [len(p) for p in _paths(tree).values()] == list(depth)
    assert proposer.max_path_len == max(depth) + 1 == 6


@pytest.mark.parametrize("total,depth,top_k", [(12, 3, 3), (63, 5, 8), (6, 4, 1)])
def test_dynamic_tree_is_valid_and_best_first(target, total, depth, top_k):
    """EAGLE-2 trees: parents precede children, depth = parent depth + 1, no duplicate sibling
    tokens, every node is one of the top_k draft tokens after its path, and the kept nodes are
    the candidates of highest cumulative log-probability."""
    import numpy as np

    draft_cfg, net = random_eagle(jax.random.PRNGKey(11), scale=0.5)
    proposer = EagleDynamicProposer(draft_cfg, total_tokens=total, depth=depth, top_k=top_k)
    pparams = {"net": net, "embed": target["embed"], "lm_head": lm_head_weight(target)}
    state, ctx = _draft_state(target, proposer, pparams, PROMPTS[0])
    tree, _ = _propose(proposer, pparams, state, ctx)
    parent, dep, tok, valid = (np.asarray(a[0]) for a in (tree.parent, tree.depth, tree.tokens, tree.valid))
    assert valid.all() and tree.size == total
    assert parent[0] == -1 and dep[0] == 0
    assert all(0 <= parent[i] < i and dep[i] == dep[parent[i]] + 1 for i in range(1, total))
    siblings = {(int(parent[i]), int(tok[i])) for i in range(1, total)}
    assert len(siblings) == total - 1
    assert dep.max() <= depth + 1 and dep.max() + 1 <= proposer.max_path_len
    # A plain re-implementation of EAGLE-2's selection over chain-drafted distributions.
    layer = [((t,), lp) for t, lp in zip(*_chain_top(proposer, pparams, state, ctx, [], top_k))]
    candidates = list(layer)
    for _ in range(depth):
        children = []
        for path, s in layer:
            ids, logp = _chain_top(proposer, pparams, state, ctx, list(path), top_k)
            children += [(path + (t,), s + lp) for t, lp in zip(ids, logp)]
        candidates += children
        layer = sorted(children, key=lambda c: -c[1])[:top_k]
    best = sorted(candidates, key=lambda c: -c[1])[: total - 1]
    assert {p for p, _ in best} == {tuple(p) for i, p in _paths(tree).items() if i}


# ---------------------------------------------------------------------------------------------
# EAGLE-3: the same drafting over three fused target layers and a reduced draft vocabulary


def random_eagle3(target, key, draft_vocab=40):
    from specjax.proposers.eagle3_net import eagle3_feature_layers, init_eagle3_params

    counts = jax.random.uniform(key, (CFG.vocab_size,))
    cfg3, net = init_eagle3_params(key, CFG, draft_vocab, token_counts=counts, scale=0.3)
    pparams = {"net": net, "embed": target["embed"], "lm_head": lm_head_weight(target)}
    return cfg3, pparams, eagle3_feature_layers(CFG.num_layers)


@pytest.mark.parametrize("kind", ["chain", "dynamic"])
def test_eagle3_greedy_equals_vanilla(target, kind):
    cfg3, pparams, layers = random_eagle3(target, jax.random.PRNGKey(4))
    if kind == "chain":
        proposer = EagleChainProposer(cfg3, net=Eagle3Net(layers), max_draft_len=3)
    else:
        proposer = EagleDynamicProposer(cfg3, net=Eagle3Net(layers), total_tokens=10, depth=3, top_k=3)
    eng = Engine(target, CFG, num_pages=256, page_size=4)
    vanilla = eng.generate(PROMPTS, 20, eos_token_ids=())
    spec = eng.generate(PROMPTS, 20, eos_token_ids=(), proposer=proposer, proposer_params=pparams)
    assert spec.token_ids == vanilla.token_ids


def test_eagle3_tree_nodes_are_in_the_draft_vocabulary(target):
    """EAGLE-3 drafts only tokens of its reduced vocabulary, mapped to target ids through d2t,
    and the tree is the best-first selection over chain-drafted distributions."""
    import numpy as np

    from specjax.proposers.eagle3_net import draft_to_target

    cfg3, pparams, layers = random_eagle3(target, jax.random.PRNGKey(8))
    proposer = EagleDynamicProposer(cfg3, net=Eagle3Net(layers), total_tokens=8, depth=2, top_k=3)

    state, ctx = _draft_state(target, proposer, pparams, PROMPTS[0], layers)
    tree, _ = _propose(proposer, pparams, state, ctx)
    allowed = set(np.asarray(draft_to_target(pparams["net"], jnp.arange(40))).tolist())
    assert set(np.asarray(tree.tokens[0, 1:]).tolist()) <= allowed
    for i, path in _paths(tree).items():
        if i:
            ids, _ = _chain_top(proposer, pparams, state, ctx, path[:-1], 3)
            assert path[-1] in ids


def test_frequent_token_draft_vocabulary(target):
    """Drafting from the lm_head rows of a subset of tokens (FR-Spec): trees hold only those
    tokens, and output still equals vanilla."""
    import numpy as np

    from specjax.proposers.eagle_net import draft_vocabulary

    draft_cfg, net = random_eagle(jax.random.PRNGKey(3))
    order = jax.random.permutation(jax.random.PRNGKey(9), CFG.vocab_size)
    head, ids = draft_vocabulary(lm_head_weight(target), order, 20)
    pparams = {"net": net, "embed": target["embed"], "lm_head": head, "draft_ids": ids}
    proposer = EagleDynamicProposer(draft_cfg, total_tokens=10, depth=3, top_k=3)
    state, ctx = _draft_state(target, proposer, pparams, PROMPTS[0])
    tree, _ = _propose(proposer, pparams, state, ctx)
    assert set(np.asarray(tree.tokens[0, 1:]).tolist()) <= set(np.asarray(ids).tolist())
    eng = Engine(target, CFG, num_pages=256, page_size=4)
    vanilla = eng.generate(PROMPTS, 16, eos_token_ids=())
    spec = eng.generate(PROMPTS, 16, eos_token_ids=(), proposer=proposer, proposer_params=pparams)
    assert spec.token_ids == vanilla.token_ids
    with pytest.raises(ValueError, match="draft vocabulary size"):
        draft_vocabulary(lm_head_weight(target), order, 0)


MIN_PROB_PROPOSERS = {
    "chain": lambda cfg, m: EagleChainProposer(cfg, max_draft_len=4, min_prob=m),
    "static": lambda cfg, m: EagleTreeProposer(cfg, eagle_choices=((0, 0, 0), (1, 0), (2,)), min_prob=m),
    "dynamic": lambda cfg, m: EagleDynamicProposer(cfg, total_tokens=12, depth=3, top_k=3, min_prob=m),
}


@pytest.mark.parametrize("kind", sorted(MIN_PROB_PROPOSERS))
def test_min_prob_keeps_exactly_the_confident_drafts(target, kind):
    """With a draft-confidence floor the valid nodes are those of the full tree whose path's
    cumulative draft probability (recomputed by chain drafting) reaches it; EAGLE-2's are a prefix
    of its nodes, so the verify pass can run narrower. Output still equals vanilla."""
    import numpy as np

    draft_cfg, net = random_eagle(jax.random.PRNGKey(11), scale=0.15)
    pparams = {"net": net, "embed": target["embed"], "lm_head": lm_head_weight(target)}
    full = MIN_PROB_PROPOSERS[kind](draft_cfg, 0.0)
    state, ctx = _draft_state(target, full, pparams, PROMPTS[0])
    tree0, _ = _propose(full, pparams, state, ctx)

    def score(path):  # cumulative draft log-prob of a drafted path
        s = 0.0
        for i, t in enumerate(path):
            ids, logp = _chain_top(full, pparams, state, ctx, path[:i], CFG.vocab_size)
            s += logp[ids.index(t)]
        return s

    scores = {tuple(p): score(p) for i, p in _paths(tree0).items() if i}
    assert len(scores) == tree0.size - 1
    floor = float(np.median(list(scores.values())))
    m = float(np.exp(floor - 1e-3))
    expected = {p for p, s in scores.items() if s >= floor - 1e-3}
    assert 0 < len(expected) < len(scores)
    pruned = MIN_PROB_PROPOSERS[kind](draft_cfg, m)
    tree, _ = _propose(pruned, pparams, state, ctx)
    valid = np.asarray(tree.valid[0])
    assert {tuple(p) for i, p in _paths(tree).items() if i} == expected
    if kind != "static":
        assert valid[: len(expected) + 1].all() and not valid[len(expected) + 1 :].any()
    eng = Engine(target, CFG, num_pages=256, page_size=4)
    vanilla = eng.generate(PROMPTS, 16, eos_token_ids=())
    for proposer in (pruned, MIN_PROB_PROPOSERS[kind](draft_cfg, 1.0)):
        spec = eng.generate(PROMPTS, 16, eos_token_ids=(), proposer=proposer, proposer_params=pparams)
        assert spec.token_ids == vanilla.token_ids
    assert spec.steps == [16, 16, 16]  # a floor of 1: nothing drafted, one token per step
    with pytest.raises(ValueError, match=r"min_prob .* must be in \[0, 1\], got 1.5"):
        MIN_PROB_PROPOSERS[kind](draft_cfg, 1.5)
