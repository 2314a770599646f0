"""The marker-token tool-call formats (qwen3_coder, deepseek_v3, granite, kimi_k2,
glm45, openai/gpt-oss harmony, llama4_pythonic and vLLM's aliases of them), each on
its model family's real output format.

Streamed, the answer is cut at every point (two pieces), and also fed one character
at a time: the deltas must join into exactly the non-streamed message (content, each
call's name once with an id, argument fragments that join into the arguments).
"""

from __future__ import annotations

import json

import pytest

from pagoda.services.gateway.openai.chat_output import ChatOutput
from pagoda.services.gateway.openai.tool_parsers import get_tool_parser

WEATHER = {"city": "Paris", "unit": "celsius"}
# The request's functions, as tools.check_tools returns them: types for bare values.
TOOLS = [{"name": "get_weather", "parameters": {"type": "object", "properties": {
             "city": {"type": "string"}, "unit": {"type": "string"}}}},
         {"name": "add", "parameters": {"type": "object", "properties": {
             "a": {"type": "integer"}, "b": {"type": "number"}, "exact": {"type": "boolean"},
             "tags": {"type": "array"}, "label": {"type": "string"}}}}]
ADD = {"a": 2, "b": 3.5, "exact": True, "tags": ["x", "y"], "label": "007"}

DS_CALL = ("<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```"
           "<｜tool▁call▁end｜>")
KIMI_CALL = "<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>{args}<|tool_call_end|>"

# (parser, model output, expected content, expected calls [(name, arguments dict)])
CASES = [
    # Qwen3-Coder: bare values typed by the tool's schema ("007" stays a string)
    ("qwen3_coder", "I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                    "</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n</function>\n"
                    "</tool_call>\n<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n"
                    "<parameter=b>\n3.5\n</parameter>\n<parameter=exact>\ntrue\n</parameter>\n"
                    "<parameter=tags>\n[\"x\", \"y\"]\n</parameter>\n<parameter=label>\n007\n"
                    "</parameter>\n</function>\n</tool_call>",
     "I'll check.\n", [("get_weather", WEATHER), ("add", ADD)]),
    ("qwen3_coder", "<tool_call>\n<function=now>\n</function>\n</tool_call>\nDone.", "Done.",
     [("now", {})]),
    ("qwen3_coder", "Paris is sunny.", "Paris is sunny.", []),
    ("qwen3_xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                  "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>", None,
     [("get_weather", WEATHER)]),
    # DeepSeek-V3 / R1, and V3.1's call form
    ("deepseek_v3", "Checking.<｜tool▁calls▁begin｜>"
     + DS_CALL.format(name="get_weather", args=json.dumps(WEATHER))
     + DS_CALL.format(name="add", args=json.dumps(ADD)) + "<｜tool▁calls▁end｜>",
     "Checking.", [("get_weather", WEATHER), ("add", ADD)]),
    ("deepseek_v3", "No call needed.", "No call needed.", []),
    ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
     + json.dumps(WEATHER) + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", None,
     [("get_weather", WEATHER)]),
    # Granite 3.0 (<|tool_call|>) and 3.1 (<tool_call>)
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", '
                '"unit": "celsius"}}, {"name": "now", "arguments": {}}]', None,
     [("get_weather", WEATHER), ("now", {})]),
    ("granite", '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", '
                '"unit": "celsius"}}]', None, [("get_weather", WEATHER)]),
    ("granite", "It is sunny.", "It is sunny.", []),
    # Kimi-K2
    ("kimi_k2", "Let me look.<|tool_calls_section_begin|>"
     + KIMI_CALL.format(name="get_weather", i=0, args=json.dumps(WEATHER))
     + KIMI_CALL.format(name="add", i=1, args=json.dumps(ADD)) + "<|tool_calls_section_end|>",
     "Let me look.", [("get_weather", WEATHER), ("add", ADD)]),
    ("kimi_k2", "Sunny.", "Sunny.", []),
    # GLM-4.5 (and glm47): values typed by the schema, else read as JSON
    ("glm45", "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
              "</arg_value>\n<arg_key>unit</arg_key>\n<arg_value>celsius</arg_value>\n"
              "</tool_call>\n<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>2</arg_value>\n"
              "<arg_key>b</arg_key>\n<arg_value>3.5</arg_value>\n<arg_key>exact</arg_key>\n"
              "<arg_value>true</arg_value>\n<arg_key>tags</arg_key>\n<arg_value>[\"x\", \"y\"]"
              "</arg_value>\n<arg_key>label</arg_key>\n<arg_value>007</arg_value>\n</tool_call>",
     "Checking.\n", [("get_weather", WEATHER), ("add", ADD)]),
    ("glm47", "<tool_call>now</tool_call>", None, [("now", {})]),
    ("glm45", "Sunny.", "Sunny.", []),
    # gpt-oss (harmony): analysis is not content; a preamble and the final answer are
    ("openai", "<|channel|>analysis<|message|>User wants weather.<|end|><|start|>assistant"
               "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
               + json.dumps(WEATHER) + "<|call|>", None, [("get_weather", WEATHER)]),
    ("openai", "<|channel|>analysis<|message|>Two calls.<|end|><|start|>assistant"
               "<|channel|>commentary<|message|>Checking both.<|end|><|start|>assistant "
               "to=functions.get_weather<|channel|>commentary json<|message|>"
               + json.dumps(WEATHER) + "<|call|><|start|>assistant<|channel|>commentary "
               "to=functions.now <|constrain|>json<|message|>{}<|call|>", "Checking both.",
     [("get_weather", WEATHER), ("now", {})]),
    ("openai", "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
               "<|message|>It is sunny in Paris.<|return|>", "It is sunny in Paris.", []),
    ("openai", "It is sunny in Paris.", "It is sunny in Paris.", []),
    # Llama 4 pythonic, and llama4_json (vLLM's alias of llama3_json)
    ("llama4_pythonic", '<|python_start|>[get_weather(city="Paris", unit="celsius")]'
                        '<|python_end|>', None, [("get_weather", WEATHER)]),
    ("llama4_pythonic", "Sunny.", "Sunny.", []),
    ("llama4_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
                    '"celsius"}}', None, [("get_weather", WEATHER)]),
]

