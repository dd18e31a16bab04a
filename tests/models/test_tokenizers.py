"""Tokenizers: the stories260K golden, llama2.c merge semantics, HF parity, streaming."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hf_checkpoints import Factory
from jaxserve.models.gguf_loader import load_gguf
from jaxserve.models.llama2c_loader import llama2c_tokenizer, read_llama2c_vocab
from jaxserve.models.tokenizer import HFTokenizer, IncrementalDetokenizer, Tokenizer

GOLDEN_PROMPT = "Once upon a time"
GOLDEN_PROMPT_IDS = [1, 403, 407, 261, 378]
GOLDEN_IDS = [
    1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396,
    267, 337, 410, 408, 419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394, 261,
    370, 432, 352, 266, 268, 388, 426, 338, 391, 266, 267, 337, 335, 312, 432, 398, 312, 286, 267,
    414, 270, 333, 415, 426, 13, 438, 310]
GOLDEN_TEXT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in "
               "the park. One day, she saw a big, red ball. She wanted to play with it, but it was "
               "too high.\nLily")
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Tell me about the sea."},
            {"role": "assistant", "content": "It is big."},
            {"role": "user", "content": "And the stars?"}]
# Characters the stories vocab lacks (byte fallback) or splits into several byte tokens.
FIXTURE_OK = [HealthCheck.function_scoped_fixture]  # module fixtures, read only
SP_ALPHABET = list("abcdefghilmnorstuwy OLS,.!'\n") + ["é", "日", "☃", "🙂"]


@pytest.fixture(scope="module")
def tok512(stories_dir: Path) -> HFTokenizer:
    return llama2c_tokenizer(stories_dir / "tok512.bin", 512)


@pytest.fixture(scope="module")
def tok512_vocab(stories_dir: Path) -> tuple[list[str], list[float]]:
    return read_llama2c_vocab(stories_dir / "tok512.bin", 512)


@pytest.fixture(scope="module", params=["tok512", "gguf"])
def stories_tokenizer(request: pytest.FixtureRequest, stories_dir: Path) -> Tokenizer:
    if request.param == "tok512":
        return llama2c_tokenizer(stories_dir / "tok512.bin", 512)
    tokenizer = load_gguf(stories_dir / "stories260K.gguf").tokenizer
    assert tokenizer is not None
    return tokenizer


@pytest.fixture(scope="module")
def hf_dir(hf_checkpoint: Factory) -> Path:
    return hf_checkpoint("llama")


def reference_llama2c_encode(vocab: tuple[list[str], list[float]], text: str) -> list[int]:
    """llama2.c's encode, literally: rescan for the best-scoring pair after every merge."""
    pieces, scores = vocab
    lookup: dict[str, int] = {}
    for i, piece in enumerate(pieces[3:], start=3):  # 0-2: unk, BOS, EOS
        if not (piece.startswith("<0x") and len(piece) == 6):
            lookup.setdefault(piece, i)
    ids: list[int] = []
    for char in (" " + text if text else ""):
        if char in lookup:
            ids.append(lookup[char])
        else:
            ids.extend(pieces.index(f"<0x{b:02X}>") for b in char.encode())
    while True:
        best: tuple[float, int, int] | None = None
        for i in range(len(ids) - 1):
            merged = lookup.get(pieces[ids[i]] + pieces[ids[i + 1]])
            if merged is not None and (best is None or scores[merged] > best[0]):
                best = (scores[merged], i, merged)
        if best is None:
            return [1, *ids]
        ids[best[1]:best[1] + 2] = [best[2]]


def test_stories_tokenizer_encodes_golden_prompt(stories_tokenizer: Tokenizer) -> None:
    assert stories_tokenizer.encode(GOLDEN_PROMPT) == GOLDEN_PROMPT_IDS
    without_bos = stories_tokenizer.encode(GOLDEN_PROMPT, add_special_tokens=False)
    assert without_bos == GOLDEN_PROMPT_IDS[1:]


