"""The planned size of each filter, str method and global a chat template may call.

`filter_plan(name, value, args, kwargs, limit)` and `method_plan(...)` answer the size
of what the call would build (template_size.py's rules: an upper bound, computed
without building), or None for a call that builds nothing larger than its inputs.
An input that is an iterator (a `map`, `select` or `batch` result) cannot be sized
before it is consumed: `bounded_items` consumes it counting OBJECT_CHARS per item
and stops at the limit, so a filter that lists it never holds more.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from pagoda.tokenizer.template_size import (
    CASE_GROWTH, ESCAPE_GROWTH, ITEM_CHARS, OBJECT_CHARS, URL_GROWTH, format_size, join_size,
    json_size, lines_size, pprint_size, replace_size, size_of, text_size,
)


class PlannedTooBig(Exception):
    """An iterator passed the size limit while being consumed."""


def bounded_items(value: Any, limit: int) -> Any:
    """`value` as is, or an iterator's items as a list of at most limit/OBJECT_CHARS."""
    if not isinstance(value, Iterator):
        return value
    items: list = []
    size = 0
    for item in value:
        items.append(item)
        size += OBJECT_CHARS + size_of(item, limit - size)
        if size > limit:
            raise PlannedTooBig
    return items


def _escaped_size(value: Any, limit: int) -> int:
    if not isinstance(value, str):
        return ESCAPE_GROWTH * text_size(value, limit)
    # markupsafe: & < > " ' become 4 or 5 characters
    return len(value) + 4 * sum(value.count(c) for c in "&<>\"'")


def _case_size(value: Any, limit: int) -> int:
    size = text_size(value, limit)
    return size if isinstance(value, str) and value.isascii() else CASE_GROWTH * size


def _listed_size(value: Any, per_item: int = ITEM_CHARS) -> int:
    try:
        return per_item * len(value)
    except TypeError:  # not sized (consumed by bounded_items first)
        return 0


def _words(text: Any) -> int:
    text = text if isinstance(text, str) else ""
    return text.count(" ") + text.count("\n") + text.count("\t") + 1


def _wordwrap(value, limit, width=79, break_long_words=True, wrapstring=None, *_, **__):
    text = value if isinstance(value, str) else ""
    lines = len(text) // max(int(width), 1) + text.count("\n") + 1
    # textwrap holds every chunk (a word, a hyphen's part) as its own string
    chunks = _words(text) + text.count("-") + lines
    return lines_size(text, 0) + lines * len(wrapstring or "\n") + OBJECT_CHARS * chunks


def _urlize(value, limit, trim_url_limit=None, nofollow=False, target=None, rel=None,
            *_, **__):
    link = 64 + len(str(target or "")) + len(str(rel or ""))
    return 2 * _escaped_size(value, limit) + _words(value) * link


def _sum(value, limit, attribute=None, start=0, *_, **__):
    if not isinstance(start, (list, tuple)):
        return None  # numbers (strings are refused by sum itself)
    total = ITEM_CHARS * len(start)
    for item in value if isinstance(value, (list, tuple)) else ():
        total += size_of(item, limit - total)
        if total > limit:
            break
    return total


