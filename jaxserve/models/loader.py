"""The one entry point for weights: `load_model(path, load_format)` -> config, canonical float32
params (see `llama_config.param_shapes`) and the tokenizer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxserve.models.llama_config import LlamaConfig, check_params, param_shapes
from jaxserve.models.tokenizer import Tokenizer, load_hf_tokenizer

LOAD_FORMATS = ("auto", "hf", "gguf", "llama2c", "orbax", "dummy")
# Written by `checkpoint_io.save_converted`; its presence marks a converted (orbax) checkpoint.
CONVERTED_CONFIG_FILE = "jaxserve_config.json"
_NORMS = ("attn_norm", "mlp_norm", "final_norm", "q_norm", "k_norm")


@dataclass(slots=True)
class LoadedModel:
    config: LlamaConfig
    params: dict[str, np.ndarray]
    tokenizer: Tokenizer | None


def detect_format(path: Path) -> str:
    if path.is_dir():
        if (path / CONVERTED_CONFIG_FILE).is_file():
            return "orbax"
        if (path / "config.json").is_file():
            return "hf"
        raise ValueError(f"{path}: cannot detect the load format: the directory has neither "
                         f"config.json (HF) nor {CONVERTED_CONFIG_FILE} (converted by jaxserve)")
    if path.suffix == ".gguf":
        return "gguf"
    if path.suffix == ".bin":
        return "llama2c"
    raise ValueError(f"{path}: cannot detect the load format from the name; expected a directory, "
                     "a *.gguf or a llama2.c *.bin file, or pass load_format")


def dummy_params(config: LlamaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights in the canonical layout: normal(0, 0.02), norm scales 1 (vLLM's dummy)."""
    rng = np.random.default_rng(seed)
    params: dict[str, np.ndarray] = {}
    for name, shape in param_shapes(config).items():
        if name in _NORMS:
            params[name] = np.ones(shape, np.float32)
        else:
            params[name] = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
    return params


def _load_dummy(path: Path | None, config: LlamaConfig | None, seed: int) -> LoadedModel:
    tokenizer = None
    if config is None:
        if path is None:
            raise ValueError("load_format 'dummy' needs dummy_config or a path with config.json")
        config_file = path / "config.json" if path.is_dir() else path
        if not config_file.is_file():
            raise ValueError(f"load_format 'dummy': no config.json at {path}")
        from jaxserve.models.hf_loader import read_hf_config

        config = read_hf_config(config_file.parent)
    if path is not None and path.is_dir():
        tokenizer = load_hf_tokenizer(path, bos_token_id=config.bos_token_id,
                                      eos_token_id=(config.eos_token_ids or (None,))[0])
    params = dummy_params(config, seed)
    check_params(config, params, "dummy weights")
    return LoadedModel(config=config, params=params, tokenizer=tokenizer)


def load_model(path: str | Path | None, load_format: str = "auto", *,
               dummy_config: LlamaConfig | None = None, seed: int = 0) -> LoadedModel:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    p = Path(path) if path not in (None, "") else None
    if load_format == "dummy":
        if p is not None and dummy_config is None and not p.exists():
            raise ValueError(f"model path {str(p)!r} does not exist")
        return _load_dummy(p if p is not None and p.exists() else None, dummy_config, seed)
    if p is None:
        raise ValueError(f"load_format {load_format!r} needs a model path")
    if not p.exists():
        raise ValueError(f"model path {str(p)!r} does not exist")
    fmt = detect_format(p) if load_format == "auto" else load_format
    if fmt == "hf":
        from jaxserve.models.hf_loader import load_hf

        return load_hf(p)
    if fmt == "gguf":
        from jaxserve.models.gguf_loader import load_gguf

        return load_gguf(p)
    if fmt == "llama2c":
        from jaxserve.models.llama2c_loader import load_llama2c

        return load_llama2c(p)
    from jaxserve.models.checkpoint_io import load_converted

    return load_converted(p)


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read JSON: {e}") from e
