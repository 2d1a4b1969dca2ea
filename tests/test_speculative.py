"""Speculative decoding is lossless and leaves the cache exactly as vanilla decoding does.

Covers: greedy equality with vanilla for Prompt-Lookup and Draft-Target proposers (batch 1 and 3,
ragged prompts, EOS); adversarial proposers (right, wrong, random chains and random trees); the
target's K/V after a speculative run with tree commits; tree verification against per-path
causal chains (hypothesis); and unit tests of ancestor_mask, static_tree and find_continuation.
Sampling losslessness lives in test_accept_sampling.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax import Engine, ModelConfig, PagedKVCache, SamplingConfig, causal_mask, forward, init_params
from specjax.cache import init_pages, pages_needed
from specjax.draft_tree import DraftTree, ancestor_mask, chain, static_tree
from specjax.generate import DecodeState, bucket, decode_loop, prefill
from specjax.kernels_pallas.tree_paged_attention_reference import gather_pages
from specjax.proposers import DraftModelProposer, PromptLookupProposer, self_draft_params
from specjax.proposers.draft_model import self_draft_config
from specjax.proposers.prompt_lookup import find_continuation
from specjax.spec_decode import SpecContext, SpecState, StatelessProposer, init_proposer, spec_loop
from specjax.verify import verify

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
# A different, smaller random draft model with the target's vocabulary.
DRAFT_CFG = ModelConfig(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    max_position_embeddings=256,
)
V = CFG.vocab_size
PAGE, NUM_PAGES = 4, 192
N_NEW = 24
# Ragged prompts; the first is repetitive so Prompt-Lookup finds matches, the last is 1 token.
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9, 10, 7, 8], [40]]
# The target (seed 5) falls into a loop after this prompt: Prompt-Lookup accepts long runs.
REPETITIVE = [32, 38, 32, 38, 32, 38]
# "No EOS" as a one-element array (a token id never generated), so that runs with and without
# EOS share compiled shapes.
NO_EOS = (-1,)
# Tree topology of the adversarial tree proposer (Medusa-style child-rank paths).
TREE_PATHS = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (0, 0, 0), (0, 0, 1), (1, 0, 0), (0, 0, 0, 0))


@pytest.fixture(scope="module")
def target():
    return init_params(CFG, jax.random.PRNGKey(5), scale=0.5)


@pytest.fixture(scope="module")
def engine(target):
    return Engine(target, CFG, num_pages=NUM_PAGES, page_size=PAGE)


@pytest.fixture(scope="module")
def vanilla_all(engine):
    """Vanilla greedy outputs of PROMPTS + [REPETITIVE], N_NEW + 8 tokens each (the extra
    tokens let the oracle proposers draft past the end)."""
    out = engine.generate(PROMPTS + [REPETITIVE], N_NEW + 8, eos_token_ids=NO_EOS)
    assert out.steps == [N_NEW + 8] * 4
    return out.token_ids


@pytest.fixture(scope="module")
def vanilla(vanilla_all):
    return vanilla_all[:3]


def _check_equal(out, vanilla_ids, n=N_NEW):
    assert len(out.token_ids) == len(vanilla_ids)
    for got, want in zip(out.token_ids, vanilla_ids):
        assert got == want[:n]


# ---------------------------------------------------------------------------------------------
# 1. Greedy output equals vanilla greedy decoding


def _simulate(prompt_len, accepted_at, k):
    """(steps, accepted_hist) of a lossless run whose step at length L accepts accepted_at(L)
    drafts (what the engine must report, given the drafts a correct proposer makes)."""
    length, steps, hist = prompt_len, 0, [0] * (k + 1)
    while length - prompt_len < N_NEW:
        n = accepted_at(length)
        hist[n] += 1
        steps += 1
        length += min(n + 1, N_NEW - (length - prompt_len))
    return steps, hist


def _leading(drafts, truth):
    n = 0
    while n < len(drafts) and n < len(truth) and drafts[n] == truth[n]:
        n += 1
    return n


def _pld_drafts(tokens, k, max_ngram):
    """Reference Prompt-Lookup: earliest earlier occurrence of the longest matching n-gram."""
    length = len(tokens)
    for n in range(max_ngram, 0, -1):
        if length < n:
            continue
        suffix = tokens[length - n :]
        for j in range(length - n):
            if tokens[j : j + n] == suffix:
                return tokens[j + n : j + n + k]
    return []


def _check_pld_counts(out, prompts, vanilla_ids, k, max_ngram):
    for i, (p, full) in enumerate(zip(prompts, vanilla_ids)):
        seq = p + full

        def accepted_at(length):
            return _leading(_pld_drafts(seq[:length], k, max_ngram), seq[length:])

        assert (out.steps[i], out.accepted_hist[i]) == _simulate(len(p), accepted_at, k)


def test_prompt_lookup_greedy_equals_vanilla(engine, vanilla_all):
    k = 3
    pld = PromptLookupProposer(prompt_lookup_num_tokens=k, max_matching_ngram_size=3)
    out = engine.generate(PROMPTS, N_NEW, eos_token_ids=NO_EOS, proposer=pld, fixed_speculation=True)
    _check_equal(out, vanilla_all[:3])
    # The drafts were the Prompt-Lookup drafts: per-step acceptance counts as simulated.
    _check_pld_counts(out, PROMPTS, vanilla_all, k, 3)
    # Batch 1, on a prompt after which the target loops: Prompt-Lookup must accept long runs.
    rep = engine.generate([REPETITIVE], N_NEW, eos_token_ids=NO_EOS, proposer=pld, fixed_speculation=True)
    _check_equal(rep, vanilla_all[3:])
    _check_pld_counts(rep, [REPETITIVE], vanilla_all[3:], k, 3)
    assert rep.mean_accepted[0] > 2.0, rep.mean_accepted
    assert rep.acceptance_rates()[0] > 0.3


def _draft(kind, target):
    if kind == "self":  # the target's first layer with its norm and head
        return (DraftModelProposer(self_draft_config(CFG, 1), max_draft_len=3), self_draft_params(target, 1))
    if kind == "self-logits":
        return (
            DraftModelProposer(self_draft_config(CFG, 1), max_draft_len=3, use_logits=True),
            self_draft_params(target, 1),
        )
    if kind == "full":  # the target itself: every draft is right
        return DraftModelProposer(CFG, max_draft_len=3), target
    return (DraftModelProposer(DRAFT_CFG, max_draft_len=3), init_params(DRAFT_CFG, jax.random.PRNGKey(7), scale=0.5))


@pytest.mark.parametrize("kind", ["self", "self-logits", "random-small"])
def test_draft_model_greedy_equals_vanilla(engine, target, vanilla, kind):
    proposer, params = _draft(kind, target)
    if kind == "self-logits":  # batch 1, a one-token prompt (shares no compile with the others)
        prompts, want = PROMPTS[2:], vanilla[2:]
    else:
        prompts, want = PROMPTS, vanilla
    out = engine.generate(
        prompts, N_NEW, eos_token_ids=NO_EOS, proposer=proposer, proposer_params=params, fixed_speculation=True
    )
    _check_equal(out, want)
    # The drafts were the draft model's greedy continuations (its cache stayed in sync): a step
    # at length L accepts as many drafts as the draft's argmax agrees with the target's output
    # from there on.
    k = proposer.max_draft_len
    seqs = [p + full for p, full in zip(prompts, want)]
    agree = _draft_agreement(params, proposer.config, seqs)
    for i, (p, a) in enumerate(zip(prompts, agree)):
        expect = _simulate(len(p), lambda n: _leading(a[n - 1 : n - 1 + k], [True] * k), k)
        assert (out.steps[i], out.accepted_hist[i]) == expect, i
    if kind == "self":  # not vacuous: the one-layer self-draft agrees with the target at times
        assert sum(out.steps) < 3 * N_NEW


@functools.partial(jax.jit, static_argnames=("cfg",))
def _greedy_preds(params, cfg, tokens, cache):
    b, w = tokens.shape
    out = forward(params, cfg, tokens, jnp.broadcast_to(jnp.arange(w), (b, w)), cache, causal_mask(b, w))
    return jnp.argmax(out.logits, -1)


def _draft_agreement(params, cfg, seqs):
    """agree[i][j]: the draft model's argmax after seqs[i][:j + 1] equals seqs[i][j + 1]."""
    b, w = len(seqs), max(len(s) for s in seqs)
    arr = np.zeros((b, w), np.int32)
    for i, s in enumerate(seqs):
        arr[i, : len(s)] = s
    per_seq = -(-w // PAGE)
    k_pages, v_pages = init_pages(cfg, b * per_seq, PAGE)
    table = jnp.arange(b * per_seq, dtype=jnp.int32).reshape(b, per_seq)
    cache = PagedKVCache(k_pages, v_pages, table, jnp.zeros((b,), jnp.int32))
    pred = np.asarray(_greedy_preds(params, cfg, jnp.asarray(arr), cache))
    return [[bool(pred[i, j] == s[j + 1]) for j in range(len(s) - 1)] for i, s in enumerate(seqs)]


def test_full_self_draft_accepts_everything(engine, target, vanilla):
    """A draft identical to the target is always right: K + 1 tokens per pass."""
    proposer, params = _draft("full", target)
    k = proposer.max_draft_len
    out = engine.generate(
        PROMPTS, N_NEW, eos_token_ids=NO_EOS, proposer=proposer, proposer_params=params, fixed_speculation=True
    )
    _check_equal(out, vanilla)
    assert out.steps == [math.ceil(N_NEW / (k + 1))] * 3
    assert out.acceptance_rates() == [1.0] * k


def test_eos_stops_where_vanilla_stops(engine, target, vanilla):
    eos = vanilla[0][9]  # a token sequence 0 emits mid-output
    # Vanilla stops right after the first EOS (tests/test_generate.py checks that).
    want = []
    for full in vanilla:
        head = full[:N_NEW]
        want.append(head[: head.index(eos) + 1] if eos in head else head)
    assert len(want[0]) <= 10
    cases = [
        (PromptLookupProposer(prompt_lookup_num_tokens=3, max_matching_ngram_size=3), None),
        _draft("self", target),
        _draft("full", target),
        (OracleProposer(tree=True), _oracle_params(vanilla)),
    ]
    for proposer, params in cases:
        out = engine.generate(PROMPTS, N_NEW, eos_token_ids=(eos,), proposer=proposer, proposer_params=params)
        assert out.token_ids == want, proposer
        assert out.finished_by_eos == [w[-1] == eos for w in want]


# ---------------------------------------------------------------------------------------------
# 2. Adversarial drafts


MODES = {"right": 0, "wrong": 1, "random": 2}


@dataclasses.dataclass(frozen=True)
class OracleProposer(StatelessProposer):
    """Test proposer drafting around the known vanilla continuation.

    proposer_params: {"rows": int32[B, W] prompt + vanilla output, "mode": int32 scalar}.
    Chains (tree=False) draft, by mode: the vanilla tokens ("right"), never the vanilla token
    ("wrong"), or random tokens (the mode is traced, so the three share one compile).
    tree=True drafts a static tree of TREE_PATHS where, under every node, one child at a random
    rank holds the right token and the others wrong ones (sometimes a duplicate of the right
    one), and random subtrees are invalid.
    """

    tree: bool = False
    max_draft_len: int = 3
    vocab: int = V
    rule: str = "match"

    @property
    def is_chain(self) -> bool:
        return not self.tree

    @property
    def tree_size(self) -> int:
        return len(TREE_PATHS) + 1 if self.tree else self.max_draft_len + 1

    @staticmethod
    def _right(rows, ctx, offsets):
        """Vanilla tokens at positions lengths - 1 + offsets ([B, n])."""
        idx = jnp.clip(ctx.lengths[:, None] - 1 + offsets, 0, rows.shape[1] - 1)
        return jnp.take_along_axis(rows, idx, axis=1)

    def _randint(self, keys, n, high):
        return jax.vmap(lambda kk: jax.random.randint(kk, (n,), 0, high))(keys)

    def propose(self, params, state, ctx, keys, sampling):
        b = ctx.tokens.shape[0]
        rows = params["rows"]
        pending = ctx.tokens[jnp.arange(b), ctx.lengths - 1]
        k_a, k_b, k_c, k_d = (jax.vmap(lambda kk: jax.random.split(kk, 4))(keys)[:, i] for i in range(4))
        if not self.tree:
            k = self.max_draft_len
            right = self._right(rows, ctx, jnp.arange(1, k + 1)[None, :])
            wrong = (right + 1 + self._randint(k_a, k, self.vocab - 1)) % self.vocab
            drafts = jnp.select(
                [params["mode"] == 0, params["mode"] == 1], [right, wrong], self._randint(k_b, k, self.vocab)
            )
            return chain(pending, drafts, jnp.full((b,), k, jnp.int32)), state

        parent_np, depth_np, rank_np = static_tree(TREE_PATHS)
        t = parent_np.shape[0]
        n_children = np.maximum(np.bincount(parent_np[1:], minlength=t), 1)
        # The rank of the right child under every node, drawn per step.
        pick = jax.vmap(lambda kk: jax.random.randint(kk, (t,), 0, jnp.asarray(n_children)))(k_a)
        right = self._right(rows, ctx, jnp.asarray(depth_np)[None, :])  # [B, T]
        is_right = jnp.asarray(rank_np)[None, :] == pick[:, np.maximum(parent_np, 0)]
        wrong = (right + 1 + self._randint(k_b, t, self.vocab - 1)) % self.vocab
        dup = jax.vmap(lambda kk: jax.random.bernoulli(kk, 0.15, (t,)))(k_c)
        tokens = jnp.where(is_right | dup, right, wrong).at[:, 0].set(pending)
        drop = jax.vmap(lambda kk: jax.random.bernoulli(kk, 0.15, (t,)))(k_d)
        valid = jnp.ones((b, t), bool)
        for i in range(1, t):  # an invalid node takes its subtree with it
            valid = valid.at[:, i].set(valid[:, parent_np[i]] & ~drop[:, i])
        tree = DraftTree(
            tokens=jnp.where(valid, tokens, 0).astype(jnp.int32),
            parent=jnp.broadcast_to(jnp.asarray(parent_np), (b, t)),
            depth=jnp.broadcast_to(jnp.asarray(depth_np), (b, t)),
            valid=valid,
        )
        return tree, state


def _oracle_params(vanilla_ids, mode="right"):
    width = max(len(p) for p in PROMPTS) + len(vanilla_ids[0])
    rows = np.zeros((len(PROMPTS), width), np.int32)
    for i, (p, o) in enumerate(zip(PROMPTS, vanilla_ids)):
        rows[i, : len(p) + len(o)] = p + o
    return {"rows": jnp.asarray(rows), "mode": jnp.int32(MODES.get(mode, 0))}


@pytest.mark.parametrize("mode", ["right", "wrong", "random", "tree"])
def test_adversarial_drafts_keep_output(engine, vanilla, mode):
    proposer = OracleProposer(tree=mode == "tree")
    k = proposer.max_draft_len
    out = engine.generate(
        PROMPTS,
        N_NEW,
        eos_token_ids=NO_EOS,
        proposer=proposer,
        proposer_params=_oracle_params(vanilla, mode),
        fixed_speculation=True,
    )
    _check_equal(out, vanilla)
    hist = np.asarray(out.accepted_hist)
    assert (hist.sum(axis=1) == out.steps).all()
    if mode == "right":  # K + 1 tokens every pass
        assert out.steps == [math.ceil(N_NEW / (k + 1))] * 3
        assert (hist[:, k] == out.steps).all()
    elif mode == "wrong":  # exactly one token per pass
        assert out.steps == [N_NEW] * 3 and (hist[:, 0] == N_NEW).all()
        assert out.mean_accepted == [1.0] * 3
    elif mode == "tree":  # right paths of depth up to 4 exist in most trees
        assert min(out.mean_accepted) > 2.0, out.mean_accepted
        assert hist[:, 3:].sum() > 0


# ---------------------------------------------------------------------------------------------
# 3. The target cache after a speculative run holds exactly vanilla's K/V


def _direct_run(params, prompts, max_new, proposer=None, proposer_params=None):
    """Prefill + decode_loop/spec_loop (as Engine._run drives them) on our own NaN-filled pools
    with a scrambled page table; returns (tokens, lengths, cache).

    Shapes equal the engine's for the tree proposer (same pool size, table width and buffers),
    so the compiled spec_loop is shared with the engine tests.
    """
    b = len(prompts)
    lens = [len(p) for p in prompts]
    tree_size = OracleProposer(tree=True).tree_size
    per_seq = pages_needed(bucket(max(lens) + max_new + tree_size), PAGE)
    table = np.random.default_rng(1).permutation(NUM_PAGES)[: b * per_seq].reshape(b, per_seq)
    k_pages, v_pages = init_pages(CFG, NUM_PAGES, PAGE)
    k_pages = [jnp.full_like(x, jnp.nan) for x in k_pages]
    v_pages = [jnp.full_like(x, jnp.nan) for x in v_pages]
    cache = PagedKVCache(k_pages, v_pages, jnp.asarray(table, jnp.int32), jnp.zeros((b,), jnp.int32))
    chunk = np.zeros((b, bucket(max(lens) - 1)), np.int32)
    for i, p in enumerate(prompts):
        chunk[i, : len(p) - 1] = p[:-1]
    lengths = jnp.asarray(lens, jnp.int32)
    cache, features, _ = prefill(params, CFG, cache, jnp.asarray(chunk), lengths - 1)
    buf = np.zeros((b, per_seq * PAGE + 1), np.int32)
    for i, p in enumerate(prompts):
        buf[i, : len(p)] = p
    tokens = jnp.asarray(buf)
    keys = jnp.stack([jax.random.PRNGKey(i) for i in range(b)])
    common = dict(
        tokens=tokens,
        lengths=lengths,
        prompt_lengths=lengths + 0,
        done=jnp.zeros((b,), bool),
        steps=jnp.zeros((b,), jnp.int32),
        keys=keys,
        cache=cache,
    )
    eos = jnp.asarray(NO_EOS, jnp.int32)
    if proposer is None:
        state = decode_loop(params, CFG, SamplingConfig(), DecodeState(**common), jnp.int32(max_new), eos)
    else:
        ctx = SpecContext(tokens, lengths, cache.block_tables, features)
        pstate = init_proposer(proposer, proposer_params, None, ctx, jnp.asarray(chunk), lengths - 1)
        state = SpecState(
            **common,
            features=features,
            proposer_state=pstate,
            accepted_hist=jnp.zeros((b, proposer.tree_size), jnp.int32),
        )
        state = spec_loop(params, CFG, proposer, proposer_params, SamplingConfig(), state, jnp.int32(max_new), eos)
    return np.asarray(state.tokens), np.asarray(state.lengths), state.cache


def test_cache_after_tree_commits_equals_vanilla(target, vanilla):
    van_tok, van_len, van_cache = _direct_run(target, PROMPTS, N_NEW)
    spec = _direct_run(target, PROMPTS, N_NEW, OracleProposer(tree=True), _oracle_params(vanilla))
    spec_tok, spec_len, spec_cache = spec
    np.testing.assert_array_equal(spec_len, van_len)
    for i, n in enumerate(van_len):
        np.testing.assert_array_equal(spec_tok[i, :n], van_tok[i, :n])
        assert spec_tok[i, len(PROMPTS[i]) : n].tolist() == vanilla[i][:N_NEW]
    assert (np.asarray(spec_cache.lengths) >= van_len - 1).all()
    for layer in range(CFG.num_layers):
        for name in ("k_pages", "v_pages"):
            want = np.asarray(gather_pages(getattr(van_cache, name)[layer], van_cache.block_tables))
            got = np.asarray(gather_pages(getattr(spec_cache, name)[layer], spec_cache.block_tables))
            for i, n in enumerate(van_len):
                w, g = want[:, i, : n - 1], got[:, i, : n - 1]  # [KVH, slots, D]
                assert np.isfinite(w).all() and np.isfinite(g).all()
                np.testing.assert_allclose(
                    g, w, rtol=1e-5, atol=1e-5 * np.abs(w).max(), err_msg=f"layer {layer} {name} seq {i}"
                )


# ---------------------------------------------------------------------------------------------
# 5. Tree verification equals running every root-to-node path as a causal chain

T_TREE = 8
VERIFY_PROMPTS = [[3, 14, 15, 9, 26], [5, 35, 8, 9, 7, 9, 32, 38, 46]]


@pytest.fixture(scope="module")
def verify_setup(target):
    b = len(VERIFY_PROMPTS)
    per_seq = 5
    k_pages, v_pages = init_pages(CFG, b * per_seq, PAGE)
    k_pages = [jnp.full_like(x, jnp.nan) for x in k_pages]
    v_pages = [jnp.full_like(x, jnp.nan) for x in v_pages]
    table = jnp.asarray(np.arange(b * per_seq)[::-1].reshape(b, per_seq).copy(), jnp.int32)
    cache = PagedKVCache(k_pages, v_pages, table, jnp.zeros((b,), jnp.int32))
    chunk = np.zeros((b, 16), np.int32)
    for i, p in enumerate(VERIFY_PROMPTS):
        chunk[i, : len(p) - 1] = p[:-1]
    n = jnp.asarray([len(p) - 1 for p in VERIFY_PROMPTS], jnp.int32)
    cache, _, _ = prefill(target, CFG, cache, jnp.asarray(chunk), n)
    run_verify = jax.jit(lambda tree: verify(target, CFG, cache, tree).logits)

    # Reference: every (sequence, node) as its own causal chain from an empty cache.
    width = max(len(p) for p in VERIFY_PROMPTS) - 1 + T_TREE
    rows = b * T_TREE
    ref_pages = -(-width // PAGE)
    rk, rv = init_pages(CFG, rows * ref_pages, PAGE)
    ref_cache = PagedKVCache(
        rk, rv, jnp.arange(rows * ref_pages, dtype=jnp.int32).reshape(rows, ref_pages), jnp.zeros((rows,), jnp.int32)
    )

    @jax.jit
    def run_chains(tokens, at):
        pos = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (rows, width))
        out = forward(target, CFG, tokens, pos, ref_cache, causal_mask(rows, width), logits_at=at[:, None])
        return out.logits[:, 0]

    return run_verify, run_chains, width


@st.composite
def trees(draw):
    """B random valid trees of T_TREE nodes: parent[i] < i, random tokens, invalid subtrees."""
    out = []
    for _ in VERIFY_PROMPTS:
        parent = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, T_TREE)]
        tokens = [draw(st.integers(0, V - 1)) for _ in range(T_TREE)]
        valid = [True]
        for i in range(1, T_TREE):
            valid.append(valid[parent[i]] and draw(st.integers(0, 4)) > 0)
        out.append((parent, tokens, valid))
    return out


