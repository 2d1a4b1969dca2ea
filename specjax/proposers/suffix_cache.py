"""The global cache of suffix decoding: earlier requests' outputs, shared by every request of
an `Engine` or a server and searched by each step for what followed the text's last tokens.

A device-resident index, kept on the host and uploaded when it changed: for each match length
m, a hash of every m-token window of the cached text, sorted, beside the window's last
position. A step finds the occurrences of its last m tokens with two binary searches (the
hash's range; its last entries are the most recent) and checks them token by token (hash
collisions never draft), so its cost grows with log(cached tokens), not with their number
(a vectorized scan of the whole cache, the other design measured, is linear:
benchmarks/bench_suffix_cache.py, docs/benchmarks.md). The text is a ring of `capacity`
tokens with a separator before each request's output; the oldest tokens are evicted first
(FIFO); windows across a separator, into evicted text or at a text's end are never indexed.

`SuffixCache` is the host object (what `make_proposer` returns as the suffix method's
parameters); it is a pytree whose leaves are its current device arrays, so jitted steps take it
as they take any parameters and see a `SuffixIndex`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

SEPARATOR = -1  # before each cached text: no window spans two texts
HASH_BASE = np.uint32(0x01000193)
EMPTY_KEY = np.uint32(0xFFFFFFFF)  # padding past the indexed windows (sorted last)


def _powers(n: int) -> np.ndarray:
    return np.cumprod(np.concatenate([[1], np.full(n - 1, HASH_BASE)]).astype(np.uint32), dtype=np.uint32)


def window_hashes(tokens: np.ndarray, m: int) -> np.ndarray:
    """uint32[len - m + 1]: the hash of each m-token window, by its last token (the same as
    `query_hashes` computes on device)."""
    t = tokens.astype(np.uint32) + np.uint32(1)
    pw = _powers(m)
    n = len(t) - m + 1
    h = np.zeros(n, np.uint32)
    for k in range(m):  # k-th token from the window's end
        h += t[m - 1 - k : m - 1 - k + n] * pw[k]
    return h


def query_hashes(tokens, length, max_match: int):
    """uint32[M, B]: the hash of each row's last m tokens, m = 1..max_match."""
    b = tokens.shape[0]
    k = jnp.arange(max_match)
    last = tokens[jnp.arange(b)[:, None], jnp.maximum(length[:, None] - 1 - k, 0)]  # [B, M]
    terms = (last.astype(jnp.uint32) + jnp.uint32(1)) * jnp.asarray(_powers(max_match))
    return jnp.cumsum(terms, axis=1, dtype=jnp.uint32).T


@struct.dataclass
class SuffixIndex:
    """The device arrays of a `SuffixCache`."""

    text: jax.Array  # int32[C]: the ring of cached tokens (SEPARATOR between texts)
    keys: jax.Array  # uint32[M, C]: window hashes per match length, sorted (EMPTY_KEY padding)
    ends: jax.Array  # int32[M, C]: each window's last position (absolute), -1 for padding
    written: jax.Array  # int32: tokens ever written (positions < written - C are evicted)

    @property
    def capacity(self) -> int:
        return self.text.shape[0]


def cached_continuations(index: SuffixIndex, tokens, length, *, max_match: int, count: int, depth: int):
    """(cont int32[M, B, G, D], known bool[M, B, G, D]): the `depth` tokens that followed the
    `count` most recent cached occurrences of each row's last m tokens (m = 1..max_match, G =
    count); `known` marks real ones (a verified occurrence, text not yet ended or evicted)."""
    c = index.capacity
    queries = query_hashes(tokens, length, max_match)  # [M, B]
    lo = jax.vmap(lambda k, q: jnp.searchsorted(k, q, side="left"))(index.keys, queries)
    hi = jax.vmap(lambda k, q: jnp.searchsorted(k, q, side="right"))(index.keys, queries)
    slot = hi[..., None] - count + jnp.arange(count)  # [M, B, G]: the range's last entries
    ends = jnp.take_along_axis(index.ends, jnp.clip(slot, 0, c - 1).reshape(max_match, -1), axis=1)
    ends = ends.reshape(slot.shape)
    found = (slot >= lo[..., None]) & (ends >= 0)
    # check the window token by token: a hash collision never drafts
    b = tokens.shape[0]
    k = jnp.arange(max_match)
    last = tokens[jnp.arange(b)[:, None], jnp.maximum(length[:, None] - 1 - k, 0)]  # [B, K]
    at = ends[..., None] - k  # [M, B, G, K]
    same = (index.text[jnp.mod(at, c)] == last[None, :, None, :]) | (
        k >= jnp.arange(1, max_match + 1)[:, None, None, None]
    )
    found = found & jnp.all(same, axis=-1) & (jnp.arange(1, max_match + 1)[:, None, None] <= length[None, :, None])
    d = jnp.arange(depth)
    at = ends[..., None] + 1 + d  # [M, B, G, D]
    cont = index.text[jnp.mod(at, c)]
    known = found[..., None] & (at < index.written) & (at >= index.written - c)
    known = known & (jnp.cumprod(cont != SEPARATOR, axis=-1) > 0)
    return cont, known


