"""The model's dense layers: XLA's dot, or on CPU the native kernel (pallas_kernels/
cpu_matmul.cc) over weights packed into column panels once, when the model is built."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_matmul

# The layer weights the dense layers read, each [(L,) K, N]
DENSE_PARAMS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
# Weights that read the same input, packed side by side (along N) as one where the native
# matmul runs them: one call and one pass over the input instead of several. Each column's sum
# is the same as apart, so outputs do not change. At 32 decode rows of the 30M dummy model the
# q, k and v calls took ~290 us a layer (k and v at ~100 GFLOP/s), the fused one ~200.
FUSED_DENSE = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}


def pack(w: Any) -> Any:  # [..., K, N] -> f32[..., ceil(N / 32), K, 32]
    """A weight placed on a device (one: packed weights are not sharded) stays on it."""
    packed = cpu_matmul.pack(np.asarray(w, np.float32))
    if isinstance(w, jax.Array):
        (device,) = w.devices()
        return jax.device_put(packed, device)
    return packed


def packed_columns(w: jax.Array,  # f32[P, K, 32] from pack()
                   columns: jax.Array,  # i32[T]
                   ) -> jax.Array:  # f32[T, K]: each column of the weight pack() was given
    return w[columns // cpu_matmul.PANEL, :, columns % cpu_matmul.PANEL]


def concat_columns(ws: list[Any]) -> Any:  # [..., K, N_i] each -> [..., K, sum of N_i]
    """Weights placed on a device stay on it."""
    return (jnp.concatenate(ws, -1) if isinstance(ws[0], jax.Array)
            else np.concatenate([np.asarray(w) for w in ws], -1))


def dense(x: jax.Array,  # [T, K]
          w: jax.Array,  # [K, N], or packed by pack() when `columns` is given
          columns: int | None = None,  # N of a packed weight
          ) -> jax.Array:  # [T, N]
    return x @ w if columns is None else cpu_matmul.matmul(x, w, columns)


def uses_native_matmul(attention_backend: str, num_devices: int, dtype: Any) -> bool:
    """The `cpu` backend runs the dense layers in the native kernel too: float32 weights on
    one device (a packed weight is not split by tensor parallelism; TP on CPU keeps XLA's
    dots)."""
    return attention_backend == "cpu" and num_devices == 1 and np.dtype(dtype) == np.float32