@settings(max_examples=25, deadline=None)
@given(trees())
def test_tree_verify_equals_per_path_chains(verify_setup, batch):
    run_verify, run_chains, width = verify_setup
    b = len(VERIFY_PROMPTS)
    parent = np.asarray([t[0] for t in batch], np.int32)
    tokens = np.asarray([t[1] for t in batch], np.int32)
    tokens[:, 0] = [p[-1] for p in VERIFY_PROMPTS]
    valid = np.asarray([t[2] for t in batch], bool)
    depth = np.zeros_like(parent)
    for i in range(1, T_TREE):
        depth[:, i] = depth[np.arange(b), parent[:, i]] + 1
    tree = DraftTree(
        tokens=jnp.asarray(tokens), parent=jnp.asarray(parent), depth=jnp.asarray(depth), valid=jnp.asarray(valid)
    )
    got = np.asarray(run_verify(tree))
    chains = np.zeros((b * T_TREE, width), np.int32)
    at = np.zeros((b * T_TREE,), np.int32)
    for s, prompt in enumerate(VERIFY_PROMPTS):
        for i in range(T_TREE):
            path, j = [], i
            while j >= 0:
                path.append(int(tokens[s, j]))
                j = int(parent[s, j])
            seq = prompt[:-1] + path[::-1]  # the root (node 0) is the pending token
            chains[s * T_TREE + i, : len(seq)] = seq
            at[s * T_TREE + i] = len(seq) - 1
    want = np.asarray(run_chains(jnp.asarray(chains), jnp.asarray(at))).reshape(b, T_TREE, V)
    assert np.isfinite(got).all()
    err = np.abs(got - want)[valid].max() / np.abs(want[valid]).max()
    assert err < 1e-4, err