# Malformed or cut-short calls: the whole answer comes back as content (vLLM's rule).
MALFORMED = [
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"),
    ("qwen3_coder", "<tool_call>\nget_weather(city='Paris')\n</tool_call>"),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather"
                    "\n```json\n{\"city\": \"Par"),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather"
                    "\n```json\nnot json\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": '),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {}}] and more'),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                "<|tool_call_argument_begin|>[1, 2]<|tool_call_end|><|tool_calls_section_end|>"),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n</tool_call>"),
    ("openai", "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
               "{\"city\": "),
]


def parser(name):
    return get_tool_parser(name, TOOLS)


def non_streamed(name, text):
    message, finish = ChatOutput(None, parser(name)).message(text, "stop")
    return message, finish


def joined(deltas):
    content = "".join(d.get("content", "") for d in deltas) or None
    calls: dict[int, dict] = {}
    for d in deltas:
        for item in d.get("tool_calls", ()):
            if item["index"] not in calls:  # first delta of a call: id, type, whole name
                assert item["id"].startswith("chatcmpl-tool-") and item["type"] == "function"
                calls[item["index"]] = {"name": item["function"]["name"], "arguments": ""}
            else:
                assert "id" not in item and "name" not in item.get("function", {})
            calls[item["index"]]["arguments"] += item.get("function", {}).get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


def streamed(name, pieces):
    stream = ChatOutput(None, parser(name)).stream()
    deltas = []
    for piece in pieces:
        deltas += stream.feed(piece)
    deltas += stream.finish()
    return joined(deltas), stream.finish_reason("stop")


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_non_streamed(name, text, content, calls):
    message, finish = non_streamed(name, text)
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
           for c in message.get("tool_calls", [])]
    assert (message["content"], got) == (content, calls)
    assert finish == ("tool_calls" if calls else "stop")
    ids = [c["id"] for c in message.get("tool_calls", [])]
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_every_split_streams_the_same_answer(name, text, content, calls):
    message, _ = non_streamed(name, text)
    want = (message["content"],
            [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for c in message.get("tool_calls", [])])
    splits = [[text[:k], text[k:]] for k in range(1, len(text))] + [list(text)]
    for pieces in splits:
        got, finish = streamed(name, pieces)
        assert got == want, pieces
        assert finish == ("tool_calls" if calls else "stop")


@pytest.mark.parametrize("name, text", MALFORMED)
def test_malformed_calls_are_content(name, text):
    message, finish = non_streamed(name, text)
    assert (message["content"], message.get("tool_calls"), finish) == (text, None, "stop")
