"""HF, llama2.c and dummy loaders: canonical params, configs, and clear errors on bad input."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from hf_checkpoints import Factory
from jaxserve.models.llama2c_loader import interleaved_to_half_split
from jaxserve.models.llama_config import LlamaConfig, param_shapes
from jaxserve.models.loaded_model import LoadedModel
from jaxserve.models.loader import detect_format, load_model

# Independent statement of HF's names: canonical name -> (HF name, is a torch Linear weight).
HF_NAMES = {
    "attn_norm": ("input_layernorm.weight", False), "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True), "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True), "bq": ("self_attn.q_proj.bias", False),
    "bk": ("self_attn.k_proj.bias", False), "bv": ("self_attn.v_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False), "k_norm": ("self_attn.k_norm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True), "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}
CASES = [  # (kind, tie, num_kv_heads)
    ("llama", False, 2), ("llama", True, 4), ("llama3.1", False, 2), ("mistral", False, 4),
    ("qwen2", True, 2), ("qwen2", False, 4), ("qwen3", False, 2), ("qwen3", True, 4),
]


def hf_tensors(directory: Path) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    for f in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def expected_from_safetensors(tensors: dict[str, np.ndarray], cfg: LlamaConfig
                              ) -> dict[str, np.ndarray]:
    out = {"embed": tensors["model.embed_tokens.weight"],
           "final_norm": tensors["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = tensors["lm_head.weight"]
    for name in param_shapes(cfg):
        if name in HF_NAMES:
            hf, linear = HF_NAMES[name]
            layers = [tensors[f"model.layers.{i}.{hf}"] for i in range(cfg.num_layers)]
            out[name] = np.stack([w.T if linear else w for w in layers])
    return {k: np.asarray(v, dtype=np.float32) for k, v in out.items()}


def copy_checkpoint(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("kind,tie,kv", CASES)
def test_hf_loader_yields_exactly_the_safetensors_tensors_transposed(
        hf_checkpoint: Factory, kind: str, tie: bool, kv: int) -> None:
    path = hf_checkpoint(kind, tie=tie, num_kv_heads=kv)
    loaded = load_model(path)
    expected = expected_from_safetensors(hf_tensors(path), loaded.config)
    assert sorted(loaded.params) == sorted(expected)
    for name, value in expected.items():
        assert loaded.params[name].dtype == np.float32
        np.testing.assert_array_equal(loaded.params[name], value, err_msg=name)
    assert loaded.config.tie_word_embeddings is tie
    assert loaded.config.num_kv_heads == kv
    assert loaded.tokenizer is not None and loaded.tokenizer.bos_token_id == 0


def test_hf_configs_carry_each_family_switch(hf_checkpoint: Factory) -> None:
    llama31 = load_model(hf_checkpoint("llama3.1")).config
    assert llama31.rope_theta == 500000.0
    assert llama31.rope_scaling_dict == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
    qwen2 = load_model(hf_checkpoint("qwen2")).config
    assert qwen2.attention_bias and not qwen2.qk_norm
    qwen3 = load_model(hf_checkpoint("qwen3")).config
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.hidden_size == 64
    llama = load_model(hf_checkpoint("llama")).config
    assert (llama.bos_token_id, llama.eos_token_ids, llama.rms_norm_eps) == (0, (1,), 1e-6)
    assert load_model(hf_checkpoint("mistral")).config.architecture == "MistralForCausalLM"


def test_sharded_checkpoint_loads_like_a_single_file(hf_checkpoint: Factory) -> None:
    single = load_model(hf_checkpoint("qwen2", seed=3))
    sharded_dir = hf_checkpoint("qwen2", seed=3, max_shard_size="40KB")
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    sharded = load_model(sharded_dir)
    assert single.config == sharded.config
    for name, value in single.params.items():
        np.testing.assert_array_equal(sharded.params[name], value, err_msg=name)


def test_bfloat16_checkpoint_is_upcast_exactly(hf_checkpoint: Factory) -> None:
    path = hf_checkpoint("llama", dtype="bfloat16")
    tensors = hf_tensors(path)
    assert tensors["model.norm.weight"].dtype == ml_dtypes.bfloat16
    loaded = load_model(path)
    assert all(v.dtype == np.float32 for v in loaded.params.values())
    expected = expected_from_safetensors(tensors, loaded.config)
    for name, value in expected.items():
        np.testing.assert_array_equal(loaded.params[name], value, err_msg=name)


def test_generation_config_eos_ids_override_config(hf_checkpoint: Factory, tmp_path: Path) -> None:
    path = copy_checkpoint(hf_checkpoint("llama"), tmp_path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    assert load_model(path).config.eos_token_ids == (1, 7)


def _rewrite_config(path: Path, **changes: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_hf_bad_inputs_give_clear_errors(hf_checkpoint: Factory, tmp_path: Path) -> None:
    src = hf_checkpoint("llama")
    path = copy_checkpoint(src, tmp_path / "arch")
    _rewrite_config(path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_model(path)

    path = copy_checkpoint(src, tmp_path / "missing")
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model(path)

    path = copy_checkpoint(src, tmp_path / "truncated")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(path)

    path = copy_checkpoint(src, tmp_path / "shape")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.1.self_attn.k_proj.weight"] = np.zeros((48, 64), np.float32)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.k_proj.weight.*\(48, 64\)"):
        load_model(path)

    path = copy_checkpoint(src, tmp_path / "absent")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj.weight"):
        load_model(path)

    path = copy_checkpoint(src, tmp_path / "extra")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.mlp.extra.weight"] = np.zeros(3, np.float32)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="mlp.extra.weight"):
        load_model(path)

    path = copy_checkpoint(src, tmp_path / "key")
    cfg = json.loads((path / "config.json").read_text())
    del cfg["hidden_size"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="hidden_size"):
        load_model(path)


def test_sharded_checkpoint_with_a_missing_shard_names_it(
        hf_checkpoint: Factory, tmp_path: Path) -> None:
    path = copy_checkpoint(hf_checkpoint("llama", max_shard_size="40KB"), tmp_path)
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ValueError, match=shard.name):
        load_model(path)


def test_load_model_rejects_bad_paths_and_formats(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(ValueError, match="load_format"):
        load_model(tmp_path, load_format="pickle")
    with pytest.raises(ValueError, match="config.json"):
        load_model(tmp_path)
    (tmp_path / "weights.pt").write_bytes(b"x")
    with pytest.raises(ValueError, match="weights.pt"):
        detect_format(tmp_path / "weights.pt")


# llama2.c


def hf_to_interleaved(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's `permute` for q/k rows `[out, in]`: HF half-split -> interleaved pairs."""
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def write_llama2c(path: Path, loaded: LoadedModel, seq_len: int = 32) -> None:
    cfg, p = loaded.config, loaded.params
    vocab = cfg.vocab_size if cfg.tie_word_embeddings else -cfg.vocab_size
    parts = [p["embed"], p["attn_norm"],
             np.stack([hf_to_interleaved(w.T, cfg.num_heads) for w in p["wq"]]),
             np.stack([hf_to_interleaved(w.T, cfg.num_kv_heads) for w in p["wk"]]),
             p["wv"].transpose(0, 2, 1), p["wo"].transpose(0, 2, 1), p["mlp_norm"],
             p["w_gate"].transpose(0, 2, 1), p["w_down"].transpose(0, 2, 1),
             p["w_up"].transpose(0, 2, 1), p["final_norm"],
             np.zeros(seq_len * cfg.head_dim // 2), np.zeros(seq_len * cfg.head_dim // 2)]
    if not cfg.tie_word_embeddings:
        parts.append(p["lm_head"])
    header = struct.pack("<7i", cfg.hidden_size, cfg.intermediate_size, cfg.num_layers,
                         cfg.num_heads, cfg.num_kv_heads, vocab, seq_len)
    path.write_bytes(header + b"".join(np.asarray(x, "<f4").tobytes() for x in parts))


@pytest.mark.parametrize("tie", [False, True])
def test_llama2c_loader_undoes_the_interleaved_rope_layout(
        hf_checkpoint: Factory, tmp_path: Path, tie: bool) -> None:
    hf = load_model(hf_checkpoint("llama", tie=tie))
    write_llama2c(tmp_path / "model.bin", hf)
    loaded = load_model(tmp_path / "model.bin")
    assert loaded.tokenizer is None
    assert loaded.config.tie_word_embeddings is tie
    assert sorted(loaded.params) == sorted(hf.params)
    for name, value in hf.params.items():
        np.testing.assert_array_equal(loaded.params[name], value, err_msg=name)


def rope_scores(q: np.ndarray, k: np.ndarray, positions: np.ndarray, interleaved: bool
                ) -> np.ndarray:
    """Attention scores of one head `[T, T]` after RoPE (theta 10000) in either layout."""
    d = q.shape[-1]
    angles = positions[:, None] * (10000.0 ** (-np.arange(0, d, 2) / d))[None, :]
    cos, sin = np.cos(angles), np.sin(angles)

    def rotate(x: np.ndarray) -> np.ndarray:
        if interleaved:
            a, b = x[:, 0::2], x[:, 1::2]
            return np.stack([a * cos - b * sin, a * sin + b * cos], -1).reshape(x.shape)
        a, b = x[:, : d // 2], x[:, d // 2:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], -1)

    return rotate(q) @ rotate(k).T


def test_stories_bin_rope_permutation_preserves_attention_scores(stories_dir: Path) -> None:
    raw = np.fromfile(stories_dir / "stories260K.bin", dtype="<f4", offset=28)
    dim, vocab, hd = 64, 512, 8
    wq_raw = raw[vocab * dim + 5 * dim:][: dim * dim].reshape(dim, dim)  # layer 0, [out, in]
    wk_raw = raw[vocab * dim + 5 * dim + 5 * dim * dim:][: 32 * dim].reshape(32, dim)
    loaded = load_model(stories_dir / "stories260K.bin")
    x = np.random.default_rng(0).standard_normal((6, dim))
    positions = np.arange(6, dtype=np.float64) + 3
    q_raw, k_raw = x @ wq_raw.T, x @ wk_raw.T
    q_new, k_new = x @ loaded.params["wq"][0], x @ loaded.params["wk"][0]
    for head in range(8):
        kv = head // 2
        ref = rope_scores(q_raw[:, head * hd:(head + 1) * hd], k_raw[:, kv * hd:(kv + 1) * hd],
                          positions, interleaved=True)
        got = rope_scores(q_new[:, head * hd:(head + 1) * hd], k_new[:, kv * hd:(kv + 1) * hd],
                          positions, interleaved=False)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_stories_bin_and_gguf_give_identical_params(stories_dir: Path) -> None:
    from_bin = load_model(stories_dir / "stories260K.bin")
    from_gguf = load_model(stories_dir / "stories260K.gguf")
    assert from_bin.config.replace(max_position_embeddings=1) == \
        from_gguf.config.replace(max_position_embeddings=1)
    assert from_bin.config.max_position_embeddings == 512  # trained context, from the header
    assert from_bin.config.tie_word_embeddings and "lm_head" not in from_bin.params
    assert sorted(from_bin.params) == sorted(from_gguf.params)
    for name, value in from_bin.params.items():
        np.testing.assert_array_equal(from_gguf.params[name], value, err_msg=name)
    assert from_bin.tokenizer is not None and from_bin.tokenizer.vocab_size == 512


def test_interleaved_to_half_split_inverts_llama_cpp_permute() -> None:
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    np.testing.assert_array_equal(interleaved_to_half_split(hf_to_interleaved(w, 8), 8), w)
    b = np.arange(32, dtype=np.float32)  # a bias permutes like a one-column matrix
    permuted = interleaved_to_half_split(b, 4)
    assert not np.array_equal(permuted, b)
    np.testing.assert_array_equal(permuted, interleaved_to_half_split(b[:, None], 4)[:, 0])


def test_llama2c_truncated_or_corrupt_file_is_rejected(stories_dir: Path, tmp_path: Path) -> None:
    data = (stories_dir / "stories260K.bin").read_bytes()
    (tmp_path / "short.bin").write_bytes(data[:-4])
    with pytest.raises(ValueError, match="truncated"):
        load_model(tmp_path / "short.bin")
    (tmp_path / "tiny.bin").write_bytes(data[:10])
    with pytest.raises(ValueError, match="truncated"):
        load_model(tmp_path / "tiny.bin")
    (tmp_path / "neg.bin").write_bytes(struct.pack("<7i", 64, 172, 0, 8, 4, 512, 512) + data[28:])
    with pytest.raises(ValueError, match="n_layers"):
        load_model(tmp_path / "neg.bin")
    (tmp_path / "long.bin").write_bytes(data + b"\0" * 8)
    with pytest.raises(ValueError, match="trailing"):
        load_model(tmp_path / "long.bin")


# dummy


def test_dummy_weights_from_config_are_seeded(hf_checkpoint: Factory) -> None:
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=8, attention_bias=True, qk_norm=True)
    a = load_model(None, "dummy", dummy_config=cfg, seed=1)
    b = load_model(None, "dummy", dummy_config=cfg, seed=1)
    c = load_model(None, "dummy", dummy_config=cfg, seed=2)
    assert {k: v.shape for k, v in a.params.items()} == param_shapes(cfg)
    for name in a.params:
        np.testing.assert_array_equal(a.params[name], b.params[name])
    assert not np.array_equal(a.params["wq"], c.params["wq"])
    for name in ("attn_norm", "mlp_norm", "final_norm", "q_norm", "k_norm"):
        assert np.all(a.params[name] == 1.0)
    assert abs(float(a.params["w_gate"].std()) - 0.02) < 0.002
    assert a.tokenizer is None

    path = hf_checkpoint("qwen3")
    from_dir = load_model(path, "dummy")
    assert from_dir.config == load_model(path).config
    assert from_dir.tokenizer is not None
    assert not np.array_equal(from_dir.params["wq"], load_model(path).params["wq"])


def test_dummy_without_a_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="dummy_config"):
        load_model(None, "dummy")
    with pytest.raises(ValueError, match="config.json"):
        load_model(tmp_path, "dummy")
