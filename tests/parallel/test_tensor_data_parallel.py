"""Tensor and data parallelism on 8 forced CPU devices: same greedy tokens as one device."""

from __future__ import annotations

import jax
import pytest

from engine_helpers import FEW_BUCKETS, SMALL_ENGINE, assert_no_leaks, hf_greedy, random_prompts
from jaxserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (forced) CPU devices")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def gqa8(hf_checkpoint):
    """8 query heads over 2 KV heads: TP 4 and 8 exceed the KV-head count."""
    path = hf_checkpoint("llama", num_heads=8, num_kv_heads=2)
    prompts = random_prompts(10, 1, 50, seed=61)
    return path, prompts, hf_greedy(path, prompts, 12)


# TP 8 spans every device (the `cpu` backend: its native attention per device), DP 2 runs the
# native attention on two devices (its rotary table on each), and TP 2 x DP 2 runs the Pallas
# kernels per device; the other meshes run with `pytest -m full`.
@pytest.mark.parametrize("tp,dp,backend", [
    *(pytest.param(tp, dp, backend, marks=pytest.mark.full)
      for tp, dp, backend in [(1, 1, "xla"), (2, 1, "xla"), (4, 1, "xla"), (2, 2, "xla"),
                              (2, 4, "xla"), (8, 1, "xla"), (4, 1, "pallas_interpret")]),
    (8, 1, "cpu"), (1, 2, "cpu"), (2, 2, "pallas_interpret")])
def test_greedy_tokens_equal_single_device(gqa8, compile_cache_dir, tp, dp, backend):
    path, prompts, expected = gqa8
    llm = LLM(str(path), tensor_parallel_size=tp, data_parallel_size_local=dp,
              attention_backend=backend, compilation_cache_dir=compile_cache_dir,
              **(SMALL_ENGINE | (FEW_BUCKETS if backend == "pallas_interpret" else {})))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("tp,backend", [(4, "xla"), (2, "pallas_interpret")])
def test_collective_matmul_steps_give_the_same_greedy_tokens(gqa8, compile_cache_dir, tp,
                                                             backend):
    """Steps of 32 tokens and more shard the residual stream by rows and overlap their
    collectives with the matmuls (layers/collective_matmul.py): prefills run that way, decode
    steps (16 tokens) the plain way, and the tokens are HF's."""
    path, prompts, expected = gqa8
    llm = LLM(str(path), tensor_parallel_size=tp, attention_backend=backend,
              collective_matmul_min_tokens=32, compilation_cache_dir=compile_cache_dir,
              **(SMALL_ENGINE | FEW_BUCKETS | {"token_buckets": [16, 128]}))
    statics = llm.engine.core.executor.worker.runner.statics
    assert statics.collective is not None and statics.collective.applies(128)
    assert not statics.collective.applies(16)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("method, tp, dp", [
    pytest.param("layer_skip", 2, 2, marks=pytest.mark.full), ("draft_model", 2, 1),
    ("ngram", 2, 2)])
def test_speculation_under_tp_and_dp_gives_the_same_greedy_tokens(gqa8, compile_cache_dir,
                                                                  method, tp, dp):
    """Layer skip, n-gram lookup (its token cache replicated on each rank's devices), and the
    target as its own draft model (its weights and cache sharded by head like the target's),
    whose drafts are all accepted only if the sharded draft computes what the target does."""
    path, prompts, expected = gqa8
    spec = {"method": method, "num_speculative_tokens": 2, "adaptive": False}
    extra = {"layer_skip": {"num_layers": 1}, "draft_model": {"model": str(path)},
             "ngram": {"prompt_lookup_min": 1, "prompt_lookup_max": 2}}[method]
    # One bucket each but for layer skip (2 programs; a draft model doubles compile time).
    buckets = {} if method == "layer_skip" else {"token_buckets": [128], "request_buckets": [16]}
    llm = LLM(str(path), tensor_parallel_size=tp, data_parallel_size_local=dp,
              speculative_config=spec | extra, compilation_cache_dir=compile_cache_dir,
              **(SMALL_ENGINE | buckets))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.stats().spec_decoding
    assert stats.num_draft_tokens > 0
    if method == "draft_model":
        assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens, stats
    if method == "ngram":  # the lookup read real histories (greedy outputs here repeat)
        assert stats.num_accepted_tokens > 0, stats
    assert_no_leaks(llm.engine)


def _device0_bytes(arrays) -> int:
    dev = jax.devices()[0]
    return sum(s.data.nbytes for a in arrays for s in a.addressable_shards if s.device == dev)


