"""Log-probabilities of generated tokens under the target model: what an API's `logprobs` reports.

They are computed once the tokens are known, by one teacher-forced pass over them that reads the
paged cache and writes nothing. So they do not depend on how the tokens were found: a method's
verify pass and a plain decode step give logits that differ by float rounding, this pass gives
the same numbers whichever drafted. They are the model's own distribution (log-softmax of the
logits, before temperature, top-k and top-p), as vLLM reports by default.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specjax.cache import PagedKVCache
from specjax.cpu.top_k import top_log_probs
from specjax.model import causal_mask, forward
from specjax.model_config import ModelConfig

MAX_TOP_LOGPROBS = 5  # the most alternatives a request may ask for per token


@functools.partial(jax.jit, static_argnames=("config",))
def token_logprobs(params, config: ModelConfig, cache: PagedKVCache, inputs, targets, count):
    """(log p [R, T], top log-probabilities [R, T, K], their ids [R, T, K]) of targets[r, i],
    the token that followed inputs[r, i], for i < count[r] (zeros past it); K = MAX_TOP_LOGPROBS
    (or the vocabulary's size, if smaller).

    inputs[r, i] sits at position cache.lengths[r] + i and attends to the cache's first
    cache.lengths[r] entries (already written: the sequence's committed prefix) and to the
    inputs before it. Nothing is written to the cache."""
    r, t = inputs.shape
    positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    valid = jnp.arange(t)[None, :] < count[:, None]
    out = forward(params, config, inputs, positions, cache, causal_mask(r, t), valid=valid, defer_kv_write=True)
    logits = out.logits.astype(jnp.float32)
    logp = jnp.take_along_axis(logits, targets[:, :, None], axis=-1)[..., 0] - jax.nn.logsumexp(logits, axis=-1)
    top, ids = top_log_probs(logits, min(MAX_TOP_LOGPROBS, logits.shape[-1]))
    keep = valid[:, :, None]
    return jnp.where(valid, logp, 0.0), jnp.where(keep, top, 0.0), jnp.where(keep, ids, 0)
