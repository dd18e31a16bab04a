"""After warm-up, a long run of random requests compiles nothing (counted by JAX itself)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from engine_helpers import backend_compiles
from jaxserve import LLM, SamplingParams
from jaxserve.runtime.model_runner import UnexpectedCompilationError
from jaxserve.sampling_params import StructuredOutputsParams


@pytest.fixture(name="backend_compiles")
def backend_compiles_fixture():
    """Counts every XLA backend compilation in the process while the test runs."""
    with backend_compiles() as events:
        yield events


def test_200_random_requests_trigger_no_compilation_after_warm_up(hf_checkpoint,
                                                                  backend_compiles):
    llm = LLM(str(hf_checkpoint("llama")), max_model_len=128, num_kv_blocks=96,
              max_num_seqs=16, max_num_batched_tokens=64, token_buckets=[16, 64],
              request_buckets=[4, 16], long_prefill_token_threshold=32, precompile=True,
              strict_compile=True, compilation_cache_dir="")
    warm = llm.stats().num_compilations
    # The model for every (tokens, requests) pair; the sampler for 2 request buckets, greedy
    # and sampled, without and with logprobs, without and with a grammar bitmask.
    assert warm == 4 + 2 * 2 * 2 * 2
    compiles_at_warm_up = len(backend_compiles)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(2, 320, int(rng.integers(1, 100))).tolist()}
               for _ in range(200)]
    # Every fifth request constrained (a regex or a choice), mixed with free ones in a step.
    constraints = [StructuredOutputsParams(regex=r"[a-z]{1,6}( [0-9]{1,4})*"),
                   StructuredOutputsParams(choice=["yes", "no", "maybe not"])]
    params = [SamplingParams(temperature=float(rng.choice([0.0, 0.8])), top_p=0.9,
                             max_tokens=int(rng.integers(1, 24)), ignore_eos=i % 5 != 0, seed=i,
                             structured_outputs=constraints[i % 2] if i % 5 == 0 else None)
              for i in range(200)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outs) == 200 and all(o.finished for o in outs)
    done = [o.outputs[0].text for o in outs[::5] if o.outputs[0].finish_reason == "stop"]
    assert done and all(re.fullmatch(r"[a-z]{1,6}( [0-9]{1,4})*|yes|no|maybe not", t)
                        for t in done)
    assert llm.stats().num_compilations == warm
    assert len(backend_compiles) == compiles_at_warm_up


def test_strict_mode_compiles_the_samplers_history_widths_and_raises_on_any_other(
        hf_checkpoint):
    """Penalties, min_tokens and bad_words come in widths warm-up cannot enumerate: the sampler
    alone compiles for them on first use (the request is served, not the engine stopped)."""
    llm = LLM(str(hf_checkpoint("llama")), max_model_len=128, num_kv_blocks=64, max_num_seqs=4,
              max_num_batched_tokens=32, token_buckets=[32], request_buckets=[4],
              precompile=True, strict_compile=True, compilation_cache_dir="")
    runner = llm.engine.core.executor.worker.runner
    warm = set(runner.compiled_shapes)
    out = llm.generate({"prompt_token_ids": [3, 4, 5]},  # logprobs are warmed up
                       SamplingParams(max_tokens=2, logprobs=2), use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs) == 2 and runner.compiled_shapes == warm
    for params in (SamplingParams(max_tokens=2, repetition_penalty=1.2),
                   SamplingParams(max_tokens=4, min_tokens=2),
                   SamplingParams(max_tokens=4, bad_words=["robot"])):
        out = llm.generate({"prompt_token_ids": [3, 4, 5]}, params, use_tqdm=False)[0]
        assert out.outputs[0].finish_reason == "length", params
    assert {key[0] for key in runner.compiled_shapes - warm} == {"sample"}
    with pytest.raises(UnexpectedCompilationError, match="not compiled at warm-up"):
        runner._count_shape(("step", 999))  # a model shape the buckets do not hold


def test_penalty_histories_compile_the_sampler_and_never_the_model(hf_checkpoint):
    llm = LLM(str(hf_checkpoint("llama")), max_model_len=128, num_kv_blocks=64, max_num_seqs=4,
              max_num_batched_tokens=32, token_buckets=[32], request_buckets=[4],
              precompile=True, compilation_cache_dir="")
    runner = llm.engine.core.executor.worker.runner
    warm = set(runner.compiled_shapes)
    params = SamplingParams(max_tokens=40, repetition_penalty=1.3, frequency_penalty=0.2,
                            ignore_eos=True)
    out = llm.generate({"prompt_token_ids": [3, 4, 5]}, params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 40
    new = runner.compiled_shapes - warm
    # ("sample", R, output width, prompt width, blocked width, bitmask width, greedy, logprobs)
    assert {key[0] for key in new} == {"sample"}
    assert {key[2] for key in new} == {0, 16, 32, 64}  # the output history grew past 16, 32
