"""Reasoning and tool calls together: the reasoning is split off first, tool parsing
reads only the answer after it; streamed and non-streamed agree."""

from __future__ import annotations

import json

from pagoda.reasoning import get_reasoning_parser
from pagoda.services.gateway.openai.chat_output import ChatOutput
from pagoda.services.gateway.openai.tool_parsers import get_tool_parser

TEXT = ('I should look up the weather. <tool_call> is the format.</think>\n\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


def test_tool_calls_are_read_after_the_reasoning_only():
    output = ChatOutput(get_reasoning_parser("deepseek_r1"), get_tool_parser("hermes"))
    message, finish = output.message(TEXT, "stop")
    assert message["reasoning_content"] == "I should look up the weather. <tool_call> is the format."
    assert message["content"] == "\n\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == [("get_weather", {"city": "Paris"})]
    assert finish == "tool_calls"
    stream = output.stream()
    deltas = [d for piece in (TEXT[:20], TEXT[20:61], TEXT[61:]) for d in stream.feed(piece)]
    deltas += stream.finish()
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == message["content"]
    assert stream.finish_reason("stop") == "tool_calls"
    assert stream.finish_reason("length") == "length"  # a cut answer says so


def test_without_stages_the_text_is_the_content():
    output = ChatOutput(get_reasoning_parser("qwen3"), None)
    message, finish = output.message("Plain answer.", "stop", echo="Echo: ")
    assert message == {"role": "assistant", "content": "Echo: Plain answer.",
                       "reasoning": None, "reasoning_content": None}
    assert finish == "stop"


def test_the_reasoning_travels_under_both_of_vllms_names():
    output = ChatOutput(get_reasoning_parser("qwen3"), None)
    message, _ = output.message("<think>hmm</think>Four.", "stop")
    assert (message["reasoning"], message["reasoning_content"], message["content"]) == \
        ("hmm", "hmm", "Four.")
    deltas = output.stream().feed("<think>hmm</think>Four.")
    assert {"reasoning": "hmm", "reasoning_content": "hmm"} in deltas


def test_include_reasoning_false_drops_the_reasoning_not_into_the_content():
    output = ChatOutput(get_reasoning_parser("qwen3"), None, include_reasoning=False)
    message, _ = output.message("<think>hmm</think>Four.", "stop")
    assert (message["reasoning"], message["content"]) == (None, "Four.")
    stream = output.stream()
    deltas = stream.feed("<think>hm") + stream.feed("m</think>Four.") + stream.finish()
    assert deltas == [{"content": "Four."}]


def test_a_template_that_opened_the_block_is_read_from_the_prompt():
    """Qwen3-Thinking-2507: the prompt ends in `<think>`; the model writes no opener."""
    output = ChatOutput(get_reasoning_parser("qwen3"), None)
    output.prompt = "<|im_start|>assistant\n<think>\n"
    message, _ = output.message("2+2 is 4.</think>\n\nFour.", "stop")
    assert (message["reasoning"], message["content"]) == ("2+2 is 4.", "\n\nFour.")
    stream = output.stream()
    deltas = stream.feed("2+2 is 4.</th") + stream.feed("ink>\n\nFour.") + stream.finish()
    assert "".join(d.get("content", "") for d in deltas) == "\n\nFour."


def test_a_harmony_reasoning_parser_gets_the_special_tokens_it_reads():
    """gpt_oss reads harmony headers, which are special tokens: a chat answer it parses is
    decoded with them (else the analysis would be served as content); other parsers
    leave the request's skip_special_tokens alone."""
    from types import SimpleNamespace

    from pagoda.services.gateway.openai.request_models import ChatCompletionRequest
    from pagoda.services.gateway.openai.routes import chat_output

    for parser, skip in (("gpt_oss", False), ("deepseek_r1", True), (None, True)):
        state = SimpleNamespace(options=SimpleNamespace(auto_tool_parser=None,
                                                        reasoning_parser=parser))
        body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}])
        chat_output(state, body)
        assert body.skip_special_tokens is skip, parser
    harmony = ("<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final"
               "<|message|>answer")
    message, _ = ChatOutput(get_reasoning_parser("gpt_oss"), None).message(harmony, "stop")
    assert (message["reasoning_content"], message["content"]) == ("think", "answer")
