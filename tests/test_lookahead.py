"""Lookahead decoding: the combined attention mask, the n-gram pool, losslessness, the CLI.

The mask and positions of the lookahead and verification branches are checked against a mask
built cell by cell from the method's rule, and end to end: every node's logits equal those of
its prescribed context run as a plain causal chain. The pool is checked against a Python
dict-of-lists model of TensorRT-LLM's LookaheadPoolManager (per-key cap G, re-inserted n-grams
become newest, oldest evicted first).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import Engine, ModelConfig, PagedKVCache, causal_mask, forward, init_params
from specjax.cache import init_pages
from specjax.draft_tree import ancestor_mask, tree_positions
from specjax.generate import prefill
from specjax.proposers.lookahead import (
    LookaheadProposer,
    LookaheadState,
    bucket_of,
    empty_pool,
    lookahead_tree,
    merge_ngrams,
    pool_insert,
    pool_lookup,
)
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
PAGE = 4
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9, 10, 7, 8], [40]]
REPETITIVE = [32, 38, 32, 38, 32, 38]  # the target (seed 5) falls into a loop after it
NO_EOS = (-1,)
N_NEW = 32


@pytest.fixture(scope="module")
def target():
    return init_params(CFG, jax.random.PRNGKey(5), scale=0.5)


@pytest.fixture(scope="module")
def engine(target):
    return Engine(target, CFG, num_pages=160, page_size=PAGE)


@pytest.fixture(scope="module")
def vanilla(engine):
    return engine.generate(PROMPTS + [REPETITIVE], N_NEW, eos_token_ids=NO_EOS).token_ids


# ---------------------------------------------------------------------------------------------
# Greedy output equals vanilla greedy decoding


@pytest.mark.parametrize(
    "wng, accept_window", [((7, 5, 7), False), ((3, 2, 1), False), ((7, 5, 7), True), ((1, 3, 1), True)]
)
def test_greedy_equals_vanilla_batched(engine, vanilla, wng, accept_window):
    proposer = LookaheadProposer(*wng, accept_window=accept_window)
    out = engine.generate(PROMPTS[:2], N_NEW, eos_token_ids=NO_EOS, proposer=proposer, fixed_speculation=True)
    assert out.token_ids == vanilla[:2]
    single = engine.generate(PROMPTS[2:3], N_NEW, eos_token_ids=NO_EOS, proposer=proposer, fixed_speculation=True)
    assert single.token_ids == vanilla[2:3]


def test_repetitive_prompt_accepts_more_than_one(engine, vanilla):
    out = engine.generate([REPETITIVE], N_NEW, eos_token_ids=NO_EOS, proposer=LookaheadProposer(7, 5, 7))
    assert out.token_ids[0] == vanilla[3]
    assert out.mean_accepted[0] > 1.5, out.mean_accepted


def test_eos_stops_like_vanilla(engine, vanilla):
    """Stopping at an EOS in the middle of an accepted n-gram keeps exactly vanilla's tokens."""
    eos = vanilla[3][5]
    want = engine.generate([REPETITIVE], N_NEW, eos_token_ids=(eos,)).token_ids
    got = engine.generate([REPETITIVE], N_NEW, eos_token_ids=(eos,), proposer=LookaheadProposer(7, 5, 7)).token_ids
    assert got == want and got[0][-1] == eos


# ---------------------------------------------------------------------------------------------
# The combined mask


W, N, G = 3, 4, 3
PENDING = 60
# Window cell (k, j) holds token 10 * k + j + 1 (cell (0, 0) is the pending token).
WINDOW = np.array([[10 * k + j + 1 for j in range(W)] for k in range(N - 1)], np.int32)
# Pool n-grams after the pending token: two share the prefix (41, 42), one is disjoint.
NGRAMS = [[41, 42, 43], [41, 42, 44], [51, 52, 53]]


