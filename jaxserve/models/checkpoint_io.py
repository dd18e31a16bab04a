"""Converted checkpoints: canonical params through orbax, the LlamaConfig as JSON, and the
tokenizer's HF files.

Layout of `dst/`: `jaxserve_config.json`, `params/` (orbax StandardCheckpointer),
`tokenizer/` (`tokenizer.json` ...; `sentencepiece.json` in directories written before
tokenizers built from GGUF or llama2.c vocabularies became HF ones).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.models.llama_config import LlamaConfig
from jaxserve.models.loaded_model import CONVERTED_CONFIG_FILE, LoadedModel, read_json
from jaxserve.models.registry import DEFAULT_HF_ARCHITECTURE, check_params, hf_family
from jaxserve.models.tokenizer import HFTokenizer, Tokenizer, load_hf_tokenizer
from jaxserve.models.tokenizer_builders import SPACE, sentencepiece_bpe

FORMAT_VERSION = 1
SENTENCEPIECE_FILE = "sentencepiece.json"


def config_to_dict(config: LlamaConfig) -> dict[str, Any]:
    d = dataclasses.asdict(config)
    d["rope_scaling"] = dict(config.rope_scaling) if config.rope_scaling else None
    d["eos_token_ids"] = list(config.eos_token_ids)
    return d


def config_from_dict(d: dict[str, Any], source: str) -> LlamaConfig:
    config_type = hf_family(d.get("architecture", DEFAULT_HF_ARCHITECTURE), source).config_type
    fields = {f.name for f in dataclasses.fields(config_type)}
    unknown = sorted(set(d) - fields)
    if unknown:
        raise ValueError(f"{source}: unknown config keys {unknown}")
    d = dict(d)
    if d.get("rope_scaling"):
        d["rope_scaling"] = tuple(sorted(d["rope_scaling"].items()))
    if "eos_token_ids" in d:
        d["eos_token_ids"] = tuple(d["eos_token_ids"])
    try:
        return config_type(**d)
    except TypeError as e:  # a required field is absent
        raise ValueError(f"{source}: {e}") from e


def _save_tokenizer(tokenizer: Tokenizer, dst: Path) -> None:
    if not isinstance(tokenizer, HFTokenizer):
        raise ValueError(f"cannot save a tokenizer of type {type(tokenizer).__name__}")
    dst.mkdir()
    tokenizer.save(dst)


def _load_tokenizer(src: Path, config: LlamaConfig) -> Tokenizer | None:
    if (src / SENTENCEPIECE_FILE).is_file():
        d = read_json(src / SENTENCEPIECE_FILE)
        tok = sentencepiece_bpe([p.replace(" ", SPACE) for p in d["pieces"]], d["scores"],
                                d["token_types"], unk_id=d["unk_token_id"])
        return HFTokenizer(tok, {"add_bos_token": d["bos_token_id"] is not None},
                           bos_token_id=d["bos_token_id"], eos_token_id=d["eos_token_id"])
    return load_hf_tokenizer(src, config)


def save_converted(loaded: LoadedModel, dst: str | Path) -> Path:
    import orbax.checkpoint as ocp

    dst = Path(dst).resolve()
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"convert destination {str(dst)!r} exists and is not an empty directory")
    check_params(loaded.config, loaded.params, "save_converted")
    dst.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(dst / "params", loaded.params)
        checkpointer.wait_until_finished()
    if loaded.tokenizer is not None:
        _save_tokenizer(loaded.tokenizer, dst / "tokenizer")
    # Written last: its presence marks a complete converted checkpoint.
    (dst / CONVERTED_CONFIG_FILE).write_text(json.dumps(
        {"format_version": FORMAT_VERSION, "config": config_to_dict(loaded.config),
         "generation_config": loaded.generation_config}, indent=1))
    return dst


def read_converted_config(path: str | Path) -> LlamaConfig:
    path = Path(path).resolve()
    meta = read_json(path / CONVERTED_CONFIG_FILE)
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path / CONVERTED_CONFIG_FILE}: format_version "
                         f"{meta.get('format_version')!r}, expected {FORMAT_VERSION}")
    return config_from_dict(meta["config"], str(path / CONVERTED_CONFIG_FILE))


def load_converted(path: str | Path, target: dict[str, Any] | None = None) -> LoadedModel:
    """Restore a `save_converted` directory. `target` maps names to `jax.ShapeDtypeStruct`s
    (with shardings) to restore straight into device arrays; without it the params are numpy."""
    import orbax.checkpoint as ocp

    path = Path(path).resolve()
    config = read_converted_config(path)
    if not (path / "params").is_dir():
        raise ValueError(f"{path}: converted checkpoint has no params/ directory")
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            params = checkpointer.restore(path / "params", target)
    except Exception as e:  # orbax/tensorstore errors for missing or corrupt chunks
        raise ValueError(f"{path / 'params'}: cannot restore orbax checkpoint: {e}") from e
    if target is None:
        params = {k: np.asarray(v) for k, v in params.items()}
    check_params(config, params, str(path))
    tok_dir = path / "tokenizer"
    tokenizer = _load_tokenizer(tok_dir, config) if tok_dir.is_dir() else None
    generation = read_json(path / CONVERTED_CONFIG_FILE).get("generation_config") or {}
    return LoadedModel(config=config, params=dict(params), tokenizer=tokenizer,
                       generation_config=generation)
