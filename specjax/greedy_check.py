"""Whether a greedy output is vanilla's: equal, or apart only from a float32 near-tie.

Speculative steps verify several tokens per pass; on the CPU kernels each row is bit-identical
whatever the pass width, elsewhere a reduction may round differently, so two greedy runs may
part where the target's two best logits are within rounding of each other (docs/design.md,
"Acceptance, and why each rule is lossless"). Anything else is a bug.
"""

from __future__ import annotations

import numpy as np

NEAR_TIE = 1e-3  # float32 logits of this size round apart by far less


def first_difference(got, want) -> int | None:
    """The index of the first token where two outputs differ (None: equal)."""
    if list(got) == list(want):
        return None
    return next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def top2_gap(params, config, prompt, generated, i: int) -> float:
    """The gap between the two largest target logits before generated token i (teacher forced
    over prompt + generated[:i], one sequence, float32)."""
    import jax.numpy as jnp

    from specjax import PagedKVCache, causal_mask, forward
    from specjax.cache import init_pages

    seq = list(prompt) + list(generated[:i])
    t, page = len(seq), 16
    pages = -(-t // page)
    k, v = init_pages(config, pages, page)
    cache = PagedKVCache(k, v, jnp.arange(pages, dtype=jnp.int32)[None], jnp.zeros(1, jnp.int32))
    out = forward(
        params,
        config,
        jnp.asarray([seq]),
        jnp.arange(t)[None],
        cache,
        causal_mask(1, t),
        logits_at=jnp.asarray([[t - 1]]),
    )
    top = np.sort(np.asarray(out.logits[0, 0], np.float64))[-2:]
    return float(top[1] - top[0])


def compare(params, config, prompt, want, got) -> tuple[str, int | None, float | None]:
    """("equal" | "near-tie" | "differ", first differing index, the top-2 gap there)."""
    i = first_difference(got, want)
    if i is None:
        return "equal", None, None
    gap = top2_gap(params, config, prompt, want, i)
    return ("near-tie" if gap < NEAR_TIE else "differ"), i, gap
