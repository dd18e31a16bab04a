"""The tokenizer interface, streaming detokenisation, and the HF `tokenizer.json` tokenizer."""

from __future__ import annotations

import json
import shutil
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer as RustTokenizer

from jaxserve.models.chat_template import render

if TYPE_CHECKING:
    from jaxserve.models.llama_config import LlamaConfig

# Files that make up an HF tokenizer directory; copied verbatim when a checkpoint is converted.
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                      "chat_template.jinja", "chat_template.json")

# How many tokens before the first new one are decoded with it, so merges and leading-space
# rules see the same context as a full decode would.
_CONTEXT_TOKENS = 5


class Tokenizer(ABC):
    """Encode, decode and chat templates, with the parts of HF's tokenizer API that vLLM users
    call on `LLM.get_tokenizer()`."""
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    bos_token: str | None = None
    eos_token: str | None = None
    chat_template: str | None = None

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    @abstractmethod
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    @abstractmethod
    def get_vocab(self) -> dict[str, int]: ...

    @abstractmethod
    def convert_ids_to_tokens(self, ids: int | Sequence[int], skip_special_tokens: bool = False,
                              ) -> str | list[str]:
        """HF's: the vocabulary entry of one id, or of each."""

    @abstractmethod
    def batch_decode(self, sequences: Sequence[Sequence[int]],
                     skip_special_tokens: bool = False) -> list[str]:
        """HF's, whose default keeps the special tokens (unlike `decode` here)."""

    def __call__(self, text: str | list[str], add_special_tokens: bool = True,
                 ) -> dict[str, Any]:
        """HF's call: `input_ids` and `attention_mask`, for one text or a list of them."""
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens)
            return {"input_ids": ids, "attention_mask": [1] * len(ids)}
        batch = [self.encode(t, add_special_tokens) for t in text]
        return {"input_ids": batch, "attention_mask": [[1] * len(ids) for ids in batch]}

    def __len__(self) -> int:
        return self.vocab_size

    def apply_chat_template(self, conversation: list[dict[str, Any]],
                            tools: list[dict[str, Any]] | None = None, *,
                            chat_template: str | None = None,
                            add_generation_prompt: bool = False,
                            continue_final_message: bool = False, tokenize: bool = True,
                            **kwargs: Any) -> list[int] | str:
        """HF's `apply_chat_template`: the token ids (or the text, with `tokenize=False`);
        extra keywords are template variables (vLLM's chat_template_kwargs)."""
        template = chat_template or self.chat_template
        if not template:
            raise ValueError(f"{type(self).__name__} has no chat template")
        text = render(template, conversation, tools=tools,
                      add_generation_prompt=add_generation_prompt,
                      continue_final_message=continue_final_message,
                      variables={"bos_token": self.bos_token or "",
                                 "eos_token": self.eos_token or "", **kwargs})
        # The template writes the BOS itself, so the text is encoded without specials.
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def max_token_chars(self) -> int | None:
        """An upper bound on the characters of text one token stands for (None: unknown), so
        that a text too long for the context is refused before it is tokenised."""
        return None

    def to_json(self) -> str | None:
        """The vocabulary as HF `tokenizers` JSON (tokenizer.json's text), which structured
        outputs hand to llguidance; None where it has no such form."""
        return None


class IncrementalDetokenizer:
    """Turns a stream of output ids into text deltas (vLLM's prefix/read offset scheme).

    Each push decodes a short window that starts a few tokens back, and emits what it adds beyond
    the already-emitted part of that window. Text ending in U+FFFD (an incomplete UTF-8 sequence
    split across byte tokens) is held back until the next ids complete it.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_token_ids)
        self.read_offset = len(self.token_ids)
        self.prefix_offset = max(self.read_offset - _CONTEXT_TOKENS, 0)
        self.text = ""

    def _decode(self, start: int, stop: int | None = None) -> str:
        return self.tokenizer.decode(self.token_ids[start:stop],
                                     skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: Sequence[int]) -> str:
        self.token_ids.extend(token_ids)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (an unfinished UTF-8 sequence at the end of the output)."""
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset)
        delta = new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text += delta
        return delta


