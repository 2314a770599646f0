"""gpt-oss (OpenAI's harmony format; vLLM's `openai_gptoss`, `gpt_oss` here).

After the prompt's `<|start|>assistant` the model writes messages, each a header up to
`<|message|>` naming its channel, then a body up to `<|end|>`, `<|return|>` or
`<|call|>`:

    <|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

`analysis` bodies are the reasoning, `final` bodies the content (a `<|constrain|>json`
in the header changes nothing), `commentary` bodies addressed to nobody (preambles) are
content too, and a message with a recipient (`to=functions.f`: a tool call) is neither:
it is the tool parser's. Text with no harmony header at all is content. The markers are
special tokens: the text must be decoded with them, so the gateway turns
skip_special_tokens off for a chat answer read by this parser (`keeps_special_tokens`).
"""

from __future__ import annotations

import re

from pagoda.reasoning.base import ReasoningParser, _partial_suffix

MESSAGE = "<|message|>"
TERMINATORS = ("<|end|>", "<|return|>", "<|call|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")


class GptOssReasoningParser(ReasoningParser):
    name = "gpt_oss"
    start_token = "<|channel|>analysis<|message|>"
    end_token = "<|channel|>final<|message|>"
    starts_in_reasoning = False
    keeps_special_tokens = True  # the harmony headers and terminators are special tokens
    # The grammar gate follows vLLM's GptOssReasoningParser.is_reasoning_end: everything
    # the model writes before the final channel's header (analysis, commentary, tool
    # calls) is reasoning, the header may carry `<|constrain|>json` before its
    # `<|message|>` (up to 20 tokens), and only the current turn of the prompt counts.
    gate_end_parts = ("<|channel|>final", MESSAGE)
    gate_end_gap = 20
    gate_turn_start = "<|start|>"
    gate_starts_in_reasoning = True

    def stream(self, prompt: str | None = None) -> "HarmonyStream":
        return HarmonyStream()


class HarmonyStream:
    """Same contract as `ReasoningStream` (feed deltas, then finish): a header is held
    until its `<|message|>` arrives, and a body's possible partial terminator until the
    next delta decides it."""

    def __init__(self) -> None:
        self._held = ""
        self._in_body = False
        self._sink: str | None = None  # "reasoning", "content" or None (dropped)
        self._saw_header = False

    def feed(self, delta: str) -> tuple[str, str]:
        text, self._held = self._held + delta, ""
        parts = {"reasoning": [], "content": []}
        while text:
            if not self._in_body:
                at = text.find(MESSAGE)
                if at < 0:
                    self._held = text
                    break
                self._sink, self._in_body, self._saw_header = _sink(text[:at]), True, True
                text = text[at + len(MESSAGE):]
                continue
            found = [(text.find(t), t) for t in TERMINATORS if t in text]
            if found:
                at, marker = min(found)
                self._emit(parts, text[:at])
                self._in_body, text = False, text[at + len(marker):]
                continue
            keep = max(_partial_suffix(text, t) for t in TERMINATORS)
            self._emit(parts, text[:len(text) - keep])
            self._held = text[len(text) - keep:]
            break
        return "".join(parts["reasoning"]), "".join(parts["content"])

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        parts = {"reasoning": [], "content": []}
        if self._in_body:
            self._emit(parts, held)  # cut short mid-message: the partial marker was text
        elif not self._saw_header and "<|" not in held:
            parts["content"].append(held)  # a plain answer, no harmony at all
        return "".join(parts["reasoning"]), "".join(parts["content"])

    def _emit(self, parts: dict[str, list[str]], text: str) -> None:
        if self._sink is not None and text:
            parts[self._sink].append(text)


def _sink(header: str) -> str | None:
    """Where a message's body goes, from its header."""
    if " to=" in header or header.startswith("to="):
        return None  # a tool call (or a tool's output): neither reasoning nor content
    match = _CHANNEL.search(header)
    channel = match.group(1) if match else "final"
    return {"analysis": "reasoning", "final": "content", "commentary": "content"}.get(channel)
