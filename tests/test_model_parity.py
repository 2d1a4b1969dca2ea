"""The JAX model equals transformers' PyTorch models (float32), in prefill and paged decode."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import make_tiny_hf_model

from specjax import PagedKVCache, causal_mask, forward
from specjax.cache import init_pages
from specjax.checkpoint import load_checkpoint

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
CASES = {
    "llama3-tied": ("llama", dict(rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True)),
    "qwen2-bias": ("qwen2", dict()),
    "mistral-window": ("mistral", dict(sliding_window=8)),
    "llama-mha": ("llama", dict(num_key_value_heads=4)),
    # Qwen3: per-head q/k norms, head_dim 32 != hidden / heads; every tensor perturbed so the
    # norms' weights and the biases are not transformers' ones and zeros.
    "qwen3-untied": ("qwen3", dict(tie_word_embeddings=False, perturb=0.05)),
    "qwen3-tied-bias-window": (
        "qwen3",
        dict(
            tie_word_embeddings=True,
            attention_bias=True,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=0,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            perturb=0.05,
        ),
    ),
}
T = 24


def rel_err(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    kind, overrides = CASES[request.param]
    d = tmp_path_factory.mktemp(request.param)
    model = make_tiny_hf_model(d, kind, tokenizer=False, **overrides)
    params, config, _ = load_checkpoint(d)
    ids = torch.randint(0, config.vocab_size, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    return params, config, ids.numpy(), ref


def fresh_cache(config, batch=2, page_size=4, pages_per_seq=8):
    k, v = init_pages(config, batch * pages_per_seq + 3, page_size)
    # Scatter the sequences' pages over the pool, in a non-trivial order.
    perm = np.random.default_rng(0).permutation(batch * pages_per_seq + 3)[: batch * pages_per_seq]
    table = jnp.asarray(perm.reshape(batch, pages_per_seq), jnp.int32)
    return PagedKVCache(k, v, table, jnp.zeros(batch, jnp.int32))


def test_prefill_logits_and_hidden_states_match(case):
    params, config, ids, ref = case
    cache = fresh_cache(config)
    pos = jnp.broadcast_to(jnp.arange(T), (2, T))
    out = forward(
        params, config, jnp.asarray(ids), pos, cache, causal_mask(2, T), hidden_layers=(0, config.num_layers - 1)
    )
    assert rel_err(np.asarray(out.logits), ref.logits.numpy()) < 1e-4
    # HF hidden_states[i + 1] is the output of layer i (the last one after the final norm).
    assert rel_err(np.asarray(out.layer_hiddens[0]), ref.hidden_states[1].numpy()) < 1e-4
    assert rel_err(np.asarray(out.hidden), ref.hidden_states[-1].numpy()) < 1e-4


def test_decode_through_paged_cache_matches(case):
    params, config, ids, ref = case
    cache = fresh_cache(config)
    for t in range(T):
        out = forward(params, config, jnp.asarray(ids[:, t : t + 1]), cache.lengths[:, None], cache, causal_mask(2, 1))
        cache = out.cache.replace(lengths=cache.lengths + 1)
        assert rel_err(np.asarray(out.logits[:, 0]), ref.logits[:, t].numpy()) < 1e-4, t


def test_chunked_prefill_then_decode_matches(case):
    """Prefill in two ragged chunks, then decode: every position's logits match."""
    params, config, ids, ref = case
    cache = fresh_cache(config)
    first = np.array([5, 9])
    width = 12
    chunk = np.zeros((2, width), np.int32)
    for b in range(2):
        chunk[b, : first[b]] = ids[b, : first[b]]
    valid = jnp.arange(width)[None, :] < jnp.asarray(first)[:, None]
    pos = jnp.broadcast_to(jnp.arange(width), (2, width))
    out = forward(params, config, jnp.asarray(chunk), pos, cache, causal_mask(2, width), valid=valid)
    for b in range(2):
        got = np.asarray(out.logits[b, : first[b]])
        assert rel_err(got, ref.logits[b, : first[b]].numpy()) < 1e-4
    cache = out.cache.replace(lengths=jnp.asarray(first, jnp.int32))
    # Second chunk of 6 tokens each, from each sequence's own offset.
    chunk2 = np.stack([ids[b, first[b] : first[b] + 6] for b in range(2)])
    pos2 = jnp.asarray(first)[:, None] + jnp.arange(6)[None, :]
    out = forward(params, config, jnp.asarray(chunk2), pos2, cache, causal_mask(2, 6))
    for b in range(2):
        want = ref.logits[b, first[b] : first[b] + 6].numpy()
        assert rel_err(np.asarray(out.logits[b]), want) < 1e-4


def test_logits_at_picks_positions(case):
    params, config, ids, ref = case
    cache = fresh_cache(config)
    pos = jnp.broadcast_to(jnp.arange(T), (2, T))
    at = jnp.asarray([[T - 1, 3], [0, 7]], jnp.int32)
    out = forward(params, config, jnp.asarray(ids), pos, cache, causal_mask(2, T), logits_at=at)
    want = np.stack([ref.logits[0, [T - 1, 3]].numpy(), ref.logits[1, [0, 7]].numpy()])
    assert rel_err(np.asarray(out.logits), want) < 1e-4


def test_qwen3_config_flags_and_window():
    """Qwen3's flags come from config.json; its window is taken only when it covers every layer."""
    from specjax.model_config import ConfigError, ModelConfig

    base = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128}
    base |= {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
    config = ModelConfig.from_hf(base)
    assert config.qk_norm and not config.attention_bias and not config.o_proj_bias
    assert config.head_dim == 32 and config.sliding_window is None
    biased = ModelConfig.from_hf({**base, "attention_bias": True})
    assert biased.attention_bias and biased.o_proj_bias
    assert not ModelConfig.from_hf({**base, "architectures": ["Qwen2ForCausalLM"]}).qk_norm
    window = {"use_sliding_window": True, "sliding_window": 8}
    assert ModelConfig.from_hf({**base, **window}).sliding_window is None  # max_window_layers 28 > 2 layers
    windowed = ModelConfig.from_hf({**base, **window, "max_window_layers": 0})
    assert windowed.sliding_window == 8
    assert ModelConfig.from_hf({**base, "sliding_window": 8, "max_window_layers": 0}).sliding_window is None
    with pytest.raises(ConfigError, match="some layers"):
        ModelConfig.from_hf({**base, **window, "max_window_layers": 1})
    with pytest.raises(ConfigError, match="some layers"):
        ModelConfig.from_hf({**base, **window, "layer_types": ["sliding_attention", "full_attention"]})
    for c in (config, biased, windowed):  # to_hf writes what from_hf reads back
        assert ModelConfig.from_hf(c.to_hf()) == c
