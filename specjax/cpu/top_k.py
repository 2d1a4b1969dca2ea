"""A draft's k best tokens and their log-probabilities, per row of logits, through a native CPU
kernel (`top_log_probs.cc`) where the CPU kernels run, else XLA's.

EAGLE expands its tree by the top k of a log-softmax over the draft vocabulary several times a
step; on XLA:CPU that is two library reductions and a sort-based top_k, ~28 us for 3 rows of
4096, where one pass of the kernel over each row takes a few. The ids are lax.top_k's (ties to
the lower index); the log-probabilities agree with jax.nn.log_softmax's to float32 rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.cpu.matmul import kernel_in_use

TARGET = "specjax_top_log_probs"


def _xla(k, x):
    logp, ids = jax.lax.top_k(jax.nn.log_softmax(x, axis=-1), k)
    return logp, ids.astype(jnp.int32)


def _ffi(k, x):
    out = (jax.ShapeDtypeStruct((x.shape[0], k), jnp.float32), jax.ShapeDtypeStruct((x.shape[0], k), jnp.int32))
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(x)


def top_log_probs(logits, k: int):
    """(log-probabilities [..., k] float32, ids [..., k] int32) of the k largest logits of each
    row of logits [..., V], best first: lax.top_k(jax.nn.log_softmax(logits), k)."""
    lead, v = logits.shape[:-1], logits.shape[-1]
    if not 1 <= k <= v:
        raise ValueError(f"top {k} of {v} logits: k must be in [1, {v}]")
    x = logits.reshape(-1, v).astype(jnp.float32)
    if kernel_in_use():
        logp, ids = jax.lax.platform_dependent(x, cpu=lambda a: _ffi(k, a), default=lambda a: _xla(k, a))
    else:
        logp, ids = _xla(k, x)
    return logp.reshape(*lead, k), ids.reshape(*lead, k)
