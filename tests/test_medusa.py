"""Medusa: choices -> static tree, heads as Flax modules, lossless greedy verification."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import Engine, ModelConfig, init_params
from specjax.draft_tree import static_tree
from specjax.model import lm_head_weight
from specjax.proposers.medusa import MC_SIM_7B_63, MedusaProposer, expand_choices

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
PROMPTS = [[3, 9, 27, 17, 51, 25, 11, 33, 35, 41], [5, 5, 5, 6], [1]]


def test_mc_sim_7b_63_tree():
    assert len(MC_SIM_7B_63) == 63
    parent, depth, rank = static_tree(MC_SIM_7B_63)
    assert len(parent) == 64 and depth.max() == 4 and rank.max() == 9
    assert all(parent[i] < i for i in range(1, 64))


def test_leaf_paths_expand_to_the_full_tree():
    nodes = set(MC_SIM_7B_63)
    leaves = [p for p in nodes if not any(q[: len(p)] == p and len(q) > len(p) for q in nodes)]
    assert expand_choices(leaves) == expand_choices(MC_SIM_7B_63)
    assert MedusaProposer(vocab_size=64, medusa_choices=tuple(leaves)).tree_size == 64


def test_bad_choices():
    with pytest.raises(ValueError, match="deep"):
        MedusaProposer(num_heads=2, vocab_size=64, medusa_choices=((0, 0, 0),))
    with pytest.raises(ValueError, match="ranks"):
        MedusaProposer(vocab_size=64, medusa_choices=((0, -1),))


@pytest.fixture(scope="module")
def target():
    return init_params(CFG, jax.random.PRNGKey(0), scale=0.5)


@pytest.mark.parametrize("own_lm_head", [True, False])
def test_greedy_equals_vanilla(target, own_lm_head):
    proposer = MedusaProposer(num_heads=4, vocab_size=CFG.vocab_size, own_lm_head=own_lm_head)
    heads = proposer.init_params(jax.random.PRNGKey(1), CFG.hidden_size, lm_head_weight(target))
    # Random (not identity) ResBlocks, so the drafts are arbitrary.
    heads = jax.tree_util.tree_map(lambda x: x + 0.3 * jax.random.normal(jax.random.PRNGKey(x.size), x.shape), heads)
    pparams = {"heads": heads, "lm_head": lm_head_weight(target)}
    eng = Engine(target, CFG, num_pages=256, page_size=4)
    vanilla = eng.generate(PROMPTS, 24, eos_token_ids=())
    spec = eng.generate(PROMPTS, 24, eos_token_ids=(), proposer=proposer, proposer_params=pparams)
    assert spec.token_ids == vanilla.token_ids
    assert all(s <= 24 for s in spec.steps)


def test_shallow_tree_runs_only_the_heads_it_reaches():
    """A depth-2 tree over 4 heads drafts what all 4 heads' top-k gives at depths 1 and 2."""
    from specjax.spec_decode import SpecContext

    proposer = MedusaProposer(num_heads=4, vocab_size=CFG.vocab_size, medusa_choices=((0,), (1,), (0, 0), (0, 1)))
    heads = proposer.init_params(jax.random.PRNGKey(1), CFG.hidden_size)
    heads = jax.tree_util.tree_map(lambda x: x + 0.3 * jax.random.normal(jax.random.PRNGKey(x.size), x.shape), heads)
    hidden = jax.random.normal(jax.random.PRNGKey(2), (2, CFG.hidden_size))
    tokens = jnp.array([[4, 5, 6], [7, 8, 0]], jnp.int32)
    ctx = SpecContext(tokens, jnp.array([3, 2]), None, hidden)
    tree, _ = proposer.propose({"heads": heads}, (), ctx, None, None)
    top = np.asarray(jax.lax.top_k(proposer.heads.apply(heads, hidden), 2)[1])  # [B, 4, 2]
    want = np.stack([[6, t[0, 0], t[0, 1], t[1, 0], t[1, 1]] for t in top])
    want[1, 0] = 8
    np.testing.assert_array_equal(np.asarray(tree.tokens), want)
    jaxpr = jax.make_jaxpr(
        lambda h: proposer.propose({"heads": heads}, (), SpecContext(tokens, ctx.lengths, None, h), None, None)[0]
    )(hidden)
    vocab_products = [
        e
        for e in jaxpr.jaxpr.eqns
        if e.primitive.name == "dot_general" and e.outvars[0].aval.shape[-1] == CFG.vocab_size
    ]
    assert len(vocab_products) == 2  # heads 0 and 1 only


