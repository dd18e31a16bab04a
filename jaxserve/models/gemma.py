"""The Gemma 2 and Gemma 3 (text) families: the Llama block with Gemma's parts.

- local (sliding-window) and global layers (`layer_types`; Gemma 2 alternates them, Gemma 3
  runs five local layers to one global), each kind with its own RoPE base (Gemma 3: 10k local,
  1M global, the global one optionally scaled linearly);
- attention scaled by `query_pre_attn_scalar ** -0.5`, attention and final logits soft-capped
  where the config says (Gemma 2);
- RMSNorm scaled by `1 + w` in float32, norms before and after attention and MLP, q/k norm
  (Gemma 3);
- GeGLU (tanh-approximate GELU), the embedding scaled by sqrt(hidden), tied LM head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxserve.layers.attention import AttentionBackend, AttentionMetadata
from jaxserve.layers.attention_block import AttentionShape, attention_block
from jaxserve.layers.collective_matmul import CollectiveMatmul
from jaxserve.layers.mlp import gated_mlp
from jaxserve.layers.norm import rms_norm
from jaxserve.layers.rotary import inverse_frequencies
from jaxserve.models import llama_weights
from jaxserve.models.llama import Llama
from jaxserve.models.llama_config import LayerKind, LlamaConfig, hf_fields, param_shapes
from jaxserve.models.weight_names import WeightNames

GEMMA2, GEMMA3 = "Gemma2ForCausalLM", "Gemma3ForCausalLM"
GEMMA_SWITCHES = {GEMMA2: {"sliding_window": True},
                  GEMMA3: {"sliding_window": True, "qk_norm": True}}
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class GemmaConfig(LlamaConfig):
    layer_types: tuple[str, ...] = ()  # SLIDING or FULL per layer
    query_pre_attn_scalar: float = 256.0
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    local_rope_theta: float = 10000.0  # the sliding layers' RoPE base (rope_theta: global's)

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= {SLIDING,
                                                                                     FULL}:
            raise ValueError(f"model config: layer_types must list {SLIDING!r} or {FULL!r} for "
                             f"each of the {self.num_layers} layers, got {self.layer_types!r}")
        if SLIDING in self.layer_types and self.sliding_window is None:
            raise ValueError("model config: sliding_window must be set for sliding_attention "
                             "layers")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping",
                     "final_logit_softcapping", "local_rope_theta"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float))
                                          and not isinstance(value, bool)
                                          and math.isfinite(value) and value > 0):
                raise ValueError(f"model config: {name} must be a finite number > 0, "
                                 f"got {value!r}")
        for key, _ in self.rope_scaling or ():
            if key not in ("rope_type", "factor"):
                raise ValueError(f"model config: rope_scaling.{key}: Gemma's global layers "
                                 f"take linear scaling only ('factor')")

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        # The global layers rotate by their own angles where their base or scaling differ
        global_rope = int(self.rope_theta != self.local_rope_theta or bool(self.rope_scaling))
        return tuple(LayerKind(self.sliding_window, 0) if t == SLIDING else LayerKind(None,
                                                                                      global_rope)
                     for t in self.layer_types)

    def replace(self, **changes: Any) -> "GemmaConfig":
        """Another depth (`compile-check --num-layers`) keeps the layers' kinds in order."""
        layers = changes.get("num_layers", self.num_layers)
        if "layer_types" not in changes and layers != self.num_layers:
            changes["layer_types"] = tuple(self.layer_types[i % self.num_layers]
                                           for i in range(layers))
        return super().replace(**changes)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "GemmaConfig":
        cfg = dict(cfg)
        arch = (cfg.get("architectures") or [GEMMA2])[0]
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("model config: use_bidirectional_attention is not supported")
        act = cfg.get("hidden_activation") or cfg.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"model config: hidden_activation must be 'gelu_pytorch_tanh', "
                             f"got {act!r}")
        global_rope, local_theta = _rope_parameters(cfg, arch)
        layers = cfg["num_hidden_layers"]
        pattern = 2 if arch == GEMMA2 else cfg.get("sliding_window_pattern", 6)
        types = cfg.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL
                                           for i in range(layers)]
        fields = hf_fields(cfg, GEMMA_SWITCHES)
        theta = global_rope.pop("rope_theta", 10000.0)
        scaling = None if global_rope.get("rope_type", "default") == "default" else global_rope
        if scaling is not None and scaling.get("rope_type") != "linear":
            raise ValueError(f"model config: rope_scaling type {scaling.get('rope_type')!r} "
                             f"is not supported for Gemma; it supports 'linear'")
        return cls(**(fields | {
            "rope_theta": theta,
            "rope_scaling": (("factor", scaling["factor"]), ("rope_type", "linear"))
            if scaling else None,
            "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
            "tie_word_embeddings": cfg.get("tie_word_embeddings", True)}),
            layer_types=tuple(types),
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256),
            attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            local_rope_theta=local_theta if local_theta is not None else theta)

    def to_hf_dict(self) -> dict[str, Any]:
        return super().to_hf_dict() | {
            "layer_types": list(self.layer_types),
            "query_pre_attn_scalar": self.query_pre_attn_scalar,
            "attn_logit_softcapping": self.attn_logit_softcapping,
            "final_logit_softcapping": self.final_logit_softcapping,
            "rope_local_base_freq": self.local_rope_theta}