def test_stories_tokenizer_decodes_golden_ids(stories_tokenizer: Tokenizer) -> None:
    assert stories_tokenizer.decode(GOLDEN_IDS) == GOLDEN_TEXT
    assert stories_tokenizer.vocab_size == 512
    assert (stories_tokenizer.bos_token_id, stories_tokenizer.eos_token_id) == (1, 2)


def test_tok512_and_gguf_vocabularies_agree(tok512: HFTokenizer, stories_dir: Path) -> None:
    gguf_tok = load_gguf(stories_dir / "stories260K.gguf").tokenizer
    assert isinstance(gguf_tok, HFTokenizer)
    ids = list(range(3, 512))  # specials are spelled differently
    assert [gguf_tok.decode([1, i]) for i in ids] == [tok512.decode([1, i]) for i in ids]
    assert gguf_tok.vocab_size == tok512.vocab_size == 512


@settings(max_examples=60, deadline=None, suppress_health_check=FIXTURE_OK)
@given(text=st.text(alphabet=st.sampled_from(SP_ALPHABET), max_size=80))
def test_sentencepiece_encode_equals_llama2c_reference_and_round_trips(
        stories_tokenizer: Tokenizer, tok512_vocab: tuple[list[str], list[float]],
        text: str) -> None:
    ids = stories_tokenizer.encode(text)
    assert ids == reference_llama2c_encode(tok512_vocab, text)
    assert stories_tokenizer.decode(ids) == text


def test_sentencepiece_byte_fallback_for_unknown_characters(tok512: HFTokenizer) -> None:
    ids = tok512.encode("☃", add_special_tokens=False)
    snowman = "☃".encode()
    assert ids[-3:] == [3 + b for b in snowman]  # ids 3..258 are <0x00>..<0xFF>
    assert tok512.decode([1, *ids]) == "☃"


def test_sentencepiece_empty_text_is_only_bos(tok512: HFTokenizer) -> None:
    assert tok512.encode("") == [1]
    assert tok512.encode("", add_special_tokens=False) == []


def test_sentencepiece_long_prompt_round_trips(tok512: HFTokenizer) -> None:
    text = (GOLDEN_TEXT + " ") * 40  # ~5,000 characters
    ids = tok512.encode(text)
    assert len(ids) < len(text) / 2  # merges happened
    assert tok512.decode(ids) == text


def test_sentencepiece_skip_special_tokens(tok512: HFTokenizer) -> None:
    ids = [1, 403, 2]
    assert tok512.decode(ids) == "Once"
    # "\n<s>\n" and "\n</s>\n" in tok512.bin; the space is the piece's own ("\u2581Once")
    assert tok512.decode(ids, skip_special_tokens=False) == "\n<s>\n Once\n</s>\n"


