"""The model of a checkpoint's family run over a paged KV cache in several calls, and HF
transformers' forward on the same checkpoint: logits to compare."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.layers.attention import AttentionMetadata, get_attention_backend
from jaxserve.models.llama import init_kv_cache
from jaxserve.models.llama_config import LlamaConfig
from jaxserve.models.loader import load_model
from jaxserve.models.registry import family_of

BLOCK = 16


@functools.partial(jax.jit, static_argnums=(0, 1))
def _forward(graphdef, backend, state, ids, md, k_cache, v_cache):
    model = nnx.merge(graphdef, state)
    hidden, k_cache, v_cache = model(ids, md, k_cache, v_cache, backend)
    return model.compute_logits(hidden), k_cache, v_cache


def forward_logits(path, token_ids: list[int], splits: list[int],
                   config: LlamaConfig | None = None, **model_args: bool) -> np.ndarray:
    """Logits at every position, computed in len(splits) calls that share one paged cache:
    each call reads the KV that the earlier calls wrote."""
    loaded = load_model(str(path))
    config = config or loaded.config
    graphdef, state = nnx.split(family_of(config).model(config, loaded.params, **model_args))
    k_cache, v_cache = init_kv_cache(config, 16, BLOCK)
    table = np.arange(15, 0, -1, dtype=np.int32)[None]  # blocks out of order on purpose
    backend = get_attention_backend("xla")
    logits, start = [], 0
    for end in splits + [len(token_ids)]:
        pos = np.arange(start, end, dtype=np.int32)
        md = AttentionMetadata(
            positions=jnp.asarray(pos),
            slot_mapping=jnp.asarray(table[0][pos // BLOCK] * BLOCK + pos % BLOCK),
            query_start_loc=jnp.asarray([0, end - start], jnp.int32),
            seq_lens=jnp.asarray([end], jnp.int32), block_tables=jnp.asarray(table))
        out, k_cache, v_cache = _forward(graphdef, backend, state,
                                         jnp.asarray(token_ids[start:end], jnp.int32), md,
                                         k_cache, v_cache)
        logits.append(np.asarray(out))
        start = end
    return np.concatenate(logits)


def hf_logits(path, token_ids: list[int]) -> np.ndarray:
    import torch
    from hf_checkpoints import hf_model

    with torch.no_grad():
        return hf_model(path)(torch.tensor([token_ids])).logits[0].numpy()
