"""Session fixtures of the disaggregation tests: the model and the unified engine's tokens."""

from __future__ import annotations

import pytest

from disagg_helpers import ENGINE, GREEDY, MAX_TOKENS, prefix_prompt, tokens, workload
from engine_helpers import hf_greedy
from jaxserve import LLM


@pytest.fixture(scope="session")
def gqa8(hf_checkpoint) -> str:
    return str(hf_checkpoint("llama", num_heads=8, num_kv_heads=2))


@pytest.fixture(scope="session")
def reference(gqa8: str, compile_cache_dir: str) -> list[list[list[int]]]:
    """The unified engine's (one device) tokens for the workload, per request and sample;
    its greedy ones checked against HF."""
    prompts, params = workload()
    llm = LLM(gqa8, compilation_cache_dir=compile_cache_dir, **ENGINE)
    llm.generate({"prompt_token_ids": prefix_prompt()}, GREEDY, use_tqdm=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    unified = [tokens(o) for o in outs]
    greedy = [i for i, p in enumerate(params) if p.temperature == 0.0 and p.max_tokens > 1]
    hf = hf_greedy(gqa8, [prompts[i] for i in greedy], MAX_TOKENS)
    assert [unified[i][0] for i in greedy] == hf
    assert len(unified[-2]) == 2 and unified[-2][0] != unified[-2][1]  # n = 2, distinct seeds
    return unified


