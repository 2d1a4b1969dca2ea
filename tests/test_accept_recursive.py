"""The `recursive` tree rule (recursive rejection sampling without replacement) and
`gumbel_top_k`, tested exactly as in test_accept_sampling.py.

Random target and draft logit tables over a vocabulary of 8 give p(. | prefix) and q(. | prefix)
for prefixes of up to 3 tokens; q is independent of p, and some rows of both are truncated to
their top few tokens, so that zeros appear in q where p has mass and the reverse. Each step's tree
is drawn as a drafter would: 3 root children without replacement from q (Gumbel-top-k), each with
2 children without replacement from q at it. Over 2**18 keys the first tokens emitted (with later
steps supplying the tokens a step did not emit) must match p by chi-square, and two broken rules
(q' kept after a rejection; siblings drawn with replacement) must fail it.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax.accept as accept_mod
from specjax import SamplingConfig
from specjax.accept import accept, accept_recursive
from specjax.draft_tree import DraftTree
from specjax.sampling import categorical, gumbel_max_draw, gumbel_top_k, processed_logprobs
from tests.test_accept_sampling import (
    DEPTH,
    P_BROKEN,
    P_OK,
    N,
    biased,
    chi2_power,
    chi2_pvalue,
    exact_first_three,
    exact_first_two,
    jit_optimised,
    keys_of,
    lookup,
    sample_first_three,
)

V = 8
K1, K2 = 3, 2  # root children, children of each
PARENT = np.asarray([-1] + [0] * K1 + [1 + i for i in range(K1) for _ in range(K2)], np.int32)
DEPTH_OF = np.asarray([0] + [1] * K1 + [2] * (K1 * K2), np.int32)
S_PLAIN = SamplingConfig(temperature=1.0)
S_WARPED = SamplingConfig(temperature=0.7, top_k=5, top_p=0.9)


def random_logits(rng, scale, keep, frac):
    """Logits [V, V, V, DEPTH + 1, V] (the layout `lookup` reads): scale * N(0, 1), a fraction
    `frac` of the rows cut to their `keep` largest (the rest -inf)."""
    shape = (V,) * DEPTH + (DEPTH + 1, V)
    x = scale * rng.standard_normal(shape)
    cut = np.sort(x, axis=-1)[..., -keep][..., None]
    truncated = rng.random(shape[:-1])[..., None] < frac
    return jnp.asarray(np.where(truncated & (x < cut), -np.inf, x), jnp.float32)


@pytest.fixture(scope="module")
def tables():
    rng = np.random.default_rng(7)
    return random_logits(rng, 1.2, 5, 0.4), random_logits(rng, 1.5, 4, 0.4)  # p, q


def exact_without_replacement(q, k):
    """float64[V] * k: the exact law of k draws without replacement from q, in order."""
    out = np.zeros((len(q),) * k)
    for seq in itertools.permutations(range(len(q)), k):
        prob, left = 1.0, 1.0
        for tok in seq:
            prob, left = prob * q[tok] / left if left > 0 else 0.0, left - q[tok]
        out[seq] = prob
    return out / out.sum()


def with_replacement(key, logq, k):
    """Broken control (b): k independent draws from q, all real draws."""
    tokens = jax.vmap(lambda i: categorical(jax.random.fold_in(key, i), logq))(jnp.arange(k))
    return tokens.astype(jnp.int32), jnp.zeros((k,), jnp.float32)


def tree_maker(sampling, draw=gumbel_top_k, certain=None):
    """Trees of K1 root children and K2 children each, siblings drawn by `draw` from the processed
    draft q at their parent; nodes in index order, parents first, siblings in draw order.

    certain="last": one more root child, after the drawn ones, holding the target's most likely
    token with a one-hot q (the lookup graft's kind of candidate: a group of its own, tried after
    the drawn siblings), present only when no drawn root child holds that token, as the graft
    shares it; "first": the same node placed before the drawn siblings (broken control: its
    presence then selects which draws the drawn siblings are)."""

    def make(tabs, ctx, keys):
        p_table, q_table = tabs

        def children(prefix, salt, k):
            logq = processed_logprobs(lookup(q_table, prefix), sampling)
            salted = jax.vmap(lambda key: jax.random.fold_in(key, salt))(keys)
            tokens, values = jax.vmap(lambda key, lq: draw(key, lq, k))(salted, logq)
            return tokens, values > -jnp.inf, logq

        n = ctx.shape[0]
        tokens, valid = [jnp.zeros((n,), jnp.int32)], [jnp.ones((n,), bool)]
        logqs, prefixes = [jnp.zeros((n, V))], [ctx]
        for node in range(1 + K1):  # the root, then each root child
            if node > 0 and DEPTH_OF[node] != 1:
                continue
            kids, drawn, logq = children(prefixes[node], node, K1 if node == 0 else K2)
            for i in range(kids.shape[1]):
                tokens.append(kids[:, i])
                valid.append(drawn[:, i] & valid[node])
                logqs.append(logq)
                prefixes.append(jnp.concatenate([prefixes[node], kids[:, i : i + 1]], 1))
        parent, depth = PARENT, DEPTH_OF
        if certain is not None:
            tok = jnp.argmax(lookup(p_table, ctx), -1).astype(jnp.int32)
            shared = jnp.any(jnp.stack(tokens[1 : 1 + K1], 1) == tok[:, None] & jnp.stack(valid[1 : 1 + K1], 1), axis=1)
            tokens.append(tok)
            valid.append(~shared)
            one_hot = jnp.where(jnp.arange(V) == tok[:, None], 0.0, -jnp.inf)
            logqs.append(one_hot)
            prefixes.append(jnp.concatenate([ctx, tok[:, None]], 1))
            parent, depth = np.append(PARENT, 0), np.append(DEPTH_OF, 1)
            if certain == "first":  # moved before the drawn root children
                order = np.r_[0, len(parent) - 1, 1 : len(parent) - 1]
                tokens, valid, logqs, prefixes = ([x[i] for i in order] for x in (tokens, valid, logqs, prefixes))
                parent = np.r_[-1, 0, np.where(PARENT[1:] > 0, PARENT[1:] + 1, 0)]
                depth = depth[order]
        logits = jnp.stack([lookup(p_table, prefix) for prefix in prefixes], 1)
        tree = DraftTree(
            tokens=jnp.stack(tokens, 1),
            parent=jnp.broadcast_to(parent, (n, len(parent))),
            depth=jnp.broadcast_to(depth, (n, len(parent))),
            valid=jnp.stack(valid, 1),
            draft_logprobs=jnp.stack(logqs, 1),
        )
        return tree, logits

    return make


def rule_recursive(tree, logits, keys, sampling):
    return accept(tree, logits, keys, sampling, "recursive")


AFTER_REJECTION = accept_mod._after_rejection


def keep_q_after_rejection(p, q, x, p_node):
    """Broken control (a): the residual is right, but q' keeps the rejected token and its mass."""
    return AFTER_REJECTION(p, q, x, p_node)[0], q


