"""GGUF loader: llama.cpp's tensor layout and types, and its embedded tokenizer, written here
with `gguf.GGUFWriter`."""

from __future__ import annotations

from pathlib import Path

import json

import gguf
import ml_dtypes
import numpy as np
import pytest

from hf_checkpoints import CHAT_TEMPLATE, Factory
from jaxserve.models.llama_config import LlamaConfig
from jaxserve.models.loaded_model import LoadedModel
from jaxserve.config import EngineConfig
from jaxserve.models.loader import load_configured, load_model, load_tokenizer, start_loading
from jaxserve.models.tokenizer import HFTokenizer

Q = gguf.GGMLQuantizationType
LAYER_NAMES = {
    "attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight",
    "wv": "attn_v.weight", "wo": "attn_output.weight", "bq": "attn_q.bias", "bk": "attn_k.bias",
    "bv": "attn_v.bias", "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
    "mlp_norm": "ffn_norm.weight", "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight",
    "w_down": "ffn_down.weight",
}
LINEAR = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}
GGUF_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
             "Qwen3ForCausalLM": "qwen3"}


def hf_to_interleaved(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's `permute` for q/k rows `[out, ...]`: HF half-split -> interleaved pairs."""
    rows = w.shape[0]
    return (w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def gguf_tensors(loaded: LoadedModel, arch: str) -> dict[str, np.ndarray]:
    """The canonical params in GGUF's layout: `[out, in]`, q/k interleaved for "llama"."""
    cfg, p = loaded.config, loaded.params
    out = {"token_embd.weight": p["embed"], "output_norm.weight": p["final_norm"]}
    if "lm_head" in p:
        out["output.weight"] = p["lm_head"]
    for name, suffix in LAYER_NAMES.items():
        if name not in p:
            continue
        for layer in range(cfg.num_layers):
            w = p[name][layer].T if name in LINEAR else p[name][layer]
            if arch == "llama" and name in ("wq", "bq"):
                w = hf_to_interleaved(w, cfg.num_heads)
            elif arch == "llama" and name in ("wk", "bk"):
                w = hf_to_interleaved(w, cfg.num_kv_heads)
            out[f"blk.{layer}.{suffix}"] = np.ascontiguousarray(w, dtype=np.float32)
    return out


def write_gguf(path: Path, cfg: LlamaConfig, tensors: dict[str, np.ndarray], *,
               qtype: Q = Q.F32, arch: str | None = None,
               raw_override: dict[str, tuple[np.ndarray, Q]] | None = None,
               kv_heads_per_layer: list[int] | None = None,
               tokenizer: dict | None = None) -> Path:
    """`tokenizer`: `tokenizer.ggml.*` values by short key (model, pre, tokens, merges,
    token_type, bos/eos ids, add_bos_token) and `chat_template`."""
    arch = arch or GGUF_ARCH[cfg.architecture]
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in (tokenizer or {}).items():
        name = "tokenizer.chat_template" if key == "chat_template" else f"tokenizer.ggml.{key}"
        if isinstance(value, list) and isinstance(value[0], str):
            writer.add_array(name, value)
        elif isinstance(value, list):  # token types: int32, as llama.cpp writes them
            writer.add_key_value(name, value, gguf.GGUFValueType.ARRAY,
                                 sub_type=gguf.GGUFValueType.INT32)
        elif isinstance(value, bool):
            writer.add_bool(name, value)
        elif isinstance(value, int):
            writer.add_uint32(name, value)
        else:
            writer.add_string(name, value)
    writer.add_block_count(cfg.num_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(kv_heads_per_layer or cfg.num_kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_theta)
    for name, w in tensors.items():
        if raw_override and name in raw_override:
            data, raw_type = raw_override[name]
            writer.add_tensor(name, data, raw_dtype=raw_type)
        elif w.ndim == 1 or qtype == Q.F32:  # llama.cpp keeps norms and biases in F32
            writer.add_tensor(name, w)
        elif qtype == Q.F16:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def round_trip(w: np.ndarray, qtype: Q) -> np.ndarray:
    """What a tensor `[out, in]` becomes after storing it as `qtype`."""
    if qtype == Q.F32 or w.ndim == 1:
        return w
    if qtype == Q.F16:
        return w.astype(np.float16).astype(np.float32)
    if qtype == Q.BF16:
        return w.astype(ml_dtypes.bfloat16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
def test_gguf_llama_layout_and_types_load_as_canonical(
        hf_checkpoint: Factory, tmp_path: Path, qtype: Q) -> None:
    hf = load_model(hf_checkpoint("llama"))
    path = write_gguf(tmp_path / "m.gguf", hf.config, gguf_tensors(hf, "llama"), qtype=qtype)
    loaded = load_model(path)
    cfg = loaded.config
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta,
            cfg.rms_norm_eps, cfg.tie_word_embeddings) == (64, 4, 2, 16, 10000.0, 1e-6, False)
    assert sorted(loaded.params) == sorted(hf.params)
    for name, value in hf.params.items():
        if name in LINEAR:
            expected = np.stack([round_trip(w.T, qtype).T for w in value])
        elif name in ("embed", "lm_head"):
            expected = round_trip(value, qtype)
        else:  # norms: one F32 vector per layer
            expected = value
        np.testing.assert_array_equal(loaded.params[name], expected, err_msg=name)
        if qtype == Q.Q8_0:  # blocks of 32 with one scale: error <= max|block| / 127 / 2
            np.testing.assert_allclose(loaded.params[name], value, rtol=0,
                                       atol=float(np.abs(value).max()) / 127)
    assert loaded.tokenizer is None


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_gguf_qwen_keeps_hf_rope_order_biases_and_qk_norms(
        hf_checkpoint: Factory, tmp_path: Path, kind: str) -> None:
    hf = load_model(hf_checkpoint(kind, tie=True))
    path = write_gguf(tmp_path / "m.gguf", hf.config, gguf_tensors(hf, kind))
    loaded = load_model(path)
    assert loaded.config.architecture == hf.config.architecture
    assert loaded.config.attention_bias == hf.config.attention_bias
    assert loaded.config.qk_norm == hf.config.qk_norm
    assert loaded.config.head_dim == hf.config.head_dim
    assert loaded.config.tie_word_embeddings
    assert sorted(loaded.params) == sorted(hf.params)
    for name, value in hf.params.items():
        np.testing.assert_array_equal(loaded.params[name], value, err_msg=name)


def test_gguf_llama_biases_are_permuted_like_their_rows(tmp_path: Path) -> None:
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=8, attention_bias=True)
    hf = load_model(None, "dummy", dummy_config=cfg, seed=5)
    loaded = load_model(write_gguf(tmp_path / "m.gguf", cfg, gguf_tensors(hf, "llama")))
    for name in ("wq", "wk", "bq", "bk", "bv"):
        np.testing.assert_array_equal(loaded.params[name], hf.params[name], err_msg=name)


def test_gguf_output_identical_to_embedding_means_tied(
        hf_checkpoint: Factory, tmp_path: Path) -> None:
    hf = load_model(hf_checkpoint("llama", tie=True))
    tensors = gguf_tensors(hf, "llama") | {"output.weight": hf.params["embed"]}
    loaded = load_model(write_gguf(tmp_path / "m.gguf", hf.config, tensors))
    assert loaded.config.tie_word_embeddings and "lm_head" not in loaded.params


def test_gguf_unsupported_tensor_type_names_tensor_and_type(
        hf_checkpoint: Factory, tmp_path: Path) -> None:
    hf = load_model(hf_checkpoint("llama"))
    tensors = gguf_tensors(hf, "llama")
    block, size = gguf.GGML_QUANT_SIZES[Q.Q8_1]
    rows, cols = tensors["blk.1.attn_v.weight"].shape
    raw = np.zeros((rows, cols // block * size), np.uint8)
    path = write_gguf(tmp_path / "m.gguf", hf.config, tensors,
                      raw_override={"blk.1.attn_v.weight": (raw, Q.Q8_1)})
    with pytest.raises(ValueError, match=r"blk\.1\.attn_v\.weight.*Q8_1"):
        load_model(path)


def test_gguf_bad_files_give_clear_errors(hf_checkpoint: Factory, tmp_path: Path) -> None:
    hf = load_model(hf_checkpoint("llama"))
    tensors = gguf_tensors(hf, "llama")
    path = write_gguf(tmp_path / "arch.gguf", hf.config, tensors, arch="falcon")
    with pytest.raises(ValueError, match="falcon"):
        load_model(path)

    missing = {k: v for k, v in tensors.items() if k != "blk.1.ffn_up.weight"}
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight"):
        load_model(write_gguf(tmp_path / "missing.gguf", hf.config, missing))

    wrong = tensors | {"blk.0.attn_k.weight": np.zeros((16, 64), np.float32)}
    with pytest.raises(ValueError, match=r"blk\.0\.attn_k\.weight.*\(16, 64\)"):
        load_model(write_gguf(tmp_path / "shape.gguf", hf.config, wrong))

    extra = tensors | {"blk.0.ffn_gate_exps.weight": np.zeros((4, 4), np.float32)}
    with pytest.raises(ValueError, match="ffn_gate_exps"):
        load_model(write_gguf(tmp_path / "extra.gguf", hf.config, extra))

    uniform = write_gguf(tmp_path / "uniform.gguf", hf.config, tensors, kv_heads_per_layer=[2, 2])
    assert load_model(uniform).config.num_kv_heads == 2
    mixed = write_gguf(tmp_path / "mixed.gguf", hf.config, tensors, kv_heads_per_layer=[2, 1])
    with pytest.raises(ValueError, match="head_count_kv.*differs between layers"):
        load_model(mixed)

    good = write_gguf(tmp_path / "good.gguf", hf.config, tensors).read_bytes()
    (tmp_path / "truncated.gguf").write_bytes(good[: len(good) - 4096])
    with pytest.raises(ValueError, match="truncated.gguf"):
        load_model(tmp_path / "truncated.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"GGML" + good[4:64])
    with pytest.raises(ValueError, match="junk.gguf"):
        load_model(tmp_path / "junk.gguf")


def gpt2_tokenizer_metadata(hf_dir: Path) -> dict:
    """The `tokenizer.ggml.*` values llama.cpp's converter writes for this byte-level BPE."""
    model = json.loads((hf_dir / "tokenizer.json").read_text())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return {"model": "gpt2", "pre": "default", "tokens": tokens, "merges": merges,
            "token_type": [3 if t in ("<s>", "</s>") else 1 for t in tokens],
            "bos_token_id": 0, "eos_token_id": 1, "add_bos_token": True,
            "chat_template": CHAT_TEMPLATE}


TEXTS = ["Once upon a time", "Café 日本 🙂 robot", " leading space\nnew line", "2024: a<s>b"]


def test_gguf_byte_level_tokenizer_matches_its_source_and_transformers(
        hf_checkpoint: Factory, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    hf_dir = hf_checkpoint("llama")
    hf = load_model(hf_dir)
    path = write_gguf(tmp_path / "m.gguf", hf.config, gguf_tensors(hf, "llama"),
                      tokenizer=gpt2_tokenizer_metadata(hf_dir))
    ours = load_model(path).tokenizer
    source = HFTokenizer.from_directory(hf_dir)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    assert isinstance(ours, HFTokenizer) and ours.vocab_size == source.vocab_size
    assert (ours.bos_token_id, ours.eos_token_id, ours.bos_token, ours.eos_token) == (
        0, 1, "<s>", "</s>")
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == \
        source.apply_chat_template(messages, add_generation_prompt=True)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == source.encode(text) == theirs.encode(text)
        assert ids[0] == 0  # add_bos_token
        assert ours.decode(ids) == source.decode(ids) == text.replace("<s>", "")


def test_gguf_tokenizer_bad_metadata_names_the_key(hf_checkpoint: Factory,
                                                   tmp_path: Path) -> None:
    hf_dir = hf_checkpoint("llama")
    hf = load_model(hf_dir)
    tensors, meta = gguf_tensors(hf, "llama"), gpt2_tokenizer_metadata(hf_dir)
    cases = [("pre", meta | {"pre": "martian"}, "tokenizer.ggml.pre 'martian'"),
             ("merges", {k: v for k, v in meta.items() if k != "merges"},
              "tokenizer.ggml.merges"),
             ("model", meta | {"model": "rwkv"}, "tokenizer.ggml.model 'rwkv'")]
    for name, tok_meta, message in cases:
        path = write_gguf(tmp_path / f"{name}.gguf", hf.config, tensors, tokenizer=tok_meta)
        with pytest.raises(ValueError, match=message):
            load_model(path)


def test_tokenizer_override_takes_a_gguf_or_a_llama2c_file(
        hf_checkpoint: Factory, stories_dir: Path, tmp_path: Path) -> None:
    hf_dir = hf_checkpoint("llama")
    hf = load_model(hf_dir)
    bare = write_gguf(tmp_path / "bare.gguf", hf.config, gguf_tensors(hf, "llama"))
    with_tok = write_gguf(tmp_path / "tok.gguf", hf.config, gguf_tensors(hf, "llama"),
                          tokenizer=gpt2_tokenizer_metadata(hf_dir))
    assert load_tokenizer(with_tok, hf.config).encode(TEXTS[1]) == \
        HFTokenizer.from_directory(hf_dir).encode(TEXTS[1])
    with pytest.raises(ValueError, match="bare.gguf.*has no tokenizer"):
        load_tokenizer(bare, hf.config)
    stories = load_model(stories_dir / "stories260K.bin").config
    tok = load_tokenizer(stories_dir / "tok512.bin", stories)
    assert tok.encode("Once upon a time") == [1, 403, 407, 261, 378]
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(tmp_path / "nowhere", stories)
    with pytest.raises(ValueError, match="more than the model's vocab_size"):
        load_tokenizer(with_tok, stories.replace(vocab_size=16, eos_token_ids=(1,)))


def test_start_loading_a_gguf_gives_its_config_now_and_the_same_model_after(
        hf_checkpoint: Factory, tmp_path: Path) -> None:
    """The engine's start: a GGUF's config is read at once and its weights on a background
    thread; what arrives equals a plain load. Other formats load before it returns."""
    hf_dir = hf_checkpoint("llama")
    hf = load_model(hf_dir)
    path = write_gguf(tmp_path / "m.gguf", hf.config, gguf_tensors(hf, "llama"), qtype=Q.Q4_1)
    engine = EngineConfig.from_kwargs(model=str(path), hf_overrides={"rope_theta": 5e5})
    loading = start_loading(engine.model)
    plain = load_configured(engine.model)
    assert loading.config == plain.config and loading.config.rope_theta == 5e5
    loaded = loading.result()
    assert loaded.config == plain.config and sorted(loaded.params) == sorted(plain.params)
    for name, value in plain.params.items():
        np.testing.assert_array_equal(loaded.params[name], value, err_msg=name)
    hf_loading = start_loading(EngineConfig.from_kwargs(model=str(hf_dir)).model)
    assert hf_loading.weights.done() and hf_loading.config == hf.config
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\0" * 16)
    with pytest.raises(ValueError, match="bad.gguf"):
        start_loading(EngineConfig.from_kwargs(model=str(tmp_path / "bad.gguf")).model)
