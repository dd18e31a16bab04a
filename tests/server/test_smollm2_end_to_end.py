"""A real trained model as a user runs it: SmolLM2-135M-Instruct from its Q4_1 GGUF, with the
GGUF's own tokenizer and chat template, offline, through `jaxserve generate` and through the
OpenAI server with the official client. The reference is HF transformers reading the same file
(`gguf_file=`, dequantised to float32): the same prompt ids and the same greedy tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from jaxserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

# XLA's attention and dots: the native cpu backend's kernels (checked against HF on the small
# models) run several times slower than XLA's on CPUs without AVX-512, such as CI's may be.
ENGINE = dict(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=128,
              token_buckets=[16, 128], request_buckets=[16], num_kv_blocks=320,
              attention_backend="xla")
RAW = ["The capital of France is", "Once upon a time, there was a", "def fibonacci(n):",
       "The three primary colors are", "Water boils at", "My favourite food is",
       "In 1969, the first person to walk on the Moon was", "import numpy as np\n"]
QUESTIONS = ["What is the capital of France?", "What is 2 + 2?", "Name three fruits.",
             "Who wrote Romeo and Juliet?", "What colour is the sky on a clear day?",
             "Translate 'good morning' into French.", "What is the largest planet?",
             "Give me a word that rhymes with cat."]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def engine_args(smollm2_gguf: Path, compile_cache_dir: str) -> dict[str, Any]:
    return dict(model=str(smollm2_gguf), compilation_cache_dir=compile_cache_dir, **ENGINE)


@pytest.fixture(scope="module")
def llm(engine_args: dict[str, Any]) -> LLM:
    return LLM(**engine_args)


@pytest.fixture(scope="module")
def hf(smollm2_gguf: Path) -> tuple[Any, Any]:
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    kwargs = dict(gguf_file=smollm2_gguf.name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), **kwargs)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), dtype=torch.float32, **kwargs)
    return tokenizer, model.eval()


def hf_greedy(model: Any, prompt: list[int], eos: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def offline(llm: LLM) -> list[Any]:
    """Greedy outputs of the raw prompts, then of the questions through the chat template."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    return (llm.generate(RAW, params, use_tqdm=False)
            + llm.chat(chats, params, use_tqdm=False))


def test_greedy_tokens_equal_hf_for_raw_and_chat_prompts(llm: LLM, offline: list[Any],
                                                         hf: tuple[Any, Any]) -> None:
    hf_tokenizer, model = hf
    tok = llm.get_tokenizer()
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    prompts = [o.prompt_token_ids for o in offline]
    assert prompts == [hf_tokenizer.encode(p) for p in RAW] + [
        list(hf_tokenizer.apply_chat_template(c, add_generation_prompt=True,
                                              tokenize=True)["input_ids"]) for c in chats]
    got = [list(o.outputs[0].token_ids) for o in offline]
    assert got == [hf_greedy(model, p, tok.eos_token_id) for p in prompts]
    answers = offline[len(RAW):]
    assert all(o.outputs[0].finish_reason == "stop" for o in answers[:2])  # short answers end
    assert "Paris" in answers[0].outputs[0].text and "<|im_end|>" not in answers[0].outputs[0].text


def test_generate_cli_answers_through_the_chat_template(engine_args: dict[str, Any],
                                                        capsys: pytest.CaptureFixture) -> None:
    from jaxserve.entrypoints.cli.main import main

    flags = [f"--{k.replace('_', '-')}={','.join(map(str, v)) if isinstance(v, list) else v}"
             for k, v in engine_args.items() if k != "model"]
    assert main(["generate", "--chat", "--model", engine_args["model"], *flags,
                 QUESTIONS[0]]) == 0
    answer = capsys.readouterr().out.split("\n" + "-" * 40)[0]
    assert answer.startswith(QUESTIONS[0] + "\n") and "Paris" in answer
    assert "<|im_end|>" not in answer and "<|im_start|>" not in answer


def test_openai_client_chat_and_completions_equal_offline(engine_args: dict[str, Any],
                                                          offline: list[Any]) -> None:
    from jaxserve import AsyncLLM
    from jaxserve.entrypoints.openai.api_server import BackgroundServer, build_app

    async_llm = AsyncLLM(**engine_args)
    server = BackgroundServer(build_app(async_llm, ["smollm2"])).start()
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        messages = [{"role": "user", "content": QUESTIONS[0]}]
        chat = client.chat.completions.create(model="smollm2", messages=messages,
                                              temperature=0.0, max_tokens=MAX_TOKENS)
        want = offline[len(RAW)].outputs[0]
        assert chat.choices[0].message.content == want.text
        assert chat.choices[0].finish_reason == "stop" and "Paris" in want.text
        completion = client.completions.create(model="smollm2", prompt=RAW[0], temperature=0.0,
                                               max_tokens=MAX_TOKENS)
        assert completion.choices[0].text == offline[0].outputs[0].text
    finally:
        server.stop()
        async_llm.shutdown()
