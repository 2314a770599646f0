"""Chat templates rendered in a sandbox, within a time and a size limit.

A chat template is code: the model's comes from its repository, and with
`--trust-request-chat-template` a request may bring its own. Both render here, in
jinja2's ImmutableSandboxedEnvironment (no attribute access to internals, no mutation
of the inputs, transformers' globals: raise_exception, strftime_now, tojson, dict,
namespace), with what the sandbox leaves open closed too:

  * time: a render that runs past its time limit (default MAX_RENDER_SECONDS) is
    stopped (a trace function on the template's own code checks the clock on each line
    it runs, loops included);
  * size: every string or list a template builds - output, `~`, `+`, `*`, `%`,
    `{% set %}` blocks, padding filters and str methods - is bounded by the output limit
    (default MAX_OUTPUT_CHARS), checked before it is built, so no render can exhaust
    memory;
  * `**` whose result would pass MAX_POWER_BITS is refused (a huge integer power never
    returns to the interpreter, so no clock could stop it).

Anything refused raises `TemplateLimitError` (a ValueError: the request's fault, a 400).
The two limits are an operator's settings (the tokenizer service's
`--chat-template-render-timeout` and `--chat-template-max-output-chars`): a caller
renders under other limits inside `with template_limits(TemplateLimits(...))`; outside
one (the offline `LLM`), the defaults apply.
The result equals transformers' `apply_chat_template(..., tokenize=False)` for the same
template and inputs (same environment options, message normalization, continue-final-
message cut).
"""

from __future__ import annotations

import functools
import json
import re
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_RENDER_SECONDS = 5.0
MAX_OUTPUT_CHARS = 16 * 1024 * 1024
MAX_TEMPLATE_CHARS = 1024 * 1024
MAX_EXPONENT = 4096
MAX_POWER_BITS = 1 << 16
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_PADDING_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs", "format"})
_WIDE_FORMAT = re.compile(r"\d{8,}")  # a width or precision of 10^7 or more


class TemplateLimitError(ValueError):
    """A chat template did something the sandbox does not allow, or took too long."""


@dataclass(frozen=True)
class TemplateLimits:
    """How long one render may run, and how large any value it builds may be."""

    render_timeout_s: float = MAX_RENDER_SECONDS
    max_output_chars: int = MAX_OUTPUT_CHARS

    def __post_init__(self) -> None:
        if not self.render_timeout_s > 0 or self.max_output_chars < 1:
            raise ValueError(f"chat template limits must be positive, got "
                             f"{self.render_timeout_s:g} s and {self.max_output_chars} chars")


# The limits of the renders on this thread or task (None: the module's defaults, read
# when a render starts so that they stay patchable).
_limits: ContextVar[TemplateLimits | None] = ContextVar("chat_template_limits", default=None)


@contextmanager
def template_limits(limits: TemplateLimits | None) -> Iterator[None]:
    """Render under `limits` inside this block (None: the defaults)."""
    token = _limits.set(limits)
    try:
        yield
    finally:
        _limits.reset(token)


def current_limits() -> TemplateLimits:
    return _limits.get() or TemplateLimits(MAX_RENDER_SECONDS, MAX_OUTPUT_CHARS)


def _max_chars() -> int:
    limits = _limits.get()
    return MAX_OUTPUT_CHARS if limits is None else limits.max_output_chars


def _check_size(value: Any) -> Any:
    if isinstance(value, (str, list, tuple)) and len(value) > _max_chars():
        _too_big()
    return value


def _too_big() -> None:
    raise TemplateLimitError(f"The chat template built a value of more than "
                             f"{_max_chars()} characters or items.")


def _planned_size(value: Any) -> int:
    return len(value) if isinstance(value, (str, list, tuple)) else 0


