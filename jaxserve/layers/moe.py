"""A sparse mixture-of-experts MLP: each token's router picks its top-k experts, and every
expert runs its gated MLP on the tokens routed to it only.

The (token, expert) pairs are sorted by expert so each expert's rows are contiguous, and the
three projections are grouped matmuls over those groups (`jax.lax.ragged_dot`): one op per
projection however many experts, no Python loop over experts, no expert computing rows it was
not routed. Shapes stay static: T * k rows, whatever the routing.

Scanned layers hand the experts over as the whole stack [L, E, ...]: its layers' experts are
the groups of one grouped matmul, of which only this layer's get rows. A slice of the stack
would be copied out every layer (the grouped matmul is a custom call on TPU, which takes its
operands whole), where the stack itself is a free reshape.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jaxserve.kernels.traffic import KernelTraffic, RaggedBatch, name_params, tiled_name
from jaxserve.layers.axes import AXIS

# The scope of the grouped matmuls, named with the experts a layer has on this device and in
# all (`moe_experts_e32_n128`): the cost model reads it off the compiled calls (`hbm_traffic`).
EXPERTS_SCOPE = "moe_experts"


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
            w_gate: jax.Array,  # [E_local, D, F], or the stack [L, E_local, D, F]
            w_up: jax.Array,  # as w_gate
            w_down: jax.Array,  # [E_local, F, D], or the stack [L, E_local, F, D]
            top_k: int, normalize: bool, layer: int | jax.Array = 0,
            first_expert: int | jax.Array = 0) -> jax.Array:  # [T, D]
    """The experts' outputs for every token, of the experts [first_expert, + E_local) held
    here (all of them by default): a token's pairs routed elsewhere add nothing. `layer`
    picks the layer's experts out of a stack."""
    T = x.shape[0]
    if w_gate.ndim == 4:  # the stack: every layer's experts are groups, this layer's get rows
        num_local = w_gate.shape[1]
        w_gate, w_up, w_down = (w.reshape(-1, *w.shape[2:]) for w in (w_gate, w_up, w_down))
        offset = layer * num_local
    else:
        num_local, offset = w_gate.shape[0], 0
    groups = w_gate.shape[0]
    experts, weights = route(x, router, top_k, normalize)
    local = experts.reshape(-1) - first_expert  # i32[T * k], pair p is token p // k
    group = jnp.where((local >= 0) & (local < num_local), offset + local, groups)
    order = jnp.argsort(group, stable=True)  # the pairs grouped by expert, others last
    rows = x[order // top_k]  # [T * k, D]
    # rows past the groups' sizes are left out of the matmuls: they come out zero
    sizes = jnp.bincount(group, length=groups + 1)[:groups].astype(jnp.int32)
    with jax.named_scope(tiled_name(EXPERTS_SCOPE, e=num_local, n=router.shape[1])):
        gate = jax.lax.ragged_dot(rows, w_gate, sizes)
        up = jax.lax.ragged_dot(rows, w_up, sizes)
        y = jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down, sizes)  # [T * k, D]
    # Each pair back in token order, weighted; a token's k outputs summed.
    y = jnp.zeros_like(y).at[order].set(y).reshape(T, top_k, -1)
    return jnp.einsum("tkd,tk->td", y, weights.astype(y.dtype))


def expert_parallel_moe(x: jax.Array,  # [T, D], normed, on every device
                        router: jax.Array,  # [D, E], on every device
                        w_gate: jax.Array,  # [(L,) E, D, F], experts split over the model axis
                        w_up: jax.Array,  # as w_gate
                        w_down: jax.Array,  # [(L,) E, F, D], as w_gate
                        top_k: int, normalize: bool, layer: int | jax.Array,
                        mesh: Mesh) -> jax.Array:  # [T, D]
    """Expert parallelism: each device holds E / n whole experts and runs them on the rows
    routed to them; every device routes the tokens alike (tensor-parallel attention leaves
    them on every device) and the partial outputs are summed over the devices, the one
    all-reduce a tensor-parallel MLP ends in too."""
    def local(x: jax.Array, router: jax.Array, w_gate: jax.Array, w_up: jax.Array,
              w_down: jax.Array, layer: jax.Array) -> jax.Array:
        first = jax.lax.axis_index(AXIS) * w_gate.shape[-3]
        return jax.lax.psum(moe_mlp(x, router, w_gate, w_up, w_down, top_k, normalize, layer,
                                    first), AXIS)

    experts = P(*(None,) * (w_gate.ndim - 3), AXIS)
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), experts, experts, experts, P()),
                         out_specs=P(), check_vma=False)(
        x, router, w_gate, w_up, w_down, jnp.asarray(layer, jnp.int32))


def hbm_traffic(name: str, operands: list[tuple[tuple[int, ...], int]],
                batch: RaggedBatch) -> KernelTraffic:
    """What one grouped matmul (XLA's ragged dot, a Mosaic kernel on TPU, which walks the
    groups that have rows only) reads and runs: the weights of the `e` experts of the layer
    held here that its rows are routed to (at most one a row), each once, and the matmul of
    the rows routed here (of all n experts' pairs, those of these e on average). Its rows and
    output pass once, counted by the caller; its weights operand is the only one of rank 3
    [G, K, N]."""
    params = name_params(name, EXPERTS_SCOPE)
    j = next(j for j, (dims, _) in enumerate(operands) if len(dims) == 3)
    (_, k, n), itemsize = operands[j]
    rows = max(dims[0] for dims, _ in operands if len(dims) == 2)
    routed_here = rows * params["e"] / params["n"]
    return KernelTraffic(manual_operands=(j,), weights=min(params["e"], rows) * k * n * itemsize,
                         flops=2.0 * routed_here * k * n)
