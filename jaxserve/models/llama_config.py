"""Architecture switches of the Llama family (Llama 2/3/3.1, Mistral, Qwen2, Qwen3).

One dataclass covers the family; loaders fill it from an HF `config.json` (`from_hf_dict`), a
GGUF header (`from_gguf`) or a llama2.c header. Parameter names and shapes of the canonical
weight dict are `param_shapes`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxserve.models.gguf_file import GGUFFile
from jaxserve.models.llama_weights import GGUF_NAMES

# The HF `architectures` of the family, mapped to the switches they imply.
ARCHITECTURE_SWITCHES = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {"sliding_window": True},
    "Qwen2ForCausalLM": {"attention_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
}
INT32_MAX = 2**31 - 1  # token ids and positions live on the device as i32
# Upper bounds far above any real model, low enough that nonsense fails before allocation.
_LIMITS = {"vocab_size": INT32_MAX, "hidden_size": 2**17, "intermediate_size": 2**19,
           "num_layers": 1024, "num_heads": 2**12, "num_kv_heads": 2**12, "head_dim": 2**12,
           "max_position_embeddings": INT32_MAX}


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_positive_number(value: object) -> bool:
    return (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


@dataclass(frozen=True, slots=True)
class LayerKind:
    """What a layer's program depends on beyond its weights, static in the step: its attention
    window and which of the model's rotary angle sets (`Llama._angle_sets`) it rotates by."""
    sliding_window: int | None = None
    rope: int = 0


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # None, or {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}; stored as a sorted tuple of items to stay hashable.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: biases on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None = None
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = field(default=(2,))
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self) -> None:
        for name, high in _LIMITS.items():
            value = getattr(self, name)
            if not _is_int(value) or not 0 < value <= high:
                raise ValueError(f"model config: {name} must be an integer in [1, {high}], "
                                 f"got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model config: num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"model config: head_dim must be even (RoPE rotates pairs), "
                             f"got {self.head_dim}")
        for name in ("rms_norm_eps", "rope_theta"):
            if not _is_positive_number(getattr(self, name)):
                raise ValueError(f"model config: {name} must be a finite number > 0, "
                                 f"got {getattr(self, name)!r}")
        for name in ("tie_word_embeddings", "attention_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"model config: {name} must be true or false, "
                                 f"got {getattr(self, name)!r}")
        if self.sliding_window is not None and (not _is_int(self.sliding_window)
                                                or self.sliding_window <= 0):
            raise ValueError(f"model config: sliding_window must be a positive integer or "
                             f"null, got {self.sliding_window!r}")
        ids = ([] if self.bos_token_id is None else [self.bos_token_id]) + list(self.eos_token_ids)
        if any(not _is_int(t) or not 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"model config: bos/eos token ids must be integers in [0, "
                             f"{self.vocab_size}), got {self.bos_token_id!r} and "
                             f"{list(self.eos_token_ids)!r}")
        for key, value in self.rope_scaling or ():
            if key != "rope_type" and not _is_positive_number(value):
                raise ValueError(f"model config: rope_scaling.{key} must be a finite number "
                                 f"> 0, got {value!r}")

    @property
    def eos_token_id(self) -> int | None:
        """The first EOS id (a tokenizer has one EOS token), or None when there is none."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """Each layer's kind; a family whose layers differ (local and global) overrides it."""
        return (LayerKind(self.sliding_window),) * self.num_layers

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "LlamaConfig":
        return cls(**hf_fields(cfg, ARCHITECTURE_SWITCHES))
    @classmethod
    def from_gguf(cls, gguf: GGUFFile, architecture: str) -> "LlamaConfig":
        """A GGUF's llama.cpp metadata (`{general.architecture}.*`); `architecture`: the HF
        name it stands for."""
        tensors, path = gguf.tensors, gguf.path
        arch = gguf.field("general.architecture")
        scaling = gguf.field(f"{arch}.rope.scaling.type", "none")
        if scaling != "none" or "rope_freqs.weight" in tensors:
            what = scaling if scaling != "none" else "rope_freqs (llama3)"
            raise ValueError(f"{path}: GGUF rope scaling {what!r} is not supported")
        hidden = gguf.int_field(f"{arch}.embedding_length")
        heads = gguf.int_field(f"{arch}.attention.head_count")
        embed = tensors[GGUF_NAMES.name("embed")]
        tokens = gguf.get("tokenizer.ggml.tokens")
        vocab = gguf.field(f"{arch}.vocab_size", None)
        if vocab is None:
            vocab = len(tokens) if tokens is not None else embed.shape[0]
        output = tensors.get(GGUF_NAMES.name("lm_head"))
        tied = output is None or (output.qtype == embed.qtype
                                  and np.array_equal(output.data, embed.data))
        # Generation ends at EOS and, as in llama.cpp, at end-of-turn / end-of-message tokens.
        eos = [gguf.token_id(k) for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
        return cls(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=gguf.int_field(f"{arch}.feed_forward_length"),
            num_layers=gguf.int_field(f"{arch}.block_count"),
            num_heads=heads,
            num_kv_heads=gguf.int_field(f"{arch}.attention.head_count_kv", heads),
            head_dim=gguf.int_field(f"{arch}.attention.key_length", hidden // heads),
            rms_norm_eps=gguf.f32_field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta=gguf.f32_field(f"{arch}.rope.freq_base", 10000.0),
            max_position_embeddings=gguf.int_field(f"{arch}.context_length", 2048),
            tie_word_embeddings=tied,
            attention_bias=GGUF_NAMES.name("bq", 0) in tensors,
            qk_norm=ARCHITECTURE_SWITCHES[architecture].get("qk_norm", False),
            bos_token_id=gguf.token_id("bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(i for i in eos if i is not None)),
            architecture=architecture,
        )

    def replace(self, **changes: Any) -> "LlamaConfig":
        return dataclasses.replace(self, **changes)

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json entries `from_hf_dict` reads back into this config."""
        return {
            "architectures": [self.architecture], "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling_dict,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias, "sliding_window": self.sliding_window,
            "bos_token_id": self.bos_token_id, "eos_token_id": list(self.eos_token_ids),
        }

    def with_hf_overrides(self, overrides: dict[str, Any]) -> "LlamaConfig":
        """vLLM's hf_overrides: config.json entries replaced, whatever the checkpoint format."""
        hf = self.to_hf_dict()
        unknown = sorted(set(overrides) - set(hf))
        if unknown:
            raise ValueError(f"hf_overrides: {unknown[0]!r} is not a config entry jaxserve "
                             f"reads (it reads {', '.join(sorted(hf))})")
        try:
            return type(self).from_hf_dict(hf | overrides)
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"hf_overrides: {e}") from None


def hf_fields(cfg: dict[str, Any], switches: dict[str, dict[str, bool]]) -> dict[str, Any]:
    """LlamaConfig's fields from an HF config.json whose architecture is one of `switches`
    (the switches it implies)."""
    arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
    if arch not in switches:
        raise ValueError(f"architectures: {arch!r} is not one of {sorted(switches)}")
    implied = switches[arch]
    num_heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    for name, value in (("num_attention_heads", num_heads), ("hidden_size", hidden)):
        if not _is_int(value) or value <= 0:
            raise ValueError(f"model config: {name} must be a positive integer, "
                             f"got {value!r}")
    head_dim = cfg.get("head_dim") or hidden // num_heads
    rope_scaling = cfg.get("rope_scaling") or None
    rope_theta = cfg.get("rope_theta")
    rope_params = cfg.get("rope_parameters")  # transformers 5 moves theta/scaling here
    if isinstance(rope_params, dict):
        rope_theta = rope_params.get("rope_theta", rope_theta)
        if rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
    if rope_scaling is not None:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
        if rope_type in (None, "default"):
            rope_scaling = None
        elif rope_type != "llama3":
            raise ValueError(f"unsupported rope_scaling type {rope_type!r}; jaxserve supports "
                             "'llama3'")
        else:
            keys = ("factor", "low_freq_factor", "high_freq_factor",
                    "original_max_position_embeddings")
            rope_scaling = {"rope_type": "llama3", **{k: rope_scaling[k] for k in keys}}
    eos = cfg.get("eos_token_id", 2)
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    return dict(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        rope_theta=rope_theta if rope_theta is not None else 10000.0,
        rope_scaling=tuple(sorted(rope_scaling.items())) if rope_scaling else None,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=cfg.get("attention_bias", implied.get("attention_bias", False)),
        qk_norm=implied.get("qk_norm", False),
        sliding_window=sliding if implied.get("sliding_window") else None,
        bos_token_id=cfg.get("bos_token_id", 1),
        eos_token_ids=eos_ids,
        architecture=arch,
    )


def param_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The canonical weight dict every loader produces: layers stacked on axis 0, `x @ w` layout,
    q/k rows in HF's half-split RoPE order."""
    L, D, F, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {
        "embed": (V, D),
        "attn_norm": (L, D),
        "wq": (L, D, q),
        "wk": (L, D, kv),
        "wv": (L, D, kv),
        "wo": (L, q, D),
        "mlp_norm": (L, D),
        "w_gate": (L, D, F),
        "w_up": (L, D, F),
        "w_down": (L, F, D),
        "final_norm": (D,),
    }
    if cfg.attention_bias:
        shapes |= {"bq": (L, q), "bk": (L, kv), "bv": (L, kv)}
    if cfg.qk_norm:
        shapes |= {"q_norm": (L, cfg.head_dim), "k_norm": (L, cfg.head_dim)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (V, D)
    return shapes
