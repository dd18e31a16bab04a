"""`LLM.generate` against HF transformers' `generate`, token for token (fp32, greedy)."""

from __future__ import annotations

import shutil

import pytest

from engine_helpers import SMALL_ENGINE, hf_greedy, random_prompts
from jaxserve import LLM, SamplingParams

GOLDEN = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401,
          396, 267, 337, 410, 408, 419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358,
          394, 261, 370, 432, 352, 266, 268, 388, 426, 338, 391, 266, 267, 337, 335, 312, 432, 398,
          312, 286, 267, 414, 270, 333, 415, 426, 13, 438, 310]
GOLDEN_TEXT = ("Once upon a time, there was a little girl named Lily. She loved to play outside "
               "in the park. One day, she saw a big, red ball. She wanted to play with it, but it "
               "was too high.\nLily")


# qwen2's biases and tied head are checked against HF logits in tests/models; its generate run
# is in `pytest -m full`.
@pytest.mark.parametrize("kind", ["llama", pytest.param("qwen2", marks=pytest.mark.full), "qwen3"])
def test_greedy_matches_hf_generate_for_16_prompts(hf_checkpoint, compile_cache_dir, kind):
    path = hf_checkpoint(kind)
    prompts = random_prompts(16, 1, 60, seed=7)
    expected = hf_greedy(path, prompts, 32)
    llm = LLM(str(path), compilation_cache_dir=compile_cache_dir, **SMALL_ENGINE)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


@pytest.mark.parametrize("filename", ["stories260K.bin", "stories260K.gguf", "alone/model.bin"])
def test_stories260k_reproduces_its_golden(stories_dir, compile_cache_dir, tmp_path, filename):
    """"alone": the llama2.c checkpoint in a folder of its own, its tokenizer file named."""
    model, tokenizer = stories_dir / filename, None
    if filename.startswith("alone"):
        model, tokenizer = tmp_path / filename, str(stories_dir / "tok512.bin")
        model.parent.mkdir()
        shutil.copy(stories_dir / "stories260K.bin", model)
    llm = LLM(str(model), tokenizer=tokenizer, compilation_cache_dir=compile_cache_dir,
              **SMALL_ENGINE)
    out = llm.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=60))[0]
    assert out.prompt_token_ids + out.outputs[0].token_ids == GOLDEN
    assert "Once upon a time" + out.outputs[0].text == GOLDEN_TEXT
