"""`LLM.beam_search` is token-exact against HF transformers' beam search (`num_beams`) on the
same checkpoint, and scores beams as vLLM does."""

from __future__ import annotations

import pytest

from engine_helpers import SMALL_ENGINE, random_prompts
from jaxserve import LLM
from jaxserve.entrypoints.beam_search import BeamSearchSequence, beam_score
from jaxserve.sampling_params import BeamSearchParams


@pytest.fixture(scope="module")
def llm(llama, compile_cache_dir) -> LLM:
    return LLM(str(llama), compilation_cache_dir=compile_cache_dir, **SMALL_ENGINE)


def hf_beam_search(path, prompt: list[int], beams: int, new_tokens: int):
    import torch
    from hf_checkpoints import hf_model

    with torch.no_grad():
        out = hf_model(path).generate(
            torch.tensor([prompt]), num_beams=beams, num_return_sequences=beams,
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
            early_stopping=False, length_penalty=1.0, eos_token_id=None, pad_token_id=0,
            output_scores=True, return_dict_in_generate=True)
    return out.sequences.tolist(), out.sequences_scores.tolist()


@pytest.mark.parametrize("beams", [2, 4])
def test_beam_search_equals_hf_num_beams(llm, llama, beams):
    prompts = random_prompts(2, 6, 20, seed=11)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                           BeamSearchParams(beam_width=beams, max_tokens=6, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        sequences, scores = hf_beam_search(llama, prompt, beams, 6)
        assert [s.tokens for s in out.sequences] == sequences
        # HF scores by generated length; every beam here has 6 new tokens.
        assert [s.cum_logprob / 6 for s in out.sequences] == pytest.approx(scores, abs=1e-4)
        assert all(s.finish_reason == "length" for s in out.sequences)


def test_beam_scores_follow_vllm_length_penalty_and_eos():
    beam = BeamSearchSequence([5, 6, 7, 1], [], -2.0)
    assert beam_score(beam, frozenset({1}), 1.0) == pytest.approx(-2.0 / 3)  # EOS not counted
    assert beam_score(beam, frozenset(), 2.0) == pytest.approx(-2.0 / 16)


def test_a_beam_that_ends_in_eos_is_complete_and_competes_by_its_score():
    from types import SimpleNamespace

    from jaxserve.entrypoints.beam_search import beam_search
    from jaxserve.outputs import Logprob

    script = {(9,): {5: -0.1, 1: -0.5, 6: -3.0}, (9, 5): {6: -2.0, 1: -3.0, 5: -4.0},
              (9, 6): {5: -1.0}}

    def generate(batch, step):
        assert step.max_tokens == 1 and step.logprobs == 2 * 2
        return [SimpleNamespace(outputs=[SimpleNamespace(logprobs=[{
            t: Logprob(lp) for t, lp in script[tuple(p["prompt_token_ids"])].items()}])])
            for p in batch]

    out = beam_search(generate, [[9]], BeamSearchParams(beam_width=2, max_tokens=2),
                      frozenset({1}), None)[0]
    # [9, 1]: -0.5 over 1 (the EOS is not counted); [9, 5, 6]: -2.1 / 3; [9, 6, 5]: -4 / 3;
    # [9, 5, 1]: -3.1 / 2.
    assert [(s.tokens, s.finish_reason) for s in out.sequences] == [
        ([9, 1], "stop"), ([9, 5, 6], "length")]
    assert out.sequences[0].stop_reason == 1
