"""The architecture -> family table, and each family's weight names against checkpoints that
transformers itself wrote."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from hf_checkpoints import KINDS, MOE_KINDS
from jaxserve.models.gguf_file import GGUFFile
from jaxserve.models.hf_loader import load_hf
from jaxserve.models.registry import (GEMMA, HF_ARCHITECTURES, LLAMA, MIXTRAL, PHI3, QWEN3_MOE,
                                      config_from_hf, family_of, gguf_architecture)


def test_an_unknown_hf_architecture_names_the_field_and_the_supported_ones():
    with pytest.raises(ValueError, match=r"architectures: unsupported architecture "
                                         r"'GPT2LMHeadModel'.*'LlamaForCausalLM'.*"
                                         r"'Qwen3ForCausalLM'"):
        config_from_hf({"architectures": ["GPT2LMHeadModel"]})


def gguf_named(architecture: str) -> GGUFFile:
    return GGUFFile(Path("m.gguf"), {"general.architecture": architecture}, {})


def test_an_unknown_gguf_architecture_names_the_field_and_the_supported_ones():
    with pytest.raises(ValueError, match=r"m.gguf: general.architecture: unsupported "
                                         r"architecture 'falcon'.*'llama'.*'qwen3'"):
        gguf_architecture(gguf_named("falcon"))


def test_the_supported_architectures_and_their_families():
    assert HF_ARCHITECTURES == {"LlamaForCausalLM": LLAMA, "MistralForCausalLM": LLAMA,
                                "Qwen2ForCausalLM": LLAMA, "Qwen3ForCausalLM": LLAMA,
                                "Qwen3MoeForCausalLM": QWEN3_MOE, "MixtralForCausalLM": MIXTRAL,
                                "Gemma2ForCausalLM": GEMMA, "Gemma3ForCausalLM": GEMMA,
                                "Phi3ForCausalLM": PHI3}
    assert {gguf_architecture(gguf_named(a)).family for a in ("llama", "qwen2", "qwen3")} == \
        {LLAMA}


@pytest.mark.parametrize("kind", KINDS + MOE_KINDS)
def test_hf_names_write_back_the_tensors_transformers_saved(hf_checkpoint, kind):
    path = hf_checkpoint(kind)
    saved = load_file(str(path / "model.safetensors"))
    loaded = load_hf(path)
    names = family_of(loaded.config).hf_names
    written = dict(names.checkpoint_tensors(loaded.params))
    if loaded.config.tie_word_embeddings:
        saved.pop("lm_head.weight", None)
    assert sorted(written) == sorted(saved)
    for name, tensor in saved.items():
        np.testing.assert_array_equal(written[name], tensor.astype(np.float32), err_msg=name)
