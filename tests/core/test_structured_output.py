"""The grammar manager over each tokenizer kind (HF tokenizer.json, sentencepiece as the gguf
and llama2.c loaders build it): walking random allowed tokens of the bitmask always spells a
match, the cache shares one compile per grammar text, and bad grammars are ValueErrors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from types import SimpleNamespace

from jaxserve.core.structured_output import (StructuredOutputManager, allowed_tokens_mask,
                                             step_bitmask)
from jaxserve.default_model import default_model_path
from jaxserve.models.hf_loader import read_hf_config
from jaxserve.models.tokenizer import HFTokenizer, load_hf_tokenizer
from jaxserve.models.tokenizer_builders import infer_token_types, sentencepiece_bpe
from jaxserve.sampling_params import StructuredOutputsParams


def _sentencepiece() -> HFTokenizer:
    words = ["hello", "wor", "ld", "12", "3", "{", "}", '"', ":", ",", "a", "b", "ab", "yes",
             "no", "\u2581the"]
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + words
    scores = [0.0] * 3 + [0.0] * 256 + [-float(i) for i in range(len(words))]
    tok = sentencepiece_bpe(pieces, scores, infer_token_types(pieces, 0, (1, 2)), unk_id=0)
    return HFTokenizer(tok, {"add_bos_token": True}, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module", params=["hf", "sentencepiece"])
def manager(request) -> StructuredOutputManager:
    if request.param == "hf":
        tok = load_hf_tokenizer(default_model_path(), read_hf_config(Path(default_model_path())))
        return StructuredOutputManager(tok, tok.vocab_size + 13, [tok.eos_token_id])  # padded
    tok = _sentencepiece()
    return StructuredOutputManager(tok, tok.vocab_size, [tok.eos_token_id])


def _bits(mask: np.ndarray, vocab_size: int) -> np.ndarray:
    return np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab_size]


def test_a_requests_mask_is_its_grammars_and_its_allowed_tokens(manager):
    so = manager.request(StructuredOutputsParams(regex=r"(ab|[0-9]){1,5}"))
    while not so.ready():
        pass
    V = manager.vocab_size
    ids = list(range(0, V, 7))
    allowed = allowed_tokens_mask(ids, V)
    assert np.flatnonzero(_bits(allowed, V)).tolist() == ids
    grammar, both, alone = step_bitmask([
        SimpleNamespace(structured_output=so, allowed_tokens_mask=None),
        SimpleNamespace(structured_output=so, allowed_tokens_mask=allowed),
        SimpleNamespace(structured_output=None, allowed_tokens_mask=allowed)])
    assert (_bits(both, V) == (_bits(grammar, V) & _bits(allowed, V))).all()
    assert (alone == allowed).all() and 0 < _bits(both, V).sum() < _bits(grammar, V).sum()


def _walk(manager: StructuredOutputManager, params: StructuredOutputsParams, seed: int,
          eos: int) -> bytes:
    so = manager.request(params)
    while not so.ready():
        pass
    rng = np.random.default_rng(seed)
    tokens = []
    for _ in range(200):
        mask = step_bitmask([SimpleNamespace(structured_output=so,
                                             allowed_tokens_mask=None)])  # i32[1, W]
        allowed = np.flatnonzero(_bits(mask, manager.vocab_size))
        assert len(allowed) > 0
        token = int(rng.choice(allowed))
        assert so.accept(token)
        if token != eos:
            tokens.append(token)
        if so.is_terminated:
            break
    assert so.is_terminated
    return manager.tokenizer.decode_bytes(tokens)


@pytest.mark.parametrize("seed", range(4))
def test_random_walks_over_the_mask_spell_matches(manager, seed):
    eos = manager.tokenizer.eos_token
    text = _walk(manager, StructuredOutputsParams(regex=r"(ab|[0-9]){1,5}"), seed, eos)
    assert re.fullmatch(rb"(ab|[0-9]){1,5}", text)
    text = _walk(manager, StructuredOutputsParams(choice=["hello world", "yes"]), seed, eos)
    assert text in (b"hello world", b"yes")
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"],
              "additionalProperties": False}
    assert json.loads(_walk(manager, StructuredOutputsParams(json=schema), seed, eos)) in (
        {"a": 1}, {"a": 2})


def test_one_compile_per_grammar_text_and_one_matcher_per_request(manager):
    first = manager.request(StructuredOutputsParams(regex="x+y"))
    second = manager.request(StructuredOutputsParams(regex="x+y"))
    assert first.template is second.template
    while not (first.ready() and second.ready()):
        pass
    assert first.matcher is not second.matcher


@pytest.mark.parametrize("params, field", [
    (StructuredOutputsParams(regex="a{2,1}"), "regex"),
    (StructuredOutputsParams(grammar="start: undefined_rule"), "grammar"),
    (StructuredOutputsParams(json={"type": "object", "required": 5}), "json"),
])
def test_bad_grammars_are_value_errors_naming_the_field(manager, params, field):
    with pytest.raises(ValueError, match=f"structured_outputs.{field} is invalid"):
        manager.validate(params)