def _combined_tree(ngrams=NGRAMS, accept_window=False):
    cand = np.zeros((1, G, N - 1), np.int32)
    cand[0, : len(ngrams)] = ngrams
    valid = np.arange(G)[None, :] < len(ngrams)
    return lookahead_tree(
        jnp.asarray(WINDOW)[None], jnp.asarray([PENDING]), jnp.asarray(cand), jnp.asarray(valid), accept_window
    )


def _prescribed_contexts():
    """{token: (tokens it attends to in order, offset from the pending position)} by the
    method's rule, one Python loop per branch."""
    ctx = {PENDING: ([PENDING], 0)}
    for k in range(N - 1):
        for j in range(W):
            if (k, j) == (0, 0):
                continue
            seen = [PENDING] + [int(WINDOW[0, c]) for c in range(1, j + 1)]
            seen += [int(WINDOW[lv, j]) for lv in range(1, k + 1)]
            ctx[int(WINDOW[k, j])] = (seen, j + k)
    for gram in NGRAMS:
        for d in range(N - 1):
            ctx[gram[d]] = ([PENDING] + gram[: d + 1], d + 1)
    return ctx


def test_combined_mask_and_positions_follow_the_method():
    tree = _combined_tree()
    tokens = np.asarray(tree.tokens[0])
    valid = np.asarray(tree.valid[0])
    mask = np.asarray(ancestor_mask(tree)[0])
    depth = np.asarray(tree.depth[0])
    ctx = _prescribed_contexts()
    real = [i for i in range(tokens.size) if valid[i]]
    assert sorted(int(tokens[i]) for i in real) == sorted(ctx)  # every node once, merged prefixes
    assert tree.size == (W + G) * (N - 1)
    index = {int(tokens[i]): i for i in real}
    for i in real:
        seen, offset = ctx[int(tokens[i])]
        want = np.zeros(tokens.size, bool)
        want[[index[t] for t in seen]] = True
        np.testing.assert_array_equal(mask[i], want, err_msg=f"node {i} token {tokens[i]}")
        assert depth[i] == offset
    acceptable = np.asarray(tree.acceptable[0])
    for i in real:  # only the root and the verification branch may be accepted
        assert acceptable[i] == (int(tokens[i]) >= 41 or i == 0)


def test_accept_window_opens_the_window_chains_from_the_root():
    """accept_window: column 0's levels and level 0's columns become acceptable (each a chain from
    the root), unless a verification n-gram starts with the chain's first token."""
    lw = W * (N - 1)
    chains = {k * W for k in range(N - 1)} | set(range(W))
    got = np.asarray(_combined_tree(accept_window=True).acceptable[0])
    np.testing.assert_array_equal(got[:lw], [i in chains for i in range(lw)])
    assert got[lw:].all()
    first_col0, first_row0 = int(WINDOW[1, 0]), int(WINDOW[0, 1])
    shadowed = _combined_tree([[first_col0, 42, 43], [first_row0, 52, 53]], accept_window=True)
    np.testing.assert_array_equal(np.asarray(shadowed.acceptable[0])[:lw], np.arange(lw) == 0)


@pytest.mark.parametrize("accept_window", [False, True])
def test_greedy_acceptance_follows_the_window_chain_only_when_asked(accept_window):
    """Logits whose argmax runs down column 0 (root -> (1, 0) -> (2, 0)) and then off the tree:
    with accept_window two window tokens are accepted, else none (no pool n-gram matches)."""
    from specjax.accept import accept_match
    from specjax.sampling import SamplingConfig

    tree = _combined_tree(accept_window=accept_window)
    tokens = np.asarray(tree.tokens[0])
    logits = np.zeros((1, tokens.size, CFG.vocab_size), np.float32)
    logits[0, :, 0] = 1.0  # token 0 is on no path
    logits[0, 0, WINDOW[1, 0]] = 5.0
    logits[0, W, WINDOW[2, 0]] = 5.0
    res = accept_match(
        tree, jnp.asarray(logits), jax.random.split(jax.random.PRNGKey(0), 1), SamplingConfig(temperature=0.0)
    )
    assert int(res.n_accepted[0]) == (2 if accept_window else 0)
    assert int(res.next_token[0]) == (0 if accept_window else WINDOW[1, 0])


