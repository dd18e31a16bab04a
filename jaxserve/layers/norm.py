"""RMSNorm, computed in float32 and scaled in the activations' dtype (as HF's Llama does)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array,  # [..., D]
             weight: jax.Array,  # [D]
             eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)
