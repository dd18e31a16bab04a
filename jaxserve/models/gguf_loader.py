"""GGUF files (llama.cpp): the config their family reads from the metadata, tensors
dequantised to float32 under the family's names, and the embedded tokenizer."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from jaxserve.models.gguf_dequant import dequantize
from jaxserve.models.gguf_file import GGUFTensor, read_gguf
from jaxserve.models.gguf_tokenizer import read_gguf_tokenizer
from jaxserve.models.llama2c_loader import interleaved_to_half_split
from jaxserve.models.loaded_model import LoadedModel
from jaxserve.models.registry import check_params, config_from_gguf, gguf_architecture

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")

# general.sampling.* (the sampling a GGUF's maker recommends) -> HF generation_config names
_SAMPLING_KEYS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                  "penalty_repeat": "repetition_penalty"}


def _dequantize(path: Path, tensor: GGUFTensor) -> np.ndarray:
    kind = tensor.qtype.name
    if kind not in SUPPORTED_TYPES:
        raise ValueError(f"{path}: tensor {tensor.name!r} has unsupported GGUF type {kind}; "
                         f"supported: {', '.join(SUPPORTED_TYPES)}")
    return dequantize(tensor.data, tensor.qtype).reshape(tensor.shape)


def load_gguf(path: str | Path) -> LoadedModel:
    path = Path(path)
    gguf = read_gguf(path)
    tensors = gguf.tensors
    arch = gguf_architecture(gguf)
    family, names = arch.family, arch.family.gguf_names
    if names.name("embed") not in tensors:
        raise ValueError(f"{path}: GGUF tensor {names.name('embed')!r} is missing")
    config = config_from_gguf(gguf)

    def get(name: str, canonical: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"{path}: GGUF tensor {name!r} is missing")
        w = _dequantize(path, tensors[name])
        transpose = canonical in names.transposed
        stored = tuple(reversed(shape)) if transpose else shape
        if w.shape != stored:
            raise ValueError(f"{path}: GGUF tensor {name!r} has shape {w.shape}, "
                             f"expected {stored}")
        if arch.interleaved_qk and canonical in ("wq", "bq"):
            w = interleaved_to_half_split(w, config.num_heads)
        elif arch.interleaved_qk and canonical in ("wk", "bk"):
            w = interleaved_to_half_split(w, config.num_kv_heads)
        return w.T if transpose else w

    def stacked(canonical: str, shape: tuple[int, ...], pool: ThreadPoolExecutor) -> np.ndarray:
        out = np.empty(shape, np.float32)

        def fill(layer: int) -> None:
            out[layer] = get(names.name(canonical, layer), canonical, shape[1:])

        list(pool.map(fill, range(config.num_layers)))
        return out

    params: dict[str, np.ndarray] = {}
    # numpy lets go of the GIL while it dequantises and copies: the layers fill in parallel
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        for canonical, shape in family.param_shapes(config).items():
            if names.per_layer(canonical):
                params[canonical] = stacked(canonical, shape, pool)
            else:
                params[canonical] = np.ascontiguousarray(
                    get(names.name(canonical), canonical, shape))
    # the output head is known when tied too: it may be a copy of the embedding
    known = {n for c in names.tensors if c in params or not names.per_layer(c)
             for _, n in names.names(c, params[c].shape if c in params else ())}
    unused = sorted(set(tensors) - known)
    if unused:
        raise ValueError(f"{path}: unexpected GGUF tensors {unused[:5]}"
                         f"{' ...' if len(unused) > 5 else ''}")
    check_params(config, params, str(path))
    generation = {hf: gguf.get(f"general.sampling.{key}") for key, hf in _SAMPLING_KEYS.items()
                  if gguf.get(f"general.sampling.{key}") is not None}
    return LoadedModel(config=config, params=params, tokenizer=read_gguf_tokenizer(gguf, path),
                       generation_config=generation)