class SuffixCache:
    """The host side of the global cache: `add` a finished request's output, `reset` to empty;
    its device `index` is rebuilt only after a change. `max_match` is the proposer's;
    `capacity` the most tokens kept (oldest evicted first)."""

    def __init__(self, max_match: int, capacity: int = 1 << 20):
        if capacity < 2 or max_match < 1:
            raise ValueError(f"a suffix cache needs capacity >= 2 and max_match >= 1, got {capacity}, {max_match}")
        self.max_match, self.capacity = max_match, capacity
        self.reset()

    def reset(self):
        """Forget every cached text."""
        self.text = np.full(self.capacity, SEPARATOR, np.int32)
        self.written = 0
        self._keys = [np.zeros(0, np.uint32) for _ in range(self.max_match)]
        self._ends = [np.zeros(0, np.int32) for _ in range(self.max_match)]
        self._device = None

    @property
    def tokens(self) -> int:
        """Cached tokens (separators included)."""
        return min(self.written, self.capacity)

    def add(self, tokens) -> None:
        """Cache one text (a request's output): it is searched by every later step."""
        t = np.asarray(tokens, np.int32).reshape(-1)
        if t.size == 0:
            return
        t = np.concatenate([[SEPARATOR], t[-(self.capacity - 1) :]]).astype(np.int32)
        if self.written + len(t) >= np.iinfo(np.int32).max:  # positions are int32: start over
            self.reset()
        start = self.written
        self.text[(start + np.arange(len(t))) % self.capacity] = t
        self.written = start + len(t)
        oldest = self.written - self.capacity
        for m in range(1, self.max_match + 1):
            keys, ends = self._keys[m - 1], self._ends[m - 1]
            live = ends - (m - 1) >= oldest
            keys, ends = keys[live], ends[live]
            if len(t) - 2 >= m:  # windows within the new text that something follows
                new_keys = window_hashes(t[1:-1], m)
                new_ends = start + m + np.arange(len(new_keys), dtype=np.int32)
                order = np.argsort(new_keys, kind="stable")
                new_keys, new_ends = new_keys[order], new_ends[order]
                at = np.searchsorted(keys, new_keys, side="right")  # after equal keys: later ends
                keys, ends = np.insert(keys, at, new_keys), np.insert(ends, at, new_ends)
            self._keys[m - 1], self._ends[m - 1] = keys, ends
        self._device = None

    @property
    def index(self) -> SuffixIndex:
        """The device arrays (built after a change, then reused)."""
        if self._device is None:
            keys = np.full((self.max_match, self.capacity), EMPTY_KEY, np.uint32)
            ends = np.full((self.max_match, self.capacity), -1, np.int32)
            for m in range(self.max_match):
                keys[m, : len(self._keys[m])] = self._keys[m]
                ends[m, : len(self._ends[m])] = self._ends[m]
            self._device = SuffixIndex(
                jnp.asarray(self.text), jnp.asarray(keys), jnp.asarray(ends), jnp.asarray(np.int32(self.written))
            )
        return self._device

    def tree_flatten(self):
        index = self.index
        return (index.text, index.keys, index.ends, index.written), (self.max_match, self.capacity)

    @classmethod
    def tree_unflatten(cls, aux, leaves):
        return SuffixIndex(*leaves)


jax.tree_util.register_pytree_node(SuffixCache, SuffixCache.tree_flatten, SuffixCache.tree_unflatten)


def caches_of(proposer_params) -> list:
    """The `SuffixCache`s in a proposer's parameters."""
    leaves = jax.tree_util.tree_leaves(proposer_params, is_leaf=lambda x: isinstance(x, SuffixCache))
    return [x for x in leaves if isinstance(x, SuffixCache)]


def remember_outputs(proposer_params, outputs) -> None:
    """Add finished requests' outputs to every `SuffixCache` in a proposer's parameters (none:
    nothing happens)."""
    for cache in caches_of(proposer_params):
        for out in outputs:
            cache.add(out)
