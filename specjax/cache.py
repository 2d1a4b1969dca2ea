"""Paged KV cache: device-side page pools as a pytree, and the host-side page allocator.

The pools hold one [kv_heads, num_pages + 1, page_size, head_dim] array per layer for keys and
one for values (head-major, as JAX's Pallas paged-attention kernels take them: the pages a
sequence reads gather into [kv_heads, batch, slots, head_dim] with no transpose).
`block_tables[b]` lists the pages of sequence b in order; `lengths[b]` counts its
committed tokens, which sit in slots 0..lengths[b]-1. The extra last page is a sink that no
sequence owns: unused table entries point at it, writes of padding land in it, reads of it are
masked.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.model_config import ModelConfig


class CacheFullError(RuntimeError):
    """The page pool cannot hold a request."""


@struct.dataclass
class PagedKVCache:
    """Per-layer page pools, per-sequence block tables and committed lengths."""

    k_pages: list
    v_pages: list
    block_tables: jax.Array  # int32[B, pages_per_seq]
    lengths: jax.Array  # int32[B]

    @property
    def page_size(self) -> int:
        return self.k_pages[0].shape[2]

    @property
    def num_pages(self) -> int:
        """Pages that sequences can own (the pool's sink page excluded)."""
        return self.k_pages[0].shape[1] - 1

    @property
    def capacity(self) -> int:
        """Slots each sequence can address through its table."""
        return self.block_tables.shape[1] * self.page_size


def init_pages(config: ModelConfig, num_pages: int, page_size: int, dtype=jnp.float32):
    """Zeroed page pools for every layer: `num_pages` usable pages plus the sink page."""
    shape = (config.num_kv_heads, num_pages + 1, page_size, config.head_dim)
    k = [jnp.zeros(shape, dtype) for _ in range(config.num_layers)]
    v = [jnp.zeros(shape, dtype) for _ in range(config.num_layers)]
    return k, v


def slot_address(block_tables, slots, page_size: int):
    """(page, offset in the page) of cache slots [B, N], through the block tables [B, P] (slots
    past the table read its last entry)."""
    at = jnp.clip(slots // page_size, 0, block_tables.shape[1] - 1)
    return jnp.take_along_axis(block_tables, at, axis=1), slots % page_size


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def token_pairs(tokens: Sequence[int]) -> list[int]:
    """(tokens[i], tokens[i + 1]) as one integer per position i < len - 1: the key of a draft
    cache whose entry at i depends on the next token too (EAGLE's (feature_i, token_i+1))."""
    return [(a << 32) | b for a, b in zip(tokens[:-1], tokens[1:])]


def _page_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


class PageAllocator:
    """Host-side owner of the page pool: free list, reference counts and prefix reuse.

    A full page is identified by the hash of the whole token prefix up to its end, so a new
    request whose prompt starts with the same tokens shares those pages (TensorRT-LLM's block
    reuse, vLLM's prefix caching). Freed pages keep their contents and hash until they are handed
    out again, least recently freed first.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError("num_pages and page_size must be positive")
        self.num_pages = num_pages
        self.page_size = page_size
        self.refcount = np.zeros(num_pages, dtype=np.int64)
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict((p, None) for p in range(num_pages))
        self._hash_to_page: dict[bytes, int] = {}
        self._page_to_hash: dict[int, bytes] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def _prefix_hashes(self, tokens: Sequence[int], num_full: int, namespace: bytes = b"") -> list[bytes]:
        hashes, parent = [], namespace
        for i in range(num_full):
            parent = _page_hash(parent, tokens[i * self.page_size : (i + 1) * self.page_size])
            hashes.append(parent)
        return hashes

    def match_prefix(self, tokens: Sequence[int], namespace: bytes = b"") -> list[int]:
        """Pages already holding the longest full-page prefix of `tokens` (published under the
        same `namespace`)."""
        pages = []
        for h in self._prefix_hashes(tokens, len(tokens) // self.page_size, namespace):
            page = self._hash_to_page.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def allocate(
        self, num_slots: int, reusable_tokens: Sequence[int] = (), namespace: bytes = b""
    ) -> tuple[list[int], int]:
        """Pages for a sequence of `num_slots` slots, reusing cached pages of `reusable_tokens`
        (published under `namespace`: a key space of its own, such as token pairs).

        Returns (pages, cached_tokens): the first cached_tokens slots already hold valid K/V.
        Raises CacheFullError, changing nothing, when the pool is short.
        """
        total = pages_needed(num_slots, self.page_size)
        shared = self.match_prefix(reusable_tokens, namespace)[:total]
        fresh = total - len(shared)
        shared_free = sum(1 for p in shared if self.refcount[p] == 0)
        available = self.num_free - shared_free
        if fresh > available:
            raise CacheFullError(
                f"KV cache out of pages: a sequence of {num_slots} tokens needs {fresh} free pages "
                f"of {self.page_size} slots, {available} left of {self.num_pages}"
            )
        for p in shared:
            if self.refcount[p] == 0:
                del self._free[p]
            self.refcount[p] += 1
        pages = list(shared)
        for _ in range(fresh):
            p, _ = self._free.popitem(last=False)
            old = self._page_to_hash.pop(p, None)
            if old is not None:
                del self._hash_to_page[old]
            self.refcount[p] = 1
            pages.append(p)
        return pages, len(shared) * self.page_size

    def register_prefix(self, pages: Sequence[int], tokens: Sequence[int], namespace: bytes = b"") -> None:
        """Publish the full pages of `tokens` (already written to `pages`) for reuse."""
        for page, h in zip(pages, self._prefix_hashes(tokens, len(tokens) // self.page_size, namespace)):
            if h in self._hash_to_page or page in self._page_to_hash:
                continue
            self._hash_to_page[h] = page
            self._page_to_hash[page] = h

    def forget_prefixes(self) -> None:
        """Unpublish every cached prefix: later requests prefill their whole prompt (pages and
        their contents are untouched). Benchmarks call it so that no method reuses the prompt
        another method's run left in the cache."""
        self._hash_to_page.clear()
        self._page_to_hash.clear()

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference to each page; unreferenced pages return to the free list."""
        for p in pages:
            if self.refcount[p] <= 0:
                raise ValueError(f"page {p} freed more often than allocated")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self._free[p] = None


def block_table_array(page_lists: Sequence[Sequence[int]], pages_per_seq: int, num_pages: int):
    """int32[B, pages_per_seq] padded with `num_pages` (the sink page)."""
    table = np.full((len(page_lists), pages_per_seq), num_pages, dtype=np.int32)
    for b, pages in enumerate(page_lists):
        table[b, : len(pages)] = pages
    return table
