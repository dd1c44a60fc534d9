"""Chat messages -> a prompt string through the checkpoint's chat template (``LLM.chat`` and the server's
``/v1/chat/completions``).

Messages are OpenAI's: ``{"role": str, "content": str | [{"type": "text", "text": str}, ...]}``. A list of
content parts is joined with newlines, as vLLM does for text-only parts; parts of any other type (images,
audio) are refused by name, since no served model reads them.
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2.sandbox

from jaxmamba.errors import RequestError


def load_chat_template(checkpoint: Path | None) -> str | None:
    """The chat template of a checkpoint directory (``tokenizer_config.json``), or None."""
    if checkpoint is None or not (checkpoint / "tokenizer_config.json").exists():
        return None
    template = json.loads((checkpoint / "tokenizer_config.json").read_text()).get("chat_template")
    if isinstance(template, list):  # transformers' named templates
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


def message_text(content, where: str) -> str:
    """A message's ``content`` as one string: a string as it is, a list of text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of content parts, "
                           f"not {type(content).__name__}")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise RequestError(f"{where}.content[{i}] must be a content part ({{'type': 'text', 'text': ...}})")
        if part["type"] != "text":
            raise RequestError(f"{where}.content[{i}] has type {part['type']!r}: only 'text' parts are supported")
        if not isinstance(part.get("text"), str):
            raise RequestError(f"{where}.content[{i}].text must be a string")
        texts.append(part["text"])
    return "\n".join(texts)


def normalize_messages(messages) -> list[dict]:
    """A conversation checked and with every ``content`` a string (``RequestError`` naming the bad message);
    fields besides ``role`` and ``content`` pass through to the template."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}] must be an object with 'role' and 'content'")
        if not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}].role must be a string")
        if "content" not in m:
            raise RequestError(f"messages[{i}] has no content")
        out.append({**m, "content": message_text(m["content"], f"messages[{i}]")})
    return out


def render_chat(template: str, messages, *, add_generation_prompt: bool = True, **template_kwargs) -> str:
    """The prompt string of one conversation (``RequestError`` if a message is malformed or the template
    fails on it)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise  # HF templates refuse a conversation through it
    try:
        return env.from_string(template).render(messages=normalize_messages(messages),
                                                add_generation_prompt=add_generation_prompt, **template_kwargs)
    except jinja2.TemplateError as e:
        raise RequestError(f"the chat template failed on these messages: {e}") from None


def _raise(message: str):
    raise jinja2.TemplateError(message)
