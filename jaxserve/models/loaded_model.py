"""What every weight loader returns, and the small helpers they share."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.models.llama_config import LlamaConfig
from jaxserve.models.tokenizer import Tokenizer

# Written by `checkpoint_io.save_converted`; its presence marks a converted (orbax) checkpoint.
CONVERTED_CONFIG_FILE = "jaxserve_config.json"


@dataclass(slots=True)
class LoadedModel:
    config: LlamaConfig
    params: dict[str, np.ndarray]
    tokenizer: Tokenizer | None
    # HF generation_config.json's entries (from a GGUF: its general.sampling.* under HF names)
    generation_config: dict[str, Any] = field(default_factory=dict)


def read_json(path: Path) -> dict[str, Any]:
    """A file holding one JSON object (config.json and its kin); anything else is a ValueError
    naming the file."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8
        raise ValueError(f"{path}: cannot read JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{path}: must hold a JSON object, got {type(value).__name__}")
    return value
