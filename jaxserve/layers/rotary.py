"""Rotary position embeddings in HF's half-split layout, with Llama-3.1 frequency scaling."""

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
