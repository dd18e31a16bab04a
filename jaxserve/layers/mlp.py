"""The gated MLP of Llama-like blocks: down(act(gate(x)) * up(x)); SwiGLU (silu) by default,
GeGLU for Gemma."""

from __future__ import annotations

from collections.abc import Callable

import jax

from jaxserve.layers.collective_matmul import CollectiveMatmul
from jaxserve.layers.linear import column_parallel, row_parallel


def gated_mlp(x: jax.Array,  # [T, D], normed
              w_gate: jax.Array,  # [D, F]
              w_up: jax.Array,  # [D, F]
              w_down: jax.Array,  # [F, D]
              collective: CollectiveMatmul | None,
              activation: Callable[[jax.Array], jax.Array] = jax.nn.silu,
              ) -> jax.Array:  # [T, D]
    gate, up = column_parallel(x, [w_gate, w_up], collective)
    return row_parallel(activation(gate) * up, w_down, collective)
