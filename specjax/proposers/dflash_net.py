"""The DFlash block drafter (z-lab/dflash, `dflash/model.py`: `DFlashDraftModel`) as pure functions.

DFlash (Chen et al. 2026, arXiv 2602.06036) drafts a whole block in one forward of a few
non-causal decoder layers. Its input is the block [pending token, mask, mask, ...] embedded with
the target's embedding; its context is the target's hidden states of every token before the block:
the outputs of `target_layer_ids` concatenated, projected by `fc` (no bias) and normed by
`hidden_norm`. In each layer the block's queries attend, with no causal mask, to the keys and
values of the context AND of the block itself: k = RoPE(k_norm(k_proj(x))), v = v_proj(x), with
x the fused context (the same vector in every layer: the context does not run through the layers)
or the layer's normed block input. Positions are the tokens' own: context token i at i, block
slot j at (pending token's position) + j. The final `norm` then the target's LM head turn block
slots 1.. into the draft tokens' logits.

Because a context token's keys depend on its target features alone, they are kept in a per-layer
paged draft cache (the target's block tables) and each step only the newly accepted tokens' are
written (`write_context`), as the reference keeps its DynamicCache cropped to the accepted tokens.
The block's own keys go to scratch slots after the context, rewritten by the next step's context.
Training (`dflash_blocks`) runs many blocks of a sequence in one dense pass through the same layer
code, each block masked to the context before its anchor and to itself.

params ("net"): {"fc": [D, n * Dt], "hidden_norm": [D], "norm": [D], "layers": [{"attn_norm",
"wq": [H * hd, D], "wkv": [2 * KVH * hd, D], "q_norm", "k_norm": [hd], "wo", "mlp_norm",
"w_gate_up", "w_down"}]}; linear weights [out, in] as in `specjax.model`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.attention import paged_attention, uses_pallas
from specjax.cache import PagedKVCache
from specjax.cpu.matmul import take_rows
from specjax.kernels_pallas import gathered_attention, write_paged_kv
from specjax.model import head_logits, key_mask, linear, mlp_block, rms_norm
from specjax.model_config import ModelConfig
from specjax.rope import apply_rope, rope_cos_sin

KIND = "dflash"


def default_target_layers(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The reference's `build_target_layer_ids`: one draft layer reads the middle target layer,
    n > 1 spread evenly from layer 1 to L - 3 (a checkpoint's `target_layer_ids` overrides it).
    Indices are of target layer OUTPUTS (the reference reads hidden_states[id + 1]), as
    specjax's `feature_layers`; clipped into [0, L - 1] for targets under 4 layers (tests)."""
    n, count = int(num_target_layers), int(num_draft_layers)
    if count == 1:
        ids = [n // 2]
    else:
        start, end = 1, n - 3
        ids = [int(round(start + i * (end - start) / (count - 1))) for i in range(count)]
    return tuple(min(max(i, 0), n - 1) for i in ids)


def dflash_fuse(net, config: ModelConfig, features):
    """The context: concatenated target features [.., n * Dt] -> hidden_norm(fc(.)) [.., D]."""
    return rms_norm(linear(features, net["fc"]), net["hidden_norm"], config.rms_norm_eps)


def _keys_values(layer, config: ModelConfig, x, cos, sin):
    """k = RoPE(k_norm(k_proj(x))), v = v_proj(x), each [B, T, KVH, hd]."""
    b, t, _ = x.shape
    hd, nkv = config.head_dim, config.num_kv_heads * config.head_dim
    kv = linear(x, layer["wkv"])
    k = rms_norm(kv[..., :nkv].reshape(b, t, config.num_kv_heads, hd), layer["k_norm"], config.rms_norm_eps)
    return apply_rope(k, cos, sin), kv[..., nkv:].reshape(b, t, config.num_kv_heads, hd)


def write_context(net, config: ModelConfig, cache: PagedKVCache, context, positions, valid) -> PagedKVCache:
    """The cache with every layer's keys and values of the fused context [B, T, D] written at
    slots = positions [B, T] where valid [B, T] (the draft cache is indexed by position)."""
    cos, sin = rope_cos_sin(config, positions)
    ks, vs = [], []
    for layer, k_pages, v_pages in zip(net["layers"], cache.k_pages, cache.v_pages):
        k, v = _keys_values(layer, config, context.astype(k_pages.dtype), cos, sin)
        k_pages, v_pages = write_paged_kv(k_pages, v_pages, cache.block_tables, positions, k, v, valid)
        ks.append(k_pages)
        vs.append(v_pages)
    return cache.replace(k_pages=ks, v_pages=vs)


def _block_layers(net, config: ModelConfig, h, cos, sin, attend):
    """The drafter's layers over block inputs h [B, T, D] (embedded tokens) and the final norm.

    Each layer's queries and the block's own keys and values come from the layer's normed input
    (q = RoPE(q_norm(q_proj(x))), k = RoPE(k_norm(k_proj(x))), v = v_proj(x)); `attend(i, q, k, v)`
    gives layer i's attention [B, T, H, hd] over the context and the block: the paged cache at
    inference (`dflash_block`), dense blocks in training (`dflash_blocks`)."""
    b, t, _ = h.shape
    hd, eps = config.head_dim, config.rms_norm_eps
    for i, layer in enumerate(net["layers"]):
        x = rms_norm(h, layer["attn_norm"], eps)
        q = rms_norm(linear(x, layer["wq"]).reshape(b, t, config.num_heads, hd), layer["q_norm"], eps)
        k, v = _keys_values(layer, config, x, cos, sin)
        attn = attend(i, apply_rope(q, cos, sin), k, v)
        h = h + linear(attn.reshape(b, t, -1), layer["wo"])
        h = mlp_block(layer, config, h)
    return rms_norm(h, net["norm"], eps)


def dflash_block(net, config: ModelConfig, embed, cache: PagedKVCache, tokens, positions):
    """(normed hidden states [B, K, D] of the block, the cache with the block's keys written).

    tokens [B, K]: the block, written at the scratch slots lengths .. lengths + K - 1 after the
    context (cache.lengths tokens); positions [B, K] its RoPE positions. Every block slot sees
    the whole context and the whole block."""
    b, t = tokens.shape
    slots = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    block_mask = jnp.ones((b, t, t), bool)
    valid = jnp.ones((b, t), bool)
    cos, sin = rope_cos_sin(config, positions)
    keys_seen = key_mask(config, cache, positions, block_mask)
    exact = config.sliding_window is None and uses_pallas()
    ks, vs = list(cache.k_pages), list(cache.v_pages)

    def attend(i, q, k, v):
        ks[i], vs[i] = write_paged_kv(ks[i], vs[i], cache.block_tables, slots, k, v, valid)
        return paged_attention(
            q,
            ks[i],
            vs[i],
            cache.block_tables,
            cache.lengths,
            block_mask,
            key_mask=None if exact else keys_seen,
        )

    hidden = _block_layers(net, config, take_rows(embed, tokens), cos, sin, attend)
    return hidden, cache.replace(k_pages=ks, v_pages=vs)


def dflash_blocks(net, config: ModelConfig, embed, context, blocks, anchors):
    """Normed hidden states [B, N, K, D] of N blocks per sequence in one dense pass (training).

    context [B, T, D]: the fused features (`dflash_fuse`) of positions 0 .. T - 1; blocks
    [B, N, K]: token ids, block n at positions anchors[:, n] + 0 .. K - 1. Block n sees the
    context positions before its anchor and its own K slots, not the other blocks: block n
    gives what `dflash_block` gives over a cache holding the context 0 .. anchors[:, n] - 1
    (`write_context`), the same function of the same keys, gathered densely instead of paged.
    """
    b, n, k = blocks.shape
    t = context.shape[1]
    positions = (anchors[:, :, None] + jnp.arange(k, dtype=jnp.int32)).reshape(b, n * k)
    cos, sin = rope_cos_sin(config, positions)
    ctx_cos, ctx_sin = rope_cos_sin(config, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)))
    block_of = jnp.repeat(jnp.arange(n), k)
    earlier = jnp.arange(t)[None, None, :] < jnp.repeat(anchors, k, axis=1)[:, :, None]  # [B, NK, T]
    same_block = jnp.broadcast_to(block_of[:, None] == block_of[None, :], (b, n * k, n * k))
    mask = jnp.concatenate([earlier, same_block], axis=-1)

    def attend(i, q, k_blk, v_blk):
        layer = net["layers"][i]
        k_ctx, v_ctx = _keys_values(layer, config, context.astype(q.dtype), ctx_cos, ctx_sin)
        keys = jnp.moveaxis(jnp.concatenate([k_ctx, k_blk], axis=1), 2, 0)  # [KVH, B, T + NK, hd]
        values = jnp.moveaxis(jnp.concatenate([v_ctx, v_blk], axis=1), 2, 0)
        return gathered_attention(q, keys, values, mask)

    hidden = _block_layers(net, config, take_rows(embed, blocks.reshape(b, n * k)), cos, sin, attend)
    return hidden.reshape(b, n, k, -1)


