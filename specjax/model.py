"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) as pure functions over a pytree.

Parameters are a dict with one array per weight and per layer (a list of per-layer dicts): on
XLA:CPU, stacked [L, ...] weights under `lax.scan` ran at ~60% of the speed
(docs/design.md, "Model layout choices").
Linear weights are stored [out, in] (as in PyTorch), the embedding (and an untied `lm_head`)
[vocab, hidden]. The q/k/v projections are one [(heads + 2 * kv_heads) * head_dim, hidden] matrix
and gate/up one [2 * intermediate, hidden] matrix: on XLA:CPU a decode step is a chain of
matrix-vector products bound by one core's memory stream, and fewer, larger products ran ~7%
faster. See `linear` for why [out, in].
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.attention import attention_unwritten, on_cpu_path, paged_attention, uses_pallas
from specjax.cache import PagedKVCache
from specjax.cpu.activation import swiglu
from specjax.cpu.matmul import MAX_ROWS, PackedWeight, as_array, kernel_applies, rows_matmul, take_rows
from specjax.kernels_pallas import unwritten_keys_mask, visible_keys_mask, write_paged_kv
from specjax.model_config import ModelConfig
from specjax.rope import apply_rope, rope_cos_sin


class ForwardOutput(NamedTuple):
    logits: jax.Array | None  # [B, K, V] at the requested positions (float32)
    hidden: jax.Array  # [B, T, D] final hidden state after the last norm
    layer_hiddens: tuple  # residual stream after each requested layer, [B, T, D] each
    cache: PagedKVCache  # with the new tokens' K/V written (lengths unchanged)
    # With defer_kv_write: the new tokens' (keys, values), one [B, T, KVH, D] per layer each,
    # not yet in `cache` (write them with `write_new_kv`).
    new_kv: tuple | None = None


