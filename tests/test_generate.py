"""Vanilla generation: equals transformers' greedy generate, batching is exact, sampling is right."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from scipy import stats

from specjax import Engine, GenerationError, SamplingConfig, SamplingError, load_model
from specjax.sampling import processed_logprobs, sample_tokens


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    d, torch_model = tiny_llama
    return load_model(str(d)), torch_model


PROMPTS = [
    [5, 17, 33, 90, 12, 7, 8],
    [44],
    [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, 113, 114, 115, 116, 117, 118],
]


def hf_greedy(torch_model, prompt, n):
    with torch.no_grad():
        out = torch_model.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            do_sample=False,
            min_new_tokens=n,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def test_greedy_equals_transformers_generate(tiny):
    model, torch_model = tiny
    eng = Engine(model.params, model.config, num_pages=64, page_size=4)
    out = eng.generate(PROMPTS, max_new_tokens=20, eos_token_ids=())
    for prompt, got in zip(PROMPTS, out.token_ids):
        assert got == hf_greedy(torch_model, prompt, 20)
    assert out.steps == [20, 20, 20]


def test_qwen3_greedy_and_speculative_equal_transformers_generate(tmp_path):
    """Qwen3 (per-head q/k norms, head_dim != hidden / heads, random norm weights) loaded as the
    engine runs it (CPU-packed weights): vanilla greedy equals transformers' greedy generate, and
    so does a self-draft's (draft passes plus chain verification over the target)."""
    from conftest import make_tiny_hf_model

    from specjax.proposers import DraftModelProposer, self_draft_params
    from specjax.proposers.draft_model import self_draft_config

    torch_model = make_tiny_hf_model(tmp_path, "qwen3", tokenizer=False, perturb=0.05, tie_word_embeddings=True)
    model = load_model(str(tmp_path))
    assert model.config.qk_norm
    want = [hf_greedy(torch_model, p, 12) for p in PROMPTS]
    eng = Engine(model.params, model.config, num_pages=64, page_size=4)
    assert eng.generate(PROMPTS, max_new_tokens=12, eos_token_ids=()).token_ids == want
    proposer = DraftModelProposer(self_draft_config(model.config, 1), max_draft_len=3)
    out = eng.generate(
        PROMPTS, 12, eos_token_ids=(), proposer=proposer, proposer_params=self_draft_params(model.params, 1)
    )
    assert out.token_ids == want


def test_batch_equals_single(tiny):
    model, _ = tiny
    eng = Engine(model.params, model.config, num_pages=64, page_size=4)
    batch = eng.generate(
        PROMPTS, max_new_tokens=12, eos_token_ids=(), sampling=SamplingConfig(temperature=1.0), seeds=[3, 4, 5]
    )
    for i, p in enumerate(PROMPTS):
        single = eng.generate(
            [p], max_new_tokens=12, eos_token_ids=(), sampling=SamplingConfig(temperature=1.0), seeds=[3 + i]
        )
        assert single.token_ids[0] == batch.token_ids[i]


def test_stops_at_eos_per_sequence(tiny):
    model, _ = tiny
    eng = Engine(model.params, model.config, num_pages=64, page_size=4)
    free = eng.generate(PROMPTS, max_new_tokens=10, eos_token_ids=())
    eos = free.token_ids[0][3]  # a token sequence 0 emits as its 4th
    out = eng.generate(PROMPTS, max_new_tokens=10, eos_token_ids=(eos,))
    for full, got in zip(free.token_ids, out.token_ids):
        cut = full.index(eos) + 1 if eos in full else len(full)
        assert got == full[:cut]
    assert out.finished_by_eos[0] and out.steps[0] == len(out.token_ids[0]) <= 4


def test_zero_new_tokens(tiny):
    model, _ = tiny
    out = Engine(model.params, model.config, num_pages=16, page_size=4).generate([[1, 2]], 0)
    assert out.token_ids == [[]] and out.steps == [0]


