"""DeepSeek-R1 (and QwQ): the chat template opens `<think>`; the model writes its
reasoning, `</think>`, then the answer. An answer cut short before `</think>` is all
reasoning (vLLM's rule)."""

from pagoda.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    starts_in_reasoning = True
