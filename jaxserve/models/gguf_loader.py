"""GGUF files (llama.cpp): metadata -> LlamaConfig, tensors dequantised to float32, and the
embedded tokenizer."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.models.gguf_dequant import dequantize
from jaxserve.models.gguf_file import GGUFFile, GGUFTensor, read_gguf
from jaxserve.models.gguf_tokenizer import read_gguf_tokenizer, special_token_id
from jaxserve.models.llama2c_loader import interleaved_to_half_split
from jaxserve.models.llama_config import LlamaConfig, check_params, param_shapes
from jaxserve.models.loaded_model import LoadedModel

# GGUF general.architecture -> (HF architecture, q/k stored in interleaved RoPE order).
# llama.cpp permutes q/k rows for "llama" (its NORM rope) and keeps HF order for the NEOX-rope
# Qwen models.
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")

_LAYER_TENSORS = {  # canonical name -> GGUF name inside `blk.{i}.`
    "attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight",
    "wv": "attn_v.weight", "wo": "attn_output.weight", "bq": "attn_q.bias",
    "bk": "attn_k.bias", "bv": "attn_v.bias", "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight", "mlp_norm": "ffn_norm.weight",
    "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight", "w_down": "ffn_down.weight",
}
_GLOBAL_TENSORS = {"embed": "token_embd.weight", "final_norm": "output_norm.weight",
                   "lm_head": "output.weight"}
_LINEAR = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}

_MISSING = object()
# general.sampling.* (the sampling a GGUF's maker recommends) -> HF generation_config names
_SAMPLING_KEYS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                  "penalty_repeat": "repetition_penalty"}


def _field(gguf: GGUFFile, key: str, default: Any = _MISSING, *, path: Path) -> Any:
    value = gguf.get(key, default)
    if value is _MISSING:
        raise ValueError(f"{path}: GGUF metadata key {key!r} is missing")
    return value


def _int_field(gguf: GGUFFile, key: str, default: Any = _MISSING, *, path: Path) -> int:
    value = _field(gguf, key, default, path=path)
    if isinstance(value, list):  # per-layer values (llama.cpp allows them for some keys)
        if len(set(value)) != 1:
            raise ValueError(f"{path}: GGUF metadata {key!r} differs between layers ({value}); "
                             "jaxserve needs one value for all layers")
        value = value[0]
    return int(value)


def _f32_value(value: float) -> float:
    """The shortest decimal that rounds to the same float32 (GGUF stores 1e-5 as float32)."""
    return float(np.format_float_positional(np.float32(value)))


def _dequantize(path: Path, tensor: GGUFTensor) -> np.ndarray:
    kind = tensor.qtype.name
    if kind not in SUPPORTED_TYPES:
        raise ValueError(f"{path}: tensor {tensor.name!r} has unsupported GGUF type {kind}; "
                         f"supported: {', '.join(SUPPORTED_TYPES)}")
    return dequantize(tensor.data, tensor.qtype).reshape(tensor.shape)


def read_gguf_config(gguf: GGUFFile, path: Path) -> LlamaConfig:
    tensors = gguf.tensors
    arch = _field(gguf, "general.architecture", path=path)
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; jaxserve supports "
                         f"{sorted(ARCHITECTURES)}")
    scaling = _field(gguf, f"{arch}.rope.scaling.type", "none", path=path)
    if scaling != "none" or "rope_freqs.weight" in tensors:
        what = scaling if scaling != "none" else "rope_freqs (llama3)"
        raise ValueError(f"{path}: GGUF rope scaling {what!r} is not supported")
    hidden = _int_field(gguf, f"{arch}.embedding_length", path=path)
    heads = _int_field(gguf, f"{arch}.attention.head_count", path=path)
    tokens = gguf.get("tokenizer.ggml.tokens")
    vocab = _field(gguf, f"{arch}.vocab_size", None, path=path)
    if vocab is None:
        vocab = len(tokens) if tokens is not None else tensors["token_embd.weight"].shape[0]
    output = tensors.get("output.weight")
    tied = output is None or (
        output.qtype == tensors["token_embd.weight"].qtype
        and np.array_equal(output.data, tensors["token_embd.weight"].data))
    # Generation ends at EOS and, as in llama.cpp, at end-of-turn / end-of-message tokens.
    eos = [special_token_id(gguf, k) for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    hf_arch = ARCHITECTURES[arch][0]
    return LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=_int_field(gguf, f"{arch}.feed_forward_length", path=path),
        num_layers=_int_field(gguf, f"{arch}.block_count", path=path),
        num_heads=heads,
        num_kv_heads=_int_field(gguf, f"{arch}.attention.head_count_kv", heads, path=path),
        head_dim=_int_field(gguf, f"{arch}.attention.key_length", hidden // heads, path=path),
        rms_norm_eps=_f32_value(_field(gguf, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5,
                                       path=path)),
        rope_theta=_f32_value(_field(gguf, f"{arch}.rope.freq_base", 10000.0, path=path)),
        max_position_embeddings=_int_field(gguf, f"{arch}.context_length", 2048, path=path),
        tie_word_embeddings=tied,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm=hf_arch == "Qwen3ForCausalLM",
        bos_token_id=special_token_id(gguf, "bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(i for i in eos if i is not None)),
        architecture=hf_arch,
    )


def load_gguf(path: str | Path) -> LoadedModel:
    path = Path(path)
    gguf = read_gguf(path)
    tensors = gguf.tensors
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path}: GGUF tensor 'token_embd.weight' is missing")
    config = read_gguf_config(gguf, path)
    interleaved = ARCHITECTURES[_field(gguf, "general.architecture", path=path)][1]

    def get(name: str, canonical: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"{path}: GGUF tensor {name!r} is missing")
        w = _dequantize(path, tensors[name])
        stored = tuple(reversed(shape)) if canonical in _LINEAR else shape
        if w.shape != stored:
            raise ValueError(f"{path}: GGUF tensor {name!r} has shape {w.shape}, "
                             f"expected {stored}")
        if interleaved and canonical in ("wq", "bq"):
            w = interleaved_to_half_split(w, config.num_heads)
        elif interleaved and canonical in ("wk", "bk"):
            w = interleaved_to_half_split(w, config.num_kv_heads)
        return w.T if canonical in _LINEAR else w

    def stacked(canonical: str, shape: tuple[int, ...], pool: ThreadPoolExecutor) -> np.ndarray:
        out = np.empty(shape, np.float32)

        def fill(layer: int) -> None:
            out[layer] = get(f"blk.{layer}.{_LAYER_TENSORS[canonical]}", canonical, shape[1:])

        list(pool.map(fill, range(config.num_layers)))
        return out

    params: dict[str, np.ndarray] = {}
    # numpy lets go of the GIL while it dequantises and copies: the layers fill in parallel
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        for canonical, shape in param_shapes(config).items():
            if canonical in _GLOBAL_TENSORS:
                params[canonical] = np.ascontiguousarray(
                    get(_GLOBAL_TENSORS[canonical], canonical, shape))
            else:
                params[canonical] = stacked(canonical, shape, pool)
    known = {f"blk.{i}.{_LAYER_TENSORS[c]}" for i in range(config.num_layers) for c in params
             if c in _LAYER_TENSORS} | set(_GLOBAL_TENSORS.values())
    unused = sorted(set(tensors) - known)
    if unused:
        raise ValueError(f"{path}: unexpected GGUF tensors {unused[:5]}"
                         f"{' ...' if len(unused) > 5 else ''}")
    check_params(config, params, str(path))
    generation = {hf: gguf.get(f"general.sampling.{key}") for key, hf in _SAMPLING_KEYS.items()
                  if gguf.get(f"general.sampling.{key}") is not None}
    return LoadedModel(config=config, params=params, tokenizer=read_gguf_tokenizer(gguf, path),
                       generation_config=generation)
