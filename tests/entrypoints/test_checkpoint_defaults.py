"""vLLM's checkpoint-facing engine arguments: generation_config ("auto": the checkpoint's
sampling defaults), hf_overrides, dtype float16/half, seed=None."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from engine_helpers import hf_log_softmax
from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest
from jaxserve.entrypoints.openai.serving_common import OpenAIServing
from jaxserve.models.loader import load_model

GENERATION = {"temperature": 0.0, "top_k": 7, "repetition_penalty": 1.2, "max_new_tokens": 5,
              "do_sample": True, "eos_token_id": 1}
DEFAULTS = {"temperature": 0.0, "top_k": 7, "repetition_penalty": 1.2, "max_tokens": 5}


@pytest.fixture(scope="module")
def with_generation_config(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gen") / "model"
    shutil.copytree(tiny_model, folder)
    (folder / "generation_config.json").write_text(json.dumps(GENERATION))
    return folder


def test_generation_config_auto_gives_requests_without_params_the_checkpoints_defaults(
        engine_args: dict[str, Any], with_generation_config: Path) -> None:
    llm = LLM(**engine_args | {"model": str(with_generation_config)})
    assert llm.get_default_sampling_params() == SamplingParams(**DEFAULTS)
    out = llm.generate("Once upon a time")[0].outputs[0]
    assert len(out.token_ids) == 5  # max_new_tokens
    want = llm.generate("Once upon a time", SamplingParams(**DEFAULTS))[0].outputs[0]
    assert out.token_ids == want.token_ids
    vllm = LLM(**engine_args | {"model": str(with_generation_config),
                                "generation_config": "vllm"})
    assert vllm.get_default_sampling_params() == SamplingParams()


def test_generation_config_values_are_checked_and_the_field_named(
        engine_args: dict[str, Any], with_generation_config: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="generation_config must be 'auto' or 'vllm'"):
        EngineConfig.from_kwargs(generation_config=str(with_generation_config))
    bad = tmp_path / "bad"
    shutil.copytree(with_generation_config, bad)
    (bad / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match="generation_config .*temperature must be a finite "
                                         "number >= 0.*'vllm' ignores them"):
        LLM(**engine_args | {"model": str(bad)})


def test_server_requests_take_the_defaults_only_for_fields_they_leave_unset() -> None:
    engine = SimpleNamespace(sampling_defaults=DEFAULTS)
    serving = OpenAIServing(SimpleNamespace(engine=engine, tokenizer=None, max_model_len=128),
                            ["m"], metrics=None)
    messages = [{"role": "user", "content": "hi"}]
    params = serving.sampling_params(ChatCompletionRequest(messages=messages), None, None)
    assert (params.temperature, params.top_k, params.repetition_penalty, params.max_tokens,
            params.top_p) == (0.0, 7, 1.2, 5, 1.0)
    req = ChatCompletionRequest(messages=messages, temperature=0.5, top_k=3)
    params = serving.sampling_params(req, 9, None)
    assert (params.temperature, params.top_k, params.repetition_penalty, params.max_tokens) == (
        0.5, 3, 1.2, 9)


def test_gguf_sampling_metadata_is_the_generation_config(
        hf_checkpoint: Any, tmp_path: Path) -> None:
    import gguf

    src = load_model(hf_checkpoint("llama"))
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    for key, value in [("block_count", 2), ("context_length", 256), ("embedding_length", 64),
                       ("feed_forward_length", 128), ("attention.head_count", 4),
                       ("attention.head_count_kv", 2)]:
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("general.sampling.temp", 0.25)
    writer.add_int32("general.sampling.top_k", 20)
    writer.add_float32("general.sampling.top_p", 0.5)
    names = {"embed": "token_embd.weight", "final_norm": "output_norm.weight",
             "lm_head": "output.weight"}
    layer = {"attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v",
             "wo": "attn_output", "mlp_norm": "ffn_norm", "w_gate": "ffn_gate", "w_up": "ffn_up",
             "w_down": "ffn_down"}
    for name, value in src.params.items():
        if name in names:
            writer.add_tensor(names[name], value)
            continue
        for i in range(2):
            w = value[i] if value.ndim == 2 else np.ascontiguousarray(value[i].T)
            writer.add_tensor(f"blk.{i}.{layer[name]}.weight", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert load_model(tmp_path / "m.gguf").generation_config == {
        "temperature": 0.25, "top_k": 20, "top_p": 0.5}


def test_hf_overrides_replace_config_entries_and_are_checked(
        engine_args: dict[str, Any], tiny_model: Path) -> None:
    loaded = load_model(tiny_model, "dummy", hf_overrides={"rope_theta": 5e5,
                                                           "eos_token_id": [1, 7]})
    assert (loaded.config.rope_theta, loaded.config.eos_token_ids) == (5e5, (1, 7))
    with pytest.raises(ValueError, match=r"max_model_len \(128\) is more than the model's "
                                         r"context \(max_position_embeddings = 64\)"):
        LLM(**engine_args | {"hf_overrides": '{"max_position_embeddings": 64}'})
    with pytest.raises(ValueError, match="hf_overrides: 'rope_thetaa' is not a config entry"):
        load_model(tiny_model, "dummy", hf_overrides={"rope_thetaa": 1.0})
    with pytest.raises(ValueError, match="hf_overrides: missing weights"):
        load_model(tiny_model, "dummy", hf_overrides={"tie_word_embeddings": False,
                                                      "num_hidden_layers": 2,
                                                      "attention_bias": True})
    with pytest.raises(ValueError, match="hf_overrides is not valid JSON"):
        EngineConfig.from_kwargs(hf_overrides="{nope")


def test_seed_none_draws_a_seed_once_and_multi_host_refuses_it() -> None:
    seeds = {EngineConfig.from_kwargs(seed=None).model.seed for _ in range(4)}
    assert all(isinstance(s, int) for s in seeds) and len(seeds) > 1
    with pytest.raises(ValueError, match="seed=None.*give seed"):
        EngineConfig.from_kwargs(seed=None, num_processes=2, process_id=0,
                                 coordinator_address="127.0.0.1:1")


def test_float16_computes_near_hf_float32_and_is_refused_where_unsupported(
        hf_checkpoint: Any, compile_cache_dir: str) -> None:
    path = hf_checkpoint("llama")
    args = dict(model=str(path), max_model_len=128, num_kv_blocks=64, max_num_seqs=4,
                max_num_batched_tokens=64, token_buckets=[16, 64], request_buckets=[4],
                compilation_cache_dir=compile_cache_dir)
    with pytest.raises(ValueError, match="dtype 'float16': the cpu attention backend.*"
                                         "attention_backend='xla'"):
        LLM(**args | {"dtype": "float16"})  # auto: the cpu backend on this machine
    llm = LLM(**args | {"dtype": "half", "attention_backend": "xla"})
    assert llm.engine.core.executor.worker.runner.k_cache.dtype == np.float16
    prompt = [5, 17, 33, 90, 140, 7]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, logprobs=0))[0].outputs[0]
    hf = hf_log_softmax(path, prompt + out.token_ids)  # float32 reference
    for i, (token, logprobs) in enumerate(zip(out.token_ids, out.logprobs)):
        row = hf[len(prompt) - 1 + i]
        assert abs(logprobs[token].logprob - row[token]) < 0.05
        top2 = np.sort(row)[-2:]
        if top2[1] - top2[0] > 0.05:  # not a near-tie that float16 may break the other way
            assert token == int(np.argmax(row))