def _two_prefilled_trees(target, valid, cfg=CFG):
    """A cache holding two prefilled prompts (7 and 3 tokens) and a 7-node tree for each."""
    b, per_seq = 2, 6
    k_pages, v_pages = init_pages(cfg, b * per_seq, PAGE)
    table = jnp.asarray(np.arange(b * per_seq).reshape(b, per_seq), jnp.int32)
    cache = PagedKVCache(k_pages, v_pages, table, jnp.zeros((b,), jnp.int32))
    chunk = jnp.asarray([[3, 4, 5, 6, 7, 8, 9], [10, 11, 12, 0, 0, 0, 0]], jnp.int32)
    cache, _, _ = prefill(target, cfg, cache, chunk, jnp.asarray([7, 3], jnp.int32))
    parent = np.array([[-1, 0, 0, 1, 1, 2, 3], [-1, 0, 1, 2, 0, 4, 4]], np.int32)
    depth = np.zeros_like(parent)
    for i in range(1, parent.shape[1]):
        depth[:, i] = depth[np.arange(b), parent[:, i]] + 1
    tree = DraftTree(
        tokens=jnp.asarray(np.arange(14).reshape(b, 7) % cfg.vocab_size, jnp.int32),
        parent=jnp.asarray(parent),
        depth=jnp.asarray(depth),
        valid=jnp.asarray(valid),
    )
    return cache, tree


