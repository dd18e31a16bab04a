"""Mixture-of-experts families (Qwen3-MoE, Mixtral) against HF transformers, token for token, on
tiny random checkpoints (4 experts, top 2, fp32) built with `save_pretrained`."""

from __future__ import annotations

import jax
import pytest
from safetensors.numpy import load_file, save_file

from engine_helpers import FEW_BUCKETS, SMALL_ENGINE, assert_no_leaks, hf_greedy, random_prompts
from hf_checkpoints import copy_with_config
from jaxserve import LLM, SamplingParams
from jaxserve.models.loader import load_model
from jaxserve.models.moe import MoeConfig
from jaxserve.placement.sharding import with_expert_parallel

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def prompts_sharing_a_prefix() -> list[list[int]]:
    prompts = random_prompts(10, 1, 60, seed=11)
    return prompts + [prompts[3][:20] + tail for tail in random_prompts(4, 5, 30, seed=12)]


def generate(path, prompts: list[list[int]], **engine: object) -> tuple[list[list[int]], int]:
    """The greedy tokens of each prompt, and the prompt tokens the prefix cache served."""
    llm = LLM(str(path), **(SMALL_ENGINE | engine))
    # the CPU's loop over row tiles, not XLA's dense ragged dot
    assert llm.engine.core.executor.worker.model_config.grouped_matmul == "row_tiles"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_no_leaks(llm.engine)
    return [o.outputs[0].token_ids for o in outs], sum(o.num_cached_tokens for o in outs)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_greedy_tokens_equal_hf_generate(hf_checkpoint, compile_cache_dir, kind):
    """Chunked prefill (prompts over one step's 32 tokens), a shared prefix (prefix caching)
    and async scheduling, on the default CPU backend."""
    path = hf_checkpoint(kind)
    prompts = prompts_sharing_a_prefix()
    got, cached = generate(path, prompts, compilation_cache_dir=compile_cache_dir,
                           max_num_batched_tokens=32, token_buckets=[16, 32],
                           async_scheduling=True)
    assert cached >= 16  # a later prompt's first block came from the cache
    assert got == hf_greedy(path, prompts, GREEDY.max_tokens)


def test_greedy_tokens_equal_hf_when_requests_are_preempted(hf_checkpoint, compile_cache_dir):
    path = hf_checkpoint("qwen3_moe")
    prompts = random_prompts(8, 30, 60, seed=13)
    llm = LLM(str(path), compilation_cache_dir=compile_cache_dir,
              **(SMALL_ENGINE | {"num_kv_blocks": 14}))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, GREEDY.max_tokens)


@pytest.mark.parametrize("engine", [
    pytest.param({"attention_backend": "pallas_interpret"} | FEW_BUCKETS, id="pallas_interpret"),
    pytest.param({"tensor_parallel_size": 2}, id="tp2"),
    pytest.param({"tensor_parallel_size": 2, "enable_expert_parallel": True}, id="ep2"),
    pytest.param({"tensor_parallel_size": 4, "enable_expert_parallel": True}, id="ep4"),
    # scanned layers (TPU's default): the grouped matmuls over every layer's experts
    pytest.param({"scan_layers": True}, id="scanned"),
    pytest.param({"tensor_parallel_size": 2, "enable_expert_parallel": True,
                  "scan_layers": True}, id="ep2-scanned"),
])
def test_greedy_tokens_equal_hf_on_other_backends_and_meshes(hf_checkpoint, compile_cache_dir,
                                                             engine):
    path = hf_checkpoint("mixtral")
    prompts = random_prompts(6, 1, 40, seed=14)
    got, _ = generate(path, prompts, compilation_cache_dir=compile_cache_dir, **engine)
    assert got == hf_greedy(path, prompts, GREEDY.max_tokens)


@pytest.mark.parametrize(("changes", "message"), [
    ({"num_experts_per_tok": 5}, r"num_experts_per_tok must be an integer in \[1, "
                                 r"num_experts=4\], got 5"),
    ({"num_experts_per_tok": 0}, r"num_experts_per_tok must be an integer in \[1, "),
    ({"num_experts": 0}, r"num_experts must be an integer in \[1, "),
    ({"mlp_only_layers": [1]}, r"dense MLP layers among the sparse ones \(mlp_only_layers"),
    ({"decoder_sparse_step": 2}, r"decoder_sparse_step != 1"),
])
def test_a_bad_moe_config_is_a_clear_error_at_load(hf_checkpoint, tmp_path, changes, message):
    path = copy_with_config(hf_checkpoint("qwen3_moe"), tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=message):
        load_model(str(path))


def test_a_missing_expert_weight_is_a_clear_error_at_load(hf_checkpoint, tmp_path):
    path = copy_with_config(hf_checkpoint("mixtral"), tmp_path / "missing")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.block_sparse_moe\.experts\.3\.w2"
                                         r"\.weight' is not in any \*\.safetensors file"):
        load_model(str(path))


def test_configs_read_each_families_expert_fields(hf_checkpoint):
    qwen = load_model(str(hf_checkpoint("qwen3_moe"))).config
    mixtral = load_model(str(hf_checkpoint("mixtral"))).config
    assert isinstance(qwen, MoeConfig) and isinstance(mixtral, MoeConfig)
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size,
            qwen.norm_topk_prob, qwen.qk_norm) == (4, 2, 32, True, True)
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size,
            mixtral.norm_topk_prob, mixtral.qk_norm) == (4, 2, 32, True, False)
    # hf_overrides rebuild the config through its own family
    assert qwen.with_hf_overrides({"num_experts_per_tok": 1}).num_experts_per_tok == 1


def test_expert_parallelism_needs_experts_that_tp_divides(hf_checkpoint):
    with pytest.raises(ValueError, match=r"enable_expert_parallel: LlamaForCausalLM has no "
                                         r"experts"):
        LLM(str(hf_checkpoint("llama")), tensor_parallel_size=2, enable_expert_parallel=True,
            **SMALL_ENGINE)
    six = load_model(str(hf_checkpoint("mixtral"))).config.replace(num_experts=6)
    with pytest.raises(ValueError, match=r"enable_expert_parallel: tensor_parallel_size 4 must "
                                         r"divide num_experts \(6\)"):
        with_expert_parallel(six, True, 4)
    assert with_expert_parallel(six, True, 3).expert_parallel
    assert with_expert_parallel(six, False, 4) is six


def test_an_orbax_checkpoint_restores_whole_experts_onto_each_device(hf_checkpoint,
                                                                      compile_cache_dir, tmp_path):
    """Restored shard by shard (no host copy), the experts land split whole under expert
    parallelism, as the step's shard_map expects them."""
    from jaxserve.models.checkpoint_io import save_converted

    path = hf_checkpoint("mixtral")
    dst = save_converted(load_model(str(path)), tmp_path / "converted")
    prompts = random_prompts(4, 1, 30, seed=15)
    llm = LLM(str(dst), tensor_parallel_size=2, enable_expert_parallel=True,
              compilation_cache_dir=compile_cache_dir, **SMALL_ENGINE)
    experts = llm.engine.core.executor.worker.model.layers[0]["expert_gate"][...]
    assert experts.sharding.spec == jax.sharding.PartitionSpec("model")
    assert experts.addressable_shards[0].data.shape[0] * 2 == experts.shape[0]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, GREEDY.max_tokens)
