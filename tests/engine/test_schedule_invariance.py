"""Same greedy tokens whatever the schedule: caching, chunking, threshold, batch size,
preemption."""

from __future__ import annotations

import pytest

from engine_helpers import FEW_BUCKETS, SMALL_ENGINE, assert_no_leaks, hf_greedy, random_prompts
from full_run import params_with_full_run
from jaxserve import LLM, SamplingParams

MAX_TOKENS = 24


def mixed_workload() -> list[list[int]]:
    """Prompts of many lengths; some share a long prefix (cache hits), two are identical."""
    prompts = random_prompts(10, 1, 70, seed=11)
    shared = random_prompts(1, 40, 40, seed=12)[0]
    prompts += [shared + tail for tail in random_prompts(4, 1, 20, seed=13)]
    prompts += [prompts[3], prompts[3]]
    return prompts


@pytest.fixture(scope="module")
def expected(hf_checkpoint):
    path = hf_checkpoint("llama")
    return path, hf_greedy(path, mixed_workload(), MAX_TOKENS)


SETTINGS = {
    "default": {},
    "sync_steps_no_async_scheduling": {"async_scheduling": False},
    "no_prefix_caching": {"enable_prefix_caching": False},
    "threshold_small": {"long_prefill_token_threshold": 8},
    "threshold_large": {"long_prefill_token_threshold": 64},
    "one_partial_prefill": {"long_prefill_token_threshold": 8, "max_num_partial_prefills": 1},
    "budget_chunks_every_prompt": {"max_num_batched_tokens": 16},
    "one_seq_at_a_time": {"max_num_seqs": 1},
    "max_num_seqs_64": {"max_num_seqs": 64, "request_buckets": [4, 16, 64]},
    "no_chunked_prefill": {"enable_chunked_prefill": False, "max_num_batched_tokens": 96},
    "v0_style_no_mixed_batching": {"enable_mixed_batching": False},
    "tiny_pool_preempts": {"num_kv_blocks": 14},
    "priority_policy_tiny_pool": {"num_kv_blocks": 14, "scheduling_policy": "priority"},
    # The TPU kernels (attention and the in-place KV write) in interpret mode.
    "pallas_default": {"attention_backend": "pallas_interpret"},
    "pallas_threshold_small": {"attention_backend": "pallas_interpret",
                               "long_prefill_token_threshold": 8},
    "pallas_tiny_pool_preempts": {"attention_backend": "pallas_interpret", "num_kv_blocks": 14},
    # The layer loop as lax.scan (the TPU/GPU default), with both backends.
    "scan_layers": {"scan_layers": True},
    "pallas_scan_layers_tiny_pool": {"attention_backend": "pallas_interpret", "scan_layers": True,
                                     "num_kv_blocks": 14, **FEW_BUCKETS},
}


# The interpreted TPU kernels cost ~1 min a setting: pallas_scan_layers_tiny_pool (kernels,
# scan and preemption at once) runs by default, the other three with `pytest -m full`.
FULL_RUN_SETTINGS = ("pallas_default", "pallas_threshold_small", "pallas_tiny_pool_preempts")


@pytest.mark.parametrize("name", params_with_full_run(SETTINGS, FULL_RUN_SETTINGS))
def test_greedy_tokens_do_not_depend_on_the_schedule(expected, compile_cache_dir, name):
    path, reference = expected
    llm = LLM(str(path), compilation_cache_dir=compile_cache_dir,
              **(SMALL_ENGINE | SETTINGS[name]))
    outs = llm.generate([{"prompt_token_ids": p} for p in mixed_workload()],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    stats = llm.stats()
    if name.endswith(("preempts", "tiny_pool")):
        assert stats.num_preemptions > 0
    if name in ("default", "pallas_default"):
        assert stats.prefix_cache_hits > 0  # the shared prefix was really reused
    if name == "no_prefix_caching":
        assert stats.prefix_cache_hits == 0
    assert_no_leaks(llm.engine)
