"""Chat templates: the model's own Jinja template (from GGUF metadata or tokenizer_config.json).

Rendered as transformers and llama.cpp's Jinja runners do: a sandboxed environment with
`trim_blocks`/`lstrip_blocks`, the variables `messages`, `add_generation_prompt`, `bos_token`,
`eos_token`, and `raise_exception` for templates that reject a conversation.
"""

from __future__ import annotations

import datetime
import functools

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jaxkv.models.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant")


class ChatTemplateError(ValueError):
    """The template rejected the conversation (its own `raise_exception`)."""


def _raise(message: str):
    raise ChatTemplateError(message)


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


def _checked(messages) -> list[dict[str, str]]:
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not {"role", "content"} <= set(message):
            raise ValueError(f"messages[{i}]={message!r}: expected a dict with role and content")
        if message["role"] not in ROLES:
            raise ValueError(f"messages[{i}] role={message['role']!r}: use one of {ROLES}")
        checked.append({"role": message["role"], "content": str(message["content"])})
    if not checked:
        raise ValueError("messages is empty: give at least one message")
    return checked


def render_chat(tokenizer: Tokenizer, messages, add_generation_prompt: bool = True) -> str:
    """The prompt text for `messages` (a string is one user message) in the model's template."""
    if tokenizer.chat_template is None:
        raise ValueError(
            "this tokenizer has no chat template (the model ships none): give a plain prompt"
        )
    special = {
        name: tokenizer.token(token_id) if token_id is not None else ""
        for name, token_id in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id))
    }
    return _compiled(tokenizer.chat_template).render(
        messages=_checked(messages), add_generation_prompt=add_generation_prompt, **special
    )


def encode_chat(tokenizer: Tokenizer, messages, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of the rendered conversation (the template writes any BOS itself)."""
    return tokenizer.encode(render_chat(tokenizer, messages, add_generation_prompt), add_bos=False)


_CONTENT_MARK = "\u2063CONTENT\u2063"


def chat_halves(tokenizer: Tokenizer, system: str | None = None) -> tuple[str, str]:
    """The chat text before and after one user message's content (the generation prompt
    included; after an optional system message): a long context that several questions share
    is `before + context`, each question `question + after`."""
    messages = [] if system is None else [{"role": "system", "content": system}]
    text = render_chat(tokenizer, [*messages, {"role": "user", "content": _CONTENT_MARK}])
    before, after = text.split(_CONTENT_MARK)
    return before, after
