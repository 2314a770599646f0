"""The Responses API end to end: a two-turn function-tool conversation on the tiny cluster
through the official openai client, streamed and not, continued and read back through a
second gateway process that shares only the cluster's Redis (via the kv-cache-manager)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import openai
import pytest
from serve_cluster import flag_value, wait_until

from pagoda.free_ports import free_port

pytestmark = pytest.mark.slow
# An enum keeps the random model's forced arguments short: the grammar leaves two choices.
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
          "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                         "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}}}}]
CALL = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def second_gateway(tiny_cluster):
    """Another gateway process on the cluster's peers and kv-cache-manager: its own
    memory, the same Redis."""
    args = tiny_cluster.service_args("gateway")
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "pagoda.services.cli.main", "gateway", "--port", str(port),
         *[x for flag in ("--tokenizer-addr", "--scheduler-addrs", "--kv-cache-manager-addr")
           for x in (flag, flag_value(args, flag))]],
        stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        assert wait_until(lambda: _ready(url), timeout=240)  # a loaded 2-core machine
        yield openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/models", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _first_turn(client, stream: bool):
    kwargs = dict(model="tiny", input="What is the weather in Paris?", tools=TOOLS,
                  tool_choice=CALL, max_output_tokens=32, temperature=0.0)
    if not stream:
        return client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as events:
        kinds = [e.type for e in events]
        final = events.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    assert kinds[-1] == "response.completed"
    return final


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_two_turn_tool_conversation_across_gateways(tiny_client, second_gateway, stream):
    first = _first_turn(tiny_client, stream)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments)["city"] in ("Paris", "Oslo")
    assert first.status == "completed"

    # The second turn lands on the other gateway: it finds the first in Redis.
    turn = dict(model="tiny", previous_response_id=first.id, tools=TOOLS, max_output_tokens=6,
                temperature=0.0,
                input=[{"type": "function_call_output", "call_id": call.call_id,
                        "output": '{"temperature_c": 21}'}])
    if stream:
        events = list(second_gateway.responses.create(stream=True, **turn))
        assert events[-1].type == "response.completed"
        second = events[-1].response
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == second.output_text
    else:
        second = second_gateway.responses.create(**turn)
    assert [i.type for i in second.output] == ["message"] and second.output_text
    assert second.previous_response_id == first.id
    # The prompt held the whole conversation: longer than the first turn's.
    assert second.usage.input_tokens > first.usage.input_tokens

    # Each gateway reads what the other stored; a delete on one is seen by both.
    assert second_gateway.responses.retrieve(first.id).output[0].call_id == call.call_id
    assert tiny_client.responses.retrieve(second.id).output_text == second.output_text
    second_gateway.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        tiny_client.responses.retrieve(second.id)


def test_unknown_previous_response_is_404_naming_the_field(tiny_client):
    with pytest.raises(openai.NotFoundError) as caught:
        tiny_client.responses.create(model="tiny", input="x", previous_response_id="resp_nope")
    assert caught.value.body["param"] == "previous_response_id"


CLOCK = {"type": "function", "name": "get_time", "description": "The local time in a city.",
         "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}}}}


def test_openai_responses_client_runs_a_three_turn_tool_conversation(tiny_client,
                                                                     second_gateway):
    """The Done-when conversation: two tool turns, then the answer, each turn continued
    by previous_response_id only (the client resends nothing), the second streamed and
    the last on the other gateway. The random model cannot decide to call a tool, so
    the two tool turns force one by `tool_choice` (structured outputs write a valid
    call); the last leaves the choice to the model (no parser: text)."""
    tools = [*TOOLS, CLOCK]
    first = tiny_client.responses.create(
        model="tiny", input="Weather and time in Paris?", tools=tools, tool_choice=CALL,
        max_output_tokens=32, temperature=0.0)
    [weather] = first.output
    assert (weather.type, weather.name) == ("function_call", "get_weather")

    turn = dict(model="tiny", tools=tools, max_output_tokens=32, temperature=0.0,
                tool_choice={"type": "function", "name": "get_time"},
                previous_response_id=first.id,
                input=[{"type": "function_call_output", "call_id": weather.call_id,
                        "output": '{"temperature_c": 21}'}])
    with tiny_client.responses.stream(**turn) as events:
        kinds = [e.type for e in events]
        second = events.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    [clock] = second.output
    assert (clock.type, clock.name) == ("function_call", "get_time")
    assert json.loads(clock.arguments)["city"] in ("Paris", "Oslo")
    assert clock.call_id != weather.call_id
    assert second.usage.input_tokens > first.usage.input_tokens

    third = second_gateway.responses.create(
        model="tiny", tools=tools, max_output_tokens=6, temperature=0.0,
        previous_response_id=second.id,
        input=[{"type": "function_call_output", "call_id": clock.call_id,
                "output": '{"time": "14:05"}'}])
    assert [i.type for i in third.output] == ["message"] and third.output_text
    # The stored turns gave the last prompt the whole conversation: the same items sent
    # at once, with no stored response, make a prompt of exactly as many tokens.
    whole = [{"role": "user", "content": "Weather and time in Paris?"},
             {"type": "function_call", "call_id": weather.call_id, "name": weather.name,
              "arguments": weather.arguments},
             {"type": "function_call_output", "call_id": weather.call_id,
              "output": '{"temperature_c": 21}'},
             {"type": "function_call", "call_id": clock.call_id, "name": clock.name,
              "arguments": clock.arguments},
             {"type": "function_call_output", "call_id": clock.call_id,
              "output": '{"time": "14:05"}'}]
    stateless = tiny_client.responses.create(model="tiny", tools=tools, max_output_tokens=6,
                                             temperature=0.0, input=whole, store=False)
    assert third.usage.input_tokens == stateless.usage.input_tokens
    assert stateless.output_text == third.output_text
    # An output for a call the stored conversation does not have is a 400 naming input.
    with pytest.raises(openai.BadRequestError) as caught:
        tiny_client.responses.create(
            model="tiny", previous_response_id=third.id, max_output_tokens=2,
            input=[{"type": "function_call_output", "call_id": "call_nope", "output": "x"}])
    assert caught.value.body["param"] == "input"
