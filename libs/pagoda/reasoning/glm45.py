"""GLM-4.5 / GLM-4.6 (vLLM's `glm45`): `<think>...</think>` then the answer. Thinking is
on by default, so text before `</think>` is reasoning even when the model did not write
`<think>` itself; with thinking off the template closes an empty block in the prompt
(`<think></think>`), which starts the answer in the content."""

from pagoda.reasoning.base import ReasoningParser


class Glm45ReasoningParser(ReasoningParser):
    name = "glm45"
    starts_in_reasoning = True