def test_verify_with_deferred_writes_equals_written(target):
    """verify_pruned's branches return their K/V (written after lax.switch, so XLA updates the
    pools in place): logits and the resulting pools equal those of writing inside the pass, and
    the compiled speculative loop copies no pool (the Pallas path: test_pallas_kernels)."""
    check_deferred_writes(target, CFG)


def check_deferred_writes(target, cfg, tol=1e-5, compiled=True):
    """Deferred verify writes equal written ones, and the compiled spec loop copies no pool
    (compiled=False: no `lax.switch`/`cond` in the traced loop returns a pool, the cause of
    those copies; for the Pallas kernel, whose interpret mode on CPU copies its inputs itself)."""
    b = 2
    valid = np.array([[1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0]], bool)
    cache, tree = _two_prefilled_trees(target, valid, cfg)
    from specjax.verify import verify_pruned

    run = jax.jit(lambda cache, tree: verify_pruned(target, cfg, cache, tree))
    got = run(cache, tree)
    want = jax.jit(lambda cache, tree: verify_pruned(target, cfg, cache, tree, defer_writes=False))(cache, tree)
    # Same arithmetic, fused differently: equal up to float32 rounding.
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=tol, atol=tol)
    for a, w in zip(got[2].k_pages + got[2].v_pages, want[2].k_pages + want[2].v_pages):
        # (the pool's last page is the write sink: unread, its contents differ)
        np.testing.assert_allclose(np.asarray(a)[:, :-1], np.asarray(w)[:, :-1], rtol=1e-5, atol=1e-5)

    proposer = PromptLookupProposer(prompt_lookup_num_tokens=6)
    state = SpecState(
        tokens=jnp.zeros((b, 32), jnp.int32),
        lengths=jnp.asarray([8, 4]),
        prompt_lengths=jnp.asarray([8, 4]),
        done=jnp.zeros((b,), bool),
        steps=jnp.zeros((b,), jnp.int32),
        keys=jnp.zeros((b, 2), jnp.uint32),
        cache=cache,
        features=jnp.zeros((b, cfg.hidden_size)),
        proposer_state=None,
        accepted_hist=jnp.zeros((b, 7), jnp.int32),
    )
    args = (target, cfg, proposer, None, SamplingConfig(), state, jnp.int32(4), jnp.asarray([-1], jnp.int32))
    if not compiled:
        pool_shapes = {tuple(p.shape) for p in cache.k_pages}
        returned = [
            tuple(v.aval.shape)
            for e in _all_eqns(spec_loop.trace(*args).jaxpr.jaxpr)
            if e.primitive.name == "cond"
            for v in e.outvars
        ]
        assert not pool_shapes & set(returned), "a cond branch returns a KV pool"
        return
    hlo = spec_loop.lower(*args).compile().as_text()
    hlo_dtype = cache.k_pages[0].dtype.name.replace("float", "f")  # f32, bf16
    pool = f"{hlo_dtype}[" + ",".join(map(str, cache.k_pages[0].shape)) + "]"
    copies = [line for line in hlo.splitlines() if pool in line and " copy(" in line]
    assert not copies, copies[:3]


