"""Tool-call parsers (`--enable-auto-tool-choice --tool-call-parser NAME`), vLLM's names.

One more format is one module with a `ToolParser` subclass, listed in `PARSERS`.
`required` and named `tool_choice` use their own parsers (`forced.py`): the answer is
then constrained by a JSON schema built from the tools, so it always parses.
"""

from __future__ import annotations

from pagoda.named_classes import named_class
from pagoda.services.gateway.openai.tool_parsers.base import (CallSoFar, ParsedOutput,
                                                              ToolCallStream, ToolParser,
                                                              tool_call_id)

# Name -> "module:class".
PARSERS = {
    "hermes": "pagoda.services.gateway.openai.tool_parsers.hermes:HermesToolParser",
    "llama3_json": "pagoda.services.gateway.openai.tool_parsers.llama3_json:Llama3JsonToolParser",
    "mistral": "pagoda.services.gateway.openai.tool_parsers.mistral:MistralToolParser",
    "pythonic": "pagoda.services.gateway.openai.tool_parsers.pythonic:PythonicToolParser",
}


def get_tool_parser(name: str) -> ToolParser:
    """The parser called `name`; ValueError listing the known names otherwise."""
    return named_class("tool-call parser", PARSERS, name)()


__all__ = ["PARSERS", "CallSoFar", "ParsedOutput", "ToolCallStream", "ToolParser",
           "get_tool_parser", "tool_call_id"]