def test_sentencepiece_rejects_bad_input(tok512: HFTokenizer, stories_dir: Path,
                                         tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no chat template"):
        tok512.apply_chat_template(MESSAGES)
    data = (stories_dir / "tok512.bin").read_bytes()
    (tmp_path / "short.bin").write_bytes(data[:-100])
    with pytest.raises(ValueError, match="truncated"):
        llama2c_tokenizer(tmp_path / "short.bin", 512)
    with pytest.raises(ValueError, match="bytes left"):
        llama2c_tokenizer(stories_dir / "tok512.bin", 500)
    bad = data[:4] + struct.pack("<fi", 0.0, 10_000) + data[12:]
    (tmp_path / "bad.bin").write_bytes(bad)
    with pytest.raises(ValueError, match="tokenizer"):
        llama2c_tokenizer(tmp_path / "bad.bin", 512)


def _stream(tokenizer: Tokenizer, prompt: list[int], output: list[int],
            chunks: list[int]) -> tuple[IncrementalDetokenizer, list[str]]:
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas, i, c = [], 0, 0
    while i < len(output):
        n = chunks[c % len(chunks)] if chunks else 1
        deltas.append(detok.push(output[i:i + n]))
        i, c = i + n, c + 1
    return detok, deltas


def _expected_output_text(tokenizer: Tokenizer, prompt: list[int], output: list[int]) -> str:
    full = tokenizer.decode(prompt + output)
    prompt_text = tokenizer.decode(prompt)
    assert full.startswith(prompt_text)
    return full[len(prompt_text):]


def test_incremental_detokenizer_holds_back_split_utf8(tok512: HFTokenizer) -> None:
    ids = tok512.encode("Lily saw a ☃ and 🙂 in the park.")
    prompt, output = ids[:3], ids[3:]
    detok, deltas = _stream(tok512, prompt, output, [1])
    assert "" in deltas  # the snowman's 3 byte tokens arrived one at a time
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == _expected_output_text(tok512, prompt, output)


def test_incremental_detokenizer_golden_stream(stories_tokenizer: Tokenizer) -> None:
    detok, deltas = _stream(stories_tokenizer, GOLDEN_IDS[:5], GOLDEN_IDS[5:], [1])
    assert GOLDEN_PROMPT + detok.text == GOLDEN_TEXT
    assert deltas[0] == ","


@settings(max_examples=30, deadline=None, suppress_health_check=FIXTURE_OK)
@given(text=st.text(alphabet=st.sampled_from(SP_ALPHABET), min_size=1, max_size=40),
       split=st.integers(0, 6), chunks=st.lists(st.integers(1, 4), max_size=4))
def test_incremental_detokenizer_concatenation_equals_full_decode(
        tok512: HFTokenizer, text: str, split: int, chunks: list[int]) -> None:
    ids = tok512.encode(text)
    prompt, output = ids[:min(split, len(ids))], ids[min(split, len(ids)):]
    assume("\ufffd" not in tok512.decode(prompt))  # a prompt that ends inside a character
    detok, deltas = _stream(tok512, prompt, output, chunks)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == _expected_output_text(tok512, prompt, output)


def test_incremental_detokenizer_flush_emits_an_unfinished_sequence(
        tok512: HFTokenizer) -> None:
    detok = IncrementalDetokenizer(tok512, [1, 403])
    partial = [3 + 0xE2, 3 + 0x98]  # first 2 of the snowman's 3 bytes
    assert detok.push(partial) == ""
    full = tok512.decode([1, 403, *partial])  # "Once" and U+FFFD for the unfinished bytes
    assert full.startswith("Once\ufffd")
    assert detok.flush() == full[len("Once"):]
    assert detok.text == full[len("Once"):]


def test_hf_tokenizer_matches_transformers(hf_dir: Path) -> None:
    from transformers import AutoTokenizer

    ours = HFTokenizer.from_directory(hf_dir)
    theirs = AutoTokenizer.from_pretrained(str(hf_dir))
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
    assert ours.vocab_size == len(theirs)
    for text in ["Once upon a time", "", "Café 日本 🙂 robot", " leading space\nnew line"]:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special)
            assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    expected = theirs.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = ours.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert ids == list(expected["input_ids"])
    assert ids[0] == ours.bos_token_id
    without = ours.apply_chat_template(MESSAGES, add_generation_prompt=False)
    assert ids[:len(without)] == without and len(ids) > len(without)


TOOLS = [{"type": "function", "function": {"name": "sea_depth", "parameters": {
    "type": "object", "properties": {"where": {"type": "string"}}}}}]
# Uses tools, a chat_template_kwargs variable and the special tokens, as real templates do.
TOOL_TEMPLATE = ("{{ bos_token }}{% if tools %}tools: {{ tools | tojson }}\n{% endif %}"
                 "{% if brief %}[brief]\n{% endif %}{% for m in messages %}"
                 "{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.mark.parametrize("template", [None, TOOL_TEMPLATE])
def test_hf_tokenizer_chat_template_options_match_transformers(hf_dir: Path,
                                                               template: str | None) -> None:
    from transformers import AutoTokenizer

    ours, theirs = HFTokenizer.from_directory(hf_dir), AutoTokenizer.from_pretrained(str(hf_dir))
    open_reply = [*MESSAGES, {"role": "assistant", "content": "The stars are "}]
    for conversation, options in [
            (MESSAGES, dict(add_generation_prompt=True, tools=TOOLS, brief=True)),
            (MESSAGES, dict(add_generation_prompt=False, tools=None, brief=False)),
            (open_reply, dict(continue_final_message=True, tools=TOOLS))]:
        want = theirs.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                          **options)
        assert ours.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                        **options) == want
        assert ours.apply_chat_template(conversation, chat_template=template, **options) == \
            theirs.encode(want, add_special_tokens=False)
    assert ours.apply_chat_template(open_reply, continue_final_message=True,
                                    tokenize=False).endswith("<|assistant|>\nThe stars are ")
    with pytest.raises(ValueError, match="add_generation_prompt and continue_final_message"):
        ours.apply_chat_template(open_reply, add_generation_prompt=True,
                                 continue_final_message=True)


