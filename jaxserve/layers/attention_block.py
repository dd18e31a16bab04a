"""Self-attention over the paged KV cache: q/k/v projections (optional biases and q/k RMSNorm),
rotary, the backend's write-and-attend, and the output projection."""

from __future__ import annotations

from dataclasses import dataclass

import jax
from jax.experimental.layout import Layout, with_layout_constraint

from jaxserve.layers.attention import AttentionBackend, AttentionMetadata
from jaxserve.layers.collective_matmul import CollectiveMatmul
from jaxserve.layers.linear import column_parallel, row_parallel
from jaxserve.layers.norm import rms_norm
from jaxserve.layers.rotary import apply_rotary


@dataclass(frozen=True, slots=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float  # of the q/k RMSNorm, where the layer has one
    sliding_window: int | None = None
    sm_scale: float | None = None  # None: head_dim ** -0.5
    soft_cap: float | None = None  # scores -> soft_cap * tanh(scores / soft_cap)
    norm_unit_offset: bool = False  # the q/k RMSNorm scales by 1 + w (Gemma)


def attention_block(
    x: jax.Array,  # [T, D], normed
    # wq [D, H * Dh], wk and wv [D, Hkv * Dh], wo [H * Dh, D]; where the family has them,
    # biases bq, bk, bv and q/k norm scales q_norm, k_norm [Dh]
    w: dict[str, jax.Array],
    layer: int | jax.Array,
    k_cache: jax.Array,  # [L, Hkv, NB, BS, Dh]
    v_cache: jax.Array,  # [L, Hkv, NB, BS, Dh]
    md: AttentionMetadata,
    backend: AttentionBackend,
    angles: tuple[jax.Array, jax.Array],  # layers/rotary.py: rotary_angles or lookup_angles
    collective: CollectiveMatmul | None,
    shape: AttentionShape,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # [T, D] (before the residual), k_cache, v_cache
    # Row-major projections: left free, TPU's compiler folds the heads' reshape and the
    # kernels' head-major transposes into these dots and relays out wq/wk/wv to suit them,
    # rewriting those weights every step (a layer's slice, or the whole stack for layer skip).
    q, k, v = (with_layout_constraint(y, Layout(major_to_minor=(0, 1)))
               for y in column_parallel(x, [w["wq"], w["wk"], w["wv"]], collective))
    if "bq" in w:
        q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
    T = x.shape[0]
    q = q.reshape(T, shape.num_heads, shape.head_dim)
    k = k.reshape(T, shape.num_kv_heads, shape.head_dim)
    v = v.reshape(T, shape.num_kv_heads, shape.head_dim)
    if "q_norm" in w:
        q = rms_norm(q, w["q_norm"], shape.norm_eps, shape.norm_unit_offset)
        k = rms_norm(k, w["k_norm"], shape.norm_eps, shape.norm_unit_offset)
    q = apply_rotary(q, angles)
    k = apply_rotary(k, angles)
    o, k_cache, v_cache = backend.write_and_attend(
        q, k, v, k_cache, v_cache, layer, md,
        sm_scale=shape.head_dim ** -0.5 if shape.sm_scale is None else shape.sm_scale,
        sliding_window=shape.sliding_window, soft_cap=shape.soft_cap)
    return row_parallel(o.reshape(T, -1), w["wo"], collective), k_cache, v_cache
