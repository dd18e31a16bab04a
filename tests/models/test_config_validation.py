"""Nonsense in a model's config.json is a ValueError naming the field, before any allocation."""

from __future__ import annotations

import json
import shutil

import pytest

from jaxserve import LLM
from jaxserve.models.llama_config import LlamaConfig

BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 320, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 128, "bos_token_id": 0, "eos_token_id": 1}


def test_the_base_config_is_valid():
    cfg = LlamaConfig.from_hf_dict(BASE)
    assert (cfg.num_layers, cfg.head_dim, cfg.rms_norm_eps) == (2, 16, 1e-6)


@pytest.mark.parametrize("change, field", [
    ({"num_attention_heads": 0}, "num_attention_heads"),  # was ZeroDivisionError
    ({"num_hidden_layers": 10**9}, "num_layers"),  # was an attempt to allocate 477 GiB
    ({"rms_norm_eps": "1e-6"}, "rms_norm_eps"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
    ({"rope_theta": -10000.0}, "rope_theta"),
    ({"rope_theta": "10000"}, "rope_theta"),
    ({"hidden_size": "64"}, "hidden_size"),
    ({"vocab_size": 64.0}, "vocab_size"),
    ({"intermediate_size": True}, "intermediate_size"),
    ({"head_dim": 15}, "head_dim"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
    ({"eos_token_id": 320}, "eos"),
    ({"max_position_embeddings": 2**31}, "max_position_embeddings"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": -8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
     "factor"),
])
def test_nonsense_fields_name_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        LlamaConfig.from_hf_dict(BASE | change)


def test_a_non_numeric_eps_in_a_checkpoint_is_rejected_at_load(hf_checkpoint, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoint("llama"), ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(config | {"rms_norm_eps": "tiny"}))
    with pytest.raises(ValueError, match="rms_norm_eps"):
        LLM(str(ckpt))


def test_max_logprobs_beyond_the_vocabulary_is_rejected(hf_checkpoint):
    with pytest.raises(ValueError, match="max_logprobs"):
        LLM(str(hf_checkpoint("llama")), max_logprobs=321, max_model_len=64, num_kv_blocks=16)
    with pytest.raises(ValueError, match="max_logprobs"):
        LLM(str(hf_checkpoint("llama")), max_logprobs=-2)  # -1: no cap
