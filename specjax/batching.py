"""What every batched decoding loop shares (`generate`, `continuous`): the vanilla loop's
carry, the shape buckets that keep compiles few, per-prompt seeds, and the request error."""

from __future__ import annotations

import jax
from flax import struct

from specjax.cache import PagedKVCache


class GenerationError(ValueError):
    """A request that cannot run (too long, bad settings)."""


@struct.dataclass
class DecodeState:
    """Loop carry of batched decoding."""

    tokens: jax.Array  # int32[B, S]: prompt then generated tokens
    lengths: jax.Array  # int32[B]: tokens so far; tokens[length-1] is pending
    prompt_lengths: jax.Array  # int32[B]
    done: jax.Array  # bool[B]
    steps: jax.Array  # int32[B]: target passes each sequence took part in
    keys: jax.Array  # PRNG key per sequence
    cache: PagedKVCache


def bucket(n: int, minimum: int = 16, steps_per_octave: int = 4) -> int:
    """Round n up to one of `steps_per_octave` sizes per power of two (at least `minimum`).

    Shapes, and so compiles, repeat across calls, while at most 1/steps_per_octave of the
    attention reads are wasted on slots past the longest sequence.
    """
    n = max(n, minimum)
    step = max(1, (1 << (n - 1).bit_length()) // (2 * steps_per_octave))
    return -(-n // step) * step


def seed_list(seeds, n: int) -> list[int]:
    """One sampling seed per prompt: an int gives seed + prompt index."""
    seeds = [seeds + i for i in range(n)] if isinstance(seeds, int) else list(seeds)
    if len(seeds) != n:
        raise GenerationError(f"{len(seeds)} seeds for {n} prompts")
    return seeds
