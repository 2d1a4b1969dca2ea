"""Commit: keep the accepted path's K/V as the next contiguous slots of each sequence."""

from __future__ import annotations

import jax.numpy as jnp

from specjax.cache import PagedKVCache, slot_address
from specjax.kernels_pallas import write_paged_kv


def _read_slots(pages, block_tables, slots):
    """[B, T, KVH, D] rows of a pool [KVH, P, page_size, D] at cache slots [B, T]."""
    page, offset = slot_address(block_tables, slots, pages.shape[2])
    page = jnp.clip(page, 0, pages.shape[1] - 1)
    rows = pages[:, page, offset]  # [KVH, B, T, D]
    return jnp.moveaxis(rows, 0, 2)


def commit(cache: PagedKVCache, path, n_accepted, active, *, is_chain: bool = False, new_kv=None) -> PagedKVCache:
    """Advance each active sequence by its root plus n_accepted nodes.

    The node at depth d of the accepted path moves from scratch slot lengths + path[d] to slot
    lengths + d (chains are already in place: is_chain skips the copy). Everything past the new
    length is dead scratch. new_kv: the verified nodes' K/V when the verify pass left them
    unwritten (`verify_pruned_kv`'s `NodeKV`); the path's rows are then written from there, once.
    """
    b, t = path.shape
    start = cache.lengths
    new_lengths = jnp.where(active, start + n_accepted + 1, start)
    if is_chain and new_kv is None:
        return cache.replace(lengths=new_lengths)
    src = start[:, None] + path
    dst = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    keep = active[:, None] & (jnp.arange(t)[None, :] <= n_accepted[:, None])
    if new_kv is not None:  # the path's rows of every layer's [L, B, T', KVH, D], T' >= T
        k_path = jnp.take_along_axis(new_kv.keys, path[None, :, :, None, None], axis=2)
        v_path = jnp.take_along_axis(new_kv.values, path[None, :, :, None, None], axis=2)
    k_all, v_all = [], []
    for i, (k_pages, v_pages) in enumerate(zip(cache.k_pages, cache.v_pages)):
        if new_kv is None:
            k = _read_slots(k_pages, cache.block_tables, src)
            v = _read_slots(v_pages, cache.block_tables, src)
        else:
            k, v = k_path[i], v_path[i]
        k_pages, v_pages = write_paged_kv(k_pages, v_pages, cache.block_tables, dst, k, v, keep)
        k_all.append(k_pages)
        v_all.append(v_pages)
    return cache.replace(k_pages=k_all, v_pages=v_all, lengths=new_lengths)
