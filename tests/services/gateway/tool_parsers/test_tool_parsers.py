"""Each tool-call parser on its model's real output format, streamed and not.

Streamed, the text arrives in random pieces; the deltas must give every call's name
once (with its id) and argument fragments that join into exactly the non-streamed
arguments, and the content deltas must join into the non-streamed content.
"""

from __future__ import annotations

import json
import random

import pytest

from pagoda.services.gateway.openai.chat_output import ChatOutput
from pagoda.services.gateway.openai.tool_parsers import PARSERS, get_tool_parser
from pagoda.services.gateway.openai.tool_parsers.forced import NamedToolParser, RequiredToolParser

WEATHER = {"city": "Paris", "unit": "celsius"}
NESTED = {"q": "a \"quoted\" }{ string", "filters": {"tags": ["x", "y"], "n": 3}}

# (parser, model output, expected content, expected calls [(name, arguments dict)])
CASES = [
    # Hermes / Qwen2.5 / Qwen3
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
               '"unit": "celsius"}}\n</tool_call>', None, [("get_weather", WEATHER)]),
    ("hermes", 'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n'
               '{"name": "search", "arguments": {"q": "a \\"quoted\\" }{ string", "filters": '
               '{"tags": ["x", "y"], "n": 3}}}\n</tool_call>',
     "Let me check both.\n", [("get_weather", WEATHER), ("search", NESTED)]),
    ("hermes", "The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', []),  # cut: content
    # LongCat-Flash (vLLM's `longcat`, a hermes variant with its own tags)
    ("longcat", 'Checking.\n<longcat_tool_call>\n{"name": "get_weather", "arguments": '
                '{"city": "Paris", "unit": "celsius"}}\n</longcat_tool_call>\n'
                '<longcat_tool_call>\n{"name": "now", "arguments": {}}\n</longcat_tool_call>',
     "Checking.\n", [("get_weather", WEATHER), ("now", {})]),
    ("longcat", "Paris is sunny.", "Paris is sunny.", []),
    ("longcat", '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>', []),  # not its tag
    # Llama 3.1 / 3.2 JSON
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
                    '"celsius"}}', None, [("get_weather", WEATHER)]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
                    '"unit": "celsius"}}; {"name": "now", "parameters": {}}', None,
     [("get_weather", WEATHER), ("now", {})]),
    ("llama3_json", "It is sunny in Paris.", "It is sunny in Paris.", []),
    # Mistral: v0.3 list form, and the v11+ name[ARGS] form
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
                '"unit": "celsius"}}, {"name": "now", "arguments": {}}]', None,
     [("get_weather", WEATHER), ("now", {})]),
    ("mistral", 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
                '[TOOL_CALLS]now[ARGS]{}', "Sure.", [("get_weather", WEATHER), ("now", {})]),
    ("mistral", "No tools needed.", "No tools needed.", []),
    # Pythonic (Llama 3.2, Llama 4)
    ("pythonic", '[get_weather(city="Paris", unit="celsius"), search(q=\'a "quoted" }{ '
                 'string\', filters={"tags": ["x", "y"], "n": 3})]', None,
     [("get_weather", WEATHER), ("search", NESTED)]),
    ("pythonic", "<|python_start|>[now()]<|python_end|>", None, [("now", {})]),
    ("pythonic", "Paris is sunny today.", "Paris is sunny today.", []),
]


def non_streamed(parser, text):
    message, finish = ChatOutput(None, parser).message(text, "stop")
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in message.get("tool_calls", [])]
    return message["content"], calls, finish, message


def streamed(parser, text, rng):
    stream = ChatOutput(None, parser).stream()
    deltas, i = [], 0
    while i < len(text):
        j = i + rng.randint(1, 7)
        deltas += stream.feed(text[i:j])
        i = j
    deltas += stream.finish()
    return deltas, stream.finish_reason("stop")


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_non_streamed(name, text, content, calls):
    got_content, got_calls, finish, message = non_streamed(get_tool_parser(name), text)
    assert got_content == content and got_calls == calls
    assert finish == ("tool_calls" if calls else "stop")
    ids = [c["id"] for c in message.get("tool_calls", [])]
    assert all(i.startswith("chatcmpl-tool-") for i in ids) and len(set(ids)) == len(ids)


