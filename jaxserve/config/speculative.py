"""The `speculative_config` engine argument (vLLM's): parsed and validated (no jax here).

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
     "prompt_lookup_max": 5}
    {"method": "layer_skip", "num_speculative_tokens": 3, "num_layers": 4}
    {"method": "draft_model", "model": "/path/to/small", "num_speculative_tokens": 3}

`draft_model`: a smaller checkpoint of the same vocabulary, loaded like the target (the
target's load_format, seed and dtype) and run inside every step with its own KV cache over the
same blocks (docs/speculative_decoding.md). As in vLLM, `model` without `method` means
`draft_model` (`"ngram"` as the model means ngram); `draft_tensor_parallel_size` must be the
target's (or absent), and `quantization` absent.

`disable_by_batch_size`: no drafts in a step once this many requests run (vLLM's
speculative_disable_by_batch_size), where verification costs more than it saves.
`adaptive` (default true): the engine measures its output tokens per second with drafting on
and off and keeps the faster (engine/spec_switch.py); false: drafting always on.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

METHODS = ("ngram", "layer_skip", "draft_model")
_KEYS = frozenset({"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                   "num_layers", "disable_by_batch_size", "adaptive", "model",
                   "draft_tensor_parallel_size", "quantization"})
_NGRAM_MODELS = ("ngram", "[ngram]")  # vLLM's spelling of ngram as a model
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's, for prompt_lookup_min and _max when neither is given


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP  # ngram: shortest suffix matched
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP  # ngram: longest suffix matched
    num_layers: int = 0  # layer_skip: the target's first layers that draft
    model: str | None = None  # draft_model: the draft checkpoint's path
    disable_by_batch_size: int = 0  # 0: never off
    adaptive: bool = True  # drafting on only while measured faster than off

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def normalize_speculative(value: Any, num_model_layers: int | None = None,
                          tensor_parallel_size: int = 1) -> SpeculativeConfig | None:
    """A SpeculativeConfig from a mapping or JSON text; None stays None. Every error is a
    ValueError naming the field (`speculative_config.<field>`)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config: not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a mapping or JSON text, got "
                         f"{type(value).__name__}")
    unknown = sorted(set(value) - _KEYS)
    if unknown:
        raise ValueError(f"speculative_config.{unknown[0]}: unknown field (known: "
                         f"{', '.join(sorted(_KEYS))})")
    method = _method(value)
    if method not in METHODS:
        raise ValueError(f"speculative_config.method must be one of {METHODS}, got {method!r}")
    k = _int_field(value, "num_speculative_tokens", None, low=1)
    lookup_min = value.get("prompt_lookup_min", value.get("prompt_lookup_max",
                                                          DEFAULT_PROMPT_LOOKUP))
    lookup_max = value.get("prompt_lookup_max", lookup_min)
    config = SpeculativeConfig(
        method=method, num_speculative_tokens=k,
        prompt_lookup_min=_int_field({"prompt_lookup_min": lookup_min}, "prompt_lookup_min",
                                     None, low=1),
        prompt_lookup_max=_int_field({"prompt_lookup_max": lookup_max}, "prompt_lookup_max",
                                     None, low=1),
        num_layers=_int_field(value, "num_layers", 0, low=0),
        model=_draft_model(value, method, tensor_parallel_size),
        disable_by_batch_size=_int_field(value, "disable_by_batch_size", 0, low=0),
        adaptive=value.get("adaptive", True))
    if not isinstance(config.adaptive, bool):
        raise ValueError(f"speculative_config.adaptive must be true or false, got "
                         f"{config.adaptive!r}")
    if method != "ngram" and ("prompt_lookup_min" in value or "prompt_lookup_max" in value):
        raise ValueError("speculative_config.prompt_lookup_min/max: only for method 'ngram'")
    if config.prompt_lookup_min > config.prompt_lookup_max:
        raise ValueError(f"speculative_config.prompt_lookup_min ({config.prompt_lookup_min}) "
                         f"must be <= prompt_lookup_max ({config.prompt_lookup_max})")
    if method == "layer_skip":
        if config.num_layers < 1:
            raise ValueError("speculative_config.num_layers: layer_skip needs num_layers >= 1 "
                             "(the target's first layers that draft)")
        if num_model_layers is not None and config.num_layers >= num_model_layers:
            raise ValueError(f"speculative_config.num_layers ({config.num_layers}) must be "
                             f"below the model's {num_model_layers} layers")
    elif "num_layers" in value:
        raise ValueError("speculative_config.num_layers: only for method 'layer_skip'")
    return config


def _method(value: dict[str, Any]) -> Any:
    """vLLM's inference: a model without a method is a draft model, unless it names ngram."""
    method, model = value.get("method"), value.get("model")
    if method is None and model is not None:
        if model in _NGRAM_MODELS:
            return "ngram"
        if "eagle" in str(model).lower():
            raise ValueError(f"speculative_config.method: {model!r} looks like an EAGLE head "
                             f"(vLLM infers 'eagle'), which is not supported; methods: "
                             f"{METHODS}")
        return "draft_model"
    return method


def _draft_model(value: dict[str, Any], method: str, tensor_parallel_size: int) -> str | None:
    """The draft checkpoint's path (draft_model), checked to exist; the fields it refuses."""
    model = value.get("model")
    tp = value.get("draft_tensor_parallel_size")
    if method != "draft_model":
        if model is not None and not (method == "ngram" and model in _NGRAM_MODELS):
            raise ValueError("speculative_config.model: only for method 'draft_model'")
        if tp is not None:
            raise ValueError("speculative_config.draft_tensor_parallel_size: only for method "
                             "'draft_model'")
    elif model is None:
        raise ValueError("speculative_config.model is required for method 'draft_model' (the "
                         "draft checkpoint's path)")
    elif not isinstance(model, (str, os.PathLike)) or not Path(model).exists():
        raise ValueError(f"speculative_config.model: draft model path {model!r} does not exist")
    elif tp is not None and tp != tensor_parallel_size:
        raise ValueError(f"speculative_config.draft_tensor_parallel_size ({tp!r}): the draft "
                         f"runs sharded like the target, so it must be the target's "
                         f"tensor_parallel_size ({tensor_parallel_size}) or absent")
    if value.get("quantization") is not None:
        raise ValueError(f"speculative_config.quantization ({value['quantization']!r}) is not "
                         "supported: the draft is loaded in the target's dtype")
    return None if method != "draft_model" else os.fspath(model)


def _int_field(value: dict[str, Any], name: str, default: int | None, low: int) -> int:
    got = value.get(name, default)
    if got is None:
        raise ValueError(f"speculative_config.{name} is required")
    if not isinstance(got, int) or isinstance(got, bool) or got < low:
        raise ValueError(f"speculative_config.{name} must be an integer >= {low}, got {got!r}")
    return got
