"""HF checkpoint directories: config.json, one or sharded *.safetensors, tokenizer files."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401  registers numpy's "bfloat16", which safetensors asks for
import numpy as np

from jaxserve.models.llama_config import LlamaConfig
from jaxserve.models.loaded_model import LoadedModel, read_json
from jaxserve.models.registry import check_params, config_from_hf, family_of
from jaxserve.models.tokenizer import load_hf_tokenizer

INDEX_FILE = "model.safetensors.index.json"

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
    params: dict[str, np.ndarray] = {}
    with contextlib.ExitStack() as stack:
        reader = _TensorReader(files, stack)
        shapes = family.param_shapes(config)
        for name, shape in shapes.items():
            transpose = name in names.transposed
            fused = names.fused_rows(name, shapes)  # its rows of a tensor it shares
            rows, stored = fused if fused else (None, names.stored_shape(name, shape))
            out = np.empty(shape, np.float32)
            for index, tensor in names.names(name, shape):  # per layer (and expert), or one
                w = reader.get(tensor, stored, rows)
                out[index] = w.T if transpose else w
            params[name] = out
    unused = sorted(n for n in set(files) - reader.used
                    if not n.endswith(names.ignored_suffixes)
                    and not (n == names.name("lm_head") and config.tie_word_embeddings))
    if unused:
        raise ValueError(f"{directory}: unexpected tensors for {config.architecture}: "
                         f"{unused[:5]}{' ...' if len(unused) > 5 else ''}")
    return params


def load_hf(directory: str | Path) -> LoadedModel:
    directory = Path(directory)
    config = read_hf_config(directory)
    params = load_hf_params(directory, config)
    check_params(config, params, str(directory))
    tokenizer = load_hf_tokenizer(directory, config)
    return LoadedModel(config=config, params=params, tokenizer=tokenizer,
                       generation_config=read_generation_config(directory))