# A call cut short: the streamed deltas of its beginning cannot be taken back.
WELL_FORMED = [case for case in CASES if not case[1].endswith('"Par')]


@pytest.mark.parametrize("name, text, content, calls", WELL_FORMED)
def test_streamed_deltas_join_into_the_non_streamed_answer(name, text, content, calls):
    parser = get_tool_parser(name)
    _, _, _, message = non_streamed(parser, text)
    rng = random.Random(len(text))
    for _ in range(20):
        deltas, finish = streamed(parser, text, rng)
        assert finish == ("tool_calls" if calls else "stop")
        assert ("".join(d.get("content", "") for d in deltas) or None) == content
        joined: dict[int, dict] = {}
        for d in deltas:
            for item in d.get("tool_calls", ()):
                call = joined.get(item["index"])
                if call is None:  # the first delta of a call: id, type and the whole name
                    assert item["id"].startswith("chatcmpl-tool-") and item["type"] == "function"
                    call = joined[item["index"]] = {"name": item["function"]["name"], "args": ""}
                else:
                    assert "id" not in item and "name" not in item.get("function", {})
                call["args"] += item.get("function", {}).get("arguments", "")
        assert [joined[i]["name"] for i in sorted(joined)] == [c[0] for c in calls]
        assert [joined[i]["args"] for i in sorted(joined)] == \
            [c["function"]["arguments"] for c in message.get("tool_calls", [])]


def test_every_registered_parser_is_tested():
    from tests.services.gateway.tool_parsers.test_marker_parsers import CASES as MARKER_CASES
    assert {case[0] for case in CASES + MARKER_CASES} == set(PARSERS)


def test_forced_answers_parse_as_calls():
    required = '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, ' \
               '{"name": "now", "parameters": {}}]'
    content, calls, finish, _ = non_streamed(RequiredToolParser(), required)
    assert (content, calls, finish) == (None, [("get_weather", WEATHER), ("now", {})],
                                        "tool_calls")
    content, calls, _, _ = non_streamed(NamedToolParser("get_weather"),
                                        '{"city": "Paris", "unit": "celsius"}')
    assert (content, calls) == (None, [("get_weather", WEATHER)])
    deltas, _ = streamed(NamedToolParser("get_weather"), '{"city": "Paris"}', random.Random(1))
    first = deltas[0]["tool_calls"][0]
    assert first["function"]["name"] == "get_weather"
    assert "".join(d["tool_calls"][0]["function"].get("arguments", "") for d in deltas) \
        == '{"city": "Paris"}'


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="deepseek_v3, .*hermes, kimi_k2, llama3_json, .*qwen3_xml"):
        get_tool_parser("nope")


HERMES_TRAILING = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
                   '"Paris", "unit": "celsius"}}\n</tool_call>\nI will report back.')


def test_hermes_drops_text_after_the_calls_as_vllm_does():
    """vLLM's hermes parser keeps only the text before the first `<tool_call>` as content
    (`model_output[:model_output.find(tool_call_start_token)]`), so text after
    `</tool_call>` is dropped; Pagoda matches it, and streamed cut at every point (two
    pieces) gives exactly the non-streamed answer."""
    parser = get_tool_parser("hermes")
    content, calls, finish, message = non_streamed(parser, HERMES_TRAILING)
    assert (content, calls, finish) == ("Checking.\n", [("get_weather", WEATHER)], "tool_calls")
    for cut in range(1, len(HERMES_TRAILING)):
        stream = ChatOutput(None, parser).stream()
        deltas = stream.feed(HERMES_TRAILING[:cut]) + stream.feed(HERMES_TRAILING[cut:])
        deltas += stream.finish()
        assert "".join(d.get("content", "") for d in deltas) == "Checking.\n", cut
        items = [item for d in deltas for item in d.get("tool_calls", ())]
        assert [i["function"]["name"] for i in items if "id" in i] == ["get_weather"], cut
        assert "".join(i["function"].get("arguments", "") for i in items) == \
            message["tool_calls"][0]["function"]["arguments"], cut
        assert stream.finish_reason("stop") == "tool_calls"
