"""Phi-3 (`Phi3ForCausalLM`): the Llama block with q/k/v and gate/up fused in its checkpoints,
attention over its config's sliding window, and LongRoPE in the long-context models.

LongRoPE divides each rotary inverse frequency by a factor of its own: the short factors while a
sequence fits in `original_max_position_embeddings`, the long ones past it, and scales cos and
sin by sqrt(1 + ln(s) / ln(original)), s = max_position_embeddings / original. The canonical
params stay Llama's; the checkpoint's qkv_proj and gate_up_proj are read as blocks of rows.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.layers.attention import AttentionMetadata
from jaxserve.layers.rotary import (longrope_angles, longrope_attention_scale,
                                    longrope_inverse_frequencies, lookup_longrope_angles)
from jaxserve.models import llama_weights
from jaxserve.models.llama import Llama
from jaxserve.models.llama_config import INT32_MAX, LlamaConfig, hf_fields
from jaxserve.models.weight_names import WeightNames

PHI3 = "Phi3ForCausalLM"
PHI3_SWITCHES = {PHI3: {"sliding_window": True}}
# transformers' Phi3Config default, which it takes when config.json has none
_DEFAULT_ORIGINAL_MAX_POSITIONS = 4096
_ROPE_TYPES = {"default": "default", "longrope": "longrope",
               "su": "longrope", "yarn": "longrope"}  # transformers' older names for Phi-3's


@dataclass(frozen=True)
class Phi3Config(LlamaConfig):
    # LongRoPE, None for plain RoPE: head_dim / 2 factors each (lists become tuples)
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    original_max_position_embeddings: int | None = None
    architecture: str = PHI3

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.attention_bias:
            raise ValueError("model config: attention_bias must be false: Phi-3's projections "
                             "have no biases")
        if (self.short_factor is None) != (self.long_factor is None):
            raise ValueError("model config: short_factor and long_factor (LongRoPE) must both "
                             "be given or both be absent")
        if not self.longrope:
            return
        for name in ("short_factor", "long_factor"):
            factors = getattr(self, name)
            if not isinstance(factors, (list, tuple)) or len(factors) != self.head_dim // 2:
                raise ValueError(f"model config: {name} must be a list of head_dim / 2 = "
                                 f"{self.head_dim // 2} numbers, got {factors!r}")
            if not all(isinstance(f, numbers.Real) and not isinstance(f, bool)
                       and math.isfinite(f) and f > 0 for f in factors):
                raise ValueError(f"model config: {name} must hold finite numbers > 0, "
                                 f"got {list(factors)!r}")
            object.__setattr__(self, name, tuple(float(f) for f in factors))
        original = self.original_max_position_embeddings
        if not isinstance(original, int) or isinstance(original, bool) \
                or not 2 <= original <= INT32_MAX:
            raise ValueError(f"model config: original_max_position_embeddings must be an "
                             f"integer in [2, {INT32_MAX}], got {original!r}")

    @property
    def longrope(self) -> bool:
        return self.short_factor is not None

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "Phi3Config":
        # transformers 5 writes `rope_parameters` (theta, type, factors); older config.json
        # files `rope_scaling` (type, factors) beside a top-level rope_theta. The LongRoPE
        # entries are taken out here: hf_fields reads only plain RoPE and llama3 scaling.
        rope = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in _ROPE_TYPES:
            raise ValueError(f"model config: rope_scaling.rope_type must be 'longrope' or "
                             f"'default' for {PHI3}, got {rope_type!r}")
        partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise ValueError(f"model config: partial_rotary_factor must be 1 (rotary over the "
                             f"whole head; Phi-4-mini's partial rotary is not supported yet), "
                             f"got {partial!r}")
        for key in ("factor", "attention_factor"):
            if rope.get(key) is not None:
                raise ValueError(f"model config: rope_scaling.{key} is not supported: Phi-3's "
                                 f"scale comes from max_position_embeddings / "
                                 f"original_max_position_embeddings")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"model config: hidden_act must be 'silu', "
                             f"got {cfg['hidden_act']!r}")
        plain = {k: v for k, v in cfg.items() if k not in ("rope_scaling", "rope_parameters")}
        if rope.get("rope_theta") is not None:
            plain["rope_theta"] = rope["rope_theta"]
        fields = hf_fields(plain, PHI3_SWITCHES)
        if _ROPE_TYPES[rope_type] == "default":
            return cls(**fields)
        # transformers prefers the top-level entry to the one among the RoPE parameters
        original = cfg.get("original_max_position_embeddings")
        if original is None:
            original = rope.get("original_max_position_embeddings",
                                _DEFAULT_ORIGINAL_MAX_POSITIONS)
        return cls(**fields, short_factor=rope.get("short_factor"),
                   long_factor=rope.get("long_factor"), original_max_position_embeddings=original)

    def to_hf_dict(self) -> dict[str, Any]:
        hf = super().to_hf_dict() | {
            "original_max_position_embeddings": self.original_max_position_embeddings}
        if self.longrope:
            hf["rope_scaling"] = {"rope_type": "longrope", "short_factor": list(self.short_factor),
                                  "long_factor": list(self.long_factor)}
        return hf


_QKV = "model.layers.{layer}.self_attn.qkv_proj.weight"
_GATE_UP = "model.layers.{layer}.mlp.gate_up_proj.weight"
HF_NAMES = WeightNames(
    tensors={k: v for k, v in llama_weights.HF_NAMES.tensors.items()
             if k not in ("bq", "bk", "bv", "q_norm", "k_norm")}
    | dict.fromkeys(("wq", "wk", "wv"), _QKV) | dict.fromkeys(("w_gate", "w_up"), _GATE_UP),
    transposed=llama_weights.HF_NAMES.transposed,
    ignored_suffixes=llama_weights.HF_NAMES.ignored_suffixes,
    fused={_QKV: ("wq", "wk", "wv"), _GATE_UP: ("w_gate", "w_up")})


class Phi3(Llama):
    """With LongRoPE: two rotary tables on the lookup path (short, long), each scaled."""

    cfg: Phi3Config

    def __init__(self, cfg: Phi3Config, params: dict[str, Any], dtype: Any = jnp.float32,
                 scan_layers: bool = False, rotary_lookup: bool = False,
                 max_positions: int | None = None):
        super().__init__(cfg, params, dtype, scan_layers, rotary_lookup, max_positions)
        if cfg.longrope and self.rotary_table is not None:
            self.rotary_table = nnx.Variable(self.rotary_table[...] * np.float32(self._scale()))

    def _scale(self) -> float:
        return longrope_attention_scale(self.cfg.max_position_embeddings,
                                        self.cfg.original_max_position_embeddings)

    def _inverse_frequencies(self) -> list[np.ndarray]:
        """Plain RoPE's one set, or LongRoPE's short and long sets."""
        cfg = self.cfg
        if not cfg.longrope:
            return super()._inverse_frequencies()
        return [longrope_inverse_frequencies(cfg.head_dim, cfg.rope_theta, factors)
                for factors in (cfg.short_factor, cfg.long_factor)]

    def _angle_sets(self, md: AttentionMetadata) -> list[tuple[jax.Array, jax.Array]]:
        if not self.cfg.longrope:
            return super()._angle_sets(md)
        use_long = past_original_length(md, self.cfg.original_max_position_embeddings)
        if self.rotary_table is not None:
            return [lookup_longrope_angles(self.rotary_table[...], md.positions, use_long)]
        short, long = self._inverse_frequencies()
        return [longrope_angles(md.positions, use_long, jnp.asarray(short), jnp.asarray(long),
                                self._scale())]


def past_original_length(md: AttentionMetadata, original: int) -> jax.Array:  # bool[T]
    """Which tokens rotate by the long factors: those whose request's sequence, after this step,
    is longer than `original`.

    transformers' forward picks one set for all its tokens, the long one when its largest
    position + 1 passes `original`. Per request that is the same choice for a prompt run in one
    step and for each decode step. Where this differs from HF: a prompt prefilled in chunks
    rotates the chunks before the one that passes `original` by the short factors; and HF's
    `generate` re-prefills the whole sequence with the long factors at the step that first
    passes `original`, where a request here keeps the KV its earlier tokens had."""
    tokens = jnp.arange(md.positions.shape[0], dtype=jnp.int32)  # i32[T]
    # padding requests are empty; padding tokens, past them all, go unread
    request = jnp.searchsorted(md.query_start_loc, tokens, side="right") - 1  # i32[T]
    request = jnp.clip(request, 0, md.seq_lens.shape[0] - 1)
    return md.seq_lens[request] > original
