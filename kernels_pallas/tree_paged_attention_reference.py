"""XLA reference of tree-masked attention over a paged KV cache.

Each sequence b has `lengths[b]` committed tokens in the slots 0..lengths[b]-1 of its pages
(in `block_tables[b]` order), followed by the T new tokens (a tree, a chain, or a prefill chunk)
in slots lengths[b]..lengths[b]+T-1. Query i sees every committed key and the new keys j with
tree_mask[b, i, j]. The same signature serves the Pallas kernel beside it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def visible_keys_mask(lengths, tree_mask, num_slots: int):
    """bool[B, T, num_slots]: which cache slots each new query may attend to."""
    t = tree_mask.shape[-1]
    slot = jnp.arange(num_slots)[None, None, :]
    start = lengths[:, None, None]
    committed = slot < start
    rel = slot - start
    in_tree = (rel >= 0) & (rel < t)
    tree_vis = jnp.take_along_axis(
        tree_mask, jnp.broadcast_to(jnp.clip(rel, 0, t - 1), tree_mask.shape[:2] + (num_slots,)), axis=2
    )
    return committed | (in_tree & tree_vis)


def gather_pages(pages, block_tables):
    """[KVH, B, n * page_size, D]: the slots of each sequence's pages, in table order.

    Gathered as whole rows of a 2-D view of the pool: XLA:CPU copies such rows much faster than
    it gathers 4-D slices.
    """
    kvh, num_pages, page_size, d = pages.shape
    b, n = block_tables.shape
    rows = jnp.arange(kvh, dtype=jnp.int32)[:, None, None] * num_pages + jnp.clip(block_tables, 0, num_pages - 1)[None]
    flat = pages.reshape(kvh * num_pages, page_size * d)
    return flat[rows].reshape(kvh, b, n * page_size, d)


def tree_paged_attention_reference(q, k_pages, v_pages, block_tables, lengths, tree_mask, *, scale=None, key_mask=None):
    """Attention of q [B, T, H, D] over the paged cache; returns [B, T, H, D] in q's dtype.

    k_pages, v_pages: [KVH, P, page_size, D]; block_tables int32[B, n]; lengths int32[B];
    tree_mask bool[B, T, T]. `key_mask` (bool[B, T, n*page_size]) replaces the mask derived from
    lengths and tree_mask when given (the model computes it once for all layers, with sliding
    windows). Keys the mask hides never reach the output, even when their pages hold NaN.
    """
    num_slots = block_tables.shape[1] * k_pages.shape[2]
    mask = visible_keys_mask(lengths, tree_mask, num_slots) if key_mask is None else key_mask
    return gathered_attention(
        q, gather_pages(k_pages, block_tables), gather_pages(v_pages, block_tables), mask, scale=scale
    )


def attention_with_new_rows(q, k_pages, v_pages, block_tables, mask, k_new, v_new, *, scale=None):
    """Attention over each sequence's page slots followed by the rows k_new, v_new
    [B, Tn, KVH, D] of a pass that has not written them, where mask [B, T, n * page_size + Tn]
    allows (a verify pass with deferred K/V writes)."""
    k = jnp.concatenate([gather_pages(k_pages, block_tables), jnp.moveaxis(k_new, 2, 0).astype(k_pages.dtype)], axis=2)
    v = jnp.concatenate([gather_pages(v_pages, block_tables), jnp.moveaxis(v_new, 2, 0).astype(v_pages.dtype)], axis=2)
    return gathered_attention(q, k, v, mask, scale=scale)


def gathered_attention(q, k, v, mask, *, scale=None):
    """Attention of q [B, T, H, D] over each sequence's gathered slots k, v [KVH, B, S, D]
    (`gather_pages`) where mask [B, T, S] allows; returns [B, T, H, D] in q's dtype."""
    b, t, h, d = q.shape
    kvh, _, num_slots, _ = k.shape
    scale = d**-0.5 if scale is None else scale
    # Hidden slots get weight 0, but 0 * NaN is NaN: zero their values (keys need no care, their
    # scores are replaced below).
    slot_used = jnp.any(mask, axis=1)  # [B, S]: slots some query reads
    v = jnp.where(slot_used[None, :, :, None], v, 0)
    g = h // kvh
    # float32 dots at full precision: XLA:GPU would otherwise run them as TF32 (~5e-4 off).
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    # Dots batched over the leading (kv head, sequence) axes, as XLA:CPU runs them best.
    qk = q.reshape(b, t, kvh, g, d).transpose(2, 0, 3, 1, 4).reshape(kvh, b, g * t, d)
    scores = (
        jax.lax.dot_general(
            qk, k, (((3,), (3,)), ((0, 1), (0, 1))), precision=precision, preferred_element_type=jnp.float32
        )
        * scale
    )  # [KVH, B, G*T, S]
    visible = jnp.broadcast_to(mask[None, :, None], (kvh, b, g, t, num_slots))
    scores = jnp.where(visible.reshape(kvh, b, g * t, num_slots), scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(scores - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)
    out = jax.lax.dot_general(
        p.astype(v.dtype), v, (((3,), (2,)), ((0, 1), (0, 1))), precision=precision, preferred_element_type=jnp.float32
    )  # [KVH, B, G*T, D]
    out = out.reshape(kvh, b, g, t, d).transpose(1, 3, 0, 2, 4)
    return out.reshape(b, t, h, d).astype(q.dtype)


def unwritten_keys_mask(keys_seen, slots, write_ok):
    """bool[B, T, S + T]: `keys_seen` [B, T, S] for attention over the gathered slots followed by
    the T new rows (a pass deferring its writes), which would be written at slots [B, T] where
    write_ok: the slots they would overwrite are hidden, and new row j is seen where its slot is.

    Appending the rows, a concatenation XLA fuses with the gather, made a pass faster than
    scattering them into the gathered copy (A/B on a CPU).
    """
    b, t = slots.shape
    num_slots = keys_seen.shape[-1]
    covered = jnp.any((slots[:, :, None] == jnp.arange(num_slots)) & write_ok[:, :, None], axis=1)
    at_slots = jnp.broadcast_to(jnp.clip(slots, 0, num_slots - 1)[:, None, :], (b, t, t))
    seen_new = jnp.take_along_axis(keys_seen, at_slots, axis=2) & write_ok[:, None, :]
    return jnp.concatenate([keys_seen & ~covered[:, None, :], seen_new], axis=2)
