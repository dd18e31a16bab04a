"""HF checkpoint directories: config.json, one or sharded *.safetensors, tokenizer files; and
HF-named tensors given in memory (a weight update)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401  registers numpy's "bfloat16", which safetensors asks for
import numpy as np

from jaxserve.models.llama_config import LlamaConfig
from jaxserve.models.loaded_model import LoadedModel, read_json
from jaxserve.models.registry import check_params, config_from_hf, family_of
from jaxserve.models.tokenizer import load_hf_tokenizer
from jaxserve.models.weight_names import TensorPart

INDEX_FILE = "model.safetensors.index.json"
# Parts of params, by param: (the index of a part, e.g. its layer; its value in our layout)
ParamParts = dict[str, list[tuple[tuple[int, ...], np.ndarray]]]


def read_generation_config(directory: Path) -> dict[str, Any]:
    gen_file = directory / "generation_config.json"
    return read_json(gen_file) if gen_file.is_file() else {}


def read_hf_config(directory: Path) -> LlamaConfig:
    cfg: dict[str, Any] = read_json(directory / "config.json")
    if cfg.get("mlp_bias"):
        raise ValueError(f"{directory}/config.json: mlp_bias=true is not supported")
    try:
        config = config_from_hf(cfg, f"{directory}/config.json")
    except KeyError as e:
        raise ValueError(f"{directory}/config.json: missing key {e.args[0]!r}") from e
    eos = read_generation_config(directory).get("eos_token_id")
    if eos is not None:
        config = config.replace(eos_token_ids=tuple(eos) if isinstance(eos, list) else (eos,))
    return config


def _weight_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file holding it."""
    index_file = directory / INDEX_FILE
    if index_file.is_file():
        weight_map = read_json(index_file).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_file}: no 'weight_map'")
        files = {name: directory / fname for name, fname in weight_map.items()}
        for fname in sorted(set(files.values())):
            if not fname.is_file():
                raise ValueError(f"{index_file}: weight file {fname.name!r} is missing")
        return files
    candidates = sorted(directory.glob("*.safetensors"))
    if not candidates:
        raise ValueError(f"{directory}: no *.safetensors weight file")
    from safetensors import safe_open

    files: dict[str, Path] = {}
    for fname in candidates:
        try:
            with safe_open(str(fname), framework="numpy") as f:
                files.update((name, fname) for name in f.keys())
        except Exception as e:  # SafetensorError: truncated or corrupt header
            raise ValueError(f"{fname}: cannot read safetensors file: {e}") from e
    return files


class _TensorReader:
    def __init__(self, files: dict[str, Path], stack: contextlib.ExitStack) -> None:
        self.files = files
        self.stack = stack
        self.handles: dict[Path, Any] = {}
        self.used: set[str] = set()

    def get(self, name: str, stored: tuple[int, ...], rows: slice | None = None) -> np.ndarray:
        """Tensor `name`, which must be of shape `stored`; only `rows` of it, when given."""
        from safetensors import safe_open

        fname = self.files.get(name)
        if fname is None:
            raise ValueError(f"tensor {name!r} is not in any *.safetensors file")
        try:
            if fname not in self.handles:
                self.handles[fname] = self.stack.enter_context(
                    safe_open(str(fname), framework="numpy"))
            if rows is None:
                tensor = self.handles[fname].get_tensor(name)
                shape = tuple(tensor.shape)
            else:
                part = self.handles[fname].get_slice(name)
                shape = tuple(part.get_shape())
        except Exception as e:
            raise ValueError(f"{fname}: cannot read tensor {name!r}: {e}") from e
        if shape != stored:
            raise ValueError(f"{fname.name}: tensor {name!r} has shape {shape}, "
                             f"expected {stored}")
        self.used.add(name)
        return tensor if rows is None else part[rows]


def load_hf_params(directory: Path, config: LlamaConfig) -> dict[str, np.ndarray]:
    family = family_of(config)
    names = family.hf_names
    files = _weight_files(directory)
    shapes = family.param_shapes(config)
    params = {name: np.empty(shape, np.float32) for name, shape in shapes.items()}
    with contextlib.ExitStack() as stack:
        reader = _TensorReader(files, stack)
        for part in names.parts(shapes):
            params[part.param][part.index] = part.ours(reader.get(part.name, part.stored,
                                                                  part.rows))
    unused = sorted(n for n in set(files) - reader.used
                    if not names.unread(n, config.tie_word_embeddings))
    if unused:
        raise ValueError(f"{directory}: unexpected tensors for {config.architecture}: "
                         f"{unused[:5]}{' ...' if len(unused) > 5 else ''}")
    return params


def hf_param_parts(config: LlamaConfig, tensors: Iterable[tuple[str, Any]]) -> ParamParts:
    """HF-named tensors (numpy or jax arrays) as the parts of our params they hold, every one
    checked first: a name the model has no weight of, or a shape that is not the checkpoint's,
    is a ValueError naming the tensor. A tensor given twice: its last value."""
    family = family_of(config)
    names = family.hf_names
    by_name: dict[str, list[TensorPart]] = {}
    for part in names.parts(family.param_shapes(config)):
        by_name.setdefault(part.name, []).append(part)  # a fused tensor: each param's part
    parts: ParamParts = {}
    for name, tensor in tensors:
        known = by_name.get(name)
        if known is None:
            if names.unread(name, config.tie_word_embeddings):
                continue
            raise ValueError(f"weights: {name!r} is not a weight of this "
                             f"{config.architecture}")
        w = np.asarray(tensor)
        if w.shape != known[0].stored:
            raise ValueError(f"weights: {name!r} has shape {w.shape}, expected "
                             f"{known[0].stored}")
        for part in known:
            parts.setdefault(part.param, []).append(
                (part.index, part.ours(w if part.rows is None else w[part.rows])))
    return parts


def load_hf(directory: str | Path) -> LoadedModel:
    directory = Path(directory)
    config = read_hf_config(directory)
    params = load_hf_params(directory, config)
    check_params(config, params, str(directory))
    tokenizer = load_hf_tokenizer(directory, config)
    return LoadedModel(config=config, params=params, tokenizer=tokenizer,
                       generation_config=read_generation_config(directory))