def _all_eqns(jaxpr):
    """Every equation of a jaxpr, those inside sub-jaxprs (loops, conds, pjit) included."""
    for e in jaxpr.eqns:
        yield e
        for p in e.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _all_eqns(inner)


def test_commit_from_unwritten_node_kv_equals_commit_after_writing(target):
    """spec_step commits the accepted path straight from the verify pass's unwritten K/V
    (`verify_pruned_kv`): the committed slots equal those of writing every node, then moving
    the path's."""
    from specjax.commit import commit
    from specjax.verify import verify_pruned, verify_pruned_kv

    valid = np.array([[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]], bool)
    cache, tree = _two_prefilled_trees(target, valid)
    path = jnp.asarray([[0, 1, 3, 0, 0, 0, 0], [0, 4, 5, 0, 0, 0, 0]], jnp.int32)
    n_acc, active = jnp.asarray([2, 2], jnp.int32), jnp.asarray([True, True])
    written = commit(verify_pruned(target, CFG, cache, tree)[2], path, n_acc, active)
    _, _, unwritten, node_kv = verify_pruned_kv(target, CFG, cache, tree)
    assert node_kv is not None
    direct = commit(unwritten, path, n_acc, active, new_kv=node_kv)
    np.testing.assert_array_equal(direct.lengths, [10, 6])
    np.testing.assert_array_equal(direct.lengths, written.lengths)
    for a, w in zip(direct.k_pages + direct.v_pages, written.k_pages + written.v_pages):
        got, want = (np.asarray(gather_pages(x, cache.block_tables)) for x in (a, w))
        for i, n in enumerate([10, 6]):
            np.testing.assert_array_equal(got[:, i, :n], want[:, i, :n])