def dflash_logits(lm_head, hidden):
    """float32 logits [.., V] of the block's normed hidden states through the target's head."""
    return head_logits(hidden, lm_head)


def draft_config(target_config: ModelConfig, num_layers: int, **shape) -> ModelConfig:
    """A drafter config of the target's shapes (Qwen3-style layers: q/k norms, no biases)."""
    return dataclasses.replace(
        target_config,
        num_layers=int(num_layers),
        attention_bias=False,
        o_proj_bias=False,
        qk_norm=True,
        tie_word_embeddings=False,
        sliding_window=None,
        architecture="Qwen3ForCausalLM",
        **shape,
    )


def init_dflash_params(key, config: ModelConfig, num_features: int, target_hidden: int, scale: float = 0.02):
    """Random drafter parameters (tests, shapes): `num_features` target layers of width
    `target_hidden` fused; norms at one."""
    d, f, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_heads * hd, config.num_kv_heads * hd
    keys = iter(jax.random.split(key, 6 * config.num_layers + 2))

    def w(*shape):
        return scale * jax.random.normal(next(keys), shape, jnp.float32)

    layers = [
        {
            "attn_norm": jnp.ones((d,)),
            "wq": w(q, d),
            "wkv": w(2 * kv, d),
            "q_norm": jnp.ones((hd,)),
            "k_norm": jnp.ones((hd,)),
            "wo": w(d, q),
            "mlp_norm": jnp.ones((d,)),
            "w_gate_up": w(2 * f, d),
            "w_down": w(d, f),
        }
        for _ in range(config.num_layers)
    ]
    return {
        "fc": w(d, num_features * target_hidden),
        "hidden_norm": jnp.ones((d,)),
        "norm": jnp.ones((d,)),
        "layers": layers,
    }