def pvalues(tables, sampling, x1, x2, x3):
    """Chi-square p-values of (x1, x2) and of (x1, x2, x3) against the exact laws."""
    p_table, _ = tables
    return (
        chi2_pvalue(x1, x2, exact_first_two(p_table, sampling)),
        chi2_pvalue(x1 * V + x2, x3, exact_first_three(p_table, sampling).reshape(V * V, V)),
    )


def conditional_pvalue(tables, sampling, x1, x2, x3):
    """Chi-square p-value of x3 given (x1, x2) against p(. | x1, x2), on the samples given (the
    observed (x1, x2) frequencies stand in for their law: conservative by their degrees of
    freedom)."""
    p_table, _ = tables
    cond = np.exp(np.asarray(processed_logprobs(p_table[:, :, 0, 2], sampling), np.float64))
    freq = np.bincount(x1 * V + x2, minlength=V * V) / len(x1)
    return chi2_pvalue(x1 * V + x2, x3, freq[:, None] * cond.reshape(V * V, V))


# ---------------------------------------------------------------------------------------------


def test_the_chi_square_has_power(tables):
    """The laws `pvalues` tests here (and tests/test_accept_traversal.py), (x1, x2) and
    (x1, x2, x3), at both samplings: N = 2**18 samples catch a 2% per-cell bias (`biased`) at
    p < P_OK with probability above 0.8, by the noncentral chi-square."""
    p_table, _ = tables
    for sampling in (S_PLAIN, S_WARPED):
        for joint in (exact_first_two(p_table, sampling), exact_first_three(p_table, sampling).reshape(V * V, V)):
            assert chi2_power(joint, N, biased(joint)) > 0.8, sampling


