"""`--chat-template`: a file path or the template itself, as vLLM reads it.

Rule (vLLM's `load_chat_template`): the value is first opened as a file. If that
fails and it contains none of `{`, `}` or a newline, it was meant as a path, so the
failure is an error naming it. Otherwise it is the template written inline, with
backslash escapes (`\\n`) interpreted, since a shell flag cannot easily hold a newline.
"""

from __future__ import annotations

import codecs
from typing import Any

_JINJA_CHARS = "{}\n"


def load_chat_template(value: str | None) -> str | None:
    """The template text `value` stands for (None stays None)."""
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        if not any(c in value for c in _JINJA_CHARS):
            raise ValueError(f"The chat template {value!r} looks like a file path, but it "
                             f"could not be opened: {exc}") from exc
    return codecs.decode(value, "unicode_escape")


def use_chat_template(tokenizer: Any, value: str | None) -> None:
    """Make `value` (a path or an inline template; None: keep the model's) the
    tokenizer's chat template, so every chat request renders with it."""
    template = load_chat_template(value)
    if template is not None:
        tokenizer.chat_template = template
