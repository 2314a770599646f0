"""Kimi K2 Thinking (vLLM's `kimi_k2`, also `kimi` here): the model opens `<think>`
itself and closes it with `</think>`; a tool-call section (`<|tool_calls_section_begin|>`)
also ends the reasoning, and stays in the content for the tool parser. An answer that
does not open `<think>` (thinking off) is all content."""

from pagoda.reasoning.base import ReasoningParser


class KimiReasoningParser(ReasoningParser):
    name = "kimi"
    starts_in_reasoning = False
    content_end_tokens = ("<|tool_calls_section_begin|>",)