def test_shared_lm_head_read_once_and_draft_vocabulary(target):
    """Heads sharing the base's lm_head go through it in one product (all heads' rows at once);
    with draft_ids the heads score only those rows and draft their target ids, losslessly."""
    from specjax.proposers.eagle_net import draft_vocabulary
    from specjax.spec_decode import SpecContext

    proposer = MedusaProposer(
        num_heads=4, vocab_size=CFG.vocab_size, own_lm_head=False, medusa_choices=((0,), (1,), (0, 0), (0, 1))
    )
    lm_head = lm_head_weight(target)
    heads = proposer.init_params(jax.random.PRNGKey(1), CFG.hidden_size, lm_head)
    heads = jax.tree_util.tree_map(lambda x: x + 0.3 * jax.random.normal(jax.random.PRNGKey(x.size), x.shape), heads)
    hidden = jax.random.normal(jax.random.PRNGKey(2), (2, CFG.hidden_size))
    ctx = SpecContext(jnp.array([[4, 5, 6], [7, 8, 0]], jnp.int32), jnp.array([3, 2]), None, hidden)
    jaxpr = jax.make_jaxpr(
        lambda h: proposer.propose(
            {"heads": heads, "lm_head": lm_head}, (), SpecContext(ctx.tokens, ctx.lengths, None, h), None, None
        )[0]
    )(hidden)
    # XLA's dot_general, or specjax.cpu.matmul's kernel (a custom_vjp_call) on this CPU
    products = [
        sorted(e.outvars[0].aval.shape)
        for e in jaxpr.jaxpr.eqns
        if e.primitive.name in ("dot_general", "custom_vjp_call") and CFG.vocab_size in e.outvars[0].aval.shape
    ]
    assert products == [[2 * 2, CFG.vocab_size]]  # one product: 2 sequences x heads 0 and 1

    # Draft vocabulary: the 16 ids below, scored through their rows only.
    ids = jnp.asarray(np.random.default_rng(0).permutation(CFG.vocab_size)[:16], jnp.int32)
    rows, ids = draft_vocabulary(lm_head, ids, None)
    tree, _ = proposer.propose({"heads": heads, "lm_head": rows, "draft_ids": ids}, (), ctx, None, None)
    logits = proposer.heads.apply(heads, hidden, lm_head)[:, :2]  # [B, 2 heads, V]
    masked = jnp.full_like(logits, -jnp.inf).at[..., ids].set(logits[..., ids])
    top = np.asarray(jax.lax.top_k(masked, 2)[1])
    want = np.stack([[0, t[0, 0], t[0, 1], t[1, 0], t[1, 1]] for t in top])
    np.testing.assert_array_equal(np.asarray(tree.tokens)[:, 1:], want[:, 1:])
    assert set(np.asarray(tree.tokens)[:, 1:].ravel()) <= set(np.asarray(ids).tolist())

    eng = Engine(target, CFG, num_pages=256, page_size=4)
    vanilla = eng.generate(PROMPTS, 24, eos_token_ids=())
    spec = eng.generate(
        PROMPTS,
        24,
        eos_token_ids=(),
        proposer=proposer,
        proposer_params={"heads": heads, "lm_head": rows, "draft_ids": ids},
    )
    assert spec.token_ids == vanilla.token_ids


