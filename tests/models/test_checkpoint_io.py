"""Converted (orbax) checkpoints round-trip bit-exactly, tokenizer included."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hf_checkpoints import Factory
from jaxserve.models.checkpoint_io import load_converted, save_converted
from jaxserve.models.loaded_model import LoadedModel
from jaxserve.models.loader import detect_format, load_model

MESSAGES = [{"role": "user", "content": "Hello robot"}]


def assert_same_model(a: LoadedModel, b: LoadedModel) -> None:
    assert a.config == b.config
    assert sorted(a.params) == sorted(b.params)
    for name, value in a.params.items():
        assert b.params[name].dtype == value.dtype
        np.testing.assert_array_equal(np.asarray(b.params[name]), value, err_msg=name)


def test_orbax_round_trip_of_hf_checkpoint_is_bit_exact(
        hf_checkpoint: Factory, tmp_path: Path) -> None:
    src = load_model(hf_checkpoint("qwen3", tie=True))
    dst = save_converted(src, tmp_path / "converted")
    assert detect_format(dst) == "orbax"
    restored = load_model(dst)
    assert_same_model(src, restored)
    assert restored.tokenizer is not None and src.tokenizer is not None
    text = "Once upon a time, a robot 🙂"
    assert restored.tokenizer.encode(text) == src.tokenizer.encode(text)
    assert restored.tokenizer.apply_chat_template(MESSAGES) == \
        src.tokenizer.apply_chat_template(MESSAGES)


def test_orbax_round_trip_of_stories_keeps_sentencepiece_vocab(
        stories_dir: Path, tmp_path: Path) -> None:
    src = load_model(stories_dir / "stories260K.bin")
    restored = load_model(save_converted(src, tmp_path / "stories"), load_format="orbax")
    assert_same_model(src, restored)
    assert restored.tokenizer is not None
    assert restored.tokenizer.encode("Once upon a time") == [1, 403, 407, 261, 378]
    ids = src.tokenizer.encode("Lily saw a ☃.")
    assert restored.tokenizer.decode(ids) == "Lily saw a ☃."


def test_orbax_restore_into_a_sharded_target(hf_checkpoint: Factory, tmp_path: Path) -> None:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    src = load_model(hf_checkpoint("llama"))
    dst = save_converted(src, tmp_path / "c")
    mesh = jax.make_mesh((1,), ("model",))
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(
        mesh, PartitionSpec())) for k, v in src.params.items()}
    restored = load_converted(dst, target=target)
    assert all(isinstance(v, jax.Array) for v in restored.params.values())
    assert_same_model(src, restored)


def test_dummy_model_without_tokenizer_round_trips(tmp_path: Path) -> None:
    from jaxserve.models.llama_config import LlamaConfig

    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=40, num_layers=2,
                      num_heads=4, num_kv_heads=1, head_dim=8,
                      rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0),
                                    ("low_freq_factor", 1.0),
                                    ("original_max_position_embeddings", 64),
                                    ("rope_type", "llama3")), eos_token_ids=(2, 5))
    src = load_model(None, "dummy", dummy_config=cfg, seed=3)
    restored = load_model(save_converted(src, tmp_path / "d"))
    assert_same_model(src, restored)
    assert restored.tokenizer is None


def test_convert_refuses_non_empty_destination_and_bad_metadata(tmp_path: Path) -> None:
    from jaxserve.models.llama_config import LlamaConfig

    cfg = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_layers=1,
                      num_heads=2, num_kv_heads=2, head_dim=4)
    model = load_model(None, "dummy", dummy_config=cfg)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ValueError, match="not an empty directory"):
        save_converted(model, tmp_path / "full")
    dst = save_converted(model, tmp_path / "ok")
    meta = json.loads((dst / "jaxserve_config.json").read_text())
    meta["config"]["bogus_field"] = 1
    (dst / "jaxserve_config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="bogus_field"):
        load_model(dst)
