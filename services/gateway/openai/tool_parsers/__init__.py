"""Tool-call parsers (`--enable-auto-tool-choice --tool-call-parser NAME`), vLLM's names.

One more format is one module with a `ToolParser` subclass, listed in `PARSERS`.
`required` and named `tool_choice` use their own parsers (`forced.py`): the answer is
then constrained by a JSON schema built from the tools, so it always parses.
"""

from __future__ import annotations

from typing import Any

from pagoda.named_classes import named_class
from pagoda.services.gateway.openai.tool_parsers.base import (CallSoFar, ParsedOutput,
                                                              ToolCallStream, ToolParser,
                                                              tool_call_id)

# Name -> "module:class".
_M = "pagoda.services.gateway.openai.tool_parsers"
PARSERS = {
    "deepseek_v3": f"{_M}.deepseek_v3:DeepSeekV3ToolParser",
    "deepseek_v31": f"{_M}.deepseek_v3:DeepSeekV31ToolParser",
    "glm45": f"{_M}.glm45:Glm45ToolParser",
    "glm47": f"{_M}.glm45:Glm45ToolParser",
    "granite": f"{_M}.granite:GraniteToolParser",
    "hermes": f"{_M}.hermes:HermesToolParser",
    "kimi_k2": f"{_M}.kimi_k2:KimiK2ToolParser",
    "llama3_json": f"{_M}.llama3_json:Llama3JsonToolParser",
    "llama4_json": f"{_M}.llama3_json:Llama3JsonToolParser",
    "llama4_pythonic": f"{_M}.llama4_pythonic:Llama4PythonicToolParser",
    "longcat": f"{_M}.hermes:LongcatToolParser",
    "mistral": f"{_M}.mistral:MistralToolParser",
    "openai": f"{_M}.openai:GptOssToolParser",
    "pythonic": f"{_M}.pythonic:PythonicToolParser",
    "qwen3_coder": f"{_M}.qwen3_coder:Qwen3CoderToolParser",
    "qwen3_xml": f"{_M}.qwen3_coder:Qwen3CoderToolParser",
}


def get_tool_parser(name: str, tools: list[dict[str, Any]] | None = None) -> ToolParser:
    """The parser called `name` for a request with `tools` (its functions, as
    `tools.check_tools` returns them); ValueError listing the known names otherwise."""
    return named_class("tool-call parser", PARSERS, name)(tools)


__all__ = ["PARSERS", "CallSoFar", "ParsedOutput", "ToolCallStream", "ToolParser",
           "get_tool_parser", "tool_call_id"]