def test_combined_forward_equals_prescribed_chains(target):
    """Each node's logits in the one combined forward equal its prescribed context's logits
    run as a causal chain: mask and RoPE positions together."""
    prompt = [5, 9, 13, 2, 7]
    per_seq = 8
    k, v = init_pages(CFG, per_seq, PAGE)
    k = [jnp.full_like(x, jnp.nan) for x in k]  # unused slots must not leak
    v = [jnp.full_like(x, jnp.nan) for x in v]
    cache = PagedKVCache(k, v, jnp.arange(per_seq, dtype=jnp.int32)[None], jnp.zeros((1,), jnp.int32))
    chunk = np.zeros((1, 8), np.int32)
    chunk[0, : len(prompt)] = prompt
    cache, _, _ = prefill(target, CFG, cache, jnp.asarray(chunk), jnp.asarray([len(prompt)]))
    tree = _combined_tree()
    np.testing.assert_array_equal(
        np.asarray(tree_positions(tree, cache.lengths)[0]), len(prompt) + np.asarray(tree.depth[0])
    )
    got = np.asarray(verify(target, CFG, cache, tree).logits[0])
    tokens, valid = np.asarray(tree.tokens[0]), np.asarray(tree.valid[0])
    nodes = [i for i in range(tokens.size) if valid[i]]
    ctx = _prescribed_contexts()
    seqs = [prompt + ctx[int(tokens[i])][0] for i in nodes]
    rows, width = len(seqs), max(len(q) for q in seqs)
    chains = np.zeros((rows, width), np.int32)
    for r, q in enumerate(seqs):
        chains[r, : len(q)] = q
    pages = -(-width // PAGE)
    rk, rv = init_pages(CFG, rows * pages, PAGE)
    ref = PagedKVCache(
        rk, rv, jnp.arange(rows * pages, dtype=jnp.int32).reshape(rows, pages), jnp.zeros((rows,), jnp.int32)
    )
    at = jnp.asarray([[len(q) - 1] for q in seqs], jnp.int32)
    want = forward(
        target,
        CFG,
        jnp.asarray(chains),
        jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (rows, width)),
        ref,
        causal_mask(rows, width),
        logits_at=at,
    ).logits[:, 0]
    for r, i in enumerate(nodes):
        np.testing.assert_allclose(
            got[i], np.asarray(want[r]), rtol=1e-4, atol=1e-4, err_msg=f"node {i} (token {tokens[i]})"
        )


def test_merge_ngrams_builds_the_prefix_trie():
    grams = [[1, 2, 3], [1, 2, 4], [5, 6, 7], [1, 9, 3], [1, 2, 3]]  # the last repeats the first
    valid = [True, True, True, True, True]
    tok, par, dep, ok = (np.asarray(x[0]) for x in merge_ngrams(jnp.asarray([grams]), jnp.asarray([valid])))
    paths = []
    for i in np.flatnonzero(ok):
        path, j = [], i
        while j >= 0:
            path.append(int(tok[j]))
            j = int(par[j])
        assert par[i] < i and dep[i] == len(path)
        paths.append(tuple(path[::-1]))
    prefixes = {tuple(g[: d + 1]) for g in grams for d in range(3)}
    assert sorted(paths) == sorted(prefixes)  # each prefix exactly once
    assert ok.sum() == len(prefixes) and not ok[len(prefixes) :].any()  # packed to the front


# ---------------------------------------------------------------------------------------------
# The n-gram pool


def _distinct_bucket_keys(count, buckets):
    keys, used = [], set()
    for t in range(1, 10_000):
        bk = int(bucket_of(jnp.asarray(t), buckets))
        if bk not in used:
            used.add(bk)
            keys.append(t)
            if len(keys) == count:
                return keys


