"""/v1/messages through the official `anthropic` SDK, against the session's shared tiny
cluster (tests/shared_clusters.py): the Messages API on the chat completions path.

The tiny random model writes garbage, so every check compares greedy answers: the
Messages API's text must equal the chat completions API's for the same conversation,
streamed must equal non-streamed, and a stop sequence taken from the greedy text must
cut it there. Tool calls are forced (tool_choice "tool"), so structured outputs make
the model's garbage a valid input object."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

MODEL = "tiny"  # PLAIN_TINY_FLAGS' --served-model-name
# The SDK (2.x) has no sampling arguments; the API still takes them, as Pagoda and vLLM do.
GREEDY = {"temperature": 0}
HELLO = [{"role": "user", "content": "Hello there, how are you?"}]
SYSTEM = "You are a terse assistant."
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "additionalProperties": False,
                            "required": ["city", "celsius"],
                            "properties": {"city": {"type": "string",
                                                    "enum": ["Paris", "Tokyo", "Lima"]},
                                           "celsius": {"type": "boolean"}}}}


@pytest.fixture(scope="module")
def serve(plain_tiny_cluster):
    return plain_tiny_cluster


@pytest.fixture(scope="module")
def client(serve):
    return anthropic.Anthropic(base_url=serve.base, api_key="x", max_retries=0, timeout=60)


def greedy(client, max_tokens=12, **kwargs):
    kwargs.setdefault("messages", HELLO)
    return client.messages.create(model=MODEL, max_tokens=max_tokens, extra_body=GREEDY,
                                  **kwargs)


def text_of(message) -> str:
    assert [b.type for b in message.content] == ["text"]
    return message.content[0].text


def chat_text(serve, messages, max_tokens=12) -> str:
    r = httpx.post(f"{serve.base}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_text_message_equals_chat_completions(client, serve):
    m = greedy(client, system=SYSTEM)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.model == MODEL
    assert text_of(m) == chat_text(serve, [{"role": "system", "content": SYSTEM}, *HELLO])
    assert text_of(m) != text_of(greedy(client))  # the system prompt reached the model
    count = client.messages.count_tokens(model=MODEL, messages=HELLO, system=SYSTEM)
    assert m.usage.input_tokens == count.input_tokens
    longer = client.messages.count_tokens(model=MODEL, messages=HELLO,
                                          system=[{"type": "text", "text": SYSTEM},
                                                  {"type": "text", "text": "Answer in French."}])
    assert longer.input_tokens > count.input_tokens


def test_max_tokens_stop_reason(client):
    m = greedy(client, max_tokens=3)
    assert (m.stop_reason, m.stop_sequence, m.usage.output_tokens) == ("max_tokens", None, 3)


def test_stop_sequence_cuts_the_greedy_text(client):
    full = text_of(greedy(client, max_tokens=24))
    words = [w for w in full.split() if w.isascii() and w.isalnum()]
    assert len(full) > 10 and words, full
    stop = words[len(words) // 2]
    m = greedy(client, max_tokens=24, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert text_of(m) == full[:full.index(stop)]


def test_stream_events_in_order_and_text_equals_non_streamed(client):
    expected = greedy(client, max_tokens=16, system=SYSTEM)
    with client.messages.create(model=MODEL, max_tokens=16, extra_body=GREEDY, system=SYSTEM,
                                messages=HELLO, stream=True) as stream:
        events = list(stream)
    kinds = [e.type for e in events if e.type != "ping"]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0].message.usage.input_tokens == expected.usage.input_tokens
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == text_of(expected)
    last = next(e for e in events if e.type == "message_delta")
    assert last.delta.stop_reason == expected.stop_reason
    assert last.usage.output_tokens == expected.usage.output_tokens


def test_forced_tool_call_then_tool_result(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = greedy(client, max_tokens=64, messages=ask, tools=[WEATHER],
               tool_choice={"type": "tool", "name": "get_weather"})
    assert m.stop_reason == "tool_use"
    (call,) = [b for b in m.content if b.type == "tool_use"]
    assert call.name == "get_weather" and isinstance(call.input, dict)
    assert call.input["city"] in ("Paris", "Tokyo", "Lima")
    assert isinstance(call.input["celsius"], bool)
    with client.messages.stream(model=MODEL, max_tokens=64, extra_body=GREEDY, messages=ask,
                                tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"}) as s:
        streamed = s.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == \
        [(call.name, call.input)]

    def turn(result: str):
        return [*ask, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                              "content": result}]}]

    follow = greedy(client, messages=turn("Sunny."), tools=[WEATHER])
    assert follow.stop_reason in ("end_turn", "max_tokens") and text_of(follow)
    # The tool's answer reaches the prompt: a longer one makes a longer prompt.
    longer = client.messages.count_tokens(model=MODEL, tools=[WEATHER],
                                          messages=turn("Sunny, 24 degrees, light wind."))
    assert longer.input_tokens > follow.usage.input_tokens


def test_output_format_makes_the_answer_json(client):
    m = greedy(client, max_tokens=64, output_config={
        "format": {"type": "json_schema", "schema": WEATHER["input_schema"]}})
    assert m.stop_reason == "end_turn"
    answer = json.loads(text_of(m))
    assert answer["city"] in ("Paris", "Tokyo", "Lima") and isinstance(answer["celsius"], bool)


def test_missing_max_tokens_is_anthropic_400_naming_the_field(serve):
    r = httpx.post(f"{serve.base}/v1/messages", json={"model": MODEL, "messages": HELLO},
                   timeout=30)
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]


def test_unknown_model_is_not_found_error(client):
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="no-such-model", max_tokens=4, messages=HELLO)
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "not_found_error"


def test_image_block_is_refused(client):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}])
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[1]" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as info:  # a server tool runs at Anthropic
        client.messages.create(model=MODEL, max_tokens=4, messages=HELLO, tools=[
            {"type": "web_search_20250305", "name": "web_search"}])
    assert info.value.body["error"]["message"].startswith("tools.0.type")
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL, max_tokens=4, messages=HELLO,
                               extra_body={"mcp_servers": [{"type": "url", "url": "http://x",
                                                           "name": "x"}]})
    assert "mcp_servers" in info.value.body["error"]["message"]


def test_chat_limits_apply(client):
    """The chat route's limits (limits/request_limits.py), as Anthropic errors."""
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL, max_tokens=4, messages=HELLO,
                               stop_sequences=[f"s{i}" for i in range(65)])
    assert "--max-stop-strings" in info.value.body["error"]["message"]
    nested: dict = {"type": "string"}
    for _ in range(40):
        nested = {"type": "object", "properties": {"x": nested}}
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL, max_tokens=4, messages=HELLO, tools=[
            {"name": "deep", "input_schema": nested}])
    assert "nested more than" in info.value.body["error"]["message"]


