"""Continuous (in-flight) batching for vanilla decoding: a finished sequence's slot takes the
next prompt while the others keep decoding.

`Engine.generate` runs a batch until its longest answer ends, so slots whose answer ended early
idle (about a third of the passes when distilling SmolLM2 answers of up to 160 tokens).
Here the jitted decode loop returns to the host whenever `refill` slots have finished, their
pages go back to the allocator, and new prompts are prefilled into those slots alone (batches of
`refill` rows, in chunks of PREFILL_CHUNK tokens, so few shapes compile) before decoding resumes.
The block tables are cut to what the running sequences can reach: attention reads every slot of
the table, so one long prompt in the batch would otherwise slow every step. Each prompt keeps its
own PRNG key, so results do not depend on which slot or batch a prompt ran in.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.batching import DecodeState, GenerationError, bucket, seed_list
from specjax.cache import CacheFullError, PagedKVCache, block_table_array, pages_needed
from specjax.sampling import SamplingConfig

PREFILL_CHUNK = 64


@dataclasses.dataclass
class FinishedSequence:
    """One prompt's answer, yielded as soon as it ends."""

    index: int  # position of the prompt in the list given
    token_ids: list[int]  # new tokens only (EOS included when produced)
    finished_by_eos: bool
    steps: int  # decode passes the sequence took part in


