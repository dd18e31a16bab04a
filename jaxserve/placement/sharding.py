"""Tensor-parallel sharding rules over the mesh's `model` axis.

q/k/v by heads, o by its input, gate/up by columns, down by rows, embedding and LM head by
vocabulary (padded to a multiple of TP), the KV cache by KV heads. When TP exceeds the number
of KV heads, each KV head is duplicated so every device holds the one its query heads read.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve.layers.axes import AXIS
from jaxserve.layers.moe import kernel_for
from jaxserve.models.llama_config import LlamaConfig
from jaxserve.models.moe import MoeConfig
from jaxserve.placement.mesh import place

_SPECS = {
    "embed": P(AXIS, None),
    "lm_head": P(AXIS, None),
    "wq": P(None, None, AXIS), "wk": P(None, None, AXIS), "wv": P(None, None, AXIS),
    "bq": P(None, AXIS), "bk": P(None, AXIS), "bv": P(None, AXIS),
    "wo": P(None, AXIS, None),
    "w_gate": P(None, None, AXIS), "w_up": P(None, None, AXIS),
    "w_down": P(None, AXIS, None),
    # each expert's FFN width split as a dense MLP's is; the router is small: on every device
    "expert_gate": P(None, None, None, AXIS), "expert_up": P(None, None, None, AXIS),
    "expert_down": P(None, None, AXIS, None),
}
# Expert parallelism: whole experts split over the devices instead
_EXPERT_PARALLEL_SPECS = dict.fromkeys(("expert_gate", "expert_up", "expert_down"),
                                       P(None, AXIS, None, None))


def with_expert_parallel(cfg: LlamaConfig, enabled: bool, tp: int) -> LlamaConfig:
    """The config as the devices hold it under `enable_expert_parallel`: num_experts / TP whole
    experts on each device."""
    if not enabled:
        return cfg
    if not isinstance(cfg, MoeConfig):
        raise ValueError(f"enable_expert_parallel: {cfg.architecture} has no experts")
    if cfg.num_experts % tp:
        raise ValueError(f"enable_expert_parallel: tensor_parallel_size {tp} must divide "
                         f"num_experts ({cfg.num_experts})")
    return cfg.replace(expert_parallel=True)


def with_device_kernels(cfg: LlamaConfig, device: Any) -> LlamaConfig:
    """The config as `device` runs it: a mixture's grouped matmul (`kernel_for` it)."""
    if isinstance(cfg, MoeConfig):
        return cfg.replace(grouped_matmul=kernel_for(device))
    return cfg


def validate_tensor_parallel(cfg: LlamaConfig, tp: int) -> None:
    if cfg.num_heads % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide the number of attention heads "
                         f"({cfg.num_heads})")
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        raise ValueError(f"tensor_parallel_size {tp} must divide the number of KV heads "
                         f"({cfg.num_kv_heads}) or be a multiple of it")


def expand_kv_heads(cfg: LlamaConfig, params: dict[str, np.ndarray],
                    tp: int) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """Duplicate each KV head tp / num_kv_heads times (query head j still reads the copy of
    kv head j // group), so the KV cache and k/v projections shard one head per device."""
    if tp <= cfg.num_kv_heads:
        return cfg, params
    reps, hd = tp // cfg.num_kv_heads, cfg.head_dim
    out = dict(params)
    for name in ("wk", "wv", "bk", "bv"):
        if name in params:
            w = params[name]
            heads = w.reshape(*w.shape[:-1], cfg.num_kv_heads, hd)
            out[name] = np.repeat(heads, reps, axis=-2).reshape(*w.shape[:-1], tp * hd)
    return cfg.replace(num_kv_heads=tp), out


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    return -(-vocab_size // tp) * tp


def pad_vocab(params: dict[str, np.ndarray], vocab_size: int, tp: int) -> dict[str, np.ndarray]:
    """Zero rows/columns so the vocabulary splits evenly; their logits are cut off again."""
    extra = padded_vocab_size(vocab_size, tp) - vocab_size
    if not extra:
        return params
    out = dict(params)
    for name in ("embed", "lm_head"):
        if name in params:
            out[name] = np.pad(params[name], ((0, extra), (0, 0)))
    return out


def param_sharding(mesh: Mesh, name: str, shape: tuple[int, ...],
                   cfg: LlamaConfig) -> NamedSharding:
    spec = _SPECS.get(name, P())
    if isinstance(cfg, MoeConfig) and cfg.expert_parallel:
        spec = _EXPERT_PARALLEL_SPECS.get(name, spec)
    tp = mesh.shape[AXIS]
    if any(axis is not None and shape[dim] % tp for dim, axis in enumerate(spec)):
        spec = P()  # e.g. an FFN width that TP does not divide: replicated, still correct
    return NamedSharding(mesh, spec)


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(None, AXIS))  # [L, Hkv, NB, BS, D]: by KV head


def placed_layout(cfg: LlamaConfig, params: dict[str, np.ndarray], tp: int,
                  ) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """The config and host params as TP places them: KV heads expanded, the vocabulary padded.
    A per-layer param may be given as one layer's (or expert's) part: both change only the
    last axis of a layer param."""
    cfg, params = expand_kv_heads(cfg, params, tp)
    return cfg, pad_vocab(params, cfg.vocab_size, tp)


def shard_params(cfg: LlamaConfig, params: dict[str, np.ndarray], mesh: Mesh, dtype: Any,
                 ) -> tuple[LlamaConfig, dict[str, jax.Array]]:
    """Host weights placed on the mesh by these rules (`placed_layout`): the config as placed
    and the device arrays."""
    tp = mesh.shape[AXIS]
    validate_tensor_parallel(cfg, tp)
    cfg, params = placed_layout(cfg, params, tp)
    host_dtype = np.dtype(dtype)
    return cfg, {name: place(np.asarray(w, host_dtype), param_sharding(mesh, name, w.shape, cfg))
                 for name, w in params.items()}
