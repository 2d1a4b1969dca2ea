"""`Engine`: batched generation over a paged KV cache it owns, vanilla or speculative, on one
device or a mesh (the jitted pieces are in `specjax.decoding` and `specjax.spec_decode`)."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.batching import DecodeState, GenerationError, bucket, seed_keys, seed_list
from specjax.cache import PageAllocator, PagedKVCache, block_table_array, init_pages, pages_needed
from specjax.decoding import decode_loop, decode_step, host_array, keep_decoding, prefill  # noqa: F401 (public here)
from specjax.model_config import ModelConfig
from specjax.proposers.suffix_cache import remember_outputs
from specjax.sampling import SamplingConfig
from specjax.serving.budget import BudgetedProposer, SpeculationBudget
from specjax.sharding import (
    put_batch,
    put_replicated,
    shard_params,
    shard_proposer_params,
    sharded_init,
)
from specjax.spec_decode import SpecContext, SpecState, advance, init_proposer, scratch_slots, spec_loop

SEGMENT_STEPS = 64  # steps between two choices (16 measured 3-5% slower for EAGLE-2 on a CPU)
PROBE_STEPS = 8  # steps of a width tried first, or measured again while another is the fastest
ENGINE_PROBE_EVERY = 4  # segments between two probes of drafting while plain decoding is faster
ENGINE_DECAY = 0.5  # weight of the old tokens-per-step figure: a call's own text counts at once


@dataclasses.dataclass
class GenerationOutput:
    """Generated tokens per prompt plus the counts that speculative methods report."""

    token_ids: list[list[int]]  # new tokens only (EOS included when produced)
    steps: list[int]  # target forward passes after prefill, per prompt
    seconds: float  # wall time of this call (prefill + decode)
    finished_by_eos: list[bool]
    prefill_seconds: float = 0.0  # part of `seconds` spent before the first decode step
    # accepted_hist[i][k]: steps of prompt i that accepted exactly k drafted tokens.
    accepted_hist: list[list[int]] | None = None

    @property
    def new_tokens(self) -> list[int]:
        return [len(t) for t in self.token_ids]

    @property
    def mean_accepted(self) -> list[float]:
        """New tokens per target pass, per prompt (1.0 for vanilla decoding)."""
        return [len(t) / s if s else 0.0 for t, s in zip(self.token_ids, self.steps)]

    def acceptance_rates(self) -> list[float]:
        """rate[k-1]: fraction of steps (all prompts) that accepted at least k drafted tokens."""
        if not self.accepted_hist:
            return []
        hist = np.asarray(self.accepted_hist).sum(axis=0)
        total = hist.sum()
        return [float(hist[k:].sum() / total) if total else 0.0 for k in range(1, len(hist))]


def pool_dtype(params, requested=None):
    """The KV pools' dtype for a model: its activations' dtype (that of its embedding rows)."""
    embed = params["embed"]
    act = jnp.dtype(embed.dtype if jnp.issubdtype(embed.dtype, jnp.floating) else jnp.float32)
    if requested is not None and jnp.dtype(requested) != act:
        raise GenerationError(
            f"KV pool dtype {jnp.dtype(requested).name} differs from the model's "
            f"activations ({act.name}): leave dtype unset or load the model in "
            f"{jnp.dtype(requested).name}"
        )
    return act


class Engine:
    """Owns the page pool and allocator of one model, and runs batched generation on it.

    The pool persists across calls, so a request whose prompt shares full pages with an earlier
    one reuses their K/V (prefix caching). With a `proposer` (see `specjax.proposers`), decoding
    is speculative: each step verifies the proposer's draft tree in one target pass.
    With a `mesh` (`sharding.make_mesh`), parameters, pools and batches are split over it
    (tensor parallel over "model", batches padded to and split over "data"); see sharding.py.
    """

    def __init__(
        self,
        params,
        config: ModelConfig,
        *,
        num_pages: int = 512,
        page_size: int = 16,
        dtype=None,
        max_context: int | None = None,
        mesh=None,
    ):
        """dtype: the KV pools' dtype, by default the model's activations' (its embedding's):
        bfloat16 weights get bfloat16 pools, so attention runs on the tensor cores and reads half
        the bytes. A different dtype is refused (the kernel would mix precisions)."""
        dtype = pool_dtype(params, dtype)
        self.mesh = mesh
        self._fns = (prefill, decode_loop, spec_loop, init_proposer, advance)
        self._put_batch = self._put_replicated = jnp.asarray
        self._sharded_pparams: dict = {}
        if mesh is not None:
            params = shard_params(params, config, mesh)
            self._fns = tuple(functools.partial(f, mesh=mesh) for f in self._fns)
            self._put_batch = functools.partial(put_batch, mesh)
            self._put_replicated = functools.partial(put_replicated, mesh)
        self.params = params
        self.config = config
        self.page_size = page_size
        self.dtype = dtype
        self.max_context = max_context or config.max_position_embeddings
        self.allocator = PageAllocator(num_pages, page_size)
        self.k_pages, self.v_pages = self._init(lambda: init_pages(config, num_pages, page_size, dtype))
        self._proposer_pools: dict = {}
        self._budgets: dict = {}  # (proposer, batch) -> the SpeculationBudget measured so far

    def _init(self, make):
        """make() (pools), built directly in its shards when there is a mesh."""
        if self.mesh is None:
            return make()
        return sharded_init(self.mesh, make)

    def _sharded(self, proposer, proposer_params):
        """The proposer's parameters on the mesh (placed once per parameter pytree)."""
        if self.mesh is None or proposer_params is None:
            return proposer_params
        key = (id(proposer_params), proposer)
        if key not in self._sharded_pparams:
            self._sharded_pparams[key] = (
                proposer_params,
                shard_proposer_params(proposer, proposer_params, self.mesh, self.config.vocab_size),
            )
        return self._sharded_pparams[key][1]

    def _check(self, prompts, max_new_tokens):
        if max_new_tokens < 0:
            raise GenerationError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if not prompts:
            raise GenerationError("no prompts given")
        for p in prompts:
            if len(p) == 0:
                raise GenerationError("empty prompt: a prompt needs at least one token")
            if len(p) + max_new_tokens > self.max_context:
                raise GenerationError(
                    f"prompt of {len(p)} tokens plus max_new_tokens={max_new_tokens} exceeds the "
                    f"model's context of {self.max_context} tokens"
                )
            bad = [t for t in p if not 0 <= t < self.config.vocab_size]
            if bad:
                raise GenerationError(f"token id {bad[0]} outside the vocabulary of {self.config.vocab_size}")

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 128,
        *,
        sampling: SamplingConfig | Sequence[SamplingConfig] = SamplingConfig(),
        seeds: Sequence[int] | int = 0,
        eos_token_ids: Sequence[int] | None = None,
        warmup: bool = False,
        proposer=None,
        proposer_params=None,
        fixed_speculation: bool = False,
    ) -> GenerationOutput:
        """Generate for a batch of token-id prompts of any lengths.

        sampling: one setting for every prompt, or one per prompt (the batch runs together in
        one program either way; only an all-greedy batch runs another).

        proposer / proposer_params: a drafting method and its parameters for speculative
        decoding (None: vanilla). warmup=True compiles every function the same call would use,
        running one decode step and publishing no prefix pages, so a following timed call
        measures generation alone.

        With a proposer, every `SEGMENT_STEPS` steps the engine chooses whether the next steps
        verify the whole draft tree or run plain decoding, from the cost and the tokens per step
        it measured for this batch size (`specjax.serving.budget`; kept across calls), so
        drafting that does not pay on this device stops costing time. Those choices follow
        measured times, so a seeded sampled answer is drawn from the same distribution on every
        call but is the same tokens only with fixed_speculation=True, which verifies whole trees
        every step, in one loop on the device (so do tests that count target passes).
        """
        prompts = [list(map(int, p)) for p in prompts]
        self._check(prompts, max_new_tokens)
        t0 = time.perf_counter()
        eos = self.config.eos_token_ids if eos_token_ids is None else tuple(eos_token_ids)
        b = len(prompts)
        seeds = seed_list(seeds, b)
        per_prompt = not isinstance(sampling, SamplingConfig)
        if per_prompt:
            sampling = list(sampling)
            if len(sampling) != b or not all(isinstance(s, SamplingConfig) for s in sampling):
                raise ValueError(f"sampling: one SamplingConfig, or one per prompt ({b}), got {len(sampling)} items")
        dp = 1 if self.mesh is None else self.mesh.shape["data"]
        if b % dp:  # the "data" axis splits the batch evenly: pad with copies of the last prompt
            pad = dp - b % dp
            out = self.generate(
                prompts + [prompts[-1]] * pad,
                max_new_tokens,
                sampling=sampling + [sampling[-1]] * pad if per_prompt else sampling,
                seeds=seeds + [seeds[-1]] * pad,
                eos_token_ids=eos_token_ids,
                warmup=warmup,
                proposer=proposer,
                proposer_params=proposer_params,
                fixed_speculation=fixed_speculation,
            )
            hist = None if out.accepted_hist is None else out.accepted_hist[:b]
            return dataclasses.replace(
                out,
                token_ids=out.token_ids[:b],
                steps=out.steps[:b],
                finished_by_eos=out.finished_by_eos[:b],
                accepted_hist=hist,
            )
        if per_prompt:
            sampling = SamplingConfig.rows(sampling)
        given_params = proposer_params
        proposer_params = self._sharded(proposer, proposer_params)
        lens = [len(p) for p in prompts]
        scratch = scratch_slots(proposer)
        total = [n + max_new_tokens + scratch for n in lens]
        page_lists, cached = [], []
        allocator = self.allocator  # pages go back to it even if a failure resets the pools
        # Proposers that read every prompt token's features need the whole prompt prefilled.
        reuse = proposer is None or not proposer.needs_prompt_features
        try:
            for p, n in zip(prompts, total):
                pages, c = allocator.allocate(n, reusable_tokens=p[:-1] if reuse else ())
                page_lists.append(pages)
                cached.append(c)
        except Exception:
            for pages in page_lists:
                allocator.free(pages)
            raise
        try:
            out = self._run(
                prompts,
                lens,
                cached,
                page_lists,
                max_new_tokens,
                sampling,
                seeds,
                eos,
                t0,
                warmup,
                proposer,
                proposer_params,
                scratch,
                fixed_speculation,
            )
            if not warmup:  # a drafter's cache of earlier outputs (suffix decoding) learns them
                remember_outputs(given_params, out.token_ids)
            return out
        except BaseException:
            if self.k_pages is None:  # the pools were donated to a call that failed: start afresh
                self._reset_pools()
            raise
        finally:
            for pages in page_lists:
                allocator.free(pages)

    def generate_continuous(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 128, **options):
        """Answers of many prompts with continuous batching on the serving scheduler, yielded
        as each finishes (`FinishedSequence`); options: slots, refill, sampling, seeds,
        eos_token_ids, proposer, proposer_params. See `specjax.continuous`."""
        from specjax.continuous import generate_continuous

        return generate_continuous(self, prompts, max_new_tokens, **options)

    def _budgeted_loop(self, proposer, proposer_params, sampling, state, limit, eos, warmup):
        """The speculative loop in segments of `SEGMENT_STEPS` steps, each verifying the width
        the engine's `SpeculationBudget` for this proposer and batch size chooses. Width 1 is
        plain decoding: drafting off where the proposer allows it, else plain decoding steps
        that leave the drafter's state behind (a draft KV cache missing those tokens, a stale
        Lookahead window): later drafts from it are worse, never wrong, since every drafted
        token is verified, and the budget measures what they yield."""
        b = state.tokens.shape[0]
        run = self._fns[4]  # `advance` (on the mesh, if any)
        # plain decoding or the whole tree: a prefix of a grafted tree drops the graft's chain
        # first, and over a call's few segments each middle width measured costs more than it
        # saves (the server, with many rounds, also tries the drafter's likely widths)
        widths = (1, proposer.tree_size)
        budgeted = BudgetedProposer(proposer, widths)
        # None: `advance`'s plain decoding steps (vanilla's; for a drafter that cannot skip
        # drafting they leave its state behind)
        plain = None if proposer.plain_step_is_vanilla else budgeted.without_drafting()
        budget = self._budgets.setdefault((proposer, b), SpeculationBudget(widths, ENGINE_PROBE_EVERY, ENGINE_DECAY))
        limits = jnp.broadcast_to(limit, (b,))
        refill = jnp.int32(b + 1)  # never stop for finished rows before every row is done

        def args(width, steps=SEGMENT_STEPS):
            params = {"base": proposer_params, "budget": jnp.int32(width)}
            p = plain if width == 1 else budgeted
            return (self.params, self.config, p, params, sampling, state, limits, eos, refill, jnp.int32(steps))

        if warmup:  # one step, then plain decoding's program runs none
            for width in widths[::-1]:
                state = run(*args(width))
            return state
        done, call_start = host_array(state.done), True
        while not done.all():
            width, probe = budget.segment(b, call_start, max_gain=proposer.tree_size)
            steps, lengths = host_array(state.steps), host_array(state.lengths)
            programs = advance._cache_size()
            t0 = time.perf_counter()
            state = run(*args(width, budget.probe_steps(b, width, PROBE_STEPS) if probe else SEGMENT_STEPS))
            done = host_array(state.done)
            seconds = time.perf_counter() - t0
            ran = host_array(state.steps) - steps
            if ran.sum() and advance._cache_size() == programs:  # not a compile's time
                gained = (host_array(state.lengths) - lengths).sum() / ran.sum()
                budget.record(b, width, int(ran.max()), seconds, float(gained))
                call_start = False
        return state

    def _reset_pools(self):
        """Fresh zeroed pools and an empty prefix cache (the old contents are gone)."""
        num_pages = self.allocator.num_pages
        self.allocator = PageAllocator(num_pages, self.page_size)
        self.k_pages, self.v_pages = self._init(lambda: init_pages(self.config, num_pages, self.page_size, self.dtype))
        self._proposer_pools.clear()

    def _pools_for(self, proposer):
        if proposer not in self._proposer_pools:
            self._proposer_pools[proposer] = self._init(
                lambda: proposer.make_pools(self.allocator.num_pages, self.page_size, self.dtype)
            )
        return self._proposer_pools.pop(proposer)

    def _run(
        self,
        prompts,
        lens,
        cached,
        page_lists,
        max_new_tokens,
        sampling,
        seeds,
        eos,
        t0,
        warmup,
        proposer,
        proposer_params,
        scratch,
        fixed_speculation=False,
    ):
        b = len(prompts)
        prefill, decode_loop, spec_loop, init_proposer, _ = self._fns
        put, put1 = self._put_batch, self._put_replicated
        pages_per_seq = pages_needed(bucket(max(lens) + max_new_tokens + scratch), self.page_size)
        table = put(block_table_array(page_lists, pages_per_seq, self.allocator.num_pages))
        cache = PagedKVCache(self.k_pages, self.v_pages, table, put(np.asarray(cached, np.int32)))
        self.k_pages = self.v_pages = None  # donated below; restored from the loop's result
        chunk = [p[c : n - 1] for p, c, n in zip(prompts, cached, lens)]
        width = bucket(max(len(c) for c in chunk))
        chunk_arr = np.zeros((b, width), np.int32)
        for i, c in enumerate(chunk):
            chunk_arr[i, : len(c)] = c
        cache, features, chunk_hidden = prefill(
            self.params,
            self.config,
            cache,
            put(chunk_arr),
            put(np.asarray([len(c) for c in chunk], np.int32)),
            () if proposer is None else tuple(proposer.feature_layers),
        )
        if not warmup:
            for pages, p, n in zip(page_lists, prompts, lens):
                self.allocator.register_prefix(pages, p[: n - 1])
        buf = np.zeros((b, pages_per_seq * self.page_size + 1), np.int32)
        for i, p in enumerate(prompts):
            buf[i, : len(p)] = p
        tokens = put(buf)
        lengths = put(np.asarray(lens, np.int32))
        keys = put(seed_keys(seeds))
        limit = put1(np.int32(min(max_new_tokens, 1) if warmup else max_new_tokens))
        eos_arr = put1(np.asarray(eos, np.int32).reshape(-1))
        done = put(np.full((b,), max_new_tokens == 0))
        steps = put(np.zeros((b,), np.int32))
        hist = None
        if proposer is None:
            jax.block_until_ready(cache)
            prefill_seconds = time.perf_counter() - t0
            state = DecodeState(
                tokens=tokens,
                lengths=lengths,
                prompt_lengths=lengths + 0,
                done=done,
                steps=steps,
                keys=keys,
                cache=cache,
            )
            state = decode_loop(self.params, self.config, sampling, state, limit, eos_arr)
        else:
            prompt_width = bucket(max(lens) - 1)
            prompt_chunk = np.zeros((b, prompt_width), np.int32)
            for i, p in enumerate(prompts):
                prompt_chunk[i, : len(p) - 1] = p[:-1]
            ctx = SpecContext(tokens, lengths, cache.block_tables, features, prompt_hidden=chunk_hidden)
            pstate = init_proposer(
                proposer,
                proposer_params,
                self._pools_for(proposer),
                ctx,
                put(prompt_chunk),
                put(np.asarray(lens, np.int32) - 1),
            )
            jax.block_until_ready((cache, pstate))
            prefill_seconds = time.perf_counter() - t0
            state = SpecState(
                tokens=tokens,
                lengths=lengths,
                prompt_lengths=lengths + 0,
                done=done,
                steps=steps,
                keys=keys,
                cache=cache,
                features=features,
                proposer_state=pstate,
                accepted_hist=put(np.zeros((b, proposer.tree_size), np.int32)),
            )
            if fixed_speculation or proposer.tree_size == 1:
                state = spec_loop(self.params, self.config, proposer, proposer_params, sampling, state, limit, eos_arr)
            else:
                state = self._budgeted_loop(proposer, proposer_params, sampling, state, limit, eos_arr, warmup)
            self._proposer_pools[proposer] = proposer.pools_of(state.proposer_state)
            hist = host_array(state.accepted_hist).tolist()
        self.k_pages, self.v_pages = state.cache.k_pages, state.cache.v_pages
        tokens, lengths, steps = (host_array(x) for x in (state.tokens, state.lengths, state.steps))
        seconds = time.perf_counter() - t0
        out = [tokens[i, n : lengths[i]].tolist() for i, n in enumerate(lens)]
        eos_set = set(eos)
        return GenerationOutput(
            out, steps.tolist(), seconds, [bool(o) and o[-1] in eos_set for o in out], prefill_seconds, hist
        )