def test_pool_matches_reference_lru_per_key():
    """Random insertions (2 sequences, independent streams) against a dict-of-lists model:
    at most G per key, a repeated n-gram moves to the newest end, the oldest is evicted."""
    buckets, g, m = 16, 3, 2
    keys = _distinct_bucket_keys(4, buckets)
    rng = np.random.default_rng(0)
    pool = empty_pool(2, buckets, g, m)
    ref = [{}, {}]
    insert = jax.jit(pool_insert)
    lookup = jax.jit(pool_lookup)
    for step in range(60):
        key = rng.choice(keys, 2)
        gram = rng.integers(0, 3, (2, m))  # few distinct n-grams: repeats are common
        ok = rng.random(2) < 0.9
        pool = insert(pool, jnp.asarray(key, jnp.int32), jnp.asarray(gram, jnp.int32), jnp.asarray(ok))
        for s in range(2):
            if not ok[s]:
                continue
            lst = ref[s].setdefault(int(key[s]), [])
            item = tuple(int(x) for x in gram[s])
            if item in lst:
                lst.remove(item)
            elif len(lst) == g:
                lst.pop(0)  # oldest first
            lst.append(item)
        q = rng.choice(keys, 2)
        grams, valid = lookup(pool, jnp.asarray(q, jnp.int32))
        for s in range(2):
            got = [tuple(int(x) for x in r) for r, v in zip(np.asarray(grams[s]), np.asarray(valid[s])) if v]
            assert got == ref[s].get(int(q[s]), []), (step, s)


def test_pool_collisions_share_a_bucket_but_never_mix_keys():
    buckets, g = 4, 2
    a = 1
    b = next(
        t for t in range(2, 1000) if int(bucket_of(jnp.asarray(t), buckets)) == int(bucket_of(jnp.asarray(a), buckets))
    )
    pool = empty_pool(1, buckets, g, 2)
    for key, gram in ((a, (1, 1)), (b, (2, 2)), (a, (3, 3))):  # the third evicts a's oldest
        pool = pool_insert(pool, jnp.asarray([key]), jnp.asarray([gram]), jnp.asarray([True]))
    grams, valid = pool_lookup(pool, jnp.asarray([a]))
    assert np.asarray(grams[0])[np.asarray(valid[0])].tolist() == [[3, 3]]
    grams, valid = pool_lookup(pool, jnp.asarray([b]))
    assert np.asarray(grams[0])[np.asarray(valid[0])].tolist() == [[2, 2]]


def test_init_fills_pool_with_prompt_ngrams_and_update_with_text_and_window():
    """init: every prompt n-gram; update: the window's W column n-grams (once its levels are
    the target's own) then the n-grams ending at the appended tokens; the window shifts."""
    from specjax.accept import AcceptResult
    from specjax.spec_decode import SpecContext

    prop = LookaheadProposer(2, 3, 4, pool_buckets=64)
    toks = np.zeros((1, 16), np.int32)
    prompt = [3, 4, 5, 3, 4, 6]
    toks[0, : len(prompt)] = prompt
    ctx = SpecContext(jnp.asarray(toks), jnp.asarray([len(prompt)]), jnp.zeros((1, 1), jnp.int32))
    state = prop.init(None, None, ctx, None, None)
    grams, valid = pool_lookup(state.pool, jnp.asarray([3]))
    assert np.asarray(grams[0])[np.asarray(valid[0])].tolist() == [[4, 5], [4, 6]]
    # One step: the pending token 6 is verified, tokens 7, 8 appended.
    _, state = prop.propose(None, state, ctx, None, None)
    state = state.replace(window=jnp.asarray([[[0, 21], [30, 31]]]), updates=jnp.asarray([1]))
    toks[0, 6:8] = [7, 8]
    node_argmax = np.zeros((1, prop.tree_size), np.int32)
    node_argmax[0, 2], node_argmax[0, 3] = 50, 51  # top level (k = 1) predicts 50, 51
    ctx2 = SpecContext(
        jnp.asarray(toks), jnp.asarray([8]), jnp.zeros((1, 1), jnp.int32), node_argmax=jnp.asarray(node_argmax)
    )
    res = AcceptResult(jnp.zeros((1, prop.tree_size), jnp.int32), jnp.asarray([1]), jnp.asarray([8]))
    new = prop.update(None, state, ctx2, res, jnp.asarray([True]))
    np.testing.assert_array_equal(np.asarray(new.window[0]), [[30, 31], [50, 51]])
    look = jax.jit(pool_lookup)
    for key, want in ((6, [[30, 50], [7, 8]]), (21, [[31, 51]]), (4, [[5, 3], [6, 7]])):
        grams, valid = look(new.pool, jnp.asarray([key]))
        assert np.asarray(grams[0])[np.asarray(valid[0])].tolist() == want, key
    assert isinstance(new, LookaheadState) and int(new.updates[0]) == 2