def test_greedy_draws_are_the_argmax_of_the_verified_logits(target):
    """`verify_pruned_kv(..., greedy_draws=True)` (greedy steps) gives each node's argmax of the
    logits the plain pass returns, 0 past the verified width, and the same hidden states."""
    from specjax.verify import verify_pruned_kv

    valid = np.array([[1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0]], bool)  # verified 4 wide
    cache, tree = _two_prefilled_trees(target, valid)
    logits, hidden, _, _ = verify_pruned_kv(target, CFG, cache, tree)
    draws, hidden2, _, _ = verify_pruned_kv(target, CFG, cache, tree, greedy_draws=True)
    assert draws.dtype == jnp.int32 and draws.shape == tree.tokens.shape
    np.testing.assert_array_equal(draws[:, :4], np.argmax(logits, -1)[:, :4])
    np.testing.assert_array_equal(draws[:, 4:], 0)
    assert len(set(np.asarray(draws[:, :4]).ravel().tolist())) > 1  # not a constant
    np.testing.assert_array_equal(hidden2, hidden)


@pytest.mark.parametrize("backend", ["xla", "written"])
def test_padded_verify_equals_unpadded(target, monkeypatch, backend):
    """A whole 7-node tree is verified padded to 8 nodes: its logits, features and pools equal
    those of one unpadded pass, and the padding writes nothing."""
    import specjax.verify as verify_mod
    from specjax.cpu.matmul import unsupported_reason, use_cpu_matmul

    if unsupported_reason() is None:  # the CPU kernel has no costly widths: nothing is padded
        with use_cpu_matmul("kernel"):
            assert [verify_mod.padded_width(t) for t in (5, 7, 9, 15)] == [5, 7, 9, 15]
            assert verify_mod.verify_widths(10, (5, 12)) == (1, 4, 5, 8, 10)
    monkeypatch.setattr(verify_mod, "kernel_in_use", lambda: False)  # XLA's products pad
    assert [verify_mod.padded_width(t) for t in (1, 4, 5, 7, 8, 9, 15, 16, 20, 64)] == [
        1,
        4,
        8,
        8,
        8,
        16,
        16,
        16,
        20,
        64,
    ]
    assert verify_mod.verify_widths(7) == (1, 4, 8) and verify_mod.verify_widths(9) == (1, 4, 8, 16)
    assert verify_mod.verify_widths(10, (5,)) == (1, 4, 8, 16)  # a likely width is padded too
    cache, tree = _two_prefilled_trees(target, np.ones((2, 7), bool))
    logits, hidden, got = jax.jit(
        lambda cache, tree: verify_mod.verify_pruned(target, CFG, cache, tree, defer_writes=backend == "xla")
    )(cache, tree)
    want = jax.jit(lambda cache, tree: verify(target, CFG, cache, tree))(cache, tree)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want.logits), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(hidden), np.asarray(want.hidden), rtol=1e-5, atol=1e-5)
    for a, w in zip(got.k_pages + got.v_pages, want.cache.k_pages + want.cache.v_pages):
        np.testing.assert_allclose(
            np.asarray(a)[:, :-1], np.asarray(w)[:, :-1], rtol=1e-5, atol=1e-5
        )  # (the last page is the write sink)


