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
    `{% set %}` blocks, filters, str methods, `range`, `lipsum` - is bounded by the
    output limit (default MAX_OUTPUT_CHARS; a list item counts as 8 characters). Each
    operation's size is planned before it runs (template_plans.py) and refused when the
    plan passes the limit, so a refused render never allocates the value: no render can
    exhaust memory, and none spends long in one C call that no clock can stop;
  * `**` whose result would pass MAX_POWER_BITS is refused (a huge integer power never
    returns to the interpreter, so no clock could stop it).

Anything refused raises `TemplateLimitError` (a ValueError: the request's fault, a 400).
The two limits are an operator's settings (the tokenizer service's
`--chat-template-render-timeout` and `--chat-template-max-output-chars`): a caller
renders under other limits inside `with template_limits(TemplateLimits(...))`; outside
one (the offline `LLM`), the defaults apply.
A render equals jinja's own sandbox's for the same template and inputs (same
environment options); `chat_render.render_chat` is transformers' apply_chat_template
on top of it.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range
from jinja2.utils import _PassArg  # which filters take a context first (jinja 3.x)

from pagoda.tokenizer.template_plans import (
    PlannedTooBig, bounded_items, filter_plan, method_plan,
)
from pagoda.tokenizer.template_size import ITEM_CHARS, format_size, join_size, size_of, text_size

MAX_RENDER_SECONDS = 5.0
MAX_OUTPUT_CHARS = 16 * 1024 * 1024
MAX_TEMPLATE_CHARS = 1024 * 1024
MAX_EXPONENT = 4096
MAX_POWER_BITS = 1 << 16
_PADDING_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs", "format"})
_PADDING_FILTERS = frozenset({"center", "indent", "wordwrap", "format", "truncate"})
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
    """A backstop after an operation no plan covers (its inputs were bounded)."""
    if size_of(value, _max_chars()) > _max_chars():
        _too_big()
    return value


def _check_plan(size: int | None) -> None:
    if size is not None and size > _max_chars():
        _too_big()


def _too_big() -> None:
    raise TemplateLimitError(f"The chat template would build a value of more than "
                             f"{_max_chars()} characters (a list item counts as "
                             f"{ITEM_CHARS}).")


def _bounded(value: Any) -> Any:
    """`value`, or an iterator's items listed within the limit (template_plans)."""
    try:
        return bounded_items(value, _max_chars())
    except PlannedTooBig:
        _too_big()


def _bounded_output(value: Any) -> Any:
    """The environment's finalize: what `{{ }}` prints is sized before str() runs
    (a list of references to one long string prints as that string, many times)."""
    _check_plan(text_size(value, _max_chars()))
    return value


def _range(*args: int) -> range:
    try:
        return safe_range(*args)
    except OverflowError as exc:  # the sandbox's MAX_RANGE, as our clear refusal
        raise TemplateLimitError(f"The chat template asked for {exc}") from None


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


class _BoundedBuffer(list):
    """What a `{% set %}` block, a macro or a loop body writes before it is joined:
    refused as it passes the limit, not once the whole body has been written."""

    size = 0

    def append(self, part) -> None:
        self.size += text_size(part, _max_chars())
        if self.size > _max_chars():
            _too_big()
        list.append(self, part)

    def extend(self, parts) -> None:
        for part in parts:
            self.append(part)


class _BoundedCodeGenerator(CodeGenerator):
    """jinja's code generator, its output buffers bounded (`_BoundedBuffer`)."""

    def buffer(self, frame) -> None:
        frame.buffer = self.temporary_identifier()
        self.writeline(f"{frame.buffer} = environment.new_buffer()")


class ChatTemplateEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with its open ends bounded (see the module docstring)."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})
    code_generator_class = _BoundedCodeGenerator
    new_buffer = staticmethod(_BoundedBuffer)

    def call_binop(self, context, operator, left, right):
        if operator == "**" and _huge_power(left, right):
            raise TemplateLimitError("The chat template raised a number to too large a power.")
        if operator == "*":
            _check_plan(_product_size(left, right))
        if operator == "+":
            _check_plan(size_of(left, _max_chars()) + size_of(right, _max_chars()))
        if operator == "%" and isinstance(left, str):
            if _WIDE_FORMAT.search(left) or ("*" in left and _has_wide_int(right)):
                raise TemplateLimitError("The chat template formats a field too wide.")
            _check_plan(format_size(left, right, _max_chars()))
        return _check_size(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
        method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
        if getattr(method, "__name__", None) in _PADDING_METHODS and isinstance(
                getattr(method, "__self__", None), str):
            _check_args(args, kwargs)
        args = tuple(_bounded(a) for a in args)  # `''.join(generator)` sized first
        _check_plan(_planned(method_plan, __obj, args, kwargs))
        return _check_size(super().call(__context, __obj, *args, **kwargs))

    @staticmethod
    def concat(parts):  # `{% set x %}...{% endset %}`, macros, caller()
        return _bounded_join(parts)


def _planned(planner, *args) -> int | None:
    """A plan, or None where the call's arguments do not fit it (the call itself then
    raises its own error, on inputs that are all bounded)."""
    try:
        return planner(*args, _max_chars())
    except (TypeError, ValueError, AttributeError, OverflowError):
        return None


def _product_size(left: Any, right: Any) -> int:
    if isinstance(left, int) and isinstance(right, int):  # ints: bits, not characters
        if left.bit_length() + right.bit_length() > MAX_POWER_BITS:
            raise TemplateLimitError("The chat template multiplied numbers too large.")
        return 0
    count = right if isinstance(right, int) else left if isinstance(left, int) else 1
    return max(size_of(left, _max_chars()), size_of(right, _max_chars())) * max(count, 0)


def _has_wide_int(args: Any) -> bool:
    values = args if isinstance(args, tuple) else (args,)
    return any(isinstance(v, int) and v > _max_chars() for v in values)


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
    """`~`, `{% set %}` blocks, the render's output: each part sized before str()."""
    out, size, limit = [], 0, _max_chars()
    for part in parts:
        size += text_size(part, limit - size)
        if size > limit:
            _too_big()
        out.append(str(part))
    return "".join(out)


def _bounded_filter(name: str, function):
    """`function` (a jinja filter), refused before it runs when its plan passes the
    limit; an iterator it is given is listed within the limit first."""
    skip = 1 if _PassArg.from_obj(function) is not None else 0  # eval_ctx/env/context

    @functools.wraps(function)
    def bounded(*args, **kwargs):
        if len(args) > skip:
            args = (*args[:skip], _bounded(args[skip]), *args[skip + 1:])
            if name in _PADDING_FILTERS:
                _check_args(args[skip + 1:], kwargs)
            _check_plan(_planned(lambda *a: filter_plan(name, *a), args[skip],
                                 args[skip + 1:], kwargs))
        return _check_size(function(*args, **kwargs))

    return bounded


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' filter: no HTML escaping; options exposed
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@jinja2.pass_eval_context
def _join(eval_ctx, value, d="", attribute=None):
    """jinja's join, its items sized before they are joined (they are listed by then)."""
    if attribute is not None:
        value = list(map(jinja2.filters.make_attrgetter(eval_ctx.environment, attribute),
                         value))
    _check_plan(_planned(join_size, list(value), d))
    return jinja2.filters.do_join(eval_ctx, value, d)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


@functools.lru_cache(maxsize=64)
def compile_chat_template(source: str) -> jinja2.Template:
    """The sandboxed, bounded template for `source` (cached: model templates repeat)."""
    if len(source) > MAX_TEMPLATE_CHARS:
        raise TemplateLimitError(f"The chat template is longer than {MAX_TEMPLATE_CHARS} "
                                 f"characters.")
    env = ChatTemplateEnvironment(trim_blocks=True, lstrip_blocks=True,
                                  extensions=[_GenerationTag, jinja2.ext.loopcontrols],
                                  finalize=_bounded_output)
    env.filters["tojson"] = _tojson
    env.filters["join"] = _join
    for name in list(env.filters):
        env.filters[name] = _bounded_filter(name, env.filters[name])
    env.globals.update(raise_exception=_raise_exception, dict=_TemplateDict(), range=_range,
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
