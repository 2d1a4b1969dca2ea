"""Medusa trees fitted to measured head ranks: exact estimates, optimal trees, ranks as drafted."""

from __future__ import annotations

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import ModelConfig, init_params
from specjax.model import lm_head_weight
from specjax.proposers.medusa import MedusaProposer
from specjax.training.medusa_tree import (
    decoded_tokens_per_step,
    expected_accepted,
    fit_tree,
    main,
    prefix_counts,
    true_ranks,
)

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


def _accepted(row, tree, max_rank):
    """Drafted tokens a step accepts: the longest prefix of the true ranks that is a node."""
    ok = [all(0 <= r < max_rank for r in row[:d]) and tuple(row[:d]) in tree for d in range(1, len(row) + 1)]
    return ok.index(False) if False in ok else len(ok)


def _skewed_ranks(rng, n, k, max_rank):
    ranks = np.minimum(rng.geometric(0.45, size=(n, k)) - 1, max_rank + 2)
    ranks[rng.random((n, k)) < 0.05] = -1
    return ranks


def test_estimate_is_the_mean_accepted_length():
    rng = np.random.default_rng(0)
    ranks = _skewed_ranks(rng, 3000, 4, 6)
    counts = prefix_counts(ranks, 6)
    for n in (1, 4, 13, 40):
        tree = fit_tree(counts, n)
        assert len(tree) == n and len(set(tree)) == n
        assert all(p[:-1] in tree for p in tree if len(p) > 1)  # prefix-closed
        for i, p in enumerate(tree):  # parents come first
            assert len(p) == 1 or tree.index(p[:-1]) < i
        direct = 1 + np.mean([_accepted(r, set(tree), 6) for r in ranks])
        assert expected_accepted(counts, len(ranks), tree) == pytest.approx(direct)


def test_decoding_steps_over_the_answers():
    """Each step starts after the previous one's accepted drafts and its own token."""
    ranks = np.array([[0, 0], [0, 5], [1, 0], [0, 0], [2, 0], [0, -1], [3, 3]])
    tree = [(0,), (0, 0), (1,)]
    # sequence 1 (rows 0-3): row 0 takes 2 + 1 tokens, row 3 another 2 + 1; sequence 2 (rows
    # 4-6): row 4 none (1 token), row 5 one + 1.
    assert decoded_tokens_per_step(ranks, np.array([0, 4, 7]), tree, 10) == (3 + 3 + 1 + 2) / 4
    assert decoded_tokens_per_step(ranks, np.array([0, 7]), tree, 1) == (3 + 3 + 1) / 3


def test_fitted_tree_is_the_best_of_its_size():
    """Against every prefix-closed tree of 4 nodes over ranks < 3 and depth <= 2."""
    rng = np.random.default_rng(1)
    ranks = _skewed_ranks(rng, 500, 2, 3)
    counts = prefix_counts(ranks, 3)
    nodes = [(a,) for a in range(3)] + [(a, b) for a in range(3) for b in range(3)]
    best = max(
        expected_accepted(counts, len(ranks), s)
        for s in itertools.combinations(nodes, 4)
        if all(p[:-1] in s for p in s if len(p) > 1)
    )
    fitted = expected_accepted(counts, len(ranks), fit_tree(counts, 4))
    assert fitted == pytest.approx(best)


class _Store:
    """What true_ranks reads of a FeatureStore: sequences of tokens, answer mask, final state."""

    def __init__(self, seqs):
        self.seqs = seqs

    def __len__(self):
        return len(self.seqs)

    def sequence(self, i):
        return self.seqs[i]


def test_ranks_are_where_the_proposer_drafts_the_true_token():
    """A label's rank r in head j means the proposer drafts it at node (0, ..., 0, r) of depth
    j + 1; labels outside the draft vocabulary or past the answer get -1."""
    from specjax.proposers.eagle_net import draft_vocabulary
    from specjax.spec_decode import SpecContext

    target = init_params(CFG, jax.random.PRNGKey(0), scale=0.5)
    lm_head = lm_head_weight(target)
    ids = jnp.asarray(np.random.default_rng(0).permutation(CFG.vocab_size)[:16], jnp.int32)
    rows, ids = draft_vocabulary(lm_head, ids, None)
    choices = tuple((0,) * j + (r,) for j in range(4) for r in range(16))
    proposer = MedusaProposer(num_heads=4, vocab_size=CFG.vocab_size, own_lm_head=False, medusa_choices=choices)
    heads = proposer.init_params(jax.random.PRNGKey(1), CFG.hidden_size, lm_head)
    heads = jax.tree_util.tree_map(lambda x: x + 0.3 * jax.random.normal(jax.random.PRNGKey(x.size), x.shape), heads)
    params = {"heads": heads, "lm_head": rows, "draft_ids": ids}

    rng = np.random.default_rng(2)
    seqs = []
    for length, prompt in ((12, 4), (9, 6), (5, 1)):
        draftable = rng.random(length) < 0.7  # most labels drafted, some not
        tokens = np.where(
            draftable, np.asarray(ids)[rng.integers(0, 16, length)], rng.integers(0, CFG.vocab_size, length)
        ).astype(np.int32)
        seqs.append(
            {
                "tokens": tokens,
                "mask": np.arange(length) >= prompt,
                "final": rng.normal(size=(length, CFG.hidden_size)).astype(np.float16),
            }
        )
    ranks, offsets = true_ranks(proposer, params, _Store(seqs), chunk=8)

    rows_seen = 0
    for s in seqs:
        tokens, mask, n = s["tokens"], s["mask"], len(s["tokens"])
        for t in range(n - 2):
            if not (mask[t + 1] and mask[t + 2]):
                continue
            hidden = jnp.asarray(s["final"][t : t + 1], jnp.float32)
            ctx = SpecContext(jnp.asarray(tokens[None, : t + 2]), jnp.array([t + 2]), None, hidden)
            tree, _ = proposer.propose(params, (), ctx, None, None)
            drafted = np.asarray(tree.tokens)[0, 1:].reshape(4, 16)
            for j in range(4):
                want = -1
                if t + j + 2 < n and mask[t + j + 2]:
                    hit = np.flatnonzero(drafted[j] == tokens[t + j + 2])
                    want = int(hit[0]) if len(hit) else -1
                assert ranks[rows_seen, j] == want, (t, j)
            rows_seen += 1
    assert rows_seen == len(ranks) == 7 + 2 + 3
    assert offsets.tolist() == [0, 7, 9, 12]
    assert (ranks == -1).any() and (ranks >= 0).any()


def test_cli_errors(tmp_path, capsys):
    assert main(["--heads", str(tmp_path), "--data", str(tmp_path), "--base", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no final-state features" in err and len(err.strip().splitlines()) == 1
    (tmp_path / "features" / "l1-float16").mkdir(parents=True)
    (tmp_path / "features" / "l1-float16" / "meta.json").write_text(json.dumps({"final": False}))
    assert main(["--heads", str(tmp_path), "--data", str(tmp_path), "--nodes", "0"]) == 2
    assert "--nodes" in capsys.readouterr().err