def _special_token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer(Tokenizer):
    """An HF `tokenizers` tokenizer (from `tokenizer.json`, or built in memory from a GGUF or
    llama2.c vocabulary) with its `tokenizer_config.json` entries; chat templates rendered with
    jinja2."""

    def __init__(self, tok: RustTokenizer, config: dict[str, Any] | None = None, *,
                 bos_token_id: int | None = None, eos_token_id: int | None = None,
                 directory: Path | None = None) -> None:
        """`config`: tokenizer_config.json's `bos_token`, `eos_token`, `add_bos_token`,
        `chat_template`; `directory`: where the files came from (copied on convert)."""
        self._tok = tok
        self._config = dict(config or {})
        self.directory = directory
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.bos_token = _special_token_content(self._config.get("bos_token"))
        self.eos_token = _special_token_content(self._config.get("eos_token"))
        self.bos_token_id = self._token_id(self.bos_token, bos_token_id)
        self.eos_token_id = self._token_id(self.eos_token, eos_token_id)
        if self.bos_token is None and self.bos_token_id is not None:
            self.bos_token = tok.id_to_token(self.bos_token_id)
        if self.eos_token is None and self.eos_token_id is not None:
            self.eos_token = tok.id_to_token(self.eos_token_id)
        self.add_bos_token = bool(self._config.get("add_bos_token", False))
        self.chat_template = self._find_chat_template()

    @classmethod
    def from_directory(cls, directory: str | Path, *, bos_token_id: int | None = None,
                       eos_token_id: int | None = None) -> HFTokenizer:
        directory = Path(directory)
        path = directory / "tokenizer.json"
        try:
            tok = RustTokenizer.from_file(str(path))
        except Exception as e:  # the Rust error says what is wrong with the JSON
            raise ValueError(f"{path}: cannot load tokenizer: {e}") from e
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        return cls(tok, config, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                   directory=directory)

    def save(self, dst: Path) -> None:
        """Into the empty directory `dst`: the files it was read from, or (built in memory)
        `tokenizer.json` and `tokenizer_config.json`."""
        if self.directory is not None:
            for name in HF_TOKENIZER_FILES:
                if (self.directory / name).is_file():
                    shutil.copy2(self.directory / name, dst / name)
            return
        (dst / "tokenizer.json").write_text(self._tok.to_str())
        config = self._config | {"bos_token": self.bos_token, "eos_token": self.eos_token}
        (dst / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))

    def _token_id(self, token: str | None, fallback: int | None) -> int | None:
        token_id = self._tok.token_to_id(token) if token is not None else None
        return token_id if token_id is not None else fallback

    def _find_chat_template(self) -> str | None:
        if self.directory is not None:
            jinja_file = self.directory / "chat_template.jinja"
            if jinja_file.exists():
                return jinja_file.read_text()
            json_file = self.directory / "chat_template.json"
            if json_file.exists():
                return json.loads(json_file.read_text()).get("chat_template")
        template = self._config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default")
        return template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch lets go of the GIL while it works (encode holds it: 2.2 s for a 1M-token
        # text, stalling the event loop although the server tokenises on a worker thread).
        ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if (add_special_tokens and self.add_bos_token and self.bos_token_id is not None
                and (not ids or ids[0] != self.bos_token_id)):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def max_token_chars(self) -> int | None:
        if self._tok.model.__class__.__name__ in ("WordPiece", "WordLevel"):
            return None  # these map a whole unknown word to one token
        # A vocabulary entry has one character per byte (byte-level) or per character.
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids: int | Sequence[int], skip_special_tokens: bool = False,
                              ) -> str | list[str]:
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        skip = {i for i, t in self._tok.get_added_tokens_decoder().items()
                if t.special} if skip_special_tokens else set()
        return [self._tok.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def batch_decode(self, sequences: Sequence[Sequence[int]],
                     skip_special_tokens: bool = False) -> list[str]:
        return self._tok.decode_batch([list(ids) for ids in sequences],
                                      skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        return self._tok.to_str()


def as_tokenizer(tokenizer: object) -> Tokenizer:
    """Ours as it is, or an HF transformers fast tokenizer wrapped as a checkpoint's is: its
    Rust tokenizer (added tokens included), special tokens and chat template."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, RustTokenizer):
        raise ValueError("tokenizer must be a jaxserve Tokenizer or an HF fast tokenizer (with "
                         f"a backend_tokenizer), got {type(tokenizer).__name__}")
    config = {name: getattr(tokenizer, name, None)
              for name in ("bos_token", "eos_token", "add_bos_token", "chat_template")}
    return HFTokenizer(backend, config)


def load_hf_tokenizer(directory: str | Path, model: LlamaConfig) -> HFTokenizer | None:
    """The tokenizer of an HF checkpoint directory, with the model's BOS and (first) EOS ids,
    or None when it has no `tokenizer.json`."""
    if not (Path(directory) / "tokenizer.json").exists():
        return None
    return HFTokenizer.from_directory(directory, bos_token_id=model.bos_token_id,
                                      eos_token_id=model.eos_token_id)
