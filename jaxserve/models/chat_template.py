"""Chat templates rendered as HF transformers renders them: jinja2 in a sandbox with HF's
globals, extra template variables, and `continue_final_message`."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

CONTENT_FORMATS = ("auto", "string", "openai")


def load_chat_template(value: str) -> str:
    """vLLM's `chat_template=`: a path to a template file, or the template itself."""
    if "{" not in value and Path(value).is_file():
        return Path(value).read_text()
    if "{" not in value:
        raise ValueError(f"chat_template: {value!r} is neither a file nor a jinja template")
    return value


# apply_chat_template's own arguments: as template variables they would change the call.
_RESERVED = frozenset({"conversation", "messages", "tools", "chat_template", "tokenize",
                       "add_generation_prompt", "continue_final_message"})


def template_variables(chat_template_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """vLLM's `chat_template_kwargs`, checked: extra variables for the template only."""
    if chat_template_kwargs is None:
        return {}
    if not isinstance(chat_template_kwargs, dict):
        raise ValueError("chat_template_kwargs must be a dict of template variables, got "
                         f"{type(chat_template_kwargs).__name__}")
    reserved = sorted(_RESERVED & set(chat_template_kwargs))
    if reserved:
        raise ValueError(f"chat_template_kwargs.{reserved[0]}: not a template variable (pass "
                         "it as its own argument)")
    return chat_template_kwargs


def text_content(content: Any, where: str) -> str:
    """A message's content as one string: a string, or a list of OpenAI text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list) or any(
            not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str)
            for p in content):
        raise ValueError(f"{where}: only a string or a list of text parts is supported")
    return "".join(p["text"] for p in content)


def render(template: str, conversation: list[dict[str, Any]], *,
           tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = False,
           continue_final_message: bool = False, variables: dict[str, Any] | None = None,
           ) -> str:
    """The conversation's text; `variables` (the special tokens, chat_template_kwargs) are
    the template's too, as HF passes them."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
    if continue_final_message and not conversation:
        raise ValueError("continue_final_message: there is no final message to continue")

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        text = env.from_string(template).render({
            **(variables or {}), "messages": conversation, "tools": tools,
            "add_generation_prompt": add_generation_prompt})
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template: {e}") from e
    return _open_final_message(text, conversation[-1]) if continue_final_message else text


def _open_final_message(text: str, final: dict[str, Any]) -> str:
    """`text` cut just after the final message's content, as HF does, so that the model goes
    on writing that message instead of starting a new one."""
    content = final.get("content")
    if isinstance(content, list):
        content = next((p["text"] for p in reversed(content)
                        if isinstance(p, dict) and "text" in p), None)
    if not isinstance(content, str) or content.strip() not in text:
        raise ValueError("continue_final_message: the final message's content does not appear "
                         "in the chat after the template is applied")
    start = text.rindex(content.strip())
    if text[start:start + len(content.lstrip())] == content:
        return text[:start + len(content.lstrip())]
    return text[:start + len(content.strip())]  # the template trimmed trailing spaces
