"""The EAGLE-3 draft network (SafeAILab/EAGLE, `eagle/model/cnets.py` of EAGLE-3).

The target exposes three residual streams, concatenated low/middle/high ([.., 3D]); `fc` (no
bias) fuses them to D. One decoder layer (`midlayer`) then reads, at position t, the fused
feature of token t and the embedding of token t + 1 (the target's shared embedding, as in
EAGLE-1): its q/k/v take cat[input_layernorm(embedding), hidden_norm(feature)] (2D wide) while
the residual stream is the un-normed feature; post_attention_layernorm + MLP follow. Its output
before the final `norm` is the feature the next draft step reads (no second `fc`); the draft's own
`lm_head` maps norm(output) to a reduced draft vocabulary, and `d2t` maps draft ids back to
target ids (target = draft + d2t[draft]). The layer keeps its own one-layer paged KV cache.
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
from specjax.kernels_pallas import write_paged_kv
from specjax.model import head_logits, key_mask, linear, mlp_block, rms_norm
from specjax.model_config import ModelConfig
from specjax.rope import apply_rope, rope_cos_sin

KIND = "eagle3"


def eagle3_feature_layers(num_target_layers: int) -> tuple[int, int, int]:
    """Target layers whose output residual streams EAGLE-3 fuses (specjax's `hidden_layers`).

    SafeAILab captures the inputs of layers 2, L // 2 and L - 3, i.e. the outputs of layers
    1, L // 2 - 1 and L - 4. Targets under 7 layers (tests) cannot give three distinct layers:
    they get the nearest valid ones, repeated as needed.
    """
    n = int(num_target_layers)
    if n < 1:
        raise ValueError("the target needs at least one layer")
    picked = (2 - 1, n // 2 - 1, n - 3 - 1)
    return tuple(sorted(min(max(i, 0), n - 1) for i in picked))


def eagle3_fuse(params, features3):
    """[.., 3D] concatenated target features -> [.., D] draft input (the `fc`)."""
    fc = params["fc"]  # "kernel" [3D, D] as trained, or "weight" [D, 3D] as `linear` takes it
    if "weight" in fc:
        x = linear(features3.astype(jnp.float32), fc["weight"])
    else:
        x = features3.astype(fc["kernel"].dtype) @ fc["kernel"]
    return x + fc["bias"] if "bias" in fc else x


def _midlayer(
    layer, config: ModelConfig, emb, h, cos, sin, k_pages, v_pages, cache, slots, valid, tree_mask, keys_seen
):
    """The EAGLE-3 decoder layer: attention over [norm(emb); norm(h)], residual h, then MLP."""
    b, t, _ = h.shape
    hd, eps = config.head_dim, config.rms_norm_eps
    qkv_in = jnp.concatenate([rms_norm(emb, layer["attn_norm"], eps), rms_norm(h, layer["hidden_norm"], eps)], axis=-1)
    qkv = linear(qkv_in, layer["wqkv"])
    if "bqkv" in layer:
        qkv = qkv + layer["bqkv"]
    nq, nkv = config.num_heads * hd, config.num_kv_heads * hd
    q = apply_rope(qkv[..., :nq].reshape(b, t, config.num_heads, hd), cos, sin)
    k = apply_rope(qkv[..., nq : nq + nkv].reshape(b, t, config.num_kv_heads, hd), cos, sin)
    v = qkv[..., nq + nkv :].reshape(b, t, config.num_kv_heads, hd)
    k_pages, v_pages = write_paged_kv(k_pages, v_pages, cache.block_tables, slots, k, v, valid)
    # Pallas kernel on GPU, CPU kernel or XLA reference elsewhere (as in model._attention_block).
    exact = config.sliding_window is None and uses_pallas()
    attn = paged_attention(
        q, k_pages, v_pages, cache.block_tables, cache.lengths, tree_mask, key_mask=None if exact else keys_seen
    )
    x = h + linear(attn.reshape(b, t, -1), layer["wo"])
    return mlp_block(layer, config, x), k_pages, v_pages


def eagle3_forward(
    params,
    config: ModelConfig,
    embed,
    tokens,
    features,
    positions,
    cache: PagedKVCache,
    tree_mask,
    valid=None,
    slots=None,
):
    """Draft hidden states [B, T, D] (before the final norm) and the cache with the new K/V.

    embed: the target's [V, D] embedding (a head converted with its own `embed_tokens`, e.g. one
    whose hidden size differs from the target's, carries `params["embed"]`, used instead);
    tokens [B, T] (token t + 1); features [B, T, D]: the fused target feature of token t
    (`eagle3_fuse`) or the draft's own previous output. valid, slots and tree_mask [B, T, J]
    mean what they mean in `model.decoder_layers` (tree drafting over several calls).
    """
    b, t = tokens.shape
    if valid is None:
        valid = jnp.ones((b, t), bool)
    if slots is None:
        slots = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        tree_mask = tree_mask & valid[:, None, :]  # unwritten padding slots stay hidden
    table = params.get("embed", embed)
    h = features.astype(table.dtype)
    cos, sin = rope_cos_sin(config, positions)
    keys_seen = key_mask(config, cache, positions, tree_mask)
    x, k0, v0 = _midlayer(
        params["layers"][0],
        config,
        take_rows(table, tokens),
        h,
        cos,
        sin,
        cache.k_pages[0],
        cache.v_pages[0],
        cache,
        slots,
        valid,
        tree_mask,
        keys_seen,
    )
    return x, cache.replace(k_pages=[k0], v_pages=[v0])


def eagle3_logits(params, config: ModelConfig, hidden):
    """float32 logits [.., draft_vocab] of draft hidden states (norm, own lm_head)."""
    h = rms_norm(hidden, params["norm"], config.rms_norm_eps)
    return head_logits(h, params["lm_head"])


def eagle3_logprobs(params, config: ModelConfig, hidden):
    """float32 log-probabilities [.., draft_vocab] of draft hidden states."""
    return jax.nn.log_softmax(eagle3_logits(params, config, hidden), axis=-1)


def draft_to_target(params, draft_ids):
    """Target token ids of draft-vocabulary ids (SafeAILab's d2t holds the offsets)."""
    return draft_ids + params["d2t"][draft_ids]


def draft_config(target_config: ModelConfig) -> ModelConfig:
    """The draft layer's config: one Llama layer with the target's shapes and RoPE."""
    return dataclasses.replace(
        target_config,
        num_layers=1,
        attention_bias=False,
        qk_norm=False,
        o_proj_bias=False,
        tie_word_embeddings=False,
        sliding_window=None,
        architecture="LlamaForCausalLM",
    )


def d2t_from_counts(token_counts, vocab_size: int, draft_vocab_size: int) -> np.ndarray:
    """int32 d2t of the `draft_vocab_size` most frequent target ids (first ids when no counts).

    As SafeAILab's training: the kept ids sorted ascending, d2t[i] = kept[i] - i.
    """
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size must lie in [1, {vocab_size}]")
    if token_counts is None:
        kept = np.arange(draft_vocab_size)
    else:
        counts = np.asarray(token_counts)
        if counts.shape != (vocab_size,):
            raise ValueError(f"token_counts has shape {counts.shape}, expected ({vocab_size},)")
        kept = np.sort(np.argsort(-counts, kind="stable")[:draft_vocab_size])
    return (kept - np.arange(draft_vocab_size)).astype(np.int32)


def t2d_mask(d2t, vocab_size: int) -> np.ndarray:
    """bool[V]: the target ids the draft vocabulary covers."""
    d2t = np.asarray(d2t)
    mask = np.zeros(vocab_size, bool)
    mask[np.arange(d2t.shape[0]) + d2t] = True
    return mask


def init_eagle3_params(
    key, target_config: ModelConfig, draft_vocab_size: int, token_counts=None, dtype=jnp.float32, scale: float = 0.02
):
    """(draft config, random params) of an EAGLE-3 head for `target_config` (tests, training).

    params["d2t"] is an int32 leaf: training differentiates the other leaves only.
    """
    config = draft_config(target_config)
    d, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    keys = iter(jax.random.split(key, 8))

    def w(*shape):
        return (scale * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    ones = jnp.ones((d,), dtype)
    # Linear weights [out, in], drawn [in, out] as before so a seed gives the same head.
    layer = {
        "attn_norm": ones,
        "hidden_norm": ones,
        "wqkv": w(2 * d, q + 2 * kv).T,
        "wo": w(q, d).T,
        "mlp_norm": ones,
        "w_gate_up": w(d, 2 * f).T,
        "w_down": w(f, d).T,
    }
    params = {
        "fc": {"kernel": w(3 * d, d)},
        "layers": [layer],
        "norm": ones,
        "lm_head": w(draft_vocab_size, d),
        "d2t": jnp.asarray(d2t_from_counts(token_counts, config.vocab_size, draft_vocab_size)),
    }
    return config, params


def save_eagle3_heads(out_dir, config: ModelConfig, params, meta: dict | None = None) -> Path:
    """Write a specjax "eagle3" head checkpoint (specjax.heads).

    meta gains what loaders need: the target's hidden_size and vocab_size (checked by
    `heads.check_compatible`), draft_vocab_size, feature_layers (specjax layer indices, or None
    for `eagle3_feature_layers` of the target) and the draft layer's HF-style `config`.
    """
    from specjax.heads import save_heads

    meta = dict(meta or {})
    meta.setdefault("hidden_size", int(params["fc"]["kernel"].shape[0]) // 3)
    meta.setdefault("vocab_size", config.vocab_size)
    meta.setdefault("feature_layers", None)
    meta["draft_vocab_size"] = int(params["lm_head"].shape[0])
    meta["config"] = config.to_hf()
    variables = {k: v for k, v in params.items() if k != "layers"}
    variables["layers"] = {str(i): layer for i, layer in enumerate(params["layers"])}
    variables["d2t"] = np.asarray(params["d2t"], np.int32)
    return save_heads(out_dir, KIND, variables, meta)


def load_eagle3_heads(path) -> tuple[ModelConfig, dict, dict]:
    """(draft config, params, meta) of a specjax EAGLE-3 head checkpoint."""
    from specjax.checkpoint import CheckpointError
    from specjax.heads import load_heads

    meta, variables = load_heads(path, KIND)
    config = ModelConfig.from_hf(meta["config"])
    needed = {
        "fc/kernel": ("fc", "kernel"),
        "norm": ("norm",),
        "lm_head": ("lm_head",),
        "d2t": ("d2t",),
        "layers/0": ("layers", "0"),
    }
    for name, keys in needed.items():
        node = variables
        for k in keys:
            if not isinstance(node, dict) or k not in node:
                raise CheckpointError(f"EAGLE-3 head checkpoint {path} lacks '{name}'")
            node = node[k]
    params = {k: v for k, v in variables.items() if k != "layers"}
    params["layers"] = [variables["layers"]["0"]]
    params["d2t"] = params["d2t"].astype(jnp.int32)
    return config, params, meta


def feature_layers_of(meta: dict, num_target_layers: int) -> tuple[int, ...]:
    """The target layers a loaded head reads: its own record, else SafeAILab's rule."""
    layers = meta.get("feature_layers")
    if layers is None:
        return eagle3_feature_layers(num_target_layers)
    layers = tuple(int(i) for i in layers)
    if any(i < 0 or i >= num_target_layers for i in layers):
        raise ValueError(f"EAGLE-3 head reads target layers {layers}, the target has {num_target_layers}")
    return layers


@dataclasses.dataclass(frozen=True)
class Eagle3Net:
    """EAGLE-3's network as the EAGLE proposers draft through it (the members of `EagleNet`):
    three target layers fused by its fc, its own reduced-vocabulary head. params: {"net",
    "embed": the target's embedding}."""

    feature_layers: tuple = (0, 1, 2)  # the target layers it fuses (low, mid, high)
    splits_layers: bool = False  # its layer reads [embedding; feature]: kept whole on every device

    def __post_init__(self):
        if len(self.feature_layers) != 3:
            raise ValueError("EAGLE-3 fuses three target layers: give feature_layers=(low, mid, high)")

    def forward(self, params, config, tokens, features, positions, cache, mask, valid, slots=None):
        return eagle3_forward(
            params["net"], config, params["embed"], tokens, features, positions, cache, mask, valid, slots=slots
        )

    def fuse(self, params, features):
        """The three layers' concatenated outputs through the fc."""
        return eagle3_fuse(params["net"], features)

    def logits(self, params, config, hidden):
        return eagle3_logits(params["net"], config, hidden)

    def target_ids(self, params, ids):
        return draft_to_target(params["net"], ids)

    def vocab_rows(self, params) -> int:
        return params["net"]["lm_head"].shape[0]


def load_eagle3(heads, target, draft_vocab: int | None = None):
    """(Eagle3Net, draft config, params) of an EAGLE-3 head checkpoint for `target` (a loaded
    model), weights in the target's dtype."""
    from specjax.heads import check_compatible
    from specjax.proposers.eagle_net import cast_floats, prepared_net

    if draft_vocab is not None:
        raise ValueError("`eagle_draft_vocab` is an EAGLE-1/2 option: EAGLE-3 heads have their own draft vocabulary")
    config, net, meta = load_eagle3_heads(heads)
    check_compatible(meta, target.config, heads)
    net = prepared_net(cast_floats(net, target.params["embed"].dtype), ("layers", "fc", "lm_head"))
    return (
        Eagle3Net(feature_layers_of(meta, target.config.num_layers)),
        config,
        {"net": net, "embed": target.params["embed"]},
    )