def test_verify_at_a_likely_width_equals_the_whole_tree(target, monkeypatch):
    """A 7-node tree whose first 5 nodes are valid, verified at the likely width 5 (a graft
    without a lookup continuation): the valid nodes' logits and features equal a whole pass."""
    import specjax.verify as verify_mod

    # Widths as under the CPU kernel (unpadded) on any machine; XLA's products would pad 5 to 8.
    monkeypatch.setattr(verify_mod, "kernel_in_use", lambda: True)
    valid = np.array([[1] * 5 + [0] * 2] * 2, bool)
    cache, tree = _two_prefilled_trees(target, valid)
    logits, hidden, _ = jax.jit(
        lambda cache, tree: verify_mod.verify_pruned(target, CFG, cache, tree, likely_widths=(5,))
    )(cache, tree)
    want = jax.jit(lambda cache, tree: verify(target, CFG, cache, tree))(cache, tree)
    np.testing.assert_allclose(np.asarray(logits)[:, :5], np.asarray(want.logits)[:, :5], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(hidden)[:, :5], np.asarray(want.hidden)[:, :5], rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(logits)[:, 5:])  # nodes past the width come back as zeros


# ---------------------------------------------------------------------------------------------
# 6. Unit tests


def test_ancestor_mask_hand_tree():
    #        0
    #      / | \
    #     1  2  7(invalid)
    #    / \  \
    #   3   4  5
    #   |
    #   6
    parent = np.array([[-1, 0, 0, 1, 1, 2, 3, 0]], np.int32)
    depth = np.array([[0, 1, 1, 2, 2, 2, 3, 1]], np.int32)
    valid = np.array([[True] * 7 + [False]])
    tree = DraftTree(
        tokens=jnp.arange(8, dtype=jnp.int32)[None],
        parent=jnp.asarray(parent),
        depth=jnp.asarray(depth),
        valid=jnp.asarray(valid),
    )
    want = np.zeros((8, 8), bool)
    ancestors = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 1, 4], 5: [0, 2, 5], 6: [0, 1, 3, 6], 7: [7]}
    for i, js in ancestors.items():
        want[i, js] = True
    np.testing.assert_array_equal(np.asarray(ancestor_mask(tree))[0], want)
    # A chain is lower triangular; its invalid tail sees only itself.
    c = chain(jnp.array([5, 6]), jnp.array([[1, 2, 3], [4, 5, 6]]), jnp.array([3, 1]))
    m = np.asarray(ancestor_mask(c))
    np.testing.assert_array_equal(m[0], np.tril(np.ones((4, 4), bool)))
    want1 = np.tril(np.ones((4, 4), bool))
    want1[2:] = np.eye(4, dtype=bool)[2:]
    np.testing.assert_array_equal(m[1], want1)
    np.testing.assert_array_equal(np.asarray(c.tokens), [[5, 1, 2, 3], [6, 4, 0, 0]])


