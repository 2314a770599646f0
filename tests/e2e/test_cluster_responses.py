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

from pagoda.services.common.redis_server import free_port

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
