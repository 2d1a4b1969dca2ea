"""The jitted pieces of plain decoding: ragged prefill through the paged cache, one decode step,
and the decode loop (`Engine`'s and the scheduler's).

Convention shared with speculative decoding (docs/design.md, "The paged KV cache"): the cache
holds the K/V of tokens[:, :length-1]; the last token, tokens[length-1], is pending and is the
first token the next target pass reads. Prefill therefore writes prompt[:-1] and computes no
logits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.attention import attention_mesh
from specjax.batching import DecodeState, append_until_stop
from specjax.cache import PagedKVCache
from specjax.model import causal_mask, forward
from specjax.model_config import ModelConfig
from specjax.sampling import SamplingConfig, sample_tokens
from specjax.sharding import pinning, to_host


@functools.partial(jax.jit, static_argnames=("config", "feature_layers", "mesh"), donate_argnames=("cache",))
def prefill(
    params, config: ModelConfig, cache: PagedKVCache, tokens, num_tokens, feature_layers: tuple = (), mesh=None
):
    """Write the K/V of tokens[b, :num_tokens[b]] after each sequence's committed prefix.

    Returns the cache, the features [B, F] of each sequence's last written token (the features
    that predicted the pending token; zeros when nothing was written) and those of every token
    [B, T, F]. Features are the final hidden state, or with `feature_layers` those layers'
    outputs concatenated (EAGLE-3).
    """
    b, t = tokens.shape
    pin = pinning(mesh, b)
    cache = pin(cache)
    positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    valid = jnp.arange(t)[None, :] < num_tokens[:, None]
    with attention_mesh(mesh):
        out = forward(
            params,
            config,
            tokens,
            positions,
            cache,
            causal_mask(b, t),
            valid=valid,
            logits_at=jnp.zeros((b, 0), jnp.int32),
            hidden_layers=feature_layers,
        )
    hidden = jnp.concatenate(out.layer_hiddens, -1) if feature_layers else out.hidden
    last = jnp.take_along_axis(hidden, jnp.maximum(num_tokens - 1, 0)[:, None, None], axis=1)
    last = jnp.where((num_tokens > 0)[:, None], last[:, 0], 0)
    return pin((out.cache.replace(lengths=cache.lengths + num_tokens), last, hidden))


def host_array(x):
    """numpy copy of a result (gathered across hosts when the mesh spans several)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return to_host(x)
    return np.asarray(x)


def decode_step(
    params, config: ModelConfig, sampling: SamplingConfig, s: DecodeState, max_new_tokens, eos_ids
) -> DecodeState:
    """One vanilla decoding step: every unfinished sequence appends one sampled token."""
    return decode_step_with_features(params, config, sampling, s, max_new_tokens, eos_ids)[0]


def decode_step_with_features(
    params, config: ModelConfig, sampling: SamplingConfig, s: DecodeState, max_new_tokens, eos_ids, feature_layers=()
):
    """`decode_step`, and the features [B, F] of the pending token it read (the final hidden
    state, or with `feature_layers` those layers' outputs concatenated, as `prefill`'s): a
    drafter that defers its update stores them (`spec_decode.recorded_decode_step`)."""
    b = s.tokens.shape[0]
    rows = jnp.arange(b)
    pending = s.tokens[rows, s.lengths - 1][:, None]
    positions = (s.lengths - 1)[:, None]
    out = forward(
        params,
        config,
        pending,
        positions,
        s.cache,
        jnp.ones((b, 1, 1), bool),
        logits_at=jnp.zeros((b, 1), jnp.int32),
        hidden_layers=feature_layers,
    )
    hidden = jnp.concatenate(out.layer_hiddens, -1) if feature_layers else out.hidden
    keys = jax.vmap(jax.random.fold_in)(s.keys, s.lengths)
    nxt = sample_tokens(out.logits[:, 0], keys, sampling)
    active = ~s.done
    tokens, lengths, done = append_until_stop(s, nxt[:, None], jnp.ones((b,), jnp.int32), max_new_tokens, eos_ids)
    cache = out.cache.replace(lengths=out.cache.lengths + active)
    return s.replace(tokens=tokens, lengths=lengths, done=done, steps=s.steps + active, cache=cache), hidden[:, 0]


def keep_decoding(done, stop_done=None):
    """Loop condition: some sequence unfinished (and, with stop_done, fewer than that many done)."""
    more = jnp.any(~done)
    return more if stop_done is None else more & (jnp.sum(done) < stop_done)


@functools.partial(jax.jit, static_argnames=("config", "mesh"), donate_argnames=("state",))
def decode_loop(
    params,
    config: ModelConfig,
    sampling: SamplingConfig,
    state: DecodeState,
    max_new_tokens,
    eos_ids,
    stop_done=None,
    mesh=None,
):
    """Vanilla decoding of every unfinished sequence until EOS or max_new_tokens, in one loop
    (or until `stop_done` sequences are done: continuous batching refills their slots). With a
    `mesh` the carry stays pinned to its shardings (`sharding.pinning`)."""
    pin = pinning(mesh, state.tokens.shape[0])
    with attention_mesh(mesh):
        return pin(
            jax.lax.while_loop(
                lambda s: keep_decoding(s.done, stop_done),
                lambda s: pin(decode_step(params, config, sampling, s, max_new_tokens, eos_ids)),
                pin(state),
            )
        )