def test_min_prob_keeps_exactly_the_confident_nodes(target):
    """With a draft-confidence floor a node stays valid iff the product of its path's head
    probabilities (head d's softmax at the node's rank) reaches it; output equals vanilla."""
    from specjax.spec_decode import SpecContext

    choices = ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    full = MedusaProposer(num_heads=4, vocab_size=CFG.vocab_size, own_lm_head=False, medusa_choices=choices)
    lm_head = lm_head_weight(target)
    heads = full.init_params(jax.random.PRNGKey(1), CFG.hidden_size, lm_head)
    heads = jax.tree_util.tree_map(lambda x: x + 0.3 * jax.random.normal(jax.random.PRNGKey(x.size), x.shape), heads)
    params = {"heads": heads, "lm_head": lm_head}
    hidden = jax.random.normal(jax.random.PRNGKey(2), (1, CFG.hidden_size))
    ctx = SpecContext(jnp.array([[4, 5, 6]], jnp.int32), jnp.array([3]), None, hidden)
    probs = np.asarray(jax.nn.softmax(full.heads.apply(heads, hidden, lm_head)[0], axis=-1))
    order = np.argsort(-probs, axis=-1)
    path_prob = {c: np.prod([probs[d, order[d, r]] for d, r in enumerate(c)]) for c in choices}
    floor = float(np.median(list(path_prob.values())))
    pruned = MedusaProposer(
        num_heads=4, vocab_size=CFG.vocab_size, own_lm_head=False, medusa_choices=choices, min_prob=floor * (1 - 1e-4)
    )
    tree, _ = pruned.propose(params, (), ctx, None, None)
    nodes = sorted(choices, key=lambda c: (len(c), c))
    kept = {c for c, ok in zip(nodes, np.asarray(tree.valid)[0, 1:]) if ok}
    assert kept == {c for c, p in path_prob.items() if p >= floor * (1 - 1e-4)}
    assert 0 < len(kept) < len(choices)

    eng = Engine(target, CFG, num_pages=256, page_size=4)
    vanilla = eng.generate(PROMPTS, 16, eos_token_ids=())
    spec = eng.generate(PROMPTS, 16, eos_token_ids=(), proposer=pruned, proposer_params=params)
    assert spec.token_ids == vanilla.token_ids
    with pytest.raises(ValueError, match="must be in \\[0, 1\\], got -0.1"):
        MedusaProposer(num_heads=4, vocab_size=CFG.vocab_size, medusa_choices=choices, min_prob=-0.1)


def test_oracle_heads_accept_whole_paths(target):
    """Heads that see the future (shared lm_head on a repeating model) reach deep nodes."""
    proposer = MedusaProposer(
        num_heads=4, vocab_size=CFG.vocab_size, own_lm_head=False, medusa_choices=((0, 0, 0, 0), (1,), (0, 1))
    )
    # Identity ResBlocks + the base head: every head proposes the base's own top tokens at the
    # same position, which a model stuck in a loop of one token accepts.
    loop = dict(target)
    loop["embed"] = jnp.zeros_like(target["embed"]).at[:, 0].set(1.0).at[7, 0].set(5.0)
    # (every input embeds alike, so the model repeats one token forever)
    eng = Engine(loop, CFG, num_pages=256, page_size=4)
    vanilla = eng.generate(PROMPTS[:1], 20, eos_token_ids=())
    assert len(set(vanilla.token_ids[0])) == 1
    heads = proposer.init_params(jax.random.PRNGKey(1), CFG.hidden_size, lm_head_weight(loop))
    spec = eng.generate(
        PROMPTS[:1],
        20,
        eos_token_ids=(),
        proposer=proposer,
        proposer_params={"heads": heads, "lm_head": lm_head_weight(loop)},
        fixed_speculation=True,
    )
    assert spec.token_ids == vanilla.token_ids
    assert spec.steps[0] == 4  # 5 tokens per step: root + 4 accepted drafts


def test_typical_acceptance_rule():
    """Typical acceptance keeps plausible tokens (p > min(eps, alpha * exp(-H))) along a path."""
    from specjax.accept import accept_typical
    from specjax.draft_tree import DraftTree
    from specjax.sampling import SamplingConfig

    v = 8
    # Node 0: confident p (0.9 on token 3); node 1 = token 3 (kept), node 2 = token 5 (p = 0.014).
    p0 = np.full(v, 0.1 / (v - 1))
    p0[3] = 0.9
    p1 = np.full(v, 1.0 / v)  # flat: entropy log 8, bar = min(0.09, 0.3 / 8) = 0.0375
    logits = jnp.log(jnp.asarray(np.stack([p0, p1, p1]), jnp.float32))[None]
    tree = DraftTree(
        tokens=jnp.asarray([[0, 3, 5]]),
        parent=jnp.asarray([[-1, 0, 1]]),
        depth=jnp.asarray([[0, 1, 2]]),
        valid=jnp.ones((1, 3), bool),
    )
    keys = jax.random.split(jax.random.PRNGKey(0), 1)
    res = accept_typical(tree, logits, keys, SamplingConfig(temperature=1.0), 0.09, 0.3)
    assert int(res.n_accepted[0]) == 2  # 1/8 = 0.125 > 0.0375 keeps node 2 as well
    res = accept_typical(tree, logits, keys, SamplingConfig(temperature=1.0), 0.09, 1.0)
    assert int(res.n_accepted[0]) == 2
    tree2 = tree.replace(tokens=jnp.asarray([[0, 4, 5]]))  # p0(4) = 0.014 < bar at node 0
    res = accept_typical(tree2, logits, keys, SamplingConfig(temperature=1.0), 0.09, 0.3)
    assert int(res.n_accepted[0]) == 0
