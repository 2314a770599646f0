"""A call whose arguments are one JSON object after a marker (deepseek_v3, kimi_k2, openai):
the stable prefix of that object's text while it streams."""

from __future__ import annotations

from pagoda.services.gateway.openai.tool_parsers.base import CallSoFar
from pagoda.services.gateway.openai.tool_parsers.json_scan import skip_ws, value_end


def json_arguments(name: str | None, text: str, closed: bool) -> CallSoFar:
    """The call `name` whose arguments object starts (after whitespace) in `text`.
    Complete once the object ended and the call's end marker came (`closed`); while it
    streams, `arguments` is the object's text so far (trailing whitespace held back)."""
    if not name:
        return CallSoFar(None)
    start = skip_ws(text, 0)
    if start >= len(text):
        return CallSoFar(name, "", False)
    if text[start] != "{":
        return CallSoFar(None)  # not an object: malformed
    end = value_end(text, start)
    arguments = text[start:end] if end is not None else text[start:].rstrip()
    return CallSoFar(name, arguments, closed and end is not None and not text[end:].strip())
