"""Mistral's reasoning models (Magistral, vLLM's `mistral`): `[THINK]...[/THINK]` then
the answer. The model writes `[THINK]` itself when it reasons; an answer that does not
open with it is all content."""

from pagoda.reasoning.base import ReasoningParser


class MistralReasoningParser(ReasoningParser):
    name = "mistral"
    start_token = "[THINK]"
    end_token = "[/THINK]"
    starts_in_reasoning = False
