"""A chat choice's text -> its message: `reasoning`, `content`, `tool_calls`.

    text ──ReasoningStream──► reasoning (also as reasoning_content)
                    └───────► answer ──ToolCallStream (tool plan's parser)──► content, tool_calls

Streamed and non-streamed answers go through the same two stages (the non-streamed one
as a single final piece), so they agree. With tool calls and a natural end, the
finish_reason is "tool_calls".

The reasoning travels under vLLM's current name, `reasoning`, and under its older one,
`reasoning_content`, with the same text (clients of either version read it). With
`include_reasoning: false` it is split off the content and dropped, as vLLM does. The
rendered prompt (`ChatOutput.prompt`) says whether the answer starts inside the
thinking block (`ReasoningParser.starts_in_reasoning_after`).
"""

from __future__ import annotations

from typing import Any

from pagoda.reasoning import ReasoningParser
from pagoda.services.gateway.openai.tool_parsers import ToolCallStream, ToolParser


REASONING_FIELDS = ("reasoning", "reasoning_content")


class ChatOutput:
    """One request's output stages: its reasoning parser and its tool plan's parser
    (either may be None), whether the reasoning is returned, and the rendered prompt
    (set once the tokenizer answered; None until then)."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None,
                 include_reasoning: bool = True) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.include_reasoning = include_reasoning
        self.prompt: str | None = None

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    def stream(self) -> "ChoiceOutputStream":
        return ChoiceOutputStream(self)

    def message(self, text: str, finish_reason: str | None, echo: str = ""
                ) -> tuple[dict[str, Any], str | None]:
        """The non-streamed message and finish_reason of a whole answer."""
        stream = self.stream()
        deltas = stream.feed(text, final=True)
        message: dict[str, Any] = {"role": "assistant"}
        content = echo + "".join(d.get("content", "") for d in deltas)
        message["content"] = content if content or not stream.num_tool_calls else None
        if self.reasoning is not None:
            reasoning = "".join(d.get("reasoning", "") for d in deltas) or None
            message.update(dict.fromkeys(REASONING_FIELDS, reasoning))
        calls: dict[int, dict[str, Any]] = {}
        for delta in deltas:
            for item in delta.get("tool_calls", ()):
                call = calls.setdefault(item["index"], {"id": item.get("id"), "type": "function",
                                                        "function": {"name": "", "arguments": ""}})
                call["function"]["name"] += item.get("function", {}).get("name", "")
                call["function"]["arguments"] += item.get("function", {}).get("arguments", "")
        if calls:
            message["tool_calls"] = [calls[i] for i in sorted(calls)]
        return message, stream.finish_reason(finish_reason)


class ChoiceOutputStream:
    """One choice's stages, fed text deltas; returns OpenAI delta dicts (content,
    reasoning + reasoning_content, or tool_calls), every one final."""

    def __init__(self, output: ChatOutput) -> None:
        self._reasoning = (output.reasoning.stream(output.prompt)
                           if output.reasoning is not None else None)
        self._include_reasoning = output.include_reasoning
        self._tools = ToolCallStream(output.tools) if output.tools is not None else None

    @property
    def in_reasoning(self) -> bool:
        """Whether the answer so far ends inside the thinking block (the Responses
        API counts the tokens fed while this holds before and after as reasoning)."""
        return (self._reasoning is not None
                and self._reasoning.state == self._reasoning.REASONING)

    @property
    def num_tool_calls(self) -> int:
        return self._tools.num_calls if self._tools is not None else 0

    def feed(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        """`final`: `text` is the whole answer (the non-streamed one), parsed at once."""
        if final:
            return self.feed(text) + self.finish() if self._tools is None else \
                self._whole(text)
        if self._reasoning is None:
            return self._answer(text)
        reasoning, answer = self._reasoning.feed(text)
        return self._with_reasoning(reasoning, self._answer(answer))

    def _whole(self, text: str) -> list[dict[str, Any]]:
        reasoning, answer = "", text
        if self._reasoning is not None:
            r1, a1 = self._reasoning.feed(text)
            r2, a2 = self._reasoning.finish()
            reasoning, answer = r1 + r2, a1 + a2
        return self._with_reasoning(reasoning, self._tools.feed(answer, final=True))

    def finish(self) -> list[dict[str, Any]]:
        """What was held back, at the end of the answer."""
        reasoning, answer = self._reasoning.finish() if self._reasoning is not None else ("", "")
        deltas = self._with_reasoning(reasoning, [])
        if self._tools is not None:
            return deltas + self._tools.feed(answer, final=True)
        return deltas + ([{"content": answer}] if answer else [])

    def finish_reason(self, finish_reason: str | None) -> str | None:
        return "tool_calls" if finish_reason == "stop" and self.num_tool_calls else finish_reason

    def _answer(self, text: str) -> list[dict[str, Any]]:
        if self._tools is not None:
            return self._tools.feed(text) if text else []
        return [{"content": text}] if text else []

    def _with_reasoning(self, reasoning: str, deltas: list[dict[str, Any]]
                        ) -> list[dict[str, Any]]:
        if not reasoning or not self._include_reasoning:
            return deltas
        return [dict.fromkeys(REASONING_FIELDS, reasoning)] + deltas
