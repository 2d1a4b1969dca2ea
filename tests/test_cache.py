"""Paged KV cache: allocator bookkeeping, prefix reuse, isolation from foreign pages, exhaustion."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import CacheFullError, Engine, ModelConfig, PageAllocator, PagedKVCache, causal_mask, forward, init_params
from specjax.cache import block_table_array, init_pages

CFG = ModelConfig(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    eos_token_ids=(),
)


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.PRNGKey(0), scale=0.3)


def test_allocate_free_refcounts():
    a = PageAllocator(num_pages=10, page_size=4)
    pages, cached = a.allocate(9)  # 3 pages
    assert len(pages) == 3 and cached == 0 and a.num_free == 7
    assert all(a.refcount[p] == 1 for p in pages)
    a.free(pages)
    assert a.num_free == 10 and all(a.refcount[p] == 0 for p in pages)
    with pytest.raises(ValueError, match="freed more often"):
        a.free(pages[:1])


def test_prefix_reuse_bookkeeping():
    a = PageAllocator(num_pages=10, page_size=4)
    tokens = list(range(11))  # two full pages + 3 tokens
    pages, cached = a.allocate(16, reusable_tokens=tokens)
    assert cached == 0
    a.register_prefix(pages, tokens)
    # Same prefix, different tail: the two full pages are shared.
    pages2, cached2 = a.allocate(16, reusable_tokens=tokens[:8] + [99, 98])
    assert cached2 == 8 and pages2[:2] == pages[:2] and pages2[2:] != pages[2:]
    assert a.refcount[pages[0]] == 2 and a.refcount[pages[2]] == 1
    # Diverging inside the first page shares nothing.
    pages3, cached3 = a.allocate(4, reusable_tokens=[0, 1, 2, 5, 6])
    assert cached3 == 0 and pages3[0] not in pages
    for p in (pages, pages2, pages3):
        a.free(p)
    assert a.num_free == 10
    # Freed pages keep their contents: the prefix is still found...
    pages4, cached4 = a.allocate(8, reusable_tokens=tokens)
    assert cached4 == 8 and pages4 == pages[:2]
    a.free(pages4)
    # ...until the prefixes are forgotten (what benchmarks do between methods' runs)
    a.forget_prefixes()
    pages5, cached5 = a.allocate(8, reusable_tokens=tokens)
    assert cached5 == 0 and a.match_prefix(tokens) == []
    a.free(pages5)
    assert a.num_free == 10


def test_reallocated_page_loses_its_hash():
    a = PageAllocator(num_pages=3, page_size=2)
    pages, _ = a.allocate(4, reusable_tokens=[1, 2, 3, 4])
    a.register_prefix(pages, [1, 2, 3, 4])
    a.free(pages)
    fresh, _ = a.allocate(6)  # takes every page, overwriting the cached ones
    a.free(fresh)
    assert a.match_prefix([1, 2, 3, 4]) == []


def test_exhaustion_is_a_clear_error_and_changes_nothing():
    a = PageAllocator(num_pages=4, page_size=4)
    held, _ = a.allocate(12)
    before = (a.num_free, a.refcount.copy())
    with pytest.raises(CacheFullError, match="out of pages"):
        a.allocate(8)
    assert a.num_free == before[0] and (a.refcount == before[1]).all()


def test_engine_out_of_pages_keeps_pool_usable(params):
    eng = Engine(params, CFG, num_pages=4, page_size=4)
    with pytest.raises(CacheFullError, match="out of pages"):
        eng.generate([[1, 2, 3]], max_new_tokens=30)
    assert eng.allocator.num_free == 4
    out = eng.generate([[1, 2, 3]], max_new_tokens=5)
    assert len(out.token_ids[0]) == 5


def test_prefix_reuse_gives_identical_output(params):
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, CFG.vocab_size, 37)]
    cold = Engine(params, CFG, num_pages=64, page_size=4)
    first = cold.generate([prompt], max_new_tokens=12)
    pages_before = cold.allocator.num_free
    # Second call reuses 9 full pages of the prompt.
    matched = cold.allocator.match_prefix(prompt[:-1])
    assert len(matched) == 9
    second = cold.generate([prompt], max_new_tokens=12)
    assert second.token_ids == first.token_ids
    assert cold.allocator.num_free == pages_before
    # And a fresh engine (nothing cached) agrees as well.
    fresh = Engine(params, CFG, num_pages=64, page_size=4).generate([prompt], max_new_tokens=12)
    assert fresh.token_ids == first.token_ids


def test_prefix_reuse_gives_identical_logits(params):
    """Logits of a suffix computed over reused prefix pages equal a full prefill's."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, CFG.vocab_size, 20).astype(np.int32)
    k, v = init_pages(CFG, 16, 4)
    table = jnp.asarray(block_table_array([[3, 7, 1, 9, 12, 5]], 6, 16))
    cache = PagedKVCache(k, v, table, jnp.zeros(1, jnp.int32))
    full = forward(params, CFG, jnp.asarray(tokens[None]), jnp.arange(20)[None], cache, causal_mask(1, 20))
    # Another sequence shares the first two pages (8 tokens) and only computes the rest.
    table2 = jnp.asarray(block_table_array([[3, 7, 0, 2, 4, 6]], 6, 16))
    cache2 = PagedKVCache(full.cache.k_pages, full.cache.v_pages, table2, jnp.asarray([8], jnp.int32))
    part = forward(params, CFG, jnp.asarray(tokens[None, 8:]), jnp.arange(8, 20)[None], cache2, causal_mask(1, 12))
    np.testing.assert_array_equal(np.asarray(part.logits[0]), np.asarray(full.logits[0, 8:]))


