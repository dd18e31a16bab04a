"""A sparse mixture-of-experts MLP: each token's router picks its top-k experts, and every
expert runs its gated MLP on the tokens routed to it only.

The (token, expert) pairs are sorted by expert so each expert's rows are contiguous, and the
three projections are grouped matmuls over those groups (`jax.lax.ragged_dot`): one op per
projection however many experts, no Python loop over experts, no expert computing rows it was
not routed. Shapes stay static: T * k rows, whatever the routing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def route(x: jax.Array,  # [T, D], normed
          router: jax.Array,  # [D, E]
          top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """Each token's experts i32[T, k] and their weights f32[T, k]: the softmax over all the
    experts' logits (in float32), its top k, renormalised to sum to 1 where `normalize`."""
    probs = jax.nn.softmax((x @ router).astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return experts.astype(jnp.int32), weights


def moe_mlp(x: jax.Array,  # [T, D], normed
            router: jax.Array,  # [D, E]
            w_gate: jax.Array,  # [E, D, F]
            w_up: jax.Array,  # [E, D, F]
            w_down: jax.Array,  # [E, F, D]
            top_k: int, normalize: bool) -> jax.Array:  # [T, D]
    T, num_experts = x.shape[0], router.shape[1]
    experts, weights = route(x, router, top_k, normalize)
    pairs = experts.reshape(-1)  # i32[T * k], pair p is token p // k
    order = jnp.argsort(pairs, stable=True)  # the pairs grouped by expert
    rows = x[order // top_k]  # [T * k, D]
    sizes = jnp.bincount(pairs, length=num_experts).astype(jnp.int32)  # i32[E]
    gate = jax.lax.ragged_dot(rows, w_gate, sizes)
    up = jax.lax.ragged_dot(rows, w_up, sizes)
    y = jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down, sizes)  # [T * k, D]
    # Each pair back in token order, weighted; a token's k outputs summed.
    y = jnp.zeros_like(y).at[order].set(y).reshape(T, top_k, -1)
    return jnp.einsum("tkd,tk->td", y, weights.astype(y.dtype))
