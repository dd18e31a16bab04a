"""The one entry point for weights: `load_model(path, load_format)` -> config, canonical float32
params (a family's `param_shapes`, models/registry.py) and the tokenizer; and for a tokenizer
named on its own, `load_tokenizer(path, config)`."""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from jaxserve.config import LOAD_FORMATS, ModelConfig
from jaxserve.models.checkpoint_io import load_converted
from jaxserve.models.gguf_file import read_gguf
from jaxserve.models.gguf_loader import load_gguf
from jaxserve.models.gguf_tokenizer import read_gguf_tokenizer
from jaxserve.models.hf_loader import load_hf, read_generation_config, read_hf_config
from jaxserve.models.llama2c_loader import llama2c_tokenizer, load_llama2c
from jaxserve.models.llama_config import LlamaConfig
from jaxserve.models.loaded_model import CONVERTED_CONFIG_FILE, LoadedModel
from jaxserve.models.registry import check_params, config_from_gguf, family_of
from jaxserve.models.tokenizer import Tokenizer, load_hf_tokenizer


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
    family = family_of(config)
    rng = np.random.default_rng(seed)
    params: dict[str, np.ndarray] = {}
    for name, shape in family.param_shapes(config).items():
        if name in family.norm_params:
            params[name] = np.ones(shape, np.float32)
        else:
            params[name] = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
    return params


def _load_dummy(path: Path | None, config: LlamaConfig | None, seed: int) -> LoadedModel:
    tokenizer, generation = None, {}
    if config is None:
        if path is None:
            raise ValueError("load_format 'dummy' needs dummy_config or a path with config.json")
        config_file = path / "config.json" if path.is_dir() else path
        if not config_file.is_file():
            raise ValueError(f"load_format 'dummy': no config.json at {path}")
        config = read_hf_config(config_file.parent)
    if path is not None and path.is_dir():
        tokenizer = load_hf_tokenizer(path, config)
        generation = read_generation_config(path)
    params = dummy_params(config, seed)
    check_params(config, params, "dummy weights")
    return LoadedModel(config=config, params=params, tokenizer=tokenizer,
                       generation_config=generation)


def with_hf_overrides(loaded: LoadedModel, overrides: dict | None) -> LoadedModel:
    """The model with its config changed by vLLM's hf_overrides (its weights must still fit)."""
    if not overrides:
        return loaded
    config = loaded.config.with_hf_overrides(overrides)
    check_params(config, loaded.params, "hf_overrides")
    return dataclasses.replace(loaded, config=config)


def load_model(path: str | Path | None, load_format: str = "auto", *,
               dummy_config: LlamaConfig | None = None, seed: int = 0,
               hf_overrides: dict | None = None) -> LoadedModel:
    return with_hf_overrides(_load(path, load_format, dummy_config, seed), hf_overrides)


def load_configured(m: ModelConfig) -> LoadedModel:
    """The checkpoint an engine's model config names, as it configures it."""
    return load_model(m.model, m.load_format, seed=m.seed, hf_overrides=m.hf_overrides)


@dataclasses.dataclass(frozen=True, slots=True)
class LoadingModel:
    """A checkpoint being read: its config now, the rest (`result()`) when its weights are in.
    A GGUF's weights are dequantised on a background thread, which takes a second or more,
    while the engine readies what does not need them."""

    config: LlamaConfig
    weights: Future[LoadedModel]

    def result(self) -> LoadedModel:
        return self.weights.result()


def start_loading(m: ModelConfig) -> LoadingModel:
    """`load_configured(m)`, on a background thread for a GGUF (other formats read here)."""
    p = Path(m.model) if m.model else None
    if p is None or m.load_format not in ("auto", "gguf") or p.suffix != ".gguf" \
            or not p.is_file():
        loaded = load_configured(m)
        done: Future[LoadedModel] = Future()
        done.set_result(loaded)
        return LoadingModel(loaded.config, done)
    config = config_from_gguf(read_gguf(p))
    if m.hf_overrides:
        config = config.with_hf_overrides(m.hf_overrides)
    pool = ThreadPoolExecutor(1, thread_name_prefix="jaxserve-weights")
    weights = pool.submit(load_configured, m)
    pool.shutdown(wait=False)
    return LoadingModel(config, weights)


def _load(path: str | Path | None, load_format: str, dummy_config: LlamaConfig | None,
          seed: int) -> LoadedModel:
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
    loaders = {"hf": load_hf, "gguf": load_gguf, "llama2c": load_llama2c,
               "orbax": load_converted}
    return loaders[fmt](p)


def read_model_config(path: str | Path) -> LlamaConfig:
    """A checkpoint's config without its weights: an HF directory or a GGUF file."""
    p = Path(path)
    if p.suffix == ".gguf" and p.is_file():
        return config_from_gguf(read_gguf(p))
    if (p / "config.json").is_file():
        return read_hf_config(p)
    raise ValueError(f"{str(p)!r}: no config.json and not a GGUF file; the model's config is "
                     "read from one of them")


def load_tokenizer(path: str | Path, model: LlamaConfig) -> Tokenizer:
    """`tokenizer=`: an HF tokenizer directory, a GGUF file's embedded tokenizer, or a llama2.c
    tokenizer file (its pieces counted by the model's vocab_size)."""
    p = Path(path)
    if p.is_dir():
        tokenizer = load_hf_tokenizer(p, model)
        if tokenizer is None:
            raise ValueError(f"tokenizer: no tokenizer.json in {str(p)!r}")
    elif p.suffix == ".gguf":
        tokenizer = read_gguf_tokenizer(read_gguf(p), p)
        if tokenizer is None:
            raise ValueError(f"tokenizer: the GGUF file {str(p)!r} has no tokenizer "
                             "(no tokenizer.ggml.tokens)")
    elif p.is_file():
        tokenizer = llama2c_tokenizer(p, model.vocab_size)
    else:
        raise ValueError(f"tokenizer: {str(p)!r} does not exist")
    if tokenizer.vocab_size > model.vocab_size:
        raise ValueError(f"tokenizer {str(p)!r} has {tokenizer.vocab_size} tokens, more than "
                         f"the model's vocab_size ({model.vocab_size})")
    return tokenizer
