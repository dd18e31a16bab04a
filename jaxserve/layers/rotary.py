"""Rotary position embeddings in HF's half-split layout, with Llama-3.1 frequency scaling and
Phi-3's LongRoPE."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def inverse_frequencies(head_dim: int, theta: float,
                        rope_scaling: dict[str, Any] | None = None) -> np.ndarray:
    """f32[head_dim // 2], computed on the host once (matches transformers' llama3 rule)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32)
                                / head_dim))
    if rope_scaling is None:
        return inv_freq.astype(np.float32)
    factor = rope_scaling["factor"]
    low, high = rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]
    old_len = rope_scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rotary_angles(positions: jax.Array,  # i32[T]
                  inv_freq: jax.Array,  # f32[Dh // 2]
                  ) -> tuple[jax.Array, jax.Array]:  # cos, sin: f32[T, 1, Dh // 2]
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(freqs)[:, None, :], jnp.sin(freqs)[:, None, :]


def rotary_table(inv_freq: np.ndarray,  # f32[Dh // 2]
                 num_positions: int) -> np.ndarray:  # f32[num_positions, 2, Dh // 2]
    """cos and sin of every position's angles, for a lookup per step instead of
    rotary_angles: XLA:CPU fuses the cosine and sine into each layer's rotary and evaluates
    them again for every head (~0.25 ms a layer at 32 decodes). The angles are float32
    products, as in rotary_angles and HF; their cos and sin are rounded from float64."""
    angles = (np.arange(num_positions, dtype=np.float32)[:, None]
              * inv_freq.astype(np.float32)[None, :]).astype(np.float64)
    return np.stack([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)


def lookup_angles(table: jax.Array,  # f32[P, 2, Dh // 2]  from rotary_table
                  positions: jax.Array,  # i32[T]
                  ) -> tuple[jax.Array, jax.Array]:  # cos, sin: f32[T, 1, Dh // 2]
    rows = table[positions]
    return rows[:, 0, None, :], rows[:, 1, None, :]


def apply_rotary(x: jax.Array,  # [T, H, Dh]
                 angles: tuple[jax.Array, jax.Array],  # rotary_angles or lookup_angles
                 ) -> jax.Array:
    cos, sin = angles
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def longrope_inverse_frequencies(head_dim: int, theta: float,
                                 factors: tuple[float, ...]) -> np.ndarray:
    """f32[head_dim // 2]: each plain inverse frequency divided by its LongRoPE factor (one of
    Phi-3's two sets, short or long), computed as transformers does, in float32."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    return (1.0 / (np.asarray(factors, np.float32) * theta ** exponents)).astype(np.float32)


def longrope_attention_scale(max_position_embeddings: int,
                             original_max_position_embeddings: int) -> float:
    """What LongRoPE multiplies cos and sin by: sqrt(1 + ln(s) / ln(original)) for the context
    extension s = max / original, 1 where there is none."""
    extension = max_position_embeddings / original_max_position_embeddings
    if extension <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(extension) / math.log(original_max_position_embeddings))


def longrope_angles(positions: jax.Array,  # i32[T]
                    use_long: jax.Array,  # bool[T]  the token rotates by the long factors
                    short_inv_freq: jax.Array,  # f32[Dh // 2]
                    long_inv_freq: jax.Array,  # f32[Dh // 2]
                    scale: float,  # longrope_attention_scale
                    ) -> tuple[jax.Array, jax.Array]:  # cos, sin: f32[T, 1, Dh // 2]
    inv_freq = jnp.where(use_long[:, None], long_inv_freq[None, :],
                         short_inv_freq[None, :])  # f32[T, Dh // 2]
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq
    return (jnp.cos(freqs) * scale)[:, None, :], (jnp.sin(freqs) * scale)[:, None, :]


def lookup_longrope_angles(tables: jax.Array,  # f32[2, P, 2, Dh // 2]  short, long; scaled
                           positions: jax.Array,  # i32[T]
                           use_long: jax.Array,  # bool[T]
                           ) -> tuple[jax.Array, jax.Array]:  # cos, sin: f32[T, 1, Dh // 2]
    rows = tables[use_long.astype(jnp.int32), positions]  # f32[T, 2, Dh // 2]
    return rows[:, 0, None, :], rows[:, 1, None, :]
