"""Qwen3: hybrid thinking. The model opens `<think>` itself when it thinks; an answer
that does not begin with `<think>` (thinking disabled) is all content."""

from pagoda.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    starts_in_reasoning = False