def test_gumbel_top_k_draws_without_replacement():
    """The first three of k draws match the law of draws without replacement, the first is
    the Gumbel-max draw with the same key, and -inf tokens come last, with -inf values."""
    rng = np.random.default_rng(3)
    full = jax.nn.log_softmax(jnp.asarray(1.2 * rng.standard_normal(V), jnp.float32))
    cut = full.at[jnp.asarray([1, 4, 6])].set(-jnp.inf)  # 5 finite tokens
    keys = keys_of(jax.random.PRNGKey(0), N)
    for logq, k in ((full, 3), (cut, 7)):
        tokens, values = jax.jit(jax.vmap(lambda key, lq=logq, k=k: gumbel_top_k(key, lq, k)))(keys)
        tokens, drawn = np.asarray(tokens), np.isfinite(np.asarray(values))
        q = np.exp(np.asarray(logq, np.float64))
        exact = exact_without_replacement(q / q.sum(), 3)
        a, b, c = tokens[:, 0], tokens[:, 1], tokens[:, 2]
        assert chi2_pvalue(np.zeros_like(a), a, exact.sum((1, 2))[None]) > P_OK
        assert chi2_pvalue(a, b, exact.sum(2)) > P_OK
        assert chi2_pvalue(a * V + b, c, exact.reshape(V * V, V)) > P_OK
        finite = np.isfinite(np.asarray(logq))
        assert (drawn == (np.arange(k) < finite.sum())).all()
        assert finite[tokens[:, : finite.sum()]].all()
        real = tokens[:, : finite.sum()]
        assert (np.diff(np.sort(real, axis=1), axis=1) > 0).all()  # distinct draws
    first = jax.jit(jax.vmap(lambda key: gumbel_max_draw(key, full)))(keys)
    assert (
        np.asarray(first) == np.asarray(jax.jit(jax.vmap(lambda key: gumbel_top_k(key, full, 1)[0][0]))(keys))
    ).all()


@pytest.mark.parametrize("sampling", [S_PLAIN, S_WARPED], ids=["T1", "T0.7-topk5-topp0.9"])
def test_recursive_rule_is_lossless(tables, sampling):
    """(x1, x2) and (x1, x2, x3) against the target's law, and the bonus after two accepted
    drafts against p(. | x1, x2); the tree draws q through the same sampling settings."""
    x1, x2, x3, n1 = sample_first_three(rule_recursive, tree_maker(sampling), tables, sampling, seed=1)
    assert (n1 == 0).mean() > 0.01 and (n1 == 2).mean() > 0.05, np.bincount(n1) / N
    p12, p123 = pvalues(tables, sampling, x1, x2, x3)
    two = n1 == 2
    p_bonus = conditional_pvalue(tables, sampling, x1[two], x2[two], x3[two])
    assert min(p12, p123, p_bonus) > P_OK, (p12, p123, p_bonus)


@pytest.mark.parametrize("broken", ["keep-q", "with-replacement"])
def test_broken_recursive_rules_fail(tables, broken, monkeypatch):
    """(a) q' kept after a rejection (later siblings verified as if drawn from the original q),
    at temperature 1; (b) siblings drawn with replacement but verified as without, warped."""
    sampling, make = S_PLAIN, tree_maker(S_PLAIN)
    if broken == "keep-q":
        monkeypatch.setattr(accept_mod, "_after_rejection", keep_q_after_rejection)
    else:
        sampling, make = S_WARPED, tree_maker(S_WARPED, draw=with_replacement)
    x1, x2, x3, _ = sample_first_three(rule_recursive, make, tables, sampling, seed=2)
    p12, p123 = pvalues(tables, sampling, x1, x2, x3)
    assert max(p12, p123) < P_BROKEN, (p12, p123)


@pytest.mark.parametrize("certain", ["last", "first"])
def test_a_certain_candidate_after_drawn_siblings(tables, certain):
    """A certain candidate (one-hot q) tried after the drawn siblings against the residual they
    leave, present only when they do not hold its token (the lookup graft's case): exact; the
    same node verified as one more draw from the siblings' q must fail."""
    x1, x2, x3, n1 = sample_first_three(rule_recursive, tree_maker(S_PLAIN, certain=certain), tables, S_PLAIN, seed=3)
    p12, p123 = pvalues(tables, S_PLAIN, x1, x2, x3)
    if certain == "last":
        assert min(p12, p123) > P_OK, (p12, p123)
    else:
        assert max(p12, p123) < P_BROKEN, (p12, p123)