def test_per_device_weight_and_kv_bytes_shrink_as_one_over_tp(hf_checkpoint, compile_cache_dir):
    path = hf_checkpoint("llama", num_heads=8, num_kv_heads=4)
    sizes = {}
    for tp in (1, 2, 4):
        w = LLM(str(path), tensor_parallel_size=tp, compilation_cache_dir=compile_cache_dir,
                **SMALL_ENGINE).engine.core.executor.worker
        sharded = [p[...] for layer in w.model.layers for name, p in layer.items()
                   if name.startswith("w")]
        sharded += [w.model.embed[...], w.model.lm_head[...]]
        sizes[tp] = (_device0_bytes(sharded), _device0_bytes([w.runner.k_cache, w.runner.v_cache]))
    for tp in (2, 4):
        assert sizes[tp][0] * tp == sizes[1][0]
        assert sizes[tp][1] * tp == sizes[1][1]


def test_shared_prefixes_go_to_one_rank_and_loads_stay_balanced(hf_checkpoint, compile_cache_dir):
    path = hf_checkpoint("llama")
    llm = LLM(str(path), data_parallel_size_local=2, compilation_cache_dir=compile_cache_dir,
              **SMALL_ENGINE)
    prefix = random_prompts(1, 64, 64, seed=62)[0]
    llm.generate({"prompt_token_ids": prefix + [5]}, GREEDY, use_tqdm=False)  # cached on a rank
    family = [prefix + tail for tail in random_prompts(6, 1, 10, seed=63)]
    llm.generate([{"prompt_token_ids": p} for p in family], GREEDY, use_tqdm=False)
    hits = [s.stats().prefix_cache_hits for s in llm.engine.core.schedulers]
    assert sorted(hits) == [0, 6 * 64]  # every family member hit the whole prefix, on one rank

    unrelated = random_prompts(16, 20, 40, seed=64)
    engine = llm.engine
    for i, p in enumerate(unrelated):
        engine.add_request(f"u{i}", {"prompt_token_ids": p}, GREEDY)
    counts = [len(s.waiting) + len(s.running) for s in engine.core.schedulers]
    assert abs(counts[0] - counts[1]) <= 2
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(engine)


@pytest.mark.parametrize("kwargs,message", [
    ({"tensor_parallel_size": 3}, "tensor_parallel_size 3 must divide the number of attention"),
    ({"tensor_parallel_size": 16}, "needs 16 devices"),
    ({"tensor_parallel_size": 4, "data_parallel_size_local": 4}, "needs 16 devices"),
])
def test_bad_parallel_configurations_fail_at_start_up(hf_checkpoint, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(hf_checkpoint("llama")), **(SMALL_ENGINE | kwargs))




def test_a_draft_model_whose_heads_tp_does_not_divide_is_rejected_naming_the_field(
        hf_checkpoint):
    draft = hf_checkpoint("llama", num_layers=1, hidden_size=48, num_heads=3, num_kv_heads=1)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"speculative_config\.model: tensor_parallel_size 2 "
                                         r"must divide the number of attention heads \(3\)"):
        LLM(str(hf_checkpoint("llama")), tensor_parallel_size=2, speculative_config=spec,
            **SMALL_ENGINE)


def test_tp_neither_dividing_nor_a_multiple_of_the_kv_heads_is_rejected():
    from jaxserve.models.llama_config import LlamaConfig
    from jaxserve.placement.sharding import validate_tensor_parallel

    cfg = LlamaConfig(vocab_size=64, hidden_size=96, intermediate_size=64, num_layers=1,
                      num_heads=12, num_kv_heads=4, head_dim=8)
    with pytest.raises(ValueError, match="KV heads"):
        validate_tensor_parallel(cfg, 6)
    validate_tensor_parallel(cfg, 2)
    validate_tensor_parallel(cfg, 12)


def test_orbax_checkpoint_restores_each_shard_onto_its_device(compile_cache_dir, tmp_path, gqa8,
                                                             monkeypatch):
    from jaxserve.models.checkpoint_io import save_converted
    from jaxserve.models.loader import load_model
    from jaxserve.placement import sharding
    from jaxserve.runtime import worker

    path, prompts, expected = gqa8
    dst = save_converted(load_model(str(path)), tmp_path / "converted")

    def no_host_copy(*args: object) -> None:
        raise AssertionError("weights went through a full host array")

    monkeypatch.setattr(sharding, "place", no_host_copy)
    monkeypatch.setattr(worker, "start_loading", no_host_copy)
    llm = LLM(str(dst), tensor_parallel_size=2, compilation_cache_dir=compile_cache_dir,
              **SMALL_ENGINE)
    wq = llm.engine.core.executor.worker.model.layers[0]["wq"][...]
    assert wq.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert wq.addressable_shards[0].data.shape[-1] * 2 == wq.shape[-1]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
