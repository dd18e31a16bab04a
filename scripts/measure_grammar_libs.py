"""Measure the grammar libraries that could back structured outputs on this machine: compile
time of a JSON schema, and per-token mask time along a valid output, with the shipped model's
byte-level BPE tokenizer (2048 tokens) and a Llama-2-style sentencepiece vocabulary.

    python scripts/measure_grammar_libs.py   # writes results/grammar_libs.md

xgrammar is not measured: it declares torch and triton as dependencies (pip install --dry-run
xgrammar==0.2.9 pulls triton), which the main dependencies must not have."""

from __future__ import annotations

import json
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bb", "ccc"]},
             "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                  "zip": {"type": "string",
                                                          "pattern": "^[0-9]{5}$"}},
                "required": ["city"]}},
    "required": ["name", "age"]}
TEXT = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["a", "ccc"],
                   "address": {"city": "London", "zip": "12345"}}, separators=(",", ":"))


def llguidance_row(tokenizer, name: str) -> list[str]:
    import llguidance

    from jaxserve.core.structured_output import ll_tokenizer

    t0 = time.perf_counter()
    lltok = ll_tokenizer(tokenizer, tokenizer.vocab_size, [tokenizer.eos_token_id])
    tok_s = time.perf_counter() - t0
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    t0 = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - t0
    ids = lltok.tokenize_str(TEXT)  # sentencepiece's encode would add its leading space
    mask = np.zeros((1, (tokenizer.vocab_size + 31) // 32), np.int32)
    times = []
    from llguidance.numpy import fill_next_token_bitmask
    for t in ids:
        t0 = time.perf_counter()
        fill_next_token_bitmask(matcher, mask)
        times.append(time.perf_counter() - t0)
        assert matcher.consume_token(t), matcher.get_error()
    return ["llguidance 1.9.1", name, f"{tok_s * 1e3:.1f}", f"{compile_s * 1e3:.2f}",
            f"{statistics.median(times) * 1e6:.0f}", f"{max(times) * 1e6:.0f}", "yes"]


def _byte_level(token: str) -> bytes:
    """GPT-2's byte-level alphabet back to bytes (outlines-core takes the bytes of tokens)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = printable + [256 + i for i in range(256 - len(printable))]
    raw = printable + [b for b in range(256) if b not in printable]
    decode = {chr(c): b for c, b in zip(chars, raw)}
    return bytes(decode[c] for c in token) if all(c in decode for c in token) else b""


def _piece_bytes(piece: str) -> bytes:
    """A sentencepiece piece's bytes: `<0xHH>` byte pieces, U+2581 as a space."""
    byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
    return bytes([int(byte.group(1), 16)]) if byte else piece.replace("\u2581", " ").encode()


def outlines_row(tokenizer, name: str, sentencepiece: bool = False) -> list[str]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    spell = _piece_bytes if sentencepiece else _byte_level
    special = {i for i in range(tokenizer.vocab_size)
               if tokenizer.decode([i], skip_special_tokens=True) == ""
               and tokenizer.decode([i], skip_special_tokens=False) != ""}
    pieces = [b"" if i in special else spell(tokenizer._tok.id_to_token(i))
              for i in range(tokenizer.vocab_size)]
    eos = tokenizer.eos_token_id
    vocab_map: dict[str, list[int]] = {}
    for i, b in enumerate(pieces):
        if i != eos and b:
            vocab_map.setdefault(b.decode("latin-1"), []).append(i)
    t0 = time.perf_counter()
    vocab = Vocabulary(eos, vocab_map)
    tok_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(SCHEMA)), vocab)
    compile_s = time.perf_counter() - t0
    guide = Guide(index)
    times = []
    from jaxserve.core.structured_output import ll_tokenizer
    ids = ll_tokenizer(tokenizer, tokenizer.vocab_size, [eos]).tokenize_str(TEXT)
    for t in ids:
        t0 = time.perf_counter()
        guide.get_tokens()
        times.append(time.perf_counter() - t0)
        guide.advance(t)
    return ["outlines-core 0.2.14", name, f"{tok_s * 1e3:.1f}", f"{compile_s * 1e3:.2f}",
            f"{statistics.median(times) * 1e6:.0f}", f"{max(times) * 1e6:.0f}",
            "regex only (no EBNF grammar)"]


def main() -> None:
    from jaxserve.default_model import default_model_path
    from jaxserve.models.hf_loader import read_hf_config
    from jaxserve.models.tokenizer import HFTokenizer, load_hf_tokenizer
    from jaxserve.models.tokenizer_builders import SPACE, infer_token_types, sentencepiece_bpe

    hf = load_hf_tokenizer(default_model_path(), read_hf_config(Path(default_model_path())))
    # A sentencepiece vocabulary as the gguf and llama2.c loaders build: pieces with spaces,
    # the 256 byte pieces, and the HF model's pieces decoded to text.
    texts = [hf.decode([i], skip_special_tokens=False) for i in range(2, hf.vocab_size)]
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + sorted(
        {t for t in texts if t and "\ufffd" not in t})
    pieces = [p.replace(" ", SPACE) for p in pieces]
    sp = HFTokenizer(sentencepiece_bpe(pieces, [0.0] * len(pieces),
                                       infer_token_types(pieces, 0, (1, 2)), unk_id=0),
                     bos_token_id=1, eos_token_id=2)
    rows = [llguidance_row(hf, "byte-level BPE (tokenizer.json, 2048)"),
            outlines_row(hf, "byte-level BPE (tokenizer.json, 2048)"),
            llguidance_row(sp, f"sentencepiece ({len(pieces)})"),
            outlines_row(sp, f"sentencepiece ({len(pieces)})", sentencepiece=True)]
    head = ["library", "tokenizer", "tokenizer setup ms", "schema compile ms",
            "mask us/token (median)", "mask us/token (max)", "EBNF/Lark grammars"]
    lines = ["# Grammar libraries on this machine", "",
             (f"JSON schema of 4 fields with nesting, an enum array and a pattern; mask time "
              f"along the {len(TEXT)}-character valid output `{TEXT}`."), "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", ("outlines-core's per-token time is a lookup of a precomputed token list "
                   "(the bitmask would still have to be built from it); its index is built "
                   "eagerly over the whole vocabulary at compile time, and it takes no "
                   "context-free grammars."),
              "Chosen: llguidance (JSON schema, regex and Lark grammars; no torch).",
              "xgrammar 0.2.9: not measured, it depends on torch and triton."]
    out = ROOT / "results" / "grammar_libs.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