# filter name -> plan(value, limit, *args, **kwargs); the value is already listed
# (bounded_items) where it was an iterator.
FILTER_PLANS = {
    "center": lambda v, limit, width=80, *_: max(text_size(v, limit), int(width)),
    "indent": lambda v, limit, width=4, *_, **__: lines_size(
        v if isinstance(v, str) else "", len(width) if isinstance(width, str) else int(width)),
    "wordwrap": _wordwrap,
    "format": lambda v, limit, *args, **kwargs: format_size(
        v, kwargs if kwargs else tuple(args), limit),
    "replace": lambda v, limit, old, new, count=None, *_: replace_size(
        v, str(old), str(new), -1 if count is None else count) if isinstance(v, str)
    else text_size(v, limit) * max(len(str(new)), 1),
    "truncate": lambda v, limit, length=255, killwords=False, end="...", *_, **__:
        text_size(v, limit) + len(str(end)),
    "escape": _escaped_size, "e": _escaped_size, "forceescape": _escaped_size,
    "string": lambda v, limit: text_size(v, limit),
    "pprint": lambda v, limit: pprint_size(v, limit),
    "tojson": lambda v, limit, indent=None, *_, **kwargs: json_size(
        v, limit, kwargs.get("indent", indent)),
    "urlencode": lambda v, limit: (3 if isinstance(v, str) and v.isascii() else URL_GROWTH)
    * text_size(v, limit),
    "urlize": _urlize,
    "xmlattr": lambda v, limit, *_: ESCAPE_GROWTH * text_size(v, limit),
    "upper": _case_size, "lower": _case_size, "title": _case_size,
    "capitalize": _case_size,
    "list": lambda v, limit: _listed_size(v), "sort": lambda v, limit, *_, **__:
        _listed_size(v), "reverse": lambda v, limit: _listed_size(v),
    "unique": lambda v, limit, *_, **__: _listed_size(v),
    "dictsort": lambda v, limit, *_, **__: _listed_size(v, OBJECT_CHARS),
    "groupby": lambda v, limit, *_, **__: _listed_size(v, OBJECT_CHARS),
    "batch": lambda v, limit, linecount, *_: _listed_size(v) + OBJECT_CHARS * (
        _listed_size(v, 1) // max(int(linecount), 1) + 1),
    "slice": lambda v, limit, slices, *_: _listed_size(v) + OBJECT_CHARS * int(slices),
    "sum": _sum,
}


def filter_plan(name: str, value: Any, args: tuple, kwargs: dict, limit: int) -> int | None:
    plan = FILTER_PLANS.get(name)
    return None if plan is None else plan(value, limit, *args, **kwargs)


def _str_join(text, limit, parts, *_):
    return join_size(parts if isinstance(parts, (list, tuple)) else list(parts), text, limit)


def _split(text, limit, sep=None, maxsplit=-1, *_, **__):
    pieces = _words(text) if sep is None else text.count(str(sep)) + 1
    if isinstance(maxsplit, int) and 0 <= maxsplit < pieces:
        pieces = maxsplit + 1
    return (ITEM_CHARS + OBJECT_CHARS) * pieces


def _translate(text, limit, table=None, *_):
    widest = max((text_size(v, limit) for v in table.values()), default=1) \
        if isinstance(table, Mapping) else 1
    return len(text) * max(widest, 1)


# str method name -> plan(the string, limit, *args, **kwargs)
STR_METHOD_PLANS = {
    "center": lambda s, limit, width, *_: max(len(s), int(width)),
    "ljust": lambda s, limit, width, *_: max(len(s), int(width)),
    "rjust": lambda s, limit, width, *_: max(len(s), int(width)),
    "zfill": lambda s, limit, width: max(len(s), int(width)),
    "expandtabs": lambda s, limit, tabsize=8: len(s) + s.count("\t") * max(int(tabsize), 0),
    "replace": lambda s, limit, old, new, count=-1: replace_size(s, old, new, count),
    "join": _str_join,
    "format": lambda s, limit, *args, **kwargs: format_size(
        s, (*args, *kwargs.values()), limit),
    "format_map": lambda s, limit, mapping: format_size(s, mapping, limit),
    "split": _split, "rsplit": _split,
    "splitlines": lambda s, limit, *_, **__: (ITEM_CHARS + OBJECT_CHARS) * (
        s.count("\n") + s.count("\r") + 1),
    "upper": _case_size, "lower": _case_size, "title": _case_size,
    "capitalize": _case_size, "swapcase": _case_size, "casefold": _case_size,
    "encode": lambda s, limit, *_, **__: len(s) if s.isascii() else 4 * len(s),
    "translate": _translate,
}


def method_plan(obj: Any, args: tuple, kwargs: dict, limit: int) -> int | None:
    """The plan of calling `obj` (a bound method, a global), or None."""
    obj = getattr(obj, "__wrapped__", obj)  # the sandbox's wrapper of str.format
    owner = getattr(obj, "__self__", None)
    name = getattr(obj, "__name__", None)
    if isinstance(owner, str) and name in STR_METHOD_PLANS:
        return STR_METHOD_PLANS[name](owner, limit, *args, **kwargs)
    if name == "fromkeys":  # every key holds the value
        value = args[1] if len(args) > 1 else None
        return _listed_size(args[0], OBJECT_CHARS + size_of(value, limit))
    if name == "generate_lorem_ipsum":  # the `lipsum` global: n paragraphs of words
        return _lipsum(*args, **kwargs)
    return None


def _lipsum(n=5, html=True, min=20, max=100):  # noqa: A002 - jinja's own names
    return int(n) * int(max) * 16  # a word and its space: at most 16 characters