def test_static_tree_order_and_missing_prefix():
    parent, depth, rank = static_tree([(1,), (0, 1), (0,), (1, 0), (0, 0), (0, 0, 0), (0,)])
    # Sorted by depth then path: (0,), (1,), (0,0), (0,1), (1,0), (0,0,0); duplicates dropped.
    np.testing.assert_array_equal(parent, [-1, 0, 0, 1, 1, 2, 3])
    np.testing.assert_array_equal(depth, [0, 1, 1, 2, 2, 2, 3])
    np.testing.assert_array_equal(rank, [0, 0, 1, 0, 1, 0, 0])
    assert all(p < i for i, p in enumerate(parent) if i)
    with pytest.raises(ValueError, match="prefix"):
        static_tree([(0,), (1, 0)])
    with pytest.raises(ValueError, match="prefix"):
        static_tree([(0,), (0, 0, 0)])


def _find(rows, lengths, ngram, num):
    s = max(len(r) for r in rows)
    arr = np.zeros((len(rows), s), np.int32)
    for i, r in enumerate(rows):
        arr[i, : len(r)] = r
    start, count = find_continuation(jnp.asarray(arr), jnp.asarray(lengths, jnp.int32), ngram, num)
    return np.asarray(start).tolist(), np.asarray(count).tolist()


def test_find_continuation():
    rows = [
        [1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3],  # two earlier matches: the earliest wins
        [4, 5, 8, 4, 5, 0, 0, 0, 0, 0, 0],  # continuation clipped at the current length
        [1, 2, 3, 4, 5, 6, 4, 5, 6, 9, 9],  # the only other "4 5 6" lies past length 6
        [6, 6, 6, 6, 6, 0, 0, 0, 0, 0, 0],  # overlapping matches
        [7, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # shorter than the n-gram
    ]
    start, count = _find(rows, [11, 5, 6, 5, 2], 3, 4)
    assert (start[0], count[0]) == (3, 4)
    assert count[1] == 0 and count[2] == 0 and count[4] == 0  # no 3-gram match
    assert (start[3], count[3]) == (3, 2)  # 6 6 6 at 0 -> tokens 3, 4 (length 5)
    start, count = _find(rows, [11, 5, 6, 5, 2], 2, 10)
    assert (start[0], count[0]) == (3, 8)
    assert (start[1], count[1]) == (2, 3)  # [8, 4, 5]: stops at length
    assert count[2] == 0  # "5 6" at 4 is the suffix itself; the copy at 7 is past length
    assert (start[3], count[3]) == (2, 3)
    assert count[4] == 0  # the suffix itself is no match


def test_prompt_lookup_falls_back_to_shorter_ngrams():
    pld = PromptLookupProposer(prompt_lookup_num_tokens=3, max_matching_ngram_size=3)
    rows = np.zeros((3, 12), np.int32)
    rows[0, :7] = [7, 1, 2, 9, 3, 1, 2]  # no "3 1 2" earlier; "1 2" at 1 -> 9 3 1
    rows[1, :6] = [5, 8, 2, 4, 6, 8]  # only the 1-gram "8" -> 2 4 6
    rows[2, :4] = [1, 2, 3, 4]  # nothing
    ctx = SpecContext(jnp.asarray(rows), jnp.asarray([7, 6, 4], jnp.int32), jnp.zeros((3, 1), jnp.int32))
    tree, _ = pld.propose(None, (), ctx, None, SamplingConfig())
    np.testing.assert_array_equal(np.asarray(tree.tokens), [[2, 9, 3, 1], [8, 2, 4, 6], [4, 0, 0, 0]])
    np.testing.assert_array_equal(np.asarray(tree.valid), [[1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0]])
