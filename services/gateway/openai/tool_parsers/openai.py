"""gpt-oss tool calls (`openai`), in the harmony format: the answer is a run of messages,

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"city": "Paris"}<|call|>

A message whose recipient is `functions.NAME` is a call of NAME (its body the JSON
arguments; the recipient may also stand before `<|channel|>`). The bodies of `final`
messages, and of `commentary` ones without a recipient (preambles), are content;
`analysis` is reasoning, left to the reasoning parser and never content. Text with no
harmony header at all is plain content.
"""

from __future__ import annotations

import re

from pagoda.services.gateway.openai.tool_parsers.base import (CallSoFar, ParsedOutput, ToolParser,
                                                              finalize, held_back)
from pagoda.services.gateway.openai.tool_parsers.json_args import json_arguments

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


class GptOssToolParser(ToolParser):
    name = "openai"
    keeps_special_tokens = True  # the harmony markers are special tokens

    def parse(self, text: str, final: bool) -> ParsedOutput:
        if CHANNEL not in text and START not in text and MESSAGE not in text:
            if not final and any(m.startswith(text.lstrip()) for m in (CHANNEL, START)):
                return ParsedOutput()  # a header may be starting
            if not final:  # a header may start later: hold back what may be its beginning
                cut = min(held_back(text, m) for m in (CHANNEL, START))
                return ParsedOutput(text[:cut], [])
            return ParsedOutput(text, [])
        out, i = ParsedOutput(), 0
        while i < len(text):
            body_at = text.find(MESSAGE, i)
            if body_at < 0:
                break  # the header is still coming
            header = text[i:body_at]
            body_at += len(MESSAGE)
            ends = [(text.find(e, body_at), e) for e in ENDS]
            ends = [(at, e) for at, e in ends if at >= 0]
            at, end = min(ends) if ends else (len(text), "")
            body, closed = text[body_at:at], bool(end)
            recipient = _RECIPIENT.search(header)
            channel = _CHANNEL.search(header)
            channel = channel.group(1) if channel else ""
            if recipient and recipient.group(1).startswith("functions."):
                name = recipient.group(1)[len("functions."):]
                out.calls.append(json_arguments(name, body, closed) if name
                                 else CallSoFar(None))
            elif channel == "final" or channel == "commentary" and not recipient:
                if not closed and not final:
                    body = body[:min(held_back(body, e) for e in ENDS)]
                out.content += body
            if not closed:
                break
            i = at + len(end)
            if text.startswith(START, i):
                i += len(START)
        return finalize(text, out, final)