# ---------------------------------------------------------------------------------------------
# Configuration and the CLI


def test_invalid_configurations_are_refused():
    for wng in ((0, 5, 7), (7, 1, 7), (7, 5, 0)):
        with pytest.raises(ValueError):
            LookaheadProposer(*wng)
    assert LookaheadProposer().tree_size == (7 + 7) * 4


def test_cli_bad_lookahead_values(capsys, tiny_llama):
    from test_cli import assert_error

    model = str(tiny_llama[0])
    base = ("generate", "--model", model, "--method", "lookahead", "--prompt", "hi")
    for value, word in (
        ("7,1,7", "n-gram size"),
        ("0,5,7", "window size"),
        ("7,5,0", "verification set size"),
        ("7,5", "W,N,G"),
        ("a,b,c", "W,N,G"),
    ):
        assert_error(capsys, *base, "--lookahead", value, words=("--lookahead", word))
    assert_error(capsys, *base, "--lookahead", "600,5,7", words=("context",))
    assert_error(
        capsys,
        "generate",
        "--model",
        model,
        "--method",
        "pld",
        "--prompt",
        "hi",
        "--lookahead-accept-window",
        words=("--lookahead-accept-window", "pld"),
    )


def test_cli_lookahead_equals_vanilla(capsys, tiny_llama):
    from test_cli import run_json

    model = str(tiny_llama[0])
    args = ("--model", model, "--prompt", "def add(a, b):", "--max-new-tokens", 12, "--no-warmup")
    want = run_json(capsys, *args)[0]["token_ids"]
    got = run_json(capsys, *args, "--method", "lookahead", "--lookahead", "3,3,2")[0]
    assert got["token_ids"] == want and got["steps"] <= len(want)
    got = run_json(capsys, *args, "--method", "lookahead", "--lookahead", "1,3,1", "--lookahead-accept-window")[0]
    assert got["token_ids"] == want and got["steps"] <= len(want)


# ---------------------------------------------------------------------------------------------
# SmolLM2


@pytest.mark.slow
def test_smollm2_greedy_equals_vanilla():
    from test_real_model import PROMPTS as REAL_PROMPTS
    from test_real_model import assert_same_or_near_tie

    from specjax import load_model
    from specjax.cli import encode_prompt

    smol = load_model("smollm2-135m")
    eng = Engine(smol.params, smol.config, num_pages=96, page_size=16)
    encoded = [encode_prompt(smol.tokenizer, p, raw=False) for p in REAL_PROMPTS[1:]]
    vanilla = eng.generate(encoded, 64, eos_token_ids=())
    proposer = LookaheadProposer(7, 5, 7)
    batched = eng.generate(encoded, 64, eos_token_ids=(), proposer=proposer, fixed_speculation=True)
    single = eng.generate(encoded[:1], 64, eos_token_ids=(), proposer=proposer, fixed_speculation=True)
    for prompt, want, got in zip(encoded, vanilla.token_ids, batched.token_ids):
        assert_same_or_near_tie(smol, prompt, want, got)
    assert_same_or_near_tie(smol, encoded[0], vanilla.token_ids[0], single.token_ids[0])
    assert sum(batched.steps) < sum(vanilla.steps)


# ---------------------------------------------------------------------------------------------
# Sampling


# 2**18 seeds, as the acceptance rules' own tests: power against a 2% per-cell bias (asserted).
# Calls of 1024 rows cost the least per row here (~0.2 ms).
SAMPLING_BATCH, SAMPLING_CALLS = 1024, 256


