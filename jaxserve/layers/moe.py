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
from jax.sharding import Mesh, PartitionSpec as P

from jaxserve.layers.axes import AXIS


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
            w_gate: jax.Array,  # [E_local, D, F]
            w_up: jax.Array,  # [E_local, D, F]
            w_down: jax.Array,  # [E_local, F, D]
            top_k: int, normalize: bool,
            first_expert: int | jax.Array = 0) -> jax.Array:  # [T, D]
    """The experts' outputs for every token, of the experts [first_expert, + E_local) held
    here (all of them by default): a token's pairs routed elsewhere add nothing."""
    T, num_local = x.shape[0], w_gate.shape[0]
    experts, weights = route(x, router, top_k, normalize)
    local = experts.reshape(-1) - first_expert  # i32[T * k], pair p is token p // k
    group = jnp.where((local >= 0) & (local < num_local), local, num_local)  # elsewhere: last
    order = jnp.argsort(group, stable=True)  # the pairs grouped by expert
    rows = x[order // top_k]  # [T * k, D]
    # rows past the local groups' sizes are left out of the matmuls: they come out zero
    sizes = jnp.bincount(group, length=num_local + 1)[:num_local].astype(jnp.int32)
    gate = jax.lax.ragged_dot(rows, w_gate, sizes)
    up = jax.lax.ragged_dot(rows, w_up, sizes)
    y = jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down, sizes)  # [T * k, D]
    # Each pair back in token order, weighted; a token's k outputs summed.
    y = jnp.zeros_like(y).at[order].set(y).reshape(T, top_k, -1)
    return jnp.einsum("tkd,tk->td", y, weights.astype(y.dtype))


def expert_parallel_moe(x: jax.Array,  # [T, D], normed, on every device
                        router: jax.Array,  # [D, E], on every device
                        w_gate: jax.Array,  # [E, D, F], experts split over the model axis
                        w_up: jax.Array,  # [E, D, F], as w_gate
                        w_down: jax.Array,  # [E, F, D], as w_gate
                        top_k: int, normalize: bool, mesh: Mesh) -> jax.Array:  # [T, D]
    """Expert parallelism: each device holds E / n whole experts and runs them on the rows
    routed to them; every device routes the tokens alike (tensor-parallel attention leaves
    them on every device) and the partial outputs are summed over the devices, the one
    all-reduce a tensor-parallel MLP ends in too."""
    def local(x: jax.Array, router: jax.Array, w_gate: jax.Array, w_up: jax.Array,
              w_down: jax.Array) -> jax.Array:
        first = jax.lax.axis_index(AXIS) * w_gate.shape[0]
        return jax.lax.psum(moe_mlp(x, router, w_gate, w_up, w_down, top_k, normalize, first),
                            AXIS)

    experts = P(AXIS)
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), experts, experts, experts),
                         out_specs=P(), check_vma=False)(x, router, w_gate, w_up, w_down)
