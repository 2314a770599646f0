"""/v1/messages' thinking and auto tool_use blocks, through the official `anthropic` SDK,
against the gateway over a scripted scheduler (test_api_tool_calling.py's): the model's
real output formats (DeepSeek-R1 reasoning, Hermes tool calls) played through the whole
gateway path, streamed and not. The tiny cluster's tests are in
test_api_anthropic_messages.py."""

from __future__ import annotations

import anthropic
import httpx
import pytest
from api_fakes import Gateway
from test_api_tool_calling import THINKING, ScriptedPeers

from pagoda.services.gateway.serving_options import ServingOptions

MODEL = "fake-model"
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"name": "get_weather", "description": "The weather in a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}]
REASONING = "The user wants the weather; I will call the tool."


@pytest.fixture(scope="module")
def peers(smollm2_tokenizer):
    peers = ScriptedPeers(smollm2_tokenizer)
    peers.scheduler.script = smollm2_tokenizer.encode(THINKING, add_special_tokens=False)
    yield peers
    peers.stop()


@pytest.fixture(scope="module")
def client(peers):
    gateway = Gateway(peers, options=ServingOptions(
        enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="deepseek_r1"))
    yield anthropic.Anthropic(base_url=gateway.url.removesuffix("/v1"), api_key="x",
                              max_retries=0, timeout=30)
    gateway.stop()


def blocks(message) -> list[tuple]:
    out = []
    for b in message.content:
        if b.type == "thinking":
            out.append(("thinking", b.thinking))
        elif b.type == "text":
            out.append(("text", b.text))
        else:
            out.append((b.type, b.name, b.input))
    return out


EXPECTED = [("thinking", REASONING), ("text", "\n\nLet me check.\n"),
            ("tool_use", "get_weather", {"city": "Paris"})]


def test_thinking_text_and_tool_use_blocks(client):
    m = client.messages.create(model=MODEL, max_tokens=200, messages=MESSAGES, tools=TOOLS,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert blocks(m) == EXPECTED and m.stop_reason == "tool_use"
    assert m.content[0].signature == ""


def test_streamed_blocks_equal_the_whole_message(client):
    with client.messages.create(model=MODEL, max_tokens=200, messages=MESSAGES, tools=TOOLS,
                                stream=True) as stream:
        events = [e for e in stream if e.type != "ping"]
    starts = [(e.index, e.content_block.type) for e in events
              if e.type == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text"), (2, "tool_use")]
    stops = [e.index for e in events if e.type == "content_block_stop"]
    assert stops == [0, 1, 2]
    kinds = {e.delta.type for e in events if e.type == "content_block_delta"}
    assert kinds == {"thinking_delta", "text_delta", "input_json_delta"}
    assert [e.type for e in events[-2:]] == ["message_delta", "message_stop"]
    assert events[-2].delta.stop_reason == "tool_use"

    with client.messages.stream(model=MODEL, max_tokens=200, messages=MESSAGES,
                                tools=TOOLS) as stream:
        assert blocks(stream.get_final_message()) == EXPECTED


def test_thinking_disabled_drops_the_thinking_block(client):
    m = client.messages.create(model=MODEL, max_tokens=200, messages=MESSAGES, tools=TOOLS,
                               thinking={"type": "disabled"})
    assert blocks(m) == EXPECTED[1:]


def test_the_anthropic_sdk_authenticates_with_its_own_header(peers):
    """`--api-key`: the anthropic SDK sends `x-api-key`, and a refusal under /v1/messages
    is Anthropic's authentication_error (OpenAI's routes keep OpenAI's shape)."""
    gw = Gateway(peers, api_key="k-1")
    try:
        good = anthropic.Anthropic(base_url=gw.url, api_key="k-1", max_retries=0)
        assert good.messages.count_tokens(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}]).input_tokens > 0
        bad = anthropic.Anthropic(base_url=gw.url, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as refused:
            bad.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
        assert refused.value.body["error"]["type"] == "authentication_error"
        openai_shape = httpx.post(f"{gw.url}/v1/completions", headers={"x-api-key": "wrong"},
                                  json={"model": MODEL, "prompt": "Hi"}).json()
        assert openai_shape["error"]["code"] == 401
    finally:
        gw.stop()


@pytest.mark.parametrize("field,value", [("kv_transfer_params", {"do_remote_decode": True}),
                                         ("request_id", "r1"), ("truncation_side", "right"),
                                         ("logits_processors", ["my.Processor"])])
def test_vllm_fields_not_served_are_an_anthropic_400_naming_them(client, field, value):
    """A vLLM request field Pagoda lacks is refused on /v1/messages as on chat (named, in
    Anthropic's error shape); Anthropic's own sampling fields and vLLM's served extras
    pass."""
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL, max_tokens=4, messages=MESSAGES,
                               extra_body={field: value})
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert info.value.body["error"]["message"].startswith(f"{field} is a vLLM request field")
    m = client.messages.create(model=MODEL, max_tokens=4, messages=MESSAGES,
                               stop_sequences=["zzz"], extra_body={
                                   field: None, "temperature": 0, "top_k": 5, "top_p": 0.9})
    assert m.type == "message"
