"""Gemma 2 and Gemma 3 (text) against HF transformers on tiny random checkpoints (fp32) built
with `save_pretrained`: windows of 24 tokens that the prompts slide past, local and global
layers, soft-capping that changes the scores (tests/hf_checkpoints.py: GEMMA_KINDS)."""

from __future__ import annotations

import numpy as np
import pytest

from engine_helpers import (CHUNKED_ASYNC, FEW_BUCKETS, SMALL_ENGINE, assert_no_leaks,
                            greedy_with_a_cached_prefix, hf_greedy, random_prompts)
from hf_checkpoints import copy_with_config
from jaxserve import LLM, SamplingParams
from jaxserve.models.gemma import FULL, SLIDING, GemmaConfig
from jaxserve.models.llama import repeat_period
from jaxserve.models.llama_config import LayerKind
from jaxserve.models.loader import load_model
from model_forward import forward_logits, hf_logits

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# gemma3: five layers, two local to one global: the scan runs one period and two layers past it
SHAPES = {"gemma2": {}, "gemma3": {"num_layers": 5}}


def checkpoint(hf_checkpoint, kind: str, **kwargs: object):
    return hf_checkpoint(kind, **(SHAPES[kind] | kwargs))


@pytest.mark.parametrize("kind,tie,model_args", [
    ("gemma2", True, {}), ("gemma2", False, {"scan_layers": True}),
    ("gemma3", True, {"scan_layers": True, "rotary_lookup": True}), ("gemma3", False, {})])
def test_logits_match_hf_forward_over_calls_sharing_the_cache(hf_checkpoint, kind, tie,
                                                              model_args):
    path = checkpoint(hf_checkpoint, kind, tie=tie)
    ids = np.random.default_rng(1).integers(2, 320, size=70).tolist()
    ours = forward_logits(path, ids, splits=[20, 45], **model_args)
    np.testing.assert_allclose(ours, hf_logits(path, ids), atol=1e-4, rtol=0)


def test_gemma2s_soft_caps_and_window_change_the_logits(hf_checkpoint):
    """Each part the test checkpoint exercises moves the logits well past the tolerance."""
    path = checkpoint(hf_checkpoint, "gemma2")
    config = load_model(str(path)).config
    ids = np.random.default_rng(1).integers(2, 320, size=70).tolist()
    ref = hf_logits(path, ids)
    for change in ({"attn_logit_softcapping": None}, {"final_logit_softcapping": None},
                   {"sliding_window": 64}):
        other = forward_logits(path, ids, splits=[], config=config.replace(**change))
        assert np.abs(other - ref).max() > 0.05, change


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_greedy_tokens_equal_hf_generate(hf_checkpoint, compile_cache_dir, kind):
    """Chunked prefill (prompts over one step's 32 tokens), a shared prefix (prefix caching) and
    async scheduling on the default CPU backend; prompts and outputs slide past the window."""
    path = checkpoint(hf_checkpoint, kind)
    llm = LLM(str(path), compilation_cache_dir=compile_cache_dir,
              **(SMALL_ENGINE | CHUNKED_ASYNC))
    prompts, got = greedy_with_a_cached_prefix(llm, GREEDY, seed=21)
    assert got == hf_greedy(path, prompts, GREEDY.max_tokens)


