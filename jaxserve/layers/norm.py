"""RMSNorm, computed in float32. Llama scales in the activations' dtype by `w`; Gemma scales in
float32 by `1 + w` and rounds after (`unit_offset`), as HF's models do."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array,  # [..., D]
             weight: jax.Array,  # [D]
             eps: float, unit_offset: bool = False) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if unit_offset:
        return (x32 * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * x32.astype(x.dtype)
