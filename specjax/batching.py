"""What every batched decoding loop shares (`generate`, `continuous`): the vanilla loop's
carry, the shape buckets that keep compiles few, per-prompt seeds, and the request error."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
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


def append_until_stop(state: DecodeState, new, count, max_new_tokens, eos_ids):
    """Append up to count[b] tokens of new[b] ([B, T]) to each unfinished sequence, stopping
    after an EOS and at max_new_tokens (int or int32[B]): (tokens, lengths, done). The one place
    both loops decide where a sequence ends."""
    b, t = new.shape
    active = ~state.done
    d = jnp.arange(t)[None, :]
    room = max_new_tokens - (state.lengths - state.prompt_lengths)
    count = jnp.minimum(count, room)
    is_eos = jnp.any(new[:, :, None] == eos_ids[None, None, :], axis=-1) & (d < count[:, None])
    hit_eos = jnp.any(is_eos, axis=1)
    count = jnp.where(hit_eos, jnp.argmax(is_eos, axis=1) + 1, count)
    count = jnp.where(active, count, 0)
    cols = jnp.where(d < count[:, None], state.lengths[:, None] + d, state.tokens.shape[1])
    tokens = state.tokens.at[jnp.arange(b)[:, None], cols].set(new, mode="drop")
    lengths = state.lengths + count
    done = state.done | (active & (hit_eos | (lengths - state.prompt_lengths >= max_new_tokens)))
    return tokens, lengths, done


def bucket(n: int, minimum: int = 16, steps_per_octave: int = 4) -> int:
    """Round n up to one of `steps_per_octave` sizes per power of two (at least `minimum`).

    Shapes, and so compiles, repeat across calls, while at most 1/steps_per_octave of the
    attention reads are wasted on slots past the longest sequence.
    """
    n = max(n, minimum)
    step = max(1, (1 << (n - 1).bit_length()) // (2 * steps_per_octave))
    return -(-n // step) * step


MAX_SEED = 2**64 - 1


def seed_keys(seeds) -> np.ndarray:
    """uint32[n, 2]: the PRNG key of each integer seed in [-2**31, 2**64): its high and low 32
    bits, which is `jax.random.PRNGKey(seed)` for every seed that takes (int32 ones, negative
    ones as their low 32 bits), so any 64-bit seed, such as a random uint64, has a key of its own."""
    out = np.empty((len(seeds), 2), np.uint32)
    for i, s in enumerate(seeds):
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not -(2**31) <= int(s) <= MAX_SEED:
            raise GenerationError(f"a seed is an integer in [-2**31, 2**64), got {s!r}")
        s = int(s)
        out[i] = (0 if s < 0 else s >> 32, s & 0xFFFFFFFF)
    return out


def seed_list(seeds, n: int) -> list[int]:
    """One sampling seed per prompt: an int gives seed + prompt index."""
    seeds = [seeds + i for i in range(n)] if isinstance(seeds, int) else list(seeds)
    if len(seeds) != n:
        raise GenerationError(f"{len(seeds)} seeds for {n} prompts")
    return seeds