def dflash_head_variables(config: ModelConfig, net, meta: dict) -> tuple[dict, dict]:
    """(variables, meta) of a specjax "dflash" head checkpoint (`specjax.heads.save_heads`).
    meta holds the target's hidden_size and vocab_size, `target_layers` (specjax layer
    indices), `block_size`, `mask_token_id`; the drafter's HF-style `config` is added."""
    meta = {**meta, "config": config.to_hf()}
    for key in ("target_layers", "block_size", "mask_token_id", "hidden_size", "vocab_size"):
        if key not in meta:
            raise ValueError(f"DFlash head metadata needs '{key}'")
    meta["target_layers"] = [int(i) for i in meta["target_layers"]]
    meta["block_size"], meta["mask_token_id"] = int(meta["block_size"]), int(meta["mask_token_id"])
    variables = {k: v for k, v in net.items() if k != "layers"}
    variables["layers"] = {str(i): layer for i, layer in enumerate(net["layers"])}
    return variables, meta


def save_dflash_heads(out_dir, config: ModelConfig, net, meta: dict) -> Path:
    """Write a specjax "dflash" head checkpoint (meta as `dflash_head_variables`)."""
    from specjax.heads import save_heads

    return save_heads(out_dir, KIND, *dflash_head_variables(config, net, meta))


def load_dflash_heads(path) -> tuple[ModelConfig, dict, dict]:
    """(drafter config, net params, meta) of a specjax "dflash" head checkpoint."""
    from specjax.checkpoint import CheckpointError
    from specjax.heads import load_heads

    meta, variables = load_heads(path, KIND)
    config = ModelConfig.from_hf(meta["config"])
    for name in ("fc", "hidden_norm", "norm", "layers"):
        if name not in variables:
            raise CheckpointError(f"DFlash head checkpoint {path} lacks '{name}'")
    try:
        layers = [variables["layers"][str(i)] for i in range(config.num_layers)]
    except KeyError:
        raise CheckpointError(f"DFlash head checkpoint {path} has fewer than {config.num_layers} layers") from None
    net = {k: v for k, v in variables.items() if k != "layers"}
    net["layers"] = layers
    return config, net, meta


def random_dflash_checkpoint(target, out, num_layers: int = 2, block_size: int = 4, target_layers=None, seed: int = 0):
    """A specjax DFlash checkpoint with random weights for `target` (a `Model`): the mask token is
    the vocabulary's last id."""
    c = target.config
    config = draft_config(c, num_layers)
    layers = default_target_layers(c.num_layers, num_layers) if target_layers is None else tuple(target_layers)
    net = init_dflash_params(jax.random.PRNGKey(seed), config, len(layers), c.hidden_size)
    meta = {
        "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size,
        "target_layers": list(layers),
        "block_size": int(block_size),
        "mask_token_id": c.vocab_size - 1,
    }
    return save_dflash_heads(out, config, jax.tree_util.tree_map(np.asarray, net), meta)
