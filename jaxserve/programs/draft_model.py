"""The draft model of speculative decoding (`method: draft_model`): a smaller checkpoint of the
target's vocabulary, loaded and sharded as the target is (same loaders, load_format, seed,
dtype and TP rules: heads sharded over the mesh), with its own KV cache
`[L_d, Hkv_d, NB, BS, D_d]` over the same block ids: same block size, block tables and slot
mapping, so the scheduler's blocks hold both models' KV.

In the step (drafter.DraftModelDrafter, as spec_step.py runs it):
- catch-up, every step: after the target's pass, the draft runs over the very same inputs
  (prompt chunks, decode tokens, drafts in place) and writes its KV at every slot the target
  wrote. Rejected drafts' slots are overwritten later, as the target's are. So wherever the
  target's KV is valid the draft's is too (a prefix-cache hit reads blocks both models wrote
  in one step; a preempted request recomputes both): no separate draft prefill.
- drafting program: before the target's pass, k greedy decodes of the draft
  (device_drafts.propose_drafts) from each drafting request's last known token, whose KV
  iteration 0 writes; the positions before it were all written by earlier catch-ups (a request
  drafts only when that token is the one it has left to compute).
The price: a draft forward over every token the target computes, whether it drafts or not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh

from jaxserve.config import EngineConfig
from jaxserve.layers.attention import AttentionBackend, AttentionMetadata
from jaxserve.models.checkpoint_io import read_converted_config
from jaxserve.models.hf_loader import read_hf_config
from jaxserve.models.llama import Llama
from jaxserve.models.llama_config import LlamaConfig
from jaxserve.models.loaded_model import CONVERTED_CONFIG_FILE, LoadedModel
from jaxserve.models.loader import load_model
from jaxserve.models.registry import family_of
from jaxserve.placement.sharding import shard_params

FIELD = "speculative_config.model"


def draft_path(config: EngineConfig) -> str | None:
    """The draft checkpoint's path, or None when the engine has no draft model."""
    spec = config.scheduler.speculative_config
    return spec.model if spec is not None and spec.method == "draft_model" else None


def load_draft(config: EngineConfig) -> LoadedModel | None:
    """The draft's weights on the host, read as the target's are (its load_format and seed)."""
    path = draft_path(config)
    if path is None:
        return None
    try:
        return load_model(path, config.model.load_format, seed=config.model.seed)
    except ValueError as e:
        raise ValueError(f"{FIELD}: {e}") from None


def read_draft_config(config: EngineConfig) -> LlamaConfig | None:
    """The draft's architecture without its weights (deviceless compiles): an HF directory (a
    config.json alone will do) or a converted one."""
    path = draft_path(config)
    if path is None:
        return None
    p = Path(path)
    if (p / CONVERTED_CONFIG_FILE).is_file():
        return read_converted_config(p)
    if (p / "config.json").is_file():
        return read_hf_config(p)
    raise ValueError(f"{FIELD}: {path} has no config.json (HF) nor {CONVERTED_CONFIG_FILE}; a "
                     "deviceless compile reads the draft's architecture from one of them")


def check_draft(draft: LlamaConfig, target: LlamaConfig, max_model_len: int) -> None:
    """The draft must propose the target's token ids at every position the target may reach."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"{FIELD}: the draft's vocabulary ({draft.vocab_size} tokens) differs "
                         f"from the target's ({target.vocab_size}); a draft model must share "
                         "the target's tokenizer")
    if draft.max_position_embeddings < max_model_len:
        raise ValueError(f"{FIELD}: the draft's max_position_embeddings "
                         f"({draft.max_position_embeddings}) is below max_model_len "
                         f"({max_model_len}); lower max_model_len")


def place_draft(loaded: LoadedModel, target: LlamaConfig, max_model_len: int, mesh: Mesh,
                dtype: Any, scan_layers: bool, rotary_lookup: bool) -> Llama:
    """The checked draft as a model on the mesh, sharded by the target's rules."""
    check_draft(loaded.config, target, max_model_len)
    try:
        cfg, placed = shard_params(loaded.config, loaded.params, mesh, dtype)
    except ValueError as e:  # e.g. a head count tensor parallelism does not divide
        raise ValueError(f"{FIELD}: {e}") from None
    return family_of(cfg).model(cfg, placed, dtype, scan_layers=scan_layers,
                                rotary_lookup=rotary_lookup, max_positions=max_model_len)


def catch_up(draft: Llama, backend: AttentionBackend, input_ids: jax.Array,
             md: AttentionMetadata, k_cache: jax.Array, v_cache: jax.Array,
             ) -> tuple[jax.Array, jax.Array]:
    """The draft's KV for every input of the step (input_ids i32[T], as the target saw them),
    written at the step's slots. Its hidden states are not needed (XLA drops the final norm)."""
    _, k_cache, v_cache = draft(input_ids, md, k_cache, v_cache, backend)
    return k_cache, v_cache