@pytest.mark.parametrize("kind,engine", [
    pytest.param("gemma3", {"num_kv_blocks": 14}, id="gemma3-preempted"),
    pytest.param("gemma2", {"tensor_parallel_size": 2}, id="gemma2-tp2"),
    # scanned layers' periods and the xla backend's windows are covered by the logits tests;
    # the engines run with `pytest -m full`
    pytest.param("gemma3", {"tensor_parallel_size": 2, "scan_layers": True},
                 id="gemma3-tp2-scanned", marks=pytest.mark.full),
    # the TPU kernel's soft cap is checked against the oracle in tests/kernels; Phi-3's
    # pallas_interpret engine runs windows through it by default
    pytest.param("gemma2", {"attention_backend": "pallas_interpret"} | FEW_BUCKETS,
                 id="gemma2-pallas_interpret", marks=pytest.mark.full),
    pytest.param("gemma3", {"attention_backend": "xla"}, id="gemma3-xla",
                 marks=pytest.mark.full),
])
def test_greedy_tokens_equal_hf_on_other_backends_and_meshes(hf_checkpoint, compile_cache_dir,
                                                             kind, engine):
    path = checkpoint(hf_checkpoint, kind)
    prompts = random_prompts(6, 30, 60, seed=23)
    llm = LLM(str(path), compilation_cache_dir=compile_cache_dir, **(SMALL_ENGINE | engine))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    if "num_kv_blocks" in engine:
        assert llm.engine.core.scheduler.num_preemptions > 0
    assert_no_leaks(llm.engine)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, GREEDY.max_tokens)


def test_gemma3_layers_are_five_local_to_one_global_with_their_own_rope():
    """Gemma-3-27B's config.json in the hub's older format (no layer_types, rope_local_base_freq,
    linear scaling of the global layers)."""
    cfg = GemmaConfig.from_hf_dict({
        "architectures": ["Gemma3ForCausalLM"], "vocab_size": 262208, "hidden_size": 5376,
        "intermediate_size": 21504, "num_hidden_layers": 62, "num_attention_heads": 32,
        "num_key_value_heads": 16, "head_dim": 128, "query_pre_attn_scalar": 168,
        "sliding_window": 1024, "sliding_window_pattern": 6, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "max_position_embeddings": 131072, "bos_token_id": 2, "eos_token_id": [1, 106]})
    assert cfg.layer_types[:6] == (SLIDING,) * 5 + (FULL,) and cfg.layer_types[-2:] == (
        SLIDING, SLIDING)
    assert cfg.layer_kinds[5] == LayerKind(None, 1) and cfg.layer_kinds[0] == LayerKind(1024, 0)
    assert repeat_period(cfg.layer_kinds) == 6
    assert (cfg.local_rope_theta, cfg.rope_theta, dict(cfg.rope_scaling)["factor"]) == (
        1e4, 1e6, 8.0)
    assert cfg.qk_norm and cfg.tie_word_embeddings and cfg.query_pre_attn_scalar == 168
    assert GemmaConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_repeat_period_is_the_shortest_pattern_of_kinds():
    a, b = LayerKind(8, 0), LayerKind(None, 1)
    assert repeat_period((a,) * 4) == 1
    assert repeat_period((a, b, a, b, a)) == 2
    assert repeat_period((a, a, b, a, a)) == 3
    assert repeat_period((a, b, b)) == 3


@pytest.mark.parametrize(("changes", "message"), [
    ({"architectures": ["Gemma3ForConditionalGeneration"]},
     r"Gemma3ForConditionalGeneration: images \(its vision tower\) are not supported yet"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]},
     r"layer_types must list 'sliding_attention' or 'full_attention' for each of the 2 layers"),
    ({"layer_types": ["sliding_attention"]}, r"layer_types must list"),
    ({"hidden_activation": "relu"}, r"hidden_activation must be 'gelu_pytorch_tanh', got 'relu'"),
    ({"use_bidirectional_attention": True}, r"use_bidirectional_attention is not supported"),
    ({"attn_logit_softcapping": -1.0}, r"attn_logit_softcapping must be a finite number > 0"),
    ({"query_pre_attn_scalar": "big"}, r"query_pre_attn_scalar must be a finite number > 0"),
    ({"sliding_window": None}, r"sliding_window must be set for sliding_attention layers"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}},
     r"rope_scaling type 'yarn' is not supported for Gemma"),
])
def test_a_bad_gemma_config_is_a_clear_error_at_load(hf_checkpoint, tmp_path, changes, message):
    path = copy_with_config(checkpoint(hf_checkpoint, "gemma2"), tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=message):
        load_model(str(path))
