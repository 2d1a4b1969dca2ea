"""Rotary position embeddings (rotate-half layout of Hugging Face weights), with llama3 scaling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from specjax.cpu.matmul import kernel_in_use
from specjax.model_config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """Per-pair inverse frequencies, float32, computed on the host once per config."""
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    scaling = config.rope_scaling_dict
    if scaling is None:
        return inv.astype(np.float32)
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(config: ModelConfig, positions: jnp.ndarray):
    """cos, sin of shape positions.shape + [head_dim] for integer positions.

    On one CPU device (where the matmul kernel runs) both branches of a conditional compute
    them: it only keeps XLA from fusing the cosine and sine into every layer's rotation, where
    XLA:CPU evaluates them per head (two rotations per layer); `optimization_barrier` does not
    stop that fusion. Elsewhere (meshes, where the predicate would be one more collective; GPUs)
    they are computed plainly.
    """
    inv = jnp.asarray(inverse_frequencies(config))
    angles = positions.astype(jnp.float32)[..., None] * inv
    angles = jnp.concatenate([angles, angles], axis=-1)
    cos_sin = lambda a: (jnp.cos(a), jnp.sin(a))
    if not kernel_in_use():
        return cos_sin(angles)
    return jax.lax.cond(jnp.any(positions < 0), cos_sin, cos_sin, angles)


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotate x [B, T, heads, D] by cos/sin [B, T, D] (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)
