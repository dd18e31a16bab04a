"""The tokenizer a GGUF file carries (`tokenizer.ggml.*`, `tokenizer.chat_template`) as an
HFTokenizer: its vocabulary and merges, special tokens, BOS/EOS and add_bos_token."""

from __future__ import annotations

from pathlib import Path

from jaxserve.models.gguf_file import GGUFFile
from jaxserve.models.tokenizer import HFTokenizer
from jaxserve.models.tokenizer_builders import (CONTROL, NORMAL, byte_level_bpe,
                                                infer_token_types, sentencepiece_bpe)

# Kinds that mean "no vocabulary in this file".
_NO_VOCAB = ("none", "no_vocab")


def read_gguf_tokenizer(gguf: GGUFFile, path: Path) -> HFTokenizer | None:
    """None when the file has no vocabulary."""
    kind = gguf.get("tokenizer.ggml.model")
    tokens = gguf.get("tokenizer.ggml.tokens")
    if kind in _NO_VOCAB or (kind is None and tokens is None):
        return None
    if tokens is None:
        raise ValueError(f"{path}: GGUF metadata key 'tokenizer.ggml.tokens' is missing")
    bos, eos = gguf.token_id("bos_token_id"), gguf.token_id("eos_token_id")
    unk = gguf.token_id("unknown_token_id")
    types = gguf.get("tokenizer.ggml.token_type")
    try:
        if kind == "llama":
            scores = gguf.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
            if types is None:
                types = infer_token_types(tokens, unk, [i for i in (bos, eos) if i is not None])
            tok = sentencepiece_bpe(tokens, scores, types, unk_id=unk, add_space_prefix=bool(
                gguf.get("tokenizer.ggml.add_space_prefix", True)))
        elif kind == "gpt2":
            merges = gguf.get("tokenizer.ggml.merges")
            if merges is None:
                raise ValueError("GGUF metadata key 'tokenizer.ggml.merges' is missing")
            if types is None:
                types = [CONTROL if i in (bos, eos) else NORMAL for i in range(len(tokens))]
            tok = byte_level_bpe(tokens, merges, types, gguf.get("tokenizer.ggml.pre"))
        else:
            raise ValueError(f"tokenizer.ggml.model {kind!r} is not supported (llama, gpt2); "
                             "pass tokenizer= with an HF tokenizer directory")
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    config = {"bos_token": None if bos is None else tokens[bos],
              "eos_token": None if eos is None else tokens[eos],
              # llama.cpp's default: a BOS for SentencePiece vocabularies, none for BPE ones
              "add_bos_token": bool(gguf.get("tokenizer.ggml.add_bos_token", kind == "llama")),
              "chat_template": gguf.get("tokenizer.chat_template")}
    return HFTokenizer(tok, config, bos_token_id=bos, eos_token_id=eos)
