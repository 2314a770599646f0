"""Mistral tool calls after the `[TOOL_CALLS]` token: a JSON list
`[{"name": ..., "arguments": {...}}, ...]` (v0.3 tokenizers), or `name[ARGS]{...}` per
call (v11+ tokenizers, each call after its own `[TOOL_CALLS]`)."""

from __future__ import annotations

import json

from pagoda.services.gateway.openai.tool_parsers.base import (CallSoFar, ParsedOutput, ToolParser,
                                                              finalize, held_back, json_objects)
from pagoda.services.gateway.openai.tool_parsers.json_scan import skip_ws, value_end

BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True  # [TOOL_CALLS] is a control token

    def parse(self, text: str, final: bool) -> ParsedOutput:
        cut = text.find(BOT) if final else held_back(text, BOT)
        if cut < 0:
            return ParsedOutput(text, [])
        out = ParsedOutput(text[:cut], [])
        if text.find(BOT, cut) < 0:
            return out
        i = skip_ws(text, text.find(BOT, cut) + len(BOT))
        if i < len(text) and text[i] == "[":
            out.calls, _ = json_objects(text, i + 1)
        else:
            out.calls = self._named_calls(text, i)
        return finalize(text, out, final)

    @staticmethod
    def _named_calls(text: str, i: int) -> list[CallSoFar]:
        calls = []
        while i < len(text):
            args_at = text.find(ARGS, i)
            if args_at < 0:
                break  # the name is still coming
            call = CallSoFar(text[i:args_at].strip())
            start = skip_ws(text, args_at + len(ARGS))
            end = value_end(text, start) if start < len(text) else None
            call.arguments = text[start:end if end is not None else len(text)].rstrip()
            calls.append(call)
            if end is None:
                break
            call.complete = True
            nxt = text.find(BOT, end)
            if nxt < 0:
                break
            i = skip_ws(text, nxt + len(BOT))
        for call in calls:  # arguments must be an object
            if call.complete:
                try:
                    json.loads(call.arguments)
                except ValueError:
                    call.complete = False
        return calls
