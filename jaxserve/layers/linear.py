"""Dense projections `x @ w`, through collective matmuls where a step overlaps its
tensor-parallel collectives (layers/collective_matmul.py) and as plain dots elsewhere."""

from __future__ import annotations

import jax

from jaxserve.layers.collective_matmul import CollectiveMatmul


def column_parallel(x: jax.Array,  # [T, D]
                    weights: list[jax.Array],  # each [D, N_i]
                    collective: CollectiveMatmul | None) -> list[jax.Array]:  # each [T, N_i]
    """Column-parallel layers (q/k/v, gate/up) under tensor parallelism."""
    if collective is not None:
        return collective.gathered(x, weights)
    return [x @ w for w in weights]


def row_parallel(x: jax.Array,  # [T, K]
                 w: jax.Array,  # [K, D]
                 collective: CollectiveMatmul | None) -> jax.Array:  # [T, D]
    """A row-parallel layer (o, down) under tensor parallelism."""
    if collective is not None:
        return collective.scattered(x, w)
    return x @ w