def generate_continuous(engine, prompts: Sequence[Sequence[int]], max_new_tokens: int = 128, *,
                        slots: int = 32, refill: int | None = None,
                        sampling: SamplingConfig = SamplingConfig(),
                        seeds: Sequence[int] | int = 0,
                        eos_token_ids: Sequence[int] | None = None) -> Iterator[FinishedSequence]:
    """Answers of `prompts` through `engine`, `slots` sequences at a time, in finishing order.

    refill: finished slots that send the loop back to the host for new prompts (default
    slots // 8, at least 1). Seeds as in `Engine.generate` (an int: seed + prompt index).
    Prompts run in the order given: neighbours of similar lengths keep the tables narrow.
    The engine's pools are in use until the iterator is exhausted or closed.
    """

    prompts = [list(map(int, p)) for p in prompts]
    engine._check(prompts, max_new_tokens)
    if slots < 1:
        raise GenerationError(f"slots must be >= 1, got {slots}")
    n = len(prompts)
    seeds = seed_list(seeds, n)
    eos = engine.config.eos_token_ids if eos_token_ids is None else tuple(eos_token_ids)
    if max_new_tokens == 0:
        for i in range(n):
            yield FinishedSequence(i, [], False, 0)
        return
    _, decode_loop, _, _ = engine._fns
    put, put1 = engine._put_batch, engine._put_replicated
    dp = 1 if engine.mesh is None else engine.mesh.shape["data"]
    b = -(-min(slots, n) // dp) * dp
    refill = max(1, b // 8) if refill is None else max(1, min(refill, b))
    run = _Slots(engine, prompts, seeds, max_new_tokens, b, -(-refill // dp) * dp)
    limit = put1(np.int32(max_new_tokens))
    eos_arr = put1(np.asarray(eos, np.int32).reshape(-1))
    sink = engine.allocator.num_pages
    state = DecodeState(tokens=put(np.zeros((b, 1), np.int32)),
                        lengths=put(np.ones((b,), np.int32)),
                        prompt_lengths=put(np.ones((b,), np.int32)),
                        done=put(np.ones((b,), bool)), steps=put(np.zeros((b,), np.int32)),
                        keys=put(np.zeros((b, 2), np.uint32)),
                        cache=PagedKVCache(engine.k_pages, engine.v_pages,
                                           put(np.full((b, 1), sink, np.int32)),
                                           put(np.zeros((b,), np.int32))))
    engine.k_pages = engine.v_pages = None  # donated below; restored at the end
    try:
        while run.pending or run.busy():
            state = run.fill(state)
            stop = put1(np.int32(min(b, b - run.busy() + refill)))
            state = decode_loop(engine.params, engine.config, sampling, state, limit, eos_arr,
                                stop_done=stop)
            done, lengths, steps = (np.asarray(x) for x in (state.done, state.lengths,
                                                            state.steps))
            finished = [s for s in range(b) if run.owner[s] >= 0 and done[s]]
            tokens = np.asarray(state.tokens) if finished else None
            for s in finished:
                i = run.owner[s]
                out = tokens[s, len(prompts[i]):lengths[s]].tolist()
                run.release(s)
                yield FinishedSequence(i, out, bool(out) and out[-1] in eos, int(steps[s]))
            if finished:  # finished slots write (idly) into the sink page from now on
                c = state.cache
                state = state.replace(cache=c.replace(
                    block_tables=c.block_tables.at[jnp.asarray(finished)].set(sink)))
    finally:
        for s in range(b):
            if run.owner[s] >= 0:
                run.release(s)
        c = state.cache
        if c.k_pages[0].is_deleted():  # a failed call consumed the pools: start afresh
            engine._reset_pools()
        else:
            engine.k_pages, engine.v_pages = c.k_pages, c.v_pages


class _Slots:
    """Host-side bookkeeping of the slots: which prompt each holds and its pages."""

    def __init__(self, engine, prompts, seeds, max_new_tokens, b, group):
        self.engine, self.prompts, self.seeds = engine, prompts, seeds
        self.max_new, self.group = max_new_tokens, group
        self.owner = [-1] * b  # prompt index in each slot, -1 when empty
        self.pages: list[list[int]] = [[] for _ in range(b)]
        self.pending = list(range(len(prompts)))[::-1]

    def busy(self) -> int:
        return sum(o >= 0 for o in self.owner)

    def release(self, s: int) -> None:
        self.engine.allocator.free(self.pages[s])
        self.pages[s], self.owner[s] = [], -1

    def fill(self, state):
        """Prefill pending prompts into empty slots (as many as the pool has pages for), with
        the state's tables and token rows resized to what the running sequences can reach."""

        engine, allocator = self.engine, self.engine.allocator
        fill = []  # (slot, prompt index, cached tokens)
        for s in range(len(self.owner)):
            if self.owner[s] >= 0 or not self.pending:
                continue
            p = self.prompts[self.pending[-1]]
            try:
                pages, cached = allocator.allocate(len(p) + self.max_new, reusable_tokens=p[:-1])
            except CacheFullError:
                if fill or self.busy():
                    break  # wait for running sequences to free pages
                raise
            i = self.pending.pop()
            self.owner[s], self.pages[s] = i, pages
            fill.append((s, i, cached))
        reach = max(len(self.prompts[i]) + self.max_new for i in self.owner if i >= 0)
        pps = pages_needed(bucket(reach), engine.page_size)
        state = _resize(state, pps, pps * engine.page_size + 1)
        if not fill:
            return state
        return self._prefill(state, fill)

    def _prefill(self, state, fill):
        engine, put = self.engine, self.engine._put_batch
        prefill = engine._fns[0]
        sink = engine.allocator.num_pages
        pps, width = state.cache.block_tables.shape[1], state.tokens.shape[1]
        c = state.cache
        k_pages, v_pages = c.k_pages, c.v_pages
        fill = sorted(fill, key=lambda f: len(self.prompts[f[1]]))  # similar lengths per group
        for g in range(0, len(fill), self.group):
            rows = fill[g:g + self.group]
            pad = self.group - len(rows)  # rows of the group with nothing to write
            table = block_table_array([self.pages[s] for s, _, _ in rows] + [[]] * pad, pps, sink)
            done = np.asarray([cached for _, _, cached in rows] + [0] * pad, np.int32)
            todo = [self.prompts[i][cached:len(self.prompts[i]) - 1] for _, i, cached in rows]
            for start in range(0, max(map(len, todo)), PREFILL_CHUNK):
                chunk = np.zeros((self.group, PREFILL_CHUNK), np.int32)
                num = np.zeros((self.group,), np.int32)
                for r, t in enumerate(todo):
                    part = t[start:start + PREFILL_CHUNK]
                    chunk[r, :len(part)] = part
                    num[r] = len(part)
                sub = PagedKVCache(k_pages, v_pages, put(table), put(done))  # prefill donates it
                sub, _, _ = prefill(engine.params, engine.config, sub, put(chunk), put(num), ())
                k_pages, v_pages = sub.k_pages, sub.v_pages
                done = done + num
        for s, i, _ in fill:
            engine.allocator.register_prefix(self.pages[s], self.prompts[i][:-1])
        slots = jnp.asarray([s for s, _, _ in fill])
        plen = np.asarray([len(self.prompts[i]) for _, i, _ in fill], np.int32)
        tok_rows = np.zeros((len(fill), width), np.int32)
        for r, (_, i, _) in enumerate(fill):
            tok_rows[r, :plen[r]] = self.prompts[i]
        tables = block_table_array([self.pages[s] for s, _, _ in fill], pps, sink)
        keys = jax.vmap(jax.random.PRNGKey)(jnp.asarray([self.seeds[i] for _, i, _ in fill]))
        cache = PagedKVCache(k_pages, v_pages, c.block_tables.at[slots].set(jnp.asarray(tables)),
                             c.lengths.at[slots].set(jnp.asarray(plen - 1)))
        return state.replace(tokens=state.tokens.at[slots].set(jnp.asarray(tok_rows)),
                             lengths=state.lengths.at[slots].set(jnp.asarray(plen)),
                             prompt_lengths=state.prompt_lengths.at[slots].set(jnp.asarray(plen)),
                             done=state.done.at[slots].set(False),
                             steps=state.steps.at[slots].set(0),
                             keys=state.keys.at[slots].set(keys.astype(state.keys.dtype)),
                             cache=cache)


def _resize(state, pages_per_seq: int, width: int):
    """The state with block tables of pages_per_seq columns and token rows of width entries
    (cut or padded: the running sequences never reach past the new sizes)."""
    c = state.cache
    table, tokens = c.block_tables, state.tokens
    sink = c.num_pages
    if table.shape[1] != pages_per_seq:
        if table.shape[1] > pages_per_seq:
            table = table[:, :pages_per_seq]
        else:
            table = jnp.pad(table, ((0, 0), (0, pages_per_seq - table.shape[1])),
                            constant_values=sink)
    if tokens.shape[1] != width:
        tokens = (tokens[:, :width] if tokens.shape[1] > width
                  else jnp.pad(tokens, ((0, 0), (0, width - tokens.shape[1]))))
    return state.replace(tokens=tokens, cache=c.replace(block_tables=table))