def random_trees(rng):
    """5 trees of 7 nodes, random tokens and q: a chain, a bushy tree, one with invalid nodes, a
    lone root (the other nodes invalid), a star."""
    parent = np.asarray(
        [
            [-1, 0, 1, 2, 3, 4, 5],
            [-1, 0, 0, 0, 1, 1, 2],
            [-1, 0, 0, 1, 1, 2, 3],
            [-1, 0, 0, 0, 0, 0, 0],
            [-1, 0, 0, 0, 0, 0, 0],
        ],
        np.int32,
    )
    b, t = parent.shape
    valid = np.ones((b, t), bool)
    valid[2, [3, 5, 6]] = False
    valid[3, 1:] = False
    depth = np.zeros((b, t), np.int32)
    for i in range(1, t):
        depth[:, i] = depth[np.arange(b), parent[:, i]] + 1
    logq = jax.nn.log_softmax(jnp.asarray(1.5 * rng.standard_normal((b, t, V)), jnp.float32))
    return DraftTree(
        tokens=jnp.asarray(rng.integers(0, V, (b, t)), jnp.int32),
        parent=jnp.asarray(parent),
        depth=jnp.asarray(depth),
        valid=jnp.asarray(valid),
        draft_logprobs=logq,
    )


def check_batched_rows_equal_single_rows(rule, seed: int):
    """Rows with different trees (a chain, invalid nodes, a lone root) give under `rule` what
    each gives alone, drafts are accepted, and a lone root accepts nothing."""
    rng = np.random.default_rng(seed)
    tree = random_trees(rng)
    b, t = tree.tokens.shape
    logits = jnp.asarray(2.0 * rng.standard_normal((b, t, V)), jnp.float32)
    run = jax.jit(rule, static_argnums=3)
    seen = []
    for seed in range(8):
        keys = keys_of(jax.random.PRNGKey(seed), b)
        res = run(tree, logits, keys, S_PLAIN)
        for i in range(b):
            one = run(
                jax.tree_util.tree_map(lambda a, i=i: a[i : i + 1], tree), logits[i : i + 1], keys[i : i + 1], S_PLAIN
            )
            for got, want in zip(
                (res.path, res.n_accepted, res.next_token), (one.path, one.n_accepted, one.next_token)
            ):
                np.testing.assert_array_equal(got[i : i + 1], want)
        seen.append(np.asarray(res.n_accepted))
    seen = np.stack(seen)
    assert (seen[:, 3] == 0).all() and seen.max() >= 2 and (seen == 0).any()


def test_batched_rows_equal_single_rows():
    check_batched_rows_equal_single_rows(accept_recursive, seed=5)


@pytest.mark.parametrize("rule", ["match", "recursive", "traversal"])
def test_cpu_program_equals_gpu_program(rule, monkeypatch):
    """On XLA:CPU the walks skip the work of nodes no row tries by conditionals (`match` draws
    only at the nodes it reaches); the program traced for a GPU has none and does that work
    for every node: both give the same results."""
    rng = np.random.default_rng(9)
    tree = random_trees(rng)
    b, t = tree.tokens.shape
    logits = jnp.asarray(2.0 * rng.standard_normal((b, t, V)), jnp.float32)
    child = (tree.parent >= 0) & tree.valid  # the drafted tokens made likely, so `match` accepts
    logits = logits.at[jnp.arange(b)[:, None], jnp.clip(tree.parent, 0), tree.tokens].add(jnp.where(child, 3.0, 0.0))

    def program():  # a new function each time, so that it is traced anew
        def run(k):
            return accept(tree, logits, k, S_PLAIN, rule)

        return jax.make_jaxpr(run)(keys_of(jax.random.PRNGKey(0), b)), jax.jit(run)

    results = {}
    for on_cpu in (True, False):
        monkeypatch.setattr(accept_mod, "on_cpu_path", lambda on_cpu=on_cpu: on_cpu)
        jaxpr, run = program()
        assert (" cond[" in str(jaxpr)) == on_cpu
        results[on_cpu] = [run(keys_of(jax.random.PRNGKey(n), b)) for n in range(8)]
    for cpu, gpu in zip(results[True], results[False]):
        for got, want in zip((cpu.path, cpu.n_accepted, cpu.next_token), (gpu.path, gpu.n_accepted, gpu.next_token)):
            np.testing.assert_array_equal(got, want)
    assert max(int(r.n_accepted.max()) for r in results[True]) >= 1


def accepted_on_same_trees(tables, rules, seed: int, n: int = 1 << 16):
    """n_accepted [n] of each rule on the same n trees and keys at temperature 1."""

    @jit_optimised
    def run(key, tabs):
        k1, k2 = jax.random.split(key)
        tree, logits = tree_maker(S_PLAIN)(tabs, jnp.zeros((n, 0), jnp.int32), keys_of(k1, n))
        keys = keys_of(k2, n)
        return [accept(tree, logits, keys, S_PLAIN, r).n_accepted for r in rules]

    return [np.asarray(a) for a in run(jax.random.PRNGKey(seed), tables)]