def test_hf_tokenizer_call_vocab_and_specials_match_transformers(hf_dir: Path) -> None:
    from transformers import AutoTokenizer

    ours, theirs = HFTokenizer.from_directory(hf_dir), AutoTokenizer.from_pretrained(str(hf_dir))
    for text in ("Once upon a time", ["a robot", "by the sea", ""]):
        want = theirs(text)
        got = ours(text)
        assert got["input_ids"] == want["input_ids"]
        assert got["attention_mask"] == want["attention_mask"]
    assert ours.get_vocab() == theirs.get_vocab() and len(ours) == len(theirs)
    assert (ours.eos_token_id, ours.bos_token, ours.eos_token) == (
        theirs.eos_token_id, theirs.bos_token, theirs.eos_token)


def test_hf_tokenizer_token_strings_and_batch_decode_match_transformers(hf_dir: Path) -> None:
    from transformers import AutoTokenizer

    ours, theirs = HFTokenizer.from_directory(hf_dir), AutoTokenizer.from_pretrained(str(hf_dir))
    batch = [ours.encode(text) + [ours.eos_token_id]
             for text in ("Once upon a time", "Café 日本 🙂", "")]
    assert ours.eos_token_id in theirs.all_special_ids  # so skipping it is tested
    for skip in (False, True):
        assert ours.batch_decode(batch, skip_special_tokens=skip) == theirs.batch_decode(
            batch, skip_special_tokens=skip)
        for ids in batch:
            assert ours.convert_ids_to_tokens(ids, skip_special_tokens=skip) == \
                theirs.convert_ids_to_tokens(ids, skip_special_tokens=skip)
    assert ours.batch_decode(batch) == theirs.batch_decode(batch)  # HF's default: keep them
    assert ours.convert_ids_to_tokens(batch[0][1]) == theirs.convert_ids_to_tokens(batch[0][1])


def test_sentencepiece_vocab_and_a_given_chat_template(
        tok512: HFTokenizer, tok512_vocab: tuple[list[str], list[float]]) -> None:
    vocab = tok512.get_vocab()
    assert vocab[tok512_vocab[0][300].replace(" ", "\u2581")] == 300
    assert len(tok512) == tok512.vocab_size == len(vocab)
    text = tok512.apply_chat_template(MESSAGES[:1], chat_template=TOOL_TEMPLATE, tokenize=False)
    assert text == f"{tok512.bos_token}system: Be brief.{tok512.eos_token}\n"


def test_hf_tokenizer_incremental_detokenizer_with_split_utf8(hf_dir: Path) -> None:
    tok = HFTokenizer.from_directory(hf_dir)
    text = "The robot saw € and 🚀 by the sea."  # neither symbol is in the training text
    ids = tok.encode(text)
    detok, deltas = _stream(tok, ids[:4], ids[4:], [1])
    assert "" in deltas
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == _expected_output_text(tok, ids[:4], ids[4:])
    assert tok.decode(ids[:4]) + detok.text == text


@settings(max_examples=40, deadline=None, suppress_health_check=FIXTURE_OK)
@given(text=st.text(max_size=40))
def test_hf_tokenizer_round_trips_any_text(hf_dir: Path, text: str) -> None:
    tok = HFTokenizer.from_directory(hf_dir)
    assert tok.decode(tok.encode(text)) == text


def test_hf_tokenizer_without_template_raises(hf_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    tok = HFTokenizer.from_directory(tmp_path, bos_token_id=0, eos_token_id=1)
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(MESSAGES)


def test_hf_tokenizer_rejects_corrupt_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        HFTokenizer.from_directory(tmp_path)
