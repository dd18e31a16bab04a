"""The gated MLP of Llama-like blocks: down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import jax

from jaxserve.layers.collective_matmul import CollectiveMatmul
from jaxserve.layers.linear import column_parallel, row_parallel


def gated_mlp(x: jax.Array,  # [T, D], normed
              w_gate: jax.Array,  # [D, F]
              w_up: jax.Array,  # [D, F]
              w_down: jax.Array,  # [F, D]
              collective: CollectiveMatmul | None) -> jax.Array:  # [T, D]
    gate, up = column_parallel(x, [w_gate, w_up], collective)
    return row_parallel(jax.nn.silu(gate) * up, w_down, collective)