def test_foreign_pages_full_of_nan_change_nothing(params):
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 10)), jnp.int32)
    table = jnp.asarray(block_table_array([[1, 4, 6], [2, 8, 10]], 4, 12))  # unused entries = no page
    pos = jnp.broadcast_to(jnp.arange(10), (2, 10))

    def run(fill):
        k, v = init_pages(CFG, 12, 4)
        k = [x.at[:].set(fill) for x in k]
        v = [x.at[:].set(fill) for x in v]
        cache = PagedKVCache(k, v, table, jnp.zeros(2, jnp.int32))
        out = forward(params, CFG, tokens, pos, cache, causal_mask(2, 10))
        # One decode step on top, reading the committed prefix through the table.
        c = out.cache.replace(lengths=jnp.asarray([10, 7], jnp.int32))
        step = forward(params, CFG, tokens[:, :1], c.lengths[:, None], c, causal_mask(2, 1))
        return np.asarray(out.logits), np.asarray(step.logits)

    clean, clean_step = run(0.0)
    dirty, dirty_step = run(jnp.nan)
    assert np.isfinite(dirty).all() and np.isfinite(dirty_step).all()
    np.testing.assert_array_equal(clean, dirty)
    np.testing.assert_array_equal(clean_step, dirty_step)


def test_writes_never_leave_the_sequence_pages(params):
    """Padding tokens and slots past the table are dropped, not written to another page."""
    k, v = init_pages(CFG, 6, 4)
    table = jnp.asarray(block_table_array([[2], [4]], 2, 6))
    cache = PagedKVCache(k, v, table, jnp.zeros(2, jnp.int32))
    tokens = jnp.ones((2, 8), jnp.int32)
    valid = jnp.asarray([[True] * 8, [True] * 3 + [False] * 5])
    out = forward(params, CFG, tokens, jnp.broadcast_to(jnp.arange(8), (2, 8)), cache, causal_mask(2, 8), valid=valid)
    kp = np.moveaxis(np.asarray(out.cache.k_pages[0]), 0, 1)  # [P, KVH, ps, D]
    touched = [p for p in range(6) if np.abs(kp[p]).sum() > 0]
    assert touched == [2, 4]
    assert np.abs(kp[4, :, 3:]).sum() == 0  # padding rows of sequence 1 were not written
