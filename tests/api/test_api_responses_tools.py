"""/v1/responses with function tools and reasoning, through the official openai client.

The scripted scheduler (test_api_tool_calling.py's) answers with the model output a
test sets, so the model's real formats (DeepSeek-R1 thinking, Hermes tool calls) play
through the whole gateway: the real tokenizer service renders the chat template and
decodes, the chat path's parsers split reasoning and read the calls, and the Responses
API turns them into reasoning, message and function_call items, streamed and not.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from api_fakes import Gateway
from test_api_tool_calling import HERMES, ScriptedPeers

from pagoda.services.gateway.serving_options import ServingOptions

TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}]
REASONING = "The user wants the weather; I will call the tool."
THINKING = REASONING + "</think>\n\n" + HERMES


@pytest.fixture(scope="module")
def peers(smollm2_tokenizer):
    peers = ScriptedPeers(smollm2_tokenizer)
    yield peers
    peers.stop()


@pytest.fixture(scope="module")
def gateway(peers):
    gateway = Gateway(peers, options=ServingOptions(
        enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="deepseek_r1"))
    yield gateway
    gateway.stop()


@pytest.fixture
def client(gateway):
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0,
                         timeout=30)


@pytest.fixture
def script(peers, smollm2_tokenizer):
    """script(text): the model's next answers are `text`; returns its token ids."""
    def set_script(text: str) -> list[int]:
        peers.scheduler.script = smollm2_tokenizer.encode(text, add_special_tokens=False)
        return peers.scheduler.script
    return set_script


def reasoning_token_count(tokenizer, ids: list[int]) -> int:
    """The tokens before the one that completes `</think>` (the deltas are one token)."""
    return next(k for k in range(len(ids)) if "</think>" in tokenizer.decode(ids[:k + 1]))


def last_prompt(peers, tokenizer) -> str:
    return tokenizer.decode(list(peers.scheduler.requests[-1].prompt_token_ids))


def test_reasoning_text_and_a_function_call_become_items(client, script, smollm2_tokenizer):
    ids = script(THINKING)
    r = client.responses.create(model="fake-model", input="Weather in Paris?", tools=TOOLS,
                                max_output_tokens=200)
    assert [item.type for item in r.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = r.output
    assert reasoning.summary == [] and [c.text for c in reasoning.content] == [REASONING]
    assert message.content[0].text == "\n\nLet me check.\n" and r.output_text == message.content[0].text
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert call.call_id and call.id.startswith("fc_") and call.status == "completed"
    assert r.status == "completed" and r.usage.output_tokens == len(ids)
    assert r.usage.output_tokens_details.reasoning_tokens == \
        reasoning_token_count(smollm2_tokenizer, ids) > 0
    assert r.tools[0].name == "get_weather"


def test_the_stream_carries_the_same_items(client, script):
    script(THINKING)
    kwargs = dict(model="fake-model", input="Weather in Paris?", tools=TOOLS,
                  max_output_tokens=200)
    plain = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    for kind in ("response.reasoning_text.delta", "response.reasoning_text.done",
                 "response.output_text.delta", "response.function_call_arguments.delta",
                 "response.function_call_arguments.done"):
        assert kind in kinds, kind
    assert kinds.count("response.output_item.added") == kinds.count(
        "response.output_item.done") == 3
    assert [e.sequence_number for e in events] == list(range(len(events)))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    arguments = "".join(e.delta for e in events
                        if e.type == "response.function_call_arguments.delta")
    assert reasoning == REASONING
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == arguments == final.output[2].arguments == plain.output[2].arguments
    assert [i.type for i in final.output] == [i.type for i in plain.output]
    assert final.output_text == plain.output_text
    assert final.usage.output_tokens_details.reasoning_tokens == \
        plain.usage.output_tokens_details.reasoning_tokens


def test_two_turns_carry_the_call_and_its_output(client, script, peers, smollm2_tokenizer):
    script(THINKING)
    first = client.responses.create(model="fake-model", input="Weather in Paris?",
                                    tools=TOOLS, max_output_tokens=200)
    call = first.output[2]
    script("</think>It is 21 degrees in Paris.")
    second = client.responses.create(
        model="fake-model", previous_response_id=first.id, tools=TOOLS,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}])
    assert second.output_text == "It is 21 degrees in Paris."
    assert [i.type for i in second.output] == ["message"]  # no reasoning: it closed at once
    prompt = last_prompt(peers, smollm2_tokenizer)
    assert prompt.index("Weather in Paris?") < prompt.index("Let me check.") < \
        prompt.index("21 C")
    # The same conversation sent whole (no store): the SDK's own output items as input.
    script("</think>Sunny.")
    third = client.responses.create(
        model="fake-model", tools=TOOLS, store=False,
        input=[{"role": "user", "content": "Weather in Paris?"},
               *[item.model_dump(exclude_none=True) for item in first.output],
               {"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}])
    assert third.output_text == "Sunny."
    assert last_prompt(peers, smollm2_tokenizer) == prompt


def test_forced_tool_choices_reach_the_engine_as_a_schema(client, script, peers):
    script('</think>[{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    r = client.responses.create(model="fake-model", input="x", tools=TOOLS,
                                tool_choice="required", max_output_tokens=100)
    assert [(i.type, i.name) for i in r.output] == [("function_call", "get_weather")]
    assert json.loads(r.output[0].arguments) == {"city": "Oslo"}
    assert peers.scheduler.requests[-1].sampling_params.HasField("structured_outputs")
    script('</think>{"city": "Rome"}')
    r = client.responses.create(model="fake-model", input="x", tools=TOOLS,
                                tool_choice={"type": "function", "name": "get_weather"},
                                max_output_tokens=100)
    assert json.loads(r.output[0].arguments) == {"city": "Rome"}
    script("</think>" + HERMES)
    r = client.responses.create(model="fake-model", input="x", tools=TOOLS,
                                tool_choice="none", max_output_tokens=200)
    assert [i.type for i in r.output] == ["message"] and "<tool_call>" in r.output_text


def test_delete_then_get_is_404(client, script):
    script("</think>ok")
    r = client.responses.create(model="fake-model", input="x", max_output_tokens=5)
    assert client.responses.retrieve(r.id).output_text == "ok"
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="fake-model", input="y", previous_response_id=r.id)
    assert caught.value.body["param"] == "previous_response_id"


BAD = [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tools": [{"type": "function", "name": f"f{i}"} for i in range(129)]}, "tools"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "o"}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
     "input"),
    ({"input": [{"type": "reasoning", "summary": "no"}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"include": ["everything"]}, "include"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k": 1}}, "metadata"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning"),
    ({"text": {"format": {"type": "yaml"}}}, "text"),
    ({"previous_response_id": "chatcmpl-1"}, "previous_response_id"),
    ({"background": True}, "background"),
]


@pytest.mark.parametrize("extra,param", BAD, ids=[p for _, p in BAD])
def test_bad_fields_are_a_400_naming_them(gateway, extra, param):
    body = {"model": "fake-model", "input": "x", **extra}
    reply = httpx.post(f"{gateway.url}/v1/responses", json=body, timeout=30)
    assert reply.status_code == 400, (extra, reply.text)
    assert reply.json()["error"]["param"] == param, reply.text
    assert httpx.get(f"{gateway.url}/health", timeout=30).status_code == 200