CLOCK = {"name": "get_time", "description": "The local time in a city.",
         "input_schema": {"type": "object", "additionalProperties": False, "required": ["city"],
                          "properties": {"city": {"type": "string",
                                                  "enum": ["Paris", "Tokyo", "Lima"]}}}}


def test_sdk_runs_a_three_turn_tool_conversation(client):
    """The Done-when conversation through the anthropic SDK: two tool_use turns, each
    answered with a tool_result, then the final text; the second turn streamed. The
    random model cannot decide to call a tool, so the tool turns force one (tool_choice
    "tool": structured outputs write a valid input); the last turn leaves the choice to
    the model (no parser on this cluster: text)."""
    tools = [WEATHER, CLOCK]
    messages: list[dict] = [{"role": "user", "content": "Weather and time in Paris?"}]
    first = greedy(client, max_tokens=64, messages=messages, tools=tools,
                   tool_choice={"type": "tool", "name": "get_weather"})
    assert first.stop_reason == "tool_use"
    (weather,) = [b for b in first.content if b.type == "tool_use"]
    assert weather.name == "get_weather" and weather.input["city"] in ("Paris", "Tokyo", "Lima")
    messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": weather.id,
                                               "content": "Sunny, 21 C."}]}]

    with client.messages.stream(model=MODEL, max_tokens=64, extra_body=GREEDY, tools=tools,
                                messages=messages,
                                tool_choice={"type": "tool", "name": "get_time"}) as stream:
        kinds = [e.type for e in stream]
        second = stream.get_final_message()
    assert "content_block_delta" in kinds and kinds[-1] == "message_stop"
    assert second.stop_reason == "tool_use"
    (clock,) = [b for b in second.content if b.type == "tool_use"]
    assert clock.name == "get_time" and clock.input["city"] in ("Paris", "Tokyo", "Lima")
    assert clock.id != weather.id
    assert second.usage.input_tokens > first.usage.input_tokens
    messages += [{"role": "assistant", "content": [b.model_dump() for b in second.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": clock.id,
                                               "content": [{"type": "text",
                                                            "text": "14:05"}]}]}]

    third = greedy(client, max_tokens=8, messages=messages, tools=tools)
    assert third.stop_reason in ("end_turn", "max_tokens") and text_of(third)
    assert third.usage.input_tokens > second.usage.input_tokens
    # Both results reached the prompt: the same conversation without the last one's
    # text counts fewer tokens.
    shorter = [*messages[:-1], {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": clock.id, "content": ""}]}]
    assert client.messages.count_tokens(model=MODEL, messages=shorter, tools=tools
                                        ).input_tokens < third.usage.input_tokens
