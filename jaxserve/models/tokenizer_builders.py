"""HF `tokenizers` objects built in memory from a vocabulary as GGUF and llama2.c store it, or
trained on text.

Two kinds from a vocabulary: SentencePiece-style BPE (GGUF "llama", llama2.c `tok*.bin`: pieces
with scores, merged by score with byte fallback, as HF's Llama tokenizers do) and byte-level BPE
(GGUF "gpt2": tokens and ranked merges, split first by the regex its `tokenizer.ggml.pre` names,
as llama.cpp does). Trained: a byte-level BPE with BOS and EOS (the default model's, tests').
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                        pre_tokenizers, processors, trainers)

# SentencePiece / GGUF token types.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # SentencePiece's visible space
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> how text is split before the merges: "gpt2" (GPT-2's regex),
# "digits" (each digit alone, then GPT-2's regex), or a regex of its own.
PRE_TOKENIZERS = {
    "default": "gpt2", "gpt2": "gpt2",
    "smollm": "digits", "starcoder": "digits", "refact": "digits", "codeshell": "digits",
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def infer_token_types(pieces: Sequence[str], unk_id: int | None, control_ids: Sequence[int],
                      ) -> list[int]:
    """Token types of a vocabulary that stores none (llama2.c)."""
    return [UNKNOWN if i == unk_id else CONTROL if i in control_ids
            else BYTE if _BYTE_PIECE.fullmatch(p) else NORMAL for i, p in enumerate(pieces)]


def sentencepiece_bpe(pieces: Sequence[str], scores: Sequence[float], types: Sequence[int], *,
                      unk_id: int | None, add_space_prefix: bool = True) -> Tokenizer:
    """Pieces spell a space as U+2581. Merges are every split of a piece into two mergeable
    pieces, best score first, so BPE joins the pair that makes the best-scoring piece."""
    if not len(pieces) == len(scores) == len(types):
        raise ValueError(f"sentencepiece vocab: {len(pieces)} pieces, {len(scores)} scores, "
                         f"{len(types)} token types")
    vocab = _unique_vocab(pieces)
    mergeable = {p: i for i, (p, t) in enumerate(zip(pieces, types))
                 if t in (NORMAL, USER_DEFINED)}
    ranked = []
    for piece, i in mergeable.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                ranked.append((-scores[i], i, cut, (left, right)))
    ranked.sort()
    unk = pieces[unk_id] if unk_id is not None else None
    tok = Tokenizer(models.BPE(vocab, [m for *_, m in ranked], unk_token=unk, fuse_unk=True,
                               byte_fallback=True))
    # SentencePiece's dummy prefix: one more U+2581 even before a leading space (Metaspace
    # would not add it there).
    spaces = normalizers.Replace(" ", SPACE)
    tok.normalizer = (normalizers.Sequence([normalizers.Prepend(SPACE), spaces])
                      if add_space_prefix else spaces)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_space_prefix
                                             else []))
    _add_special_tokens(tok, pieces, types)
    return tok


def byte_level_bpe(tokens: Sequence[str], merges: Sequence[str], types: Sequence[int],
                   pre: str | None) -> Tokenizer:
    """GPT-2-style BPE: tokens spelled in its byte alphabet, merges as "left right"."""
    split = PRE_TOKENIZERS.get(pre or "default")
    if split is None:
        raise ValueError(f"tokenizer.ggml.pre {pre!r} is not known to jaxserve (known: "
                         f"{', '.join(sorted(PRE_TOKENIZERS))}); pass tokenizer= with an HF "
                         "tokenizer directory")
    pairs = []
    for m in merges:
        left, _, right = m.partition(" ")
        if not left or not right:
            raise ValueError(f"tokenizer.ggml.merges: {m!r} is not 'left right'")
        pairs.append((left, right))
    tok = Tokenizer(models.BPE(_unique_vocab(tokens), pairs))
    if split == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif split == "digits":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    _add_special_tokens(tok, tokens, types)
    return tok


def trained_byte_level_bpe(texts: Iterable[str], vocab_size: int, bos: str, eos: str,
                           ) -> Tokenizer:
    """A byte-level BPE trained on `texts`, `bos` and `eos` its first ids (0 and 1), that puts
    `bos` in front of what it encodes."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[bos, eos],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, 0)])
    return tok


def _unique_vocab(tokens: Sequence[str]) -> dict[str, int]:
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        seen: set[str] = set()
        dup = next(t for t in tokens if t in seen or seen.add(t))
        raise ValueError(f"tokenizer vocab: token {dup!r} appears more than once")
    return vocab


def _add_special_tokens(tok: Tokenizer, tokens: Sequence[str], types: Sequence[int]) -> None:
    """Control and unknown tokens as special (matched whole, skipped when decoding with
    skip_special_tokens); user-defined ones matched whole, as llama.cpp does."""
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k in (CONTROL, UNKNOWN)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == USER_DEFINED])
