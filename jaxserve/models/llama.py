"""The Llama family (Llama 2/3/3.1, Mistral, Qwen2, Qwen3) in Flax NNX over a paged KV cache.

Checkpoints stack each layer weight on axis 0. Two ways to run the layers, one layer function:
- unrolled (the CPU and GPU default): one array per layer, the layers unrolled in Python. Under
  `lax.scan` XLA:CPU and XLA:GPU copy each step's slice of the stacked weights: another pass
  over all the weights per step (a decode step of the 30M dummy model took 41 ms scanned, 24 ms
  unrolled on CPU; Llama-3-8B on H100, modelled: 2.0x its floor scanned, 1.13x unrolled).
- scanned (`scan_layers`, the TPU default): the stacked weights as they are and one
  `lax.scan` over them, with the layer index traced; a step of the scan runs one period of the
  layers' kinds (`LayerKind`: Gemma's local and global layers). Compile time does not grow with
  depth, and the weights are never held twice.
The forward pass takes a flattened ragged batch (`input_ids[T]` with explicit positions) and
reads/writes the paged cache through an attention backend. With `rotary_lookup` (the CPU's
`cpu` backend) the rotary angles come from a per-position table.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxserve.layers.attention import AttentionBackend, AttentionMetadata
from jaxserve.layers.attention_block import AttentionShape, attention_block
from jaxserve.layers.collective_matmul import CollectiveMatmul
from jaxserve.layers.mlp import gated_mlp
from jaxserve.layers.norm import rms_norm
from jaxserve.layers.rotary import inverse_frequencies, lookup_angles, rotary_angles, rotary_table
from jaxserve.models.llama_config import LayerKind, LlamaConfig

# Each layer's params a family may have (a mixture of experts: its router and experts)
LAYER_PARAMS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down",
                "bq", "bk", "bv", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm",
                "router", "expert_gate", "expert_up", "expert_down")
# The layer weights the dense layers read, each [(L,) K, N]
DENSE_PARAMS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


class Llama(nnx.Module):
    """Holds the weights as `nnx.Param`s; `__call__` is a pure function of them."""

    # Scanned, the layer gets these params as their whole stack, to index itself: an op that
    # cannot take a slice of its operand in place (a custom call) would have XLA copy the slice.
    WHOLE_STACK_PARAMS: frozenset[str] = frozenset()

    def __init__(self, cfg: LlamaConfig, params: dict[str, Any], dtype: Any = jnp.float32,
                 scan_layers: bool = False, rotary_lookup: bool = False,
                 max_positions: int | None = None):
        """`params`: the canonical weight dict (numpy, or jax arrays already placed on their
        shardings); the vocabulary may be padded for tensor parallelism. `rotary_lookup`: the
        rotary angles from a table of `max_positions` rows (the positions the model will see:
        the engine's max_model_len; default max_position_embeddings)."""
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        self.scan_layers = scan_layers

        def param(value: Any) -> nnx.Param:
            return nnx.Param(jnp.asarray(value, self.dtype))

        self.embed = param(params["embed"])
        self.final_norm = param(params["final_norm"])
        self.lm_head = None if cfg.tie_word_embeddings else param(params["lm_head"])
        # The CPU path looks its rotary angles up (layers/rotary.py: rotary_table), on the
        # embedding's one device
        # (one table per rotary angle set: [K, P, 2, Dh // 2])
        self.rotary_table = nnx.Variable(jax.device_put(
            np.stack([rotary_table(inv_freq, max_positions or cfg.max_position_embeddings)
                      for inv_freq in self._inverse_frequencies()]),
            next(iter(self.embed[...].devices())))) if rotary_lookup else None
        names = [name for name in LAYER_PARAMS if name in params]
        if scan_layers:  # [L, ...] each
            self.layers = nnx.Dict({name: param(params[name]) for name in names})
        else:
            self.layers = nnx.List([
                nnx.Dict({name: param(params[name][i]) for name in names})
                for i in range(cfg.num_layers)])

    def held_parts(self, param: str, index: tuple[int, ...], value: Any,
                   ) -> Iterator[tuple[tuple[str | int, ...], tuple[int, ...], Any]]:
        """Where this model holds `param[index] = value` (a part of a param as `params` has it,
        its layers stacked): for each array it falls in, that array's path in the model's
        state dict (`nnx.to_pure_dict`), the index into the array and the value there."""
        if param not in LAYER_PARAMS:
            yield (param,), index, value
        elif self.scan_layers:
            yield ("layers", param), index, value
        elif index:
            yield ("layers", index[0], param), index[1:], value
        else:
            for layer, part in enumerate(value):
                yield ("layers", layer, param), (), part

    def __call__(
        self,
        input_ids: jax.Array,  # i32[T]
        md: AttentionMetadata,
        k_cache: jax.Array,  # [L, Hkv, NB, BS, Dh]
        v_cache: jax.Array,  # [L, Hkv, NB, BS, Dh]
        backend: AttentionBackend,
        num_layers: int | None = None,  # the first layers only (self-speculation's drafts)
        collective: CollectiveMatmul | None = None,  # TP steps that overlap their collectives
    ) -> tuple[jax.Array, jax.Array, jax.Array]:  # hidden [T, D], k_cache, v_cache
        cfg = self.cfg
        depth = cfg.num_layers if num_layers is None else num_layers
        if collective is not None and not collective.applies(input_ids.shape[0]):
            collective = None
        x = self._embed(input_ids)
        if collective is not None:
            x = collective.shard_rows(x)
        kinds = cfg.layer_kinds[:depth]
        angle_sets = self._angle_sets(md)

        def layer(carry: tuple[jax.Array, jax.Array, jax.Array], w: dict[str, jax.Array],
                  index: int | jax.Array, kind: LayerKind,
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
            return self._layer(*carry, w, index, kind, md, backend, angle_sets[kind.rope],
                               collective)

        carry = (x, k_cache, v_cache)
        if self.scan_layers:
            # Each layer's weights are indexed out of the whole stack: a stack sliced to the
            # first layers (layer skip's drafts) was a new array, which on TPU the compiler
            # laid out anew, copying the weights (1.9 GiB of temporaries at Llama-3-8B).
            stacked = {name: p[...] for name, p in self.layers.items()}

            def weights(i: jax.Array) -> dict[str, jax.Array]:
                return {name: w if name in self.WHOLE_STACK_PARAMS else w[i]
                        for name, w in stacked.items()}

            # One scan step runs one period of the layer kinds (Gemma 3: five local layers
            # and a global one), so the program stays one period long whatever the depth.
            period = repeat_period(kinds)
            groups = depth // period

            def run_group(c: tuple[jax.Array, jax.Array, jax.Array], g: jax.Array,
                          ) -> tuple[tuple[jax.Array, jax.Array, jax.Array], None]:
                for j in range(period):
                    c = layer(c, weights(g * period + j), g * period + j, kinds[j])
                return c, None

            carry, _ = jax.lax.scan(run_group, carry, jnp.arange(groups, dtype=jnp.int32))
            for i in range(groups * period, depth):  # the layers past the last whole period
                index = jnp.int32(i)
                carry = layer(carry, weights(index), index, kinds[i])
        else:
            for index, params in enumerate(self.layers[:depth]):
                carry = layer(carry, {name: p[...] for name, p in params.items()}, index,
                              kinds[index])
        x, k_cache, v_cache = carry
        return self._final_norm(x), k_cache, v_cache

    def _final_norm(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.final_norm[...], self.cfg.rms_norm_eps)

    def _embed(self, input_ids: jax.Array) -> jax.Array:  # i32[T] -> [T, D]
        return self.embed[...][input_ids]

    def _inverse_frequencies(self) -> list[np.ndarray]:
        """f32[Dh // 2] for each rotary angle set a `LayerKind.rope` picks (Llama: one)."""
        cfg = self.cfg
        return [inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict)]

    def _angle_sets(self, md: AttentionMetadata) -> list[tuple[jax.Array, jax.Array]]:
        """cos, sin f32[T, 1, Dh // 2] of each rotary angle set at the step's positions."""
        if self.rotary_table is not None:
            table = self.rotary_table[...]
            return [lookup_angles(table[k], md.positions) for k in range(table.shape[0])]
        return [rotary_angles(md.positions, jnp.asarray(inv_freq))
                for inv_freq in self._inverse_frequencies()]

    def _layer(self, x: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
               w: dict[str, jax.Array], index: int | jax.Array, kind: LayerKind,
               md: AttentionMetadata, backend: AttentionBackend,
               angles: tuple[jax.Array, jax.Array],
               collective: CollectiveMatmul | None,
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
        cfg = self.cfg
        shape = AttentionShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps,
                               kind.sliding_window)
        h = rms_norm(x, w["attn_norm"], cfg.rms_norm_eps)
        o, k_cache, v_cache = attention_block(h, w, index, k_cache, v_cache, md, backend, angles,
                                              collective, shape)
        x = x + o
        h = rms_norm(x, w["mlp_norm"], cfg.rms_norm_eps)
        return x + self._mlp(h, w, index, collective, backend.mesh), k_cache, v_cache

    def _mlp(self, h: jax.Array, w: dict[str, jax.Array], layer: int | jax.Array,
             collective: CollectiveMatmul | None,
             mesh: Mesh | None) -> jax.Array:  # [T, D] normed -> [T, D]; `mesh`: the weights'
        return gated_mlp(h, w["w_gate"], w["w_up"], w["w_down"], collective)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:  # [N, D] -> f32[N, V]
        # The head [V, D] is vocab-major, as HF stores it and as the tied embedding is: at 32
        # decode rows XLA:CPU runs hidden @ head.T ~1.8x faster than against a [D, V] copy.
        head = (self.embed if self.lm_head is None else self.lm_head)[...]
        return (hidden @ head.T)[:, :self.cfg.vocab_size].astype(jnp.float32)


def repeat_period(kinds: tuple[LayerKind, ...]) -> int:
    """The fewest leading layers whose kinds, repeated, give every layer's kind."""
    return next(p for p in range(1, len(kinds) + 1)
                if all(kind == kinds[i % p] for i, kind in enumerate(kinds)))


def init_kv_cache(cfg: LlamaConfig, num_blocks: int, block_size: int,
                  dtype: Any = jnp.float32) -> tuple[jax.Array, jax.Array]:
    shape = (cfg.num_layers, cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


def kv_cache_bytes_per_block(cfg: LlamaConfig, block_size: int, dtype: Any) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * block_size * cfg.head_dim * jnp.dtype(
        dtype).itemsize