class _GenerationTag(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (assistant-token masks):
    the body renders as is (no mask is needed to build a prompt)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _TemplateDict:
    """transformers' `dict` global: building dicts, no type to reach through."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """transformers' `namespace`: no underscore-prefixed attributes."""

    def __init__(*args, **kwargs):  # noqa: N805 - jinja's own signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, _check_size(value))

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes, got {name!r}.")


class ChatTemplateEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with its open ends bounded (see the module docstring)."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def call_binop(self, context, operator, left, right):
        if operator == "**" and _huge_power(left, right):
            raise TemplateLimitError("The chat template raised a number to too large a power.")
        if operator == "*":
            count = right if isinstance(right, int) else left if isinstance(left, int) else 1
            if max(_planned_size(left), _planned_size(right)) * max(count, 0) > _max_chars():
                _too_big()
        if operator == "+" and _planned_size(left) + _planned_size(right) > _max_chars():
            _too_big()
        if operator == "%" and isinstance(left, str) and _WIDE_FORMAT.search(left):
            raise TemplateLimitError("The chat template formats a field too wide.")
        return _check_size(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
        if getattr(__obj, "__name__", None) in _PADDING_METHODS and isinstance(
                getattr(__obj, "__self__", None), str):
            _check_args(args, kwargs)
        return _check_size(super().call(__context, __obj, *args, **kwargs))

    @staticmethod
    def concat(parts):  # `{% set x %}...{% endset %}`, macros, caller()
        return _bounded_join(parts)


def _huge_power(base: Any, exponent: Any) -> bool:
    """A power whose integer result would pass MAX_POWER_BITS (or whose exponent passes
    MAX_EXPONENT): computed in one C call, it could not be stopped."""
    if not isinstance(exponent, (int, float)) or isinstance(exponent, bool):
        return False
    if abs(exponent) > MAX_EXPONENT:
        return True
    return isinstance(base, int) and abs(base).bit_length() * abs(exponent) > MAX_POWER_BITS


def _check_args(args, kwargs) -> None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and value > _max_chars():
            raise TemplateLimitError("The chat template pads a string past the size limit.")
        if isinstance(value, str) and _WIDE_FORMAT.search(value):
            raise TemplateLimitError("The chat template formats a field too wide.")


def _bounded_join(parts) -> str:
    out, size, limit = [], 0, _max_chars()
    for part in parts:
        part = str(part)
        size += len(part)
        if size > limit:
            _too_big()
        out.append(part)
    return "".join(out)


def _bounded_filter(name: str, function):
    @functools.wraps(function)
    def bounded(*args, **kwargs):
        _check_args(args[1:], kwargs)
        return _check_size(function(*args, **kwargs))

    return bounded


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' filter: no HTML escaping; options exposed
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


@functools.lru_cache(maxsize=64)
def compile_chat_template(source: str) -> jinja2.Template:
    """The sandboxed, bounded template for `source` (cached: model templates repeat)."""
    if len(source) > MAX_TEMPLATE_CHARS:
        raise TemplateLimitError(f"The chat template is longer than {MAX_TEMPLATE_CHARS} "
                                 f"characters.")
    env = ChatTemplateEnvironment(trim_blocks=True, lstrip_blocks=True,
                                  extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    for name in ("center", "indent", "wordwrap", "format", "join", "replace", "truncate"):
        env.filters[name] = _bounded_filter(name, env.filters[name])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, dict=_TemplateDict(),
                       namespace=_Namespace,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    template = env.from_string(source)
    namespace = template.root_render_func.__globals__  # the compiled module's own
    namespace["str_join"] = namespace["markup_join"] = _bounded_join  # `~`
    return template


def render(source: str, **variables: Any) -> str:
    """Render `source` with `variables`, within the time and size limits."""
    template = compile_chat_template(source)
    timeout_s = current_limits().render_timeout_s
    deadline = time.monotonic() + timeout_s

    def on_line(frame, event, arg):
        if time.monotonic() > deadline:
            raise TemplateLimitError(f"The chat template took more than "
                                     f"{timeout_s:g} s to render.")
        return on_line

    def on_call(frame, event, arg):  # trace lines of the template's own code only
        return on_line if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        return _bounded_join(template.generate(**variables))
    finally:
        sys.settrace(previous)


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
