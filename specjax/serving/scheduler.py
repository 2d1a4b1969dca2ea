"""Continuous batching for every method, the one batcher: online, requests arrive at any time
(a thread runs the loop, `start`); offline, every prompt is queued at once and the loop runs in
the caller's thread (`drain`, behind `Engine.generate_continuous`). Between steps the loop
admits requests into free slots, hands new tokens to their streams and frees finished or
cancelled ones.

One thread owns the engine and runs a batch of slots, as many as a power of two (up to
`max_batch`) above the requests running and waiting: a step costs what its batch's rows cost,
so one request alone decodes as fast as with `Engine.generate`. Each round it admits
queued requests into free slots (their prompts prefilled as one group, the proposer's state
initialised for those rows alone and merged into the batch's), then runs up to `sync_steps`
decoding steps in one jitted loop (fewer when a sequence finishes, so its slot frees at once),
and hands each request the tokens it gained. Every sequence drafts, verifies and accepts its own
tokens, as in `Engine.generate`; each keeps its own PRNG key, folded with its length every step,
so an answer depends on its prompt, seed and sampling settings alone, never on its neighbours.

A prompt longer than `prefill_chunk` uncached tokens is prefilled in chunks, one per round
between decoding steps (its slot stays idle until the last chunk), so a long prompt delays the
running requests by one chunk's prefill per round, not by its whole prefill.

One batch runs one `SamplingConfig` (it is compiled into the step): a request whose settings
differ from the running ones waits until those finish (first come, first served).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax.batching import DecodeState, bucket, seed_keys
from specjax.cache import CacheFullError, PagedKVCache, block_table_array, pages_needed, token_pairs
from specjax.decoding import prefill
from specjax.proposers.suffix_cache import remember_outputs
from specjax.sampling import SamplingConfig
from specjax.serving.budget import BudgetedProposer, SpeculationBudget, budget_widths
from specjax.spec_decode import SpecContext, SpecState, advance, init_proposer, scratch_slots
from specjax.token_logprobs import token_logprobs

logger = logging.getLogger("specjax.serving")


def coarse(n: int) -> int:
    """Shapes round up to powers of two (at least 16): a server meets prompts of every length,
    and each new shape compiles while requests wait."""
    return bucket(max(n, 1), steps_per_octave=1)


class QueueFull(RuntimeError):
    """The scheduler's queue holds `max_queue` requests already."""


class Unavailable(RuntimeError):
    """The decoding loop has stopped for good (`Scheduler.error`): nothing more will run."""


# Consecutive failed rounds after which the loop stops for good (each failure ends the requests
# of its round and starts afresh; failing again and again means the device itself is broken).
MAX_FAILED_ROUNDS = 3
STEP_FAILED = "the decoding step of this request failed; the server goes on (see its log)"
LOOP_STOPPED = "the decoding loop stopped; the server is restarting (see its log)"


class RequestError(ValueError):
    """A request that can never run (empty prompt, longer than the context or the cache)."""


@dataclasses.dataclass
class Finished:
    """The last event of a request: why it ended ("stop": EOS, "length": max_new_tokens,
    "cancelled", "error" with a message)."""

    reason: str
    message: str = ""


@dataclasses.dataclass
class Handle:
    """A submitted request: its events (lists of new token ids, then one `Finished`) arrive in
    `events`, and `notify(event)` is called with each (from the scheduler's thread)."""

    id: int
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingConfig
    seed: int
    notify: Callable | None = None
    events: queue.Queue = dataclasses.field(default_factory=queue.Queue)
    tokens: list[int] = dataclasses.field(default_factory=list)
    steps: int = 0  # target passes the request took part in
    accepted_draft_tokens: int = 0  # drafted tokens the target accepted
    draft_tokens: int = 0  # drafted tokens verified (tree nodes past the root, every step)
    cached_tokens: int = 0  # prompt tokens whose K/V came from shared prefix pages
    finished: Finished | None = None
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    accepted_hist: list[int] | None = None  # its target passes by drafted tokens accepted
    logprobs: bool = False  # report each token's log-probability (`token_logprobs`)
    # per token of `tokens`, when `logprobs`: (log p, [(id, log p) of the most likely ones])
    token_logprobs: list = dataclasses.field(default_factory=list)
    cancelled: bool = False

    def cancel(self) -> None:
        """Stop generating: the slot and its pages free at the next step boundary."""
        self.cancelled = True

    def _emit(self, event) -> None:
        if isinstance(event, Finished):
            self.finished, self.finished_at = event, time.perf_counter()
        elif self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.events.put(event)
        if self.notify is not None:
            try:
                self.notify(event)
            except RuntimeError:  # the listener's event loop has closed: nobody is waiting
                self.notify = None

    def result(self, timeout: float | None = None) -> list[int]:
        """Block until the request ends; its new tokens (raises on an error)."""
        while self.finished is None:
            self.events.get(timeout=timeout)
        if self.finished.reason == "error":
            raise RequestError(self.finished.message)
        return self.tokens


