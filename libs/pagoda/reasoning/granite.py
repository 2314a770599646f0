"""IBM Granite 3.2+ (`thinking=True` in the chat template's kwargs): the model opens its
reasoning with "Here is my thought process:" and its answer with "Here is my response:"
(or "Here's ..."), plain text, not special tokens. An answer that does not open with
the thought-process phrase is all content (thinking off), as vLLM's `granite` parser."""

from pagoda.reasoning.base import ReasoningParser


class GraniteReasoningParser(ReasoningParser):
    name = "granite"
    start_token = "Here is my thought process:"
    end_token = "Here is my response:"
    other_start_tokens = ("Here's my thought process:",)
    other_end_tokens = ("Here's my response:",)
    starts_in_reasoning = False
