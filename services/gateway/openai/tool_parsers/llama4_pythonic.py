"""Llama 4's pythonic tool calls (`llama4_pythonic`): the pythonic list, which Llama 4
may wrap in `<|python_start|>` ... `<|python_end|>` (handled by the pythonic parser)."""

from __future__ import annotations

from pagoda.services.gateway.openai.tool_parsers.pythonic import PythonicToolParser


class Llama4PythonicToolParser(PythonicToolParser):
    name = "llama4_pythonic"
    keeps_special_tokens = True  # <|python_start|> is a special token