REMEMBER_SECONDS = 2.0  # a busy server adds finished outputs to a suffix cache this often


class Scheduler:
    """Serves requests through `engine` with `proposer` (None: vanilla decoding).

    submit() queues a request and returns its Handle; start() runs the loop on a thread;
    stop(drain=True) finishes what was submitted, then stops. The engine's pools belong to the
    scheduler while it runs.
    """

    def __init__(
        self,
        engine,
        proposer=None,
        proposer_params=None,
        *,
        max_batch: int = 8,
        max_queue: int = 256,
        sync_steps: int = 4,
        admit_group: int = 4,
        prefill_chunk: int | None = 256,
        eos_token_ids=None,
        budget: bool = True,
        refill: int = 1,
        offline: bool = False,
    ):
        """budget: choose each round how many tree nodes a step verifies, from measured cost
        and yield (`serving.budget`); False verifies the proposer's whole trees.
        prefill_chunk: the most prompt tokens a row prefills per round (None: whole prompts).
        refill: a round decodes until this many slots finished.
        offline (`specjax.continuous`, all prompts queued at once): every free slot is prefilled
        before decoding resumes (a server admits one group per round, so running requests wait
        at most one prefill), the batch keeps `max_batch` rows, and the block tables are cut to
        what the running requests reach, shrinking too (a server sizes its batch to the load
        and only grows its tables, so that it meets few shapes)."""
        if max_batch < 1 or sync_steps < 1 or admit_group < 1 or refill < 1:
            raise ValueError("max_batch, sync_steps, admit_group and refill must be >= 1")
        self.refill, self.offline = refill, offline
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1 (or None), got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        self.engine, self.proposer, self.mesh = engine, proposer, engine.mesh
        proposer_params = engine._sharded(proposer, proposer_params)  # on the mesh, if any
        self.proposer_params, self.budget, self._plain = proposer_params, None, None
        self._new_text = True  # a request was admitted since the last round: the budget may probe
        self._unremembered, self._remembered_at = [], time.perf_counter()
        self._twins: set = set()  # batch shapes whose two step programs are compiled
        if proposer is not None and budget and len(budget_widths(proposer)) > 1:
            self.proposer = BudgetedProposer(proposer, budget_widths(proposer))
            self.proposer_params = {"base": proposer_params, "budget": jnp.int32(proposer.tree_size)}
            self.budget = SpeculationBudget(budget_widths(proposer))
            # what width 1 runs: vanilla's decode step (None; a drafter that keeps no state),
            # else a program without the draft's cost, else the drafter with its tree cut to the root
            if not proposer.plain_step_is_vanilla:
                self._plain = self.proposer.without_drafting() or self.proposer
        self.max_batch, self.max_queue, self.sync_steps = max_batch, max_queue, sync_steps
        self.group = min(admit_group, max_batch)
        eos = engine.config.eos_token_ids if eos_token_ids is None else tuple(eos_token_ids)
        self.eos = tuple(int(t) for t in eos)
        self.scratch = scratch_slots(proposer)
        self._ids = itertools.count()
        self._queue: list[Handle] = []
        self._cv = threading.Condition()
        self._stopping = False
        self._drain = True
        self._thread: threading.Thread | None = None
        # per slot (row of the batch): its request, its pages, its tokens handed out (prompt
        # included); the batch starts with one slot and grows and shrinks by powers of two
        self.owner: list[Handle | None] = [None]
        self.pages: list[list[int]] = [[]]
        self.emitted = [0]
        self.filled: list[int | None] = [None]  # prompt positions prefilled, while prefilling
        self.stats = dict(
            requests=0,
            finished=0,
            cancelled=0,
            disconnected=0,  # requests whose waiting client went away (counted by the server)
            errors=0,
            new_tokens=0,
            steps=0,
            step_seconds=0.0,
            rounds=0,
            accepted_draft_tokens=0,
            prefill_chunks=0,
        )
        self.error: BaseException | None = None
        # pages per sequence the tables hold: grows with the longest request seen and never
        # shrinks, so a batch meets few shapes (each compiles while requests wait)
        self.pages_per_seq = 1

    # ---- the client side (any thread) -------------------------------------------------
    def submit(
        self,
        prompt,
        max_new_tokens: int,
        *,
        sampling: SamplingConfig = SamplingConfig(),
        seed: int = 0,
        notify: Callable | None = None,
        logprobs: bool = False,
    ) -> Handle:
        """Queue a request (raises QueueFull, or RequestError for one that can never run).
        logprobs: each new token comes with its log-probability and the most likely tokens'
        (`Handle.token_logprobs`, filled before the tokens' event)."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise RequestError("the prompt is empty")
        if max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        need = len(prompt) + max_new_tokens + self.scratch
        if len(prompt) + max_new_tokens > self.engine.max_context:
            raise RequestError(
                f"prompt of {len(prompt)} tokens plus max_tokens={max_new_tokens} "
                f"exceeds the model's context of {self.engine.max_context} tokens"
            )
        if -(-need // self.engine.page_size) > self.engine.allocator.num_pages:
            raise RequestError(
                f"prompt of {len(prompt)} tokens plus max_tokens={max_new_tokens} "
                f"needs more KV cache pages than the server has "
                f"({self.engine.allocator.num_pages})"
            )
        try:
            seed_keys([seed])
        except ValueError as e:
            raise RequestError(str(e)) from None
        handle = Handle(next(self._ids), prompt, int(max_new_tokens), sampling, int(seed), notify, logprobs=logprobs)
        with self._cv:
            if self.error is not None:
                raise Unavailable(LOOP_STOPPED)
            if self._stopping:
                raise QueueFull("the server is shutting down")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"{len(self._queue)} requests are queued already")
            self._queue.append(handle)
            self.stats["requests"] += 1
            self._cv.notify()
        return handle

    def generate(self, prompt, max_new_tokens: int, **options) -> Handle:
        """submit() and wait for the answer (the loop must be running)."""
        handle = self.submit(prompt, max_new_tokens, **options)
        handle.result()
        return handle

    def queue_depth(self) -> int:
        return len(self._queue)

    def busy(self) -> int:
        return sum(h is not None for h in self.owner)

    def decoding(self) -> list[int]:
        """Slots whose request is past its prefill."""
        return [s for s, h in enumerate(self.owner) if h is not None and self.filled[s] is None]

    def start(self) -> "Scheduler":
        self._thread = threading.Thread(target=self._run, name="specjax-scheduler", daemon=True)
        self._thread.start()
        return self

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; with drain, finish the queued and running ones first (else
        cancel them). Returns when the loop has ended."""
        with self._cv:
            self._stopping, self._drain = True, drain
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- the loop (the scheduler's thread) -----------------------------------------------
    def _run(self) -> None:
        state, failures = None, 0
        try:
            state = self._empty_state()
            while True:
                with self._cv:
                    while not self._queue and not self.busy() and not self._stopping:
                        self._cv.wait()
                    if self._stopping and not self._drain:
                        for h in self._queue:
                            h.cancel()
                        for h in self.owner:
                            if h is not None:
                                h.cancel()
                    if self._stopping and not self._queue and not self.busy():
                        break
                try:
                    state = self._round(state)
                    failures = 0
                except Exception:  # the round's requests fail; the loop goes on afresh
                    failures += 1
                    if failures >= MAX_FAILED_ROUNDS:
                        raise
                    logger.exception("a decoding round failed; its requests end with an error")
                    state = self._recover()
        except BaseException as e:  # the loop cannot go on: every request learns it at once
            logger.exception("the decoding loop stopped")
            with self._cv:
                self.error = e
                waiting, self._queue = self._queue, []
            for h in waiting + [h for h in self.owner if h is not None]:
                if h.finished is None:
                    h._emit(Finished("error", LOOP_STOPPED))
            self.stats["errors"] += 1
            self.engine._reset_pools()
            return
        finally:
            if state is not None and self.error is None:
                self._give_back(state)

    def drain(self):
        """Run the loop in the calling thread until every submitted request has ended, yielding
        each request's Handle as it ends (offline batching: `specjax.continuous`). Errors
        propagate to the caller; closing the iterator early cancels the rest. The engine's
        pools are handed back either way."""
        with self._cv:
            pending = list(self._queue)
        state = self._empty_state()
        try:
            while self._queue or self.busy():
                stuck = not self.busy() and len(self._queue)  # nothing runs to free pages
                state = self._round(state)
                if stuck and len(self._queue) == stuck:
                    raise CacheFullError(
                        f"out of pages: a waiting prompt of "
                        f"{len(self._queue[0].prompt)} tokens does not fit the "
                        f"pool's {self.engine.allocator.num_pages} pages"
                    )
                ended = [h for h in pending if h.finished is not None]
                if ended:
                    pending = [h for h in pending if h.finished is None]
                    yield from ended
        finally:
            with self._cv:
                self._queue = []
            if state.cache.k_pages[0].is_deleted():  # a failed call consumed the pools
                for s in range(len(self.owner)):
                    if self.owner[s] is not None:
                        self._release(s)
                self.engine._reset_pools()
            else:
                self._give_back(state)

    def _recover(self):
        """After a round that raised: the requests in its slots end with an error, the pools
        start afresh (a failed call may have consumed them), the queued requests stay queued."""
        for h in self.owner:
            if h is not None and h.finished is None:
                self.stats["errors"] += 1
                h._emit(Finished("error", STEP_FAILED))
        n = len(self.owner)
        self.owner, self.pages, self.emitted, self.filled = [None] * n, [[] for _ in range(n)], [0] * n, [None] * n
        self.engine._reset_pools()
        return self._empty_state()

    def _round(self, state):
        """One round: cancelled requests leave, queued ones are admitted, the batch decodes."""
        state = self._drop_cancelled(state)
        state = self._admit(state)
        if self.decoding():
            state = self._advance(state)
        return state

    def _remember(self, outputs, idle: bool) -> None:
        """Finished outputs go to the drafter's cache of earlier outputs (suffix decoding) when
        the batch empties or REMEMBER_SECONDS after the last time: each addition rebuilds the
        cache's device index, O(its capacity), so a busy server pays it at most that often."""
        self._unremembered.extend(outputs)
        now = time.perf_counter()
        if self._unremembered and (idle or now - self._remembered_at >= REMEMBER_SECONDS):
            remember_outputs(self.proposer_params, self._unremembered)
            self._unremembered, self._remembered_at = [], now

    def _give_back(self, state) -> None:
        engine = self.engine
        for s in range(len(self.owner)):
            if self.owner[s] is not None:
                self._release(s)
        engine.k_pages, engine.v_pages = state.cache.k_pages, state.cache.v_pages
        if self.proposer is not None:
            engine._proposer_pools[self.proposer] = self.proposer.pools_of(state.proposer_state)

    def _empty_state(self):
        """Every slot free (done, its table on the sink page)."""
        engine, b = self.engine, len(self.owner)
        sink = engine.allocator.num_pages
        cache = PagedKVCache(
            engine.k_pages, engine.v_pages, jnp.full((b, 1), sink, jnp.int32), jnp.zeros((b,), jnp.int32)
        )
        engine.k_pages = engine.v_pages = None  # the loop owns them until _give_back
        common = dict(
            tokens=jnp.zeros((b, engine.page_size + 1), jnp.int32),
            lengths=jnp.ones((b,), jnp.int32),
            prompt_lengths=jnp.ones((b,), jnp.int32),
            done=jnp.ones((b,), bool),
            steps=jnp.zeros((b,), jnp.int32),
            keys=jnp.zeros((b, 2), jnp.uint32),
            cache=cache,
        )
        if self.proposer is None:
            return DecodeState(**common)
        p, config = self.proposer, engine.config
        width = config.hidden_size * max(1, len(p.feature_layers))
        features = jnp.zeros((b, width), engine.dtype)
        ctx = SpecContext(
            common["tokens"],
            common["lengths"],
            cache.block_tables,
            features,
            prompt_hidden=jnp.zeros((b, 16, width), engine.dtype),
        )
        pstate = init_proposer(
            p,
            self.proposer_params,
            engine._pools_for(p),
            ctx,
            jnp.zeros((b, 16), jnp.int32),
            jnp.zeros((b,), jnp.int32),
            mesh=self.mesh,
        )
        return SpecState(
            **common, features=features, proposer_state=pstate, accepted_hist=jnp.zeros((b, p.tree_size), jnp.int32)
        )

    def _release(self, s: int) -> None:
        self.engine.allocator.free(self.pages[s])
        self.pages[s], self.owner[s], self.emitted[s], self.filled[s] = [], None, 0, None

    def _free_slots_on_device(self, state, slots):
        """Mark `slots` done with their tables on the sink page (they write nothing real)."""
        if not slots:
            return state
        idx = jnp.asarray(slots)
        c = state.cache
        return state.replace(
            done=state.done.at[idx].set(True),
            cache=c.replace(block_tables=c.block_tables.at[idx].set(self.engine.allocator.num_pages)),
        )

    def _drop_cancelled(self, state):
        with self._cv:
            gone = [h for h in self._queue if h.cancelled]
            self._queue = [h for h in self._queue if not h.cancelled]
        for h in gone:
            self.stats["cancelled"] += 1
            h._emit(Finished("cancelled"))
        slots = [s for s, h in enumerate(self.owner) if h is not None and h.cancelled]
        for s in slots:
            h = self.owner[s]
            self._release(s)
            self.stats["cancelled"] += 1
            h._emit(Finished("cancelled"))
        return self._free_slots_on_device(state, slots)

    def _prefix_key(self, prompt: list[int], lookup: bool) -> tuple[list[int], bytes]:
        """(tokens, namespace) under which a prompt's prefix pages are found (`lookup`) or
        published. K/V at position i depends on the tokens up to i; a drafter that resumes from
        prefix pairs (EAGLE) keeps entries that depend on token i + 1 too, so its pages are keyed
        by token pairs, one position short of the prompt when looking up (init() must run at
        least the last pair). Other drafters that read the prompt's features reuse nothing."""
        p = self.proposer
        if p is None or not p.needs_prompt_features:
            return prompt[:-1], b""
        if not p.resumes_from_prefix_pairs:
            return [], b""
        pairs = token_pairs(prompt)
        return (pairs[:-1] if lookup else pairs), b"pairs"

    def _take(self) -> list[int]:
        """Queued requests for the free slots, first come first served, while the pool has pages
        (whatever their sampling settings: each row samples by its own): the slots they took
        (prefilling from their cached prefix)."""
        allocator = self.engine.allocator
        taken, room = [], self.group - len(self._filling())  # rows one prefill pass takes
        with self._cv:
            for s in range(len(self.owner)):
                if self.owner[s] is not None or not self._queue or len(taken) >= room:
                    continue
                h = self._queue[0]
                need = len(h.prompt) + h.max_new_tokens + self.scratch
                try:
                    pages, cached = allocator.allocate(need, *self._prefix_key(h.prompt, True))
                except CacheFullError:
                    break  # wait for running requests to free pages
                self._queue.pop(0)
                self.owner[s], self.pages[s], self.filled[s] = h, pages, cached
                h.cached_tokens = cached
                taken.append(s)
        return taken

    def _rows_wanted(self) -> int:
        """The batch size for the running requests and those that could join now (offline: all
        `max_batch` rows, a shape of its own for every size being worth less there)."""
        if self.offline:
            return self.max_batch
        want = min(self.busy() + len(self._queue), self.max_batch)
        rows = 1
        while rows < want:
            rows *= 2
        return min(rows, self.max_batch)

    def _fit(self, state):
        """The state with as many rows as `_rows_wanted`: running slots kept (renumbered in
        order), new rows free. Grows at once; shrinks when at most half the rows are needed."""
        rows, want = len(self.owner), self._rows_wanted()
        if want == rows or (rows // 2 < want < rows):
            return state
        keep = [s for s in range(rows) if self.owner[s] is not None][:want]
        idx = np.asarray(keep + [0] * (want - len(keep)), np.int32)
        shared = {id(x) for x in (state.cache.k_pages + state.cache.v_pages)}
        if self.proposer is not None:
            shared |= {id(x) for x in jax.tree_util.tree_leaves(self.proposer.pools_of(state.proposer_state))}
        take = jnp.asarray(idx)
        state = jax.tree_util.tree_map(lambda x: x if id(x) in shared else jnp.take(x, take, axis=0), state)
        self.owner = [self.owner[s] for s in keep] + [None] * (want - len(keep))
        self.pages = [self.pages[s] for s in keep] + [[] for _ in range(want - len(keep))]
        self.emitted = [self.emitted[s] for s in keep] + [0] * (want - len(keep))
        self.filled = [self.filled[s] for s in keep] + [None] * (want - len(keep))
        return self._free_slots_on_device(state, list(range(len(keep), want)))

    def _admit(self, state):
        state = self._fit(state)
        self._take()
        if not self.busy():
            return state
        state = self._sized_tables(state)
        filling = self._filling()
        if not filling:
            return state
        state = self._prefill(state, filling[: self.group])
        self._new_text = True
        while self.offline and (self._take() or self._filling()):
            state = self._prefill(self._sized_tables(state), self._filling()[: self.group])
        return state

    def _sized_tables(self, state):
        """The state's block tables and token rows as wide as the running requests reach."""
        engine = self.engine
        reach = max(len(h.prompt) + h.max_new_tokens + self.scratch for h in self.owner if h is not None)
        if self.offline:
            pps = pages_needed(bucket(reach), engine.page_size)
        else:
            self.pages_per_seq = max(self.pages_per_seq, -(-coarse(reach) // engine.page_size))
            pps = self.pages_per_seq
        return resize_state(state, pps, pps * engine.page_size + 1)

    def _filling(self) -> list[int]:
        """Slots still prefilling their prompt, in the order their requests arrived."""
        slots = [s for s, f in enumerate(self.filled) if f is not None]
        return sorted(slots, key=lambda s: self.owner[s].id)

    def _prefill(self, state, slots):
        """Prefill the next chunk (up to `prefill_chunk` tokens) of each slot's prompt, as one
        group. Rows whose prompt ends in this chunk start decoding: their tokens, lengths, keys,
        tables, features and proposer state are written into the batch. The others stay idle
        (done, on the sink page) until a later round; only their K/V, and the entries of a
        drafter that resumes from prefix pairs, are written: a chunk is prefilled as if its
        prompt ended one token past it, as a later request resumes from shared prefix pages.
        The group has the next power of two rows at or above the count, up to `self.group`: a
        lone admission (the common case at low load) prefills one row, and the group sizes stay
        few (one compile each)."""
        engine, p, chunk = self.engine, self.proposer, self.prefill_chunk
        runs = []  # (slot, the prompt as far as this chunk reaches, first position to prefill)
        for s in slots:
            prompt, start = self.owner[s].prompt, self.filled[s]
            end = len(prompt) if chunk is None else min(len(prompt), start + chunk + 1)
            runs.append((s, prompt[:end], start))
        runs.sort(key=lambda r: len(r[1]) < len(self.owner[r[0]].prompt))  # finishing ones first
        n = sum(len(q) == len(self.owner[s].prompt) for s, q, _ in runs)  # rows that start now
        g = min(self.group, 1 << (len(runs) - 1).bit_length())
        pad = g - len(runs)
        sink = engine.allocator.num_pages
        pps, width = state.cache.block_tables.shape[1], state.tokens.shape[1]
        prompts = [q for _, q, _ in runs] + [[0]] * pad
        cached = [c for _, _, c in runs] + [0] * pad
        table = block_table_array([self.pages[s] for s, _, _ in runs] + [[]] * pad, pps, sink)
        chunks = [q[c : len(q) - 1] for q, c in zip(prompts, cached)]
        layers = () if p is None else tuple(p.feature_layers)
        c = state.cache
        sub = PagedKVCache(
            c.k_pages,
            c.v_pages,
            jnp.asarray(table),  # prefill donates it
            jnp.asarray(cached, jnp.int32),
        )
        sub, last, hidden = prefill(
            engine.params,
            engine.config,
            sub,
            _packed(chunks),
            jnp.asarray([len(x) for x in chunks], np.int32),
            layers,
            mesh=self.mesh,
        )
        self.stats["prefill_chunks"] += len(runs)
        for s, q, _ in runs[n:]:
            self.filled[s] = len(q) - 1
        for s, q, _ in runs[:n]:
            engine.allocator.register_prefix(self.pages[s], *self._prefix_key(q, False))
            self.filled[s], self.emitted[s] = None, len(q)
        on = jnp.asarray([s for s, _, _ in runs[:n]], jnp.int32)  # rows that start decoding
        plen = np.asarray([len(q) for q in prompts], np.int32)
        rows = np.zeros((g, width), np.int32)
        for r, q in enumerate(prompts):
            rows[r, : len(q)] = q
        keys = jnp.asarray(seed_keys([self.owner[s].seed for s, _, _ in runs]))
        cache = PagedKVCache(
            sub.k_pages,
            sub.v_pages,
            c.block_tables.at[on].set(jnp.asarray(table[:n])),
            c.lengths.at[on].set(jnp.asarray(plen[:n] - 1)),
        )
        new = dict(
            tokens=state.tokens.at[on].set(jnp.asarray(rows[:n])),
            lengths=state.lengths.at[on].set(jnp.asarray(plen[:n])),
            prompt_lengths=state.prompt_lengths.at[on].set(jnp.asarray(plen[:n])),
            done=state.done.at[on].set(False),
            steps=state.steps.at[on].set(0),
            keys=state.keys.at[on].set(keys[:n].astype(state.keys.dtype)),
            cache=cache,
        )
        if p is None or not (n or p.resumes_from_prefix_pairs):
            return state.replace(**new)
        # init() runs from the first position prefill ran when it resumes from shared pairs,
        # else over the whole prompt (a draft model prefills its own cache)
        start = cached if p.resumes_from_prefix_pairs else [0] * g
        ctx = SpecContext(
            jnp.asarray(rows),
            jnp.asarray(plen),
            jnp.asarray(table),
            last,
            prompt_hidden=hidden,
            prompt_start=jnp.asarray(start, jnp.int32),
        )
        fresh = init_proposer(
            p,
            self.proposer_params,
            p.pools_of(state.proposer_state),
            ctx,
            _packed([q[c : len(q) - 1] for q, c in zip(prompts, start)]),
            jnp.asarray(plen - 1),
            mesh=self.mesh,
        )
        return state.replace(
            **new,
            features=state.features.at[on].set(last[:n]),
            proposer_state=merge_rows(p, state.proposer_state, fresh, on),
            accepted_hist=state.accepted_hist.at[on].set(0),
        )

    def _compile_twin(self, args):
        """On a batch shape first met, compile the other of the two step programs (drafting,
        and drafting off at width 1) too, so that the budget's first switch between them does
        not stall every running request while it compiles."""
        if self.budget is None or self._plain is self.proposer:
            return
        key = _twin_key(args)
        if key in self._twins:
            return
        self._twins.add(key)
        other = self.proposer if args[2] is self._plain else self._plain
        advance.lower(*args[:2], other, *args[3:], mesh=self.mesh).compile()

    def _score_new_tokens(self, state, tokens, lengths) -> None:
        """Log-probabilities of the tokens the round gave the requests that asked for them, in
        one pass over those rows (`token_logprobs`), appended to their handles."""
        rows = [s for s in self.decoding() if self.owner[s].logprobs and lengths[s] > self.emitted[s]]
        if not rows:
            return
        start = np.asarray([self.emitted[s] - 1 for s in rows])  # the token before the first new one
        count = np.asarray([lengths[s] - self.emitted[s] for s in rows])
        r, t = 1 << (len(rows) - 1).bit_length(), coarse(int(count.max()))  # few shapes
        inputs, targets = np.zeros((r, t), np.int32), np.zeros((r, t), np.int32)
        for i, (s, a, n) in enumerate(zip(rows, start, count)):
            inputs[i, :n], targets[i, :n] = tokens[s, a : a + n], tokens[s, a + 1 : a + n + 1]
        at = np.zeros((r,), np.int32)
        at[: len(rows)] = rows
        lengths_in = np.zeros((r,), np.int32)
        lengths_in[: len(rows)] = start
        counts = np.zeros((r,), np.int32)
        counts[: len(rows)] = count
        c = state.cache
        view = c.replace(block_tables=c.block_tables[jnp.asarray(at)], lengths=jnp.asarray(lengths_in))
        args = (jnp.asarray(x) for x in (inputs, targets, counts))
        logp, top, ids = (np.asarray(x) for x in token_logprobs(self.engine.params, self.engine.config, view, *args))
        for i, (s, n) in enumerate(zip(rows, count)):
            self.owner[s].token_logprobs.extend(
                (float(logp[i, j]), list(zip(ids[i, j].tolist(), top[i, j].tolist()))) for j in range(n)
            )

    def _sampling(self) -> SamplingConfig:
        """Each row's sampling settings (a free row's: greedy), as arrays the step program takes:
        one program samples any mix of settings, another serves all-greedy batches."""
        return SamplingConfig.rows([SamplingConfig() if h is None else h.sampling for h in self.owner])

    def _advance(self, state):
        limits = np.zeros((len(self.owner),), np.int32)
        for s in self.decoding():
            limits[s] = self.owner[s].max_new_tokens
        params, width, proposer = self.proposer_params, None, self.proposer
        steps = self.sync_steps
        if proposer is not None:
            width = proposer.tree_size
        if self.budget is not None:
            # as in Engine.generate: probes of a width that keeps losing wait ever longer and run
            # fewer steps where a step costs more (at 16 rows on a CPU a whole tree costs ~4x)
            rows = len(self.owner)
            width, probe = self.budget.segment(rows, self._new_text, max_gain=proposer.tree_size)
            self._new_text = False
            if probe:
                steps = self.budget.probe_steps(rows, width, steps)
            params = {**params, "budget": jnp.int32(width)}
            if width == 1:
                proposer = self._plain
        args = (
            self.engine.params,
            self.engine.config,
            proposer,
            params,
            self._sampling(),
            state,
            jnp.asarray(limits),
            jnp.asarray(self.eos, jnp.int32).reshape(-1),
            jnp.int32(self.refill),
            jnp.int32(steps),
        )
        self._compile_twin(args)
        t0 = time.perf_counter()
        steps_before, lengths_before = np.asarray(state.steps), np.asarray(state.lengths)
        programs = advance._cache_size()
        state = advance(*args, mesh=self.mesh)
        tokens, lengths, done, steps = (np.asarray(x) for x in (state.tokens, state.lengths, state.done, state.steps))
        seconds = time.perf_counter() - t0
        ran = steps - steps_before
        self.stats["step_seconds"] += seconds
        self.stats["rounds"] += 1
        self.stats["steps"] += int(ran.max(initial=0))
        compiled = advance._cache_size() != programs  # the round's time is mostly compiling
        if self.budget is not None and ran.sum() and not compiled:
            self.budget.record(
                len(self.owner), width, int(ran.max()), seconds, float((lengths - lengths_before).sum() / ran.sum())
            )
        hist = None if self.proposer is None else np.asarray(state.accepted_hist)
        self._score_new_tokens(state, tokens, lengths)
        finished = []
        for s in self.decoding():
            h = self.owner[s]
            new = tokens[s, self.emitted[s] : lengths[s]].tolist()
            self.emitted[s] = int(lengths[s])
            h.steps = int(steps[s])
            if hist is not None:
                h.accepted_draft_tokens = int((hist[s] * np.arange(hist.shape[1])).sum())
                h.accepted_hist = hist[s].tolist()
                h.draft_tokens += int(ran[s]) * (width - 1)
            if new:
                h.tokens.extend(new)
                self.stats["new_tokens"] += len(new)
                h._emit(new)
            if done[s]:
                finished.append(s)
        self._remember([self.owner[s].tokens for s in finished], idle=len(finished) == len(self.decoding()))
        for s in finished:
            h = self.owner[s]
            self._release(s)
            self.stats["finished"] += 1
            self.stats["accepted_draft_tokens"] += h.accepted_draft_tokens
            stopped = bool(h.tokens) and h.tokens[-1] in self.eos
            h._emit(Finished("stop" if stopped else "length"))
        return self._free_slots_on_device(state, finished)


def resize_state(state, pages_per_seq: int, width: int):
    """The state with block tables of pages_per_seq columns and token rows of width entries
    (cut or padded: the running sequences never reach past the new sizes)."""
    c = state.cache
    table, tokens = c.block_tables, state.tokens
    sink = c.num_pages
    if table.shape[1] != pages_per_seq:
        if table.shape[1] > pages_per_seq:
            table = table[:, :pages_per_seq]
        else:
            table = jnp.pad(table, ((0, 0), (0, pages_per_seq - table.shape[1])), constant_values=sink)
    if tokens.shape[1] != width:
        tokens = (
            tokens[:, :width] if tokens.shape[1] > width else jnp.pad(tokens, ((0, 0), (0, width - tokens.shape[1])))
        )
    return state.replace(tokens=tokens, cache=c.replace(block_tables=table))


def _packed(runs) -> jax.Array:
    """int32[len(runs), coarse(longest)]: token runs, zero-padded to a shape of few sizes."""
    out = np.zeros((len(runs), coarse(max(map(len, runs)))), np.int32)
    for r, q in enumerate(runs):
        out[r, : len(q)] = q
    return jnp.asarray(out)


def _twin_key(args):
    _, _, _, _, sampling, state, _, eos, _, _ = args
    return (state.tokens.shape, state.cache.block_tables.shape, sampling.greedy, eos.shape)


def merge_rows(proposer, state, fresh, slots):
    """`state` with `fresh`'s first len(slots) rows written at `slots`: every leaf is batch-major
    but the proposer's pools (`pools_of`), which are shared and taken from `fresh` whole (the
    call that built `fresh` consumed the old ones)."""
    pools = {id(x) for x in jax.tree_util.tree_leaves(proposer.pools_of(fresh))}
    n = slots.shape[0]
    return jax.tree_util.tree_map(
        lambda old, new: new if id(new) in pools else old.at[slots].set(new[:n]), state, fresh
    )
