"""Offline continuous (in-flight) batching: many prompts through the serving scheduler, a
finished sequence's slot taking the next prompt while the others keep decoding.

`Engine.generate` runs a batch until its longest answer ends, so slots whose answer ended early
idle (about a third of the passes when distilling SmolLM2 answers of up to 160 tokens). Here
the prompts go to `serving.scheduler.Scheduler`, the one batcher, run in the caller's thread
(`Scheduler.drain`): every method, prompts prefilled into the slots that free, prefix pages
reused. Offline it decodes until `refill` slots have finished, fills every free slot before
decoding resumes and cuts the block tables to what the running sequences reach (attention reads
every slot of the table, so one long prompt in the batch would otherwise slow every step). Each
prompt keeps its own PRNG key, so results do not depend on which slot or batch a prompt ran in.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

from specjax.batching import GenerationError, seed_list
from specjax.cache import CacheFullError
from specjax.sampling import SamplingConfig

# the most prompt tokens a slot prefills per pass (longer prompts take several passes)
PREFILL_CHUNK = 64


@dataclasses.dataclass
class FinishedSequence:
    """One prompt's answer, yielded as soon as it ends."""

    index: int  # position of the prompt in the list given
    token_ids: list[int]  # new tokens only (EOS included when produced)
    finished_by_eos: bool
    steps: int  # target passes the sequence took part in


def generate_continuous(
    engine,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int = 128,
    *,
    slots: int = 32,
    refill: int | None = None,
    sampling: SamplingConfig | Sequence[SamplingConfig] = SamplingConfig(),
    seeds: Sequence[int] | int = 0,
    eos_token_ids: Sequence[int] | None = None,
    proposer=None,
    proposer_params=None,
) -> Iterator[FinishedSequence]:
    """Answers of `prompts` through `engine`, `slots` sequences at a time, in finishing order.

    refill: finished slots that send the loop back to the host for new prompts (default
    slots // 8, at least 1). Seeds and sampling (one setting, or one per prompt) as in
    `Engine.generate` (an int seed: seed + prompt index);
    `proposer` (with its params) drafts as in `Engine.generate`. Prompts run in the order
    given: neighbours of similar lengths keep the tables narrow. The engine's pools are in use
    until the iterator is exhausted or closed.
    """
    from specjax.serving.scheduler import Scheduler

    prompts = [list(map(int, p)) for p in prompts]
    engine._check(prompts, max_new_tokens)
    if slots < 1:
        raise GenerationError(f"slots must be >= 1, got {slots}")
    n = len(prompts)
    seeds = seed_list(seeds, n)
    settings = [sampling] * n if isinstance(sampling, SamplingConfig) else list(sampling)
    if len(settings) != n:
        raise GenerationError(f"sampling: one SamplingConfig, or one per prompt ({n}), got {len(settings)} items")
    if max_new_tokens == 0:
        for i in range(n):
            yield FinishedSequence(i, [], False, 0)
        return
    if n == 0:
        return
    dp = 1 if engine.mesh is None else engine.mesh.shape["data"]
    b = -(-min(slots, n) // dp) * dp
    refill = max(1, b // 8) if refill is None else max(1, min(refill, b))
    scheduler = Scheduler(
        engine,
        proposer,
        proposer_params,
        max_batch=b,
        max_queue=n,
        sync_steps=max_new_tokens,
        admit_group=-(-refill // dp) * dp,
        prefill_chunk=PREFILL_CHUNK,
        eos_token_ids=eos_token_ids,
        budget=False,
        refill=refill,
        offline=True,
    )
    try:
        handles = [scheduler.submit(p, max_new_tokens, sampling=c, seed=s) for p, c, s in zip(prompts, settings, seeds)]
    except ValueError as e:  # a prompt that can never fit the pool
        raise CacheFullError(f"out of pages: {e}") from None
    index = {h.id: i for i, h in enumerate(handles)}
    for h in scheduler.drain():
        yield FinishedSequence(index[h.id], h.tokens, h.finished.reason == "stop", h.steps)
