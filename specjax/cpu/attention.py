"""Tree-masked attention over the paged KV cache on CPU through a native kernel
(`paged_attention.cc`), tested against the XLA reference it replaces.

XLA's version (specjax.kernels_pallas.tree_paged_attention_reference) copies every page a sequence owns,
appends a pass's new rows, masks and softmaxes over every slot: ~4 ms of a one-token SmolLM2
step at 512 tokens of context and ~9 ms of an 8-token verify pass, more than the attention's
arithmetic. The kernel walks each query row's visible keys straight from the pages, in slot
order and then the new rows, with the same sums for every row whatever the pass's width: a
row's attention is bit-identical in a one-token decode and in a verify pass.

Chosen through the attention backend (`specjax.attention`: `SPECJAX_ATTENTION=cpu`, or
`auto` on a single CPU device where the native kernels build) for float32 heads whose size is a
multiple of 64 (at most 256); other shapes take the reference. Gradients run through the
reference; lowering for another platform takes the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.cpu.native import register
from specjax.kernels_pallas.tree_paged_attention_reference import attention_with_new_rows

TARGET = "specjax_paged_attention"


def kernel_applies(q, k_pages) -> bool:
    """Whether the kernel takes q [B, T, H, D] over pools k_pages [KVH, P, page_size, D]."""
    d = q.shape[-1]
    return (
        q.dtype == jnp.float32
        and k_pages.dtype == jnp.float32
        and d % 64 == 0
        and d <= 256
        and q.shape[2] % k_pages.shape[0] == 0
    )


def _reference(q, k_pages, v_pages, block_tables, mask, k_new, v_new, scale):
    return attention_with_new_rows(q, k_pages, v_pages, block_tables, mask, k_new, v_new, scale=scale)


def _kernel(q, k_pages, v_pages, block_tables, mask, k_new, v_new, scale):
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(
        q, k_pages, v_pages, block_tables.astype(jnp.int32), mask, k_new, v_new, scale=np.float32(scale)
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _attention(q, k_pages, v_pages, block_tables, mask, k_new, v_new, scale):
    return jax.lax.platform_dependent(
        q,
        k_pages,
        v_pages,
        block_tables,
        mask,
        k_new,
        v_new,
        cpu=functools.partial(_kernel, scale=scale),
        default=functools.partial(_reference, scale=scale),
    )


def _fwd(q, k_pages, v_pages, block_tables, mask, k_new, v_new, scale):
    return (
        _attention(q, k_pages, v_pages, block_tables, mask, k_new, v_new, scale),
        (q, k_pages, v_pages, block_tables, mask, k_new, v_new),
    )


def _bwd(scale, res, g):
    q, k_pages, v_pages, block_tables, mask, k_new, v_new = res
    _, pullback = jax.vjp(
        lambda q, kp, vp, kn, vn: _reference(q, kp, vp, block_tables, mask, kn, vn, scale),
        q,
        k_pages,
        v_pages,
        k_new,
        v_new,
    )
    dq, dkp, dvp, dkn, dvn = pullback(g)
    return dq, dkp, dvp, None, None, dkn, dvn


_attention.defvjp(_fwd, _bwd)


def cpu_paged_attention(q, k_pages, v_pages, block_tables, mask, k_new=None, v_new=None, *, scale=None):
    """Attention of q [B, T, H, D] (float32) over each sequence's page slots (block_tables
    [B, n] into pools [KVH, P, page_size, D]) followed by the rows k_new, v_new [B, Tn, KVH, D]
    of a pass not yet written (none by default), where mask [B, T, n * page_size + Tn] allows.
    Returns [B, T, H, D]; a row that sees no key is 0."""
    b, t, h, d = q.shape
    kvh = k_pages.shape[0]
    if k_new is None:
        k_new = v_new = jnp.zeros((b, 0, kvh, d), q.dtype)
    scale = d**-0.5 if scale is None else float(scale)
    reason = register()
    if reason is not None:
        raise RuntimeError(f"CPU attention kernel unavailable: {reason}")
    return _attention(q, k_pages, v_pages, block_tables, mask, k_new.astype(q.dtype), v_new.astype(q.dtype), scale)
