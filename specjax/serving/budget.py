"""Load-aware speculation: how many draft-tree nodes a step verifies, chosen per round from the
measured cost of a step and the measured tokens it yields.

A verify pass over T nodes costs about one node's on a GPU at batch 1, but on a busy batch, or
on a CPU, rows cost compute: at batch 16 a 9-node tree verifies 144 rows where plain decoding
verifies 16. `BudgetedProposer` cuts the drafter's tree each step to its first `budget` nodes
(a traced parameter, so changing it compiles nothing; 1 is plain decoding through the same
step). Nodes come after their parents, so a prefix of a tree is a tree, and acceptance only
follows valid nodes: the cut keeps every rule lossless. `SpeculationBudget` picks the budget
that maximises measured tokens per second for the batch size running.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from typing import Any

import jax
import jax.numpy as jnp

from specjax.draft_tree import DraftTree
from specjax.spec_decode import ProposerWrapper

MAX_PROBE_INTERVAL = 64  # segments between two probes of a width that keeps losing, at most


@dataclasses.dataclass(frozen=True)
class BudgetedProposer(ProposerWrapper):
    """`base` with its trees cut to their first `params["budget"]` nodes; params are
    {"base": the base's params, "budget": int32}. `widths`: the budgets a server may choose,
    each verified at exactly that width. `drafting=False` (see `without_drafting`) verifies the
    root alone."""

    base: Any
    widths: tuple
    drafting: bool = True

    # every contract member is the base's (ProposerWrapper) but these
    @property
    def likely_widths(self):
        return tuple(sorted(set(self.base.likely_widths) | set(self.widths)))

    def init(self, params, pools, ctx, prompt_chunk, prompt_len):
        return self.base.init(params["base"], pools, ctx, prompt_chunk, prompt_len)

    def propose(self, params, state, ctx, keys, sampling):
        """The base's tree cut to its first `budget` nodes; with `drafting` off, the root alone
        (the pending token: a plain decoding step) and no draft work at all."""
        if self.drafting:
            tree, new_state = self.base.propose(params["base"], state, ctx, keys, sampling)
            keep = jnp.arange(tree.size)[None, :] < params["budget"]
            return tree.replace(valid=tree.valid & keep), new_state
        shapes, _ = jax.eval_shape(lambda: self.base.propose(params["base"], state, ctx, keys, sampling))
        b, t = shapes.tokens.shape
        root = jnp.arange(t)[None, :] == 0
        pending = ctx.tokens[jnp.arange(b), ctx.lengths - 1]
        tree = DraftTree(
            tokens=jnp.where(root, pending[:, None], 0).astype(shapes.tokens.dtype),
            parent=jnp.full((b, t), -1, shapes.parent.dtype),
            depth=jnp.zeros((b, t), shapes.depth.dtype),
            valid=jnp.broadcast_to(root, (b, t)),
            draft_logprobs=None
            if shapes.draft_logprobs is None
            else jnp.zeros(shapes.draft_logprobs.shape, shapes.draft_logprobs.dtype),
            acceptable=None if shapes.acceptable is None else jnp.broadcast_to(root, (b, t)),
        )
        return tree, state

    @property
    def plain_decode(self) -> bool:
        """Drafting off over a base that defers its update: vanilla's decode step and `record`."""
        return not self.drafting and self.base.defers_update

    def record(self, params, state, block_tables, positions, features, active):
        return self.base.record(params["base"], state, block_tables, positions, features, active)

    def without_drafting(self) -> "BudgetedProposer | None":
        """The same proposer with drafting off (width 1 without the draft's cost: a program of
        its own, since a `lax.cond` around drafting would copy the draft's KV pools every step
        on XLA:CPU; vanilla's decode step and `record` where the base defers its update), or
        None when the base's update needs its propose."""
        if not self.base.propose_may_be_skipped:
            return None
        return dataclasses.replace(self, drafting=False)

    def update(self, params, state, ctx, result, active):
        """The base's update; with drafting off only the root is ever accepted, so the update
        sees the path's first node alone (EAGLE's draft chain runs over one position, not the
        tree's depth)."""
        if not self.drafting:
            result = result.replace(path=result.path[:, :1])
            ctx = ctx.replace(path_hidden=None if ctx.path_hidden is None else ctx.path_hidden[:, :1])
        return self.base.update(params["base"], state, ctx, result, active)


def budget_widths(proposer) -> tuple[int, ...]:
    """The budgets worth choosing between: plain decoding, the drafter's own likely widths, and
    its whole tree."""
    t = proposer.tree_size
    return tuple(sorted({1, t} | {w for w in proposer.likely_widths if 1 < w < t}))


class SpeculationBudget:
    """Chooses a step's budget for a batch of `rows`: the width of the highest measured tokens
    per second (tokens per running request per step, a running average, over seconds per step,
    the median of the last 8 rounds), trying each width first and probing the others now and
    then (`segment`), so the figures follow the load and the text."""

    def __init__(self, widths, probe_every: int = 16, decay: float = 0.8):
        self.widths = tuple(widths)
        self.probe_every, self.decay = probe_every, decay
        # (rows, width) -> the last seconds-per-step figures; their median is the cost (rounds
        # that compiled a new shape are not recorded; one that shared the CPU reads high)
        self.cost: dict[tuple[int, int], collections.deque] = {}
        self.gain: dict[int, float] = {1: 1.0}  # width -> new tokens per request per step
        self.peak: dict[int, float] = {1: 1.0}  # width -> the most of any one round
        self.rounds: dict[int, int] = {}
        self.calls: dict[int, int] = {}
        # `segment`'s probes: (kind, rows, width) -> (the segment or call it may run at next,
        # the wait that led there, doubled by each probe until the width is the best again)
        self.next_probe: dict[tuple, tuple[int, int]] = {}

    def cost_of(self, rows: int, width: int) -> float:
        """Seconds per step of `width` at `rows`: the median of the last 8 rounds. Not their
        least: a width's real verify width varies (a graft's chain is there or not), and one
        cheap round without a chain had made a 16-row EAGLE-2 tree look affordable."""
        return statistics.median(self.cost[(rows, width)])

    def best(self, rows: int) -> int | None:
        """The width of the highest measured tokens per second for `rows` (None: some width is
        not measured yet)."""
        if any((rows, w) not in self.cost or w not in self.gain for w in self.widths):
            return None
        rate = {w: self.gain[w] / self.cost_of(rows, w) for w in self.widths}
        return max(rate, key=rate.get)

    def segment(self, rows: int, call_start: bool, max_gain: float) -> tuple[int, bool]:
        """The next segment of `Engine.generate`, or round of the scheduler: (width, probe), a
        probe being a short one (`call_start`: new text, a call's start or a request admitted). An
        unmeasured width first, as a probe; else the best width, with every other drafting
        width probed after `probe_every` segments, and at a call's start (new text, new
        acceptance) if it was once the fastest (its best round's tokens per second beat the
        best width's now); each kind of probe waits twice as long after each one (up to
        MAX_PROBE_INTERVAL segments or calls) until the width is the best again, the periodic
        probes' waits stretched by how much dearer a step of the width is than the best's (so
        they cost about the same share of the time whatever the width: at 16 rows on a CPU a
        whole EAGLE-2 tree's step costs ~7x a plain one), and none runs if its measured cost is over
        `max_gain` (the most tokens a step can gain) times the best's. So a drafter that does
        not pay on this device costs fewer and fewer steps, and one that pays on some text is
        found there."""
        for w in reversed(self.widths):
            if (rows, w) not in self.cost or w not in self.gain:
                return w, True
        best = self.best(rows)
        n = self.rounds[rows] = self.rounds.get(rows, 0) + 1
        if call_start:
            self.calls[rows] = self.calls.get(rows, 0) + 1
        cost = {w: self.cost_of(rows, w) for w in self.widths}
        for kind in ("segment", "call"):  # the best width's probes start afresh
            self.next_probe.pop((kind, rows, best), None)
        may_pay = [w for w in self.widths if w not in (1, best) and cost[w] < max_gain * cost[best]]
        for w in may_pay:
            if self._probe_due(("segment", rows, w), n, self.probe_every, cost[w] / cost[best]):
                return w, True
        if call_start:
            for w in may_pay:
                once_best = self.peak[w] / cost[w] > self.gain[best] / cost[best]
                if once_best and self._probe_due(("call", rows, w), self.calls[rows], 0):
                    return w, True
        return best, False

    def probe_steps(self, rows: int, width: int, steps: int) -> int:
        """How many steps a probe of `width` runs: `steps`, cut in proportion where a step of it
        costs more than one of the best width (at least 2, or `steps` if fewer), so a probe of
        an expensive drafter costs about what `steps` steps of the best would."""
        best = self.best(rows)
        if best is None or best == width:
            return steps
        ratio = self.cost_of(rows, best) / self.cost_of(rows, width)
        return min(steps, max(2, round(steps * ratio)))

    def _probe_due(self, key, now: int, first_wait: int, dearer: float = 1.0) -> bool:
        """Whether the probe `key` runs at `now` (a segment or call count); if so, the next waits
        twice as long as the last wait (the first: `first_wait`, then at least 2), each wait
        stretched by `dearer` (the width's cost per step over the best's) where that is > 1."""
        stretch = max(1.0, dearer)
        at, wait = self.next_probe.setdefault(key, (now + round(first_wait * stretch), max(first_wait, 1)))
        if now < at:
            return False
        wait = min(2 * wait, MAX_PROBE_INTERVAL)
        self.next_probe[key] = (now + round(wait * stretch), wait)
        return True

    def record(self, rows: int, width: int, steps: int, seconds: float, tokens_per_request: float):
        """One round's measurement: `steps` steps in `seconds`, each running request gaining
        `tokens_per_request` tokens per step on average."""
        if steps <= 0:
            return
        self.cost.setdefault((rows, width), collections.deque(maxlen=8)).append(seconds / steps)
        if width > 1:
            self.peak[width] = max(self.peak.get(width, 0.0), tokens_per_request)
            old = self.gain.get(width, tokens_per_request)
            self.gain[width] = self.decay * old + (1 - self.decay) * tokens_per_request