def test_recursive_accepts_more_than_match(tables):
    """On the same trees at temperature 1 the recursive rule accepts more drafted tokens than
    the target drawing its own token and matching it (`match`)."""
    rec, match = (float(np.mean(a)) for a in accepted_on_same_trees(tables, ("recursive", "match"), 11))
    # Measured 1.18 and 0.57 (standard errors 0.003).
    assert rec > match + 0.3, f"mean accepted: recursive {rec:.3f}, match {match:.3f}"


@pytest.mark.parametrize("rule", ["recursive", "traversal"])
def test_drawn_tree_rule_refusals(rule):
    """One-line refusals of trees the rules over drawn trees cannot walk; greedy still goes to
    `match`."""
    tree = random_trees(np.random.default_rng(0))
    logits, keys = jnp.zeros((5, 7, V)), keys_of(jax.random.PRNGKey(0), 5)
    with pytest.raises(ValueError, match=f"{rule} acceptance needs .*draft_logprobs"):
        accept(tree.replace(draft_logprobs=None), logits, keys, S_PLAIN, rule)
    with pytest.raises(ValueError, match="acceptable"):
        accept(tree.replace(acceptable=tree.valid), logits, keys, S_PLAIN, rule)
    accept(tree.replace(draft_logprobs=None), logits, keys, SamplingConfig(), rule)


def test_beam_values_are_gumbels_conditioned_on_their_parent():
    """EAGLE-2's `recursive` trees rank children by stochastic beam search's values: each
    child's value is at most its parent's, the best child's equals it, siblings keep the order
    of their perturbed log-probabilities, and tokens of no probability get -inf."""
    from specjax.proposers.eagle import _truncated_gumbel

    rng = np.random.default_rng(0)
    phi = jnp.asarray(np.log(rng.dirichlet(np.ones(V), size=64)), jnp.float32).at[:, -1].set(-jnp.inf)
    perturbed = phi + jax.random.gumbel(jax.random.PRNGKey(0), phi.shape)
    g_parent = jnp.asarray(rng.normal(size=(64, 1)), jnp.float32)
    g = np.asarray(_truncated_gumbel(g_parent, perturbed, perturbed.max(-1, keepdims=True)))
    assert np.all(g <= np.asarray(g_parent) + 1e-5)
    np.testing.assert_allclose(g.max(-1), np.asarray(g_parent)[:, 0], atol=1e-5)
    assert np.all(np.argsort(-g[:, :-1], -1) == np.argsort(-np.asarray(perturbed)[:, :-1], -1))
    assert np.all(g[:, -1] == -np.inf)


def test_static_trees_drawn_for_recursive_must_hold_first_draws():
    """Medusa and EAGLE-1 draw their static trees for `recursive` only where each node's
    children are its first draws (ranks 0, 1, .. with none missing) (a graft's width cuts only
    greedy steps' trees, tests/test_lookup_graft.py); the refusals are one line each. A floor applies to top-k trees
    alone, so it may stay set."""
    import dataclasses

    from specjax import ModelConfig
    from specjax.proposers import PromptLookupProposer
    from specjax.proposers.eagle import EagleTreeProposer
    from specjax.proposers.lookup_graft import LookupGraftProposer
    from specjax.proposers.medusa import MC_SIM_7B_63, MedusaProposer

    cfg = ModelConfig(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        max_position_embeddings=64,
    )
    medusa = MedusaProposer(vocab_size=V, medusa_choices=MC_SIM_7B_63, acceptance="recursive")
    assert medusa.rule == "recursive" and medusa.rules == ("match", "recursive", "traversal")
    assert EagleTreeProposer(cfg, rule="recursive").rules == ("match", "recursive", "traversal")
    with pytest.raises(ValueError, match=r"tree path \[0, 2\] needs \[0, 1\] too"):
        MedusaProposer(vocab_size=V, medusa_choices=((0, 0), (0, 2)), acceptance="recursive")
    with pytest.raises(ValueError, match=r"tree path \[1\] needs \[0\] too"):
        EagleTreeProposer(cfg, eagle_choices=((1,),), rule="recursive")
    dataclasses.replace(medusa, min_prob=0.3)
    with pytest.raises(ValueError, match="typical acceptance .* replaces the recursive rule"):
        dataclasses.replace(medusa, posterior_threshold=0.09)
    with pytest.raises(ValueError, match="match, recursive or traversal rule, not 'residual'"):
        dataclasses.replace(medusa, acceptance="residual")
    LookupGraftProposer(medusa, PromptLookupProposer(3, 2, 1), width=8)  # cuts greedy trees alone
    LookupGraftProposer(dataclasses.replace(medusa, acceptance="match"), width=8)