# accept_window=True accepts along the window's chains as well as the pool's n-grams, a superset
# of the default's paths: the default tier runs it, the slow tier both (~80 s each).
@pytest.mark.parametrize("accept_window", [pytest.param(False, marks=pytest.mark.slow), True])
def test_engine_sampling_is_lossless(accept_window, monkeypatch):
    """The first two sampled tokens through Engine.generate (2**18 seeds) follow the target's
    exact joint law (chi-square, power above 0.75 against a 2% per-cell bias), with n-grams from
    the prompt accepted in one pass; as a control, the first drafted node emitted unchecked
    fails the same test."""
    from test_accept_sampling import CFG as S_CFG
    from test_accept_sampling import (
        P_BROKEN,
        P_OK,
        _continuation_logits,
        accept_first_draft_unchecked,
        biased,
        chi2_power,
        chi2_pvalue,
        exact_first_two,
    )
    from test_accept_sampling import PROMPT as S_PROMPT

    import specjax.spec_decode as spec_decode_mod
    from specjax import SamplingConfig

    target = init_params(S_CFG, jax.random.PRNGKey(1), scale=0.5)
    sampling = SamplingConfig(temperature=1.0)
    joint = exact_first_two(_continuation_logits(target, S_CFG), sampling)
    n = SAMPLING_BATCH * SAMPLING_CALLS
    assert chi2_power(joint, n, biased(joint)) > 0.75
    proposer = LookaheadProposer(2, 3, 2, pool_buckets=16, accept_window=accept_window)

    def first_two(calls):
        eng = Engine(target, S_CFG, num_pages=2 * SAMPLING_BATCH + 8, page_size=16)
        tokens, steps = [], []
        for call in range(calls):
            seeds = list(range(call * SAMPLING_BATCH, (call + 1) * SAMPLING_BATCH))
            out = eng.generate(
                [S_PROMPT] * SAMPLING_BATCH,
                2,
                sampling=sampling,
                seeds=seeds,
                eos_token_ids=(),
                proposer=proposer,
                fixed_speculation=True,
            )
            tokens += out.token_ids
            steps += out.steps
        return np.asarray(tokens), np.asarray(steps)

    tokens, steps = first_two(SAMPLING_CALLS)
    assert np.mean(steps == 1) > 0.01  # some drafts were accepted
    assert chi2_pvalue(tokens[:, 0], tokens[:, 1], joint) > P_OK
    monkeypatch.setattr(spec_decode_mod, "accept", accept_first_draft_unchecked)
    jax.clear_caches()  # the step is traced again, with the broken rule
    try:
        broken, _ = first_two(1)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert chi2_pvalue(broken[:, 0], broken[:, 1], joint) < P_BROKEN


def test_sampled_steps_argmax_only_the_window_top_level(engine):
    """Sampling: spec_step takes the argmax of the rows Lookahead names (`argmax_nodes`) alone.
    The run equals one that argmaxes every node, and differs from one naming the wrong rows
    (so the window does read those rows)."""
    import dataclasses

    from specjax import SamplingConfig

    @dataclasses.dataclass(frozen=True)
    class Rows(LookaheadProposer):
        rows: tuple = None

        @property
        def argmax_nodes(self):
            return self.rows

    base = LookaheadProposer(3, 3, 2)
    lo, hi = base.argmax_nodes
    assert (lo, hi) == (3, 6)  # level k = 1 of a 3-wide window
    sampling = SamplingConfig(temperature=0.2)

    def run(proposer):
        out = engine.generate(
            [REPETITIVE] + PROMPTS,
            N_NEW,
            sampling=sampling,
            seeds=[0, 1, 2, 3],
            eos_token_ids=NO_EOS,
            proposer=proposer,
            fixed_speculation=True,
        )
        return out.token_ids, out.steps

    named = run(base)
    assert named == run(Rows(3, 3, 2, rows=(0, base.tree_size)))
    assert named != run(Rows(3, 3, 2, rows=(0, lo)))
