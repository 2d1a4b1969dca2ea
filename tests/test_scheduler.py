"""The online scheduler: requests arriving at any time get the answer they would alone, for
every kind of proposer (stateless, with state and pools), greedy or sampled; cancellation, a
full queue and a full cache behave."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_eagle2

from specjax import Engine, init_params
from specjax.model_config import ModelConfig
from specjax.proposers import PromptLookupProposer
from specjax.proposers.lookahead import LookaheadProposer
from specjax.sampling import SamplingConfig
from specjax.serving.scheduler import QueueFull, RequestError, Scheduler

CFG = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=512,
    eos_token_ids=(3,),
)


@pytest.fixture(scope="module")
def target():
    return init_params(CFG, jax.random.PRNGKey(0), scale=0.5)


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        base = rng.integers(4, 64, size=int(rng.integers(3, 12))).tolist()
        out.append(base * (1 + i % 3))  # repeats, so prompt lookup finds continuations
    return out


def _proposer(kind, target):
    if kind == "vanilla":
        return None, None
    if kind == "pld":
        return PromptLookupProposer(4, 3, 1), None
    if kind == "lookahead":
        return LookaheadProposer(3, 3, 2), None
    if kind == "draft":  # the target drafting for itself
        from specjax.proposers.draft_model import DraftModelProposer

        return DraftModelProposer(CFG, max_draft_len=3), target
    return random_eagle2(CFG, target)


SAMPLED = SamplingConfig(temperature=0.8, top_k=20)


# every method greedy; sampled, one stateless and one stateful drafter (the suite's time)
@pytest.mark.parametrize(
    "kind,sampling",
    [
        ("vanilla", SamplingConfig()),
        ("pld", SamplingConfig()),
        ("eagle2", SamplingConfig()),
        ("lookahead", SamplingConfig()),
        ("vanilla", SAMPLED),
        ("eagle2", SAMPLED),
    ],
    ids=["greedy-vanilla", "greedy-pld", "greedy-eagle2", "greedy-lookahead", "sampled-vanilla", "sampled-eagle2"],
)
def test_staggered_requests_get_the_answer_they_get_alone(target, kind, sampling):
    proposer, pparams = _proposer(kind, target)
    prompts = _prompts(7)
    limits = [5 + 3 * (i % 4) for i in range(len(prompts))]
    alone = Engine(target, CFG, num_pages=64, page_size=8)
    outs = [
        alone.generate(
            [p],
            n,
            sampling=sampling,
            seeds=[11 + i],
            proposer=proposer,
            fixed_speculation=True,
            proposer_params=pparams,
        )
        for i, (p, n) in enumerate(zip(prompts, limits))
    ]
    want = [o.token_ids[0] for o in outs]
    engine = Engine(target, CFG, num_pages=64, page_size=8)
    sched = Scheduler(engine, proposer, pparams, max_batch=3, sync_steps=2, admit_group=2, budget=False).start()
    handles = []
    for i, (p, n) in enumerate(zip(prompts, limits)):
        handles.append(sched.submit(p, n, sampling=sampling, seed=11 + i))
        time.sleep(0.01 * (i % 3))  # arrivals spread over the running batch's steps
    got = [h.result(timeout=300) for h in handles]
    sched.stop()
    assert got == want
    # the same target passes too: each request's drafter state is its own, as when alone
    assert [h.steps for h in handles] == [o.steps[0] for o in outs]
    for h, n in zip(handles, limits):
        assert h.finished.reason == ("stop" if h.tokens[-1] in CFG.eos_token_ids else "length")
        assert len(h.tokens) <= n and h.steps >= 1
        if proposer is not None:
            assert 0 <= h.accepted_draft_tokens <= len(h.tokens) - 1
    assert engine.allocator.num_free == engine.allocator.num_pages
    assert engine.k_pages is not None  # the pools came back


def test_a_broken_merge_is_caught(target, monkeypatch):
    """Control: admitting rows without their proposer state (the merge skipped) leaves the
    greedy tokens alone (verification keeps them the target's) but not the steps they take, so
    the test above can fail."""
    import specjax.serving.scheduler as sched_mod

    proposer, pparams = random_eagle2(CFG, target)
    prompts = _prompts(4, seed=1)
    alone = Engine(target, CFG, num_pages=64, page_size=8)
    want = [
        alone.generate([p], 12, proposer=proposer, fixed_speculation=True, proposer_params=pparams).steps[0]
        for p in prompts
    ]
    monkeypatch.setattr(sched_mod, "merge_rows", _keep_old_rows)
    engine = Engine(target, CFG, num_pages=64, page_size=8)
    sched = Scheduler(engine, proposer, pparams, max_batch=2, admit_group=1, budget=False).start()
    handles = [sched.submit(p, 12) for p in prompts]
    for h in handles:
        h.result(timeout=300)
    sched.stop()
    assert [h.steps for h in handles] != want


def _keep_old_rows(proposer, state, fresh, slots):
    pools = {id(x) for x in jax.tree_util.tree_leaves(proposer.pools_of(fresh))}
    return jax.tree_util.tree_map(lambda old, new: new if id(new) in pools else old, state, fresh)


def test_cancel_frees_the_slot_and_others_finish(target):
    engine = Engine(target, CFG, num_pages=64, page_size=8)
    sched = Scheduler(engine, max_batch=2, sync_steps=1).start()
    long = sched.submit(_prompts(1)[0], 200)
    first = long.events.get(timeout=120)  # it runs
    assert isinstance(first, list)
    long.cancel()
    other = sched.submit(_prompts(2)[1], 6)
    assert len(other.result(timeout=120)) <= 6
    while long.finished is None:
        long.events.get(timeout=60)
    assert long.finished.reason == "cancelled"
    sched.stop()
    assert engine.allocator.num_free == engine.allocator.num_pages


def test_queue_full_and_requests_that_can_never_run(target):
    engine = Engine(target, CFG, num_pages=8, page_size=8)
    sched = Scheduler(engine, max_batch=1, max_queue=2)  # not started: the queue only fills
    sched.submit([5, 6], 4)
    sched.submit([5, 6], 4)
    with pytest.raises(QueueFull, match="queued"):
        sched.submit([5, 6], 4)
    with pytest.raises(RequestError, match="context"):
        sched.submit([5] * 500, 20)
    with pytest.raises(RequestError, match="pages"):
        sched.submit([5] * 60, 20)  # 81 slots > 8 pages of 8
    with pytest.raises(RequestError, match="empty"):
        sched.submit([], 4)
    sched.start()
    sched.stop()  # drains the two queued
    assert engine.allocator.num_free == engine.allocator.num_pages


def _serve_beside_a_running_request(target, kind, sampling, prefill_chunk):
    """A short request runs; once it has a token, a 60-token prompt arrives. Returns both
    handles, how many rounds handed the short one tokens from then to the long one's first, the
    engine (its pools given back) and the proposer."""
    proposer, pparams = _proposer(kind, target)
    rng = np.random.default_rng(5)
    short, long_ = rng.integers(4, 64, size=6).tolist(), rng.integers(4, 64, size=20).tolist() * 3
    engine = Engine(target, CFG, num_pages=64, page_size=8)
    sched = Scheduler(
        engine, proposer, pparams, max_batch=2, sync_steps=1, budget=False, prefill_chunk=prefill_chunk
    ).start()
    order = []
    first = sched.submit(short, 40, sampling=sampling, seed=1, notify=lambda e: order.append(("short", e)))
    first.events.get(timeout=300)
    order.append(("submitted", None))
    second = sched.submit(long_, 12, sampling=sampling, seed=2, notify=lambda e: order.append(("long", e)))
    first.result(timeout=300), second.result(timeout=300)
    sched.stop()
    who = [w for w, _ in order]
    rounds = who[who.index("submitted") : who.index("long")].count("short")  # events meanwhile
    return (short, long_), (first, second), rounds, engine, proposer


@pytest.mark.parametrize(
    "kind,sampling", [("vanilla", SamplingConfig()), ("eagle2", SAMPLED)], ids=["greedy-vanilla", "sampled-eagle2"]
)
def test_a_long_prompt_is_prefilled_in_chunks_between_rounds(target, kind, sampling):
    """With prefill_chunk=8 a 60-token prompt takes 8 rounds to prefill, and the running request
    gains tokens in each; both answers (and target passes) equal each alone, and the K/V and
    EAGLE's draft entries left in the pools equal those of whole-prompt prefill. Control: whole
    prompts leave the running request waiting for the long prefill."""
    prompts, chunked, rounds, engine, proposer = _serve_beside_a_running_request(target, kind, sampling, 8)
    _, whole, whole_rounds, whole_engine, _ = _serve_beside_a_running_request(target, kind, sampling, None)
    alone = Engine(target, CFG, num_pages=64, page_size=8)
    pparams = _proposer(kind, target)[1]
    outs = [
        alone.generate(
            [p], n, sampling=sampling, seeds=[seed], proposer=proposer, fixed_speculation=True, proposer_params=pparams
        )
        for p, n, seed in zip(prompts, (40, 12), (1, 2))
    ]
    for handles in (chunked, whole):
        assert [h.tokens for h in handles] == [o.token_ids[0] for o in outs]
        assert [h.steps for h in handles] == [o.steps[0] for o in outs]
    assert rounds >= 7 and whole_rounds <= 2, (rounds, whole_rounds)
    pools = [(e.k_pages, e.v_pages, e._proposer_pools.get(proposer)) for e in (engine, whole_engine)]
    n = engine.allocator.num_pages  # the sink page after them holds what idle rows wrote
    for a, b in zip(*(jax.tree_util.tree_leaves(p) for p in pools)):  # K/V [kv heads, pages, ...]
        real = (slice(None), slice(n)) if a.ndim == 4 else slice(n)  # EAGLE's features [pages, ...]
        np.testing.assert_allclose(np.asarray(a)[real], np.asarray(b)[real], rtol=1e-3, atol=1e-3)
    assert engine.allocator.num_free == engine.allocator.num_pages


def test_cache_exhaustion_makes_requests_wait(target):
    """Four requests that fit the cache one or two at a time all finish, each as alone."""
    prompts = _prompts(4, seed=2)
    alone = Engine(target, CFG, num_pages=64, page_size=8)
    want = [alone.generate([p], 20).token_ids[0] for p in prompts]
    engine = Engine(target, CFG, num_pages=9, page_size=8)  # room for about two at a time
    sched = Scheduler(engine, max_batch=4).start()
    results = {}

    def client(i):
        results[i] = sched.submit(prompts[i], 20).result(timeout=300)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sched.stop()
    assert [results[i] for i in range(4)] == want


@pytest.mark.parametrize("kind", ["eagle2", "pld", "lookahead"])
def test_the_speculation_budget_keeps_answers_and_cuts_trees(target, kind):
    """With the budget on, steps verify a prefix of each tree (down to plain decoding): answers
    stay each request's alone, and every width gets tried."""
    proposer, pparams = _proposer(kind, target)
    prompts = _prompts(6, seed=3)
    alone = Engine(target, CFG, num_pages=64, page_size=8)
    want = [
        alone.generate([p], 16, proposer=proposer, fixed_speculation=True, proposer_params=pparams).token_ids[0]
        for p in prompts
    ]
    engine = Engine(target, CFG, num_pages=64, page_size=8)
    sched = Scheduler(engine, proposer, pparams, max_batch=4, sync_steps=1).start()
    got = [h.result(timeout=300) for h in [sched.submit(p, 16) for p in prompts]]
    sched.stop()
    assert got == want
    tried = {w for (_, w) in sched.budget.cost}
    assert tried == set(sched.budget.widths) and 1 in tried and proposer.tree_size in tried


def test_the_budget_picks_the_fastest_width_and_probes_the_others_ever_less():
    """The server's choice among middle widths (`SpeculationBudget.segment`, as the engine's):
    each width measured once first, the whole tree first; then the fastest, the others probed
    after `probe_every` rounds, then after twice as many each time while they keep losing, each
    wait stretched by how much dearer the probed width's step is than the best's."""
    from specjax.serving.budget import SpeculationBudget

    b = SpeculationBudget((1, 4, 9), probe_every=4)
    measured = {9: (0.9, 2.5), 4: (0.4, 2.0), 1: (0.25, 1.0)}  # seconds per step, tokens
    tried = []
    for _ in range(3):
        w, probe = b.segment(8, False, max_gain=9)
        assert probe
        tried.append(w)
        b.record(8, w, 10, 10 * measured[w][0], measured[w][1])
    assert tried == [9, 4, 1]
    # tokens per second: 9 -> 2.78, 4 -> 5.0, 1 -> 4.0; plain decoding's gain is known exactly.
    # A step of 9 costs 2.25x one of 4: waits of 4, 8, 16 rounds become 9, 18, 36.
    picks = [b.segment(8, False, max_gain=9) for _ in range(64)]
    probes = [n for n, (w, probe) in enumerate(picks, 1) if probe]
    assert [w for w, _ in picks].count(4) == 61 and probes == [10, 28, 64]
    assert all(picks[n - 1] == (9, True) for n in probes)
    assert b.probe_steps(8, 9, 4) == 2 and b.probe_steps(8, 9, 1) == 1  # cut, never past a round
    b.record(1, 9, 10, 10 * 0.1, 2.5)  # a batch of one row: the whole tree is cheap there
    b.record(1, 4, 10, 10 * 0.09, 2.0)
    b.record(1, 1, 10, 10 * 0.08, 1.0)
    assert b.segment(1, False, max_gain=9) == (9, False)


def test_the_server_never_probes_a_width_no_acceptance_could_pay_for(target):
    """Rounds of a width whose step costs more than the tree's size times plain decoding's
    never run (on a CPU at 16 rows a whole tree costs ~4x a plain step); answers stay exact."""
    proposer, pparams = _proposer("eagle2", target)
    prompts = _prompts(2, seed=4)
    want = Engine(target, CFG, num_pages=64, page_size=8).generate(prompts, 40, eos_token_ids=()).token_ids
    engine = Engine(target, CFG, num_pages=64, page_size=8)
    sched = Scheduler(engine, proposer, pparams, max_batch=2, sync_steps=1, eos_token_ids=())
    budget = sched.budget
    for rows in (1, 2):
        for w in budget.widths:  # as if measured: drafting 1000x dearer than plain decoding
            budget.record(rows, w, 1, 0.001 if w == 1 else 1.0, 1.0 if w == 1 else 2.0)
    sched.start()
    got = [h.result(timeout=300) for h in [sched.submit(p, 40) for p in prompts]]
    sched.stop()
    assert got == want
    assert sum(len(budget.cost[(r, 1)]) for r in (1, 2)) > 8  # 40 rounds at width 1
    assert all(len(budget.cost[(r, w)]) == 1 for r in (1, 2) for w in budget.widths if w > 1)


def test_the_engines_segments_probe_drafting_on_new_text():
    """`Engine.generate`'s choice (`SpeculationBudget.segment`): unmeasured widths first as
    short probes; on plain decoding, drafting probed again after `probe_every` segments, then
    twice as long each time it loses, and at each call's start once it has been the fastest (a
    drafter that never paid is not tried on every call); never when its cost exceeds what any
    acceptance could pay; and a probe on text where drafts pay switches to drafting at once
    (decay 0.5)."""
    from specjax.serving.budget import SpeculationBudget

    b = SpeculationBudget((1, 9), probe_every=4, decay=0.5)
    assert b.segment(1, True, max_gain=9) == (9, True)
    b.record(1, 9, 8, 8 * 0.02, 1.2)  # chat: drafts rarely accepted, a step costs 2x plain's
    assert b.segment(1, False, max_gain=9) == (1, True)
    b.record(1, 1, 8, 8 * 0.01, 1.0)
    plans = [b.segment(1, n % 3 == 0, max_gain=9) for n in range(1, 30)]  # some calls start anew
    # probes after 4 segments, then 8 as drafting keeps losing (call starts or not), each wait
    # doubled since a drafting step costs twice a plain one
    assert [n for n, plan in enumerate(plans, 1) if plan == (9, True)] == [9, 25]
    assert plans.count((1, False)) == 27
    b.record(1, 9, 8, 8 * 0.02, 3.6)  # a periodic probe meets code: three tokens a step
    assert b.segment(1, False, max_gain=9) == (9, False)
    b.record(1, 9, 64, 64 * 0.02, 1.0)  # chat again: plain decoding is faster now
    assert b.segment(1, False, max_gain=9) == (1, False)
    # but drafting once paid: a new call tries it, then the 2nd and the 4th call after while it
    # loses (call 8: the periodic probe, 2 x 4 segments after drafting stopped being the best)
    calls = [b.segment(1, True, max_gain=9) for _ in range(8)]
    assert [c for c, plan in enumerate(calls, 1) if plan == (9, True)] == [1, 3, 7, 8]
    assert b.probe_steps(1, 9, 8) == 4  # a probe of a width twice as costly: half as long
    slow = SpeculationBudget((1, 9), probe_every=4, decay=0.5)
    slow.record(1, 9, 8, 8 * 0.5, 1.0)  # a step 50x plain's: no acceptance of 9 nodes pays that
    slow.record(1, 1, 8, 8 * 0.01, 1.0)
    assert all(slow.segment(1, start, max_gain=9) == (1, False) for start in (True, False) * 8)


def _eagle_init(proposer, pparams, pools, tokens, table, start, feats):
    """EAGLE's init over one prompt `tokens` from position `start`, its features `feats` [W, D]
    those of positions start .. start + W - 1, pages `table`."""
    from specjax.spec_decode import SpecContext

    n = len(tokens)
    row = np.zeros((1, 64), np.int32)
    row[0, :n] = tokens
    width = n - 1 - start
    ctx = SpecContext(
        jnp.asarray(row),
        jnp.asarray([n], jnp.int32),
        jnp.asarray([table + [0] * (8 - len(table))], jnp.int32),
        None,
        prompt_hidden=jnp.asarray(feats[None]),
        prompt_start=jnp.asarray([start], jnp.int32),
    )
    return proposer.init(pparams, pools, ctx, jnp.zeros((1, width), jnp.int32), jnp.asarray([n - 1], jnp.int32))


def test_eagle_init_resumes_from_shared_prefix_pairs(target):
    """init() from position 24 over pages another prompt left (same tokens 0..24) gives the draft
    state a whole-prompt init gives; a neighbour whose token 24 differs leaves a draft entry
    at position 23 that is not this prompt's, which is why such pages are keyed by pairs."""
    proposer, pparams = random_eagle2(CFG, target)
    rng = np.random.default_rng(5)
    prefix = rng.integers(4, 64, size=25).tolist()  # tokens 0..24: pairs 0..23 (3 pages of 8)
    mine = prefix + rng.integers(4, 64, size=9).tolist()
    feats = rng.normal(size=(len(mine) - 1, CFG.hidden_size)).astype(np.float32)
    pools = proposer.make_pools(16, 8, jnp.float32)
    alone = _eagle_init(proposer, pparams, pools, mine, [0, 1, 2, 3, 4], 0, feats)

    def resumed(neighbour_token_24):
        other = prefix[:24] + [neighbour_token_24] + rng.integers(4, 64, size=6).tolist()
        other_feats = np.concatenate([feats[:24], rng.normal(size=(len(other) - 25, CFG.hidden_size))])
        left = _eagle_init(
            proposer,
            pparams,
            proposer.make_pools(16, 8, jnp.float32),
            other,
            [8, 9, 10, 11],
            0,
            other_feats.astype(np.float32),
        )
        return _eagle_init(proposer, pparams, proposer.pools_of(left), mine, [8, 9, 10, 12, 13], 24, feats[24:])

    same = resumed(prefix[24])
    np.testing.assert_allclose(same.next_hidden, alone.next_hidden, rtol=1e-5, atol=1e-5)
    assert int(same.lengths[0]) == int(alone.lengths[0]) == len(mine) - 1
    # every draft entry: pages 0..4 alone are pages 8, 9, 10 (shared) and 12, 13 resumed
    for layer in range(len(alone.k_pages)):
        np.testing.assert_allclose(
            np.asarray(same.k_pages[layer])[:, [8, 9, 10, 12, 13]],
            np.asarray(alone.k_pages[layer])[:, [0, 1, 2, 3, 4]],
            rtol=1e-5,
            atol=1e-5,
        )
    differs = resumed(4 + (prefix[24] - 4 + 1) % 60)
    k_alone, k_differs = np.asarray(alone.k_pages[0])[:, 2], np.asarray(differs.k_pages[0])[:, 10]
    np.testing.assert_allclose(k_differs[:, :7], k_alone[:, :7], rtol=1e-5, atol=1e-5)
    assert not np.allclose(k_differs[:, 7], k_alone[:, 7], rtol=1e-3, atol=1e-3)  # position 23


@pytest.mark.parametrize("sampling", [SamplingConfig(), SAMPLED], ids=["greedy", "sampled"])
def test_eagle_requests_reuse_the_pages_of_a_shared_prefix(target, sampling):
    """A later EAGLE request whose prompt shares full pages of token pairs with an earlier one
    prefills only the rest, and gets the answer (and the target passes) it gets alone; an
    identical prompt still runs its last pair."""
    proposer, pparams = random_eagle2(CFG, target)
    rng = np.random.default_rng(7)
    prefix = rng.integers(4, 64, size=30).tolist()
    prompts = [prefix + [5, 6, 7], prefix + [9, 10], prefix + [5, 6, 7]]
    alone = Engine(target, CFG, num_pages=64, page_size=8)
    outs = [
        alone.generate(
            [p],
            8,
            sampling=sampling,
            seeds=[21 + i],
            proposer=proposer,
            fixed_speculation=True,
            proposer_params=pparams,
        )
        for i, p in enumerate(prompts)
    ]
    engine = Engine(target, CFG, num_pages=64, page_size=8)
    sched = Scheduler(engine, proposer, pparams, max_batch=2, sync_steps=2, admit_group=2, budget=False).start()
    handles = []
    for i, p in enumerate(prompts):  # one after the other: each finds the last one's pages
        handles.append(sched.submit(p, 8, sampling=sampling, seed=21 + i))
        handles[-1].result(timeout=300)
    sched.stop()
    assert [h.tokens for h in handles] == [o.token_ids[0] for o in outs]
    assert [h.steps for h in handles] == [o.steps[0] for o in outs]
    # pairs 0..29 are shared (tokens 0..30 agree): 3 full pages of 8; the repeat has pairs
    # 0..31, but its lookup stops one pair short of its last, so it reuses 3 pages too
    assert [h.cached_tokens for h in handles] == [0, 24, 24]


@pytest.mark.parametrize("kind", ["pld", "eagle2"])
def test_offline_continuous_batching_runs_every_method_on_the_scheduler(target, kind):
    """`Engine.generate_continuous` is the scheduler run in the caller's thread: with a drafter
    (stateless, or with state and pools), sampled, each prompt's answer and target passes are
    those of `generate` on the prompt alone, and the pools come back."""
    proposer, pparams = _proposer(kind, target)
    prompts = _prompts(6, seed=3)
    engine = Engine(target, CFG, num_pages=64, page_size=8)
    got = {
        r.index: r
        for r in engine.generate_continuous(
            prompts,
            9,
            slots=4,
            refill=2,
            sampling=SAMPLED,
            seeds=[50 + i for i in range(6)],
            proposer=proposer,
            proposer_params=pparams,
        )
    }
    assert sorted(got) == list(range(6))
    for i, p in enumerate(prompts):
        alone = engine.generate(
            [p], 9, sampling=SAMPLED, seeds=[50 + i], proposer=proposer, fixed_speculation=True, proposer_params=pparams
        )
        assert got[i].token_ids == alone.token_ids[0]
        assert got[i].steps == alone.steps[0] and got[i].finished_by_eos == alone.finished_by_eos[0]
    assert any(r.steps < len(r.token_ids) for r in got.values())  # drafts were accepted
    assert engine.allocator.num_free == engine.allocator.num_pages and engine.k_pages is not None


@pytest.mark.parametrize("kind", ["pld", "eagle2", "lookahead", "draft"])
def test_engine_generate_follows_its_budget(target, kind):
    """`Engine.generate` runs the budget too: answers equal vanilla's whatever the widths; with
    measurements that make plain decoding the fastest it drafts nothing (one token per pass),
    with ones that make the whole tree the fastest it drafts; and each call measures."""
    from specjax.serving.budget import SpeculationBudget

    proposer, pparams = _proposer(kind, target)
    prompts = _prompts(2, seed=5)
    engine = Engine(target, CFG, num_pages=64, page_size=8)
    vanilla = engine.generate(prompts, 24, eos_token_ids=()).token_ids
    widths = (1, proposer.tree_size)  # the engine's: plain decoding or the whole tree
    kw = dict(eos_token_ids=(), proposer=proposer, proposer_params=pparams)
    fast = {1: 1.0, proposer.tree_size: 0.001}  # seconds per step, as if measured
    for best in (1, proposer.tree_size):
        budget = SpeculationBudget(widths, probe_every=1000)
        for w in widths:
            budget.record(
                2, w, 1, fast.get(w, 10.0) if best == proposer.tree_size else (0.001 if w == 1 else 10.0), 2.0
            )
        engine._budgets[(proposer, 2)] = budget
        for _call in range(2):  # the first compiles (its rounds are not measured), the second measures
            out = engine.generate(prompts, 24, **kw)
            assert out.token_ids == vanilla
            plain = sum(out.steps) == sum(map(len, out.token_ids))
            assert plain == (best == 1), (best, out.steps)
        assert sum(len(c) for c in budget.cost.values()) > len(widths)
    # plain segments and drafting ones in turn: a drafter whose state missed the plain steps
    # (Lookahead's window, the draft model's KV cache) drafts from it, and answers stay exact
    budget = SpeculationBudget(widths, probe_every=2)
    for w in widths:
        budget.record(2, w, 1, 0.001 if w == 1 else 0.0015, 1.0)
    engine._budgets[(proposer, 2)] = budget
    out = engine.generate(prompts, 80, **kw)
    assert out.token_ids == engine.generate(prompts, 80, eos_token_ids=()).token_ids
