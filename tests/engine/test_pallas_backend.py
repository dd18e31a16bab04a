"""The engine with the Pallas kernel (interpret mode on CPU) gives the same tokens as with xla."""

from __future__ import annotations

import pytest

from engine_helpers import SMALL_ENGINE, assert_no_leaks, hf_greedy, random_prompts
from jaxserve import LLM, SamplingParams
from jaxserve.layers.attention import get_attention_backend


@pytest.mark.full  # test_schedule_invariance's pallas_scan_layers_tiny_pool checks this against HF
def test_pallas_interpret_backend_gives_the_xla_greedy_tokens(hf_checkpoint, compile_cache_dir):
    path = hf_checkpoint("llama")
    prompts = random_prompts(6, 1, 40, seed=51) + [random_prompts(1, 20, 20, seed=52)[0] * 2]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = {}
    for backend in ("xla", "pallas_interpret"):
        llm = LLM(str(path), attention_backend=backend, compilation_cache_dir=compile_cache_dir,
                  **(SMALL_ENGINE | {"long_prefill_token_threshold": 24}))
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outs[backend] = [o.outputs[0].token_ids for o in got]
        assert_no_leaks(llm.engine)
    assert outs["pallas_interpret"] == outs["xla"] == hf_greedy(path, prompts, 10)


def test_backend_selection():
    assert get_attention_backend("auto", "cpu").name == "cpu"  # its native kernel builds here
    assert get_attention_backend("auto", "tpu").name == "pallas"
    with pytest.raises(ValueError, match="attention_backend"):
        get_attention_backend("pallas", "cpu")
    with pytest.raises(ValueError, match="attention_backend 'cpu'"):
        get_attention_backend("cpu", "tpu")
    assert get_attention_backend("pallas_interpret", "cpu") == get_attention_backend(
        "pallas_interpret", "cpu")  # one object: the jitted step cache is keyed on it


@pytest.mark.parametrize("name", ["cpu", "xla", "pallas_interpret"])
def test_a_step_without_drafts_runs_the_backend_of_an_engine_without_speculation(name):
    """A speculative engine's steps without drafts (programs/spec_step.py) take this backend:
    their decodes are one row each, as in the plain step of an engine without speculation."""
    with_drafts = get_attention_backend(name, "cpu", decode_rows=5)
    plain = get_attention_backend(name, "cpu")
    assert (with_drafts == plain) == (name != "xla")  # the others tile any rows
    assert with_drafts.without_drafts() == plain
