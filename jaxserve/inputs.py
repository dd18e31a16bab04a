"""vLLM's prompt types (`vllm.inputs`): a text, or token ids, as a typed dict."""

from __future__ import annotations

from typing import NotRequired, TypedDict


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # the text the ids came from, if any (reported back as is)


PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids"})
