"""A tiny dummy-weight Llama with a tokenizer and (optionally) a chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = ("{% for m in messages %}{% if loop.first %}{{ bos_token }}{% endif %}"
                 "<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
TEXT = ["Once upon a time there was a little robot who lived by the sea.",
        "The robot liked to read books about boats, fish and the stars at night."]


def write_tiny_model(folder: Path, *, chat_template: bool = True) -> Path:
    """config.json (hidden 64, 2 layers, vocab 320) + a byte-level BPE tokenizer.json, with no
    transformers import (it costs seconds)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 320, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
        "bos_token_id": 0, "eos_token_id": 1}))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    config: dict[str, Any] = {"bos_token": "<s>", "eos_token": "</s>"}
    if chat_template:
        config["chat_template"] = CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder
