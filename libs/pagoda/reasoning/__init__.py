"""Reasoning parsers (`--reasoning-parser NAME`): where a reasoning model's thinking ends.

Two readers use one parser: the gateway splits a chat answer's text into
`reasoning_content` and `content` (`ReasoningParser.split`, or a `ReasoningStream` for
SSE deltas), and the scheduler's grammar state enables a structured-output constraint
only once the reasoning ended (`start_token`/`end_token` looked up in the vocabulary),
as vLLM does. Pure Python, so the gateway may import it.

One more parser is one module with a `ReasoningParser` subclass, listed in `PARSERS`.
"""

from __future__ import annotations

from pagoda.named_classes import named_class
from pagoda.reasoning.base import ReasoningParser, ReasoningStream

# Name (vLLM's) -> "module:class".
PARSERS = {
    "deepseek_r1": "pagoda.reasoning.deepseek_r1:DeepSeekR1ReasoningParser",
    "qwen3": "pagoda.reasoning.qwen3:Qwen3ReasoningParser",
    "granite": "pagoda.reasoning.granite:GraniteReasoningParser",
    "glm45": "pagoda.reasoning.glm45:Glm45ReasoningParser",
    "gpt_oss": "pagoda.reasoning.gpt_oss:GptOssReasoningParser",
    "openai_gptoss": "pagoda.reasoning.gpt_oss:GptOssReasoningParser",  # vLLM's name
    "kimi": "pagoda.reasoning.kimi:KimiReasoningParser",
    "kimi_k2": "pagoda.reasoning.kimi:KimiReasoningParser",  # vLLM's name
    "mistral": "pagoda.reasoning.mistral:MistralReasoningParser",
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser called `name`; ValueError listing the known names otherwise."""
    return named_class("reasoning parser", PARSERS, name)()


__all__ = ["PARSERS", "ReasoningParser", "ReasoningStream", "get_reasoning_parser"]
