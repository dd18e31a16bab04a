"""The engine's plan (programs/resolved.py): the facts derived from the config, the model and the
devices, resolved once into a frozen object. A plan whose KV pool cannot hold one max_model_len
sequence cannot be built, and the worker and the compile check resolve the same plan."""

from __future__ import annotations

import copy
import dataclasses

import jax
import jax.numpy as jnp
import pytest

from jaxserve import LLM
from jaxserve.compilation.compile_check import prepare
from jaxserve.config import EngineConfig
from jaxserve.models.llama_config import LlamaConfig
from jaxserve.placement.mesh import tp_mesh
from jaxserve.programs.resolved import resolve_plan
from jaxserve.placement.targets import Target

CFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                  num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=200)
ENGINE = dict(block_size=16, max_num_seqs=4, max_num_batched_tokens=32)


def _plan(platform: str = "cpu", **kwargs: object):
    config = EngineConfig.from_kwargs(model="unused", **ENGINE | kwargs)
    return resolve_plan(config, CFG, platform, tp_mesh(jax.devices()[:1]))


def test_a_pool_that_cannot_hold_one_sequence_is_refused_however_it_was_sized():
    plan = _plan(max_model_len=100)  # 7 blocks of 16
    assert plan.blocks_per_seq == 7 and plan.num_kv_blocks == plan.min_kv_blocks == 8
    assert plan.with_pool(8, 1024).num_kv_blocks == 8
    with pytest.raises(ValueError, match=r"num_kv_blocks \(7\) must hold one max_model_len "
                                         r"\(100\) sequence: at least 7 \+ 1"):
        plan.with_pool(7)
    with pytest.raises(ValueError, match="KV cache budget holds 7 blocks of 1024 bytes"):
        plan.with_pool(7, 1024)
    with pytest.raises(ValueError, match=r"num_kv_blocks \(7\) must hold"):
        _plan(max_model_len=100, num_kv_blocks=7)


def test_the_plan_reads_the_models_context_and_the_platforms_dtype_and_leaves_config_alone():
    config = EngineConfig.from_kwargs(model="unused", **ENGINE)
    before = copy.deepcopy(config)
    plan = resolve_plan(config, CFG, "cpu", tp_mesh(jax.devices()[:1]))
    assert config == before
    assert plan.max_model_len == 200 and plan.blocks_per_seq == 13
    assert plan.dtype == jnp.float32 and _plan("tpu").dtype == jnp.bfloat16
    assert _plan(dtype="float16").dtype == jnp.float16
    assert plan.token_buckets == (1, 2, 4, 8, 16, 32) and plan.request_buckets == (4,)
    assert plan.mesh_shape == (1, 1) and plan.mesh_axes == ("data", "model")
    assert plan.max_logprobs == 20 and _plan(max_logprobs=-1).max_logprobs == 64  # vocabulary
    assert hash(plan) == hash(dataclasses.replace(plan))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.max_model_len = 1  # type: ignore[misc]


def test_the_worker_and_the_compile_check_resolve_the_same_plan(hf_checkpoint):
    """The engine on this host's CPU and the compile check's abstract step for the same
    devices: the same max_model_len, dtype, buckets, mesh and pool."""
    path = hf_checkpoint("llama")
    kwargs = dict(ENGINE, max_model_len=64, num_kv_blocks=24, speculative_config={
        "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
        "prompt_lookup_max": 2}, compilation_cache_dir="")
    worker = LLM(str(path), **kwargs).engine.core.executor.worker
    device = jax.devices()[0]
    target = Target("host", device.platform, device.device_kind, (device,), 1 << 30)
    _, _, plan = prepare(target, worker.loaded.config,
                         EngineConfig.from_kwargs(model=str(path), **kwargs))
    assert plan == worker.plan and plan.num_speculative_tokens == 2
    assert worker.runner.plan is worker.plan