def test_sampling_is_seeded_per_request(tiny):
    model, _ = tiny
    eng = Engine(model.params, model.config, num_pages=64, page_size=4)
    s = SamplingConfig(temperature=1.0, top_k=50, top_p=0.95)
    a = eng.generate([PROMPTS[0], PROMPTS[1]], 16, sampling=s, seeds=[7, 8], eos_token_ids=())
    b = eng.generate([PROMPTS[1], PROMPTS[0]], 16, sampling=s, seeds=[8, 7], eos_token_ids=())
    assert a.token_ids == b.token_ids[::-1]
    c = eng.generate([PROMPTS[0]], 16, sampling=s, seeds=[9], eos_token_ids=())
    assert c.token_ids[0] != a.token_ids[0]


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.9, 20, 0.6)])
def test_processed_logprobs_match_transformers_warpers(temperature, top_k, top_p):
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)) * 3
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    want = torch.softmax(scores, -1).numpy()
    got = np.exp(np.asarray(processed_logprobs(jnp.asarray(logits.numpy()), SamplingConfig(temperature, top_k, top_p))))
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_per_row_settings_match_transformers_warpers_row_by_row():
    """One call with a setting per row (traced, inside jit) equals transformers' warpers applied
    to each row alone; greedy rows put all their mass on the argmax (first on ties). Top-k runs
    its one-pass path (k <= 64) and its bisection (k = 70) and agrees with lax.top_k's ties."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from specjax.sampling import TOP_K_FAST, kth_largest, per_row, top_k_keep

    rows = [(0.7, 0, 1.0), (0.0, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.9, 20, 0.6), (1.0, 70, 1.0), (0.0, 3, 0.5)]
    logits = torch.randn(len(rows), 2, 100, generator=torch.Generator().manual_seed(1)) * 3
    logits[1, 0, 7] = logits[1, 0, 9] = logits[1, 0].max() + 1  # a tie for the greedy row
    settings = SamplingConfig.rows([SamplingConfig(*r) for r in rows])
    got = np.exp(np.asarray(jax.jit(processed_logprobs)(jnp.asarray(logits.numpy()), settings)))
    for i, (temperature, top_k, top_p) in enumerate(rows):
        if temperature == 0:
            want = np.eye(100)[np.argmax(logits[i].numpy(), -1)]
        else:
            scores = TemperatureLogitsWarper(temperature)(None, logits[i].clone())
            if top_k:
                scores = TopKLogitsWarper(top_k)(None, scores)
            if top_p < 1:
                scores = TopPLogitsWarper(top_p)(None, scores)
            want = torch.softmax(scores, -1).numpy()
        np.testing.assert_allclose(got[i], want, atol=1e-6, err_msg=str(rows[i]))
    x = jnp.round(jnp.asarray(logits.numpy()), 1)  # many ties
    for k in (1, 5, TOP_K_FAST, TOP_K_FAST + 1, 99):
        want = x >= kth_largest(x, k)
        for small in (None, k <= TOP_K_FAST):
            np.testing.assert_array_equal(top_k_keep(x, per_row(jnp.full(len(rows), k), x), small), want)


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_mask_equals_the_sorted_rule(top_p):
    """The bisection keeps what sorting keeps: ties together, -0.0 equal to 0.0, -inf rows."""
    from specjax.sampling import top_p_mask

    rng = np.random.default_rng(1)
    rows = [
        rng.normal(size=300) * 3,
        np.round(rng.normal(size=300)),
        rng.normal(size=300) * 1e-3,
        np.where(rng.random(300) < 0.5, -np.inf, rng.normal(size=300)),
        np.array([0.0, -0.0] * 150),
        np.round(rng.normal(size=300) * 0.3) * 1.0,
    ]
    logits = np.stack(rows).astype(np.float32)
    want = []
    for row in logits:  # HF's rule by sorting: keep a token if the mass before it is < top_p
        probs = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
        order = np.argsort(-row, kind="stable")
        before = np.concatenate([[0.0], np.cumsum(probs[order])[:-1]])
        threshold = row[order][before < top_p].min()
        want.append(row >= threshold)
    np.testing.assert_array_equal(np.asarray(top_p_mask(jnp.asarray(logits), top_p)), want)


def test_argmax_last_and_gumbel_max_draw_give_what_jax_gives():
    """argmax_last is jnp.argmax (first of ties, NaN largest, all--inf rows) and gumbel_max_draw
    (`categorical` on a GPU) draws exactly jax.random.categorical's tokens (same keys), masked
    rows included."""
    from specjax.sampling import argmax_last, gumbel_max_draw

    rng = np.random.default_rng(2)
    rows = np.stack(
        [
            rng.normal(size=500) * 3,
            np.round(rng.normal(size=500)),
            np.where(rng.random(500) < 0.9, -np.inf, rng.normal(size=500)),
            np.full(500, -np.inf),
            np.where(np.arange(500) == 7, np.nan, 1.0),
            np.where(np.arange(500) % 3 == 0, np.nan, 0.0),
        ]
    ).astype(np.float32)
    x = jnp.asarray(rows)
    np.testing.assert_array_equal(np.asarray(argmax_last(x)), np.asarray(jnp.argmax(x, axis=-1)))
    np.testing.assert_array_equal(
        np.asarray(argmax_last(x[:, :9].reshape(2, 3, 9))), np.asarray(jnp.argmax(x[:, :9].reshape(2, 3, 9), axis=-1))
    )
    # blockwise: whole blocks, a padded last block, ties across blocks, the max in the last slot
    ties = np.where(np.isin(np.arange(500), [40, 41, 300]), 5.0, 0.0)
    last = np.where(np.arange(500) == 499, 9.0, rng.normal(size=500))
    late_nan = np.where(np.arange(500) == 333, np.nan, rng.normal(size=500) * 100)
    infs = np.where(np.isin(np.arange(500), [3, 200]), np.inf, 0.0)
    neg_nan = np.where(np.arange(500) == 250, -np.nan, np.where(np.arange(500) == 9, np.inf, 0.0))
    extra = np.stack([ties, last, late_nan, infs, neg_nan]).astype(np.float32)
    wide = np.concatenate([rows, extra])
    for width, block in ((500, 16), (500, 25), (480, 8), (49152, 1024), (49999, 1024)):
        w = np.resize(wide, (wide.shape[0], width)) if width > 500 else wide[:, :width]
        if width > 500:
            w[-2, -1] = 9.0e9  # the largest value in the padded last block's last real slot
        got = argmax_last(jnp.asarray(w).reshape(-1, 1, width), block=block)
        np.testing.assert_array_equal(
            np.asarray(got).ravel(), np.argmax(w, axis=-1), err_msg=f"width {width}, block {block}"
        )
    keys = jax.random.split(jax.random.PRNGKey(3), 400)
    finite = x[:3]
    got = jax.vmap(lambda k: gumbel_max_draw(k, finite))(keys)
    want = jax.vmap(lambda k: jax.random.categorical(k, finite))(keys)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert len(set(np.asarray(got)[:, 0].tolist())) > 20  # the draws vary with the key


def test_inverse_cdf_draw_follows_softmax():
    """`categorical` on XLA:CPU (inverse_cdf_draw): 2**18 draws per row follow softmax(logits)
    by chi-square (the sampling tests' N and thresholds), one key drawing every row,
    with a vocabulary that does not fill its last block, a row mostly -inf, one whose mass sits
    in one token of a late block, and one with no finite logit (token 0), and a vocabulary
    within one block (one level). A draw from a distribution 3% off in temperature is caught;
    tokens without mass are never drawn."""
    from specjax.sampling import categorical, inverse_cdf_draw
    from tests.test_accept_sampling import P_BROKEN, P_OK, N, chi2_pvalue

    v, block = 1000, 64  # 16 blocks, the last one 40 tokens short
    rng = np.random.default_rng(4)
    rows = np.stack(
        [
            rng.normal(size=v) * 2,
            np.where(rng.random(v) < 0.9, -np.inf, rng.normal(size=v)),
            np.where(np.arange(v) == 990, 6.0, np.where(np.arange(v) < 500, -np.inf, 0.0)),
            np.full(v, -np.inf),
        ]
    ).astype(np.float32)
    logits = jnp.asarray(rows)
    keys = jax.random.split(jax.random.PRNGKey(5), N)
    draw = jax.jit(jax.vmap(lambda k, x: inverse_cdf_draw(k, x, block), in_axes=(0, None)))
    got = np.asarray(draw(keys, logits))  # [N, 4]
    assert (got[:, 3] == 0).all() and ((0 <= got) & (got < v)).all()
    probs = np.exp(rows[:3].astype(np.float64) - rows[:3].max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    for r in range(3):
        assert chi2_pvalue(np.zeros(N, int), got[:, r], probs[r][None]) > P_OK, f"row {r}"
    hot = np.asarray(draw(keys, logits[:1] / 0.97))[:, 0]
    assert chi2_pvalue(np.zeros(N, int), hot, probs[0][None]) < P_BROKEN
    assert len(set(got[:, 0].tolist())) > 200
    small = np.asarray(draw(keys, logits[:, :48]))  # a vocabulary within one block: one level
    assert (small[:, 3] == 0).all()
    cut = np.exp(rows[0, :48].astype(np.float64) - rows[0, :48].max())
    assert chi2_pvalue(np.zeros(N, int), small[:, 0], (cut / cut.sum())[None]) > P_OK
    hot = np.asarray(draw(keys, logits[:1, :48] / 0.97))[:, 0]
    assert chi2_pvalue(np.zeros(N, int), hot, (cut / cut.sum())[None]) < P_BROKEN
    # on the CPU, categorical is this draw (same key, same token)
    one = jax.jit(lambda k: (categorical(k, logits), inverse_cdf_draw(k, logits)))(keys[0])
    np.testing.assert_array_equal(*map(np.asarray, one))


def test_sample_distribution_chi_square():
    """20k samples follow the processed distribution; a wrong temperature is caught."""
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(16,)) * 1.5, jnp.float32)
    s = SamplingConfig(temperature=0.8, top_k=12)
    n = 20000
    keys = jax.random.split(jax.random.PRNGKey(0), n)
    draws = np.asarray(sample_tokens(jnp.broadcast_to(logits, (n, 16)), keys, s))
    probs = np.exp(np.asarray(processed_logprobs(logits, s), np.float64))
    probs /= probs.sum()
    support = probs > 0
    counts = np.bincount(draws, minlength=16)
    assert counts[~support].sum() == 0
    assert stats.chisquare(counts[support], probs[support] * n).pvalue > 1e-3
    wrong = np.exp(np.asarray(processed_logprobs(logits, SamplingConfig(1.0, 12)), np.float64))
    assert stats.chisquare(counts[support], wrong[support] / wrong[support].sum() * n).pvalue < 1e-6


@pytest.mark.parametrize(
    "kwargs,word",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
    ],
)
def test_bad_sampling_settings(kwargs, word):
    with pytest.raises(SamplingError, match=word):
        SamplingConfig(**kwargs)


def test_bad_requests(tiny):
    model, _ = tiny
    eng = Engine(model.params, model.config, num_pages=64, page_size=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.generate([[1, 2]], -1)
    with pytest.raises(ValueError, match="context"):
        eng.generate([[1] * 500], 20)
    with pytest.raises(ValueError, match="vocabulary"):
        eng.generate([[1, 99999]], 2)


def test_engine_survives_a_failing_call(tiny):
    """A call that fails after the pools were handed to jit leaves the engine usable."""
    from specjax.proposers import PromptLookupProposer

    class Broken(PromptLookupProposer):
        def propose(self, *args, **kwargs):
            raise RuntimeError("broken proposer")

    model, _ = tiny
    eng = Engine(model.params, model.config, num_pages=64, page_size=4)
    before = eng.generate([PROMPTS[0]], 6, eos_token_ids=())
    with pytest.raises(RuntimeError, match="broken proposer"):
        eng.generate([PROMPTS[0]], 6, eos_token_ids=(), proposer=Broken())
    assert eng.allocator.num_free == 64
    assert eng.generate([PROMPTS[0]], 6, eos_token_ids=()).token_ids == before.token_ids


MANY = [PROMPTS[i % 3][: 1 + (5 * i) % 19] + [i + 1] for i in range(11)]


@pytest.mark.parametrize("slots,refill,chunk", [(4, 1, 64), (3, 2, 4), (16, None, 64)])
def test_continuous_batching_equals_generate(tiny, slots, refill, chunk, monkeypatch):
    """Each prompt's answer (sampled, seeded per prompt; EOS cuts some short) equals a call of
    `generate` on that prompt alone, whatever slot it ran in and whoever shared the batch
    (prompts prefilled in one chunk or in chunks of 4 tokens)."""
    import specjax.continuous

    monkeypatch.setattr(specjax.continuous, "PREFILL_CHUNK", chunk)
    model, _ = tiny
    eng = Engine(model.params, model.config, num_pages=64, page_size=4)
    s = SamplingConfig(temperature=1.0)
    free = eng.generate([MANY[0]], 12, sampling=s, seeds=[100], eos_token_ids=())
    eos = (free.token_ids[0][5],)  # a token sampled early, so some answers end before 12
    got = list(
        eng.generate_continuous(
            MANY,
            12,
            slots=slots,
            refill=refill,
            sampling=s,
            seeds=[100 + i for i in range(len(MANY))],
            eos_token_ids=eos,
        )
    )
    assert sorted(r.index for r in got) == list(range(len(MANY)))
    for r in got:
        one = eng.generate([MANY[r.index]], 12, sampling=s, seeds=[100 + r.index], eos_token_ids=eos)
        assert r.token_ids == one.token_ids[0]
        assert r.finished_by_eos == one.finished_by_eos[0]
        assert r.steps == one.steps[0] == len(r.token_ids)
    assert any(r.finished_by_eos for r in got) and not all(r.finished_by_eos for r in got)
    assert eng.allocator.num_free == 64  # every page back; the engine still works
    assert (
        eng.generate([MANY[3]], 4, eos_token_ids=()).token_ids[0]
        == eng.generate([MANY[3]], 4, eos_token_ids=()).token_ids[0]
    )


def test_continuous_batching_waits_for_pages(tiny):
    """A pool that holds two sequences at a time still answers all prompts (slots wait for
    pages); a pool too small for one sequence raises CacheFullError and keeps its pages."""
    from specjax import CacheFullError

    model, _ = tiny
    eng = Engine(model.params, model.config, num_pages=10, page_size=4)  # 5 pages per sequence
    prompts = [p[:8] for p in MANY[:5]]
    got = {r.index: r.token_ids for r in eng.generate_continuous(prompts, 10, slots=4, eos_token_ids=())}
    want = (
        Engine(model.params, model.config, num_pages=64, page_size=4).generate(prompts, 10, eos_token_ids=()).token_ids
    )
    assert [got[i] for i in range(5)] == want
    small = Engine(model.params, model.config, num_pages=3, page_size=4)
    with pytest.raises(CacheFullError, match="out of pages"):
        list(small.generate_continuous(prompts, 10, slots=2))
    assert small.allocator.num_free == 3


def test_continuous_batching_early_close_and_zero_tokens(tiny):
    model, _ = tiny
    eng = Engine(model.params, model.config, num_pages=64, page_size=4)
    it = eng.generate_continuous(MANY, 8, slots=4, eos_token_ids=())
    first = next(it)
    it.close()  # a consumer that stops early gives every page back
    assert eng.allocator.num_free == 64 and len(first.token_ids) == 8
    assert [r.token_ids for r in eng.generate_continuous(MANY[:2], 0)] == [[], []]
    with pytest.raises(ValueError, match="slots"):
        list(eng.generate_continuous(MANY, 4, slots=0))


def test_seed_keys_extend_prngkey_to_64_bit_seeds():
    """Every seed `jax.random.PRNGKey` takes keeps its key (answers reproduce as before); seeds
    up to 2**64 - 1 get keys of their own; others are refused by name."""
    import numpy as np

    from specjax.batching import seed_keys

    small = [0, 7, 2**31 - 1, -1, -(2**31)]
    assert (seed_keys(small) == np.stack([np.asarray(jax.random.PRNGKey(s)) for s in small])).all()
    big = seed_keys([5, 2**32 + 5, 2**63, 2**64 - 1])
    assert len({tuple(k) for k in big}) == 4
    for bad in (2**64, -(2**31) - 1, 1.5, True):
        with pytest.raises(GenerationError, match="seed"):
            seed_keys([bad])
