"""Tensor-parallel dense layers whose collectives overlap their matmuls (collective matmul).

With plain tensor parallelism every layer ends its attention and its MLP with an all-reduce of
the [T, D] residual that nothing can overlap: the next op needs its result. For a step of many
tokens the residual stream is instead sharded over the devices by rows (sequence parallel):
- a column-parallel layer (q/k/v, gate/up) gathers the rows while it multiplies: each device
  multiplies the rows it holds while passing them on around the ring, in both directions;
- a row-parallel layer (o, down) reduce-scatters while it multiplies: each device adds its part
  of one block of rows to the partial sum it received and passes it on.
Each step's transfer is a collective-permute the compiler runs asynchronously beside the next
chunk's matmul. The bytes sent are an all-reduce's, and the weights are read once per chunk:
worth it only where a chunk's matmul is compute-bound (`min_tokens`), which `CollectiveMatmul`
decides from the step's static token count.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve.layers.axes import AXIS

ROWS = P(AXIS, None)  # the residual stream, sharded by rows
COLUMNS = P(None, AXIS)  # a column-parallel layer's output and weight; a row-parallel one's input


@dataclass(frozen=True)
class CollectiveMatmul:
    """Where steps shard their residual stream by rows: on `mesh` (its model axis), from
    `min_tokens` tokens a step (static: the step's bucket)."""
    mesh: Mesh
    min_tokens: int

    def applies(self, num_tokens: int) -> bool:
        tp = self.mesh.shape[AXIS]
        return tp > 1 and num_tokens >= self.min_tokens and num_tokens % (2 * tp) == 0

    def shard_rows(self, x: jax.Array) -> jax.Array:  # [T, D]
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, ROWS))

    def gathered(self, x: jax.Array, weights: list[jax.Array]) -> list[jax.Array]:
        """x [T, D] sharded by rows, each weight [D, N_i] by columns -> x @ w_i [T, N_i],
        sharded by columns (as XLA's column-parallel dot gives it)."""
        return jax.shard_map(_gathered, mesh=self.mesh,
                             in_specs=(ROWS, *(COLUMNS,) * len(weights)),
                             out_specs=[COLUMNS] * len(weights), check_vma=False)(x, *weights)

    def scattered(self, x: jax.Array, w: jax.Array) -> jax.Array:
        """x [T, K] sharded by columns, w [K, D] by rows -> x @ w [T, D], sharded by rows."""
        return jax.shard_map(_scattered, mesh=self.mesh, in_specs=(COLUMNS, ROWS),
                             out_specs=ROWS, check_vma=False)(x, w)


def _ring(tp: int, step: int) -> list[tuple[int, int]]:
    """Every device sends to the one `step` further along the ring (+1 or -1)."""
    return [(j, (j + step) % tp) for j in range(tp)]


def _gathered(x: jax.Array, *weights: jax.Array) -> list[jax.Array]:
    """Per device: x [R, D] its rows, weights [D, N_i] its columns -> [tp * R, N_i]. Half of
    each device's rows travel forward around the ring and half backward, so each step's
    transfers take both directions of the links; the two halves a step holds go through one
    matmul (each matmul reads the weight once)."""
    tp = jax.lax.axis_size(AXIS)
    me = jax.lax.axis_index(AXIS)
    rows = x.shape[0]
    half = rows // 2
    fwd, bwd = x[:half], x[half:]
    outs = [jnp.zeros((tp * rows, w.shape[1]), x.dtype) for w in weights]
    for step in range(tp):
        if step:  # the rows of the devices `step` before and after this one
            fwd = jax.lax.ppermute(fwd, AXIS, _ring(tp, 1))
            bwd = jax.lax.ppermute(bwd, AXIS, _ring(tp, -1))
        both = jnp.concatenate([fwd, bwd])
        for i, w in enumerate(weights):
            y = (both @ w).astype(x.dtype)
            outs[i] = jax.lax.dynamic_update_slice(outs[i], y[:half],
                                                   ((me - step) % tp * rows, 0))
            outs[i] = jax.lax.dynamic_update_slice(outs[i], y[half:],
                                                   ((me + step) % tp * rows + half, 0))
    return outs


def _scattered(x: jax.Array, w: jax.Array) -> jax.Array:
    """Per device: x [tp * R, K] its columns, w [K, D] its rows -> [R, D], this device's block
    of rows summed over the devices. The partial sums of a block's first half travel backward
    around the ring and of its second half forward, ending on the block's device."""
    tp = jax.lax.axis_size(AXIS)
    me = jax.lax.axis_index(AXIS)
    rows = x.shape[0] // tp
    half = rows // 2
    acc_a = acc_b = None
    for step in range(tp):
        # the first half of the block summed onward to the device before this one, the second
        # half of another block to the one after: one matmul
        a = jax.lax.dynamic_slice_in_dim(x, (me + step + 1) % tp * rows, half)
        b = jax.lax.dynamic_slice_in_dim(x, (me - step - 1) % tp * rows + half, half)
        y = (jnp.concatenate([a, b]) @ w).astype(x.dtype)
        acc_a = y[:half] if acc_a is None else acc_a + y[:half]
        acc_b = y[half:] if acc_b is None else acc_b + y[half:]
        if step < tp - 1:
            acc_a = jax.lax.ppermute(acc_a, AXIS, _ring(tp, -1))
            acc_b = jax.lax.ppermute(acc_b, AXIS, _ring(tp, 1))
    return jnp.concatenate([acc_a, acc_b])
