"""The JAX model against HF transformers' own forward pass and `generate`, on the same weights."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jaxserve.models.llama import Llama
from jaxserve.models.loader import load_model
from model_forward import forward_logits, hf_logits

CASES = [("llama", False, 2), ("llama", True, 2), ("llama", False, 4), ("llama3.1", False, 2),
         ("mistral", False, 2), ("qwen2", False, 2), ("qwen2", True, 4), ("qwen3", False, 2),
         ("qwen3", True, 1)]


@pytest.mark.parametrize("kind,tie,kv_heads", CASES)
def test_logits_match_hf_forward_at_every_position(hf_checkpoint, kind, tie, kv_heads):
    path = hf_checkpoint(kind, tie=tie, num_kv_heads=kv_heads)
    ids = np.random.default_rng(1).integers(2, 320, size=70).tolist()
    ours = forward_logits(path, ids, splits=[])
    np.testing.assert_allclose(ours, hf_logits(path, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind,tie,scan_layers", [
    ("llama", False, False), ("llama", True, True), ("qwen2", False, True),
    ("qwen3", True, False)])
def test_the_rotary_table_gives_hf_logits(hf_checkpoint, kind, tie, scan_layers):
    """The `cpu` backend's path: rotary angles looked up per position."""
    path = hf_checkpoint(kind, tie=tie)
    ids = np.random.default_rng(3).integers(2, 320, size=40).tolist()
    ours = forward_logits(path, ids, splits=[17], rotary_lookup=True, scan_layers=scan_layers)
    np.testing.assert_allclose(ours, hf_logits(path, ids), atol=1e-4, rtol=0)


def test_the_rotary_table_stays_on_the_weights_device(hf_checkpoint):
    """A data-parallel rank's model lives on its own device: the rotary table too."""
    loaded = load_model(str(hf_checkpoint("llama")))  # untied head
    device = jax.devices()[-1]
    placed = {name: jax.device_put(value, device) for name, value in loaded.params.items()}
    leaves = jax.tree.leaves(nnx.state(Llama(loaded.config, placed, rotary_lookup=True)))
    assert len(leaves) > 3 and all(leaf.devices() == {device} for leaf in leaves)


def test_the_rotary_table_holds_the_positions_the_engine_serves(hf_checkpoint):
    """Sized by max_model_len, not max_position_embeddings (a 128K-context model's table would
    take 64 MB for an engine serving 4K)."""
    loaded = load_model(str(hf_checkpoint("llama")))
    assert loaded.config.max_position_embeddings != 40
    model = Llama(loaded.config, loaded.params, rotary_lookup=True, max_positions=40)
    assert model.rotary_table[...].shape[:2] == (1, 40)  # one angle set, 40 positions


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_prompt_split_over_two_calls_reads_the_kv_of_the_first(hf_checkpoint, kind):
    path = hf_checkpoint(kind)
    ids = np.random.default_rng(2).integers(2, 320, size=53).tolist()
    ours = forward_logits(path, ids, splits=[21])  # the split falls inside a block
    np.testing.assert_allclose(ours, hf_logits(path, ids), atol=1e-4, rtol=0)


def test_llama31_rope_scaling_is_exercised(hf_checkpoint):
    """Positions beyond the scaled wavelengths: a model without llama3 scaling would differ."""
    path = hf_checkpoint("llama3.1")
    loaded = load_model(str(path))
    assert loaded.config.rope_scaling_dict["rope_type"] == "llama3"
    plain = loaded.config.replace(rope_scaling=None)
    ids = np.random.default_rng(3).integers(2, 320, size=200).tolist()
    ref = hf_logits(path, ids)
    scaled = forward_logits(path, ids, splits=[100])
    np.testing.assert_allclose(scaled, ref, atol=1e-4, rtol=0)
    unscaled = forward_logits(path, ids, splits=[100], config=plain)
    # Without the llama3 rule the logits move far more than our numerical error.
    assert np.abs(unscaled - ref).max() > 100 * np.abs(scaled - ref).max()