def rms_norm(x, weight, eps):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(row_sums(x32 * x32) / x.shape[-1] + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


def row_sums(x):
    """x [..., n] summed over its last axis (keeping it, size 1), each row the same way whatever
    the number of rows.

    XLA:CPU sums a few rows through a library (YNNPACK) and a single row in its own loop, in
    different orders: a verify pass's normalized rows differed in the last bits from the same
    rows decoded one at a time, which could flip a near-tie of the greedy choice. Where the CPU
    matmul kernel takes the rows they are summed as a product with a row of ones, which computes
    every row alike (`specjax.cpu.matmul`); elsewhere (prefill, GPU) XLA's sum.
    """
    x2 = x.reshape(-1, x.shape[-1])
    ones = np.ones((1, x.shape[-1]), x2.dtype)
    if kernel_applies(x2, ones):
        return rows_matmul(x2, ones).reshape(*x.shape[:-1], 1)
    return jnp.sum(x, axis=-1, keepdims=True)


def linear(x, w, out_dtype=None):
    """x [..., in] times a weight stored [out, in] -> [..., out] (accumulated in out_dtype if set).

    On XLA:CPU computed as (w @ x^T)^T: for the few rows of a decode or verify pass (2-16
    tokens) its matrix multiply runs faster with the weight as the tall left operand than as
    x @ w (measured in docs/design.md, "Model layout choices"; benchmarks/bench_forward_cost.py
    times whole passes). The barrier keeps XLA from folding the transpose back into the product.
    A GPU gains nothing from that: there (and in any program with the Pallas kernel) it is a
    plain product.
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.result_type(x, w))
    if kernel_applies(x2, w, out_dtype):  # float32 rows on CPU: specjax.cpu.matmul
        return rows_matmul(x2, w).reshape(*lead, w.shape[0])
    if not on_cpu_path():
        w = as_array(w).astype(x2.dtype)
        y = jnp.einsum("nk,ok->no", x2, w, preferred_element_type=out_dtype)
        return y.reshape(*lead, w.shape[0])
    return _columns(x2, as_array(w), out_dtype).T.reshape(*lead, w.shape[0])


def _columns(x, w, out_dtype=None):
    """XLA's product w @ x^T of rows x [..., in] and a weight [out, in]: columns [out, N]."""
    dtype = jnp.result_type(x, w)
    x2 = x.reshape(-1, x.shape[-1]).astype(dtype)
    y = jax.lax.dot_general(w.astype(dtype), x2, (((1,), (1,)), ((), ())), preferred_element_type=out_dtype)
    return jax.lax.optimization_barrier(y)


def init_params(config: ModelConfig, key, dtype=jnp.float32, scale: float = 0.02):
    """Random parameters (tests, benchmarks of shapes)."""
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    keys = iter(jax.random.split(key, 8 * config.num_layers + 4))

    def w(*shape):
        return (scale * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    def lin(n_in, n_out):  # [out, in]; drawn [in, out] as before, so a seed gives the same model
        return w(n_in, n_out).T

    layers = []
    for _ in range(config.num_layers):
        layer = {
            "attn_norm": jnp.ones((d,), dtype),
            "wqkv": lin(d, q + 2 * kv),
            "wo": lin(q, d),
            "mlp_norm": jnp.ones((d,), dtype),
            "w_gate_up": lin(d, 2 * f),
            "w_down": lin(f, d),
        }
        if config.attention_bias:
            layer["bqkv"] = w(q + 2 * kv)
        if config.o_proj_bias:
            layer["bo"] = w(d)
        if config.qk_norm:
            layer["q_norm"] = jnp.ones((config.head_dim,), dtype)
            layer["k_norm"] = jnp.ones((config.head_dim,), dtype)
        layers.append(layer)
    params = {"embed": w(v, d), "layers": layers, "norm": jnp.ones((d,), dtype)}
    if not config.tie_word_embeddings:
        params["lm_head"] = w(v, d)
    return params


def lm_head_weight(params):
    """[vocab, hidden] output projection (the embedding when tied; packed for the CPU kernel as
    `tied_head`, see `cpu.matmul.pack_params`)."""
    return params.get("lm_head", params.get("tied_head", params["embed"]))


def head_logits(x, w):
    """float32 logits [..., V] of x [..., D] through an output head stored [V, D].

    Up to 64 rows (decode, verify and draft passes) as (w @ x^T)^T, like `linear`: inside the
    target forward a 4 / 8 / 16-token verify ran 14 / 5 / 10% faster than with x @ w^T (one
    token unchanged; docs/design.md, "Model layout choices"). Larger batches (prefill,
    training) as x @ w^T, which wins from a few hundred rows on (the 49152-row head alone:
    75.6 ms against 85.1 at 256 rows).
    """
    if x.size // x.shape[-1] > 64 and not isinstance(w, PackedWeight):
        return jnp.einsum("...d,vd->...v", x, w, preferred_element_type=jnp.float32)
    return linear(x, w, jnp.float32)


def compute_logits(params, hidden):
    """float32 logits [..., V] of normalized hidden states [..., D]."""
    return head_logits(hidden, lm_head_weight(params))


def _attention_block(
    layer,
    config: ModelConfig,
    x,
    cos,
    sin,
    k_pages,
    v_pages,
    block_tables,
    lengths,
    slots,
    write_ok,
    tree_mask,
    keys_seen,
    defer_write=False,
):
    b, t, _ = x.shape
    hd = config.head_dim
    h = rms_norm(x, layer["attn_norm"], config.rms_norm_eps) if "attn_norm" in layer else x
    if "wqkv" in layer:
        qkv = linear(h, layer["wqkv"])
        if config.attention_bias:
            qkv = qkv + layer["bqkv"]
        nq, nkv = config.num_heads * hd, config.num_kv_heads * hd
        q, k, v = qkv[..., :nq], qkv[..., nq : nq + nkv], qkv[..., nq + nkv :]
    else:  # unfused (tensor-parallel layers: each product splits over whole heads, sharding.py)
        q, k, v = (linear(h, layer[w]) for w in ("wq", "wk", "wv"))
        if config.attention_bias:
            q, k, v = q + layer["bq"], k + layer["bk"], v + layer["bv"]
    q, k = q.reshape(b, t, config.num_heads, hd), k.reshape(b, t, config.num_kv_heads, hd)
    if config.qk_norm:  # Qwen3: each head's vector normalized before RoPE
        q = rms_norm(q, layer["q_norm"], config.rms_norm_eps)
        k = rms_norm(k, layer["k_norm"], config.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    v = v.reshape(b, t, config.num_kv_heads, hd)
    # Pallas kernel on GPU, CPU kernel or XLA reference elsewhere (specjax.attention).
    # Without a sliding window keys_seen is the mask lengths and tree_mask imply, which the
    # Pallas kernel builds itself; the others take it precomputed (once per forward, not per layer).
    exact = config.sliding_window is None and uses_pallas()
    if defer_write:  # attend over the committed slots and the new rows; the pools stay as they are
        if uses_pallas():  # the kernel reads the tree keys from the rows (keys_seen is by slot)
            attn = paged_attention(
                q,
                k_pages,
                v_pages,
                block_tables,
                lengths,
                tree_mask,
                key_mask=None if exact else keys_seen,
                k_new=k,
                v_new=v,
            )
        else:
            attn = attention_unwritten(q, k, v, k_pages, v_pages, block_tables, keys_seen)
        return x + _attention_output(layer, config, attn), k, v
    k_pages, v_pages = write_paged_kv(k_pages, v_pages, block_tables, slots, k, v, write_ok)
    attn = paged_attention(q, k_pages, v_pages, block_tables, lengths, tree_mask, key_mask=None if exact else keys_seen)
    return x + _attention_output(layer, config, attn), k_pages, v_pages


def _attention_output(layer, config: ModelConfig, attn):
    """The output projection of the heads' outputs attn [B, T, H, D] (with Qwen3's bias)."""
    b, t = attn.shape[:2]
    out = linear(attn.reshape(b, t, -1), layer["wo"])
    return out + layer["bo"] if config.o_proj_bias else out


def write_new_kv(cache: PagedKVCache, new_kv, slots, valid) -> PagedKVCache:
    """The cache with a deferred forward's K/V (`ForwardOutput.new_kv`) written at slots [B, T]
    where valid [B, T]."""
    k_all, v_all = [], []
    for k_pages, v_pages, k, v in zip(cache.k_pages, cache.v_pages, *new_kv):
        k_pages, v_pages = write_paged_kv(k_pages, v_pages, cache.block_tables, slots, k, v, valid)
        k_all.append(k_pages)
        v_all.append(v_pages)
    return cache.replace(k_pages=k_all, v_pages=v_all)


def _gated_columns(h, w_gate_up):
    """silu(gate) * up of many rows h [..., D] (a prefill), computed on the product's columns.

    XLA's product comes out as columns [2F, N] (see `linear`); taking silu there reads it in
    memory order, where reading it back as rows [N, 2F] was a strided pass costing ~12% of a
    489-token SmolLM2 prefill. The result returns as rows through a transpose that w_down's
    product absorbs.
    """
    lead = h.shape[:-1]
    gate_up = _columns(h, w_gate_up)
    f = gate_up.shape[0] // 2
    act = jax.lax.optimization_barrier(jax.nn.silu(gate_up[:f]) * gate_up[f:])
    return act.T.reshape(*lead, f)


def mlp_block(layer, config: ModelConfig, x):
    h = rms_norm(x, layer["mlp_norm"], config.rms_norm_eps)
    if "w_gate_up" not in layer:  # unfused (tensor-parallel layers)
        act = jax.nn.silu(linear(h, layer["w_gate"])) * linear(h, layer["w_up"])
    elif np.prod(h.shape[:-1]) > MAX_ROWS and not isinstance(layer["w_gate_up"], PackedWeight):
        # more rows than the CPU kernel takes from a plain weight: XLA's product
        act = _gated_columns(h, layer["w_gate_up"])
    else:
        act = swiglu(linear(h, layer["w_gate_up"]))
    return x + linear(act, layer["w_down"])


def key_mask(config: ModelConfig, cache: PagedKVCache, positions, tree_mask):
    """bool[B, T, slots]: the keys each new token sees (with Mistral's sliding window applied).

    tree_mask [B, T, J] covers the scratch slots lengths .. lengths + J - 1 (J = T unless the
    tokens are written elsewhere, see `decoder_layers`). Computed once per forward and shared by
    every layer.
    """
    num_slots = cache.capacity
    vis = visible_keys_mask(cache.lengths, tree_mask, num_slots)
    if config.sliding_window is None:
        return vis
    slot = jnp.arange(num_slots)[None, :]
    rel = slot - cache.lengths[:, None]
    t = positions.shape[1]
    if tree_mask.shape[-1] == t:
        new_pos = jnp.take_along_axis(positions, jnp.clip(rel, 0, t - 1), axis=1)
    else:  # scratch keys of earlier calls: a draft tree, far shorter than any window
        new_pos = jnp.broadcast_to(jnp.min(positions, axis=1, keepdims=True), rel.shape)
    key_pos = jnp.where(rel >= 0, new_pos, slot)  # committed slots sit at their own position
    near = positions[:, :, None] - key_pos[:, None, :] < config.sliding_window
    return vis & near


def decoder_layers(
    layers,
    config: ModelConfig,
    x,
    positions,
    cache: PagedKVCache,
    tree_mask,
    valid,
    capture=frozenset(),
    slots=None,
    defer_kv_write=False,
):
    """The decoder layers over input vectors x [B, T, D] (no embedding, no final norm).

    Returns (x, cache with the new K/V written, {layer index: output} for `capture`). A layer
    without `attn_norm` skips its input norm (EAGLE's first draft layer).
    By default token i is written at slot lengths + i and tree_mask is [B, T, T]. Drafting a tree
    over several calls passes `slots` (int32[B, T], each >= lengths) and a tree_mask [B, T, J]
    over the scratch slots lengths .. lengths + J - 1, where earlier calls wrote the ancestors;
    the caller then hides unwritten slots itself.
    defer_kv_write: leave the pools untouched and return the new (keys, values) per layer as a
    fourth result (None otherwise); on the Pallas path only with the default slots.
    """
    t = x.shape[1]
    given_slots = slots is not None
    if slots is None:
        slots = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        # Padding is not written: no query may see its slot, whose stale contents (even NaN)
        # would otherwise reach real tokens' outputs as 0 * NaN through the padding queries.
        tree_mask = tree_mask & valid[:, None, :]
    cos, sin = rope_cos_sin(config, positions)
    keys_seen = key_mask(config, cache, positions, tree_mask)
    if defer_kv_write and uses_pallas():
        if given_slots:
            raise ValueError("deferred K/V writes on the Pallas path need the default slots")
    elif defer_kv_write:  # once per pass, not per layer
        keys_seen = unwritten_keys_mask(keys_seen, slots, valid)
    captured = {}
    k_all, v_all = list(cache.k_pages), list(cache.v_pages)
    new_k, new_v = [], []
    for i, layer in enumerate(layers):
        x, k, v = _attention_block(
            layer,
            config,
            x,
            cos,
            sin,
            k_all[i],
            v_all[i],
            cache.block_tables,
            cache.lengths,
            slots,
            valid,
            tree_mask,
            keys_seen,
            defer_kv_write,
        )
        if defer_kv_write:
            new_k.append(k)
            new_v.append(v)
        else:
            k_all[i], v_all[i] = k, v
        x = mlp_block(layer, config, x)
        if i in capture:
            captured[i] = x
    if defer_kv_write:
        return x, cache, captured, (tuple(new_k), tuple(new_v))
    return x, cache.replace(k_pages=k_all, v_pages=v_all), captured, None


def forward(
    params,
    config: ModelConfig,
    tokens,
    positions,
    cache: PagedKVCache,
    tree_mask,
    *,
    valid=None,
    logits_at=None,
    hidden_layers: Sequence[int] = (),
    defer_kv_write: bool = False,
) -> ForwardOutput:
    """Run the decoder over T new tokens per sequence, writing their K/V into the cache.

    tokens, positions: int32[B, T]. New token i of sequence b is stored at slot
    cache.lengths[b] + i and attends to the committed prefix plus the new tokens j with
    tree_mask[b, i, j] (a causal mask for prefill and chains, an ancestor mask for trees).
    valid (bool[B, T]) marks padding whose K/V is not written. logits_at (int32[B, K]) picks the
    positions whose logits are computed (all when None; an empty K skips the head).
    hidden_layers: indices of decoder layers whose output residual stream is returned.
    defer_kv_write: return the new K/V in `new_kv` instead of writing them (the cache comes back
    unchanged); for passes inside `lax.switch` branches (see `attention.attention_unwritten`).
    """
    b, t = tokens.shape
    if valid is None:
        valid = jnp.ones((b, t), bool)
    wanted = set(hidden_layers)
    if any(i < 0 or i >= config.num_layers for i in wanted):
        raise ValueError(f"hidden_layers must lie in [0, {config.num_layers})")
    x, cache, captured, new_kv = decoder_layers(
        params["layers"],
        config,
        take_rows(params["embed"], tokens),
        positions,
        cache,
        tree_mask,
        valid,
        wanted,
        defer_kv_write=defer_kv_write,
    )
    hidden = rms_norm(x, params["norm"], config.rms_norm_eps)
    if logits_at is None:
        logits = compute_logits(params, hidden)
    elif logits_at.shape[1] == 0:
        logits = None
    else:
        picked = jnp.take_along_axis(hidden, logits_at[:, :, None], axis=1)
        logits = compute_logits(params, picked)
    return ForwardOutput(logits, hidden, tuple(captured[i] for i in hidden_layers), cache, new_kv)


def causal_mask(batch: int, t: int):
    """bool[B, T, T] lower-triangular mask of a chain of new tokens."""
    return jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (batch, t, t))
