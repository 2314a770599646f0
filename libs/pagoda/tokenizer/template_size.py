"""How large a value a chat-template operation would build, known before it is built.

The sandbox (template_sandbox.py) asks these planners first and refuses an operation
whose planned size passes its limit, so a refused render never allocates the value
(a check after building lets one C call allocate hundreds of MB first, and no clock
can stop it). Rules every planner keeps:

  * the unit is a character of text; a list or tuple costs ITEM_CHARS per item (its
    array of references), and an item made while consuming an iterator (whose
    elements may be fresh objects) costs OBJECT_CHARS;
  * a plan is an upper bound of the real size (never smaller), and close to it for
    what templates really do, so nothing a real template builds is refused;
  * planning allocates nothing large and takes time linear in its inputs; a walk
    over a container stops as soon as its total passes the limit it was given.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import jinja2.utils

ITEM_CHARS = 8
OBJECT_CHARS = 64
REPR_GROWTH = 10  # repr('\U000e0000') is 10 characters for one
JSON_GROWTH = 6  # json's '\u0000' is 6 for one
ESCAPE_GROWTH = 5  # markupsafe's '&#34;' is 5 for one
URL_GROWTH = 12  # one character, 4 UTF-8 bytes, '%XX' each
CASE_GROWTH = 3  # 'ﬃ'.upper() == 'FFI'
MAX_DEPTH = 64  # deeper nesting counts as past any limit (repr would recurse away)
SCALAR_CHARS = 32  # a float's or a bool's text, or an object we cannot see into


def size_of(value: Any, limit: int, depth: int = 0) -> int:
    """The size a value already built counts for: a string's length; a list's, tuple's
    or dict's references plus what its items count for, so that a list a loop grows
    (`ns.items + [text]`) counts the text it holds, not only its length."""
    if isinstance(value, str):
        return len(value)
    if depth > MAX_DEPTH:
        return limit + 1
    if isinstance(value, (list, tuple)):
        items: Iterable = value
    elif isinstance(value, Mapping):
        items = (x for pair in value.items() for x in pair)
    else:
        return 0
    total = ITEM_CHARS * len(value)
    for item in items:
        if total > limit:
            break
        if not isinstance(item, (int, float, bool)) and item is not None:
            total += size_of(item, limit - total, depth + 1)
    return total


def text_size(value: Any, limit: int) -> int:
    """An upper bound of len(str(value)): a string's length, a container's repr."""
    if isinstance(value, str):
        return len(value)
    return repr_size(value, limit)


def repr_size(value: Any, limit: int, depth: int = 0) -> int:
    """An upper bound of len(repr(value)) (a number past `limit` once it passes it)."""
    if depth > MAX_DEPTH:
        return limit + 1
    if isinstance(value, str):
        return len(value) + 2 if value.isprintable() else REPR_GROWTH * len(value) + 2
    if isinstance(value, bool) or value is None:
        return 5
    if isinstance(value, int):
        return value.bit_length() // 3 + 2
    if isinstance(value, jinja2.utils.Namespace):  # '<Namespace {...}>'
        return 12 + repr_size(value._Namespace__attrs, limit, depth + 1)
    if isinstance(value, Mapping):
        return _sum_items(((k, v) for k, v in value.items()), limit, depth, pair=True)
    if isinstance(value, (list, tuple, set, frozenset)):
        return _sum_items(value, limit, depth)
    return SCALAR_CHARS


def _sum_items(items: Iterable, limit: int, depth: int, pair: bool = False) -> int:
    total = 16  # brackets, a type's name (dict_items([...]))
    for item in items:
        if pair:
            key, value = item
            total += repr_size(key, limit - total, depth + 1) + 2
            item = value
        total += repr_size(item, limit - total, depth + 1) + 2
        if total > limit:
            break
    return total


def json_size(value: Any, limit: int, indent: int | str | None = None, depth: int = 0) -> int:
    """An upper bound of len(json.dumps(value, indent=indent, ensure_ascii=False))."""
    if depth > MAX_DEPTH:
        return limit + 1
    if isinstance(value, str):
        if value.isprintable():
            return len(value) + value.count('"') + value.count("\\") + 2
        return JSON_GROWTH * len(value) + 2
    if isinstance(value, (Mapping, list, tuple)):
        step = 2 + (len(indent) if isinstance(indent, str) else indent or 0) * (depth + 1)
        total = 2 + step
        pairs = value.items() if isinstance(value, Mapping) else ((None, v) for v in value)
        for key, item in pairs:
            if key is not None:
                total += json_size(str(key), limit - total) + 2
            total += json_size(item, limit - total, indent, depth + 1) + step
            if total > limit:
                break
        return total
    return repr_size(value, limit, depth)


def pprint_size(value: Any, limit: int, indent: int = 0, depth: int = 0) -> int:
    """An upper bound of len(pprint.pformat(value)): every item may go on its own line,
    indented as deep as pformat indents it, and a string it wraps is cut at whitespace."""
    if depth > MAX_DEPTH:
        return limit + 1
    line = indent + 3  # a newline, the indentation, a comma
    if isinstance(value, str):
        size = repr_size(value, limit)
        if size + indent <= 80:
            return size
        cuts = value.count(" ") + value.count("\n") + value.count("\t") + 1
        return size + cuts * (line + 2)
    if isinstance(value, Mapping):
        total = 2
        for key, item in value.items():
            key_size = repr_size(key, limit)
            total += key_size + line + pprint_size(item, limit - total, indent + key_size + 2,
                                                   depth + 1)
            if total > limit:
                break
        return total
    if isinstance(value, (list, tuple, set, frozenset)):
        total = 2
        for item in value:
            total += line + pprint_size(item, limit - total, indent + 1, depth + 1)
            if total > limit:
                break
        return total
    return repr_size(value, limit, depth)


def format_size(fmt: str, args: Any, limit: int) -> int:
    """An upper bound of len(fmt % args) or len(fmt.format(*args)): each field of `fmt`
    may hold the longest argument (a mapping's fields may name one again and again).
    Widths are checked apart (a wide field is refused by its number)."""
    if isinstance(args, Mapping):
        values = list(args.values())
    elif isinstance(args, tuple):
        values = list(args)
    else:
        values = [args]
    longest = max((text_size(v, limit) for v in values), default=0)
    fields = fmt.count("%") + fmt.count("{")
    return len(fmt) + fields * longest


def join_size(parts: list, separator: str, limit: int) -> int:
    """len(separator.join(str(p) for p in parts)), bounded."""
    total = len(separator) * max(len(parts) - 1, 0)
    for part in parts:
        total += text_size(part, limit - total)
        if total > limit:
            break
    return total


def replace_size(text: str, old: str, new: str, count: int = -1) -> int:
    """len(text.replace(old, new, count)), counted (str.count allocates nothing)."""
    hits = len(text) + 1 if old == "" else text.count(old)
    if count is not None and 0 <= count < hits:
        hits = count
    return len(text) + hits * (len(new) - len(old))


def lines_size(text: str, per_line: int) -> int:
    """len(text) plus `per_line` characters on each of its lines (indent, wordwrap)."""
    return len(text) + (text.count("\n") + 1) * per_line
