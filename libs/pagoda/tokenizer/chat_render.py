"""transformers' `apply_chat_template(..., tokenize=False)`, rendered in the sandbox.

The result equals transformers' for the same template and inputs (same message
normalization, reasoning aliases, continue-final-message cut); the render itself is
`template_sandbox.render`, bounded in time and size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pagoda.tokenizer.template_sandbox import render

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def render_chat(tokenizer: Any, conversation: Sequence[Mapping[str, Any]],
                tools: list | None, add_generation_prompt: bool,
                continue_final_message: bool, template_kwargs: Mapping[str, Any]) -> str:
    """transformers' `tokenizer.apply_chat_template(conversation, tools=...,
    tokenize=False, ...)`, sandboxed. `template_kwargs` may hold `chat_template` (a
    template, or the name of one of the tokenizer's) and `documents`."""
    kwargs = dict(template_kwargs)
    source = tokenizer.get_chat_template(kwargs.pop("chat_template", None), tools)
    documents = kwargs.pop("documents", None)
    chat = [_aliased({k: v for k, v in dict(m).items() if v is not None}) for m in conversation]
    final = None
    if continue_final_message:
        final = chat[-1].get("content")
        if not isinstance(final, str):
            raise ValueError("continue_final_message is set but the final message has no text.")
        chat[-1] = {**chat[-1], "content": final + _CONTINUE_TAG}
    text = render(source, messages=chat, tools=tools, documents=documents,
                  add_generation_prompt=add_generation_prompt,
                  **{**getattr(tokenizer, "special_tokens_map", {}), **kwargs})
    if final is None:
        return text
    if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
        raise ValueError("continue_final_message is set but the chat template drops the "
                         "final message.")
    cut = text.rindex(_CONTINUE_TAG.strip())
    return text[:cut] if text[cut:cut + len(_CONTINUE_TAG)] == _CONTINUE_TAG \
        else text[:cut].rstrip()


def _aliased(message: dict) -> dict:
    """transformers' reasoning aliases: `reasoning_content` (and `thinking`) from
    whichever name the message used."""
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message
