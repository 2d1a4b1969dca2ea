"""The `traversal` tree rule (traversal verification: leaves first, path weights), tested on
the trees and tables of test_accept_recursive.py: exact against the target's law at depth 1, 2
and the bonus (chi-square over 2**18 keys, power above 0.8 against a 2% per-cell bias, computed
in test_accept_recursive.py), three broken controls that must fail, more tokens accepted than
`recursive` on the same trees, batched rows equal to single rows, and the proposers taking it
only for trees it verifies exactly (its refusals of trees it cannot walk are tested with
`recursive`'s)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import specjax.accept as accept_mod
from specjax.accept import accept, accept_traversal
from tests.test_accept_recursive import (
    S_PLAIN,
    S_WARPED,
    V,
    accepted_on_same_trees,
    check_batched_rows_equal_single_rows,
    conditional_pvalue,
    keep_q_after_rejection,
    pvalues,
    tables,
    tree_maker,
)
from tests.test_accept_sampling import P_BROKEN, P_OK, N, sample_first_three

__all__ = ["tables"]  # the module fixture, shared


def rule_traversal(tree, logits, keys, sampling):
    return accept(tree, logits, keys, sampling, "traversal")


@pytest.mark.parametrize("sampling", [S_PLAIN, S_WARPED], ids=["T1", "T0.7-topk5-topp0.9"])
def test_traversal_rule_is_lossless(tables, sampling):
    """(x1, x2), (x1, x2, x3) and the bonus after two accepted drafts against the target's law;
    both the accept-at-once and the rejected-then-reached paths are exercised."""
    x1, x2, x3, n1 = sample_first_three(rule_traversal, tree_maker(sampling), tables, sampling, seed=21)
    assert (n1 == 0).mean() > 0.01 and (n1 == 2).mean() > 0.05, np.bincount(n1) / N
    p12, p123 = pvalues(tables, sampling, x1, x2, x3)
    two = n1 == 2
    p_bonus = conditional_pvalue(tables, sampling, x1[two], x2[two], x3[two])
    assert min(p12, p123, p_bonus) > P_OK, (p12, p123, p_bonus)


def test_traversal_with_a_certain_candidate_after_drawn_siblings(tables):
    """The lookup graft's kind of node (one-hot q, after the drawn root children, present only
    when they do not hold its token): still exact."""
    x1, x2, x3, _ = sample_first_three(rule_traversal, tree_maker(S_PLAIN, certain="last"), tables, S_PLAIN, seed=22)
    p12, p123 = pvalues(tables, S_PLAIN, x1, x2, x3)
    assert min(p12, p123) > P_OK, (p12, p123)


def keep_weight(mass, a):
    """Broken control: a node keeps its weight when a child is rejected."""
    return a


def one_weight(mass, a):
    """Broken control: a node's weight returns to 1 when a child is rejected."""
    return jnp.ones_like(a)


@pytest.mark.parametrize("broken", ["keep-q", "keep-weight", "weight-one"])
def test_broken_traversal_rules_fail(tables, broken, monkeypatch):
    """q' kept after a rejection, or the rejected node's parent keeping its weight, or its weight
    reset to 1: each biases the output, and the test sees it."""
    patch = {
        "keep-q": ("_after_rejection", keep_q_after_rejection),
        "keep-weight": ("_weight_after_rejection", keep_weight),
        "weight-one": ("_weight_after_rejection", one_weight),
    }[broken]
    monkeypatch.setattr(accept_mod, *patch)
    x1, x2, x3, _ = sample_first_three(rule_traversal, tree_maker(S_PLAIN), tables, S_PLAIN, seed=23)
    p12, p123 = pvalues(tables, S_PLAIN, x1, x2, x3)
    assert min(p12, p123) < P_BROKEN, (p12, p123)


def test_traversal_accepts_more_than_recursive(tables):
    """On the same trees at temperature 1, more drafted tokens are accepted than by `recursive`
    (a path's weight min(1, a r) is at least min(1, a) min(1, r)), and exactly as many at depth 1."""
    trav, rec = accepted_on_same_trees(tables, ("traversal", "recursive"), 12)
    # Measured 1.216 against 1.181 (0.759 and 0.759 with one or more; standard errors ~0.003).
    assert abs((trav >= 1).mean() - (rec >= 1).mean()) < 0.01, ((trav >= 1).mean(), (rec >= 1).mean())
    assert trav.mean() > rec.mean() + 0.02, f"mean accepted: traversal {trav.mean():.3f}, recursive {rec.mean():.3f}"


def test_traversal_batched_rows_equal_single_rows():
    check_batched_rows_equal_single_rows(accept_traversal, seed=6)


def test_traversal_only_where_subtrees_are_drawn_apart():
    """The proposers take `traversal` only for trees whose subtrees do not depend on each other's
    draws: EAGLE-1's static trees (each parent draws its own children), EAGLE-2/3 trees of fixed
    shape, Medusa trees with one parent per depth; the refusals are one line each."""
    from specjax import ModelConfig
    from specjax.proposers.eagle import EAGLE_DEFAULT_TREE, EagleDynamicProposer, EagleTreeProposer
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
    assert EagleTreeProposer(cfg, eagle_choices=EAGLE_DEFAULT_TREE, rule="traversal").rule == "traversal"
    for total, depth, top_k in ((4, 2, 2), (5, 2, 3), (6, 5, 1)):
        EagleDynamicProposer(cfg, total_tokens=total, depth=depth, top_k=top_k, rule="traversal")
    with pytest.raises(ValueError, match=r"shape is fixed: total_tokens - 1 <= top_k \+ 1 = 4"):
        EagleDynamicProposer(cfg, total_tokens=8, depth=2, top_k=3, rule="traversal")
    MedusaProposer(vocab_size=V, medusa_choices=((0,), (1,), (0, 0)), acceptance="traversal")
    with pytest.raises(ValueError, match="each depth of medusa_choices under one parent"):
        MedusaProposer(vocab_size=V, medusa_choices=MC_SIM_7B_63, acceptance="traversal")