def _rope_parameters(cfg: dict[str, Any], arch: str) -> tuple[dict[str, Any], float | None]:
    """The global layers' RoPE (theta and scaling) and the local layers' theta (None: the
    global's), popped from `cfg`: in transformers 5's `rope_parameters` (Gemma 3: one entry
    per layer type) or the older `rope_theta` / `rope_scaling` / `rope_local_base_freq`."""
    params = cfg.pop("rope_parameters", None) or {}
    scaling = cfg.pop("rope_scaling", None) or {}
    local = cfg.pop("rope_local_base_freq", None)
    if FULL in params or SLIDING in params:
        full, sliding = dict(params.get(FULL) or {}), params.get(SLIDING) or {}
        local = sliding.get("rope_theta", local)
    else:
        full = dict(params)
    full.setdefault("rope_theta", cfg.pop("rope_theta", 1e6 if arch == GEMMA3 else 1e4))
    full |= scaling
    if "type" in full:
        full["rope_type"] = full.pop("type")
    for key in ("partial_rotary_factor",):
        if full.pop(key, 1.0) != 1.0:
            raise ValueError(f"model config: rope {key} != 1 is not supported for Gemma")
    return full, local


def gemma_param_shapes(cfg: GemmaConfig) -> dict[str, tuple[int, ...]]:
    L, D = cfg.num_layers, cfg.hidden_size
    return param_shapes(cfg) | {"post_attn_norm": (L, D), "post_mlp_norm": (L, D)}


HF_NAMES = WeightNames(
    tensors=llama_weights.HF_NAMES.tensors | {
        "post_attn_norm": "model.layers.{layer}.post_attention_layernorm.weight",
        "mlp_norm": "model.layers.{layer}.pre_feedforward_layernorm.weight",
        "post_mlp_norm": "model.layers.{layer}.post_feedforward_layernorm.weight"},
    transposed=llama_weights.HF_NAMES.transposed,
    ignored_suffixes=llama_weights.HF_NAMES.ignored_suffixes)


def _gelu_tanh(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=True)


class Gemma(Llama):
    cfg: GemmaConfig

    def _embed(self, input_ids: jax.Array) -> jax.Array:  # i32[T] -> [T, D]
        x = self.embed[...][input_ids]
        return x * jnp.asarray(np.float32(self.cfg.hidden_size ** 0.5)).astype(x.dtype)

    def _inverse_frequencies(self) -> list[np.ndarray]:
        cfg = self.cfg
        local = inverse_frequencies(cfg.head_dim, cfg.local_rope_theta)
        if max(kind.rope for kind in cfg.layer_kinds) == 0:
            return [local]
        factor = dict(cfg.rope_scaling or ()).get("factor", 1.0)
        return [local, (inverse_frequencies(cfg.head_dim, cfg.rope_theta) / np.float32(factor))
                .astype(np.float32)]

    def _norm(self, x: jax.Array, weight: jax.Array) -> jax.Array:
        return rms_norm(x, weight, self.cfg.rms_norm_eps, unit_offset=True)

    def _final_norm(self, x: jax.Array) -> jax.Array:
        return self._norm(x, self.final_norm[...])

    def _layer(self, x: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
               w: dict[str, jax.Array], index: int | jax.Array, kind: LayerKind,
               md: AttentionMetadata, backend: AttentionBackend,
               angles: tuple[jax.Array, jax.Array],
               collective: CollectiveMatmul | None,
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
        cfg = self.cfg
        shape = AttentionShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps,
                               kind.sliding_window, sm_scale=cfg.query_pre_attn_scalar ** -0.5,
                               soft_cap=cfg.attn_logit_softcapping, norm_unit_offset=True)
        o, k_cache, v_cache = attention_block(self._norm(x, w["attn_norm"]), w, index, k_cache,
                                              v_cache, md, backend, angles, collective, shape)
        x = x + self._norm(o, w["post_attn_norm"])
        h = self._mlp(self._norm(x, w["mlp_norm"]), w, index, collective, backend.mesh)
        return x + self._norm(h, w["post_mlp_norm"]), k_cache, v_cache

    def _mlp(self, h: jax.Array, w: dict[str, jax.Array], layer: int | jax.Array,
             collective: CollectiveMatmul | None, mesh: Mesh | None) -> jax.Array:
        return gated_mlp(h, w["w_gate"], w["w_up"], w["w_down"], collective, _gelu_tanh)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:  # [N, D] -> f32[N, V]
        logits = super().compute_logits(hidden)
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)
